"""A gang pool's PodGroup follows the pool as it scales: ``schedulingPolicy.gang.minCount`` is the pool's
desired worker count after every ``/scale`` (issue 9: it stayed at the count the pool was created with), and
Pods that never registered are removed when the pool is scaled below them (they stayed Pending for good)."""

from __future__ import annotations

import kubernetes_validate

from tests.k8s.conftest import GROUP, NS, VERSION, Cluster, pool_doc, wait_for


def _min_count(c: Cluster) -> int | None:
    groups = c.api.objects("scheduling.k8s.io/v1beta1/podgroups", NS)
    return groups[0]["spec"]["schedulingPolicy"]["gang"]["minCount"] if groups else None


def test_pod_group_min_count_follows_scale(cluster_factory) -> None:
    c: Cluster = cluster_factory(max_pods=0)  # no node room: Pods stay Pending, no worker process starts
    c.apply(pool_doc(name="gpus", replicas=2, slots=1, accelerators={"count": 1, "gang": True}))
    c.controller()
    wait_for(lambda: len(c.pods("gpus")) == 2, 90, "two Pods")
    assert wait_for(lambda: _min_count(c) == 2 and 2, 30, "minCount 2")
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "gpus"} for p in c.pods("gpus"))
    for replicas in (4, 1):
        c.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NS, "workerpools", "gpus",
                                                      {"spec": {"replicas": replicas}})
        wait_for(lambda: _min_count(c) == replicas, 30, f"minCount {replicas}")
        # and the Pods follow, also down: Pods that never registered (Pending here) beyond the count go
        wait_for(lambda: len([p for p in c.pods("gpus") if not p["metadata"].get("deletionTimestamp")]) == replicas,
                 30, f"{replicas} Pods")
    group = c.api.objects("scheduling.k8s.io/v1beta1/podgroups", NS)[0]
    kubernetes_validate.validate(group, "1.37", strict=True)
    assert len(c.api.objects("scheduling.k8s.io/v1beta1/podgroups", NS)) == 1
