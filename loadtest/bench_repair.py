"""What one state-manager repair pass costs at a given directory size (``make bench``'s ``repair`` rows).

The repair pass (``snapshot.state_manager.StateManager.repair``) reads every session: it is the slow-timer
backstop for crash recovery, the per-state counters and the quota bookkeeping. This measures it on a real
Redis with ``sessions`` SUSPENDED session records made through the directory and the quota step a create
takes (so the quota bookkeeping holds what a real create leaves), no workers, and in-memory fakes for the
workers' API and the object store: the pass's own work, nothing else.

Reported per pass (median of ``passes``): wall ms, CPU ms of this process (the repair's Python side: the
Redis server's own time is in the wall figure only), and the wait the pass earns before the next one
(``StateManager.repair_due_s``). The records live under a key prefix of their own and are deleted after.

Command: ``python -m loadtest.bench_repair --sessions 20000`` (or ``make bench``, which runs it at
20,000 unless ``--skip-repair``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

from snapshot.state_manager import StateManager
from snapshot.store import MemoryStore
from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.models import SessionRecord, SessionState
from substrate.quotas import Quotas
from substrate.settings import Settings
from substrate.specs import load_documents

_CATALOG = [
    {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 1, "slots": 4}},  # no pool controller runs: no worker starts
    {"kind": "ActorTemplate", "metadata": {"name": "counter"},
     "spec": {"entrypoint": "workers.agents.counter:Counter"}}]


class _NoWorkers:
    """The workers' API for a directory without workers: the repair must not call it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the repair pass called the workers' {name} with no worker registered")


async def bench_repair(redis_url: str, sessions: int = 20_000, passes: int = 3) -> list[dict[str, Any]]:
    """Rows for ``passes`` repair passes over ``sessions`` session records (module docstring). Raises
    ``ValueError`` for ``sessions`` < 1 or ``passes`` < 1."""
    if sessions < 1 or passes < 1:
        raise ValueError("sessions and passes must be at least 1")
    d = Directory(redis_url, f"bench-repair-{uuid.uuid4().hex[:8]}")
    settings = Settings()
    catalog = load_documents(_CATALOG)
    quotas = Quotas(d.redis, d.keys, settings.quota)
    act = Activator(settings, d, catalog, _NoWorkers(), WorkerView(d, 60), quotas=quotas)  # type: ignore[arg-type]
    sm = StateManager(settings, d, catalog, act, MemoryStore())
    template = catalog.templates["counter"]
    now = time.time()
    gate = asyncio.Semaphore(64)

    async def make(i: int) -> None:
        async with gate:
            sid = f"r{i:08d}"
            await quotas.acquire("default", template, sid, create=True)
            await d.create_session(SessionRecord(id=sid, state=SessionState.SUSPENDED, actorTemplate="counter",
                                                 pool="default", epoch=1, createdAt=now + i * 1e-6,
                                                 updatedAt=now, lastActiveAt=now))
            await quotas.release("default", "counter", sid, epoch=1)  # suspended: it holds no running place

    try:
        await asyncio.gather(*(make(i) for i in range(sessions)))
        walls, cpus = [], []
        for _ in range(passes):
            c0, w0 = time.process_time(), time.perf_counter()
            await sm.repair()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    finally:
        async for key in d.redis.scan_iter(f"{d.keys.prefix}:*", count=10_000):
            await d.redis.delete(key)
        await d.close()
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    case = f"state manager repair pass, {sessions:,} sessions (median of {passes} passes)"
    return [{"case": f"{case}: wall ms", "n": passes, "value": round(wall * 1e3, 1), "unit": "ms"},
            {"case": f"{case}: CPU ms of the state manager's process", "n": passes, "value": round(cpu * 1e3, 1),
             "unit": "ms"},
            {"case": f"{case}: least wait before the next pass (state.repair_max_share "
                     f"{settings.state.repair_max_share:g})", "n": passes,
             "value": round(max(sm.repair_due_s(wall), 10 * settings.state.scan_interval_s), 1), "unit": "s"}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_repair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=20_000, help="session records in the directory")
    ap.add_argument("--passes", type=int, default=3, help="repair passes measured")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.passes < 1:
        ap.error("--sessions and --passes must be at least 1")
    url = os.environ.get("SUBSTRATE_REDIS_URL")
    red = None
    if not url:
        from substrate.embedded import EmbeddedRedis

        red = EmbeddedRedis()
        url = red.start()
    try:
        for row in asyncio.run(bench_repair(url, args.sessions, args.passes)):
            print(f"{row['case']}: {row['value']} {row['unit']}")
    finally:
        if red is not None:
            red.stop()


if __name__ == "__main__":
    main()
