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


def test_a_limit_that_cannot_be_written_is_raised_not_only_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: a ``maxMemory`` below what the slot already used was refused by the kernel
    (EBUSY), only logged, and the agent ran without a limit. Here a folder in the file's place makes
    the write fail: each limit asked for that is not written is named, the others are still written,
    and lifting a limit (no ``maxMemory``) that fails is only logged."""
    monkeypatch.setattr(sandbox, "_CGROUP_ROOT", tmp_path)
    cg = SlotCgroup("w-1/slot-0")
    (cg.dirs["memory"] / "memory.limit_in_bytes").mkdir()
    with pytest.raises(sandbox.LimitNotApplied, match=r"memory.limit_in_bytes = 1048576") as e:
        cg.set(sandbox.Limits(memory_bytes=1 << 20, processes=24, cpu_cores=0.5))
    assert "pids" not in str(e.value) and "cpu" not in str(e.value)
    assert (cg.dirs["pids"] / "pids.max").read_text() == "24"  # the rest is in force
    assert (cg.dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "50000"
    cg.set(sandbox.Limits(memory_bytes=None, processes=24))  # nothing asked of the failing file
    (cg.dirs["pids"] / "pids.max").unlink()
    (cg.dirs["pids"] / "pids.max").mkdir()
    with pytest.raises(sandbox.LimitNotApplied, match="pids.max = 24"):
        cg.set(sandbox.Limits(memory_bytes=None, processes=24))
    cg._close_oom_fd()



def test_a_memory_limit_the_kernel_refuses_as_busy_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded suite run: with the slot emptied, the kernel still refused a 1 MiB limit (EBUSY: memory its
    gone processes left charged), and the create answered 500 ``agent_start_failed``. The refusal now says
    it was EBUSY on the memory limit (``memory_busy``), which the worker answers as 422
    ``memory_limit_exceeded``; another failure (here a folder in the file's place) does not."""
    import errno
    import pathlib

    monkeypatch.setattr(sandbox, "_CGROUP_ROOT", tmp_path)
    cg = SlotCgroup("w-1/slot-0")
    real = pathlib.Path.write_text

    def write_text(self: pathlib.Path, data: str, *a: object, **kw: object) -> int:
        if self.name == "memory.limit_in_bytes" and data != "-1":
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(self, data, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    with pytest.raises(sandbox.LimitNotApplied, match="Device or resource busy") as e:
        cg.set(sandbox.Limits(memory_bytes=1 << 20, processes=24))
    assert e.value.memory_busy
    monkeypatch.setattr(pathlib.Path, "write_text", real)
    (cg.dirs["pids"] / "pids.max").unlink()
    (cg.dirs["pids"] / "pids.max").mkdir()
    with pytest.raises(sandbox.LimitNotApplied) as e:
        cg.set(sandbox.Limits(memory_bytes=1 << 20, processes=24))
    assert not e.value.memory_busy
    cg._close_oom_fd()
