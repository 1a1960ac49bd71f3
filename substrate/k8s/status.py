"""A WorkerPool's ``status`` per the API conventions, and the HPA of a pool with ``autoscaling.metrics``.

``compute`` is pure: replicas (worker Pods that exist and are not being deleted), readyReplicas (workers
registered READY), slots/freeSlots/availableSlots, ``selector`` (for ``/scale``), ``observedGeneration``
and ``conditions``. A condition's ``lastTransitionTime`` is carried over from the current status unless its
``status`` changed (reason/message updates do not move it), so the status is only rewritten when something
changed, not every tick.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from substrate.backends.kubernetes import PodProblem
from substrate.k8s.pods import selector
from substrate.models import API_VERSION, WorkerPool, WorkerRecord, WorkerState
from substrate.pool import desired_replicas


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(ctype: str, ok: bool, reason: str, message: str, previous: list[dict[str, Any]],
              generation: int) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = next((c for c in previous if c.get("type") == ctype), None)
    ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": ltt or _now(), "observedGeneration": generation}


def compute(pool: WorkerPool, raw: dict[str, Any], workers: list[WorkerRecord], pods: dict[str, dict[str, Any]],
            problems: list[PodProblem], *, expectations: int = 0, draining: set[str] | frozenset[str] = frozenset()
            ) -> dict[str, Any]:
    """The status dict for ``pool`` (see the module docstring)."""
    import time

    now = time.time()
    meta = raw.get("metadata") or {}
    generation = int(meta.get("generation") or pool.metadata.generation or 1)
    previous = list((raw.get("status") or {}).get("conditions") or [])
    live = [p for p, o in pods.items() if not (o.get("metadata") or {}).get("deletionTimestamp")
            and (o.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
    ready = [w for w in workers if w.state == WorkerState.READY and w.leaseExpiresAt > now and w.id not in draining]
    busy = sum(w.activeSlots for w in workers)
    desired = desired_replicas(pool.spec, busy)
    a = pool.spec.autoscaling
    unsched = [p for p in problems if p.reason == "Unschedulable"]
    backoff = [p for p in problems if p.reason == "BackOff"]
    conds = [
        condition("Valid", True, "Loaded", "spec loaded", previous, generation),
        condition("Ready", len(ready) >= desired and desired > 0 or desired == 0,
                  "WorkersReady" if len(ready) >= desired else "WorkersStarting",
                  f"{len(ready)} of {desired} workers ready", previous, generation),
        condition("PodsSchedulable", not unsched, "Unschedulable" if unsched else "Scheduled",
                  (f"{len(unsched)} worker Pod(s) unschedulable: {unsched[0].message}"[:500]) if unsched
                  else "every worker Pod was placed", previous, generation),
        condition("PodsHealthy", not backoff, "BackOff" if backoff else "Healthy",
                  backoff[0].message if backoff else "no worker Pod failed recently", previous, generation),
    ]
    if a is not None and not a.metrics:
        # spec.replicas is named only when the pool has one: the model's default was reported as "not
        # used" for a pool that never set it (fresh-user review)
        written = ((raw.get("spec") or {}).get("replicas") if isinstance(raw.get("spec"), dict) else None)
        unused = f"; spec.replicas ({written}) is not used" if written is not None else ""
        conds.append(condition("ScalingManaged", True, "SlotAutoscaler",
                               f"spec.autoscaling decides between {a.minReplicas} and {a.maxReplicas} "
                               f"workers{unused}", previous, generation))
    return {
        "replicas": len(live),
        "readyReplicas": len(ready),
        "slots": sum(w.slots for w in workers),
        "freeSlots": sum(w.freeSlots for w in workers),
        "availableSlots": sum(w.freeSlots for w in ready),
        "selector": selector(pool.name),
        "observedGeneration": generation,
        "conditions": conds,
    }


def same(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return old == new


def hpa(pool: WorkerPool, namespace: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """An ``autoscaling/v2`` HorizontalPodAutoscaler driving the pool's ``/scale`` with its
    ``autoscaling.metrics`` (the HPA reads Pod metrics through ``status.selector``)."""
    a = pool.spec.autoscaling
    assert a is not None and a.metrics
    meta: dict[str, Any] = {"name": pool.name, "namespace": namespace,
                            "labels": {"app.kubernetes.io/name": "agent-substrate", "substrate.agent.dev/pool": pool.name}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
            "spec": {"scaleTargetRef": {"apiVersion": API_VERSION, "kind": "WorkerPool", "name": pool.name},
                     "minReplicas": max(1, a.minReplicas), "maxReplicas": a.maxReplicas,
                     "metrics": a.metrics}}
