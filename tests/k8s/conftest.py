"""Fixtures for the Kubernetes tests: an emulated API server (kmock + our adapter) on a real port, the
test kubelet, and ``substrate controller`` / ``substrate router`` as child processes pointed at it."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kubernetes import client

from substrate.client import SubstrateClient
from substrate.keys import Keys
from tests.conftest import ROOT, free_port
from tests.k8s.emulator import EmulatedCluster
from tests.k8s.kubelet import TestKubelet

NS = "agent-substrate"
GROUP, VERSION = "substrate.agent.dev", "v1"


def wait_for(pred: Callable[[], Any], timeout_s: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {str(pred())[:300]})")


class Cluster:
    """An emulated cluster with a kubelet, Secrets for Redis and the internal token, and helpers."""

    def __init__(self, tmp: Path, redis_url: str, ns: str = NS, max_pods: int = 50) -> None:
        self.ns = ns
        self.tmp = tmp
        self.redis_url = redis_url
        self.api = EmulatedCluster().start()
        cfg = client.Configuration()
        cfg.host = self.api.url
        self.client = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.prefix = f"k{uuid.uuid4().hex[:10]}"
        self.keys = Keys(self.prefix)
        self.token = uuid.uuid4().hex
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        for name, key, value in (("substrate-redis", "url", redis_url), ("substrate-internal-token", "token", self.token)):
            self.core.create_namespaced_secret(ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                                                    "data": {key: base64.b64encode(value.encode()).decode()}})
        self.kubelet = TestKubelet(self.api.url, ns, tmp / "node", max_pods=max_pods).start()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.controller_urls: dict[str, str] = {}
        self.env = {**os.environ, "SUBSTRATE_REDIS_URL": redis_url, "SUBSTRATE_REDIS__KEY_PREFIX": self.prefix,
                    "SUBSTRATE_WORKER__INTERNAL_TOKEN": self.token, "SUBSTRATE_KUBERNETES__API_URL": self.api.url,
                    "SUBSTRATE_KUBERNETES__NAMESPACE": ns, "SUBSTRATE_SNAPSHOT__LOCAL_DIR": str(tmp / "snapshots"),
                    "SUBSTRATE_WORKER__HEARTBEAT_S": "0.2", "SUBSTRATE_WORKER__LEASE_S": "2",
                    # dozens of runtimes share 2 cores here: 16 booting agent hosts per worker (the default)
                    # starved heartbeats past the 2 s test lease; tests that need more pre-started set it
                    "SUBSTRATE_WORKER__PRESTART_HOSTS": "4",
                    "SUBSTRATE_STATE__SCAN_INTERVAL_S": "0.2", "SUBSTRATE_POOL__SCALE_DOWN_DELAY_S": "2",
                    "SUBSTRATE_POOL__RECONCILE_INTERVAL_S": "0.3",
                    "SUBSTRATE_KUBERNETES__LEASE_DURATION_S": "3", "SUBSTRATE_KUBERNETES__LEASE_RENEW_S": "0.5",
                    "SUBSTRATE_KUBERNETES__UNSCHEDULABLE_GRACE_S": "0.5",
                    "SUBSTRATE_LOG_LEVEL": "WARNING"}

    # ---------------------------------------------------------------------------- processes
    def start(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{log}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "substrate.cli", *args], env=self.env, cwd=ROOT,
                             stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def controller(self, name: str = "controller") -> subprocess.Popen[bytes]:
        port = free_port()
        self.controller_urls[name] = f"http://127.0.0.1:{port}"
        return self.start("controller", "--host", "127.0.0.1", "--port", str(port), log=name)

    def router(self) -> SubstrateClient:
        port = free_port()
        self.start("router", "--host", "127.0.0.1", "--port", str(port), log="router")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(url + "/healthz"), 60, "router up")
        return SubstrateClient(url, timeout_s=30)

    def logs(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    # ---------------------------------------------------------------------------- API helpers
    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        plural = doc["kind"].lower() + "s"
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, plural, doc)

    def pool(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, "workerpools", name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_pool(self, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, "workerpools", name, body)

    def pods(self, pool: str | None = None) -> list[dict[str, Any]]:
        return [p for p in self.api.objects("v1/pods", self.ns)
                if pool is None or p["metadata"].get("labels", {}).get("substrate.agent.dev/pool") == pool]

    def workers(self, pool: str | None = None) -> dict[str, dict[str, str]]:
        out = {}
        for wid in self.r.zrange(self.keys.workers_index, 0, -1):
            raw = self.r.hgetall(self.keys.worker(wid))
            if raw and (pool is None or raw.get("pool") == pool):
                out[wid] = raw
        return out

    def ready_workers(self, pool: str) -> set[str]:
        return {w for w, raw in self.workers(pool).items() if raw.get("state") == "READY"}

    def session(self, sid: str) -> dict[str, str]:
        return self.r.hgetall(self.keys.session(sid))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.kubelet.stop()
        self.api.stop()
        for key in self.r.scan_iter(f"{self.prefix}:*", count=1000):
            self.r.delete(key)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def cluster(tmp_path: Path, redis_url: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_url)
    yield c
    c.close()


@pytest.fixture
def cluster_factory(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        c = Cluster(tmp_path, redis_url, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def pool_doc(name: str = "agents", replicas: int = 2, slots: int = 4, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WorkerPool", "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": replicas, "slots": slots,
                     "template": {"spec": {"containers": [{"name": "worker", "image": "substrate:test"}],
                                           "terminationGracePeriodSeconds": 20}}, **spec}}


def counter_doc(pool: str = "agents", name: str = "counter") -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ActorTemplate", "metadata": {"name": name, "namespace": NS},
            "spec": {"entrypoint": "workers.agents.counter:Counter", "workerPool": pool,
                     "stateManagement": {"snapshotInterval": "0", "maxIdleTime": "0"}}}
