"""An answer's head and body leave in one write (``substrate.serving.CoalescingTransport``): uvicorn wrote
them separately, two system calls and two TCP segments per answer. The server's protocol is driven here
on a recording transport, so what is counted is the writes themselves."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from substrate.serving import CoalescingTransport, header_timeout_protocol


class Recording:
    """A transport that records each ``write`` (and the calls that end a connection)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.calls: list[str] = []
        self.closing = False
        self.protocol: Any = None

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def get_protocol(self) -> Any:
        return self.protocol


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")]})
    await send({"type": "http.response.body", "body": b'{"output":1}'})


async def _settle() -> None:
    for _ in range(20):  # the request's task, its sends and the flush each take a turn of the loop
        await asyncio.sleep(0)


async def test_a_plain_answer_leaves_in_one_write_and_keep_alive_answers_each_in_their_own() -> None:
    cfg = uvicorn.Config(_app, lifespan="off", log_config=None, access_log=False)
    cfg.load()
    proto = header_timeout_protocol(5.0)(config=cfg, server_state=ServerState(), app_state={},
                                         _loop=asyncio.get_running_loop())
    t = Recording()
    t.protocol = proto
    proto.connection_made(t)
    req = b"POST /v1/sessions/s/invoke HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    proto.data_received(req)
    await _settle()
    assert len(t.writes) == 1, t.writes  # uvicorn alone: the head, then the body
    head, _, body = t.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b'{"output":1}'
    proto.data_received(req)  # the next request on the kept-alive connection: its own single write
    await _settle()
    assert len(t.writes) == 2 and t.writes[1].endswith(b'{"output":1}')
    proto.connection_lost(None)


async def test_writes_of_one_turn_are_joined_and_ending_the_connection_sends_or_drops_them() -> None:
    loop = asyncio.get_running_loop()
    t = Recording()
    c = CoalescingTransport(t, loop)
    c.write(b"a")
    c.write(bytearray(b"b"))
    c.writelines([b"c", memoryview(b"d")])
    assert t.writes == [] and c.get_write_buffer_size() == 4
    await asyncio.sleep(0)
    assert t.writes == [b"abcd"]
    c.write(b"e")  # a later turn: its own write
    await asyncio.sleep(0)
    assert t.writes == [b"abcd", b"e"]

    c.write(b"last")
    c.write_eof()  # what is kept goes out before the end of the stream
    assert t.writes[-1] == b"last" and t.calls == ["write_eof"]
    c.write(b"bye")  # after the end of the stream: the transport would raise (tester 37's traceback)
    c.close()
    assert t.writes[-1] == b"last" and t.calls == ["write_eof", "close"]
    await asyncio.sleep(0)
    assert t.writes[-1] == b"last"  # dropped, not sent by the flush scheduled earlier either
    t4 = Recording()
    c4 = CoalescingTransport(t4, loop)
    c4.write(b"bye")
    c4.close()  # what is kept goes out before the close
    assert t4.writes == [b"bye"] and t4.calls == ["close"]
    await asyncio.sleep(0)
    assert t4.writes == [b"bye"]  # the flush scheduled earlier sends nothing twice

    t2 = Recording()
    c2 = CoalescingTransport(t2, loop)
    c2.write(b"dropped")
    c2.abort()
    await asyncio.sleep(0)
    assert t2.writes == [] and t2.calls == ["abort"]
    t3 = Recording()
    c3 = CoalescingTransport(t3, loop)
    c3.write(b"late")
    t3.closing = True  # the peer went away before the turn ended
    await asyncio.sleep(0)
    assert t3.writes == []
    assert c3.get_extra_info("peername") == ("127.0.0.1", 50000)  # everything else is the transport's


async def test_a_request_refused_before_it_is_parsed_gets_a_request_id_and_is_counted() -> None:
    from substrate import metrics
    from substrate.serving import UNPARSED_ROUTE

    cfg = uvicorn.Config(_app, lifespan="off", log_config=None, access_log=False)
    cfg.load()
    before = metrics.REQUESTS_TOTAL.labels(route=UNPARSED_ROUTE, code="400")._value.get()
    ids = []
    for _ in range(2):
        proto = header_timeout_protocol(5.0)(config=cfg, server_state=ServerState(), app_state={},
                                             _loop=asyncio.get_running_loop())
        t = Recording()
        t.protocol = proto
        proto.connection_made(t)
        proto.data_received(b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
        await _settle()
        head = b"".join(t.writes).partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 400 ") and b"connection: close" in head, head
        ids.append(next(line.split(b": ")[1] for line in head.split(b"\r\n") if line.startswith(b"x-request-id:")))
        proto.connection_lost(None)
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    assert metrics.REQUESTS_TOTAL.labels(route=UNPARSED_ROUTE, code="400")._value.get() == before + 2
