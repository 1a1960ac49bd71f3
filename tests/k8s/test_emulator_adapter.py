"""The thin adapter over kmock's emulator does what the API server does for the parts we rely on, and the
runtime's informer and Lease election work against it in-process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from substrate.k8s.api import Informer, Kube, KubeError
from substrate.k8s.leader import LeaderElector
from tests.k8s.emulator import EmulatedCluster, _matches


@pytest.fixture
def kube() -> Iterator[tuple[EmulatedCluster, Kube]]:
    c = EmulatedCluster().start()
    cfg = client.Configuration()
    cfg.host = c.url
    yield c, Kube(client.ApiClient(cfg))
    c.stop()


def _pod(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]}}


def test_uid_resource_version_generation_and_status_subresource(kube) -> None:
    c, k = kube
    k.custom.create_namespaced_custom_object("substrate.agent.dev", "v1", "ns", "workerpools", {
        "apiVersion": "substrate.agent.dev/v1", "kind": "WorkerPool", "metadata": {"name": "p"},
        "spec": {"replicas": 1}})
    created = k.custom.get_namespaced_custom_object("substrate.agent.dev", "v1", "ns", "workerpools", "p")
    meta = created["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["namespace"] == "ns"
    rv1 = int(meta["resourceVersion"])
    out = k.patch_pool_status("ns", "p", {"replicas": 5})
    assert out["status"] == {"replicas": 5} and out["metadata"]["generation"] == 1
    assert int(out["metadata"]["resourceVersion"]) > rv1
    out = k.patch_pool("ns", "p", {"spec": {"replicas": 3}, "status": {"replicas": 99}})
    assert out["metadata"]["generation"] == 2 and out["status"] == {"replicas": 5}  # status ignored here
    out = k.custom.patch_namespaced_custom_object_scale("substrate.agent.dev", "v1", "ns", "workerpools", "p",
                                                        {"spec": {"replicas": 4}})
    got = k.custom.get_namespaced_custom_object("substrate.agent.dev", "v1", "ns", "workerpools", "p")
    assert got["spec"]["replicas"] == 4 and got["metadata"]["generation"] == 3
    with pytest.raises(KubeError) as e:
        k.patch_pool("ns", "p", {"metadata": {"resourceVersion": str(rv1)}, "spec": {"replicas": 1}})
    assert e.value.status == 409
    assert c.objects("substrate.agent.dev/v1/workerpools")[0]["spec"]["replicas"] == 4


def test_label_selectors_on_list_and_watch(kube) -> None:
    _, k = kube
    for n, pool in (("a", "x"), ("b", "y")):
        k.create_pod("ns", _pod(n, pool=pool))
    assert [p.metadata.name for p in k.core.list_namespaced_pod("ns", label_selector="pool=x").items] == ["a"]
    inf = Informer(k, k.core.list_namespaced_pod, "ns", label_selector="pool=y")
    inf.start()
    assert inf.synced.wait(10)
    k.create_pod("ns", _pod("c", pool="y"))
    k.create_pod("ns", _pod("d", pool="x"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "c" not in inf.items:
        time.sleep(0.02)
    assert set(inf.items) == {"b", "c"}
    k.delete_pod("ns", "c")  # graceful: marked, not removed (the kubelet removes it)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not inf.items["c"]["metadata"].get("deletionTimestamp"):
        time.sleep(0.02)
    assert inf.items["c"]["metadata"]["deletionTimestamp"]
    k.delete_pod("ns", "c", 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "c" in inf.items:
        time.sleep(0.02)
    assert set(inf.items) == {"b"}
    inf.stop()
    assert _matches({"a": "1"}, "a=1,b!=2") and not _matches({"a": "1", "b": "2"}, "a=1,b!=2")


def test_lease_election_one_winner_and_takeover_after_expiry(kube) -> None:
    _, k = kube
    a = LeaderElector(k, "ns", "lease", "a", duration_s=1, renew_s=0.2)
    b = LeaderElector(k, "ns", "lease", "b", duration_s=1, renew_s=0.2)
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False  # held and fresh
    assert a.try_acquire_or_renew() is True  # renew
    time.sleep(1.6)  # a stops renewing: the lease expires
    assert b.try_acquire_or_renew() is True
    assert a.try_acquire_or_renew() is False
    lease = k.get_lease("ns", "lease")
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
    b.release()
    assert a.try_acquire_or_renew() is True  # released: taken at once


def test_stale_resource_version_loses_the_race(kube) -> None:
    """Two candidates read the same expired lease; the second write carries a stale resourceVersion."""
    _, k = kube
    a = LeaderElector(k, "ns", "l2", "a", duration_s=1)
    assert a.try_acquire_or_renew()
    lease = k.get_lease("ns", "l2")
    rv = lease["metadata"]["resourceVersion"]
    k.patch_lease("ns", "l2", {"metadata": {"resourceVersion": rv}, "spec": {"holderIdentity": "b"}})
    with pytest.raises(KubeError) as e:
        k.patch_lease("ns", "l2", {"metadata": {"resourceVersion": rv}, "spec": {"holderIdentity": "c"}})
    assert e.value.status == 409
