"""The HTTP server ``substrate up`` and ``substrate router`` run: uvicorn's, with one change to its
signals (:class:`Server`) and a time limit on reading a request's head (:func:`header_timeout_protocol`)."""

from __future__ import annotations

import asyncio
import json
import time
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: a stop signal repeated within this many seconds of the first is the same stop request
REPEAT_SIGNAL_WINDOW_S = 1.0


class Server(uvicorn.Server):
    """``uvicorn.Server`` whose graceful shutdown survives a doubled Ctrl-C.

    uvicorn forces the exit (cutting requests in flight) on any SIGINT after the first. A Ctrl-C in a
    terminal under ``uv run`` (or ``make``) delivers SIGINT twice within milliseconds: once from the
    terminal to the process group and once forwarded by the parent. So a signal repeated within
    ``REPEAT_SIGNAL_WINDOW_S`` of the first is ignored; a deliberate second Ctrl-C after it still forces.
    """

    _first_signal_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the graceful shutdown; a repeat after the window forces the exit, as in uvicorn."""
        now = time.monotonic()
        if self._first_signal_at is not None and now - self._first_signal_at < REPEAT_SIGNAL_WINDOW_S:
            # the same stop request again: not recorded either, so it is not re-raised after the shutdown
            return
        if self._first_signal_at is None:
            self._first_signal_at = now
        super().handle_exit(sig, frame)


def _timeout_answer(timeout_s: float) -> bytes:
    body = json.dumps({"code": "request_timeout",
                       "message": f"the request's headers did not arrive within {timeout_s:g} s "
                                  "(api.header_read_timeout_s)"}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's head.

    The deadline is armed when a connection is made and when a request's first byte is parsed
    (``on_message_begin``), and disarmed when its headers are complete; if it fires first, the client
    gets 408 ``request_timeout`` (JSON, ``Connection: close``) and the connection is closed. Idle
    keep-alive connections stay under uvicorn's own ``timeout_keep_alive``; bodies under the API's
    ``api.body_read_timeout_s`` (``api/guard.py``). Cost: one ``call_later`` and one ``cancel`` per
    request (microseconds). Build it with :func:`header_timeout_protocol`.
    """

    header_read_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_read_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.write(_timeout_answer(self.header_read_timeout_s))
            self.transport.close()

    def connection_made(self, transport: Any) -> None:  # noqa: D102
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:  # noqa: D102
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:  # noqa: D102
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self._disarm()
        super().connection_lost(exc)


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``: :class:`HeaderTimeoutProtocol`
    with a deadline of ``timeout_s`` seconds (> 0) on each request's head."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_read_timeout_s": float(timeout_s)})
