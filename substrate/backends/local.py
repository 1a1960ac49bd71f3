"""Local backend: workers are child processes of this one (the embedded default).

Each worker is ``python -m workers.server --pool P --slots N --worker-id ID`` with the parent's
settings passed as JSON environment variables, so it reaches the same Redis and object store. A worker
that exits is reported by ``reap()``; the pool controller recovers its sessions and starts another.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from substrate.models import WorkerPool
from substrate.settings import Settings

log = logging.getLogger(__name__)


class LocalBackend:
    """Start/stop worker processes on this machine."""

    def __init__(self, settings: Settings, *, python: str = sys.executable) -> None:
        self.settings = settings
        self.python = python
        self.procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in [k for k in env if k.startswith("SUBSTRATE_")]:
            del env[k]
        s = self.settings
        env["SUBSTRATE_REDIS"] = s.redis.model_dump_json()
        env["SUBSTRATE_WORKER"] = s.worker.model_dump_json()
        env["SUBSTRATE_SNAPSHOT"] = s.snapshot.model_dump_json()
        env["SUBSTRATE_STATE"] = s.state.model_dump_json()
        env["SUBSTRATE_LOG_LEVEL"] = s.log_level
        env["SUBSTRATE_LOG_JSON"] = "true" if s.log_json else "false"
        return env

    async def create(self, pool: WorkerPool, worker_id: str) -> None:
        proc = subprocess.Popen(
            [self.python, "-m", "workers.server", "--pool", pool.name, "--slots", str(pool.spec.slots),
             "--worker-id", worker_id], env=self._env(), stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[worker_id] = (proc, pool.name)
        log.info("worker process started", extra={"worker": worker_id, "pool": pool.name, "pid": proc.pid})

    async def delete(self, worker_id: str, grace_s: float = 10.0) -> None:
        entry = self.procs.get(worker_id)
        if entry is None:
            return
        proc = entry[0]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            for _ in range(int(grace_s / 0.05)):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            else:
                proc.kill()
                proc.wait()
        self.procs.pop(worker_id, None)

    def running(self) -> dict[str, str]:
        return {wid: pool for wid, (p, pool) in self.procs.items() if p.poll() is None}

    def reap(self) -> list[str]:
        dead = [wid for wid, (p, _) in self.procs.items() if p.poll() is not None]
        for wid in dead:
            code = self.procs.pop(wid)[0].returncode
            log.warning("worker process exited", extra={"worker": wid, "returncode": code})
            # a killed worker could not clean its folder (workspaces, archives in flight)
            shutil.rmtree(Path(self.settings.worker.root_dir) / wid, ignore_errors=True)
        return dead

    def pid(self, worker_id: str) -> int | None:
        entry = self.procs.get(worker_id)
        return entry[0].pid if entry else None

    async def close(self) -> None:
        for wid in list(self.procs):
            await self.delete(wid)
