"""End to end on an emulated cluster: WorkerPool -> worker Pods (real ``substrate worker`` processes
started by the test kubelet) -> sessions route, suspend and wake through ``substrate router`` -> a template
edit rolls every worker with no state lost -> /scale -> deleting the pool suspends its sessions first."""

from __future__ import annotations

import threading

from tests.k8s.conftest import Cluster, counter_doc, pool_doc, wait_for

HASH = "substrate.agent.dev/template-hash"


def test_pool_lifecycle_on_the_cluster(cluster: Cluster) -> None:
    cluster.apply(pool_doc(replicas=2, slots=4))
    cluster.apply(counter_doc())
    cluster.controller()
    wait_for(lambda: len(cluster.ready_workers("agents")) == 2, 90, "two READY workers")
    pods = wait_for(lambda: (lambda ps: len(ps) == 2 and all(p.get("status", {}).get("phase") == "Running"
                                                             for p in ps) and ps)(cluster.pods("agents")),
                    30, "pods Running")
    for pod in pods:  # workers are Pods owned by their pool, registered with their Pod IP
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "WorkerPool" and owner["name"] == "agents" and owner["uid"]
        w = cluster.workers()[pod["metadata"]["name"]]
        assert w["address"] == f"http://{pod['status']['podIP']}:8081"
    c = cluster.router()
    s = c.create_session("counter")
    for n in range(1, 4):
        assert c.invoke(s["id"], "increment") == {"count": n}
    assert c.suspend(s["id"])["state"] == "SUSPENDED"
    assert c.invoke(s["id"], "increment") == {"count": 4}  # woke on a worker Pod

    # status through the status subresource, with the /scale selector and stable transition times
    st = wait_for(lambda: (cluster.pool("agents") or {}).get("status", {}).get("readyReplicas") == 2
                  and cluster.pool("agents")["status"], 30, "status written")
    assert st["selector"] == "app.kubernetes.io/component=worker,substrate.agent.dev/pool=agents"
    assert st["observedGeneration"] == cluster.pool("agents")["metadata"]["generation"]
    ready = next(x for x in st["conditions"] if x["type"] == "Ready")
    assert ready["status"] == "True"
    rv = cluster.pool("agents")["metadata"]["resourceVersion"]
    assert "substrate.agent.dev/suspend-sessions" in cluster.pool("agents")["metadata"]["finalizers"]

    # load while the template changes: every turn must succeed and no count may go back
    sessions = [c.create_session("counter")["id"] for _ in range(6)]
    counts = {sid: 0 for sid in sessions}
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:
        from substrate.client import SubstrateClient

        with SubstrateClient(str(c.http.base_url), timeout_s=60) as cc:
            while not stop.is_set():
                for sid in sessions:
                    try:
                        out = cc.invoke(sid, "increment")
                        counts[sid] += 1
                        if out != {"count": counts[sid]}:
                            failures.append(f"{sid}: {out} != {counts[sid]}")
                    except Exception as e:  # noqa: BLE001
                        failures.append(f"{sid}: {e!r}")
    t = threading.Thread(target=load)
    t.start()
    old = {p["metadata"]["name"] for p in cluster.pods("agents")}
    old_hash = {p["metadata"]["labels"][HASH] for p in cluster.pods("agents")}
    cluster.patch_pool("agents", {"spec": {"template": {"metadata": {"labels": {"rev": "2"}}}}})
    wait_for(lambda: (lambda pods: len(pods) == 2 and not ({p["metadata"]["name"] for p in pods} & old)
                      and not ({p["metadata"]["labels"][HASH] for p in pods} & old_hash))(cluster.pods("agents"))
             and len(cluster.ready_workers("agents")) == 2, 120, "every worker replaced")
    stop.set()
    t.join(60)
    assert failures == []
    assert sum(counts.values()) > 0
    for sid in sessions:
        assert c.invoke(sid, "get") == {"count": counts[sid]}
    assert c.invoke(s["id"], "get") == {"count": 4}
    assert cluster.pool("agents")["metadata"]["resourceVersion"] != rv

    # /scale: kubectl scale wp/agents --replicas 3
    cluster.custom.patch_namespaced_custom_object_scale("substrate.agent.dev", "v1", "agent-substrate",
                                                        "workerpools", "agents", {"spec": {"replicas": 3}})
    wait_for(lambda: len(cluster.ready_workers("agents")) == 3, 60, "scaled to 3")
    wait_for(lambda: cluster.pool("agents")["status"]["replicas"] == 3, 30, "status.replicas 3")

    # delete the pool: its sessions are suspended before the object goes
    cluster.custom.delete_namespaced_custom_object("substrate.agent.dev", "v1", "agent-substrate", "workerpools",
                                                   "agents")
    wait_for(lambda: cluster.pool("agents") is None, 90, "pool gone")
    for sid in [s["id"], *sessions]:
        rec = cluster.session(sid)
        assert rec["state"] == "SUSPENDED", (sid, rec.get("state"))
    wait_for(lambda: not cluster.pods("agents"), 30, "pods gone")
    # the pool comes back: sessions wake with their state
    cluster.apply(pool_doc(replicas=1, slots=4))
    wait_for(lambda: len(cluster.ready_workers("agents")) == 1, 60, "pool back")
    assert c.invoke(s["id"], "get") == {"count": 4}
    c.close()
