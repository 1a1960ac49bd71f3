"""``make bench``: the runtime's micro-benchmarks, printed and written as one markdown table.

Starts a whole runtime the way a user does (``substrate up`` in a child process, embedded Redis unless
``SUBSTRATE_REDIS_URL`` is set, real worker processes), then measures over loopback:

* router overhead: a RUNNING session's turn through the router, the same call straight to its worker,
  and through the lean floor proxy (:mod:`loadtest.floor`) in front of that worker, interleaved one by
  one once the runtime has settled (:meth:`Server.settle`: its host pre-starts done); the overhead is
  the distribution of the **paired differences** (routed - direct), with the floor proxy's own paired
  differences of the same run beside it;
* routed throughput: requests/s one router process answers at saturation (64 keep-alive connections on
  one RUNNING session; the load generator, ``wrk`` when installed, else aiohttp clients, on the same
  cores), next to the same load sent straight to the
  worker and through the floor proxy (:mod:`loadtest.floor`: the least a Python proxy hop on this
  stack does, measured in the same run against the same worker); with the CPU time each side used in the
  window (``/proc``): the router process's per request, the load generator's, the rest of the machine's
  (worker, Redis, others), and so the routed requests per router CPU-second -- what one router process
  would answer with a whole core to itself, which 2 shared cores cannot show directly;
* session creation with a realistic agent start (``echo-command``: one agent process spawned per
  session, as a sandboxed agent is) on a pool that starts from zero workers and scales with its
  autoscaler: latency (sequential) and creations/s (64 concurrent, one router), with the CPU of the
  ``substrate up`` process (router, pool controller, state manager) per create and so the creates per
  CPU-second of that process (what one router process would sustain with a whole core, workers and
  agents elsewhere), and how many sessions were still RUNNING at the end (the rest were suspended by
  slot pressure);
* suspend latency, and the wake latency a parked request sees (suspended -> answered);
* wake from the object store end to end through the runtime (moto S3 on loopback; shell sessions with
  a workspace of 1, 16, 64 MiB of random bytes, a distinct session per wake): the client's latency and
  the router's ``X-Substrate-Wake-Ms``, for wakes back to back (each competes with the previous
  session's teardown and host pre-start) and paced ``PACE_S`` apart (a settled warm worker);
* resume from object storage by workspace size at the store level (moto S3 server and the local store);
* optionally a short trace replay (``--replay``).

Percentiles are :func:`substrate.quantiles.percentile` (the project's one definition). Benchmarks are
not tests: they report figures; the machine is shared and noisy (10-40 % run-to-run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import aiohttp

from loadtest import floor, wrk
from loadtest.bench_report import markdown_table
from loadtest.proctree import descendants, machine_busy_cpu_s, process_cpu_s, tree_cpu_s
from loadtest.replay import server_timing_ms
from loadtest.report import DEFINITIONS
from substrate.quantiles import percentile
from substrate.netports import free_port as _free_port  # outside the ephemeral range

POOL = """apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec: {replicas: %(replicas)d, slots: %(slots)d}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter}
spec:
  entrypoint: workers.agents.counter:Counter
  stateManagement: {snapshotInterval: 0, maxIdleTime: 0}
"""




def _row(case: str, xs_s: list[float], **extra: Any) -> dict[str, Any]:
    ms = [x * 1000 for x in xs_s]
    return {"case": case, "n": len(ms), "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95),
            "p99_ms": percentile(ms, 99), **extra}


#: a pool that starts with no worker and scales with its autoscaler (no pre-provisioned capacity), and
#: an agent whose start spawns a process per session (as a sandboxed agent does)
AUTOSCALED = """apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec:
  slots: 16
  autoscaling: {minReplicas: 0, maxReplicas: 256, targetUtilization: 100}
  warmPool: {readyReplicas: 0}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: echo-command}
spec:
  command: ["%(python)s", "-u", "-m", "workers.agents.echo_jsonl"]
  stateManagement: {snapshotInterval: 0, maxIdleTime: 0}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: shell}
spec:
  entrypoint: workers.agents.shell:Shell
  stateManagement: {snapshotInterval: 0, maxIdleTime: 0}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter-hosted}
spec:
  entrypoint: workers.agents.counter:Counter
  stateManagement: {snapshotInterval: 0, maxIdleTime: 0}
"""

#: a runtime counts as settled (:meth:`Server.settle`) when its processes use less than this share of one core
SETTLE_QUIET_CORES = 0.05


class Server:
    """``substrate up`` in a child process with a temporary config; with ``checkout``, the runtime of that
    checkout (its ``.venv``'s Python, run from its folder: ``make install`` there first)."""

    def __init__(self, replicas: int = 0, slots: int = 0, *, config: Path | None = None,
                 env: dict[str, str] | None = None, yaml_text: str | None = None,
                 checkout: Path | None = None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="substrate-bench-")
        cfg = Path(self.tmp.name) / "config"
        cfg.mkdir()
        if config is not None:
            for f in config.glob("*.yaml"):
                shutil.copy(f, cfg / f.name)
        elif yaml_text is not None:
            (cfg / "bench.yaml").write_text(yaml_text)
        else:
            (cfg / "bench.yaml").write_text(POOL % {"replicas": replicas, "slots": slots})
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = f"bench{os.getpid()}-{self.port}"
        env = {**os.environ, "SUBSTRATE_CONFIG_DIR": str(cfg), "SUBSTRATE_LOG_LEVEL": "WARNING",
               "SUBSTRATE_REDIS__KEY_PREFIX": self.prefix,
               "SUBSTRATE_WORKER__ROOT_DIR": f"{self.tmp.name}/workers",
               "SUBSTRATE_SNAPSHOT__LOCAL_DIR": f"{self.tmp.name}/snapshots", **(env or {})}
        python = str(checkout / ".venv" / "bin" / "python") if checkout is not None else sys.executable
        self.proc = subprocess.Popen([python, "-m", "substrate.cli", "up", "--port", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=checkout)

    async def ready(self, http: aiohttp.ClientSession, replicas: int) -> None:
        for _ in range(600):
            try:
                async with http.get(self.url + "/v1/workerpools") as r:
                    if r.status == 200 and (await r.json())["items"][0]["status"]["readyReplicas"] >= replicas:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("runtime did not become ready")

    def wait_healthy(self, timeout_s: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("runtime did not become ready")

    async def settle(self, quiet_cores: float = SETTLE_QUIET_CORES, window_s: float = 1.0,
                     timeout_s: float = 60.0) -> float:
        """Wait until the runtime's processes (``substrate up`` and everything under it: zygote, workers,
        pre-started agent hosts) together use less than ``quiet_cores`` of a core over ``window_s``
        seconds, so a latency case measures the path it names and not the pool still booting its hosts
        (right after readiness each worker pre-starts its spare hosts, ~85 ms of CPU each: measured
        2026-12-06, direct calls to a worker then had p99 12-14 ms against 0.85 ms once settled).
        Returns the seconds waited; raises ``RuntimeError`` after ``timeout_s`` (a runtime that never
        goes quiet would make every latency figure meaningless)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            pids = [self.proc.pid, *descendants(self.proc.pid)]
            before = tree_cpu_s(pids)
            await asyncio.sleep(window_s)
            after = tree_cpu_s([self.proc.pid, *descendants(self.proc.pid)])
            # a process started within the window (a host being pre-started) counts with all its CPU
            used_s = sum(cpu - before.get(p, 0.0) for p, cpu in after.items())
            if used_s / window_s < quiet_cores:
                return time.monotonic() - t0
        raise RuntimeError(f"the runtime's processes did not go quiet (< {quiet_cores} of a core) in {timeout_s:.0f} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.tmp.cleanup()


async def _post(http: aiohttp.ClientSession, url: str, body: Any = None, headers: dict[str, str] | None = None
                ) -> tuple[int, Any, float]:
    t0 = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as r:
        data = await r.read()
        dt = time.perf_counter() - t0
        return r.status, (json.loads(data) if data else None), dt


async def bench_runtime(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    srv = Server(replicas=4, slots=256)
    conn = aiohttp.TCPConnector(limit=128)
    async with aiohttp.ClientSession(connector=conn) as http:
        try:
            await srv.ready(http, 4)
            base = srv.url
            status, s, _ = await _post(http, f"{base}/v1/sessions", {"actorTemplate": "counter"})
            assert status == 201, s
            async with http.get(f"{base}/v1/workerpools") as r:
                pass
            workers = {}
            async with http.get(f"{base}/v1/stats") as r:
                pass
            # worker address: from the proxied answer's header + the worker list of /v1/activations
            async with http.post(f"{base}/v1/sessions/{s['id']}/invoke", json={"input": "get"}) as r:
                wid = r.headers["X-Substrate-Worker"]
            import redis  # the bench reads the worker address from the directory, as the router does

            url = os.environ.get("SUBSTRATE_REDIS_URL")
            if url:
                rr = redis.Redis.from_url(url, decode_responses=True)
                workers[wid] = rr.hget(f"{srv.prefix}:{{w:{wid}}}:worker", "address")
            from loadtest.bench_auth import worker_headers

            direct_h = worker_headers(url, srv.prefix, workers[wid], s["id"], s["epoch"]) if workers.get(wid) else {}
            routed, direct, floored = [], [], []
            body = {"input": "get"}
            inv = f"{base}/v1/sessions/{s['id']}/invoke"
            d_url = f"{workers[wid]}/v1/activations/{s['id']}/invoke" if workers.get(wid) else ""
            floor_proc = None
            if d_url:  # the lean floor proxy in front of the same worker: its paired overhead is this run's floor
                floor_port = _free_port()
                floor_proc = await asyncio.to_thread(floor.start, floor_port, d_url, direct_h, "lean")
            try:
                settled_s = await srv.settle()
                for _ in range(200):  # warm-up: connection pools, route cache
                    await _post(http, inv, body)
                    if floor_proc is not None:
                        await _post(http, f"http://127.0.0.1:{floor_port}/invoke", body)
                for i in range(n):
                    # routed, direct and floor calls interleaved one by one: the same conditions for each
                    routed.append((await _post(http, inv, body))[2])
                    if d_url:
                        direct.append((await _post(http, d_url, body, direct_h))[2])
                        floored.append((await _post(http, f"http://127.0.0.1:{floor_port}/invoke", body))[2])
            finally:
                if floor_proc is not None:
                    floor_proc.terminate()
                    await asyncio.to_thread(floor_proc.wait)
            settled = (f"settled runtime: its processes under {SETTLE_QUIET_CORES:.0%} of a core for 1 s first, "
                       f"{settled_s:.1f} s after ready")
            rows.append(_row(f"invoke via router (RUNNING session; {settled})", routed))
            if direct:
                rows.append(_row(f"invoke direct to worker ({settled})", direct))
                # the overhead of each request: routed minus the direct call made right after it
                paired = [r - d for r, d in zip(routed, direct, strict=True)]
                floor_paired = [f - d for f, d in zip(floored, direct, strict=True)]
                fp = {q: percentile(floor_paired, q) * 1e3 for q in (50, 99)}
                rows.append(_row(f"router overhead: paired differences (routed - direct; {settled})", paired,
                                 target="p50 <= 0.5, p99 <= 1",
                                 floor=f"{fp[50]:.3f} / {fp[99]:.3f} (p50 / p99 of the lean floor proxy's paired "
                                       "differences, same calls interleaved, this run)"))
                rows.append(_row("floor proxy overhead: paired differences (lean floor proxy - direct, "
                                 "interleaved with the rows above; loadtest/floor.py)", floor_paired))
                rows += await _throughput(http, base, workers, wid, s, direct_h, router_pid=srv.proc.pid)
            # suspend, and the wake a parked request sees
            sus, wake = [], []
            for _ in range(min(n, 100)):
                st, _, dt = await _post(http, f"{base}/v1/sessions/{s['id']}/suspend")
                assert st == 202
                sus.append(dt)
                st, _, dt = await _post(http, f"{base}/v1/sessions/{s['id']}/invoke", {"input": "increment"})
                assert st == 200
                wake.append(dt)
            rows.append(_row("suspend (snapshot + commit + free slot), local store", sus))
            rows.append(_row("wake: invoke of a SUSPENDED session, local store", wake))
        finally:
            srv.stop()
    return rows


async def _throughput(http: aiohttp.ClientSession, base: str, workers: dict[str, str], wid: str,
                      s: dict[str, Any], direct_headers: dict[str, str], conc: int = 64,
                      seconds: int = 5, router_pid: int | None = None) -> list[dict[str, Any]]:
    """Requests/s of one router process at saturation, of the floor proxy (:mod:`loadtest.floor`, the
    least a Python proxy hop on this stack does) in front of the same worker, and of the same load sent
    straight to the worker (``conc`` connections on one RUNNING session's warm path for ``seconds``
    each, one after the other). The load generator is ``wrk`` when it is installed (:mod:`loadtest.wrk`:
    a C client, so more of the shared cores go to the proxy), else ``conc`` aiohttp clients in this
    process, and the rows say which. With ``router_pid`` the routed and floor rows also say where the
    CPU went in their window (module doc), and a row gives the router's CPU per turn over the floor's."""
    body = {"input": "get"}
    direct_url = f"{workers[wid]}/v1/activations/{s['id']}/invoke"
    use_wrk = wrk.available()
    generator = (f"wrk, {conc} connections" if use_wrk
                 else f"{conc} aiohttp clients in the bench process; wrk not installed: {wrk.INSTALL_HINT}")
    rows: list[dict[str, Any]] = []
    measured: dict[str, tuple[float, float]] = {}  # name -> (requests/s, proxy CPU us per request)
    cases = {"routed": "throughput routed, one router process",
             "aiohttp": "throughput through the floor proxy with aiohttp's client (loadtest/floor.py: raw ASGI, "
                        "nothing else), same worker; its CPU in the router columns",
             "lean": "throughput through the floor proxy with the router's lean client (loadtest/floor.py), "
                     "same worker; its CPU in the router columns",
             "direct": "throughput direct to the worker, no router"}
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases:
            proc, port = None, 0
            if name in floor.CLIENTS:  # each floor proxy runs only during its own window
                port = _free_port()
                proc = await asyncio.to_thread(floor.start, port, direct_url, direct_headers, name)
            url, headers, pid = {"routed": (f"{base}/v1/sessions/{s['id']}/invoke", None, router_pid),
                                 "direct": (direct_url, direct_headers, None)}.get(
                name, (f"http://127.0.0.1:{port}/invoke", None, proc.pid if proc and router_pid else None))
            try:
                cpu0 = (process_cpu_s(pid) if pid else 0.0, time.process_time(), machine_busy_cpu_s())
                if use_wrk:
                    script = wrk.write_script(Path(tmp) / f"{name}.lua", json.dumps(body), headers)
                    r = await wrk.run(url, script, connections=conc, seconds=seconds)  # raises if any answer failed
                    done, errors, wall, gen_s = r.requests, 0, r.seconds, r.cpu_s
                else:
                    done, errors, wall = await _aiohttp_load(http, url, body, headers, conc, seconds)
                    gen_s = time.process_time() - cpu0[1]
                proxy_s, busy_s = (process_cpu_s(pid) - cpu0[0] if pid else 0.0, machine_busy_cpu_s() - cpu0[2])
            finally:
                if proc is not None:
                    proc.terminate()
                    await asyncio.to_thread(proc.wait)
            cpu = {}
            if done and pid:
                cpu = {"router_cpu_us_per_req": proxy_s / done * 1e6, "router_cores": proxy_s / wall,
                       "loadgen_cores": gen_s / wall, "other_cores": max(0.0, busy_s - proxy_s - gen_s) / wall}
                measured[name] = (done / wall, proxy_s / done * 1e6)
            rows.append({"case": f"{cases[name]} (load generator: {generator})", "n": done, "per_s": done / wall,
                         "errors": errors, **cpu, **({"target": ">= 5000/s"} if name == "routed" else {})})
            if name == "routed" and cpu and proxy_s > 0:
                rows.append({"case": "routed requests per router CPU-second (one router process with a whole "
                                     "core; derived from the row above)",
                             "n": done, "per_s": done / proxy_s, "target": ">= 5000/s"})
    if "routed" in measured:
        r_s, r_us = measured["routed"]
        rows[0]["floor"] = "; ".join(f"{client}: {f_s:,.0f}/s, {f_us:.0f} us CPU/req" for client, (f_s, f_us)
                                     in measured.items() if client != "routed") + " (floor proxies, this run)"
        for client in floor.CLIENTS:
            if client in measured:
                rows.append({"case": f"router CPU per turn / the {client} floor proxy's (same worker, same load, "
                                     "this run)", "n": rows[0]["n"], "value": round(r_us / measured[client][1], 2),
                             "unit": "x"})
    return rows


async def _aiohttp_load(http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None,
                        conc: int, seconds: float) -> tuple[int, int, float]:
    """``conc`` aiohttp clients posting ``body`` to ``url`` back to back for ``seconds``: (answered 200,
    other answers, wall seconds)."""
    done = errors = 0
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            st, _, _ = await _post(http, url, body, headers)
            if st == 200:
                done += 1
            else:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(conc)))
    return done, errors, time.perf_counter() - t0


async def bench_creation(n: int) -> list[dict[str, Any]]:
    """Creation with a realistic agent start on a pool that starts from zero workers (see module doc)."""
    rows: list[dict[str, Any]] = []
    srv = Server(yaml_text=AUTOSCALED % {"python": sys.executable},
                 env={"SUBSTRATE_POOL__SCALE_DOWN_DELAY_S": "30"})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=128)) as http:
        try:
            await asyncio.to_thread(srv.wait_healthy)
            lat, ids = [], []
            up0, t_seq = process_cpu_s(srv.proc.pid), time.perf_counter()
            for _ in range(min(n, 200)):
                st, body_, dt = await _post(http, f"{srv.url}/v1/sessions", {"actorTemplate": "echo-command"})
                assert st == 201, body_
                lat.append(dt)
                ids.append(body_["id"])
            up_seq_s, wall_seq = process_cpu_s(srv.proc.pid) - up0, time.perf_counter() - t_seq
            # one create at a time: no slot pressure (nothing is suspended for room), so the `up` process's
            # CPU per create is the create path itself plus the pool controller's part in the few worker
            # starts and the runtime's time-driven loops over the run (said in the row)
            rows.append(_row("create session, agent process per session, autoscaled pool (sequential; the `up` "
                             "process's CPU per create includes its loops' time-driven work over the run)", lat,
                             router_cpu_us_per_req=up_seq_s / len(lat) * 1e6, router_cores=up_seq_s / wall_seq))
            for sid in ids:
                async with http.delete(f"{srv.url}/v1/sessions/{sid}"):
                    pass
            total, conc = 1000, 64
            # the same burst twice: an agent process spawned per session (a `command:` template: a Python
            # interpreter start, ~150 ms of CPU here, bounds the rate), then a Python-class agent whose
            # sandboxed host each slot pre-starts (an `entrypoint:` template)
            for template, what in (("echo-command", "agent process per session"),
                                   ("counter-hosted", "pre-started sandboxed agent host (entrypoint template)")):
                sem = asyncio.Semaphore(conc)
                lat2: list[float] = []
                ids2: list[str] = []
                errors: dict[str, int] = {}

                async def one() -> None:
                    async with sem:
                        st, b, dt = await _post(http, f"{srv.url}/v1/sessions", {"actorTemplate": template})
                        if st == 201:
                            lat2.append(dt)
                            ids2.append(b["id"])
                        else:
                            code = (b or {}).get("code", str(st)) if isinstance(b, dict) else str(st)
                            errors[code] = errors.get(code, 0) + 1

                async with http.get(f"{srv.url}/v1/stats") as r:
                    before = (await r.json())["workers"]
                cpu0 = (process_cpu_s(srv.proc.pid), time.process_time(), machine_busy_cpu_s())
                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(total)))
                wall = time.perf_counter() - t0
                up_s, gen_s, busy_s = (process_cpu_s(srv.proc.pid) - cpu0[0], time.process_time() - cpu0[1],
                                       machine_busy_cpu_s() - cpu0[2])
                async with http.get(f"{srv.url}/v1/stats") as r:
                    stats = await r.json()
                # where the shared cores went in the burst (as in the routed-throughput rows): the
                # `substrate up` process (the router, and the pool controller that starts the workers),
                # this process (the clients), the rest (workers, agents, Redis)
                cpu = ({"router_cpu_us_per_req": up_s / len(lat2) * 1e6, "router_cores": up_s / wall,
                        "loadgen_cores": gen_s / wall, "other_cores": max(0.0, busy_s - up_s - gen_s) / wall}
                       if lat2 else {})
                # none is deleted during the burst; under slot pressure the runtime suspends those idle
                # for ``pressure_min_idle_s`` instead of growing for them (lazy suspension), so the row
                # says how many were still RUNNING at the end
                states = stats.get("sessions", {})
                rows.append(_row(f"create session, {what}, {conc} concurrent, {total} created, none deleted "
                                 f"({states.get('RUNNING', '?')} RUNNING and {states.get('SUSPENDED', '?')} "
                                 f"suspended by slot pressure at the end; workers: {before} before, "
                                 f"{stats['workers']} at the end)", lat2,
                                 per_s=len(lat2) / wall, errors=sum(errors.values()), target=">= 1000/s",
                                 **({"error_codes": ", ".join(f"{k} x{v}" for k, v in sorted(errors.items()))}
                                    if errors else {}), **cpu))
                if lat2 and up_s > 0:
                    rows.append({"case": f"creates per CPU-second of the `substrate up` process ({what}; the "
                                         "router with the pool controller that starts workers: one router process "
                                         "with a whole core, workers and agents on other cores; derived from the "
                                         "row above)", "n": len(lat2), "per_s": len(lat2) / up_s,
                                 "target": ">= 1000/s"})
                for sid in ids2:
                    async with http.delete(f"{srv.url}/v1/sessions/{sid}"):
                        pass
        finally:
            srv.stop()
    return rows


#: seconds between two paced wakes of the S3 wake benchmark (past the slot's host pre-start delay and boot)
PACE_S = 1.0


def phase_medians(phases: dict[str, list[float]]) -> str:
    """``"place 0.4 · activate 21 · restore 14 · ..."``: the median (ms) of each ``Server-Timing`` phase of
    the wakes measured, in the header's order, ``wake`` (the row's own figure) left out."""
    return " · ".join(f"{name} {percentile(ms, 50):.3g}" for name, ms in phases.items() if name != "wake" and ms)


async def bench_wake_sizes(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """Wake from S3 (moto) end to end through the runtime, one distinct session per wake (module doc)."""
    from moto.server import ThreadedMotoServer

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    env = {"SUBSTRATE_SNAPSHOT__STORE": "s3", "SUBSTRATE_SNAPSHOT__ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "SUBSTRATE_SNAPSHOT__BUCKET": "bench-wake", "SUBSTRATE_SNAPSHOT__REGION": "us-east-1",
           "SUBSTRATE_SNAPSHOT__ACCESS_KEY_ID": "testing", "SUBSTRATE_SNAPSHOT__SECRET_ACCESS_KEY": "testing"}
    srv = Server(yaml_text=AUTOSCALED % {"python": sys.executable}, env=env)
    rows: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        try:
            await asyncio.to_thread(srv.wait_healthy)
            for size in sizes:
                sids = []
                for _ in range(repeats):
                    st, b, _ = await _post(http, f"{srv.url}/v1/sessions", {"actorTemplate": "shell"})
                    assert st == 201, b
                    sid = b["id"]
                    cmd = f"head -c {size} /dev/urandom > blob"
                    st, b, _ = await _post(http, f"{srv.url}/v1/sessions/{sid}/invoke", {"input": cmd})
                    assert st == 200, b
                    sids.append(sid)
                for sid in sids:
                    st, b, _ = await _post(http, f"{srv.url}/v1/sessions/{sid}/suspend")
                    assert st == 202, b
                # the suspends freed `repeats` slots at once, and their hosts' refill (~85 ms of CPU each)
                # would overlap the first wakes: settle first, so a back-to-back wake competes with what
                # its label says (the previous wake's teardown and refill), not with this set-up's
                await srv.settle()
                mib = size / 2**20
                # half the sessions woken one right after the other (each wake then competes with the
                # previous session's teardown and its slot's host pre-start on the same cores), half paced
                # PACE_S apart (a wake on a settled warm worker, what one user's wake sees)
                for how, part in (("back to back", sids[: len(sids) // 2]), (f"paced {PACE_S} s apart",
                                                                           sids[len(sids) // 2:])):
                    client, server = [], []
                    phases: dict[str, list[float]] = {}
                    for sid in part:  # a distinct session each time: no cache helps
                        if how != "back to back":
                            await asyncio.sleep(PACE_S)
                        t0 = time.perf_counter()
                        async with http.post(f"{srv.url}/v1/sessions/{sid}/invoke", json={"input": "true"}) as r:
                            text = await r.text()
                            assert r.status == 200 and r.headers.get("X-Substrate-Woke") == "1", (r.status, text[:300])
                            client.append(time.perf_counter() - t0)
                            server.append(float(r.headers["X-Substrate-Wake-Ms"]) / 1000)
                            for name, ms in server_timing_ms(r.headers).items():
                                phases.setdefault(name, []).append(ms)
                        async with http.delete(f"{srv.url}/v1/sessions/{sid}"):
                            pass
                    rows.append(_row(f"wake {mib:.0f} MiB workspace from S3 (moto), {how}, through the runtime, "
                                     "client (incl. a shell turn)", client))
                    rows.append(_row(f"wake {mib:.0f} MiB workspace from S3 (moto), {how}, router "
                                     "X-Substrate-Wake-Ms", server, **({"target": "p95 <= 30"} if size == 1 << 20 else {}),
                                     phases_p50_ms=phase_medians(phases)))
        finally:
            srv.stop()
            moto.stop()
    return rows


async def bench_snapshots(repeats: int, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    from moto.server import ThreadedMotoServer

    from snapshot.bench import bench_resume
    from snapshot.store import LocalDirStore, S3Store

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    port = _free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    try:
        s3 = S3Store("bench", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1",
                     access_key_id="testing", secret_access_key="testing")
        await s3.ensure_bucket()
        with tempfile.TemporaryDirectory() as d:
            # both stores in alternation (snapshot/bench.py says why)
            stores = {"s3 (moto, loopback)": s3, "local dir": LocalDirStore(Path(d) / "store")}
            for r in await bench_resume(stores, sizes_bytes=sizes, repeats=repeats):
                mib, name = r["sizeBytes"] / 2**20, r["store"]
                rows.append({"case": f"resume {mib:.0f} MiB workspace, {name} (stores alternated)", "n": repeats,
                             "p50_ms": r["resumeP50Ms"], "p95_ms": r["resumeP95Ms"]})
                rows.append({"case": f"suspend {mib:.0f} MiB workspace (pack + upload), {name} (stores alternated)",
                             "n": repeats, "p50_ms": r["suspendP50Ms"], "p95_ms": r["suspendP95Ms"]})
        s3.close()
    finally:
        moto.stop()
    return rows


ROOT = Path(__file__).resolve().parents[1]
GENTD26 = ROOT.parent / "shared" / "traces" / "gentd26_requests_2024-11-15_to_11-26.csv"
#: the control loops' clocks compressed like the trace, and one free slot kept per pool (see README: trace
#: replay; the headroom's A/B: docs/replays/gentd26-2024-11-26-rate-2x/report-2026-12-07-headroom-ab.md)
REPLAY_ENV = {"SUBSTRATE_POOL__SCALE_DOWN_DELAY_S": "1", "SUBSTRATE_POOL__FORECAST_WINDOW_S": "1",
              "SUBSTRATE_WORKER__ACTIVE_WINDOW_S": "0.3",
              "SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "0.2", "SUBSTRATE_POOL__HEADROOM_SLOTS": "1"}


def bench_replay(trace: Path, args: list[str], out: Path) -> list[dict[str, Any]]:
    """Replay ``trace`` against a fresh runtime on the dense replay pool; one row of figures."""
    from loadtest.replay import main as replay_main

    srv = Server(config=ROOT / "loadtest" / "config", env=REPLAY_ENV)
    try:
        srv.wait_healthy()
        replay_main([str(trace), "--host", srv.url, "--template", "replay-counter", "--out", str(out),
                     "--no-progress", *args])
    finally:
        srv.stop()
    res = json.loads((out / "result.json").read_text())
    s = res["targets"]["ours"]["summary"]
    added, cost = s["added_ms"], s["cost"]
    rows = [{"case": f"replay {trace.name} {' '.join(args)} (added latency from scheduled arrival, "
                     "failures = inf)", "n": s["turns_run"],
             "p50_ms": added["all"]["p50"], "p95_ms": added["all"]["p95"], "p99_ms": added["all"]["p99"],
             "errors": s["errors"] + s["lost_state"]},
            {"case": "  replay: warm turns added latency", "n": added["warm"]["n"], "p50_ms": added["warm"]["p50"],
             "p95_ms": added["warm"]["p95"], "p99_ms": added["warm"]["p99"]},
            {"case": "  replay: wake turns added latency", "n": added["wake"]["n"], "p50_ms": added["wake"]["p50"],
             "p95_ms": added["wake"]["p95"], "p99_ms": added["wake"]["p99"]},
            {"case": "  replay: utilization (busy / provisioned slot-seconds)", "n": s["turns_run"],
             "value": cost["utilization"]},
            {"case": "  replay: density (time-averaged alive sessions per slot)", "n": s["turns_run"],
             "value": cost["density"]}]
    for h in (res.get("baseline") or {}).get("holds", []):
        rows.append({"case": f"  replay: always-on baseline / ours, slot-seconds, {h['hold']}", "n": s["turns_run"],
                     "value": h["slot_ratio"]})
    return rows


_TARGET_PART = re.compile(r"\s*(p\d+)\s*<=\s*([\d.]+)\s*$|\s*>=\s*([\d.]+)/s\s*$")


def target_met(row: dict[str, Any]) -> bool | None:
    """Whether ``row``'s figures meet its ``target`` (``"p50 <= 0.5, p99 <= 1"`` on its ``pNN_ms``,
    ``">= 5000/s"`` on its ``per_s``): True, False, or None when it has no target or no figure to judge it
    by. The table printed targets beside misses with no mark (fresh-user round 10)."""
    target = row.get("target")
    if not isinstance(target, str) or not target:
        return None
    verdicts = []
    for part in target.split(","):
        m = _TARGET_PART.match(part)
        if m is None:
            return None
        if m.group(1):
            got, bound = row.get(f"{m.group(1)}_ms"), float(m.group(2))
            if not isinstance(got, (int, float)):
                return None
            verdicts.append(got <= bound)
        else:
            got, bound = row.get("per_s"), float(m.group(3))
            if not isinstance(got, (int, float)):
                return None
            verdicts.append(got >= bound)
    return all(verdicts)


def _with_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with a ``met`` cell right after each ``target`` (``target_met``)."""
    out = []
    for row in rows:
        if "target" not in row:
            out.append(row)
            continue
        new: dict[str, Any] = {}
        for k, v in row.items():
            new[k] = v
            if k == "target":
                new["met"] = target_met(row)
        out.append(new)
    return out


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, ...]:
    """Refuse (``ap.error``: usage, exit 2) values no benchmark can run with, before anything starts:
    ``--sizes-mib abc`` was a traceback, ``-1`` a row titled "resume -1 MiB", ``--repeats 0`` rows of
    zeros as if measured, ``-n -5`` silently dropped rows, ``--out`` naming a file a traceback at the
    end, and ``--replay`` naming no file left the replay out without a word (fresh-user round 10).
    Returns the workspace sizes in bytes."""
    for name, value in (("-n", args.n), ("--repeats", args.repeats), ("--wake-repeats", args.wake_repeats),
                        ("--repair-sessions", args.repair_sessions)):
        if value < 1:
            ap.error(f"{name} must be at least 1, not {value}")
    if args.wake_repeats < 2:
        ap.error("--wake-repeats must be at least 2 (half the wakes back to back, half paced)")
    try:
        mib = [int(x) for x in args.sizes_mib.split(",")]
    except ValueError:
        ap.error(f"--sizes-mib takes whole MiB separated by commas (e.g. 1,16,64), not {args.sizes_mib!r}")
    if not mib or min(mib) < 1 or max(mib) > 4096:
        ap.error(f"--sizes-mib: each size must be 1-4096 MiB, not {args.sizes_mib!r}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {args.out} is a file, not a folder")
    default_replay = args.replay == str(GENTD26)
    if not args.skip_replay and not Path(args.replay).is_file():
        if not default_replay:
            ap.error(f"--replay {args.replay}: no such file (or --skip-replay)")
        print(f"bench: the default trace {GENTD26} is not here: the replay part is left out", file=sys.stderr)
    return tuple(m << 20 for m in mib)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="turns per latency case")
    ap.add_argument("--repeats", type=int, default=10, help="resumes per workspace size")
    ap.add_argument("--sizes-mib", default="1,16,64", help="workspace sizes for the resume benchmark")
    ap.add_argument("--out", default="bench-results", help="folder for bench.md and bench.json")
    ap.add_argument("--skip-runtime", action="store_true")
    ap.add_argument("--skip-creation", action="store_true")
    ap.add_argument("--skip-wake", action="store_true")
    ap.add_argument("--wake-repeats", type=int, default=40,
                    help="distinct sessions woken per workspace size (half back to back, half paced)")
    ap.add_argument("--skip-snapshots", action="store_true")
    ap.add_argument("--skip-sandbox", action="store_true")
    ap.add_argument("--skip-auth", action="store_true", help="skip the auth on/off router-overhead rows")
    ap.add_argument("--replay", default=str(GENTD26), help="trace for the short replay (default: GenTD26 from "
                    "../shared/traces; skipped if absent)")
    ap.add_argument("--replay-args", default="--start 2024-11-21T17:00 --duration 1h --compress 120",
                    help="window and compression of the short replay")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-k8s", action="store_true", help="skip the emulated-cluster figures (loadtest/bench_k8s.py)")
    ap.add_argument("--skip-repair", action="store_true",
                    help="skip the state manager's repair pass figures (loadtest/bench_repair.py)")
    ap.add_argument("--repair-sessions", type=int, default=20_000,
                    help="session records in the directory for the repair pass figures")
    args = ap.parse_args(argv)
    sizes = _check_args(ap, args)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    if not os.environ.get("SUBSTRATE_REDIS_URL"):
        from substrate.embedded import EmbeddedRedis

        red = EmbeddedRedis()
        os.environ["SUBSTRATE_REDIS_URL"] = red.start()
    else:
        red = None
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def section(name: str, run: Callable[[], list[dict[str, Any]]]) -> None:
        """One part of the bench; a part that fails is reported (a row and the traceback) and the others
        still run, so one broken part does not throw away a quarter hour of figures."""
        try:
            rows.extend(run())
        except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
            traceback.print_exc()
            failed.append(name)
            rows.append({"case": f"{name}: FAILED", "error": f"{e.__class__.__name__}: {e}"[:300]})

    try:
        if not args.skip_runtime:
            section("runtime", lambda: asyncio.run(bench_runtime(args.n)))
        if not args.skip_creation:
            section("creation", lambda: asyncio.run(bench_creation(args.n)))
        if not args.skip_wake:
            section("wake", lambda: asyncio.run(bench_wake_sizes(sizes, args.wake_repeats)))
        if not args.skip_sandbox:  # issue 7: create and 1 MiB wake with the sandbox on and off
            from loadtest.bench_sandbox import bench_sandbox

            section("sandbox", lambda: asyncio.run(bench_sandbox(min(args.n, 200))))
        if not args.skip_auth:
            from loadtest.bench_auth import bench_auth

            section("auth", lambda: asyncio.run(bench_auth(min(args.n, 1000))))
        if not args.skip_snapshots:
            section("snapshots", lambda: asyncio.run(bench_snapshots(args.repeats, sizes)))
        if not args.skip_k8s:
            from loadtest.bench_k8s import bench_k8s

            section("k8s", lambda: bench_k8s(os.environ["SUBSTRATE_REDIS_URL"]))
        if not args.skip_repair:
            from loadtest.bench_repair import bench_repair

            section("repair", lambda: asyncio.run(bench_repair(os.environ["SUBSTRATE_REDIS_URL"],
                                                               args.repair_sessions)))
        if not args.skip_replay and Path(args.replay).exists():  # the default trace may be absent: said below
            section("replay", lambda: bench_replay(Path(args.replay), args.replay_args.split(), out / "replay"))
    finally:
        if red is not None:
            red.stop()
    rows = _with_verdicts(rows)
    table = markdown_table(rows)
    (out / "bench.md").write_text(f"# make bench ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)\n\n"
                                  + table + "\n\nDefinitions:\n\n" + DEFINITIONS + "\n")
    print("Definitions:\n" + DEFINITIONS + "\n")
    (out / "bench.json").write_text(json.dumps(rows, indent=2))
    print(table)
    print(f"\nwrote {out / 'bench.md'} and {out / 'bench.json'}")
    if failed:
        raise SystemExit(f"bench parts that failed: {', '.join(failed)} (tracebacks above)")


if __name__ == "__main__":
    main()
