"""The directory's atomic steps against a real Redis (DESIGN invariant 1)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.errors import Conflict
from substrate.models import SessionRecord, SessionState, SnapshotRef, WorkerRecord, WorkerState
from substrate.settings import Settings
from substrate.specs import load_documents


@pytest.fixture
async def directory(directory_url):
    d = Directory(directory_url, f"td{uuid.uuid4().hex[:8]}")
    d.url = directory_url  # type: ignore[attr-defined]
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


async def test_a_commit_adds_the_turns_it_carries_only_if_it_commits(directory):
    """A suspend folds the turns no heartbeat reported into its commit (fresh-user review L12)."""
    await directory.create_session(_rec("t", state=SessionState.SUSPENDING, epoch=2))
    ok, _ = await directory.commit_snapshot("t", epoch=1, ref=_ref("t", 1), states=(SessionState.SUSPENDING,),
                                            to=SessionState.SUSPENDED, add_turns=3)
    assert not ok and (await directory.get_session("t")).turns == 0  # a stale epoch adds nothing
    ok, _ = await directory.commit_snapshot("t", epoch=2, ref=_ref("t", 2), states=(SessionState.SUSPENDING,),
                                            to=SessionState.SUSPENDED, add_turns=3)
    rec = await directory.get_session("t")
    assert ok and rec.turns == 3 and rec.state == SessionState.SUSPENDED
    ok, _ = await directory.commit_snapshot("t", epoch=2, ref=_ref("t", 2, 1), states=(SessionState.SUSPENDED,))
    assert ok and (await directory.get_session("t")).turns == 3  # none carried: unchanged


async def test_commit_keeps_the_previous_snapshot_and_returns_the_dropped_one(directory):
    await directory.create_session(_rec("k", state=SessionState.RUNNING, epoch=1))
    dropped = []
    for n in range(3):
        ok, d = await directory.commit_snapshot("k", epoch=1, ref=_ref("k", 1, n))
        assert ok
        dropped.append(d[0] if d else None)
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


async def test_a_slot_claim_stamps_the_worker_record_and_a_refused_one_does_not(directory):
    """``placedAt`` is written by the claim itself (any router's), never by a refused claim, and a
    worker re-registering (its heartbeat record has no ``placedAt``) does not erase it."""
    now = time.time()
    rec = WorkerRecord(id="w1", pool="default", address="http://x", slots=1, leaseExpiresAt=now + 10, startedAt=now)
    await directory.register_worker(rec)
    assert (await directory.get_worker("w1")).placedAt is None
    assert await directory.claim_slot("w1", "a", now=now - 5) == 0
    assert (await directory.get_worker("w1")).placedAt == now - 5
    assert await directory.claim_slot("w1", "b", now=now) == -1  # full: not a placement
    assert (await directory.get_worker("w1")).placedAt == now - 5
    await directory.register_worker(rec)
    assert [w.placedAt for w in await directory.list_workers()] == [now - 5]


class _FakeWorkers:
    """Stands in for the workers' HTTP API; counts activations per epoch."""

    def __init__(self) -> None:
        self.activations: list[tuple[str, int]] = []

    async def activate(self, address, *, session, epoch, template, slot, env, snapshot, restored=None, tenant="default", answers=None, **_):
        await asyncio.sleep(0.001)
        self.activations.append((session, epoch))
        return {}

    async def healthy(self, address, timeout_s=0.5):
        return True


async def test_two_routers_resuming_one_session_activate_it_once_200_times(directory):
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
        d = Directory(directory.url, directory.keys.prefix)
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


async def test_a_worker_marked_unreachable_is_skipped_until_it_renews_after_the_mark(directory):
    """``WorkerView.mark_unreachable``: a lease renewed before the mark (a heartbeat just before a kill -9,
    read after it) keeps the worker skipped; one renewed after the mark clears it."""
    from substrate.placement import candidates

    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=2,
                                                 leaseExpiresAt=now + 5, startedAt=now))
    view = WorkerView(directory, 60)
    await view.refresh()
    renewed_before = time.time()
    view.mark_unreachable("w1", 5)
    assert candidates(view.workers.values(), "default", exclude=view.unreachable) == []
    assert await directory.heartbeat("w1", renewed_before + 5)  # renewed before the mark, read only now
    await view.refresh()
    assert "w1" in view.unreachable, "a lease from before the mark is no sign of life"
    assert await directory.heartbeat("w1", time.time() + 5 + 1)  # renewed after the mark
    await view.refresh()
    assert "w1" not in view.unreachable
    assert [w.id for w in candidates(view.workers.values(), "default", exclude=view.unreachable)] == ["w1"]
    view.mark_unreachable("gone", 5)
    assert "gone" not in view.unreachable, "a worker not in the view is not marked"


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


async def test_heartbeat_never_recreates_a_deregistered_worker(directory):
    """Regression (issue 8): the heartbeat's EXISTS-then-HSET could recreate a removed worker's record,
    which then lived on unseen; renewal is one script that renews only an existing record."""
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=2,
                                                 leaseExpiresAt=now + 10, startedAt=now))
    await directory.deregister_worker("w1")
    assert not await directory.heartbeat("w1", now + 30, active_slots=1)
    assert not await directory.redis.exists(directory.keys.worker("w1"))
    assert await directory.get_worker("w1") is None
    assert not await directory.set_worker_state("w1", WorkerState.DRAINING)
    assert not await directory.redis.exists(directory.keys.worker("w1")), "a state write creates nothing"


async def test_a_worker_is_removed_only_once_its_lease_expired(directory):
    """Regression (issue 8): one failed probe declared a live worker dead; removal is now conditional on
    lease expiry (plus a grace), atomic with reading its slot table."""
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=2,
                                                 leaseExpiresAt=now + 5, startedAt=now))
    assert await directory.claim_slot("w1", "s1") == 0
    assert await directory.expire_worker("w1", grace_s=1.0, now=now) is None
    assert await directory.expire_worker("w1", grace_s=1.0, now=now + 5.5) is None, "within the grace"
    assert await directory.get_worker("w1") is not None
    assert await directory.expire_worker("w1", grace_s=1.0, now=now + 6.5) == {0: "s1"}
    assert await directory.get_worker("w1") is None and await directory.worker_slots("w1") == {}
    assert not await directory.heartbeat("w1", now + 30), "the expired worker learns it is dead"


async def test_epochs_never_repeat_for_a_reused_session_id(directory):
    """Regression (issue 8): re-creating a deleted ID started again at epoch 1, so a worker still holding
    the old activation took the new one for it."""
    assert await directory.create_session(_rec("again", state=SessionState.RUNNING, epoch=1)) == 1
    for _ in range(3):
        await directory.transition("again", to=SessionState.RUNNING, bump=True)
    await directory.transition("again", to=SessionState.DELETED, bump=True)
    await directory.delete_session("again")
    rec = _rec("again", state=SessionState.STARTING, epoch=1)
    assert await directory.create_session(rec) == 6 and rec.epoch == 6
    assert (await directory.get_session("again")).epoch == 6
    assert 0 < await directory.redis.ttl(directory.keys.session_epoch_floor("again")) <= Directory.epoch_floor_ttl_s


@pytest.mark.parametrize("retention", [1, 2, 4])
async def test_commit_keeps_exactly_retention_snapshots(directory, retention):
    await directory.create_session(_rec("r", state=SessionState.RUNNING, epoch=1))
    dropped: list[str] = []
    refs = []
    for n in range(6):
        ref = _ref("r", 1, n)
        ref.createdAt += n  # strictly increasing
        refs.append(ref)
        ok, d = await directory.commit_snapshot("r", epoch=1, ref=ref, retention=retention)
        assert ok
        dropped += d
    kept = await directory.committed_snapshots("r")
    assert kept == [r.key for r in refs[-retention:]]
    assert dropped == [r.key for r in refs[:-retention]]
    rec = await directory.get_session("r")
    assert rec.snapshot.key == refs[-1].key
    assert (rec.previousSnapshot is None) == (retention == 1)
    await directory.forget_snapshot("r", refs[-1].key)
    assert refs[-1].key not in await directory.committed_snapshots("r")
    await directory.delete_session("r")
    assert await directory.committed_snapshots("r") == []


class _FailingActivate(_FakeWorkers):
    """A worker whose activate fails after ``before_fail`` ran (e.g. the deadline's roll-back)."""

    def __init__(self, before_fail) -> None:  # noqa: ANN001
        super().__init__()
        self.before_fail = before_fail
        self.deactivated: list[tuple[str, int]] = []

    async def activate(self, address, *, session, epoch, **_):  # noqa: ANN001, ANN003
        await self.before_fail(session, epoch)
        from substrate.errors import WorkerUnavailable
        raise WorkerUnavailable("activate timed out")

    async def deactivate(self, address, session, epoch):  # noqa: ANN001
        self.deactivated.append((session, epoch))


@pytest.mark.parametrize("rolled", [False, True])
async def test_a_failed_create_is_undone_unless_its_deadline_already_kept_it(directory, rolled):
    """Chaos run 2026-12-01: the deadline rolled a slow create STARTING -> SUSPENDED, a retried create was
    told 409 session_exists, then the first create's undo deleted the session (the retry's session vanished).
    The undo now deletes only a record still STARTING; a kept one stays SUSPENDED, its slot given back."""
    cat = load_documents([
        {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 1, "slots": 2}},
        {"kind": "ActorTemplate", "metadata": {"name": "counter"},
         "spec": {"entrypoint": "workers.agents.counter:Counter"}}])
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=2,
                                                 leaseExpiresAt=now + 600, startedAt=now))

    async def roll(sid: str, epoch: int) -> None:
        if rolled:  # what the state manager does to a STARTING session past its deadline
            await directory.transition(sid, from_states=[SessionState.STARTING], epoch=epoch,
                                       to=SessionState.SUSPENDED, unset=("worker", "slot"))

    fake = _FailingActivate(roll)
    view = WorkerView(directory, 60)
    await view.refresh()
    act = Activator(Settings(), directory, cat, fake, view)  # type: ignore[arg-type]
    sid = f"undo-{rolled}"
    rec = _rec(sid, state=SessionState.PENDING, epoch=0)
    with pytest.raises(Exception):
        await act.create(rec, cat.template("counter"))
    assert fake.deactivated == [(sid, 1)]
    assert await directory.worker_slots("w1") == {}, "the attempt's slot is given back either way"
    if rolled:
        kept = await directory.get_session(sid)
        assert kept.state == SessionState.SUSPENDED and kept.worker is None
    else:
        from substrate.errors import NotFound
        with pytest.raises(NotFound):
            await directory.get_session(sid)


async def test_a_heartbeat_records_when_its_active_slots_were_counted(directory):
    """``activeSlotsAt`` is the worker's count time of ``activeSlots`` (the activator holds activations
    that became RUNNING after it as in flight); a beat without the count leaves both as they were."""
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=4,
                                                 leaseExpiresAt=now + 10, startedAt=now))
    assert [(w.activeSlots, w.activeSlotsAt) for w in await directory.list_workers()] == [(0, None)]
    assert await directory.heartbeat("w1", now + 10, active_slots=2, counted_at=now + 0.25)
    assert [(w.activeSlots, w.activeSlotsAt) for w in await directory.list_workers()] == [(2, now + 0.25)]
    assert await directory.heartbeat("w1", now + 11, counted_at=now + 1)  # no count: nothing counted then
    assert [(w.activeSlots, w.activeSlotsAt) for w in await directory.list_workers()] == [(2, now + 0.25)]


async def test_warm_slots_reported_by_a_heartbeat_shrink_with_the_claims_made_since(directory):
    """A worker reports ``warmSlots`` (free slots whose host has booted) with its heartbeat; every router
    reads it through ``list_workers`` less the slots claimed since (each claim takes a warm host), never
    below 0 nor above the free slots."""
    now = time.time()
    await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=4,
                                                 leaseExpiresAt=now + 10, startedAt=now, warmSlots=0))
    assert [w.warmSlots for w in await directory.list_workers()] == [0]
    assert await directory.heartbeat("w1", now + 10, warm_slots=3)
    assert [w.warmSlots for w in await directory.list_workers()] == [3]
    assert await directory.claim_slot("w1", "a") >= 0
    assert [w.warmSlots for w in await directory.list_workers()] == [2]
    for sid in ("b", "c", "d"):
        assert await directory.claim_slot("w1", sid) >= 0
    assert [(w.warmSlots, w.freeSlots) for w in await directory.list_workers()] == [(0, 0)]
    assert await directory.heartbeat("w1", now + 10)  # a beat without the figure leaves it
    assert [w.warmSlots for w in await directory.list_workers()] == [0]


async def test_the_registry_read_gives_each_workers_record_and_free_slots_and_skips_a_half_gone_one(directory):
    """``list_workers`` reads the whole registry in one script on a standalone Redis and pipelined per
    worker on a cluster: both give the same records, free-slot counts and index order."""
    now = time.time()
    for wid, slots in (("wa", 4), ("wb", 2), ("wc", 3)):
        await directory.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}",
                                                     slots=slots, leaseExpiresAt=now + 60, startedAt=now))
    assert await directory.claim_slot("wa", "s1") >= 0 and await directory.claim_slot("wa", "s2") >= 0
    assert await directory.claim_slot("wb", "s3") >= 0
    await directory.redis.delete(directory.keys.worker("wc"))  # its index entry outlived its record
    got = {w.id: (w.freeSlots, w.slots, w.address, w.state) for w in await directory.list_workers()}
    assert got == {"wa": (2, 4, "http://wa", WorkerState.READY), "wb": (1, 2, "http://wb", WorkerState.READY)}


async def test_state_counters_stay_exact_through_creates_transitions_refusals_and_deletes(directory):
    """The counters move in the same round trip as a create or a one-state transition, optimistically:
    a refused create or a failed compare-and-set takes its move back."""
    for sid in ("a", "b", "c"):
        await directory.create_session(_rec(sid, SessionState.STARTING))
    with pytest.raises(Conflict):
        await directory.create_session(_rec("a", SessionState.SUSPENDED))  # refused: counts nothing
    assert (await directory.transition("a", from_states=[SessionState.STARTING], to=SessionState.RUNNING)).ok
    assert not (await directory.transition("a", from_states=[SessionState.STARTING], to=SessionState.RUNNING)).ok
    assert not (await directory.transition("gone", from_states=[SessionState.STARTING], to=SessionState.RUNNING)).ok
    assert (await directory.transition("b", from_states=[SessionState.STARTING, SessionState.RUNNING],
                                       to=SessionState.SUSPENDED)).ok  # more than one from-state: after
    assert (await directory.transition("c", to=SessionState.RUNNING)).ok  # no from-state at all
    await directory.delete_session("c")
    counts = await directory.state_counts()
    assert {k: v for k, v in counts.items() if v} == {"RUNNING": 1, "SUSPENDED": 1}, counts


async def test_pipelines_send_no_script_check_and_come_back_after_the_server_lost_its_scripts(monkeypatch):
    """redis-py asks SCRIPT EXISTS before every pipeline that holds a script (a round trip more per create
    and per state transition); the directory loads its scripts once instead. A server that lost them (a
    restart; here SCRIPT FLUSH, on a Redis of this test's own) answers NOSCRIPT: they are loaded again,
    the pipeline runs once more, and nothing is counted twice."""
    from redis.asyncio.client import Pipeline

    from substrate.embedded import EmbeddedRedis

    checks: list[int] = []
    real = Pipeline.load_scripts

    async def counting(self):  # type: ignore[no-untyped-def]
        checks.append(1)
        await real(self)

    monkeypatch.setattr(Pipeline, "load_scripts", counting)
    with EmbeddedRedis() as server:
        directory = Directory(server.url, "flush")
        try:
            await directory.create_session(_rec("a", SessionState.STARTING))
            assert (await directory.transition("a", from_states=[SessionState.STARTING], to=SessionState.RUNNING)).ok
            assert checks == [], "no SCRIPT EXISTS round trip"
            await directory.redis.script_flush()
            await directory.create_session(_rec("b", SessionState.STARTING))
            assert (await directory.transition("b", from_states=[SessionState.STARTING],
                                               to=SessionState.RUNNING)).ok
            await directory.redis.script_flush()
            assert (await directory.transition("a", from_states=[SessionState.RUNNING],
                                               to=SessionState.SUSPENDED)).ok
            await directory.redis.script_flush()
            await directory.delete_session("b")
            assert (await directory.get_session("a")).state == SessionState.SUSPENDED
            counts = await directory.state_counts()
            assert {k: v for k, v in counts.items() if v} == {"SUSPENDED": 1}, counts
        finally:
            await directory.close()


async def test_heartbeats_add_the_workers_loop_lag_to_the_stats_once_also_after_a_lost_script():
    """A worker's heartbeat carries its event-loop lag probes (``LagCounts.fields``) into the directory's
    stats (what /v1/stats shows as ``workerLoopLag``), in the heartbeat's own round trip; a pipeline run
    again after NOSCRIPT (a Redis restart; SCRIPT FLUSH here, on a Redis of this test's own) does not
    count them twice, and a heartbeat of a worker declared dead adds nothing."""
    from substrate.embedded import EmbeddedRedis

    lag = {"workerLoopLagProbes": 3, "workerLoopLagOver5ms": 1, "workerLoopLagOver10ms": 0,
           "workerLoopLagOver25ms": 0}
    with EmbeddedRedis() as server:
        directory = Directory(server.url, "lag")
        try:
            now = time.time()
            await directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://x", slots=2,
                                                         leaseExpiresAt=now + 10, startedAt=now))
            await directory.create_session(_rec("live"))
            assert await directory.heartbeat("w1", now + 20, loop_lag=lag)  # no session touched
            await directory.redis.script_flush()
            assert await directory.heartbeat("w1", now + 20, {"live": now + 5}, {"live": 1}, loop_lag=lag)
            stats = await directory.get_stats()
            assert stats["workerLoopLagProbes"] == 6 and stats["workerLoopLagOver5ms"] == 2, stats
            assert "workerLoopLagOver10ms" not in stats  # nothing to add: not written
            assert (await directory.get_session("live")).turns == 1, "the turns were not counted twice either"
            await directory.deregister_worker("w1")
            assert not await directory.heartbeat("w1", now + 30, loop_lag=lag)
            assert (await directory.get_stats())["workerLoopLagProbes"] == 6
        finally:
            await directory.close()


async def test_session_summaries_page_through_every_record_with_the_fields_of_its_whole_record(directory):
    """``session_summaries`` (one script per page on a standalone Redis, pipelined on a cluster) gives
    the same ID, state, tenant, template, epoch, worker, slot and deadline as the whole record, in
    creation order, page by page; a record gone from under its index entry is left out but still
    advances the offset (a delete takes the entry too), and the last page says so (next offset None)."""
    now = time.time()
    for i in range(7):
        rec = _rec(f"s{i}", SessionState.RUNNING if i % 2 else SessionState.SUSPENDED)
        rec.createdAt = now + i  # the index orders by creation time
        rec.tenant, rec.epoch = f"t{i % 3}", i + 1
        if i % 2:
            rec.worker, rec.slot, rec.stateDeadline = "wa", i, now + 30.5
        await directory.create_session(rec)
    await directory.delete_session("s3")
    await directory.redis.delete(directory.keys.session("s5"))  # its index entry outlived its record
    pages, offset = [], 0
    while offset is not None:
        page, offset = await directory.session_summaries(offset=offset, limit=3)
        pages.append([s.id for s in page])
    assert pages == [["s0", "s1", "s2"], ["s4", "s6"], []], pages  # the second page read s4, s5, s6
    got = {s.id: s for s in (await directory.session_summaries(limit=100))[0]}
    assert (await directory.session_summaries(limit=100))[1] is None
    for full in await directory.get_sessions([f"s{i}" for i in range(7)]):
        s = got.pop(full.id)
        assert (s.state, s.tenant, s.actorTemplate, s.epoch, s.worker, s.slot, s.stateDeadline) == (
            full.state, full.tenant, full.actorTemplate, full.epoch, full.worker, full.slot, full.stateDeadline)
    assert not got, "no summary of a record get_sessions does not give"
    assert [s.id for s in await directory.summaries_of(["s6", "s3", "nope", "s1"])] == ["s6", "s1"]
