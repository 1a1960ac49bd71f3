"""Issue 7, "killed with its worker": no process of an agent sandbox outlives its worker, however the
worker dies (SIGKILL included, and with a slot frozen by the cgroup freezer at that moment).

Real processes and real bubblewrap, as root with writable cgroup v1 (skipped elsewhere). The "worker" is
a small Python process that owns a ``SandboxPool`` (the same code the worker runs) with live sandboxes;
the test SIGKILLs it and then waits, bounded, for every process of its sandboxes to be gone. Before the
reaper (``substrate/sandbox_sweep.py``) the frozen case left the whole sandbox in the kernel's
refrigerator (state D, parent 1) for good, and nothing swept a dead worker's uids or cgroups.
Every test kills and removes what it made, also when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.proctree import descendants
from substrate import sandbox_sweep
from substrate.settings import Settings, WorkerSettings
from workers.sandbox import SlotCgroup, cgroup_v1_writable, find_bwrap

ROOT = Path(__file__).resolve().parents[2]
#: the machine-wide uid lock folder every worker uses: a uid is free there only if its holder died
LOCK_DIR = WorkerSettings().sandbox_uid_lock_dir
#: uids far from the workers' default range (20000+), so these tests never meet a real worker's sandboxes
UID_BASE, UID_SPAN = 27000, 400

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or find_bwrap() is None or not cgroup_v1_writable(),
    reason="needs root, bubblewrap and a writable cgroup v1 hierarchy")

# The "worker": a SandboxPool with two live sandboxes. Slot 0 runs a real agent host (as a create would);
# slot 1 runs a shell that ignores SIGTERM/SIGHUP and leaves background and setsid()-daemonised sleepers
# (what an agent could do). With FREEZE set, slot 0 is frozen as during a snapshot's packing.
WORKER = r"""
import asyncio, json, os, sys
from pathlib import Path
from workers.sandbox import Limits, SandboxPool, find_bwrap

async def main():
    root, name, freeze = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    pool = SandboxPool(root, 2, name=name, bwrap=find_bwrap(), uid_base=int(sys.argv[4]), uid_span=int(sys.argv[5]),
                       uid_lock_dir=Path(sys.argv[6]), prestart=0)
    await pool.start()
    host = await pool.spawn(pool.slots[0], Limits())
    s1 = pool.slots[1]
    a = pool.argv(s1, Limits())
    cut = a.index("--") + 1
    setpriv = a[cut:a.index("--", cut) + 1]
    sh = "trap '' TERM HUP; (setsid sleep 600 &); sleep 600 & exec sleep 600"
    await asyncio.create_subprocess_exec(*pool.launcher(s1, Limits()), *a[:cut], *setpriv, "/bin/sh", "-c", sh,
                                         stdin=asyncio.subprocess.DEVNULL)
    want = 1 + 3  # slot 0: the agent host; slot 1: sh's three sleepers
    for _ in range(500):
        if sum(1 for s in pool.slots for _ in _as_uid(s.uid)) >= want:
            break
        await asyncio.sleep(0.02)
    if freeze:
        pool.slots[0].cgroup.freeze(True)
        state = pool.slots[0].cgroup.dirs["freezer"] / "freezer.state"
        while state.read_text().strip() != "FROZEN":
            await asyncio.sleep(0.01)
    print(json.dumps({"uids": [s.uid for s in pool.slots], "outer": host.proc.pid,
                      "cgroups": [str(d) for s in pool.slots for d in s.cgroup.dirs.values()]}), flush=True)
    await asyncio.sleep(600)

def _as_uid(uid):
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and f"Uid:\t{uid}\t" in open(f"/proc/{p}/status").read():
                yield p
        except OSError:
            pass

asyncio.run(main())
"""


def _state(pid: int) -> str | None:
    """A process's state letter from ``/proc/<pid>/stat`` (never ``cmdline``: reading it can block on a
    frozen task); None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _living(pids: set[int]) -> dict[int, str]:
    """The processes of ``pids`` that still exist and are not zombies (a zombie runs nothing), with state."""
    return {p: s for p in pids if (s := _state(p)) not in (None, "Z", "X")}


def _leftovers(pids: set[int], uids: list[int], cgroups: list[str]) -> dict[str, object]:
    procs = {p for c in cgroups for p in sandbox_sweep._procs(Path(c))}
    return {k: v for k, v in {
        "processes": _living(pids),
        "as_slot_uids": _living(set(sandbox_sweep.pids_of_uids(set(uids)))) if uids else None,
        "in_slot_cgroups": _living(procs),
        "cgroup_dirs": [c for c in cgroups if Path(c).exists()],
    }.items() if v}


def _wait_until_clean(pids: set[int], uids: list[int], cgroups: list[str], timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (left := _leftovers(pids, uids, cgroups)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def cleanup() -> Iterator[list]:
    """Things to kill at the end: ("uids", [...]), ("cgroups", [dirs]), ("proc", Popen)."""
    todo: list = []
    yield todo
    # thaw (and kill) first: waiting for a process that is still frozen would hang for good
    for kind, what in todo:
        if kind == "cgroups":
            dirs = [Path(d) for d in what if Path(d).exists()]
            sandbox_sweep.thaw_and_kill(dirs, wait_s=5)
            sandbox_sweep.remove(dirs)
        elif kind == "uids":
            sandbox_sweep.kill_uids(what, wait_s=5)
    for kind, what in todo:
        if kind == "proc" and what.poll() is None:
            what.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                what.wait(10)


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "slot-frozen"])
def test_a_sigkilled_worker_leaves_no_process_of_its_sandboxes(tmp_path, cleanup, frozen):
    name = f"test-kill-{uuid.uuid4().hex[:8]}"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(tmp_path / "w"), name, "1" if frozen else "0", str(UID_BASE),
         str(UID_SPAN), str(LOCK_DIR)], stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cleanup.append(("proc", worker))
    cleanup.append(("cgroups", [str(d) for c in sandbox_sweep.CONTROLLERS
                                for d in (sandbox_sweep.CGROUP_ROOT / c / "substrate" / name,)]))
    assert worker.stdout is not None
    line = worker.stdout.readline()
    assert line, "the worker process did not start its sandboxes"
    info = json.loads(line)
    cleanup.insert(0, ("uids", info["uids"]))
    cleanup.insert(0, ("cgroups", info["cgroups"]))
    sandbox = set(descendants(worker.pid))
    assert info["outer"] in sandbox and len(_living(set(sandbox_sweep.pids_of_uids(set(info["uids"]))))) >= 4
    if frozen:
        freezer = next(c for c in info["cgroups"] if "/freezer/" in c)
        assert (Path(freezer) / "freezer.state").read_text().strip() == "FROZEN"
        assert any(_state(p) == "D" for p in sandbox), "slot 0 is frozen at the moment of the kill"

    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()

    left = _wait_until_clean(sandbox, info["uids"], info["cgroups"])
    assert not left, f"left behind by the SIGKILLed worker: {left}"


def test_the_start_up_sweep_kills_what_a_dead_worker_left_as_its_uid(tmp_path, cleanup):
    """A leftover of a worker that died with its reaper: a frozen process running as a slot uid, in that
    dead worker's slot cgroup. The next worker that claims the uid (its lock is free: the holder is dead)
    thaws and kills it before anything of its own runs as that uid, and removes the dead one's cgroup."""
    import asyncio

    from workers.sandbox import SandboxPool

    uid = _free_uid()
    dead = f"test-dead-{uuid.uuid4().hex[:8]}"
    cg = SlotCgroup(f"{dead}/slot-0")
    cleanup.append(("cgroups", [str(d.parent) for d in cg.dirs.values()]))
    cleanup.append(("uids", [uid]))
    script = 'while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift; exec "$@"'
    leftover = subprocess.Popen(
        ["/bin/sh", "-c", script, "sh", *(str(d / "cgroup.procs") for d in cg.dirs.values()), "--",
         "/usr/bin/setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--",
         "/bin/sh", "-c", "sleep 600 & exec sleep 600"], start_new_session=True)
    cleanup.append(("proc", leftover))
    deadline = time.monotonic() + 10
    while len(sandbox_sweep.pids_of_uids({uid})) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = set(sandbox_sweep.pids_of_uids({uid}))
    assert len(pids) == 2
    cg.freeze(True)

    async def claim() -> None:
        pool = SandboxPool(tmp_path / "w", 1, name=f"test-new-{uuid.uuid4().hex[:8]}", bwrap=find_bwrap(),
                           uid_base=uid, uid_span=1, uid_lock_dir=LOCK_DIR, prestart=0)
        try:
            assert pool.slots[0].uid == uid
        finally:
            await pool.close()

    asyncio.run(claim())
    with contextlib.suppress(subprocess.TimeoutExpired):
        leftover.wait(10)  # our own child: reap it, or it stays a zombie
    left = _wait_until_clean(pids, [uid], [str(d) for d in cg.dirs.values()], timeout_s=10)
    assert not left, f"the start-up sweep left: {left}"


def test_stale_cgroups_of_dead_workers_go_and_a_live_workers_stay(tmp_path, cleanup):
    """``sweep_stale`` (each reaper runs it when it starts): a dead worker's empty cgroups (its lock file is
    free) and a worker whose processes are orphans are removed; a worker whose process has a live parent
    (this test) and one not known to be dead are left alone."""
    locks = tmp_path / "locks"
    locks.mkdir()
    names = {k: f"test-stale-{k}-{uuid.uuid4().hex[:6]}" for k in ("dead", "orphan", "live", "unknown")}
    cgs = {k: SlotCgroup(f"{n}/slot-0") for k, n in names.items()}
    for cg in cgs.values():
        cleanup.append(("cgroups", [str(d.parent) for d in cg.dirs.values()]))
    sandbox_sweep.worker_lock(locks, names["dead"]).touch()
    join = 'while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift; exec "$@"'

    def start_in(cg: SlotCgroup, cmd: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["/bin/sh", "-c", join, "sh", *(str(d / "cgroup.procs") for d in cg.dirs.values()),
                              "--", "/bin/sh", "-c", cmd], start_new_session=True, stdout=subprocess.PIPE)
        cleanup.append(("proc", p))
        return p

    live = start_in(cgs["live"], "exec sleep 600")
    orphan_parent = start_in(cgs["orphan"], "sleep 600 & echo $!")
    assert orphan_parent.stdout is not None
    orphan = int(orphan_parent.stdout.readline())
    orphan_parent.wait()
    ppid = Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]
    if ppid != "1":
        pytest.skip(f"orphans are reparented to a subreaper here (pid {ppid}), not to init")
    cgs["orphan"].freeze(True)

    swept = sandbox_sweep.sweep_stale("nobody", locks, wait_s=5)

    # (it may also sweep real leftovers of dead workers on this machine: that is its job)
    assert {names["dead"], names["orphan"]} <= set(swept)
    assert names["live"] not in swept and names["unknown"] not in swept
    for k in ("dead", "orphan"):
        assert not any(d.parent.exists() for d in cgs[k].dirs.values()), f"{k}: its cgroups were not removed"
    assert _state(orphan) in (None, "Z"), "the frozen orphan was thawed and killed"
    assert not sandbox_sweep.worker_lock(locks, names["dead"]).exists()
    assert live.poll() is None and all(d.exists() for d in cgs["live"].dirs.values()), "a live worker's sandbox stays"
    assert all(d.exists() for d in cgs["unknown"].dirs.values()), "a worker not known to be dead stays"


def test_the_local_backend_thaws_and_kills_what_a_dead_worker_left(tmp_path, cleanup):
    """``LocalBackend.reap`` learns that a worker process died and sweeps its cgroups (a frozen process
    there too), without blocking: one pass per call, retried on the next calls."""
    from substrate.backends.local import LocalBackend, _Worker

    wid = f"test-local-{uuid.uuid4().hex[:8]}"
    cg = SlotCgroup(f"{wid}/slot-0")
    cleanup.append(("cgroups", [str(d.parent) for d in cg.dirs.values()]))
    join = 'while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift; exec "$@"'
    left = subprocess.Popen(["/bin/sh", "-c", join, "sh", *(str(d / "cgroup.procs") for d in cg.dirs.values()),
                             "--", "sleep", "600"], start_new_session=True)
    cleanup.append(("proc", left))
    deadline = time.monotonic() + 10
    while not cg.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cg.pids() == [left.pid]
    cg.freeze(True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    backend = LocalBackend(Settings(worker=WorkerSettings(root_dir=tmp_path / "workers")), fork_server=False)
    backend.workers[wid] = _Worker("default", gone.pid, gone)

    assert backend.reap() == [wid]
    deadline = time.monotonic() + 10
    while any(d.exists() for d in cg.dirs.values()) and time.monotonic() < deadline:
        backend.reap()
        time.sleep(0.05)
    assert left.wait(5) == -signal.SIGKILL
    assert not any(d.exists() for d in cg.dirs.values()), "the dead worker's cgroups were removed"
    assert not any(d.parent.exists() for d in cg.dirs.values())


def _free_uid() -> int:
    """A uid of the test range whose machine-wide lock is free and that no process runs as."""
    import fcntl

    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for uid in range(UID_BASE + UID_SPAN - 1, UID_BASE, -1):
        fd = os.open(LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        finally:
            os.close(fd)
        if not sandbox_sweep.pids_of_uids({uid}):
            return uid
    pytest.skip("no free test uid")


def test_a_killed_reaper_is_restarted_before_the_next_spawn(tmp_path):
    """The reaper is the only thing that thaws a frozen sandbox of a dead worker: if someone kills it, the
    worker starts another before it starts its next sandbox, and a closed pool's reaper exits."""
    import asyncio

    from workers.sandbox import Limits, SandboxPool

    name = f"test-reaper-{uuid.uuid4().hex[:8]}"

    async def run() -> tuple[int, int, int | None]:
        pool = SandboxPool(tmp_path / "w", 1, name=name, bwrap=find_bwrap(),
                           uid_base=UID_BASE, uid_span=UID_SPAN, uid_lock_dir=LOCK_DIR, prestart=0)
        try:
            assert pool._reaper is not None
            first = pool._reaper
            first.kill()
            first.wait()
            pool.launcher(pool.slots[0], Limits())
            second = pool._reaper
            assert second is not None and second.poll() is None
        finally:
            await pool.close()
        return first.pid, second.pid, second.returncode

    first, second, status = asyncio.run(run())
    assert first != second
    assert status == 0, "the reaper exits cleanly when its pool closes"
    assert not sandbox_sweep.worker_lock(LOCK_DIR, name).exists(), "a closed pool leaves no worker lock file"


def test_a_real_worker_sigkilled_with_its_slots_frozen_leaves_nothing(runtime_factory, cleanup):
    """End to end through ``substrate up``: a worker forked by the zygote, with a session's sandboxed agent
    and a pre-started host, every slot frozen (as while a workspace is packed), then SIGKILLed."""
    rt = runtime_factory(replicas=1, slots=2)
    c = rt.client
    s = c.create_session("counter")
    assert c.invoke(s["id"], "increment") == {"count": 1}
    wid = s["worker"]
    pid = int(rt.workers()[wid]["pid"])
    worker_dirs = [str(sandbox_sweep.CGROUP_ROOT / c_ / "substrate" / wid) for c_ in sandbox_sweep.CONTROLLERS]
    cleanup.append(("cgroups", worker_dirs))
    sandbox = set(descendants(pid))
    uids = sorted({u for p in sandbox if (st := sandbox_sweep._status(str(p))) for u in st[0] if u})
    assert uids, "the session's agent runs as a slot uid"
    slots = sorted(Path(worker_dirs[sandbox_sweep.CONTROLLERS.index("freezer")]).glob("slot-*"))
    cgroups = [str(d) for w in worker_dirs for d in Path(w).glob("slot-*")]
    for d in slots:
        (d / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + 10
    while any((d / "freezer.state").read_text().strip() != "FROZEN" for d in slots) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(_state(p) == "D" for p in sandbox), "the sandboxes are frozen at the moment of the kill"

    rt.kill_worker(wid)

    # what ran then, and the dead worker's cgroups (not its uids: once the reaper is done with them,
    # the replacement worker may claim them for its own hosts)
    left = _wait_until_clean(sandbox, [], cgroups + worker_dirs)
    assert not left, f"left behind by the SIGKILLed worker: {left}"
