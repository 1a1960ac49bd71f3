"""The per-pool queue of placements waiting for a slot (substrate.slotqueue), with in-memory fakes."""

from __future__ import annotations

import asyncio

import pytest

from substrate.slotqueue import SlotQueue


class FakePool:
    """Free slot counter + a log of who claimed/released; ``reads`` counts registry refreshes."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.claimed: list[str] = []
        self.released: list[str] = []
        self.reads = 0
        self.room = 0  # idle sessions that make_room may suspend
        self.room_for: list[str] = []  # tenants room was asked for
        self.room_asks: list[int] = []  # slots asked for per round

    async def claim(self, sid: str, pin: str | None):
        if pin is not None and pin != "w1":
            return None
        if self.free <= 0:
            return None
        self.free -= 1
        self.claimed.append(sid)
        return ("w1", len(self.claimed))

    async def refresh(self) -> None:
        self.reads += 1

    async def make_room(self, tenant: str, count: int) -> int:
        self.room_for.append(tenant)
        self.room_asks.append(count)
        n = min(count, self.room)
        self.room -= n
        self.free += n
        return n

    async def release(self, w, slot, sid) -> None:
        self.released.append(sid)
        self.free += 1

    def queue(self, poll_s: float = 0.01) -> SlotQueue:
        return SlotQueue(self.claim, refresh=self.refresh, make_room=self.make_room, release=self.release,
                         poll_s=poll_s)


async def test_waiters_are_served_in_arrival_order_as_slots_free_up():
    pool = FakePool(free=0)
    q = pool.queue()
    tasks = [asyncio.create_task(q.wait(f"s{i}", None, 5.0)) for i in range(3)]
    await asyncio.sleep(0.03)
    assert pool.claimed == [] and len(q) == 3
    for _ in range(3):
        pool.free += 1
        q.notify()
        await asyncio.sleep(0.005)
    results = await asyncio.gather(*tasks)
    assert pool.claimed == ["s0", "s1", "s2"]
    assert [r[0] for r in results] == ["w1"] * 3


async def test_registry_is_read_once_per_round_not_once_per_waiter():
    pool = FakePool(free=0)
    q = pool.queue(poll_s=0.02)
    tasks = [asyncio.create_task(q.wait(f"s{i}", None, 0.2)) for i in range(50)]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.TimeoutError) for r in done)
    # 50 waiters polling every 50 ms for 0.2 s would read the registry ~200 times
    assert pool.reads <= q.rounds + 1 <= 20


async def test_make_room_suspends_an_idle_session_for_the_head_waiter():
    pool = FakePool(free=0)
    pool.room = 1
    q = pool.queue()
    assert await q.wait("s0", None, 1.0, tenant="acme") == ("w1", 1)
    assert pool.room == 0
    assert pool.room_for == ["acme"], "room is made for the waiting tenant (fairness between tenants)"


async def test_a_waiter_that_timed_out_gets_no_slot_and_leaks_none():
    pool = FakePool(free=0)
    q = pool.queue()
    with pytest.raises(asyncio.TimeoutError):
        await q.wait("late", None, 0.02)
    pool.free = 1
    assert await q.wait("next", None, 1.0) == ("w1", 1)
    assert pool.claimed == ["next"] and pool.free == 0


async def test_a_pinned_waiter_does_not_block_unpinned_ones():
    pool = FakePool(free=1)
    q = pool.queue()
    pinned = asyncio.create_task(q.wait("p", "w2", 0.1))  # w2 never has room
    got = await q.wait("u", None, 1.0)
    assert got[0] == "w1"
    with pytest.raises(asyncio.TimeoutError):
        await pinned


async def test_room_for_many_waiters_is_made_at_once_not_one_per_round():
    pool = FakePool(free=0)
    pool.room = 5
    q = pool.queue()
    got = await asyncio.gather(*(q.wait(f"s{i}", None, 1.0) for i in range(5)))
    assert len(got) == 5 and pool.room == 0
    assert pool.room_asks[0] == 5, "one round asked for a slot per waiter"


async def test_a_waiter_held_for_capacity_on_its_way_outlives_its_timeout():
    # the pool is growing for the waiters (``hold``): the waiter is not refused after ``timeout_s``
    # (capacity never refuses what it is creating) and keeps its place; the slot of the new worker is its
    pool = FakePool(free=0)
    q = pool.queue()
    growing = True
    task = asyncio.create_task(q.wait("s0", None, 0.05, hold=lambda: growing, max_s=30.0))
    await asyncio.sleep(0.3)  # six of its timeouts
    assert not task.done() and len(q) == 1
    pool.free += 1  # the new worker registered
    growing = False
    q.notify()
    assert await task == ("w1", 1)


async def test_a_held_waiter_is_still_bounded_by_max_s_and_then_by_timeout_s():
    pool = FakePool(free=0)
    q = pool.queue()
    with pytest.raises(asyncio.TimeoutError):
        await q.wait("s0", None, 0.01, hold=lambda: True, max_s=0.1)
    assert len(q) == 0 and pool.claimed == []
    stopped = iter([True, True, False])  # growth stops: timeout_s counts from then
    with pytest.raises(asyncio.TimeoutError):
        await q.wait("s1", None, 0.05, hold=lambda: next(stopped, False), max_s=30.0)


async def test_capacity_that_came_between_two_looks_gets_a_whole_timeout_to_reach_the_waiter():
    # the waiter looked at ``hold`` while a worker was starting (true); at its next look the worker is up
    # (false) and its slots are free but not yet handed out: the waiter must not give up at that moment
    # (the fresh-user burst refused 15 creates with 23 slots free), it waits one more timeout_s
    pool = FakePool(free=0)
    q = pool.queue()
    looks: list[bool] = []

    def hold() -> bool:
        if not looks:
            looks.append(True)
            return True
        pool.free += 1  # the worker registered just now; the pump has not served anyone yet
        q.notify()
        looks.append(False)
        return False

    assert await q.wait("s0", None, 0.5, hold=hold, max_s=30.0) == ("w1", 1)
    assert looks == [True, False]


class SlowRoom(FakePool):
    """make_room frees one slot per call, each after a snapshot's worth of waiting."""

    async def make_room(self, tenant: str, count: int) -> int:
        self.room_asks.append(count)
        if self.room <= 0:
            return 0
        await asyncio.sleep(0.005)
        self.room -= 1
        self.free += 1
        return 1


async def test_a_burst_on_a_full_pool_waits_while_room_is_being_made():
    """Fresh-user run: 100 creates on a pool at maxReplicas with 120 idle sessions; room was made 8 at a
    time and every create still waiting after slot_wait_s (2 s) got no_capacity, 52 of them. Now the
    timeout counts from the queue's last progress: all are served, by suspensions, within max_s."""
    pool = SlowRoom(free=0)
    pool.room = 200
    q = pool.queue()
    # one make_room per round frees one slot: 200 rounds take >= 1 s, twice the waiters' 0.5 s timeout
    results = await asyncio.gather(*(q.wait(f"s{i}", None, 0.5, max_s=60.0) for i in range(200)),
                                   return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert sorted(pool.claimed) == sorted(f"s{i}" for i in range(200)) and pool.room == 0


async def test_without_progress_a_waiter_still_gives_up_after_its_timeout_not_max_s():
    pool = SlowRoom(free=0)  # nobody idle: make_room frees nothing
    q = pool.queue()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(asyncio.TimeoutError):
        await q.wait("s0", None, 0.2, max_s=3600.0)
    assert loop.time() - t0 < 60, "it waited for max_s although nothing moved"
    assert pool.claimed == [] and len(q) == 0


async def test_a_round_of_suspensions_longer_than_the_timeout_counts_as_progress():
    """A round's suspensions (a snapshot each) can take longer than ``slot_wait_s``: the waiters behind
    it wait for the round instead of giving up while room is being made."""
    class SlowRounds(FakePool):
        async def make_room(self, tenant: str, count: int) -> int:
            if self.room <= 0:
                return 0
            await asyncio.sleep(0.3)  # three times the waiters' timeout
            n = min(count, self.room)
            self.room -= n
            self.free += n
            return n

    pool = SlowRounds(free=0)
    pool.room = 16
    q = pool.queue()
    results = await asyncio.gather(*(q.wait(f"s{i}", None, 0.1, max_s=60.0) for i in range(16)),
                                   return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert len(pool.claimed) == 16


async def test_a_queue_that_finds_nothing_pauses_longer_and_longer_and_a_notify_serves_it_at_once():
    """Each round re-reads the registry (O(workers)); a burst waiting on a full pool read it 40 times a
    second. Rounds that find nothing double the pause up to ``max_poll_s``; a freed slot (``notify``) is
    still served at once."""
    pool = FakePool(free=0)
    q = SlotQueue(pool.claim, refresh=pool.refresh, make_room=pool.make_room, release=pool.release,
                  poll_s=0.01, max_poll_s=0.08)
    task = asyncio.create_task(q.wait("s0", None, 5.0))
    await asyncio.sleep(0.6)
    # a fixed 10 ms pause reads the registry about 60 times in 0.6 s; 10, 20, 40, then 80 ms: about 10
    assert pool.reads <= 20, pool.reads
    pool.free = 1
    q.notify()
    got = await asyncio.wait_for(task, 1.0)  # a bound on a hang, not a speed figure
    assert got[0] == "w1" and pool.claimed == ["s0"]
