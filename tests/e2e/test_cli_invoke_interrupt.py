"""``substrate sessions invoke`` interrupted (Ctrl-C) while its turn runs: the turn goes on on the server,
so the command names the turn's Idempotency-Key, and the same command with ``-k`` that key gets the
turn's answer without running it twice (fresh-user tester 50: it printed nothing, and the automatic key
was the SDK's own, so no resend could be safe)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _wait_until_connected(pid: int, limit: int = 600) -> None:
    """Return once process ``pid`` holds a socket (the CLI connected to the API), polling at most
    ``limit`` times every 0.1 s; raise ``AssertionError`` if it never does."""
    for _ in range(limit):
        fds = Path(f"/proc/{pid}/fd")
        try:
            if any(os.readlink(fds / f).startswith("socket:") for f in os.listdir(fds)):
                return
        except OSError:  # an fd closed while read
            pass
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never connected")


@pytest.mark.parametrize("stream", [False, True])  # tester 53: --stream said nothing on Ctrl-C
def test_an_interrupted_invoke_names_its_key_and_a_resend_with_it_does_not_run_the_turn_twice(shared_runtime,
                                                                                            stream: bool):
    c = shared_runtime.client
    sid = c.create_session("counter")["id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBSTRATE_")}
    env["SUBSTRATE_SERVER"] = shared_runtime.url
    cli = [sys.executable, "-m", "substrate.cli", "sessions", "invoke", sid, *(["--stream"] if stream else [])]
    p = subprocess.Popen([*cli, json.dumps({"op": "increment", "work_s": 3})], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_until_connected(p.pid)  # the CLI is past its imports and sending (a sleep was too short under load)
    time.sleep(0.3)  # the turn is on its way to the worker (it takes 3 s)
    p.send_signal(signal.SIGINT)
    out, errs = p.communicate(timeout=60)
    assert p.returncode == 130 and out == "", (out, errs)
    m = re.search(r"send it again with -k (\S+)", errs)
    assert m and "interrupted: the turn may still run on the server" in errs, errs
    again = subprocess.run([*cli, json.dumps({"op": "increment", "work_s": 3}), "-k", m.group(1)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and json.loads(again.stdout) == {"count": 1}, (again.stdout, again.stderr)
    assert c.invoke(sid, "get") == {"count": 1}, "the resend ran the turn a second time"
