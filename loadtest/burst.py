"""A bounded burst against a running runtime (loopback): ``n`` concurrent creates, then ``n`` concurrent
invokes of those sessions, recording every status and error code and sampling ``/v1/stats`` and
``/v1/workerpools`` every ``sample_s`` while it runs.

    uv run python -m loadtest.burst --url http://127.0.0.1:PORT --n 120 [--out burst.json]

Prints a JSON summary: counts of ``status code`` per phase, phase durations (s), the samples over time
(workers, slots, slotsUsed, sessions by state, parked), and the load average at start and end.
Bounded: every request has a timeout (``--timeout-s``), and the run makes exactly ``2 n`` requests
(plus the samples). Errors are counted, never retried, so the figures are what a client sees.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import time
from typing import Any

import aiohttp


async def _one(http: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any]) -> tuple[str, Any]:
    try:
        async with http.request(method, url, json=body) as r:
            data = await r.json(content_type=None)
            code = data.get("code") if isinstance(data, dict) and r.status >= 400 else None
            return (f"{r.status} {code}" if code else str(r.status)), data
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"client_error {type(e).__name__}", None


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


async def run(url: str, n: int, template: str, timeout_s: float, sample_s: float, settle_s: float
              ) -> dict[str, Any]:
    """The burst (see the module docstring); returns the summary."""
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    result: dict[str, Any] = {"n": n, "loadavg_start": os.getloadavg()}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
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
        invoked = await asyncio.gather(*(_one(http, "POST", f"{url}/v1/sessions/{sid}/invoke",
                                              {"input": "increment"}) for sid in sids))
        result["invoke_s"] = round(time.monotonic() - ts, 2)
        result["invoke"] = dict(collections.Counter(c for c, _ in invoked))
        await asyncio.sleep(2 * sample_s)
        stop.set()
        await sampler
        for sid in sids:  # leave nothing behind
            try:
                async with http.delete(f"{url}/v1/sessions/{sid}"):
                    pass
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
    result["loadavg_end"] = os.getloadavg()
    result["samples"] = samples
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--n", type=int, default=120)
    ap.add_argument("--template", default="counter")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=1.0)
    ap.add_argument("--settle-s", type=float, default=0.0, help="pause between creates and invokes")
    ap.add_argument("--out")
    a = ap.parse_args()
    res = asyncio.run(run(a.url.rstrip("/"), a.n, a.template, a.timeout_s, a.sample_s, a.settle_s))
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    summary = {k: v for k, v in res.items() if k != "samples"}
    print(json.dumps(summary))
    for s in res["samples"]:
        print(json.dumps(s))


if __name__ == "__main__":
    main()
