"""Per-pool back-off of worker starts after workers fail (both backends).

A pool whose workers keep dying (a crash at start, a port range taken by other programs, a Pod that
fails) is re-created after a pause that doubles with each failure, as the kubelet's CrashLoopBackOff
does for containers (10 s doubling to 5 min there; workers start in well under a second here, so the
defaults are lower). Without it the local backend restarted a worker that could not listen every
reconcile round (58 starts in 30 s), and the pool controller's "a worker is starting" made every waiting
create hold out for that worker for ``api.start_wait_s`` instead of suspending an idle session for room.

A quiet period of ``max_s`` past the last pause's end forgives the failures (as Kubernetes resets its
back-off after 10 minutes of running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _Pool:
    failures: int = 0
    until: float = 0.0  # time.monotonic() the pause ends


class StartBackoff:
    """Failures per pool and the pause they impose: ``base_s * 2**(failures - 1)``, at most ``max_s``
    (seconds; ``base_s`` 0 disables the pause). ``noun`` names what failed in ``reason`` ("worker
    process", "worker Pod")."""

    def __init__(self, base_s: float, max_s: float, *, noun: str = "worker") -> None:
        if base_s < 0 or max_s < 0:
            raise ValueError(f"back-off durations must not be negative, got {base_s!r} and {max_s!r}")
        self.base_s = base_s
        self.max_s = max_s
        self.noun = noun
        self._pools: dict[str, _Pool] = {}

    def failed(self, pool: str, *, now: float | None = None) -> float:
        """Count a failure of one of ``pool``'s workers; return the pause it starts (s)."""
        now = time.monotonic() if now is None else now
        self._forgive(now)
        b = self._pools.setdefault(pool, _Pool())
        b.failures += 1
        pause = min(self.max_s, self.base_s * 2 ** (b.failures - 1))
        b.until = now + pause
        return pause

    def failures(self, pool: str) -> int:
        """Failures of ``pool``'s workers counted (0 once forgiven)."""
        self._forgive(time.monotonic())
        b = self._pools.get(pool)
        return b.failures if b else 0

    def reason(self, pool: str, *, now: float | None = None) -> str:
        """Why no worker of ``pool`` is started now (a sentence), or "" when none is held back."""
        now = time.monotonic() if now is None else now
        b = self._pools.get(pool)
        if b is None or now >= b.until:
            return ""
        return (f"{b.failures} {self.noun}(s) of pool {pool!r} failed in a row; the next start is backed off "
                f"for {b.until - now:.1f} s more (see the runtime's log for why they exited)")

    def _forgive(self, now: float) -> None:
        for b in self._pools.values():
            if b.failures and now > b.until + self.max_s:
                b.failures = 0
