"""The state manager's deadline handling, repair pass and orphan sweep, and the activator's failure
handling, against a real Redis with in-memory fakes for workers and object storage (issue 8)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from snapshot.commit import SnapshotManager
from snapshot.state_manager import StateManager
from snapshot.store import MemoryStore, snapshot_key
from substrate.activator import Activator, WorkerView
from tests.integration.fakes import RecordingBackend
from substrate.directory import Directory
from substrate.errors import NoCapacity, NotFound
from substrate.models import SessionRecord, SessionState, SnapshotRef, WorkerRecord
from substrate.settings import Settings
from substrate.specs import load_documents

CATALOG = load_documents([
    {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 1, "slots": 4}},
    {"kind": "ActorTemplate", "metadata": {"name": "counter"},
     "spec": {"entrypoint": "workers.agents.counter:Counter"}}])


class FakeWorkers:
    """The workers' internal API as the control plane sees it: records calls; ``healthy`` is settable."""

    def __init__(self) -> None:
        self.deactivated: list[tuple[str, int | None]] = []
        self.activated: list[tuple[str, int]] = []
        self.is_healthy = True

    async def activate(self, address, *, session, epoch, template, slot, env, snapshot, restored=None, tenant="default", answers=None, **_):
        self.activated.append((session, epoch))
        return {}

    async def deactivate(self, address, session, epoch=None):
        self.deactivated.append((session, epoch))

    async def healthy(self, address, timeout_s=0.5):
        return self.is_healthy

    async def suspend(self, address, session, epoch, *, idle_s=None, wait_s=None, reason="explicit"):
        raise AssertionError("not expected")


@pytest.fixture
async def env(redis_url):
    d = Directory(redis_url, f"sm{uuid.uuid4().hex[:8]}")
    settings = Settings()
    settings.api.slot_wait_s = 0.2
    view = WorkerView(d, 60)
    fake = FakeWorkers()
    act = Activator(settings, d, CATALOG, fake, view)  # type: ignore[arg-type]
    store = MemoryStore()
    sm = StateManager(settings, d, CATALOG, act, store)
    yield d, act, fake, sm, store, settings
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


async def _worker(d: Directory, wid: str, lease_s: float = 60) -> None:
    now = time.time()
    await d.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}", slots=4,
                                         leaseExpiresAt=now + lease_s, startedAt=now))


async def _session(d: Directory, sid: str, state: SessionState, *, worker: str | None = None,
                   deadline_in_s: float | None = None, epoch: int = 3) -> SessionRecord:
    now = time.time()
    slot = None
    if worker is not None:
        slot = await d.claim_slot(worker, sid)
    rec = SessionRecord(id=sid, state=state, actorTemplate="counter", pool="default", epoch=epoch,
                        worker=worker, slot=slot, createdAt=now, updatedAt=now, lastActiveAt=now,
                        stateDeadline=now + deadline_in_s if deadline_in_s is not None else None)
    await d.create_session(rec)
    return rec


async def test_every_transitional_state_past_its_deadline_is_rolled(env):
    d, act, fake, sm, _, _ = env
    await _worker(d, "live")
    await _session(d, "p", SessionState.PENDING, deadline_in_s=-1)
    await _session(d, "st", SessionState.STARTING, worker="live", deadline_in_s=-1)
    await _session(d, "re", SessionState.RESUMING, worker="live", deadline_in_s=-1)
    await _session(d, "su-live", SessionState.SUSPENDING, worker="live", deadline_in_s=-1)
    await _session(d, "su-gone", SessionState.SUSPENDING, worker="gone-worker", deadline_in_s=-1)
    await _session(d, "future", SessionState.RESUMING, worker="live", deadline_in_s=60)
    # a wake of a session whose earlier loss no answer has reported yet
    await _session(d, "re-lossy", SessionState.RESUMING, worker="live", deadline_in_s=-1)
    await d.transition("re-lossy", set={"reason": "worker_lost", "message": "worker w0 was lost"})
    await sm.enforce_deadlines()
    with pytest.raises(NotFound):
        await d.get_session("p")
    rec = await d.get_session("su-gone")  # a suspend cut off: the turns since the snapshot may be gone
    assert rec.state == SessionState.SUSPENDED and rec.reason == "deadline" and rec.worker is None
    for sid in ("st", "re"):  # a start or wake cut off had answered nothing: no loss to report
        rec = await d.get_session(sid)
        assert rec.state == SessionState.SUSPENDED and rec.reason is None and rec.worker is None, sid
    rec = await d.get_session("re-lossy")  # the earlier loss is still to be reported
    assert rec.state == SessionState.SUSPENDED and rec.reason == "worker_lost", rec
    assert rec.message == "worker w0 was lost"
    assert (await d.get_session("su-live")).state == SessionState.RUNNING, "its worker is alive: rolled back"
    assert (await d.get_session("future")).state == SessionState.RESUMING, "not due yet"
    assert sorted(fake.deactivated) == [("re", 3), ("re-lossy", 3), ("st", 3)], "only the fenced epoch is ended"
    assert sorted((await d.worker_slots("live")).values()) == ["future", "su-live"]
    assert await d.expired_deadlines() == []


async def test_a_hanging_orphan_sweep_holds_up_no_deadline(env):
    """Full-suite run: the first scan's orphan sweep listed a frozen object store and hung, and no deadline
    was enforced while it did (the scan awaited it). The sweep now runs beside the scan, one at a time."""
    d, act, fake, sm, store, _ = env
    listed = asyncio.Event()
    release = asyncio.Event()

    async def list_keys_hanging(prefix: str) -> list[str]:
        listed.set()
        await release.wait()
        return []

    store.list_keys = list_keys_hanging  # type: ignore[method-assign]
    await _worker(d, "live")
    await sm.scan_once()  # starts the sweep, which hangs in the store
    await asyncio.wait_for(listed.wait(), 5)
    await _session(d, "re", SessionState.RESUMING, worker="live", deadline_in_s=-1)
    await asyncio.wait_for(sm.scan_once(), 5)  # not held up by the sweep in flight
    rec = await d.get_session("re")
    assert rec.state == SessionState.SUSPENDED and rec.worker is None, "rolled"
    sweep = sm._sweep
    sm._swept_at = 0.0
    await sm.scan_once()
    assert sm._sweep is sweep, "one sweep at a time"
    release.set()
    await asyncio.wait_for(sweep, 5)
    await sm.stop()


async def test_repair_recovers_sessions_of_vanished_workers_and_frees_orphan_slots_in_two_passes(env):
    d, act, fake, sm, _, _ = env
    await _worker(d, "w1")
    await _session(d, "lost", SessionState.RUNNING, worker="vanished")
    await _session(d, "fine", SessionState.RUNNING, worker="w1")
    assert await d.claim_slot("w1", "nobody") >= 0  # a claim whose record write never happened
    # a record past its deadline that is missing from the deadline index
    await _session(d, "unindexed", SessionState.RESUMING, worker="w1", deadline_in_s=-1)
    await d.redis.zrem(d.keys.deadlines, "unindexed")
    await sm.repair()
    lost = await d.get_session("lost")
    assert lost.state == SessionState.SUSPENDED and lost.reason == "worker_lost" and lost.epoch == 4
    assert (await d.get_session("unindexed")).state == SessionState.SUSPENDED
    assert "nobody" in (await d.worker_slots("w1")).values(), "first sighting: kept (a claim in flight)"
    await sm.repair()
    assert sorted((await d.worker_slots("w1")).values()) == ["fine"], "second sighting: freed"
    assert (await d.get_session("fine")).state == SessionState.RUNNING


async def test_repair_passes_are_spaced_by_their_own_length_so_they_take_a_bounded_share(env, monkeypatch):
    """A repair pass reads every session: it runs at every tenth scan, but after a pass of ``t`` seconds
    the next waits ``t * (1 / repair_max_share - 1)`` (a directory too big to read every 10 s is read
    less often instead of keeping the state manager busy). The clock is a fake: each pass "takes" 2 s."""
    d, act, fake, sm, _, settings = env
    settings.state.repair_max_share = 0.2
    clock = [1000.0]
    monkeypatch.setattr("snapshot.state_manager.time.monotonic", lambda: clock[0])
    passes = []

    async def repair() -> None:
        passes.append(clock[0])
        clock[0] += 2.0

    monkeypatch.setattr(sm, "repair", repair)
    assert sm.repair_due_s(2.0) == pytest.approx(8.0)
    async def scan() -> None:
        await sm.scan_once()
        if sm._repair is not None:
            await sm._repair  # it runs beside the scan: wait for it, so the fake clock moves in order
        clock[0] += 1.0

    for _ in range(40):  # scans 1..40, one simulated second apart
        await scan()
    # scan 1 at t=1000 (ends 1002: next not before 1010); scan 11 at 1012, 21 at 1024, 31 at 1036: each
    # tenth scan comes after its due time
    assert passes == [1000.0, 1012.0, 1024.0, 1036.0]
    settings.state.repair_max_share = 0.05
    passes.clear()
    for _ in range(50):  # scans 41..90
        await scan()
    # scan 41 at 1048 runs (ends 1050: next not before 1050 + 2 * 19 = 1088): scans 51, 61, 71 (1060,
    # 1070, 1080) are skipped; scan 81 at 1090 runs
    assert passes == [1048.0, 1090.0], passes


async def test_a_long_repair_pass_holds_up_no_deadline(env, monkeypatch):
    """The repair reads every session (10-11 s at 100,000 sessions before summaries): it runs beside the
    scan, one pass at a time, so deadlines are enforced while a pass is under way."""
    d, act, fake, sm, _, _ = env
    started, release = asyncio.Event(), asyncio.Event()
    passes = []

    async def repair() -> None:
        passes.append(1)
        started.set()
        await release.wait()

    monkeypatch.setattr(sm, "repair", repair)
    await _worker(d, "live")
    await sm.scan_once()  # scan 1 starts a pass, which hangs
    await asyncio.wait_for(started.wait(), 5)
    await _session(d, "re", SessionState.RESUMING, worker="live", deadline_in_s=-1)
    for _ in range(10):  # scans 2..11: the 11th would start a pass, but one is under way
        await asyncio.wait_for(sm.scan_once(), 5)
    rec = await d.get_session("re")
    assert rec.state == SessionState.SUSPENDED and rec.worker is None, "rolled while the pass hung"
    assert passes == [1], "one pass at a time"
    release.set()
    await asyncio.wait_for(sm._repair, 5)  # type: ignore[arg-type]
    await sm.stop()


async def test_a_dead_workers_unanswered_starts_and_wakes_are_recovered_without_a_false_loss(env):
    """A worker that died under a start or a wake (STARTING, RESUMING: no turn had been sent there) lost
    nothing since the snapshot the session came from: its recovery marked them ``worker_lost``, and the
    next answer said ``X-Substrate-Restored: worker_lost``. A loss not yet reported stays."""
    d, act, fake, sm, _, _ = env
    await _session(d, "run", SessionState.RUNNING, worker="vanished")
    await _session(d, "sus", SessionState.SUSPENDING, worker="vanished")
    await _session(d, "st", SessionState.STARTING, worker="vanished")
    await _session(d, "re", SessionState.RESUMING, worker="vanished")
    await _session(d, "re-lossy", SessionState.RESUMING, worker="vanished")
    await d.transition("re-lossy", set={"reason": "agent_restarted", "message": "agent died"})
    for sid in ("run", "sus", "st", "re", "re-lossy"):
        assert await act.recover_session(sid, "vanished", reason="worker_lost"), sid
    reasons = {sid: (await d.get_session(sid)).reason for sid in ("run", "sus", "st", "re", "re-lossy")}
    assert reasons == {"run": "worker_lost", "sus": "worker_lost", "st": None, "re": None,
                       "re-lossy": "agent_restarted"}
    for sid in reasons:
        rec = await d.get_session(sid)
        assert rec.state == SessionState.SUSPENDED and rec.worker is None and rec.epoch == 4, rec
    assert not await act.recover_session("re", "vanished", reason="worker_lost"), "once"


async def test_a_failed_probe_does_not_declare_a_worker_within_its_lease_dead(env):
    """Regression (issue 8): one failed /healthz made the router recover a live worker's sessions."""
    d, act, fake, sm, _, settings = env
    await _worker(d, "w1", lease_s=30)
    await _session(d, "s", SessionState.RUNNING, worker="w1")
    fake.is_healthy = False
    assert not await act.check_worker("w1")
    assert (await d.get_session("s")).state == SessionState.RUNNING
    assert await d.get_worker("w1") is not None
    await sm.recover_dead_workers()
    assert (await d.get_session("s")).worker == "w1"
    # past its lease and the grace: now it is dead, and its session is fenced by a new epoch
    await d.redis.hset(d.keys.worker("w1"), "leaseExpiresAt", repr(time.time() - settings.worker.lease_grace_s - 1))
    await sm.recover_dead_workers()
    rec = await d.get_session("s")
    assert rec.state == SessionState.SUSPENDED and rec.reason == "worker_lost" and rec.epoch == 4
    assert await d.get_worker("w1") is None


async def test_a_lease_that_lapsed_in_a_directory_outage_is_not_death(env):
    """Regression (CI, issue 8): Redis paused 3 s (past a 2 s lease); right after, the router took the
    lapsed lease for death and recovered a live worker's session from its last snapshot (a turn lost).
    A worker cannot renew while Redis is out: it gets one full lease after the outage first."""
    d, act, fake, sm, _, settings = env
    await _worker(d, "w1", lease_s=30)
    await _session(d, "s", SessionState.RUNNING, worker="w1")
    await d.redis.hset(d.keys.worker("w1"), "leaseExpiresAt", repr(time.time() - settings.worker.lease_grace_s - 1))
    d.unavailable_at_m = time.monotonic()  # as _translate records it when a call fails
    await sm.recover_dead_workers()
    assert not await act.check_worker("w1")
    rec = await d.get_session("s")
    assert rec.state == SessionState.RUNNING and rec.worker == "w1" and await d.get_worker("w1") is not None
    # a whole lease (and the grace) after the outage without renewal: now it is dead
    d.unavailable_at_m -= settings.worker.lease_s + settings.worker.lease_grace_s
    await sm.recover_dead_workers()
    rec = await d.get_session("s")
    assert rec.state == SessionState.SUSPENDED and rec.reason == "worker_lost"


async def test_a_failed_directory_call_is_noted_as_an_outage(redis_url):
    d = Directory("redis://127.0.0.1:1/0", prefix=f"t-{uuid.uuid4().hex}", socket_timeout_s=0.2)
    assert not d.unavailable_within(60)
    with pytest.raises(Exception) as e:
        await d.get_worker("w1")
    assert getattr(e.value, "code", None) == "directory_unavailable"
    assert d.unavailable_within(60) and not d.unavailable_within(0)
    await d.close()


async def test_a_lost_activation_is_repaired_only_for_the_current_worker_and_epoch(env):
    d, act, fake, sm, _, _ = env
    await _worker(d, "w1")
    await _session(d, "s", SessionState.RUNNING, worker="w1", epoch=5)
    assert not await act.repair_lost_activation("s", "w1", 4), "an old epoch's answer changes nothing"
    assert not await act.repair_lost_activation("s", "w2", 5), "another worker's answer changes nothing"
    assert (await d.get_session("s")).state == SessionState.RUNNING
    assert await act.repair_lost_activation("s", "w1", 5)
    rec = await d.get_session("s")
    assert rec.state == SessionState.SUSPENDED and rec.reason == "activation_lost" and rec.worker is None
    assert await d.worker_slots("w1") == {}


async def test_placement_waits_for_a_worker_being_started_instead_of_refusing(env):
    """Regression (issue 8): 503 no_capacity while the pool controller was starting a worker."""
    d, act, fake, sm, _, _ = env
    with pytest.raises(NoCapacity):
        await act.place("s1", CATALOG.template("counter"))
    act.starting["default"] = 1

    async def worker_comes_up() -> None:
        await asyncio.sleep(0.5)
        await _worker(d, "late")

    task = asyncio.create_task(worker_comes_up())
    w, slot = await act.place("s1", CATALOG.template("counter"))
    await task
    assert w.id == "late" and slot == 0


async def test_a_placement_pinned_to_a_full_worker_says_so_not_that_the_pool_is_full(env):
    """A resume pinned to a full worker (``{"worker": ...}``) waited and answered "no free slot in pool"
    while the pool's other worker had every slot free (fresh-user run): room is made pool-wide, not on
    one worker. The answer names the worker, what is free elsewhere, and how to get a slot."""
    d, act, *_ = env
    await _worker(d, "full")
    await _worker(d, "roomy")
    for i in range(4):
        assert await d.claim_slot("full", f"held-{i}") >= 0
    await act.view.refresh()
    with pytest.raises(NoCapacity) as e:
        await act.place("s1", CATALOG.template("counter"), worker="full")
    assert "no free slot on worker 'full', which this resume is pinned to (4 free elsewhere" in e.value.message
    assert e.value.details == {"pool": "default", "worker": "full", "freeElsewhere": 4}
    w, _ = await act.place("s1", CATALOG.template("counter"))  # unpinned: placed at once
    assert w.id == "roomy"


async def test_parked_requests_and_slot_waits_are_demand(env):
    """Regression (issue 8): sessions being resumed did not count as demand; two runtimes on one Redis
    picked the same worker IDs."""
    from substrate.pool import PoolController

    d, act, *_ = env

    docs = [{"kind": "WorkerPool", "metadata": {"name": "default"},
             "spec": {"slots": 2, "autoscaling": {"minReplicas": 0, "maxReplicas": 5, "targetUtilization": 100}}},
            {"kind": "ActorTemplate", "metadata": {"name": "counter"},
             "spec": {"entrypoint": "workers.agents.counter:Counter"}}]
    b = RecordingBackend()
    pc = PoolController(Settings(), d, load_documents(docs), b, act)
    other = RecordingBackend()  # a second runtime on the same Redis, ticking in the same second
    act2 = Activator(Settings(), d, CATALOG, FakeWorkers(), WorkerView(d, 60))  # type: ignore[arg-type]
    act2.parked = 3
    act2.parked_by_pool = {"default": 3}  # three sessions parked on their wakes (issue 11's accounting)
    pc2 = PoolController(Settings(), d, load_documents(docs), other, act2)
    await pc.tick()
    assert b.created == []
    act.parked = 3
    act.parked_by_pool = {"default": 3}
    await pc.tick()
    assert len(b.created) == 2 and act.starting["default"] == 2, "3 parked requests want 2 workers of 2 slots"
    assert len({w for w in b.created}) == 2 and all(w.startswith("default-") for w in b.created)
    # regression (issue 8): worker IDs are unique across processes (they were time + a per-process counter)
    await pc2.tick()
    assert len(other.created) == 2 and not set(other.created) & set(b.created)


async def test_objects_in_the_store_after_churn_crashes_and_failed_commits(env, tmp_path: Path):
    """``snapshot.retention`` is honoured and the sweep removes every orphan: after churn, an upload a
    crash left uncommitted, a rejected (zombie) commit, a corrupt snapshot set aside and a deleted
    session, the store holds exactly ``retention`` objects per live session."""
    d, act, fake, sm, store, settings = env
    settings.snapshot.retention = 2
    settings.snapshot.orphan_min_age_s = 10.0
    mgr = SnapshotManager(store, d, settings.snapshot, tmp_path / "tmp")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_text("x")
    live = [f"live-{i}" for i in range(3)]
    for sid in [*live, "doomed", "bad"]:
        await _session(d, sid, SessionState.RUNNING, epoch=1)
        for n in range(5):  # churn: five snapshots each
            ref = await mgr.capture(sid, 1, "counter", ws, {"n": n})
            assert await mgr.commit(sid, 1, ref)
    assert len(store.objects) == 5 * 2, "retention: two kept per session"
    # a crash between upload and commit
    crashed = await mgr.capture("live-0", 1, "counter", ws, {"n": 99})
    # a zombie's commit (epoch moved on) is rejected and deletes its own upload
    await d.transition("live-1", to=SessionState.RUNNING, bump=True)
    zombie = await mgr.capture("live-1", 1, "counter", ws, {"n": 98})
    assert not await mgr.commit("live-1", 1, zombie)
    assert zombie.key not in store.objects
    # a corrupt snapshot is set aside (the session rolls back to its previous one)
    bad = await d.get_session("bad")
    await d.transition("bad", to=SessionState.FAILED, set={"snapshot": bad.previousSnapshot},
                       unset=("previousSnapshot",))
    await d.forget_snapshot("bad", bad.snapshot.key)
    # a deleted session whose snapshot clean-up never ran
    await d.delete_session("doomed")
    # an object of a key shape nobody knows under a live session
    store.objects[snapshot_key(settings.snapshot.prefix, "live-2", 1, 7)] = b"junk"
    # another directory's, whose prefix is nested in this one's (fresh-user round 21): never this sweep's
    prefix = settings.snapshot.prefix.strip("/")
    nested = [f"{prefix}/b/.substrate-store", f"{prefix}/b/b1/000000000001-000001-0123abcd.tar.zst"]
    for key in nested:
        store.objects[key] = b"theirs"
    t0 = time.time()
    assert await sm.sweep_orphans(now=t0) == [], "first sighting: nothing deleted (uploads in flight)"
    assert crashed.key in store.objects
    deleted = await sm.sweep_orphans(now=t0 + settings.snapshot.orphan_min_age_s + 1)
    assert crashed.key in deleted and bad.snapshot.key in deleted
    assert len([k for k in deleted if "/doomed/" in k]) == 2
    kept = [k for sid in [*live, "bad"] for k in await d.committed_snapshots(sid)]
    assert not set(nested) & set(deleted)
    for key in nested:
        del store.objects[key]
    assert sorted(store.objects) == sorted(kept)
    assert len(store.objects) == 3 * 2 + 1
    refs = [await d.get_session(s) for s in live]
    assert all(isinstance(r.snapshot, SnapshotRef) and r.snapshot.key in store.objects for r in refs)


async def test_retention_one_keeps_one_object(env, tmp_path: Path):
    d, act, fake, sm, store, settings = env
    settings.snapshot.retention = 1
    mgr = SnapshotManager(store, d, settings.snapshot, tmp_path / "tmp")
    ws = tmp_path / "ws"
    ws.mkdir()
    await _session(d, "one", SessionState.RUNNING, epoch=1)
    for n in range(4):
        assert await mgr.commit("one", 1, await mgr.capture("one", 1, "counter", ws, {"n": n}))
    rec = await d.get_session("one")
    assert list(store.objects) == [rec.snapshot.key] and rec.previousSnapshot is None


async def test_deleting_a_session_removes_only_its_own_objects_not_a_nested_prefixs(env, tmp_path: Path) -> None:
    """Fresh-user round 22: a session ``b`` of a runtime on prefix ``snapshots`` deleted, with its own
    objects, the whole store of another runtime on ``snapshots/b``, marker included."""
    from snapshot.commit import delete_session_objects

    d, act, fake, sm, store, settings = env
    prefix = settings.snapshot.prefix.strip("/")
    ours = snapshot_key(settings.snapshot.prefix, "b", 1, 1)
    theirs = [f"{prefix}/b/.substrate-store", f"{prefix}/b/t3b-1/000000000001-000001-0123abcd.tar.zst"]
    for key in (ours, *theirs):
        store.objects[key] = b"x"
    assert await delete_session_objects(store, settings.snapshot.prefix, "b", up_to_epoch=None) == 1
    assert ours not in store.objects
    assert all(key in store.objects for key in theirs)


async def test_deleting_a_session_leaves_the_snapshots_of_its_id_made_again(env, tmp_path: Path) -> None:
    """A fresh-user run: a session deleted and made again under the same ID at once took its first
    snapshot before the delete's background GC listed the prefix, and the GC deleted it: the new
    session's wakes met "object missing". The GC takes only epochs up to the deleted session's last
    (epochs never repeat for an ID)."""
    from snapshot.commit import delete_session_objects

    d, act, fake, sm, store, settings = env
    old = [snapshot_key(settings.snapshot.prefix, "x", epoch, 1) for epoch in (3, 7)]
    new = snapshot_key(settings.snapshot.prefix, "x", 8, 1)
    for key in (*old, new):
        store.objects[key] = b"x"
    assert await delete_session_objects(store, settings.snapshot.prefix, "x", up_to_epoch=7) == 2
    assert list(store.objects) == [new]


async def test_a_pending_session_rolled_past_its_deadline_gives_its_places_back_before_its_record(env):
    """Its places go while its record still keeps the ID taken: a create of the same ID right after the
    record is gone takes places that a release coming after the record would have taken from it (the
    same order bug a DELETE had: live sessions ran without their places)."""
    from substrate.models import QuotaLimits
    from substrate.quotas import Quotas
    from substrate.settings import QuotaSettings

    d, act, fake, sm, _, _ = env
    act.quotas = quotas = Quotas(d.redis, d.keys, QuotaSettings(default=QuotaLimits(maxTotal=5)))
    template = CATALOG.template("counter")
    await _session(d, "p", SessionState.PENDING, deadline_in_s=-1)
    await quotas.acquire("default", template, "p", create=True)
    delete = d.delete_session

    async def then_a_create_of_the_same_id(sid: str, **kw: Any) -> None:
        await delete(sid, **kw)
        await quotas.acquire("default", template, sid, create=True)  # the next create of "p" takes its places

    d.delete_session = then_a_create_of_the_same_id  # type: ignore[method-assign]
    await sm.enforce_deadlines()
    usage = await quotas.usage("default")
    assert (usage.total, usage.running) == (1, 1), "the new create's places stay"


async def test_repair_warns_once_of_sessions_whose_template_is_gone(env, caplog):
    """Fresh-user tester 54: a runtime restarted without a template its sessions use said nothing until
    one of them was called (422 ``unknown_template``). The repair pass, which reads every session anyway,
    says which templates and how many sessions, once per change."""
    d, act, fake, sm, _, _ = env
    now = time.time()
    for sid in ("g1", "g2"):
        await d.create_session(SessionRecord(id=sid, state=SessionState.SUSPENDED, actorTemplate="soon-gone",
                                             pool="default", createdAt=now, updatedAt=now, lastActiveAt=now))
    await _session(d, "fine", SessionState.SUSPENDED)
    with caplog.at_level("WARNING", logger="snapshot.state_manager"):
        await sm.repair()
        await sm.repair()
    said = [r.getMessage() for r in caplog.records if "no longer defines" in r.getMessage()]
    assert len(said) == 1 and "'soon-gone' (2)" in said[0] and "counter" not in said[0], said
