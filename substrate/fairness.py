"""Fairness between tenants when the pool is full, and a circuit breaker per tenant and template.

* **Parked wakes**: one tenant's requests may take at most ``tenant_parked_share`` of a router's
  ``max_parked`` places; the rest stay for others (429 ``tenant_parked_share``).
* **Placements**: when no slot is free, a placement may suspend an idle session of another tenant only
  while the requesting tenant holds less than its fair share of the pool's slots (slots divided by the
  tenants present), and then only as many as it is short of its share; at or past its share it can only
  make room among its own sessions (``victim_order``).
* **Circuit breaker**: ``breaker_failures`` failed activations (create or wake) of one tenant's sessions
  of one ActorTemplate within ``breaker_window_s`` open that (tenant, template) breaker for
  ``breaker_open_s``: those creates and wakes get 429 ``tenant_circuit_open`` at once, without claiming
  slots or touching workers, while other tenants, and the same tenant's other templates, go on. Keyed by
  template too because the usual cause is one template that cannot start (a missing binary or secret):
  a per-tenant key let 10 creates of a broken template shut the tenant (in open mode: every caller) out
  of every create and wake for 30 s (a fresh-user run). Templates are the operator's, a bounded set.
  After the open period one trial is let through (half-open); a success closes it, a failure reopens.

State is per router process (the breaker is a local defence, like a client-side breaker): with N routers
a failing tenant is cut off after at most N x ``breaker_failures`` failures.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque

from substrate.errors import TooManyRequests
from substrate.settings import QuotaSettings


class TenantBreaker:
    """Circuit breaker per (tenant, template) (closed -> open -> half-open -> closed). ``now`` (monotonic
    s) is injectable."""

    def __init__(self, settings: QuotaSettings) -> None:
        self.settings = settings
        self._failures: dict[tuple[str, str], deque[float]] = defaultdict(deque)
        self._open_until: dict[tuple[str, str], float] = {}

    def check(self, tenant: str, template: str, now: float | None = None) -> None:
        """Raise ``TooManyRequests(code="tenant_circuit_open")`` (details: tenant, actorTemplate,
        failures) while the breaker of ``tenant``'s ``template`` sessions is open."""
        now = time.monotonic() if now is None else now
        key = (tenant, template)
        until = self._open_until.get(key)
        if until is None:
            return
        if now < until:
            raise TooManyRequests(
                f"tenant {tenant!r}: too many failed activations of template {template!r} recently; retry "
                "later (its other templates are not affected)",
                code="tenant_circuit_open", retry_after_s=max(1.0, until - now),
                details={"tenant": tenant, "actorTemplate": template, "failures": len(self._failures[key])})
        # half-open: let this one through; one more failure reopens at once
        del self._open_until[key]
        self._failures[key] = deque([now] * (self.settings.breaker_failures - 1))

    def failure(self, tenant: str, template: str, now: float | None = None) -> None:
        """Count a failed activation of ``tenant``'s ``template``; opens its breaker at the threshold."""
        now = time.monotonic() if now is None else now
        key = (tenant, template)
        q = self._failures[key]
        q.append(now)
        while q and q[0] < now - self.settings.breaker_window_s:
            q.popleft()
        if len(q) >= self.settings.breaker_failures:
            self._open_until[key] = now + self.settings.breaker_open_s

    def success(self, tenant: str, template: str) -> None:
        """A successful activation closes the breaker of ``tenant``'s ``template``."""
        self._failures.pop((tenant, template), None)
        self._open_until.pop((tenant, template), None)


class ParkedShare:
    """Counts parked requests per tenant; refuses a tenant past its share of ``max_parked``."""

    def __init__(self, max_parked: int, share: float) -> None:
        self.cap = max(1, math.floor(max_parked * share))
        self.by_tenant: dict[str, int] = defaultdict(int)

    def enter(self, tenant: str, retry_after_s: float) -> None:
        if self.by_tenant[tenant] >= self.cap:
            raise TooManyRequests(f"tenant {tenant!r} already has {self.cap} requests waiting for resumes "
                                  "(its share of this router); retry later", code="tenant_parked_share",
                                  retry_after_s=retry_after_s, details={"tenant": tenant, "max": self.cap})
        self.by_tenant[tenant] += 1

    def leave(self, tenant: str) -> None:
        self.by_tenant[tenant] -= 1
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]


def fair_share(requester: str, held_by_tenant: dict[str, int], pool_slots: int) -> int:
    """A tenant's fair share of a pool's ``pool_slots``: the slots divided by the tenants present
    (``held_by_tenant``'s, the requester included), rounded up."""
    tenants = set(held_by_tenant) | {requester}
    return math.ceil(pool_slots / len(tenants))


def victim_order(requester: str, held_by_tenant: dict[str, int], pool_slots: int,
                 candidates: list[tuple[str, str]]) -> list[str]:
    """The sessions a placement for ``requester`` may suspend, in the order given (``candidates``:
    ``(session ID, owning tenant)``, least recently used first): all of the requester's own, and of other
    tenants' at most as many as the requester is short of its :func:`fair_share` (none at or over it).
    ``requester`` "" (no requesting tenant: the pool's headroom) may take anyone's.

    Capped, not all-or-nothing: a tenant one slot under its share whose burst queued five wakes could
    suspend five other tenants' sessions (each make-room call asks for as many slots as it has waiters),
    and took every slot of the pool (a fresh-user run: the other tenant's next turn was 503 no_capacity)."""
    if not requester:
        return [sid for sid, _ in candidates]
    others = max(0, fair_share(requester, held_by_tenant, pool_slots) - held_by_tenant.get(requester, 0))
    out = []
    for sid, owner in candidates:
        if owner == requester:
            out.append(sid)
        elif others > 0:
            out.append(sid)
            others -= 1
    return out
