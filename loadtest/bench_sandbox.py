"""Sandbox benchmarks for ``make bench`` (issue 7): create on a warm worker and 1 MiB wake, sandbox on/off.

One runtime (``substrate up``, local snapshot store) with the same agents twice: in their per-session
bubblewrap sandbox (the default; pool ``default``, 1 worker x 16 slots) and opted out
(``isolation.sandbox: false``: still a separate agent process, no namespaces; pool ``nosandbox``, 1 worker
x 16 slots, all of whose templates opt out). Measured end to end from an aiohttp client over loopback:

* **create on a warm worker**: ``POST /v1/sessions`` of a counter, sequentially; after each create the
  session is deleted and the next create waits 0.3 s, so the worker has re-warmed a pre-started host
  (that is the "warm worker" case; a burst past the pre-started hosts pays a spawn and a boot);
* **wake, 1 MiB workspace**: a shell session holding a 1 MiB random file is suspended (the 202 comes
  once the snapshot is committed and the sandbox is gone), then an invoke (``true``) of the SUSPENDED
  session is timed until its answer (restore + agent start + turn). Two rows:
  - **paced** (the target's row): the invoke comes ``WAKE_PAUSE_S`` after the suspend's answer, and
    the next suspend as long after the wake, as when a session is suspended after ``maxIdleTime``,
    long before its next turn;
  - **at once**: suspend and wake back to back on one session, ~20 wakes/s on one worker: the
    previous iteration's clean-up (a pre-started host booting for the freed slot, the old sandbox's
    teardown) shares the 2 cores with the wake being timed. Measured here: the same p50 as paced, a
    p95 2-3x the paced one; capping the booting host's CPU (a cgroup quota) did not change it, so it
    is not the boot alone.

Why the opted-out templates have their own pool: a worker pre-starts hosts of one kind, sandboxed with
network ``none``, or unsandboxed when every template of its pool opts out. In a mixed pool an opted-out
session spawns its host on demand (a fresh interpreter: ~100 ms here), which is what made "sandbox off"
slower than "on" in earlier runs of this benchmark, not the sandbox.

What it leaves out: concurrency (see the create-concurrent row of ``loadtest.bench``), S3 (local store;
the S3 wake rows are ``loadtest.bench``'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench import Server, _post, _row

CONFIG = """apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec: {replicas: 1, slots: 16}
---
apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: nosandbox}
spec: {replicas: 1, slots: 16}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter}
spec: {entrypoint: "workers.agents.counter:Counter", stateManagement: {snapshotInterval: 0, maxIdleTime: 0}}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter-nosandbox}
spec:
  entrypoint: "workers.agents.counter:Counter"
  workerPool: nosandbox
  stateManagement: {snapshotInterval: 0, maxIdleTime: 0}
  isolation: {sandbox: false}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: shell}
spec: {entrypoint: "workers.agents.shell:Shell", stateManagement: {snapshotInterval: 0, maxIdleTime: 0}}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: shell-nosandbox}
spec:
  entrypoint: "workers.agents.shell:Shell"
  workerPool: nosandbox
  stateManagement: {snapshotInterval: 0, maxIdleTime: 0}
  isolation: {sandbox: false}
"""


#: seconds between a suspend's answer and the wake (and between a wake and the next suspend) in the
#: paced wake row
WAKE_PAUSE_S = 0.5


async def _delete(http: aiohttp.ClientSession, url: str) -> None:
    async with http.delete(url):
        pass


async def _pools_ready(http: aiohttp.ClientSession, base: str, timeout_s: float = 60.0) -> None:
    """Wait until every pool has a ready worker (``Server.ready`` looks at the first pool only)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{base}/v1/workerpools") as r:
                items = (await r.json())["items"] if r.status == 200 else []
                if len(items) >= 2 and all(p["status"]["readyReplicas"] >= 1 for p in items):
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError("the benchmark's pools did not become ready")


async def bench_sandbox(n: int) -> list[dict[str, Any]]:
    """Rows for the bench table: create and 1 MiB wake, sandbox on and off (``n`` samples each)."""
    rows: list[dict[str, Any]] = []
    cfg = Path(tempfile.mkdtemp(prefix="substrate-bench-sandbox-"))
    (cfg / "bench.yaml").write_text(CONFIG)
    srv = Server(config=cfg)
    async with aiohttp.ClientSession() as http:
        try:
            await srv.ready(http, 1)
            base = srv.url
            await _pools_ready(http, base)
            await asyncio.sleep(3)  # let the worker pre-start its hosts
            for template, label in (("counter", "on"), ("counter-nosandbox", "off")):
                lat = []
                for _ in range(n):
                    st, body, dt = await _post(http, f"{base}/v1/sessions", {"actorTemplate": template})
                    assert st == 201, body
                    lat.append(dt)
                    await _delete(http, f"{base}/v1/sessions/{body['id']}")
                    await asyncio.sleep(0.3)
                rows.append(_row(f"create on a warm worker, sandbox {label}", lat))
            for template, label in (("shell", "on"), ("shell-nosandbox", "off")):
                st, s, _ = await _post(http, f"{base}/v1/sessions", {"actorTemplate": template})
                assert st == 201, s
                inv = f"{base}/v1/sessions/{s['id']}/invoke"
                st, out, _ = await _post(http, inv, {"input": "head -c 1048576 /dev/urandom > blob && wc -c < blob"})
                assert st == 200 and out["output"]["stdout"].strip() == "1048576", out
                for pause_s, how in ((WAKE_PAUSE_S, f"paced, {WAKE_PAUSE_S:g} s apart"), (0.0, "at once")):
                    wake = []
                    for _ in range(n):
                        st, _, _ = await _post(http, f"{base}/v1/sessions/{s['id']}/suspend")
                        assert st == 202
                        await asyncio.sleep(pause_s)
                        st, out, dt = await _post(http, inv, {"input": "true"})
                        assert st == 200, out
                        wake.append(dt)
                        await asyncio.sleep(pause_s)
                    rows.append(_row(f"wake, 1 MiB workspace, sandbox {label}, {how} (suspended -> answered)", wake))
                await _delete(http, f"{base}/v1/sessions/{s['id']}")
        finally:
            srv.stop()
            shutil.rmtree(cfg, ignore_errors=True)
    return rows


if __name__ == "__main__":
    import os

    from loadtest.bench_report import markdown_table
    from substrate.embedded import EmbeddedRedis

    red = None
    if not os.environ.get("SUBSTRATE_REDIS_URL"):
        red = EmbeddedRedis()
        os.environ["SUBSTRATE_REDIS_URL"] = red.start()
    try:
        t0 = time.perf_counter()
        print(markdown_table(asyncio.run(bench_sandbox(int(os.environ.get("BENCH_N", "100"))))))
    finally:
        if red is not None:
            red.stop()
