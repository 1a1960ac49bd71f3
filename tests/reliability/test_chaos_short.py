"""A short, bounded run of the fault-injection harness (``make chaos`` runs the long one): two real
router processes, several workers, every fault kind, and the history checker must find nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadtest.chaos import FAULTS, ChaosConfig, run


# its own bounds: 30 s of faults + up to 45 s to settle + start-up and teardown of two routers, workers, moto;
# the suite-wide 120 s safety net cut it off on a busy machine (70 s alone, >120 s in CI's fresh clone)
@pytest.mark.timeout(300)
def test_short_chaos_run_has_no_violations(tmp_path: Path) -> None:
    cfg = ChaosConfig(duration_s=30, fault_every_s=1.2, counters=3, logs=2, settle_s=45, seed=8,
                      out=tmp_path / "chaos")
    summary, verdict = asyncio.run(run(cfg))
    assert verdict.violations == [], (tmp_path / "chaos" / "report.md").read_text()
    assert summary["faultsTotal"] >= 10 and len(summary["faults"]) >= 4, summary["faults"]
    assert set(summary["faults"]) <= set(FAULTS)
    assert summary["turnsAcknowledged"] >= 50, summary
    assert summary["turnsAbandoned"] == 0
    assert (tmp_path / "chaos" / "history.jsonl").read_text().count("\n") == summary["turnsAcknowledged"]
