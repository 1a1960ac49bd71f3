"""The router's hot path: ``POST /v1/sessions/{id}/invoke`` as a thin Starlette endpoint.

Per request for a RUNNING session: zero Redis round trips when the process-local route cache holds the
session (DESIGN invariant 5: the cache entry carries the activation epoch and the worker rejects a stale
one with 409 / an unknown one with 404, which drops the entry and retries through the directory), plus
one proxied HTTP call over a pooled aiohttp ``ClientSession`` (measured 2-3x cheaper than httpx here).
Bodies stream back unchanged; the router never parses the worker's answer.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, AsyncIterator

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from substrate import metrics
from substrate.activator import Route
from substrate.errors import InvalidInput, PayloadTooLarge, SubstrateError, Unauthorized, WorkerUnavailable
from substrate.models import SESSION_ID_RE
from substrate.workerclient import EPOCH_HEADER, TOKEN_HEADER

if TYPE_CHECKING:
    from api.runtime import Runtime

_JSON = {"Content-Type": "application/json"}


class RouteCache:
    """LRU map session id -> Route, bounded (``max_entries``)."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._d: OrderedDict[str, Route] = OrderedDict()
        self.max_entries = max_entries

    def get(self, sid: str) -> Route | None:
        r = self._d.get(sid)
        if r is not None:
            self._d.move_to_end(sid)
        return r

    def put(self, sid: str, route: Route) -> None:
        self._d[sid] = route
        self._d.move_to_end(sid)
        if len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def drop(self, sid: str) -> None:
        self._d.pop(sid, None)

    def __len__(self) -> int:
        return len(self._d)


def error_response(e: SubstrateError) -> Response:
    """Render an error as ``{"code","message"[,"details"]}`` JSON with its status and Retry-After."""
    import json

    headers = dict(_JSON)
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(round(e.retry_after_s))))
    return Response(json.dumps(e.to_dict()), status_code=e.status, headers=headers)


def check_auth(runtime: "Runtime", request: Request) -> None:
    token = runtime.settings.api.auth_token
    if token and request.headers.get("authorization") != f"Bearer {token}":
        raise Unauthorized("missing or wrong bearer token", code="unauthorized")


async def invoke(request: Request) -> Response:
    """Proxy one turn to the session's worker, waking the session first if it is suspended."""
    runtime: Runtime = request.app.state.runtime
    sid = request.path_params["sid"]
    try:
        check_auth(runtime, request)
        if not SESSION_ID_RE.match(sid):
            raise InvalidInput(f"malformed session id {sid!r}", code="invalid_session_id")
        limit = runtime.settings.api.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise PayloadTooLarge(f"body of {cl} bytes is over the {limit}-byte limit")
        body = await request.body()
        if len(body) > limit:
            raise PayloadTooLarge(f"body of {len(body)} bytes is over the {limit}-byte limit")
        stream = request.query_params.get("stream") in ("1", "true")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        return await _forward(runtime, sid, body, stream, rid)
    except SubstrateError as e:
        metrics.ERRORS_TOTAL.labels(code=e.code).inc()  # wake-path errors too (no_capacity, resume_timeout ...)
        return error_response(e)


async def _forward(runtime: "Runtime", sid: str, body: bytes, stream: bool, rid: str) -> Response:
    cache = runtime.routes
    t_start = time.perf_counter()
    route = cache.get(sid)
    woke_ms: float | None = None
    for _ in range(4):
        if route is None:
            t0 = time.perf_counter()
            route, woke = await runtime.activator.wake(sid)
            if woke:
                woke_ms = (time.perf_counter() - t0) * 1000
            cache.put(sid, route)
        url = f"{route.address}/v1/activations/{sid}/invoke" + ("?stream=1" if stream else "")
        headers = {EPOCH_HEADER: str(route.epoch), "Content-Type": "application/json",
                   TOKEN_HEADER: runtime.settings.worker.internal_token or "", "X-Request-ID": rid}
        try:
            resp = await runtime.http.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            # the request never reached the worker (it is gone): safe to route again
            cache.drop(sid)
            await runtime.activator.check_worker(route.worker)
            route = None
            continue
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            cache.drop(sid)
            await runtime.activator.check_worker(route.worker)
            raise WorkerUnavailable(f"worker {route.worker} failed during the request: "
                                    f"{e.__class__.__name__}; the session will resume from its last "
                                    "snapshot on the next request") from e
        if resp.status in (404, 409):  # not active there / stale epoch: the cache was stale
            resp.release()
            cache.drop(sid)
            route = None
            continue
        extra = {"X-Substrate-Worker": route.worker, "X-Substrate-Epoch": str(route.epoch), "X-Request-ID": rid}
        if woke_ms is not None:
            extra["X-Substrate-Woke"] = "1"
            extra["X-Substrate-Wake-Ms"] = f"{woke_ms:.1f}"
            if route.restored:  # state since the last snapshot was lost: say so on the answer itself
                extra["X-Substrate-Restored"] = route.restored
        if stream and resp.status == 200:
            return StreamingResponse(_relay(resp), status_code=200, media_type="application/x-ndjson",
                                     headers=extra)
        try:
            data = await resp.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            cache.drop(sid)
            await runtime.activator.check_worker(route.worker)
            raise WorkerUnavailable(f"worker {route.worker} failed while answering") from e
        finally:
            resp.release()
        if woke_ms is None:  # the hot path only: a wake is timed by the wake/resume histograms
            metrics.PROXY_DURATION_SECONDS.observe(time.perf_counter() - t_start)
        return Response(data, status_code=resp.status, headers={**_JSON, **extra})
    raise WorkerUnavailable(f"session {sid!r} kept moving between workers; retry", code="session_moving")


async def _relay(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        yield b'{"error": {"code": "worker_unavailable", "message": "worker failed mid-stream"}}\n'
    finally:
        resp.release()
