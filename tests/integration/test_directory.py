"""The directory's atomic steps against a real Redis (DESIGN invariant 1)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.errors import Conflict
from substrate.models import SessionRecord, SessionState, SnapshotRef, WorkerRecord
from substrate.settings import Settings
from substrate.specs import load_documents


@pytest.fixture
async def directory(redis_url):
    d = Directory(redis_url, f"td{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


def _rec(sid: str, state=SessionState.SUSPENDED, epoch: int = 1) -> SessionRecord:
    now = time.time()
    return SessionRecord(id=sid, state=state, actorTemplate="counter", pool="default", epoch=epoch,
                         createdAt=now, updatedAt=now, lastActiveAt=now)


def _ref(sid: str, epoch: int, n: int = 0) -> SnapshotRef:
    return SnapshotRef(key=f"snapshots/{sid}/{epoch:012d}-{n}", epoch=epoch, createdAt=time.time(),
                       sizeBytes=10, sha256="0" * 64)


async def test_create_is_exclusive(directory):
    await directory.create_session(_rec("a"))
    with pytest.raises(Conflict):
        await directory.create_session(_rec("a"))


async def test_only_one_of_many_concurrent_claims_wins(directory):
    await directory.create_session(_rec("s", epoch=4))
    results = await asyncio.gather(*(directory.transition(
        "s", from_states=[SessionState.SUSPENDED], epoch=4, to=SessionState.RESUMING, bump=True)
        for _ in range(50)))
    assert sum(r.ok for r in results) == 1
    assert (await directory.get_session("s")).epoch == 5


async def test_zombie_commit_is_rejected(directory):
    await directory.create_session(_rec("z", state=SessionState.RUNNING, epoch=3))
    ok, _ = await directory.commit_snapshot("z", epoch=3, ref=_ref("z", 3))
    assert ok
    await directory.transition("z", to=SessionState.RESUMING, bump=True)  # a newer activation
    ok, _ = await directory.commit_snapshot("z", epoch=3, ref=_ref("z", 3, 1))
    assert not ok
    assert (await directory.get_session("z")).snapshot.key == _ref("z", 3).key


async def test_commit_keeps_the_previous_snapshot_and_returns_the_dropped_one(directory):
    await directory.create_session(_rec("k", state=SessionState.RUNNING, epoch=1))
    dropped = []
    for n in range(3):
        ok, d = await directory.commit_snapshot("k", epoch=1, ref=_ref("k", 1, n))
        assert ok
        dropped.append(d.key if d else None)
    rec = await directory.get_session("k")
    assert rec.snapshot.key.endswith("-2") and rec.previousSnapshot.key.endswith("-1")
    assert dropped == [None, None, _ref("k", 1, 0).key]


async def test_slot_claims_are_unique_and_idempotent(directory):
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=5,
                                                 leaseExpiresAt=now + 10, startedAt=now))
    slots = await asyncio.gather(*(directory.claim_slot("w1", f"s{i}") for i in range(8)))
    assert sorted(s for s in slots if s >= 0) == [0, 1, 2, 3, 4] and slots.count(-1) == 3
    assert not await directory.release_slot("w1", slots[0], "someone-else")
    assert await directory.release_slot("w1", slots[0], "s0")
    assert await directory.claim_slot("w1", "new") == slots[0]
    assert await directory.claim_slot("nope", "x") == -3


class _FakeWorkers:
    """Stands in for the workers' HTTP API; counts activations per epoch."""

    def __init__(self) -> None:
        self.activations: list[tuple[str, int]] = []

    async def activate(self, address, *, session, epoch, template, slot, env, snapshot, tenant="default"):
        await asyncio.sleep(0.001)
        self.activations.append((session, epoch))
        return {}

    async def healthy(self, address, timeout_s=0.5):
        return True


async def test_two_routers_resuming_one_session_activate_it_once_200_times(directory, redis_url):
    cat = load_documents([
        {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 2, "slots": 4}},
        {"kind": "ActorTemplate", "metadata": {"name": "counter"},
         "spec": {"entrypoint": "workers.agents.counter:Counter"}}])
    now = time.time()
    for wid in ("w1", "w2"):
        await directory.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}", slots=4,
                                                     leaseExpiresAt=now + 600, startedAt=now))
    fake = _FakeWorkers()
    routers = []
    for _ in range(2):  # two routers: separate Directory clients, views and single-flight tables
        d = Directory(redis_url, directory.keys.prefix)
        view = WorkerView(d, 60)
        await view.refresh()
        routers.append(Activator(Settings(), d, cat, fake, view))  # type: ignore[arg-type]
    for i in range(200):
        sid = f"race-{i}"
        await directory.create_session(_rec(sid, epoch=i))
        (r1, _), (r2, _) = await asyncio.gather(routers[0].wake(sid), routers[1].wake(sid))
        assert r1 == r2, "both routers route to the same activation"
        assert [a for a in fake.activations if a[0] == sid] == [(sid, i + 1)]
        rec = await directory.get_session(sid)
        assert rec.state == SessionState.RUNNING and rec.epoch == i + 1
        held = [s for w in ("w1", "w2") for s in (await directory.worker_slots(w)).values() if s == sid]
        assert held == [sid], "exactly one slot"
        await directory.transition(sid, to=SessionState.SUSPENDED, unset=("worker", "slot"))
        await directory.release_slot(rec.worker, rec.slot, sid)
    for r in routers:
        await r.directory.close()


async def test_heartbeat_records_last_activity_without_resurrecting(directory):
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=2,
                                                 leaseExpiresAt=now + 10, startedAt=now))
    await directory.create_session(_rec("live"))
    assert await directory.heartbeat("w1", now + 20, {"live": now + 5, "gone": now + 5})
    assert (await directory.get_session("live")).lastActiveAt == pytest.approx(now + 5)
    assert not await directory.redis.exists(directory.keys.session("gone"))
    await directory.deregister_worker("w1")
    assert not await directory.heartbeat("w1", now + 30), "a deregistered worker learns it is dead"
