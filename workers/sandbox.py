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
  allow-listed environment; ``--die-with-parent`` (killed with its worker), ``--new-session`` (no
  TIOCSTI into the worker's terminal), ``--disable-userns`` (no nested user namespaces).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from substrate.models import ActorTemplateSpec

log = logging.getLogger("substrate.sandbox")

BWRAP_PACKAGE = "bubblewrap"
#: where the slot's workspace appears inside the sandbox
WORKSPACE_PATH = "/workspace"
#: where the agent host's package source (``workers``) appears inside the sandbox
CODE_PATH = "/opt/substrate"
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: files and folders of /etc an agent needs (loader cache, name service, TLS roots, time zone)
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "hosts", "resolv.conf", "localtime",
        "ssl", "ca-certificates", "ca-certificates.conf", "alternatives", "mime.types", "os-release",
        "protocols", "services", "passwd", "group")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
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


def probe(bwrap: str | None, uid: int | None) -> str | None:
    """Start one empty sandbox as ``uid``; None if it works, else why not (with what to install)."""
    if not bwrap:
        return f"bwrap not found on PATH: install the Debian package `{BWRAP_PACKAGE}` (apt-get install {BWRAP_PACKAGE})"
    argv = [bwrap, *_unshare(uid, "none"), "--die-with-parent", "--ro-bind", "/usr", "/usr",
            *_root_links(), "--proc", "/proc", "--dev", "/dev", "--", *_setpriv(uid), "/bin/true"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap failed to run: {e}; install or fix the Debian package `{BWRAP_PACKAGE}`"
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


def _setpriv(uid: int | None) -> list[str]:
    """util-linux ``setpriv``: become the slot uid with no groups and no capabilities at all (bwrap has
    already set no_new_privs, so no setuid binary can regain any)."""
    if uid is None:
        return []
    return ["/usr/bin/setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--"]


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


class SlotCgroup:
    """The cgroup v1 folders of one slot (memory, pids, cpu, freezer). All writes are best effort but
    logged: limits that cannot be written are reported once, never silently assumed."""

    def __init__(self, name: str) -> None:
        self.dirs = {c: _CGROUP_ROOT / c / "substrate" / name for c in _CGROUP_CONTROLLERS}
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        self._oom_seen = self.oom_kills()

    def _write(self, controller: str, name: str, value: str | int) -> None:
        try:
            (self.dirs[controller] / name).write_text(str(value))
        except OSError as e:
            log.warning("cgroup write failed: %s: %s", self.dirs[controller] / name, e)

    def join(self, pid: int) -> None:
        """Move ``pid`` into every controller (call in the child before exec: nothing escapes)."""
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(pid))

    def set(self, limits: Limits) -> None:
        mem = limits.memory_bytes or -1
        memsw = (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists()
        # the kernel keeps memory <= memory+swap: open memsw first, then set both (swap adds nothing)
        if memsw:
            self._write("memory", "memory.memsw.limit_in_bytes", -1)
        self._write("memory", "memory.limit_in_bytes", mem)
        if memsw and mem > 0:
            self._write("memory", "memory.memsw.limit_in_bytes", mem)
        self._write("pids", "pids.max", limits.processes or "max")
        self._write("cpu", "cpu.cfs_period_us", _CFS_PERIOD_US)
        quota = int(limits.cpu_cores * _CFS_PERIOD_US) if limits.cpu_cores else -1
        self._write("cpu", "cpu.cfs_quota_us", max(quota, 1000) if quota > 0 else -1)

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
            for line in (self.dirs["memory"] / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return int((self.dirs["memory"] / "memory.failcnt").read_text())
        except (OSError, ValueError):
            return 0

    def new_oom_kill(self) -> bool:
        """True once for each OOM kill since the last call."""
        n = self.oom_kills()
        seen, self._oom_seen = self._oom_seen, n
        return n > seen

    def freeze(self, frozen: bool) -> None:
        self._write("freezer", "freezer.state", "FROZEN" if frozen else "THAWED")

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            with contextlib.suppress(OSError):
                d.rmdir()


# ----------------------------------------------------------------------------------------- processes


@dataclass
class HostProcess:
    """A running agent host: its JSON-lines pipes and the pid of the outer ``bwrap`` (or the host)."""

    proc: asyncio.subprocess.Process
    slot: Slot
    limits: Limits
    sandboxed: bool

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

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
    _prestart: asyncio.Task[Any] | None = field(default=None, repr=False)

    @property
    def workspace(self) -> Path:
        return self.dir / "workspace"


class SandboxPool:
    """The slots of one worker and the sandboxes that run in them.

    ``acquire(limits)`` gives a free slot with a fresh, empty workspace owned by the slot's uid and,
    for the default network and sandbox, its pre-started host; ``spawn(slot, limits)`` starts a host;
    ``release(slot)`` kills everything of the slot, empties the workspace and pre-starts the next host.
    """

    def __init__(self, root: Path, slots: int, *, name: str, bwrap: str | None, uid_base: int,
                 uid_span: int, uid_lock_dir: Path, prestart: int = 16, require_sandbox: bool = True) -> None:
        self.root = root
        self.name = name
        self.bwrap = bwrap
        self.prestart = prestart
        self.as_root = os.geteuid() == 0
        self.uids = UidLease(uid_lock_dir, uid_base, uid_span, slots) if self.as_root else None
        probe_uid = self.uids.uids[0] if self.uids else None
        self.unavailable = probe(bwrap, probe_uid)
        if self.unavailable and require_sandbox:
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
        self._freed = asyncio.Event()

    # ---------------------------------------------------------------------------------- slot lifecycle
    async def start(self) -> None:
        """Make every slot's workspace; pre-start the hosts one after another in the background (the
        worker is ready at once; a create that comes first spawns its own)."""
        for s in self.slots:
            await asyncio.to_thread(self._reset_workspace, s)
        if self.prestart and not self.unavailable:
            self._warmup = asyncio.create_task(self._prestart_all())

    def _warm(self) -> int:
        return sum(1 for s in self.slots if s.ready is not None or (s._prestart is not None and not s._prestart.done()))

    async def _prestart_all(self) -> None:
        for s in self.slots:
            if self._closed:
                return
            if self._warm() >= self.prestart:
                return
            if not s.busy and s.ready is None and (s._prestart is None or s._prestart.done()):
                s._prestart = asyncio.create_task(self._prestart(s))
                await asyncio.wait([s._prestart])

    def free(self) -> int:
        return sum(1 for s in self.slots if not s.busy)

    async def acquire(self, wait_s: float = 5.0) -> Slot:
        """A free slot (prefer one whose host is pre-started), waiting up to ``wait_s`` for one being
        torn down (the directory frees a slot before its sandbox is gone). ``LookupError`` if none."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not (free := [s for s in self.slots if not s.busy]):
            self._freed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise LookupError("no free slot")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)
        s = next((s for s in free if s.ready is not None and s.ready.alive), free[0])
        s.busy = True
        return s

    async def host_for(self, slot: Slot, limits: Limits) -> HostProcess:
        """The slot's pre-started host if it fits ``limits`` (network none, sandboxed), else a new one.
        Taking one starts warming another free slot in the background."""
        if self.prestart and not self._closed and not self.unavailable and \
                (self._warmup is None or self._warmup.done()):
            self._warmup = asyncio.create_task(self._prestart_all())
        ready, slot.ready = slot.ready, None
        if slot._prestart is not None and not slot._prestart.done() and ready is None:
            with contextlib.suppress(Exception):
                await slot._prestart
            ready, slot.ready = slot.ready, None
        # a pre-started host fits when what is fixed at spawn matches: network, sandbox, /tmp size
        if ready is not None and ready.alive and limits.network == "none" and limits.sandboxed \
                and limits.disk_bytes == ready.limits.disk_bytes and not self.unavailable:
            ready.limits = limits
            if slot.cgroup is not None:
                slot.cgroup.set(limits)
            return ready
        if ready is not None:
            await ready.close()
        return await self.spawn(slot, limits)

    async def release(self, slot: Slot, host: HostProcess | None) -> None:
        """Kill the slot's processes, empty its workspace, pre-start its next host, mark it free."""
        if host is not None:
            await host.close()
        if slot.cgroup is not None:
            slot.cgroup.freeze(False)
            slot.cgroup.kill_all()
        await asyncio.to_thread(self._reset_workspace, slot)
        slot.busy = False
        self._freed.set()
        if self.prestart and not self._closed and not self.unavailable and self._warm() < self.prestart:
            slot._prestart = asyncio.create_task(self._prestart(slot))
        elif self.prestart and not self._closed and not self.unavailable and \
                (self._warmup is None or self._warmup.done()):
            self._warmup = asyncio.create_task(self._prestart_all())

    async def close(self) -> None:
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
        if self.uids:
            self.uids.close()

    async def _prestart(self, slot: Slot) -> None:
        try:
            host = await self.spawn(slot, Limits())
        except Exception:  # noqa: BLE001 - a create then spawns on demand
            log.warning("pre-starting an agent host failed", extra={"slot": slot.index}, exc_info=True)
            return
        if slot.busy or self._closed or slot.ready is not None:
            await host.close()
            return
        slot.ready = host

    def _reset_workspace(self, slot: Slot) -> None:
        ws = slot.workspace
        if ws.exists() or ws.is_symlink():
            shutil.rmtree(ws, ignore_errors=True)
        for leftover in slot.dir.iterdir():  # staging folders of an interrupted restore
            shutil.rmtree(leftover, ignore_errors=True)
        ws.mkdir(mode=0o700)
        if slot.uid is not None:
            os.chown(ws, slot.uid, slot.uid)

    def own_workspace(self, slot: Slot) -> None:
        """Give the slot's uid every file of its workspace (after a restore wrote them as root)."""
        if slot.uid is None:
            return
        uid = slot.uid
        os.lchown(slot.workspace, uid, uid)
        for top, dirs, files in os.walk(slot.workspace):
            for n in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    os.lchown(os.path.join(top, n), uid, uid)

    # ------------------------------------------------------------------------------------------- spawn
    def argv(self, slot: Slot, limits: Limits) -> list[str]:
        """The command line of a host in ``slot`` (bwrap + python, or python alone when opted out)."""
        host = [sys.executable, "-s", "-B", "-m", "workers.agenthost"]
        if not limits.sandboxed:
            return host
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
        and die with the worker (``setpriv --pdeathsig KILL``: ``bwrap --die-with-parent`` only covers
        the sandbox's own processes, not the outer bwrap)."""
        out: list[str] = []
        if slot.cgroup is not None:
            out += ["/bin/sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"',
                    "sh", *(str(d / "cgroup.procs") for d in slot.cgroup.dirs.values()), "--"]
        out += ["/usr/bin/prlimit", "--core=0:0"]
        if limits.processes and slot.uid is not None and limits.sandboxed:  # counts the slot uid's processes
            out.append(f"--nproc={limits.processes}:{limits.processes}")
        return out + ["--", "/usr/bin/setpriv", "--pdeathsig", "KILL", "--"]

    def base_env(self, limits: Limits) -> dict[str, str]:
        """The fixed minimum environment of a host (the template and session env come with ``init``)."""
        home = WORKSPACE_PATH if limits.sandboxed else "/nonexistent"
        return {"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                "PYTHONPATH": CODE_PATH if limits.sandboxed else str(_PROJECT_ROOT),
                "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2", "TMPDIR": "/tmp"}

    async def spawn(self, slot: Slot, limits: Limits) -> HostProcess:
        """Start an agent host in ``slot`` under ``limits``; its pipes speak ``workers.agenthost``'s protocol."""
        if limits.sandboxed and self.unavailable:
            raise SandboxUnavailable(self.unavailable)
        cg = slot.cgroup
        if cg is not None:
            cg.freeze(False)
            cg.set(limits)
        env = self.base_env(limits) if not limits.sandboxed else {}
        cwd = str(slot.workspace) if not limits.sandboxed else None
        # no preexec_fn: a Python callback in the child forces fork() and makes the event loop wait for
        # the child's exec; this argv prefix does the same steps after a vfork (measured: ~1 ms blocked)
        proc = await asyncio.create_subprocess_exec(
            *self.launcher(slot, limits), *self.argv(slot, limits), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=None, env=env, cwd=cwd, close_fds=True,
            start_new_session=not limits.sandboxed, limit=64 * 1024 * 1024)
        return HostProcess(proc=proc, slot=slot, limits=limits, sandboxed=limits.sandboxed)


def _python_binds() -> list[str]:
    """Read-only binds that make this Python and its installed packages work inside a sandbox."""
    paths = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}
    out = []
    for p in sorted(paths, key=len):
        if not p.startswith("/usr/") and p != "/usr" and not any(p == o or p.startswith(o + "/") for o in out):
            out.append(p)
    return out
