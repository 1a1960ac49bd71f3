"""The pool controller creates a pool's missing workers concurrently, up to the backend's
``create_concurrency``, with expectations that stay exact (issue 9: Pod creation was sequential)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from substrate.directory import Directory
from substrate.pool import PoolController
from substrate.settings import Settings
from substrate.specs import load_documents

DOCS = [{"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 20, "slots": 1}}]


class SlowBackend:
    """Each create takes a while; tracks how many run at once; every 5th one fails once."""

    create_concurrency = 4

    def __init__(self) -> None:
        self.created: list[str] = []
        self.now = self.peak = self.attempts = 0

    async def create(self, pool, worker_id):
        self.attempts += 1
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.05)
            if self.attempts % 5 == 0:
                raise RuntimeError("API server said 500")
            self.created.append(worker_id)
        finally:
            self.now -= 1

    async def delete(self, worker_id):
        pass

    def running(self):
        return {w: "default" for w in self.created}

    def reap(self):
        return []

    async def close(self):
        pass


@pytest.fixture
async def d(redis_url):
    d = Directory(redis_url, f"cc{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


async def test_missing_workers_are_created_concurrently_and_bounded_with_exact_expectations(d) -> None:
    b = SlowBackend()
    pc = PoolController(Settings(), d, load_documents(DOCS), b, None)
    await pc.tick()
    assert b.peak == b.create_concurrency  # concurrent, never beyond the bound
    assert len(b.created) == 16 and b.attempts == 20  # 4 failed
    # expectations are exactly the creates that succeeded: the failed ones are made again, no more
    assert set(pc._state["default"].expectations) == set(b.created)
    await pc.tick()
    assert len(b.created) == 20 and len(set(b.created)) == 20
    await pc.tick()
    assert len(b.created) == 20  # none registered yet: still counted as starting, nothing over-created


async def test_a_backend_without_the_attribute_creates_one_at_a_time(d) -> None:
    b = SlowBackend()
    del SlowBackend.create_concurrency
    try:
        pc = PoolController(Settings(), d, load_documents(DOCS[:1]), b, None)
        await pc.tick()
    finally:
        SlowBackend.create_concurrency = 4
    assert b.peak == 1


async def test_scale_up_step_bounds_the_workers_starting_at_once(d) -> None:
    """``pool.scale_up_step``: at most max(step, READY workers) of an autoscaled pool starting; the rest
    wait for those to register (none does here: they stay expectations, so nothing more starts). A fixed
    ``replicas`` is created at once (the test above, with the default step)."""
    from substrate.settings import PoolSettings

    docs = [{"kind": "WorkerPool", "metadata": {"name": "default"},
             "spec": {"slots": 1, "autoscaling": {"minReplicas": 20, "maxReplicas": 20}}}]
    b = SlowBackend()
    b.attempts = 10  # 4 creates at once read 14 after their sleep: none of them fails (every 5th does)
    pc = PoolController(Settings(pool=PoolSettings(scale_up_step=4)), d, load_documents(docs), b, None)
    await pc.tick()
    assert len(b.created) == 4, b.created
    await pc.tick()
    assert len(b.created) == 4, "4 still starting and none READY: no more until they are"
