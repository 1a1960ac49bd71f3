"""``make bench`` on an emulated Kubernetes cluster (kmock's emulator + our adapter + the test kubelet,
all from ``tests/k8s``; real ``substrate controller``/``router``/``worker`` processes over loopback):

* rollout: time from a WorkerPool pod-template edit to every worker replaced and READY, with turns
  running against all sessions meanwhile; failed turns and lost counts are reported (must be 0);
* failover: two controllers; the leader is SIGKILLed; time until the standby holds the Lease
  (lease duration set to 3 s here; the default is 15 s, so expect up to ~duration + renew period);
* pod creation rate of one controller: a pool scaled 0 -> N on a node with no room (no processes start),
  Pods per second until all N exist in the API (creates run ``SUBSTRATE_KUBERNETES__CREATE_CONCURRENCY``
  at once, 8 by default; set it to 1 for the sequential figure).

What these leave out: the emulator answers in microseconds-to-milliseconds where an API server, the
scheduler and image pulls take seconds; worker start-up here is a local process (~1 s), not a container.
The figures measure the controller's own logic and round trips, not a cluster's.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.k8s.conftest import NS, Cluster, counter_doc, pool_doc, wait_for


def _rollout(c: Cluster, sessions: int = 8) -> list[dict[str, Any]]:
    c.apply(pool_doc(replicas=3, slots=4))
    c.apply(counter_doc())
    c.controller()
    wait_for(lambda: len(c.ready_workers("agents")) == 3, 180, "3 workers")
    router = c.router()
    ids = [router.create_session("counter")["id"] for _ in range(sessions)]
    counts = {sid: 0 for sid in ids}
    turns, failed = [0], [0]
    stop = threading.Event()

    def load(mine: list[str]) -> None:
        from substrate.client import SubstrateClient

        with SubstrateClient(str(router.http.base_url), timeout_s=60) as cl:
            while not stop.is_set():
                for sid in mine:
                    try:
                        out = cl.invoke(sid, "increment")
                        counts[sid] += 1
                        turns[0] += 1
                        if out != {"count": counts[sid]}:
                            failed[0] += 1
                    except Exception:  # noqa: BLE001 - counted
                        failed[0] += 1
    threads = [threading.Thread(target=load, args=(ids[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1)
    old = {p["metadata"]["name"] for p in c.pods("agents")}
    t0 = time.monotonic()
    c.patch_pool("agents", {"spec": {"template": {"metadata": {"labels": {"rev": "2"}}}}})
    wait_for(lambda: (lambda ps: len(ps) == 3 and not ({p["metadata"]["name"] for p in ps} & old))(c.pods("agents"))
             and len(c.ready_workers("agents")) == 3, 600, "rollout")
    took = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(60)
    lost = sum(1 for sid in ids if router.invoke(sid, "get") != {"count": counts[sid]})
    router.close()
    return [{"case": "k8s rollout: template edit -> 3 workers replaced (s)", "n": turns[0], "value": took},
            {"case": "k8s rollout: failed turns / sessions with lost state", "n": turns[0],
             "value": f"{failed[0]} / {lost}"}]


def _failover(c: Cluster) -> list[dict[str, Any]]:
    c.apply(pool_doc(replicas=1, slots=4))
    a, b = c.controller("ca"), c.controller("cb")

    def holder() -> str:
        lease = c.api.objects("coordination.k8s.io/v1/leases", NS)
        return (lease[0]["spec"].get("holderIdentity") or "") if lease else ""
    wait_for(holder, 180, "leader")
    wait_for(lambda: len(c.ready_workers("agents")) == 1, 180, "worker")
    pid = int(holder().rsplit("-", 1)[1])
    standby = b if pid == a.pid else a
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: holder().endswith(f"-{standby.pid}"), 120, "takeover")
    took = time.monotonic() - t0
    t1 = time.monotonic()
    c.custom.patch_namespaced_custom_object_scale("substrate.agent.dev", "v1", NS, "workerpools", "agents",
                                                  {"spec": {"replicas": 2}})
    wait_for(lambda: len(c.pods("agents")) == 2, 120, "new leader acts")
    acted = time.monotonic() - t1
    return [{"case": "k8s failover: leader SIGKILLed -> standby holds the Lease (3 s lease) (s)", "n": 1, "value": took},
            {"case": "k8s failover: then /scale -> Pod created by the new leader (s)", "n": 1, "value": acted}]


def _creation_rate(c: Cluster, n: int = 100) -> list[dict[str, Any]]:
    c.apply(pool_doc(replicas=0, slots=4))
    c.controller()
    wait_for(lambda: (c.pool("agents") or {}).get("status"), 180, "controller running")
    t0 = time.monotonic()
    c.custom.patch_namespaced_custom_object_scale("substrate.agent.dev", "v1", NS, "workerpools", "agents",
                                                  {"spec": {"replicas": n}})
    wait_for(lambda: len(c.pods("agents")) >= n, 300, f"{n} pods")
    took = time.monotonic() - t0
    return [{"case": f"k8s pod creation, one controller, 0 -> {n} Pods (Pods/s)", "n": n, "value": n / took}]


def bench_k8s(redis_url: str) -> list[dict[str, Any]]:
    """All three figures; each on its own emulated cluster."""
    rows: list[dict[str, Any]] = []
    for fn, kw in ((_rollout, {}), (_failover, {}), (_creation_rate, {"max_pods": 0})):
        with tempfile.TemporaryDirectory(prefix="substrate-bench-k8s-") as tmp:
            c = Cluster(Path(tmp), redis_url, **kw)
            try:
                rows += fn(c)
            except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
                rows.append({"case": f"k8s {fn.__name__.strip('_')}: FAILED", "value": repr(e)[:200]})
            finally:
                c.close()
    return rows


if __name__ == "__main__":
    from loadtest.bench_report import markdown_table

    print(markdown_table(bench_k8s(os.environ.get("SUBSTRATE_REDIS_URL", "redis://127.0.0.1:6379/0"))))
