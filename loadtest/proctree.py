"""The processes of this machine as ``/proc`` shows them (Linux): CPU time per process, the tree of
processes under a root, the machine's busy CPU time. Used by the benchmarks (where each side's CPU went)
and by tests that check what a runtime leaves behind. Every function reads ``/proc`` now, with no cache;
proc(5) gives the field numbers."""
from __future__ import annotations

import os

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, from ``/proc/<pid>/stat`` (Linux;
    proc(5): fields 14 and 15, in clock ticks). Raises ``OSError`` if the process is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def descendants(root: int) -> list[int]:
    """The pids of every process now running under ``root`` (children, their children, ...), ``root``
    excluded, from each process's parent in ``/proc/<pid>/stat`` (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                ppid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # gone since the scan began
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_s(pids: list[int]) -> dict[int, float]:
    """``process_cpu_s`` of each of ``pids`` still running (those gone are left out)."""
    out = {}
    for pid in pids:
        try:
            out[pid] = process_cpu_s(pid)
        except OSError:
            pass
    return out


def machine_busy_cpu_s() -> float:
    """CPU seconds all cores have spent busy so far (``/proc/stat``'s first line less idle and iowait)."""
    with open("/proc/stat", "rb") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _CLK_TCK
