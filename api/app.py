"""The public REST API (FastAPI), with the invoke hot path as a thin Starlette route (``api.proxy``).

Resources, not verbs (DESIGN.md): sessions, their invoke/suspend/resume sub-resources, worker pools and
actor templates as the control plane sees them, ``/metrics``, ``/healthz``, ``/readyz``. Errors are JSON
``{"code","message"[,"details"]}`` with a stable code and the right status (see ``substrate.errors``;
every code is listed in ``api.errors_doc`` and in the OpenAPI document's ``Error`` schema).

Tenancy (issue 10): every ``/v1`` call is authenticated (``api.auth``); a session belongs to the tenant
that created it and another tenant's session answers 404 ``session_not_found`` exactly like a missing
one, in every route; admins see all. Each state-changing call leaves one audit record (``substrate.audit``).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable, Iterable
from urllib.parse import unquote

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from api import proxy
from api.auth import Principal
from api.hotpath import INVOKE_PATH, SubstrateAPI, endpoint, runtime_of
from api.errors_doc import DEFAULT_STATUSES, ROUTE_STATUSES, openapi_error_schema, responses_for
from api.runtime import Runtime
from substrate import metrics
from substrate.serving import ANSWERED_BY_SERVER
from substrate.apikeys import check_tenant
from api.guard import CLIENT_GONE, Guard, encoded_slash, request_id_of
from substrate.envpolicy import check_session_env
from substrate.errors import BadRequest, Forbidden, InvalidInput, NotFound, PayloadTooLarge, SubstrateError, clip
from substrate.labelselector import LABEL_KEY_PATTERN, MAX_VALUE_CHARS, SelectorError, parse_selector
from substrate.listing import list_page
from substrate.loops import LagCounts
from substrate.models import LISTABLE_STATES, NAME_RE, SESSION_ID_HINT, SESSION_ID_RE, SessionRecord, SessionState
from substrate.settings import Settings, get_settings
from substrate.text import text_ok, unprintable

log = logging.getLogger(__name__)

#: a session's labels: at most ``MAX_LABELS``, each key ``_LABEL_KEY_RE`` (1-63 characters, as a Kubernetes
#: label's name), each value at most ``MAX_LABEL_VALUE_CHARS`` characters. ``CreateSession._labels``
#: checks them and the OpenAPI document states them (``LABELS_SCHEMA``)
MAX_LABELS = 64
MAX_LABEL_VALUE_CHARS = MAX_VALUE_CHARS  # a label selector names labels by the same rules
_LABEL_KEY_RE = LABEL_KEY_PATTERN
_LABEL_KEY = re.compile(rf"\A{_LABEL_KEY_RE}\Z")
LABELS_SCHEMA: dict[str, Any] = {
    "maxProperties": MAX_LABELS,
    "propertyNames": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": f"^{_LABEL_KEY_RE}$"},
    "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE_CHARS}}


#: a list's page size (``?limit=``): 1 to ``MAX_PAGE_LIMIT``, default ``DEFAULT_PAGE_LIMIT``
DEFAULT_PAGE_LIMIT = 100
MAX_PAGE_LIMIT = 1000
_DIGITS = re.compile(r"[0-9]{1,12}")


def _query_error(name: str, msg: str) -> InvalidInput:
    """422 ``invalid_input`` for query parameter ``name``, in the shape of FastAPI's and the guard's own
    (message ``query.NAME: msg``, ``details.errors[0].loc`` ``["query", NAME]``): a fresh-user run found
    ``?state=`` errors without the prefix and the details that ``?limit=`` errors carry."""
    return InvalidInput(f"query.{name}: {msg}", code="invalid_input",
                        details={"errors": [{"loc": ["query", name], "msg": msg}]})


def _plain_digits(v: Any) -> Any:
    """``?limit=`` as plain decimal digits only. Pydantic's lax int took ``1.0``, ``1e3``, `` 5`` and ``+5``
    (a fresh-user run: ``?limit=1.0`` listed a page of one), which no client means as a count; the range is
    the ``Query``'s ``ge``/``le``. Raises ``PydanticCustomError`` (FastAPI answers 422 ``invalid_input``
    naming ``query.limit``) for any other text or a number outside 1 to ``MAX_PAGE_LIMIT``."""
    if isinstance(v, str) and not _DIGITS.fullmatch(v):
        raise PydanticCustomError(
            "int_digits", "must be a whole number from 1 to {max} in plain decimal digits (no sign, decimal "
            "point, exponent or space): got {got}", {"max": MAX_PAGE_LIMIT, "got": clip(v)})
    # the range in the same words (pydantic's own said "Input should be greater than or equal to 1")
    if isinstance(v, str) and not 1 <= int(v) <= MAX_PAGE_LIMIT:
        raise PydanticCustomError("int_range", "must be a whole number from 1 to {max}: got {got}",
                                  {"max": MAX_PAGE_LIMIT, "got": clip(v)})
    return v


#: the ``limit`` query parameter of every paginated list (sessions, a session's events, events); the
#: validator sits in the ``Annotated`` with the ``Query`` (FastAPI drops it when the ``Query`` is the default)
PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT,
                                 description=f"page size, 1 to {MAX_PAGE_LIMIT} in plain decimal digits (`1.0`, "
                                             "`1e3`, `+5` are 422 `invalid_input`)"),
                      BeforeValidator(_plain_digits)]


class CreateSession(BaseModel):
    """Body of ``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")
    actorTemplate: str = Field(..., description="name of an ActorTemplate")
    id: str | None = Field(None, description="client-chosen ID, [a-z0-9][a-z0-9._-]{0,127}; generated if absent")
    labels: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=LABELS_SCHEMA,
        description=f"at most {MAX_LABELS} labels; a key is 1-63 letters, digits, '-', '_', '.' or '/', starting "
                    f"and ending with a letter or digit; a value is at most {MAX_LABEL_VALUE_CHARS} characters "
                    "(no control character, line or paragraph separator, bidi control or invisible character such "
                    "as U+200B); anything else is "
                    "422 `invalid_input`; `null` means none")
    env: dict[str, str] = Field(default_factory=dict,
                                description="extra environment for the agent; `null` means none")

    @field_validator("labels", "env", mode="before")
    @classmethod
    def _null_is_none(cls, v: Any) -> Any:
        """``null`` means no labels (no env), as a ``null`` ``id`` means none chosen: it was 422 "Input
        should be a valid dictionary" while ``"id": null`` was accepted (a fresh-user finding)."""
        return {} if v is None else v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} labels")
        for k, val in v.items():
            if not _LABEL_KEY.fullmatch(k):
                raise ValueError(f"label key {clip(k)} must be 1-63 letters, digits, '-', '_', '.', '/', starting "
                                 "and ending with a letter or digit")
            if len(val) > MAX_LABEL_VALUE_CHARS:
                raise ValueError(f"label {clip(k)} value is over {MAX_LABEL_VALUE_CHARS} characters")
            if not text_ok(val) or "\0" in val:
                raise ValueError(f"label {clip(k)} value is not valid Unicode text (lone surrogate or NUL)")
            if bad := unprintable(val):
                raise ValueError(f"label {clip(k)} value holds {bad}, which changes how text around it is shown "
                                 "(control characters, line or paragraph separators, bidi controls), or shows as nothing "
                                 "(zero width space and its kin)")
        return v

    @field_validator("actorTemplate", "id")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None and not text_ok(v):
            raise ValueError("not valid Unicode text (lone surrogate)")
        return v


class ResumeSession(BaseModel):
    """Optional body of ``POST /v1/sessions/{id}/resume``."""

    model_config = ConfigDict(extra="forbid")
    # an empty name is no worker's: bad input (it was 422 unknown_worker "unknown worker ''": tester 50)
    worker: str | None = Field(None, min_length=1, max_length=253,
                               description="place the activation on this worker only")

    @field_validator("worker")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None and not text_ok(v):
            raise ValueError("not valid Unicode text (lone surrogate)")
        return v


def session_view(rec: SessionRecord, rt: Runtime | None = None) -> dict[str, Any]:
    """The public shape of a session (env values are not echoed: they may hold secrets).
    ``sandboxed`` is false only when the session's template opts out of the per-session sandbox."""
    out = rec.model_dump(mode="json", exclude={"env", "carriedAnswers"})
    out["env"] = sorted(rec.env)
    if rt is not None:
        t = rt.catalog.templates.get(rec.actorTemplate)
        out["sandboxed"] = t.spec.isolation.sandbox if t is not None else True
    return out


def _guard_settings(scope: dict[str, Any], default: Settings) -> tuple[Settings, Any]:
    rt = runtime_of(scope.get("app"))
    return (rt.settings, rt.auth) if rt is not None else (default, None)


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


async def _auth(request: Request) -> None:
    await proxy.authenticate(_rt(request), request)


def _principal(request: Request) -> Principal:
    p: Principal = request.state.principal
    return p


async def _owned(rt: Runtime, sid: str, principal: Principal) -> SessionRecord:
    """The session if the caller may see it; 404 for a missing one and for another tenant's alike."""
    rec = await rt.directory.get_session(_check_id(sid))
    if not principal.owns(rec.tenant):
        raise NotFound(f"session {sid!r} not found", code="session_not_found")
    return rec


async def _audited(rt: Runtime, action: str, rec: SessionRecord, op: Any, *, reason: str = "",
                   early: bool = False, changed: Callable[[], bool] | None = None,
                   recorded: Callable[[], bool] | None = None) -> Any:
    """Run ``op()`` (a coroutine factory) and leave one audit record of its outcome (``reason``: as the
    automatic records of the same action say it, e.g. ``explicit`` for a suspend, the session's
    ``suspendReason``). ``early``: ``op`` is called as ``op(ok)`` and may await ``ok()`` to write the
    success record at the moment it succeeded (before its clean-up), which is then its only record.
    ``changed``: asked after a success; False (the call changed nothing, e.g. a suspend of a session
    already suspended) leaves no record: a record is of a transition, not of a call. ``recorded``: asked
    after a failure; True (what the call started records its own outcome, e.g. a resume's wake) leaves
    none either."""
    written = False

    async def ok() -> None:
        nonlocal written
        written = True
        await rt.audit.record(action, session=rec.id, tenant=rec.tenant, template=rec.actorTemplate,
                              worker=rec.worker, epoch=rec.epoch, gpus=_gpus(rt, rec), reason=reason)
    try:
        result = await (op(ok) if early else op())
        if written:
            return result
    except SubstrateError as e:
        if written or (recorded is not None and recorded()):
            raise
        # the code the client gets (a worker-internal ``busy`` is answered 409 ``conflict``): an audit
        # trail that says otherwise cannot be matched to the answer (fresh-user run)
        await rt.audit.record(action, session=rec.id, tenant=rec.tenant, template=rec.actorTemplate,
                              worker=rec.worker, epoch=rec.epoch, result=proxy.public_error(e).code,
                              gpus=_gpus(rt, rec), reason=reason)
        raise
    if changed is not None and not changed():
        return result
    after = result if isinstance(result, SessionRecord) else rec
    await rt.audit.record(action, session=rec.id, tenant=rec.tenant, template=rec.actorTemplate,
                          worker=after.worker or rec.worker, epoch=after.epoch, gpus=_gpus(rt, rec), reason=reason)
    return result


def _gpus(rt: Runtime, rec: SessionRecord) -> int:
    t = rt.catalog.templates.get(rec.actorTemplate)
    return t.spec.resources.gpus if t else 0


async def _body_limit(request: Request) -> None:
    cl = request.headers.get("content-length")
    limit = _rt(request).settings.api.max_body_bytes
    if cl and cl.isdigit() and int(cl) > limit:
        raise PayloadTooLarge(f"body of {cl} bytes is over the {limit}-byte limit")
    if len(await request.body()) > limit:  # a chunked body has no Content-Length to check up front
        raise PayloadTooLarge(f"body is over the {limit}-byte limit")


def _check_body(request: Request, body: bytes) -> None:
    """The body checks in order (the label, then the JSON): also run when FastAPI's own parse of a body
    failed first, so a compressed body is told 415 about its encoding, not 400 "not UTF-8"."""
    proxy.check_json_content_type(request.headers.get("content-type"), body,
                                  proxy.header_list(request.scope["headers"], b"content-encoding"))
    if body:
        proxy.check_json_keys(body)


async def _json_body(request: Request) -> None:
    """415 ``unsupported_media_type`` for a body not labelled JSON (see ``proxy.check_json_content_type``):
    FastAPI would not parse it as JSON and answer a 422 saying the body is not an object. Then 400
    ``bad_json`` for a body that is not UTF-8 JSON or repeats a key (``{"actorTemplate": "a",
    "actorTemplate": "b"}``: JSON parsers disagree on which one wins, so the request is ambiguous)."""
    _check_body(request, await request.body())


async def _no_body(request: Request) -> None:
    """For calls that take no body (suspend, delete): none, or JSON ``{}``/``null`` (what clients send by default).
    Anything else is refused before anything is done, so a client that meant to pass options learns that
    none are read: a body that is not JSON is 400 ``bad_json`` (or 415 by its label, as ``_json_body``),
    any other JSON value 422 ``invalid_input``."""
    body = await request.body()
    if not body.strip():
        return
    _check_body(request, body)
    value = json.loads(body)
    if value not in ({}, None):
        raise InvalidInput(f"this call takes no body (or {{}}): got {clip(body.decode('utf-8', 'replace'))}",
                           code="invalid_input")


async def _unexpected(request: Request, e: Exception) -> Response:
    """The answer to an error no code was made for: 500 ``internal`` in JSON like every error (Starlette
    answered a plain-text "Internal Server Error"), counted. The server still logs the traceback: the
    error is raised again after this answer is sent (Starlette's ``ServerErrorMiddleware``, outermost in
    FastAPI's stack; the invoke hot path's ``RequestCounter`` does the same, ``api.hotpath``)."""
    metrics.ERRORS_TOTAL.labels(code="internal").inc()
    return _error(500, "internal", f"an unexpected error ({e.__class__.__name__}); it is logged")


def _error(status: int, code: str, message: str, details: dict[str, Any] | None = None,
           headers: dict[str, str] | None = None) -> Response:
    """An error answer built here rather than raised, written as every error body is
    (``proxy.error_response``: ``substrate.errors.error_json``, compact JSON)."""
    e = SubstrateError(message, code=code, details=details)
    e.status = status
    resp = proxy.error_response(e)
    resp.headers.update(headers or {})
    return resp


#: the order of the methods in an ``Allow`` header
_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(routes: list[Any], scope: dict[str, Any]) -> str:
    """The ``Allow`` header of the request's path: the methods of every route serving it (one path can be
    served by several routes, e.g. GET and DELETE ``/v1/sessions/{sid}``), HEAD with GET, and OPTIONS."""
    return _allow(r.methods for r in routes
                  if isinstance(r, Route) and r.methods and r.matches(scope)[0] != Match.NONE)


def server_methods(routes: list[Any]) -> str:
    """The ``Allow`` header of ``OPTIONS *``: every method some route of ``routes`` takes, HEAD with GET,
    and OPTIONS, in ``_METHOD_ORDER``."""
    return _allow(r.methods for r in routes if isinstance(r, Route) and r.methods)


def _allow(method_sets: Iterable[set[str]]) -> str:
    """An ``Allow`` header of the union of ``method_sets``, OPTIONS, and HEAD with GET, in ``_METHOD_ORDER``."""
    methods = {"OPTIONS"}.union(*method_sets)
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join([m for m in _METHOD_ORDER if m in methods] + sorted(methods - set(_METHOD_ORDER)))


def _schema_routes(routes: list[Any]) -> list[Any]:
    """``routes`` as the OpenAPI document shows them: without the HEAD each GET route also answers
    (``create_app``), which would double every GET operation (under the same operation ID)."""
    out = []
    for r in routes:
        if isinstance(r, APIRoute) and "HEAD" in r.methods:
            r = copy.copy(r)
            r.methods = r.methods - {"HEAD"}
        out.append(r)
    return out


def _check_id(sid: str) -> str:
    if not SESSION_ID_RE.fullmatch(sid):
        raise InvalidInput(f"malformed session id {clip(sid)}: {SESSION_ID_HINT}",
                           code="invalid_session_id")
    return sid


class RequestCounter:
    """Pure ASGI middleware: ``agent_substrate_requests_total{route, code}`` for every HTTP answer, with
    the matched route's template as ``route`` (never the raw path: bounded label values) and
    ``unmatched`` for paths no route serves. Also puts the request's ID (``X-Request-ID``, the client's or
    the one the router made, see ``api.proxy.request_id``) on every answer of a call that got one, not only
    on invoke's, so a client can match any call to its audit record.

    With ``on_error`` (``(request, exception) -> response``) it also does what Starlette's
    ``ServerErrorMiddleware`` outside it would: an exception from the app before any answer began gets
    ``on_error``'s answer (sent as is, counted 500) and is raised again for the server to log. The
    invoke hot path (``api.hotpath``) uses that instead of one more middleware and one more ``send``
    wrapper per call."""

    def __init__(self, app: Any, routes: list[Any] | None = None,
                 on_error: Callable[[Request, Exception], Awaitable[Response]] | None = None) -> None:
        self.app = app
        #: routes to match when the router did not record one in the scope (plain Starlette routes)
        self.routes = routes if routes is not None else []
        self.on_error = on_error
        #: the counter of each (route, status) seen: ``labels()`` checks and locks on every call
        self._counters: dict[tuple[str, int], Any] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0  # no answer sent (yet)

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = request_id_of(scope)
                if rid:
                    headers = message.get("headers") or []
                    for k, _ in headers:  # a loop, not any() over a generator: once per answer
                        if k.lower() == b"x-request-id":
                            break
                    else:
                        message = {**message, "headers": [*headers, (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as e:
            if self.on_error is None or status:  # no handler, or half an answer: the server ends it
                raise
            answer = await self.on_error(Request(scope), e)
            await answer(scope, receive, send)  # counted 500 below: nothing was answered by the app
            raise
        finally:
            # the protocol answered (and counted) it itself: what the app sent was dropped
            if not scope.get(ANSWERED_BY_SERVER):
                self._count(scope, status)

    def _count(self, scope: dict[str, Any], status: int) -> None:
        """Count one answer of ``status`` under ``scope``'s route; ``status`` 0 (nothing answered) is 499
        when the client went away first (as nginx logs it; tester 37: a body cut short counted as a
        server error), else 500 (the app failed before it could answer)."""
        if not status:
            status = 499 if scope.get(CLIENT_GONE) else 500
        route = getattr(scope.get("route"), "path", None)
        if route is None:  # answered before routing (the front door), or a path no route serves
            route = self._match(scope)
        counter = self._counters.get((route, status))
        if counter is None:  # bounded: the routes' templates (and "unmatched") times the statuses sent
            counter = self._counters[(route, status)] = metrics.REQUESTS_TOTAL.labels(route=route, code=str(status))
        counter.inc()


    def _match(self, scope: dict[str, Any]) -> str:
        """The template of the route ``scope``'s path belongs to: one that takes it, else one whose path
        matches with another method (a 405 or an OPTIONS is that route's), else ``unmatched``. A segment
        sent with an encoded slash (``%2F``, refused by the front door: 422 for a session ID) counts as one
        segment, as it was sent, not as the two the decoded path has (they were all ``unmatched``)."""
        raw = scope.get("raw_path")
        if raw and encoded_slash(raw) is not None:
            sent = [b"_" if b"%2f" in seg.lower() else seg for seg in raw.split(b"/")]
            scope = {**scope, "path": unquote(b"/".join(sent).decode("latin-1"))}
        partial = None
        for r in self.routes:
            match = r.matches(scope)[0]
            if match == Match.FULL:
                return str(r.path)
            if match == Match.PARTIAL and partial is None:
                partial = str(r.path)
        return partial or "unmatched"


#: a request header of every /v1 operation (``api.proxy.request_id`` checks it), as the README describes it
REQUEST_ID_PARAM: dict[str, Any] = {
    "name": "X-Request-ID", "in": "header", "required": False,
    "description": "The request's ID, recorded in the audit trail (and, for invoke, the idempotency key when no "
                   "`Idempotency-Key` is sent): 1-128 visible ASCII characters (`!` to `~`), anything else is "
                   "422 `invalid_request_id`; absent or empty: the router makes one.",
    "schema": {"type": "string", "maxLength": 128, "pattern": "^[!-~]*$"}}

IDEMPOTENCY_KEY_PARAM: dict[str, Any] = {
    "name": "Idempotency-Key", "in": "header", "required": False,
    "description": "Anything unique per turn; makes the turn safe to retry: a retry with the same key is answered "
                   "again (`X-Substrate-Replayed: 1`), never run twice (the worker keeps the answers of the last "
                   "`SUBSTRATE_WORKER__IDEMPOTENCY_KEYS` keys per session, 64 by default: a retry after that many "
                   "later keyed turns runs again; a retry whose answer was too big to keep gets 410 `answer_not_kept`). "
                   "Without one, the `X-Request-ID` is the key. Printable ASCII; over 200 characters or any other byte: 422 "
                   "`invalid_idempotency_key`; used before for a turn with another body: 422 "
                   "`idempotency_key_reused`.",
    "schema": {"type": "string", "maxLength": 200, "pattern": "^[ -~]+$"}}

#: the SDK's and CLI's mark of a key they made up (not the caller's own): such keys make room first
KEY_ORIGIN_PARAM: dict[str, Any] = {
    "name": "X-Substrate-Key-Origin", "in": "header", "required": False,
    "description": "`auto`: the `Idempotency-Key` was made up by the client library for its own retries, not "
                   "chosen by the caller; the worker lets such keys give way first when it keeps no more "
                   "answers, so they never push a caller's own key out of its window. Any other value: 422 "
                   "`invalid_idempotency_key`.",
    "schema": {"type": "string", "enum": ["auto"]}}


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


#: the headers of invoke's answers (``api.proxy._forward``), as the README describes them
INVOKE_RESPONSE_HEADERS: dict[str, Any] = {
    "X-Substrate-Worker": _header("The worker that ran the turn."),
    "X-Substrate-Epoch": _header("The session's activation epoch (an integer) that ran the turn."),
    "X-Substrate-Woke": _header("`1` when this call found the session suspended and waited for its wake (concurrent "
                                "calls share one wake, and each says so)."),
    "X-Substrate-Wake-Ms": _header("With `X-Substrate-Woke`: how long the wake took, in milliseconds."),
    "Server-Timing": _header(
        "With `X-Substrate-Woke`: the wake's phases in W3C Server Timing form, e.g. "
        "`place;dur=1.2, activate;dur=21.7, sandbox;dur=0.1, restore;dur=15.2, recheck;dur=0.8, agent;dur=4.1, "
        "running;dur=0.9, wake;dur=24.0` (ms): `place` waited for and claimed a slot (a worker starting or a "
        "session suspended for room included), `activate` restored and started the agent, followed by its "
        "parts: the worker's `sandbox` (taking the slot's sandbox), `restore` (download and unpack), `recheck` "
        "(the claim still holds), `agent` (the agent's start), then `running` (the RUNNING write); `wake` is "
        "the whole wake (`X-Substrate-Wake-Ms`)."),
    "X-Substrate-Restored": _header(
        "The answer's state came back from a snapshot after a loss: `worker_lost` (an older snapshot after a "
        "crash; the session's `restoredFrom` says which), `worker_lost;snapshot=none` (the worker died before "
        "the session's first snapshot: its state restarted empty), `agent_restarted` (the agent process "
        "died: back from its last snapshot under a new epoch), `deadline`, `activation_lost`, "
        "`snapshot_corrupt` or `evicted` (slot pressure ended an activation whose own content refused its "
        "suspend), each with `;snapshot=none` when no snapshot came back."),
    "X-Substrate-Restored-Snapshot-At": _header(
        "With `X-Substrate-Restored`: the time (Unix s) the answer's state dates from; turns acknowledged "
        "after it are gone."),
    "X-Substrate-Replayed": _header("`1`: a retried turn (same `Idempotency-Key`) answered from its kept "
                                    "answer, not run again; its `X-Substrate-Restored` is that of the "
                                    "activation that ran the turn (none if it had lost nothing), its "
                                    "`X-Substrate-Epoch` the activation's that answered the retry."),
    "X-Request-ID": _header("The request's ID: the client's `X-Request-ID`, or the one the router made."),
}


def create_app(settings: Settings | None = None, *, embedded: bool = True, runtime: Runtime | None = None
               ) -> SubstrateAPI:
    """Build the ASGI app. The runtime is built in the lifespan unless one is passed."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or await Runtime.build(settings, embedded=embedded)
        app.state.runtime = rt
        app.runtime = rt  # the hot path's way to it (``runtime_of``)
        await rt.start()
        await rt.wait_ready()
        try:
            yield
        finally:
            await rt.stop()

    # redirect_slashes off: ``/v1/sessions/`` answered 307 with an empty body, and a client following it
    # turned ``DELETE /v1/sessions/`` into a call on the collection; it is 404 ``not_found`` now
    app = SubstrateAPI(title="Agent session runtime", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                       description="Runs many bursty, stateful agent sessions on few warm workers.")
    # the hot path: a plain Starlette route ahead of FastAPI's (no pydantic, no dependency injection),
    # registered for the OpenAPI document and 405's Allow; a turn is dispatched ahead of the whole stack
    # (api/hotpath.py) through the same RequestCounter and Guard
    route = Route(INVOKE_PATH, proxy.invoke, methods=["POST"])
    app.router.routes.insert(0, route)
    # authentication and the body size limit before any body is read (chunked bodies too): api/guard.py;
    # inside the request counter, so that its refusals are counted too (added last = outermost)
    app.add_middleware(Guard, get_settings=lambda scope: _guard_settings(scope, settings))
    app.add_middleware(RequestCounter, routes=app.router.routes)
    app.invoke_route = route
    app.hot_path = RequestCounter(Guard(endpoint(proxy.invoke), get_settings=lambda scope: _guard_settings(scope, settings)),
                                  routes=[route], on_error=_unexpected)

    @app.exception_handler(SubstrateError)
    async def _substrate_error(request: Request, e: SubstrateError) -> Response:
        metrics.ERRORS_TOTAL.labels(code=e.code).inc()
        return proxy.error_response(e)

    app.add_exception_handler(Exception, _unexpected)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        if any(er.get("type") == "json_invalid" for er in e.errors()):
            try:  # say what is wrong (json.loads's message), as on invoke
                _check_body(request, await request.body())
            except SubstrateError as bad:
                return proxy.error_response(bad)
            return _error(400, "bad_json", "body is not valid JSON")
        if request.method in ("POST", "PUT", "PATCH"):
            # what is not JSON is told as on invoke (400 bad_json) before what the JSON lacks (422):
            # FastAPI's parser takes NaN and Infinity and calls an empty body a missing field (fresh-user run)
            body = await request.body()
            try:
                _check_body(request, body)
            except SubstrateError as bad:
                return proxy.error_response(bad)
            if not body.strip() and any(tuple(er.get("loc", ())) == ("body",) for er in e.errors()):
                return _error(400, "bad_json", "the body is empty: send a JSON object")
        # loc holds client keys (a label's name): echoed clipped, like every input in a message
        errs = [{"loc": [p if isinstance(p, int) else clip(p, quote=False) for p in er.get("loc", ())],
                 "msg": clip(er.get("msg", ""), 300, quote=False)} for er in e.errors()]
        msg = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in errs)
        return _error(422, "invalid_input", msg or "invalid request", {"errors": errs})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 400 and "parsing the body" in str(e.detail):
            # FastAPI's answer to a body json.loads refused for other reasons than syntax (not UTF-8, a
            # number of over 4300 digits): say which, with the code every other bad body gets
            try:
                _check_body(request, await request.body())
            except SubstrateError as bad:
                return proxy.error_response(bad)
            return _error(400, "bad_json", "body is not valid JSON")
        if e.status_code == 405:
            # the path exists; the method is not one of its routes'. OPTIONS asks which ones are: 204 with
            # the Allow header (no CORS here: a preflight gets no Access-Control-* headers). A 405 carries
            # the same Allow header (RFC 9110 15.5.6), listing every route of the path, not the first one's
            allow = allowed_methods(app.router.routes, request.scope)
            if request.method == "OPTIONS":
                return Response(status_code=204, headers={"Allow": allow})
            return _error(405, "method_not_allowed", f"{request.method} is not allowed here: use {allow}",
                          headers={"Allow": allow})
        if e.status_code == 404 and request.method == "OPTIONS" and request.scope.get("path") == "*":
            # RFC 9110 9.3.7: ``OPTIONS *`` asks about the server, not one resource: the methods any of
            # its routes takes (it was 404 "no route for *": fresh-user tester 36)
            return Response(status_code=204, headers={"Allow": server_methods(app.router.routes)})
        code = {404: "not_found"}.get(e.status_code, "http_error")
        detail = str(e.detail)
        path = request.url.path
        if e.status_code == 404 and detail == "Not Found":
            detail = f"no route for {clip(path)}"
            if path.endswith("/") and len(path) > 1:  # routes take no trailing slash (nothing redirects)
                detail += f"; without the trailing slash: {clip(path.rstrip('/'))}"
        return _error(e.status_code, code, detail, headers=e.headers)

    v1 = [Depends(_auth)]

    @app.post("/v1/sessions", status_code=201, dependencies=[*v1, Depends(_body_limit), Depends(_json_body)],
              tags=["sessions"])
    async def create_session(body: CreateSession, request: Request,
                             tenant: str | None = Query(None, description="admins: create the session for this "
                                                        "tenant (its quotas apply); others: only their own")
                             ) -> Response:
        """Create a session of an ActorTemplate on a free slot of a warm worker and start it. An admin's
        ``tenant=`` makes the session that tenant's (403 ``forbidden`` for anyone else naming another
        tenant, 422 ``invalid_tenant`` for no tenant name), checked before anything is taken."""
        rt = _rt(request)
        owner = _tenant_scope(request, tenant, verb="create") or _principal(request).tenant
        sid = _check_id(body.id) if body.id is not None else f"s-{uuid.uuid4().hex[:16]}"
        template = rt.catalog.template(body.actorTemplate)
        if not (template.spec.entrypoint or template.spec.command):
            # refused before a slot is claimed (the worker's own refusal came after placement, as an
            # internal code: fresh-user run with a seed's container-only template)
            raise BadRequest(f"template {template.name!r} has only spec.container: workers here run an agent's "
                             "spec.entrypoint (module:Class) or spec.command; add one", code="unsupported_template")
        env = check_session_env(body.env, [e.name for e in template.spec.env])
        pool = rt.catalog.pool_for(template)
        now = time.time()
        rec = SessionRecord(id=sid, state=SessionState.PENDING, actorTemplate=template.name, pool=pool.name,
                            tenant=owner, labels=body.labels, env=env,
                            createdAt=now, updatedAt=now, lastActiveAt=now)
        gpus = template.spec.resources.gpus
        try:
            rec = await rt.activator.create(rec, template)
        except SubstrateError as e:
            if e.code != "session_exists":  # that ID is someone else's session: not this one's record
                await rt.audit.record("create", session=sid, tenant=rec.tenant, template=template.name,
                                      result=e.code, gpus=gpus)
            raise
        await rt.audit.record("create", session=sid, tenant=rec.tenant, template=template.name,
                              worker=rec.worker, epoch=rec.epoch, gpus=gpus)
        route = rt.activator.route_of(rec)
        if route is not None:
            rt.routes.put(sid, route)
        return JSONResponse(session_view(rec, rt), status_code=201)  # skips FastAPI's generic encoder

    def _tenant_scope(request: Request, tenant: str | None, *, verb: str = "read") -> str | None:
        """The tenant whose data a call reads: the caller's own; an admin's choice (None = all). A
        ``tenant`` that is no valid tenant name (also an empty ``tenant=``) is 422 ``invalid_tenant``, by the
        rule API keys are made with: it could only ever match nothing."""
        if tenant is not None:
            check_tenant(tenant)
        p = _principal(request)
        if tenant is not None and not p.admin and tenant != p.tenant:
            raise Forbidden(f"only an admin may {verb} another tenant's "
                            + ("data" if verb == "read" else "sessions"), code="forbidden")
        return tenant if p.admin else p.tenant

    @app.get("/v1/sessions", dependencies=v1, tags=["sessions"])
    async def list_sessions(request: Request,
                            state: str | None = Query(None, description="one state (upper case)",
                                                      json_schema_extra={"enum": [s.value for s in LISTABLE_STATES]}),
                            template: str | None = None,
                            limit: PageLimit = DEFAULT_PAGE_LIMIT,
                            continue_: str | None = Query(None, alias="continue"),
                            tenant: str | None = Query(None, description="admins: one tenant's sessions"),
                            label_selector: str | None = Query(
                                None, alias="labelSelector",
                                description="only sessions whose labels match this Kubernetes-style selector: "
                                            "requirements joined by commas (AND), each `key=value` (or "
                                            "`key==value`), `key!=value` (a session without the label matches), "
                                            "`key` (has the label), `!key` (has not), `key in (v1,v2)` or "
                                            "`key notin (v1,v2)`; a value has no whitespace, `,`, `(`, `)`, `=` "
                                            "or `!`; empty selects every session; anything else is 422 "
                                            "`invalid_input`")
                            ) -> dict[str, Any]:
        """List the caller's sessions (oldest first; admins: every tenant's, or ``tenant``'s), filtered by
        ``state``, ``template`` and ``labelSelector``; paginate with the ``metadata.continue`` token of the
        previous page (a keyset cursor: deleting sessions between pages skips or repeats none). A page of a
        filtered list may hold fewer than ``limit`` items, even none, with a ``continue`` token still: only
        a null token means the end."""
        rt = _rt(request)
        scope = _tenant_scope(request, tenant)
        try:
            selector = parse_selector(label_selector) if label_selector is not None else None
        except SelectorError as e:
            raise _query_error("labelSelector", str(e)) from None
        if template is not None and not NAME_RE.fullmatch(template):
            # no template can have such a name: say so instead of an empty list (a removed template's
            # sessions stay listable by its name, so unknown names are not refused)
            raise _query_error("template", f"{clip(template)} is no ActorTemplate name (lower-case letters, "
                               "digits, '-' and '.', at most 253)")
        if state == SessionState.DELETED.value:
            raise _query_error("state", "DELETED lists nothing: a deleted session is gone (its audit records "
                               "stay in /v1/events)")
        # checked here, not by FastAPI's enum: its message offered DELETED, which a listing never shows
        if state is not None and state not in {s.value for s in LISTABLE_STATES}:
            raise _query_error("state", f"{clip(state)} is no state a listing shows: one of "
                               f"{', '.join(s.value for s in LISTABLE_STATES)}")
        keys = rt.directory.keys
        index = keys.sessions_index if scope is None else keys.tenant_sessions(scope)
        items, nxt = await list_page(rt.directory.redis, keys, index, limit=limit, cursor=continue_,
                                     state=SessionState(state) if state else None, template=template,
                                     tenant=scope, selector=selector)
        return {"items": [session_view(r, rt) for r in items], "metadata": {"continue": nxt}}

    @app.get("/v1/sessions/{sid}", dependencies=v1, tags=["sessions"])
    async def get_session(sid: str, request: Request) -> Response:
        """One session: state, template, tenant, worker, epoch, snapshot, restoredFrom ..."""
        return JSONResponse(session_view(await _owned(_rt(request), sid, _principal(request)), _rt(request)))

    @app.delete("/v1/sessions/{sid}", status_code=204, dependencies=[*v1, Depends(_no_body)], tags=["sessions"])
    async def delete_session(sid: str, request: Request) -> Response:
        """End the session wherever it is and delete its record and snapshots. Not idempotent: a session
        already deleted is 404 ``session_not_found``, and of concurrent DELETEs exactly one answers 204."""
        rt = _rt(request)
        p = _principal(request)
        read: SessionRecord | None = None  # the record read here, not read again by the delete
        try:
            rec = read = await _owned(rt, sid, p)
        except NotFound:
            # a delete under way (another DELETE won): this one loses like one that read the record
            # just before, below (404 after the winner's record, with its own); it answered at once and
            # left no record (fresh-user round 9, 4 of 4 runs)
            rec_ = await rt.directory.get_deleting(sid)
            if rec_ is None or not p.owns(rec_.tenant):
                raise
            # the delete's compare-and-set bumped the epoch: recorded with the one the session had, as
            # the winner's record and the other losers' are (fresh-user round 10: epoch 2 of a session
            # that only ever had 1)
            rec = rec_.model_copy(update={"epoch": max(0, rec_.epoch - 1)})
        # the record is written when the session has ended, before its record goes: a concurrent DELETE
        # that lost answers (and records) 404 only after that (``Activator.delete``)
        await _audited(rt, "delete", rec, lambda ok: rt.activator.delete(sid, snapshot_gc=rt.snapshot_gc,
                                                                         before_removal=ok, read=read),
                       early=True)
        rt.routes.drop(sid)
        return Response(status_code=204)

    @app.post("/v1/sessions/{sid}/suspend", status_code=202, dependencies=[*v1, Depends(_no_body)],
              tags=["sessions"])
    async def suspend_session(sid: str, request: Request) -> dict[str, Any]:
        """Snapshot the session and free its slot. Idempotent for a suspended session. A 202 always
        names state SUSPENDED and the snapshot the suspend committed; a suspend that meets one under way
        waits for it; one that meets a concurrent resume is 409 ``conflict`` (``Activator.suspend_explicit``)."""
        rt = _rt(request)
        rec = await _owned(rt, sid, _principal(request))
        committed: list[bool] = []  # this call's own suspend committed (not one it found done or joined)

        async def op() -> SessionRecord:
            try:
                return await rt.activator.suspend_explicit(rec, on_committed=lambda: committed.append(True))
            finally:
                if rec.state == SessionState.RUNNING:  # the route read may name a gone activation now
                    rt.routes.drop(sid)
        return session_view(await _audited(rt, "suspend", rec, op, reason="explicit",
                                           changed=lambda: bool(committed)), rt)

    @app.post("/v1/sessions/{sid}/resume", dependencies=[*v1, Depends(_json_body)], tags=["sessions"])
    async def resume_session(sid: str, request: Request, body: ResumeSession | None = None) -> dict[str, Any]:
        """Wake a suspended (or FAILED) session now instead of on its next request. ``worker`` pins the
        placement to one worker (like a Pod's ``nodeName``): 503 if it has no free slot. A worker that dies
        while restoring the session is replaced by another, as on invoke, unless ``worker`` pins it (502). A
        concurrent suspend that takes the session right after this call woke it: 409 ``conflict`` with
        ``details.state`` (``Activator.resume_explicit``)."""
        rt = _rt(request)
        p = _principal(request)
        rec = await _owned(rt, sid, p)
        pin = body.worker if body else None
        if pin is not None and pin not in rt.view.workers:
            await rt.view.refresh()
            if pin not in rt.view.workers:
                raise InvalidInput(f"unknown worker {clip(pin)}", code="unknown_worker")

        started: list[bool] = []  # this call started a wake (not found it running, nor joined one)

        async def op() -> SessionRecord:
            # woken again if the worker chosen for it dies while restoring it, as an invoke's wake is
            route, cur = await rt.activator.resume_explicit(sid, worker=pin, tenant=None if p.admin else p.tenant,
                                                            on_started=lambda: started.append(True))
            rt.routes.put(sid, route)
            return cur
        # a wake this call started records itself with its own outcome when it ends, also after this
        # call's wait ended (resume_timeout): this call records only what no wake of its own did
        return session_view(await _audited(rt, "resume", rec, op, changed=lambda: False,
                                           recorded=lambda: bool(started)), rt)

    @app.get("/v1/sessions/{sid}/events", dependencies=v1, tags=["audit"])
    async def session_events(sid: str, request: Request, limit: PageLimit = DEFAULT_PAGE_LIMIT,
                             continue_: str | None = Query(None, alias="continue")) -> dict[str, Any]:
        """The session's audit records, oldest first (also after it was deleted, for
        ``audit.deleted_retention_s``); paginate with ``metadata.continue``."""
        rt = _rt(request)
        p = _principal(request)
        try:
            await _owned(rt, sid, p)
            owned = True
        except NotFound as e:
            owned, missing = False, e
        # only the caller's tenant's records: an ID one tenant deleted may now be another's session
        items, nxt = await rt.audit.session_events(sid, after=continue_, limit=limit,
                                                   tenant=None if p.admin else p.tenant)
        if not owned and not items:  # neither a live session of the caller's nor a deleted one's trail
            raise missing
        return {"items": items, "metadata": {"continue": nxt}}

    @app.get("/v1/events", dependencies=v1, tags=["audit"])
    async def tenant_events(request: Request, tenant: str | None = Query(None, description="admins: whose"),
                            limit: PageLimit = DEFAULT_PAGE_LIMIT,
                            continue_: str | None = Query(None, alias="continue")) -> dict[str, Any]:
        """The caller's tenant's audit records (admins: ``tenant``'s, default their own), oldest first."""
        rt = _rt(request)
        scope = _tenant_scope(request, tenant) or _principal(request).tenant
        items, nxt = await rt.audit.tenant_events(scope, after=continue_, limit=limit)
        return {"items": items, "metadata": {"continue": nxt}}

    @app.get("/v1/workerpools", dependencies=v1, tags=["control plane"])
    async def list_pools(request: Request) -> dict[str, Any]:
        """WorkerPools with live status (replicas, readyReplicas, slots, freeSlots = availableSlots: free slots
        on READY workers, the same field the Kubernetes status carries). The live status is for admins and
        the open-mode caller (``Principal.sees_fleet``); an ordinary tenant gets each pool's spec without
        ``replicas`` (which the autoscaler sets) and ``status.observedGeneration`` only: capacity and load
        say what other tenants run (as ``/v1/stats``)."""
        rt = _rt(request)
        if not _principal(request).sees_fleet:
            items = []
            for pool in rt.catalog.pools.values():
                d = pool.model_dump(mode="json")
                d["spec"].pop("replicas", None)  # the autoscaler's live choice, not configuration
                d["status"] = {"observedGeneration": pool.metadata.generation}
                items.append(d)
            return {"items": items}
        workers = await rt.directory.list_workers()
        items = []
        for pool in rt.catalog.pools.values():
            mine = [w for w in workers if w.pool == pool.name]
            ready = [w for w in mine if w.state.value == "READY" and w.leaseExpiresAt > time.time()]
            d = pool.model_dump(mode="json")
            d["status"].update(replicas=len(mine), readyReplicas=len(ready),
                               slots=sum(w.slots for w in ready), freeSlots=sum(w.freeSlots for w in ready),
                               availableSlots=sum(w.freeSlots for w in ready),
                               observedGeneration=pool.metadata.generation)
            if rt.pools is not None:
                d["status"]["conditions"] = [c.model_dump() for c in rt.pools.conditions(pool.name, ready=len(ready))]
            items.append(d)
        return {"items": items}

    @app.get("/v1/actortemplates", dependencies=v1, tags=["control plane"])
    async def list_templates(request: Request) -> dict[str, Any]:
        """ActorTemplates the control plane knows."""
        return {"items": [t.model_dump(mode="json") for t in _rt(request).catalog.templates.values()]}

    @app.get("/v1/stats", dependencies=v1, tags=["control plane"])
    async def stats(request: Request, tenant: str | None = Query(None, description="admins: one tenant's")
                    ) -> dict[str, Any]:
        """The caller's sessions by state and quota usage (admins: every tenant's sessions, or
        ``tenant``'s), plus, for admins and the open-mode caller only (``Principal.sees_fleet``), the
        fleet's figures for dashboards and the trace replay: workers, slots, the cumulative cost integrals
        since the directory was created (``workerSeconds``, ``slotSeconds`` = provisioned slots x time,
        ``processSeconds`` = workers plus the zygote), the workers' event-loop lag probes (``workerLoopLag``:
        how many, and how many were late by over 5, 10, 25 ms), and this router's parked requests and route
        cache.
        An ordinary tenant's answer has only ``sessions``, ``tenant`` and ``quota``: the fleet's capacity
        and load say what other tenants run. Sessions by state come from counters the transitions
        maintain, runtime-wide and per tenant (O(states)); a tenant's from its own index (O(its sessions))
        only while its counters do not add up to its index (a drift the repair pass corrects)."""
        rt = _rt(request)
        p = _principal(request)
        scope = _tenant_scope(request, tenant)
        keys = rt.directory.keys
        by_state: dict[str, int] | None = None
        if scope is None:
            by_state = await rt.directory.state_counts()
        else:
            # the tenant's own counters, moved by the transitions like the runtime-wide ones: O(states),
            # trusted when they add up to its index's size (read in the same round trip). Reading its index
            # took 200 ms at 2,109 sessions, linear (a fresh-user run)
            by_state = await rt.directory.tenant_counts_checked(scope)
            if by_state is None:
                # drifted, or counters that a runtime before them never kept (the repair pass fills them
                # in): a tenant that holds every session (open mode's ``default``) is counted by the
                # runtime-wide counters when its index holds as many sessions as they count
                counts = await rt.directory.state_counts()
                if sum(counts.values()) == await rt.directory.tenant_session_count(scope):
                    by_state = counts
        if by_state is None:
            by_state = {s.value: 0 for s in SessionState if s != SessionState.DELETED}
            cursor: str | None = None
            while True:
                page, cursor = await list_page(rt.directory.redis, keys, keys.tenant_sessions(scope), limit=1000,
                                               cursor=cursor, tenant=scope)
                for r in page:
                    by_state[r.state.value] = by_state.get(r.state.value, 0) + 1
                if cursor is None:
                    break
        usage = await rt.quotas.usage(scope or p.tenant)
        out: dict[str, Any] = {
            "sessions": by_state, "tenant": scope,
            "quota": {"tenant": scope or p.tenant, "running": usage.running, "total": usage.total,
                      "gpus": usage.gpus,
                      "limits": rt.quotas.limits_of(scope or p.tenant).model_dump(exclude_none=True)}}
        if not p.sees_fleet:
            return out
        workers = await rt.directory.list_workers()
        s = await rt.directory.get_stats()
        return {"workers": len(workers), "slots": sum(w.slots for w in workers),
                "slotsUsed": sum(w.slots - w.freeSlots for w in workers),
                "workerSeconds": s.get("workerSeconds", 0.0), "slotSeconds": s.get("slotSeconds", 0.0),
                "processSeconds": s.get("processSeconds", 0.0), "parked": rt.activator.parked,
                # the workers' event-loop lag probes since the directory was created (substrate.loops.LagCounts)
                "workerLoopLag": LagCounts.totals(s),
                "routeCacheEntries": len(rt.routes), **out}

    def _fleet_only(request: Request, what: str) -> None:
        if not _principal(request).sees_fleet:
            raise Forbidden(f"only an admin may {what}", code="forbidden")

    @app.get("/v1/snapshotstore", dependencies=v1, tags=["control plane"])
    async def snapshot_store(request: Request) -> dict[str, Any]:
        """The snapshot store as this process finds it: ``location``, ``reachable`` (its marker could be
        read just now), ``error`` (why not, else null), ``verified`` (its marker is this directory's),
        ``fenced`` (why suspends and wakes that read a snapshot answer 503 ``snapshot_store_unavailable``;
        null when it serves). The marker is read first (a fenced store's at most every 5 s). Admins and open
        mode only (403 ``forbidden``): the location and reasons are whole, as in the log."""
        _fleet_only(request, "read the snapshot store's status")
        store = _rt(request).store
        error: str | None = None
        try:
            await store.check_now()  # type: ignore[union-attr]
        except SubstrateError as e:
            # fenced: the status says why; unreachable (a store down: it said "verified" and nothing else,
            # fresh-user tester 55): said here
            if store.fenced is None:  # type: ignore[union-attr]
                error = e.message
        out = store.status()  # type: ignore[union-attr]
        return {"location": out["location"], "reachable": error is None, "error": error,
                "verified": out["verified"], "fenced": out["fenced"]}

    @app.post("/v1/snapshotstore/adopt", dependencies=[*v1, Depends(_no_body)], tags=["control plane"])
    async def adopt_snapshot_store(request: Request) -> dict[str, Any]:
        """Take the configured store as this directory's when its marker object is missing (objects lost
        for good: a bucket deleted or emptied, a folder lost): writes the marker (making the bucket if it
        does not exist); suspends and wakes are served again, by every process within 5 s. A session
        whose snapshot is gone falls back at its next wake (after ``SUBSTRATE_SNAPSHOT__MISSING_GRACE_S``)
        to an earlier one or a fresh start, and says so. 200 ``{"adopted": bool, "location": str}``
        (false: it was this directory's already); 409 ``store_taken`` for another directory's marker; 503
        ``snapshot_store_unavailable`` if the store or Redis does not answer. Admins and open mode only."""
        _fleet_only(request, "adopt the snapshot store")
        p = _principal(request)
        out = await _rt(request).store.adopt()  # type: ignore[union-attr]
        log.warning("snapshot store adopt", extra={"who": p.subject, "adopted": out["adopted"]})
        return out

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
        """200 when Redis answers and, in a process that runs the pools (``substrate up``), every pool
        has the READY workers it starts with; else 503 (``directory_unavailable``, ``no_workers``).

        A router whose pools another process runs (``substrate router``: Kubernetes' readiness probe) is
        ready once Redis answers, and lists the short pools in ``poolsWithoutReadyWorkers``: one pool
        whose Pods cannot be scheduled took every router out of its Service, and the healthy pools'
        sessions with them (fresh-user tester 51); its creates answer 503 ``no_capacity`` with the reason
        instead."""
        rt = _rt(request)
        try:
            await rt.directory.ping()
        except SubstrateError as e:
            return proxy.error_response(e)
        from substrate.pool import desired_replicas

        ready = [w.pool for w in rt.view.workers.values() if w.state.value == "READY"]
        short = [p.name for p in rt.catalog.pools.values() if ready.count(p.name) < desired_replicas(p.spec, 0)]
        # a fenced store leaves the API ready (warm sessions are served) but says so: it stayed "ready"
        # with every suspend failing (fresh-user tester 54)
        fenced = getattr(rt.store, "fenced", None)
        warn = {"warnings": ["the snapshot store is fenced: suspends and wakes that read a snapshot answer 503 "
                             "snapshot_store_unavailable (GET /v1/snapshotstore says why)"]} if fenced else {}
        if rt.pools is None:
            return JSONResponse({"status": "ready", "poolsWithoutReadyWorkers": short, **warn})
        if short:  # a pool that may scale to zero is ready without workers
            return _error(503, "no_workers", f"pools without their ready workers: {short}")
        return JSONResponse({"status": "ready", **warn})

    # HEAD on every GET route answers as GET does, without the body (the server drops it: uvicorn sends
    # no body to a HEAD), as Starlette's own routes do; FastAPI's answer 405. Added to the routes, so
    # the invoke hot path does nothing more per request
    for r in app.router.routes:
        if isinstance(r, APIRoute) and "GET" in r.methods:
            r.methods.add("HEAD")

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=_schema_routes(app.routes))
        schema["paths"]["/v1/sessions/{sid}/invoke"] = {"post": {
            "tags": ["sessions"], "summary": "Invoke a session (wakes it if suspended)",
            "description": "Body `{\"input\": ...}` -> 200 `{\"output\": ...}`. `?stream=true` answers "
                           "NDJSON lines `{\"chunk\": ...}` then `{\"done\": true}`. Headers "
                           "`X-Substrate-Woke: 1` and `X-Substrate-Wake-Ms` when the call woke the session "
                           "(all of the answer's headers: see the 200 response).",
            "parameters": [{"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "stream", "in": "query", "required": False,
                            "description": "`1`/`true`: NDJSON; `0`/`false` (default): JSON; else 422",
                            "schema": {"type": "string", "enum": ["1", "true", "0", "false"]}},
                           IDEMPOTENCY_KEY_PARAM, KEY_ORIGIN_PARAM],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["input"], "properties": {"input": {}}}}}},
            "responses": {"200": {
                "description": "the agent's output", "headers": INVOKE_RESPONSE_HEADERS,
                "content": {
                    "application/json": {"schema": {
                        "type": "object", "required": ["output"], "properties": {"output": {}}}},
                    # one JSON object per line: {"chunk": ...} lines, then {"done": true}; a failure
                    # after the first line ends the stream with an {"error": {...}} line
                    "application/x-ndjson": {"schema": {
                        "type": "object", "properties": {
                            "chunk": {}, "done": {"type": "boolean"},
                            "error": {"$ref": "#/components/schemas/Error"}}}}}}}}}
        comps = schema.setdefault("components", {})
        comps.setdefault("schemas", {})["Error"] = openapi_error_schema()
        comps["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer", "bearerFormat": "sk_<id>_<secret>",
                       "description": "An API key (`substrate keys create TENANT`), as `Authorization: Bearer "
                                      "sk_...`. Only its SHA-256 is stored; revocation is effective at once."},
            "oidc": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                     "description": "A JWT from the OIDC issuer `auth.oidc_issuer` (verified against its "
                                    "JWKS); the tenant is the `auth.tenant_claim` claim, admins carry "
                                    "`auth.admin_role` in `auth.roles_claim`."}}
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                statuses = ROUTE_STATUSES.get((method, path))
                if path.startswith("/v1"):
                    # no credentials configured = open mode (the single tenant `default`): {} allows that
                    op["security"] = [{"apiKey": []}, {"oidc": []}, {}]
                    params = op.setdefault("parameters", [])  # every /v1 route takes (and checks) one
                    if not any(p.get("name") == "X-Request-ID" for p in params):
                        params.append(REQUEST_ID_PARAM)
                    statuses = statuses or DEFAULT_STATUSES
                responses = op.setdefault("responses", {})
                if statuses is None:
                    responses.pop("422", None)  # FastAPI's validation answer: a route without parameters
                    continue
                # replaces FastAPI's own 422 (HTTPValidationError): every error answer here is an Error
                responses.update(responses_for(*sorted(set(statuses))))
        for name in ("HTTPValidationError", "ValidationError"):  # no answer has that shape
            comps["schemas"].pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = _openapi  # type: ignore[method-assign]
    return app

