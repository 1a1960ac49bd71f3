"""The worker Pod of a WorkerPool: the pool's pod template merged with hardened defaults.

What the template says wins where it is at least as strict; the builder adds what a worker needs:

* identity: name = worker id; labels ``app.kubernetes.io/{name,component}``, ``substrate.agent.dev/pool``
  (the pool's ``status.selector``) and ``substrate.agent.dev/template-hash`` (rolling replacement);
  ``ownerReferences`` to the WorkerPool (controller, blockOwnerDeletion) so garbage collection follows it;
* hardening: ``runAsNonRoot`` (uid/gid 10001 unless the template sets one), ``hostUsers: false``,
  seccomp ``RuntimeDefault``, ``allowPrivilegeEscalation: false``, all capabilities dropped,
  read-only root with a writable workspace volume (``kubernetes.worker_root``) and ``/tmp``, no service
  account token, no service links; ``runtimeClassName`` from the template;
* the worker process: ``substrate worker`` on ``0.0.0.0:<kubernetes.worker_port>``, advertising the Pod
  IP (downward API ``status.podIP``), worker id from ``metadata.name``, Redis URL and internal token from
  Secrets, snapshot store from the pool's ``snapshotStorage`` or the controller's settings;
  ``restartPolicy: Never`` (a worker that ended is replaced and its sessions recovered, never restarted
  under the same identity), readiness on ``/healthz``;
* GPUs: the pool's ``resourceClaims`` and, for ``spec.accelerators``, a claim from the compiled
  ResourceClaimTemplate (``substrate.k8s.dra``), referenced from the worker container.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from substrate.k8s import dra
from substrate.k8s.snapshot_uri import store_env
from substrate.models import API_VERSION, WorkerPool
from substrate.settings import Settings

POOL_LABEL = "substrate.agent.dev/pool"
HASH_LABEL = "substrate.agent.dev/template-hash"
COMPONENT_LABELS = {"app.kubernetes.io/name": "agent-substrate", "app.kubernetes.io/component": "worker"}
WORKER_CONTAINER = "worker"
NON_ROOT_ID = 10001


def selector(pool: str) -> str:
    """The label selector of a pool's worker Pods, in string form (``status.selector``)."""
    return f"app.kubernetes.io/component=worker,{POOL_LABEL}={pool}"


def template_hash(pool: WorkerPool) -> str:
    """Hash of everything that goes into a worker Pod; a change rolls the pool's workers."""
    spec = pool.spec
    material = {"template": spec.template, "slots": spec.slots, "claims": spec.resourceClaims,
                "accelerators": getattr(spec, "accelerators", None), "storage": spec.snapshotStorage}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:10]


def owner_reference(pool: WorkerPool) -> dict[str, Any]:
    """ownerReference to the WorkerPool (needs the uid the API server gave it)."""
    return {"apiVersion": API_VERSION, "kind": "WorkerPool", "name": pool.name,
            "uid": str(getattr(pool.metadata, "uid", None) or ""), "controller": True, "blockOwnerDeletion": True}


def _secret_or_literal(name: str, secret: str, key: str, literal: str | None) -> dict[str, Any]:
    if secret:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
    return {"name": name, "value": literal or ""}


def worker_env(pool: WorkerPool, settings: Settings) -> list[dict[str, Any]]:
    """Environment every worker container gets (appended after the template's own variables)."""
    k = settings.kubernetes
    w = settings.worker
    env: list[dict[str, Any]] = [
        {"name": "SUBSTRATE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SUBSTRATE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SUBSTRATE_WORKER_POOL", "value": pool.name},
        {"name": "SUBSTRATE_WORKER_SLOTS", "value": str(pool.spec.slots)},
        {"name": "SUBSTRATE_WORKER_PORT", "value": str(k.worker_port)},
        {"name": "SUBSTRATE_WORKER__ROOT_DIR", "value": f"{k.worker_root}/workers"},
        {"name": "SUBSTRATE_WORKER__HEARTBEAT_S", "value": str(w.heartbeat_s)},
        {"name": "SUBSTRATE_WORKER__LEASE_S", "value": str(w.lease_s)},
        {"name": "SUBSTRATE_WORKER__ACTIVE_WINDOW_S", "value": str(w.active_window_s)},
        {"name": "SUBSTRATE_WORKER__FIRST_TURN_WINDOW_S", "value": str(w.first_turn_window_s)},
        {"name": "SUBSTRATE_REDIS__KEY_PREFIX", "value": settings.redis.key_prefix},
        _secret_or_literal("SUBSTRATE_REDIS__URL", k.redis_secret, "url", settings.redis.url),
        _secret_or_literal("SUBSTRATE_WORKER__INTERNAL_TOKEN", k.token_secret, "token", w.internal_token),
        {"name": "SUBSTRATE_LOG_LEVEL", "value": settings.log_level},
    ]
    env += [{"name": n, "value": v} for n, v in store_env(pool.spec.snapshotStorage, settings.snapshot).items()]
    return env


def _merge_env(user: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = {e.get("name") for e in user}
    return [*user, *(e for e in ours if e["name"] not in names)]


def session_limits(templates: list[Any], slots: int) -> tuple[dict[str, str], int | None]:
    """Pod limits implied by the ``isolation`` of the templates a pool hosts: for ``cpu``/``memory``, the
    largest per-session ``maxCpu``/``maxMemory`` times ``slots`` (only when every template sets it: one
    unbounded template leaves the Pod unbounded too); and the workspace volume's size from
    ``maxDiskBytes`` the same way. Returns (limits, workspace bytes or None)."""
    from kubernetes.utils.quantity import parse_quantity  # lazy: importing kubernetes costs ~1 s

    limits: dict[str, str] = {}
    if not templates:
        return limits, None
    isos = [t.spec.isolation for t in templates]
    cpus = [getattr(i, "maxCpu", None) for i in isos]
    if all(cpus):
        limits["cpu"] = f"{int(max(parse_quantity(c) for c in cpus) * 1000 * slots)}m"
    mems = [getattr(i, "maxMemory", None) for i in isos]
    if all(mems):
        limits["memory"] = str(int(max(parse_quantity(m) for m in mems) * slots))
    disks = [getattr(i, "maxDiskBytes", None) for i in isos]
    disk = int(max(parse_quantity(d) for d in disks) * slots) if all(disks) else None
    return limits, disk


def build_worker_pod(pool: WorkerPool, worker_id: str, settings: Settings, *, namespace: str | None = None,
                     gang: bool = False, templates: list[Any] | None = None) -> dict[str, Any]:
    """The Pod (a plain dict) for worker ``worker_id`` of ``pool``. Pure: no API call. ``templates``:
    the ActorTemplates the pool hosts, whose per-session isolation limits bound the Pod where the
    pod template sets no limit (``session_limits``)."""
    k = settings.kubernetes
    ns = namespace or pool.metadata.namespace or k.namespace
    tpl = copy.deepcopy(pool.spec.template or {})
    tmeta = tpl.get("metadata") or {}
    spec: dict[str, Any] = copy.deepcopy(tpl.get("spec") or {})
    labels = {**(tmeta.get("labels") or {}), **COMPONENT_LABELS, POOL_LABEL: pool.name,
              HASH_LABEL: template_hash(pool)}
    meta: dict[str, Any] = {"name": worker_id, "namespace": ns, "labels": labels,
                            "annotations": dict(tmeta.get("annotations") or {}),
                            "ownerReferences": [owner_reference(pool)]}
    if not meta["annotations"]:
        del meta["annotations"]

    # --- pod-level hardening
    spec.setdefault("restartPolicy", "Never")
    spec["restartPolicy"] = "Never"
    spec.setdefault("automountServiceAccountToken", False)
    spec.setdefault("enableServiceLinks", False)
    spec.setdefault("hostUsers", False)
    spec.setdefault("terminationGracePeriodSeconds", 60)
    psc = spec.setdefault("securityContext", {})
    psc.setdefault("runAsNonRoot", True)
    psc.setdefault("runAsUser", NON_ROOT_ID)
    psc.setdefault("runAsGroup", NON_ROOT_ID)
    psc.setdefault("fsGroup", NON_ROOT_ID)
    psc.setdefault("seccompProfile", {"type": "RuntimeDefault"})

    # --- the worker container (the one named "worker", else the first, else a new one)
    containers = spec.setdefault("containers", [])
    if not containers:
        containers.append({"name": WORKER_CONTAINER})
    c = next((x for x in containers if x.get("name") == WORKER_CONTAINER), containers[0])
    c.setdefault("image", k.worker_image)
    if not c.get("command") and not c.get("args"):
        c["command"] = ["substrate", "worker"]
    ports = c.setdefault("ports", [])
    if not any(p.get("name") == "http" for p in ports):
        ports.append({"name": "http", "containerPort": k.worker_port, "protocol": "TCP"})
    c["env"] = _merge_env(c.get("env") or [], worker_env(pool, settings))
    c.setdefault("readinessProbe", {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2})
    csc = c.setdefault("securityContext", {})
    csc.setdefault("allowPrivilegeEscalation", False)
    csc.setdefault("readOnlyRootFilesystem", True)
    csc.setdefault("capabilities", {"drop": ["ALL"]})
    csc.setdefault("runAsNonRoot", True)

    # --- limits from the hosted templates' isolation, where the pod template sets none
    limits, disk_bytes = session_limits(templates or [], pool.spec.slots)
    if limits:
        have = c.setdefault("resources", {}).setdefault("limits", {})
        for r, q in limits.items():
            have.setdefault(r, q)

    # --- writable workspace and /tmp on a read-only root
    volumes = spec.setdefault("volumes", [])
    mounts = c.setdefault("volumeMounts", [])
    mounted = {m.get("mountPath") for m in mounts}
    for vol, path in (("substrate-workspace", k.worker_root), ("substrate-tmp", "/tmp")):
        if path not in mounted:
            mounts.append({"name": vol, "mountPath": path})
            if not any(v.get("name") == vol for v in volumes):
                empty: dict[str, Any] = {}
                if vol == "substrate-workspace" and disk_bytes:
                    empty["sizeLimit"] = str(disk_bytes)
                volumes.append({"name": vol, "emptyDir": empty})

    # --- GPUs through DRA
    claims = [dict(x) for x in pool.spec.resourceClaims]
    acc = getattr(pool.spec, "accelerators", None)
    if acc:
        claims.append({"name": "accelerators", "resourceClaimTemplateName": dra.claim_template_name(pool.name)})
    if claims:
        existing = {x.get("name") for x in spec.get("resourceClaims") or []}
        spec["resourceClaims"] = [*(spec.get("resourceClaims") or []),
                                  *(x for x in claims if x["name"] not in existing)]
        res = c.setdefault("resources", {})
        wanted = res.setdefault("claims", [])
        have = {x.get("name") for x in wanted}
        wanted += [{"name": x["name"]} for x in claims if x["name"] not in have]
    if gang:
        spec["schedulingGroup"] = {"podGroupName": pool.name}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
