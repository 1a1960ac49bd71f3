"""A test agent (command mode, unsandboxed template only) whose turn kills the worker hosting it: the
first ancestor process forked from the zygote. Used to prove the router does not resend such a turn to
worker after worker without bound."""

import json
import os
import signal
import sys


def _worker_pid() -> int | None:
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"workers.zygote" in f.read():
                    return pid
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None
    return None


for line in sys.stdin:
    msg = json.loads(line)
    op = msg.get("op")
    if op == "invoke":
        pid = _worker_pid()
        if pid:
            os.kill(pid, signal.SIGKILL)
        reply = {"output": "survived"}
    elif op == "snapshot":
        reply = {"state": {}}
    elif op == "stop":
        break
    else:
        reply = {"ok": True}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
