"""``/readyz`` by role: ``substrate up`` (it runs the pools) is ready once every pool has the READY
workers it starts with; a router whose pools another process runs (``substrate router``, Kubernetes'
readiness probe) is ready once Redis answers, and names the short pools (fresh-user tester 51: one pool
whose Pods stayed Pending took every router out of its Service)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from api.app import create_app
from substrate.errors import DirectoryUnavailable
from substrate.specs import load_documents

DOCS = [{"kind": "WorkerPool", "metadata": {"name": "cpu"}, "spec": {"replicas": 1, "slots": 2}},
        {"kind": "WorkerPool", "metadata": {"name": "gpu"}, "spec": {"replicas": 2, "slots": 1}},
        {"kind": "WorkerPool", "metadata": {"name": "elastic"},
         "spec": {"slots": 1, "autoscaling": {"minReplicas": 0, "maxReplicas": 3}}},
        {"kind": "ActorTemplate", "metadata": {"name": "counter"},
         "spec": {"entrypoint": "workers.agents.counter:Counter", "workerPool": "cpu"}}]


class _Directory:
    def __init__(self, up: bool = True) -> None:
        self.up = up

    async def ping(self) -> None:
        if not self.up:
            raise DirectoryUnavailable("Redis does not answer")


def _runtime(*, runs_pools: bool, ready_pools: list[str], redis_up: bool = True, fenced: str | None = None) -> Any:
    workers = {f"w{i}": SimpleNamespace(pool=p, state=SimpleNamespace(value="READY"))
               for i, p in enumerate(ready_pools)}
    return SimpleNamespace(directory=_Directory(redis_up), view=SimpleNamespace(workers=workers),
                           catalog=load_documents(DOCS), pools=object() if runs_pools else None,
                           store=SimpleNamespace(fenced=fenced))


async def _readyz(rt: Any) -> httpx.Response:
    app = create_app()
    app.state.runtime = rt
    app.runtime = rt
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        return await c.get("/readyz")


async def test_up_is_not_ready_while_a_pool_lacks_the_workers_it_starts_with() -> None:
    r = await _readyz(_runtime(runs_pools=True, ready_pools=["cpu", "gpu"]))  # gpu starts with 2
    assert r.status_code == 503 and r.json()["code"] == "no_workers" and "gpu" in r.json()["message"], r.text
    r = await _readyz(_runtime(runs_pools=True, ready_pools=["cpu", "gpu", "gpu"]))
    assert r.status_code == 200 and r.json() == {"status": "ready"}, r.text  # elastic may be at zero


@pytest.mark.parametrize("ready", [[], ["cpu"]])
async def test_a_router_is_ready_when_redis_answers_and_names_the_short_pools(ready: list[str]) -> None:
    r = await _readyz(_runtime(runs_pools=False, ready_pools=ready))
    want = ["cpu", "gpu"] if not ready else ["gpu"]
    assert r.status_code == 200 and r.json() == {"status": "ready", "poolsWithoutReadyWorkers": want}, r.text


async def test_a_router_without_redis_is_not_ready() -> None:
    r = await _readyz(_runtime(runs_pools=False, ready_pools=["cpu", "gpu", "gpu"], redis_up=False))
    assert r.status_code == 503 and r.json()["code"] == "directory_unavailable", r.text


@pytest.mark.parametrize("runs_pools", [True, False])
async def test_a_fenced_snapshot_store_leaves_the_api_ready_with_a_warning(runs_pools: bool) -> None:
    """Fresh-user tester 54: every suspend failed on a fenced store while ``/readyz`` said plain "ready".
    Still 200 (warm sessions are served), with a ``warnings`` line saying where to look."""
    r = await _readyz(_runtime(runs_pools=runs_pools, ready_pools=["cpu", "gpu", "gpu"], fenced="marker missing"))
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    assert r.json()["warnings"] == ["the snapshot store is fenced: suspends and wakes that read a snapshot answer "
                                    "503 snapshot_store_unavailable (GET /v1/snapshotstore says why)"]
