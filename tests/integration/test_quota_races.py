"""Running quota under racing suspends and resumes (fresh-user run: resume/suspend/resume races left
RUNNING sessions outside the tenant's running set, and a tenant with ``maxRunning`` 2 then ran 3).
Against a real Redis, with activators driven directly and an in-memory fake of the workers' API whose
suspend can be held at the point the race needs, so every interleaving here is forced, not hoped for."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.errors import (Conflict, DirectoryUnavailable, NoCapacity, NotFound, StaleEpoch, StoreUnavailable,
                              SubstrateError, TooManyRequests, WorkerUnavailable)
from substrate.models import QuotaLimits, SessionRecord, SessionState, SnapshotRef, WorkerRecord
from substrate.quotas import Quotas
from substrate.settings import QuotaSettings, Settings
from substrate.specs import load_documents

CATALOG = load_documents([
    {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 1, "slots": 4}},
    {"kind": "ActorTemplate", "metadata": {"name": "counter"},
     "spec": {"entrypoint": "workers.agents.counter:Counter"}}])
TEMPLATE = CATALOG.template("counter")


class Workers:
    """The workers' internal API, in memory. ``suspend`` does what a worker does (RUNNING -> SUSPENDED
    at the same epoch, slot freed) and then, if ``hold`` is set, waits for ``go`` before answering: the
    window in which the router has not yet given back the quota of the suspended activation."""

    def __init__(self, d: Directory) -> None:
        self.d = d
        self.hold = False
        self.suspended = asyncio.Event()
        self.go = asyncio.Event()

    async def activate(self, address: str, *, session: str, epoch: int, **_: Any) -> dict[str, Any]:
        return {}

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        pass

    async def suspend(self, address: str, session: str, epoch: int, **_: Any) -> None:
        rec = await self.d.get_session(session)
        cas = await self.d.transition(session, from_states=[SessionState.RUNNING], epoch=epoch,
                                      to=SessionState.SUSPENDED, unset=("worker", "slot"))
        assert cas.ok
        await self.d.release_slot(rec.worker or "", rec.slot or 0, session)
        self.suspended.set()
        if self.hold:
            await self.go.wait()


async def _activator(d: Directory, max_running: int, max_total: int | None = None
                     ) -> tuple[Activator, Workers, Quotas]:
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 600, startedAt=now))
    view = WorkerView(d, 60)
    await view.refresh()
    settings = Settings()
    limits = QuotaLimits(maxRunning=max_running, maxTotal=max_total)
    quotas = Quotas(d.redis, d.keys, QuotaSettings(default=limits))
    workers = Workers(d)
    return Activator(settings, d, CATALOG, workers, view, quotas=quotas), workers, quotas  # type: ignore[arg-type]


def _new(sid: str) -> SessionRecord:
    now = time.time()
    return SessionRecord(id=sid, state=SessionState.PENDING, actorTemplate="counter", pool="default",
                         tenant="a", createdAt=now, updatedAt=now, lastActiveAt=now)


async def _running_set(d: Directory) -> set[str]:
    return set(await d.redis.smembers(d.keys.quota("a", "running")))


async def test_a_suspend_answering_after_a_resume_of_the_same_session_leaves_its_place(directory):
    """The tester's race, forced: a suspend has moved the session to SUSPENDED on the worker but not yet
    given back its place when a resume wakes it again. The suspend's late release used to remove the
    place the resumed activation holds: the session ran uncounted and a create beyond the limit passed."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=1)
    await act.create(_new("s1"), TEMPLATE)
    rec = await d.get_session("s1")
    workers.hold = True
    suspend = asyncio.create_task(act.suspend(rec))
    await workers.suspended.wait()  # SUSPENDED in the directory; the router's release still to come
    route, woke = await act.wake("s1")
    assert woke and route.epoch == rec.epoch + 1
    workers.go.set()
    await suspend
    assert (await d.get_session("s1")).state == SessionState.RUNNING
    assert await _running_set(d) == {"s1"}, "the resumed activation keeps its place"
    with pytest.raises(TooManyRequests) as e:
        await act.create(_new("s2"), TEMPLATE)
    assert e.value.code == "quota_max_running"
    assert "suspend one of this tenant's running sessions" in e.value.message, "says how to make room"
    # the place is given back when the resumed activation itself is suspended
    workers.hold = False
    await act.suspend(await d.get_session("s1"))
    assert await _running_set(d) == set()


async def test_a_wake_refused_after_its_claim_rolls_the_claim_back_and_takes_nothing(directory):
    """A wake checks the quota before it claims a slot, and takes its place only once its claim won;
    if a create took the last place in between, the claim is undone: SUSPENDED again, slot free, no
    place held, 429 to the caller."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=1)
    await act.create(_new("s1"), TEMPLATE)
    await act.suspend(await d.get_session("s1"))
    assert await _running_set(d) == set()
    place = act.place

    async def place_then_someone_takes_the_last_place(*a: Any, **kw: Any) -> Any:
        got = await place(*a, **kw)
        await quotas.acquire("a", TEMPLATE, "other", create=True)
        return got

    act.place = place_then_someone_takes_the_last_place  # type: ignore[method-assign]
    with pytest.raises(TooManyRequests) as e:
        await act.wake("s1")
    assert e.value.code == "quota_max_running"
    rec = await d.get_session("s1")
    assert rec.state == SessionState.SUSPENDED and rec.worker is None and rec.slot is None
    assert await d.worker_slots("w1") == {}
    assert await _running_set(d) == {"other"}


async def test_a_wake_over_the_quota_claims_nothing(directory):
    """Refused by the check before the claim: no slot taken, no epoch used, nobody suspended for it."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=1)
    await act.create(_new("s1"), TEMPLATE)
    await act.suspend(await d.get_session("s1"))
    await act.create(_new("s2"), TEMPLATE)
    before = await d.get_session("s1")
    with pytest.raises(TooManyRequests):
        await act.wake("s1")
    after = await d.get_session("s1")
    assert (after.state, after.epoch) == (SessionState.SUSPENDED, before.epoch)
    assert (await d.get_session("s2")).state == SessionState.RUNNING
    assert await _running_set(d) == {"s2"}


async def test_reconcile_adds_live_sessions_missing_their_place_and_keeps_a_newer_owner(directory):
    """The repair pass reconciles both ways: a RUNNING session missing from the running set is added
    (at the second pass that finds it so: a create or wake may be one step from taking it), a RESUMING
    one is not (its wake takes its place right after the claim, and may be refused); a member whose
    record (as read) does not hold is dropped, unless a wake took the place for a newer epoch since."""
    d = directory
    q = Quotas(d.redis, d.keys, QuotaSettings(default=QuotaLimits(maxRunning=2)))
    now = time.time()

    def rec(sid: str, state: SessionState, epoch: int) -> SessionRecord:
        return SessionRecord(id=sid, state=state, actorTemplate="counter", pool="default", tenant="a",
                             epoch=epoch, createdAt=now, updatedAt=now, lastActiveAt=now)

    await q.acquire("a", TEMPLATE, "woken", create=True, epoch=5)  # a wake took it for epoch 5 ...
    await q.acquire("a", TEMPLATE, "stale", create=True, epoch=2)
    records = {r.id: r for r in (rec("lost", SessionState.RUNNING, 3), rec("claiming", SessionState.RESUMING, 4),
                                 rec("woken", SessionState.SUSPENDED, 4),  # ... after this was read
                                 rec("stale", SessionState.SUSPENDED, 2))}
    assert await q.reconcile(records) == (0, 0), "first sight: only suspected"
    # added: lost's running place, and the total places of lost and claiming (existing sessions missing one)
    assert await q.reconcile(records) == (1, 3)
    assert await _running_set(d) == {"lost", "woken"}
    assert set(await d.redis.smembers(d.keys.quota("a", "total"))) == {"lost", "claiming", "woken", "stale"}
    assert (await q.usage("a")).running == 2
    with pytest.raises(TooManyRequests):
        await q.acquire("a", TEMPLATE, "new", create=True)


async def test_a_suspend_whose_activation_is_gone_answers_from_the_directory(directory):
    """An explicit suspend refused by its worker (``not_active`` / ``stale_epoch``: the activation it read
    is gone) is told what the directory says: suspended by a concurrent suspend -> the record (202); the
    worker lost the activation the record still names -> repaired to SUSPENDED; resumed again by a
    concurrent call -> 409 ``conflict``, never the worker's internal code."""
    d = directory
    act, workers, _ = await _activator(d, max_running=4)
    await act.create(_new("s1"), TEMPLATE)
    read = await d.get_session("s1")
    await act.suspend(read)  # the concurrent suspend that won
    got = await act.after_lost_suspend(read, NotFound("not active", code="not_active"))
    assert got.state == SessionState.SUSPENDED
    await act.wake("s1")  # ... and a resume after it: a new activation
    with pytest.raises(Conflict) as e:
        await act.after_lost_suspend(read, StaleEpoch("moved on"))
    assert e.value.code == "conflict" and e.value.status == 409 and e.value.details["state"] == "RUNNING"
    # the record names an activation its worker says it does not have: lost, repaired to SUSPENDED
    lost = await d.get_session("s1")
    got = await act.after_lost_suspend(lost, NotFound("not active", code="not_active"))
    assert (got.state, got.reason) == (SessionState.SUSPENDED, "activation_lost")
    assert await _running_set(d) == set()


@pytest.mark.parametrize("error, counted", [
    (DirectoryUnavailable("Redis down"), False), (StoreUnavailable("object store down"), False),
    (WorkerUnavailable("worker died"), False),
    (SubstrateError("agent failed to start", code="agent_start_failed"), True)])
async def test_only_the_tenants_own_failures_count_toward_its_breaker(directory, error, counted):
    """Chaos run on d8fe6b3: wakes failing while the object store or Redis was paused opened the (one)
    tenant's breaker, so its sessions got 429 ``tenant_circuit_open`` for ``breaker_open_s`` after the
    store was back. A platform outage, met by every tenant at once, no longer counts; a failure of the
    tenant's own activation (its agent did not start) still does, for creates and wakes alike."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=4)
    await act.create(_new("s1"), TEMPLATE)
    await act.suspend(await d.get_session("s1"))
    failures: list[str] = []
    act.breaker.failure = lambda tenant, template: failures.append(f"{tenant}/{template}")  # type: ignore[method-assign]

    async def failing_activate(*a: Any, **kw: Any) -> dict[str, Any]:
        raise error

    workers.activate = failing_activate  # type: ignore[method-assign]
    with pytest.raises(SubstrateError):
        await act.wake("s1")
    with pytest.raises(SubstrateError):
        await act.create(_new("s2"), TEMPLATE)
    assert failures == ([f"a/{TEMPLATE.name}"] * 2 if counted else [])


async def test_a_second_create_of_an_id_being_created_is_refused_and_gives_back_nothing(directory):
    """Two creates of one ID at once: the second used to find the places already held (taking is
    idempotent), fail to place or to write its record, and give back the places of the first. Now it
    is refused with 409 before it takes anything, and the first create's places stay."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=2)
    place = act.place
    placed, go = asyncio.Event(), asyncio.Event()

    async def first_place_waits(*a: Any, **kw: Any) -> Any:
        placed.set()
        await go.wait()
        return await place(*a, **kw)

    act.place = first_place_waits  # type: ignore[method-assign]
    first = asyncio.create_task(act.create(_new("dup"), TEMPLATE))
    await placed.wait()  # the first create holds its places and is placing
    act.place = place  # type: ignore[method-assign]
    with pytest.raises(Conflict) as e:
        await act.create(_new("dup"), TEMPLATE)
    assert e.value.code == "session_exists"
    assert await _running_set(d) == {"dup"}, "the first create's place stays"
    assert set(await d.redis.smembers(d.keys.quota("a", "total"))) == {"dup"}
    go.set()
    rec = await first
    assert rec.state == SessionState.RUNNING
    assert await _running_set(d) == {"dup"}
    # and the limit still holds: one more fits, a third does not
    await act.create(_new("s2"), TEMPLATE)
    with pytest.raises(TooManyRequests):
        await act.create(_new("s3"), TEMPLATE)


class CommittingWorkers(Workers):
    """A worker's suspend as the real one runs it: RUNNING -> SUSPENDING, then (after ``go`` if ``hold``)
    commit a snapshot with the move to SUSPENDED, free the slot and answer the committed ref; with
    ``hold_after``, waits for ``go`` after the commit instead (the window a concurrent resume uses).
    ``fail``: the next snapshot fails, the session goes back to RUNNING (the store error is raised)."""

    def __init__(self, d: Directory) -> None:
        super().__init__(d)
        self.hold_after = False
        self.fail = False
        self.suspending = asyncio.Event()
        self.calls = 0

    async def suspend(self, address: str, session: str, epoch: int, **_: Any) -> SnapshotRef:
        self.calls += 1
        rec = await self.d.get_session(session)
        cas = await self.d.transition(session, from_states=[SessionState.RUNNING], epoch=epoch,
                                      to=SessionState.SUSPENDING, deadline_s=60)
        if not cas.ok:
            if cas.epoch != epoch:
                raise StaleEpoch("moved on")
            raise Conflict("not RUNNING", code="invalid_state")
        self.suspending.set()
        if self.hold:
            await self.go.wait()
        if self.fail:
            self.fail = False
            await self.d.transition(session, from_states=[SessionState.SUSPENDING], epoch=epoch,
                                    to=SessionState.RUNNING)
            raise StoreUnavailable("object store down")
        ref = SnapshotRef(key=f"{session}/{epoch}-{self.calls}", epoch=epoch, createdAt=time.time(),
                          sizeBytes=1, sha256="0" * 64)
        ok, _ = await self.d.commit_snapshot(session, epoch=epoch, ref=ref, states=(SessionState.SUSPENDING,),
                                             to=SessionState.SUSPENDED, unset=("worker", "slot"))
        assert ok
        await self.d.release_slot(rec.worker or "", rec.slot or 0, session)
        self.suspended.set()
        if self.hold_after:
            await self.go.wait()
        return ref


async def _committing(d: Directory) -> tuple[Activator, CommittingWorkers]:
    act, _, _ = await _activator(d, max_running=4)
    workers = CommittingWorkers(d)
    act.client = workers  # type: ignore[assignment]
    await act.create(_new("s1"), TEMPLATE)
    return act, workers


async def test_a_suspend_meeting_a_suspend_under_way_waits_and_answers_the_suspended_record(directory):
    """Fresh-user run: 20 concurrent suspends and resumes of one session got 202s naming SUSPENDING (the
    record read while another suspend was under way, returned at once). It now waits for that suspend
    and answers its SUSPENDED record, with the snapshot it committed."""
    d = directory
    act, workers = await _committing(d)
    workers.hold = True
    first = asyncio.create_task(act.suspend_explicit(await d.get_session("s1")))
    await workers.suspending.wait()
    read = await d.get_session("s1")
    assert read.state == SessionState.SUSPENDING
    second = asyncio.create_task(act.suspend_explicit(read))
    await asyncio.sleep(0.05)
    assert not second.done(), "answered before the suspend under way ended"
    workers.go.set()
    a, b = await first, await second
    assert a.state == b.state == SessionState.SUSPENDED
    assert a.snapshot == b.snapshot and a.snapshot is not None and workers.calls == 1


async def test_a_suspend_meeting_a_suspend_that_fails_suspends_the_session_itself(directory):
    """The suspend waited for failed (the session is RUNNING again at the same epoch): the waiting one
    suspends it itself and answers 202 with the SUSPENDED record."""
    d = directory
    act, workers = await _committing(d)
    workers.hold, workers.fail = True, True
    first = asyncio.create_task(act.suspend_explicit(await d.get_session("s1")))
    await workers.suspending.wait()
    second = asyncio.create_task(act.suspend_explicit(await d.get_session("s1")))
    await asyncio.sleep(0.05)
    workers.hold = False
    workers.go.set()
    with pytest.raises(StoreUnavailable):
        await first
    got = await second
    assert got.state == SessionState.SUSPENDED and workers.calls == 2


async def test_a_suspend_answers_the_record_its_commit_left_though_a_resume_moved_it_on(directory):
    """The suspend's own commit succeeded, but a concurrent resume woke the session before the answer
    was made: the answer used to re-read the record (RUNNING or RESUMING, a new epoch). It is now the
    record as the commit left it: SUSPENDED, at the suspended epoch, with the committed snapshot."""
    d = directory
    act, workers = await _committing(d)
    before = await d.get_session("s1")
    workers.hold_after = True
    task = asyncio.create_task(act.suspend_explicit(before))
    await workers.suspended.wait()
    route, woke = await act.wake("s1")
    assert woke and route.epoch == before.epoch + 1
    workers.go.set()
    got = await task
    now = await d.get_session("s1")
    assert now.state == SessionState.RUNNING
    assert (got.state, got.epoch, got.worker, got.slot) == (SessionState.SUSPENDED, before.epoch, None, None)
    assert got.snapshot == now.snapshot and got.snapshot is not None and got.snapshot.epoch == before.epoch
    # an explicit suspend's answer says so (null is a recovery's: a fresh-user run got null here)
    assert before.suspendReason is None and got.suspendReason == "explicit"


async def test_a_lost_suspend_meeting_a_suspend_under_way_answers_suspended_not_suspending(directory):
    """``after_lost_suspend`` returned a SUSPENDING record (a 202 naming SUSPENDING): it now waits for the
    suspend under way and answers the SUSPENDED record."""
    d = directory
    act, workers = await _committing(d)
    read = await d.get_session("s1")
    workers.hold = True
    first = asyncio.create_task(act.suspend_explicit(read))
    await workers.suspending.wait()
    lost = asyncio.create_task(act.after_lost_suspend(read, NotFound("not active", code="not_active")))
    await asyncio.sleep(0.05)
    assert not lost.done()
    workers.go.set()
    assert (await lost).state == SessionState.SUSPENDED
    assert (await first).state == SessionState.SUSPENDED


@pytest.mark.parametrize("state, code", [
    (SessionState.RESUMING, "conflict"), (SessionState.STARTING, "invalid_state"),
    (SessionState.PENDING, "invalid_state"), (SessionState.FAILED, "invalid_state")])
async def test_a_suspend_meeting_a_wake_is_conflict_and_a_state_no_suspend_applies_to_invalid_state(
        directory, state, code):
    """Fresh-user run: a suspend racing a resume answered 409 ``conflict`` sometimes and ``invalid_state``
    other times (the record read RESUMING). A concurrent wake (RESUMING) is ``conflict``, as a suspend
    whose activation a resume replaced; ``invalid_state`` only for a state no suspend applies to. Both
    name the state in ``details``; nothing is changed."""
    d = directory
    act, workers = await _committing(d)
    rec = (await d.get_session("s1")).model_copy(update={"state": state})
    with pytest.raises(Conflict) as e:
        await act.suspend_explicit(rec)
    assert (e.value.status, e.value.code, e.value.details["state"]) == (409, code, state.value)
    assert workers.calls == 0 and (await d.get_session("s1")).state == SessionState.RUNNING


async def test_a_suspend_the_worker_finds_not_running_answers_from_the_directory(directory):
    """The worker's own ``invalid_state`` (the record at that epoch was no longer RUNNING when the worker
    tried: another suspend got there) used to reach the client as 409 ``invalid_state``: the directory
    now decides, here 202 with the SUSPENDED record."""
    d = directory
    act, workers = await _committing(d)
    read = await d.get_session("s1")
    await act.suspend_explicit(read)  # the concurrent suspend that won; the worker still knows the epoch
    workers.calls = 0

    async def not_running(*a: Any, **kw: Any) -> Any:
        workers.calls += 1
        raise Conflict("not RUNNING", code="invalid_state")
    workers.suspend = not_running  # type: ignore[method-assign]
    got = await act.suspend_explicit(read)
    assert got.state == SessionState.SUSPENDED and workers.calls == 1


async def test_a_suspend_whose_worker_is_unknown_is_not_a_202_naming_running(directory):
    """The session's worker is not registered (gone; its lease not yet expired): the suspend cannot
    reach it. It used to answer 202 with the re-read record, still RUNNING; now 502 ``worker_unavailable``."""
    d = directory
    act, workers = await _committing(d)
    rec = (await d.get_session("s1")).model_copy(update={"worker": "nowhere"})
    await d.transition("s1", set={"worker": "nowhere"})
    with pytest.raises(WorkerUnavailable):
        await act.suspend_explicit(rec)
    assert workers.calls == 0 and (await d.get_session("s1")).state == SessionState.RUNNING


async def test_a_create_of_an_id_that_turns_out_another_tenants_gives_its_places_back(directory):
    """IDs are one namespace across tenants, quota sets are per tenant: a create whose ID another tenant's
    create took between its existence check and its record write used to keep its places (the code took
    them for the other create's), and the repair kept them too (the ID had a live record). A fresh-user
    run: 18 such places under another tenant's sessions, then 429 ``quota_max_total`` for good."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=4)
    theirs = _new("shared")
    theirs.tenant = "b"
    await act.create(theirs, TEMPLATE)

    async def not_yet(sid: str) -> int:  # the other create's record lands right after this check
        return 1

    d.create_epoch = not_yet  # type: ignore[method-assign]
    with pytest.raises(Conflict) as e:
        await act.create(_new("shared"), TEMPLATE)  # tenant a
    assert e.value.code == "session_exists"
    assert await _running_set(d) == set() and await d.redis.smembers(d.keys.quota("a", "total")) == set()
    assert (await quotas.usage("b")).total == 1, "the other tenant's session keeps its place"


async def test_reconcile_drops_a_tenants_place_under_an_id_another_tenants_session_holds(directory):
    d = directory
    q = Quotas(d.redis, d.keys, QuotaSettings(default=QuotaLimits(maxRunning=4)))
    now = time.time()
    await q.acquire("a", TEMPLATE, "x", create=True)  # a leaked place of tenant a ...
    await q.acquire("b", TEMPLATE, "x", create=True)  # ... under b's session x
    records = {"x": SessionRecord(id="x", state=SessionState.RUNNING, actorTemplate="counter", pool="default",
                                  tenant="b", epoch=0, createdAt=now, updatedAt=now, lastActiveAt=now)}
    assert await q.reconcile(records) == (0, 0), "first sight: only suspected"
    assert await q.reconcile(records) == (1, 0)
    assert (await q.usage("a")).total == 0 and (await q.usage("a")).running == 0
    assert (await q.usage("b")).total == 1 and (await q.usage("b")).running == 1


async def test_a_late_release_for_a_deleted_namesake_leaves_the_new_sessions_place(directory):
    """A create takes its running place before its record has an epoch (owner 0); a release naming an
    older epoch, e.g. the late suspend of a deleted session of the same ID, took it, and the new session
    ran uncounted until the repair pass (a fresh-user run: 5 RUNNING against a running quota of 2 after
    churn on four IDs). The created session's place is its own epoch's as soon as its record exists."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=4)
    old = await act.create(_new("s"), TEMPLATE)
    old_epoch = old.epoch
    await act.delete("s")
    new = await act.create(_new("s"), TEMPLATE)
    assert new.epoch > old_epoch
    for _ in range(20):  # the owner is set off the create's path
        await asyncio.sleep(0.01)
        if await d.redis.hget(d.keys.quota("a", "owner"), "s") == str(new.epoch):
            break
    stale = _new("s")
    await act.release_quota(stale, epoch=old_epoch)  # the deleted namesake's suspend answering late
    assert await _running_set(d) == {"s"}, "the new session keeps its place"


async def _repair_records(d: Directory) -> dict[str, Any]:
    """Every session as the state manager's repair pass reads them before it reconciles the quotas."""
    out: dict[str, Any] = {}
    offset: int | None = 0
    while offset is not None:
        page, offset = await d.session_summaries(offset=offset, limit=250)
        out.update((r.id, r) for r in page)
    return out


async def test_repair_passes_during_a_long_create_leave_its_places(directory):
    """A create takes its places before it waits for an activation permit and a slot, and writes its record
    after: repair passes during a long wait found places with no record and, at the second, dropped them.
    The create then ran without a total or running place until two passes later, and creates over the
    limit got in meanwhile (a chaos run: 6 sessions against a tenant's ``maxTotal`` of 4)."""
    d = directory
    act, workers, quotas = await _activator(d, max_running=4, max_total=1)
    place = act.place
    placing, go = asyncio.Event(), asyncio.Event()

    async def place_after_a_long_wait(*a: Any, **kw: Any) -> Any:
        placing.set()
        await go.wait()  # the slot wait (slot_wait_s, longer while the pool grows)
        return await place(*a, **kw)

    act.place = place_after_a_long_wait  # type: ignore[method-assign]
    create = asyncio.create_task(act.create(_new("slow"), TEMPLATE))
    await placing.wait()
    for _ in range(3):  # repair passes while the create waits: its places have no record yet
        assert await quotas.reconcile(await _repair_records(d)) == (0, 0)
    assert (await quotas.usage("a")).total == 1
    go.set()
    assert (await create).state == SessionState.RUNNING
    assert (await quotas.usage("a")).total == 1 and await _running_set(d) == {"slow"}
    act.place = place  # type: ignore[method-assign]
    with pytest.raises(TooManyRequests) as e:
        await act.create(_new("over"), TEMPLATE)
    assert e.value.code == "quota_max_total"


async def test_the_places_of_a_create_that_died_are_dropped_once_its_hold_is_over(directory):
    """A create whose process died between its quota take and its record write leaves places nobody
    gives back: the repair keeps them while the create could still be under way (its ``hold_s``), and
    drops them at the second pass after that. Entries of creates past their hold are pruned by the next
    create's take."""
    d = directory
    q = Quotas(d.redis, d.keys, QuotaSettings(default=QuotaLimits(maxTotal=2)))
    inflight = d.keys.quota("a", "inflight")
    await d.redis.zadd(inflight, {"long-gone": 1.0})  # a create's entry whose hold ended long ago
    t0 = time.time()
    await q.acquire("a", TEMPLATE, "died", create=True, hold_s=60)
    assert await d.redis.zrange(inflight, 0, -1) == ["died"], "the expired entry is pruned"
    assert 0 < await d.redis.ttl(inflight) <= 61
    for now in (t0, t0 + 59):
        assert await q.reconcile({}, now=now) == (0, 0), "kept while the create may be under way"
    assert await q.reconcile({}, now=t0 + 61) == (0, 0), "over: first sight, only suspected"
    assert await q.reconcile({}, now=t0 + 62) == (1, 0)
    assert (await q.usage("a")).total == 0 and await _running_set(d) == set()


async def test_a_create_taking_its_places_while_the_repair_drops_them_keeps_them(directory):
    """A record-less running place (a late take for a deleted session) is dropped at the second pass; a
    create of that ID which takes its places after the pass read the creates in flight, but before its
    drop, keeps them: the drop itself checks the create's entry."""
    d = directory
    q = Quotas(d.redis, d.keys, QuotaSettings(default=QuotaLimits(maxRunning=4)))
    await q.acquire("a", TEMPLATE, "x", create=False, epoch=3)
    assert await q.reconcile({}) == (0, 0), "first sight: only suspected"
    drop = q._reconcile

    async def a_create_first(**kw: Any) -> Any:
        await q.acquire("a", TEMPLATE, "x", create=True, hold_s=60)
        return await drop(**kw)

    q._reconcile = a_create_first  # type: ignore[method-assign]
    assert await q.reconcile({}) == (0, 0)
    assert (await q.usage("a")).total == 1 and await _running_set(d) == {"x"}
