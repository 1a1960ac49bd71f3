"""A bounded burst against a running runtime (loopback): ``n`` concurrent creates, then ``n`` concurrent
invokes of those sessions, recording every status and error code and sampling ``/v1/stats`` and
``/v1/workerpools`` every ``sample_s`` while it runs.

    uv run python -m loadtest.burst --url http://127.0.0.1:PORT --n 120 [--wake] [--out burst.json]

``--wake`` adds a wake burst: every session is suspended (``POST .../suspend``), the run waits until all
are SUSPENDED and the pool has at most ``--idle-workers`` workers (or ``--idle-wait-s`` passed), then
invokes all of them at once: ``n`` concurrent wakes from the object store onto a pool that must grow
(the fresh-user burst of issue 11).

Prints a JSON summary: counts of ``status code`` per phase, phase durations (s), per-request latency
p50/p99/max (ms, ``substrate.quantiles``; a request without an answer counts as infinite), the peak
worker count, the sessions the runtime suspended meanwhile by reason (``suspensions``, from
``agent_substrate_suspensions_total`` on ``/metrics``: ``pressure`` ones on a pool that could grow are
sessions suspended for the burst itself), the samples over time (workers, slots, slotsUsed, sessions by
state, parked), and the load average at start and end. Bounded: every request has a timeout
(``--timeout-s``), and the run makes ``2 n`` requests (``4 n`` with ``--wake``, plus the samples and the
state polls). Errors are counted, never retried, so the figures are what a client sees.

With API keys on, pass one (``--token``, default ``$SUBSTRATE_TOKEN``). Exit status: 0 if every create,
turn (and with ``--wake`` suspend and wake) succeeded, 1 otherwise (the summary is printed either way).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import re
import sys
import time
from typing import Any

import aiohttp

from substrate.quantiles import percentile


async def _one(http: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any] | None,
               took_ms: list[float] | None = None) -> tuple[str, Any]:
    """One request: (``"status"`` or ``"status code"`` or ``"client_error Name"``, the JSON body). Appends
    the latency (ms; ``inf`` without an answer or with a 5xx) to ``took_ms`` when given."""
    t = time.perf_counter()
    try:
        async with http.request(method, url, json=body) as r:
            data = await r.json(content_type=None)
            code = data.get("code") if isinstance(data, dict) and r.status >= 400 else None
            if took_ms is not None:
                took_ms.append((time.perf_counter() - t) * 1e3 if r.status < 500 else math.inf)
            return (f"{r.status} {code}" if code else str(r.status)), data
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if took_ms is not None:
            took_ms.append(math.inf)
        return f"client_error {type(e).__name__}", None


def _latency(took_ms: list[float]) -> dict[str, float | None]:
    """p50, p99 and max of ``took_ms`` (ms, rounded; ``inf`` when an error reached the quantile)."""
    out = {f"p{q}": percentile(took_ms, q) for q in (50, 99)}
    out["max"] = max(took_ms, default=None)
    return {k: (round(v, 1) if v is not None and math.isfinite(v) else v) for k, v in out.items()}


async def _wait_idle(http: aiohttp.ClientSession, url: str, sids: list[str], max_workers: int,
                     wait_s: float) -> dict[str, Any]:
    """Poll until every session in ``sids`` is SUSPENDED and the runtime runs at most ``max_workers``
    workers, or ``wait_s`` passed; returns what was seen last."""
    deadline = time.monotonic() + wait_s
    seen: dict[str, Any] = {}
    while True:
        states: collections.Counter[str] = collections.Counter()
        for sid in sids:
            _, d = await _one(http, "GET", f"{url}/v1/sessions/{sid}", None)
            states[d.get("state", "?") if isinstance(d, dict) else "?"] += 1
        _, stats = await _one(http, "GET", f"{url}/v1/stats", None)
        workers = stats.get("workers") if isinstance(stats, dict) else None
        seen = {"states": dict(states), "workers": workers}
        if (states.get("SUSPENDED", 0) == len(sids) and isinstance(workers, int) and workers <= max_workers) \
                or time.monotonic() >= deadline:
            return seen
        await asyncio.sleep(0.5)


_SUSPENSIONS = re.compile(r'^agent_substrate_suspensions_total\{([^}]*)\} ([0-9.e+]+)$', re.M)


def suspensions_by_reason(metrics_text: str) -> dict[str, float]:
    """``agent_substrate_suspensions_total`` of a Prometheus text exposition, summed by ``reason`` (a
    reason never counted is absent: the counter has no series until its first suspension)."""
    out: dict[str, float] = collections.defaultdict(float)
    for m in _SUSPENSIONS.finditer(metrics_text):
        reason = re.search(r'reason="([^"]*)"', m.group(1))
        out[reason.group(1) if reason else ""] += float(m.group(2))
    return dict(out)


async def _suspensions(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """:func:`suspensions_by_reason` of the runtime's ``/metrics`` ({} if it cannot be read)."""
    try:
        async with http.get(f"{url}/metrics") as r:
            return suspensions_by_reason(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


def failed(result: dict[str, Any]) -> bool:
    """True if any create, turn, suspend or wake of ``result`` (a ``run`` summary) did not succeed."""
    return any(not code.startswith("2") for phase in ("create", "invoke", "suspend", "wake")
               for code in result.get(phase, {}))


async def _sampler(http: aiohttp.ClientSession, url: str, t0: float, every_s: float,
                   out: list[dict[str, Any]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with http.get(f"{url}/v1/stats") as r:
                s = await r.json()
            async with http.get(f"{url}/v1/workerpools") as r:
                p = (await r.json())["items"][0]["status"]
            out.append({"t": round(time.monotonic() - t0, 2), "workers": s["workers"], "slots": s["slots"],
                        "slotsUsed": s["slotsUsed"], "parked": s["parked"],
                        "sessions": {k: v for k, v in s["sessions"].items() if v},
                        "readyReplicas": p.get("readyReplicas"), "freeSlots": p.get("freeSlots")})
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def run(url: str, n: int, template: str, timeout_s: float, sample_s: float, settle_s: float,
              *, wake: bool = False, idle_workers: int = 0, idle_wait_s: float = 60.0,
              token: str | None = None) -> dict[str, Any]:
    """The burst (see the module docstring); returns the summary. ``token``: sent as a bearer token."""
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    result: dict[str, Any] = {"n": n, "loadavg_start": os.getloadavg()}
    conn = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     headers=headers) as http:
        before = await _suspensions(http, url)
        sampler = asyncio.create_task(_sampler(http, url, t0, sample_s, samples, stop))
        ts = time.monotonic()
        created = await asyncio.gather(*(_one(http, "POST", f"{url}/v1/sessions", {"actorTemplate": template})
                                         for _ in range(n)))
        result["create_s"] = round(time.monotonic() - ts, 2)
        result["create"] = dict(collections.Counter(c for c, _ in created))
        sids = [d["id"] for c, d in created if c == "201"]
        if settle_s:
            await asyncio.sleep(settle_s)
        ts = time.monotonic()
        took: list[float] = []
        invoked = await asyncio.gather(*(_one(http, "POST", f"{url}/v1/sessions/{sid}/invoke",
                                              {"input": "increment"}, took) for sid in sids))
        result["invoke_s"] = round(time.monotonic() - ts, 2)
        result["invoke"] = dict(collections.Counter(c for c, _ in invoked))
        result["invoke_ms"] = _latency(took)
        if wake:
            suspended = await asyncio.gather(*(_one(http, "POST", f"{url}/v1/sessions/{sid}/suspend", None)
                                               for sid in sids))
            result["suspend"] = dict(collections.Counter(c for c, _ in suspended))
            result["idle"] = await _wait_idle(http, url, sids, idle_workers, idle_wait_s)
            ts = time.monotonic()
            took = []
            woken = await asyncio.gather(*(_one(http, "POST", f"{url}/v1/sessions/{sid}/invoke",
                                                {"input": "increment"}, took) for sid in sids))
            result["wake_s"] = round(time.monotonic() - ts, 2)
            result["wake"] = dict(collections.Counter(c for c, _ in woken))
            result["wake_ms"] = _latency(took)
            # the counter's state survived: the second increment of each session answers 2
            result["wake_state_lost"] = sum(1 for c, d in woken if c == "200" and isinstance(d, dict)
                                            and (d.get("output") or {}).get("count") not in (None, 2))
        await asyncio.sleep(2 * sample_s)
        stop.set()
        await sampler
        after = await _suspensions(http, url)
        result["suspensions"] = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
                                 if v - before.get(k, 0.0) > 0}
        for sid in sids:  # leave nothing behind
            try:
                async with http.delete(f"{url}/v1/sessions/{sid}"):
                    pass
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
    result["loadavg_end"] = os.getloadavg()
    result["peak_workers"] = max((x["workers"] for x in samples), default=None)
    result["samples"] = samples
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--url", required=True)
    ap.add_argument("--n", type=int, default=120)
    ap.add_argument("--template", default="counter")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=1.0)
    ap.add_argument("--settle-s", type=float, default=0.0, help="pause between creates and invokes")
    ap.add_argument("--wake", action="store_true", help="then suspend all and wake all at once")
    ap.add_argument("--idle-workers", type=int, default=0,
                    help="with --wake: wait until the pool runs at most this many workers")
    ap.add_argument("--idle-wait-s", type=float, default=60.0, help="with --wake: wait at most this long")
    ap.add_argument("--token", default=os.environ.get("SUBSTRATE_TOKEN"),
                    help="bearer token (an API key) when the runtime has keys; default $SUBSTRATE_TOKEN")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.n < 1 or a.n > 2000:
        ap.error("--n must be within 1..2000")
    res = asyncio.run(run(a.url.rstrip("/"), a.n, a.template, a.timeout_s, a.sample_s, a.settle_s,
                          wake=a.wake, idle_workers=a.idle_workers, idle_wait_s=a.idle_wait_s, token=a.token))
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    summary = {k: v for k, v in res.items() if k != "samples"}
    print(json.dumps(summary))
    for s in res["samples"]:
        print(json.dumps(s))
    sys.exit(1 if failed(res) else 0)


if __name__ == "__main__":
    main()
