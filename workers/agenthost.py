"""The agent host: the process that runs ONE session's agent, inside that session's sandbox.

Started by the worker (``workers/sandbox.py``) as ``python -m workers.agenthost`` with the JSON-lines
protocol of ``workers/command.py`` on stdin/stdout. Once started (interpreter up, the shipped agents'
modules imported: ``PRELOAD``) it writes ``{"ready": true}``, then waits; its first message is ``init``:

    -> {"op": "init", "entrypoint": "pkg.mod:Class" | null, "argv": [...] | null, "env": {...},
        "session": "s1", "epoch": 3, "template": "t", "workspace": "/workspace",
        "rlimits": {"RLIMIT_NPROC": 256, ...}, "sandboxed": true, "maxAnswerBytes": 16777216}

The host lowers its rlimits (inherited by every process the agent starts), sets the template's and
session's env, changes to the workspace and then either

* ``argv`` (``spec.command`` agents): ``exec``s the command, which speaks the same protocol from the
  next message on (no answer to ``init``), or
* ``entrypoint`` (Python agents): imports the class, answers ``{"ok": true}``, and serves ``start`` /
  ``invoke`` / ``snapshot`` / ``stop`` by calling the agent (``workers.handler.Agent``).

Every request of the worker carries ``"id"`` (a fresh random string per request); every line the host
writes for it (answer, streamed chunk, error) carries the same ``"id"``. The agent's code runs in this
process and can write to the protocol pipe itself; the worker takes a line without the id of the request
it waits for as a protocol violation by the agent and ends the activation (``workers/command.py``).

The agent's state is serialized (``snapshot``) and restored (``start``) here, inside the sandbox; the
worker only moves JSON. An agent that finds its restored state unusable raises
``workers.handler.StateLoadFailed`` from ``start``: the answer is then
``{"error": ..., "code": "state_load_failed", "exception": "<type>"}`` (the only answer the worker
takes as the session's own state being at fault; any other start failure is treated as one of the
moment). A ``snapshot`` that cannot be written within the limits raises ``StateTooLarge``:
``{"error": ..., "code": "state_too_large"}``, and the agent goes on. The protocol's stdout is a private duplicate of fd 1: fd 1 and ``sys.stdout``
point at stderr, so an agent that prints cannot corrupt the protocol. stderr is a pipe to the worker,
which logs it as bounded, escaped data (``workers/agentlog.py``), never the runtime's own stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
import traceback
from typing import Any, BinaryIO

#: an answer line is at most this long (the worker's reader has the same bound)
MAX_LINE_BYTES = 64 * 1024 * 1024
#: the host's first line, once started (the same bytes as ``workers.sandbox.READY_LINE``; this module
#: imports nothing of the worker's, so it is spelled out here)
READY_LINE = b'{"ready": true}'
#: modules of the shipped agents, imported while a host waits for its session (pre-started hosts), so
#: ``init`` of a shipped template costs no import (measured: the shell agent's ~5-9 ms, mostly
#: ``subprocess`` and ``tempfile``); an agent of any other entrypoint imports its own at ``init``
PRELOAD = ("workers.agents.shell", "workers.agents.counter", "workers.agents.notebook")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a broken optional agent must not stop the host
            print(f"agenthost: preloading {name} failed: {e!r}", file=sys.stderr)


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
        #: the largest protocol line sent (``maxAnswerBytes`` of ``init``); the worker reads no longer line
        self.max_line = MAX_LINE_BYTES
        #: the ``id`` of the request being answered (None: it carried none), echoed in every line sent for
        #: it, so the worker can tell the answer to its current request from a line the agent's own code
        #: wrote to the protocol pipe (it runs in this process and can reach ``out``). Not a secret: the
        #: agent can read it here; the worker's check is that a line answers the request it waits for.
        self.rid: Any = None

    def send(self, msg: dict[str, Any]) -> bool:
        """Write ``msg`` (plus ``id``: the current request's, if it carried one) as one line; False if it
        was replaced by an error (not JSON, or too long)."""
        sent = True
        tag = {} if self.rid is None else {"id": self.rid}
        try:
            # strict JSON (RFC 8259): NaN and Infinity are not JSON, and a lone surrogate is not Unicode
            # (UTF-8 cannot encode it); an answer holding either reached clients as invalid JSON labelled
            # application/json (fresh-user round 14)
            line = json.dumps({**msg, **tag}, allow_nan=False, ensure_ascii=False).encode()
        except (TypeError, ValueError, RecursionError) as e:
            line = json.dumps({"error": f"agent answered something that is not JSON: {e}",
                               "code": "agent_error", **tag}).encode()
            sent = False
        if len(line) > self.max_line:
            line = json.dumps({"error": f"the agent's answer of {len(line)} bytes is over the {self.max_line}-byte "
                                        "limit (worker.max_answer_bytes)", "code": "output_too_large", **tag}).encode()
            sent = False
        self.out.write(line + b"\n")
        self.out.flush()
        return sent

    def recv(self) -> dict[str, Any] | None:
        line = self.inp.readline()
        if not line:
            return None
        return json.loads(line)

    def init(self, msg: dict[str, Any]) -> None:
        _apply_rlimits(msg.get("rlimits") or {})
        if msg.get("maxAnswerBytes"):
            self.max_line = min(MAX_LINE_BYTES, int(msg["maxAnswerBytes"]))
        env = {str(k): str(v) for k, v in (msg.get("env") or {}).items()}
        os.environ.update(env)
        workspace = msg.get("workspace") or os.getcwd()
        os.chdir(workspace)
        argv = msg.get("argv")
        if argv:
            missing = _not_executable(str(argv[0]))
            if missing:  # said in init's answer: after ``ok`` an exec failure is only an exit status (127)
                if msg.get("sandboxed"):  # a host path outside the sandbox's binds is "not found" in it
                    missing += (" inside the sandbox, which sees /usr (and /bin, /lib), this Python's install and "
                                "packages, /tmp and the workspace (/workspace): install the program under /usr "
                                "or the venv, or ship it in the workspace, or set isolation.sandbox: false")
                self.send({"error": missing, "code": "agent_start_failed"})
                return
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
        from workers.handler import AgentError, StateLoadFailed, StateTooLarge

        while True:
            self.rid = None
            try:
                msg = self.recv()
            except (ValueError, RecursionError) as e:
                self.send({"error": f"bad request line: {e}", "code": "agent_error"})
                continue
            if msg is None:
                return
            if not isinstance(msg, dict):
                self.send({"error": "a request line must be a JSON object", "code": "agent_error"})
                continue
            self.rid = msg.get("id")
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
            except StateLoadFailed as e:  # the agent's positive word that its restored state is unusable
                # (only ``start`` loads state: from any other op it is just a failed call)
                code = "state_load_failed" if op == "start" else "agent_error"
                self.send({"error": str(e), "code": code, "exception": e.exception_type})
            except StateTooLarge as e:
                code = "state_too_large" if op == "snapshot" else "agent_error"
                self.send({"error": str(e), "code": code})
            except MemoryError:
                self.send({"error": "the agent ran out of memory (isolation.maxMemory)",
                           "code": "memory_limit_exceeded"})
            except NotImplementedError:
                self.send({"error": "agent does not implement this operation", "code": "agent_error"})
            except Exception as e:  # noqa: BLE001 - an agent bug is the turn's answer
                traceback.print_exc(file=sys.stderr)
                # the process lives on with its state: not ``agent_crashed`` (a dead process, the session back
                # from its snapshot), which a client could not tell from this (fresh-user run); a snapshot
                # that raises is the agent refusing it, 422 ``agent_error``, as documented
                code = "agent_error" if op == "snapshot" else "agent_exception"
                self.send({"error": f"agent raised {e.__class__.__name__}: {e}", "code": code})

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
            if not self.send({"chunk": chunk}):  # the error ends the turn: nothing more may follow it
                with contextlib.suppress(Exception):
                    self.loop.run_until_complete(gen.aclose())
                return
            last = chunk
        self.send({"output": last, "streamed": True})


def _not_executable(command: str) -> str | None:
    """Why a command agent's ``command`` (its ``argv[0]``) cannot be run here, or None if it can; it is
    looked up as ``os.execvpe`` will (a name on this process's ``PATH``, a path as is, from the
    workspace, the current directory by then)."""
    import shutil

    if "/" not in command:
        path = os.environ.get("PATH", os.defpath)
        return None if shutil.which(command, path=path) else f"command {command!r} not found on PATH ({path})"
    if not os.path.exists(command):
        return f"command {command!r} not found"
    if os.path.isdir(command) or not os.access(command, os.X_OK):
        return f"command {command!r} is not an executable file"
    return None


def main() -> None:
    # the protocol keeps a private copy of stdout; the agent's prints go to stderr (a pipe the worker logs)
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto_in = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a subprocess of the agent must not read the protocol
    os.close(devnull)
    import workers.handler  # noqa: F401 - imported before the session arrives (pre-started hosts)

    _preload()
    # the worker hands a pre-started host to a session only after this line: a session never waits
    # for the interpreter's start-up while a booted host is free (``workers.sandbox.HostProcess``)
    proto_out.write(READY_LINE + b"\n")
    proto_out.flush()
    Host(proto_in, proto_out).serve()
    sys.stderr.flush()
    os._exit(0)  # threads an agent left behind must not keep the sandbox alive


if __name__ == "__main__":
    main()
