"""A turn through the router's hot path leaves no reference cycles behind.

The per-turn lease watch of ``api.proxy._post`` (a ``call_later`` whose callback and the waiting
coroutine's frame referred to each other) left about ten objects of cyclic garbage per turn: the
collector then ran every few hundred turns and the in-process cost of a turn was about a third higher
(2026-12-07: 38 us against 27.5 us, ``docs/bench/2026-12-07-router-cpu-ab.md``). Reference counting
frees everything a turn makes now; this holds it so. The whole hot path runs in-process (the front
door, the request counter, ``invoke``, the route cache, the lease watch, the answer), with the worker's
answer given at once by a stand-in for the lean client; the directory is a real Redis."""

from __future__ import annotations

import gc
import time
import uuid
from types import SimpleNamespace
from typing import Any

from api.app import create_app
from api.runtime import Runtime
from api.workerhttp import Answer, Headers
from substrate.activator import Route
from substrate.settings import Settings

_BODY = b'{"input": "get"}'


class _Cycle:
    """What the front door reads to know the body is in (``api.guard.body_arrived``)."""

    def __init__(self) -> None:
        self.message_event = SimpleNamespace(is_set=lambda: True)
        self.more_body = False

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": _BODY, "more_body": False}


def _scope() -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "method": "POST", "path": "/v1/sessions/g1/invoke",
            "raw_path": b"/v1/sessions/g1/invoke", "root_path": "", "query_string": b"",
            "headers": [(b"host", b"127.0.0.1:8080"), (b"content-length", b"16"),
                        (b"content-type", b"application/json")],
            "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5555)}


async def test_turns_through_the_hot_path_leave_no_cyclic_garbage(redis_url: str) -> None:
    settings = Settings(redis={"url": redis_url, "key_prefix": f"hpg{uuid.uuid4().hex[:8]}"})
    app = create_app(settings)
    rt = await Runtime.build(settings, embedded=False)
    try:
        await rt.signing.load()
        app.state.runtime = rt
        address = "http://127.0.0.1:1"
        rt.view.workers = {"w1": SimpleNamespace(leaseExpiresAt=time.time() + 3600, address=address)}  # type: ignore[dict-item]
        rt.routes.put("g1", Route("w1", address, 1, tenant="default"))

        async def answer(*_: Any) -> Answer:
            return Answer(200, Headers({"content-type": "application/json"}), b'{"output": {"count": 0}}')

        rt.worker_http.post = answer  # type: ignore[method-assign]
        statuses: list[int] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        for _ in range(200):  # warm-up: caches, metrics' children, the lease watch's timer
            await app(_scope(), _Cycle().receive, send)
        gc.collect()
        gc.disable()
        try:
            for _ in range(2000):
                await app(_scope(), _Cycle().receive, send)
            cyclic = gc.collect()  # unreachable objects only the cycle collector could free
        finally:
            gc.enable()
        assert statuses == [200] * 2200
        assert cyclic < 200, f"{cyclic} objects of cyclic garbage in 2,000 turns (about {cyclic / 2000:.1f} a turn)"
    finally:
        rt.lease_watch.close()
        await rt.http.close()
        await rt.client.close()
        await rt.directory.close()
