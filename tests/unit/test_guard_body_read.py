"""The front door reads a body that arrived whole without arming its deadline (``api.guard.body_arrived``).

The deadline (``api.body_read_timeout_s``) is a timer armed and cancelled per request; a turn's small
body arrives with its headers, so the front door skips the timer when uvicorn already holds the whole
message. These tests pin the uvicorn behaviour that relies on (a server of ours, over loopback), the
fast path itself, and that a body still on its way keeps its deadline."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
import uvicorn

from api import guard
from api.guard import Guard, body_arrived
from substrate.serving import header_timeout_protocol
from substrate.settings import Settings


class _Cycle:
    """What ``body_arrived`` reads of uvicorn's request cycle."""

    def __init__(self, arrived: bool, more_body: bool) -> None:
        self.message_event = asyncio.Event()
        if arrived:
            self.message_event.set()
        self.more_body = more_body
        self.body = b'{"input": 1}'

    async def receive(self) -> dict[str, Any]:
        await self.message_event.wait()
        return {"type": "http.request", "body": self.body, "more_body": self.more_body}


async def test_body_arrived_only_for_a_whole_message_held_by_the_server() -> None:
    assert body_arrived(_Cycle(arrived=True, more_body=False).receive)
    assert not body_arrived(_Cycle(arrived=True, more_body=True).receive)  # a part of it: more may wait
    assert not body_arrived(_Cycle(arrived=False, more_body=False).receive)

    async def plain() -> dict[str, Any]:
        return {}

    assert not body_arrived(plain)  # not uvicorn's: cannot be told


def _scope(length: int) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/sessions/s1/invoke",
            "raw_path": b"/v1/sessions/s1/invoke", "query_string": b"", "http_version": "1.1", "scheme": "http",
            "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5000),
            "headers": [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"),
                        (b"content-length", str(length).encode())]}


async def _through_guard(receive: Any, settings: Settings) -> tuple[list[dict[str, Any]], list[bytes]]:
    seen: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await Guard(app, lambda scope: (settings, None))(_scope(12), receive, send)
    return sent, seen


async def test_a_body_that_arrived_whole_is_read_without_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timer(delay: float | None) -> Any:
        raise AssertionError("the deadline was armed for a body already in")

    monkeypatch.setattr(guard.asyncio, "timeout", no_timer)
    sent, seen = await _through_guard(_Cycle(arrived=True, more_body=False).receive, Settings())
    assert seen == [b'{"input": 1}'] and sent[0]["status"] == 200


async def test_a_body_over_the_limit_is_refused_on_the_fast_path_too() -> None:
    settings = Settings()
    settings.api.max_body_bytes = 4
    cycle = _Cycle(arrived=True, more_body=False)
    sent, seen = await _through_guard(cycle.receive, settings)
    assert seen == [] and sent[0]["status"] == 413
    assert json.loads(sent[-1]["body"])["code"] == "payload_too_large"


async def test_a_body_still_on_its_way_keeps_its_deadline() -> None:
    settings = Settings()
    settings.api.body_read_timeout_s = 0.05
    cycle = _Cycle(arrived=False, more_body=True)  # never arrives
    sent, seen = await _through_guard(cycle.receive, settings)
    assert seen == [] and sent[0]["status"] == 408
    assert json.loads(sent[-1]["body"])["code"] == "request_timeout"


async def test_uvicorn_holds_a_small_body_whole_before_the_app_reads_it() -> None:
    """The server side of the assumption: a request written at once reaches the app (behind uvicorn's
    own middleware, as the API is) with ``body_arrived`` true, and a body sent later with it false. Fails
    if a uvicorn upgrade renames what ``body_arrived`` reads (the fast path would then never be taken)."""
    seen: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append(body_arrived(receive))
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None,
                                           http=header_timeout_protocol(5.0)))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            r = await client.post(f"http://127.0.0.1:{port}/x", content=b'{"input": 1}')
            assert r.status_code == 200

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 12\r\n\r\n")
        await writer.drain()
        while len(seen) < 2:  # the app runs once the headers are in: the body is not
            await asyncio.sleep(0.01)
        writer.write(b'{"input": 1}')
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        server.should_exit = True
        await task
    assert seen == [True, False]

