"""An agent host's stderr, logged by its worker as bounded, escaped data (logger ``substrate.agent``).

The agent host's fd 2 (and its fd 1: ``workers/agenthost.py`` points it at stderr) is a pipe owned by the
worker, never the runtime's own stderr: with the runtime logging to a file, an inherited fd 2 let an agent
reopen that file through ``/proc/<pid>/fd/2`` and read every tenant's log and audit lines, and write raw
lines (forged JSON records, terminal escapes) into the operator's log or terminal.

``drain`` reads that pipe for the host's whole life, always (over a budget it reads and discards, so a
full pipe never blocks the agent or hangs a turn), and logs each line as the field ``text`` of a record
with the session, epoch and slot, control characters escaped (``\\x1b`` ...) so neither the JSON nor the
console renderer passes them through. Bounds, per host process:

* a line is cut at ``MAX_LINE_BYTES`` (the rest, up to its newline, is counted and dropped);
* at most ``RATE_LINES_PER_S`` lines a second on average (bursts up to ``BURST_LINES``); lines over the
  rate are dropped and counted, and the count is logged with the next line that passes;
* at most ``MAX_TOTAL_BYTES`` logged in all; past it one notice, then everything is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

log = logging.getLogger("substrate.agent")

#: longest stderr line logged (bytes); longer lines are cut
MAX_LINE_BYTES = 4096
#: average lines per second logged per host; bursts up to BURST_LINES
RATE_LINES_PER_S = 50.0
BURST_LINES = 200
#: bytes logged per host process in all; past this the rest of its stderr is read and dropped
MAX_TOTAL_BYTES = 256 * 1024
_READ_CHUNK = 64 * 1024

# C0 controls (but tab), DEL and C1 controls, shown as \xNN: a line can never carry a newline, carriage
# return or terminal escape sequence into the log
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0a, 0x20), *range(0x7f, 0xa0))}


def escape(raw: bytes) -> str:
    """``raw`` as text safe for any log renderer: UTF-8 (invalid bytes as U+FFFD), controls as ``\\xNN``."""
    return raw.decode("utf-8", "replace").translate(_ESCAPES)


class _Labelled(Protocol):
    session: str
    epoch: int


class StderrBudget:
    """The per-host bounds (see the module docstring). ``take(line)`` says whether to log ``line``;
    ``now`` is injectable for tests (seconds, monotonic)."""

    def __init__(self, *, rate: float = RATE_LINES_PER_S, burst: int = BURST_LINES,
                 total: int = MAX_TOTAL_BYTES) -> None:
        self.rate, self.burst, self.total = rate, burst, total
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.logged_bytes = 0
        self.dropped = 0
        self.exhausted = False

    def take(self, nbytes: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.exhausted or self.tokens < 1.0:
            self.dropped += 1
            return False
        self.tokens -= 1.0
        self.logged_bytes += nbytes
        return True


async def drain(stream: asyncio.StreamReader, owner: _Labelled, slot: int, budget: StderrBudget | None = None) -> None:
    """Read ``stream`` (the host's stderr pipe) to EOF, logging its lines within ``budget``. ``owner``'s
    ``session`` and ``epoch`` are read at each line (a pre-started host gets its session later)."""
    budget = budget or StderrBudget()
    buf = b""
    skipping = 0  # bytes of an over-long line still being dropped up to its newline

    def emit(line: bytes, cut: int = 0) -> None:
        if budget.exhausted:
            budget.dropped += 1
            return
        if not budget.take(len(line)):
            return
        extra: dict[str, Any] = {"session": owner.session, "epoch": owner.epoch, "slot": slot,
                                 "text": escape(line)}
        if cut:
            extra["cut_bytes"] = cut
        if budget.dropped:
            extra["dropped_lines"], budget.dropped = budget.dropped, 0
        log.info("agent stderr", extra=extra)
        if budget.logged_bytes >= budget.total:
            budget.exhausted = True
            log.warning("agent stderr over its budget: the rest of this process's stderr is dropped",
                        extra={"session": owner.session, "epoch": owner.epoch, "slot": slot,
                               "budget_bytes": budget.total})

    while True:
        try:
            data = await stream.read(_READ_CHUNK)
        except (OSError, ValueError):
            break
        if not data:
            break
        buf += data
        while buf:
            nl = buf.find(b"\n")
            if skipping:
                if nl < 0:
                    skipping += len(buf)
                    buf = b""
                    break
                skipping += nl
                buf = buf[nl + 1:]
                skipping = 0
                continue
            if nl < 0:
                if len(buf) > MAX_LINE_BYTES:
                    emit(buf[:MAX_LINE_BYTES], cut=len(buf) - MAX_LINE_BYTES)
                    skipping = len(buf) - MAX_LINE_BYTES
                    buf = b""
                break
            line, buf = buf[:nl], buf[nl + 1:]
            if len(line) > MAX_LINE_BYTES:
                emit(line[:MAX_LINE_BYTES], cut=len(line) - MAX_LINE_BYTES)
            else:
                emit(line)
    if buf and not skipping:
        emit(buf[:MAX_LINE_BYTES], cut=max(0, len(buf) - MAX_LINE_BYTES))
