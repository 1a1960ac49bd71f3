"""A real local Redis Cluster for the tests: three ``redis-server --cluster-enabled yes`` masters on free
loopback ports, joined with ``redis-cli --cluster create ... --cluster-yes``. Skipped (with the reason
shown) only when ``redis-server``/``redis-cli`` are not installed.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from substrate import netports


def _free_port() -> int:
    # the bus port (port + 10000) must stay below the ephemeral range too
    return netports.free_port(high=netports.ephemeral_range()[0] - 10001)


def _ports(n: int) -> list[int]:
    # a cluster node also listens on port + 10000 (the cluster bus): pick ports whose bus port is free too
    out: list[int] = []
    while len(out) < n:
        p = _free_port()
        if p + 10000 > 65535 or p in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        out.append(p)
    return out


def _die_with(parent: int):
    """``preexec_fn`` of a node: SIGTERM when the test process dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG, as ``substrate/embedded.py`` does for the embedded Redis), so a killed pytest
    leaves no cluster node behind; exits at once if that parent is already gone."""
    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # died between fork and prctl: no signal would ever come
            os._exit(1)
    return preexec


def _cluster_ok(info: object) -> bool:
    # redis-py parses CLUSTER INFO into a dict; older versions return the raw text
    return info.get("cluster_state") == "ok" if isinstance(info, dict) else "cluster_state:ok" in str(info)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis+cluster://127.0.0.1:PORT/0`` of a fresh three-master cluster (session scope)."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        pytest.skip("redis-server/redis-cli not installed: Redis Cluster tests need them "
                    "(scripts/system-deps.sh installs redis-server)")
    root: Path = tmp_path_factory.mktemp("redis-cluster")
    procs: list[subprocess.Popen[bytes]] = []
    ports = _ports(3)
    try:
        for p in ports:
            d = root / str(p)
            d.mkdir()
            procs.append(subprocess.Popen(
                [server, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "5000",
                 "--save", "", "--appendonly", "no", "--dir", str(d), "--protected-mode", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with(os.getpid())))
        for p in ports:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(port=p, socket_timeout=0.5).ping()
                    break
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        deadline = time.monotonic() + 20
        probe = redis.Redis(port=ports[0], decode_responses=True)
        while not _cluster_ok(probe.execute_command("CLUSTER INFO")):
            if time.monotonic() > deadline:
                raise RuntimeError("local Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        probe.close()
        yield f"redis+cluster://127.0.0.1:{ports[0]}/0"
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            try:
                pr.wait(5)
            except subprocess.TimeoutExpired:
                pr.kill()
