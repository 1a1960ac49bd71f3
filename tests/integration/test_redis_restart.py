"""After Redis restarts (the embedded one is restarted when it dies), the directory's pooled connections
to the dead process are replaced on their next command instead of failing it (a fresh-user run: 21 of 60
creates answered 503 ``directory_unavailable`` 15 s after the restart, with /readyz green)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid

import pytest

from substrate.directory import Directory
from tests.conftest import free_port


def _start(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)


async def _up(d: Directory) -> None:
    for _ in range(100):
        try:
            if await d.ping():
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("redis-server did not start")


async def test_every_pooled_connection_survives_a_redis_restart() -> None:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server not installed (scripts/system-deps.sh installs it)")
    port = free_port()
    proc = _start(port)
    d = Directory(f"redis://127.0.0.1:{port}/0", f"rr{uuid.uuid4().hex[:8]}")
    try:
        await _up(d)
        # 40 connections in the pool, each used once
        await asyncio.gather(*(d.redis.set(f"{d.keys.prefix}:k{i}", i) for i in range(40)))
        assert len(d.redis.connection_pool._available_connections) >= 20  # noqa: SLF001 - the test's premise
        proc.kill()
        proc.wait()
        proc = _start(port)
        time.sleep(0.3)
        await _up(d)
        # every one of them is stale now: each call must still be answered (the keys died with the process)
        got = await asyncio.gather(*(d.redis.get(f"{d.keys.prefix}:k{i}") for i in range(60)), return_exceptions=True)
        assert [g for g in got if isinstance(g, Exception)] == [], got[:3]
        assert await d.count_sessions() == 0
    finally:
        await d.close()
        proc.kill()
        proc.wait()
