"""Structured logging: JSON lines (structlog over the stdlib) with session/epoch/worker/request IDs.

Modules log with the stdlib (``logging.getLogger(__name__).info("msg", extra={"session": sid})``); the
formatter renders the message, level, logger, time and every ``extra`` field as one JSON object.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "INFO", json_lines: bool = True) -> None:
    """Install a root handler on stderr. Idempotent."""
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
                           structlog.stdlib.ExtraAdder(), structlog.processors.TimeStamper(fmt="iso")],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # the audit trail's mirror is a record, not chatter: emitted whatever the level (substrate.audit)
    logging.getLogger("substrate.audit").setLevel(logging.INFO)
    for noisy in ("aiohttp.access", "uvicorn.access", "botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
