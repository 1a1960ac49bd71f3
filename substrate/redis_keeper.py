"""Runs the embedded Redis and keeps it up after the runtime dies until the runtime's workers are gone.

``substrate up`` (``substrate.embedded.EmbeddedRedis``) starts this as ``python -I -S redis_keeper.py
HOLD_FD GRACE_S [FILE...] -- REDIS_ARGV...`` with Redis's configuration (its password) on stdin. It starts
``redis-server`` as its own child (which gets SIGTERM if this process dies by any means: Linux
``PR_SET_PDEATHSIG``), writes the server's pid as one line on stdout, then waits for one of:

* **SIGTERM** (the runtime's own stop, after its workers stopped): stop Redis now;
* **end of file on ``HOLD_FD``**: the read end of a pipe whose write ends the runtime, its zygote and
  every worker hold (inherited at their start, never written). It reads EOF only when all of them are
  gone: after a ``kill -9`` or OOM of ``substrate up``, the workers see their lifeline close
  (``workers/lifeline.py``), suspend their sessions into Redis and exit, and only then does Redis stop.
  Before this keeper the embedded Redis died with the runtime, the workers' suspends failed
  ``directory_unavailable`` and every session came back from an older snapshot (fresh-user run 35);
* **``GRACE_S`` after the runtime died** (SIGUSR1, this process's parent-death signal) with a holder
  still alive: stop Redis anyway (a worker that hangs must not keep the folder's Redis up for ever);
* Redis exiting on its own: exit with its status, 128 + the signal if one killed it (the runtime's
  watcher starts a new pair).

Stopping Redis is SIGTERM, so it flushes its append-only file; SIGKILL if it has not exited 10 s later.
When it stops Redis because the runtime died, it also removes each ``FILE`` (the URL file that CLI
commands find a running Redis by), which the runtime's own stop does otherwise.
Standard library only and started with ``-I -S``: it must start fast and hold nothing of the runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

#: prctl option: the signal a process gets when the thread that forked it exits
PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def main(argv: list[str]) -> int:
    """Run as documented in the module docstring; returns the process's exit status."""
    split = argv.index("--")
    hold_fd, grace_s, files, redis_argv = int(argv[0]), float(argv[1]), argv[2:split], argv[split + 1:]
    parent = os.getppid()
    state = {"stop": False, "gone_at": None}

    def on_term(_sig: int, _frame: object) -> None:
        state["stop"] = True

    def on_parent_gone(_sig: int, _frame: object) -> None:
        if state["gone_at"] is None:
            state["gone_at"] = time.monotonic()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the runtime, which stops this in order
    signal.signal(signal.SIGUSR1, on_parent_gone)
    _die_with_parent(signal.SIGUSR1)
    if os.getppid() != parent:  # the runtime died before the prctl: its signal will never come
        on_parent_gone(signal.SIGUSR1, None)
    config = sys.stdin.buffer.read()
    redis = subprocess.Popen(redis_argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=lambda: _die_with_parent(signal.SIGTERM))
    assert redis.stdin is not None
    redis.stdin.write(config)
    redis.stdin.close()
    sys.stdout.write(f"{redis.pid}\n")
    sys.stdout.flush()
    while not state["stop"]:
        if redis.poll() is not None:
            # a signal's death as a shell reports it, 128 + the signal (SIGKILL: 137), so the log can name it
            return redis.returncode if redis.returncode >= 0 else 128 - redis.returncode
        gone_at = state["gone_at"]
        if gone_at is not None and time.monotonic() - gone_at >= grace_s:
            break
        ready, _, _ = select.select([hold_fd], [], [], 0.2)
        if ready and not os.read(hold_fd, 64):
            break  # every holder is gone: nothing can write to Redis any more
    redis.terminate()
    if not state["stop"]:  # the runtime is gone: nothing else removes what pointed at this Redis
        for f in files:
            with contextlib.suppress(OSError):
                os.unlink(f)
    try:
        redis.wait(10)
    except subprocess.TimeoutExpired:
        redis.kill()
        redis.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
