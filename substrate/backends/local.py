"""Local backend: workers are processes on this machine (the embedded default).

By default workers are forked from a **zygote** (``python -m workers.zygote``, started once with the
runtime's settings), which has already imported everything a worker needs, so a new worker serves in
tens of milliseconds instead of the ~0.5-1.5 s of a cold interpreter: scale-up and replacing a dead
worker are fast enough to happen on the request path. If the zygote cannot be used, workers start as
``python -m workers.server --pool P --slots N --worker-id ID``. Settings reach workers as JSON
environment variables, so they use the same Redis and object store. A worker that exits is reported by
``reap()``; the pool controller recovers its sessions and starts another. What is left of a dead worker's
agent sandboxes is thawed and killed there too (``substrate/sandbox_sweep.py``; the worker's own reaper
normally did it already): a worker killed while a slot was frozen would otherwise leave it frozen.

Every worker is tied to the runtime by a *lifeline* pipe: the backend holds the only write end, workers
(through the zygote too) get the read end (``SUBSTRATE_LIFELINE_FD``, see ``workers/lifeline.py``). When
the runtime ends in any way, SIGKILL included, the kernel closes the write end and each worker stops
gracefully on its own instead of living on, holding its port, slot uids and sandboxes.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from substrate import sandbox_sweep
from substrate.embedded import hold_fds
from substrate.backends.backoff import StartBackoff
from substrate.models import WorkerPool, WorkerPoolSpec
from substrate.pool import desired_replicas
from substrate.settings import Settings
from substrate.specs import Catalog, SpecError

log = logging.getLogger(__name__)

#: the environment variable that names the lifeline's read end in a worker (``workers/lifeline.py``; the
#: substrate package imports nothing of workers, so the name is repeated here)
LIFELINE_ENV = "SUBSTRATE_LIFELINE_FD"


def max_workers(spec: WorkerPoolSpec) -> int:
    """The most workers the pool controller may run for a pool of ``spec``: ``autoscaling.maxReplicas``
    when it autoscales (the safety bound), else ``replicas``."""
    return spec.autoscaling.maxReplicas if spec.autoscaling is not None else spec.replicas


def check_capacity(catalog: Catalog, settings: Settings, *, source: str = "", as_root: bool | None = None) -> None:
    """Refuse pools this machine's local backend cannot run, before anything starts. Raises
    ``SpecError`` (code ``invalid_spec``) naming each pool's worker and slot counts when

    * all pools together may ask for more than ``pool.local_max_workers`` worker processes, or
    * running as root (``as_root``; default: the effective uid is 0), they may ask for more slots than
      there are sandbox uids (``worker.sandbox_uid_span``): each slot of a worker started as root holds
      one uid of its own, and a worker that finds none free fails to start, again and again.

    ``source`` (the config folder) starts the message. Only for the local backend: on Kubernetes the
    scheduler and the nodes say what fits."""
    pools = sorted(catalog.pools.values(), key=lambda p: p.name)
    workers = sum(max_workers(p.spec) for p in pools)
    # a worker's sandboxes: its slots and its spares (``worker.spare_sandboxes``), each holding a uid as root
    slots = sum(max_workers(p.spec) * (p.spec.slots + settings.worker.sandbox_spares()) for p in pools)

    def each(spares: int = 0) -> str:
        return (f"{source}: " if source else "") + "; ".join(f"WorkerPool {p.name}: {max_workers(p.spec)} workers ("
                         + ("spec.autoscaling.maxReplicas" if p.spec.autoscaling is not None else "spec.replicas")
                         + f") x {p.spec.slots} slots" + (f" (+{spares} spare sandbox)" if spares else "")
                         for p in pools if max_workers(p.spec))

    if workers > settings.pool.local_max_workers:
        raise SpecError(f"{each()}: {workers} worker processes in all, over the {settings.pool.local_max_workers} "
                        "this machine's local runtime runs (SUBSTRATE_POOL__LOCAL_MAX_WORKERS; each is a Python "
                        "process): lower them, put more slots on each worker, or run on Kubernetes")
    root = os.geteuid() == 0 if as_root is None else as_root
    if root and slots > settings.worker.sandbox_uid_span:
        raise SpecError(f"{each(settings.worker.sandbox_spares())}: {slots} sandboxes in all, over the {settings.worker.sandbox_uid_span} sandbox uids "
                        "(SUBSTRATE_WORKER__SANDBOX_UID_SPAN; running as root, each slot and each spare sandbox "
                        "holds one): lower them or widen the span (or SUBSTRATE_WORKER__SPARE_SANDBOXES=0)")


def check_port_range(catalog: Catalog, settings: Settings, *, api_port: int, embedded_redis: bool) -> str | None:
    """Check ``worker.port_range`` (when set) against what ``substrate up`` will run. Raises ValueError,
    with the line to print, when the API's ``api_port`` is in the range (a worker could take it first, and
    the API then failed to bind after everything had started: fresh-user tester 46), or when the range has
    fewer ports than the workers the pools start with no demand (fixed ``replicas``, or the autoscaler's
    floor) plus the embedded Redis's: such a pool never reaches its size, the runtime never becomes ready,
    and the workers beyond it cannot listen and exit (tester 46). Returns a warning line when it
    has fewer than the workers the pools may run at most (``max_workers``; not refused: ``maxReplicas`` is
    a safety bound a pool may never reach), else None."""
    if settings.worker.ports is None:
        return None
    lo, hi = settings.worker.ports
    if lo <= api_port <= hi:
        raise ValueError(f"--port {api_port} is inside SUBSTRATE_WORKER__PORT_RANGE {lo}-{hi}, whose ports the "
                         "workers and the embedded Redis take: choose a port outside the range")
    have = hi - lo + 1
    redis = 1 if embedded_redis else 0
    pools = catalog.pools.values()
    floor = sum(desired_replicas(p.spec, 0) for p in pools)
    most = sum(max_workers(p.spec) for p in pools)
    also = " and the embedded Redis takes one" if redis else ""
    if have < floor + redis:
        raise ValueError(f"SUBSTRATE_WORKER__PORT_RANGE {lo}-{hi} has {have} port(s); the pools start {floor} "
                         f"worker(s){also}: widen the range to at least {floor + redis} ports (a port for each "
                         f"worker the pools may run, {most}, and the Redis's, to let them all start)")
    if have < most + redis:
        return (f"SUBSTRATE_WORKER__PORT_RANGE {lo}-{hi} has {have} port(s); the pools may run {most} worker(s)"
                f"{also}: past {have - redis} worker(s) at once, a new one cannot listen and exits, and the pool's "
                f"next start backs off (SUBSTRATE_POOL__RESTART_BACKOFF_S); widen the range to at least "
                f"{most + redis} ports")
    return None


def _zombie(pid: int) -> bool:
    """Whether process ``pid`` has exited and waits to be reaped (state ``Z`` in ``/proc/<pid>/stat``,
    proc(5)); False when that cannot be read (not Linux, or gone: the caller's signal 0 tells)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # the state follows the command name, which is in parentheses and may itself hold ") "
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"Z"


@dataclass
class _Worker:
    pool: str
    pid: int
    popen: subprocess.Popen[bytes] | None = None  # None: a child of the zygote
    #: ``delete`` is stopping it: its exit is expected (``reap`` leaves it to ``delete``)
    stopping: bool = False

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)  # the zygote reaps its children at once: no zombies linger...
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # ...unless it cannot run (frozen: SIGSTOP, a cgroup freeze): a worker that died meanwhile stays
        # a zombie, which signal 0 still reaches; it was seen only when its lease ran out (tester 46)
        return not _zombie(self.pid)

    def exit_code(self) -> int | None:
        """Its exit status once exited, if this process knows it (a child of the zygote: the zygote reaped
        it, so None; a negative value: killed by that signal)."""
        return self.popen.poll() if self.popen is not None else None

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


#: ``<worker>.after-runtime-exit.log`` files kept in the workers' folder (the newest)
EXIT_LOGS_KEPT = 10
#: how long a ready zygote may take to answer a fork (s). It forks and answers at once (milliseconds, on a
#: loaded machine too); only a frozen or wedged zygote takes longer, and every worker start queued behind
#: it waits as long (it was 30 s: a SIGSTOPped zygote held creates for 30 s, fresh-user tester 43)
FORK_REPLY_TIMEOUT_S = 5.0
#: how long a newly started zygote may take to import what workers need (s) before it is given up
ZYGOTE_READY_TIMEOUT_S = 60.0
#: after a zygote failed (gave no answer, or none in time): workers start cold for this long (s), then a new
#: zygote is tried; the pause doubles with each failure in a row, up to ``ZYGOTE_RETRY_MAX_S``. A zygote
#: that failed once used to disable forking for the runtime's whole life (every later worker cold)
ZYGOTE_RETRY_S = 5.0
ZYGOTE_RETRY_MAX_S = 300.0


class LocalBackend:
    """Start/stop worker processes on this machine (``fork_server`` uses the zygote)."""

    def __init__(self, settings: Settings, *, python: str = sys.executable, fork_server: bool = True) -> None:
        self.settings = settings
        self.python = python
        self.fork_server = fork_server
        self.workers: dict[str, _Worker] = {}
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_ready = False
        self._zlock = asyncio.Lock()
        self.fork_reply_timeout_s = FORK_REPLY_TIMEOUT_S
        self.zygote_ready_timeout_s = ZYGOTE_READY_TIMEOUT_S
        self.zygote_retry_s = ZYGOTE_RETRY_S
        #: failures of the zygote in a row (reset by a fork it answered) and, after one, until when
        #: (``time.monotonic()``) workers start cold before a new zygote is tried
        self._zygote_failures = 0
        self._zygote_retry_at = 0.0
        #: a new zygote's imports, waited for in the background (``_fork``)
        self._warming: asyncio.Task[None] | None = None
        #: dead workers whose cgroups still held processes at the last ``reap`` (worker id -> attempts left)
        self._sweeps: dict[str, int] = {}
        #: (read end, write end) of the lifeline pipe, made at the first process started, closed by ``close``
        self._lifeline: tuple[int, int] | None = None
        #: workers that exit on their own hold back their pool's next start (the pool controller reads it:
        #: the ``start_backoff`` of the ``Backend`` port)
        self.start_backoff = StartBackoff(settings.pool.restart_backoff_s, settings.pool.restart_backoff_max_s,
                                          noun="worker process")

    def _lifeline_fd(self) -> int:
        """The lifeline's read end, for a child to inherit (``pass_fds``). The write end stays in this
        process only: it is non-inheritable, and every child is started with ``close_fds``, so no other
        process can keep the pipe open after the runtime is gone."""
        if self._lifeline is None:
            r, w = os.pipe()  # both non-inheritable (PEP 446)
            if r < 3:  # a runtime started with stdio closed: the zygote's children reuse fds 0-2
                moved = fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, 3)
                os.close(r)
                r = moved
            self._lifeline = (r, w)
        return self._lifeline[0]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in [k for k in env if k.startswith("SUBSTRATE_")]:
            del env[k]
        env[LIFELINE_ENV] = str(self._lifeline_fd())
        s = self.settings
        env["SUBSTRATE_REDIS"] = s.redis.model_dump_json()
        env["SUBSTRATE_WORKER"] = s.worker.model_dump_json()
        env["SUBSTRATE_SNAPSHOT"] = s.snapshot.model_dump_json()
        env["SUBSTRATE_STATE"] = s.state.model_dump_json()
        # workers need where template credentials are, not the API keys
        env["SUBSTRATE_AUTH"] = s.auth.model_dump_json(include={"secrets_dir", "signing_refresh_s"})
        # the same catalog as the runtime (the worker checks its pool's sandbox opt-out against it)
        env["SUBSTRATE_CONFIG_DIR"] = str(Path(s.config_dir).resolve())
        env["SUBSTRATE_LOG_LEVEL"] = s.log_level
        env["SUBSTRATE_LOG_JSON"] = "true" if s.log_json else "false"
        return env

    def _ensure_zygote(self) -> subprocess.Popen[bytes]:
        if self._zygote is None or self._zygote.poll() is not None:
            if self._zygote is not None:  # its workers go on serving; only new ones need it (round 16: silent)
                log.warning("the zygote (pid %s) exited with status %s; starting a new one (workers start cold "
                            "until it is ready)", self._zygote.pid, self._zygote.returncode)
            self._zygote_ready = False
            self._zygote = subprocess.Popen(
                [self.python, "-m", "workers.zygote"], env=self._env(), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, start_new_session=True, pass_fds=(self._lifeline_fd(), *hold_fds()))
        return self._zygote

    async def _read_reply(self, z: subprocess.Popen[bytes], key: str, timeout_s: float) -> dict[str, Any]:
        """The zygote's next JSON line that carries ``key`` (skipping its one-time ``ready`` line)."""
        assert z.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(z.stdout.readline),
                                          max(0.1, deadline - time.monotonic()))
            if not line:
                raise OSError("zygote closed its output")
            msg = json.loads(line)
            if key in msg:
                return msg
            if msg.get("ready"):
                self._zygote_ready = True

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start the zygote now and wait until it has imported what workers need, so that a pool
        scaling from zero pays for a fork (tens of ms), not for the imports (~1 s, far more on a loaded
        machine). A zygote that does not come up is killed, and workers start cold until a new one is
        tried (``_zygote_failed``)."""
        self._tidy_exit_logs()
        if not self.fork_server:
            return
        await self._warm(timeout_s)

    async def _warm(self, timeout_s: float) -> None:
        """Start a zygote unless one runs and is ready, and wait up to ``timeout_s`` for its imports;
        one that does not come up in time is given up (``_zygote_failed``)."""
        async with self._zlock:
            z = self._ensure_zygote()
            if self._zygote_ready:
                return
            try:
                await self._read_reply(z, "ready", timeout_s)
                self._zygote_ready = True
            except (OSError, ValueError, asyncio.TimeoutError):
                self._zygote_failed(z, "zygote did not start")

    def _zygote_failed(self, z: subprocess.Popen[bytes], what: str) -> None:
        """Kill the zygote ``z`` that failed and start workers cold for a pause (``zygote_retry_s``,
        doubled per failure in a row, at most ``ZYGOTE_RETRY_MAX_S``); the first worker start after it
        starts a new zygote in the background (``_warm``) and itself cold. Its workers go on serving: they
        are their own sessions."""
        self._zygote_failures += 1
        pause_s = min(ZYGOTE_RETRY_MAX_S, self.zygote_retry_s * 2 ** (self._zygote_failures - 1))
        self._zygote_retry_at = time.monotonic() + pause_s
        log.warning("%s; starting workers cold for %.0f s, then a new zygote", what, pause_s, exc_info=True)
        z.kill()
        try:  # reaped (milliseconds after a SIGKILL), so that the next start sees it gone and warms a new one
            z.wait(1)
        except subprocess.TimeoutExpired:
            pass
        if z is self._zygote:  # gone by our hand: not logged again as an exit found later ("status -9")
            self._zygote, self._zygote_ready = None, False

    def _tidy_exit_logs(self, keep: int = EXIT_LOGS_KEPT) -> None:
        """Keep the newest ``keep`` ``<worker>.after-runtime-exit.log`` files (what a worker wrote after its
        runtime was gone: ``workers.lifeline``) and remove the older ones: each hard stop left one per
        worker, never removed (fresh-user round 16). The ones kept are named once in the log."""
        root = Path(self.settings.worker.root_dir)
        try:
            logs = sorted(root.glob("*.after-runtime-exit.log"), key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            return
        for old in logs[keep:]:
            old.unlink(missing_ok=True)
        if logs:
            log.info("%d log(s) of workers that outlived a stopped runtime are kept in %s (*.after-runtime-exit.log, "
                     "the newest %d)", min(len(logs), keep), root, keep)

    async def _fork(self, pool: WorkerPool, worker_id: str) -> int | None:
        """Ask the zygote for a worker's pid; None if the zygote is unusable now (the caller spawns cold):
        it failed less than its pause ago (``_zygote_failed``), it is not ready (a new one, replacing one
        that failed or exited, imports in the background meanwhile: ``_warm``, up to
        ``zygote_ready_timeout_s``), or it fails this fork (no answer within ``fork_reply_timeout_s``)."""
        if time.monotonic() < self._zygote_retry_at:
            return None
        z = self._zygote
        if z is None or z.poll() is not None or not self._zygote_ready:
            # worker starts used to queue behind a new zygote's imports under the lock (up to 60 s for a
            # wedged one); this one starts cold instead, and the zygote serves the starts after it is ready
            if self._warming is None or self._warming.done():
                self._warming = asyncio.create_task(self._warm(self.zygote_ready_timeout_s))
            return None
        async with self._zlock:
            if time.monotonic() < self._zygote_retry_at:  # it failed for a fork queued ahead of this one
                return None
            z = self._zygote
            if z is None or z.poll() is not None or not self._zygote_ready:
                return None  # it failed or exited while this start waited: the next start warms a new one
            assert z.stdin is not None and z.stdout is not None
            try:
                req = {"worker_id": worker_id, "pool": pool.name, "slots": pool.spec.slots}
                z.stdin.write(json.dumps(req).encode() + b"\n")
                z.stdin.flush()
                pid = int((await self._read_reply(z, "pid", self.fork_reply_timeout_s))["pid"])
            except (OSError, ValueError, KeyError, asyncio.TimeoutError):
                self._zygote_failed(z, "zygote failed")
                return None
            self._zygote_failures = 0
            return pid

    async def create(self, pool: WorkerPool, worker_id: str) -> None:
        pid = await self._fork(pool, worker_id) if self.fork_server else None
        if pid is not None:
            self.workers[worker_id] = _Worker(pool.name, pid)
        else:
            proc = subprocess.Popen(
                [self.python, "-m", "workers.server", "--pool", pool.name, "--slots", str(pool.spec.slots),
                 "--worker-id", worker_id], env=self._env(), stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=(self._lifeline_fd(), *hold_fds()))
            self.workers[worker_id] = _Worker(pool.name, proc.pid, proc)
        log.info("worker process started", extra={"worker": worker_id, "pool": pool.name,
                                                   "pid": self.workers[worker_id].pid})

    async def delete(self, worker_id: str, grace_s: float | None = None) -> None:
        """Graceful stop: SIGTERM (the worker suspends every session, deregisters and exits), SIGKILL only
        after ``grace_s`` (default: the worker's own ``shutdown_grace_s`` plus 5 s)."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        if grace_s is None:
            grace_s = self.settings.worker.shutdown_grace_s + 5.0
        w.stopping = True
        try:
            if w.alive():
                w.signal(signal.SIGTERM)
                for _ in range(int(grace_s / 0.05)):
                    if not w.alive():
                        break
                    await asyncio.sleep(0.05)
                else:
                    w.signal(signal.SIGKILL)
                    if w.popen is not None:
                        w.popen.wait()
                    self._sweeps[worker_id] = 50  # killed: its sandboxes' leftovers are ours to sweep
                    self._sweep_dead()
        except BaseException:
            w.stopping = False  # cut short (the runtime stopping): ``reap`` reports it once it is gone
            raise
        self.workers.pop(worker_id, None)

    def running(self) -> dict[str, str]:
        return {wid: w.pool for wid, w in self.workers.items() if w.alive()}

    def reap(self) -> list[str]:
        """Workers whose process exited since the last call. Their sandboxes' leftovers are thawed and
        killed, and their folder removed."""
        # a worker being stopped (a drain's end) is not lost: reported here, the pool controller would
        # "recover" a worker that had just suspended all its sessions, and log its exit as a warning
        dead = [wid for wid, w in self.workers.items() if not w.stopping and not w.alive()]
        for wid in dead:
            w = self.workers.pop(wid)
            pause = self.start_backoff.failed(w.pool)
            log.warning("worker process exited", extra={"worker": wid, "pool": w.pool, "exitCode": w.exit_code(),
                                                        "restartBackoffS": round(pause, 2)})
            self._sweeps[wid] = 50
            # a killed worker could not clean its folder (workspaces, archives in flight)
            shutil.rmtree(Path(self.settings.worker.root_dir) / wid, ignore_errors=True)
        self._sweep_dead()
        return dead

    async def abandon(self, worker_id: str) -> None:
        """Kill a worker that did not register within the pool controller's create timeout (frozen or hung
        in its start; SIGKILL reaches a stopped process too) and count it as a failed start of its pool
        (``start_backoff``). It never registered, so it holds no session."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        w.signal(signal.SIGKILL)
        if w.popen is not None:
            await asyncio.to_thread(w.popen.wait)
        self._sweeps[worker_id] = 50  # its sandboxes' leftovers are ours to sweep
        self._sweep_dead()
        shutil.rmtree(Path(self.settings.worker.root_dir) / worker_id, ignore_errors=True)
        pause = self.start_backoff.failed(w.pool)
        log.warning("worker did not register in time; killed", extra={"worker": worker_id, "pool": w.pool,
                                                                       "restartBackoffS": round(pause, 2)})

    def unplaceable(self, pool: str) -> tuple[set[str], str]:
        """(no stuck worker, why none can come now) for the capacity note routers in other processes read
        (``substrate.demand``): while the pool backs off, nothing is coming."""
        return set(), self.start_backoff.reason(pool)

    def _sweep_dead(self) -> None:
        """Thaw and kill what is left in dead workers' cgroups without blocking the control loop: one pass
        per call (killed processes take a moment to go); retried on later calls until the cgroups are
        gone, at most 50 times."""
        for wid, left in list(self._sweeps.items()):
            try:
                done = sandbox_sweep.sweep_worker(wid, wait_s=0)
            except (OSError, ValueError):
                log.warning("sweeping a dead worker's sandboxes failed", extra={"worker": wid}, exc_info=True)
                done = False
            if done or left <= 1:
                del self._sweeps[wid]
                if not done:
                    log.warning("a dead worker's sandbox cgroups are still busy; giving up", extra={"worker": wid})
            else:
                self._sweeps[wid] = left - 1

    def helper_processes(self) -> int:
        """Processes kept for sessions besides the workers: the zygote, while it runs (counted in the
        process-seconds cost: it is always on)."""
        return 1 if self._zygote is not None and self._zygote.poll() is None else 0

    def pid(self, worker_id: str) -> int | None:
        w = self.workers.get(worker_id)
        return w.pid if w else None

    async def close(self) -> None:
        """Stop every worker gracefully, all at once (each suspends its sessions within its grace)."""
        if self._warming is not None:
            self._warming.cancel()
            await asyncio.gather(self._warming, return_exceptions=True)
        await asyncio.gather(*(self.delete(wid) for wid in list(self.workers)))
        if self._zygote is not None:
            if self._zygote.stdin:
                self._zygote.stdin.close()  # the zygote exits when its stdin closes
            try:
                self._zygote.wait(5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
            self._zygote = None
        if self._lifeline is not None:  # every worker was stopped above; nothing is left to tie
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None
