"""Placement while the pool grows, and placement on a fenced worker (issue 11's fresh-user burst), against
a real Redis with in-memory fakes for the workers."""

from __future__ import annotations

import asyncio
import re
import contextlib
import time
from typing import Iterator
import uuid

import pytest

from substrate.activator import Activator, WorkerView
from tests.integration.fakes import RecordingBackend
from substrate.directory import Directory
from substrate.errors import NotFound, SubstrateError, WorkerUnavailable
from substrate.models import SessionRecord, SessionState, WorkerRecord
from substrate.settings import Settings
from substrate.specs import load_documents

CATALOG = load_documents([
    {"kind": "WorkerPool", "metadata": {"name": "default"},
     "spec": {"slots": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetUtilization": 100}}},
    {"kind": "ActorTemplate", "metadata": {"name": "counter"},
     "spec": {"entrypoint": "workers.agents.counter:Counter"}}])


class Workers:
    """The workers' internal API as the control plane sees it; ``fence`` addresses answer 503
    ``worker_fenced`` (past their own lease) to activations; suspends are recorded and succeed."""

    def __init__(self, d: Directory) -> None:
        self.d = d
        self.fence: set[str] = set()
        #: addresses whose connection is refused (a worker killed, its lease not yet out), or whose
        #: connection is lost after the call was sent (``lose``)
        self.refuse: set[str] = set()
        self.lose: set[str] = set()
        #: addresses frozen past their lease (``view``: the activator's, whose leases run out); with
        #: ``recover_first`` the frozen activation's session is recovered before the create's undo
        self.freeze: set[str] = set()
        self.recover_first = False
        self.view: WorkerView | None = None
        self.activated: list[tuple[str, str]] = []  # (address, session)
        self.suspended: list[str] = []
        self.reasons: list[str] = []  # what each suspend told the worker (the record's suspendReason)
        self.activate_delay_s = 0.0  # how long an activation (a restore) takes

    async def activate(self, address, *, session, epoch, template, slot, env, snapshot, restored=None, tenant="", **_):
        if self.activate_delay_s:
            await asyncio.sleep(self.activate_delay_s)
        if address in self.fence:
            err = SubstrateError(f"worker at {address} is past its lease", code="worker_fenced", retry_after_s=1)
            err.status = 503
            raise err
        if address in self.freeze:
            # frozen past its lease (SIGSTOP): the lease runs out in the view and the call never returns
            if self.recover_first:  # the lost worker's recovery gets there before the create's undo
                await self.d.transition(session, from_states=[SessionState.STARTING], epoch=epoch,
                                        to=SessionState.SUSPENDED, bump=True, unset=("worker", "slot"),
                                        set={"reason": "worker_lost"})
            self.view.workers[address.removeprefix("http://")].leaseExpiresAt = 0.0
            await asyncio.sleep(3600)
        if address in self.refuse or address in self.lose:
            err = WorkerUnavailable("the session's worker did not answer: ClientConnectorError")
            err.reached = address in self.lose
            raise err
        self.activated.append((address, session))
        return {}

    async def deactivate(self, address, session, epoch=None):
        pass

    async def suspend(self, address, session, epoch, *, idle_s=None, wait_s=None, tenant="", reason="explicit"):
        # what a worker does: snapshot (skipped), SUSPENDED, slot freed
        self.suspended.append(session)
        self.reasons.append(reason)
        rec = await self.d.get_session(session)
        await self.d.transition(session, from_states=[SessionState.RUNNING], epoch=epoch, to=SessionState.SUSPENDED,
                                unset=("worker", "slot"))
        if rec.worker is not None and rec.slot is not None:
            await self.d.release_slot(rec.worker, rec.slot, session)


@pytest.fixture
async def env(redis_url):
    d = Directory(redis_url, f"pg{uuid.uuid4().hex[:8]}")
    settings = Settings()
    settings.api.slot_wait_s = 0.2
    settings.api.start_wait_s = 20
    workers = Workers(d)
    act = Activator(settings, d, CATALOG, workers, WorkerView(d, 60))  # type: ignore[arg-type]
    yield d, act, workers
    # a wake or repair a test left running would count its transition after the clean-up (keys left behind)
    left = [*act._repairs, *act._wakes.values(), *(t for t in act._headroom.values() if t is not None)]
    if left:
        await asyncio.wait(left, timeout=5)
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


async def _worker(d: Directory, wid: str, slots: int = 2, warm: int | None = None) -> None:
    now = time.time()
    await d.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}", slots=slots,
                                         leaseExpiresAt=now + 60, startedAt=now, warmSlots=warm))


async def _idle_running(d: Directory, sid: str, wid: str, idle_s: float, tenant: str = "default") -> None:
    now = time.time()
    slot = await d.claim_slot(wid, sid, now=now - idle_s)  # placed when it last ran
    await d.create_session(SessionRecord(id=sid, state=SessionState.RUNNING, actorTemplate="counter", pool="default",
                                         tenant=tenant, epoch=1, worker=wid, slot=slot, createdAt=now - idle_s,
                                         updatedAt=now - idle_s, lastActiveAt=now - idle_s))


async def _full_of_idle_sessions_at_its_size(d: Directory, act: Activator) -> None:
    """Worker ``full`` (2 slots) holding ``idle-1`` (idle 30 s, the least recently used) and ``idle-2``
    (idle 20 s), in the activator's view; no worker is starting (the pool is at its size)."""
    await _worker(d, "full")
    await _idle_running(d, "idle-1", "full", idle_s=30)
    await _idle_running(d, "idle-2", "full", idle_s=20)
    await act.view.refresh()
    act.starting["default"] = 0


async def _full_of_idle_sessions_while_a_worker_starts(d: Directory, act: Activator) -> None:
    """Worker ``full`` (2 slots) holding ``idle-1`` and ``idle-2``, idle 30 s (well past
    ``pressure_min_idle_s``), in the activator's view; its pool controller is starting a worker."""
    await _worker(d, "full")
    await _idle_running(d, "idle-1", "full", idle_s=30)
    await _idle_running(d, "idle-2", "full", idle_s=30)
    await act.view.refresh()
    act.starting["default"] = 1


def _controller_rounds(act: Activator) -> "asyncio.Task[None]":
    """What ``PoolController.tick`` does for the activator, round after round, whenever a placement asks
    (``capacity_wanted``); cancel the task to stop it."""
    async def rounds() -> None:
        while True:
            await act.capacity_wanted.wait()
            act.capacity_wanted.clear()
            act.capacity_ticks += 1

    return asyncio.create_task(rounds())


@contextlib.contextmanager
def _controller_running(act: Activator) -> Iterator[None]:
    """:func:`_controller_rounds` for the block's length."""
    ticking = _controller_rounds(act)
    try:
        yield
    finally:
        ticking.cancel()


def _new(sid: str) -> SessionRecord:
    now = time.time()
    return SessionRecord(id=sid, state=SessionState.PENDING, actorTemplate="counter", pool="default",
                         createdAt=now, updatedAt=now, lastActiveAt=now)


async def test_a_create_on_a_fenced_worker_is_placed_on_another_and_never_answers_worker_fenced(env):
    d, act, workers = env
    await _worker(d, "a", slots=4)
    await _worker(d, "b", slots=4)
    await act.view.refresh()
    workers.fence = {"http://a"}
    for i in range(3):  # whichever worker placement picks first, every create ends on b
        rec = await act.create(_new(f"s{i}"), CATALOG.template("counter"))
        assert rec.state == SessionState.RUNNING and rec.worker == "b"
        await act.view.refresh()  # the fenced worker comes back into the view: it must be skipped again
    assert await d.worker_slots("a") == {}, "the fenced worker holds no slot of a retried create"
    assert all(addr == "http://b" for addr, _ in workers.activated)


async def test_a_create_on_a_worker_that_refuses_connections_is_placed_on_another(env):
    """Fresh-user tester 37: for about a second after a worker's kill -9 (its lease not yet out) creates
    placed on it were answered 502 ``worker_unavailable`` while another worker had free slots. A refused
    connection ran nothing: the create is placed again elsewhere. A call lost after it was sent (tester 39:
    the worker frozen past its lease: ``tests/reliability/test_frozen_worker_calls.py``) is placed again
    too; a call lost otherwise (reset, timed out) is not: the caller is told."""
    d, act, workers = env
    await _worker(d, "a", slots=4)
    await _worker(d, "b", slots=4)
    await act.view.refresh()
    workers.refuse = {"http://a"}
    for i in range(3):
        rec = await act.create(_new(f"r{i}"), CATALOG.template("counter"))
        assert rec.state == SessionState.RUNNING and rec.worker == "b"
        await act.view.refresh()  # the dead worker's record is still in the view: skipped again
    assert await d.worker_slots("a") == {}
    workers.refuse, workers.lose = set(), {"http://a", "http://b"}
    with pytest.raises(WorkerUnavailable):
        await act.create(_new("lost"), CATALOG.template("counter"))
    with pytest.raises(NotFound):
        await d.get_session("lost")  # undone, not retried


async def test_a_create_on_a_worker_frozen_past_its_lease_is_answered_running_on_another(env):
    """Tester 39: a create on a worker frozen past its lease waited until the worker was resumed, and the
    router's retry of the create then answered 409 ``session_exists`` for the session the create itself
    had made (the lost worker's recovery had kept it SUSPENDED). Now the activation is abandoned when the
    lease runs out; an undone create is placed again on another worker, and a kept session is woken on
    another worker: the create answers it RUNNING either way."""
    d, act, workers = env
    await _worker(d, "a", slots=8)  # the most free slots: placed there first
    await _worker(d, "b", slots=4)
    await act.view.refresh()
    workers.view, workers.freeze = act.view, {"http://a"}
    rec = await act.create(_new("undone"), CATALOG.template("counter"))
    assert rec.state == SessionState.RUNNING and rec.worker == "b" and rec.epoch > 1  # above the fenced one
    assert workers.activated == [("http://b", "undone")]
    await act.view.refresh()  # a's lease is valid in the view again: tried first again
    workers.recover_first = True
    rec = await act.create(_new("kept"), CATALOG.template("counter"))
    assert rec.state == SessionState.RUNNING and rec.worker == "b", rec
    assert rec.epoch > 2, "woken above the epoch the recovery moved it to, not created again"
    assert workers.activated[-1] == ("http://b", "kept")
    assert (await d.get_session("kept")).state == SessionState.RUNNING


async def test_a_kept_create_deleted_before_it_was_woken_elsewhere_is_410_not_404(env):
    """Tester 43: a create whose session the lost worker's recovery kept SUSPENDED is woken on another
    worker; a DELETE that won the race meanwhile made that wake's 404 ``session_not_found`` the create's
    answer. A create racing a delete is 410 ``session_deleted``, as when the delete comes mid-activation."""
    from substrate.errors import NotFound, SessionDeleted

    d, act, workers = env
    await _worker(d, "a", slots=8)
    await _worker(d, "b", slots=4)
    await act.view.refresh()
    workers.view, workers.freeze, workers.recover_first = act.view, {"http://a"}, True

    async def deleted_meanwhile(sid: str, **_: object) -> None:
        await d.delete_session(sid)
        raise NotFound(f"session {sid!r} not found", code="session_not_found")

    act.wake_retrying = deleted_meanwhile  # type: ignore[method-assign]
    with pytest.raises(SessionDeleted):
        await act.create(_new("raced"), CATALOG.template("counter"))


async def test_a_create_on_fenced_workers_only_still_answers_after_bounded_retries(env):
    d, act, workers = env
    await _worker(d, "a")
    await act.view.refresh()
    workers.fence = {"http://a"}
    act.settings.api.start_wait_s = 0.3
    with pytest.raises(SubstrateError) as e:
        await act.create(_new("s"), CATALOG.template("counter"))
    assert e.value.code in ("worker_fenced", "no_capacity")
    assert await d.worker_slots("a") == {}


async def test_nobody_is_suspended_for_waiters_while_a_worker_starts_for_them(env):
    # one worker full of sessions idle well past pressure_min_idle_s; the pool controller of this process
    # is starting a worker for the waiters: they wait for it, and no idle session is suspended for them
    # (the fresh-user burst suspended its own just-created sessions while the pool grew)
    d, act, workers = env
    await _full_of_idle_sessions_while_a_worker_starts(d, act)

    async def worker_comes_up() -> None:
        while act.waiting_for_slots < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # several of the waiters' slot_wait_s
        await _worker(d, "late")
        act.starting["default"] = 0
        act.slot_freed("default")

    up = asyncio.create_task(worker_comes_up())
    placed = await asyncio.gather(*(act.place(f"new-{i}", CATALOG.template("counter")) for i in range(2)))
    await up
    assert sorted(w.id for w, _ in placed) == ["late", "late"]
    assert workers.suspended == []
    assert {r.state for r in await d.get_sessions(["idle-1", "idle-2"])} == {SessionState.RUNNING}


async def test_no_room_is_made_while_a_worker_that_registered_since_the_queues_last_refresh_is_free(env):
    """The e2e burst on a slow VM (2 pressure suspensions): the new worker registered, the controller saw
    it and said nothing more is starting, and the queue, on a view older than that registration, found
    no slot and made room. Room is now made only after the registry was read again."""
    d, act, workers = env
    await _full_of_idle_sessions_while_a_worker_starts(d, act)

    async def stale() -> None:  # the queue's own refreshes miss the new worker (its view is older)
        return None

    async def registers_unseen() -> None:
        while act.waiting_for_slots < 2:
            await asyncio.sleep(0.01)
        act._queues["default"]._refresh = stale
        await _worker(d, "late")
        act.starting["default"] = 0  # what the controller publishes once it saw the registration

    ticking = _controller_rounds(act)
    up = asyncio.create_task(registers_unseen())
    try:
        placed = await asyncio.wait_for(
            asyncio.gather(*(act.place(f"new-{i}", CATALOG.template("counter")) for i in range(2))), 10)
    finally:
        ticking.cancel()
    await up
    assert workers.suspended == []
    assert sorted(w.id for w, _ in placed) == ["late", "late"]


async def test_lazy_suspension_still_makes_room_once_the_pool_cannot_grow(env):
    # the same full worker, no worker starting, and the controller has run its rounds since the waiter
    # asked (the pool is at its size): the least recently used idle session makes room
    d, act, workers = env
    await _full_of_idle_sessions_at_its_size(d, act)

    with _controller_running(act):
        w, _ = await act.place("new", CATALOG.template("counter"))
    assert w.id == "full" and workers.suspended[:1] == ["idle-1"]
    assert workers.reasons[:1] == ["pressure"], "the record says why it was suspended"


async def test_activations_beyond_the_limit_wait_for_a_permit_and_are_not_demand_for_new_workers(env):
    """Issue 11's 2.5x overlay: 165 activations in flight on a saturated machine were each counted as a
    slot of demand and the pool ran to 34 workers. With the limiter (here fixed at 2 permits), 5 slow
    creates hold 2 slots; the other 3 wait for a permit holding none, the pool controller sizes for 2
    in flight (not 5) and starts no worker, and every create ends RUNNING once the activations finish."""
    from substrate.pool import PoolController

    d, act, workers = env
    api = act.settings.api
    api.activation_limit_initial = api.activation_limit_min = api.activation_limit_max = 2
    await _worker(d, "a", slots=6)
    await act.view.refresh()
    gate = asyncio.Event()
    started: list[str] = []
    orig = workers.activate

    async def slow(address, **kw):
        started.append(kw["session"])
        await gate.wait()
        return await orig(address, **kw)

    workers.activate = slow  # type: ignore[method-assign]
    tasks = [asyncio.create_task(act.create(_new(f"s{i}"), CATALOG.template("counter"))) for i in range(5)]
    for _ in range(100):
        if len(started) == 2 and act.gated_by_pool.get("default") == 3:
            break
        await asyncio.sleep(0.01)
    assert len(started) == 2 and act.gated_by_pool["default"] == 3
    assert len(await d.worker_slots("a")) == 2, "a waiting activation holds no slot"
    dem = act.demand_by_pool()["default"]
    assert (dem.waiting, dem.in_flight) == (0, 2), dem
    b = RecordingBackend(also_running=("a",))
    pc = PoolController(act.settings, d, CATALOG, b, act)
    await pc.tick()
    assert b.created == [], "2 slots claimed + 2 in flight fit the worker's 6 slots: no new worker"
    gate.set()
    recs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(r.state == SessionState.RUNNING for r in recs)
    assert act.limiter("default").in_use == 0 and act.gated_by_pool["default"] == 0


async def test_sessions_running_since_their_workers_last_heartbeat_are_demand_until_it_counts_them(env):
    """While a placement waits, a create is in flight from its slot claim until its worker's heartbeat
    counts it, not only until RUNNING: in between its slot shows as used but not active, and the e2e
    burst's pool controller, seeing 20 new sessions as neither, sized the pool a worker short of the
    creates still to come (8 pressure suspensions). Worker ``a`` (2 slots) holds 2 new sessions, no
    heartbeat since; a third create waits: the controller counts 3 slots wanted and starts a worker. A
    heartbeat that counted before they were RUNNING keeps them in flight; one after them takes them out
    (its count has them). With nobody waiting they are not counted (the pool is not short)."""
    from substrate.pool import PoolController

    d, act, workers = env
    await _worker(d, "a")
    await act.view.refresh()
    t0 = time.time()
    for sid in ("s1", "s2"):
        await act.create(_new(sid), CATALOG.template("counter"))
    assert act.demand_by_pool()["default"].in_flight == 0, "nobody waits: not counted"
    third = asyncio.create_task(act.create(_new("s3"), CATALOG.template("counter")))
    for _ in range(100):
        if act.waiting_by_pool.get("default"):
            break
        await asyncio.sleep(0.01)
    dem = act.demand_by_pool()["default"]
    assert (dem.waiting, dem.in_flight) == (1, 2), "RUNNING, but no heartbeat has counted them"
    b = RecordingBackend(also_running=("a",))
    pc = PoolController(act.settings, d, CATALOG, b, act)
    await pc.tick()
    assert len(b.created) == 1, "2 uncounted sessions + 1 waiting create need a second 2-slot worker"

    assert await d.heartbeat("a", time.time() + 60, active_slots=0, counted_at=t0)  # counted before them
    await act.view.refresh()
    assert act.demand_by_pool()["default"].in_flight == 2
    assert await d.heartbeat("a", time.time() + 60, active_slots=2, counted_at=time.time())
    await act.view.refresh()
    assert act.demand_by_pool()["default"].in_flight == 0, "counted by the heartbeat: active, not in flight"
    third.cancel()
    await asyncio.gather(third, return_exceptions=True)


async def test_a_create_that_waits_too_long_for_a_permit_is_refused_and_holds_nothing(env):
    d, act, workers = env
    api = act.settings.api
    api.activation_limit_initial = api.activation_limit_min = api.activation_limit_max = 1
    api.start_wait_s = 0.2
    await _worker(d, "a", slots=4)
    await act.view.refresh()
    gate = asyncio.Event()
    orig = workers.activate

    async def slow(address, **kw):
        await gate.wait()
        return await orig(address, **kw)

    workers.activate = slow  # type: ignore[method-assign]
    first = asyncio.create_task(act.create(_new("s0"), CATALOG.template("counter")))
    await asyncio.sleep(0.05)
    with pytest.raises(SubstrateError) as e:
        await act.create(_new("s1"), CATALOG.template("counter"))
    assert e.value.code == "no_capacity" and e.value.details.get("reason") == "activations_saturated"
    assert not await d.redis.exists(d.keys.session("s1")), "nothing of the refused create remains"
    assert list((await d.worker_slots("a")).values()) == ["s0"]
    gate.set()
    assert (await first).state == SessionState.RUNNING


async def _wake_behind_a_full_worker(d: Directory, act: Activator) -> tuple[asyncio.Task, asyncio.Task]:
    """Worker ``w`` (2 slots) full with ``busy-1`` and ``busy-2``, and a wake of the suspended ``sleepy``
    waiting in the slot queue; a pool controller in this process starts nothing (the pool is at its size)
    and runs its rounds when asked, so the wait is not one for a worker being started. Returns (the
    controller's rounds, the wake); the caller cancels the rounds."""
    await _worker(d, "w")
    await act.view.refresh()
    act.starting["default"] = 0
    ticking = _controller_rounds(act)
    await act.create(_new("sleepy"), CATALOG.template("counter"))
    await act.suspend(await d.get_session("sleepy"))
    await act.create(_new("busy-1"), CATALOG.template("counter"))
    await act.create(_new("busy-2"), CATALOG.template("counter"))
    return ticking, asyncio.create_task(act.wake("sleepy"))


async def test_a_parked_wake_waiting_in_the_slot_queue_is_not_cut_at_the_park_timeout(env):
    """A fresh-user run: 100 wakes at once after a restart, the pool growing one worker at a time; 27 got
    503 ``resume_timeout`` after ``park_timeout_s`` (5 s) while their placements still waited, in order,
    for a slot (no worker was starting at that instant, so the wait did not count as one for capacity).
    A wake whose placement still waits (its own bound: ``slot_wait_s`` without progress, ``start_wait_s``
    in all) is now waited for; the park timeout bounds the restore once it is placed."""
    d, act, workers = env
    act.settings.api.park_timeout_s = 0.2
    act.settings.api.slot_wait_s = 5
    act.settings.api.pressure_min_idle_s = 1e9  # nobody idle enough to be suspended for it
    ticking, wake = await _wake_behind_a_full_worker(d, act)
    await asyncio.sleep(0.6)  # three park timeouts: the placement still waits for a slot
    assert not wake.done(), wake
    await act.suspend(await d.get_session("busy-1"))  # a slot frees (slot_freed serves the queue)
    try:
        route, woke = await asyncio.wait_for(wake, 10)
    finally:
        ticking.cancel()
    assert woke and route.worker == "w"
    assert (await d.get_session("sleepy")).state == SessionState.RUNNING


async def test_a_wake_placed_just_before_the_park_timeout_gets_the_whole_park_timeout_to_restore(env):
    """The park timeout bounds the restore once the wake is placed (the test above); it was counted from
    when the request parked, so a wake placed shortly before it ran out had almost no time left for its
    restore and answered 503 ``resume_timeout`` (an e2e burst under load: 6 wakes that waited for a new
    worker). It now counts from the placement."""
    from substrate.errors import ResumeTimeout

    d, act, workers = env
    act.settings.api.park_timeout_s = 1.0
    act.settings.api.slot_wait_s = 5
    act.settings.api.pressure_min_idle_s = 1e9
    ticking, wake = await _wake_behind_a_full_worker(d, act)
    await asyncio.sleep(0.9)  # most of a park timeout waiting in the slot queue
    assert not wake.done(), wake
    workers.activate_delay_s = 0.5  # the restore outlives what was left of the first park timeout
    await act.suspend(await d.get_session("busy-1"))
    try:
        route, woke = await asyncio.wait_for(wake, 10)
    except ResumeTimeout as e:
        pytest.fail(f"the restore was cut by a park timeout counted from the park: {e}")
    finally:
        ticking.cancel()
    assert woke and route.worker == "w"
    assert (await d.get_session("sleepy")).state == SessionState.RUNNING


async def test_room_is_made_only_for_the_waiters_the_pool_controller_has_sized_the_pool_for(env):
    """The e2e burst on a loaded machine: the first create of a burst found the pool full of idle
    sessions, the pool controller ran its two rounds seeing that one waiter (it fits by suspending one:
    no new worker), and meanwhile 13 more creates of the burst had joined the queue; room was then made
    for all of them at once (8 suspended), and the controller's next round, seeing them, started 3
    workers. Room is made only for the waiters the controller has had its rounds to size the pool for;
    the later ones wait for its decision (here: a worker)."""
    d, act, workers = env
    for i in range(4):
        if i == 0:
            await _worker(d, "full", slots=4)
        await _idle_running(d, f"idle-{i}", "full", idle_s=30 - i)
    await act.view.refresh()
    act.starting["default"] = 0  # a pool controller in this process; its rounds are counted by hand here
    queue = act._slot_queue("default")
    queue.poll_s = 30  # the queue's rounds run when a waiter joins or a slot frees, not on a timer
    template = CATALOG.template("counter")

    first = asyncio.create_task(act.place("first", template))
    for _ in range(200):
        if act.waiting_for_slots == 1 and queue.rounds >= 1:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert workers.suspended == [], "no room before the controller has run its rounds"
    act.capacity_ticks += 2  # two rounds that saw one waiter, and started nothing
    later = [asyncio.create_task(act.place(f"later-{i}", template)) for i in range(3)]
    w, _ = await asyncio.wait_for(first, 10)
    assert w.id == "full"
    for _ in range(20):  # the queue's rounds for the later waiters
        await asyncio.sleep(0.01)
    assert workers.suspended == ["idle-0"], "one session suspended, for the one waiter the controller saw"
    assert act.waiting_for_slots == 3
    # the controller's next round sees them and starts a worker; it comes up and serves them
    act.starting["default"] = 1
    act.capacity_ticks += 1
    await _worker(d, "grown", slots=4)
    act.starting["default"] = 0
    act.slot_freed("default")
    placed = await asyncio.wait_for(asyncio.gather(*later), 10)
    assert [w.id for w, _ in placed] == ["grown"] * 3
    assert workers.suspended == ["idle-0"]


@pytest.mark.parametrize("placed_by", ["this process", "another router"])
async def test_the_pool_controller_does_not_drain_a_worker_a_session_was_just_placed_on(env, placed_by):
    """The Azure replay: the least loaded worker was drained 0.9 s after a session was woken on it (its
    turn had not run yet, so it looked idle) and the parked request's retry had to wake it again. The
    slot claim stamps the worker record's ``placedAt``: that worker is kept and the other, idle for long,
    is drained instead, also when the placement was made by another router process than the
    controller's (Kubernetes: routers and the controller are separate Deployments)."""
    from substrate.pool import PoolController

    d, act, workers = env
    await _worker(d, "old")
    await _worker(d, "fresh")
    for i in range(2):
        await _idle_running(d, f"idle-{i}", "old", idle_s=60)  # "old" is full of idle sessions
    router = act if placed_by == "this process" else Activator(act.settings, d, CATALOG, workers, WorkerView(d, 60))
    await router.view.refresh()
    await router.create(_new("new-1"), CATALOG.template("counter"))  # the only free slots: on "fresh"
    assert (await d.get_session("new-1")).worker == "fresh"
    assert [w.placedAt is not None and time.time() - w.placedAt < 5 for w in await d.list_workers()
            if w.id == "fresh"] == [True]
    pc = PoolController(act.settings, d, CATALOG, RecordingBackend(also_running=("old", "fresh")), act,
                        scale_down_delay_s=30)
    drained: list[str] = []

    async def record(wid: str) -> None:
        drained.append(wid)

    pc._drain = record  # type: ignore[method-assign]
    await pc.tick()
    await asyncio.sleep(0)
    assert drained == ["old"], "the least loaded worker was just placed on: the other one goes"


async def test_placement_takes_a_booted_host_before_the_emptiest_worker_whose_hosts_still_boot(env):
    """A new worker (all slots free, its hosts booting: it registers ``warmSlots`` 0) is not where a
    wake goes while another worker has a free slot with a booted host; once those are taken (this
    router counts its own claims at once), it is."""
    d, act, workers = env
    await _worker(d, "new", slots=6, warm=0)
    await _worker(d, "old", slots=6)
    for i in range(2):
        await _idle_running(d, f"busy-{i}", "old", idle_s=0)
    assert await d.heartbeat("old", time.time() + 60, warm_slots=1)  # one of its four free slots is warm
    await act.view.refresh()
    placed = []
    for i in range(3):
        rec = await act.create(_new(f"s{i}"), CATALOG.template("counter"))
        placed.append(rec.worker)
    # the warm slot first; then no worker has one and the emptiest wins (the view counted the claim)
    assert placed == ["old", "new", "new"]


async def test_demand_that_returns_during_a_drain_takes_the_draining_worker_back_instead_of_creating(env):
    """The 11-21 replay: a worker was drained after a quiet second and a new one created 0.5-1.5 s later
    (a cold start: fork, boot its hosts). Taking back the worker being drained is instant: the drain
    stops at its next step (what it suspended stays suspended), the worker is READY and not stopped, and
    no worker is created. A worker that marks itself DRAINING (SIGTERM) is never taken back."""
    from substrate.models import WorkerState
    from substrate.pool import PoolController

    d, act, workers = env
    await _worker(d, "w")
    await _idle_running(d, "idle-0", "w", idle_s=60)
    await _idle_running(d, "idle-1", "w", idle_s=60)
    backend = RecordingBackend(also_running=("w",))
    deleted: list[str] = []

    async def delete(wid: str) -> None:
        deleted.append(wid)

    backend.delete = delete  # type: ignore[method-assign]
    pc = PoolController(act.settings, d, CATALOG, backend, act, scale_down_delay_s=30)
    gate = asyncio.Event()
    suspend = workers.suspend

    async def slow_suspend(*a, **kw):  # the drain's first suspend takes until the gate opens
        await gate.wait()
        return await suspend(*a, **kw)

    workers.suspend = slow_suspend  # type: ignore[method-assign]
    pc._draining.add("w")
    pc._scale_downs.add("w")  # as ``_reconcile_pool`` starts a scale-down's drain
    drain = asyncio.create_task(pc._drain("w"))
    for _ in range(200):
        if [w.state for w in await d.list_workers()] == [WorkerState.DRAINING]:
            break
        await asyncio.sleep(0.01)
    assert [w.state for w in await d.list_workers()] == [WorkerState.DRAINING]
    await pc.tick()  # minReplicas 1 and the only worker drains: demand is back
    assert backend.created == [], "the draining worker is taken back, not replaced by a cold one"
    assert [w.state for w in await d.list_workers()] == [WorkerState.READY]
    gate.set()
    await asyncio.wait_for(drain, 10)
    assert deleted == [] and pc._draining == set()
    assert workers.suspended == ["idle-0"], "the suspend under way finished; the drain stopped there"
    assert (await d.get_session("idle-1")).state == SessionState.RUNNING
    assert [w.state for w in await d.list_workers()] == [WorkerState.READY]

    # a worker stopping on its own (it marked itself DRAINING) is not this controller's to take back,
    # nor one drained for a rolling update (not a scale-down)
    pc._draining.add("w")
    rolling = asyncio.create_task(pc._drain("w"))
    await asyncio.sleep(0.05)
    await pc.tick()
    assert len(backend.created) == 1
    assert [w.state for w in await d.list_workers() if w.id == "w"] == [WorkerState.DRAINING]
    rolling.cancel()


@pytest.mark.parametrize("case", ["headroom 1", "headroom 0", "pool growing"])
async def test_a_placement_that_takes_the_last_free_slot_makes_room_for_the_next_in_the_background(env, case):
    """The 11-21 replay: 27 % of creates and wakes waited for a pressure suspension on their own path.
    With ``pool.headroom_slots`` 1, the placement that takes the pool's last free slot starts suspending
    the least recently used idle session at once, so the next one finds a slot; never while the pool
    grows (the capacity on its way is waited for), and not at all with 0 (only on need)."""
    d, act, workers = env
    act.settings.pool.headroom_slots = 0 if case == "headroom 0" else 1
    act.settings.api.pressure_min_idle_s = 1.0
    if case == "pool growing":
        act.starting["default"] = 1  # this process's pool controller is starting a worker
    await _worker(d, "w")
    await _idle_running(d, "old", "w", idle_s=60)
    await act.view.refresh()
    await act.create(_new("new-1"), CATALOG.template("counter"))  # takes the last free slot
    task = act._headroom.get("default")
    if task is not None:
        await asyncio.wait_for(task, 10)
    if case == "headroom 1":
        assert workers.suspended == ["old"] and workers.reasons == ["pressure"]
        assert (await d.get_session("old")).state == SessionState.SUSPENDED
        assert (await d.get_session("new-1")).state == SessionState.RUNNING, "the new session is never the victim"
    else:
        assert task is None and workers.suspended == []
        assert (await d.get_session("old")).state == SessionState.RUNNING


async def test_a_headroom_search_that_finds_nobody_idle_is_not_repeated_per_placement(env):
    """Keeping free slots reads every session of the pool; when nobody is idle long enough (a pool busy
    with turns) the next placements do not search again until a session could qualify."""
    d, act, workers = env
    act.settings.pool.headroom_slots = 1
    act.settings.api.pressure_min_idle_s = 30.0
    await _worker(d, "w")
    await _idle_running(d, "recent", "w", idle_s=1)  # idle, but not for 30 s
    await act.view.refresh()
    searches = 0
    suspend_lru = act._suspend_lru

    async def counting(*a, **kw):
        nonlocal searches
        searches += 1
        return await suspend_lru(*a, **kw)

    act._suspend_lru = counting  # type: ignore[method-assign]
    for i in range(3):  # each create takes w's last free slot; its delete gives it back
        await act.create(_new(f"new-{i}"), CATALOG.template("counter"))
        task = act._headroom.get("default")
        if task is not None:
            await asyncio.wait_for(task, 10)
        await act.delete(f"new-{i}")
        await act.view.refresh()
    assert workers.suspended == []
    assert searches == 1, "one search found nobody idle for 30 s; the next placements did not repeat it"


async def test_pressure_suspensions_read_the_pools_sessions_once_per_scan_not_per_call(env, monkeypatch):
    """The slot queue asks for room every round (50 ms) while its waiters find no slot; each ask read and
    decoded every session of the pool (a fifth of the router's CPU in a 1,000-create burst, 2026-12-06).
    Asks within ``min(_LRU_SCAN_TTL_S, pressure_min_idle_s)`` of one read take their victims from it, least
    recently used first, each session tried once; a later ask reads the pool again."""
    import substrate.activator as activator_mod

    d, act, workers = env
    await _worker(d, "w", slots=4)
    for sid, idle_s in (("oldest", 300), ("older", 200), ("old", 100), ("fresh", 0)):
        await _idle_running(d, sid, "w", idle_s=idle_s)
    await act.view.refresh()
    reads = 0
    activity = d.session_activity

    async def counting(sids):
        nonlocal reads
        reads += 1
        return await activity(sids)

    monkeypatch.setattr(d, "session_activity", counting)
    monkeypatch.setattr(activator_mod, "_LRU_SCAN_TTL_S", 60.0)
    act.settings.api.pressure_min_idle_s = 10.0
    assert await act._suspend_lru("default", 10.0, count=1) == 1
    assert await act._suspend_lru("default", 10.0, count=1) == 1
    assert workers.suspended == ["oldest", "older"], "least recently used first, each once"
    assert reads == 1, "the second ask took its victim from the first one's read"
    # a candidate of that read that was active since is read again when chosen and passed over
    await d.redis.hset(d.keys.session("old"), "lastActiveAt", str(time.time()))
    assert await act._suspend_lru("default", 10.0, count=1) == 0
    assert workers.suspended == ["oldest", "older"] and reads == 1
    assert (await d.get_session("old")).state == SessionState.RUNNING
    monkeypatch.setattr(activator_mod, "_LRU_SCAN_TTL_S", 0.0)  # the read has expired: the next ask reads again
    assert await act._suspend_lru("default", 10.0, count=1) == 0
    assert reads == 2 and (await d.get_session("fresh")).state == SessionState.RUNNING


async def test_a_tenant_at_its_share_displaces_only_its_own_sessions_also_within_one_scan(env, monkeypatch):
    """Pool of 4 slots, tenants a and b holding 2 each (each at its share), all idle, b's the least
    recently used. a's waiters make room among a's sessions only, also on the second ask answered from the
    same read: the slot the first victim freed went to a's waiter, so a still holds its share (a
    fresh-user run: the read counted a's suspended session as a slot a had given up, and a's next waiter
    suspended b's session; b's next turn was 503 no_capacity). A newcomer c (share 2 of 4, holding none),
    asking for 4 slots at once, displaces at most 2 of the others' sessions."""
    import substrate.activator as activator_mod

    d, act, workers = env
    await _worker(d, "w", slots=4)
    for sid, tenant, idle_s in (("b-1", "b", 400), ("b-2", "b", 300), ("a-1", "a", 200), ("a-2", "a", 100)):
        await _idle_running(d, sid, "w", idle_s=idle_s, tenant=tenant)
    await act.view.refresh()
    monkeypatch.setattr(activator_mod, "_LRU_SCAN_TTL_S", 60.0)
    assert await act._suspend_lru("default", 10.0, tenant="a", count=1) == 1
    assert await act._suspend_lru("default", 10.0, tenant="a", count=1) == 1
    assert workers.suspended == ["a-1", "a-2"], "a at its share: its own sessions only, both asks"
    assert await act._suspend_lru("default", 10.0, tenant="a", count=1) == 0, "nothing of a's left to suspend"
    for i in range(2):  # a's waiters take the two slots the suspends freed
        await _idle_running(d, f"a-new-{i}", "w", idle_s=50, tenant="a")
        assert ((await d.get_session(f"a-new-{i}")).slot or 0) >= 0, "a free slot"
    monkeypatch.setattr(activator_mod, "_LRU_SCAN_TTL_S", 0.0)  # read the pool again
    workers.suspended.clear()
    assert await act._suspend_lru("default", 10.0, tenant="c", count=4) == 2
    assert workers.suspended == ["b-1", "b-2"], "c is 2 short of its share: the 2 least recently used, not 4"


async def test_a_session_that_became_running_after_a_scan_is_found_by_the_next_scan(env, monkeypatch):
    """A session missing from a read (it became RUNNING after it) qualifies only after
    ``pressure_min_idle_s``, and the read lasts at most that long: the next ask after it sees the session."""
    import substrate.activator as activator_mod

    d, act, workers = env
    monkeypatch.setattr(activator_mod, "_LRU_SCAN_TTL_S", 60.0)
    await _worker(d, "w", slots=2)
    await act.view.refresh()
    assert await act._suspend_lru("default", 0.2, count=1) == 0  # an empty pool: nobody to suspend
    await _idle_running(d, "later", "w", idle_s=0)
    await asyncio.sleep(0.3)  # idle 0.3 s > 0.2 s: the read of the empty pool is older than 0.2 s too
    assert await act._suspend_lru("default", 0.2, count=1) == 1
    assert workers.suspended == ["later"]


async def test_a_full_pool_whose_idle_sessions_cannot_be_suspended_for_want_of_the_store_says_so(env):
    """Fresh-user run: with the snapshot store gone, a wake into a full pool answered 503 ``no_capacity``
    (pointing at the pool's size) while the log said that making room had failed on
    ``snapshot_store_unavailable``. The answer now names the store; nothing is suspended or placed."""
    from substrate.errors import StoreUnavailable

    d, act, workers = env
    await _full_of_idle_sessions_at_its_size(d, act)
    act.settings.api.start_wait_s = 0.5

    async def store_gone(*a, **k):  # what a worker answers when its snapshot's upload cannot be made
        raise StoreUnavailable("snapshot store unavailable: the local store folder is missing",
                               details={"reason": "store_not_verified"})

    workers.suspend = store_gone  # type: ignore[method-assign]
    with _controller_running(act), pytest.raises(StoreUnavailable) as e:
        await act.place("new", CATALOG.template("counter"))
    assert e.value.code == "snapshot_store_unavailable" and e.value.status == 503
    assert "making room" in e.value.message and "folder is missing" in e.value.message, e.value.message
    assert e.value.details["pool"] == "default" and e.value.retry_after_s
    assert sorted((await d.worker_slots("full")).values()) == ["idle-1", "idle-2"], "nothing moved"
    # a later wait that fails with no such failure during it is no_capacity again
    act._room_failed = (float("-inf"), None)
    act.settings.api.pressure_min_idle_s = 1e9  # nobody idle enough: no suspension is tried
    with _controller_running(act), pytest.raises(SubstrateError) as e2:
        await act.place("new2", CATALOG.template("counter"))
    assert e2.value.code == "no_capacity"


async def test_waiters_make_room_while_the_pools_new_workers_keep_dying_and_starts_back_off(env):
    """A pool whose new workers exit before they register (a fresh user's port range taken by other
    programs: each could not listen and exited 2) was "growing" for ever: the controller started one
    every round, so a worker was always starting, and the waiting create held out for it for
    ``api.start_wait_s`` (30 s; 503 ``no_capacity`` saying nothing of why). Now the backend's back-off
    (``substrate.backends.backoff``) stops the starts, nothing counts as starting, and the idle session
    makes room; the pool's status says why it does not grow."""
    from substrate.backends.backoff import StartBackoff
    from substrate.pool import PoolController

    d, act, workers = env
    act.settings.api.slot_wait_s = 2.0  # the default: the time a waiter has to make room once the hold ends
    await _full_of_idle_sessions_at_its_size(d, act)
    # both count as active for sizing (created, not yet at their first turn: the worker's first-turn
    # window), so the waiter is demand beyond the pool's slots and the pool wants a second worker
    rec = (await d.list_workers())[0]
    rec.activeSlots = 2
    await d.register_worker(rec)

    class Dying(RecordingBackend):
        """Every worker it starts exits before registering: gone at the next round (``reap``)."""

        def __init__(self) -> None:
            super().__init__(also_running=("full",))
            self.started: list[str] = []
            self.gone: list[str] = []
            self.healthy: list[str] = []  # started and registering (the trouble is over)
            self.start_backoff = StartBackoff(30.0, 60.0, noun="worker process")

        def running(self):
            return {w: "default" for w in ("full", *self.healthy, *self.created) if w not in self.gone}

        def reap(self):
            dead = [w for w in self.created if w not in self.gone]
            for w in dead:
                self.gone.append(w)
                self.start_backoff.failed("default")
            return dead

    backend = Dying()
    pc = PoolController(act.settings, d, CATALOG, backend, act)
    stop = asyncio.Event()

    async def rounds() -> None:  # the controller's loop: a round whenever a placement asks, or 50 ms
        while not stop.is_set():
            try:
                await asyncio.wait_for(act.capacity_wanted.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
            act.capacity_wanted.clear()
            await pc.tick()

    loop = asyncio.create_task(rounds())
    try:
        w, _ = await asyncio.wait_for(act.place("new", CATALOG.template("counter")), 15)
    finally:
        stop.set()
        await loop
    assert w.id == "full" and workers.suspended[:1] == ["idle-1"] and workers.reasons[:1] == ["pressure"]
    # the first failure was retried at once (a one-off is waited for); the second paused the starts
    assert len(backend.created) == 2, "two starts failed; the next waits for the back-off, not the next round"
    assert act.starting["default"] == 0
    note = act.capacity_blocked["default"]
    assert note.code == "start_backoff" and 28 < note.retry_after_s <= 30, note
    assert note.blocked.startswith("2 worker processes of pool 'default' failed in a row"), note
    healthy = [c for c in pc.conditions("default") if c.type == "WorkersHealthy"]
    assert [(c.status, c.reason) for c in healthy] == [("False", "BackOff")]
    assert healthy[0].message.startswith("2 worker processes of pool 'default' failed in a row")
    # a waiter the pool cannot serve now is told why, with a stable code and the pause as Retry-After
    err = act._no_capacity("default", note)
    assert err.details == {"pool": "default", "reason": "start_backoff"} and err.retry_after_s == 30
    assert "failed in a row" in err.message
    # a worker of the pool that registers ends the run: healthy again, starts allowed
    backend.healthy.append("good")
    await _worker(d, "good")
    pc._state["default"].expectations["good"] = time.monotonic()
    await pc.tick()
    assert backend.start_backoff.failures("default") == 0 and "default" not in act.capacity_blocked
    assert [c.status for c in pc.conditions("default") if c.type == "WorkersHealthy"] == ["True"]


async def test_a_start_that_never_registers_is_abandoned_after_the_create_timeout(env):
    """Tester 48: a worker frozen in its start counted as capacity on its way for ever. Past the pool
    controller's create timeout, a backend that can (``abandon``: the local one) stops it, and it is no
    longer counted as starting; a backend without it (a Pending Pod) is left alone."""
    from substrate.pool import PoolController

    d, act, workers = env

    class Hung(RecordingBackend):
        def __init__(self) -> None:
            super().__init__()
            self.abandoned: list[str] = []

        async def abandon(self, worker_id):
            self.abandoned.append(worker_id)
            self.created.remove(worker_id)

    backend = Hung()
    pc = PoolController(act.settings, d, CATALOG, backend, act, create_timeout_s=0.0)
    await pc.tick()  # minReplicas 1: one start, which never registers
    (first,) = backend.created
    assert act.starting["default"] == 1
    await asyncio.sleep(0.01)
    await pc.tick()
    assert backend.abandoned == [first] and first not in pc._state["default"].expectations
    assert len(backend.created) == 1 and backend.created[0] != first, "a new start replaces it"
    plain = RecordingBackend()  # no abandon: its late start stays, counted as on its way (a Pending Pod)
    pc2 = PoolController(act.settings, d, CATALOG, plain, act, create_timeout_s=0.0)
    await pc2.tick()
    await asyncio.sleep(0.01)
    await pc2.tick()
    assert len(plain.created) == 1


async def test_a_resume_timeout_says_how_long_the_request_waited_and_why_the_pool_has_no_room(env):
    """Tester 48: a wake that waited 30 s for a worker frozen in its start answered "did not resume
    within 5s" (the restore's budget). The message now gives the request's own wait, and the pool's
    block (its start back-off) when there is one, with its code."""
    from substrate.demand import START_BACKOFF, CapacityNote
    from substrate.errors import ResumeTimeout

    d, act, workers = env
    act.settings.api.park_timeout_s = 0.2
    act.settings.api.slot_wait_s = 5
    act.settings.api.pressure_min_idle_s = 1e9
    act.capacity_blocked["default"] = CapacityNote(blocked="2 worker processes of pool 'default' failed in a row",
                                                   code=START_BACKOFF, retry_after_s=4.0)
    ticking, wake = await _wake_behind_a_full_worker(d, act)
    await asyncio.sleep(0.5)  # waiting for a slot, past the park timeout
    workers.activate_delay_s = 1.0  # then the restore outlives its budget
    await act.suspend(await d.get_session("busy-1"))
    try:
        with pytest.raises(ResumeTimeout) as e:
            await asyncio.wait_for(wake, 10)
    finally:
        ticking.cancel()
    waited = float(re.search(r"within the ([\d.]+) s this request waited", e.value.message).group(1))
    assert waited >= 0.6, e.value.message  # the queue's wait and the restore's budget, not "within 0.2s"
    assert "a wake has 0.2 s to restore once it has a slot" in e.value.message
    assert "pool 'default': 2 worker processes of pool 'default' failed in a row" in e.value.message
    assert e.value.details == {"reason": "start_backoff"}


async def test_a_whole_pool_ends_the_run_of_failures_and_a_start_under_way_shows_in_scaling(env):
    """Tester 49: after a start that failed, a pool that needed no other worker (every worker it wants
    READY) still said WorkersHealthy=False for a minute; and while a start hung, Scaling said Steady."""
    from substrate.backends.backoff import StartBackoff
    from substrate.pool import PoolController

    d, act, workers = env
    await _worker(d, "w")  # minReplicas 1: the pool is whole with it
    backend = RecordingBackend(also_running=("w",))
    backend.start_backoff = StartBackoff(30.0, 60.0)  # type: ignore[attr-defined]
    backend.start_backoff.failed("default")  # a worker of the pool died; none was needed since
    pc = PoolController(act.settings, d, CATALOG, backend, act)
    await pc.tick()
    assert backend.created == [] and backend.start_backoff.failures("default") == 0
    healthy = next(c for c in pc.conditions("default") if c.type == "WorkersHealthy")
    assert (healthy.status, healthy.reason) == ("True", "Healthy")
    assert next(c for c in pc.conditions("default") if c.type == "Scaling").reason == "Steady"

    # a start under way (not registered yet) shows, and does not end a run of failures
    pc._state["default"].expectations["starting-1"] = time.monotonic()
    backend.also_running = ("w", "starting-1")
    backend.start_backoff.failed("default")
    await pc.tick()
    scaling = next(c for c in pc.conditions("default") if c.type == "Scaling")
    assert (scaling.status, scaling.reason) == ("True", "WorkersStarting"), scaling
    assert "1 worker(s) started, not registered yet" in scaling.message
    assert backend.start_backoff.failures("default") == 1
