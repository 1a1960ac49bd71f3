"""A lean HTTP/1.1 client for the router's one hot call: ``POST`` a turn to a worker, read the answer whole.

Why not aiohttp here: the router profile (``docs/bench/router-profile-2026-12-01.md``) put 32 % of a
saturated router's CPU in aiohttp's client (request objects, URL parsing, header multidicts, timers,
traces, connector bookkeeping) for a call that is always the same shape: one POST with a
``Content-Length`` body to a worker over plain HTTP on a kept-alive connection, and an answer read whole.
This client does only that, with ``asyncio.Protocol`` connections and ``httptools`` (the C parser uvicorn
uses) for the answer; aiohttp stays the router's client for everything else (streamed turns, the
control-plane calls to workers, HTTPS workers).

Protocol: RFC 9112 (HTTP/1.1 message syntax): the request is written in one ``transport.write``; the
answer's framing (``Content-Length`` or chunked, as every worker sends: an answer delimited only by the
close of the connection is not read, it fails as :class:`Disconnected`) is the parser's; a connection goes back to
its address's idle pool only after a complete answer that allows keep-alive (RFC 9112 section 9.3).

Errors, shaped like aiohttp's so the router's retry rules stay the same (``api.proxy``):

* :class:`ConnectError`: no connection could be made (refused, unreachable, connect timeout): the turn
  was not sent;
* :class:`Disconnected`: the connection closed or broke before the whole answer came (a stale keep-alive
  closed by the worker, the worker stopping or crashing mid-turn): the turn may have run;
* :class:`TimeoutError`: no whole answer within ``timeout_s``.

Both error classes derive from :class:`WorkerHTTPError`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import httptools

__all__ = ["WorkerHTTP", "Answer", "WorkerHTTPError", "ConnectError", "Disconnected"]


class WorkerHTTPError(Exception):
    """A call to a worker failed below HTTP (see the module docstring)."""


class ConnectError(WorkerHTTPError):
    """No connection to the worker: the request was not sent."""


class Disconnected(WorkerHTTPError):
    """The connection ended before the whole answer: the request may have been processed."""


class Headers(dict):
    """Answer headers, looked up case-insensitively (stored lower-case; a repeated header keeps its last
    value, which is all the router reads). A lower-case name is found without lowering it."""

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (isinstance(key, str) and dict.__contains__(self, key.lower()))

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        v = dict.get(self, key)
        return v if v is not None else dict.get(self, key.lower(), default)


class Answer:
    """A worker's whole answer: ``status`` (int), ``headers`` (:class:`Headers`), ``body`` (bytes).
    ``read()`` and ``release()`` mirror the aiohttp response methods the router calls."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        return None


class _Connection(asyncio.Protocol):
    """One kept-alive connection; at most one request at a time (no pipelining)."""

    def __init__(self, pool: "WorkerHTTP", key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.closed = False
        self.idle_since = 0.0
        self._headers = Headers()
        self._name = b""
        self._body: list[bytes] = []
        self._status = 0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Disconnected("the worker asked to switch protocols"))
        except httptools.HttpParserError as e:
            self._fail(Disconnected(f"malformed answer from the worker: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(Disconnected(f"the worker closed the connection{f': {exc}' if exc else ''}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name:
            self._name = name
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        else:  # a value split across reads
            k = self._name.decode("latin-1").lower()
            self._headers[k] = self._headers.get(k, "") + value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer = Answer(self._status, self._headers, b"".join(self._body))
        keep = self.parser.should_keep_alive()
        self._headers, self._body = Headers(), []
        waiter, self.waiter = self.waiter, None
        if keep:
            self.pool._release(self)
        else:
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, e: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(e)
        self.close()

    def close(self) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.close()


class WorkerHTTP:
    """Pools of kept-alive connections per worker address (``http://host:port``); no limit on their
    number (each request in flight holds one, as the router's aiohttp connector with ``limit=0`` did).

    ``connect_timeout_s`` bounds making a connection; ``idle_timeout_s`` drops connections idle longer
    (below the worker's own keep-alive timeout, so the router rarely sends into one the worker is
    closing)."""

    def __init__(self, *, connect_timeout_s: float = 2.0, idle_timeout_s: float = 30.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    @staticmethod
    def supports(address: str) -> bool:
        """Whether ``address`` (a worker's base URL) is plain ``http://`` (the only kind served here)."""
        return address.startswith("http://")

    def _target(self, address: str) -> tuple[tuple[str, int], bytes]:
        t = self._targets.get(address)
        if t is None:
            u = urlsplit(address)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"not a plain http:// worker address: {address!r}")
            port = u.port or 80
            t = ((u.hostname, port), u.netloc.encode("latin-1"))
            if len(self._targets) > 10_000:  # addresses of long-gone workers
                self._targets.clear()
            self._targets[address] = t
        return t

    async def post(self, address: str, path: str, body: bytes, headers: dict[str, str] | bytes,
                   timeout_s: float) -> Answer:
        """``POST address + path`` with ``body`` and ``headers``; -> the whole :class:`Answer`. ``headers``
        is a dict (name -> value, latin-1 text), or the header lines already encoded, each preceded by
        CRLF (``b"\\r\\nName: value\\r\\nOther: value"``: the router's hot path keeps its fixed ones
        encoded per route). Raises :class:`ConnectError`, :class:`Disconnected` or ``TimeoutError`` (see
        the module docstring), and ``ValueError`` for an address that is not ``http://``."""
        key, host = self._target(address)
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(key)
        head = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nHost: ", host,
                b"\r\nContent-Length: ", str(len(body)).encode()]
        if isinstance(headers, bytes):
            head.append(headers)
        else:
            for k, v in headers.items():
                head += [b"\r\n", k.encode("latin-1"), b": ", v.encode("latin-1")]
        head += [b"\r\n\r\n", body]
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        conn.waiter = waiter
        assert conn.transport is not None
        conn.transport.write(b"".join(head))
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            return await waiter
        except BaseException:
            if not conn.closed and conn.waiter is waiter:  # abandoned mid-answer: never reuse it
                conn.close()
            raise
        finally:
            timer.cancel()

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        q = self._idle.get(key)
        now = time.monotonic()
        while q:
            conn = q.pop()  # the most recently used: the least likely to be closing
            if not conn.closed and now - conn.idle_since < self.idle_timeout_s:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1])
        except (OSError, TimeoutError) as e:
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {e or 'timed out'}") from e
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, deque()).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        q = self._idle.get(conn.key)
        if q is not None:
            try:
                q.remove(conn)
            except ValueError:
                pass
            if not q:
                del self._idle[conn.key]

    def connections(self) -> int:
        """Open connections (idle and in use)."""
        return len(self._all)

    async def close(self) -> None:
        """Close every connection."""
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no whole answer from the worker in time"))
