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


def _server_over(cmd: str):  # a bench Server whose runtime is just this command's process
    from loadtest.bench import Server

    srv = Server.__new__(Server)
    srv.proc = subprocess.Popen([sys.executable, "-c", cmd])
    return srv


def test_settle_waits_for_a_busy_runtime_and_says_so_when_it_never_goes_quiet() -> None:
    import asyncio

    # the root sleeps and its child burns: the runtime is its whole tree (workers, hosts), not one process
    busy = _server_over("import os, time\nif os.fork() == 0:\n    while True: pass\ntime.sleep(30)")
    try:
        from loadtest.proctree import descendants

        while not descendants(busy.proc.pid):  # forked (a settle before that would rightly see quiet)
            assert busy.proc.poll() is None
        with pytest.raises(RuntimeError, match="did not go quiet"):
            asyncio.run(busy.settle(window_s=0.3, timeout_s=1.0))
    finally:
        for pid in descendants(busy.proc.pid):
            os.kill(pid, 9)
        busy.proc.kill()
        busy.proc.wait()
    quiet = _server_over("import time; time.sleep(30)")
    try:
        waited = asyncio.run(quiet.settle(window_s=0.3, timeout_s=10.0))
        assert 0.3 <= waited < 10.0
    finally:
        quiet.proc.kill()
        quiet.proc.wait()
