"""What ``kubectl kustomize deploy/...`` renders: every object validates (Kubernetes 1.37 schemas, strict;
our custom resources against our CRDs and models), Services/PDB/monitors select real Pods/Services, and the
NetworkPolicy admits only router/controller -> worker traffic."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from substrate.models import API_GROUP, ActorTemplate, WorkerPool

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = ["base", "overlays/external-redis", "overlays/s3", "overlays/kind", "monitoring"]
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (apt-get install kubernetes-client)")


def render(path: str) -> list[dict[str, Any]]:
    out = subprocess.run([KUBECTL or "kubectl", "kustomize", str(ROOT / "deploy" / path)], capture_output=True,
                         text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_rendered_objects_validate(path: str) -> None:
    from tests.unit.test_manifests import _schema_errors

    docs = render(path)
    assert docs
    for d in docs:
        group = d["apiVersion"].split("/")[0] if "/" in d["apiVersion"] else ""
        if group == API_GROUP:
            assert _schema_errors(d) == [], d["metadata"]["name"]
            (WorkerPool if d["kind"] == "WorkerPool" else ActorTemplate).model_validate(d)
        elif group == "monitoring.coreos.com":
            continue  # no upstream schema; selectors are checked below
        else:
            kubernetes_validate.validate(d, "1.37", strict=True)


def test_base_wiring() -> None:
    docs = render("overlays/kind")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in by_kind["Deployment"]}
    for svc in by_kind["Service"]:  # every Service selects the Pods of one Deployment
        assert any(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()) for labels in pods.values())
    (pdb,) = by_kind["PodDisruptionBudget"]
    assert _matches(pdb["spec"]["selector"], pods["substrate-router"])
    for dep in ("substrate-router", "substrate-controller"):
        d = next(x for x in by_kind["Deployment"] if x["metadata"]["name"] == dep)
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
        assert c["args"][0] == dep.removeprefix("substrate-")
    ctrl = next(x for x in by_kind["Deployment"] if x["metadata"]["name"] == "substrate-controller")
    assert ctrl["spec"]["replicas"] == 2  # one leads, one stands by
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for ref in (("Secret", "substrate-redis"), ("Secret", "substrate-internal-token"), ("ConfigMap", "substrate-snapshots")):
        assert ref in names


def test_network_policy_admits_only_router_and_controller_to_workers() -> None:
    docs = render("base")
    pols = [d for d in docs if d["kind"] == "NetworkPolicy"]
    deny = next(p for p in pols if p["spec"]["podSelector"] == {})
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    worker_labels = {"app.kubernetes.io/name": "agent-substrate", "app.kubernetes.io/component": "worker"}
    admitted: set[str] = set()
    for p in pols:
        if not _matches(p["spec"]["podSelector"], worker_labels):
            continue
        for rule in p["spec"].get("ingress") or []:
            assert rule.get("from"), "no rule may admit everyone to workers"
            for peer in rule["from"]:
                admitted.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
            assert [x["port"] for x in rule["ports"]] == [8081]
    assert admitted == {"router", "controller"}


def test_monitors_match_real_services_and_worker_pods() -> None:
    from substrate.k8s.pods import build_worker_pod
    from substrate.settings import Settings

    base = render("base")
    mon = render("monitoring")
    services = [d for d in base if d["kind"] == "Service"]
    sm = next(d for d in mon if d["kind"] == "ServiceMonitor")
    selected = [s for s in services if _matches(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in selected} == {"substrate-router", "substrate-controller"}
    for s in selected:
        assert {p["name"] for p in s["spec"]["ports"]} >= {ep["port"] for ep in sm["spec"]["endpoints"]}
    pm = next(d for d in mon if d["kind"] == "PodMonitor")
    pool = WorkerPool.model_validate(next(d for d in base if d["kind"] == "WorkerPool"))
    pod = build_worker_pod(pool, "default-w", Settings())
    assert _matches(pm["spec"]["selector"], pod["metadata"]["labels"])
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {ep["port"] for ep in pm["spec"]["podMetricsEndpoints"]} <= ports


def test_gvisor_component_renders_a_runtime_class(tmp_path: Path) -> None:
    k = tmp_path / "kustomization.yaml"
    k.write_text(yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                 "resources": [os.path.relpath(ROOT / "deploy/base", tmp_path)],
                                 "components": [os.path.relpath(ROOT / "deploy/components/gvisor", tmp_path)]}))
    out = subprocess.run([KUBECTL or "kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone",
                          str(tmp_path)], capture_output=True, text=True, check=True).stdout
    rc = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "RuntimeClass"]
    assert len(rc) == 1 and rc[0]["handler"] == "runsc"
    kubernetes_validate.validate(rc[0], "1.37", strict=True)


def test_the_network_policies_let_prometheus_scrape_every_monitored_port() -> None:
    """Fresh-user round 13: the base's default-deny left no way in to the controller's 8090 or the workers'
    8081 for a Prometheus in another namespace, so the ServiceMonitor's controller target and the
    PodMonitor's worker targets timed out. With deploy/monitoring, a scrape from Prometheus's pods reaches
    every port a monitor names; the workers stay closed to everyone else."""
    from substrate.k8s.pods import build_worker_pod
    from substrate.settings import Settings

    base, mon = render("base"), render("monitoring")
    pols = [d for d in base + mon if d["kind"] == "NetworkPolicy"]
    prom_ns, prom_pod = {"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"}

    def admits(pod_labels: dict[str, str], port: int) -> bool:
        for p in pols:
            if not _matches(p["spec"]["podSelector"], pod_labels):
                continue
            for rule in p["spec"].get("ingress") or []:
                if port not in [x["port"] for x in rule.get("ports") or []]:
                    continue
                peers = rule.get("from")
                if not peers:  # from anywhere
                    return True
                for peer in peers:
                    if _matches(peer.get("namespaceSelector") or {}, prom_ns) and \
                            _matches(peer.get("podSelector") or {}, prom_pod) and "namespaceSelector" in peer:
                        return True
        return False

    deps = {d["metadata"]["name"]: d for d in base if d["kind"] == "Deployment"}
    for name in ("substrate-router", "substrate-controller"):
        tpl = deps[name]["spec"]["template"]
        (port,) = [p["containerPort"] for p in tpl["spec"]["containers"][0]["ports"] if p["name"] == "http"]
        assert admits(tpl["metadata"]["labels"], port), name
    pool = WorkerPool.model_validate(next(d for d in base if d["kind"] == "WorkerPool"))
    pod = build_worker_pod(pool, "default-w", Settings())
    (port,) = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    assert admits(pod["metadata"]["labels"], port)
    # and without deploy/monitoring, a pod outside the namespace still cannot reach a worker
    pols = [d for d in base if d["kind"] == "NetworkPolicy"]
    assert not admits(pod["metadata"]["labels"], port)
