"""The wake's phases: the worker's own (``workers.server._phases_ms``), carried by its activation answer
(``substrate.activator.worker_phases``) into the woken answer's ``Server-Timing`` (``api.proxy.server_timing``)
and summed up by ``make bench`` (``loadtest.bench.phase_medians``)."""

from __future__ import annotations

from api.proxy import server_timing
from loadtest.bench import phase_medians
from substrate.activator import Route, worker_phases
from workers.server import _phases_ms


def test_each_worker_phase_is_its_own_time_in_order():
    got = _phases_ms(10.0, [("sandbox", 10.0001), ("restore", 10.0151), ("recheck", 10.016), ("agent", 10.018)])
    assert list(got) == ["sandbox", "restore", "recheck", "agent"]  # the order the worker went through them
    assert got == {"sandbox": 0.1, "restore": 15.0, "recheck": 0.9, "agent": 2.0}
    assert _phases_ms(1.0, [("sandbox", 1.0002), ("agent", 1.0032)]) == {"sandbox": 0.2, "agent": 3.0}  # a new session


def test_the_router_takes_only_well_formed_phases_from_a_worker():
    assert worker_phases({"phasesMs": {"sandbox": 0.1, "restore": 14}}) == (("sandbox", 0.1), ("restore", 14.0))
    assert worker_phases({"session": "s"}) == ()  # an older worker sends none
    assert worker_phases({"phasesMs": [1, 2]}) == () and worker_phases(None) == ()
    # a name that could break the header, or a value that is not a number, is dropped (never a failed wake)
    assert worker_phases({"phasesMs": {"a,b": 1, "x;dur=9": 2, "ok": "3", "flag": True, "y": 1.5}}) == (("y", 1.5),)


def test_server_timing_puts_the_activation_parts_after_it():
    route = Route("w1", "http://w1", 3, place_ms=0.42, activate_ms=21.0,
                  phases_ms=(("sandbox", 0.1), ("restore", 15.0), ("running", 0.7)))
    assert server_timing(24.0, route) == ("place;dur=0.4, activate;dur=21.0, sandbox;dur=0.1, restore;dur=15.0, "
                                          "running;dur=0.7, wake;dur=24.0")
    # another router's wake followed: only the wait, no phases of a wake this router did not make
    assert server_timing(5.0, Route("w1", "http://w1", 3, phases_ms=(("restore", 1.0),))) == "wake;dur=5.0"
    assert route == Route("w1", "http://w1", 3)  # timings are not part of a route's identity


def test_the_bench_row_gives_each_phase_median_without_the_whole():
    phases = {"place": [0.3, 0.5, 0.4], "restore": [10.0, 30.0, 14.0], "wake": [25.0, 50.0, 30.0], "agent": []}
    assert phase_medians(phases) == "place 0.4 · restore 14"
