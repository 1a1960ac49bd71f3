"""One stale-cgroup sweep at a time (``substrate.sandbox_sweep._sweep_stale_quietly``).

Fresh-user round 11: with ``replicas: 100000`` about 830 workers started within two minutes, and each
one's reaper tried an ``rmdir`` of every other worker's cgroup folder in every controller; the rmdirs
queued on the parent folder's lock and the machine's load average reached 3,200. A reaper now skips its
start-up sweep while another reaper's runs. The cgroup tree here is plain folders (``rmdir`` of an empty
one works as on cgroupfs), so the test needs no root."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from substrate import sandbox_sweep


def _tree(root: Path, *workers: str) -> list[Path]:
    made = []
    for c in sandbox_sweep.CONTROLLERS:
        for w in workers:
            d = root / c / sandbox_sweep.PARENT / w
            d.mkdir(parents=True)
            made.append(d)
    return made


def test_a_sweep_is_skipped_while_another_runs_and_done_once_it_is_over(tmp_path: Path) -> None:
    root, locks = tmp_path / "cgroup", tmp_path / "locks"
    locks.mkdir()
    left_over = _tree(root, "dead-worker-1")  # a dead worker's empty folders: the sweep removes them
    holder = os.open(locks / sandbox_sweep.STALE_SWEEP_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another reaper's sweep is running
        assert sandbox_sweep._sweep_stale_quietly("me", locks, root) is False
        assert all(d.exists() for d in left_over), "skipped: nothing touched"
    finally:
        os.close(holder)
    assert sandbox_sweep._sweep_stale_quietly("me", locks, root) is True
    assert not any(d.exists() for d in left_over)


def test_without_a_lock_folder_it_sweeps_and_never_raises(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    left_over = _tree(root, "dead-worker-2")
    assert sandbox_sweep._sweep_stale_quietly("me", None, root) is True
    assert not any(d.exists() for d in left_over)
    # an unusable lock folder: no sweep, no exception (the reaper must go on to wait for its worker)
    assert sandbox_sweep._sweep_stale_quietly("me", tmp_path / "no-such-folder", root) is False
