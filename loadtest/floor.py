"""The floor of a routed turn on this machine, measured in the same run as the router.

DESIGN.md's "proxy hop" rows were measured once, on another machine; ``make bench`` compares the router
with a figure of the same run instead. This module is the least a Python proxy hop on the project's
stack does: a raw ASGI app under uvicorn (uvloop, httptools, no access log) that reads each request's
body, forwards it to one fixed upstream URL with fixed extra headers, and sends the answer's status,
content type and body back. Two clients forward: ``aiohttp`` (one pooled ``ClientSession``: DESIGN.md's
floor stack) and ``lean`` (the router's own hot-path client, ``api.workerhttp``, which costs less CPU
than aiohttp's): the router over the ``lean`` floor is what the router's own work per turn costs.
What the floor leaves out, and the router does: authentication, the route cache and its directory reads on a miss, the session's state machine,
idempotency keys and retries, metrics, audit, admission and the other control loops of the
``substrate up`` process. The router's steady state makes no Redis round trip per turn (``api.proxy``),
so the floor makes none either.

Run as a process (its CPU is then read from ``/proc`` like the router's)::

    python -m loadtest.floor --port P --upstream URL [--client aiohttp|lean] [--header 'Name: value' ...]

It answers ``GET /readyz`` with 200 once serving; any other request is forwarded. An upstream that
cannot be reached answers 502 with the error's text. Loopback only: ``--host`` defaults to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from typing import Any, Awaitable, Callable

import aiohttp

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


#: the clients the floor proxy can forward with (module doc)
CLIENTS = ("aiohttp", "lean")


def make_app(upstream: str, headers: dict[str, str], client: str = "aiohttp"
             ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The floor proxy as an ASGI app forwarding every request but ``GET /readyz`` to ``upstream``
    (a full URL: the path of the request is not appended) with ``headers`` added, by ``client`` (one of
    ``CLIENTS``). Raises ``ValueError`` for another client, or for ``lean`` and an upstream that is not
    plain ``http://``."""
    from urllib.parse import urlsplit

    from api.workerhttp import WorkerHTTP, WorkerHTTPError

    if client not in CLIENTS:
        raise ValueError(f"client must be one of {', '.join(CLIENTS)}, not {client!r}")
    u = urlsplit(upstream)
    base, path = f"{u.scheme}://{u.netloc}", (u.path or "/") + (f"?{u.query}" if u.query else "")
    if client == "lean" and not WorkerHTTP.supports(base):
        raise ValueError(f"the lean client forwards to plain http:// only, not {upstream!r}")
    lean = WorkerHTTP()
    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    # one pooled client, as DESIGN.md's floor row: no connection limit below wrk's
                    state["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await state["http"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/readyz":
            await _answer(send, 200, b"text/plain", b"ok")
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"application/json")
        out = {**headers, "Content-Type": content_type.decode("latin-1")}
        try:
            if client == "lean":
                a = await lean.post(base, path, body, out, timeout_s=60.0)
                await _answer(send, a.status, a.headers.get("content-type", "").encode(), a.body)
                return
            async with state["http"].post(upstream, data=body, headers=out) as r:
                data = await r.read()
                await _answer(send, r.status, r.headers.get("Content-Type", "").encode(), data)
        except (aiohttp.ClientError, WorkerHTTPError, TimeoutError) as e:
            await _answer(send, 502, b"text/plain", f"upstream: {type(e).__name__}: {e}".encode())

    return app


async def _answer(send: Send, status: int, content_type: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def parse_header(text: str) -> tuple[str, str]:
    """``'Name: value'`` as (name, value). Raises ``ValueError`` for text without a colon, an empty
    name, or a control character (it would split the request head)."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not name:
        raise ValueError(f"a header is 'Name: value', not {text!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name + value):
        raise ValueError(f"a header may not hold control characters: {text!r}")
    return name, value


def start(port: int, upstream: str, headers: dict[str, str], client: str = "aiohttp",
          timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """The floor proxy (``client``: one of ``CLIENTS``) as a child process on 127.0.0.1:``port``, once it
    answers ``/readyz``. Raises
    ``RuntimeError`` (with its output) if it exits or is not ready within ``timeout_s``; stop it with
    ``terminate()`` and ``wait()``."""
    import httpx

    args = [sys.executable, "-m", "loadtest.floor", "--port", str(port), "--upstream", upstream, "--client", client]
    for k, v in headers.items():
        args += ["--header", f"{k}: {v}"]
    out = tempfile.TemporaryFile()  # a file, not a pipe: nothing reads it while the proxy runs
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out.seek(0)
            raise RuntimeError(f"the floor proxy exited ({proc.returncode}): "
                               f"{out.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the floor proxy was not ready within {timeout_s} s")


def main(argv: list[str] | None = None) -> None:
    """The command line (module doc); exits 2 on a bad argument."""
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m loadtest.floor", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the URL every request is forwarded to")
    ap.add_argument("--client", choices=CLIENTS, default="aiohttp", help="what forwards (module doc)")
    ap.add_argument("--header", action="append", default=[], help="'Name: value' added to each forwarded request")
    a = ap.parse_args(argv)
    if not a.upstream.startswith(("http://", "https://")):
        ap.error(f"--upstream must be an http(s) URL, not {a.upstream!r}")
    try:
        app = make_app(a.upstream, dict(parse_header(h) for h in a.header), a.client)
    except ValueError as e:
        ap.error(str(e))
    uvicorn.run(app, host=a.host, port=a.port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
