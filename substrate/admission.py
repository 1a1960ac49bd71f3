"""Admission control for activations: an adaptive bound on the creates and wakes under way at once.

Why: an activation (a create's agent start, a wake's restore) costs its worker CPU, and the pool
controller counts every activation in flight as a slot of demand (``substrate.pool.demand``). On a
saturated machine that is a positive feedback loop: activations slow down, more of them are in flight at
once, the pool grows for them, each new worker boots its agent hosts on the same cores, and activations
slow down further. A 2.5x overlay of the busiest GenTD26 day ran the pool from 6 to 34 workers for a mean
demand of 1.44 busy slots, with restores taking 22 s at p99 (``docs/replays/gentd26-2024-11-24-overlay-3``).

What: one ``ActivationLimiter`` per pool in each router process. An activation takes a permit before it
claims a slot and gives it back when it is RUNNING or failed; the rest wait in FIFO order, holding no
slot, and are *not* demand for new workers (more workers do not make a saturated worker faster). The
limit adapts to the activations' own latency with the gradient rule of Netflix's concurrency-limits
(``Gradient2Limit``; the same idea as Envoy's adaptive concurrency filter), written here from its
description:

* ``long`` is an exponentially weighted mean of activation latencies over ``long_window`` samples (the
  latency the pool normally has), each sample clipped to ``tolerance x long`` first, so that an overload
  moves it slowly (by at most ``(tolerance - 1) / long_window`` a sample: a lasting change of the
  workload is still learnt, in a few hundred activations); ``short`` one over the last few samples
  (what it has now);
* ``gradient = clamp(tolerance x long / short, 0.5, 1)``: 1 while the latency stays within ``tolerance``
  times its usual level, down to 0.5 when it rises far above it;
* ``limit <- (1 - smoothing) x limit + smoothing x (gradient x limit + queue)`` with ``queue =
  sqrt(limit)``: it grows by about ``smoothing x sqrt(limit)`` per sample while latency holds and only
  while at least half of it is in use (an idle limit does not grow for ever), and it falls towards a few
  permits when latency climbs; bounded by ``[min_limit, max_limit]``;
* after an overload ``long`` has absorbed the high latencies: while ``long`` is above twice ``short`` it
  decays towards ``short`` (5 % a sample), so the limit recovers.

Only the worker's activation call is timed (not the wait for a slot, which measures capacity, not
load). Pure bookkeeping plus one FIFO of futures: no I/O, no clock but the caller's samples.
"""

from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LimiterSettings:
    """``initial``/``min_limit``/``max_limit``: permits (``max_limit`` 0 = no bound: every activation
    is admitted at once); ``tolerance``: how many times its usual latency an activation may take before
    the limit falls (>= 1); ``long_window``/``short_window``: samples averaged for ``long``/``short``;
    ``smoothing``: weight of each update, in (0, 1]."""

    initial: int = 32
    min_limit: int = 4
    max_limit: int = 1000
    tolerance: float = 2.0
    long_window: int = 500
    short_window: int = 10
    smoothing: float = 0.2

    def __post_init__(self) -> None:
        if self.min_limit < 1 or self.initial < self.min_limit:
            raise ValueError(f"need 1 <= min_limit <= initial, got {self.min_limit}, {self.initial}")
        if self.max_limit and self.max_limit < self.initial:
            raise ValueError(f"max_limit {self.max_limit} is below initial {self.initial}")
        if not (self.tolerance >= 1.0 and math.isfinite(self.tolerance)):
            raise ValueError(f"tolerance must be a finite number >= 1, got {self.tolerance!r}")
        if self.long_window < 1 or self.short_window < 1 or not 0 < self.smoothing <= 1:
            raise ValueError("long_window and short_window must be >= 1 and smoothing in (0, 1]")


class GradientLimit:
    """The adaptive limit alone (see the module docstring): ``sample(latency_s, in_use)`` after each
    activation, ``value`` the permits allowed now (an int >= ``min_limit``)."""

    def __init__(self, settings: LimiterSettings) -> None:
        self.settings = settings
        self._limit = float(settings.initial)
        self.long_s: float | None = None
        self.short_s: float | None = None

    @property
    def value(self) -> int:
        return max(self.settings.min_limit, int(self._limit))

    def sample(self, latency_s: float, in_use: int) -> int:
        """Take one activation's latency (s; non-finite or negative ones are ignored) seen with
        ``in_use`` permits taken; returns the new ``value``."""
        s = self.settings
        if not (math.isfinite(latency_s) and latency_s >= 0):
            return self.value
        latency_s = max(latency_s, 1e-6)
        a_long, a_short = 2.0 / (s.long_window + 1), 2.0 / (s.short_window + 1)
        if self.long_s is None:
            self.long_s = latency_s
        else:  # an overload's latencies enter the usual level slowly (see the module docstring)
            self.long_s += a_long * (min(latency_s, s.tolerance * self.long_s) - self.long_s)
        self.short_s = latency_s if self.short_s is None else self.short_s + a_short * (latency_s - self.short_s)
        if self.long_s > 2 * self.short_s:  # recovering from an overload: forget its latencies faster
            self.long_s *= 0.95
        gradient = max(0.5, min(1.0, s.tolerance * self.long_s / self.short_s))
        if gradient >= 1.0 and in_use < self._limit / 2:
            return self.value  # the limit is not what holds activations back: do not grow it
        new = gradient * self._limit + math.sqrt(self._limit)
        self._limit = (1 - s.smoothing) * self._limit + s.smoothing * new
        self._limit = max(float(s.min_limit), self._limit)
        if s.max_limit:
            self._limit = min(float(s.max_limit), self._limit)
        return self.value


class LimiterTimeout(Exception):
    """No permit came within the wait given to ``ActivationLimiter.acquire``."""


class ActivationLimiter:
    """Permits for the activations of one pool in one process (see the module docstring).

    ``acquire(timeout_s)`` waits (FIFO) for a permit and raises ``LimiterTimeout`` after ``timeout_s``;
    ``release(latency_s)`` gives it back, with the activation's latency (s) when it succeeded (None: it
    failed or never reached its worker, and teaches the limit nothing). ``queued`` is how many wait."""

    def __init__(self, settings: LimiterSettings) -> None:
        self.limit = GradientLimit(settings)
        self.in_use = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def unbounded(self) -> bool:
        return self.limit.settings.max_limit == 0

    @property
    def queued(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self, timeout_s: float) -> None:
        """Take a permit (at once if one is free and nobody waits); ``LimiterTimeout`` after
        ``timeout_s`` s; a cancelled waiter leaves the queue (a permit granted to it is passed on)."""
        if self.unbounded or (self.in_use < self.limit.value and not self.queued):
            self.in_use += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, timeout_s))
        except BaseException:
            self._leave(fut)
            raise
        if not done:
            self._leave(fut)
            raise LimiterTimeout(f"no activation permit within {timeout_s:g}s ({self.in_use} under way, "
                                 f"limit {self.limit.value})")

    def release(self, latency_s: float | None = None) -> None:
        """Give a permit back (``latency_s``: the activation's duration if it succeeded)."""
        self.in_use = max(0, self.in_use - 1)
        if latency_s is not None:
            self.limit.sample(latency_s, self.in_use + 1)
        self._grant()

    def _leave(self, fut: asyncio.Future[None]) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # granted as we gave up: hand it to the next one
            return
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def _grant(self) -> None:
        while self._waiters and self.in_use < self.limit.value:
            f = self._waiters.popleft()
            if f.done():
                continue
            self.in_use += 1
            f.set_result(None)
