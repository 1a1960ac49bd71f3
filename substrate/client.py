"""A small Python client SDK for the REST API (httpx), used by the CLI and the tests.

    with SubstrateClient("http://127.0.0.1:8080") as c:
        s = c.create_session("counter")
        c.invoke(s["id"], "increment")        # -> {"count": 1}

Error answers raise ``ApiError`` carrying ``status``, ``code``, ``message`` and ``retry_after_s``; a server
that cannot be reached raises ``httpx.TransportError`` (after the retries a turn gets). An answer that is
not the API's JSON (a proxy's page, an empty body where the route has one, ``NaN``, a continue token
repeated) raises ``ApiError`` with its status and code ``error``.

An answer that comes from an older state than the session had (its worker was lost, its agent restarted,
a snapshot was corrupt: the API's ``X-Substrate-Restored``) is not silent here either: ``invoke`` and
``invoke_stream`` warn with :class:`StateRestoredWarning` (shown for every such answer), and
``invoke_answer`` returns the output with what the answer's headers say (:class:`Answer`).

Turns are safe to retry: ``invoke`` sends one ``Idempotency-Key`` per turn (or the caller's) and resends
the same key after a connection error or a retryable answer (502/503/504), up to ``retries`` times with
exponential back-off (honouring ``Retry-After``); the server answers a turn it already ran from its cache
instead of running it twice.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import quote

import httpx

from substrate.errors import clip
from substrate.labelselector import equality_selector
from substrate.models import IDEMPOTENCY_KEY_RE, MAX_IDEMPOTENCY_KEY_CHARS


class ApiError(Exception):
    """An error answer: ``status``, ``code``, ``message``, ``retry_after_s``, ``details``; ``replayed``:
    the answer was the kept one of a turn that already ran under the same key (``X-Substrate-Replayed``),
    not a new failure. An error after a streamed answer began has ``status`` 200 and
    ``details.mid_stream`` true, with the chunks that came before it in ``chunks``."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 details: dict[str, Any] | None = None, *, replayed: bool = False,
                 chunks: list[Any] | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.retry_after_s = retry_after_s
        self.details = details or {}
        self.replayed = replayed
        self.chunks = chunks or []


class StateRestoredWarning(UserWarning):
    """An answer of a session whose state came back older than it was (``X-Substrate-Restored``): the
    state since its last snapshot is gone. Shown every time (never only once per call site): a loss
    is never folded into an earlier one. ``warnings.simplefilter("error", StateRestoredWarning)`` makes it
    an exception, ``"ignore"`` silences it."""


@dataclass(frozen=True)
class Answer:
    """One turn's answer: ``output`` (the agent's; a list of chunks when ``streamed``), and what the
    answer's headers say about it:
    ``restored`` (``X-Substrate-Restored``, e.g. ``worker_lost;snapshot=none``: the state came back older
    than it was; None when it did not), ``restored_snapshot_at`` (Unix s of the state it came back to, if
    any), ``replayed`` (the turn had already run under this key: its kept answer), ``woke`` (the session
    was suspended and woken for this turn), ``worker`` and ``request_id``."""

    output: Any
    #: the answer was a streamed turn's lines (a replay of a turn first run with ``?stream``): ``output``
    #: is then the list of its chunks
    streamed: bool = False
    restored: str | None = None
    restored_snapshot_at: float | None = None
    replayed: bool = False
    woke: bool = False
    worker: str | None = None
    request_id: str | None = None

    @classmethod
    def of(cls, resp: httpx.Response, output: Any = None, *, streamed: bool = False) -> "Answer":
        h = resp.headers
        at = h.get("x-substrate-restored-snapshot-at")
        try:
            at_s = float(at) if at else None
        except ValueError:
            at_s = None
        return cls(output=output, streamed=streamed, restored=h.get("x-substrate-restored") or None,
                   restored_snapshot_at=at_s,
                   replayed=h.get("x-substrate-replayed") == "1", woke=h.get("x-substrate-woke") == "1",
                   worker=h.get("x-substrate-worker"), request_id=h.get("x-request-id"))

    def warn(self, sid: str) -> None:
        """Warn (:class:`StateRestoredWarning`) if this answer came from an older state."""
        if self.restored:
            # warn_explicit with no registry: the default filter's "once per call site" never folds one
            # loss into an earlier one, while "error" and "ignore" filters still apply
            frame = sys._getframe(2)  # the caller of invoke, or the code iterating invoke_stream
            warnings.warn_explicit(
                f"session {sid!r} answered from an older state than it had ({self.restored}): its state since "
                "its last snapshot is gone", StateRestoredWarning, frame.f_code.co_filename, frame.f_lineno,
                module=frame.f_globals.get("__name__"), registry=None, module_globals=frame.f_globals)


def _chunks(lines: Any, *, replayed: bool = False) -> Iterator[Any]:
    """The chunks of a streamed turn's NDJSON lines, in order; an error line (the turn failed after its
    answer began: a worker lost mid-stream, the agent raised) raises ``ApiError`` with its code and
    ``status`` 200 (the answer's status was already sent), ``details.mid_stream`` true, the chunks before
    it in ``chunks`` and ``replayed`` as given (the answer was a kept one). A line that is not a JSON
    object (a proxy's text in the stream) raises the same way with code ``error`` (it was a raw
    ``JSONDecodeError``), and so does a line of JSON the API never sends (``NaN``, nesting too deep: see
    ``_loads``)."""
    before: list[Any] = []
    for line in lines:
        if not line:
            continue
        msg = _loads(line)
        if not isinstance(msg, dict):
            raise ApiError(200, "error", f"a line of the streamed answer is not a JSON object ({clip(line, 200)}): "
                           "not the API's own answer (a proxy in between?)", details={"mid_stream": True},
                           replayed=replayed, chunks=before)
        if "chunk" in msg:
            before.append(msg["chunk"])
            yield msg["chunk"]
        elif "error" in msg:
            err = msg["error"] if isinstance(msg["error"], dict) else {"message": str(msg["error"])}
            code, message = err.get("code"), err.get("message")
            raise ApiError(200, code if isinstance(code, str) and code else "error",
                           message if isinstance(message, str) else "", details={"mid_stream": True},
                           replayed=replayed, chunks=before)


def _session_path(sid: str) -> str:
    """``/v1/sessions/<sid>`` with the ID percent-encoded; an empty ID is refused here (it would name the
    collection, which answers a redirect, not an error), and so are ``.`` and ``..``: percent-encoding
    leaves dots alone, and the HTTP library resolves them as path segments (``sessions get .`` listed
    every session; ``sessions delete .`` answered 405; fresh-user run). Raises ApiError 422
    ``invalid_session_id``."""
    if not isinstance(sid, str) or not sid:
        raise ApiError(422, "invalid_session_id", "a session ID must be a non-empty string")
    if sid in (".", ".."):
        raise ApiError(422, "invalid_session_id", f"{sid!r} is not a session ID (a path segment)")
    return "/v1/sessions/" + quote(sid, safe="")


def json_body(value: Any, what: str = "the input") -> bytes:
    """``value`` as the JSON body the API takes (UTF-8, compact), else ``ApiError`` 422 ``invalid_input``
    before anything is sent: a NaN, an infinity, a lone surrogate or an object JSON has no form for raised
    a bare ``ValueError``, ``TypeError`` or ``UnicodeEncodeError`` from the HTTP library (fresh-user runs).
    Sent as it is (``content=``, with ``JSON_HEADERS``), so the body is encoded once."""
    try:
        return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as e:
        # said as the character, not as the codec's position in the encoded body (fresh-user tester 53)
        bad = e.object[e.start] if isinstance(e.object, str) and e.start < len(e.object) else "?"
        raise ApiError(422, "invalid_input", f"{what} holds U+{ord(bad[0]):04X}, a lone surrogate: it has no UTF-8 "
                       "form (bytes that are not UTF-8 text, as a command line's undecodable bytes become)") from None
    except (ValueError, TypeError, RecursionError) as e:
        raise ApiError(422, "invalid_input", f"{what} is not JSON the API takes: {e}") from None


#: the headers of a body made by ``json_body``
JSON_HEADERS = {"Content-Type": "application/json"}


def checked_idempotency_key(key: str | None) -> str | None:
    """``key`` if the API would take it as an ``Idempotency-Key`` (``substrate.models.IDEMPOTENCY_KEY_RE``:
    1-200 printable ASCII characters, space to ``~``), None for None. Raises ``ApiError`` 422
    ``invalid_idempotency_key``, as the API would answer, before anything is sent: a non-ASCII key cannot
    even be put in a header, and the HTTP library's ``UnicodeEncodeError`` reached the CLI's user raw (a
    fresh-user run)."""
    if key is None or IDEMPOTENCY_KEY_RE.fullmatch(key) and key.strip():
        return key
    if not key.strip():
        raise ApiError(422, "invalid_idempotency_key",
                       "Idempotency-Key is empty or blank: give a key unique per turn, or none")
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise ApiError(422, "invalid_idempotency_key", f"Idempotency-Key is over {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    bad = next(i for i, ch in enumerate(key) if not " " <= ch <= "~")
    raise ApiError(422, "invalid_idempotency_key",
                   f"Idempotency-Key must be printable ASCII (space to ~): U+{ord(key[bad]):04X} at position {bad + 1}")


def bearer_token(token: str | None) -> str | None:
    """``token`` without surrounding whitespace (a key pasted with its newline or a CR), or None if that
    leaves nothing. Raises ``ApiError`` 401 ``invalid_token`` if what is left has a character other
    than visible ASCII (a control character, an inner space, a typographic quote): the message says
    where and never echoes the token (an HTTP library's error would print it whole, secret included)."""
    if token is None:
        return None
    token = token.strip()
    for i, ch in enumerate(token):
        if not "!" <= ch <= "~":
            what = "a control character" if ord(ch) < 32 or ord(ch) == 127 else (
                "a space" if ch.isspace() else f"the non-ASCII character U+{ord(ch):04X}")
            raise ApiError(401, "invalid_token", f"the API token has {what} at position {i + 1} of "
                           f"{len(token)}: an HTTP header cannot carry it (check how the key was copied)")
    return token or None


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds: delay-seconds, or an HTTP-date (RFC 9110 10.2.3, which
    a reverse proxy may send) as the seconds from now to it (0 for a date past). None for no header and for
    one that is neither (unparsable, negative or not finite): it is ignored, not raised (a ``ValueError``
    from ``float`` reached the caller: fresh-user run)."""
    if value is None or not value.strip():
        return None
    try:
        delay = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000" parses naive; an HTTP-date is always GMT
            when = when.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, when.timestamp() - time.time())
    return delay if math.isfinite(delay) and delay >= 0 else None


def _snippet(resp: httpx.Response, limit: int = 200) -> str:
    """The start of an answer's body on one line, for a message about an answer that is not the API's."""
    text = " ".join(resp.text.split())
    return "an empty body" if not text else repr(text[:limit]) + ("..." if len(text) > limit else "")


def _not_the_apis(resp: httpx.Response, why: str, *, replayed: bool = False) -> ApiError:
    """``ApiError`` code ``error`` (the code of any answer that is not the API's JSON) for an answer of
    ``resp``'s status whose body the API would never send (``why``): a reverse proxy's or a load
    balancer's page, a gateway's JSON. The message says so and quotes the body's start."""
    ctype = resp.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    return ApiError(resp.status_code, "error", f"HTTP {resp.status_code} answer whose body {why} ({ctype}: "
                    f"{_snippet(resp)}): not the API's own answer (a proxy in between?)",
                    retry_after_s(resp.headers.get("retry-after")), replayed=replayed)


_NOT_JSON = object()


def _no_constant(name: str) -> Any:
    """``parse_constant`` of ``_loads``: the API's JSON is strict (it never sends ``NaN`` or ``Infinity``)."""
    raise ValueError(f"{name} is not JSON")


def _loads(text: str | bytes) -> Any:
    """``text`` as strict JSON (no ``NaN``, ``Infinity``, ``-Infinity``), or ``_NOT_JSON``: a value the API
    never sends (``{"output": NaN}`` was handed on as ``nan``; an array nested 100,000 deep raised
    ``RecursionError`` from every call: fresh-user run)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # JSONDecodeError, and UnicodeDecodeError for bytes that are not text
        return _NOT_JSON


def _body(resp: httpx.Response) -> Any:
    """The answer's JSON (strict, see ``_loads``), or ``_NOT_JSON``."""
    return _loads(resp.content)


def _not_an_object(body: Any) -> str:
    """What a JSON body that is no object is, in JSON's words (``is JSON but not an object (an array)``)."""
    kind = ("null" if body is None else "a boolean" if isinstance(body, bool) else "a number"
            if isinstance(body, (int, float)) else "a string" if isinstance(body, str) else "an array")
    return f"is JSON but not an object ({kind})"


def _json_object(resp: httpx.Response) -> dict[str, Any]:
    """A success answer's body, a JSON object as every API answer is; else ``ApiError`` (see
    ``_not_the_apis``): a proxy's HTML page or a JSON list answered with status 200 raised a bare
    ``JSONDecodeError``, ``TypeError`` or ``KeyError`` further on, and an empty one is no answer either."""
    if not resp.content:
        raise _not_the_apis(resp, "is empty")
    body = _body(resp)
    if body is _NOT_JSON:
        raise _not_the_apis(resp, "is not JSON")
    if not isinstance(body, dict):
        raise _not_the_apis(resp, _not_an_object(body))
    return body


def _output(resp: httpx.Response) -> Any:
    """A plain turn's ``output`` (``ApiError`` code ``error`` for a body that is no object holding one)."""
    body = _json_object(resp)
    if "output" not in body:
        raise _not_the_apis(resp, "is a JSON object without an output")
    return body["output"]


def _raise_for(resp: httpx.Response) -> None:
    """Raises ``ApiError`` for an answer of status 300 or more: the API's ``code``, ``message`` and
    ``details``, and ``Retry-After`` in seconds (``retry_after_s``). A body that is not a JSON object
    (a reverse proxy's HTML page, a JSON list: an ``AttributeError`` before) is code ``error`` with a
    message saying what came; a JSON object without a ``code`` (another server's error) is code ``error``
    with the body as its message; a redirect (none is followed) names where it points."""
    if resp.status_code < 300:
        return
    replayed = resp.headers.get("x-substrate-replayed") == "1"
    body = _body(resp)
    if not isinstance(body, dict):
        if 300 <= resp.status_code < 400 and resp.headers.get("location"):
            raise ApiError(resp.status_code, "error", f"a redirect to {resp.headers['location']} (the client "
                           "follows none: is the server URL the API's base URL?)", replayed=replayed)
        raise _not_the_apis(resp, "is not JSON" if body is _NOT_JSON else _not_an_object(body), replayed=replayed)
    code, message, details = body.get("code"), body.get("message"), body.get("details")
    # each field as the API sends it, or a fallback: another server's JSON may hold anything there
    raise ApiError(resp.status_code, code if isinstance(code, str) and code else "error",
                   message if isinstance(message, str) else resp.text,
                   retry_after_s(resp.headers.get("retry-after")),
                   details if isinstance(details, dict) else None, replayed=replayed)


def next_continue(page: dict[str, Any], sent: set[str]) -> str | None:
    """The ``continue`` token of ``page`` (a page of a list call, as ``_req_items`` checked it) to send
    next, None at the end; ``sent``: the tokens sent so far for this listing (updated here). A token sent
    before raises ``ApiError`` 200 code ``error``: the API's tokens are keyset cursors that only move
    forward, and following one a server repeats loops forever (``iter_sessions`` did: fresh-user run)."""
    token = page["metadata"]["continue"]
    if not token:
        return None
    if token in sent:
        raise ApiError(200, "error", f"the server repeated the continue token {clip(token, 80)} it was "
                       "sent: following it would loop forever (not the API's answer: a proxy in between?)")
    sent.add(token)
    return token  # type: ignore[no-any-return]


def selector_text(selector: str | Mapping[str, str] | Sequence[str] | None) -> str | None:
    """``list_sessions``' ``label_selector`` as the query's text: a str as it is; a mapping of labels as
    its equality requirements (``{"team": "a"}`` -> ``"team=a"``, ``equality_selector``: ``ValueError``
    naming a key or value no selector can state); a list or tuple of requirements joined by commas
    (``["team=a", "env!=prod"]``). Anything else raises ``TypeError`` (a dict was sent as its repr)."""
    if selector is None or isinstance(selector, str):
        return selector
    if isinstance(selector, Mapping):
        return equality_selector(selector)
    if isinstance(selector, (list, tuple)):
        if not all(isinstance(r, str) for r in selector):
            raise TypeError("label_selector: each requirement of a list must be a str, e.g. ['team=a', 'env!=prod']")
        return ",".join(selector)
    raise TypeError(f"label_selector must be a str ('team=a,env!=prod'), a mapping of labels or a list of "
                    f"requirements, got {type(selector).__name__}")


def server_url_problem(url: str) -> str | None:
    """Why ``url`` (with a scheme) cannot name an API server, or None: a scheme other than http(s), no
    host, or a host with spaces (each was "cannot reach the API" at the first request: fresh-user
    round 11)."""
    if url != url.strip():  # "  http://h" read as scheme '' (fresh-user tester 53)
        return "has spaces around it"
    try:
        u = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as e:
        return f"is not a URL: {e}"
    if u.scheme not in ("http", "https"):
        return f"has scheme {u.scheme!r}: use http:// or https://"
    if not u.host:
        return "names no host: e.g. http://127.0.0.1:8080"
    if any(c.isspace() for c in url):
        return "has a space in it"
    # the client adds /v1/...: a URL ending in /v1 made every call /v1/v1/... (404), and a query or a
    # fragment was dropped from every call (fresh-user tester 52); a path before it is kept (a reverse
    # proxy's prefix)
    if u.query or u.fragment or "#" in url or "?" in url:  # a bare "?" too (tester 53)
        return "has a query or a fragment: give the server's base URL, e.g. http://127.0.0.1:8080"
    if u.port is not None and not 1 <= u.port <= 65535:
        return f"names port {u.port}: a port is 1 to 65535"
    if u.path.rstrip("/").endswith("/v1"):
        return f"ends in /v1, which every call adds: use {url.rstrip('/')[:-3] or url}"
    return None


def _check_number(name: str, value: Any, accepted: str, *, positive: bool = False) -> None:
    """``ValueError`` naming ``name`` and what it accepts unless ``value`` is a finite int or float that is
    >= 0 (> 0 if ``positive``)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
    if not ok:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


class SubstrateClient:
    """Synchronous client. ``base_url`` like ``http://127.0.0.1:8080``; ``token`` for bearer auth."""

    #: answers worth retrying a turn on (the turn was not acknowledged; the same key makes it safe)
    RETRYABLE_STATUS = (502, 503, 504)

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 60.0,
                 retries: int = 3, retry_backoff_s: float = 0.2,
                 transport: httpx.BaseTransport | None = None) -> None:
        """Raises ``ApiError`` 401 ``invalid_token`` (before any request) if ``token``, once stripped of
        surrounding whitespace (a copied key's trailing newline), has a character an HTTP header cannot
        carry (the message never contains the token), and 400 ``invalid_server_url`` if ``base_url`` has
        no scheme. Raises ``TypeError`` naming the parameter if ``base_url`` is not a str or ``token``
        neither a str nor None. Raises ``ValueError`` naming the parameter and its range unless ``timeout_s`` is a
        finite number of seconds above 0, ``retries`` a whole number from 0 and ``retry_backoff_s`` a
        finite number of seconds from 0 (``retries=-1`` failed at the first turn with ``AssertionError``,
        ``timeout_s=0`` with a ``ConnectError``: fresh-user run)."""
        _check_number("timeout_s", timeout_s, "a finite number of seconds > 0", positive=True)
        _check_number("retry_backoff_s", retry_backoff_s, "a finite number of seconds >= 0")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a whole number >= 0 (0: no retry), got {retries!r}")
        # checked first: `SubstrateClient(None)` raised "argument of type 'NoneType' is not iterable"
        if not isinstance(base_url, str):
            raise TypeError(f"base_url must be the API server's URL as a str, e.g. 'http://127.0.0.1:8080', "
                            f"got {type(base_url).__name__}")
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token must be a str (the API key) or None, got {type(token).__name__}")
        token = bearer_token(token)
        if "://" not in base_url:  # httpx read "localhost:8080" as scheme "localhost" (fresh-user run)
            raise ApiError(400, "invalid_server_url", f"server URL {base_url!r} has no scheme: use "
                           f"http://{base_url} (or https://)")
        if problem := server_url_problem(base_url):
            raise ApiError(400, "invalid_server_url", f"server URL {base_url!r} {problem}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers,
                                 transport=transport)
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "SubstrateClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _req(self, method: str, path: str, *, no_content: bool = False, **kw: Any) -> Any:
        """``method path`` -> the answer's JSON object; None for a 204 where the route answers one
        (``no_content``: DELETE). Any other answer without a body (a 200 with an empty body, a 204 of a
        route that always has a body) raises ``ApiError`` code ``error`` (see ``_not_the_apis``): it was
        returned as None, and the caller failed further on with a ``TypeError``."""
        resp = self.http.request(method, path, **kw)
        _raise_for(resp)
        return None if no_content and resp.status_code == 204 else _json_object(resp)

    def _req_items(self, path: str, *, paged: bool = True, **kw: Any) -> dict[str, Any]:
        """``GET path`` of a list route: ``{"items": [...], "metadata": {"continue": str | None}}`` (no
        ``metadata`` needed without ``paged``). Another JSON object (a proxy's or gateway's, with a 200)
        raises ``ApiError`` code ``error`` saying so: indexing it raised ``KeyError`` (tester 54's helper)."""
        resp = self.http.request("GET", path, **kw)
        _raise_for(resp)
        body = _json_object(resp)
        meta = body.get("metadata")
        if not isinstance(body.get("items"), list) or paged and not (
                isinstance(meta, dict) and (meta.get("continue") is None or isinstance(meta.get("continue"), str))):
            raise _not_the_apis(resp, "is JSON but no page of items (`items`, `metadata.continue`)")
        return body

    def create_session(self, template: str, *, id: str | None = None, labels: dict[str, str] | None = None,
                       env: dict[str, str] | None = None, tenant: str | None = None) -> dict[str, Any]:
        """Create and start a session of ActorTemplate ``template`` -> the session (its ``id``,
        ``state`` RUNNING, ``worker``...). ``tenant``: admins only, create it for that tenant."""
        body: dict[str, Any] = {"actorTemplate": template}
        if id is not None:
            body["id"] = id
        if labels:
            body["labels"] = labels
        if env:
            body["env"] = env
        content = json_body(body, "the session's body (env, labels)")
        # `is not None`: an empty tenant is sent, and refused (422 invalid_tenant), not read as "mine"
        return self._req("POST", "/v1/sessions", content=content, headers=JSON_HEADERS,
                         params={"tenant": tenant} if tenant is not None else None)

    def get_session(self, sid: str) -> dict[str, Any]:
        return self._req("GET", _session_path(sid))

    def list_sessions(self, *, state: str | None = None, template: str | None = None, limit: int = 100,
                      continue_: str | None = None, tenant: str | None = None,
                      label_selector: str | Mapping[str, str] | Sequence[str] | None = None) -> dict[str, Any]:
        """One page of sessions: ``{items, metadata: {continue}}`` (``tenant``: admins only, one tenant's).
        ``state`` in any case (``"running"``), as the CLI takes it: the API takes the upper-case names
        only. ``label_selector``: Kubernetes-style, e.g. ``"team=a,env!=prod"`` or ``"tier in (web,api)"``
        (``substrate.labelselector``; a malformed one is ``ApiError`` 422 ``invalid_input``), or a mapping
        of labels (``{"team": "a"}``: each with that value) or a list of requirements (``selector_text``:
        ``ValueError``/``TypeError`` before anything is sent). A filtered
        page may hold fewer than ``limit`` items with a ``continue`` still (``iter_sessions`` follows it)."""
        if isinstance(state, str):
            state = state.strip().upper()
        params = {k: v for k, v in {"state": state, "template": template, "limit": limit,
                                    "continue": continue_, "tenant": tenant,
                                    "labelSelector": selector_text(label_selector)}.items() if v is not None}
        return self._req_items("/v1/sessions", params=params)

    def iter_sessions(self, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every session matching ``filters``, following ``continue`` tokens (from ``continue_``, if given).
        A server that answers a token already sent raises ``ApiError`` code ``error`` (``next_continue``)."""
        token = filters.pop("continue_", None)
        sent = {token} if token else set()
        while True:
            page = self.list_sessions(continue_=token, **filters)
            yield from page["items"]
            token = next_continue(page, sent)
            if token is None:
                return

    def invoke(self, sid: str, input: Any, *, idempotency_key: str | None = None) -> Any:  # noqa: A002
        """One turn; returns the agent's ``output``. Retried with the same idempotency key (see the
        module docstring); raises ``ApiError`` once retries are spent or for a non-retryable answer.
        Warns ``StateRestoredWarning`` when the answer came from an older state (``invoke_answer`` gives
        the answer's headers instead)."""
        answer = self.invoke_answer(sid, input, idempotency_key=idempotency_key)
        answer.warn(sid)
        return answer.output

    def invoke_answer(self, sid: str, input: Any, *, idempotency_key: str | None = None,  # noqa: A002
                      key_is_auto: bool = False) -> Answer:
        """``invoke``, returning the :class:`Answer` (output and what its headers say), without a warning.
        Without ``idempotency_key`` the turn gets a key of its own for the retries here, sent as an
        automatic one (``X-Substrate-Key-Origin: auto``): the worker lets such keys make room first, so
        any number of such turns never pushes a caller's own key out of its window. ``key_is_auto``: the
        ``idempotency_key`` given was made up by the caller (to name it for a resend, as the CLI does
        when interrupted), not its own: sent as an automatic one too."""
        content = json_body({"input": input})
        given = checked_idempotency_key(idempotency_key)
        auto = given is None or key_is_auto
        key = given if given is not None else uuid.uuid4().hex
        extra = {"X-Substrate-Key-Origin": "auto"} if auto else {}
        path = _session_path(sid) + "/invoke"
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                resp = self.http.post(path, content=content,
                                      headers={**JSON_HEADERS, "Idempotency-Key": key, **extra})
            except (httpx.TransportError,):
                if last:
                    raise
                self._backoff(attempt, None)
                continue
            if resp.status_code in self.RETRYABLE_STATUS and not last:
                self._backoff(attempt, retry_after_s(resp.headers.get("retry-after")))
                continue
            _raise_for(resp)
            if resp.headers.get("content-type", "").startswith("application/x-ndjson"):
                # the replay of a streamed turn under this key: it comes as it first ran (its lines); the
                # output is its chunks in order (a raw JSONDecodeError before: fresh-user round 24)
                chunks = list(_chunks(resp.text.splitlines(), replayed=resp.headers.get("x-substrate-replayed") == "1"))
                return Answer.of(resp, chunks, streamed=True)
            return Answer.of(resp, _output(resp))
        raise AssertionError("unreachable")  # pragma: no cover: retries >= 0 (the constructor checks it)

    def _backoff(self, attempt: int, retry_after_s: float | None) -> None:
        delay = self.retry_backoff_s * (2 ** attempt)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, 5.0)) if self.retry_backoff_s else 0.0
        time.sleep(delay)

    def invoke_stream(self, sid: str, input: Any, *, idempotency_key: str | None = None,  # noqa: A002
                      on_answer: Callable[[Answer], None] | None = None, key_is_auto: bool = False) -> Iterator[Any]:
        """One streamed turn; yields the agent's chunks. Not retried here (chunks may have been yielded);
        a caller that retries passes the same ``idempotency_key``: a turn that ran is answered again from
        its kept lines, never run twice (a plain turn's kept answer comes back as one chunk).
        ``key_is_auto``: ``idempotency_key`` was made up, not the caller's own (it makes room first).
        ``on_answer`` is called once the answer's headers are in, before the first chunk, with an
        :class:`Answer` whose ``output`` is None; without it, an answer from an older state warns
        ``StateRestoredWarning``."""
        content = json_body({"input": input})
        key = checked_idempotency_key(idempotency_key)
        headers = {**JSON_HEADERS, **({"Idempotency-Key": key} if key is not None else {})}
        if key is not None and key_is_auto:  # made up by the caller for a resend (see invoke_answer)
            headers["X-Substrate-Key-Origin"] = "auto"
        with self.http.stream("POST", _session_path(sid) + "/invoke", params={"stream": "true"},
                              content=content, headers=headers) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            if on_answer is not None:
                on_answer(Answer.of(resp))
            else:
                Answer.of(resp).warn(sid)
            if resp.headers.get("content-type", "").startswith("application/json"):
                resp.read()  # the replay of a plain turn under this key: its answer as it was
                yield _output(resp)
                return
            yield from _chunks(resp.iter_lines(), replayed=resp.headers.get("x-substrate-replayed") == "1")

    def suspend(self, sid: str) -> dict[str, Any]:
        return self._req("POST", _session_path(sid) + "/suspend")

    def resume(self, sid: str, *, worker: str | None = None) -> dict[str, Any]:
        """Wake a session now; ``worker`` pins it to one worker."""
        # an empty name is sent (the API refuses it), not dropped: the pin silently went (tester 52)
        return self._req("POST", _session_path(sid) + "/resume", json={"worker": worker} if worker is not None else None)

    def delete_session(self, sid: str) -> None:
        self._req("DELETE", _session_path(sid), no_content=True)

    def pools(self) -> list[dict[str, Any]]:
        return self._req_items("/v1/workerpools", paged=False)["items"]  # type: ignore[no-any-return]

    def templates(self) -> list[dict[str, Any]]:
        return self._req_items("/v1/actortemplates", paged=False)["items"]  # type: ignore[no-any-return]

    def session_events(self, sid: str, *, limit: int = 100, continue_: str | None = None) -> dict[str, Any]:
        """One page of a session's audit records: ``{items, metadata: {continue}}``."""
        params: dict[str, Any] = {"limit": limit}
        if continue_:
            params["continue"] = continue_
        return self._req_items(_session_path(sid) + "/events", params=params)

    def events(self, *, tenant: str | None = None, limit: int = 100, continue_: str | None = None) -> dict[str, Any]:
        """One page of the caller's tenant's audit records (admins: ``tenant``'s)."""
        params: dict[str, Any] = {"limit": limit}
        if tenant is not None:  # an empty one is sent (and refused), not dropped
            params["tenant"] = tenant
        if continue_:
            params["continue"] = continue_
        return self._req_items("/v1/events", params=params)

    def stats(self) -> dict[str, Any]:
        return self._req("GET", "/v1/stats")

    def snapshot_store(self) -> dict[str, Any]:
        """The snapshot store as the server finds it: ``{"location", "verified", "fenced"}`` (``fenced``: why
        suspends and wakes answer 503, or None). Admins and open mode only (``ApiError`` 403 ``forbidden``)."""
        return self._req("GET", "/v1/snapshotstore")

    def adopt_snapshot_store(self) -> dict[str, Any]:
        """Take the store as the runtime's when its marker object is missing (its objects lost for good):
        ``{"adopted": bool, "location": str}``. Sessions whose snapshots are gone fall back at their next wake.
        ``ApiError`` 409 ``store_taken`` if another runtime's marker is there; 403 for a non-admin."""
        return self._req("POST", "/v1/snapshotstore/adopt")
