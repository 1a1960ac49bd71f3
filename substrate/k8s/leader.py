"""Leader election on a ``coordination.k8s.io/v1`` Lease (client-go's leaderelection, simplified).

Each candidate tries every ``renew_s``: create the Lease if missing; renew it if it holds it; take it over
if ``renewTime + leaseDurationSeconds`` has passed. Writes are merge patches carrying
``metadata.resourceVersion``, which the API server treats as a precondition (409 Conflict when another
candidate wrote first), so two candidates never both win. A leader that cannot renew within the lease
duration steps down (``is_leader`` false); standbys take over within one lease duration of the leader's
last renewal.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Any

from substrate.k8s.api import REACHABILITY, Kube, KubeError, unreachable

log = logging.getLogger(__name__)


def _now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(t: Any) -> float:
    if t is None:
        return 0.0
    if isinstance(t, dt.datetime):
        return t.timestamp()
    s = str(t).replace("Z", "+00:00")
    return dt.datetime.fromisoformat(s).timestamp()


def lease_body(ns: str, name: str, identity: str, duration_s: float, transitions: int = 0) -> dict[str, Any]:
    now = _now_micro()
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": ns,
                         "labels": {"app.kubernetes.io/name": "agent-substrate",
                                    "app.kubernetes.io/component": "controller"}},
            "spec": {"holderIdentity": identity, "leaseDurationSeconds": max(1, int(round(duration_s))),
                     "acquireTime": now, "renewTime": now, "leaseTransitions": transitions}}


class LeaderElector:
    """``await run()`` until cancelled; ``is_leader`` and ``became_leader`` (an Event) tell the state."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *, duration_s: float = 15.0,
                 renew_s: float = 5.0) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration_s = duration_s
        self.renew_s = renew_s
        self.is_leader = False
        self.became_leader = asyncio.Event()
        self.lost_leadership = asyncio.Event()
        self._last_renew = 0.0
        self.transitions_seen = 0

    def try_acquire_or_renew(self) -> bool:
        """One attempt (blocking). True if this candidate holds the Lease afterwards."""
        lease = self.kube.get_lease(self.namespace, self.name)
        if lease is None:
            try:
                self.kube.create_lease(self.namespace, lease_body(self.namespace, self.name, self.identity,
                                                                  self.duration_s))
                return True
            except KubeError as e:
                if e.status == 409:
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        rv = (lease.get("metadata") or {}).get("resourceVersion")
        duration = float(spec.get("leaseDurationSeconds") or self.duration_s)
        expired = _parse(spec.get("renewTime")) + duration < time.time()
        if holder != self.identity and holder and not expired:
            return False
        patch: dict[str, Any] = {"metadata": {"resourceVersion": rv},
                                 "spec": {"holderIdentity": self.identity, "renewTime": _now_micro(),
                                          "leaseDurationSeconds": max(1, int(round(self.duration_s)))}}
        if holder != self.identity:
            patch["spec"]["acquireTime"] = _now_micro()
            patch["spec"]["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        try:
            self.kube.patch_lease(self.namespace, self.name, patch)
            return True
        except KubeError as e:
            if e.status == 409:
                return False
            raise

    def release(self) -> None:
        """Give the lease up at once (graceful stop): a standby takes over on its next attempt."""
        lease = self.kube.get_lease(self.namespace, self.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        self.kube.patch_lease(self.namespace, self.name, {
            "metadata": {"resourceVersion": (lease.get("metadata") or {}).get("resourceVersion")},
            "spec": {"holderIdentity": "", "renewTime": "1970-01-01T00:00:00.000000Z"}})
        self.is_leader = False

    async def run(self) -> None:
        while True:
            wait_s = self.renew_s if self.is_leader else min(self.renew_s, self.duration_s / 3)
            try:
                ok = await asyncio.to_thread(self.try_acquire_or_renew)
                REACHABILITY.ok(self.kube.url)
            except Exception as e:  # noqa: BLE001 - the API may be briefly away; the lease covers it
                why = unreachable(e)
                if why is not None:  # one line, at most once a minute: not a traceback every attempt
                    REACHABILITY.failed(self.kube.url, why, wait_s)
                else:
                    log.warning("lease attempt failed", exc_info=True)
                ok = False
            now = time.monotonic()
            if ok:
                self._last_renew = now
                if not self.is_leader:
                    log.warning("became leader", extra={"lease": self.name, "identity": self.identity})
                    self.is_leader = True
                    self.became_leader.set()
            elif self.is_leader and now - self._last_renew > self.duration_s:
                log.error("lost leadership", extra={"lease": self.name, "identity": self.identity})
                self.is_leader = False
                self.lost_leadership.set()
            await asyncio.sleep(self.renew_s if self.is_leader else min(self.renew_s, self.duration_s / 3))
