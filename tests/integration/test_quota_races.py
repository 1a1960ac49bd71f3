"""Running quota under racing suspends and resumes (fresh-user run: resume/suspend/resume races left
RUNNING sessions outside the tenant's running set, and a tenant with ``maxRunning`` 2 then ran 3).
Against a real Redis, with activators driven directly and an in-memory fake of the workers' API whose
suspend can be held at the point the race needs, so every interleaving here is forced, not hoped for."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.errors import (Conflict, DirectoryUnavailable, NoCapacity, NotFound, StaleEpoch, StoreUnavailable,
                              SubstrateError, TooManyRequests)
from substrate.models import QuotaLimits, SessionRecord, SessionState, WorkerRecord
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


@pytest.fixture
async def directory(redis_url: str):
    d = Directory(redis_url, f"qr{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


async def _activator(d: Directory, max_running: int) -> tuple[Activator, Workers, Quotas]:
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 600, startedAt=now))
    view = WorkerView(d, 60)
    await view.refresh()
    settings = Settings()
    quotas = Quotas(d.redis, d.keys, QuotaSettings(default=QuotaLimits(maxRunning=max_running)))
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
    assert await q.reconcile(records) == (1, 1)
    assert await _running_set(d) == {"lost", "woken"}
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
    act.breaker.failure = failures.append  # type: ignore[method-assign]

    async def failing_activate(*a: Any, **kw: Any) -> dict[str, Any]:
        raise error

    workers.activate = failing_activate  # type: ignore[method-assign]
    with pytest.raises(SubstrateError):
        await act.wake("s1")
    with pytest.raises(SubstrateError):
        await act.create(_new("s2"), TEMPLATE)
    assert failures == (["a", "a"] if counted else [])


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
