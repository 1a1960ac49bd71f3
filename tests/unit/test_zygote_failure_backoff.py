"""A zygote that stops answering forks is replaced after a pause, not given up for the runtime's life
(before: one fork timeout, 30 s long, made every later worker start cold for good; fresh-user tester 43
froze the zygote and waited 30 s per create)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from substrate.backends.local import LocalBackend
from substrate.settings import Settings

# A stand-in zygote speaking the JSON-lines protocol of workers/zygote.py. The first one started says
# ready and then never answers a fork (a wedged zygote); later ones answer each fork with their own pid.
_FAKE = r"""
import json, os, sys, time
marker = sys.argv[1]
first = not os.path.exists(marker)
open(marker, "a").close()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if first:
        time.sleep(3600)
    print(json.dumps({"worker_id": json.loads(line)["worker_id"], "pid": os.getpid()}), flush=True)
"""


def _backend(tmp_path: Path) -> LocalBackend:
    script = tmp_path / "fake-python"
    # the backend runs `<python> -m workers.zygote`: this "python" ignores its arguments
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{_FAKE}' {tmp_path / 'started'}\n")
    script.chmod(0o755)
    backend = LocalBackend(Settings(), python=str(script))
    backend.fork_reply_timeout_s = 0.5
    backend.zygote_retry_s = 0.3
    return backend


async def test_a_zygote_that_stops_answering_is_replaced_after_a_pause(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    pool = SimpleNamespace(name="p", spec=SimpleNamespace(slots=1))
    try:
        await backend.start(timeout_s=30)
        wedged = backend._zygote
        assert wedged is not None and backend._zygote_ready

        assert await backend._fork(pool, "w1") is None  # no answer in time: this worker starts cold
        assert wedged.wait(5) is not None  # and the wedged zygote is killed
        assert backend.fork_server  # forking is not given up for good

        # within the pause, workers start cold without waiting on (or starting) a zygote
        assert await backend._fork(pool, "w2") is None
        assert backend._zygote is None  # killed by us: not found later as an exit ("status -9", tester 49)

        await asyncio.sleep(0.4)
        # after the pause: a new zygote imports in the background, and this worker starts cold rather
        # than wait behind its imports (under the lock, up to 60 s for a wedged one)
        assert await backend._fork(pool, "w3") is None
        assert backend._warming is not None
        await asyncio.wait_for(backend._warming, 30)
        fresh = backend._zygote
        assert fresh is not wedged and fresh is not None and fresh.poll() is None and backend._zygote_ready
        pid = await backend._fork(pool, "w4")  # the new zygote, which answers
        assert pid == fresh.pid
        assert backend._zygote_failures == 0
    finally:
        await backend.close()


async def test_the_pause_doubles_while_new_zygotes_keep_failing(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    (tmp_path / "started").unlink(missing_ok=True)
    pool = SimpleNamespace(name="p", spec=SimpleNamespace(slots=1))
    try:
        await backend.start(timeout_s=30)
        assert await backend._fork(pool, "w1") is None
        first_pause = backend._zygote_retry_at - time.monotonic()
        # the next zygote fails too (its imports never end): the pause doubles
        backend.python = "/bin/sleep"  # `sleep -m workers.zygote` exits at once: no ready line
        backend._zygote_retry_at = 0.0
        assert await backend._fork(pool, "w2") is None  # cold, while the new zygote warms...
        await asyncio.wait_for(backend._warming, 30)  # ...and fails
        second_pause = backend._zygote_retry_at - time.monotonic()
        assert backend._zygote_failures == 2
        assert 0.25 < first_pause <= 0.3 and 0.55 < second_pause <= 0.6
    finally:
        await backend.close()
