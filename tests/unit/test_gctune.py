"""``substrate.gctune``: the serving processes freeze their start-up heap and raise the young threshold.
Run in a child interpreter: freezing the test process's own heap would keep its garbage for good."""

from __future__ import annotations

import subprocess
import sys


def test_tune_after_startup_freezes_the_heap_and_raises_the_young_threshold():
    code = ("import gc; from substrate.gctune import GEN0_THRESHOLD, tune_after_startup; "
            "assert gc.get_freeze_count() == 0; tune_after_startup(); "
            "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); "
            "assert gc.get_threshold()[0] == GEN0_THRESHOLD > 700; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
