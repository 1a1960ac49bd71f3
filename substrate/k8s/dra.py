"""Accelerators by attributes -> a DRA ``resource.k8s.io/v1`` ResourceClaimTemplate.

A WorkerPool's ``spec.accelerators`` (``count``, ``minMemory``, ``product``, ``architecture``,
``minComputeCapability``, ``migProfile``, ``deviceClassName``, ``gang``) compiles to one request
``spec.devices.requests[0].exactly`` with ``allocationMode: ExactCount``, the requested ``count`` (2 GPUs
stay 2) and CEL ``selectors`` over the attributes and capacities the NVIDIA DRA driver publishes in its
ResourceSlices (``gpu.nvidia.com``: ``productName``, ``architecture``, ``cudaComputeCapability``,
``type``, ``profile``; capacity ``memory``). Each worker Pod gets its own claim stamped from the template
(``spec.resourceClaims[].resourceClaimTemplateName``), so a GPU lives and dies with its worker.

Gang placement (``gang: true``): all workers of the pool are scheduled all-or-nothing through a
``scheduling.k8s.io/v1beta1`` **PodGroup** with ``schedulingPolicy.gang.minCount`` = the pool's replicas,
referenced from each Pod's ``spec.schedulingGroup.podGroupName`` (the GenericWorkload/gang scheduling API
in the Kubernetes 1.37 schemas; needs its feature gate). We chose it over scheduler-plugins' PodGroup
(``scheduling.x-k8s.io``) because it is the upstream API, needs no second scheduler and validates against
the same schemas as everything else.

The seed's ``resource.k8s.io/v1alpha2`` objects are translated by ``translate_v1alpha2_claim``: a
``ResourceClass`` (``driverName``) becomes a DeviceClass selector on ``device.driver``; a ResourceClaim's
free-form ``parameters`` (``gpuMemory``, ``computeCapability``, ``multiInstanceGPU``, ``count``) become the
attributes above. Unknown parameters are refused (``ValueError`` naming them), never dropped.
"""

from __future__ import annotations

import re
from typing import Any

NVIDIA = "gpu.nvidia.com"
#: DeviceClasses the NVIDIA DRA driver installs: whole GPUs and MIG partitions
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
_CC_RE = re.compile(r"^\d+(\.\d+){0,2}$")
_SAFE = re.compile(r'^[A-Za-z0-9 ._\-/]+$')

ACCELERATOR_FIELDS = {"count", "minMemory", "product", "architecture", "minComputeCapability", "migProfile",
                      "deviceClassName", "gang"}


def _semver(v: str) -> str:
    parts = v.split(".") + ["0", "0"]
    return ".".join(parts[:3])


def _literal(field: str, v: Any) -> str:
    s = str(v)
    if not _SAFE.match(s):
        raise ValueError(f"accelerators.{field}: {s!r} has characters not allowed in a CEL string literal")
    return s


def selectors(acc: dict[str, Any]) -> list[str]:
    """CEL expressions (one per attribute) for ``acc``; raises ``ValueError`` naming a bad field."""
    out: list[str] = []
    attrs = f'device.attributes["{NVIDIA}"]'
    if acc.get("minMemory") is not None:
        q = str(acc["minMemory"])
        from kubernetes.utils.quantity import parse_quantity  # lazy: importing kubernetes costs ~1 s

        try:
            parse_quantity(q)
        except ValueError:
            raise ValueError(f"accelerators.minMemory: {q!r} is not a quantity (e.g. 40Gi)") from None
        out.append(f'device.capacity["{NVIDIA}"].memory.compareTo(quantity("{q}")) >= 0')
    if acc.get("product"):
        out.append(f'{attrs}.productName == "{_literal("product", acc["product"])}"')
    if acc.get("architecture"):
        out.append(f'{attrs}.architecture == "{_literal("architecture", acc["architecture"])}"')
    if acc.get("minComputeCapability") is not None:
        cc = str(acc["minComputeCapability"])
        if not _CC_RE.match(cc):
            raise ValueError(f"accelerators.minComputeCapability: {cc!r} is not a version like 8.0")
        out.append(f'{attrs}.cudaComputeCapability.compareTo(semver("{_semver(cc)}")) >= 0')
    if acc.get("migProfile"):
        out.append(f'{attrs}.type == "mig"')
        if acc["migProfile"] != "any":
            out.append(f'{attrs}.profile == "{_literal("migProfile", acc["migProfile"])}"')
    return out


def validate_accelerators(acc: dict[str, Any]) -> None:
    """Refuse unknown fields and bad values (``ValueError`` naming the field)."""
    unknown = sorted(set(acc) - ACCELERATOR_FIELDS)
    if unknown:
        raise ValueError(f"accelerators: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(ACCELERATOR_FIELDS))})")
    count = acc.get("count", 1)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"accelerators.count must be an integer >= 1, got {count!r}")
    selectors(acc)


def claim_template_name(pool: str) -> str:
    return f"{pool}-accelerators"


def claim_template(pool: str, namespace: str, acc: dict[str, Any],
                   owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ResourceClaimTemplate for a pool's ``spec.accelerators`` (a plain dict, ready to create)."""
    validate_accelerators(acc)
    device_class = acc.get("deviceClassName") or (MIG_CLASS if acc.get("migProfile") else GPU_CLASS)
    exactly: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "ExactCount",
                               "count": int(acc.get("count", 1))}
    sel = selectors(acc)
    if sel:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in sel]
    meta: dict[str, Any] = {"name": claim_template_name(pool), "namespace": namespace,
                            "labels": {"app.kubernetes.io/name": "agent-substrate",
                                       "substrate.agent.dev/pool": pool}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": meta,
            "spec": {"spec": {"devices": {"requests": [{"name": "accelerators", "exactly": exactly}]}}}}


def pod_group(pool: str, namespace: str, min_count: int, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gang PodGroup of a pool (``scheduling.k8s.io/v1beta1``): ``min_count`` Pods or none."""
    meta: dict[str, Any] = {"name": pool, "namespace": namespace,
                            "labels": {"app.kubernetes.io/name": "agent-substrate", "substrate.agent.dev/pool": pool}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": meta,
            "spec": {"schedulingPolicy": {"gang": {"minCount": max(1, int(min_count))}}}}


#: v1alpha2 ResourceClaim parameters of the seed -> accelerator fields
_V1ALPHA2 = {"gpuMemory": "minMemory", "computeCapability": "minComputeCapability", "count": "count",
             "multiInstanceGPU": "migProfile", "productName": "product", "architecture": "architecture"}


def translate_v1alpha2_claim(claim: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Seed ``resource.k8s.io/v1alpha2`` ResourceClaim -> (``accelerators`` dict, notes on what changed).

    ``multiInstanceGPU: true`` becomes ``migProfile: any`` (any MIG partition of the class); ``count`` is
    kept. Raises ``ValueError`` naming a parameter that has no v1 meaning.
    """
    spec = claim.get("spec") or {}
    params = dict(spec.get("parameters") or {})
    acc: dict[str, Any] = {}
    notes = [f"resource.k8s.io/v1alpha2 ResourceClaim {claim.get('metadata', {}).get('name', '?')!r}: "
             "translated to a resource.k8s.io/v1 ResourceClaimTemplate (v1alpha2 was removed in 1.32)"]
    for key, value in params.items():
        if key not in _V1ALPHA2:
            raise ValueError(f"v1alpha2 parameter {key!r} has no resource.k8s.io/v1 equivalent here "
                             f"(known: {', '.join(sorted(_V1ALPHA2))})")
        if key == "multiInstanceGPU":
            if value:
                acc["migProfile"] = "any"
            continue
        acc[_V1ALPHA2[key]] = int(value) if key == "count" else str(value)
    if spec.get("resourceClassName"):
        notes.append(f"resourceClassName {spec['resourceClassName']!r} -> DeviceClass "
                     f"{MIG_CLASS if acc.get('migProfile') else GPU_CLASS!r} of the NVIDIA DRA driver")
    validate_accelerators(acc)
    return acc, notes


def translate_v1alpha2_class(rc: dict[str, Any]) -> dict[str, Any]:
    """Seed ``ResourceClass`` (``driverName``) -> a v1 DeviceClass selecting that driver's devices."""
    driver = rc.get("driverName")
    if not driver:
        raise ValueError("v1alpha2 ResourceClass without driverName")
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": rc.get("metadata", {}).get("name", driver)},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{_literal("driverName", driver)}"'}}]}}
