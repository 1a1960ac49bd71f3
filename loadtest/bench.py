"""``make bench``: the runtime's micro-benchmarks, printed and written as one markdown table.

Starts a whole runtime the way a user does (``substrate up`` in a child process, embedded Redis unless
``SUBSTRATE_REDIS_URL`` is set, real worker processes), then measures over loopback:

* router overhead: a RUNNING session's turn through the router vs. the same call straight to its worker;
* session creation on a warm worker: latency (sequential) and creations/s (concurrent, one router);
* suspend latency, and the wake latency a parked request sees (suspended -> answered);
* resume from object storage by workspace size (moto S3 server on loopback, and the local store);
* optionally a short trace replay (``--replay``).

Benchmarks are not tests: they report figures (medians and tails); the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench_report import markdown_table

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


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def _row(case: str, xs_s: list[float], **extra: Any) -> dict[str, Any]:
    ms = [x * 1000 for x in xs_s]
    return {"case": case, "n": len(ms), "p50_ms": statistics.median(ms), "p95_ms": _pct(ms, 0.95),
            "p99_ms": _pct(ms, 0.99), **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``substrate up`` in a child process with a temporary config."""

    def __init__(self, replicas: int = 0, slots: int = 0, *, config: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="substrate-bench-")
        cfg = Path(self.tmp.name) / "config"
        cfg.mkdir()
        if config is not None:
            for f in config.glob("*.yaml"):
                shutil.copy(f, cfg / f.name)
        else:
            (cfg / "bench.yaml").write_text(POOL % {"replicas": replicas, "slots": slots})
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = f"bench{os.getpid()}-{self.port}"
        env = {**os.environ, "SUBSTRATE_CONFIG_DIR": str(cfg), "SUBSTRATE_LOG_LEVEL": "WARNING",
               "SUBSTRATE_REDIS__KEY_PREFIX": self.prefix,
               "SUBSTRATE_WORKER__ROOT_DIR": f"{self.tmp.name}/workers",
               "SUBSTRATE_SNAPSHOT__LOCAL_DIR": f"{self.tmp.name}/snapshots", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "substrate.cli", "up", "--port", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

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
            routed, direct = [], []
            body = {"input": "get"}
            for _ in range(200):  # warm-up
                await _post(http, f"{base}/v1/sessions/{s['id']}/invoke", body)
            for i in range(n):
                routed.append((await _post(http, f"{base}/v1/sessions/{s['id']}/invoke", body))[2])
                if workers.get(wid):
                    direct.append((await _post(http, f"{workers[wid]}/v1/activations/{s['id']}/invoke", body,
                                               direct_h))[2])
            rows.append(_row("invoke via router (RUNNING session)", routed))
            if direct:
                rows.append(_row("invoke direct to worker", direct))
                rows.append({"case": "router overhead (router - direct)", "n": n,
                             "p50_ms": (statistics.median(routed) - statistics.median(direct)) * 1000,
                             "p95_ms": (_pct(routed, .95) - _pct(direct, .95)) * 1000,
                             "p99_ms": (_pct(routed, .99) - _pct(direct, .99)) * 1000})
            # creation on a warm worker: sequential latency
            lat, ids = [], []
            for _ in range(min(n, 300)):
                st, body_, dt = await _post(http, f"{base}/v1/sessions", {"actorTemplate": "counter"})
                assert st == 201, body_
                lat.append(dt)
                ids.append(body_["id"])
            rows.append(_row("create session on a warm worker (sequential)", lat))
            for sid in ids:
                async with http.delete(f"{base}/v1/sessions/{sid}"):
                    pass
            # creations per second, concurrent
            total, conc = 900, 64
            sem = asyncio.Semaphore(conc)
            lat2: list[float] = []
            ids2: list[str] = []

            async def one() -> None:
                async with sem:
                    st, b, dt = await _post(http, f"{base}/v1/sessions", {"actorTemplate": "counter"})
                    if st == 201:
                        lat2.append(dt)
                        ids2.append(b["id"])

            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(total)))
            wall = time.perf_counter() - t0
            rows.append(_row(f"create session, {conc} concurrent", lat2,
                             per_s=len(lat2) / wall, errors=total - len(lat2)))
            for sid in ids2:
                async with http.delete(f"{base}/v1/sessions/{sid}"):
                    pass
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
            for name, store in (("s3 (moto, loopback)", s3), ("local dir", LocalDirStore(Path(d) / "store"))):
                for r in await bench_resume(store, sizes_bytes=sizes, repeats=repeats):
                    mib = r["sizeBytes"] / 2**20
                    rows.append({"case": f"resume {mib:.0f} MiB workspace, {name}", "n": repeats,
                                 "p50_ms": r["resumeP50Ms"], "p95_ms": r["resumeP95Ms"]})
                    rows.append({"case": f"suspend {mib:.0f} MiB workspace (pack + upload), {name}",
                                 "n": repeats, "p50_ms": r["suspendP50Ms"], "p95_ms": r["suspendP95Ms"]})
        s3.close()
    finally:
        moto.stop()
    return rows


ROOT = Path(__file__).resolve().parents[1]
GENTD26 = ROOT.parent / "shared" / "traces" / "gentd26_requests_2024-11-15_to_11-26.csv"
#: the control loops' clocks compressed like the trace (see README: trace replay)
REPLAY_ENV = {"SUBSTRATE_POOL__SCALE_DOWN_DELAY_S": "1", "SUBSTRATE_WORKER__ACTIVE_WINDOW_S": "0.3",
              "SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "0.2"}


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
    added = s["added_ms"]
    return [{"case": f"replay {trace.name} {' '.join(args)}", "n": s["turns_run"],
             "p50_ms": added["all"]["p50"], "p95_ms": added["all"]["p95"], "p99_ms": added["all"]["p99"],
             "errors": s["errors"] + s["lost_state"]},
            {"case": "  replay: warm turns added latency", "n": added["warm"]["n"], "p50_ms": added["warm"]["p50"],
             "p95_ms": added["warm"]["p95"], "p99_ms": added["warm"]["p99"]},
            {"case": "  replay: wake turns added latency", "n": added["wake"]["n"], "p50_ms": added["wake"]["p50"],
             "p95_ms": added["wake"]["p95"], "p99_ms": added["wake"]["p99"]},
            {"case": "  replay: sessions per slot (distinct / peak slots)",
             "n": s["capacity"]["distinct_sessions"], "value": s["capacity"]["per_slot_peak"]},
            {"case": "  replay: worker-seconds, always-on baseline / ours", "n": s["turns_run"],
             "value": (res.get("ratios") or {}).get("worker_seconds_baseline_over_ours")}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="turns per latency case")
    ap.add_argument("--repeats", type=int, default=10, help="resumes per workspace size")
    ap.add_argument("--sizes-mib", default="1,16,64", help="workspace sizes for the resume benchmark")
    ap.add_argument("--out", default="bench-results", help="folder for bench.md and bench.json")
    ap.add_argument("--skip-runtime", action="store_true")
    ap.add_argument("--skip-snapshots", action="store_true")
    ap.add_argument("--skip-sandbox", action="store_true")
    ap.add_argument("--skip-auth", action="store_true", help="skip the auth on/off router-overhead rows")
    ap.add_argument("--replay", default=str(GENTD26), help="trace for the short replay (default: GenTD26 from "
                    "../shared/traces; skipped if absent)")
    ap.add_argument("--replay-args", default="--start 2024-11-21T17:00 --duration 1h --compress 120",
                    help="window and compression of the short replay")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-k8s", action="store_true", help="skip the emulated-cluster figures (loadtest/bench_k8s.py)")
    args = ap.parse_args(argv)
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
    try:
        if not args.skip_runtime:
            rows += asyncio.run(bench_runtime(args.n))
        if not args.skip_sandbox:  # issue 7: create and 1 MiB wake with the sandbox on and off
            from loadtest.bench_sandbox import bench_sandbox

            rows += asyncio.run(bench_sandbox(min(args.n, 200)))
        if not args.skip_auth:
            from loadtest.bench_auth import bench_auth

            rows += asyncio.run(bench_auth(min(args.n, 1000)))
        if not args.skip_snapshots:
            sizes = tuple(int(x) << 20 for x in args.sizes_mib.split(","))
            rows += asyncio.run(bench_snapshots(args.repeats, sizes))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if not args.skip_k8s:
            from loadtest.bench_k8s import bench_k8s

            rows += bench_k8s(os.environ["SUBSTRATE_REDIS_URL"])
        if not args.skip_replay and Path(args.replay).exists():
            rows += bench_replay(Path(args.replay), args.replay_args.split(), out / "replay")
    finally:
        if red is not None:
            red.stop()
    table = markdown_table(rows)
    (out / "bench.md").write_text(f"# make bench ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)\n\n"
                                  + table + "\n")
    (out / "bench.json").write_text(json.dumps(rows, indent=2))
    print(table)
    print(f"\nwrote {out / 'bench.md'} and {out / 'bench.json'}")


if __name__ == "__main__":
    main()
