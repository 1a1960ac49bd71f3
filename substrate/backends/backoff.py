"""Per-pool back-off of worker starts after workers fail (both backends).

A pool whose workers keep dying (a crash at start, a port range taken by other programs, a Pod that
fails) is re-created after a pause that doubles with each failure, as the kubelet's CrashLoopBackOff
does for containers (10 s doubling to 5 min there; workers start in well under a second here, so the
defaults are lower). Without it the local backend restarted a worker that could not listen every
reconcile round (58 starts in 30 s), and the pool controller's "a worker is starting" made every waiting
create hold out for that worker for ``api.start_wait_s`` instead of suspending an idle session for room.

The first failure in a row is retried at once (most are one-offs, and a waiting create waits for that
retry); the pause starts at the second. A quiet period of ``max_s`` past the last pause's end forgives the
failures (as Kubernetes resets its
back-off after 10 minutes of running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _Pool:
    failures: int = 0
    #: doublings so far: only a failure after the pause ended doubles it (workers started together and
    #: dying of one cause took the pause 8 -> 16 -> 32 s within a second: tester 49)
    steps: int = 0
    until: float = 0.0  # time.monotonic() the pause ends


class StartBackoff:
    """Failures per pool and the pause they impose: none for the first in a row, then ``base_s *
    2**(n - 2)``, at most ``max_s``, where ``n`` counts the failures that came after the previous pause
    had ended (seconds; ``base_s`` 0 disables the pause): workers that fail together, started in one
    round, double it once. ``noun`` names what failed in the sentences ("worker
    process", "worker Pod"). A worker of the pool that starts (registers) ends the run of failures
    (``started``); so does a quiet period of ``max_s`` past the last pause's end."""

    def __init__(self, base_s: float, max_s: float, *, noun: str = "worker") -> None:
        if base_s < 0 or max_s < 0:
            raise ValueError(f"back-off durations must not be negative, got {base_s!r} and {max_s!r}")
        if base_s > max_s:
            raise ValueError(f"the back-off's start ({base_s!r} s) is over its maximum ({max_s!r} s)")
        self.base_s = base_s
        self.max_s = max_s
        self.noun = noun
        self._pools: dict[str, _Pool] = {}

    def failed(self, pool: str, *, now: float | None = None) -> float:
        """Count a failure of one of ``pool``'s workers; return the pause left (s): a new one, or, for a
        failure during a pause, what is left of it."""
        now = time.monotonic() if now is None else now
        self._forgive(now)
        b = self._pools.setdefault(pool, _Pool())
        b.failures += 1
        if now < b.until:  # within the pause another one started: same cause, no further doubling
            return b.until - now
        b.steps += 1
        # the first failure in a row is retried at once: most are one-offs (an evicted Pod, a crash), and
        # a pause then turned a create that would have waited a second for the retry into a 503 (the
        # waiters stop counting on a start during a pause: a k8s test's router gave up on its create)
        pause = 0.0 if b.steps == 1 else min(self.max_s, self.base_s * 2 ** (b.steps - 2))
        b.until = now + pause
        return pause

    def started(self, pool: str) -> None:
        """A worker of ``pool`` started (registered): the failures were not "in a row" any more, and a
        pause under way ends (a pool whose workers started fine was held at zero workers for a minute
        after one later crash: fresh-user tester 47)."""
        self._pools.pop(pool, None)

    def failures(self, pool: str, *, now: float | None = None) -> int:
        """Failures of ``pool``'s workers in a row (0 once one started, or once forgiven)."""
        self._forgive(time.monotonic() if now is None else now)
        b = self._pools.get(pool)
        return b.failures if b else 0

    def pause_left_s(self, pool: str, *, now: float | None = None) -> float:
        """Seconds until a worker of ``pool`` may be started again (0: now)."""
        now = time.monotonic() if now is None else now
        b = self._pools.get(pool)
        return max(0.0, b.until - now) if b else 0.0

    def reason(self, pool: str, *, now: float | None = None) -> str:
        """Why no worker of ``pool`` is started now (a sentence), or "" when a start may be tried."""
        left = self.pause_left_s(pool, now=now)
        if not left:
            return ""
        return f"{self._failed(pool)}; its next start is backed off for {left:.1f} s more"

    def failing(self, pool: str, *, now: float | None = None) -> str:
        """While ``pool``'s workers fail in a row (none started since): a sentence saying so and when
        the next start is (for the pool's condition, which stays False through the retries); else ""."""
        if not self.failures(pool, now=now):
            return ""
        left = self.pause_left_s(pool, now=now)
        # not "a start is being tried": the pool may need none (tester 48 read that for 60 s with no start)
        return f"{self._failed(pool)}; " + (f"the next start in {left:.1f} s" if left
                                            else "the pause is over: the next start the pool needs goes ahead")

    def _failed(self, pool: str) -> str:
        n = self._pools[pool].failures
        nouns = self.noun if n == 1 else self.noun + ("es" if self.noun.endswith("s") else "s")
        return f"{n} {nouns} of pool {pool!r} failed in a row (none started since; the runtime's log says why)"

    def _forgive(self, now: float) -> None:
        for pool, b in list(self._pools.items()):
            if now > b.until + self.max_s:
                del self._pools[pool]
