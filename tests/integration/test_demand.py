"""Demand and capacity notes between router processes and a pool controller in another process
(``substrate.demand``; issue 9: on Kubernetes routers answered 503 no_capacity while the controller was
starting a Pod, and their waiting placements never reached the controller). Real Redis; each "process"
is its own Activator/DemandBoard pair sharing only Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from substrate.activator import Activator, WorkerView
from substrate.demand import CapacityNote, DemandBoard, PoolDemand
from substrate.directory import Directory
from substrate.errors import NoCapacity
from substrate.models import WorkerRecord
from substrate.pool import PoolController
from substrate.settings import Settings
from substrate.specs import load_documents

DOCS = [{"kind": "WorkerPool", "metadata": {"name": "default"},
         "spec": {"slots": 1, "autoscaling": {"minReplicas": 0, "maxReplicas": 4, "targetUtilization": 100}}},
        {"kind": "ActorTemplate", "metadata": {"name": "counter"},
         "spec": {"entrypoint": "workers.agents.counter:Counter"}}]


class Workers:
    async def activate(self, *a, **kw):
        return {}


class Backend:
    """Creates nothing real: records creates; ``stuck`` Pods are refused by the 'scheduler'."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.stuck: set[str] = set()

    async def create(self, pool, worker_id):
        self.created.append(worker_id)

    async def delete(self, worker_id):
        pass

    def running(self):
        return {w: "default" for w in self.created}

    def reap(self):
        return []

    def unplaceable(self, pool):
        return set(self.stuck), ("worker Pod is Unschedulable: 0/1 nodes have free GPUs" if self.stuck else "")

    async def close(self):
        pass


@pytest.fixture
async def d(redis_url):
    d = Directory(redis_url, f"dm{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


def _router(d: Directory, settings: Settings, name: str = "router-1") -> Activator:
    catalog = load_documents(DOCS)
    act = Activator(settings, d, catalog, Workers(), WorkerView(d, 60))  # type: ignore[arg-type]
    act.board = DemandBoard(d.redis, d.keys, name, ttl_s=settings.pool.demand_ttl_s)
    return act


def _controller(d: Directory, settings: Settings, backend: Backend) -> PoolController:
    catalog = load_documents(DOCS)
    own = Activator(settings, d, catalog, Workers(), WorkerView(d, 60))  # type: ignore[arg-type]
    return PoolController(settings, d, catalog, backend, own, scale_down_delay_s=60,
                          board=DemandBoard(d.redis, d.keys, "controller", ttl_s=settings.pool.demand_ttl_s))


async def _register(d: Directory, wid: str) -> None:
    now = time.time()
    await d.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}", slots=1,
                                         leaseExpiresAt=now + 60, startedAt=now))


async def _ticks_until_created(pc: PoolController, backend: Backend) -> None:
    """Tick the controller (another process's, in effect) until it has created a worker, at most 5 s."""
    for _ in range(100):
        await asyncio.sleep(0.05)
        await pc.tick()
        if backend.created:
            return


async def test_a_router_waits_for_a_worker_its_demand_made_another_process_start(d):
    """Pool at zero: the router's waiting placement reaches the controller (another process), which
    creates a worker and says so; the router keeps waiting past slot_wait_s and gets the new slot."""
    settings = Settings()
    settings.api.slot_wait_s = 0.2  # far below the time the worker takes to come: the note must hold it
    settings.api.start_wait_s = 30
    router = _router(d, settings)
    backend = Backend()
    pc = _controller(d, settings, backend)
    await pc.tick()
    assert backend.created == []  # no demand yet: a pool at zero stays at zero

    placement = asyncio.create_task(router.place("s1", router.catalog.template("counter")))
    # the demand crosses processes through Redis only: the controller's own activator waits for nothing
    await _ticks_until_created(pc, backend)
    assert len(backend.created) == 1, "the router's waiting placement did not reach the controller"
    assert (await router.board.capacity("default")).starting == 1
    await asyncio.sleep(0.6)  # beyond slot_wait_s: without the note the router would have answered 503
    assert not placement.done()
    await _register(d, backend.created[0])
    router.slot_freed("default")
    w, slot = await asyncio.wait_for(placement, 10)
    assert w.id == backend.created[0] and slot == 0
    # registered: no longer on its way. (On a loaded machine the router's last demand note, published
    # before its placement ended, can still ask for one more worker in a tick: that one is starting; and a
    # tick that read the workers before the registration landed still counts it: the next one does not)
    for _ in range(10):
        await pc.tick()
        if (await router.board.capacity("default")).starting == len(backend.created) - 1:
            break
        await asyncio.sleep(0.1)
    assert (await router.board.capacity("default")).starting == len(backend.created) - 1


async def test_a_router_does_not_give_up_before_the_controller_has_counted_its_demand(d):
    """The controller ticks only after slot_wait_s: the router's placement must not have answered 503 from
    the note the controller wrote before the demand existed."""
    settings = Settings()
    settings.api.slot_wait_s = 0.1
    router = _router(d, settings)
    backend = Backend()
    pc = _controller(d, settings, backend)
    await pc.tick()  # a fresh note saying nothing is starting, written before the demand
    placement = asyncio.create_task(router.place("s1", router.catalog.template("counter")))
    await asyncio.sleep(1.0)  # ten slot waits, no controller tick
    assert not placement.done()
    await pc.tick()
    assert len(backend.created) == 1
    await _register(d, backend.created[0])
    router.slot_freed("default")
    w, _ = await asyncio.wait_for(placement, 10)
    assert w.id == backend.created[0]


async def test_an_unschedulable_pool_answers_no_capacity_with_the_reason_not_after_the_start_wait(d):
    settings = Settings()
    settings.api.slot_wait_s = 0.2
    settings.api.start_wait_s = 600  # a router that waited for the refused Pod would hit wait_for below
    router = _router(d, settings)
    backend = Backend()
    pc = _controller(d, settings, backend)
    placement = asyncio.create_task(router.place("s1", router.catalog.template("counter")))
    await _ticks_until_created(pc, backend)
    backend.stuck = set(backend.created)  # the scheduler marks the new Pod Unschedulable
    await pc.tick()
    note = await router.board.capacity("default")
    assert note.starting == 0 and "Unschedulable" in note.blocked and note.code == "unschedulable"
    with pytest.raises(NoCapacity) as e:
        await asyncio.wait_for(placement, 20)
    assert e.value.status == 503 and e.value.retry_after_s == settings.api.retry_after_s
    # the scheduler's sentence in the message, a stable code for clients in details.reason (tester 47)
    assert "Unschedulable" in e.value.message and e.value.details["reason"] == "unschedulable"


async def test_a_stale_note_or_stale_demand_counts_for_nothing(d):
    settings = Settings()
    board = DemandBoard(d.redis, d.keys, "r", ttl_s=1.0)
    old = time.time() - 5
    await d.redis.hset(d.keys.pool_capacity, "default", json.dumps({"at": old, "starting": 3, "blocked": ""}))
    assert await board.capacity("default") == CapacityNote()  # a controller that died holds no router
    await d.redis.hset(d.keys.pool_demand, "dead-router", json.dumps({"at": old, "pools": {"default": [5, 1, 9]}}))
    await d.redis.hset(d.keys.pool_demand, "ancient", json.dumps({"at": old - 60, "pools": {"default": [5, 0, 0]}}))
    await d.redis.hset(d.keys.pool_demand, "garbage", "not json")
    ctl = DemandBoard(d.redis, d.keys, "c", ttl_s=1.0)
    assert (await ctl.read_demand()).get("default", PoolDemand()) == PoolDemand()
    # entries far past their TTL and entries that do not parse are deleted
    assert set(await d.redis.hkeys(d.keys.pool_demand)) == {"dead-router"}
    backend = Backend()
    pc = PoolController(settings, d, load_documents(DOCS), backend, None, board=ctl)
    await pc.tick()
    assert backend.created == []
    with pytest.raises(ValueError):
        DemandBoard(d.redis, d.keys, "x", ttl_s=0)


async def test_router_demand_sums_across_processes_and_activation_counters_only_grow(d):
    a = DemandBoard(d.redis, d.keys, "a")
    b = DemandBoard(d.redis, d.keys, "b")
    ctl = DemandBoard(d.redis, d.keys, "c")
    assert await a.publish_demand({"default": PoolDemand()}) is False  # idle routers write nothing
    assert await a.publish_demand({"default": PoolDemand(2, 1, 10)})
    assert await b.publish_demand({"default": PoolDemand(1, 0, 4)})
    got = await ctl.read_demand()
    assert (got["default"].waiting, got["default"].in_flight, got["default"].activations) == (3, 1, 0)
    # a controller's own process (its activator counts its placements) is left out
    assert (await DemandBoard(d.redis, d.keys, "other").read_demand(exclude="a"))["default"].waiting == 1
    await a.publish_demand({"default": PoolDemand(0, 0, 13)})  # busy -> idle is written once
    await b.publish_demand({"default": PoolDemand(1, 0, 6)})
    got = await ctl.read_demand()
    assert (got["default"].waiting, got["default"].activations) == (1, 5)
    b2 = DemandBoard(d.redis, d.keys, "b")  # router b restarted: its counter starts again
    await b2.publish_demand({"default": PoolDemand(1, 0, 1)})
    got = await ctl.read_demand()
    assert got["default"].activations == 5
    assert await a.publish_demand({"default": PoolDemand(0, 0, 13)}) is False
    # activations that found a free slot at once (never waiting) still reach the forecast
    assert await a.publish_demand({"default": PoolDemand(0, 0, 15)})
    assert (await ctl.read_demand())["default"].activations == 7


async def test_the_controller_is_poked_at_once_when_a_router_placement_finds_no_slot(d):
    settings = Settings()
    settings.api.slot_wait_s = 0.1
    settings.api.start_wait_s = 0.1
    router = _router(d, settings)
    ctl = DemandBoard(d.redis, d.keys, "c")
    wanted, subscribed = asyncio.Event(), asyncio.Event()
    follower = asyncio.create_task(ctl.follow(wanted, subscribed))
    await asyncio.wait_for(subscribed.wait(), 5)
    with pytest.raises(NoCapacity):
        await router.place("s1", router.catalog.template("counter"))
    await asyncio.wait_for(wanted.wait(), 5)
    follower.cancel()
    # and the demand it announced was written (force) before any periodic publish
    raw = await d.redis.hget(d.keys.pool_demand, "router-1")
    assert raw and json.loads(raw)["pools"]["default"][0] == 1


async def test_capacity_notes_are_read_once_per_short_period_for_all_waiting_placements(d):
    board = DemandBoard(d.redis, d.keys, "r")
    board.cache_s = 0.3

    async def write(n: int) -> None:
        await d.redis.hset(d.keys.pool_capacity, "default", json.dumps({"at": time.time(), "starting": n}))
    await write(1)
    assert (await board.capacity("default")).starting == 1
    await write(2)
    assert (await board.capacity("default")).starting == 1  # shared read: no second HGET yet
    await asyncio.sleep(0.35)
    assert (await board.capacity("default")).starting == 2


async def test_a_waiting_placement_takes_the_started_worker_without_being_told_in_process(d):
    """The first fresh-clone run of 6bc687f: a placement waiting on another process's controller (which says
    a worker is starting) answered 503 once the worker was up. Nothing in the router's process says a
    worker registered (no ``slot_freed``): the slot queue re-reads the registry on a pause that backs off to
    0.4 s, longer than the one ``slot_wait_s`` the placement waits after the note stops saying "starting".
    It re-reads at once now when that happens."""
    settings = Settings()
    settings.api.slot_wait_s = 0.05
    settings.api.start_wait_s = 30
    router = _router(d, settings)
    router.capacity_recheck_s = 0.05
    backend = Backend()
    pc = _controller(d, settings, backend)
    await pc.tick()
    placement = asyncio.create_task(router.place("s1", router.catalog.template("counter")))
    await _ticks_until_created(pc, backend)
    assert len(backend.created) == 1
    await asyncio.sleep(1.0)  # fruitless rounds: the queue's pause has backed off to its longest
    assert not placement.done()
    await _register(d, backend.created[0])  # up, in another process: no slot_freed here
    await pc.tick()  # the note: nothing starting any more
    w, slot = await asyncio.wait_for(placement, 10)
    assert w.id == backend.created[0] and slot == 0


async def test_a_pause_of_the_start_back_off_is_a_start_to_come_for_routers_elsewhere(d):
    """Routers in other processes wait through a back-off pause for the start after it (their queue
    makes room by suspending idle sessions meanwhile): counted as nothing coming, a Kubernetes create got
    503 during a 1 s pause under load. The note still says why, with the code and the pause left."""
    from substrate.backends.backoff import StartBackoff
    from substrate.demand import START_BACKOFF

    settings = Settings()
    settings.api.start_wait_s = 30
    router = _router(d, settings)
    backend = Backend()
    backend.start_backoff = StartBackoff(30.0, 60.0, noun="worker Pod")  # type: ignore[attr-defined]
    pc = _controller(d, settings, backend)
    placement = asyncio.create_task(router.place("s1", router.catalog.template("counter")))
    try:
        await _ticks_until_created(pc, backend)
        assert len(backend.created) == 1
        backend.created.clear()  # its Pod failed, and so did a second one: a 30 s pause
        backend.start_backoff.failed("default")
        backend.start_backoff.failed("default")
        await pc.tick()
        assert backend.created == [], "nothing is created during the pause"
        note = await router.board.capacity("default")
        assert note.starting == 1 and note.code == START_BACKOFF and 28 < note.retry_after_s <= 30, note
        assert note.blocked.startswith("2 worker Pods of pool 'default' failed in a row"), note
        assert not placement.done(), "the router waits through the pause"
    finally:
        placement.cancel()
        await asyncio.gather(placement, return_exceptions=True)


async def test_a_quiescing_controller_creates_no_worker_for_demand(d):
    """Fresh-user tester 54: ``substrate up`` stopping (its graceful shutdown waiting for a turn in flight)
    started a worker half a second after "Shutting down", only to stop it again. Once ``quiesce`` is
    called (``Server.before_shutdown``), the same demand that made a worker before makes none."""
    settings = Settings()
    settings.api.slot_wait_s = 0.2
    settings.api.start_wait_s = 30
    router = _router(d, settings)
    backend = Backend()
    pc = _controller(d, settings, backend)
    pc.quiesce()
    placement = asyncio.create_task(router.place("s1", router.catalog.template("counter")))
    try:
        for _ in range(20):  # as many ticks as made a worker in the test above, and more
            await asyncio.sleep(0.05)
            await pc.tick()
        assert backend.created == [], "a stopping controller created a worker"
        assert pc.quiescing
    finally:
        placement.cancel()
        await asyncio.gather(placement, return_exceptions=True)
