"""A worker that refuses the control plane's activation token (401) is not the client's credentials failing.

A fresh-user run flushed the runtime's Redis: a worker started meanwhile made a signing key of its own,
routers still signed with theirs, and creates answered the client 401 ``invalid_token`` with
``WWW-Authenticate``, as if its key were bad. Now the caller reloads the signing keys and calls once more
when the current key changed, and otherwise answers 502 ``worker_unavailable``. Against a real Redis and
an HTTP worker stand-in that checks tokens with a real ``TokenVerifier``."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from substrate.errors import SubstrateError, WorkerUnavailable
from substrate.keys import Keys
from substrate.tokens import SigningKeyRing, TokenMinter, TokenVerifier
from substrate.workerclient import WorkerClient


@pytest.fixture
async def redis_keys(redis_url: str) -> Any:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    r = aioredis.from_url(redis_url, decode_responses=True)
    yield r, Keys(prefix)
    async for k in r.scan_iter(f"{prefix}:*"):
        await r.delete(k)
    await r.aclose()


async def _worker(verifier: TokenVerifier, calls: list[str]) -> tuple[web.AppRunner, str]:
    async def deactivate(request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        try:
            await verifier.verify(token, session=request.match_info["sid"], epoch=1)
        except SubstrateError as e:
            calls.append(e.code)
            return web.json_response(e.to_dict(), status=e.status)
        calls.append("ok")
        return web.Response(status=204)

    app = web.Application()
    app.router.add_delete("/v1/activations/{sid}", deactivate)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    verifier.audience = f"http://127.0.0.1:{port}"
    return runner, verifier.audience


async def test_a_refused_token_is_signed_again_with_the_reloaded_key(redis_keys: Any) -> None:
    r, keys = redis_keys
    router_ring = SigningKeyRing(r, keys)
    await router_ring.load()
    await r.delete(keys.signing_keys)  # the data is lost; a worker started since makes a key of its own
    worker_ring = SigningKeyRing(r, keys)
    await worker_ring.load()
    assert worker_ring.current != router_ring.current
    calls: list[str] = []
    runner, address = await _worker(TokenVerifier(worker_ring, "set below"), calls)
    client = WorkerClient(TokenMinter(router_ring))
    try:
        await client.deactivate(address, "s1", 1)
        assert calls == ["invalid_token", "ok"]  # refused, keys reloaded, signed with the worker's key
        assert router_ring.current == worker_ring.current
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_token_refused_again_is_502_worker_unavailable_never_the_clients_401(redis_keys: Any) -> None:
    r, keys = redis_keys
    router_ring = SigningKeyRing(r, keys)
    await router_ring.load()
    other = SigningKeyRing(r, Keys(keys.prefix + "x"))
    await other.load()  # a worker of another key ring altogether: the reload changes nothing
    calls: list[str] = []
    runner, address = await _worker(TokenVerifier(other, "set below"), calls)
    client = WorkerClient(TokenMinter(router_ring))
    try:
        with pytest.raises(WorkerUnavailable) as e:
            await client.deactivate(address, "s1", 1)
        assert e.value.status == 502 and e.value.code == "worker_unavailable"
        assert "refused this router's activation token" in e.value.message
        assert calls == ["invalid_token"]  # not sent again: the reload found no other key
    finally:
        await client.close()
        await runner.cleanup()
        await r.delete(Keys(keys.prefix + "x").signing_keys)
