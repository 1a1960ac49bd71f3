"""The agent host: the process that runs ONE session's agent, inside that session's sandbox.

Started by the worker (``workers/sandbox.py``) as ``python -m workers.agenthost`` with the JSON-lines
protocol of ``workers/command.py`` on stdin/stdout. Its first message is ``init``:

    -> {"op": "init", "entrypoint": "pkg.mod:Class" | null, "argv": [...] | null, "env": {...},
        "session": "s1", "epoch": 3, "template": "t", "workspace": "/workspace",
        "rlimits": {"RLIMIT_NPROC": 256, ...}, "sandboxed": true}

The host lowers its rlimits (inherited by every process the agent starts), sets the template's and
session's env, changes to the workspace and then either

* ``argv`` (``spec.command`` agents): ``exec``s the command, which speaks the same protocol from the
  next message on (no answer to ``init``), or
* ``entrypoint`` (Python agents): imports the class, answers ``{"ok": true}``, and serves ``start`` /
  ``invoke`` / ``snapshot`` / ``stop`` by calling the agent (``workers.handler.Agent``).

The agent's state is serialized (``snapshot``) and restored (``start``) here, inside the sandbox; the
worker only moves JSON. The protocol's stdout is a private duplicate of fd 1: fd 1 and ``sys.stdout``
point at stderr (the worker's log), so an agent that prints cannot corrupt the protocol.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import traceback
from typing import Any, BinaryIO

#: an answer line is at most this long (the worker's reader has the same bound)
MAX_LINE_BYTES = 64 * 1024 * 1024


def _apply_rlimits(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        which = getattr(resource, name, None)
        if which is None:
            continue
        soft, hard = resource.getrlimit(which)
        value = int(value)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as e:
            print(f"agenthost: cannot set {name}={value}: {e}", file=sys.stderr)


class Host:
    def __init__(self, inp: BinaryIO, out: BinaryIO) -> None:
        self.inp = inp
        self.out = out
        self.loop = asyncio.new_event_loop()
        self.agent: Any = None

    def send(self, msg: dict[str, Any]) -> None:
        try:
            line = json.dumps(msg).encode()
        except (TypeError, ValueError, RecursionError) as e:
            line = json.dumps({"error": f"agent answered something that is not JSON: {e}",
                               "code": "agent_error"}).encode()
        if len(line) > MAX_LINE_BYTES:
            line = json.dumps({"error": f"answer of {len(line)} bytes is over {MAX_LINE_BYTES}",
                               "code": "agent_error"}).encode()
        self.out.write(line + b"\n")
        self.out.flush()

    def recv(self) -> dict[str, Any] | None:
        line = self.inp.readline()
        if not line:
            return None
        return json.loads(line)

    def init(self, msg: dict[str, Any]) -> None:
        _apply_rlimits(msg.get("rlimits") or {})
        env = {str(k): str(v) for k, v in (msg.get("env") or {}).items()}
        os.environ.update(env)
        workspace = msg.get("workspace") or os.getcwd()
        os.chdir(workspace)
        argv = msg.get("argv")
        if argv:
            # answer first (the worker sends nothing more until then, so no line sits in our read buffer),
            # then the command speaks the protocol on its own stdin/stdout
            self.send({"ok": True, "exec": True})
            os.dup2(self.out.fileno(), 1)
            os.dup2(self.inp.fileno(), 0)
            os.environ["SUBSTRATE_SESSION_ID"] = str(msg.get("session", ""))
            try:
                os.execvpe(argv[0], list(argv), dict(os.environ))  # never returns
            except OSError as e:
                print(f"agenthost: cannot exec {argv[0]!r}: {e}", file=sys.stderr)
                os._exit(127)
        from pathlib import Path

        from workers.handler import SessionContext, load_agent_class

        cls = load_agent_class(str(msg["entrypoint"]))
        ctx = SessionContext(session_id=str(msg.get("session", "")), epoch=int(msg.get("epoch", 0)),
                             template=str(msg.get("template", "")), workspace=Path(workspace), env=env,
                             sandboxed=bool(msg.get("sandboxed")), limits=dict(msg.get("limits") or {}))
        self.agent = cls(ctx)
        self.send({"ok": True})

    def serve(self) -> None:
        from workers.handler import AgentError

        while True:
            try:
                msg = self.recv()
            except (ValueError, RecursionError) as e:
                self.send({"error": f"bad request line: {e}", "code": "agent_error"})
                continue
            if msg is None:
                return
            op = msg.get("op")
            try:
                if op == "init":
                    self.init(msg)
                elif op == "start":
                    self.loop.run_until_complete(self.agent.start(msg.get("state")))
                    self.send({"ok": True})
                elif op == "invoke":
                    self._invoke(msg.get("input"), bool(msg.get("stream")))
                elif op == "snapshot":
                    state = self.loop.run_until_complete(self.agent.snapshot())
                    self.send({"state": state})
                elif op == "stop":
                    try:
                        self.loop.run_until_complete(self.agent.stop())
                    finally:
                        self.send({"ok": True})
                    return
                else:
                    self.send({"error": f"unknown op {op!r}", "code": "agent_error"})
            except AgentError as e:
                self.send({"error": str(e), "code": "agent_error"})
            except MemoryError:
                self.send({"error": "the agent ran out of memory (isolation.maxMemory)",
                           "code": "memory_limit_exceeded"})
            except NotImplementedError:
                self.send({"error": "agent does not implement this operation", "code": "agent_error"})
            except Exception as e:  # noqa: BLE001 - an agent bug is the turn's answer
                traceback.print_exc(file=sys.stderr)
                self.send({"error": f"agent raised {e.__class__.__name__}: {e}", "code": "agent_crashed"})

    def _invoke(self, input: Any, stream: bool) -> None:  # noqa: A002
        if not stream:
            self.send({"output": self.loop.run_until_complete(self.agent.invoke(input))})
            return
        gen = self.agent.stream(input).__aiter__()
        last: Any = None
        while True:
            try:
                chunk = self.loop.run_until_complete(gen.__anext__())
            except StopAsyncIteration:
                break
            self.send({"chunk": chunk})
            last = chunk
        self.send({"output": last, "streamed": True})


def main() -> None:
    # the protocol keeps a private copy of stdout; the agent's prints go to stderr (the worker's log)
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto_in = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a subprocess of the agent must not read the protocol
    os.close(devnull)
    import workers.handler  # noqa: F401 - imported before the session arrives (pre-started hosts)

    Host(proto_in, proto_out).serve()
    sys.stderr.flush()
    os._exit(0)  # threads an agent left behind must not keep the sandbox alive


if __name__ == "__main__":
    main()
