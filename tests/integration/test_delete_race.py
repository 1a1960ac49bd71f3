"""Two concurrent DELETEs of one session (a fresh-user run: both answered 204). DELETE is not idempotent
here (README: a DELETE of a session that is gone is 404 ``session_not_found``), so of two racing ones
exactly one deletes and the other is told 404, whichever order their steps interleave in: against a real
Redis, two activators (two routers) and an in-memory fake of the workers' internal API."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from substrate.activator import Activator, WorkerView
from substrate.audit import AuditLog
from substrate.directory import Directory
from substrate.errors import NotFound
from substrate.models import SessionRecord, SessionState, WorkerRecord
from substrate.settings import Settings
from tests.integration.test_audit_once import CATALOG


async def _suspended_session(d: Directory) -> "SnapshotRef":
    """Worker ``w1`` and session ``s1`` SUSPENDED at epoch 1 with a snapshot; returns that snapshot."""
    from substrate.models import SnapshotRef

    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 60, startedAt=now))
    ref = SnapshotRef(key="snapshots/s1/000000000001-x.tar.zst", sha256="0" * 64, sizeBytes=10, epoch=1,
                      createdAt=now)
    await d.create_session(SessionRecord(id="s1", state=SessionState.SUSPENDED, actorTemplate="counter",
                                         pool="default", tenant="team-a", epoch=1, snapshot=ref,
                                         createdAt=now, updatedAt=now, lastActiveAt=now))
    return ref


class Workers:
    def __init__(self) -> None:
        self.deactivated: list[tuple[str, int | None]] = []

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        self.deactivated.append((session, epoch))


async def _routers(d: Directory, workers: Workers, settings: Settings, audit: AuditLog, n: int = 2) -> list[Activator]:
    """``n`` activators (routers) over one directory and one fake of the workers' internal API."""
    out = []
    for _ in range(n):
        view = WorkerView(d, 60)
        await view.refresh()
        out.append(Activator(settings, d, CATALOG, workers, view, audit=audit))  # type: ignore[arg-type]
    return out


async def _running_session(d: Directory) -> None:
    """Worker ``w1`` and session ``s1`` RUNNING on one of its slots, epoch 2."""
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 60, startedAt=now))
    slot = await d.claim_slot("w1", "s1")
    await d.create_session(SessionRecord(id="s1", state=SessionState.RUNNING, actorTemplate="counter",
                                         pool="default", tenant="team-a", epoch=2, worker="w1", slot=slot,
                                         createdAt=now, updatedAt=now, lastActiveAt=now))


async def test_of_two_concurrent_deletes_one_deletes_and_the_other_is_404(directory: Directory) -> None:
    """Both deletes read the record RUNNING before either marks it DELETED (the window the fresh-user run
    hit): the second one's move to DELETED must fail, not bump the epoch again, deactivate again and
    release the slot and quota a second time."""
    d = directory
    await _running_session(d)
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    workers = Workers()
    routers = await _routers(d, workers, settings, audit)
    read = d.get_session
    both_read = asyncio.Barrier(2)
    reads = 0

    async def read_then_wait_for_the_other(sid: str) -> SessionRecord:
        nonlocal reads
        rec = await read(sid)
        reads += 1
        if reads <= 2:  # each delete's first read: both see the record before either marks it
            await both_read.wait()
        return rec

    d.get_session = read_then_wait_for_the_other  # type: ignore[method-assign]
    results: list[Any] = await asyncio.wait_for(
        asyncio.gather(*(r.delete("s1") for r in routers), return_exceptions=True), 10)
    d.get_session = read  # type: ignore[method-assign]
    assert sorted(type(x).__name__ for x in results) == ["NoneType", "NotFound"], results
    lost = next(x for x in results if isinstance(x, NotFound))
    assert lost.code == "session_not_found" and lost.status == 404
    assert workers.deactivated == [("s1", 3)], "one delete, one deactivation, one epoch bump"
    with pytest.raises(NotFound):
        await d.get_session("s1")
    assert await d.redis.hgetall(d.keys.worker_slots("w1")) == {}, "the slot is free"


@pytest.mark.parametrize("failure", ["corrupt", "missing_in_grace", "missing_made_again"])
async def test_a_wake_whose_snapshot_the_delete_removed_is_404_not_a_corrupt_snapshot(directory: Directory,
                                                                                     failure: str) -> None:
    """A fresh-user race: resume (or invoke) a suspended session and DELETE it 0-30 ms later; the delete
    answered 204 and removed the snapshot while the worker restored it, and the wake answered 500
    ``snapshot_corrupt`` "object ... is missing", recorded a corrupt snapshot after the delete and counted
    a failure against the tenant. It is the 404 ``session_not_found`` any call after a delete gets. The
    same once the store keeps a missing object in its grace (a later fresh-user run: 503
    ``snapshot_store_unavailable`` "object missing", 14 of 200 races, counted as a store outage), and when
    the ID already names a new session made since (same run: create/delete/suspend/invoke on six IDs)."""
    from substrate.errors import SnapshotCorrupt, StoreUnavailable

    d = directory
    ref = await _suspended_session(d)
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    view = WorkerView(d, 60)
    await view.refresh()

    activations: list[asyncio.Task[Any]] = []

    class Restoring(Workers):
        async def activate(self, address: str, *, session: str, epoch: int, **_: Any) -> dict[str, Any]:
            activations.append(asyncio.current_task())  # type: ignore[arg-type]
            await router.delete(session)  # the DELETE lands mid-restore; its GC removes the object
            if failure == "missing_made_again":  # and a create of the same ID lands before the restore fails
                await asyncio.sleep(0.01)
                now = time.time()
                await d.create_session(SessionRecord(id="s1", state=SessionState.RUNNING, actorTemplate="counter",
                                                     pool="default", tenant="team-a", epoch=1, createdAt=now,
                                                     updatedAt=now, lastActiveAt=now))
            if failure == "corrupt":
                raise SnapshotCorrupt(f"snapshot object {ref.key!r} is missing", details={"reason": "missing"})
            raise StoreUnavailable(f"snapshot object {ref.key!r} is missing", retry_after_s=10,
                                   details={"reason": "object_missing", "key": ref.key})

    workers = Restoring()
    router = Activator(settings, d, CATALOG, workers, view, audit=audit)  # type: ignore[arg-type]
    with pytest.raises(NotFound) as e:
        await router.wake("s1")
    assert e.value.code == "session_not_found" and e.value.status == 404
    # the delete answers the waiting wake at once; the restore fails after it, in the wake's own task:
    # what it leaves is checked once that task and its repairs have ended
    await asyncio.wait(activations)
    await asyncio.gather(*router._repairs, return_exceptions=True)
    if failure == "missing_made_again":  # the new session of the same ID is left as its create made it
        made = await d.get_session("s1")  # (its epoch starts above the deleted one's last)
        assert made.state == SessionState.RUNNING and made.snapshot is None and not made.reason, made
    else:
        with pytest.raises(NotFound):
            await d.get_session("s1")
    # no wake record (the API records the delete itself; the wake that lost to it leaves none)
    assert [ev["action"] for ev in (await audit.session_events("s1"))[0]] == []
    assert await d.redis.hgetall(d.keys.worker_slots("w1")) == {}, "the slot is free"
    router.breaker.check("team-a", "counter")  # no failure counted against the tenant


class SlowDeactivate:
    """Deactivate takes a while, as a worker ending a busy activation does."""

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        await asyncio.sleep(0.3)


async def test_losers_of_concurrent_deletes_are_recorded_after_the_winner(directory: Directory) -> None:
    """The losers answer 404 only after the winner's success is on record (fresh-user run: the trail held
    ``delete session_not_found`` records before the winner's ``delete ok``, in 6 of 6 runs)."""
    d = directory
    await _running_session(d)
    view = WorkerView(d, 60)
    await view.refresh()
    act = Activator(Settings(), d, CATALOG, SlowDeactivate(), view)  # type: ignore[arg-type]
    trail: list[str] = []

    async def ok() -> None:
        trail.append("ok")

    async def one(i: int) -> None:
        await asyncio.sleep(0.01 * i)  # the first one wins; the others meet its delete under way
        try:
            await act.delete("s1", before_removal=ok)
        except NotFound as e:
            trail.append(e.code)

    await asyncio.gather(*(one(i) for i in range(6)))
    assert trail == ["ok"] + ["session_not_found"] * 5, trail
    assert not await d.redis.exists(d.keys.session("s1"))


async def test_a_suspend_that_loses_to_a_delete_is_404_after_the_delete_is_on_record(directory: Directory) -> None:
    """A fresh-user run (4 of 4): a turn running, a suspend waiting for it, then a DELETE; the suspend's
    ``session_not_found`` was recorded before the delete's ``ok``. It is now answered (and so recorded by
    the API) only once the record is gone, after the delete's own record, as a losing delete is."""
    from substrate.errors import SubstrateError

    d = directory
    await _running_session(d)
    view = WorkerView(d, 60)
    await view.refresh()
    trail: list[str] = []
    suspending = asyncio.Event()

    class BusyWorker(SlowDeactivate):
        async def suspend(self, address: str, session: str, epoch: int, **_: Any) -> None:
            suspending.set()  # waits for the running turn; the delete ends the activation under it
            await asyncio.sleep(0.1)
            raise SubstrateError("no such activation", code="not_active")

    act = Activator(Settings(), d, CATALOG, BusyWorker(), view)  # type: ignore[arg-type]

    async def ok() -> None:
        trail.append("delete ok")

    async def suspend() -> None:
        try:
            await act.suspend_explicit(await d.get_session("s1"))
        except NotFound as e:
            trail.append(f"suspend {e.code}")

    async def delete() -> None:
        await suspending.wait()
        await act.delete("s1", before_removal=ok)

    await asyncio.wait_for(asyncio.gather(suspend(), delete()), 10)
    assert trail == ["delete ok", "suspend session_not_found"], trail


async def test_a_wake_that_loses_its_compare_and_set_to_a_delete_is_404_with_no_record(directory: Directory) -> None:
    """Fresh-user round 10 (4 of 8 races of invokes and a DELETE on a SUSPENDED session): the wake read
    the record SUSPENDED, the delete marked it DELETED, the wake's compare-and-set failed and was
    recorded ``wake conflict`` while its client was told 404. It now loses as any call after a delete
    does: 404 ``session_not_found``, no record of its own, answered once the delete is done."""
    d = directory
    ref = await _suspended_session(d)
    stale = await d.get_session("s1")
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    view = WorkerView(d, 60)
    await view.refresh()
    router = Activator(settings, d, CATALOG, Workers(), view, audit=audit)  # type: ignore[arg-type]
    cas = await d.transition("s1", to=SessionState.DELETED, bump=True)  # the delete's first step
    assert cas.ok
    trail: list[str] = []

    async def finish_delete() -> None:
        await asyncio.sleep(0.2)
        trail.append("removed")
        await d.delete_session("s1")

    remover = asyncio.create_task(finish_delete())
    with pytest.raises(NotFound) as e:
        await router._resume(stale, None, "wake")  # the wake that read the record just before
    assert e.value.code == "session_not_found"
    assert [(ev["action"], ev["result"]) for ev in (await audit.session_events("s1"))[0]] == [], "no wake conflict record"
    with pytest.raises(NotFound):
        await router.wake_retrying("s1", audit_action="wake")
    assert trail == ["removed"], "answered only once the delete was done"
    await remover
    assert await d.redis.hgetall(d.keys.worker_slots("w1")) == {}, "the slot is free"


async def test_a_wake_that_waited_for_a_slot_in_vain_while_a_delete_went_through_leaves_no_record(
        directory: Directory) -> None:
    """Tester 34: a wake waiting for a slot while a DELETE went through ended ``no_capacity``, and the trail
    read "delete ok" then "wake no_capacity". Whatever a wake fails with, if the session is gone or being
    deleted by then, it lost to the delete: 404 ``session_not_found``, no record of its own. The same
    failure on a session that lives is recorded and answered as it is."""
    from substrate.errors import NoCapacity

    d = directory
    await _suspended_session(d)
    stale = await d.get_session("s1")
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    (router,) = await _routers(d, Workers(), settings, audit, n=1)
    deleting = False

    async def no_slot(rec: SessionRecord, pin: str | None) -> Any:
        if deleting:  # the delete goes through while the wake waits
            assert (await d.transition("s1", to=SessionState.DELETED, bump=True)).ok
            await d.delete_session("s1")
        raise NoCapacity("no free slot in pool 'default'")

    router._resume_held = no_slot  # type: ignore[method-assign]

    async def trail() -> list[tuple[str, str]]:
        return [(ev["action"], ev["result"]) for ev in (await audit.session_events("s1"))[0]]

    with pytest.raises(NoCapacity):
        await router._resume(stale, None, "wake")
    assert await trail() == [("wake", "no_capacity")]
    deleting = True
    with pytest.raises(NotFound) as e:
        await router._resume(stale, None, "wake")
    assert e.value.code == "session_not_found"
    assert await trail() == [("wake", "no_capacity")], "no record after the delete's"


async def test_a_create_whose_session_a_delete_removed_while_it_started_is_410_session_deleted(
        directory: Directory) -> None:
    """Fresh-user round 12: a create racing a DELETE of the same ID answered 409 ``conflict`` ("changed
    while starting") while the DELETE answered 204. The session it made is gone: 410 ``session_deleted``,
    as a turn the delete stopped is told, and the tenant's breaker does not count it."""
    from substrate.errors import SessionDeleted

    d = directory
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 60, startedAt=now))
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    deleted: list[Any] = []

    class Starting(Workers):
        """The worker's activation is where the DELETE comes in: by another router, while STARTING."""

        async def activate(self, address: str, **kw: Any) -> None:
            deleted.append(await other.delete(kw["session"]))
            for _ in range(200):  # the delete has marked or removed the record
                try:
                    if (await d.get_session(kw["session"])).state == SessionState.DELETED:
                        break
                except NotFound:
                    break
                await asyncio.sleep(0.01)

    workers = Starting()
    routers = await _routers(d, workers, settings, audit)
    creator, other = routers
    rec = SessionRecord(id="c1", state=SessionState.PENDING, actorTemplate="counter", pool="default",
                        tenant="team-a", createdAt=now, updatedAt=now, lastActiveAt=now)
    with pytest.raises(SessionDeleted) as e:
        await asyncio.wait_for(creator.create(rec, CATALOG.template("counter")), 10)
    assert (e.value.status, e.value.code) == (410, "session_deleted") and deleted == [None], deleted
    assert not creator.breaker._failures.get(("team-a", "counter")), "not counted against the tenant"
    with pytest.raises(NotFound):
        await d.get_session("c1")
    assert await d.redis.hgetall(d.keys.worker_slots("w1")) == {}, "the slot is free"


async def test_a_delete_hands_its_snapshot_gc_the_last_epoch_of_the_session(directory: Directory) -> None:
    """The background GC of a deleted session takes only objects up to its last epoch (a session made
    again under the ID at once starts above it: ``snapshot.commit.delete_session_objects``)."""
    d = directory
    await _suspended_session(d)
    settings = Settings()
    router = (await _routers(d, Workers(), settings, AuditLog(d.redis, d.keys, settings.audit), n=1))[0]
    asked: list[tuple[str, int]] = []

    async def gc(sid: str, up_to_epoch: int) -> None:
        asked.append((sid, up_to_epoch))

    await router.delete("s1", snapshot_gc=gc)
    await asyncio.sleep(0)  # the GC runs in a task of its own
    await asyncio.sleep(0)
    assert asked == [("s1", 2)]  # epoch 1, bumped once by the move to DELETED
    await d.create_session(SessionRecord(id="s1", state=SessionState.RUNNING, actorTemplate="counter",
                                         pool="default", epoch=1, createdAt=time.time(), updatedAt=time.time(),
                                         lastActiveAt=time.time()))
    assert (await d.get_session("s1")).epoch > asked[0][1], "the ID made again starts above what the GC takes"


class _HeldActivation(Workers):
    """A worker whose activation of a wake is held (a slow restore and agent start) until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def activate(self, address: str, *, session: str, epoch: int, **_: Any) -> dict[str, Any]:
        self.entered.set()
        await self.go.wait()
        return {"session": session, "epoch": epoch, "restored": True, "worker": "w1"}


async def test_turns_parked_on_a_wake_hear_of_this_routers_delete_at_once(directory: Directory) -> None:
    """A fresh-user race: turns parked on a slow wake, then a DELETE (204 in 80 ms); the turns answered
    404 only when the wake's own next step met the DELETED record, 1-5 s later (its restore and agent
    start), some 503 ``resume_timeout`` "retry" instead. The delete now fails the parked wake at once."""
    d = directory
    await _suspended_session(d)
    settings = Settings()
    workers = _HeldActivation()
    [router] = await _routers(d, workers, settings, AuditLog(d.redis, d.keys, settings.audit), n=1)
    turns = [asyncio.create_task(router.wake_retrying("s1")) for _ in range(3)]
    await asyncio.wait_for(workers.entered.wait(), 10)
    await router.delete("s1")
    done, _ = await asyncio.wait(turns, timeout=10)
    assert len(done) == 3 and not workers.go.is_set(), "answered while the activation was still held"
    for t in turns:
        with pytest.raises(NotFound) as e:
            t.result()
        assert e.value.code == "session_not_found"
    workers.go.set()  # the wake itself ends at its next step (the record is gone) and gives its slot back
    for _ in range(200):
        if not router._wakes and await d.redis.hgetall(d.keys.worker_slots("w1")) == {}:
            break
        await asyncio.sleep(0.02)
    assert await d.redis.hgetall(d.keys.worker_slots("w1")) == {}, "the slot is free"


async def test_a_parked_turn_whose_session_another_router_deleted_is_404_not_resume_timeout(
        directory: Directory) -> None:
    """The same race with the DELETE through another router: the parked turn ran out of its park time
    and answered 503 ``resume_timeout`` ("its wake goes on: retry") for a session already gone."""
    d = directory
    await _suspended_session(d)
    settings = Settings(api={"park_timeout_s": 0.3})
    workers = _HeldActivation()
    waking, deleting = await _routers(d, workers, settings, AuditLog(d.redis, d.keys, settings.audit))
    turn = asyncio.create_task(waking.wake("s1"))
    await asyncio.wait_for(workers.entered.wait(), 10)
    await deleting.delete("s1")
    with pytest.raises(NotFound) as e:
        await asyncio.wait_for(turn, 10)
    assert e.value.code == "session_not_found"
    workers.go.set()
    for _ in range(200):
        if not waking._wakes:
            break
        await asyncio.sleep(0.02)
