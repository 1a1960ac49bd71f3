"""JSON bodies and query parameters the API refuses before anything is done (fresh-user run): a body
that is not UTF-8 (a BOM, UTF-16: Python's ``json.loads`` of bytes guesses the encoding, so routes took
them), an invoke envelope with fields beside ``input`` (dropped silently, while create refuses unknown
fields), and a query parameter given twice (FastAPI silently kept one)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from api import proxy
from api.guard import Guard
from substrate.errors import BadRequest, InvalidInput
from substrate.settings import Settings

BODIES = {
    "utf-16 with BOM": lambda d: json.dumps(d).encode("utf-16"),
    "utf-8 with BOM": lambda d: b"\xef\xbb\xbf" + json.dumps(d).encode(),
    "utf-16-le": lambda d: json.dumps(d).encode("utf-16-le"),
    "utf-32": lambda d: json.dumps(d).encode("utf-32"),
    "latin-1": lambda d: json.dumps(d, ensure_ascii=False).encode("latin-1"),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_a_body_that_is_not_utf8_is_bad_json_on_invoke_and_the_control_plane(name: str) -> None:
    encode = BODIES[name]
    for check, doc in [(proxy.check_invoke_body, {"input": "caf\u00e9"}),
                       (proxy.check_json_keys, {"actorTemplate": "caf\u00e9"})]:
        with pytest.raises(BadRequest) as e:
            check(encode(doc))
        assert e.value.code == "bad_json" and "must be UTF-8 JSON" in e.value.message, (name, check)


def test_utf8_bodies_still_pass_and_a_lone_surrogate_is_still_invalid_input() -> None:
    proxy.check_invoke_body(json.dumps({"input": "caf\u00e9 \u2603"}, ensure_ascii=False).encode())
    proxy.check_json_keys(json.dumps({"actorTemplate": "caf\u00e9"}, ensure_ascii=False).encode())
    with pytest.raises(InvalidInput) as e:
        proxy.check_invoke_body(b'{"input": "\\ud800"}')  # a lone surrogate as a JSON escape: valid JSON
    assert e.value.code == "invalid_input"
    # its code point as raw UTF-8-like bytes is no UTF-8 (RFC 3629): not JSON text (fresh-user run 35)
    for check in (proxy.check_invoke_body, proxy.check_json_keys):
        with pytest.raises(BadRequest) as e2:
            check(b'{"input": "\xed\xa0\x80"}')
        assert e2.value.code == "bad_json" and "not UTF-8" in e2.value.message


def test_invoke_refuses_fields_beside_input_as_create_does() -> None:
    with pytest.raises(InvalidInput) as e:
        proxy.check_invoke_body(b'{"input": 1, "strem": true, "timeout": 5}')
    assert e.value.code == "invalid_input" and e.value.status == 422
    assert e.value.details["errors"] == [{"loc": ["body", "strem"], "msg": "Extra inputs are not permitted"},
                                         {"loc": ["body", "timeout"], "msg": "Extra inputs are not permitted"}]
    assert "body.strem" in e.value.message
    proxy.check_invoke_body(b'{"input": {"any": "free-form", "fields": 1}}')  # the input itself is free


async def test_a_repeated_query_parameter_is_422_naming_it_before_the_app_runs() -> None:
    ran: list[str] = []

    async def endpoint(request: Request) -> Any:
        ran.append(request.url.query)
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/sessions", endpoint, methods=["GET", "POST"])])
    guarded = Guard(app, get_settings=lambda scope: (Settings(), None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
        for query, name in [("limit=5&limit=7", "limit"), ("state=RUNNING&limit=1&state=FAILED", "state"),
                            ("continue=&continue=x", "continue")]:
            r = await c.get(f"/v1/sessions?{query}")
            assert r.status_code == 422, r.text
            body = r.json()
            assert body["code"] == "invalid_input" and f"query.{name}" in body["message"]
            assert body["details"]["errors"][0]["loc"] == ["query", name]
        r = await c.post("/v1/sessions?limit=1&limit=1", json={})
        assert r.status_code == 422
        assert ran == []
        assert (await c.get("/v1/sessions?limit=5&state=RUNNING")).status_code == 200
        assert ran == ["limit=5&state=RUNNING"]


@pytest.mark.parametrize("method,url,name", [
    ("GET", "/v1/sessions?stat=SUSPENDED", "stat"),
    ("GET", "/v1/sessions?state=RUNNING&limt=3", "limt"),
    ("POST", "/v1/sessions/s1/invoke?streem=true", "streem"),
    ("POST", "/v1/sessions/s1/suspend?x=1", "x"),
    ("HEAD", "/v1/sessions/s1?verbose=1", "verbose"),
])
async def test_a_query_parameter_the_route_does_not_take_is_422_naming_it(method: str, url: str, name: str) -> None:
    """A fresh-user run: ``?stat=SUSPENDED`` listed every session, ``invoke?streem=true`` ran an unstreamed
    turn and ``suspend?x=1`` suspended; each typo is refused before the app runs (nothing is done: this
    app has no runtime, so reaching a route would fail otherwise), naming the parameter and, where the
    route takes some, those."""
    from api.app import create_app

    app = create_app(Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://t") as c:
        r = await c.request(method, url, json={"input": 1} if "invoke" in url else None)
    assert r.status_code == 422, r.text
    if method != "HEAD":
        body = r.json()
        assert body["code"] == "invalid_input" and f"query.{name}" in body["message"]
        if "sessions?" in url:
            assert "state" in body["message"] and "limit" in body["message"]


@pytest.mark.parametrize("method,url", [("GET", "/v1/sessions?state=RUNNING&limit=3&template=counter"),
                                        ("POST", "/v1/sessions/s1/invoke?stream=1"),
                                        ("GET", "/v1/sessions/s1/events?limit=2")])
async def test_the_query_parameters_a_route_takes_pass_the_check(method: str, url: str) -> None:
    from api.app import create_app

    app = create_app(Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://t") as c:
        r = await c.request(method, url, json={"input": 1} if "invoke" in url else None)
    assert "query." not in r.text, r.text  # whatever the runtime-less app answers, not the check's refusal
