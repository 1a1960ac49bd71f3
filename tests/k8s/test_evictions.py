"""Pods that go away without the controller asking: an API eviction (delete) and a kubelet eviction
(phase Failed). The pool is made whole again and the sessions come back with their state."""

from __future__ import annotations

from tests.k8s.conftest import NS, Cluster, counter_doc, pool_doc, wait_for


def test_evicted_workers_are_replaced_and_sessions_survive(cluster: Cluster) -> None:
    cluster.apply(pool_doc(replicas=1, slots=4))
    cluster.apply(counter_doc())
    bad = pool_doc(name="typo")
    bad["spec"]["template"]["spec"]["runtimeClass"] = "gvisor"
    cluster.apply(bad)
    cluster.controller()
    cond = wait_for(lambda: ((cluster.pool("typo") or {}).get("status") or {}).get("conditions"), 90, "typo status")
    assert cond[0]["type"] == "Valid" and cond[0]["status"] == "False"
    assert "did you mean runtimeClassName" in cond[0]["message"]
    assert not cluster.pods("typo")
    wait_for(lambda: len(cluster.ready_workers("agents")) == 1, 90, "one worker")
    router = cluster.router()
    s = router.create_session("counter")
    for n in range(1, 4):
        assert router.invoke(s["id"], "increment") == {"count": n}

    # API eviction / node drain: the Pod is deleted by someone else; the worker gets SIGTERM and suspends
    # its sessions (graceful drain); the controller creates a replacement
    (first,) = cluster.ready_workers("agents")
    cluster.core.delete_namespaced_pod(first, NS)
    wait_for(lambda: (lambda ws: len(ws) == 1 and first not in ws)(cluster.ready_workers("agents")), 90,
             "a replacement worker")
    assert router.invoke(s["id"], "increment") == {"count": 4}

    # kubelet eviction: the Pod is marked Failed (the container is gone); the controller deletes it, backs
    # off, then replaces it; the session comes back from its snapshot
    router.suspend(s["id"])
    (second,) = cluster.ready_workers("agents")
    proc = cluster.kubelet.procs[second][0]
    proc.kill()
    wait_for(lambda: (lambda ws: len(ws) == 1 and second not in ws)(cluster.ready_workers("agents")), 90,
             "a replacement after the failure")
    wait_for(lambda: second not in {p["metadata"]["name"] for p in cluster.pods("agents")}, 30, "failed Pod deleted")
    assert router.invoke(s["id"], "increment") == {"count": 5}
    router.close()
