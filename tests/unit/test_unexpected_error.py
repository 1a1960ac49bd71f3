"""An unexpected error (a bug: no code was made for it) is 500 ``internal`` in JSON, written as every
error body is (README: ``internal``, an unexpected error, logged): Starlette answered it in plain text."""

from __future__ import annotations

import json

import httpx

from api.app import create_app
from substrate.settings import Settings


async def test_an_unexpected_error_is_500_internal_in_json() -> None:
    app = create_app(Settings())

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # no lifespan: no runtime is built
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["code"] == "internal" and "RuntimeError" in r.json()["message"]
    assert r.content == json.dumps(r.json(), separators=(",", ":")).encode()
