"""The router's own CPU per turn, in-process: ``python -m loadtest.hotpath_cost [-n TURNS] [--repeats R]``.

``make bench`` measures a whole router process under ``wrk`` on shared cores, where two runs of the same
code differ by 10-40 %; ``loadtest.router_ab`` pairs two checkouts to see a change through that noise.
This is the third, finer tool: it runs turns through the router's hot path **in this process** (the
ASGI app of ``api.app.create_app``: the front door, the request counter, ``api.proxy.invoke`` with the
route cache, the lease watch and the answer), with no HTTP server, no socket and no worker (a stand-in
for the lean client answers at once), so what it times is only the code the router adds to a turn. The
directory is a real Redis (``SUBSTRATE_REDIS_URL``, else an embedded one), read only at start.

Prints, per turn: the wall time (microseconds; the minimum and the median of ``repeats`` runs of
``turns`` turns each, on uvloop and with the collector set as a serving router sets it,
``substrate.gctune``), and the objects of cyclic garbage a turn leaves
(what only the cycle collector frees: ``gc.collect()`` after the turns with the collector off; every
such object costs a collector pass that walks it). What it leaves out: uvicorn's HTTP parsing and
writes, the lean client's request and answer, and every system call (``docs/bench``'s profiles put
those at about two thirds of a routed turn's CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
import uuid
from types import SimpleNamespace
from typing import Any

_BODY = b'{"input": "get"}'
_SID = "hotpath-1"


class _Cycle:
    """What the front door reads to know the body is in (``api.guard.body_arrived``)."""

    def __init__(self) -> None:
        self.message_event = SimpleNamespace(is_set=lambda: True)
        self.more_body = False

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": _BODY, "more_body": False}


def _scope() -> dict[str, Any]:
    path = f"/v1/sessions/{_SID}/invoke"
    return {"type": "http", "asgi": {"version": "3.0"}, "method": "POST", "path": path,
            "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"host", b"127.0.0.1:8080"), (b"user-agent", b"wrk"), (b"content-length", b"16"),
                        (b"content-type", b"application/json")],
            "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5555)}


async def measure(redis_url: str, *, turns: int = 20_000, repeats: int = 5) -> dict[str, float]:
    """Run ``repeats`` x ``turns`` turns (after 200 of warm-up) through the hot path of an app on the
    directory at ``redis_url`` (a key prefix of its own). Returns ``us_per_turn_min``,
    ``us_per_turn_median`` and ``cyclic_per_turn`` (see the module docstring). Raises
    ``AssertionError`` if a turn is not answered 200."""
    from api.app import create_app
    from api.runtime import Runtime
    from api.workerhttp import Answer, Headers
    from substrate.activator import Route
    from substrate.settings import Settings

    settings = Settings(redis={"url": redis_url, "key_prefix": f"hotpath{uuid.uuid4().hex[:8]}"})
    app = create_app(settings)
    rt = await Runtime.build(settings, embedded=False)
    try:
        await rt.signing.load()
        app.state.runtime = app.runtime = rt  # as the lifespan sets them
        address = "http://127.0.0.1:1"
        rt.view.workers = {"w1": SimpleNamespace(leaseExpiresAt=time.time() + 86400, address=address)}  # type: ignore[dict-item]
        rt.routes.put(_SID, Route("w1", address, 1, tenant="default"))

        async def answer(*_: Any) -> Answer:
            return Answer(200, Headers({"content-type": "application/json"}), b'{"output": {"count": 0}}')

        rt.worker_http.post = answer  # type: ignore[method-assign]
        statuses: list[int] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        async def run(n: int) -> None:
            for _ in range(n):
                await app(_scope(), _Cycle().receive, send)

        await run(200)
        from substrate.gctune import tune_after_startup

        thresholds = gc.get_threshold()
        tune_after_startup()  # the collector's settings of a serving router (``api.runtime``)
        try:
            gc.collect()
            gc.disable()
            try:
                await run(turns)
                cyclic = gc.collect()
            finally:
                gc.enable()
            times_us = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                await run(turns)
                times_us.append((time.perf_counter() - t0) / turns * 1e6)
        finally:  # this process's own settings back (a test runner's, say)
            gc.unfreeze()
            gc.set_threshold(*thresholds)
        if statuses != [200] * len(statuses):
            raise AssertionError(f"a turn was not answered 200: {sorted(set(statuses))}")
        return {"us_per_turn_min": min(times_us), "us_per_turn_median": statistics.median(times_us),
                "cyclic_per_turn": cyclic / turns}
    finally:
        watch = getattr(rt, "lease_watch", None)  # a checkout from before the watch (an A/B's baseline) has none
        if watch is not None:
            watch.close()
        await rt.http.close()
        await rt.client.close()
        await rt.directory.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.hotpath_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--turns", type=int, default=20_000, help="turns per run (default 20000)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    a = ap.parse_args(argv)
    if a.turns < 1 or a.repeats < 1:
        ap.error("--turns and --repeats must be at least 1")
    import uvloop

    embedded = None
    url = os.environ.get("SUBSTRATE_REDIS_URL")
    if not url:
        from substrate.embedded import EmbeddedRedis

        embedded = EmbeddedRedis(None)
        url = embedded.start()
    try:
        r = uvloop.run(measure(url, turns=a.turns, repeats=a.repeats))
    finally:
        if embedded is not None:
            embedded.stop()
    print(f"hot path, in-process: {r['us_per_turn_min']:.1f} us per turn (min of {a.repeats}), "
          f"{r['us_per_turn_median']:.1f} (median); cyclic garbage {r['cyclic_per_turn']:.2f} objects per turn")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
