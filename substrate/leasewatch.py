"""Calls in flight to workers, watched against the workers' leases by one coarse timer per process.

A call to a worker (a turn the router sent, an activation, a suspend, a deactivate) waits for the
worker's answer up to the call's timeout. If the worker freezes or is cut off, its lease in Redis runs
out and it stops serving (DESIGN.md: each worker holds a lease), but the call would still wait out the
whole timeout; so a call whose worker's lease (as the process's ``WorkerView`` last read it) expired
more than ``grace_s`` ago is abandoned: the router routes a turn again with the same idempotency key
(``api.proxy``), and the activator fails an activation or suspend as ``worker_unavailable``
(``substrate.activator``: a create is then placed again on another worker).

The router's turns each used to arm a timer of their own for that (a ``call_later`` and a ``cancel``
per turn, re-armed every ``check_s`` while it waited; its callback and the waiting coroutine's frame
referred to each other, so every turn also left a reference cycle for the garbage collector). Here the
calls are kept by worker, and one timer per process, armed only while some call is in flight, looks
every ``check_s`` at the leases of the workers that have calls: the cost per call is a set insertion
and a removal, and each look is O(workers with calls in flight), not O(calls), until a worker is found
lost. This is the usual coarse-timer way servers keep per-request timeouts (one sweep of a timer wheel
per tick, not a timer per request): a lost worker's calls are abandoned at most ``check_s`` after the
lease ran out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class _Lease(Protocol):
    leaseExpiresAt: float


class _View(Protocol):
    workers: dict[str, _Lease]  # the WorkerView's last read of the registry: id -> record
    read_at: float  # when that read began (time.time())


class LeaseWatch:
    """Calls in flight by worker id, checked every ``check_s`` seconds (> 0) against ``view``'s leases
    with ``grace_s`` seconds of grace (``worker.lease_grace_s``).

    ``add(worker, task)`` before awaiting the worker and ``discard(worker, task)`` after (in a
    ``finally``); a task cancelled by the watch is in ``lost`` until discarded: its ``CancelledError`` is
    the watch's doing, not a stop of the server (the caller tells them apart with ``Task.uncancel``).
    Wall-clock time (``time.time``), as leases are written. One loop: not thread-safe."""

    def __init__(self, view: _View, *, grace_s: float, check_s: float) -> None:
        if check_s <= 0:
            raise ValueError(f"check_s must be > 0, not {check_s!r}")
        self.view = view
        self.grace_s = grace_s
        self.check_s = check_s
        self._calls: dict[str, set[asyncio.Task[object]]] = {}
        #: when each worker's calls began to be watched (its set became non-empty)
        self._since: dict[str, float] = {}
        #: tasks this watch cancelled (their worker lost its lease), until discarded
        self.lost: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, worker: str, task: asyncio.Task[object]) -> None:
        """Watch ``task``'s call to ``worker`` (arms the timer if none is armed)."""
        calls = self._calls.get(worker)
        if calls is None:
            calls = self._calls[worker] = set()
            self._since[worker] = time.time()
        calls.add(task)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.check_s, self.check)

    def discard(self, worker: str, task: asyncio.Task[object]) -> None:
        """Stop watching ``task``'s call to ``worker`` (answered, failed or abandoned)."""
        calls = self._calls.get(worker)
        if calls is not None:
            calls.discard(task)
            if not calls:
                del self._calls[worker]
                del self._since[worker]
        if self.lost:
            self.lost.discard(task)

    def in_flight(self) -> int:
        """Calls being watched."""
        return sum(len(c) for c in self._calls.values())

    def check(self) -> None:
        """Cancel the calls of every worker past its lease plus grace, or gone from the view (absent from
        a registry read that began after its calls did: a worker that registered after the view's last
        read, which a placement can already use, is not taken for gone), and arm the timer again while
        calls remain. Called by the timer; never raises."""
        self._timer = None
        now = time.time()
        workers, read_at = self.view.workers, self.view.read_at
        for worker, calls in self._calls.items():
            w = workers.get(worker)
            gone = read_at > self._since[worker] if w is None else w.leaseExpiresAt + self.grace_s < now
            if gone:
                for task in calls:
                    if task not in self.lost and not task.done():
                        self.lost.add(task)
                        task.cancel()
        if self._calls:
            self._timer = asyncio.get_running_loop().call_later(self.check_s, self.check)

    def close(self) -> None:
        """Disarm the timer (the calls themselves are left alone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
