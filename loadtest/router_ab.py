"""Router CPU per turn, two checkouts side by side: ``python -m loadtest.router_ab A_DIR B_DIR``.

A change to the router's request path is judged by the CPU the router process spends per turn, which
a shared 2-core machine shows only as a ratio: run one after the other, two runs of the same code
differ by up to 2x here (2026-12-04). So both runtimes (``substrate up`` of each checkout, one worker
of 16 slots, one RUNNING ``counter`` session each, 300 warm-up turns) are loaded **at the same time**,
by two ``wrk`` processes with the same connections and duration, and each round reads each router
process's CPU time (``/proc``, user + system) over the same window. Reported per round and as
medians: turns/s, router CPU microseconds per turn, and B's CPU per turn over A's in the same round
(the paired ratio); and the same for the rest of each runtime, every process under its router (the
worker, its agent hosts, the embedded Redis), so that a change to the worker is measured too. What it
leaves out: wrk's CPU, the CPU of a runtime process that started or ended within a round (none does in
a steady round: the session's agent host lives throughout), and latency.

``wrk`` (Debian package ``wrk``) is the load generator: a C client whose own cost per request is small
next to a Python one, so more of the cores go to the runtimes. Traffic goes to loopback only; every
round is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import wrk
from loadtest.bench import Server, _post
from loadtest.proctree import descendants, process_cpu_s, tree_cpu_s

_BODY = '{"input": "get"}'


async def _start(checkout: Path, http: aiohttp.ClientSession) -> tuple[Server, str]:
    srv = Server(replicas=1, slots=16, checkout=checkout)
    await srv.ready(http, 1)
    status, s, _ = await _post(http, f"{srv.url}/v1/sessions", {"actorTemplate": "counter"})
    if status != 201:
        raise RuntimeError(f"{checkout}: create answered {status}: {s}")
    url = f"{srv.url}/v1/sessions/{s['id']}/invoke"
    for _ in range(300):
        await _post(http, url, {"input": "get"})
    return srv, url


async def _wrk(url: str, conc: int, seconds: int, script: Path) -> tuple[int, float]:
    r = await wrk.run(url, script, connections=conc, seconds=seconds)  # both at once: only the counts are read
    return r.requests, r.seconds


def _rest_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes in both ``before`` and ``after`` (pid -> CPU s) used between the two."""
    return sum(after[p] - before[p] for p in before.keys() & after.keys())


async def run(a: Path, b: Path, rounds: int, conc: int, seconds: int) -> dict[str, Any]:
    """Both runtimes up, ``rounds`` paired rounds; returns the rows and the medians (module doc)."""
    if not wrk.available():
        raise SystemExit(f"wrk is not installed: {wrk.INSTALL_HINT}")
    for c in (a, b):
        if not (c / ".venv" / "bin" / "python").exists():
            raise SystemExit(f"{c} has no .venv: run `make install` in it first")
    with tempfile.TemporaryDirectory() as tmp:
        script = wrk.write_script(Path(tmp) / "turn.lua", _BODY)
        async with aiohttp.ClientSession() as http:
            servers: list[Server] = []
            try:
                sa, ua = await _start(a, http)
                servers.append(sa)
                sb, ub = await _start(b, http)
                servers.append(sb)
                rows = []
                for i in range(rounds):
                    rest0 = (tree_cpu_s(descendants(sa.proc.pid)), tree_cpu_s(descendants(sb.proc.pid)))
                    cpu0 = (process_cpu_s(sa.proc.pid), process_cpu_s(sb.proc.pid))
                    (na, ta), (nb, tb) = await asyncio.gather(_wrk(ua, conc, seconds, script),
                                                              _wrk(ub, conc, seconds, script))
                    cpu_a, cpu_b = (process_cpu_s(sa.proc.pid) - cpu0[0], process_cpu_s(sb.proc.pid) - cpu0[1])
                    rest_a, rest_b = (_rest_s(rest0[0], tree_cpu_s(list(rest0[0]))),
                                      _rest_s(rest0[1], tree_cpu_s(list(rest0[1]))))
                    row = {"round": i + 1, "a_per_s": na / ta, "b_per_s": nb / tb,
                           "a_router_us_per_turn": cpu_a / na * 1e6, "b_router_us_per_turn": cpu_b / nb * 1e6,
                           "a_rest_us_per_turn": rest_a / na * 1e6, "b_rest_us_per_turn": rest_b / nb * 1e6}
                    row["b_over_a"] = row["b_router_us_per_turn"] / row["a_router_us_per_turn"]
                    row["b_over_a_rest"] = row["b_rest_us_per_turn"] / row["a_rest_us_per_turn"]
                    rows.append(row)
                    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
            finally:
                for s in servers:
                    s.stop()
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    return {"a": str(a), "b": str(b), "conc": conc, "seconds": seconds, "rows": rows, "medians": medians}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="checkout A (the baseline), with its .venv (make install)")
    ap.add_argument("b", type=Path, help="checkout B (the change), with its .venv")
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds (default 8)")
    ap.add_argument("--conc", type=int, default=16, help="connections per wrk (default 16)")
    ap.add_argument("--seconds", type=int, default=5, help="length of a round in whole seconds (default 5)")
    ap.add_argument("--out", type=Path, help="write the rows and medians here as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.conc < 1 or not 1 <= args.seconds <= 60:
        ap.error("--rounds and --conc must be >= 1, --seconds 1-60")
    res = asyncio.run(run(args.a.resolve(), args.b.resolve(), args.rounds, args.conc, args.seconds))
    m = res["medians"]
    print(f"medians: A {m['a_per_s']:.0f} turns/s, {m['a_router_us_per_turn']:.0f} us router CPU per turn; "
          f"B {m['b_per_s']:.0f} turns/s, {m['b_router_us_per_turn']:.0f} us; B/A paired {m['b_over_a']:.3f}")
    print(f"rest of the runtime (worker, agent host, Redis): A {m['a_rest_us_per_turn']:.0f} us CPU per turn, "
          f"B {m['b_rest_us_per_turn']:.0f} us; B/A paired {m['b_over_a_rest']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
