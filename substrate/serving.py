"""The HTTP server ``substrate up`` and ``substrate router`` run: uvicorn's, with changes to its
signals (:class:`Server`), a time and size limit on reading a request's head
(:func:`header_timeout_protocol`), and an answer's head and body sent in one write
(:class:`CoalescingTransport`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from substrate import metrics
from substrate.errors import error_json

#: a stop signal repeated within this many seconds of the first is the same stop request
REPEAT_SIGNAL_WINDOW_S = 1.0
#: the most bytes a request's head (request line and headers) may take: uvicorn's httptools protocol has
#: no bound (a fresh-user run sent one 128 MiB header and the router grew by 184 MB before the deadline
#: cut it). 64 KiB holds any real head (nginx's default allows 32 KiB, Node's 16 KiB) and a large JWT
MAX_HEADER_BYTES = 64 * 1024
#: after a 408/431 the connection is half-closed and what the client still sends is read and dropped
#: for this long before the close: closing a socket with unread data makes the kernel send a reset,
#: which discards the answer on its way (a client still sending its giant header saw only the reset)
LINGER_S = 2.0


#: the exit status of a forced exit: a shell's for a process ended by SIGINT (128 + 2)
FORCED_EXIT_CODE = 130
FORCED_EXIT_LINE = ("forced exit (a second Ctrl-C): turns in flight are cut; workers suspend their sessions "
                    "and stop on their own\n")
#: how the process ends on a forced exit (a module attribute so that tests can replace it)
_exit: Callable[[int], Any] = os._exit


class Server(uvicorn.Server):
    """``uvicorn.Server`` whose graceful shutdown survives a doubled Ctrl-C, and whose forced exit exits.

    uvicorn forces the exit (cutting requests in flight) on any SIGINT after the first. A Ctrl-C in a
    terminal under ``uv run`` (or ``make``) delivers SIGINT twice within milliseconds: once from the
    terminal to the process group and once forwarded by the parent. So a signal repeated within
    ``REPEAT_SIGNAL_WINDOW_S`` of the first is ignored; a deliberate second Ctrl-C after it still forces.

    uvicorn's force only skips its wait for connections: the lifespan shutdown (``Runtime.stop``,
    suspending every session) still ran, under cancellation, for 15-23 s and ended in a CancelledError
    traceback. A forced exit here ends the process at once (:meth:`exit_now`): one line on stderr, exit
    status 130, nothing else: its workers see their lifeline close (``workers/lifeline.py``), suspend their
    sessions and stop, as after a SIGKILL, and the embedded Redis outlives the process until they are done
    (``substrate/redis_keeper.py``). It used to stop the embedded Redis first: that cost the workers'
    suspends (a double Ctrl-C lost turns a ``kill -9`` kept), and a third Ctrl-C re-entered the handler
    inside that stop and deadlocked on its lock, the process hung for good (fresh-user run 36).
    """

    _first_signal_at: float | None = None

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        #: called once when the graceful shutdown begins, before it waits for the requests in flight
        #: (``substrate up``: the pools stop creating workers); an error in it is logged, not raised
        self.before_shutdown: Callable[[], None] | None = None

    #: the signals that start the graceful shutdown: uvicorn's (SIGINT, SIGTERM) and SIGHUP, which a
    #: closed terminal or a dropped SSH session sends: its default action ended ``substrate up`` at once,
    #: without suspending a session (a fresh-user run lost three acknowledged turns that way)
    STOP_SIGNALS = (*uvicorn.server.HANDLED_SIGNALS, signal.SIGHUP)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's ``capture_signals`` for ``STOP_SIGNALS``: each one starts the graceful shutdown
        (``handle_exit``); the handlers from before are put back afterwards and the signals caught are
        raised again, as uvicorn does (``substrate up`` turns SIGTERM and SIGHUP into a normal exit)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can be handled on the main thread only
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in self.STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
        for sig in reversed(self._captured_signals):
            signal.raise_signal(sig)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start the graceful shutdown; a repeat after the window forces the exit, as in uvicorn."""
        now = time.monotonic()
        if self._first_signal_at is not None and now - self._first_signal_at < REPEAT_SIGNAL_WINDOW_S:
            # the same stop request again: not recorded either, so it is not re-raised after the shutdown
            return
        if self._first_signal_at is None:
            self._first_signal_at = now
        super().handle_exit(sig, frame)
        if self.force_exit:
            self.exit_now()

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """uvicorn's graceful shutdown, said in one plain line on stderr when requests are in flight:
        the stop then waits up to ``timeout_graceful_shutdown`` seconds for them before the workers
        suspend their sessions (a fresh-user run's stop with a 30 s turn in flight took 28 s with only
        uvicorn's JSON "Waiting for connections to close" to show for it)."""
        if self.before_shutdown is not None:
            try:
                self.before_shutdown()
            except Exception:  # noqa: BLE001 - the shutdown goes on
                logging.getLogger(__name__).warning("before_shutdown failed", exc_info=True)
        n = len(self.server_state.tasks)
        if n:
            sys.stderr.write(f"stopping: waiting up to {self.config.timeout_graceful_shutdown:g} s for {n} request"
                             f"{'s' if n != 1 else ''} in flight (a second Ctrl-C, SIGTERM or SIGHUP forces the "
                             "exit), then the workers suspend their sessions\n")
            sys.stderr.flush()
        await super().shutdown(sockets)

    def exit_now(self) -> None:
        """End the process now: one line, status 130, nothing that takes a lock or waits (it runs in the
        signal handler, which a further signal may interrupt). The line is written with ``os.write``
        because the handler may have interrupted a write to ``sys.stderr`` (a reentrant write raises)."""
        os.write(2, FORCED_EXIT_LINE.encode())
        _exit(FORCED_EXIT_CODE)


#: the ``route`` label of requests refused before they were parsed (a malformed request, a head over the
#: limit or too slow): no route can be told
UNPARSED_ROUTE = "unparsed"
#: a scope key (ASGI extension) set on the request the protocol answered itself (``_reject``) while the
#: app already had it: the app's own answer is dropped and ``api.app.RequestCounter`` does not count it
ANSWERED_BY_SERVER = "substrate.answered_by_server"


def _closing_answer(status: bytes, code: str, message: str) -> bytes:
    """An error answer written by the protocol itself, with a new request ID as every API answer has
    (random, as the API's own: ``api.guard.new_request_id``), closing the connection."""
    body = error_json({"code": code, "message": message}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nx-request-id: " + os.urandom(16).hex().encode()
            + b"\r\nconnection: close\r\n\r\n" + body)


def _timeout_answer(timeout_s: float) -> bytes:
    return _closing_answer(b"408 Request Timeout", "request_timeout",
                           f"the request's headers did not arrive within {timeout_s:g} s (api.header_read_timeout_s)")


class CoalescingTransport:
    """A transport whose writes made in one turn of the event loop leave in one ``write``.

    uvicorn writes an answer's head on ``http.response.start`` and its body on ``http.response.body``,
    and uvloop sends each at once: two ``send`` system calls and two TCP segments per answer, and on
    loopback each one also runs the receiver's side of the stack. A profile of a saturated router
    (2026-12-04) had the second one at about 4 % of its CPU. Here writes are kept until the end of the
    loop's current turn (one ``call_soon`` per turn that wrote, not per write), so a plain answer leaves
    in one call; a streamed answer's chunks still leave as they come, each in the turn it was written.

    Everything else is the wrapped transport's. ``close`` and ``write_eof`` send what is kept first;
    ``abort`` drops it, as the transport's own ``abort`` drops its buffer. Writes to a transport that is
    already closing, or after ``write_eof``, are dropped, as uvloop drops them after a close."""

    __slots__ = ("_transport", "_loop", "_kept", "_scheduled", "_eof")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._kept: list[bytes] = []
        self._scheduled = False
        self._eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:  # noqa: D102
        if not data:
            return
        self._kept.append(data if isinstance(data, bytes) else bytes(data))  # the caller may reuse its buffer
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, chunks: Any) -> None:  # noqa: D102
        for c in chunks:
            self.write(c)

    def flush(self) -> None:
        """Send what is kept now (one ``write``)."""
        self._scheduled = False
        if not self._kept:
            return
        kept, self._kept = self._kept, []
        if not self._transport.is_closing() and not self._eof:
            self._transport.write(kept[0] if len(kept) == 1 else b"".join(kept))

    def close(self) -> None:  # noqa: D102
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:  # noqa: D102
        self.flush()
        self._eof = True  # a write after it raises in the transport: dropped, as after a close
        self._transport.write_eof()

    def abort(self) -> None:  # noqa: D102
        self._kept = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:  # noqa: D102
        return int(self._transport.get_write_buffer_size()) + sum(len(c) for c in self._kept)

    # asked several times per request (uvicorn's send and receive, the protocol's parse step): named here,
    # since reaching them through ``__getattr__`` first fails the normal lookup, which costs an exception
    def is_closing(self) -> bool:  # noqa: D102
        return bool(self._transport.is_closing())

    def get_protocol(self) -> Any:  # noqa: D102
        return self._transport.get_protocol()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size limit on each request's head.

    The deadline is armed when a connection is made and when a request's first byte is parsed
    (``on_message_begin``), and disarmed when its headers are complete; if it fires first, the client
    gets 408 ``request_timeout`` (JSON, ``Connection: close``) and the connection is closed. A head
    that grows past ``max_header_bytes`` before it is complete gets 431 ``headers_too_large`` the same
    way (bytes are parsed in pieces no longer than the head may still grow, and a piece that ends inside
    the head is counted: exact whatever the chunking, and a body never counts). Idle
    keep-alive connections stay under uvicorn's own ``timeout_keep_alive``; bodies under the API's
    ``api.body_read_timeout_s`` (``api/guard.py``).

    The deadline is kept lazily, as a coarse timer (the way event-driven servers keep per-connection
    timeouts without a timer operation per request): a request's first byte only records when its head
    began, and one timer per connection is armed only when none is. When it fires it looks: a head still
    being read past its deadline is answered 408; one still within it re-arms the timer for what is
    left; no head being read lets the timer lapse, and the next request arms it again. On a kept-alive
    connection serving request after request that is one timer every ``header_read_timeout_s`` instead
    of a ``call_later`` and a ``cancel`` per request (a saturated router armed and cancelled four timers
    per turn, the floor proxy two: 2026-12-07 profile). Answers are written through
    a :class:`CoalescingTransport`. Build it with :func:`header_timeout_protocol`.
    """

    header_read_timeout_s: float = 10.0
    max_header_bytes: int = MAX_HEADER_BYTES
    _head_timer: asyncio.TimerHandle | None = None
    #: the head of the current request is still being read, and how many bytes of it came so far
    _in_head: bool = True
    _head_bytes: int = 0
    #: an answer was sent and the connection is lingering: incoming bytes are dropped, not parsed
    _discarding: bool = False
    _linger: asyncio.TimerHandle | None = None
    #: the loop time (s) at which the head being read began (``_in_head``)
    _head_began: float = 0.0
    #: a refusal of a pipelined request's head, sent once the answers before it are (``_reject``)
    _deferred: bytes | None = None

    def _begin_head(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._head_began = self.loop.time()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_read_timeout_s, self._head_check)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_check(self) -> None:
        """The connection's timer fired (class docstring): 408 for a head past its deadline, the timer
        again for one still within it, nothing while no head is being read."""
        self._head_timer = None
        if not self._in_head or self._discarding:
            return
        if self._earlier_answer_pending():
            # a pipelined head waits for the answers before it: its time counts from the last of them
            # (``on_response_complete``)
            self._head_timer = self.loop.call_later(self.header_read_timeout_s, self._head_check)
            return
        left_s = self._head_began + self.header_read_timeout_s - self.loop.time()
        if left_s > 0:
            self._head_timer = self.loop.call_later(left_s, self._head_check)
            return
        self._reject(_timeout_answer(self.header_read_timeout_s))

    def _earlier_answer_pending(self) -> bool:
        """A head is being read while a request before it on this connection (pipelined, RFC 9112 9.3.2)
        is still being answered: uvicorn queues the later ones until the earlier answers are sent."""
        cycle = getattr(self, "cycle", None)
        return self._in_head and cycle is not None and not cycle.response_complete

    def on_response_complete(self) -> None:  # noqa: D102
        super().on_response_complete()
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            return  # a pipelined request queued behind the one answered has started: its answer is next
        if self._deferred is not None:
            answer, self._deferred = self._deferred, None
            self._reject(answer)
        elif self._in_head:  # a pipelined head was waiting for this answer: its time starts now
            self._head_began = self.loop.time()

    def _reject(self, answer: bytes) -> None:
        """Send ``answer`` and end the connection without a reset (see ``LINGER_S``): the answer, then
        our end closed for writing, then what still comes is dropped until the client closes or
        ``LINGER_S`` has passed. A refusal of a pipelined request's head waits for the answers of the
        requests before it (HTTP answers in order: fresh-user tester 39 read a 408 meant for a
        pipelined request as the answer to the 12 s turn before it, which had run): reading stops, and
        it is sent once they are (``on_response_complete``)."""
        if self._earlier_answer_pending() and not self._discarding:
            if self._deferred is None:
                self._deferred = answer
                self._disarm()
                self.transport.pause_reading()
            return
        self._in_head = False
        self._disarm()
        if self.transport.is_closing() or self._discarding:
            return
        self._discarding = True
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            # the app has this request already (its headers were complete: e.g. ``Transfer-Encoding:
            # gzip`` fails only at the body): its answer would follow this one on a half-closed
            # connection (tester 37: "Cannot call write() after write_eof()" logged per request, and
            # the request counted twice); uvicorn drops what a disconnected cycle sends
            cycle.disconnected = True
            cycle.scope[ANSWERED_BY_SERVER] = True
            cycle.message_event.set()
        # counted as every answer is (api.app.RequestCounter), under a route of its own
        metrics.REQUESTS_TOTAL.labels(route=UNPARSED_ROUTE, code=answer[9:12].decode()).inc()
        self.transport.write(answer)
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def connection_made(self, transport: Any) -> None:  # noqa: D102
        super().connection_made(CoalescingTransport(transport, self.loop))
        self._begin_head()

    def on_message_begin(self) -> None:  # noqa: D102
        super().on_message_begin()
        self._begin_head()

    def on_headers_complete(self) -> None:  # noqa: D102
        if b"#" in self.url:
            # RFC 9112 3.2: a request target has no fragment (a client strips it); the parser dropped it and
            # the request ran as if it were not there (tester 41). Refused like any malformed request line,
            # still as a head (``_reject``: after the answers before it on a pipelined connection)
            self._reject(_closing_answer(b"400 Bad Request", "bad_request",
                                         "the request target holds a fragment (#...): send the path and "
                                         "query only; the connection is closed"))
            return
        self._in_head = False  # the timer, if armed, lapses when it fires (class docstring)
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:  # noqa: D102
        if self._discarding or self._deferred is not None:
            return
        # Parsed in pieces no longer than the head may still grow (the limit, between requests): httptools
        # gives no position, so bytes of a chunk that completes a head cannot be told from the body bytes
        # after them, and counting only chunks that end inside a head let one write of up to twice the
        # limit through. Requests under the limit arrive in one piece, as before.
        if len(data) <= (self.max_header_bytes - self._head_bytes if self._in_head else self.max_header_bytes):
            self._feed(data)  # one piece (nearly every read): no views to cut
            return
        view = memoryview(data)
        while view:
            room = self.max_header_bytes - self._head_bytes if self._in_head else self.max_header_bytes
            if room <= 0:  # the head has used the whole limit and is not complete: more of it is too much
                self._reject(_closing_answer(
                    b"431 Request Header Fields Too Large", "headers_too_large",
                    f"the request's line and headers are over {self.max_header_bytes} bytes"))
                return
            piece, view = view[:room], view[room:]
            if not self._feed(piece):
                return

    def _feed(self, piece: bytes | memoryview) -> bool:
        """Parse ``piece``; True if this protocol still reads the connection (no answer that ends it or
        waits to, no upgrade that handed the transport to another protocol)."""
        super().data_received(piece)  # type: ignore[arg-type]  # httptools takes any buffer
        if self._discarding or self._deferred is not None or self.transport.is_closing() or \
                self.transport.get_protocol() is not self:
            return False
        # still inside a head after parsing this piece: all of the piece was head (when a pipelined
        # request began inside the piece, the end of the one before is counted as its head too: cautious)
        if self._in_head:
            self._head_bytes += len(piece)
        return True

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (a control character in a header, a negative or doubled
        ``Content-Length``, garbage): uvicorn answers plain text; the API answers JSON, as everywhere,
        code ``bad_request``, and ends the connection without a reset (``_reject``)."""
        self._reject(_closing_answer(b"400 Bad Request", "bad_request",
                                     "malformed HTTP request (request line, header or framing); "
                                     "the connection is closed"))

    def eof_received(self) -> bool | None:  # noqa: D102
        if self._discarding:
            self.transport.close()  # the client is done sending: nothing unread is left to reset
            return None
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)


def server_config(api: Any, host: str, port: int) -> uvicorn.Config:
    """The uvicorn config ``substrate up`` and ``substrate router`` serve the API with: ``api`` is
    ``Settings().api`` (``header_read_timeout_s``, ``keep_alive_timeout_s``); uvloop, no access log,
    10 s of graceful shutdown."""
    # ws="none": the API serves no WebSocket, so a handshake is plain HTTP (an upgrade with a body is
    # refused by the front door, api.guard.upgrade_losing_body); with a WebSocket library installed it
    # was handed to one and answered 403 with no body and no request ID (fresh-user run)
    return uvicorn.Config("api.main:app", host=host, port=port, loop="uvloop", ws="none",
                          http=header_timeout_protocol(api.header_read_timeout_s),
                          timeout_keep_alive=api.keep_alive_timeout_s,
                          log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=10)


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``: :class:`HeaderTimeoutProtocol`
    with a deadline of ``timeout_s`` seconds (> 0) on each request's head."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_read_timeout_s": float(timeout_s)})
