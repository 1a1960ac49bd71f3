"""GPU memory of a pool's workers, from DRA objects: which devices each worker Pod's ResourceClaims were
allocated (``status.allocation.devices.results[]``: driver, pool, device) and what the drivers publish
about them in ResourceSlices (``spec.devices[].capacity.memory``); a worker that read its devices with
``nvidia-smi`` (``workers.devices``) reports them in its registry record, and that figure wins for its Pod.
Pure functions over the API's JSON.

``total`` is the memory of every device allocated to the pool's Pods; ``fragmented`` the part that no
session slot can use right now: devices held by Pods whose worker is not serving (Pending after
allocation, starting, draining, or gone from the registry). These feed ``agent_substrate_gpu_memory_total``
and ``agent_substrate_gpu_memory_fragmented`` (0 when a pool has no claims or the slices say nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _bytes(q: Any) -> int:
    from kubernetes.utils.quantity import parse_quantity  # lazy: importing kubernetes costs ~1 s

    return int(parse_quantity(q))


def device_memory(slices: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], int]:
    """(driver, pool, device) -> memory bytes, from ResourceSlices (``resource.k8s.io/v1``)."""
    out: dict[tuple[str, str, str], int] = {}
    for s in slices:
        spec = s.get("spec") or {}
        driver, pool = spec.get("driver", ""), (spec.get("pool") or {}).get("name", "")
        for d in spec.get("devices") or []:
            mem = ((d.get("capacity") or {}).get("memory") or {}).get("value")
            if mem is not None:
                out[(driver, pool, d.get("name", ""))] = _bytes(mem)
    return out


def pod_gpu_memory(pod: dict[str, Any], claims: dict[str, dict[str, Any]],
                   memory: dict[tuple[str, str, str], int]) -> int:
    """Bytes of device memory allocated to ``pod`` through its claims (``claims`` by name)."""
    total = 0
    for st in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        claim = claims.get(st.get("resourceClaimName") or "")
        results = ((((claim or {}).get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
        for r in results or []:
            total += memory.get((r.get("driver", ""), r.get("pool", ""), r.get("device", "")), 0)
    return total


def pool_gpu_memory(pods: dict[str, dict[str, Any]], serving: set[str], claims: dict[str, dict[str, Any]],
                    memory: dict[tuple[str, str, str], int],
                    reported: dict[str, int] | None = None) -> tuple[int, int]:
    """(total, fragmented) bytes for one pool's ``pods``; ``serving`` = worker ids READY in the registry;
    ``reported`` = bytes a worker read from ``nvidia-smi`` (by worker id = Pod name), which win over the
    claims' figure for that Pod (they are what the container actually sees)."""
    total = fragmented = 0
    reported = reported or {}
    for name, pod in pods.items():
        m = reported.get(name) or pod_gpu_memory(pod, claims, memory)
        total += m
        if name not in serving:
            fragmented += m
    return total, fragmented
