"""``LocalBackend.reap`` reports workers that died, not workers that ``delete`` is stopping.

A drain ends with ``delete`` (SIGTERM, then wait). The pool controller's next tick could find the worker
gone before ``delete`` had forgotten it: ``reap`` reported it as lost, the controller "recovered" a worker
that had just suspended all its sessions, and the log said ``worker process exited`` (a warning) after
every ordinary scale-down (seen in the 2026-12-02 day replays).
"""

from __future__ import annotations

import asyncio
import subprocess

from substrate.backends.local import LocalBackend, _Worker
from substrate.settings import Settings, WorkerSettings


def _backend(tmp_path) -> LocalBackend:  # noqa: ANN001
    return LocalBackend(Settings(worker=WorkerSettings(root_dir=tmp_path / "workers")), fork_server=False)


def _child() -> _Worker:
    p = subprocess.Popen(["sleep", "60"])  # dies at SIGTERM, like a worker that has drained
    return _Worker("dense", p.pid, p)


async def test_a_worker_being_deleted_is_not_reaped_as_lost(tmp_path):
    b = _backend(tmp_path)
    checked = 0
    for attempt in range(5):  # until ``reap`` ran between the exit and ``delete`` noticing it (~45 ms)
        wid = f"w-drained-{attempt}"
        w = b.workers[wid] = _child()
        task = asyncio.create_task(b.delete(wid, grace_s=30))
        try:
            for _ in range(6000):  # the SIGTERM is sent at once; then ``delete`` polls every 50 ms
                await asyncio.sleep(0.005)
                if w.popen is not None and w.popen.poll() is not None:
                    break
            assert not w.alive()
            if not task.done():
                assert b.reap() == []  # exited under ``delete``: not lost
                checked += 1
            await asyncio.wait_for(task, 30)
            assert wid not in b.workers and b.reap() == []
        finally:
            w.signal(9)
        if checked:
            break
    assert checked, "reap never ran while delete was stopping the worker"


async def test_a_worker_that_dies_by_itself_is_reaped(tmp_path):
    b = _backend(tmp_path)
    w = b.workers["w-crashed"] = _child()
    w.signal(9)
    assert w.popen is not None
    w.popen.wait(30)
    assert b.reap() == ["w-crashed"] and "w-crashed" not in b.workers


def test_a_dead_worker_its_frozen_zygote_cannot_reap_is_reaped_at_once(tmp_path) -> None:
    """Fresh-user tester 46: with the zygote SIGSTOPped, a worker it forked and that was killed stayed a
    zombie, which signal 0 still reaches: its death was seen ~12 s later, when its lease ran out. Here the
    test process is the unreaping parent: the worker's process has exited and is not waited for."""
    import time

    p = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until it has exited (a zombie: nobody waited for it)
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.01)
    b = _backend(tmp_path)
    b.workers["w1"] = _Worker("dense", p.pid)  # a child of the zygote: no Popen here
    try:
        assert not b.workers["w1"].alive()
        assert b.reap() == ["w1"]
    finally:
        p.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        assert _Worker("dense", alive.pid).alive()  # a live one still is
    finally:
        alive.kill()
        alive.wait()
