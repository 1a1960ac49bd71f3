"""``substrate-replay`` refuses to run what cannot mean anything, and stops when its host is gone
(fresh-user round 10): option values that ran no turn (``--retries -1``, ``--concurrency 0``) and passed
``--strict``; a missing token or an unknown template that failed every turn of the plan, exit 0; a
runtime killed mid-run replayed against to the end of the plan, exit 0."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from loadtest.replay import HOST_GONE_S
from loadtest.replay import main as replay_main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "loadtest" / "fixtures" / "gentd26_small.csv"


@pytest.mark.parametrize("option, value, says", [
    ("--retries", "-1", "--retries must be at least 0, not -1"),
    ("--concurrency", "0", "--concurrency must be at least 1, not 0"),
    ("--overlay", "0", "--overlay must be at least 1, not 0"),
    ("--overlay", "-2", "--overlay must be at least 1"),
    ("--max-sessions", "0", "--max-sessions must be at least 1"),
    ("--compress", "0", "--compress must be more than 0"),
    ("--compress", "nan", "--compress must be more than 0, not nan"),
    ("--duration", "0", "--duration must be more than 0"),
    ("--duration", "soon", "--duration: bad duration 'soon'"),
    ("--max-wall", "0s", "--max-wall must be more than 0"),
    ("--request-timeout", "-3", "--request-timeout must be more than 0"),
])
def test_an_option_value_that_cannot_mean_anything_is_refused(option, value, says, capsys):
    with pytest.raises(SystemExit) as e:
        replay_main([str(FIXTURE), "--dry-run", option, value])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_an_unknown_template_or_missing_credentials_stop_it_before_the_plan_runs(runtime_factory, tmp_path, capsys):
    key = "sk_replay01_" + "k" * 40
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_AUTH__API_KEYS": json.dumps(
        [{"tenant": "ops", "key": key, "admin": True}])})
    base = [str(FIXTURE), "--host", rt.url, "--compress", "2000", "--no-progress", "--out", str(tmp_path / "r")]
    assert replay_main([*base, "--template", "counter"]) == 2
    assert "refused the credentials (401 unauthorized): pass --token" in capsys.readouterr().err
    assert replay_main([*base, "--token", key, "--template", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "has no ActorTemplate 'nosuch' (it has: " in err and "counter" in err
    assert not (tmp_path / "r").exists() and rt.client.http.get(
        "/v1/sessions", headers={"Authorization": f"Bearer {key}"}).json()["items"] == [], "nothing ran"


def test_a_host_that_dies_mid_run_stops_the_replay_and_fails_it(runtime_factory, tmp_path, capsys):
    rt = runtime_factory(replicas=1, slots=4)
    out = tmp_path / "r"
    got: list[int] = []
    # the fixture at 200x plans about 441 s of wall time: the run is cut by the host's death, not its end
    t = threading.Thread(target=lambda: got.append(replay_main(
        [str(FIXTURE), "--host", rt.url, "--template", "counter", "--compress", "200", "--no-progress",
         "--out", str(out), "--strict"])))
    t.start()
    rt.wait_for(lambda: bool(rt.client.list_sessions()["items"]), 60, "the replay under way")
    rt.proc.kill()
    t.join(120)  # far below the plan's 441 s: it ended because the host was gone
    assert got == [1], "a replay whose host died fails, and ends"
    result = json.loads((out / "result.json").read_text())
    ours = result["targets"]["ours"]
    assert ours["stopped_by"] == "host_unreachable"
    assert ours["summary"]["turns_run"] < ours["summary"]["turns_planned"]
    assert f"refused connections for {HOST_GONE_S:g} s: stopping" in capsys.readouterr().err


def test_a_short_trace_cut_in_its_final_idle_hold_says_every_turn_ran(runtime_factory, tmp_path, capsys):
    """Fresh-user round 13: a plain trace of 25 s at --compress 1 planned 1,825 s (each session is deleted
    its idle split, 30 min, after its last turn); cut by --max-wall at 50 s with 80 of 80 turns run, the
    report said "Partial run". The plan now says where its wall time goes, and a cut that only shortened
    the final idle hold is said as such."""
    rt = runtime_factory(replicas=1, slots=4)
    trace = tmp_path / "short.csv"
    trace.write_text("session_id,arrival_s,duration_s\n" + "".join(
        f"s{i},{0.3 * j + 0.1 * i},0.05\n" for i in range(3) for j in range(3)))
    out = tmp_path / "r"
    code = replay_main([str(trace), "--host", rt.url, "--template", "counter", "--compress", "1", "--no-progress",
                        "--max-wall", "8s", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "the last turn ends at" in printed and "--idle-split shortens that tail" in printed, printed
    ours = json.loads((out / "result.json").read_text())["targets"]["ours"]
    assert ours["stopped_by"] == "wall_cap_in_final_idle"
    assert ours["summary"]["turns_run"] == ours["summary"]["turns_planned"] == 9
    report = (out / "report.md").read_text()
    assert "**Every turn ran**" in report and "**Partial run**" not in report
