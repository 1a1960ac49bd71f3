"""The public REST API (FastAPI), with the invoke hot path as a thin Starlette route (``api.proxy``).

Resources, not verbs (DESIGN.md): sessions, their invoke/suspend/resume sub-resources, worker pools and
actor templates as the control plane sees them, ``/metrics``, ``/healthz``, ``/readyz``. Errors are JSON
``{"code","message"[,"details"]}`` with a stable code and the right status (see ``substrate.errors``).
"""

from __future__ import annotations

import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from api import proxy
from api.runtime import Runtime
from substrate import metrics
from substrate.errors import InvalidInput, PayloadTooLarge, SubstrateError
from substrate.models import SESSION_ID_RE, SessionRecord, SessionState
from substrate.settings import Settings, get_settings


_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_./]{0,61}[A-Za-z0-9])?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class CreateSession(BaseModel):
    """Body of ``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")
    actorTemplate: str = Field(..., description="name of an ActorTemplate")
    id: str | None = Field(None, description="client-chosen ID, [a-z0-9][a-z0-9-_.]{0,127}; generated if absent")
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the agent")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not _LABEL_KEY.match(k):
                raise ValueError(f"label key {k!r} must be 1-63 letters, digits, '-', '_', '.', '/'")
            if len(val) > 256:
                raise ValueError(f"label {k!r} value is over 256 characters")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENV_KEY.match(k):
                raise ValueError(f"env name {k!r} must look like A_NAME")
        return v


class ResumeSession(BaseModel):
    """Optional body of ``POST /v1/sessions/{id}/resume``."""

    model_config = ConfigDict(extra="forbid")
    worker: str | None = Field(None, description="place the activation on this worker only")


def session_view(rec: SessionRecord) -> dict[str, Any]:
    """The public shape of a session (env values are not echoed: they may hold secrets)."""
    out = rec.model_dump(mode="json", exclude={"env"})
    out["env"] = sorted(rec.env)
    return out


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


def _auth(request: Request) -> None:
    proxy.check_auth(_rt(request), request)


async def _body_limit(request: Request) -> None:
    cl = request.headers.get("content-length")
    limit = _rt(request).settings.api.max_body_bytes
    if cl and cl.isdigit() and int(cl) > limit:
        raise PayloadTooLarge(f"body of {cl} bytes is over the {limit}-byte limit")
    if len(await request.body()) > limit:  # a chunked body has no Content-Length to check up front
        raise PayloadTooLarge(f"body is over the {limit}-byte limit")


def _check_id(sid: str) -> str:
    if not SESSION_ID_RE.match(sid):
        raise InvalidInput(f"malformed session id {sid!r}: use [a-z0-9][a-z0-9-_.]{{0,127}}",
                           code="invalid_session_id")
    return sid


class RequestCounter:
    """Pure ASGI middleware: ``agent_substrate_requests_total{route, code}`` for every HTTP answer, with
    the matched route's template as ``route`` (never the raw path: bounded label values) and
    ``unmatched`` for paths no route serves."""

    def __init__(self, app: Any, routes: list[Any] | None = None) -> None:
        self.app = app
        #: routes to match when the router did not record one in the scope (plain Starlette routes)
        self.routes = routes if routes is not None else []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is None:
                route = next((r.path for r in self.routes if r.matches(scope)[0] == Match.FULL), "unmatched")
            metrics.REQUESTS_TOTAL.labels(route=route, code=str(status)).inc()


def create_app(settings: Settings | None = None, *, embedded: bool = True, runtime: Runtime | None = None) -> FastAPI:
    """Build the ASGI app. The runtime is built in the lifespan unless one is passed."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or await Runtime.build(settings, embedded=embedded)
        app.state.runtime = rt
        await rt.start()
        await rt.wait_ready()
        try:
            yield
        finally:
            await rt.stop()

    app = FastAPI(title="Agent session runtime", version="0.1.0", lifespan=lifespan,
                  description="Runs many bursty, stateful agent sessions on few warm workers.")
    app.add_middleware(RequestCounter, routes=app.router.routes)
    # the hot path: a plain Starlette route ahead of FastAPI's (no pydantic, no dependency injection)
    app.router.routes.insert(0, Route("/v1/sessions/{sid}/invoke", proxy.invoke, methods=["POST"]))

    @app.exception_handler(SubstrateError)
    async def _substrate_error(request: Request, e: SubstrateError) -> Response:
        metrics.ERRORS_TOTAL.labels(code=e.code).inc()
        return proxy.error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        if any(er.get("type") == "json_invalid" for er in e.errors()):
            return JSONResponse({"code": "bad_json", "message": "body is not valid JSON"}, status_code=400)
        errs = [{"loc": list(er.get("loc", ())), "msg": er.get("msg", "")} for er in e.errors()]
        msg = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in errs)
        return JSONResponse({"code": "invalid_input", "message": msg or "invalid request",
                             "details": {"errors": errs}}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return JSONResponse({"code": code, "message": str(e.detail)}, status_code=e.status_code)

    v1 = [Depends(_auth)]

    @app.post("/v1/sessions", status_code=201, dependencies=[*v1, Depends(_body_limit)], tags=["sessions"])
    async def create_session(body: CreateSession, request: Request) -> Response:
        """Create a session of an ActorTemplate on a free slot of a warm worker and start it."""
        rt = _rt(request)
        sid = _check_id(body.id) if body.id is not None else f"s-{uuid.uuid4().hex[:16]}"
        template = rt.catalog.template(body.actorTemplate)
        pool = rt.catalog.pool_for(template)
        now = time.time()
        rec = SessionRecord(id=sid, state=SessionState.PENDING, actorTemplate=template.name, pool=pool.name,
                            labels=body.labels, env=body.env, createdAt=now, updatedAt=now, lastActiveAt=now)
        rec = await rt.activator.create(rec, template)
        route = rt.activator.route_of(rec)
        if route is not None:
            rt.routes.put(sid, route)
        return JSONResponse(session_view(rec), status_code=201)  # skips FastAPI's generic encoder

    @app.get("/v1/sessions", dependencies=v1, tags=["sessions"])
    async def list_sessions(request: Request, state: SessionState | None = None,
                            template: str | None = None,
                            limit: int = Query(100, ge=1, le=1000),
                            continue_: str | None = Query(None, alias="continue")) -> dict[str, Any]:
        """List sessions (oldest first), filtered by ``state`` and ``template``; paginate with the
        ``metadata.continue`` token of the previous page."""
        offset = 0
        if continue_:
            if not continue_.isdigit() or len(continue_) > 15:
                raise InvalidInput("bad continue token", code="invalid_continue")
            offset = int(continue_)
        items, nxt = await _rt(request).directory.list_sessions(state=state, template=template, limit=limit,
                                                               offset=offset)
        return {"items": [session_view(r) for r in items],
                "metadata": {"continue": str(nxt) if nxt is not None else None}}

    @app.get("/v1/sessions/{sid}", dependencies=v1, tags=["sessions"])
    async def get_session(sid: str, request: Request) -> Response:
        """One session: state, template, worker, epoch, snapshot, restoredFrom ..."""
        return JSONResponse(session_view(await _rt(request).directory.get_session(_check_id(sid))))

    @app.delete("/v1/sessions/{sid}", status_code=204, dependencies=v1, tags=["sessions"])
    async def delete_session(sid: str, request: Request) -> Response:
        """End the session wherever it is and delete its record and snapshots."""
        rt = _rt(request)
        await rt.activator.delete(_check_id(sid), snapshot_gc=rt.snapshot_gc)
        rt.routes.drop(sid)
        return Response(status_code=204)

    @app.post("/v1/sessions/{sid}/suspend", status_code=202, dependencies=v1, tags=["sessions"])
    async def suspend_session(sid: str, request: Request) -> dict[str, Any]:
        """Snapshot the session and free its slot. Idempotent for a suspended session."""
        rt = _rt(request)
        rec = await rt.directory.get_session(_check_id(sid))
        if rec.state == SessionState.RUNNING:
            await rt.activator.suspend(rec)
            rt.routes.drop(sid)
            rec = await rt.directory.get_session(sid)
        elif rec.state not in (SessionState.SUSPENDED, SessionState.SUSPENDING):
            from substrate.errors import Conflict
            raise Conflict(f"session {sid!r} is {rec.state.value}; only a RUNNING session can be suspended",
                           code="invalid_state")
        return session_view(rec)

    @app.post("/v1/sessions/{sid}/resume", dependencies=v1, tags=["sessions"])
    async def resume_session(sid: str, request: Request, body: ResumeSession | None = None) -> dict[str, Any]:
        """Wake a suspended (or FAILED) session now instead of on its next request. ``worker`` pins the
        placement to one worker (like a Pod's ``nodeName``): 503 if it has no free slot."""
        rt = _rt(request)
        pin = body.worker if body else None
        if pin is not None and pin not in rt.view.workers:
            await rt.view.refresh()
            if pin not in rt.view.workers:
                raise InvalidInput(f"unknown worker {pin!r}", code="unknown_worker")
        route, _ = await rt.activator.wake(_check_id(sid), worker=pin)
        rt.routes.put(sid, route)
        return session_view(await rt.directory.get_session(sid))

    @app.get("/v1/workerpools", dependencies=v1, tags=["control plane"])
    async def list_pools(request: Request) -> dict[str, Any]:
        """WorkerPools with live status (replicas, readyReplicas, slots, freeSlots)."""
        rt = _rt(request)
        workers = await rt.directory.list_workers()
        items = []
        for pool in rt.catalog.pools.values():
            mine = [w for w in workers if w.pool == pool.name]
            ready = [w for w in mine if w.state.value == "READY" and w.leaseExpiresAt > time.time()]
            d = pool.model_dump(mode="json")
            d["status"].update(replicas=len(mine), readyReplicas=len(ready),
                               slots=sum(w.slots for w in ready), freeSlots=sum(w.freeSlots for w in ready),
                               observedGeneration=pool.metadata.generation)
            if rt.pools is not None:
                d["status"]["conditions"] = [c.model_dump() for c in rt.pools.conditions(pool.name)]
            items.append(d)
        return {"items": items}

    @app.get("/v1/actortemplates", dependencies=v1, tags=["control plane"])
    async def list_templates(request: Request) -> dict[str, Any]:
        """ActorTemplates the control plane knows."""
        return {"items": [t.model_dump(mode="json") for t in _rt(request).catalog.templates.values()]}

    @app.get("/v1/stats", dependencies=v1, tags=["control plane"])
    async def stats(request: Request) -> dict[str, Any]:
        """Runtime-wide figures for dashboards and the trace replay: workers, slots, sessions by state
        (from counters the transitions maintain, not a scan), and the cumulative cost integrals since
        the directory was created: ``workerSeconds``, ``slotSeconds`` (provisioned slots x time) and
        ``processSeconds`` (workers plus the zygote that forks them)."""
        rt = _rt(request)
        workers = await rt.directory.list_workers()
        s = await rt.directory.get_stats()
        return {"workers": len(workers), "slots": sum(w.slots for w in workers),
                "slotsUsed": sum(w.slots - w.freeSlots for w in workers),
                "sessions": await rt.directory.state_counts(),
                "workerSeconds": s.get("workerSeconds", 0.0), "slotSeconds": s.get("slotSeconds", 0.0),
                "processSeconds": s.get("processSeconds", 0.0), "parked": rt.activator.parked,
                "routeCacheEntries": len(rt.routes)}

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint() -> Response:
        payload, ctype = metrics.render_latest()
        return Response(payload, media_type=ctype)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """200 while the process serves."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz(request: Request) -> Response:
        """200 when Redis answers and a worker is ready; 503 otherwise."""
        rt = _rt(request)
        try:
            await rt.directory.ping()
        except SubstrateError as e:
            return proxy.error_response(e)
        from substrate.pool import desired_replicas

        ready = [w.pool for w in rt.view.workers.values() if w.state.value == "READY"]
        short = [p.name for p in rt.catalog.pools.values() if ready.count(p.name) < desired_replicas(p.spec, 0)]
        if short:  # a pool that may scale to zero is ready without workers
            return JSONResponse({"code": "no_workers", "message": f"pools without their ready workers: {short}"},
                                status_code=503)
        return JSONResponse({"status": "ready"})

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema["paths"]["/v1/sessions/{sid}/invoke"] = {"post": {
            "tags": ["sessions"], "summary": "Invoke a session (wakes it if suspended)",
            "description": "Body `{\"input\": ...}` -> 200 `{\"output\": ...}`. `?stream=true` answers "
                           "NDJSON lines `{\"chunk\": ...}` then `{\"done\": true}`. Headers "
                           "`X-Substrate-Woke: 1` and `X-Substrate-Wake-Ms` when the call woke the session.",
            "parameters": [{"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["input"], "properties": {"input": {}}}}}},
            "responses": {"200": {"description": "the agent's output"},
                          "404": {"description": "unknown session"}, "413": {"description": "body too large"},
                          "422": {"description": "bad input or agent error"},
                          "502": {"description": "worker died mid-request"},
                          "503": {"description": "no capacity / resume timeout (Retry-After)"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = _openapi  # type: ignore[method-assign]
    return app

