"""What the controller writes back about specs it reads: every ActorTemplate gets a ``Valid`` condition
(True ``Loaded``; False ``InvalidSpec`` with the loader's message, or ``UnknownWorkerPool`` naming the pool,
logged once), written only when it changes; a WorkerPool with a pod template of the wrong shape is
``Valid=False`` naming the field; a pool without ``spec.replicas`` gets the model's default written unless
the built-in autoscaler sizes it (the CRD has no default: it would land on autoscaled pools too)."""

from __future__ import annotations

import time
from typing import Any

from tests.k8s.conftest import GROUP, VERSION, Cluster, counter_doc, pool_doc, wait_for


def _template(c: Cluster, name: str) -> dict[str, Any]:
    return c.custom.get_namespaced_custom_object(GROUP, VERSION, c.ns, "actortemplates", name)


def _valid(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((x for x in conds if x.get("type") == "Valid"), None)


def test_templates_and_pools_get_a_valid_condition(cluster: Cluster) -> None:
    c = cluster
    c.apply(pool_doc(replicas=0))
    both = counter_doc(name="both")
    both["spec"]["command"] = ["python", "-m", "agent"]
    c.apply(both)
    c.apply(counter_doc(pool="nosuchpool", name="t"))
    c.apply(counter_doc(name="good"))
    shape = pool_doc(name="shape", replicas=0)
    shape["spec"]["template"]["spec"]["containers"] = "notalist"
    c.apply(shape)
    plain = pool_doc(name="plain")
    del plain["spec"]["replicas"]
    c.apply(plain)
    auto = pool_doc(name="auto", autoscaling={"minReplicas": 0, "maxReplicas": 2})
    del auto["spec"]["replicas"]
    c.apply(auto)
    c.controller()

    v = wait_for(lambda: _valid(_template(c, "both")), 90, "Valid on the template with both")
    assert (v["status"], v["reason"]) == ("False", "InvalidSpec")
    assert "spec.entrypoint or spec.command, not both" in v["message"]
    assert v["observedGeneration"] == 1 and v["lastTransitionTime"]
    v = wait_for(lambda: _valid(_template(c, "t")), 30, "Valid on the template naming an unknown pool")
    assert (v["status"], v["reason"]) == ("False", "UnknownWorkerPool")
    assert v["message"] == "template 't' names unknown workerPool 'nosuchpool'"
    v = wait_for(lambda: _valid(_template(c, "good")), 30, "Valid on the good template")
    assert (v["status"], v["reason"], v["message"]) == ("True", "Loaded", "spec loaded")

    v = wait_for(lambda: _valid(c.pool("shape")), 30, "Valid on the pool with containers as a string")
    assert v["status"] == "False" and "spec.template.spec.containers: must be a list" in v["message"]

    wait_for(lambda: ((c.pool("plain") or {}).get("spec") or {}).get("replicas") == 2, 30, "replicas defaulted")
    managed = wait_for(lambda: next((x for x in ((c.pool("auto") or {}).get("status") or {}).get("conditions") or []
                                     if x["type"] == "ScalingManaged"), None), 30, "ScalingManaged")
    assert "replicas" not in (c.pool("auto") or {})["spec"]
    assert "spec.replicas" not in managed["message"]

    # written once, not every round: no write while nothing changes (reconcile interval 0.3 s)
    rv = {n: _template(c, n)["metadata"]["resourceVersion"] for n in ("both", "t", "good")}
    time.sleep(2)
    assert {n: _template(c, n)["metadata"]["resourceVersion"] for n in rv} == rv

    # the pool appears: the template is valid again, and the unknown pool was logged once
    c.apply(pool_doc(name="nosuchpool", replicas=0))
    wait_for(lambda: (_valid(_template(c, "t")) or {}).get("status") == "True", 30, "t valid once its pool exists")
    assert c.logs("controller").count("names unknown workerPool 'nosuchpool'") == 1, c.logs("controller")
