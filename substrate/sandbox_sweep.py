"""Killing what is left of a worker's agent sandboxes: thaw, kill, remove (README "Security model").

An agent sandbox (``workers/sandbox.py``) is an outer ``bwrap`` process, the init of its PID namespace
and the agent's processes, all in the slot's cgroups (``/sys/fs/cgroup/<ctrl>/substrate/<worker>/slot-N``)
and, below bwrap, running as the slot's uid. Normally each one dies with its worker: the outer bwrap
carries ``PR_SET_PDEATHSIG`` = SIGKILL (bwrap's ``--die-with-parent`` and ``setpriv --pdeathsig``), and the
namespace's init dies with it. That fails in one case measured here: a worker killed while a slot's
cgroup v1 freezer is ``FROZEN`` (the worker freezes the agent while it packs the workspace) leaves the
whole sandbox frozen for good: its SIGKILL stays pending in the kernel's refrigerator (state ``D``) until
someone thaws the cgroup, and the worker that would have done so is gone. So this module is used by:

* the **reaper** (``python -I -S this_file reap ...``): one small process per worker, started by the
  worker's ``SandboxPool``, outside every slot cgroup, in its own session. It reads its stdin, a pipe
  whose only writer is the worker; the kernel closes that pipe however the worker ends (SIGKILL too), so
  on EOF the reaper kills the worker's sandboxes (``sweep_worker``) and the processes of its slot uids,
  then exits. It holds duplicates of the worker's uid ``flock``s, so a uid becomes free for another worker
  only once nothing of the old one runs as it. At start it also removes stale cgroups of other, dead
  workers (``sweep_stale``).
* the worker's **start-up sweep** (``kill_uids``): a uid whose lock was free has no live holder, so
  every process still running as it is a leftover (the reaper itself was killed).
* the **local backend** (``substrate/backends/local.py``) when it learns that a worker process died.

Everywhere the order is: SIGKILL, thaw, SIGKILL again until the cgroups are empty. A kill sent to a frozen
task stays pending, so thawing afterwards lets no agent code run (it cannot fork away in between), and
nothing is left frozen. This file imports only the standard library: the reaper runs it with ``-I -S``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: the cgroup v1 controllers a slot uses (``workers/sandbox.py``)
CONTROLLERS = ("memory", "pids", "cpu", "freezer")
#: the folder, below each controller, that holds one folder per worker
PARENT = "substrate"
#: a worker's lock file in the uid lock folder (held by the worker and its reaper while either lives)
WORKER_LOCK_PREFIX = "worker-"


def _valid_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..")


def worker_dirs(worker: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The worker's cgroup folders (``<root>/<ctrl>/substrate/<worker>``), one per controller, that exist."""
    if not _valid_name(worker):
        raise ValueError(f"bad worker name {worker!r}")
    return [d for c in CONTROLLERS if (d := root / c / PARENT / worker).is_dir()]


def _tree(dirs: Iterable[Path]) -> list[Path]:
    """Every cgroup folder at or below ``dirs``, deepest first (the order rmdir needs)."""
    out: list[Path] = []
    for d in dirs:
        for top, subdirs, _ in os.walk(d, topdown=False, onerror=lambda e: None):
            out.extend(Path(top) / s for s in subdirs)
        out.append(d)
    return out


def _procs(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _thaw(d: Path) -> None:
    f = d / "freezer.state"
    if f.exists():
        with contextlib.suppress(OSError):
            f.write_text("THAWED")


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        if pid > 1:  # a pid of another PID namespace reads 0 (never 1: we never kill an init we see)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def thaw_and_kill(dirs: Iterable[Path], wait_s: float = 5.0) -> int:
    """SIGKILL every process in the cgroups ``dirs`` (and below), thaw them, and repeat until they are
    empty or ``wait_s`` seconds passed. Returns how many processes were still there at the end (0: done)."""
    tree = _tree(dirs)
    deadline = time.monotonic() + wait_s
    while True:
        left = {p for d in tree for p in _procs(d)}
        if not left:
            return 0
        _kill(left)
        for d in tree:
            _thaw(d)
        if time.monotonic() >= deadline:
            return len(left)
        time.sleep(0.02)


def remove(dirs: Iterable[Path]) -> bool:
    """rmdir the cgroups ``dirs`` and everything below (empty ones only). True if all are gone."""
    ok = True
    for d in _tree(dirs):
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            ok = False
    return ok


def sweep_worker(worker: str, wait_s: float = 5.0, root: Path = CGROUP_ROOT) -> bool:
    """Thaw and kill every process left in ``worker``'s cgroups, then remove them. True if nothing is left."""
    dirs = worker_dirs(worker, root)
    if not dirs:
        return True
    left = thaw_and_kill(dirs, wait_s)
    return remove(dirs) and left == 0


# --------------------------------------------------------------------------------------------- by uid


def _status(pid: str) -> tuple[set[int], int] | None:
    """(the real, effective, saved and fs uids, the parent pid) of a process; None if it is gone or a
    zombie (it runs nothing; its parent reaps it). Reads ``/proc/<pid>/status`` only: ``cmdline`` or
    ``environ`` of a frozen task can block the reader."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    uids: set[int] = set()
    ppid = -1
    for line in text.splitlines():
        if line.startswith("State:") and line.split()[1] in ("Z", "X"):
            return None
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:]}
        elif line.startswith("PPid:"):
            ppid = int(line.split()[1])
    return uids, ppid


def _slot_cgroup(pid: int, root: Path) -> Path | None:
    """The ``substrate/<worker>/<slot>`` part of a process's freezer cgroup, if it is in one."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "freezer" in ctrls.split(",") and path.startswith(f"/{PARENT}/") and path.count("/") >= 3:
            return Path(path.lstrip("/"))
    return None


def pids_of_uids(uids: set[int]) -> list[int]:
    """Processes that run as any of ``uids`` (real, effective, saved or filesystem uid)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _status(name)) is not None and st[0] & uids:
            out.append(int(name))
    return out


def kill_uids(uids: Iterable[int], wait_s: float = 5.0, root: Path = CGROUP_ROOT) -> int:
    """SIGKILL every process running as one of ``uids``, thawing its slot cgroup and killing the rest of
    that cgroup too (the root-owned ``bwrap`` processes of the same sandbox), until none is left or
    ``wait_s`` passed. Only for uids this process holds the lock of. Returns how many were killed."""
    want = {u for u in uids if u > 0}  # never root's processes
    if not want:
        return 0
    killed: set[int] = set()
    slots: set[Path] = set()
    deadline = time.monotonic() + wait_s
    while True:
        pids = pids_of_uids(want)
        for pid in pids:
            if (rel := _slot_cgroup(pid, root)) is not None:
                slots.add(rel)
        if not pids:
            break
        killed.update(pids)
        _kill(pids)
        dirs = [root / c / rel for rel in slots for c in CONTROLLERS if (root / c / rel).is_dir()]
        thaw_and_kill(dirs, wait_s=0)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if slots:
        dirs = [root / c / rel for rel in slots for c in CONTROLLERS if (root / c / rel).is_dir()]
        thaw_and_kill(dirs, max(0.0, deadline - time.monotonic()))
        remove(dirs)
    return len(killed)


# -------------------------------------------------------------------------------------- stale workers


def worker_lock(lock_dir: Path, worker: str) -> Path:
    """The lock file that says ``worker`` (or its reaper) still lives: ``<lock_dir>/worker-<name>``."""
    if not _valid_name(worker):
        raise ValueError(f"bad worker name {worker!r}")
    return lock_dir / f"{WORKER_LOCK_PREFIX}{worker}"


def _lock_is_free(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from ``/proc/<pid>/stat`` (zombies included); None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _orphaned(tree: list[Path]) -> bool:
    """True if the cgroups hold a live process and none of their processes (zombies too) has a parent
    outside them but init: the worker that started them is gone. Unknown or invisible processes count
    as owned (never killed)."""
    pids = {p for d in tree for p in _procs(d)}
    if not pids or 0 in pids:
        return False
    running = False
    for pid in pids:
        st = _stat(pid)
        if st is None:
            continue  # exited meanwhile
        if st[1] not in pids and st[1] != 1:
            return False
        running = running or st[0] not in ("Z", "X")
    return running


def _still_orphaned(tree: list[Path], after_s: float = 0.5) -> bool:
    time.sleep(after_s)
    return _orphaned(tree)


def sweep_stale(own: str, lock_dir: Path | None, wait_s: float = 5.0, root: Path = CGROUP_ROOT) -> list[str]:
    """Remove the cgroups of workers that no longer exist (not ``own``). A worker's folder without slot
    folders is removed as it is (the kernel refuses to rmdir a cgroup that has child cgroups or
    processes; a live worker keeps its slot folders until it closes its pool). One with slot folders is
    stale when its lock file in ``lock_dir`` exists and nobody holds it, or when the processes in it are
    orphans (their parent outside the folder is gone); then they are thawed and killed and the folders
    removed. A folder of a worker not known to be dead (e.g. another runtime with another lock folder,
    or code without these locks) is left alone. Returns the workers whose slots were swept."""
    names: set[str] = set()
    for c in CONTROLLERS:
        with contextlib.suppress(OSError):
            for p in (root / c / PARENT).iterdir():
                if p.name == own or not p.is_dir():
                    continue
                try:
                    p.rmdir()  # fails (EBUSY) when it still has slot folders
                except OSError:
                    names.add(p.name)
    swept = []
    for name in sorted(names):
        dirs = [d for c in CONTROLLERS if (d := root / c / PARENT / name).is_dir()]
        lock = worker_lock(lock_dir, name) if lock_dir is not None and _valid_name(name) else None
        dead = lock is not None and lock.exists() and _lock_is_free(lock)
        # every slot is in every controller with the same processes: one controller says who is there
        probe = [d for d in dirs if d.parent.parent.name == "pids"] or dirs[:1]
        # orphans twice, half a second apart: a live worker's sandbox whose outer bwrap was just killed
        # has an orphaned init for an instant, and removing that worker's cgroups would break its slot
        if dead or (_orphaned(_tree(probe)) and _still_orphaned(_tree(probe))):
            thaw_and_kill(dirs, wait_s)
            remove(dirs)
            if dead and lock is not None:
                with contextlib.suppress(OSError):
                    lock.unlink()
            swept.append(name)
    return swept


# --------------------------------------------------------------------------------------------- reaper


#: the file in the uid lock folder whose ``flock`` one stale sweep at a time holds
STALE_SWEEP_LOCK = "stale-sweep.lock"


def _sweep_stale_quietly(worker: str, lock_dir: Path | None, root: Path) -> bool:
    """A reaper's ``sweep_stale`` at start, unless another reaper's is running (then that one does the
    job): each sweep tries an ``rmdir`` of every other worker's cgroup folder in every controller, under
    the parent folder's lock, so hundreds of workers starting together each sweeping all the others queued
    on that lock for minutes (fresh-user round 11: ~830 reapers in state D, load average 3,200). Returns
    whether it swept. Never raises."""
    fd = None
    try:
        if lock_dir is not None:
            fd = os.open(lock_dir / STALE_SWEEP_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
        sweep_stale(worker, lock_dir, root=root)
        return True
    except Exception:  # noqa: BLE001 - others' leftovers; the next reaper's sweep tries again
        return False
    finally:
        if fd is not None:
            os.close(fd)


def reap(worker: str, uids: list[int], lock_dir: Path | None, root: Path = CGROUP_ROOT,
         own_lock: bool = False) -> None:
    """The reaper's life: sweep stale workers, wait for EOF on stdin (the worker is gone or closed its
    pool), then kill what is left of the worker's sandboxes and uids, remove its cgroups and (with
    ``own_lock``: the worker held it) its lock file."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # a terminal's or a process group's signal is not the worker's end
    # others' leftovers in the background: this worker's own end must not wait for them
    threading.Thread(target=_sweep_stale_quietly, args=(worker, lock_dir, root), daemon=True).start()
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    try:
        sweep_worker(worker, root=root)
    finally:
        kill_uids(uids, root=root)
        if lock_dir is not None and own_lock:
            with contextlib.suppress(OSError):
                worker_lock(lock_dir, worker).unlink()


def main(argv: list[str]) -> int:
    """``reap --worker NAME [--uids 1,2] [--lock-dir DIR [--own-lock]] [--cgroup-root DIR]`` (see ``reap``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="sandbox_sweep")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap")
    r.add_argument("--worker", required=True)
    r.add_argument("--uids", default="")
    r.add_argument("--lock-dir", default=None)
    r.add_argument("--own-lock", action="store_true")
    r.add_argument("--cgroup-root", default=str(CGROUP_ROOT))
    a = ap.parse_args(argv)
    uids = [int(u) for u in a.uids.split(",") if u]
    reap(a.worker, uids, Path(a.lock_dir) if a.lock_dir else None, Path(a.cgroup_root), own_lock=a.own_lock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
