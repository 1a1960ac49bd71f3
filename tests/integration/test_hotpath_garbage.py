"""A turn through the router's hot path leaves no reference cycles behind (``loadtest.hotpath_cost``).

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
