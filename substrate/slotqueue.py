"""Placements waiting for a slot: one FIFO queue per pool, served by one task as slots free up.

Under slot pressure a placement that finds no free slot joins its pool's queue instead of polling the
registry itself. One pump task per pool (started on the first waiter, ending when the queue is empty)
serves the waiters in arrival order: each round it refreshes its view of the pool once, claims slots
for as many waiters as it can, and if none fit it asks for room once (lazy suspension of the least
recently used idle session). So the registry is read once per round for the whole pool, not once per
waiter per tick. It then sleeps until ``notify()`` (a slot was freed by this process, a worker came up)
or the poll pause (slots freed by other processes show up on the next refresh). The pause doubles from
``poll_s`` up to ``max_poll_s`` while rounds find nothing (each round re-reads the registry, O(workers):
at 50 ms a burst that waited on a pool of 40 workers read it 40 times a second, about 7 % of the
router's CPU, 2026-12-06), and drops back to ``poll_s`` at a ``notify()`` or a round that served or
made room. Room is made for the
oldest waiter's tenant, as many slots as there are waiters at once (``make_room(tenant, n)``: a tenant
over its share displaces only its own sessions).

A waiter's ``timeout_s`` counts from the queue's last progress, not from when it joined: while rounds
keep serving waiters or making room, everyone behind waits on (up to ``max_s``), so a burst on a full
pool with idle sessions is served by suspensions instead of being refused (fresh-user run: 100 creates
on a pool at ``maxReplicas`` with 120 idle sessions, 8 suspensions a round: 52 got ``no_capacity``
after the 2 s ``slot_wait_s``). Without progress for ``timeout_s`` (nobody idle to suspend, nothing
freed) the waiter still gives up then.

A waiter that gave up (timeout, cancellation) is skipped; a slot claimed for it after it gave up is
released at once. A pinned waiter (``worker=...``) does not block unpinned ones behind it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

W = TypeVar("W")
#: claim(session id, pinned worker or None) -> (worker, slot) or None when no slot fits
Claim = Callable[[str, str | None], Awaitable["tuple[W, int] | None"]]


@dataclass
class _Waiter(Generic[W]):
    sid: str
    pin: str | None
    fut: asyncio.Future[tuple[W, int]] = field(repr=False)
    tenant: str = "default"


class SlotQueue(Generic[W]):
    """FIFO of placements of one pool (see the module docstring).

    ``claim`` tries to claim a slot for a session (``None``: nothing free); ``refresh`` re-reads the
    registry view; ``make_room(tenant, n)`` frees up to ``n`` slots for ``tenant`` by suspending idle
    sessions at once (returns how many it freed);
    ``release(worker, slot, sid)`` gives back a slot claimed for a waiter that already left.
    """

    def __init__(self, claim: Claim[W], *, refresh: Callable[[], Awaitable[None]],
                 make_room: Callable[[str, int], Awaitable[int]],
                 release: Callable[[W, int, str], Awaitable[object]], poll_s: float = 0.05,
                 max_poll_s: float = 0.4) -> None:
        self._claim, self._refresh, self._make_room, self._release = claim, refresh, make_room, release
        self.poll_s = poll_s
        #: the longest pause between two rounds that found nothing (module docstring)
        self.max_poll_s = max(poll_s, max_poll_s)
        #: at most this many idle sessions are suspended at once for the waiters of one round
        self.max_room_per_round = 8
        self._waiters: collections.deque[_Waiter[W]] = collections.deque()
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        #: rounds served (each round reads the registry once): for tests and debugging
        self.rounds = 0
        #: loop time of the last round that served a waiter or made room (-inf: none yet)
        self.progress_at = float("-inf")
        #: a ``make_room`` call is under way (suspensions take a snapshot each: seconds under load)
        self._making_room = False

    def __len__(self) -> int:
        return sum(1 for w in self._waiters if not w.fut.done())

    def pending(self) -> list[str]:
        """The sessions of the waiters still waiting, in queue order."""
        return [w.sid for w in self._waiters if not w.fut.done()]

    def progressing(self, within_s: float) -> bool:
        """Whether a round served a waiter or made room in the last ``within_s`` seconds, or room is
        being made now."""
        return self._making_room or asyncio.get_running_loop().time() - self.progress_at < within_s

    def notify(self) -> None:
        """A slot may have become free: serve the queue now instead of at the next poll."""
        self._wake.set()

    async def wait(self, sid: str, pin: str | None, timeout_s: float, *, tenant: str = "default",
                   hold: Callable[[], bool] | None = None, max_s: float | None = None) -> tuple[W, int]:
        """Join the queue; the claimed ``(worker, slot)``. Raises ``TimeoutError`` after ``timeout_s``
        unless, when that time is up, the queue has progressed within the last ``timeout_s`` (see the
        module docstring) or ``hold()`` is true (capacity is on its way: e.g. a worker starting for the
        pool): then the wait goes on for another ``timeout_s``, and so on, and once more after the first
        look that finds ``hold()`` false (so at least ``timeout_s`` after the capacity came), up to
        ``max_s`` (default ``timeout_s``) in all. ``hold`` is asked only at those moments (one timer per
        waiter, not a poll). The waiter keeps its place in the queue meanwhile."""
        fut: asyncio.Future[tuple[W, int]] = asyncio.get_running_loop().create_future()
        self._waiters.append(_Waiter(sid, pin, fut, tenant))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        self._wake.set()
        loop = asyncio.get_running_loop()
        limit = loop.time() + max(timeout_s, max_s or 0.0)
        deadline = loop.time() + timeout_s
        held = False
        try:
            while True:
                now = loop.time()
                if now >= deadline:
                    # capacity on its way, or it was at the last look (growth stopped in between: the
                    # new slots get a whole timeout_s to reach this waiter; a burst's fresh-user run
                    # refused 15 creates with 23 slots free when this counted from the last look)
                    was_held, held = held, (hold() if hold is not None else False)
                    if held or was_held or self.progressing(timeout_s):
                        deadline = now + timeout_s
                end = min(deadline, limit)
                if now >= end:
                    raise asyncio.TimeoutError
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), end - now)
                except asyncio.TimeoutError:
                    continue
        except (asyncio.TimeoutError, asyncio.CancelledError):
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled() and fut.exception() is None:
                # claimed for us just as we gave up: hand it back
                w, slot = fut.result()
                await self._release(w, slot, sid)
            raise

    async def _serve_round(self) -> bool:
        """One pass over the queue; True if any waiter got a slot."""
        served = False
        unpinned_full = False
        for waiter in list(self._waiters):
            if waiter.fut.done():
                continue
            if waiter.pin is None and unpinned_full:
                continue
            got = await self._claim(waiter.sid, waiter.pin)
            if got is None:
                if waiter.pin is None:
                    unpinned_full = True
                continue
            if waiter.fut.done():  # left while we claimed
                await self._release(got[0], got[1], waiter.sid)
                continue
            waiter.fut.set_result(got)
            served = True
            self.progress_at = asyncio.get_running_loop().time()
        while self._waiters and self._waiters[0].fut.done():
            self._waiters.popleft()
        self._waiters = collections.deque(w for w in self._waiters if not w.fut.done())
        return served

    async def _run(self) -> None:
        pause = self.poll_s
        try:
            while self._waiters:
                self._wake.clear()
                self.rounds += 1
                try:
                    if await self._serve_round():
                        pause = self.poll_s
                        continue
                    if self._waiters:
                        self._making_room = True
                        try:
                            made = await self._make_room(self._waiters[0].tenant,
                                                         min(len(self), self.max_room_per_round))
                        finally:
                            self._making_room = False
                        if made:
                            self.progress_at = asyncio.get_running_loop().time()
                            pause = self.poll_s
                            await self._refresh()
                            continue
                except Exception:  # noqa: BLE001 - waiters time out on their own; the pump goes on
                    log.warning("slot queue round failed", exc_info=True)
                if not self._waiters:
                    break
                try:
                    await asyncio.wait_for(self._wake.wait(), pause)
                    pause = self.poll_s  # notified: a slot was freed here, or a waiter came
                except asyncio.TimeoutError:
                    pause = min(pause * 2, self.max_poll_s)
                try:
                    await self._refresh()
                except Exception:  # noqa: BLE001
                    log.warning("slot queue refresh failed", exc_info=True)
        finally:
            self._pump = None
