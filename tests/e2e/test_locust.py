"""``loadtest/locustfile.py`` (the README's Locust load test) against a real runtime: a short headless run
of every user class has no failure (counters, notebooks, churn: any lost state is a Locust failure) and
leaves no session behind (a fresh-user run: 2 ``lt-*`` sessions were left after a 60 s run, created by
users stopped mid-create)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_locust_run_has_no_failure_and_leaves_no_session(runtime_factory, tmp_path):
    rt = runtime_factory(replicas=1, slots=8)
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "8", "-r", "8",
         "-t", "8s", "--host", rt.url, "--only-summary", "--csv", str(tmp_path / "lt"),
         "--exit-code-on-error", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={"PATH": "/usr/bin:/bin", "SUBSTRATE_TIME_COMPRESSION": "600", "HOME": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    stats = (tmp_path / "lt_stats.csv").read_text()
    assert "[create counter]" in stats and "[create notebook]" in stats, stats  # every kind of user ran
    assert rt.client.list_sessions()["items"] == [], "every session a user made is deleted when it stops"


@pytest.mark.parametrize("env, says", [
    ({"SUBSTRATE_LOAD_SHAPE": "bogus"}, "SUBSTRATE_LOAD_SHAPE='bogus': the one shape is 'burst'"),
    ({"SUBSTRATE_LOAD_SHAPE": "burst", "SUBSTRATE_BURST_PEAK_USERS": "x"}, "SUBSTRATE_BURST_PEAK_USERS='x' is not a number"),
    ({"SUBSTRATE_LOAD_SHAPE": "burst", "SUBSTRATE_BURST_PERIOD_S": "-5"}, "SUBSTRATE_BURST_PERIOD_S='-5' is not a number"),
])
def test_a_bad_load_shape_setting_stops_the_locustfile_with_one_line(env, says):
    """Fresh-user round 10: a bad value was ignored without a word (the default shape or number used)."""
    p = subprocess.run([sys.executable, "-c", "import loadtest.locustfile"], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_dead_host_is_failed_creates_not_a_traceback_per_user():
    """Fresh-user round 10: each user whose session could not be created logged a StopUser traceback."""
    from substrate.netports import free_port

    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "4", "-r", "4",
         "-t", "3s", "--host", f"http://127.0.0.1:{free_port()}", "--only-summary", "--exit-code-on-error", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, "the failed creates fail the run"
    assert "Traceback" not in p.stdout + p.stderr and "/v1/sessions [create" in p.stdout + p.stderr
