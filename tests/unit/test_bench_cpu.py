"""The CPU accounting of the routed throughput bench (``loadtest.bench``) reads /proc correctly."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from loadtest.proctree import machine_busy_cpu_s, process_cpu_s


def _burn() -> None:
    h = hashlib.sha256()
    for _ in range(200_000):
        h.update(b"x" * 256)


def test_process_cpu_grows_with_the_work_done_and_counts_only_that_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me0, child0, machine0 = process_cpu_s(os.getpid()), process_cpu_s(child.pid), machine_busy_cpu_s()
        _burn()
        me1, child1, machine1 = process_cpu_s(os.getpid()), process_cpu_s(child.pid), machine_busy_cpu_s()
        assert me1 > me0  # our own work shows up...
        assert child1 - child0 < me1 - me0  # ...and not in a sleeping process's account
        assert machine1 >= machine0 + (me1 - me0) * 0.5  # the machine's busy time holds ours
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        process_cpu_s(child.pid)  # gone: the caller is told, not given a stale figure
