"""The seed article's YAML as written: loads with a warning per translated field, refuses what has no
meaning, validates against our CRD schemas after conversion, and runs sessions on an emulated cluster."""

from __future__ import annotations

import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from substrate.specs import SpecError, convert_documents, load_catalog, load_documents
from tests.k8s.conftest import GROUP, VERSION, Cluster, counter_doc, wait_for

SEED = Path(__file__).parent / "seed"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((SEED / name).read_text()) if d]


def test_seed_documents_load_unchanged_with_their_warnings() -> None:
    cat = load_catalog(SEED)
    assert set(cat.pools) == {"coding-agent-pool", "coding-agents"}
    assert set(cat.templates) == {"claude-code-agent"}
    text = "\n".join(cat.warnings)
    for expected in ("apiVersion substrate.agent.google.com/v1 mapped to substrate.agent.dev/v1",
                     "runtimeClass is not a Pod field: did you mean runtimeClassName?",
                     "autoscaling.metrics: the pool is scaled by a HorizontalPodAutoscaler",
                     "spec.replicas (100) is ignored while spec.autoscaling is set",
                     "resourceClaims[agent-gpu].source is the removed v1alpha2 shape",
                     "stateManagement.snapshotStorage is not applied per template",
                     # fresh-user tester 51: accepted and silently not applied, they read as in force
                     "isolation.runtimeClass (gvisor) is not applied per template",
                     "isolation.networkPolicy (default-deny) is not applied per template"):
        assert expected in text, expected
    seed = cat.pools["coding-agents"]
    assert seed.spec.template["spec"]["runtimeClassName"] == "gvisor"
    assert seed.spec.accelerators == {"minMemory": "40Gi", "migProfile": "any", "count": 2}  # 2 GPUs stay 2
    assert cat.pools["coding-agent-pool"].spec.snapshotStorage == "gs://my-bucket/agent-snapshots"


def test_converted_seed_validates_against_our_crds_and_kubernetes() -> None:
    from tests.unit.test_manifests import _schema_errors

    for f in sorted(SEED.glob("*.yaml")):
        docs, warnings = convert_documents(_docs(f.name), f.name)
        assert warnings
        for d in docs:
            if d["apiVersion"].startswith(GROUP):
                assert _schema_errors(d) == [], (f.name, d["metadata"]["name"])
            else:
                kubernetes_validate.validate(d, "1.37", strict=True)
        assert not [d for d in docs if d["apiVersion"].endswith("v1alpha2")]


@pytest.mark.parametrize("doc,message", [
    ({"apiVersion": f"{GROUP}/v1", "kind": "WorkerPool", "metadata": {"name": "p"},
      "spec": {"template": {"spec": {"runtimeClass": "gvisor"}}}}, "did you mean runtimeClassName"),
    ({"apiVersion": "example.com/v1", "kind": "WorkerPool", "metadata": {"name": "p"}}, "apiVersion"),
    ({"apiVersion": f"{GROUP}/v2", "kind": "WorkerPool", "metadata": {"name": "p"}}, "only version v1"),
    ({"apiVersion": f"{GROUP}/v1", "kind": "WorkerPool", "metadata": {"name": "p"}, "spec": {"template": {"spec": {
        "containers": [{"name": "c", "resources": {"limits": {"memory": "8 gigs"}}}]}}}}, "not a Kubernetes quantity"),
    ({"apiVersion": f"{GROUP}/v1", "kind": "WorkerPool", "metadata": {"name": "p"},
      "spec": {"snapshotStorage": "ftp://x/y"}}, "s3://"),
    ({"apiVersion": f"{GROUP}/v1", "kind": "ActorTemplate", "metadata": {"name": "t"},
      "spec": {"entrypoint": "a:B", "isolation": {"maxCpu": "two"}}}, "isolation.maxCpu"),
    ({"apiVersion": f"{GROUP}/v1", "kind": "WorkerPool", "metadata": {"name": "p"},
      "spec": {"accelerators": {"count": 2, "vram": "8Gi"}}}, "vram"),
])
def test_bad_fields_are_refused_naming_them(doc: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        load_documents([doc], "t.yaml")


def test_seed_pool_runs_sessions_on_the_emulated_cluster(cluster_factory) -> None:
    """The seed's 200-replica pool on a node with room for 2 workers: 2 serve, the rest stay Pending and
    Unschedulable (said in a condition, never re-created), the HPA and the claim template exist."""
    c: Cluster = cluster_factory(ns="ai-agents", max_pods=2)
    docs, _ = convert_documents(_docs("section-5-2.yaml"), "seed")
    pool = next(d for d in docs if d["kind"] == "WorkerPool")
    import base64

    c.core.create_namespaced_secret("ai-agents", {"apiVersion": "v1", "kind": "Secret",
                                                  "metadata": {"name": "agent-secrets"},
                                                  "data": {"anthropic-key": base64.b64encode(b"sk-test").decode()}})
    c.apply(pool)
    tpl = counter_doc(pool="coding-agents")
    tpl["metadata"]["namespace"] = "ai-agents"
    c.apply(tpl)
    c.controller()
    wait_for(lambda: len(c.ready_workers("coding-agents")) == 2, 90, "two workers of the seed pool")
    wait_for(lambda: len(c.pods("coding-agents")) == 200, 60,
             f"200 Pods (spec.replicas, HPA mode): {len(c.pods('coding-agents'))}")
    router = c.router()
    s = router.create_session("counter")
    assert router.invoke(s["id"], "increment") == {"count": 1}
    router.suspend(s["id"])
    assert router.invoke(s["id"], "increment") == {"count": 2}
    cond = wait_for(lambda: next((x for x in (c.pool("coding-agents").get("status") or {}).get("conditions", [])
                                  if x["type"] == "PodsSchedulable" and x["status"] == "False"), None),
                    30, "PodsSchedulable=False")
    assert cond["reason"] == "Unschedulable" and "Insufficient" in cond["message"]
    names = {p["metadata"]["name"] for p in c.pods("coding-agents")}
    time.sleep(3)  # several reconcile periods: Pending Pods are kept, not re-created
    assert {p["metadata"]["name"] for p in c.pods("coding-agents")} == names
    rct = c.api.objects("resource.k8s.io/v1/resourceclaimtemplates", "ai-agents")
    assert len(rct) == 1 and rct[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2
    hpas = c.api.objects("autoscaling/v2/horizontalpodautoscalers", "ai-agents")
    assert len(hpas) == 1 and hpas[0]["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    for obj in [*rct, *hpas, *c.pods("coding-agents")[:5]]:
        kubernetes_validate.validate(obj, "1.37", strict=True)

    # GPU memory from DRA: a driver publishes 2 x 40Gi devices, the claim of one serving worker gets both,
    # the kubelet reports the claim on the Pod -> the controller's gauges carry real values
    serving = sorted(c.ready_workers("coding-agents"))[0]
    claim_name = f"{serving}-accelerators"
    c.custom.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "node-a"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                 "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": f"mig-{i}", "capacity": {"memory": {"value": "40Gi"}}} for i in range(2)]}})
    c.custom.create_namespaced_custom_object("resource.k8s.io", "v1", "ai-agents", "resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim_name},
        "spec": {"devices": {"requests": [{"name": "accelerators", "exactly": {"deviceClassName": "mig.nvidia.com",
                                                                                "count": 2}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "accelerators", "driver": "gpu.nvidia.com", "pool": "node-a", "device": f"mig-{i}"}
            for i in range(2)]}}}})
    c.core.patch_namespaced_pod_status(serving, "ai-agents", {"status": {"resourceClaimStatuses": [
        {"name": "accelerators", "resourceClaimName": claim_name}]}})
    import httpx

    from prometheus_client.parser import text_string_to_metric_families

    def gauges() -> dict[str, float]:
        text = httpx.get(c.controller_urls["controller"] + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("agent_substrate_gpu_memory") and s.labels.get("pool") == "coding-agents"}
    wait_for(lambda: gauges().get("agent_substrate_gpu_memory_total") == 80 * (1 << 30), 30, "GPU memory gauge")
    assert gauges()["agent_substrate_gpu_memory_fragmented"] == 0
    router.close()
