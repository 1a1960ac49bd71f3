"""The OOM count a worker reads before every turn under a memory limit (``SlotCgroup.oom_kills``): the
file is opened once and re-read with ``pread`` (one system call per turn instead of seven), the count
follows the file, no agent process can inherit the descriptor, and a file that went away reads as 0
and is opened again once it is back. A folder stands in for cgroupfs here."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from workers import sandbox
from workers.sandbox import SlotCgroup


def _control(n: int) -> str:
    return f"oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"


def test_the_count_is_re_read_through_one_kept_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_CGROUP_ROOT", tmp_path)
    cg = SlotCgroup("w-1/slot-0")
    f = cg.dirs["memory"] / "memory.oom_control"
    f.write_text(_control(3))
    assert cg.oom_kills() == 3
    fd = cg._oom_fd
    assert fd is not None and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # never in an agent's process
    cg.mark_oom_baseline()
    f.write_text(_control(5))  # the kernel counted two kills
    assert cg.new_oom_kill() and not cg.new_oom_kill()
    assert cg._oom_fd == fd  # the same descriptor throughout

    os.close(fd)
    cg._oom_fd = 1 << 20  # a stale descriptor (a file that went away): the read fails, drops it, opens again next
    f.write_text(_control(7))
    assert cg.oom_kills() == 0 and cg._oom_fd is None
    assert cg.oom_kills() == 7 and cg._oom_fd is not None
    cg._close_oom_fd()
