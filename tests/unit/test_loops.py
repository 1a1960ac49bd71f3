"""Control loops end when cancelled, even when a step swallowed the cancellation.

On Python 3.11, ``asyncio.wait_for`` (inside every redis-py command) can swallow a ``cancel()`` that
arrives as the command completes (CPython gh-86296). ``substrate up`` then hung on Ctrl-C in about one
stop in ten: its signing-key refresh loop slept and stepped on, and ``asyncio.run`` waited for it for ever
(the suite's runtimes were SIGKILLed after 20 s). The steps below swallow the cancellation the same way.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from substrate.loops import cancel_and_wait, reraise_lost_cancel, run_forever


def _swallowing_step(entered: asyncio.Event, calls: list[int]):
    async def step() -> None:
        calls.append(1)
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return  # what a lost cancellation looks like to the caller: a normal return
    return step


async def test_a_loop_whose_step_swallowed_the_cancel_still_ends() -> None:
    entered, calls = asyncio.Event(), []
    task = asyncio.create_task(run_forever(_swallowing_step(entered, calls), 3600, "test loop"))
    await entered.wait()
    task.cancel()
    # without reraise_lost_cancel the loop goes on to its hour-long sleep and this wait runs out
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()
    assert calls == [1], "no step after the cancel"


async def test_a_loop_whose_step_failed_while_cancelled_still_ends(caplog: pytest.LogCaptureFixture) -> None:
    entered = asyncio.Event()

    async def step() -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionError("connection closed by the cancel") from None  # a client that converts it

    task = asyncio.create_task(run_forever(step, 3600, "test loop"))
    await entered.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()
    assert "test loop failed" in caplog.text  # the error is still logged, as for any failed step


async def test_an_uncancelled_loop_keeps_going_after_errors() -> None:
    calls: list[int] = []

    async def step() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("transient")

    task = asyncio.create_task(run_forever(step, 0, "test loop"))
    for _ in range(200):
        if len(calls) >= 4:
            break
        await asyncio.sleep(0)
    assert len(calls) >= 4 and not task.done(), "a control loop never dies of a step's error"
    await cancel_and_wait([task])
    assert task.cancelled()


async def test_reraise_lost_cancel_is_a_no_op_unless_cancel_was_asked() -> None:
    reraise_lost_cancel()  # in a task nobody cancelled: nothing happens
    outcome: list[str] = []

    async def swallow_then_check() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            outcome.append("swallowed")
        reraise_lost_cancel()
        outcome.append("went on")  # never reached

    t = asyncio.create_task(swallow_then_check())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert outcome == ["swallowed"]


async def test_cancel_and_wait_waits_for_the_tasks_and_names_one_that_will_not_stop(
        caplog: pytest.LogCaptureFixture) -> None:
    cleaned: list[str] = []

    async def tidy() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # releases what it holds before it ends
            cleaned.append("tidy")

    stubborn_go = asyncio.Event()

    async def stubborn() -> None:
        while not stubborn_go.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # refuses to stop

    a = asyncio.create_task(tidy(), name="tidy")
    b = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    caplog.set_level(logging.WARNING)
    left = await cancel_and_wait([a, None, b], timeout_s=0.2)
    assert left == 1 and a.done() and cleaned == ["tidy"], "the tidy task finished its clean-up first"
    assert not b.done()
    assert any(getattr(r, "task", None) == "stubborn" for r in caplog.records)
    stubborn_go.set()
    b.cancel()
    await asyncio.wait([b], timeout=5)
    assert b.done()
    assert await cancel_and_wait([]) == 0


async def test_watch_lag_measures_a_loop_held_by_cpu_bound_work(caplog: pytest.LogCaptureFixture) -> None:
    """A callback that holds the loop (``time.sleep``, as CPU-bound work does) shows as lag at least as
    long, and a hold past ``LAG_WARN_S`` is logged once; an idle loop's lag stays near timer precision."""
    import time

    from substrate import loops

    seen: list[float] = []
    task = asyncio.create_task(loops.watch_lag(seen.append, interval_s=0.02))
    while len(seen) < 3:
        await asyncio.sleep(0.01)
    idle = list(seen)
    with caplog.at_level(logging.WARNING, logger="substrate.loops"):
        old = loops.LAG_WARN_S
        loops.LAG_WARN_S = 0.1
        try:
            n = len(seen)
            time.sleep(0.15)  # holds the loop: the probe's timer is due meanwhile
            while len(seen) < n + 2:
                await asyncio.sleep(0.01)
        finally:
            loops.LAG_WARN_S = old
    assert await cancel_and_wait([task]) == 0
    assert max(seen[n:]) >= 0.12, seen
    assert min(idle) < 0.1, idle  # not a constant: an idle loop reads small
    warnings = [r for r in caplog.records if "event loop held" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


async def test_watch_lag_survives_a_failing_observer() -> None:
    from substrate import loops

    calls: list[float] = []

    def observe(lag_s: float) -> None:
        calls.append(lag_s)
        raise RuntimeError("a broken metric")

    task = asyncio.create_task(loops.watch_lag(observe, interval_s=0.01))
    while len(calls) < 3:
        await asyncio.sleep(0.01)
    assert not task.done()
    assert await cancel_and_wait([task]) == 0


def test_lag_counts_count_probes_over_each_bound_and_give_back_what_was_reported() -> None:
    from substrate.loops import LagCounts

    c = LagCounts()
    for lag_s in (0.0, 0.004, 0.006, 0.011, 0.03, 0.01):  # 0.01 is not over 10 ms
        c.observe(lag_s)
    sent = c.fields()
    assert sent == {"workerLoopLagProbes": 6, "workerLoopLagOver5ms": 4, "workerLoopLagOver10ms": 2,
                    "workerLoopLagOver25ms": 1}
    c.observe(0.1)  # probed while the heartbeat was on its way: kept for the next one
    c.take(sent)
    assert c.fields() == {"workerLoopLagProbes": 1, "workerLoopLagOver5ms": 1, "workerLoopLagOver10ms": 1,
                          "workerLoopLagOver25ms": 1}


def test_lag_totals_read_back_what_the_heartbeats_added() -> None:
    from substrate.loops import LagCounts

    c = LagCounts()
    for lag_s in (0.001, 0.006, 0.03):
        c.observe(lag_s)
    stats = {k: float(v) for k, v in c.fields().items()} | {"slotSeconds": 5.0}
    assert LagCounts.totals(stats) == {"probes": 3, "over5ms": 2, "over10ms": 1, "over25ms": 1}
    assert LagCounts.totals({}) == {"probes": 0, "over5ms": 0, "over10ms": 0, "over25ms": 0}
