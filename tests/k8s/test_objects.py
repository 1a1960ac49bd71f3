"""Every object the controller generates validates against the Kubernetes 1.37 schemas (strict), and the
builders keep what they promise: hardened defaults, owner references, DRA count and selectors, Lease shape."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from substrate.k8s import dra
from substrate.k8s.leader import lease_body
from substrate.k8s.pods import HASH_LABEL, POOL_LABEL, build_worker_pod, selector, template_hash
from substrate.k8s.snapshot_uri import store_env
from substrate.k8s.status import compute, hpa
from substrate.models import WorkerPool, WorkerRecord, WorkerState
from substrate.settings import Settings, SnapshotSettings
from substrate.specs import load_documents

K8S = "1.37"
ROOT = Path(__file__).resolve().parents[2]
SEED = Path(__file__).parent / "seed"


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S, strict=True)


def _pool(spec: dict[str, Any], name: str = "p") -> WorkerPool:
    return WorkerPool.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": "u-1"}, "spec": spec})


def _pools() -> list[WorkerPool]:
    out = [_pool({}), _pool({"replicas": 1, "accelerators": {"count": 2, "minMemory": "40Gi", "gang": True}})]
    for path in [ROOT / "deploy/examples/coding-agent-pool.yaml", *sorted(SEED.glob("*.yaml"))]:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        cat = load_documents(docs, str(path))
        out += [p.model_copy(update={"metadata": p.metadata.model_copy(update={"uid": "u-2"})})
                for p in cat.pools.values()]
    return out


POOLS = _pools()


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_worker_pod_validates_and_is_hardened(pool: WorkerPool) -> None:
    acc = pool.spec.accelerators or {}
    pod = build_worker_pod(pool, f"{pool.name}-w1", Settings(), gang=bool(acc.get("gang")))
    validate(pod)
    spec = pod["spec"]
    assert spec["hostUsers"] is False and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["restartPolicy"] == "Never"
    c = spec["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/substrate", "/tmp"} <= mounts or "/tmp" in mounts
    env = {e["name"]: e for e in c["env"]}
    assert env["SUBSTRATE_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["SUBSTRATE_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["SUBSTRATE_WORKER__INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "substrate-internal-token"
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner == {"apiVersion": "substrate.agent.dev/v1", "kind": "WorkerPool", "name": pool.name,
                     "uid": "u-2" if pool.name not in ("p",) else "u-1", "controller": True,
                     "blockOwnerDeletion": True}
    labels = pod["metadata"]["labels"]
    assert labels[POOL_LABEL] == pool.name and labels[HASH_LABEL] == template_hash(pool)
    assert all(f"{k}={v}" in selector(pool.name).split(",") or k not in ("app.kubernetes.io/component", POOL_LABEL)
               for k, v in labels.items())
    claims = {x["name"] for x in spec.get("resourceClaims", [])}
    assert {x["name"] for x in c.get("resources", {}).get("claims", [])} == claims
    if acc:
        assert "accelerators" in claims
    if acc.get("gang"):
        assert spec["schedulingGroup"] == {"podGroupName": pool.name}
    tpl_rc = ((pool.spec.template or {}).get("spec") or {}).get("runtimeClassName")
    assert spec.get("runtimeClassName") == tpl_rc


def test_template_values_win_and_user_env_is_kept() -> None:
    pool = _pool({"template": {"spec": {"securityContext": {"runAsUser": 2000}, "containers": [
        {"name": "worker", "image": "me/w:1", "command": ["my-worker"],
         "env": [{"name": "SUBSTRATE_LOG_LEVEL", "value": "DEBUG"}]}]}}})
    pod = build_worker_pod(pool, "w", Settings())
    validate(pod)
    c = pod["spec"]["containers"][0]
    assert c["image"] == "me/w:1" and c["command"] == ["my-worker"]
    assert [e["value"] for e in c["env"] if e["name"] == "SUBSTRATE_LOG_LEVEL"] == ["DEBUG"]
    assert pod["spec"]["securityContext"]["runAsUser"] == 2000


def test_template_hash_changes_with_the_pod_template_only() -> None:
    a = _pool({"replicas": 2, "template": {"spec": {"containers": [{"name": "worker", "image": "x:1"}]}}})
    b = _pool({"replicas": 7, "template": {"spec": {"containers": [{"name": "worker", "image": "x:1"}]}}})
    c = _pool({"replicas": 2, "template": {"spec": {"containers": [{"name": "worker", "image": "x:2"}]}}})
    assert template_hash(a) == template_hash(b) != template_hash(c)


def test_claim_template_keeps_count_and_compiles_selectors() -> None:
    acc = {"count": 2, "minMemory": "80Gi", "product": "NVIDIA A100-SXM4-80GB", "architecture": "Ampere",
           "minComputeCapability": "8.0"}
    rct = dra.claim_template("p", "ns", acc, {"apiVersion": "substrate.agent.dev/v1", "kind": "WorkerPool",
                                              "name": "p", "uid": "u", "controller": True})
    validate(rct)
    req = rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert req["count"] == 2 and req["allocationMode"] == "ExactCount" and req["deviceClassName"] == "gpu.nvidia.com"
    exprs = [s["cel"]["expression"] for s in req["selectors"]]
    assert 'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("80Gi")) >= 0' in exprs
    assert 'device.attributes["gpu.nvidia.com"].cudaComputeCapability.compareTo(semver("8.0.0")) >= 0' in exprs
    assert any("productName" in e for e in exprs) and any("architecture" in e for e in exprs)
    mig = dra.claim_template("p", "ns", {"migProfile": "1g.10gb"})
    validate(mig)
    assert mig["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "mig.nvidia.com"


@pytest.mark.parametrize("acc,field", [({"count": 0}, "count"), ({"minMemory": "lots"}, "minMemory"),
                                       ({"gpus": 2}, "gpus"), ({"product": 'x" || true'}, "product"),
                                       ({"minComputeCapability": "eight"}, "minComputeCapability")])
def test_bad_accelerators_are_refused_naming_the_field(acc: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dra.validate_accelerators(acc)


def test_seed_v1alpha2_claim_translates_to_v1_keeping_count() -> None:
    claim = {"apiVersion": "resource.k8s.io/v1alpha2", "kind": "ResourceClaim", "metadata": {"name": "llm"},
             "spec": {"resourceClassName": "nvidia-gpu", "parameters": {
                 "gpuMemory": "80Gi", "computeCapability": "8.0", "multiInstanceGPU": True, "count": 2}}}
    acc, notes = dra.translate_v1alpha2_claim(claim)
    assert acc == {"minMemory": "80Gi", "minComputeCapability": "8.0", "migProfile": "any", "count": 2}
    rct = dra.claim_template("llm", "ns", acc)
    validate(rct)
    assert rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2
    assert any("v1alpha2" in n for n in notes)
    dc = dra.translate_v1alpha2_class({"metadata": {"name": "nvidia-gpu"}, "driverName": "gpu.nvidia.com"})
    validate(dc)
    with pytest.raises(ValueError, match="version"):
        dra.translate_v1alpha2_claim({"spec": {"parameters": {"version": "560"}}})


def test_pod_group_hpa_and_lease_validate() -> None:
    validate(dra.pod_group("p", "ns", 4))
    assert dra.pod_group("p", "ns", 4)["spec"]["schedulingPolicy"]["gang"]["minCount"] == 4
    pool = _pool({"autoscaling": {"minReplicas": 2, "maxReplicas": 9, "metrics": [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}]}})
    h = hpa(pool, "ns")
    validate(h)
    assert h["spec"]["scaleTargetRef"] == {"apiVersion": "substrate.agent.dev/v1", "kind": "WorkerPool", "name": "p"}
    validate(lease_body("ns", "substrate-controller", "me", 15))


def test_snapshot_storage_uris() -> None:
    base = SnapshotSettings(endpoint_url="http://minio:9000")
    assert store_env("s3://bkt/pre/fix", base) == {"SUBSTRATE_SNAPSHOT__STORE": "s3", "SUBSTRATE_SNAPSHOT__BUCKET": "bkt",
                                                 "SUBSTRATE_SNAPSHOT__PREFIX": "pre/fix",
                                                 "SUBSTRATE_SNAPSHOT__ENDPOINT_URL": "http://minio:9000"}
    gs = store_env("gs://my-bucket/agent-snapshots", base)
    assert gs["SUBSTRATE_SNAPSHOT__ENDPOINT_URL"] == "https://storage.googleapis.com"
    with pytest.raises(ValueError, match="s3://"):
        store_env("azure://x/y", base)
    with pytest.raises(ValueError, match="'My_Bucket' is not an S3 bucket name"):  # workers would refuse it
        store_env("s3://My_Bucket/x", base)


def test_condition_transition_time_moves_only_when_status_changes() -> None:
    import time

    pool = _pool({"replicas": 1})
    now = time.time()
    w = WorkerRecord(id="w1", pool="p", address="http://x", slots=4, state=WorkerState.READY,
                     leaseExpiresAt=now + 60, startedAt=now, freeSlots=4)
    raw: dict[str, Any] = {"metadata": {"generation": 3}}
    first = compute(pool, raw, [w], {"w1": {"metadata": {}, "status": {"phase": "Running"}}}, [])
    assert first["observedGeneration"] == 3 and first["selector"] == selector("p")
    old = copy.deepcopy(first)
    for c in old["conditions"]:
        c["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    raw["status"] = old
    w2 = w.model_copy(update={"freeSlots": 3})
    second = compute(pool, raw, [w2], {"w1": {"metadata": {}, "status": {"phase": "Running"}}}, [])
    assert all(c["lastTransitionTime"] == "2020-01-01T00:00:00Z" for c in second["conditions"])
    third = compute(pool, raw, [], {}, [])
    ready = next(c for c in third["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"] != "2020-01-01T00:00:00Z"


def test_scaling_managed_names_spec_replicas_only_when_the_pool_has_one() -> None:
    """The CRD used to default spec.replicas to 2, so an autoscaled pool that never set it was told
    "spec.replicas (2) is not used" (fresh-user review); the default is gone and the message names the
    field only when it is written."""
    auto = {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}

    def managed(spec: dict[str, Any]) -> str:
        st = compute(_pool(spec), {"metadata": {"generation": 1}, "spec": spec}, [], {}, [])
        return next(c["message"] for c in st["conditions"] if c["type"] == "ScalingManaged")

    assert managed(auto) == "spec.autoscaling decides between 1 and 4 workers"
    assert managed({**auto, "replicas": 3}).endswith("; spec.replicas (3) is not used")


def test_the_status_doc_lists_exactly_the_conditions_the_controller_writes() -> None:
    """docs/kubernetes.md listed Ready, PodsSchedulable, PodsHealthy and ScalingManaged, not the Valid
    condition the controller also writes (fresh-user review)."""
    import re

    doc = (ROOT / "docs/kubernetes.md").read_text().split("## Status", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    spec = {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
    written = {c["type"] for c in compute(_pool(spec), {"spec": spec}, [], {}, [])["conditions"]}
    assert listed == written
    for reason in ("Loaded", "InvalidSpec", "UnknownWorkerPool"):  # KubeCatalog.template_valid, both kinds
        assert f"`{reason}`" in doc, reason


def test_the_workerpool_crd_has_no_replicas_default() -> None:
    """A CRD default is added to every pool, autoscaled ones too (where it is unused); the controller
    fills in the model's default instead (``KubePoolController._default_replicas``)."""
    crd = yaml.safe_load((ROOT / "deploy/crds/substrate.agent.dev_workerpools.yaml").read_text())
    replicas = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["replicas"]
    assert "default" not in replicas


def test_gpu_memory_from_claim_allocation_and_resource_slices() -> None:
    from substrate.k8s.gpu import device_memory, pool_gpu_memory

    slice_ = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "node-a-gpu"},
              "spec": {"driver": "gpu.nvidia.com", "pool": {"name": "node-a", "generation": 1,
                                                            "resourceSliceCount": 1},
                       "nodeName": "node-a",
                       "devices": [{"name": f"gpu-{i}", "capacity": {"memory": {"value": "80Gi"}},
                                    "attributes": {"productName": {"string": "A100"}}} for i in range(3)]}}
    validate(slice_)

    def claim(name: str, devices: list[str]) -> dict[str, Any]:
        c = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": "ns"},
             "spec": {"devices": {"requests": [{"name": "accelerators", "exactly": {
                 "deviceClassName": "gpu.nvidia.com", "count": len(devices)}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "accelerators", "driver": "gpu.nvidia.com", "pool": "node-a", "device": d}
                 for d in devices]}}}}
        validate(c)
        return c

    claims = {"w1-accelerators-x": claim("w1-accelerators-x", ["gpu-0", "gpu-1"]),
              "w2-accelerators-y": claim("w2-accelerators-y", ["gpu-2"])}
    pods = {w: {"metadata": {"name": w}, "status": {"resourceClaimStatuses": [
        {"name": "accelerators", "resourceClaimName": c}]}} for w, c in (("w1", "w1-accelerators-x"),
                                                                       ("w2", "w2-accelerators-y"))}
    pods["w3"] = {"metadata": {"name": "w3"}, "status": {}}  # Pending, nothing allocated yet
    gib = 1 << 30
    total, fragmented = pool_gpu_memory(pods, {"w1"}, claims, device_memory([slice_]))
    assert total == 3 * 80 * gib and fragmented == 80 * gib  # w2 holds a GPU but does not serve


def test_template_isolation_bounds_the_worker_pod() -> None:
    from substrate.models import ActorTemplate

    def tpl(name: str, **iso: Any) -> ActorTemplate:
        return ActorTemplate.model_validate({"metadata": {"name": name},
                                             "spec": {"entrypoint": "a:B", "isolation": iso}})

    pool = _pool({"slots": 4})
    pod = build_worker_pod(pool, "w", Settings(), templates=[tpl("a", maxCpu="500m", maxMemory="1Gi", maxDiskBytes="1Gi"),
                                                             tpl("b", maxCpu="2", maxMemory="512Mi", maxDiskBytes="1Mi")])
    validate(pod)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"cpu": "8000m", "memory": str(4 << 30)}
    ws = next(v for v in pod["spec"]["volumes"] if v["name"] == "substrate-workspace")
    assert ws["emptyDir"]["sizeLimit"] == str(4 << 30)
    # one template without a bound leaves the Pod unbounded; the pod template's own limits win
    pod = build_worker_pod(pool, "w", Settings(), templates=[tpl("a", maxCpu="1"), tpl("b", maxCpu=None)])
    assert "cpu" not in pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
    own = _pool({"slots": 2, "template": {"spec": {"containers": [{"name": "worker", "image": "x",
                                                                   "resources": {"limits": {"cpu": "3"}}}]}}})
    pod = build_worker_pod(own, "w", Settings(), templates=[tpl("a", maxCpu="1", maxMemory="1Gi")])
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "3", "memory": str(2 << 30)}
