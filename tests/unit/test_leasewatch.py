"""``substrate.leasewatch.LeaseWatch``: calls in flight to workers are abandoned when their worker's lease runs out, by one
timer per router that runs only while some turn is in flight (not a timer per turn)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from substrate.leasewatch import LeaseWatch


@dataclass
class _Worker:
    leaseExpiresAt: float  # noqa: N815 - the registry's field name


class _View:
    def __init__(self) -> None:
        self.workers: dict[str, _Worker] = {}
        self.read_at = 0.0  # when the registry read that ``workers`` holds began


async def test_only_the_calls_of_a_worker_past_its_lease_and_grace_are_cancelled() -> None:
    view = _View()
    now = time.time()
    view.workers = {"w-live": _Worker(now + 60), "w-grace": _Worker(now - 1), "w-lost": _Worker(now - 10)}
    watch = LeaseWatch(view, grace_s=5, check_s=3600)  # the timer never fires here: checked by hand
    tasks = {w: asyncio.create_task(asyncio.sleep(3600)) for w in ("w-live", "w-grace", "w-lost", "w-gone")}
    for w, t in tasks.items():
        watch.add(w, t)
    assert watch.in_flight() == 4
    view.read_at = time.time() - 5  # read before the calls began: w-gone may have registered since
    watch.check()
    await asyncio.sleep(0)
    assert not tasks["w-gone"].done(), "a worker newer than the view's last read is not taken for gone"
    view.read_at = time.time() + 1  # a read that began after the calls did, without w-gone
    watch.check()
    await asyncio.sleep(0)
    # within the lease, or past it by less than the grace: left alone; past lease and grace, or gone from
    # the registry: cancelled, and marked as the watch's doing
    assert not tasks["w-live"].done() and not tasks["w-grace"].done()
    assert tasks["w-lost"].cancelled() and tasks["w-gone"].cancelled()
    assert watch.lost == {tasks["w-lost"], tasks["w-gone"]}
    watch.check()  # a second look does not cancel them again
    assert tasks["w-lost"].cancelling() == 1
    for w, t in tasks.items():
        watch.discard(w, t)
    assert watch.in_flight() == 0 and not watch.lost
    for t in tasks.values():
        t.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    watch.close()


async def test_the_timer_runs_only_while_calls_are_in_flight() -> None:
    view = _View()
    view.workers = {"w": _Worker(time.time() + 60)}
    watch = LeaseWatch(view, grace_s=0, check_s=3600)
    assert watch._timer is None  # nothing in flight: no timer
    task = asyncio.current_task()
    assert task is not None
    watch.add("w", task)
    first = watch._timer
    assert first is not None
    watch.add("w", task)
    assert watch._timer is first  # one timer per watch, not one per call
    watch.check()  # a call still in flight: armed again
    assert watch._timer is not None and watch._timer is not first
    watch.discard("w", task)
    watch.check()  # nothing in flight: the timer lapses
    assert watch._timer is None
    watch.close()


def test_a_period_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="check_s must be > 0"):
        LeaseWatch(_View(), grace_s=1, check_s=0)
