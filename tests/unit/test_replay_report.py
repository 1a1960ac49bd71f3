"""Replay planning, response checks, report arithmetic and report files (pure, no server)."""

from __future__ import annotations

import math

import json
from pathlib import Path

import pytest

from loadtest import report as rpt
from loadtest.bench_report import format_cell, markdown_table, write_table
from loadtest.replay import (
    build_plan,
    check_count,
    classify,
    extract_count,
    label_value,
    main,
    retry_after_s,
    server_timing_ms,
    write_outputs,
)
from loadtest.traces import TraceError, Turn

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "loadtest" / "fixtures" / "sessions_small.csv"


# ------------------------------------------------------------------------------------ percentiles


def test_percentile_interpolates_like_numpy():
    xs = list(range(1, 101))
    assert rpt.percentile(xs, 50) == pytest.approx(50.5)
    assert rpt.percentile(xs, 99) == pytest.approx(99.01)
    assert rpt.percentile(xs, 95) == pytest.approx(95.05)
    assert rpt.percentile(xs, 0) == 1
    assert rpt.percentile(xs, 100) == 100
    assert rpt.percentile([3, 1, 2], 50) == 2  # unsorted input
    assert rpt.percentile([7.0], 99) == 7.0
    assert rpt.percentile([], 50) is None
    with pytest.raises(ValueError):
        rpt.percentile([1, 2], 101)


def test_latency_stats():
    s = rpt.latency_stats([10.0, 20.0, 30.0, 40.0])
    assert s == {"n": 4, "p50": pytest.approx(25.0), "p95": pytest.approx(38.5), "p99": pytest.approx(39.7),
                 "mean": 25.0, "max": 40.0}
    assert rpt.latency_stats([]) == {"n": 0, "p50": None, "p95": None, "p99": None, "mean": None, "max": None}


# ------------------------------------------------------------------------------------ capacity / cost


def test_cost_from_the_server_counters_and_sampled_fallback():
    samples = [{"t_s": 0.0, "slotSeconds": 100.0, "processSeconds": 20.0, "workerSeconds": 10.0},
               {"t_s": 5.0, "slotSeconds": 160.0, "processSeconds": 30.0, "workerSeconds": 19.0}]
    c = rpt.cost_from_stats(samples)
    assert (c["slot_seconds"], c["process_seconds"], c["worker_seconds"]) == (60.0, 10.0, 9.0)
    assert c["slot_seconds_source"] == "stats.slotSeconds"
    sampled = [{"t_s": 0.0, "slots": 6, "workers": 1}, {"t_s": 2.0, "slots": 12, "workers": 2},
               {"t_s": 3.0, "slots": 0, "workers": 0}]
    c = rpt.cost_from_stats(sampled)
    assert c["slot_seconds"] == 6 * 2 + 12 * 1 and c["slot_seconds_source"].startswith("integrated")


def test_density_is_time_averaged_alive_sessions_per_provisioned_slot():
    sessions = [{"created_s": 0.0, "deleted_s": 10.0}, {"created_s": 5.0, "deleted_s": None},
                {"created_s": None}]
    assert rpt.alive_session_seconds(sessions, ended_s=20.0) == 10 + 15
    assert rpt.alive_session_seconds([{"start_s": 0}], 5.0) is None


def test_baseline_holds():
    holds = rpt.baseline_holds(2.0, 200.0)
    assert [h for _, h in holds] == [0.0, 2.0, 1.5, 9.0]
    assert "idle timeout (400 s)" in holds[1][0]
    assert len(rpt.baseline_holds(None, 200.0)) == 3


def test_worker_seconds_prefers_the_server_counter():
    samples = [
        {"t_s": 0.0, "workers": 1, "workerSeconds": 100.0},
        {"t_s": 1.0, "workers": 3, "workerSeconds": 101.0},
        {"t_s": 2.0, "workers": 3, "workerSeconds": 104.0},
    ]
    assert rpt.worker_seconds_from_stats(samples) == (pytest.approx(4.0), "stats.workerSeconds")


def test_worker_seconds_integrates_workers_without_the_counter():
    samples = [{"t_s": 0.0, "workers": 1}, {"t_s": 2.0, "workers": 3}, {"t_s": 3.0, "workers": 2},
               {"t_s": 5.0, "workers": 0}]
    # 1 worker for 2 s + 3 for 1 s + 2 for 2 s
    assert rpt.worker_seconds_from_stats(samples) == (pytest.approx(2 + 3 + 4), "integrated stats.workers")
    assert rpt.worker_seconds_from_stats([{"t_s": 0, "workers": None}]) == (None, None)


def test_analytical_baseline_from_a_plan():
    turns = [
        Turn("a", 1000, 100), Turn("a", 1300, 200),  # one session: 1000 -> 1500, + idle split 600
        Turn("b", 1100, 50),  # 1100 -> 1150 + 600
        Turn("a", 3000, 10),  # gap 1500 > 600: second session of a, 3000 -> 3010 + 600
    ]
    plan = build_plan(turns, compress=10, idle_split_s=600, run_id="t")
    holds_trace = [1500 + 600 - 1000, 1150 + 600 - 1100, 3010 + 600 - 3000]
    assert [round(s.hold_s, 9) for s in plan.sessions] == pytest.approx([h / 10 for h in holds_trace])
    assert plan.baseline_worker_seconds == pytest.approx(sum(holds_trace) / 10)
    assert rpt.analytical_baseline_worker_seconds([1.0, 2.5, -1.0]) == 3.5
    assert rpt.session_hold_s(10, 25, 30) == 45


def test_clipped_holds_only_count_the_time_run():
    sessions = [{"start_s": 0.0, "end_s": 10.0}, {"start_s": 5.0, "end_s": 50.0}, {"start_s": 30.0, "end_s": 40.0}]
    assert rpt.clipped_holds_s(sessions, 1000) == 10 + 45 + 10
    assert rpt.clipped_holds_s(sessions, 20) == 10 + 15 + 0


# ------------------------------------------------------------------------------------ plan


def test_build_plan_compresses_and_names_sessions():
    turns = [Turn("a", 500, 20), Turn("b", 510, 30, ok=False), Turn("a", 560, 10)]
    plan = build_plan(turns, compress=100, idle_split_s=1800, run_id="abc")
    assert [s.id for s in plan.sessions] == ["rp-abc-00000", "rp-abc-00001"]
    a, b = plan.sessions
    assert (a.key, a.start_s, [t.at_s for t in a.turns], [t.work_s for t in a.turns]) == (
        "a#0", 0.0, [0.0, 0.6], [0.2, 0.1])
    assert a.end_s == pytest.approx(0.7 + 18.0)
    assert b.turns[0].trace_ok is False and b.turns[0].work_s == pytest.approx(0.3)
    assert plan.turns == 3 and plan.owners == 2 and plan.trace_failed_turns == 1
    assert plan.wall_span_s == pytest.approx(max(a.end_s, b.end_s))
    skipped = build_plan(turns, compress=100, idle_split_s=1800, failed_turns="skip")
    assert skipped.turns == 2 and skipped.trace_failed_turns == 0
    capped = build_plan(turns, compress=100, idle_split_s=1800, max_sessions=1)
    assert [s.key for s in capped.sessions] == ["a#0"]
    with pytest.raises(ValueError):
        build_plan(turns, compress=0, idle_split_s=1)


# ------------------------------------------------------------------------------------ responses


def test_check_count_detects_resets_and_tolerates_unanswered_increments():
    assert check_count(1, 0, 0) == ("ok", (1, 1))
    assert check_count(5, 4, 0) == ("ok", (5, 5))
    assert check_count(1, 4, 0) == ("lost_state", (5, 5))  # reset
    assert check_count(4, 4, 0) == ("lost_state", (5, 5))  # increment lost
    assert check_count(7, 4, 0) == ("lost_state", (5, 5))  # replayed increments
    assert check_count(6, 4, 1) == ("ok", (5, 6))  # the failed turn did land
    assert check_count(5, 4, 1) == ("ok", (5, 6))  # ... or did not
    assert check_count(None, 4, 0) == ("error", (5, 5))


def test_extract_count():
    assert extract_count({"output": {"count": 3}}) == 3
    assert extract_count({"output": 4}) == 4
    assert extract_count({"output": {"count": 2.0}}) == 2
    assert extract_count({"output": {"count": True}}) is None
    assert extract_count({"output": {"stdout": "x"}}) is None
    assert extract_count(None) is None


def test_classify_wake_vs_warm():
    assert classify({"output": {}, "session": {"woke": True, "wake_ms": 12.5, "state_before": "SUSPENDED"}}, {}) == (
        "wake", True, 12.5, "SUSPENDED")
    assert classify({"output": {}, "session": {"woke": False, "state_before": "RUNNING"}}, {}) == (
        "warm", False, None, "RUNNING")
    # early builds: no session block, only the header
    assert classify({"output": {}}, {"X-Substrate-Woke": "1", "X-Substrate-Wake-Ms": "33.0"}) == (
        "wake", True, 33.0, None)
    assert classify({"output": {}}, {}) == ("warm", None, None, None)
    # a request that found the session still starting counts as a wake (cold path), not warm
    assert classify({"output": {}, "session": {"woke": False, "state_before": "STARTING"}}, {})[0] == "wake"


def test_server_timing_gives_every_phase_in_order():
    h = {"Server-Timing": "place;dur=0.4, activate;dur=20, sandbox;dur=0.1, restore;dur=14.5, wake;dur=24"}
    assert list(server_timing_ms(h).items()) == [("place", 0.4), ("activate", 20.0), ("sandbox", 0.1),
                                                 ("restore", 14.5), ("wake", 24.0)]
    assert server_timing_ms({}) == {} and server_timing_ms(None) == {}
    assert server_timing_ms({"Server-Timing": "wake;dur=9"}) == {"wake": 9.0}  # another router's wake followed
    # other servers' entries, descriptions and a broken figure are skipped, not fatal
    assert server_timing_ms({"Server-Timing": 'cdn;desc="edge", place;desc="x";dur=2, activate;dur=abc'}) == {
        "place": 2.0}


def test_small_helpers():
    assert retry_after_s("2") == 2.0
    assert retry_after_s("60") == 5.0  # capped
    assert retry_after_s(None) == 1.0 and retry_after_s("soon") == 1.0
    assert label_value("repo/x:1 y") == "repo-x-1-y"
    assert label_value("__") == "x"
    assert len(label_value("a" * 100)) == 63


# ------------------------------------------------------------------------------------ canned result


def _turn(session, i, *, kind="warm", added=5.0, status="ok", http=200, sent=1.0, work=0.1, trace_ok=True):
    served = http == 200
    return {"session": session, "i": i, "at_s": sent, "sent_s": sent, "done_s": sent, "queue_s": 0.0, "work_s": work,
            "trace_ok": trace_ok, "status": status, "http": http,
            "latency_ms": (added + work * 1000) if served else None, "added_ms": added if served else None,
            "kind": kind if served else None, "woke": (kind == "wake") if served else None,
            "wake_ms": (added - 2) if served and kind == "wake" else None, "state_before": None,
            "place_ms": (added / 4) if served and kind == "wake" else None,
            "activate_ms": (added / 2) if served and kind == "wake" else None,
            "restore_ms": (added / 3) if served and kind == "wake" else None,
            "sandbox_ms": (added / 10) if served and kind == "wake" else None,
            "agent_ms": (added / 20) if served and kind == "wake" else None,
            "worker": "w1", "epoch": 1, "count": i + 1 if served else None, "expected": [i + 1, i + 1],
            "retries": 0, "error": None if status in ("ok", "lost_state") else "boom"}


def canned_result(with_baseline: bool = False) -> dict:
    turns = [
        _turn("s0", 0, added=4.0, sent=0.5),
        _turn("s0", 1, added=6.0, sent=12.0),
        _turn("s0", 2, kind="wake", added=80.0, sent=25.0),
        _turn("s1", 0, added=5.0, sent=3.0, trace_ok=False),
        {**_turn("s1", 1, kind="wake", added=120.0, sent=30.0, status="lost_state"), "restored": "agent_restarted"},
        _turn("s1", 2, status="error", http=500, sent=31.0),
        _turn("s2", 0, status="timeout", http=None, sent=2.0),
        _turn("s2", 1, status="not_run", http=None, sent=None),
    ]
    sessions = [
        {"id": f"s{i}", "key": f"o{i}#0", "owner": f"o{i}", "start_s": float(i), "end_s": 40.0 + i,
         "last_end_s": 10.0 + i, "created_s": float(i) if i < 2 else None, "deleted_s": 40.0 + i if i < 2 else None,
         "hold_s": 40.0, "turns": 3 if i < 2 else 2, "created": i < 2, "create_ms": 3.0 if i < 2 else None,
         "create_http": 201 if i < 2 else 503, "create_retries": 0, "deleted": i < 2, "final_count": None,
         "error": None}
        for i in range(3)
    ]
    stats = [{"t_s": float(t), "inflight": t % 3, "alive": 2, "ok": True, "workers": 1 if t < 20 else 2,
              "slots": 4 if t < 20 else 8, "slotsUsed": 1, "sessions": {"RUNNING": 1, "SUSPENDED": 1},
              "workerSeconds": 1000.0 + (t if t <= 20 else 20 + 2 * (t - 20)),
              "slotSeconds": 5000.0 + 4 * (t if t <= 20 else 20 + 2 * (t - 20)),
              "processSeconds": 2000.0 + 2 * t} for t in range(43)]
    ours = {"name": "ours", "host": "http://ours", "wall_s": 43.0, "stopped_by": "done", "ended_s": 43.0,
            "turns": turns, "sessions": sessions, "stats": stats}
    ours["summary"] = rpt.summarize_target(turns, sessions, stats, 43.0)
    result = {
        "schema": "substrate-replay/v1",
        "config": {"trace": "/x/trace.csv", "format": "plain", "compress": 100.0, "window_start_s": 0.0,
                   "window_start_utc": None, "duration_s": None, "idle_split_s": 1800.0,
                   "ours_idle_timeout_s": 2.0},
        "plan": {"sessions": 3, "turns": 8, "owners": 3, "trace_failed_turns": 1, "wall_span_s": 42.0,
                 "baseline_worker_seconds": 999.0},
        "targets": {"ours": ours},
    }
    if with_baseline:
        bturns = [_turn("s0", i, added=a, sent=float(i)) for i, a in enumerate([2.0, 3.0, 50.0])]
        bstats = [{"t_s": float(t), "workers": 3, "slots": 3, "alive": 3, "workerSeconds": 10.0 + 3 * t,
                   "slotSeconds": 10.0 + 3 * t, "processSeconds": 10.0 + 4 * t} for t in range(43)]
        base = {"name": "baseline", "host": "http://base", "wall_s": 43.0, "stopped_by": "done", "ended_s": 43.0,
                "turns": bturns, "sessions": sessions, "stats": bstats}
        base["summary"] = rpt.summarize_target(bturns, sessions, bstats, 43.0)
        result["targets"]["baseline"] = base
    result.update(rpt.compare(result))
    return result


def test_summarize_target_counts_and_latencies():
    s = canned_result()["targets"]["ours"]["summary"]
    assert s["lost_state_reported"] == 1, "the lost turn's answer said its state came back older"
    assert (s["turns_planned"], s["turns_run"], s["ok"], s["errors"], s["lost_state"], s["not_run"]) == (
        8, 7, 4, 2, 1, 1)
    assert s["errors_by_kind"] == {"error:500": 1, "timeout:-": 1}
    assert s["trace_failed"] == 1
    assert (s["warm"], s["wake"]) == (3, 2)
    assert s["warm_hit_rate"] == pytest.approx(3 / 5)
    assert s["added_ms"]["warm"]["p50"] == pytest.approx(5.0)
    assert s["added_ms"]["wake"]["p99"] == pytest.approx(80 + 0.99 * 40)
    # the two failures are in the tail as +inf: 7 values, p99 is a failure, p50 is not
    assert s["added_ms"]["all"]["n"] == 7
    assert s["added_ms"]["all"]["p99"] == math.inf and s["added_ms"]["all"]["p50"] == pytest.approx(80.0)
    assert s["server_wake_ms"]["p50"] == pytest.approx((78.0 + 118.0) / 2)
    assert s["wake_place_ms"]["p50"] == pytest.approx((80.0 + 120.0) / 8)
    assert s["wake_activate_ms"]["n"] == 2 and s["wake_activate_ms"]["p50"] == pytest.approx(50.0)
    assert s["wake_restore_ms"]["n"] == 2 and s["wake_restore_ms"]["p50"] == pytest.approx(100.0 / 3)
    assert s["wake_sandbox_ms"]["n"] == 2 and s["wake_sandbox_ms"]["p50"] == pytest.approx(10.0)
    assert s["wake_agent_ms"]["n"] == 2 and s["wake_agent_ms"]["p50"] == pytest.approx(5.0)
    assert s["sessions"] == {"planned": 3, "created": 2, "create_failed": 1,
                             "create_ms": rpt.latency_stats([3.0, 3.0])}
    cap = s["capacity"]
    assert (cap["peak_slots"], cap["peak_workers"], cap["peak_inflight"]) == (8, 2, 2)
    cost = s["cost"]
    # slotSeconds grows 4/s to t=20 then 8/s to t=42; busy = the work of the 7 turns sent (0.1 s each)
    assert cost["slot_seconds"] == pytest.approx(4 * (20 + 2 * 22))
    assert cost["process_seconds"] == pytest.approx(2 * 42)
    assert cost["busy_slot_seconds"] == pytest.approx(7 * 0.1)
    assert cost["utilization"] == pytest.approx(0.7 / 256)
    assert cost["density"] == pytest.approx((40 + 40) / 256)  # sessions alive [0,40] and [1,41]
    assert s["worker_seconds"] == pytest.approx(20 + 2 * 22)
    assert s["worker_seconds_source"] == "stats.workerSeconds"


def test_compare_reports_the_analytical_baseline_for_every_hold():
    r = canned_result()
    holds = r["baseline"]["holds"]
    assert [h["hold_wall_s"] for h in holds] == [0.0, 2.0, 3.0, 18.0]  # compress 100
    # sessions [0, 10], [1, 11], [2, 12] (+ L) all inside ended_s = 43
    assert holds[0]["slot_seconds"] == pytest.approx(30.0)
    assert holds[3]["slot_seconds"] == pytest.approx(30.0 + 3 * 18)
    assert holds[0]["slot_ratio"] == pytest.approx(30.0 / 256)
    assert holds[0]["process_ratio"] == pytest.approx(30.0 / 84)
    assert holds[0]["utilization"] == pytest.approx(0.7 / 30)
    assert r["baseline"]["measured"] is None


def test_compare_measured_baseline_ratios():
    r = canned_result(with_baseline=True)
    m = r["baseline"]["measured"]
    assert m["mode"] == "measured"
    assert m["slot_seconds"] == pytest.approx(3 * 42)
    assert m["slot_ratio"] == pytest.approx(126 / 256)
    assert m["process_ratio"] == pytest.approx(168 / 84)
    assert rpt.ratio(1.0, 0.0) is None and rpt.ratio(None, 1.0) is None


def test_render_markdown_reports_the_figures():
    md = rpt.render_markdown(canned_result())
    assert "| lost_state | 1 (1 reported by X-Substrate-Restored) |" in md
    assert "| errors | 2 (error:500 x1, timeout:- x1) |" in md
    assert "| warm-hit rate | 60.0 % |" in md
    assert "| added ms all (failures = inf) p50 / p99 | 80.0 / inf (failures) |" in md
    assert "turn wait ms p50 / p95 / p99" in md and "turn wait s " not in md  # in ms like its neighbours
    assert "| L = 0 | 30.0 | 30.0 |" in md
    assert "of which the worker's sandbox (taking the slot's) p50 / p95 / p99 |" in md
    assert "of which the agent's start p50 / p95 / p99 |" in md
    assert "Definitions:" in md and "paired differences" in md
    assert "Partial run" not in md
    md2 = rpt.render_markdown(canned_result(with_baseline=True))
    assert "measured" in md2 and "| ours | baseline |" in md2


def test_render_markdown_flags_a_partial_run():
    r = canned_result()
    r["targets"]["ours"]["stopped_by"] = "wall_cap"
    assert "**Partial run** (ours stopped by wall_cap)" in rpt.render_markdown(r)


def test_write_outputs_writes_json_markdown_and_png(tmp_path):
    result = canned_result(with_baseline=True)
    paths = write_outputs(result, tmp_path / "out")
    loaded = json.loads(paths["json"].read_text())
    assert loaded["schema"] == "substrate-replay/v1"
    assert loaded["baseline"]["holds"][0]["slot_seconds"] == pytest.approx(result["baseline"]["holds"][0]["slot_seconds"])
    assert loaded["targets"]["ours"]["summary"]["lost_state"] == 1
    assert paths["md"].read_text().startswith("## Trace replay: trace.csv (plain)")
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_plot_report_survives_an_empty_run(tmp_path):
    r = canned_result()
    r["targets"]["ours"]["turns"] = []
    r["targets"]["ours"]["stats"] = []
    out = rpt.plot_report(r, tmp_path / "empty.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------ CLI


def test_cli_dry_run_plans_without_a_server(capsys):
    assert main([str(FIXTURE), "--dry-run", "--compress", "100", "--idle-split", "30m"]) == 0
    out = capsys.readouterr().out
    assert "7 sessions / 4 owners / 10 turns (1 trace-failed)" in out
    # analytical hold (trace s): alice 50+1800, 2530+5-2000+1800; bob 125-5+1800, 2510-2500+1800;
    # carol 5+1800, 2140-2100+1800; dave 60+1800 -> /100 wall
    holds = [1850, 2335, 1920, 1810, 1805, 1840, 1860]
    assert f"{sum(holds) / 100:.1f} worker-seconds (wall)" in out


def test_cli_window_and_errors(capsys, tmp_path):
    assert main([str(FIXTURE), "--dry-run", "--start", "1900", "--duration", "700"]) == 0
    assert "-> 4 turns" in capsys.readouterr().out  # arrivals 2000, 2100, 2500, 2530
    assert main([str(tmp_path / "missing.csv"), "--dry-run"]) == 2
    assert main([str(FIXTURE), "--dry-run", "--start", "2024-01-01"]) == 2  # absolute start, relative trace


# ------------------------------------------------------------------------------------ bench table


def test_markdown_table():
    rows = [{"case": "warm", "p50_ms": 1.234, "n": 10}, {"case": "wake", "p50_ms": 41.5, "extra": True}]
    assert markdown_table(rows) == (
        "| case | p50_ms | n | extra |\n"
        "|---|---:|---:|---|\n"
        "| warm | 1.23 | 10 |  |\n"
        "| wake | 41.5 |  | yes |"
    )
    assert markdown_table([]) == ""
    assert markdown_table(rows, columns=["n"]) == "| n |\n|---:|\n| 10 |\n|  |"


def test_format_cell():
    assert [format_cell(v) for v in (None, False, 7, 1234.5, 123.4, 0.000123, "a|b")] == [
        "", "no", "7", "1,234", "123", "0.000123", "a\\|b"]


def test_write_table(tmp_path, capsys):
    text = write_table([{"a": 1}], tmp_path / "t.md", title="Bench")
    assert text == "## Bench\n\n| a |\n|---:|\n| 1 |"
    assert (tmp_path / "t.md").read_text() == text + "\n"
    assert capsys.readouterr().out.strip() == text


def test_overlay_lays_consecutive_windows_over_the_first():
    from loadtest.replay import overlay_windows

    turns = [Turn("a", 10.0, 1.0), Turn("b", 110.0, 2.0), Turn("a", 150.0, 1.0), Turn("c", 250.0, 1.0)]
    out = overlay_windows(turns, 0.0, 100.0, 2)
    assert [(t.session_owner, t.arrival_s) for t in out] == [("a", 10.0), ("b@1", 10.0), ("a@1", 50.0)]
    assert [t.duration_s for t in out] == [1.0, 2.0, 1.0], "durations are kept (not compressed)"
    with pytest.raises(TraceError):
        overlay_windows(turns, None, 100.0, 2)


def test_send_to_answer_latency_is_reported_beside_the_latency_from_arrival():
    t = _turn("s0", 0, added=50.0, sent=1.0)
    t["service_ms"] = 12.0 + t["work_s"] * 1000  # 38 ms of the 50 were spent waiting before the send
    s = rpt.summarize_target([t], [], [])
    assert s["added_ms"]["warm"]["p50"] == pytest.approx(50.0)
    assert s["service_added_ms"]["warm"]["p50"] == pytest.approx(12.0)
    assert s["service_added_ms"]["wake"]["n"] == 0


def test_write_outputs_keeps_the_results_without_matplotlib(tmp_path, monkeypatch, capsys):
    """A plain ``uv sync`` has no matplotlib: a whole replay's results must not be lost to the plot."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'", name="matplotlib")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    paths = write_outputs(canned_result(), tmp_path / "out")
    assert set(paths) == {"json", "md"}
    assert paths["json"].exists() and paths["md"].exists() and not (tmp_path / "out" / "report.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_a_window_that_misses_the_trace_is_an_error_also_in_a_dry_run(capsys):
    """Fresh-user run: an Azure trace with a GenTD26 date printed "-> 0 turns" and exited 0."""
    assert main([str(FIXTURE), "--dry-run", "--start", "999999", "--duration", "60"]) == 2
    assert "the window holds none of the trace's 10 turns" in capsys.readouterr().err


def test_added_over_the_ideal_runtime_keeps_passed_on_delay_and_leaves_out_the_traces_own_wait():
    """Session a: turn 0 arrives at 0 s with 1 s of work and is answered at 1.3 s (its create took
    0.3 s); turn 1 arrives at 0.5 s, 1 s of work, answered at 2.35 s. On the ideal runtime turn 1 would
    wait for turn 0 anyway (until 1.0 s) and end at 2.0 s: 350 ms added over it (the 300 ms the create
    passed on + 50 ms of its own), where "added" (latency - work) says 850 ms. A failed turn is +inf."""
    def t(i, at, work, done, *, kind="warm", status="ok", http=200):
        return {"session": "a", "i": i, "at_s": at, "sent_s": at, "done_s": done, "queue_s": 0.0, "work_s": work,
                "status": status, "http": http, "kind": kind if http == 200 else None,
                "added_ms": (done - at - work) * 1000 if http == 200 else None, "latency_ms": (done - at) * 1000}

    turns = [t(0, 0.0, 1.0, 1.3), t(1, 0.5, 1.0, 2.35, kind="wake"), t(2, 9.0, 0.1, 9.5, status="error", http=500)]
    s = rpt.summarize_target(turns, [], [], 10.0)
    assert s["added_ms"]["wake"]["p50"] == pytest.approx(850.0)
    assert s["over_ideal_ms"]["warm"]["p50"] == pytest.approx(300.0)
    assert s["over_ideal_ms"]["wake"]["p50"] == pytest.approx(350.0)
    assert s["over_ideal_ms"]["all"]["n"] == 3 and s["over_ideal_ms"]["all"]["max"] == math.inf
    rows = dict(rpt.target_rows(s))
    assert rows["added over the ideal runtime ms wake p50 / p95 / p99"] == "350 / 350 / 350"
    assert "added over the ideal runtime" in rpt.DEFINITIONS


LAG_EXPOSITION = """# HELP agent_substrate_event_loop_lag_seconds lag
# TYPE agent_substrate_event_loop_lag_seconds histogram
agent_substrate_event_loop_lag_seconds_bucket{le="0.001"} %d
agent_substrate_event_loop_lag_seconds_bucket{le="0.005"} %d
agent_substrate_event_loop_lag_seconds_bucket{le="0.01"} %d
agent_substrate_event_loop_lag_seconds_bucket{le="0.025"} %d
agent_substrate_event_loop_lag_seconds_bucket{le="+Inf"} %d
agent_substrate_event_loop_lag_seconds_count %d
agent_substrate_event_loop_lag_seconds_sum 1.0
# HELP agent_substrate_requests_total r
# TYPE agent_substrate_requests_total counter
agent_substrate_requests_total{route="x",code="200"} 5.0
"""


def test_event_loop_lag_share_counts_only_the_runs_own_probes() -> None:
    before = rpt.lag_buckets(LAG_EXPOSITION % (90, 95, 98, 99, 100, 100))
    after = rpt.lag_buckets(LAG_EXPOSITION % (150, 180, 190, 196, 200, 200))
    assert before[math.inf] == 100 and after[0.005] == 180
    lag = rpt.lag_share_over(before, after)
    # the run's 100 probes: 85 within 5 ms, 92 within 10, 97 within 25
    assert lag == {"n": 100, "over_ms": {"5": pytest.approx(0.15), "10": pytest.approx(0.08),
                                  "25": pytest.approx(0.03)}}
    assert rpt._lag_row(lag) == "15.0 % / 8.0 % / 3.0 % of 100"
    assert rpt.lag_share_over(None, None) is None
    assert rpt.lag_share_over(after, after) is None  # no probe in the run
    assert rpt.lag_buckets("# nothing here\n") == {}


def test_summary_carries_the_client_lag_probes() -> None:
    s = rpt.summarize_target([], [], [], client_lag_s=[0.001, 0.002, 0.050])
    assert s["client_lag_ms"]["n"] == 3 and s["client_lag_ms"]["max"] == pytest.approx(50.0)
    assert s["server_lag"] is None
    rows = dict(rpt.target_rows(s))
    assert rows["  event-loop lag of the replay client (it sends and times each turn) ms p50 / p99 / max"] \
        .endswith("/ 50.0")


def test_worker_lag_share_counts_the_runs_probes_from_the_stats_samples() -> None:
    """Workers come and go within a run: their probes reach the report as /v1/stats' workerLoopLag
    (counts since the directory was made), taken between the run's first and last sample with it."""
    samples = [{"t_s": 0, "workerLoopLag": None},  # an older runtime's sample, or a failed read
               {"t_s": 1, "workerLoopLag": {"probes": 50, "over5ms": 10, "over10ms": 5, "over25ms": 1}},
               {"t_s": 2},
               {"t_s": 9, "workerLoopLag": {"probes": 250, "over5ms": 30, "over10ms": 15, "over25ms": 5}}]
    lag = rpt.worker_lag_share(samples)
    assert lag == {"n": 200, "over_ms": {"5": pytest.approx(0.10), "10": pytest.approx(0.05),
                                  "25": pytest.approx(0.02)}}
    assert rpt.worker_lag_share(samples[:2]) is None  # one sample: no run to speak of
    s = rpt.summarize_target([], [], samples)
    assert s["worker_lag"] == lag
    rows = dict(rpt.target_rows(s))
    key = next(k for k in rows if "lag of the target's workers" in k)
    assert rows[key] == "10.0 % / 5.0 % / 2.0 % of 200"
