"""The router's hot path: ``POST /v1/sessions/{id}/invoke`` as a thin Starlette endpoint.

Per request for a RUNNING session: zero Redis round trips when the process-local route cache holds the
session (DESIGN invariant 5: the cache entry carries the activation epoch and the worker rejects a stale
one with 409 / an unknown one with 404, which drops the entry and retries through the directory), plus
one proxied HTTP call over a pooled aiohttp ``ClientSession`` (measured 2-3x cheaper than httpx here).
Bodies stream back unchanged; the router never parses the worker's answer.

Retries (issue 8): every turn carries an idempotency key (the client's ``Idempotency-Key``, else the
request ID) and the worker keeps the answers of recent keys, so after any connection error (a stale
pooled keep-alive to a dead worker, a worker stopping, a crash before the answer) the router routes
again and resends the same turn with the same key: it is answered, never run twice. A cached route is
used only while its worker is within its lease, and a call in flight to a worker whose lease ran out
(frozen, partitioned) is abandoned and retried instead of waiting out the invoke timeout. A worker that
answers ``not_active`` for the record's current worker and epoch lost the activation: the record is
repaired (guarded by both) and the session woken again.

Tenancy (issue 10) adds no I/O here in the steady state: the caller is authenticated from a
process-local cache (``api.auth``), the cached route carries the session's tenant (another tenant's
session answers 404 exactly like a missing one, before anything is woken), and the per-activation token
presented to the worker is reused per (session, epoch, worker) for half its lifetime.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, AsyncIterator

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from substrate import audit, metrics
from substrate.activator import Route
from substrate.errors import (
    BadRequest,
    Conflict,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    StaleEpoch,
    SubstrateError,
    WorkerUnavailable,
)
from substrate.models import SESSION_ID_RE
from substrate.workerclient import IDEMPOTENCY_HEADER

if TYPE_CHECKING:
    from api.auth import Principal
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


async def authenticate(runtime: "Runtime", request: Request) -> "Principal":
    """The caller (see ``api.auth``); also sets the audit actor for everything this request causes."""
    principal = await runtime.auth.authenticate(request.headers)
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    request.state.request_id = rid
    request.state.principal = principal
    audit.actor.set(audit.Actor(principal.subject, principal.tenant, rid))
    return principal


#: invoke inputs nested deeper than this are refused (a worker or agent must never see them)
MAX_JSON_DEPTH = 64


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def _depth_ok(doc: Any, limit: int) -> bool:
    stack = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
    return True


def check_invoke_body(body: bytes) -> None:
    """Refuse an invoke body that is not ``{"input": ...}`` JSON, nests deeper than
    ``MAX_JSON_DEPTH``, or holds numbers Python cannot hold (over 4300 digits, overflowing floats,
    NaN/Infinity). Raises ``BadRequest`` (400 ``bad_json`` / ``missing_input``)."""
    try:
        doc = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        msg = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise BadRequest(f"body is not valid JSON: {msg}", code="bad_json") from None
    if not isinstance(doc, dict) or "input" not in doc:
        raise BadRequest("body must be a JSON object with an 'input' field", code="missing_input")
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and not _depth_ok(doc, MAX_JSON_DEPTH):
        raise BadRequest(f"body is nested deeper than {MAX_JSON_DEPTH} levels", code="bad_json")


async def invoke(request: Request) -> Response:
    """Proxy one turn to the session's worker, waking the session first if it is suspended."""
    runtime: Runtime = request.app.state.runtime
    sid = request.path_params["sid"]
    try:
        principal = await authenticate(runtime, request)
        if not SESSION_ID_RE.fullmatch(sid):
            raise InvalidInput(f"malformed session id {sid!r}", code="invalid_session_id")
        limit = runtime.settings.api.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isascii() and cl.isdigit() and int(cl) > limit:
            raise PayloadTooLarge(f"body of {cl} bytes is over the {limit}-byte limit")
        body = await request.body()
        if len(body) > limit:
            raise PayloadTooLarge(f"body of {len(body)} bytes is over the {limit}-byte limit")
        check_invoke_body(body)
        stream = request.query_params.get("stream") in ("1", "true")
        rid = request.state.request_id
        key = request.headers.get("idempotency-key") or rid
        if len(key) > 200:
            raise InvalidInput("Idempotency-Key is over 200 characters", code="invalid_idempotency_key")
        return await _forward(runtime, sid, body, stream, rid, key, principal)
    except SubstrateError as e:
        metrics.ERRORS_TOTAL.labels(code=e.code).inc()  # wake-path errors too (no_capacity, resume_timeout ...)
        return error_response(e)


class _LeaseLost(Exception):
    """The worker of a call in flight is past its lease (plus grace): it stopped serving."""


async def _post(runtime: "Runtime", route: Route, url: str, body: bytes, headers: dict[str, str]
                ) -> aiohttp.ClientResponse:
    """POST to the worker; raises ``_LeaseLost`` if the worker's lease runs out while we wait (a frozen
    worker would otherwise hold the request for the whole invoke timeout)."""
    task = asyncio.ensure_future(runtime.http.post(url, data=body, headers=headers))
    grace = runtime.settings.worker.lease_grace_s
    check_s = max(0.25, runtime.settings.api.worker_refresh_s)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=check_s)
            if done:
                return task.result()
            w = runtime.view.workers.get(route.worker)
            if w is None or w.leaseExpiresAt + grace < time.time():
                raise _LeaseLost(route.worker)
    finally:
        if not task.done():
            task.cancel()


async def _forward(runtime: "Runtime", sid: str, body: bytes, stream: bool, rid: str, key: str,
                   principal: "Principal") -> Response:
    cache = runtime.routes
    t_start = time.perf_counter()
    act = runtime.activator
    route = cache.get(sid)
    if route is not None and not principal.owns(route.tenant):
        raise NotFound(f"session {sid!r} not found", code="session_not_found")
    if route is not None and not runtime.view.leased(route.worker):
        cache.drop(sid)  # no cached route to a worker past its lease
        route = None
    woke_ms: float | None = None
    restored: str | None = None
    s = runtime.settings
    deadline = time.monotonic() + s.api.park_timeout_s + s.worker.lease_s + s.worker.lease_grace_s
    attempt = 0
    lost_workers: set[str] = set()  # workers that dropped this turn after it was sent
    while True:
        attempt += 1
        if attempt > 1 and (time.monotonic() > deadline or attempt > 12):
            raise WorkerUnavailable(f"session {sid!r} kept moving between workers; retry", code="session_moving",
                                    retry_after_s=s.api.retry_after_s)
        if route is None:
            t0 = time.perf_counter()
            try:
                route, woke = await act.wake(sid, tenant=None if principal.admin else principal.tenant)
            except (StaleEpoch, Conflict, WorkerUnavailable) as e:
                if e.code not in ("stale_epoch", "conflict", "worker_unavailable"):
                    raise
                # the session moved while it was being woken (a deadline roll, another router), or the
                # worker chosen for it died while restoring it: wake it again
                await asyncio.sleep(min(0.05 * attempt, 0.5))
                continue
            if woke:
                woke_ms = (time.perf_counter() - t0) * 1000
                restored = route.restored or restored
            cache.put(sid, route)
        url = f"{route.address}/v1/activations/{sid}/invoke" + ("?stream=1" if stream else "")
        headers = {**runtime.client.auth_headers(route.address, sid, route.epoch, route.tenant),
                   "Content-Type": "application/json", "X-Request-ID": rid, IDEMPOTENCY_HEADER: key}
        try:
            resp = await _post(runtime, route, url, body, headers)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, _LeaseLost) as e:
            # not answered (refused, reset, a stale keep-alive, the worker stopping or frozen): route again
            # and resend with the same key; the worker answers a turn it already ran from its cache.
            # Bounded: a turn that keeps losing its worker may be what kills it (fresh-user run: one
            # turn took down 11 workers in a row), so once more than max_lost_worker_retries distinct
            # workers dropped it after it was sent, it is answered 502.
            if not isinstance(e, aiohttp.ClientConnectorError):  # refused before sending: not this turn's doing
                lost_workers.add(route.worker)
            cache.drop(sid)
            if len(lost_workers) > s.api.max_lost_worker_retries:
                await act.check_worker(route.worker, sid=sid)
                raise WorkerUnavailable(
                    f"session {sid!r}: {len(lost_workers)} workers went away during this turn; not retried again "
                    "(the turn may be what stops it)", code="worker_unavailable", retry_after_s=s.api.retry_after_s)
            await act.check_worker(route.worker, sid=sid)
            route = None
            await asyncio.sleep(min(0.02 * attempt, 0.2))
            continue
        except TimeoutError as e:
            cache.drop(sid)
            raise WorkerUnavailable(f"worker {route.worker} did not answer within the invoke timeout",
                                    code="invoke_timeout") from e
        if resp.status in (404, 409, 503):
            try:
                err = json.loads(await resp.read() or b"{}")
            except (ValueError, aiohttp.ClientError):
                err = {}
            finally:
                resp.release()
            code = err.get("code") if isinstance(err, dict) else None
            if resp.status == 404 and code == "not_active":
                cache.drop(sid)
                await act.repair_lost_activation(sid, route.worker, route.epoch)
                route = None
                continue
            if resp.status == 409 and code in ("stale_epoch", "tenant_mismatch"):
                # a stale cache entry: an older epoch, or the ID was deleted and re-created by another
                # tenant; the directory decides (and answers 404 to a caller who does not own it)
                cache.drop(sid)
                route = None
                continue
            if resp.status == 503 and code == "worker_fenced":
                cache.drop(sid)
                route = None
                await asyncio.sleep(min(0.05 * attempt, 0.5))
                continue
            return Response(json.dumps(err), status_code=resp.status, headers={**_JSON, "X-Request-ID": rid})
        extra = {"X-Substrate-Worker": route.worker, "X-Substrate-Epoch": str(route.epoch), "X-Request-ID": rid}
        for h in ("X-Substrate-Restored", "X-Substrate-Replayed"):
            if h in resp.headers:
                extra[h] = resp.headers[h]
        if woke_ms is not None:
            extra["X-Substrate-Woke"] = "1"
            extra["X-Substrate-Wake-Ms"] = f"{woke_ms:.1f}"
            if restored:  # state since the last snapshot was lost: say so on the answer itself
                extra["X-Substrate-Restored"] = restored
        if stream and resp.status == 200:
            return StreamingResponse(_relay(resp), status_code=200, media_type="application/x-ndjson",
                                     headers=extra)
        try:
            data = await resp.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            cache.drop(sid)  # the answer was lost on the way: ask again with the same key
            await act.check_worker(route.worker, sid=sid)
            route = None
            continue
        finally:
            resp.release()
        if woke_ms is None:  # the hot path only: a wake is timed by the wake/resume histograms
            metrics.PROXY_DURATION_SECONDS.observe(time.perf_counter() - t_start)
        return Response(data, status_code=resp.status, headers={**_JSON, **extra})


async def _relay(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        yield b'{"error": {"code": "worker_unavailable", "message": "worker failed mid-stream"}}\n'
    finally:
        resp.release()
