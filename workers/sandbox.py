"""One sandbox per agent process: bubblewrap namespaces, a uid per slot, cgroup or rlimit limits.

Every session's agent (Python entrypoints too) runs as ``python -m workers.agenthost`` inside its own
sandbox, never inside the worker process (README "Security model"). Per sandbox:

* **bubblewrap** (``bwrap``, Debian package ``bubblewrap``): new user, mount, PID, IPC, UTS, cgroup and
  network namespaces (``--unshare-all``; ``isolation.network: egress`` shares the host's network, and
  ``none``/``loopback`` get a private network namespace whose loopback reaches nothing outside it). The
  filesystem is an empty tmpfs root with the system (``/usr`` and the ``/bin``, ``/lib*`` links), a few
  files of ``/etc``, the Python installation, the virtualenv and the agent's package source bound
  **read-only**, the slot's workspace read-write at ``/workspace``, a size-bounded tmpfs ``/tmp``, a fresh
  ``/proc`` (own PID namespace) and a minimal ``/dev``. Never bound: the runtime's ``var/`` folder, the
  snapshot store, other slots' workspaces, the checkout's other files, sockets. ``--clearenv`` plus an
  allow-listed environment; ``--die-with-parent`` (killed with its worker: see below), ``--new-session`` (no
  TIOCSTI into the worker's terminal), ``--disable-userns`` (no nested user namespaces).
* **a seccomp filter** (``bwrap --seccomp FD``, ``workers/syscalls.py``, built once per worker with
  libseccomp, Debian package ``libseccomp2``): no kernel keyrings, namespaces, mounts, ptrace, bpf,
  perf, userfaultfd, kexec, ... A worker that cannot build or apply it refuses to start like without bwrap.
* **descriptors**: the host gets only its stdin/stdout protocol pipes and a stderr pipe the worker drains
  and logs as bounded, escaped data (``workers/agentlog.py``); never the runtime's own stderr or any
  other descriptor of the worker (``close_fds``; the seccomp memfd is read and closed by bwrap).
* **a uid per slot** (when the worker runs as root): each slot owns a distinct unprivileged uid claimed
  machine-wide through ``flock`` on ``<uid_lock_dir>/<uid>`` (so two workers on one host never share
  one), the sandbox starts as that uid, so ``RLIMIT_NPROC`` counts per session and file permissions
  separate sessions even without namespaces.
* **limits** (``isolation`` of the template): a cgroup v1 per slot (``memory``: ``maxMemory`` with swap
  off, ``pids``: ``maxProcesses``, ``cpu``: CFS quota for ``maxCpu``, ``freezer`` to stop the agent
  while its workspace is packed) where ``/sys/fs/cgroup/<controller>`` is writable; otherwise rlimits
  only: ``RLIMIT_AS`` (= ``maxMemory``, per process, not summed), ``RLIMIT_NPROC`` (per uid), and no CPU
  rate limit (logged at start). Always: ``RLIMIT_FSIZE`` (= ``maxDiskBytes``, per file; the tmpfs ``/tmp``
  has the same size) and ``RLIMIT_CORE`` 0. The agent host applies the template's rlimits to itself at
  ``init`` (lowering only), so a pre-started host serves any template. cgroup v2 is not driven yet: on a
  v2-only host the rlimits apply (departure from the issue's "cgroup v2 where writable", said here).
* **killing**: the whole sandbox is one PID namespace whose init dies with the outer ``bwrap`` process
  (``--die-with-parent``), so ``SIGKILL`` to that one pid ends every process of the session, however
  it daemonised; with a cgroup, its remaining pids are killed as well.
* **dying with the worker**, however the worker dies (``SIGKILL`` included):

  1. the outer ``bwrap`` has ``PR_SET_PDEATHSIG`` = SIGKILL (``setpriv --pdeathsig`` before bwrap, and
     bwrap's own ``--die-with-parent``: measured, without setpriv's the outer bwrap still died with its
     parent). Measured here (bwrap 0.8, worker as root, bwrap not setuid): it survives bwrap's capability
     drop (the kernel clears it when the euid/egid/fsuid change or capabilities are gained, not when
     they are dropped), so a SIGKILLed worker's running sandboxes die at once, an agent that ignores
     SIGTERM/SIGHUP and ``setsid`` daemons included. The suspected "bwrap's credential change clears it"
     did not happen here.
  2. that is not enough when a slot's freezer is ``FROZEN`` at that moment (the worker freezes the agent
     while it packs the workspace): the SIGKILL stays pending, and the outer bwrap, its init and the agent
     stayed frozen for good (state D, parent 1; measured). No signal helps: something outside the slot's
     cgroup must thaw it. So each worker starts a **reaper** (``substrate/sandbox_sweep.py reap``), one
     small process per worker (not per sandbox: ~13 MB RSS measured, started once with the pool, off the create path),
     outside every slot cgroup, in its own session. Its stdin is a pipe only the worker writes to, and the
     kernel closes it however the worker ends; on EOF the reaper kills, thaws and kills again everything
     in the worker's cgroups and every process of its slot uids, removes its cgroups and exits. It holds
     the uid locks too, so a uid is free again only once nothing of the dead worker runs as it. A killed
     reaper is restarted before the next spawn. (Rejected: a supervisor per sandbox costs a process per
     session; bwrap's ``--sync-fd``/``--block-fd`` only tell the outside when the sandbox ends or let it
     start, they kill nothing; ``--as-pid-1`` removes bwrap's init, not the frozen-task problem.)
  3. backstops when the reaper died too: a worker that claims a uid kills (thawing first) whatever still
     runs as it (its lock was free, so its holder is dead); each reaper at start removes the cgroups of
     workers known dead (their lock file is free) or whose processes are orphans; the local backend
     (``substrate/backends/local.py``) sweeps a worker's cgroups when it sees that worker's process gone.

``SandboxPool`` owns the slots of one worker: it claims the uids, makes the cgroups and slot folders,
and keeps one **pre-started agent host per free slot** (network ``none``, sandboxed) so a create does not
pay the ~30 ms spawn (bwrap ~7 ms + Python start-up); a template with another network or with
``sandbox: false`` spawns on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from substrate import sandbox_sweep
from substrate.models import ActorTemplateSpec
from workers import agentlog, syscalls

log = logging.getLogger("substrate.sandbox")

BWRAP_PACKAGE = "bubblewrap"
#: where the slot's workspace appears inside the sandbox
WORKSPACE_PATH = "/workspace"
#: where the agent host's package source (``workers``) appears inside the sandbox
CODE_PATH = "/opt/substrate"
#: the first line an agent host writes, once started (``workers.agenthost.main``)
READY_LINE = b'{"ready": true}'
#: a refill that takes and releases keep postponing (a burst of wakes) starts at the latest this many
#: ``refill_delay_s`` after it was first asked for
_REFILL_MAX_POSTPONE = 8
#: how long a pre-started host may take to boot before it is given up (a loaded machine: seconds)
_BOOT_TIMEOUT_S = 30.0
#: pre-started hosts booting at once: one per CPU this process may run on, at most 4. A boot is mostly
#: CPU (an interpreter importing asyncio: ~85 ms), so more boots at once than CPUs only delay the first
#: one: on 2 CPUs a new worker's first warm slot came a median 376 ms after its start with 4 at once and
#: 276 ms with 2, all 6 slots warm at 538 vs 578 ms (6 starts each). At most 4: a burst of freed slots
#: (a drain, many suspends) must not start a storm of interpreters competing with the activations that
#: follow
_BOOT_CONCURRENCY = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: files and folders of /etc an agent needs (loader cache, name service, TLS roots, time zone)
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "hosts", "resolv.conf", "localtime",
        "ssl", "ca-certificates", "ca-certificates.conf", "alternatives", "mime.types", "os-release",
        "protocols", "services", "passwd", "group")
_CGROUP_ROOT = sandbox_sweep.CGROUP_ROOT
_CGROUP_CONTROLLERS = sandbox_sweep.CONTROLLERS
_CFS_PERIOD_US = 100_000


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; the message says what to install."""


@dataclass(frozen=True)
class Limits:
    """The enforced bounds of one session (from its template's ``isolation``). Bytes, cores, seconds."""

    memory_bytes: int | None = 1 << 30
    cpu_cores: float | None = None
    processes: int | None = 256
    disk_bytes: int | None = 1 << 30
    turn_timeout_s: float = 300.0
    network: str = "none"
    sandboxed: bool = True

    @classmethod
    def of(cls, spec: ActorTemplateSpec) -> Limits:
        iso = spec.isolation
        return cls(memory_bytes=iso.memory_bytes, cpu_cores=iso.cpu_cores, processes=iso.maxProcesses,
                   disk_bytes=iso.disk_bytes, turn_timeout_s=iso.turn_timeout_s, network=iso.network,
                   sandboxed=iso.sandbox)

    def rlimits(self, with_memory: bool) -> dict[str, int]:
        """The rlimits the agent host applies to itself (``RLIMIT_*`` name -> value)."""
        out = {"RLIMIT_CORE": 0}
        if self.processes:
            out["RLIMIT_NPROC"] = self.processes
        if self.disk_bytes:
            out["RLIMIT_FSIZE"] = self.disk_bytes
        if with_memory and self.memory_bytes:
            out["RLIMIT_AS"] = self.memory_bytes
        return out


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


#: how long the start-up probe's trial sandbox may take (it takes ~10 ms on an idle machine)
PROBE_TIMEOUT_S = 60.0


def probe(bwrap: str | None, uid: int | None, bpf: bytes | None = None) -> str | None:
    """Start one empty sandbox as ``uid`` (under the seccomp filter ``bpf`` if given); None if it
    works, else why not (with what to install)."""
    if not bwrap:
        return f"bwrap not found on PATH: install the Debian package `{BWRAP_PACKAGE}` (apt-get install {BWRAP_PACKAGE})"
    fd = syscalls.bpf_fd(bpf) if bpf is not None else None
    seccomp = ["--seccomp", str(fd)] if fd is not None else []
    argv = [bwrap, *seccomp, *_unshare(uid, "none"), "--die-with-parent", "--ro-bind", "/usr", "/usr",
            *_root_links(), "--proc", "/proc", "--dev", "/dev", "--", *_setpriv(uid), "/bin/true"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT_S,
                           pass_fds=(fd,) if fd is not None else ())
    except subprocess.TimeoutExpired:
        # not a broken install: a replay that started 13 workers at once on 2 busy cores timed out a
        # 10 s probe and the workers refused to start
        return (f"bwrap did not finish a trial sandbox (/bin/true) within {PROBE_TIMEOUT_S:g} s: the machine is "
                "overloaded, or bwrap hangs")
    except OSError as e:
        return f"bwrap failed to run: {e}; install or fix the Debian package `{BWRAP_PACKAGE}`"
    finally:
        if fd is not None:
            os.close(fd)
    if r.returncode != 0:
        return (f"bwrap cannot create a sandbox here ({r.stderr.decode(errors='replace').strip()}); "
                f"it needs user namespaces (sysctl user.max_user_namespaces > 0) and the package `{BWRAP_PACKAGE}`")
    return None


def _root_links() -> list[str]:
    """Recreate /bin, /lib, /lib64, /sbin as on the host (merged-/usr links, or read-only binds)."""
    out: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            out += ["--symlink", os.readlink(p), f"/{name}"]
        elif p.is_dir():
            out += ["--ro-bind", str(p), f"/{name}"]
    return out


def _unshare(uid: int | None, network: str) -> list[str]:
    """Namespaces to unshare. As root (``uid`` set) no user namespace: the agent then runs as a real
    unprivileged uid (``_setpriv``), so per-uid rlimits and file permissions hold on the host too; as
    a non-root worker, an unprivileged user namespace (bwrap's own mode)."""
    out = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    if network != "egress":
        out.append("--unshare-net")
    if uid is None:
        out += ["--unshare-user", "--disable-userns"]
    else:  # only to let setpriv switch to the slot uid; setpriv then drops every capability
        out += ["--cap-add", "CAP_SETUID,CAP_SETGID"]
    return out


def _setpriv(uid: int | None, *, no_new_privs: bool = False) -> list[str]:
    """util-linux ``setpriv``: become the slot uid with no groups and no capabilities at all (in a sandbox
    bwrap has already set no_new_privs, so no setuid binary can regain any; ``no_new_privs`` sets it
    here, for a host without bwrap)."""
    if uid is None:
        return []
    return ["/usr/bin/setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", *(["--no-new-privs"] if no_new_privs else []), "--"]


# ------------------------------------------------------------------------------------------------ uids


class UidLease:
    """Distinct unprivileged uids for this worker's slots, claimed with ``flock`` machine-wide.

    The locks live as long as this process (or until ``close``); another worker skips a locked uid.
    Raises ``SandboxUnavailable`` when ``count`` uids cannot be claimed in ``[base, base + span)``.
    """

    def __init__(self, lock_dir: Path, base: int, span: int, count: int) -> None:
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.uids: list[int] = []
        self._fds: list[int] = []
        for uid in range(base, base + span):
            if len(self.uids) == count:
                break
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise
            self.uids.append(uid)
            self._fds.append(fd)
        if len(self.uids) < count:
            self.close()
            raise SandboxUnavailable(f"only {len(self.uids)} of {count} sandbox uids free in [{base}, {base + span})")

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


# --------------------------------------------------------------------------------------------- cgroups


def cgroup_v1_writable() -> bool:
    """Whether a per-slot cgroup v1 hierarchy can be made for every controller we use."""
    for c in _CGROUP_CONTROLLERS:
        d = _CGROUP_ROOT / c
        if not (d / "cgroup.procs").exists() or not os.access(d, os.W_OK):
            return False
    return True


class LimitNotApplied(RuntimeError):
    """A limit the template asks for could not be written to the slot's cgroup (``SlotCgroup.set``); the
    message names each file and the kernel's reason. The sandbox must then not run: an agent whose limit
    is not in force runs without one. ``memory_busy``: the memory limit was refused with EBUSY, the
    kernel unable to reclaim the slot's memory down to it (a limit too small for the slot)."""

    def __init__(self, message: str, *, memory_busy: bool = False) -> None:
        super().__init__(message)
        self.memory_busy = memory_busy


class SlotCgroup:
    """The cgroup v1 folders of one slot (memory, pids, cpu, freezer). Writes that lift a limit or set
    scheduling are best effort but logged; a limit the template asks for that cannot be written raises
    ``LimitNotApplied`` from ``set``, never silently assumed."""

    def __init__(self, name: str) -> None:
        self.dirs = {c: _CGROUP_ROOT / c / sandbox_sweep.PARENT / name for c in _CGROUP_CONTROLLERS}
        for d in self.dirs.values():
            for attempt in range(3):  # a reaper's sweep may rmdir the (still childless) worker folder between
                try:
                    d.mkdir(parents=True, exist_ok=True)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        #: ``memory.oom_control`` kept open: it is read before every turn under a memory limit
        #: (``mark_oom_baseline``), and one ``pread`` costs one system call where opening and reading the
        #: file again cost seven (about 5 % of a busy worker's CPU, 2026-12-04). Close-on-exec: no agent
        #: process inherits it
        self._oom_fd: int | None = None
        self._oom_seen = self.oom_kills()
        #: the errno of the last failed ``_write`` (0: it succeeded)
        self.last_errno = 0

    def _write(self, controller: str, name: str, value: str | int) -> str | None:
        """Write ``value`` to the controller's file ``name``; the failure, said in words (logged too),
        or None if it was written (or the folder is gone: a worker's stop removes them, and nothing is
        left to limit)."""
        self.last_errno = 0
        try:
            (self.dirs[controller] / name).write_text(str(value))
        except FileNotFoundError as e:
            if self.dirs[controller].exists():
                log.warning("cgroup write failed: %s: %s", self.dirs[controller] / name, e)
                return f"{name}: {e.strerror or e}"
        except OSError as e:
            self.last_errno = e.errno or 0
            log.warning("cgroup write failed: %s: %s", self.dirs[controller] / name, e)
            return f"{name} = {value}: {e.strerror or e}"
        return None

    def join(self, pid: int) -> None:
        """Move ``pid`` into every controller (call in the child before exec: nothing escapes)."""
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(pid))

    def set(self, limits: Limits) -> None:
        """Put ``limits`` (memory, processes, CPU) in force for the slot's processes, those running now
        included. Raises ``LimitNotApplied`` if a limit ``limits`` asks for could not be written; the
        most common case is a memory limit below what the slot's processes use already (the kernel
        answers EBUSY when it cannot reclaim down to it: a pre-started host under a ``maxMemory`` of
        a few MiB). The other limits are still written."""
        failed: list[str | None] = []
        mem = limits.memory_bytes or -1
        memsw = (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists()
        # the kernel keeps memory <= memory+swap: open memsw first, then set both (swap adds nothing)
        if memsw:
            self._write("memory", "memory.memsw.limit_in_bytes", -1)
        wrote = self._write("memory", "memory.limit_in_bytes", mem)
        memory_busy = bool(wrote) and mem > 0 and self.last_errno == errno.EBUSY
        failed.append(wrote if mem > 0 else None)  # lifting a limit is best effort (logged)
        if memsw and mem > 0:
            failed.append(self._write("memory", "memory.memsw.limit_in_bytes", mem))
        wrote = self._write("pids", "pids.max", limits.processes or "max")
        failed.append(wrote if limits.processes else None)
        self._write("cpu", "cpu.cfs_period_us", _CFS_PERIOD_US)
        quota = int(limits.cpu_cores * _CFS_PERIOD_US) if limits.cpu_cores else -1
        wrote = self._write("cpu", "cpu.cfs_quota_us", max(quota, 1000) if quota > 0 else -1)
        failed.append(wrote if quota > 0 else None)
        if errors := [f for f in failed if f]:
            raise LimitNotApplied("; ".join(errors), memory_busy=memory_busy)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs["pids"] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def oom_kills(self) -> int:
        """How many times the kernel's OOM killer acted in this slot's memory cgroup (ever)."""
        try:
            if self._oom_fd is None:
                self._oom_fd = os.open(self.dirs["memory"] / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            text = os.pread(self._oom_fd, 4096, 0)  # cgroupfs makes the file anew at offset 0
        except OSError:
            self._close_oom_fd()  # gone or stale: opened again at the next call
            return 0
        try:
            for line in text.decode().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return int((self.dirs["memory"] / "memory.failcnt").read_text())  # a kernel without oom_kill
        except (OSError, ValueError):
            return 0

    def _close_oom_fd(self) -> None:
        fd, self._oom_fd = self._oom_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def new_oom_kill(self) -> bool:
        """True once for each OOM kill since the last call or :meth:`mark_oom_baseline`."""
        n = self.oom_kills()
        seen, self._oom_seen = self._oom_seen, n
        return n > seen

    def mark_oom_baseline(self) -> None:
        """Count OOM kills from now on only: called when a session's agent boots in the slot and at each of
        its turns. A child the kernel killed for memory while the agent host lived (a shell's ``python``
        over the limit: "Killed", exit 137) left the count ahead, and the next death of any host in the
        slot, another session's ``kill -9`` or a DELETE, was reported as ``memory_limit_exceeded``
        (fresh-user run)."""
        self._oom_seen = self.oom_kills()

    def freeze(self, frozen: bool) -> None:
        self._write("freezer", "freezer.state", "FROZEN" if frozen else "THAWED")

    def empty(self, wait_s: float = 2.0) -> int:
        """Kill, thaw and kill again until the slot's cgroups hold no process (at most ``wait_s``);
        how many were left (0: empty). Blocking: call it in a thread."""
        return sandbox_sweep.thaw_and_kill(self.dirs.values(), wait_s)

    def remove(self, wait_s: float = 2.0) -> None:
        """Kill, thaw and kill again until the slot's cgroups are empty (at most ``wait_s``), then rmdir them."""
        self._close_oom_fd()
        sandbox_sweep.thaw_and_kill(self.dirs.values(), wait_s)
        sandbox_sweep.remove(self.dirs.values())


# ----------------------------------------------------------------------------------------- processes


@dataclass
class HostProcess:
    """A running agent host: its JSON-lines pipes and the pid of the outer ``bwrap`` (or the host)."""

    proc: asyncio.subprocess.Process
    slot: Slot
    limits: Limits
    sandboxed: bool
    #: whose session this host serves (set when a session takes it): labels its logged stderr
    session: str = ""
    epoch: int = 0
    #: the task that reads the host's stderr pipe and logs it (``workers.agentlog``)
    stderr_task: asyncio.Task[None] | None = field(default=None, repr=False)
    #: the host has said it finished starting (``{"ready": true}``, its first line): it answers ``init`` at once
    booted: bool = False
    #: the task reading the start-up line (``wait_booted``)
    _boot: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def wait_booted(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the host's start-up line (``{"ready": true}``, written once
        its interpreter and modules are loaded). Raises ``RuntimeError`` if it exits or writes anything
        else, ``asyncio.TimeoutError`` after ``timeout_s``.

        One task reads the line (``_read_ready``), started by the first call; a timeout or a cancelled
        waiter leaves it reading, so the pool can stop waiting for a pre-started host and hand it, still
        booting, to an activation that waits for the same line within its own deadline: a read cut off
        by a cancel could have consumed the line and left the host unusable."""
        if self.booted:
            return
        if self._boot is None:
            self._boot = asyncio.ensure_future(self._read_ready())
            # its failure is every waiter's; one that nobody awaits any more must not log "never retrieved"
            self._boot.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.wait_for(asyncio.shield(self._boot), timeout_s)

    async def _read_ready(self) -> None:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if line.strip() != READY_LINE:
            raise RuntimeError(f"agent host did not start (exit status {self.proc.returncode}, "
                               f"first line {line[:200]!r})")
        self.booted = True

    def kill(self) -> None:
        """SIGKILL the whole sandbox: the outer bwrap (its PID namespace, so every process of the
        session, dies with it), or without a sandbox the host's process group. Not the slot's cgroup:
        another host of the same slot may already run there (``SandboxPool.release`` sweeps it)."""
        if self.slot.cgroup is not None:
            self.slot.cgroup.freeze(False)  # a frozen process only dies once thawed
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self.sandboxed:
                    self.proc.kill()
                else:
                    os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        self.kill()
        with contextlib.suppress(ProcessLookupError):
            await self.proc.wait()
        if self._boot is not None and not self._boot.done():
            self._boot.cancel()
        if self.stderr_task is not None and not self.stderr_task.done():
            # EOF comes once the sandbox is gone; a writer that escaped it (opt-out mode) is not waited for
            await asyncio.wait({self.stderr_task}, timeout=0.5)
            self.stderr_task.cancel()
        for stream in (self.proc.stdin,):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()


@dataclass
class Slot:
    """One session slot of this worker: its uid, folder (``dir/workspace``) and cgroup."""

    index: int
    uid: int | None
    dir: Path
    cgroup: SlotCgroup | None
    #: the pre-started host waiting for a session (network none, sandboxed), if any
    ready: HostProcess | None = None
    busy: bool = False
    #: counts acquisitions: a release names the lease it ends, so a late one cannot free a later holder
    lease: int = 0
    _prestart: asyncio.Task[Any] | None = field(default=None, repr=False)
    #: the host ``_prestart`` spawned and waits for while it boots (an activation may take it over)
    booting: HostProcess | None = field(default=None, repr=False)
    #: set once ``_prestart``'s spawn has returned (or failed): ``booting`` is then known
    _spawned: asyncio.Future[None] | None = field(default=None, repr=False)
    #: the workspace was made for this worker (``SandboxPool.start``): no host is pre-started before
    prepared: bool = True

    @property
    def workspace(self) -> Path:
        return self.dir / "workspace"


class SandboxPool:
    """The slots of one worker and the sandboxes that run in them.

    ``acquire(limits)`` gives a free slot with a fresh, empty workspace owned by the slot's uid and,
    for the default network and sandbox, its pre-started host; ``spawn(slot, limits)`` starts a host;
    ``release(slot)`` kills everything of the slot, empties the workspace and pre-starts the next host.

    Pre-started hosts (up to ``prestart``) are sandboxed with network ``none``; in a pool whose every
    template opts out of the sandbox (``require_sandbox=False``) they are unsandboxed hosts instead,
    the kind its sessions use. A host counts as pre-started only once it has booted (its
    ``{"ready": true}`` line), so an activation never waits for a half-started interpreter while a
    booted one is free. The start-up's and the refills boot ``_BOOT_CONCURRENCY`` hosts at a time (a new
    worker booting all its slots at once, 16 by default, had each host finish only when all did: the first
    activations on a worker started for them waited for the whole batch, and a wake after a restart on a
    loaded 2-core machine ran past the park timeout), and refills start only once the slots have been
    left alone (no host taken, no slot released) for ``refill_delay_s``, at most ``_REFILL_MAX_POSTPONE``
    of those delays after the first ask, while more than a quarter of ``prestart`` booted spares are
    left (``refill_delay_s`` after the first ask below that, at once at one spare): a slot is often freed
    (suspend, delete) just before an activation needs the CPU (a pressure suspend makes room for a waiting
    wake), and a burst of wakes is served from the spares, both of which a refill's boots would slow.
    """

    def __init__(self, root: Path, slots: int, *, name: str, bwrap: str | None, uid_base: int,
                 uid_span: int, uid_lock_dir: Path, prestart: int = 16, require_sandbox: bool = True,
                 read_limit: int = 64 * 1024 * 1024, refill_delay_s: float = 0.25) -> None:
        self.root = root
        self.name = name
        self.bwrap = bwrap
        self.prestart = prestart
        #: called (no arguments) each time a pre-started host has booted: the worker then reports its
        #: warm slots soon instead of at its next heartbeat
        self.on_host_ready: Callable[[], None] | None = None
        self.refill_delay_s = refill_delay_s
        #: what a pre-started host is spawned with (its kind: sandboxed with network none, or not)
        self.prestart_limits = Limits() if require_sandbox else Limits(sandboxed=False)
        self.as_root = os.geteuid() == 0
        #: opted-out hosts (``isolation.sandbox: false``) run as their slot's uid: None until the first
        #: one is spawned (``_probe_unsandboxed_uid``), then whether that uid can run the host
        self.unsandboxed_uid_ok: bool | None = None
        self.uid_lock_dir = uid_lock_dir
        self._worker_lock: int | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._reaper_restarted = float("-inf")
        self.uids = UidLease(uid_lock_dir, uid_base, uid_span, slots) if self.as_root else None
        if self.uids:
            self._claim(self.uids)
        probe_uid = self.uids.uids[0] if self.uids else None
        #: the sandbox's seccomp filter (BPF), built once; None only when it cannot be built (then no
        #: sandbox starts: ``unavailable`` says why)
        self.bpf: bytes | None = None
        try:
            self.bpf = syscalls.build_bpf()
            self.unavailable = probe(bwrap, probe_uid, self.bpf)
        except syscalls.SeccompUnavailable as e:
            self.unavailable = str(e)
        if self.unavailable and require_sandbox:
            self._stop_reaper()
            if self.uids:
                self.uids.close()
            raise SandboxUnavailable(self.unavailable)
        self.use_cgroups = self.as_root and cgroup_v1_writable()
        if not self.use_cgroups:
            log.warning("cgroup v1 not writable: limits are rlimits only (RLIMIT_AS per process for "
                        "maxMemory, RLIMIT_NPROC per uid for maxProcesses, no maxCpu rate limit)")
        self.slots: list[Slot] = []
        for i in range(slots):
            d = root / "slots" / str(i)
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o755)
            cg = SlotCgroup(f"{name}/slot-{i}") if self.use_cgroups else None
            self.slots.append(Slot(index=i, uid=self.uids.uids[i] if self.uids else None, dir=d, cgroup=cg))
        self._site = _python_binds()
        self._closed = False
        self._warmup: asyncio.Task[None] | None = None
        #: the warm-up task is still in its refill delay (a refill needed now may replace it)
        self._warmup_waiting = False
        #: when the refill now waiting was first asked for (loop time): takes and releases postpone it,
        #: up to ``_REFILL_MAX_POSTPONE`` delays in all
        self._refill_since = 0.0
        self._freed = asyncio.Event()
        #: a slot's workspace was made during ``start`` (the warm-up waits for it besides its boots)
        self._prepared = asyncio.Event()
        #: the longest line read from a host's stdout (the protocol): a longer answer kills the host
        self.read_limit = read_limit

    # ---------------------------------------------------------------------------------- slot lifecycle
    async def start(self) -> None:
        """Make every slot's workspace; pre-start the hosts a few at a time in the background (the
        worker is ready at once; a create that comes first spawns its own). The first slot's host starts
        booting as soon as that slot is ready, while the others' workspaces are made (each clears its
        uid's keyrings in a forked child: ~5-10 ms a slot, which delayed every boot of a new worker by
        ~50 ms for 6 slots)."""
        for s in self.slots:
            s.prepared = False
        first, rest = self.slots[:1], self.slots[1:]
        for s in first:
            await asyncio.to_thread(self._reset_workspace, s)
            s.prepared = True
        if self._can_prestart():  # a few at a time (class docstring): the first hosts are ready sooner
            self._warmup = asyncio.create_task(self._prestart_all())

        async def prepare(s: Slot) -> None:
            await asyncio.to_thread(self._reset_workspace, s)
            s.prepared = True
            self._prepared.set()  # the warm-up may take it now

        await asyncio.gather(*(prepare(s) for s in rest))

    def _warm(self) -> int:
        return sum(1 for s in self.slots if s.ready is not None or (s._prestart is not None and not s._prestart.done()))

    def _spares(self) -> int:
        """Free slots whose pre-started host has booted and is alive."""
        return sum(1 for s in self.slots if not s.busy and s.ready is not None and s.ready.alive)

    def warm_slots(self) -> int:
        """Free slots an activation would start in at once: their pre-started host has booted (the
        worker reports it with its heartbeat; placement prefers a worker that has one)."""
        return self._spares()

    def _can_prestart(self) -> bool:
        return bool(self.prestart) and not self._closed and not (self.prestart_limits.sandboxed and self.unavailable)

    def _refill(self) -> None:
        """Start warming free slots up to ``prestart`` in the background: at once if at most one booted
        spare is left, else once the slots have been left alone ``refill_delay_s`` (see the class
        docstring)."""
        if not self._can_prestart():
            return
        spares = self._spares()
        now = asyncio.get_running_loop().time()
        # three levels of spares: at most one left, warm up now; at most a quarter of ``prestart`` (at least
        # 2) left (a steady stream of takes), warm up ``refill_delay_s`` after the first ask, as a refill
        # always did; more (a burst the spares still cover), wait for a lull: each take or release restarts
        # the wait, up to ``_REFILL_MAX_POSTPONE`` delays in all. Boots (~85 ms of CPU each) then land after
        # a burst of wakes, not under it (1 MiB S3 wakes back to back: router Wake-Ms p95 about halved),
        # while sequential creates, which use the spares up, are refilled before they run dry (waiting for
        # a lull down to the last spare made each create wait for boots: p50 65 -> 75 ms); A/Bs in
        # docs/bench/2026-12-06-refill-lull-ab.md
        plenty = spares > max(2, self.prestart // 4)
        if self._warmup is not None and not self._warmup.done():
            if not self._warmup_waiting:
                return  # booting now
            if spares > 1 and not plenty:
                return  # waiting since the first ask: keep that wait
            self._warmup.cancel()  # waiting: wait again from now (a lull), or warm up now
        else:
            self._refill_since = now
        if spares <= 1:
            delay = 0.0
        elif not plenty:
            delay = max(0.0, self._refill_since + self.refill_delay_s - now)
        else:
            delay = max(0.0, min(self.refill_delay_s,
                                 self._refill_since + self.refill_delay_s * _REFILL_MAX_POSTPONE - now))
        self._warmup_waiting = delay > 0
        self._warmup = asyncio.create_task(self._prestart_all(delay))

    async def _prestart_all(self, delay_s: float = 0.0, concurrency: int = _BOOT_CONCURRENCY) -> None:
        """Pre-start hosts in free slots until ``prestart`` are warm, ``concurrency`` booting at a time,
        trying each slot once per pass (a failing spawn does not loop)."""
        if delay_s:
            await asyncio.sleep(delay_s)
        self._warmup_waiting = False
        tried: set[int] = set()
        while not self._closed and self._warm() < self.prestart:
            booting = [s._prestart for s in self.slots if s._prestart is not None and not s._prestart.done()]
            want = next((s for s in self.slots if not s.busy and s.ready is None and s.index not in tried
                         and s.prepared and (s._prestart is None or s._prestart.done())), None)
            if want is not None and len(booting) < concurrency:
                tried.add(want.index)
                want._prestart = asyncio.create_task(self._prestart(want))
                continue
            unprepared = any(not s.prepared for s in self.slots)
            if not booting and not unprepared:
                return
            # wait for a boot to end, or (during start) for another slot's workspace
            self._prepared.clear()
            waits: set[asyncio.Future[Any]] = set(booting)
            more = asyncio.ensure_future(self._prepared.wait()) if unprepared else None
            if more is not None:
                waits.add(more)
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if more is not None:
                    more.cancel()

    def free(self) -> int:
        return sum(1 for s in self.slots if not s.busy)

    async def acquire(self, wait_s: float = 5.0, prefer: int | None = None) -> Slot:
        """A free slot (prefer one whose host is pre-started), waiting up to ``wait_s`` for one being
        torn down (the directory frees a slot before its sandbox is gone). ``LookupError`` if none.

        ``prefer``: the slot index the directory placed the session in; taken when it is free and its
        host is as warm as any other free slot's, so that the API's ``slot`` is usually the sandbox's
        (its cgroup ``slot-N`` and uid: an operator who acts on a session's slot finds that session)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (free := [s for s in self.slots if not s.busy]):
            self._freed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise LookupError("no free slot")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)
        # a booted pre-started host first, then one still booting (sooner than a spawn), then any
        def warmth(x: Slot) -> int:
            if x.ready is not None and x.ready.alive:
                return 2
            return 1 if x._prestart is not None and not x._prestart.done() else 0

        best = max(warmth(x) for x in free)
        s = next((x for x in free if x.index == prefer and warmth(x) == best), None) if prefer is not None else None
        if s is None:
            s = next(x for x in free if warmth(x) == best)
        s.busy = True
        s.lease += 1
        return s

    def _fits(self, host: HostProcess, limits: Limits) -> bool:
        """Whether a pre-started ``host`` can serve ``limits``: what is fixed at spawn must match (the
        sandbox, and for a sandbox its network and /tmp size); the rest is applied at ``init``."""
        if not host.alive or host.sandboxed != limits.sandboxed:
            return False
        if not limits.sandboxed:
            return True
        return limits.network == "none" and limits.disk_bytes == host.limits.disk_bytes and not self.unavailable

    async def host_for(self, slot: Slot, limits: Limits) -> HostProcess:
        """The slot's pre-started host if it fits ``limits`` (see ``_fits``), else a new one (not yet
        booted: the caller reads its ready line). Taking one starts warming another free slot."""
        ready, slot.ready = slot.ready, None
        task = slot._prestart
        if ready is None and task is not None and not task.done():
            if slot.booting is None and slot._spawned is not None:  # its spawn (fork + exec) is under way
                await asyncio.wait({task, slot._spawned}, return_when=asyncio.FIRST_COMPLETED)
            ready, slot.ready = slot.ready, None
            if ready is None and slot.booting is not None:
                # take the booting host over instead of waiting for the pool's boot timeout: it started
                # before any host spawned now would, and ``_booted`` waits for its ready line within the
                # turn's deadline (on a loaded machine a boot takes seconds; waiting out the pool's
                # timeout and then spawning again cost a restore up to 30 s more)
                ready, slot.booting = slot.booting, None
                task.cancel()
        self._refill()
        if ready is not None and self._fits(ready, limits):
            ready.limits = limits
            if slot.cgroup is None:
                return ready
            try:
                slot.cgroup.set(limits)
                return ready
            except LimitNotApplied as e:
                # it already uses more than the limit (a maxMemory of a few MiB): a host spawned under
                # the limit either fits in it or is killed at boot, and never runs without it (a
                # fresh-user run: maxMemory 1Mi let the agent allocate 300 MiB)
                log.info("a pre-started agent host is over the template's limits; spawning one under them",
                         extra={"slot": slot.index, "error": str(e)})
                await ready.close()
                # its sandbox's processes die after the outer one: until they are gone their memory is
                # still the slot's, and the limit would be refused again (a loaded run: 500, not 422)
                await asyncio.to_thread(slot.cgroup.empty)
                return await self.spawn(slot, limits)
        if ready is not None:
            await ready.close()
        return await self.spawn(slot, limits)

    async def release(self, slot: Slot, host: HostProcess | None, lease: int | None = None) -> None:
        """Kill the slot's processes, empty its workspace, pre-start its next host, mark it free.

        With ``lease`` (``slot.lease`` as ``acquire`` left it): only if the slot is still held under that
        lease; a release of an older lease (the slot was freed and taken again since) only closes
        ``host`` and is logged: sweeping the slot would kill its new holder's agent."""
        if host is not None:
            await host.close()
        if lease is not None and (lease != slot.lease or not slot.busy):
            log.warning("stale release of a sandbox slot ignored", extra={
                "slot": slot.index, "lease": lease, "current_lease": slot.lease, "busy": slot.busy})
            return
        stale, slot.ready = slot.ready, None  # an activation that failed before taking its host
        if stale is not None:
            await stale.close()
        await self._drop_booting(slot)
        if slot.cgroup is not None:
            slot.cgroup.freeze(False)
            slot.cgroup.kill_all()
        await asyncio.to_thread(self._reset_workspace, slot)
        slot.busy = False
        self._freed.set()
        self._refill()

    async def _drop_booting(self, slot: Slot) -> None:
        """Stop the pre-start under way in ``slot`` (a host spawning or booting there) and close its host.

        ``release`` calls it before it sweeps the slot: an activation that failed before it took the
        slot's booting host (a credential it could not resolve, say) left that host to the pre-start
        task, and the sweep's cgroup kill then killed it under that task. Until the task read the EOF,
        the slot still named the dead host as booting (and, not yet reaped, ``alive``): the next
        activation in the slot adopted it and failed ``agent_start_failed`` ("exit status None, first
        line b''", a loaded CI run, 2026-12-05). Closing it here leaves the slot with no host, and the
        refill that ends ``release`` starts a fresh one."""
        task = slot._prestart
        if task is None or task.done():
            return
        if slot.booting is None and slot._spawned is not None and not slot._spawned.done():
            # its spawn (fork + exec) is under way: a cancel now could leave the process unowned
            await asyncio.wait({task, slot._spawned}, return_when=asyncio.FIRST_COMPLETED)
        booting, slot.booting = slot.booting, None  # cleared first: the task then leaves the host to us
        task.cancel()
        if booting is not None:
            await booting.close()

    async def close(self) -> None:
        """Kill every host, remove the cgroups (the worker's own folder too), stop the reaper and free
        the uids (the reaper holds them until it has checked that nothing runs as them)."""
        self._closed = True
        if self._warmup is not None:
            self._warmup.cancel()
        for s in self.slots:
            if s._prestart is not None:
                s._prestart.cancel()
            if s.ready is not None:
                await s.ready.close()
                s.ready = None
            if s.cgroup is not None:
                s.cgroup.remove()
        if self.use_cgroups:
            sandbox_sweep.remove(sandbox_sweep.worker_dirs(self.name))
        await asyncio.to_thread(self._stop_reaper)
        if self.uids:
            self.uids.close()

    # ------------------------------------------------------------------------------ dying with the worker
    def _claim(self, uids: UidLease) -> None:
        """After the uids are claimed: take the worker's lock, kill what still runs as those uids (their
        locks were free, so whoever ran them is dead: a leftover of a worker whose reaper was killed
        too), and start the reaper that kills this worker's sandboxes when it dies."""
        try:
            lock = sandbox_sweep.worker_lock(self.uid_lock_dir, self.name)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: another live worker has this name
            except OSError:
                os.close(fd)
                raise
            self._worker_lock = fd
        except (OSError, ValueError):
            log.warning("no worker lock: stale cgroups of this worker are found by their orphaned processes only",
                        exc_info=True)
        killed = sandbox_sweep.kill_uids(uids.uids, wait_s=5.0)
        if killed:
            log.warning("killed processes left by a dead worker under this worker's sandbox uids",
                        extra={"worker": self.name, "processes": killed})
        self._start_reaper()

    def _start_reaper(self) -> None:
        """Start ``substrate/sandbox_sweep.py reap`` (module docstring there): its stdin is a pipe only this
        process writes to, so it sees EOF when this worker ends, however it ends, then thaws and kills
        what is left of its sandboxes. It inherits the uid and worker locks: they stay held until it is done."""
        if not self.uids:
            return
        fds = [*self.uids._fds, *([self._worker_lock] if self._worker_lock is not None else [])]
        argv = [sys.executable, "-I", "-S", "-B", sandbox_sweep.__file__, "reap", "--worker", self.name,
                "--uids", ",".join(map(str, self.uids.uids)), "--lock-dir", str(self.uid_lock_dir),
                "--cgroup-root", str(_CGROUP_ROOT), *(["--own-lock"] if self._worker_lock is not None else [])]
        try:
            # its own session: a signal to the worker's process group or terminal must not stop it
            self._reaper = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            close_fds=True, pass_fds=fds, start_new_session=True)
        except OSError:
            self._reaper = None
            log.warning("sandbox reaper did not start: sandboxes of a killed worker rely on PR_SET_PDEATHSIG "
                        "and the next start-up sweep", exc_info=True)

    def _check_reaper(self) -> None:
        """Restart the reaper if it died (someone killed it): called before every spawn."""
        if self._closed or not self.uids:
            return
        if self._reaper is None or self._reaper.poll() is not None:
            now = time.monotonic()
            if now - self._reaper_restarted < 10.0:
                return  # one that keeps failing must not cost every create a fork and an exec
            self._reaper_restarted = now
            if self._reaper is not None:
                log.warning("sandbox reaper exited; restarting it", extra={"worker": self.name,
                                                                          "status": self._reaper.returncode})
                with contextlib.suppress(OSError):
                    if self._reaper.stdin is not None:
                        self._reaper.stdin.close()
            self._start_reaper()

    def _stop_reaper(self, timeout_s: float = 10.0) -> None:
        """Close the reaper's pipe (it then sweeps, finding nothing after a clean close) and wait for it."""
        r, self._reaper = self._reaper, None
        if r is not None:
            with contextlib.suppress(OSError):
                if r.stdin is not None:
                    r.stdin.close()
            try:
                r.wait(timeout_s)
            except subprocess.TimeoutExpired:
                r.kill()
                r.wait()
        if self._worker_lock is not None:
            with contextlib.suppress(OSError, ValueError):  # its reaper removes it too, unless it was killed
                sandbox_sweep.worker_lock(self.uid_lock_dir, self.name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                os.close(self._worker_lock)
            self._worker_lock = None

    async def _prestart(self, slot: Slot) -> None:
        spawned = slot._spawned = asyncio.get_running_loop().create_future()
        try:
            host = await self.spawn(slot, self.prestart_limits)
        except Exception:  # noqa: BLE001 - a create then spawns on demand
            log.warning("pre-starting an agent host failed", extra={"slot": slot.index}, exc_info=True)
            return
        finally:
            if not spawned.done():
                spawned.set_result(None)
        slot.booting = host
        try:
            await host.wait_booted(_BOOT_TIMEOUT_S)
        except (Exception, asyncio.CancelledError) as e:
            adopted = slot.booting is not host  # an activation took it over (``host_for``): it is theirs
            if not adopted:
                slot.booting = None
                await host.close()
            if isinstance(e, asyncio.CancelledError):
                raise
            if not adopted:
                why = f"not ready within {_BOOT_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else (str(e) or repr(e))
                log.warning("a pre-started agent host did not boot: %s", why, extra={"slot": slot.index})
            return
        if slot.booting is not host:
            return  # taken over while booting
        slot.booting = None
        # a busy slot keeps it too: its activation chose this slot for the host being booted and takes
        # it in ``host_for`` (or ``release`` closes it if the activation failed first)
        if self._closed or slot.ready is not None:
            await host.close()
            return
        slot.ready = host
        if self.on_host_ready is not None:
            self.on_host_ready()

    def _reset_workspace(self, slot: Slot) -> None:
        if slot.uid is not None:  # per-uid kernel state outlives the session's processes (seccomp bans it too)
            syscalls.clear_uid_keyrings(slot.uid)
        ws = slot.workspace
        if ws.exists() or ws.is_symlink():
            shutil.rmtree(ws, ignore_errors=True)
        for leftover in slot.dir.iterdir():  # staging folders of an interrupted restore
            shutil.rmtree(leftover, ignore_errors=True)
        ws.mkdir(mode=0o700)
        if slot.uid is not None:
            os.chown(ws, slot.uid, slot.uid)

    # ------------------------------------------------------------------------------------------- spawn
    def argv(self, slot: Slot, limits: Limits) -> list[str]:
        """The command line of a host in ``slot`` (bwrap + python, or python alone when opted out)."""
        host = [sys.executable, "-s", "-B", "-m", "workers.agenthost"]
        if not limits.sandboxed:
            # opted out (no namespaces, no seccomp): still not root when the slot's uid can run the host
            # (``unsandboxed_uid_ok``); a fresh-user run's opted-out agent ran as root and read the
            # runtime's Redis password, every workspace and every snapshot
            return [*_setpriv(slot.uid, no_new_privs=True), *host] if self.unsandboxed_uid_ok else host
        assert self.bwrap
        a = [self.bwrap, *_unshare(slot.uid, limits.network), "--die-with-parent", "--new-session",
             "--hostname", "sandbox", "--clearenv"]
        a += ["--ro-bind", "/usr", "/usr", *_root_links()]
        # /tmp first: a later tmpfs would hide binds below it (a checkout or venv under /tmp, as in CI's
        # fresh clone, left every agent without its interpreter: exit 127). Sticky and world-writable like
        # a host /tmp: the agent runs as the slot's uid, not root
        if limits.disk_bytes:
            a += ["--size", str(limits.disk_bytes)]
        a += ["--perms", "1777", "--tmpfs", "/tmp"]
        made: set[str] = {"/", "/tmp"}

        def ro(src: str, dest: str) -> None:
            # parents bwrap would create 0700 (unreadable for the slot uid) are made 0755 first
            missing = []
            for parent in Path(dest).parents:
                if str(parent) in made:
                    break
                missing.append(str(parent))
            for d in reversed(missing):
                a.extend(["--perms", "0755", "--dir", d])
                made.add(d)
            a.extend(["--ro-bind", src, dest])

        for name in _ETC:
            p = Path("/etc") / name
            if p.exists():
                ro(str(p), str(p))
        for src in self._site:
            ro(src, src)
        ro(str(_PROJECT_ROOT / "workers"), f"{CODE_PATH}/workers")
        a += ["--proc", "/proc", "--dev", "/dev"]
        a += ["--bind", str(slot.dir), "/slot", "--symlink", "/slot/workspace", WORKSPACE_PATH,
              "--chdir", WORKSPACE_PATH]
        for k, v in self.base_env(limits).items():
            a += ["--setenv", k, v]
        return a + ["--", *_setpriv(slot.uid), *host]

    def launcher(self, slot: Slot, limits: Limits) -> list[str]:
        """What runs before bwrap, in the same process (each step ``exec``s the next): join the slot's
        cgroups (``sh``), set ``RLIMIT_CORE`` 0 and ``RLIMIT_NPROC`` for the slot uid (``prlimit``),
        and die with the worker (``setpriv --pdeathsig KILL``, from the first exec on; bwrap's own
        ``--die-with-parent`` sets the same once it runs). A frozen sandbox cannot act on that signal:
        the reaper (module docstring), restarted here if it died, thaws it."""
        out: list[str] = []
        if slot.cgroup is not None:
            out += ["/bin/sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"',
                    "sh", *(str(d / "cgroup.procs") for d in slot.cgroup.dirs.values()), "--"]
        out += ["/usr/bin/prlimit", "--core=0:0"]
        # counts the slot uid's processes: only when the host runs as that uid
        if limits.processes and slot.uid is not None and (limits.sandboxed or self.unsandboxed_uid_ok):
            out.append(f"--nproc={limits.processes}:{limits.processes}")
        self._check_reaper()
        return out + ["--", "/usr/bin/setpriv", "--pdeathsig", "KILL", "--"]

    async def _probe_unsandboxed_uid(self, slot: Slot) -> None:
        """Find out once whether an opted-out host can run as a slot's unprivileged uid: it needs to read
        this Python, its packages and the project's ``workers`` package, and to enter its slot's folder,
        any of which may sit in a folder only root can enter (``/root``: a checkout there keeps its data
        folder there too). Sets ``unsandboxed_uid_ok``; if not, opted-out hosts run as this process's
        user, said once in the log with the reason."""
        proc = None
        argv = [*_setpriv(slot.uid, no_new_privs=True), sys.executable, "-s", "-B", "-c",
                "import os, sys, workers.agenthost; os.chdir(sys.argv[1])", str(slot.dir.resolve())]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, env=self.base_env(Limits(sandboxed=False)), cwd="/", close_fds=True)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            ok, why = proc.returncode == 0, err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        except (OSError, asyncio.TimeoutError) as e:
            ok, why = False, [str(e) or type(e).__name__]
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self.unsandboxed_uid_ok is None:
            self.unsandboxed_uid_ok = ok
            if not ok:
                log.warning("agents of templates with isolation.sandbox false run as this worker's user (root): "
                            "the slot's unprivileged uid cannot run this Python or enter the worker's folder "
                            "(%s); keep Python, the project and SUBSTRATE_DATA_DIR where every user can enter "
                            "them (not under /root) to run them unprivileged",
                            why[0][:300])

    def base_env(self, limits: Limits) -> dict[str, str]:
        """The fixed minimum environment of a host (the template and session env come with ``init``)."""
        home = WORKSPACE_PATH if limits.sandboxed else "/nonexistent"
        return {"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                "PYTHONPATH": CODE_PATH if limits.sandboxed else str(_PROJECT_ROOT),
                "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2", "TMPDIR": "/tmp"}

    async def spawn(self, slot: Slot, limits: Limits) -> HostProcess:
        """Start an agent host in ``slot`` under ``limits``; its pipes speak ``workers.agenthost``'s protocol.
        Raises ``SandboxUnavailable`` (no sandbox on this machine) or ``LimitNotApplied`` (a limit of
        ``limits`` could not be put in force; nothing is started)."""
        if limits.sandboxed and self.unavailable:
            raise SandboxUnavailable(self.unavailable)
        if not limits.sandboxed and slot.uid is not None and self.unsandboxed_uid_ok is None:
            await self._probe_unsandboxed_uid(slot)
        cg = slot.cgroup
        if cg is not None:
            cg.freeze(False)
            cg.set(limits)
        env = self.base_env(limits) if not limits.sandboxed else {}
        cwd = str(slot.workspace) if not limits.sandboxed else None
        # no preexec_fn: a Python callback in the child forces fork() and makes the event loop wait for
        # the child's exec; this argv prefix does the same steps after a vfork (measured: ~1 ms blocked)
        # stderr is a pipe the worker drains and logs as data (workers/agentlog.py), never the runtime's
        # own stderr: an agent could reopen that (a log file) through /proc/<pid>/fd/2 and read or forge
        # log lines. close_fds: nothing else of the worker's reaches the sandbox
        argv = self.argv(slot, limits)
        # bwrap's options (host paths of the slot, the venv, /etc files) go through ``--args FD``: the
        # sandbox's PID 1 is a fork of bwrap, and its /proc/1/cmdline, readable by the agent, showed
        # them all (a fresh-user run); now it shows ``bwrap --args N --seccomp M -- <agent host>``. The
        # seccomp filter (workers/syscalls.py, built once per worker) gets its own memfd per spawn too;
        # bwrap reads and closes both before the agent starts
        fds: tuple[int, ...] = ()
        if limits.sandboxed:
            cut = argv.index("--")
            args_fd = syscalls.memfd_with(b"".join(o.encode() + b"\0" for o in argv[1:cut]),
                                          "substrate-bwrap-args")
            argv[1:cut] = ["--args", str(args_fd)]
            fds = (args_fd,)
            if self.bpf is not None:
                try:
                    seccomp_fd = syscalls.bpf_fd(self.bpf)
                except OSError:
                    os.close(args_fd)
                    raise
                argv[3:3] = ["--seccomp", str(seccomp_fd)]
                fds += (seccomp_fd,)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.launcher(slot, limits), *argv, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, close_fds=True,
                pass_fds=fds, start_new_session=not limits.sandboxed, limit=self.read_limit)
        finally:
            for fd in fds:
                os.close(fd)
        host = HostProcess(proc=proc, slot=slot, limits=limits, sandboxed=limits.sandboxed)
        assert proc.stderr is not None
        host.stderr_task = asyncio.create_task(agentlog.drain(proc.stderr, host, slot.index))
        return host


def _python_binds() -> list[str]:
    """Read-only binds that make this Python and its installed packages work inside a sandbox."""
    paths = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}
    out = []
    for p in sorted(paths, key=len):
        if not p.startswith("/usr/") and p != "/usr" and not any(p == o or p.startswith(o + "/") for o in out):
            out.append(p)
    return out
