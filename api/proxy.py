"""The router's hot path: ``POST /v1/sessions/{id}/invoke`` as a thin Starlette endpoint.

Per request for a RUNNING session: zero Redis round trips when the process-local route cache holds the
session (DESIGN invariant 5: the cache entry carries the activation epoch and the worker rejects a stale
one with 409 / an unknown one with 404, which drops the entry and retries through the directory), plus
one proxied HTTP call: a plain turn over the lean kept-alive client of ``api.workerhttp`` (aiohttp's
client was a third of a saturated router's CPU), a streamed one over a pooled aiohttp ``ClientSession``.
Bodies go back unchanged; the router never parses the worker's answer.

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
import codecs
import json
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, AsyncIterator

import aiohttp
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope

from api.errors_doc import ERROR_CODES
from api.guard import retry_after, www_authenticate
from api.hotpath import runtime_of
from api.workerhttp import Answer, ConnectError, WorkerHTTP, WorkerHTTPError
from substrate import audit, metrics
from substrate.activator import Route
from substrate.errors import (
    BadRequest,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    SessionDeleted,
    SubstrateError,
    UnsupportedMediaType,
    WorkerUnavailable,
    clip,
    error_json,
)
from substrate.models import IDEMPOTENCY_KEY_RE, MAX_IDEMPOTENCY_KEY_CHARS, SESSION_ID_HINT, SESSION_ID_RE
from substrate.workerclient import IDEMPOTENCY_HEADER, KEY_ORIGIN_HEADER, token_refused_error

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


#: codes of the workers' internal API that are no public answer (api/errors_doc.py lists the public ones),
#: and what a client is told instead: (status, public code, what happened). The routes turn the cases
#: they know into retries or precise answers; this is the net under all of them (fresh-user run: a
#: suspend racing another answered 404 ``not_active`` for a session that exists)
_INTERNAL_CODES: dict[str, tuple[int, str, str]] = {
    "not_active": (409, "conflict", "the session's activation ended while this call reached it (it was "
                                    "suspended, resumed or moved concurrently); retry"),
    "stale_epoch": (409, "conflict", "the session moved to a new activation while this call reached it; retry"),
    "busy": (409, "conflict", "the session is in the middle of a turn; retry"),
    # only a pressure suspend evicts (the router's own call, never a client's): the net for a path that
    # would pass it on
    "session_evicted": (409, "conflict", "the session was evicted under slot pressure while this call reached "
                                         "it; retry"),
    "worker_error": (502, "worker_unavailable", "the worker failed the call without saying why"),
}


def server_timing(woke_ms: float, route: Route) -> str:
    """The ``Server-Timing`` value (W3C Server Timing, https://www.w3.org/TR/server-timing/) of an answer
    whose call woke its session: ``place`` (ms waiting for and claiming a slot, including any wait for a
    worker to start or a session to be suspended for room), ``activate`` (ms the worker took to restore
    and start the agent, and the RUNNING write) and ``wake`` (how long this call waited for the wake, the
    same figure as ``X-Substrate-Wake-Ms``). The phases are the shared wake's: a call that joined a
    wake already under way waited less than they add up to. They are left out when another router's
    wake was followed (then only ``wake``). After ``activate`` come its parts, in order (``Route.phases_ms``):
    the worker's ``sandbox``, ``restore``, ``recheck`` and ``agent``, then ``running``, the RUNNING write."""
    parts = [f"{name};dur={ms:.1f}" for name, ms in (("place", route.place_ms), ("activate", route.activate_ms))
             if ms is not None]
    if route.activate_ms is not None:
        parts += [f"{name};dur={ms:.1f}" for name, ms in route.phases_ms]
    return ", ".join([*parts, f"wake;dur={woke_ms:.1f}"])


def public_error(e: SubstrateError) -> SubstrateError:
    """``e`` as a client may see it: a worker-internal code (``_INTERNAL_CODES``) becomes its public
    counterpart, with the worker's message kept after the explanation; any other error as it is."""
    mapped = _INTERNAL_CODES.get(e.code)
    if mapped is None:
        return e
    status, code, what = mapped
    out = SubstrateError(f"{what} ({clip(e.message, 300, quote=False)})", code=code,
                         retry_after_s=e.retry_after_s, details=e.details)
    out.status = status
    return out


def error_response(e: SubstrateError) -> Response:
    """Render an error as ``{"code","message"[,"details"]}`` JSON with its status and Retry-After; a
    worker-internal code is first turned into its public counterpart (``public_error``). Every error
    body of the API is written this way (``substrate.errors.error_json``: compact JSON)."""
    e = public_error(e)
    headers = dict(_JSON)
    if e.status == 401:
        headers["WWW-Authenticate"] = www_authenticate(e.code)
    if e.retry_after_s is not None:
        headers["Retry-After"] = retry_after(e.retry_after_s)
    return Response(e.to_json(), status_code=e.status, headers=headers)


# the request ID is the front door's (``api.guard``): it makes or checks one for every /v1 call first
from api.guard import new_request_id, request_id  # noqa: E402,F401  (re-exported: routes and tests use them)


async def authenticate(runtime: "Runtime", request: Request) -> "Principal":
    """The caller (see ``api.auth``); also sets the audit actor for everything this request causes.

    The caller is authenticated once per request: a principal the front door (``api.guard.Guard``) put in
    the request's state is used as is (a JWT is not verified twice). Raises the authentication errors
    (401/403) and ``InvalidInput`` ``invalid_request_id`` (see ``request_id``)."""
    # the request's state dict itself (``request.state`` wraps it in a new object on every access)
    state = request.scope.setdefault("state", {})
    principal = state.get("principal")
    if principal is None:
        principal = await runtime.auth.authenticate(request.headers)
    # the front door made or checked it already (api.guard.Guard); an app without one checks it here
    rid = state.get("request_id") or request_id(request.headers)
    state["request_id"] = rid
    state["principal"] = principal
    audit.actor.set(audit.Actor(principal.subject, principal.tenant, rid))
    return principal


def check_json_content_type(content_type: str | None, body: bytes, content_encoding: str | None = None) -> None:
    """Refuse a non-empty ``body`` that is not labelled JSON: ``UnsupportedMediaType`` (415
    ``unsupported_media_type``, naming the header to send). JSON is ``application/json`` or any
    ``application/*+json``; a ``charset`` parameter must be UTF-8, and a ``Content-Encoding`` other than
    ``identity`` (a compressed body) is refused the same way. An empty body passes (a resume without one).

    Deliberately strict, also for a body without ``Content-Type``: ``curl -d`` labels a JSON body
    ``application/x-www-form-urlencoded`` and the answer tells how to fix that; guessing instead would let a
    web page drive the API from the user's browser, since a form, ``text/plain`` or unlabelled post is
    sent cross-site without a CORS preflight (in open mode, with no credentials, a page could create a
    shell session under an ID it chose and run commands in it), while ``application/json`` is not."""
    if not body or (content_type == "application/json" and not content_encoding):  # nearly every call
        return
    if content_encoding and any(c.strip().lower() not in ("identity", "") for c in content_encoding.split(",")):
        # a gzip body was "not UTF-8 text" (400 bad_json): say what is wrong
        raise UnsupportedMediaType(f"Content-Encoding {clip(content_encoding)} is not supported: send the body "
                                   "uncompressed", code="unsupported_media_type")
    media, _, params = (content_type or "").partition(";")
    main, _, sub = media.strip().lower().partition("/")
    # a structured-syntax suffix needs a name before it (RFC 6838 4.2.8): ``application/+json`` is none
    if main == "application" and (sub == "json" or (sub.endswith("+json") and len(sub) > len("+json"))):
        # every charset given must be UTF-8: ``charset=utf-8; charset=latin1`` was taken by its first
        for charset in (v.strip().strip('"').lower() for k, _, v in (x.partition("=") for x in params.split(";"))
                        if k.strip().lower() == "charset"):
            if charset not in ("utf-8", "utf8"):  # it was read as UTF-8 whatever it said
                raise UnsupportedMediaType(f"charset {clip(charset)} is not supported: JSON bodies are UTF-8",
                                           code="unsupported_media_type")
        return
    got = f"Content-Type {clip(content_type)} is not JSON" if content_type else "the body has no Content-Type"
    raise UnsupportedMediaType(f"{got}: send the body as JSON with the header 'Content-Type: application/json' "
                               "(curl: -H 'Content-Type: application/json')", code="unsupported_media_type")


def header_list(raw: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """Every value of header ``name`` (lower-case) in an ASGI scope's ``raw`` headers, joined with ", " as
    one list (RFC 9110 5.3: repeated field lines of a list header are one comma-separated value), or None.
    A ``Content-Encoding: identity`` then ``Content-Encoding: gzip`` was checked by its first line only:
    the gzip body reached the JSON parser (fresh-user run)."""
    values = [v.decode("latin-1") for k, v in raw if k == name]
    return ", ".join(values) if values else None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {clip(k)}")
        out[k] = v
    return out


def _json_error(e: Exception) -> str:
    """What to say of a body ``json.loads`` refused (never Python's advice on its own settings)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8 text"
    if "integer string conversion" in str(e):
        return "a number has more than 4300 digits"
    return str(e)[:200]


def _utf8_text(body: bytes) -> str:
    """The body as text, if it is UTF-8 without a byte order mark (RFC 8259 8.1: JSON exchanged between
    systems is UTF-8, and no BOM is added). ``json.loads`` of bytes would guess UTF-16 or UTF-32 and skip
    a BOM, so such a body used to be taken on some routes; every JSON route now refuses it alike, 400
    ``bad_json``. Decoded strictly (RFC 3629): a surrogate's code point written as UTF-8-like bytes
    (``ED A0 80``) is not UTF-8 either, 400 ``bad_json`` like any other invalid byte (``json.loads``
    would take it with ``surrogatepass``, and it answered 422: fresh-user run 35); a lone surrogate
    written as a JSON escape (``"\\ud800"``) is valid JSON, left to the caller's 422 ``invalid_input``."""
    why = None
    if body.startswith(codecs.BOM_UTF8):
        why = "it starts with a UTF-8 byte order mark"
    elif body.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or b"\x00" in body:
        # no JSON text holds a raw NUL byte in UTF-8 (in a string it is written \u0000)
        why = ("it holds a NUL byte: UTF-16 or UTF-32 text, or a raw NUL (in a JSON string write it as "
               "\\u0000)")
    else:
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            why = "it is not UTF-8 text"
    raise BadRequest(f"body is not valid JSON: {why}; the body must be UTF-8 JSON without a byte order mark",
                     code="bad_json")


def check_json_keys(body: bytes) -> None:
    """Refuse a control-plane body (create, resume) that is not UTF-8 JSON (``NaN``, ``Infinity`` and a
    number out of range included: Python's parser takes them, JSON has none) or repeats a key in an
    object: ``BadRequest`` (400 ``bad_json``), as invoke does. Not used on invoke, whose check is
    ``check_invoke_body``."""
    text = _utf8_text(body)
    try:
        json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant,
                   parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"body is not valid JSON: {_json_error(e)}", code="bad_json") from None


#: invoke inputs nested deeper than this are refused (a worker or agent must never see them)
MAX_JSON_DEPTH = 64


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


#: invoke's parser, built once: ``json.loads`` with arguments builds a decoder per call (0.8 % of a
#: saturated router's CPU in the 2026-12-06 profile). ``json.loads`` also refuses text starting with a
#: BOM, which ``_utf8_text`` already has
_INVOKE_JSON = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


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


def lone_surrogate_path(doc: Any) -> str | None:
    """Where in ``doc`` (parsed JSON) a string or key holds a lone surrogate (``"\ud800"``: JSON allows
    the escape, UTF-8 cannot hold it), as a short path like ``input[2].k``; None if nowhere."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "(body)"
        elif isinstance(v, dict):
            for k, c in v.items():
                sub = f"{path}.{clip(k, 32, quote=False)}" if path else clip(k, 32, quote=False)
                stack.append((k, sub))
                stack.append((c, sub))
        elif isinstance(v, list):
            stack.extend((c, f"{path}[{i}]") for i, c in enumerate(v))
    return None


def check_invoke_body(body: bytes) -> None:
    """Refuse an invoke body that is not ``{"input": ...}`` JSON (another top-level field: 422
    ``invalid_input``, as create's), nests deeper than
    ``MAX_JSON_DEPTH``, or holds numbers Python cannot hold (over 4300 digits, overflowing floats,
    NaN/Infinity): ``BadRequest`` (400 ``bad_json`` / ``missing_input``); or that holds a lone surrogate
    in a string (text no agent can be given, the README's "text with a lone surrogate is 422"):
    ``InvalidInput`` (422 ``invalid_input``). A body that is not UTF-8 (a BOM, UTF-16) is 400 ``bad_json``
    (``_utf8_text``), as on every JSON route."""
    text = _utf8_text(body)
    try:
        doc = _INVOKE_JSON.decode(text)
    except (ValueError, RecursionError) as e:
        if not text:  # told as create tells it (fresh-user run: two messages for one mistake)
            raise BadRequest('the body is empty: send a JSON object such as {"input": ...}',
                             code="bad_json") from None
        raise BadRequest(f"body is not valid JSON: {_json_error(e)}", code="bad_json") from None
    if not isinstance(doc, dict) or "input" not in doc:
        raise BadRequest("body must be a JSON object with an 'input' field", code="missing_input")
    if len(doc) > 1:
        # the envelope is ``{"input": ...}`` only (``input`` is the agent's free-form part): an unknown
        # field is refused as create and resume refuse one (their models forbid extras), not dropped
        # silently, so a client that meant to pass an option learns that none is read
        extra = [k for k in doc if k != "input"]
        errs = [{"loc": ["body", clip(k, 64, quote=False)], "msg": "Extra inputs are not permitted"}
                for k in extra[:10]]
        raise InvalidInput("; ".join(f"body.{e['loc'][1]}: {e['msg']}" for e in errs), code="invalid_input",
                           details={"errors": errs})
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and not _depth_ok(doc, MAX_JSON_DEPTH):
        raise BadRequest(f"body is nested deeper than {MAX_JSON_DEPTH} levels", code="bad_json")
    # a lone surrogate arrives as a \uD800-\uDFFF escape or (json.loads decodes with surrogatepass) as raw
    # UTF-8-like bytes ED A0-BF: only then is the walk needed
    if b"\\u" in body or b"\xed" in body:
        where = lone_surrogate_path(doc)
        if where is not None:
            raise InvalidInput(f"{where}: not valid Unicode text (a lone surrogate such as \\ud800)",
                               code="invalid_input", details={"path": where})


_STREAM_VALUES = {"1": True, "true": True, "0": False, "false": False}


def stream_param(values: list[str]) -> bool:
    """Invoke's ``?stream=``: ``1``/``true`` stream, ``0``/``false`` or none answer plain JSON. Anything
    else (``maybe``, ``yes``, given twice) raises ``InvalidInput`` (422 ``invalid_input``, as FastAPI's
    answer to a bad parameter elsewhere): silently answering JSON would break a client expecting NDJSON."""
    if not values:
        return False
    if len(values) == 1 and values[0] in _STREAM_VALUES:
        return _STREAM_VALUES[values[0]]
    got = ", ".join(clip(v) for v in values[:3])
    msg = f"query.stream: must be one of 1, true, 0, false (got {got})"
    raise InvalidInput(msg, code="invalid_input",
                       details={"errors": [{"loc": ["query", "stream"], "msg": msg.split(": ", 1)[1]}]})


def _headers_of(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers (lower-case names) as a dict: the one the front door (``api.guard.Guard``)
    made, else one made here; one C-level pass where each ``request.headers`` lookup walked the whole list
    again (six lookups per turn on the hot path). A name given twice keeps one of its values: every header
    invoke reads is refused when repeated (by the parser, the front door or invoke itself) or read with
    all its lines (``header_list``), so which one does not matter."""
    headers = scope.get("state", {}).get("headers")
    return headers if headers is not None else dict(scope["headers"])


async def _read_body(receive: Receive) -> bytes:
    """The request's whole body, as ``Request.body`` reads it (chunks until ``more_body`` is false);
    raises Starlette's ``ClientDisconnect`` if the client went away first. Behind the front door
    (``api.guard.Guard``) the body comes as one message already read."""
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.request":
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif msg["type"] == "http.disconnect":
            raise ClientDisconnect()


async def invoke(request: Request) -> Response:
    """Proxy one turn to the session's worker, waking the session first if it is suspended.

    Reads the scope's headers, query string and body directly, with the same answers: Starlette's
    ``Request.headers`` (a walk of the header list per lookup), ``query_params`` and ``body()`` took a
    measurable part of a saturated router's CPU (the router's CPU per turn went down about 14 %, paired
    A/B in ``docs/bench/2026-12-06-invoke-scope-ab.md``)."""
    scope = request.scope
    runtime: Runtime = runtime_of(scope["app"])
    sid = scope["path_params"]["sid"]
    try:
        principal = await authenticate(runtime, request)
        if not SESSION_ID_RE.fullmatch(sid):
            raise InvalidInput(f"malformed session id {clip(sid)}: {SESSION_ID_HINT}", code="invalid_session_id")
        raw = scope["headers"]
        headers = _headers_of(scope)
        limit = runtime.settings.api.max_body_bytes
        cl = headers.get(b"content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:  # bytes.isdigit: ASCII digits only
            raise PayloadTooLarge(f"body of {cl.decode()} bytes is over the {limit}-byte limit")
        # read whole by the front door (api.guard.Guard) already, else from the request
        body = scope["state"].get("body")
        if body is None:
            body = await _read_body(request.receive)
        if len(body) > limit:
            raise PayloadTooLarge(f"body of {len(body)} bytes is over the {limit}-byte limit")
        ctype = headers.get(b"content-type")
        check_json_content_type(None if ctype is None else ctype.decode("latin-1"), body,
                                header_list(raw, b"content-encoding") if b"content-encoding" in headers else None)
        check_invoke_body(body)
        # no query string (nearly every turn): nothing to parse
        stream = stream_param(request.query_params.getlist("stream")) if scope.get("query_string") else False
        rid = scope["state"]["request_id"]
        sent_key = headers.get(b"idempotency-key")
        key = sent_key.decode("latin-1") if sent_key else rid
        if sent_key is not None and sum(k == b"idempotency-key" for k, _ in raw) > 1:
            # which one a proxy or retry meant is unknown
            raise InvalidInput("Idempotency-Key is sent more than once: send one per turn",
                               code="invalid_idempotency_key")
        if sent_key is not None and not sent_key.strip():
            # an empty key fell back to the request ID silently (a fresh-user run): a client that meant to
            # send one (a variable left empty) would get no retry safety across requests without knowing
            raise InvalidInput("Idempotency-Key is empty or blank: send a key unique per turn, or no header",
                               code="invalid_idempotency_key")
        if not IDEMPOTENCY_KEY_RE.fullmatch(key):
            raise InvalidInput(
                f"Idempotency-Key is over {MAX_IDEMPOTENCY_KEY_CHARS} characters" if len(key) > MAX_IDEMPOTENCY_KEY_CHARS else
                "Idempotency-Key must be printable ASCII (space to ~; no control characters or non-ASCII bytes)",
                code="invalid_idempotency_key")
        keyless = not sent_key
        # a key a client library made up for its own retries (the SDK and the CLI key every turn) makes
        # room first, like the router's own: with 64 such turns an explicit key was pushed out of the
        # window and its retry ran the turn again (fresh-user round 25)
        origin = header_list(raw, b"x-substrate-key-origin") if b"x-substrate-key-origin" in headers else None
        # each listed value without the whitespace around it (RFC 9110 5.5): "  auto  ", "auto, auto"
        if origin is not None and {v.strip() for v in origin.split(",")} == {"auto"}:
            origin = "auto"
        if origin is not None and origin != "auto":
            raise InvalidInput(f"X-Substrate-Key-Origin takes only 'auto' (a key a client library made for its "
                               f"own retries), not {clip(origin)}", code="invalid_idempotency_key")
        return await _forward(runtime, sid, body, stream, rid, key, principal, key_is_request_id=keyless,
                              key_by_router=(keyless and b"x-request-id" not in headers) or origin == "auto")
    except SubstrateError as e:
        metrics.ERRORS_TOTAL.labels(code=e.code).inc()  # wake-path errors too (no_capacity, resume_timeout ...)
        return error_response(e)


#: the turn's header names as the lean client writes them (``_forward``)
_IDEMPOTENCY_NAME = IDEMPOTENCY_HEADER.encode("latin-1")
_KEY_ORIGIN_NAME = KEY_ORIGIN_HEADER.encode("latin-1")

#: the worker's answer headers relayed to the client: (lower-case name, the name as sent)
_RELAYED_HEADERS = tuple((h.lower(), h) for h in ("X-Substrate-Restored", "X-Substrate-Restored-Snapshot-At",
                                                   "X-Substrate-Replayed"))
_RELAYED_NAMES = frozenset(h for h, _ in _RELAYED_HEADERS)
#: the ASGI (lower-case, encoded) names of the headers the router puts on a turn's answer
_ASGI_NAMES = {name: name.lower().encode("latin-1") for name in (
    "X-Substrate-Worker", "X-Substrate-Epoch", "X-Request-ID", "X-Substrate-Woke", "X-Substrate-Wake-Ms",
    "Server-Timing", *(name for _, name in _RELAYED_HEADERS))}


class _LeaseLost(Exception):
    """The worker of a call in flight is past its lease (plus grace): it stopped serving."""


async def _post(runtime: "Runtime", route: Route, path: str, body: bytes, headers: dict[str, str] | bytes,
                lean: bool) -> aiohttp.ClientResponse | Answer:
    """POST the turn to the worker at ``route.address + path``: with ``lean`` (a plain turn to an
    ``http://`` worker) over the lean client (``api.workerhttp``: the whole answer; ``headers`` may be
    lines already encoded), else over aiohttp (a streamed turn or an ``https://`` worker: the answer's
    headers; its body is relayed as it comes; ``headers`` a dict). Raises aiohttp's or ``api.workerhttp``'s
    connection errors, ``TimeoutError``, and ``_LeaseLost`` if the worker's lease runs out while we wait
    (a frozen worker would otherwise hold the request for the whole invoke timeout): the call is watched
    by the router's ``substrate.leasewatch.LeaseWatch`` (a set insertion and removal per turn, no timer)."""
    task = asyncio.current_task()
    assert task is not None
    watch = runtime.lease_watch
    watch.add(route.worker, task)
    try:
        if lean:
            return await runtime.worker_http.post(route.address, path, body, headers,
                                                  runtime.settings.api.invoke_timeout_s)
        assert isinstance(headers, dict)
        return await runtime.http.post(route.address + path, data=body, headers=headers)
    except asyncio.CancelledError:
        # the watch's (the lease ran out) unless something else cancelled the request too (a server stop)
        if task in watch.lost and task.uncancel() == 0:
            raise _LeaseLost(route.worker) from None
        raise
    finally:
        watch.discard(route.worker, task)


async def _forward(runtime: "Runtime", sid: str, body: bytes, stream: bool, rid: str, key: str,
                   principal: "Principal", *, key_is_request_id: bool = False,
                   key_by_router: bool = False) -> Response:
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
    sent = False  # a worker may have started this turn: a session gone since was deleted under it
    token_retried = False  # sent again once with reloaded signing keys after the worker refused the token
    waits_on_lease = 0  # tries that found nothing listening on a worker whose lease still runs
    unreachable: str | None = None  # that worker, when it was the last try's
    while True:
        attempt += 1
        if (attempt > 1 or waits_on_lease) and (time.monotonic() > deadline or attempt > 12):
            if unreachable is not None:  # the last try found its worker unreachable: it did not move
                raise WorkerUnavailable(f"session {sid!r}: its worker {unreachable} cannot be reached and was not "
                                        "declared dead (its lease did not lapse) in time; retry",
                                        code="worker_unavailable", retry_after_s=s.api.retry_after_s)
            raise WorkerUnavailable(f"session {sid!r} kept moving between workers; retry", code="session_moving",
                                    retry_after_s=s.api.retry_after_s)
        unreachable = None
        if route is None:
            t0 = time.perf_counter()
            try:
                # woken again if it moved meanwhile (a deadline roll, another router) or the worker
                # chosen for it died while restoring it
                route, woke = await act.wake_retrying(sid, tenant=None if principal.admin else principal.tenant,
                                                      deadline=deadline)
            except NotFound as e:
                if sent and e.code == "session_not_found":
                    raise await _gone(runtime, sid) from e
                raise
            if woke:
                woke_ms = (time.perf_counter() - t0) * 1000
                # this activation's own marker: one from an earlier attempt's wake may be stale (a commit
                # since then can have told the record the loss was reported)
                restored = route.restored
            cache.put(sid, route)
        path = f"/v1/activations/{sid}/invoke" + ("?stream=1" if stream else "")
        lean = not stream and WorkerHTTP.supports(route.address)
        headers: dict[str, str] | bytes
        if lean:  # the lean client writes its request itself: the route's fixed lines are kept encoded
            headers = (runtime.client.auth_head(route.address, sid, route.epoch, route.tenant)
                       + b"\r\nContent-Type: application/json\r\nX-Request-ID: " + rid.encode("latin-1")
                       + b"\r\n" + _IDEMPOTENCY_NAME + b": " + key.encode("latin-1")
                       + (b"\r\n" + _KEY_ORIGIN_NAME + b": router" if key_by_router else b""))
        else:
            headers = {**runtime.client.auth_headers(route.address, sid, route.epoch, route.tenant),
                       "Content-Type": "application/json", "X-Request-ID": rid, IDEMPOTENCY_HEADER: key}
            if key_by_router:  # made for this router's own retry (the client learns it only from the answer):
                # the worker evicts such keys first
                headers[KEY_ORIGIN_HEADER] = "router"
        first = b""
        try:
            resp = await _post(runtime, route, path, body, headers, lean)
            sent = True
            if stream and _streamed(resp, stream):
                first = await _first_bytes(resp)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, WorkerHTTPError, _LeaseLost) as e:
            # not answered (refused, reset, a stale keep-alive, the worker stopping or frozen): route again
            # and resend with the same key; the worker answers a turn it already ran from its cache.
            # Bounded: a turn that keeps losing its worker may be what kills it (fresh-user run: one
            # turn took down 11 workers in a row), so once more than max_lost_worker_retries distinct
            # workers dropped it after it was sent, it is answered 502.
            # refused before sending: not this turn's doing
            refused = isinstance(e, (aiohttp.ClientConnectorError, ConnectError))
            if not refused:
                lost_workers.add(route.worker)
                sent = True
            cache.drop(sid)
            if len(lost_workers) > s.api.max_lost_worker_retries:
                await act.check_worker(route.worker, sid=sid)
                raise WorkerUnavailable(
                    f"session {sid!r}: {len(lost_workers)} workers went away during this turn; not retried again "
                    "(the turn may be what stops it)", code="worker_unavailable", retry_after_s=s.api.retry_after_s)
            if not await act.check_worker(route.worker, sid=sid) and (refused or isinstance(e, _LeaseLost)):
                # nothing listens there (or it froze past its lease), and its lease still runs: the session
                # stays there until the lease lapses and the worker is declared dead. Each such try fails
                # at once, so they are bounded by the deadline (park + lease + grace), not by the count of
                # attempts: the 12 attempts ran out in 1.5 s, and the turn was answered 502
                # ``session_moving`` for a session that never moved (fresh-user tester 42, a worker killed
                # where the runtime could not see it exit)
                act.view.mark_unreachable(route.worker, s.worker.lease_s)
                unreachable = route.worker
                attempt -= 1
                waits_on_lease += 1
                route = None
                await asyncio.sleep(min(0.05 * waits_on_lease, 0.5))
                continue
            route = None
            await asyncio.sleep(min(0.02 * attempt, 0.2))
            continue
        except TimeoutError as e:
            cache.drop(sid)
            raise WorkerUnavailable(f"worker {route.worker} did not answer within the invoke timeout "
                                    f"({s.api.invoke_timeout_s:g} s): the turn may still be running there; retry "
                                    "with the same Idempotency-Key to get its answer instead of running it again",
                                    code="invoke_timeout") from e
        if resp.status in (401, 404, 409, 503):
            try:
                err = json.loads(await resp.read() or b"{}")
            except (ValueError, aiohttp.ClientError):
                err = {}
            finally:
                resp.release()
            code = err.get("code") if isinstance(err, dict) else None
            if resp.status == 401:  # the worker refused this router's token (not the client's credentials)
                if not token_retried and await runtime.client.token_refused():
                    token_retried = True  # signed with the reloaded key: once
                    continue
                raise token_refused_error(route.address, err)
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
            if isinstance(err, dict) and code in _INTERNAL_CODES:  # never a worker-internal code to a client
                pub = public_error(SubstrateError(str(err.get("message", "")), code=code))
                err, status = pub.to_dict(), pub.status
            else:
                status = resp.status
            _count_error(err)
            return Response(error_json(err), status_code=status, headers={**_JSON, "X-Request-ID": rid})
        extra = {"X-Substrate-Worker": route.worker, "X-Substrate-Epoch": str(route.epoch), "X-Request-ID": rid}
        # an Answer's names are lower-case: one set operation tells there is none to relay (nearly every turn)
        if not isinstance(resp, Answer) or resp.headers.keys() & _RELAYED_NAMES:
            for h, name in _RELAYED_HEADERS:
                if h in resp.headers:  # lower-case: found without lowering it
                    extra[name] = resp.headers[h]
        if woke_ms is not None:
            extra["X-Substrate-Woke"] = "1"
            extra["X-Substrate-Wake-Ms"] = f"{woke_ms:.1f}"
            extra["Server-Timing"] = server_timing(woke_ms, route)
            # state since the last snapshot was lost: say so on the answer itself (the worker's own marker
            # wins). Never on a replay: its marker is the activation's that ran the turn, and none means
            # that one had lost nothing (a tester's run: a retry that woke the session showed the wake's
            # loss on an answer from before it; the same retry without a wake showed none)
            if restored and "X-Substrate-Restored" not in extra and "X-Substrate-Replayed" not in extra:
                extra["X-Substrate-Restored"] = restored
        # the worker's content type: a replayed answer comes in the form its turn first ran (a streamed
        # turn's NDJSON lines, a plain turn's JSON), whichever this call asked for
        ndjson = resp.headers.get("content-type", "").startswith("application/x-ndjson")
        if stream and _streamed(resp, stream):
            failed = _failed_at_once(first)
            if failed is None:
                return StreamingResponse(_relay(resp, runtime, sid, first), status_code=200,
                                         media_type="application/x-ndjson", headers=extra)
            # the turn failed before it said anything: nothing has reached the client yet, so it is
            # answered as the same plain turn is, with the error's own status (a fresh-user run: a
            # streamed invoke of bad input was 200 with an error line, the plain one 422 agent_error)
            resp.release()
            status = ERROR_CODES.get(str(failed.get("code")), (500, ""))[0]
            if status >= 500 and not await _exists(runtime, sid):
                raise await _gone(runtime, sid)
            _count_error(failed)
            return Response(error_json(failed), status_code=status, headers={**_JSON, **extra})
        try:
            data = resp.body if isinstance(resp, Answer) else await resp.read()  # an Answer is whole
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            cache.drop(sid)  # the answer was lost on the way: ask again with the same key
            await act.check_worker(route.worker, sid=sid)
            route = None
            continue
        finally:
            resp.release()
        if resp.status >= 500 and not await _exists(runtime, sid):
            # a DELETE ends the activation at once, even mid-turn: the agent stopped under the turn is the
            # delete's doing, not a crash to retry (fresh-user run: 500 agent_crashed, "it restarts from
            # its last snapshot", for a session that had been deleted)
            raise await _gone(runtime, sid)
        if woke_ms is None:  # the hot path only: a wake is timed by the wake/resume histograms
            metrics.PROXY_DURATION_SECONDS.observe(time.perf_counter() - t_start)
        if resp.status == 422 and key_is_request_id:
            data = _request_id_key_reused(data, rid)
        if resp.status >= 400:  # the worker's or its agent's error (agent_error, turn_timeout ...): counted too
            try:
                _count_error(json.loads(data))
            except ValueError:
                _count_error({})
        return _Plain(data, resp.status, "application/x-ndjson" if ndjson else "application/json", extra)


class _Plain(Response):
    """A whole answer with ``content_type`` and ``headers`` (names as sent, values latin-1 text) and its
    Content-Length: Starlette's ``Response`` with its headers put in ASGI form directly (its
    ``init_headers`` lower-cases and re-scans them: ~1 % of a saturated router's CPU)."""

    def __init__(self, body: bytes, status_code: int, content_type: str, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body
        names = _ASGI_NAMES
        self.raw_headers = [(b"content-type", content_type.encode("latin-1")),
                            *((names.get(k) or k.lower().encode("latin-1"), v.encode("latin-1"))
                              for k, v in headers.items())]
        if status_code >= 200 and status_code not in (204, 304):  # as Starlette: these carry no body
            self.raw_headers.append((b"content-length", str(len(body)).encode("latin-1")))


def _request_id_key_reused(data: bytes, rid: str) -> bytes:
    """The worker's ``idempotency_key_reused`` answer when the key was the router's choice (the request ID,
    no ``Idempotency-Key`` sent): the worker's message names an Idempotency-Key the client never sent, so it
    is told which header to change instead. Any other answer is returned as it is."""
    if b"idempotency_key_reused" not in data:
        return data
    try:
        err = json.loads(data)
    except ValueError:
        return data
    if not isinstance(err, dict) or err.get("code") != "idempotency_key_reused":
        return data
    err["message"] = (f"X-Request-ID {clip(rid)} was used as the idempotency key (no Idempotency-Key was sent) "
                      "for a turn with another body: send a new X-Request-ID, or an Idempotency-Key, per turn")
    return error_json(err).encode()


async def _gone(runtime: "Runtime", sid: str) -> SessionDeleted | NotFound:
    """What a turn is told when its session went away under it: 410 ``session_deleted`` if a delete took
    it (a delete under way leaves the record marked DELETED, a finished one the ID's epoch floor for a
    week; both keys share the session's hash tag), else 404 ``session_not_found`` saying the
    record vanished without a delete: the directory lost its data (a Redis flushed, or restarted without
    persistence), and telling that client its session "was deleted" blamed someone who did not (an
    earlier review). One directory read, on this failure path only; unreadable counts as deleted."""
    try:
        keys = runtime.directory.keys
        floor = await runtime.directory.redis.exists(keys.session(sid), keys.session_epoch_floor(sid))
    except Exception:  # noqa: BLE001 - the answer's wording only: the turn failed either way
        floor = 1
    if floor:
        # "if it had started": a turn that waited for the session's suspend or wake never ran (tester 50)
        return SessionDeleted(f"session {sid!r} was deleted while this turn was under way; the turn, if it had "
                              "started, was stopped, and the session is gone")
    return NotFound(f"session {sid!r} is gone from the session directory without a delete (its Redis lost its "
                    "data: flushed, or restarted without persistence); this turn was stopped", code="session_not_found")


async def _exists(runtime: "Runtime", sid: str) -> bool:
    """Whether ``sid`` still exists (one directory read, on a worker's failure answer only). A directory
    that cannot be reached counts as existing: the worker's own answer is then given as it is."""
    try:
        await runtime.directory.get_session(sid)
    except NotFound:
        return False
    except SubstrateError:
        return True
    return True


def _streamed(resp: aiohttp.ClientResponse | Answer, stream: bool) -> bool:
    """Whether the worker's answer is relayed as a stream: asked for, 200, and NDJSON (a replayed plain
    turn comes back as JSON whatever was asked)."""
    return stream and resp.status == 200 and resp.headers.get("content-type", "").startswith("application/x-ndjson")


def _count_error(err: Any) -> None:
    """Count an error answer the router passes on from a worker in ``agent_substrate_errors_total`` by
    its ``code`` (``worker_error`` when it has none): only the router's own errors were counted, so the
    dashboard's errors-by-code missed every agent error (fresh-user round 13)."""
    code = err.get("code") if isinstance(err, dict) else None
    metrics.ERRORS_TOTAL.labels(code=code if isinstance(code, str) and code else "worker_error").inc()


def _failed_at_once(first: bytes) -> dict[str, Any] | None:
    """The error of a streamed turn whose first line (in ``first``, the bytes read so far) is its error
    line, ``{"error": {"code": ..., ...}}``: it failed before any output. None otherwise (output first, or
    the first line not whole yet)."""
    if not first.startswith(b'{"error"'):
        return None
    line, nl, _ = first.partition(b"\n")
    if not nl:
        return None
    try:
        err = json.loads(line).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) and isinstance(err.get("code"), str) else None


async def _first_bytes(resp: aiohttp.ClientResponse) -> bytes:
    """The first bytes of a streamed turn's body, waited for before the router answers 200: until then
    nothing has reached the client, so a worker lost before its turn's first line is retried like a lost
    plain turn (same key: the session's next worker runs it, or answers it from its kept answer). A stream
    that ends empty is a lost worker too (a turn always ends with a line). Raises
    ``aiohttp.ClientConnectionError`` when the worker is lost and ``TimeoutError`` at the invoke timeout
    (the response released in both cases)."""
    try:
        first = await resp.content.readany()
    except TimeoutError:  # the invoke timeout (aiohttp's ServerTimeoutError is one too): not a lost worker
        resp.release()
        raise
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        resp.release()
        raise aiohttp.ServerDisconnectedError() from None
    if not first:
        resp.release()
        raise aiohttp.ServerDisconnectedError()
    return first


async def _relay(resp: aiohttp.ClientResponse, runtime: "Runtime", sid: str, first: bytes = b""
                 ) -> AsyncIterator[bytes]:
    """Pass a streamed turn's NDJSON lines through as they come (``first``: the bytes already read by
    :func:`_first_bytes`). Its final ``{"error": ...}`` line of a
    5xx kind is checked as a plain turn's 5xx answer is: if the session is gone, a DELETE stopped the
    turn, and the line says ``session_deleted`` (a fresh-user run: ``agent_crashed``, "it restarts from
    its last snapshot", for a session that had been deleted)."""
    rest = b""

    async def body() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for more in resp.content.iter_any():
            yield more

    try:
        async for chunk in body():
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            whole, rest = data[:cut], data[cut:]
            if whole.startswith(b'{"error"') or b'\n{"error"' in whole:
                whole = await _deleted_line(whole, runtime, sid)
            if whole:
                yield whole
        if rest:
            yield rest
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        yield rest + b'{"error":{"code":"worker_unavailable","message":"worker failed mid-stream"}}\n'
    finally:
        resp.release()


#: in-band error codes of a stream that a DELETE of the session under the turn also produces
_STREAM_KILLED = ("agent_crashed", "turn_timeout", "agent_protocol_violation")


async def _deleted_line(lines: bytes, runtime: "Runtime", sid: str) -> bytes:
    """``lines`` (whole NDJSON lines) with an error line of ``_STREAM_KILLED`` replaced by a
    ``session_deleted`` one if the session no longer exists (one directory read, on that line only)."""
    out = []
    for line in lines.split(b"\n"):
        if line.startswith(b'{"error"'):
            try:
                code = json.loads(line)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
            if code in _STREAM_KILLED and not await _exists(runtime, sid):
                line = error_json({"error": (await _gone(runtime, sid)).to_dict()}).encode()
        out.append(line)
    return b"\n".join(out)
