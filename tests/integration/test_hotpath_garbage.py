"""A turn through the router's hot path leaves no reference cycles behind, and a create and a delete send no
more Redis round trips than they need (``loadtest.hotpath_cost``).

The per-turn lease watch of ``api.proxy._post`` (a ``call_later`` whose callback and the waiting
coroutine's frame referred to each other) left 11 objects of cyclic garbage per turn: the collector
then ran every few hundred turns and the in-process cost of a turn was about a third higher (2026-12-07:
38 us against 27 us, ``docs/bench/2026-12-07-router-cpu-ab.md``). Reference counting frees everything a
turn makes now; this holds it so. The whole hot path runs in-process (the front door, the request
counter, ``invoke``, the route cache, the lease watch, the answer), the worker's answer given at once;
the directory is a real Redis."""

from __future__ import annotations

import pytest

from loadtest import hotpath_cost


async def test_turns_through_the_hot_path_leave_no_cyclic_garbage(redis_url: str) -> None:
    r = await hotpath_cost.measure(redis_url, turns=2000, repeats=1)  # raises if a turn is not answered 200
    assert r["cyclic_per_turn"] < 0.1, f"{r['cyclic_per_turn']:.1f} objects of cyclic garbage per turn"
    assert r["us_per_turn_min"] > 0


def test_the_command_refuses_counts_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        hotpath_cost.main(["-n", "0"])
    assert e.value.code == 2 and "--turns and --repeats must be at least 1" in capsys.readouterr().err


async def test_a_create_and_a_delete_send_seven_redis_round_trips_each(redis_url: str) -> None:
    """The control plane's create and delete, in-process on a stand-in worker (``hotpath_cost --create``):
    a create sent 8 round trips (its tenant's index entry in one of its own) and a delete 9 (the record
    read twice, once to check its owner and once to delete it; its tenant's index entry apart); both are
    7 now. A step added to either path shows here (the bound leaves room for the odd round trip of a
    process-wide task that falls within a create, not for one more per create)."""
    import redis.asyncio as aioredis

    import uuid

    prefix = f"createcost{uuid.uuid4().hex[:8]}"
    # raises on a 201/204 missed
    r = await hotpath_cost.measure_create(redis_url, sessions=40, repeats=1, key_prefix=prefix)
    assert r["round_trips_per_create"] < 7.5, r
    assert r["round_trips_per_delete"] < 7.5, r
    assert r["cpu_us_per_create"] > 0 and r["cpu_us_per_delete"] > 0
    # its keys are gone from the (maybe shared) Redis: each run had left ~190 (deleted sessions' epochs)
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert [k async for k in client.scan_iter(f"{prefix}:*", count=1000)] == []
    finally:
        await client.aclose()
