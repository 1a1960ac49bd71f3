"""The invoke hot path (``api.hotpath``): a turn is dispatched ahead of FastAPI's middleware stack, yet
through the same front door (``Guard``), the same request counter and the same 500 ``internal`` answer
as every other route; any other request still goes through FastAPI."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from api import proxy
from api.app import create_app
from api.hotpath import INVOKE_PATH
from substrate import metrics
from substrate.settings import Settings

_TURN = json.dumps({"input": "get"}).encode()


def _app(monkeypatch: pytest.MonkeyPatch, invoke: Any, settings: Settings | None = None) -> Any:
    monkeypatch.setattr(proxy, "invoke", invoke)  # create_app binds proxy.invoke when it builds the hot path
    app = create_app(settings or Settings())

    async def not_fastapi(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError(f"{scope['method']} {scope['path']} went through FastAPI's stack")

    app.middleware_stack = not_fastapi  # what FastAPI would run: a turn must never get here
    return app


def _client(app: Any, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)  # no lifespan
    return httpx.AsyncClient(transport=transport, base_url="http://localhost")


def _requests(code: str) -> float:
    return metrics.REQUESTS_TOTAL.labels(route=INVOKE_PATH, code=code)._value.get()


async def test_a_turn_skips_fastapis_stack_and_keeps_its_path_parameter_and_route_label(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bytes]] = []

    async def invoke(request: Request) -> Response:
        seen.append((request.path_params["sid"], await request.body()))
        assert request.app.state is not None  # the app is in the scope, as Starlette's router puts it
        return Response(b'{"output": 1}', media_type="application/json")

    app = _app(monkeypatch, invoke)
    before = _requests("200")
    async with _client(app) as c:
        r = await c.post("/v1/sessions/s-1.a_b/invoke", content=_TURN, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json() == {"output": 1}
    assert seen == [("s-1.a_b", _TURN)]
    assert _requests("200") == before + 1  # labelled with the route's template, not the raw path


async def test_everything_else_still_goes_through_fastapi(monkeypatch: pytest.MonkeyPatch) -> None:
    async def invoke(request: Request) -> Response:
        raise AssertionError("not a turn")

    app = _app(monkeypatch, invoke)
    async with _client(app) as c:
        for method, path in [("GET", "/v1/sessions/s-1/invoke"), ("POST", "/v1/sessions/s-1/suspend"),
                             ("POST", "/v1/sessions/a/b/invoke"), ("POST", "/v1/sessions//invoke")]:
            with pytest.raises(AssertionError, match="went through FastAPI's stack"):
                await c.request(method, path)


async def test_the_front_door_still_guards_a_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    async def invoke(request: Request) -> Response:
        calls.append(request.path_params["sid"])
        return Response(b"{}", media_type="application/json")

    settings = Settings()
    settings.api.auth_token = "sekret"
    settings.api.max_body_bytes = 64
    app = _app(monkeypatch, invoke, settings)
    async with _client(app) as c:
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", r.text
        auth = {"Authorization": "Bearer sekret"}
        r = await c.post("/v1/sessions/s-1/invoke", content=b'{"input": "' + b"x" * 100 + b'"}', headers=auth)
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers={**auth, "Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["code"] == "cross_origin_request", r.text
        assert calls == []  # none of them reached the route
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers=auth)
        assert r.status_code == 200 and calls == ["s-1"]


async def test_an_unexpected_error_in_a_turn_is_500_internal_in_json_and_is_raised_for_the_log(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def invoke(request: Request) -> Response:
        raise RuntimeError("a bug")

    app = _app(monkeypatch, invoke)
    internal = metrics.ERRORS_TOTAL.labels(code="internal")._value.get()
    answered_500 = _requests("500")
    async with _client(app, raise_app_exceptions=False) as c:
        r = await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers={"Content-Type": "application/json"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["code"] == "internal" and "RuntimeError" in r.json()["message"]
    assert metrics.ERRORS_TOTAL.labels(code="internal")._value.get() == internal + 1
    assert _requests("500") == answered_500 + 1  # counted once, under the route
    async with _client(app) as c:  # the server sees the error too (it logs the traceback)
        with pytest.raises(RuntimeError, match="a bug"):
            await c.post("/v1/sessions/s-1/invoke", content=_TURN, headers={"Content-Type": "application/json"})


async def test_an_error_after_the_answer_began_is_not_answered_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half an answer is the server's to end (it closes the connection): no 500 is sent after a 200's head."""
    sent: list[dict[str, Any]] = []

    async def invoke(request: Request) -> Response:
        class Broken(Response):
            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                await send({"type": "http.response.start", "status": 200, "headers": []})
                raise RuntimeError("mid-answer")
        return Broken()

    app = _app(monkeypatch, invoke)
    scope = {"type": "http", "method": "POST", "path": "/v1/sessions/s-1/invoke", "raw_path": b"/v1/sessions/s-1/invoke",
             "query_string": b"", "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                                              (b"content-length", str(len(_TURN)).encode())],
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "root_path": ""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": _TURN, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    with pytest.raises(RuntimeError, match="mid-answer"):
        await app(scope, receive, send)
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]
