"""The API's front door, as plain ASGI middleware: bearer token and body size, before any body is read.

FastAPI resolves a route's dependencies only after it has read and parsed the body, so a check there
lets an unauthenticated client make the router buffer and parse up to the whole body, and a chunked
body (no ``Content-Length``) is buffered whole before its size is known. This middleware runs first for
every ``/v1/`` request:

1. the caller is authenticated with the runtime's ``api.auth`` (shared token compared in constant time,
   API keys, JWTs) -> 401/403 as that answers; without a runtime, ``Authorization: Bearer <token>`` is
   compared in constant time (``hmac.compare_digest``) against ``api.auth_token``. The principal is
   left in the request's state (``scope["state"]``), where the route's own check finds it: one
   authentication per request;
2. a ``Content-Length`` over ``api.max_body_bytes`` -> 413 at once; a malformed one -> 400 ``bad_request``;
3. the body is read here, whole, before the app sees the request: a chunked one (no ``Content-Length``)
   at most ``max_body_bytes + 1`` bytes (over the limit -> 413 without reading further), and every body
   within ``api.body_read_timeout_s`` of the request's start: a client that sends its headers and then
   trickles (or never finishes) the body gets 408 ``request_timeout`` and its connection is closed
   (uvicorn has no such bound, so it would otherwise hold a connection and a handler for ever). The body
   is replayed to the app unchanged; every route reads its body whole anyway.
4. a state-changing request (any method but GET, HEAD, OPTIONS) that a browser says comes from another
   site or origin is refused, 403 ``cross_origin_request``: ``Sec-Fetch-Site`` other than ``same-origin``
   or ``none`` (a user's own navigation), or without that header an ``Origin`` that is not this server's.
   A page can make a browser send a body-less POST (a suspend, a resume) to ``localhost`` without a CORS
   preflight, and the body rules (``proxy.check_json_content_type``) do not stop a request with no body.
   This is the Fetch Metadata / Origin check OWASP's CSRF cheat sheet describes; clients that are not
   browsers send neither header;
4b. in open mode (no credentials configured), a request that reached the server on a loopback address
   must name a loopback host in its ``Host`` header (``localhost``, ``127.x.y.z``, ``::1``, or one of
   ``api.allowed_hosts``), else 403 ``host_not_allowed``, GETs included. A page that rebinds its own
   name to 127.0.0.1 (DNS rebinding) is same-origin with the API in the browser's eyes, so item 4
   passes it; its requests still carry its own name in ``Host`` (a fresh-user run created a shell
   session and ran commands in it that way). The defence the Fetch standard's authors and OWASP name
   for DNS rebinding: check ``Host`` against the names the server answers to;
5. a query parameter given more than once (``?limit=5&limit=7``) -> 422 ``invalid_input`` naming it:
   every ``/v1/`` parameter takes one value, and FastAPI would silently keep one of them; and one the
   route does not take (``?stat=SUSPENDED``, ``?streem=1``) -> 422 ``invalid_input`` naming it and the
   ones it takes (as the app's OpenAPI document lists them): a typo silently ignored listed every
   session, or ran a turn unstreamed (fresh-user run);
6. an encoded slash (``%2F``) in the path: the server decodes it before routing, so
   ``POST /v1/sessions/abc%2Finvoke`` ran a turn of session ``abc``. A session ID cannot hold ``/``: in the
   session ID's segment it is 422 ``invalid_session_id``, anywhere else 404 ``not_found`` (no route has
   one), and nothing is done. The check costs the hot path one byte search (``%`` in the raw path);
0. (before all of the above) the request's ID: the client's ``X-Request-ID`` if valid, else a new
   unpredictable one (``new_request_id``), kept in the request's state, so every answer, a refusal
   included, carries ``X-Request-ID``; an invalid one is 422 ``invalid_request_id`` (after item 1). A
   request carrying ``Host``, ``Authorization`` or ``X-Request-ID`` twice is refused: 400
   ``bad_request`` (RFC 9112 3.2 for ``Host``), 422 ``invalid_request_id`` for the ID;
7. a request still in the app when the server stops and its graceful-shutdown time is over is cancelled
   by uvicorn, which would answer a plain-text 500 (a fresh-user run: SIGTERM during a 25 s shell turn);
   it gets 503 ``router_stopping`` in JSON with ``Retry-After`` instead: the turn may have run, and a
   retry with the same ``Idempotency-Key`` is answered from its kept answer, never run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import os
import re
import time
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import parse_qsl, unquote

from starlette.datastructures import Headers

from substrate.errors import InvalidInput, SubstrateError, clip, error_json
from substrate.models import SESSION_ID_HINT

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


#: a client's ``X-Request-ID`` must be 1-128 visible ASCII characters (``!`` to ``~``: no spaces, control
#: characters or non-ASCII): it goes into audit records, logs, the worker call and the answer's headers
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)


class _RequestIds:
    """The IDs the router makes for requests that bring none: 16 bytes of the OS's random source as 32 hex
    digits, the block read 4 KiB at a time (one ``getrandom`` call per 256 IDs, where ``uuid4`` made one
    and a ``UUID`` object per request: about 2 % of a saturated router's CPU, 2026-12-04).

    Unpredictable on purpose: the ID is the turn's idempotency key when the client sends no
    ``Idempotency-Key``, so a caller who could guess the next one could send a turn under it first and
    have the next key-less request answered with that turn's kept answer, never run (a fresh-user run did
    exactly that against a counter-based ID). A forked child drops the block it inherited. Not
    thread-safe: the router makes IDs on its event loop only."""

    BLOCK_BYTES = 4096

    def __init__(self) -> None:
        self._drop()
        os.register_at_fork(after_in_child=self._drop)

    def _drop(self) -> None:
        self._block = b""
        self._pos = 0

    def __call__(self) -> str:
        pos = self._pos
        if pos + 16 > len(self._block):
            self._block, pos = os.urandom(self.BLOCK_BYTES), 0
        self._pos = pos + 16
        return self._block[pos:pos + 16].hex()


new_request_id = _RequestIds()


def bad_request_id(rid: str) -> str | None:
    """What is wrong with a client's non-empty ``X-Request-ID`` (the message of 422
    ``invalid_request_id``), or None if it follows the rule: the length, or the first byte that is not
    visible ASCII (headers arrive as latin-1, one character per byte, so a UTF-8 letter shows as its
    first byte)."""
    if _REQUEST_ID_RE.fullmatch(rid):
        return None
    if len(rid) > MAX_REQUEST_ID_CHARS:
        why = f"it has {len(rid)} bytes"
    else:
        i, c = next((i, c) for i, c in enumerate(rid) if not "\x21" <= c <= "\x7e")
        what = "a space" if c == " " else f"byte 0x{ord(c):02x}" + (" (non-ASCII)" if ord(c) > 0x7f else "")
        why = f"{what} at position {i}"
    return (f"X-Request-ID must be 1-{MAX_REQUEST_ID_CHARS} visible ASCII characters "
            f"('!' to '~'; no spaces, control characters or non-ASCII): {why}")


def id_of(sent: str | None) -> tuple[str, str | None]:
    """(the request's ID, what is wrong with the one sent or None) for the ``X-Request-ID`` value ``sent``
    (None: no header): the client's if it follows the rule above, else a new one (``new_request_id``),
    with the reason when one was sent and broke the rule. Whitespace around a field's value is not part
    of it (RFC 9110 5.5; the parser keeps it)."""
    rid = (sent or "").strip(" \t")
    if not rid:
        return new_request_id(), None
    why = bad_request_id(rid)
    return (rid, None) if why is None else (new_request_id(), why)


def request_id(headers: Any) -> str:
    """The request's ID from its headers (anything with ``get``; see ``id_of``). Raises ``InvalidInput``
    (422 ``invalid_request_id``) for an ID that breaks the rule: an ID that cannot be stored as sent is
    refused, not silently replaced, so the client's correlation never breaks unnoticed. (``Guard`` does
    the same from the raw headers, for every /v1 call, before anything else.)"""
    rid, why = id_of(headers.get("x-request-id"))
    if why is not None:
        raise InvalidInput(why, code="invalid_request_id")
    return rid


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value (whole seconds, at least 1) for a wait of ``seconds``."""
    return str(max(1, int(round(seconds))))


#: the challenge of every 401 (RFC 9110 11.6.1 requires one; RFC 6750: shared tokens, API keys and JWTs
#: are all bearer tokens here)
WWW_AUTHENTICATE = 'Bearer realm="substrate"'


def www_authenticate(code: str) -> str:
    """The ``WWW-Authenticate`` value of a 401 with error ``code``: the bearer challenge, with RFC 6750
    3.1's ``error="invalid_token"`` when a token was sent and refused (``invalid_token``,
    ``token_expired``)."""
    if code in ("invalid_token", "token_expired"):
        return WWW_AUTHENTICATE + ', error="invalid_token"'
    return WWW_AUTHENTICATE

#: request headers a request carries at most once: a second ``Host`` must be refused (RFC 9112 3.2), and
#: of two ``Authorization``, ``X-Request-ID`` or ``Content-Type`` headers one was used and the other
#: dropped silently (fresh-user runs). ``Idempotency-Key`` is checked by invoke (422 ``invalid_idempotency_key``) and a
#: second ``Content-Length`` by the HTTP parser (400)
_ONCE_NAMES = {b"host": "Host", b"authorization": "Authorization", b"x-request-id": "X-Request-ID",
               b"content-type": "Content-Type"}
_ONCE_HEADERS = frozenset(_ONCE_NAMES)


def repeated_header(raw_headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The first of ``_ONCE_HEADERS`` (lower-case bytes, as in an ASGI scope) that ``raw_headers`` carry
    more than once, or None."""
    seen: set[bytes] = set()
    for k, _ in raw_headers:
        if k in _ONCE_HEADERS:
            if k in seen:
                return k
            seen.add(k)
    return None


def request_id_of(scope: Scope) -> str | None:
    """The ID to echo as ``X-Request-ID`` on an answer to ``scope``: the one the call was given (the
    client's or a fresh one, set by ``api.proxy.authenticate``), else the client's own if it is valid (an
    answer given before the call was authenticated: a body over the limit, a stalled body, one FastAPI
    could not parse). None if there is neither (an invalid one is answered 422 where it is checked)."""
    rid = (scope.get("state") or {}).get("request_id")
    if rid:
        return str(rid)
    for k, v in scope.get("headers") or ():
        if k == b"x-request-id":
            raw = v.decode("latin-1")
            return raw if _REQUEST_ID_RE.fullmatch(raw) else None
    return None


async def _answer(send: Send, status: int, code: str, message: str,
                  extra: list[tuple[bytes, bytes]] | None = None, *, scope: Scope | None = None,
                  details: dict[str, Any] | None = None) -> None:
    """Answer ``status`` with the error body every error has, the request's ID and, for 401, the scheme to
    authenticate with (RFC 9110 11.6.1: ``WWW-Authenticate``). The connection is closed after it when the
    request may have a body left unread (a ``Content-Length`` above 0 or a chunked one): reading it to
    keep the connection would read whatever an unauthenticated or refused client sends; a request
    without a body keeps its connection (a fresh-user run found some refusals closing and others not)."""
    body = error_json({"code": code, "message": message, **({"details": details} if details else {})}).encode()
    rid = request_id_of(scope) if scope is not None else None
    close = scope is None or any((k == b"content-length" and v.strip() != b"0") or k == b"transfer-encoding"
                                 for k, v in scope.get("headers") or ())
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *([(b"connection", b"close")] if close else []), *(extra or []),
                            *([(b"www-authenticate", www_authenticate(code).encode())] if status == 401 else []),
                            *([(b"x-request-id", rid.encode("latin-1"))] if rid else [])]})
    await send({"type": "http.response.body", "body": body})


#: scope keys (ASGI extensions) ``api.app.RequestCounter`` reads: the client went away before an answer
#: (``CLIENT_GONE``: counted as code 499, as nginx logs it, not as the 500 of an app that sent nothing),
#: or the HTTP protocol already answered the request itself (``substrate.serving.ANSWERED_BY_SERVER``:
#: not counted again)
CLIENT_GONE = "substrate.client_gone"


def body_arrived(receive: Receive) -> bool:
    """Whether ``receive`` (uvicorn's, for this request) will give the request's whole body at once,
    without waiting: the parser has the whole message (uvicorn sets the cycle's ``message_event`` and
    clears ``more_body`` when the message is complete, and then its ``receive`` returns the body it holds
    without suspending). The front door then reads it without arming the body deadline: a timer armed
    and cancelled per turn was about a third of the front door's CPU on the invoke path (a 16-byte body
    arrives with its headers). False whenever that cannot be told (another server, a wrapped
    ``receive``, a body still on its way): the deadline path is taken, as before."""
    cycle = getattr(receive, "__self__", None)
    event = getattr(cycle, "message_event", None)
    return event is not None and event.is_set() and getattr(cycle, "more_body", True) is False


class _TooLarge(Exception):
    """The request's body is over the limit (``_whole_body``)."""


async def _whole_body(receive: Receive, limit: int) -> bytes | None:
    """The request's whole body from ``receive`` (chunks until ``more_body`` is false), or None if the
    client went away first. Raises ``_TooLarge`` as soon as more than ``limit`` bytes came (a chunked body
    is read no further)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise _TooLarge
        chunks.append(body)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_STOPPING_MESSAGE = ("the router stopped before this call's answer came; the turn may have run: retry with "
                     "the same Idempotency-Key (a turn that ran is answered again, never run twice)")


async def _until_stopped(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app``; if the server cancels it (shutdown past its graceful time) before it began its
    answer, answer 503 ``router_stopping`` (see the module docstring, 7) and end the request there; in a
    streamed (NDJSON) answer already under way, end it with the line ``{"error": {"code":
    "router_stopping", ...}}``, as a stream cut by a worker's death ends with its error line (it ended as a
    broken chunked body and a traceback at error level: a fresh-user run)."""
    start: Message | None = None  # the answer's start, once sent
    ended = False

    async def tracking(msg: Message) -> None:
        nonlocal start, ended
        if msg["type"] == "http.response.start":
            start = msg
        elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
            ended = True
        await send(msg)

    try:
        await app(scope, receive, tracking)
    except asyncio.CancelledError:
        started = start is not None
        # its content type is looked at only here: every call would otherwise scan its headers
        ndjson = start is not None and any(k.lower() == b"content-type" and v.startswith(b"application/x-ndjson")
                                           for k, v in start.get("headers", ()))
        if started and ndjson and not ended:
            line = error_json({"error": {"code": "router_stopping", "message": _STOPPING_MESSAGE}})
            with contextlib.suppress(OSError, RuntimeError):  # the client may be gone too
                await send({"type": "http.response.body", "body": line.encode() + b"\n", "more_body": False})
            return
        if started:
            raise  # half an answer: uvicorn closes the connection
        # the request's own task is ending here: nothing above it waits for the cancellation
        await _answer(send, 503, "router_stopping", _STOPPING_MESSAGE, [(b"retry-after", b"1")], scope=scope)


def _Headers(scope: Scope) -> Headers:  # noqa: N802 - a constructor
    return Headers(scope=scope)


_NO_HEADERS = Headers(raw=[])


def bearer_ok(header: bytes | str | None, token: str) -> bool:
    """Constant-time check of an ``Authorization`` header value against ``Bearer <token>``."""
    if header is None:
        return False
    got = header if isinstance(header, bytes) else header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, b"Bearer " + token.encode())


#: Sec-Fetch-Site values of requests a browser made for this server's own pages or the user (W3C Fetch Metadata)
_SAME_ORIGIN_FETCH = (b"same-origin", b"none")
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def cross_origin(method: str, headers: dict[bytes, bytes], scheme: str = "http") -> str | None:
    """Why a state-changing request is a cross-origin one a browser sent (see the module docstring), or
    None. ``headers``: the raw ASGI headers (lower-case names)."""
    if method in _SAFE_METHODS:
        return None
    site = headers.get(b"sec-fetch-site")
    if site is not None:
        if site.strip().lower() in _SAME_ORIGIN_FETCH:
            return None
        return f"Sec-Fetch-Site {site.decode('latin-1')[:40]}"
    origin = headers.get(b"origin")
    if origin is None:
        return None
    host = headers.get(b"host", b"")
    if origin.strip().lower() == f"{scheme}://".encode() + host.strip().lower():
        return None
    return f"Origin {origin.decode('latin-1')[:100]}"


#: ``Host`` = uri-host [ ":" port ] (RFC 9110 7.2, RFC 3986 3.2.2-3.2.3): an IP literal in brackets
#: (IPv6, with an optional zone), or a reg-name / IPv4 address of unreserved, sub-delims and %-escapes;
#: the port is decimal digits (empty allowed by the grammar)
_HOST_RE = re.compile(r"(?:\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(?:%25[A-Za-z0-9._~-]+)?\]|(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)"
                      r"(?::([0-9]*))?")


@functools.lru_cache(maxsize=256)  # asked on every call, mostly for the same two or three values
def malformed_host(raw: bytes) -> str | None:
    """Why the ``Host`` header value ``raw`` is not ``host[:port]`` (see ``_HOST_RE``; a port above 65535
    too), or None if it is. RFC 9112 3.2: a request with an invalid ``Host`` is answered 400."""
    m = _HOST_RE.fullmatch(raw.decode("latin-1").strip(" \t"))  # RFC 9110 5.5: whitespace around a value
    if m is None:
        return "is not host[:port]"
    if m.group(1) and int(m.group(1)) > 65535:
        return "names a port above 65535"
    return None


@functools.lru_cache(maxsize=256)  # asked on every open-mode call, mostly for the same two or three names
def _loopback(name: str) -> bool:
    """Whether ``name`` (a host name or IP literal, lower-case, no port) is this machine's loopback."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def rebinding(headers: dict[bytes, bytes], server: tuple[str, int] | None, allowed: Iterable[str]) -> str | None:
    """For an open-mode request: the ``Host`` it names if that is not a loopback name although the request
    came in on a loopback address (``server``: the ASGI scope's local address), else None. ``allowed``:
    further names the server answers to (any case; read only for a non-loopback ``Host``). A request
    without ``Host`` (HTTP/1.0; no browser sends one) passes."""
    if not server:
        return None
    raw = headers.get(b"host")
    if raw is None:
        return None
    return _rebinding(raw, str(server[0]), tuple(allowed))


@functools.lru_cache(maxsize=256)  # asked on every open-mode call, mostly for the same two or three values
def _rebinding(raw: bytes, server_host: str, allowed: tuple[str, ...]) -> str | None:
    if not _loopback(server_host.lower()):
        return None
    host = raw.decode("latin-1").strip().lower()
    name = host[1:host.find("]")] if host.startswith("[") and "]" in host else host.rpartition(":")[0] or host
    if host.count(":") > 1 and not host.startswith("["):  # a bare IPv6 literal without a port
        name = host
    if _loopback(name) or any(name == a.strip().lower() for a in allowed):
        return None
    return host[:100]


def repeated_param(query_string: bytes) -> str | None:
    """The first query parameter given more than once (``?limit=5&limit=7``), or None. Every ``/v1/``
    parameter takes one value, and FastAPI silently keeps one of the repeats: which one the client meant
    is unknown, so the call is refused (422 ``invalid_input`` naming it) before anything is done."""
    seen: set[str] = set()
    for name, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):  # as Starlette parses
        if name in seen:
            return name
        seen.add(name)
    return None


class QueryNames:
    """The query parameters each ``/v1/`` route takes, read once from the app's OpenAPI document (the
    routes declare them there; the invoke route's ``stream`` too)."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], frozenset[str]]] | None = None

    def _load(self, app: Any) -> list[tuple[str, re.Pattern[str], frozenset[str]]]:
        out: list[tuple[str, re.Pattern[str], frozenset[str]]] = []
        if not hasattr(app, "openapi"):  # not the API's app (a bare test app): nothing to check against
            return out
        for path, ops in app.openapi().get("paths", {}).items():
            rx = re.compile("^" + re.sub(r"\\{[^/{}]+\\}", "[^/]+", re.escape(path)) + "$")
            for method, op in ops.items():
                names = frozenset(p["name"] for p in op.get("parameters", ()) if p.get("in") == "query")
                out.append((method.upper(), rx, names))
        return out

    def routed(self, app: Any, path: str) -> bool:
        """Whether some route of ``app`` takes ``path`` (any method); True when that cannot be told (an app
        without an OpenAPI document). An unknown route is the app's 404 whatever its query says."""
        if self._routes is None:
            self._routes = self._load(app)
        return not self._routes or any(rx.match(path) for _, rx, _ in self._routes)

    def unknown(self, app: Any, method: str, path: str, query_string: bytes) -> tuple[str, frozenset[str]] | None:
        """(the first parameter ``method path`` does not take, the ones it takes), or None (all known,
        or no such route: the app answers that)."""
        if self._routes is None:
            self._routes = self._load(app)
        method = "GET" if method == "HEAD" else method
        for m, rx, names in self._routes:
            if m == method and rx.match(path):
                for name, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
                    if name not in names:
                        return name, names
                return None
        return None


def encoded_slash(raw_path: bytes) -> tuple[int, str] | None:
    """The first segment of ``raw_path`` (the path as sent, before percent-decoding) that holds an encoded
    slash (``%2F``), as (its index in ``raw_path.split(b"/")``, the segment decoded); None if none does."""
    if b"%2f" not in raw_path.lower():
        return None
    for i, seg in enumerate(raw_path.split(b"/")):
        if b"%2f" in seg.lower():
            return i, unquote(seg.decode("latin-1"))
    return None


def _closing(send: Send) -> Send:
    """``send`` that marks the answer ``Connection: close`` (the server then closes the connection after
    it). For a request that asked for a protocol upgrade, served as plain HTTP/1.1: the HTTP parser reads
    nothing after its head, so a request pipelined behind it on the same connection was never answered
    and never ran, and the client waited for ever (fresh-user run). Closing tells the client to send it
    again on a new connection."""

    async def closing(msg: Message) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", ()), (b"connection", b"close")]}
        await send(msg)

    return closing


def upgrade_losing_body(raw_headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request that asks for a protocol upgrade (``Connection: upgrade`` and ``Upgrade: ...``: an h2c
    upgrade, as ``curl --http2`` sends over ``http://``, or a WebSocket handshake) and carries a body must
    be refused, or None. This server takes no upgrade, and may ignore one (RFC 9110 7.8), which a request
    without a body gets: it is answered as plain HTTP/1.1. But the HTTP parser stops at the head of an
    upgrade request, so its body never arrives: a create or invoke sent by ``curl --http2`` was answered
    400 "the body is empty", and one with WebSocket headers was held open with no answer at all
    (fresh-user run). Refused at once instead (400, connection closed)."""
    connection = upgrade = None
    has_body = False
    for name, value in raw_headers:
        if name == b"connection":
            connection = value.lower()
        elif name == b"upgrade":
            upgrade = value
        elif name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            has_body = True
    if upgrade is None or connection is None or not has_body or \
            b"upgrade" not in (t.strip() for t in connection.split(b",")):
        return None
    return (f"this server takes no protocol upgrade (Upgrade: {clip(upgrade.decode('latin-1'), quote=False)}), and the body of a "
            "request asking for one is lost: send it as plain HTTP/1.1 without Upgrade (curl: --http1.1 instead "
            "of --http2)")


#: the index of the session ID's segment in ``/v1/sessions/{sid}...`` split at ``/``
_SID_SEGMENT = 3


class Guard:
    """ASGI middleware; ``get_settings(scope)`` gives the settings per request (the runtime's)."""

    def __init__(self, app: ASGIApp, get_settings: Callable[[Scope], tuple[Any, Any]]) -> None:
        self.app = app
        self.get_settings = get_settings
        self.query_names = QueryNames()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if not (path.startswith("/v1/") or path == "/v1"):  # ``/v1`` too: its 404 had no request ID
            if any(k == b"upgrade" for k, _ in scope["headers"]):
                if (why := upgrade_losing_body(scope["headers"])) is not None:
                    await _answer(send, 400, "bad_request", why)
                    return
                send = _closing(send)
            await self.app(scope, receive, send)
            return
        settings, auth = self.get_settings(scope)
        api = settings.api
        # the body's time runs from here (the headers are in): authentication is part of the wait
        deadline = time.monotonic() + float(api.body_read_timeout_s)
        # the request's ID first, so that every answer carries one, refusals included (0.)
        state = scope.setdefault("state", {})
        headers = dict(scope["headers"])  # a repeated Host, Authorization or ID is refused just below
        state["headers"] = headers  # read again by the invoke route (api.proxy.invoke), not rebuilt
        sent_id = headers.get(b"x-request-id")
        state["request_id"], bad_id = (new_request_id(), None) if sent_id is None else id_of(sent_id.decode("latin-1"))
        if b"upgrade" in headers:
            if (why := upgrade_losing_body(scope["headers"])) is not None:
                await _answer(send, 400, "bad_request", why, scope=scope)
                return
            send = _closing(send)
        # a name given twice makes the dict shorter than the list: only then is the list looked through
        if len(headers) != len(scope["headers"]) and (twice := repeated_header(scope["headers"])) is not None:
            name = _ONCE_NAMES[twice]
            if twice == b"x-request-id":
                state["request_id"] = new_request_id()  # which one the client meant is unknown: echo neither
                await _answer(send, 422, "invalid_request_id",
                              "X-Request-ID is sent more than once: send one per request", scope=scope)
            else:
                await _answer(send, 400, "bad_request", f"{name} is sent more than once: a request carries one "
                              f"{name} header", scope=scope)
            return
        if not scope.get("http_version", "1.1").startswith("1."):
            # RFC 9110 6.2 / 15.6.6: this server speaks HTTP/1.x; an "HTTP/2.0" request line (not HTTP/2's
            # binary preface, which uvicorn refuses) was served as 1.1 (fresh-user tester 36). A higher 1.x
            # minor is served as 1.1, as RFC 9110 2.5 says
            await _answer(send, 505, "http_version_not_supported",
                          f"HTTP/{clip(scope.get('http_version'), quote=False)} is not supported: send HTTP/1.1",
                          scope=scope)
            return
        if b"transfer-encoding" in headers and (te := b", ".join(
                v for k, v in scope["headers"] if k == b"transfer-encoding")) and \
                [c.strip() for c in te.lower().split(b",") if c.strip()] != [b"chunked"]:
            # RFC 9112 6.1: a transfer coding the server does not understand is 501. The parser decodes only
            # `chunked`: the body of `gzip, chunked` reached the JSON parser still compressed (a fresh-user
            # run's plain body under that header was taken, 201). Every line of the header counts (RFC 9110
            # 5.3: `gzip` and `chunked` on two lines are that list too: fresh-user run 36)
            await _answer(send, 501, "unsupported_transfer_encoding",
                          f"Transfer-Encoding {clip(te.decode('latin-1'))} is not supported: send the body as "
                          "it is, with Content-Length or Transfer-Encoding: chunked only", scope=scope)
            return
        if b"host" not in headers and scope.get("http_version") not in ("1.0", "0.9"):
            # RFC 9112 3.2: an HTTP/1.1 request without Host is answered 400 (HTTP/1.0 had none: it passes)
            await _answer(send, 400, "bad_request", "an HTTP/1.1 request must carry a Host header", scope=scope)
            return
        if (raw_host := headers.get(b"host")) is not None and (why := malformed_host(raw_host)) is not None:
            # RFC 9112 3.2: an invalid Host is answered 400 (a fresh-user run: localhost:abc was served)
            await _answer(send, 400, "bad_request", f"Host {clip(raw_host.decode('utf-8', 'replace'))} {why}",
                          scope=scope)
            return
        if why := cross_origin(scope.get("method", ""), headers, scope.get("scheme", "http")):
            await _answer(send, 403, "cross_origin_request",
                          f"a browser sent this from another site ({why}): the API takes state-changing calls "
                          "only from clients that are not web pages, or from its own origin", scope=scope)
            return
        open_mode = not (auth.enabled if auth is not None else api.auth_token)
        if open_mode and (bad_host := rebinding(headers, scope.get("server"), api.allowed_hosts)) is not None:
            await _answer(send, 403, "host_not_allowed",
                          f"Host {bad_host!r} is not a name of this server: in open mode (no credentials) a "
                          "request that reaches the server on a loopback address (whatever address it listens "
                          "on) is answered only when its Host is localhost, 127.0.0.1 or ::1 (a web page could "
                          "otherwise reach it by DNS rebinding); SUBSTRATE_API__ALLOWED_HOSTS adds names", scope=scope)
            return
        if auth is not None:
            try:
                # kept in the request's state: the route's own check (api/proxy.authenticate) uses it
                # instead of authenticating again (a JWT used to be verified twice per call). The invoke
                # route is authenticated here too: its body is read below, and only for a known caller
                # in open mode it answers its anonymous caller without reading a header: none are wrapped
                # (Starlette's ``Headers`` copies the list: about 0.5 % of a saturated router's CPU)
                scope.setdefault("state", {})["principal"] = await auth.authenticate(
                    _NO_HEADERS if open_mode else _Headers(scope))
            except SubstrateError as e:
                retry = (None if e.retry_after_s is None
                         else [(b"retry-after", retry_after(e.retry_after_s).encode())])
                await _answer(send, e.status, e.code, e.message, retry, scope=scope)
                return
        elif api.auth_token and not bearer_ok(headers.get(b"authorization"), api.auth_token):
            await _answer(send, 401, "unauthorized", "missing or wrong bearer token", scope=scope)
            return
        if bad_id is not None:  # after authentication, where the route used to check it
            await _answer(send, 422, "invalid_request_id", bad_id, scope=scope)
            return
        qs = scope.get("query_string") or b""
        if b"&" in qs and (name := repeated_param(qs)) is not None and \
                ("app" not in scope or self.query_names.routed(scope["app"], path)):  # one parameter cannot repeat
            msg = "given more than once: this parameter takes one value"
            await _answer(send, 422, "invalid_input", f"query.{clip(name, 64, quote=False)}: {msg}", scope=scope,
                          details={"errors": [{"loc": ["query", clip(name, 64, quote=False)], "msg": msg}]})
            return
        if qs and "app" in scope and (bad := self.query_names.unknown(scope["app"], scope.get("method", ""),
                                                                      scope["path"], qs)) is not None:
            name, known = bad
            msg = ("this route takes no query parameter" if not known else
                   "not a parameter of this route (it takes: " + ", ".join(sorted(known)) + ")")
            await _answer(send, 422, "invalid_input", f"query.{clip(name, 64, quote=False)}: {msg}", scope=scope,
                          details={"errors": [{"loc": ["query", clip(name, 64, quote=False)], "msg": msg}]})
            return
        raw = scope.get("raw_path")
        if raw and b"%" in raw and (slash := encoded_slash(raw)) is not None:  # the hot path: one search
            i, seg = slash
            if i == _SID_SEGMENT and raw.startswith(b"/v1/sessions/"):
                await _answer(send, 422, "invalid_session_id",
                              f"malformed session id {clip(seg)}: a session ID cannot hold '/' (sent as %2F); "
                              f"{SESSION_ID_HINT}", scope=scope)
            else:
                await _answer(send, 404, "not_found", f"no route has an encoded slash (%2F) in a path segment: "
                              f"{clip(seg)}", scope=scope)
            return
        limit = int(api.max_body_bytes)
        cl = headers.get(b"content-length")
        if cl is not None:
            cl = cl.strip(b" \t")  # optional whitespace around a field value (RFC 9110 5.5): "  21 " is 21
            if not (cl.isdigit() and len(cl) <= 19):  # bytes.isdigit: ASCII digits only
                await _answer(send, 400, "bad_request", "malformed Content-Length", scope=scope)
                return
            if int(cl) > limit:
                await _answer(send, 413, "payload_too_large", f"body of {int(cl)} bytes is over the {limit}-byte limit",
                              scope=scope)
                return
            if int(cl) == 0:
                await _until_stopped(self.app, scope, receive, send)
                return
        elif scope.get("method") not in ("POST", "PUT", "PATCH"):
            await _until_stopped(self.app, scope, receive, send)  # no Content-Length, no body-carrying method
            return
        # read the whole body (a chunked one at most limit + 1 bytes) by the deadline, then replay it;
        # one timeout scope for the whole read (asyncio.wait_for would make a task per chunk), and none
        # when the body is in already (nearly every turn: see body_arrived)
        try:
            if body_arrived(receive):
                body = await _whole_body(receive, limit)
            else:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    body = await _whole_body(receive, limit)
        except _TooLarge:
            await _answer(send, 413, "payload_too_large", f"body is over the {limit}-byte limit", scope=scope)
            return
        except TimeoutError:
            await _answer(send, 408, "request_timeout",
                          f"the request body did not arrive within {api.body_read_timeout_s:g} s; "
                          "send it whole right after the headers", scope=scope)
            return
        if body is None:
            # nothing to answer: counted as the client's doing, not as a 500 (tester 37)
            scope[CLIENT_GONE] = True
            return
        state["body"] = body  # the invoke route reads it here, without a receive (api.proxy.invoke)
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await _until_stopped(self.app, scope, replayed, send)
