"""The API's front door, as plain ASGI middleware: bearer token and body size, before any body is read.

FastAPI resolves a route's dependencies only after it has read and parsed the body, so a check there
lets an unauthenticated client make the router buffer and parse up to the whole body, and a chunked
body (no ``Content-Length``) is buffered whole before its size is known. This middleware runs first for
every ``/v1/`` request:

1. the caller is authenticated with the runtime's ``api.auth`` (shared token compared in constant time,
   API keys, JWTs) -> 401/403 as that answers; without a runtime, ``Authorization: Bearer <token>`` is
   compared in constant time (``hmac.compare_digest``) against ``api.auth_token``. The route's own
   dependency authenticates again (cheap: keys are cached) and keeps the principal;
2. a ``Content-Length`` over ``api.max_body_bytes`` -> 413 at once; a malformed one -> 400 ``bad_request``;
3. a body without ``Content-Length`` (chunked) is read at most ``max_body_bytes + 1`` bytes: over the
   limit -> 413 without reading further; else it is replayed to the app unchanged.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from starlette.datastructures import Headers

from substrate.errors import SubstrateError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _Headers(scope: Scope) -> Headers:  # noqa: N802 - a constructor
    return Headers(scope=scope)


def bearer_ok(header: bytes | str | None, token: str) -> bool:
    """Constant-time check of an ``Authorization`` header value against ``Bearer <token>``."""
    if header is None:
        return False
    got = header if isinstance(header, bytes) else header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, b"Bearer " + token.encode())


class Guard:
    """ASGI middleware; ``get_settings(scope)`` gives the settings per request (the runtime's)."""

    def __init__(self, app: ASGIApp, get_settings: Callable[[Scope], tuple[Any, Any]]) -> None:
        self.app = app
        self.get_settings = get_settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        settings, auth = self.get_settings(scope)
        api = settings.api
        headers = dict(scope["headers"])  # later duplicates win; both checks below refuse odd values
        # the invoke route (api/proxy.py) authenticates before it reads its body: not twice on the hot path
        # (a chunked invoke body is read here, so then the caller is authenticated here first)
        is_invoke = scope.get("method") == "POST" and scope["path"].endswith("/invoke")
        if auth is not None and (not is_invoke or b"content-length" not in headers):
            try:
                await auth.authenticate(_Headers(scope))
            except SubstrateError as e:
                await _answer(send, e.status, e.code, e.message)
                return
        elif auth is None and api.auth_token and not bearer_ok(headers.get(b"authorization"), api.auth_token):
            await _answer(send, 401, "unauthorized", "missing or wrong bearer token")
            return
        limit = int(api.max_body_bytes)
        cl = headers.get(b"content-length")
        if cl is not None:
            if not (cl.isdigit() and len(cl) <= 19):  # bytes.isdigit: ASCII digits only
                await _answer(send, 400, "bad_request", "malformed Content-Length")
                return
            if int(cl) > limit:
                await _answer(send, 413, "payload_too_large", f"body of {int(cl)} bytes is over the {limit}-byte limit")
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # no Content-Length: read at most limit + 1 bytes, then replay what was read
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                await _answer(send, 413, "payload_too_large", f"body is over the {limit}-byte limit")
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)
