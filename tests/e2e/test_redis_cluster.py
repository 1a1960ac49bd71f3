"""The whole runtime on a real local Redis Cluster (three masters started by the tests): the directory's
claim to be cluster-safe (one hash slot per script) holds end to end."""

from __future__ import annotations

import os
import signal


def test_sessions_live_suspend_wake_and_recover_on_a_redis_cluster(runtime_factory, redis_cluster_url):
    rt = runtime_factory(redis_url=redis_cluster_url, replicas=2, slots=4)
    c = rt.client
    s = c.create_session("counter")
    assert s["state"] == "RUNNING"
    for n in range(1, 4):
        assert c.invoke(s["id"], "increment") == {"count": n}
    st = c.suspend(s["id"])
    assert st["state"] == "SUSPENDED" and st["snapshot"] is not None
    r = c.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "increment"})
    assert r.json() == {"output": {"count": 4}} and r.headers["x-substrate-woke"] == "1"
    # a crash: recovered through the lease and the slot tables, on the cluster
    wid = c.get_session(s["id"])["worker"]
    os.kill(int(rt.workers()[wid]["pid"]), signal.SIGKILL)
    r = c.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "get"})
    assert r.status_code == 200 and r.headers["x-substrate-worker"] != wid
    # no periodic snapshots here: it comes back from the suspend's snapshot and says so
    assert r.json() == {"output": {"count": 3}} and r.headers["x-substrate-restored"] == "worker_lost"
    assert len({k.split(":")[1] for k in rt.r.scan_iter(f"{rt.prefix}:*")}) > 2, "keys spread over hash tags"
    c.delete_session(s["id"])
    assert c.http.get(f"/v1/sessions/{s['id']}").status_code == 404
