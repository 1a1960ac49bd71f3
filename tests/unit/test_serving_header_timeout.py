"""uvicorn had no limit on reading a request's head: a client that connected and sent nothing, or
trickled its headers a byte at a time, held its connection for ever. ``HeaderTimeoutProtocol`` answers
408 ``request_timeout`` and closes; requests whose heads arrive in time are untouched, however long
their handlers or bodies take. A real uvicorn server on loopback, raw sockets."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from substrate.netports import free_port
from substrate.serving import MAX_HEADER_BYTES, HeaderTimeoutProtocol, header_timeout_protocol

TIMEOUT_S = 0.5


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(TIMEOUT_S * 3)  # a handler longer than the head's deadline
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok:" + body})


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    port = free_port()
    cfg = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", http=header_timeout_protocol(TIMEOUT_S),
                         log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30)
    srv = uvicorn.Server(cfg)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    yield port
    srv.should_exit = True
    t.join(10)


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(15)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _timed_out(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), raw[:200]
    assert b"connection: close" in head.lower()
    err = json.loads(body)
    assert err["code"] == "request_timeout" and "header_read_timeout_s" in err["message"]
    return err


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as s:
        _timed_out(_read_all(s))  # the server closed it: recv returned EOF after the answer


def test_headers_trickled_past_the_deadline_get_408_although_bytes_keep_coming(server: int) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    with socket.create_connection(("127.0.0.1", server)) as s:
        sent_until_closed = 0
        for b in head:  # one byte every 50 ms: 4 s in all, the deadline is 0.5 s
            if select.select([s], [], [], 0)[0]:
                break  # the answer is there: stop sending (bytes sent after the close would draw a reset)
            s.sendall(bytes([b]))
            sent_until_closed += 1
            time.sleep(0.05)
        _timed_out(_read_all(s))
    assert sent_until_closed < len(head), "the server let the trickle run to its end"


def test_heads_in_time_are_served_however_long_the_handler_and_on_keep_alive(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.settimeout(15)
        for path in ("/slow", "/", "/slow"):  # three requests on one connection, some slower than the deadline
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi".encode())
            data = b""
            while b"ok:hi" not in data:
                chunk = s.recv(65536)
                assert chunk, data
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 ")
        time.sleep(TIMEOUT_S * 2)  # idle between requests is the keep-alive timeout's business (30 s), not ours
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_the_factory_sets_the_deadline_on_its_own_class() -> None:
    a, b = header_timeout_protocol(3), header_timeout_protocol(7.5)
    assert issubclass(a, HeaderTimeoutProtocol) and (a.header_read_timeout_s, b.header_read_timeout_s) == (3.0, 7.5)
    assert HeaderTimeoutProtocol.header_read_timeout_s == 10.0


def test_a_head_over_the_size_limit_gets_431_and_is_closed(server: int) -> None:
    """Fresh-user run: one 128 MiB header grew the router by 184 MB before the deadline reset it."""
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: "
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(head)
        sent = 0
        try:
            while sent < 8 * MAX_HEADER_BYTES and not select.select([s], [], [], 0)[0]:
                s.sendall(b"a" * 4096)
                sent += 4096
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw = _read_all(s)
    status, _, body = raw.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 431 "), raw[:200]
    # the whole answer, then the end of the stream (no reset, although the client was still sending)
    assert json.loads(body)["code"] == "headers_too_large"


def test_a_large_body_in_one_chunk_with_a_small_head_is_not_counted_as_head(server: int) -> None:
    body = b"b" * (4 * MAX_HEADER_BYTES)  # arrives together with the head, in the same reads
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.settimeout(15)
        data = b""
        while not data.endswith(b"b" * 16):
            chunk = s.recv(1 << 20)
            assert chunk, data[:200]
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",                      # a control character
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",                 # a negative length
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",  # both
    b"\x16\x03\x01\x02\x00garbage\r\n\r\n",                                       # TLS to a plain port
])
def test_a_request_that_cannot_be_parsed_gets_a_json_400(server: int, raw: bytes) -> None:
    """Fresh-user run: uvicorn answered these in plain text ("Invalid HTTP request received.")."""
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(raw)
        answer = _read_all(s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head, answer[:200]
    assert json.loads(body)["code"] == "bad_request"


def _head_of(size: int, connection: bytes = b"close") -> bytes:
    """A GET whose request line and headers (up to and including the blank line) are ``size`` bytes."""
    start, end = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: " + connection + b"\r\nX-Pad: ", b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


def _send_head(port: int, head: bytes, piece: int | None) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if piece is None:
            s.sendall(head)
        else:
            for i in range(0, len(head), piece):
                s.sendall(head[i:i + piece])
                time.sleep(0.002)  # let the server read the pieces apart (the result must not depend on it)
        return _read_all(s)


@pytest.mark.parametrize("piece", [None, 4096, 1000], ids=["one-write", "4KiB-writes", "1000B-writes"])
def test_a_head_one_byte_over_the_limit_gets_431_however_it_is_chunked(server: int, piece: int | None) -> None:
    """Fresh-user run: the chunk that completed the head was never counted, so a head of up to twice the
    limit got through when it came in one write (and one of limit + a piece in many)."""
    raw = _send_head(server, _head_of(MAX_HEADER_BYTES + 1), piece)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), raw[:200]
    assert json.loads(body)["code"] == "headers_too_large"


@pytest.mark.parametrize("piece", [None, 4096, 1000], ids=["one-write", "4KiB-writes", "1000B-writes"])
def test_a_head_of_exactly_the_limit_is_served_however_it_is_chunked(server: int, piece: int | None) -> None:
    raw = _send_head(server, _head_of(MAX_HEADER_BYTES), piece)
    assert raw.startswith(b"HTTP/1.1 200 ") and b"ok:" in raw, raw[:200]




class _Transport(asyncio.Transport):
    """Enough of a transport to drive the protocol by hand, with chunks of our choosing."""

    def __init__(self, protocol: asyncio.BaseProtocol) -> None:
        super().__init__()
        self.protocol, self.written, self.closing = protocol, b"", False

    def get_extra_info(self, name: str, default=None):  # type: ignore[no-untyped-def]
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data) -> None:  # type: ignore[no-untyped-def]
        self.written += bytes(data)

    def write_eof(self) -> None:
        self.closing = True

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _hand_driven(loop: asyncio.AbstractEventLoop) -> tuple[HeaderTimeoutProtocol, "_Transport"]:
    """A protocol (30 s head deadline) on ``loop``, connected to a ``_Transport`` the test drives by hand."""
    cfg = uvicorn.Config(app, loop="asyncio", log_config=None, lifespan="off")
    cfg.load()
    from uvicorn.server import ServerState

    p = header_timeout_protocol(30)(config=cfg, server_state=ServerState(), app_state={}, _loop=loop)
    t = _Transport(p)
    p.connection_made(t)
    return p, t


def test_a_later_request_on_a_keep_alive_connection_is_bounded_too() -> None:
    """Between requests no head is being read: the chunk that holds all of the next one's over-limit head
    (more than a loopback segment, so the server above cannot be made to get it whole) must be counted."""
    loop = asyncio.new_event_loop()
    try:
        p, t = _hand_driven(loop)
        p.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the first request, answered
        assert not t.written
        _answer_first(p)  # (a head pipelined behind a request still being answered waits for its answer)
        p.data_received(_head_of(MAX_HEADER_BYTES + 1, b"keep-alive"))
        assert t.written.startswith(b"HTTP/1.1 431 "), t.written[:200]
        p.connection_lost(None)
    finally:
        pending = asyncio.all_tasks(loop)  # the first request's ASGI task, never run
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def test_one_timer_per_connection_bounds_every_head_on_a_kept_alive_connection() -> None:
    """The deadline is kept lazily (``HeaderTimeoutProtocol``'s docstring): a request's first byte only
    records when its head began, the connection's one timer is not re-armed per request, and when it fires
    it re-arms for a head still within its deadline, answers 408 for one past it, and lapses between
    requests. Driven by hand on a loop whose clock the test sets (nothing runs: the timer's callback is
    called as the loop would call it)."""
    loop = asyncio.new_event_loop()
    now = [100.0]
    loop.time = lambda: now[0]  # type: ignore[method-assign]
    try:
        p, t = _hand_driven(loop)
        first = p._head_timer
        assert first is not None and first.when() == 130.0  # the connection's first head: 30 s from now
        now[0] = 101.0
        p.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a head in time: the timer is left armed
        assert p._head_timer is first
        _answer_first(p)
        now[0] = 120.0
        p.data_received(b"GET / HTTP/1.1\r\nHo")  # the next head begins at 120 and stalls: not re-armed
        assert p._head_timer is first
        now[0] = 130.0
        first._run()  # fires at 130 (as the loop would): this head has until 150
        assert not t.written and p._head_timer is not None and p._head_timer.when() == 150.0
        now[0] = 150.0
        p._head_timer._run()
        assert t.written.startswith(b"HTTP/1.1 408 "), t.written[:200]
        assert p._head_timer is None
        p.connection_lost(None)

        q, u = _hand_driven(loop)
        q.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _answer_first(q)
        now[0] = 180.0
        q._head_timer._run()  # between requests: no head is read, the timer lapses
        assert q._head_timer is None and not u.written
        now[0] = 185.0
        q.data_received(b"GET / HTTP/1.1\r\nHo")  # the next head arms it again, 30 s from its first byte
        assert q._head_timer is not None and q._head_timer.when() == 215.0
        q.connection_lost(None)
        assert q._head_timer is None
    finally:
        pending = asyncio.all_tasks(loop)  # the requests' ASGI tasks, never run
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def _pipelined(now: list[float]) -> tuple[asyncio.AbstractEventLoop, HeaderTimeoutProtocol, _Transport]:
    loop = asyncio.new_event_loop()
    loop.time = lambda: now[0]  # type: ignore[method-assign]
    p, t = _hand_driven(loop)
    return loop, p, t


def _answer_first(p: HeaderTimeoutProtocol) -> None:
    """What uvicorn does when the app's answer to the request in flight is complete."""
    p.cycle.response_complete = True
    p.on_response_complete()


def _close(loop: asyncio.AbstractEventLoop, p: HeaderTimeoutProtocol) -> None:
    p.connection_lost(None)
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def test_a_pipelined_heads_deadline_counts_from_the_answer_before_it() -> None:
    """Fresh-user tester 39: a turn of 12 s followed in the same write by the start of a second request
    got a 408 at 10 s, meant for the second request, as the only answer on the connection (the turn had
    run). A pipelined head's time now counts from the answer before it, and the 408 follows that answer."""
    now = [100.0]
    loop, p, t = _pipelined(now)
    try:
        p.data_received(b"POST /turn HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiGET /v1/sta")
        now[0] = 130.0
        p._head_timer._run()  # the first request is still being answered: no 408 yet
        assert not t.written and p._head_timer is not None
        now[0] = 142.0
        _answer_first(p)  # its answer went out at 142: the pipelined head has until 172
        now[0] = 160.0
        p._head_timer._run()
        assert not t.written and p._head_timer.when() == 172.0
        now[0] = 172.0
        p._head_timer._run()
        assert t.written.startswith(b"HTTP/1.1 408 "), t.written[:200]
    finally:
        _close(loop, p)


def test_a_refused_pipelined_head_is_answered_after_the_answer_before_it() -> None:
    """A pipelined head over the size limit is refused (431) only once the request before it is answered:
    the in-flight request's answer is not dropped for it."""
    now = [100.0]
    loop, p, t = _pipelined(now)
    try:
        p.data_received(b"POST /turn HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        first = p.cycle
        p.data_received(_head_of(MAX_HEADER_BYTES + 1, b"keep-alive"))
        assert not t.written and not first.disconnected  # the first request's answer is still to come
        _answer_first(p)
        assert t.written.startswith(b"HTTP/1.1 431 "), t.written[:200]
    finally:
        _close(loop, p)


def test_the_answer_to_a_request_comes_before_the_408_of_a_stalled_head_pipelined_behind_it(server: int) -> None:
    """The real server: a request whose handler takes longer than the head deadline, and the start of a
    second request in the same write. Its answer comes first, then the second request's 408 (tester 39
    got only the 408, and read it as the answer to its turn)."""
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiGET /v1/sta")
        raw = _read_all(s)
    assert raw.startswith(b"HTTP/1.1 200 ") and b"ok:hi" in raw, raw[:300]
    assert raw.count(b"HTTP/1.1 ") == 2 and raw.index(b"HTTP/1.1 408 ") > raw.index(b"ok:hi"), raw[:400]
    _timed_out(raw[raw.index(b"HTTP/1.1 408 "):])


@pytest.mark.parametrize("target", [b"/#x", b"/slow?a=1#frag", b"/#"])
def test_a_request_target_with_a_fragment_is_a_json_400_and_is_closed(server: int, target: bytes) -> None:
    """RFC 9112 3.2: a request target carries no fragment. The parser dropped it and served the request
    (tester 41: ``POST /v1/sessions/b1/invoke#x`` ran the turn); it is refused now, and nothing runs."""
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        raw = _read_all(s)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), raw[:200]
    assert json.loads(body)["code"] == "bad_request" and b"ok:" not in raw
