"""``python -m loadtest.bench``: values no benchmark can run with are refused before anything starts, and
each row with a target says whether it met it (fresh-user round 10: a traceback for ``--sizes-mib abc``,
rows of zeros for ``--repeats 0``, the replay left out without a word, targets beside misses unmarked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import bench


@pytest.mark.parametrize("argv, says", [
    (["--sizes-mib", "abc"], "--sizes-mib takes whole MiB separated by commas"),
    (["--sizes-mib", "-1"], "each size must be 1-4096 MiB"),
    (["--sizes-mib", "1,,16"], "--sizes-mib takes whole MiB"),
    (["--repeats", "0"], "--repeats must be at least 1, not 0"),
    (["-n", "-5"], "-n must be at least 1, not -5"),
    (["--wake-repeats", "1"], "--wake-repeats must be at least 2"),
    (["--repair-sessions", "0"], "--repair-sessions must be at least 1, not 0"),
    (["--replay", "/nonexistent.csv"], "--replay /nonexistent.csv: no such file (or --skip-replay)"),
])
def test_a_value_no_benchmark_can_run_with_is_refused_before_anything_starts(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(bench, "bench_runtime", lambda n: pytest.fail("a benchmark started"))
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_refused(tmp_path: Path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "f")])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("row, met", [
    ({"target": "p50 <= 0.5, p99 <= 1", "p50_ms": 0.4, "p99_ms": 0.9}, True),
    ({"target": "p50 <= 0.5, p99 <= 1", "p50_ms": 0.4, "p99_ms": 5.1}, False),
    ({"target": ">= 5000/s", "per_s": 2768.0}, False),
    ({"target": ">= 1000/s", "per_s": 1000}, True),
    ({"target": "p95 <= 30", "p95_ms": 24.9}, True),
    ({"target": "p95 <= 30"}, None),  # no figure to judge
    ({"target": "fast enough", "p95_ms": 1.0}, None),  # a target it cannot read
    ({"case": "no target"}, None),
])
def test_each_target_is_judged_on_its_own_figures(row, met):
    assert bench.target_met(row) is met
    out = bench._with_verdicts([row])[0]
    if "target" in row:
        keys = list(out)
        assert keys[keys.index("target") + 1] == "met" and out["met"] is met
    else:
        assert "met" not in out
