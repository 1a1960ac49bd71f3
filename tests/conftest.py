"""Shared fixtures: a real Redis (the machine's, or an embedded one), a real S3 endpoint (moto server),
and whole runtimes started the way a user starts them (``substrate up`` in a child process, real worker
processes, real HTTP). Each runtime gets its own Redis key prefix, so test runs never see each other.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from substrate import netports
from substrate.client import SubstrateClient
from substrate.embedded import EmbeddedRedis
from substrate.keys import Keys

pytest_plugins = ["tests.integration.conftest_s3", "tests.redis_cluster", "tests.xdist_order"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Give every test the environment it started with. The CLI run in-process (``CliRunner``) writes
    ``os.environ`` (``substrate router`` sets ``SUBSTRATE_ROLE=router``, the callback ``SUBSTRATE_TOKEN``,
    ``up --config`` ``SUBSTRATE_CONFIG_DIR``) and every runtime a later test starts inherits it: with
    ``SUBSTRATE_ROLE=router`` its ``substrate up`` serves without a local pool and no worker registers."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


#: the loggers whose level ``substrate.logs.configure_logging`` sets (``""``: the root logger)
_CONFIGURED_LOGGERS = ("", "substrate.audit", "aiohttp.access", "uvicorn.access", "botocore", "boto3", "urllib3",
                       "s3transfer")


def _on_closed_stream(handler: logging.Handler) -> bool:
    return bool(getattr(getattr(handler, "stream", None), "closed", False))


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Give every test the logging set-up it started with, and fail a test that leaves a root handler
    writing to a closed stream. ``substrate up`` run in-process (``CliRunner``) calls ``configure_logging``,
    which replaced the root handlers with one bound to the runner's stderr, closed when the command
    returned: later CLI tests of the same process printed ``--- Logging error ---`` into their output. The
    handler follows ``sys.stderr`` now (``substrate.logs.StderrHandler``); this removes the root handlers a
    test installed (pytest's own capture handlers, which pytest adds and removes per phase, aside) and puts
    back the levels ``configure_logging`` set (the root's INFO made every later test's records at INFO reach
    the handlers)."""
    root = logging.getLogger()
    before = list(root.handlers)
    levels = {name: logging.getLogger(name).level for name in _CONFIGURED_LOGGERS}
    yield
    closed = [h for h in root.handlers if _on_closed_stream(h)]
    for h in list(root.handlers):
        if h in closed or (h not in before and not type(h).__module__.startswith("_pytest")):
            root.removeHandler(h)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    if closed:
        pytest.fail(f"the test left root logging handlers writing to a closed stream: {closed} (every later "
                    "record would print '--- Logging error ---' into another test's output)")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """``SUBSTRATE_TEST_REDIS_URL``, else 127.0.0.1:6379 db 0 if it answers, else an embedded server."""
    url = os.environ.get("SUBSTRATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=1).ping()
        yield url
        return
    except redis.RedisError:
        pass
    with EmbeddedRedis() as r:
        yield r.url


def free_port() -> int:
    """A loopback port outside the kernel's ephemeral range (``substrate.netports``): a port picked by
    ``bind(0)`` could be handed to a worker's own ``bind(0)`` or an outgoing connection before the
    runtime binds it (CI failed on exactly that)."""
    return netports.free_port()


POOL_YAML = """
apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {{name: default}}
spec:
  replicas: {replicas}
  slots: {slots}
"""

TEMPLATES_YAML = """
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {{name: counter}}
spec:
  entrypoint: workers.agents.counter:Counter
  stateManagement: {{snapshotInterval: {snapshot_interval}, maxIdleTime: {max_idle}}}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {{name: notebook}}
spec:
  entrypoint: workers.agents.notebook:Notebook
  stateManagement: {{snapshotInterval: {snapshot_interval}, maxIdleTime: {max_idle}}}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {{name: shell}}
spec:
  entrypoint: workers.agents.shell:Shell
  stateManagement: {{snapshotInterval: {snapshot_interval}, maxIdleTime: {max_idle}}}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {{name: shell-fast}}
spec:
  entrypoint: workers.agents.shell:Shell
  env: [{{name: SHELL_TIMEOUT_S, value: "1"}}]
  stateManagement: {{snapshotInterval: {snapshot_interval}, maxIdleTime: {max_idle}}}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {{name: echo-command}}
spec:
  command: ["{python}", "-u", "-m", "workers.agents.echo_jsonl"]
  stateManagement: {{snapshotInterval: {snapshot_interval}, maxIdleTime: {max_idle}}}
"""


class RuntimeProc:
    """A whole runtime in a child process: ``substrate up`` with its own key prefix and config."""

    def __init__(self, tmp: Path, redis_url: str, *, replicas: int = 2, slots: int = 8,
                 snapshot_interval: str = "0", max_idle: str = "0", extra_yaml: str = "",
                 env: dict[str, str] | None = None, pool_yaml: str | None = None,
                 share_with: "RuntimeProc | None" = None, wait_workers: bool = True) -> None:
        # ``share_with``: a second router process of the same deployment (same prefix, signing keys, store)
        self.prefix = share_with.prefix if share_with else f"t{uuid.uuid4().hex[:10]}"
        self.keys = Keys(self.prefix)
        self.redis_url = redis_url
        cfg = tmp / f"config-{self.prefix}-{uuid.uuid4().hex[:6]}"
        cfg.mkdir(parents=True)
        (cfg / "pool.yaml").write_text(pool_yaml or POOL_YAML.format(replicas=replicas, slots=slots))
        (cfg / "templates.yaml").write_text(TEMPLATES_YAML.format(
            snapshot_interval=snapshot_interval, max_idle=max_idle, python=sys.executable) + extra_yaml)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.var = share_with.var if share_with else tmp / f"var-{self.prefix}"
        self.env = {**os.environ, "SUBSTRATE_REDIS_URL": redis_url, "SUBSTRATE_REDIS__KEY_PREFIX": self.prefix,
                    "SUBSTRATE_CONFIG_DIR": str(cfg), "SUBSTRATE_DATA_DIR": str(self.var),
                    "SUBSTRATE_WORKER__ROOT_DIR": str(self.var / "workers"),
                    "SUBSTRATE_SNAPSHOT__LOCAL_DIR": str(self.var / "snapshots"),
                    "SUBSTRATE_LOG_LEVEL": "WARNING", "SUBSTRATE_STATE__SCAN_INTERVAL_S": "0.2",
                    "SUBSTRATE_WORKER__HEARTBEAT_S": "0.2", "SUBSTRATE_WORKER__LEASE_S": "2",
                    # dozens of runtimes share 2 cores here: 16 booting agent hosts per worker (the default)
                    # starved heartbeats past the 2 s test lease; tests that need more pre-started set it
                    "SUBSTRATE_WORKER__PRESTART_HOSTS": "4",
                    # this RuntimeProc's own processes (workers inherit it), told apart from a sharer's at stop
                    "TEST_RUNTIME_ID": uuid.uuid4().hex,
                    **(env or {})}
        self.log = open(tmp / f"runtime-{self.prefix}-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = self._spawn()
        self.client = SubstrateClient(self.url, timeout_s=30)
        if redis_url.startswith("redis+cluster://"):
            from redis.cluster import RedisCluster

            self.r = RedisCluster.from_url(redis_url.replace("redis+cluster://", "redis://", 1),
                                           decode_responses=True)
        else:
            self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.replicas = replicas
        self.shared = share_with is not None
        try:
            for attempt in range(3):
                try:
                    self._wait_ready(workers=wait_workers)
                    break
                except RuntimeError as e:
                    # the port picked was bound by another process between the pick and `up`'s bind (two
                    # pickers in parallel test processes chose it: a full-suite run's "cannot listen on
                    # 127.0.0.1:61064: Address already in use"): pick another, start again
                    if attempt == 2 or f"cannot listen on 127.0.0.1:{self.port}: Address already in use" not in str(e):
                        raise
                    self.client.close()
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    self.client = SubstrateClient(self.url, timeout_s=30)
                    self.proc = self._spawn()
        except BaseException:
            self.stop()  # never handed to the factory: nothing else would stop it (it leaked, serving)
            raise

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "substrate.cli", "up", "--port", str(self.port)],
                                env=self.env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def restart(self, *, sig: int = signal.SIGINT) -> None:
        """Stop the process the way a user does (Ctrl-C = SIGINT) and start it again on the same
        port, prefix, data folders and config; the directory is kept."""
        self.proc.send_signal(sig)
        self.proc.wait(60)
        self.proc = self._spawn()
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60, workers: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"runtime exited: {self.logs()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200 and \
                        (not workers or len(self.workers()) >= self.replicas):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"runtime not ready: {self.logs()[-3000:]}")

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    # ------------------------------------------------------------------ directory inspection helpers
    def session_raw(self, sid: str) -> dict[str, str]:
        return self.r.hgetall(self.keys.session(sid))

    def workers(self) -> dict[str, dict[str, str]]:
        ids = self.r.zrange(self.keys.workers_index, 0, -1)
        out = {}
        for wid in ids:
            raw = self.r.hgetall(self.keys.worker(wid))
            if raw:
                out[wid] = raw
        return out

    def slots(self, wid: str) -> dict[str, str]:
        return self.r.hgetall(self.keys.worker_slots(wid))

    def worker_token(self, address: str, session: str = "*", epoch: int | None = None, *,
                     tenant: str = "default", ttl_s: float = 60.0, now: float | None = None) -> str:
        """An activation token as the control plane mints it (from the signing keys in Redis)."""
        from substrate.tokens import derive_secret, mint_token

        raw = self.r.hgetall(self.keys.signing_keys)
        kid = raw["current"]
        secret = derive_secret(raw[kid], self.env.get("SUBSTRATE_WORKER__INTERNAL_TOKEN"))
        return mint_token(secret, kid, session=session, epoch=epoch, audience=address, tenant=tenant,
                          ttl_s=ttl_s, now=now)

    def worker_headers(self, address: str, session: str = "*", epoch: int | None = None, **kw: Any) -> dict[str, str]:
        """Headers a direct call to a worker needs: ``Authorization: Bearer <activation token>``."""
        return {"Authorization": f"Bearer {self.worker_token(address, session, epoch, **kw)}"}

    def worker_activations(self, wid: str) -> list[dict[str, Any]]:
        addr = self.workers()[wid]["address"]
        return httpx.get(addr + "/v1/activations", timeout=5, headers=self.worker_headers(addr)).json()["items"]

    def kill_worker(self, wid: str) -> None:
        os.kill(int(self.workers()[wid]["pid"]), signal.SIGKILL)

    def wait_for(self, pred: Callable[[], bool], timeout_s: float = 20, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self) -> None:
        if self.log.closed:
            return
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                # said in the run's warnings summary, not silently killed: such a stop once hid a hang on
                # Ctrl-C (a cancel lost in a Redis call; see substrate/loops.py)
                warnings.warn(f"runtime on port {self.port} did not stop within 20 s of SIGINT; SIGKILLed "
                              f"(its log: {self.log.name})", stacklevel=1)
        # everything it started must be gone: no worker process outlives the runtime. The keys of its prefix
        # are removed once its own processes are, by whichever of the runtimes sharing the prefix stops
        # last (the first one's clean-up, with a sharer still running, left `stats` behind, and a worker
        # still suspending after its runtime's exit wrote deadlines after it: test keys left in Redis)
        _wait_for_processes_gone(f"TEST_RUNTIME_ID={self.env['TEST_RUNTIME_ID']}".encode())
        if not _processes_with(f"SUBSTRATE_REDIS__KEY_PREFIX={self.prefix}".encode()):
            for key in self.r.scan_iter(f"{self.prefix}:*", count=1000):
                self.r.delete(key)
        self.log.close()


def _processes_with(marker: bytes) -> bool:
    """Whether a process other than this one has ``marker`` (``NAME=value``) in its environment."""
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    return True
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return False


def _wait_for_processes_gone(marker: bytes, limit: int = 100) -> None:
    """Wait until no process has ``marker`` in its environment (``_processes_with``), polling every 0.1 s
    at most ``limit`` times (then go on: the caller cleans up what it can)."""
    for _ in range(limit):
        if not _processes_with(marker):
            return
        time.sleep(0.1)


@pytest.fixture
def runtime_factory(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., RuntimeProc]]:
    made: list[RuntimeProc] = []

    def make(**kw: Any) -> RuntimeProc:
        rt = RuntimeProc(tmp_path, kw.pop("redis_url", redis_url), **kw)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.stop()


@pytest.fixture(scope="module")
def shared_runtime(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RuntimeProc]:
    """One runtime for a module of tests that do not disturb each other (2 workers x 8 slots)."""
    rt = RuntimeProc(tmp_path_factory.mktemp("rt"), redis_url, replicas=2, slots=8)
    yield rt
    rt.stop()


def dedent(s: str) -> str:
    return textwrap.dedent(s)


@pytest.fixture(params=["standalone", "cluster"])
def directory_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """The directory suite runs twice: on the standalone Redis and on a local three-master Redis Cluster."""
    if request.param == "cluster":
        return str(request.getfixturevalue("redis_cluster_url"))
    return redis_url


@pytest.fixture
def moto_proc(tmp_path: Path) -> Iterator["MotoProc"]:
    """A moto S3 server in its own process (so a test can freeze it with SIGSTOP)."""
    m = MotoProc(tmp_path)
    yield m
    m.stop()


class MotoProc:
    """``python -m moto.server`` on a free loopback port; ``freeze()``/``thaw()`` send SIGSTOP/SIGCONT."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"moto-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url, timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("moto server did not start")

    def env(self) -> dict[str, str]:
        """Runtime settings that put snapshots in a fresh bucket of this server."""
        return {"SUBSTRATE_SNAPSHOT__STORE": "s3", "SUBSTRATE_SNAPSHOT__ENDPOINT_URL": self.url,
                "SUBSTRATE_SNAPSHOT__BUCKET": f"b-{uuid.uuid4().hex[:10]}", "SUBSTRATE_SNAPSHOT__REGION": "us-east-1",
                "SUBSTRATE_SNAPSHOT__ACCESS_KEY_ID": "testing", "SUBSTRATE_SNAPSHOT__SECRET_ACCESS_KEY": "testing"}

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        try:
            self.thaw()
        except ProcessLookupError:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
