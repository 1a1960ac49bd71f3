"""``loadtest.wrk``: the request script says what the benchmark means to send, a run's count and CPU are
read back, and a run in which any answer failed is refused (a server answering errors fast would look
fast)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from aiohttp import web

from loadtest import wrk

REPORT = """Running 5s test @ http://127.0.0.1:20393/v1/sessions/s-1/invoke
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    10.19ms    2.48ms  29.93ms   84.19%
    Req/Sec     1.58k   180.11     1.90k    70.00%
  7878 requests in 5.01s, 1.49MB read
Requests/sec:   1572.32
Transfer/sec:    304.65KB
"""


def test_the_count_and_the_time_are_read() -> None:
    assert wrk.parse_report(REPORT) == (7878, 5.01)
    assert wrk.parse_report(REPORT.replace("in 5.01s", "in 1.00m")) == (7878, 60.0)
    assert wrk.parse_report(REPORT.replace("in 5.01s", "in 500.00ms")) == (7878, 0.5)


@pytest.mark.parametrize("bad", ["  Non-2xx or 3xx responses: 12\n",
                                 "  Socket errors: connect 0, read 3, write 0, timeout 0\n"])
def test_a_run_with_failed_answers_is_refused(bad: str) -> None:
    with pytest.raises(RuntimeError, match="wrk saw errors"):
        wrk.parse_report(REPORT + bad)
    with pytest.raises(RuntimeError, match="no request count"):
        wrk.parse_report("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_a_header_that_would_split_the_request_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="control characters"):
        wrk.write_script(tmp_path / "t.lua", "{}", {"Authorization": "Bearer x\r\nX-Evil: 1"})
    assert not (tmp_path / "t.lua").exists()


async def test_bad_run_arguments_are_refused_before_wrk_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seconds must be 1-60"):
        await wrk.run("http://127.0.0.1:1/", tmp_path / "t.lua", connections=1, seconds=0)
    with pytest.raises(ValueError, match="connections >= 1"):
        await wrk.run("http://127.0.0.1:1/", tmp_path / "t.lua", connections=0, seconds=1)


@pytest.mark.skipif(not wrk.available(), reason=f"wrk not on PATH ({wrk.INSTALL_HINT})")
async def test_a_run_sends_the_scripted_request_and_counts_what_was_answered(tmp_path: Path) -> None:
    """A real wrk against a loopback server that records what it receives: every request is the
    scripted POST (body, content type, extra header, quotes kept), and the count wrk reports is the
    count the server answered; a server that answers 500 makes the run fail."""
    seen: list[tuple[str, str, str, bytes]] = []
    fail = False

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.content_type, request.headers.get("Authorization", ""),
                     await request.read()))
        return web.Response(status=500 if fail else 200, text="{}")

    app = web.Application()
    app.router.add_post("/turn", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/turn"
    try:
        body = '{"input": "say \\"hi\\""}'
        script = wrk.write_script(tmp_path / "t.lua", body, {"Authorization": "Bearer sk_1"})
        r = await wrk.run(url, script, connections=2, seconds=1)
        assert r.requests > 0 and r.per_s > 0 and r.cpu_s >= 0
        # wrk counts the answers it read; the server may have taken a few more it had no time to read
        assert 0 <= len(seen) - r.requests <= 2
        assert set(seen) == {("POST", "application/json", "Bearer sk_1", body.encode())}
        fail = True
        with pytest.raises(RuntimeError, match="Non-2xx"):
            await wrk.run(url, script, connections=1, seconds=1)
    finally:
        await runner.cleanup()
        await asyncio.sleep(0)
