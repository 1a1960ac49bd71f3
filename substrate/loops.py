"""The one shape every periodic control loop here has: call a step, log and survive any error, sleep."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def run_forever(step: Callable[[], Awaitable[object]], interval_s: float, what: str, *,
                      first_delay: bool = False) -> None:
    """Run ``step`` every ``interval_s`` seconds until cancelled. An exception from ``step`` is logged
    (as ``"<what> failed"``) and the loop goes on: a control loop never dies."""
    if first_delay:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
        except Exception:  # noqa: BLE001 - a control loop never dies
            log.warning("%s failed", what, exc_info=True)
        await asyncio.sleep(interval_s)
