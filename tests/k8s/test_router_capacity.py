"""A router process and the controller process meet only in Redis (``substrate.demand``): a create that
finds no slot scales an autoscaled pool up from zero (and from full), waits for the Pod the controller
starts until it is Ready and succeeds, not 503; a pool whose next Pod the scheduler refuses answers 503
``no_capacity`` with Retry-After and the scheduler's reason, not after the start wait (issue 9)."""

from __future__ import annotations

import pytest

from substrate.client import ApiError, SubstrateClient
from tests.k8s.conftest import Cluster, counter_doc, pool_doc, wait_for


def test_router_waits_for_pods_started_for_its_demand_and_refuses_fast_when_unschedulable(cluster_factory) -> None:
    c: Cluster = cluster_factory(max_pods=2)  # room for two worker Pods: the third is Unschedulable
    c.env.update({
        # any wait beyond 0.2 s must come from the controller's note that a Pod is starting
        "SUBSTRATE_API__SLOT_WAIT_S": "0.2",
        # far above the client's timeout below: a router that waited for a refused Pod would time out
        "SUBSTRATE_API__START_WAIT_S": "300",
        # sessions stay active demand (not evictable: none is suspended to make room), and the pool does not
        # shrink between the steps
        "SUBSTRATE_WORKER__ACTIVE_WINDOW_S": "600", "SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "600",
        "SUBSTRATE_POOL__SCALE_DOWN_DELAY_S": "600"})
    c.apply(pool_doc(replicas=0, slots=1,
                     autoscaling={"minReplicas": 0, "maxReplicas": 3, "targetUtilization": 100}))
    c.apply(counter_doc())
    c.controller()
    router = c.router()
    # the controller leads and has reconciled the pool (status written): at zero demand, zero Pods
    wait_for(lambda: ((c.pool("agents") or {}).get("status") or {}).get("observedGeneration"), 90, "pool status")
    assert c.pods("agents") == []

    with SubstrateClient(str(router.http.base_url), timeout_s=120) as slow:
        # pool at zero: the create waits for the Pod its demand made the controller create
        s1 = slow.create_session("counter")
        assert s1["state"] == "RUNNING" and c.ready_workers("agents")
        assert slow.invoke(s1["id"], "increment") == {"count": 1}
        # the worker's heartbeat has reported the session as active demand (not an evictable idle slot)
        # (the arrival forecast may already have started a second worker: the count is not asserted)
        wait_for(lambda: s1["worker"] in c.workers("agents")
                 and c.workers("agents")[s1["worker"]].get("activeSlots") == "1", 30, "active slot")
        # pool full (its one slot held): a second Pod is started and waited for
        s2 = slow.create_session("counter")
        assert s2["state"] == "RUNNING" and len(c.ready_workers("agents")) == 2
        assert slow.invoke(s2["id"], "increment") == {"count": 1}
        wait_for(lambda: sorted(w.get("activeSlots") for w in c.workers("agents").values()) == ["1", "1"], 30,
                 "two active slots")
        assert c.session(s1["id"])["state"] == "RUNNING"  # nobody was suspended to make room

    # full again, and the node has no room for a third Pod: 503 with the scheduler's reason, quickly
    with SubstrateClient(str(router.http.base_url), timeout_s=30) as fast:
        with pytest.raises(ApiError) as e:
            fast.create_session("counter")
    assert e.value.status == 503 and e.value.code == "no_capacity" and e.value.retry_after_s
    assert "Unschedulable" in e.value.message and "Insufficient" in e.value.message
    wait_for(lambda: any(((p.get("status") or {}).get("conditions") or [{}])[0].get("reason") == "Unschedulable"
                         for p in c.pods("agents")), 10, "the third Pod Unschedulable")
    router.close()
