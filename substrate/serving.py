"""The HTTP server ``substrate up`` and ``substrate router`` run: uvicorn's, with one change to its signals."""

from __future__ import annotations

import time
from types import FrameType

import uvicorn

#: a stop signal repeated within this many seconds of the first is the same stop request
REPEAT_SIGNAL_WINDOW_S = 1.0


class Server(uvicorn.Server):
    """``uvicorn.Server`` whose graceful shutdown survives a doubled Ctrl-C.

    uvicorn forces the exit (cutting requests in flight) on any SIGINT after the first. A Ctrl-C in a
    terminal under ``uv run`` (or ``make``) delivers SIGINT twice within milliseconds: once from the
    terminal to the process group and once forwarded by the parent. So a signal repeated within
    ``REPEAT_SIGNAL_WINDOW_S`` of the first is ignored; a deliberate second Ctrl-C after it still forces.
    """

    _first_signal_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the graceful shutdown; a repeat after the window forces the exit, as in uvicorn."""
        now = time.monotonic()
        if self._first_signal_at is not None and now - self._first_signal_at < REPEAT_SIGNAL_WINDOW_S:
            # the same stop request again: not recorded either, so it is not re-raised after the shutdown
            return
        if self._first_signal_at is None:
            self._first_signal_at = now
        super().handle_exit(sig, frame)
