"""A request the server cancels at shutdown (past its graceful time), through ``api.guard._until_stopped``."""

from __future__ import annotations

import asyncio
import json

import pytest

from api.guard import _until_stopped


async def _cut(app) -> list[dict]:  # noqa: ANN001
    """Run ``app`` under ``_until_stopped``, cancel it once it waits, return what it sent."""
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    task = asyncio.create_task(_until_stopped(app, {"type": "http", "method": "POST", "path": "/x", "headers": []},
                                              receive, send))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.wait_for(task, 5)  # ends without raising: the request's answer was ended here
    return sent


async def test_a_stream_cut_at_shutdown_ends_with_an_error_line_not_a_broken_body() -> None:
    async def streaming(scope, receive, send):  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        await send({"type": "http.response.body", "body": b'{"chunk": 1}\n', "more_body": True})
        await asyncio.sleep(60)

    sent = await _cut(streaming)
    last = sent[-1]
    assert last["type"] == "http.response.body" and last["more_body"] is False
    assert json.loads(last["body"])["error"]["code"] == "router_stopping"


async def test_a_call_cut_before_its_answer_is_503_router_stopping() -> None:
    async def slow(scope, receive, send):  # noqa: ANN001
        await asyncio.sleep(60)

    sent = await _cut(slow)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert json.loads(sent[-1]["body"])["code"] == "router_stopping"


async def test_a_plain_answer_cut_half_way_is_still_cut() -> None:
    async def half(scope, receive, send):  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"out', "more_body": True})
        await asyncio.sleep(60)

    with pytest.raises(asyncio.CancelledError):
        await _cut(half)
