"""What the front door (``api.guard.Guard``) answers itself, on invoke's hot path and on FastAPI's routes
alike (fresh-user run, 2026-12-04): every answer carries an ``X-Request-ID`` (a refusal included, and a
new one when the client's is invalid), every refusal is counted in ``agent_substrate_requests_total``
under its route's template (a 405 too), a 401 names its scheme (``WWW-Authenticate``), a request with
two ``Host``, ``Authorization`` or ``X-Request-ID`` headers is refused instead of one being used
silently, and a refusal keeps the connection when the request has no body left unread."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.hotpath import INVOKE_PATH
from substrate import metrics
from substrate.errors import DirectoryUnavailable
from substrate.settings import Settings

_ID = re.compile(r"[0-9a-f]{32}")
_JSON = {"Content-Type": "application/json"}
_TURN = b'{"input": "get"}'


@pytest.fixture
def client() -> httpx.AsyncClient:
    settings = Settings()
    settings.api.auth_token = "sekret"
    settings.api.max_body_bytes = 64
    app = create_app(settings)  # no lifespan: the front door's own answers need no runtime
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


def _count(route: str, code: int) -> float:
    return metrics.REQUESTS_TOTAL.labels(route=route, code=str(code))._value.get()


AUTH = {"Authorization": "Bearer sekret"}
CASES: list[tuple[str, str, str, dict[str, str], bytes, int, str]] = [
    # (case, method, path, headers, body, status, code)
    ("no token", "POST", "/v1/sessions/s-1/invoke", _JSON, _TURN, 401, "unauthorized"),
    ("cross-origin", "POST", "/v1/sessions/s-1/invoke", {**AUTH, **_JSON, "Origin": "http://evil.example"}, _TURN,
     403, "cross_origin_request"),
    ("body over the limit", "POST", "/v1/sessions/s-1/invoke", {**AUTH, **_JSON}, b"x" * 100, 413,
     "payload_too_large"),
    ("unknown query parameter", "POST", "/v1/sessions/s-1/invoke?streem=1", {**AUTH, **_JSON}, _TURN, 422,
     "invalid_input"),
    ("encoded slash", "POST", "/v1/sessions/a%2Fb/invoke", {**AUTH, **_JSON}, _TURN, 422, "invalid_session_id"),
    ("bad X-Request-ID", "POST", "/v1/sessions/s-1/invoke", {**AUTH, **_JSON, "X-Request-ID": "has space"}, _TURN,
     422, "invalid_request_id"),
    ("wrong method", "GET", "/v1/sessions/s-1/invoke", AUTH, b"", 405, "method_not_allowed"),
]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
async def test_every_refusal_carries_a_request_id_and_is_counted_under_its_route(
        client: httpx.AsyncClient, case: str) -> None:
    _, method, path, headers, body, status, code = next(c for c in CASES if c[0] == case)
    # a %2F segment counts as the one segment it was sent as: the invoke route's 422 (it was "unmatched")
    route = INVOKE_PATH
    before = _count(route, status)
    async with client as c:
        r = await c.request(method, path, headers=headers, content=body)
    assert r.status_code == status and r.json()["code"] == code, r.text
    assert _ID.fullmatch(r.headers.get("x-request-id", "")), r.headers  # made for it: none valid was sent
    assert _count(route, status) == before + 1  # under the template, also for the 405


async def test_a_valid_request_id_is_echoed_on_a_refusal_and_401_names_its_scheme(client: httpx.AsyncClient) -> None:
    async with client as c:
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers={**_JSON, "X-Request-ID": "trace-7"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "trace-7"
    assert r.headers["www-authenticate"] == 'Bearer realm="substrate"'


@pytest.mark.parametrize("name,status,code", [("Host", 400, "bad_request"), ("Authorization", 400, "bad_request"),
                                              ("X-Request-ID", 422, "invalid_request_id")])
async def test_a_header_that_must_come_once_is_refused_when_it_comes_twice(
        client: httpx.AsyncClient, name: str, status: int, code: str) -> None:
    values = {"Host": ("localhost", "evil.example"), "Authorization": ("Bearer sekret", "Bearer other"),
              "X-Request-ID": ("dup-a", "dup-b")}[name]
    auth = [] if name == "Authorization" else list(AUTH.items())
    headers = [*auth, *_JSON.items(), (name, values[0]), (name, values[1])]
    async with client as c:
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers=headers)
    assert r.status_code == status and r.json()["code"] == code, r.text
    assert f"{name} is sent more than once" in r.json()["message"]
    assert _ID.fullmatch(r.headers["x-request-id"])  # neither of two X-Request-IDs is echoed


async def test_a_refusal_closes_the_connection_only_when_a_body_may_be_left_unread(client: httpx.AsyncClient) -> None:
    async with client as c:
        no_body = await c.post("/v1/sessions/s-1/suspend")  # 401, nothing unread
        with_body = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers=_JSON)  # 401, body unread
    assert no_body.status_code == with_body.status_code == 401
    assert "connection" not in no_body.headers
    assert with_body.headers["connection"] == "close"


async def test_a_path_no_route_serves_is_counted_as_unmatched(client: httpx.AsyncClient) -> None:
    before = _count("unmatched", 404)
    async with client as c:
        r = await c.get("/v1/nope", headers=AUTH)
    assert r.status_code == 404 and _ID.fullmatch(r.headers["x-request-id"])
    assert _count("unmatched", 404) == before + 1


async def test_content_type_twice_is_refused_and_spaces_around_a_request_id_are_not_part_of_it(
        client: httpx.AsyncClient) -> None:
    async with client as c:
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN,
                         headers=[*AUTH.items(), ("Content-Type", "application/json"), ("Content-Type", "text/plain")])
        assert r.status_code == 400 and "Content-Type is sent more than once" in r.json()["message"], r.text
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers={**_JSON, "X-Request-ID": "  trace-8\t"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "trace-8"


async def _asgi(app: Any, scope: dict[str, Any], body: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
    """One request straight through the ASGI app (a scope httpx cannot make: no Host)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def _scope(path: str, headers: list[tuple[bytes, bytes]], http_version: str = "1.1") -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": http_version, "method": "GET",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080), "state": {}}


async def test_an_http11_request_without_host_is_400_and_http10_passes() -> None:
    app = create_app(Settings())  # open mode
    status, headers, body = await _asgi(app, _scope("/v1/nope", []))
    assert status == 400 and json.loads(body)["code"] == "bad_request" and b"Host" in body
    assert _ID.fullmatch(headers[b"x-request-id"].decode())
    status, _, _ = await _asgi(app, _scope("/v1/nope", [], http_version="1.0"))
    assert status == 404  # no Host in HTTP/1.0: passed on (no browser sends such a request)


async def test_options_star_names_the_servers_methods() -> None:
    """RFC 9110 9.3.7: ``OPTIONS *`` is about the server; it was 404 "no route for *" (fresh-user run 36)."""
    app = create_app(Settings())
    scope = {**_scope("*", [(b"host", b"localhost")]), "method": "OPTIONS"}
    status, headers, body = await _asgi(app, scope)
    assert status == 204 and body == b"", body
    assert headers[b"allow"] == b"GET, HEAD, POST, DELETE, OPTIONS"


@pytest.mark.parametrize("version", ["2.0", "2", "3.0", "0.9"])
async def test_another_major_http_version_is_505(version: str) -> None:
    """Fresh-user run 36: a text request line ``HTTP/2.0`` was served as HTTP/1.1 (RFC 9110 15.6.6)."""
    app = create_app(Settings())
    status, headers, body = await _asgi(app, _scope("/v1/sessions", [(b"host", b"localhost")], http_version=version))
    assert status == 505 and json.loads(body)["code"] == "http_version_not_supported", body
    assert f"HTTP/{version} is not supported".encode() in body and _ID.fullmatch(headers[b"x-request-id"].decode())


@pytest.mark.parametrize("host,why", [(b"localhost:abc", b"is not host[:port]"),
                                      (b"localhost:99999", b"above 65535"), (b"evil.example/x", b"host[:port]"),
                                      (b"a b", b"host[:port]"), (b"[::1", b"host[:port]"),
                                      (b"localhost:80:80", b"host[:port]"), (b"[127.0.0.1]", b"host[:port]")])
@pytest.mark.parametrize("token", [None, "sekret"])
async def test_a_malformed_host_is_400_in_every_mode(host: bytes, why: bytes, token: str | None) -> None:
    """A fresh-user run: ``Host: localhost:abc`` and ``localhost:99999`` were served in open mode. RFC 9112
    3.2: a request with an invalid Host is answered 400, whatever the mode, before anything is done."""
    settings = Settings()
    settings.api.auth_token = token
    app = create_app(settings)
    headers = [(b"host", host)] + ([(b"authorization", b"Bearer sekret")] if token else [])
    status, answer_headers, body = await _asgi(app, _scope("/v1/stats", headers))
    assert status == 400 and json.loads(body)["code"] == "bad_request" and why in body, body
    assert _ID.fullmatch(answer_headers[b"x-request-id"].decode())


@pytest.mark.parametrize("host", [b"localhost", b"localhost:8080", b"127.0.0.1:1", b"[::1]:8080", b"[::1]",
                                  b"localhost:", b"localhost \t", b"[0:0:0:0:0:0:0:1]:80"])
async def test_a_well_formed_host_passes(host: bytes) -> None:
    status, _, _ = await _asgi(create_app(Settings()), _scope("/v1/nope", [(b"host", host)]))
    assert status == 404  # past the front door, to the routes


class _DownAuth:
    enabled = True

    async def authenticate(self, headers: Any) -> Any:
        raise DirectoryUnavailable("cannot check the API key: Redis is away")


async def test_a_503_of_the_front_doors_authentication_says_when_to_retry() -> None:
    settings = Settings()
    app = create_app(settings)
    app.state.runtime = SimpleNamespace(settings=settings, auth=_DownAuth())  # what the lifespan would set
    status, headers, body = await _asgi(app, _scope("/v1/sessions", [(b"host", b"localhost"),
                                                                     (b"authorization", b"Bearer sk_x")]))
    assert status == 503 and json.loads(body)["code"] == "directory_unavailable"
    assert headers[b"retry-after"] == b"1"
