"""Structured logging: JSON lines (structlog over the stdlib) with session/epoch/worker/request IDs.

Modules log with the stdlib (``logging.getLogger(__name__).info("msg", extra={"session": sid})``); the
formatter renders the message, level, logger, time and every ``extra`` field as one JSON object.
"""

from __future__ import annotations

import logging
import sys

import structlog


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` that writes to whatever ``sys.stderr`` is when a record is emitted, not to the
    stream it was made with (as the stdlib's ``logging.lastResort`` does). ``substrate up`` run in-process
    by click's ``CliRunner`` configured logging while ``sys.stderr`` was the runner's buffer, which is closed
    when the command returns: every later record, in later commands of the same process too, printed
    ``--- Logging error ---`` (``ValueError: I/O operation on closed file``) into their output."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - a text stream, as StreamHandler.stream
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__/setStream assign it: nothing to keep
        pass


def configure_logging(level: str = "INFO", json_lines: bool = True) -> None:
    """Make a ``StderrHandler`` the root logger's only handler (so a second call replaces the first's
    handler instead of adding one) and set the root level; the audit trail's logger logs at any level,
    the noisy libraries' at WARNING. Idempotent. Raises ``ValueError`` for an unknown ``level`` name,
    before anything is changed."""
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
                           structlog.stdlib.ExtraAdder(), structlog.processors.TimeStamper(fmt="iso")],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.setLevel(level.upper())  # first: an unknown level name raises before anything is replaced
    root.handlers[:] = [handler]
    # the audit trail's mirror is a record, not chatter: emitted whatever the level (substrate.audit)
    logging.getLogger("substrate.audit").setLevel(logging.INFO)
    for noisy in ("aiohttp.access", "uvicorn.access", "botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
