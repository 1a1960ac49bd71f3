"""One audit record per transition where two control-plane processes race for it (issue 10): against a
real Redis, two activators (two routers) and an in-memory fake of the workers' internal API."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from substrate.activator import Activator, WorkerView
from substrate.audit import SYSTEM, Actor, AuditLog, actor
from substrate.directory import Directory
from substrate.models import SessionRecord, SessionState, WorkerRecord
from substrate.settings import Settings
from substrate.specs import load_documents

CATALOG = load_documents([
    {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 1, "slots": 4}},
    {"kind": "ActorTemplate", "metadata": {"name": "counter"},
     "spec": {"entrypoint": "workers.agents.counter:Counter"}}])


class SlowWorkers:
    """Activations wait for ``release`` (so a second router can meet one in flight)."""

    def __init__(self) -> None:
        self.activating = asyncio.Event()
        self.release = asyncio.Event()
        self.activated: list[tuple[str, int]] = []

    async def activate(self, address: str, *, session: str, epoch: int, **_: Any) -> dict[str, Any]:
        self.activated.append((session, epoch))
        self.activating.set()
        await self.release.wait()
        return {}

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        pass


async def test_a_wake_won_by_another_router_is_recorded_once(directory: Directory) -> None:
    """Router 2 reads the session SUSPENDED, router 1 claims the activation first: router 2 loses the
    CAS, follows router 1's activation and answers from it, and must not write a second ``wake``
    record (it used to: both recorded ``wake ok``)."""
    d = directory
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 60, startedAt=now))
    await d.create_session(SessionRecord(id="s1", state=SessionState.SUSPENDED, actorTemplate="counter",
                                         pool="default", tenant="team-a", epoch=3, createdAt=now,
                                         updatedAt=now, lastActiveAt=now))
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    fake1, fake2 = SlowWorkers(), SlowWorkers()
    fake2.release.set()
    routers = []
    for fake in (fake1, fake2):
        view = WorkerView(d, 60)
        await view.refresh()
        routers.append(Activator(settings, d, CATALOG, fake, view, audit=audit))  # type: ignore[arg-type]
    r1, r2 = routers
    place1, place2 = r1.place, r2.place
    r2_placing = asyncio.Event()

    async def place_once_router_2_read_suspended(*a: Any, **kw: Any) -> Any:
        await r2_placing.wait()
        return await place1(*a, **kw)

    async def place_after_router_1_claimed(*a: Any, **kw: Any) -> Any:
        r2_placing.set()  # router 2 read the record SUSPENDED at epoch 3 and is about to claim it
        await fake1.activating.wait()  # router 1 holds the activation (RESUMING, epoch 4) by now
        return await place2(*a, **kw)

    r1.place = place_once_router_2_read_suspended  # type: ignore[method-assign]
    r2.place = place_after_router_1_claimed  # type: ignore[method-assign]
    token = actor.set(Actor("apikey:a0000001", "team-a", "req-1"))
    try:
        w1 = asyncio.create_task(r1.wake("s1", tenant="team-a"))
        w2 = asyncio.create_task(r2.wake("s1", tenant="team-a"))
        await fake1.activating.wait()
        await asyncio.sleep(0.3)  # router 2 lost the CAS and is waiting for router 1's activation
        assert not w2.done()
        fake1.release.set()
        (route1, _), (route2, _) = await asyncio.gather(w1, w2)
    finally:
        actor.reset(token)
    assert route1.epoch == route2.epoch == 4 and fake2.activated == [], "router 2 made no activation"
    items, _ = await audit.session_events("s1")
    assert [(e["action"], e["result"], e["epoch"], e["who"]) for e in items] == \
        [("wake", "ok", 4, "apikey:a0000001")], items
    assert (await d.get_session("s1")).state == SessionState.RUNNING


async def test_a_recovery_inside_another_tenants_request_is_recorded_as_the_system(directory: Directory) -> None:
    """A dead worker found while serving tenant B's request: A's session on it is recovered, and its
    record names the system, not B's key or request ID."""
    d = directory
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now - 30, startedAt=now - 60))
    slot = await d.claim_slot("w1", "sa")
    await d.create_session(SessionRecord(id="sa", state=SessionState.RUNNING, actorTemplate="counter",
                                         pool="default", tenant="team-a", epoch=2, worker="w1", slot=slot,
                                         createdAt=now, updatedAt=now, lastActiveAt=now))
    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    act = Activator(settings, d, CATALOG, SlowWorkers(), WorkerView(d, 60), audit=audit)  # type: ignore[arg-type]
    token = actor.set(Actor("apikey:b0000001", "team-b", "req-of-b"))
    try:
        assert await act.check_worker("w1") is True
    finally:
        actor.reset(token)
    items, _ = await audit.session_events("sa")
    assert [(e["action"], e["reason"], e["who"], e["requestId"], e["worker"], e["epoch"]) for e in items] == \
        [("recover", "worker_lost", SYSTEM.who, "", "w1", 2)]


async def test_a_failing_automatic_suspend_is_recorded_once_per_streak(directory: Directory) -> None:
    """A drain retries a failing suspend every 0.2 s for over a minute: the trail gets one record when
    it starts failing, one if the error changes, and one for the success, not one per retry."""
    from substrate.errors import StoreUnavailable, WorkerUnavailable

    d = directory
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 60, startedAt=now))
    rec = SessionRecord(id="s1", state=SessionState.RUNNING, actorTemplate="counter", pool="default",
                        tenant="team-a", epoch=2, worker="w1", slot=0, createdAt=now, updatedAt=now,
                        lastActiveAt=now)
    errors: list[Exception | None] = [StoreUnavailable("down")] * 5 + [WorkerUnavailable("gone")] + [None]

    class Failing(SlowWorkers):
        async def suspend(self, address: str, session: str, epoch: int, **_: Any) -> None:
            e = errors.pop(0)
            if e is not None:
                raise e

    settings = Settings()
    audit = AuditLog(d.redis, d.keys, settings.audit)
    act = Activator(settings, d, CATALOG, Failing(), WorkerView(d, 60), audit=audit)  # type: ignore[arg-type]
    for _ in range(6):
        with pytest.raises((StoreUnavailable, WorkerUnavailable)):
            await act.suspend(rec, reason="drain")
    await act.suspend(rec, reason="drain")
    items, _ = await audit.session_events("s1")
    assert [(e["action"], e["reason"], e["result"], e["who"]) for e in items] == [
        ("suspend", "drain", "snapshot_store_unavailable", SYSTEM.who),
        ("suspend", "drain", "worker_unavailable", SYSTEM.who),
        ("suspend", "drain", "ok", SYSTEM.who)]
