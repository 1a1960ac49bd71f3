"""api.workerhttp: the router's lean client for plain turns, against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from api.workerhttp import ConnectError, Disconnected, WorkerHTTP


@pytest.fixture
async def server():
    """An aiohttp server (like a worker's) with routes that answer in the framings the client must read."""
    seen: list[dict] = []

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append({"headers": dict(request.headers), "body": body, "path": request.path_qs,
                     "peer": request.transport.get_extra_info("peername")})
        return web.Response(body=body, status=201, headers={"X-Substrate-Restored": "agent_restarted"},
                            content_type="application/json")

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b'{"n": %d}\n' % i)
        await resp.write_eof()
        return resp

    async def close(request: web.Request) -> web.Response:
        return web.Response(body=b'{"bye": 1}', headers={"Connection": "close"})

    async def crash(request: web.Request) -> web.Response:
        request.transport.close()  # a worker dying mid-turn
        await asyncio.sleep(0.05)
        return web.Response(body=b"never")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.Response(body=b"late")

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/chunked", chunked)
    app.router.add_post("/close", close)
    app.router.add_post("/crash", crash)
    app.router.add_post("/slow", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


@pytest.fixture
async def http():
    """A client with default settings, closed after the test."""
    client = WorkerHTTP()
    yield client
    await client.close()


async def test_a_post_is_answered_whole_and_the_connection_kept(server, http):
    base, seen = server
    a = await http.post(base, "/echo?x=1", b'{"input": 1}', {"X-Request-ID": "r1", "Content-Type": "application/json"}, 5)
    b = await http.post(base, "/echo", b"{}", {}, 5)
    assert a.status == 201 and a.body == b'{"input": 1}' and await a.read() == a.body
    assert a.headers["x-substrate-restored"] == "agent_restarted" and "X-Substrate-Restored" in a.headers
    assert a.headers.get("Content-Type", "").startswith("application/json") and a.headers.get("nope") is None
    assert "x-substrate-restored" in a.headers and a.headers.get("content-type", "").startswith("application/json")
    assert "X-Nope" not in a.headers and "x-nope" not in a.headers and a.headers.get("x-nope", "d") == "d"
    assert b.body == b"{}"
    assert seen[0]["path"] == "/echo?x=1" and seen[0]["headers"]["X-Request-ID"] == "r1"
    assert seen[0]["headers"]["Content-Length"] == "12"
    assert seen[0]["peer"] == seen[1]["peer"]  # the same kept-alive connection
    assert http.connections() == 1


async def test_concurrent_posts_use_a_connection_each(server):
    base, seen = server
    http = WorkerHTTP()
    try:
        answers = await asyncio.gather(*(http.post(base, "/echo", b"%d" % i, {}, 5) for i in range(8)))
        assert sorted(a.body for a in answers) == sorted(b"%d" % i for i in range(8))
        assert http.connections() == 8
    finally:
        await http.close()
    assert http.connections() == 0


async def test_a_chunked_answer_is_decoded(server, http):
    base, _ = server
    a = await http.post(base, "/chunked", b"", {}, 5)
    assert a.status == 200 and a.body == b'{"n": 0}\n{"n": 1}\n{"n": 2}\n'
    assert a.headers["content-type"] == "application/x-ndjson"


async def test_connection_close_is_honoured(server, http):
    base, seen = server
    assert (await http.post(base, "/close", b"", {}, 5)).body == b'{"bye": 1}'
    assert http.connections() == 0  # not returned to the pool
    assert (await http.post(base, "/echo", b"again", {}, 5)).body == b"again"


async def test_a_worker_that_dies_mid_turn_is_disconnected(server, http):
    base, _ = server
    with pytest.raises(Disconnected, match="closed the connection"):
        await http.post(base, "/crash", b"x", {}, 5)
    assert http.connections() == 0


async def test_a_refused_connection_is_a_connect_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = WorkerHTTP()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await http.post(f"http://127.0.0.1:{port}", "/echo", b"", {}, 5)


async def test_no_answer_in_time_is_a_timeout_and_the_connection_is_dropped(server, http):
    base, _ = server
    with pytest.raises(TimeoutError):
        await http.post(base, "/slow", b"", {}, 0.2)
    assert http.connections() == 0  # half an answer could still arrive on it: never reused
    assert (await http.post(base, "/echo", b"ok", {}, 5)).body == b"ok"


async def test_a_stale_keep_alive_closed_by_the_worker_is_not_reused(server, http):
    base, seen = server
    await http.post(base, "/echo", b"1", {}, 5)
    (conn,) = list(http._all)
    conn.transport.close()  # as a worker's keep-alive timeout does
    await asyncio.sleep(0.05)
    assert http.connections() == 0
    assert (await http.post(base, "/echo", b"2", {}, 5)).body == b"2"
    assert seen[0]["peer"] != seen[1]["peer"]


async def test_idle_connections_past_the_idle_timeout_are_dropped(server):
    base, seen = server
    http = WorkerHTTP(idle_timeout_s=0.05)
    try:
        await http.post(base, "/echo", b"1", {}, 5)
        await asyncio.sleep(0.1)
        await http.post(base, "/echo", b"2", {}, 5)
        assert seen[0]["peer"] != seen[1]["peer"] and http.connections() == 1
    finally:
        await http.close()


def test_only_plain_http_addresses():
    assert WorkerHTTP.supports("http://10.0.0.1:8000") and not WorkerHTTP.supports("https://w:443")
    with pytest.raises(ValueError, match="not a plain http"):
        WorkerHTTP()._target("https://w:443")
