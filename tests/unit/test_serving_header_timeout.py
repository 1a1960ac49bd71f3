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
