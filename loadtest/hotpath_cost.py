"""The router's own CPU per turn (or create), in-process: ``python -m loadtest.hotpath_cost [-n N] [--repeats R]
[--create]``.

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

With ``--create``, the same for a session's create and delete (``POST /v1/sessions``, ``DELETE
/v1/sessions/{id}``), one after the other, on a stand-in worker registered in the directory whose
activations start and end at once: what the control plane's own code and its Redis round trips cost a
create (``make bench``'s creation rows count the whole ``substrate up`` process instead, with its pool
controller, the agent starts and the worker calls). Prints the microseconds of this process's CPU per
create and per delete (median of ``repeats`` runs) and the Redis round trips each sends (a pipeline or a
script is one; the create's background step that makes its running place its own is counted with it).
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


async def _close(rt: Any) -> None:
    """Stop what ``Runtime.build`` started that the lifespan would stop: the lease watch's timer, the HTTP
    clients and the directory's connections; and remove the run's keys (its own prefix) from the Redis,
    which may be a shared one (each ``--create`` run left ~190 keys behind: deleted sessions' epochs)."""
    watch = getattr(rt, "lease_watch", None)  # a checkout from before the watch (an A/B's baseline) has none
    if watch is not None:
        watch.close()
    await rt.http.close()
    await rt.client.close()
    try:
        async for key in rt.directory.redis.scan_iter(f"{rt.directory.keys.prefix}:*", count=1000):
            await rt.directory.redis.delete(key)
    finally:
        await rt.directory.close()


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
        await _close(rt)


async def measure_create(redis_url: str, *, sessions: int = 500, repeats: int = 3,
                         key_prefix: str | None = None) -> dict[str, float]:
    """Create and delete ``sessions`` sessions one after the other, ``repeats`` times (after 50 of warm-up),
    through the ASGI app of ``api.app.create_app`` on the directory at ``redis_url`` (``key_prefix``, default
    a new one; its keys are removed at the end), with a stand-in worker (see the module docstring). Returns ``cpu_us_per_create`` and
    ``cpu_us_per_delete`` (this process's CPU, ``time.process_time``; median of the runs),
    ``round_trips_per_create`` and ``round_trips_per_delete`` (Redis commands sent, a pipeline as one).
    Raises ``AssertionError`` if a create is not answered 201 or a delete 204."""
    import json
    import tempfile
    from pathlib import Path

    from redis.asyncio.connection import AbstractConnection

    from api.app import create_app
    from api.runtime import Runtime
    from loadtest.bench import POOL
    from substrate.models import WorkerRecord
    from substrate.settings import Settings
    from substrate.specs import load_catalog

    with tempfile.TemporaryDirectory(prefix="create-cost-") as tmp:
        (Path(tmp) / "catalog.yaml").write_text(POOL % {"replicas": 1, "slots": 64})
        prefix = key_prefix or f"createcost{uuid.uuid4().hex[:8]}"
        settings = Settings(redis={"url": redis_url, "key_prefix": prefix},
                            snapshot={"local_dir": f"{tmp}/snapshots"})
        app = create_app(settings)
        rt = await Runtime.build(settings, embedded=False, catalog=load_catalog(tmp, log_warnings=False))
        sent = [0]
        send = AbstractConnection.send_packed_command

        async def counted(self: Any, *a: Any, **kw: Any) -> Any:
            sent[0] += 1
            return await send(self, *a, **kw)

        try:
            await rt.signing.load()
            app.state.runtime = app.runtime = rt  # as the lifespan sets them
            now = time.time()
            await rt.directory.register_worker(WorkerRecord(id="w1", pool="default", address="http://127.0.0.1:1",
                                                            slots=64, leaseExpiresAt=now + 86400, startedAt=now))
            await rt.view.refresh()

            async def activate(*_: Any, **__: Any) -> dict[str, Any]:
                return {}

            async def deactivate(*_: Any, **__: Any) -> None:
                return None

            rt.client.activate = activate  # type: ignore[method-assign]
            rt.client.deactivate = deactivate  # type: ignore[method-assign]

            async def call(method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
                scope = {"type": "http", "asgi": {"version": "3.0"}, "method": method, "path": path,
                         "raw_path": path.encode(), "root_path": "", "query_string": b"",
                         "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())],
                         "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8080),
                         "client": ("127.0.0.1", 5555)}
                status, chunks = [0], []

                async def receive() -> dict[str, Any]:
                    return {"type": "http.request", "body": body, "more_body": False}

                async def reply(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        status[0] = message["status"]
                    elif message["type"] == "http.response.body":
                        chunks.append(message.get("body", b""))

                await app(scope, receive, reply)
                return status[0], b"".join(chunks)

            async def run(n: int) -> tuple[float, float, int, int]:
                cpu_create = cpu_delete = 0.0
                trips_create = trips_delete = 0
                for _ in range(n):
                    c0, s0 = time.process_time(), sent[0]
                    st, body = await call("POST", "/v1/sessions", b'{"actorTemplate": "counter"}')
                    await asyncio.sleep(0)  # the create's background step (its running place made its own)
                    c1, s1 = time.process_time(), sent[0]
                    if st != 201:
                        raise AssertionError(f"create answered {st}: {body[:300]!r}")
                    st, body2 = await call("DELETE", f"/v1/sessions/{json.loads(body)['id']}")
                    if st != 204:
                        raise AssertionError(f"delete answered {st}: {body2[:300]!r}")
                    cpu_create += c1 - c0
                    cpu_delete += time.process_time() - c1
                    trips_create += s1 - s0
                    trips_delete += sent[0] - s1
                return cpu_create, cpu_delete, trips_create, trips_delete

            AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
            try:
                await run(50)
                runs = [await run(sessions) for _ in range(repeats)]
            finally:
                AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
            return {"cpu_us_per_create": statistics.median(r[0] for r in runs) / sessions * 1e6,
                    "cpu_us_per_delete": statistics.median(r[1] for r in runs) / sessions * 1e6,
                    "round_trips_per_create": runs[-1][2] / sessions,
                    "round_trips_per_delete": runs[-1][3] / sessions}
        finally:
            await _close(rt)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.hotpath_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--turns", type=int, default=None,
                    help="turns per run (default 20000), or sessions with --create (default 500)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    ap.add_argument("--create", action="store_true",
                    help="time a session's create and delete instead of a turn (-n: sessions per run, default 500)")
    a = ap.parse_args(argv)
    if a.turns is None:
        a.turns = 500 if a.create else 20_000
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
        if a.create:
            c = uvloop.run(measure_create(url, sessions=a.turns, repeats=a.repeats))
        else:
            r = uvloop.run(measure(url, turns=a.turns, repeats=a.repeats))
    finally:
        if embedded is not None:
            embedded.stop()
    if a.create:
        print(f"create and delete, in-process: {c['cpu_us_per_create']:.0f} us of CPU per create, "
              f"{c['cpu_us_per_delete']:.0f} per delete (median of {a.repeats}); Redis round trips "
              f"{c['round_trips_per_create']:.1f} per create, {c['round_trips_per_delete']:.1f} per delete")
        sys.stdout.flush()
        return
    print(f"hot path, in-process: {r['us_per_turn_min']:.1f} us per turn (min of {a.repeats}), "
          f"{r['us_per_turn_median']:.1f} (median); cyclic garbage {r['cyclic_per_turn']:.2f} objects per turn")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
