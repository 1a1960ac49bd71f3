"""loadtest.bounds: what any runtime could achieve on a plan (inherent wait, fixed and reactive capacity)."""

from __future__ import annotations

import pytest

from loadtest import report as rpt
from loadtest.bounds import (ideal_schedule, others_running_at_starts, plan_bounds, render_bounds)


def _t(session, at, work):
    return {"session": session, "at_s": at, "work_s": work}


def test_ideal_schedule_runs_a_sessions_turns_one_at_a_time():
    waits, intervals = ideal_schedule([_t("a", 0.0, 1.0), _t("a", 0.5, 1.0), _t("b", 0.5, 0.2),
                                       {"session": "c", "at_s": None, "work_s": 1.0}])
    # a's second turn arrives at 0.5 while the first runs until 1.0: it waits 0.5 s
    assert sorted(waits) == [0.0, 0.0, 0.5]
    assert sorted(intervals) == [(0.0, 1.0), (0.5, 0.7), (1.0, 2.0)]


def test_others_running_counts_ties_once_and_frees_a_slot_at_its_end():
    # two starts at the same instant: the second sees the first; a turn starting exactly when another
    # ends does not count it
    assert others_running_at_starts([(0.0, 1.0), (0.0, 1.0), (1.0, 2.0), (1.5, 3.0)]) == [0, 1, 0, 1]


def test_plan_bounds_fixed_and_reactive_capacity():
    # 100 turns of one session each, 0.1 s of work, one every second, plus a burst of 3 at t = 50.5
    turns = [_t(f"s{i}", float(i), 0.1) for i in range(100)] + [_t(f"b{i}", 50.5, 0.1) for i in range(3)]
    b = plan_bounds(turns)
    assert b["turns"] == 103
    assert b["busy_s"] == pytest.approx(10.3)
    assert b["span_s"] == pytest.approx(99.1)
    assert b["waiting_share"] == 0 and b["inherent_wait_ms"]["p99"] == 0
    shares = {r["slots"]: r["no_free_slot_share"] for r in b["fixed"]}
    # 1 slot: two of the burst find it busy; 2 slots: one does; 3 slots: none
    assert shares[1] == pytest.approx(2 / 103) and shares[2] == pytest.approx(1 / 103)
    assert shares[3] == 0
    assert b["c99"] == 2  # 1/103 <= 1 %
    assert b["c99_utilization_max"] == pytest.approx(10.3 / (2 * 99.1))
    rows = {(r["delay_s"], r["spare"]): r for r in b["reactive"]}
    # a 10 ms scale-down delay with no spare: every turn needs a scale-up, and capacity follows the turns
    assert rows[(0.01, 0)]["scale_up_share"] == 1.0
    assert rows[(0.01, 0)]["utilization"] > 0.85
    # one spare slot: only the two burst turns beyond the first need one
    assert rows[(0.01, 1)]["scale_up_share"] == pytest.approx(2 / 103)
    # a longer delay holds more capacity: lower utilization
    assert rows[(1.0, 0)]["utilization"] < rows[(0.01, 0)]["utilization"]


def test_reactive_bounds_in_workers_of_several_slots():
    # the same plan; capacity that comes a whole 2-slot worker at a time holds a second slot beside each
    # lone turn: about half the utilization, and one spare slot rounds up to a whole worker
    turns = [_t(f"s{i}", float(i), 0.1) for i in range(100)] + [_t(f"b{i}", 50.5, 0.1) for i in range(3)]
    b = plan_bounds(turns, worker_slots=(2, 1, 2))
    rows = {(r["delay_s"], r["spare"], r["worker_slots"]): r for r in b["reactive"]}
    assert {r["worker_slots"] for r in b["reactive"]} == {1, 2}
    assert rows[(0.01, 0, 2)]["utilization"] == pytest.approx(rows[(0.01, 0, 1)]["utilization"] / 2, rel=0.05)
    assert rows[(0.01, 0, 2)]["scale_up_share"] == 1.0
    # k = 1 in 2-slot workers keeps 2 slots: only the burst's third turn finds none free (1-slot: two do)
    assert rows[(0.01, 1, 2)]["scale_up_share"] == pytest.approx(1 / 103)
    assert rows[(0.01, 1, 1)]["scale_up_share"] == pytest.approx(2 / 103)
    md = "\n".join(render_bounds(b))
    assert "| slots per worker S |" in md and "| 0.01 | 1 | 2 |" in md
    with pytest.raises(ValueError, match="worker_slots"):
        plan_bounds(turns, worker_slots=(0,))


def test_plan_bounds_inherent_wait_is_a_floor():
    # one session whose turns overlap: the second waits 0.9 s behind the first, whatever the runtime
    b = plan_bounds([_t("a", 0.0, 1.0), _t("a", 0.1, 1.0)])
    assert b["waiting_share"] == 0.5
    assert b["inherent_wait_ms"]["p99"] == pytest.approx(0.99 * 900.0)


def test_plan_bounds_empty_and_bad_grid():
    assert plan_bounds([]) is None
    assert render_bounds(None) == []
    with pytest.raises(ValueError, match="grid_s"):
        plan_bounds([_t("a", 0.0, 1.0)], grid_s=0)


def test_the_replay_report_prints_the_bounds():
    from tests.unit.test_replay_report import canned_result

    md = rpt.render_markdown(canned_result())
    assert "What the plan allows" in md and "inherent wait behind the session's previous turn" in md
    assert "fewest with at most 1 % of turns finding none free" in md


def test_dry_run_prints_the_bounds(capsys):
    from loadtest.replay import main
    from tests.unit.test_replay_report import FIXTURE

    assert main([str(FIXTURE), "--dry-run", "--compress", "100"]) == 0
    assert "What the plan allows" in capsys.readouterr().out


def test_bound_worker_sizes_from_the_replay_config():
    from loadtest.bounds import bound_worker_sizes

    assert bound_worker_sizes({"ours_worker_slots": 6}) == (1, 6)
    assert bound_worker_sizes({"ours_worker_slots": 1}) == (1,)
    assert bound_worker_sizes({}) == (1,) and bound_worker_sizes({"ours_worker_slots": "6"}) == (1,)


def test_template_facts_of_an_unreachable_host_are_unknown():
    import asyncio

    from loadtest.replay import template_facts
    from substrate.netports import free_port

    assert asyncio.run(template_facts(f"http://127.0.0.1:{free_port()}", "counter", None)) == (None, None)
