"""Pre-started agent hosts (``workers.sandbox.SandboxPool``, issue 7's "pre-start a host per free slot").

These start real agent host processes, unsandboxed (a pool whose templates all opt out of the sandbox),
so they run without bubblewrap; the sandboxed kind is covered end to end by ``tests/e2e`` and
``tests/security``. No timing is asserted: every wait is bounded only so a broken pool fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path

from workers.sandbox import READY_LINE, HostProcess, Limits, SandboxPool

UNSANDBOXED = Limits(sandboxed=False)


def _pool(tmp_path: Path, slots: int, **kw: object) -> SandboxPool:
    # bwrap=None and require_sandbox=False: the pool of an opted-out template (works without bubblewrap)
    return SandboxPool(tmp_path / "w", slots, name=f"unit-{uuid.uuid4().hex[:8]}", bwrap=None, uid_base=29000,
                       uid_span=500, uid_lock_dir=tmp_path / "locks", require_sandbox=False, **kw)  # type: ignore[arg-type]


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.02)


async def _init_counter(host: HostProcess) -> dict:
    """Send ``init`` for the counter agent and return the host's next line (its answer)."""
    assert host.proc.stdin is not None and host.proc.stdout is not None
    host.proc.stdin.write(json.dumps({"op": "init", "entrypoint": "workers.agents.counter:Counter", "env": {},
                                      "session": "s1", "epoch": 1, "template": "t", "workspace": None,
                                      "rlimits": {}, "sandboxed": False}).encode() + b"\n")
    await host.proc.stdin.drain()
    return json.loads(await asyncio.wait_for(host.proc.stdout.readline(), 30))


async def test_a_pre_started_host_is_handed_out_only_once_it_has_booted(tmp_path):
    pool = _pool(tmp_path, 2, prestart=2)
    seen_unbooted = []
    try:
        await pool.start()

        def both_ready() -> bool:
            seen_unbooted.extend(s.index for s in pool.slots if s.ready is not None and not s.ready.booted)
            return all(s.ready is not None for s in pool.slots)

        await _until(both_ready, "both slots pre-started")
        assert seen_unbooted == []
        slot = await pool.acquire()
        pre = slot.ready
        host = await pool.host_for(slot, UNSANDBOXED)
        # the opted-out pool's own kind of host serves its session; its ready line was consumed by the
        # pool, so the next line the worker reads is the answer to init
        assert host is pre and not host.sandboxed
        assert await _init_counter(host) == {"ok": True}
        await pool.release(slot, host)
    finally:
        await pool.close()


async def test_a_spawned_host_writes_its_ready_line_first(tmp_path):
    pool = _pool(tmp_path, 1, prestart=0)
    try:
        await pool.start()
        host = await pool.spawn(pool.slots[0], UNSANDBOXED)
        assert host.proc.stdout is not None
        assert (await asyncio.wait_for(host.proc.stdout.readline(), 30)).strip() == READY_LINE
        host.booted = True
        assert await _init_counter(host) == {"ok": True}
        await host.close()
    finally:
        await pool.close()


async def test_acquire_prefers_a_booted_host_then_one_still_booting(tmp_path):
    pool = _pool(tmp_path, 3, prestart=0)
    never = asyncio.get_running_loop().create_future()
    try:
        await pool.start()
        booted = await pool.spawn(pool.slots[1], UNSANDBOXED)
        await booted.wait_booted(30)
        pool.slots[1].ready = booted
        pool.slots[0]._prestart = asyncio.ensure_future(never)  # a host still booting in slot 0
        assert (await pool.acquire()).index == 1
        assert (await pool.acquire()).index == 0  # sooner than a spawn in slot 2
        assert (await pool.acquire()).index == 2
    finally:
        never.cancel()
        pool.slots[0]._prestart = None
        await pool.close()


async def test_refill_waits_while_spares_last_and_starts_at_once_when_they_run_out(tmp_path):
    pool = _pool(tmp_path, 4, prestart=4, refill_delay_s=3600.0)  # a delayed refill would never come
    try:
        await pool.start()
        await _until(lambda: all(s.ready is not None for s in pool.slots), "all slots pre-started")
        a = await pool.acquire()
        host_a = await pool.host_for(a, UNSANDBOXED)  # 3 spares left: the refill waits
        assert pool._warmup_waiting
        b = await pool.acquire()
        host_b = await pool.host_for(b, UNSANDBOXED)  # 2 left: still waiting
        assert pool._warmup_waiting and all(s._prestart is None or s._prestart.done() for s in (a, b))
        await pool.release(a, host_a)  # a free slot to refill, yet the refill waits while 2 spares last
        assert a.ready is None and pool._warmup_waiting
        c = await pool.acquire()
        host_c = await pool.host_for(c, UNSANDBOXED)  # 1 spare left: warm up now
        await _until(lambda: a.ready is not None, "the freed slot refilled once the spares ran low")
        assert a.ready is not None and a.ready.booted
        for s, h in ((b, host_b), (c, host_c)):
            await pool.release(s, h)
    finally:
        await pool.close()


async def test_each_take_or_release_restarts_a_waiting_refill_but_never_past_its_bound(tmp_path):
    """A burst of wakes served from the spares: the refill's boots wait for a lull (each take or release
    restarts the wait) instead of landing under the burst, but a burst that never pauses postpones them
    at most ``_REFILL_MAX_POSTPONE`` delays, and once the spares are down to a quarter (a steady stream of
    takes) the wait is no longer restarted."""
    pool = _pool(tmp_path, 6, prestart=6, refill_delay_s=3600.0)
    try:
        await pool.start()
        await _until(lambda: all(s.ready is not None for s in pool.slots), "all slots pre-started")
        a = await pool.acquire()
        host_a = await pool.host_for(a, UNSANDBOXED)
        first, since = pool._warmup, pool._refill_since
        assert pool._warmup_waiting
        await pool.release(a, host_a)
        await asyncio.sleep(0)  # the cancelled wait ends at the loop's next turn
        assert pool._warmup is not first and first.cancelled(), "the wait started again"
        assert pool._warmup_waiting and pool._refill_since == since, "from the first ask, for the bound"
        held = []
        while pool._spares() > 2:  # a steady stream of takes down to a quarter of the spares (at least 2)
            s_ = await pool.acquire()
            held.append((s_, await pool.host_for(s_, UNSANDBOXED)))
        waiting = pool._warmup
        pool._refill()  # another take or release now
        assert pool._warmup is waiting and pool._warmup_waiting, "no more restarts: it comes a delay after the ask"
        for s_, h in held:
            await pool.release(s_, h)
    finally:
        await pool.close()
    # the bound: a take or release every 20 ms, spares never below 2, yet the freed slot gets its host
    pool = _pool(tmp_path, 6, prestart=6, refill_delay_s=0.05)  # bound: 8 x 50 ms
    try:
        await pool.start()
        await _until(lambda: all(s.ready is not None for s in pool.slots), "all slots pre-started")
        held = []
        for _ in range(2):
            s_ = await pool.acquire()
            held.append((s_, await pool.host_for(s_, UNSANDBOXED)))
        freed = held[0][0]
        await pool.release(*held.pop(0))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while freed.ready is None:  # the burst goes on until the freed slot has its host again
            assert loop.time() < deadline, "a burst that never pauses postponed the refill for ever"
            assert pool._spares() > 1  # so the refill is never started for want of spares
            pool._refill()  # what each take and release of the burst does (without using up the spares)
            await asyncio.sleep(0.02)
        for s_, h in held:
            await pool.release(s_, h)
    finally:
        await pool.close()


async def test_a_failing_spawn_is_tried_once_per_slot_not_in_a_loop(tmp_path):
    pool = _pool(tmp_path, 3, prestart=3)
    calls = []

    async def broken(slot, limits):  # noqa: ANN001, ANN202
        calls.append(slot.index)
        raise OSError("no more processes")

    try:
        pool.spawn = broken  # type: ignore[method-assign]
        await asyncio.wait_for(pool._prestart_all(), 30)
        assert sorted(calls) == [0, 1, 2]
        assert all(s.ready is None for s in pool.slots)
    finally:
        await pool.close()


async def test_release_closes_a_pre_started_host_its_activation_never_took(tmp_path):
    pool = _pool(tmp_path, 1, prestart=1)
    try:
        await pool.start()
        await _until(lambda: pool.slots[0].ready is not None, "slot pre-started")
        slot = await pool.acquire()
        left = slot.ready
        assert left is not None
        await pool.release(slot, None)  # e.g. the restore failed before the agent started
        await asyncio.wait_for(left.proc.wait(), 30)
        assert not left.alive and slot.ready is not left
    finally:
        await pool.close()


async def test_a_stale_release_does_not_free_or_sweep_the_slots_next_holder(tmp_path):
    """A 2x replay killed five agents in a row: a suspend and the reconciler both ended one activation,
    and the second release, after another session had taken the slot, killed that session's host and
    freed the slot under it. A release names its lease now; an older one changes nothing."""
    pool = _pool(tmp_path, 1, prestart=0)
    try:
        await pool.start()
        slot = await pool.acquire()
        first = slot.lease
        await pool.release(slot, None, lease=first)
        assert not slot.busy
        again = await pool.acquire()
        assert again is slot and slot.lease == first + 1
        host = await pool.spawn(slot, UNSANDBOXED)
        await host.wait_booted(30)
        await pool.release(slot, None, lease=first)  # the late second release of the first holder
        assert slot.busy and host.alive  # the new holder keeps its slot and its agent
        await pool.release(slot, host, lease=first + 1)
        assert not slot.busy and not host.alive
        await pool.release(slot, None, lease=first + 1)  # a double release of a free slot: nothing happens
        assert not slot.busy and slot.lease == first + 1
    finally:
        await pool.close()


async def test_acquire_takes_the_directorys_slot_when_it_is_as_warm_as_any(tmp_path):
    """Fresh-user run: the API's ``slot`` named another sandbox than the session's (cgroup slot-3 for
    slot 2); an operator acting on a session's slot would have hit another session."""
    pool = _pool(tmp_path, 3, prestart=0)
    try:
        await pool.start()
        assert (await pool.acquire(prefer=2)).index == 2
        assert (await pool.acquire(prefer=2)).index != 2  # taken: any free one
        assert (await pool.acquire()).busy
    finally:
        await pool.close()


async def test_a_pre_started_host_wins_over_the_preferred_slot(tmp_path):
    pool = _pool(tmp_path, 2, prestart=1)
    try:
        await pool.start()
        await _until(lambda: any(s.ready is not None for s in pool.slots), "one slot pre-started")
        warm = next(s for s in pool.slots if s.ready is not None)
        cold = next(s for s in pool.slots if s is not warm)
        assert await pool.acquire(prefer=cold.index) is warm  # a warm host beats the index
    finally:
        await pool.close()


def _gated(pool: SandboxPool, gate: Path) -> None:
    """Make the pool's hosts wait for ``gate`` to exist before they start: a boot as slow as we like."""
    argv = pool.argv

    def slow(slot, limits):  # noqa: ANN001, ANN202
        wait = f'while [ ! -e "{gate}" ]; do sleep 0.02; done; exec "$@"'
        return ["/bin/sh", "-c", wait, "sh", *argv(slot, limits)]

    pool.argv = slow  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def _booting_slot(tmp_path: Path, monkeypatch, boot_timeout_s: float):  # noqa: ANN001, ANN202
    """A one-slot pool whose pre-started host waits for ``gate`` before it boots, with the pool's boot
    timeout set to ``boot_timeout_s``: yields (pool, slot, gate) once the host has spawned."""
    import workers.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_BOOT_TIMEOUT_S", boot_timeout_s)
    gate = tmp_path / "gate"
    pool = _pool(tmp_path, 1, prestart=1)
    _gated(pool, gate)
    try:
        await pool.start()
        slot = pool.slots[0]
        await _until(lambda: slot.booting is not None, "the pre-started host spawned")
        yield pool, slot, gate
    finally:
        gate.touch()
        await pool.close()


async def test_an_activation_takes_over_a_host_still_booting_instead_of_waiting_out_the_boot_timeout(
        tmp_path, monkeypatch):
    """Under overload (a replay at load ~27) a restore waited up to the pool's 30 s boot timeout for the
    slot's pre-started host, then spawned another. Now ``host_for`` hands the booting host over at once
    and the activation waits for its ready line itself; the pool's timeout does not close it."""
    # the old code would wait here for ever
    async with _booting_slot(tmp_path, monkeypatch, 1e6) as (pool, slot, gate):
        booting = slot.booting
        task = slot._prestart
        taken = await pool.acquire()
        assert taken is slot
        host = await asyncio.wait_for(pool.host_for(slot, UNSANDBOXED), 30)
        assert host is booting and not host.booted and host.alive
        await asyncio.wait({task}, timeout=30)
        assert task.done() and slot.booting is None and slot.ready is None
        assert host.alive  # the pre-start's end did not close the host it gave away
        gate.touch()
        await host.wait_booted(30)
        assert await _init_counter(host) == {"ok": True}
        await pool.release(slot, host, lease=taken.lease)


async def test_release_ends_the_pre_start_still_booting_in_the_slot(tmp_path, monkeypatch):
    """A loaded CI run (2026-12-05): a create failed after it took a slot whose pre-started host was
    still booting (its credential could not be resolved), and the release's cgroup sweep killed that
    host under the pre-start task. Until the task read the EOF, the slot still named the dead, unreaped
    host as booting: the next create in the slot adopted it and failed ``agent_start_failed``. Release
    now ends the pre-start and closes its host itself. The host here is started outside the slot's
    cgroup, so that the sweep cannot end it by chance: only release's own handling does."""
    import workers.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_BOOT_TIMEOUT_S", 1e6)
    gate = tmp_path / "gate"
    pool = _pool(tmp_path, 1, prestart=1)
    _gated(pool, gate)
    launcher = pool.launcher
    monkeypatch.setattr(pool, "launcher", lambda s, limits: [])  # the pre-started host: no cgroup
    try:
        await pool.start()
        slot = pool.slots[0]
        await _until(lambda: slot.booting is not None, "the pre-started host spawned")
        booting, task = slot.booting, slot._prestart
        assert booting is not None and task is not None
        monkeypatch.setattr(pool, "launcher", launcher)
        taken = await pool.acquire()
        assert taken is slot
        await pool.release(slot, None, lease=taken.lease)  # the activation failed before host_for
        assert slot.booting is not booting and slot.ready is not booting
        assert task.done()
        assert await asyncio.wait_for(booting.proc.wait(), 30) is not None and not booting.alive
        # the slot's next activation gets a host that boots and answers
        again = await pool.acquire()
        gate.touch()
        host = await asyncio.wait_for(pool.host_for(again, UNSANDBOXED), 30)
        assert host is not booting
        await host.wait_booted(30)
        assert await _init_counter(host) == {"ok": True}
        await pool.release(again, host, lease=again.lease)
    finally:
        gate.touch()
        await pool.close()


async def test_a_wait_for_the_ready_line_that_times_out_does_not_lose_the_line(tmp_path):
    gate = tmp_path / "gate"
    pool = _pool(tmp_path, 1, prestart=0)
    _gated(pool, gate)
    try:
        await pool.start()
        host = await pool.spawn(pool.slots[0], UNSANDBOXED)
        for _ in range(3):  # the pool gives up; so does an impatient activation
            try:
                await host.wait_booted(0.05)
            except asyncio.TimeoutError:
                pass
        assert not host.booted
        gate.touch()
        await host.wait_booted(30)  # the line comes to the next waiter
        assert host.booted and await _init_counter(host) == {"ok": True}
        await host.close()
    finally:
        gate.touch()
        await pool.close()


async def test_a_pre_started_host_that_never_boots_is_closed_by_the_pool(tmp_path, monkeypatch):
    async with _booting_slot(tmp_path, monkeypatch, 0.2) as (_pool_, slot, _gate):  # the gate never opens
        host = slot.booting
        await asyncio.wait_for(host.proc.wait(), 30)
        await _until(lambda: slot.booting is not host, "the pool let go of it")
        assert slot.ready is None or slot.ready is not host


async def test_a_new_worker_boots_its_hosts_a_few_at_a_time_not_all_at_once(tmp_path):
    # all at once, every host of a new worker finished only when all did: the activations it was started
    # for waited for the whole batch (and on a loaded machine ran past the park timeout)
    from workers.sandbox import _BOOT_CONCURRENCY

    slots = _BOOT_CONCURRENCY * 2
    pool = _pool(tmp_path, slots, prestart=slots)
    peak = 0

    def all_ready() -> bool:
        nonlocal peak
        peak = max(peak, sum(1 for s in pool.slots if s._prestart is not None and not s._prestart.done()))
        return all(s.ready is not None for s in pool.slots)

    try:
        await pool.start()
        await _until(all_ready, "every slot pre-started")
        assert 0 < peak <= _BOOT_CONCURRENCY
    finally:
        await pool.close()


async def test_warm_slots_count_free_booted_hosts_and_each_boot_is_announced(tmp_path):
    """What a worker reports as ``warmSlots`` (placement prefers a worker that has one): 0 while the hosts
    boot, one per booted host in a free slot, one less per slot taken; ``on_host_ready`` is called once
    per booted host, so the worker can report it before its next heartbeat."""
    pool = _pool(tmp_path, 2, prestart=2)
    announced: list[int] = []
    pool.on_host_ready = lambda: announced.append(pool.warm_slots())
    try:
        assert pool.warm_slots() == 0
        await pool.start()
        await _until(lambda: all(s.ready is not None for s in pool.slots), "both slots pre-started")
        assert pool.warm_slots() == 2 and sorted(announced) == [1, 2]
        slot = await pool.acquire()
        assert pool.warm_slots() == 1
        await pool.release(slot, None)
    finally:
        await pool.close()


async def test_start_boots_the_first_slot_while_the_others_workspaces_are_made(tmp_path):
    """A new worker's first host starts booting right after slot 0's workspace is made, not after all of
    them (each clears a uid's keyrings in a forked child); no host starts in a slot not yet made."""
    import threading

    pool = _pool(tmp_path, 3, prestart=3)
    gate = threading.Event()
    make = pool._reset_workspace

    def slow_make(slot):  # slots 1 and 2 are made only once the gate opens
        if slot.index > 0:
            gate.wait(30)
        make(slot)

    pool._reset_workspace = slow_make  # type: ignore[method-assign]
    spawned: list[tuple[int, bool]] = []
    real_spawn = pool.spawn

    async def spawn(slot, limits):
        spawned.append((slot.index, slot.prepared))
        return await real_spawn(slot, limits)

    pool.spawn = spawn  # type: ignore[method-assign]
    starting = asyncio.create_task(pool.start())
    try:
        await _until(lambda: bool(spawned), "the first host spawned")
        await _until(lambda: pool.slots[0].ready is not None, "the first host booted")
        assert spawned == [(0, True)] and not starting.done()
        gate.set()
        await asyncio.wait_for(starting, 30)
        await _until(lambda: all(s.ready is not None for s in pool.slots), "every slot pre-started")
        assert sorted(spawned) == [(0, True), (1, True), (2, True)]
    finally:
        gate.set()
        await pool.close()
