"""A local worker stops when the runtime that started it is gone, even when the runtime was SIGKILLed.

The local backend (``substrate/backends/local.py``) holds the only write end of a pipe and gives every
worker it starts the read end, naming the descriptor in ``SUBSTRATE_LIFELINE_FD`` (through the zygote's
fork as well as to a cold ``python -m workers.server``). Nothing is ever written: the kernel closes the
write end however the runtime ends, and the worker's read returns EOF. The worker then sends itself
SIGTERM, which is its ordinary graceful stop (suspend every session within ``shutdown_grace_s``,
deregister, exit), and SIGKILLs itself if that has not finished ``escalate_after_s`` later: the runtime
that would have escalated is gone. The sandbox reaper (``substrate/sandbox_sweep.py``) then cleans up
after the worker as after any other death.

Given a log file, the worker first moves its standard output and error there: the runtime's terminal
is its user's again (``substrate up`` forced out by a second Ctrl-C has printed its one line and
returned), and a graceful stop with the embedded Redis gone warns for seconds (a fresh-user run: about
50 lines with tracebacks in the shell after the prompt came back). There each kind of record is written
at most three times (``_FirstFew``).

Why a pipe and not ``PR_SET_PDEATHSIG``: a zygote-forked worker's parent is the zygote, not the runtime,
so a parent-death signal would fire on the zygote's death (taking healthy workers down with it) and not
on the runtime's. A pipe needs no pid (no pid reuse), works through any number of forks, and a runtime
that died before the worker started watching is seen at once (EOF on the first read). It is the same
tie the sandbox reaper has to its worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: environment variable naming the read end's descriptor number in the worker
ENV = "SUBSTRATE_LIFELINE_FD"


def _redirect_output(path: Path) -> None:
    """Point descriptors 1 and 2 at ``path`` (appended to, made with its folder if missing), or at
    ``/dev/null`` if it cannot be opened: the logging handlers write through them."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)


class _FirstFew(logging.Filter):
    """Passes each kind of record (its logger and message template) at most ``limit`` times: a worker
    stopping with its Redis gone warned about every heartbeat and call, ~150 KB in seconds (a fresh-user
    run), where the first few of each say all there is."""

    def __init__(self, limit: int = 3) -> None:
        super().__init__()
        self.limit = limit
        self.seen: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        n = self.seen[key] = self.seen.get(key, 0) + 1
        return n <= self.limit


def _wait_and_stop(fd: int, escalate_after_s: float, log_path: Path | None) -> None:
    try:
        while os.read(fd, 1):  # nothing is ever written; a byte would be a bug, not a reason to stop
            pass
    except OSError:
        pass  # EBADF etc.: treat as the runtime gone too, rather than leave the worker unwatched
    if log_path is not None:
        for stream in (sys.stdout, sys.stderr):  # what was written before goes where it was meant to
            with contextlib.suppress(Exception):
                stream.flush()
        _redirect_output(log_path)
        few = _FirstFew()
        for handler in logging.getLogger().handlers:
            handler.addFilter(few)
    log.warning("the runtime that started this worker is gone; stopping gracefully")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(escalate_after_s)
    log.error("graceful stop did not finish %.0f s after the runtime died; killing the worker", escalate_after_s)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_from_env(escalate_after_s: float, log_path: Path | None = None) -> bool:
    """Start watching the descriptor named by ``SUBSTRATE_LIFELINE_FD``, if set (a worker of the local
    backend; a Kubernetes worker has none and is not affected).

    ``escalate_after_s``: seconds between the SIGTERM and the SIGKILL the worker sends itself once the
    runtime is gone. ``log_path``: where the worker's standard output and error go from then on (see the
    module docstring; None: they stay). The variable is removed from the environment and the descriptor made
    non-inheritable, so the worker's own children (sandboxes, reaper) are not tied to the runtime.
    Returns True if a watch was started; a malformed value is logged and ignored (False).
    """
    raw = os.environ.pop(ENV, None)
    if not raw:
        return False
    try:
        fd = int(raw)
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        log.warning("ignoring %s=%r: not an open descriptor", ENV, raw)
        return False
    threading.Thread(target=_wait_and_stop, args=(fd, escalate_after_s, log_path), name="lifeline",
                     daemon=True).start()
    return True
