"""``loadtest.floor``: the floor proxy ``make bench`` sets beside the router forwards each request as it
came (body, content type, the extra headers) to the one upstream and sends the answer back unchanged,
with either client; a bad argument is refused before it serves."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx
import pytest
from aiohttp import web

from loadtest import floor
from substrate.netports import free_port


@pytest.mark.parametrize("client", floor.CLIENTS)
async def test_the_floor_proxy_forwards_the_request_and_the_answer(client: str) -> None:
    seen: list[tuple[str, str, str, str, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, request.content_type, request.headers.get("Authorization", ""),
                     await request.read()))
        return web.Response(status=201 if request.content_type == "text/plain" else 200,
                            body=b'{"output": "\\u00e9"}', content_type="application/x-turn")

    app = web.Application()
    app.router.add_post("/v1/activations/s-1/invoke", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    upstream = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/activations/s-1/invoke"
    port = free_port()
    proc = await asyncio.to_thread(floor.start, port, upstream, {"Authorization": "Bearer tok"}, client)
    try:
        async with httpx.AsyncClient() as http:
            r = await http.post(f"http://127.0.0.1:{port}/anything", content=b'{"input": "get"}',
                                headers={"Content-Type": "application/json"})
            assert (r.status_code, r.headers["content-type"], r.content) == (200, "application/x-turn",
                                                                            b'{"output": "\\u00e9"}')
            r = await http.post(f"http://127.0.0.1:{port}/", content=b"x" * 70_000, headers={"Content-Type": "text/plain"})
            assert r.status_code == 201  # the answer's own status, for a body in several chunks
        assert seen == [("POST", "/v1/activations/s-1/invoke", "application/json", "Bearer tok", b'{"input": "get"}'),
                        ("POST", "/v1/activations/s-1/invoke", "text/plain", "Bearer tok", b"x" * 70_000)]
        await runner.cleanup()  # the upstream gone: 502 naming the error, not a hang or a crash
        async with httpx.AsyncClient() as http:
            r = await http.post(f"http://127.0.0.1:{port}/", content=b"{}")
        assert r.status_code == 502 and r.text.startswith("upstream: ")
        assert proc.poll() is None
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait)
        await runner.cleanup()


@pytest.mark.parametrize("args, message", [
    (["--upstream", "ftp://x/"], "--upstream must be an http(s) URL"),
    (["--upstream", "http://127.0.0.1:1/", "--header", "NoColon"], "a header is 'Name: value'"),
    (["--upstream", "http://127.0.0.1:1/", "--client", "httpx"], "invalid choice: 'httpx'"),
    (["--upstream", "https://127.0.0.1:1/", "--client", "lean"], "the lean client forwards to plain http:// only"),
])
def test_bad_arguments_are_refused_before_it_serves(args: list[str], message: str) -> None:
    p = subprocess.run([sys.executable, "-m", "loadtest.floor", "--port", str(free_port()), *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_a_header_with_a_control_character_is_refused() -> None:
    with pytest.raises(ValueError, match="control characters"):
        floor.parse_header("X-A: b\r\nX-Evil: 1")
    assert floor.parse_header(" Authorization :  Bearer a:b ") == ("Authorization", "Bearer a:b")
