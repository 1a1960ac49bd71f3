"""The worker's side of an agent process: JSON lines to the agent host in the session's sandbox.

Every agent runs out of the worker's process (``workers/sandbox.py``, ``workers/agenthost.py``); this
module is the only place the worker talks to it. The protocol (one JSON object per line, request then
answer; stderr goes to the worker's log) is also what a ``spec.command`` agent in any language speaks:

    -> {"op": "start", "session": "s1", "epoch": 3, "workspace": "/workspace", "state": {...} | null}
    <- {"ok": true}
    -> {"op": "invoke", "input": <any>, "stream": false}
    <- {"chunk": <any>}            (zero or more, for streaming)
    <- {"output": <any>}           (or {"error": "message", "code": "agent_error"})
    -> {"op": "snapshot"}
    <- {"state": {...}}
    -> {"op": "stop"}               (the process should exit; it is killed after 2 s)

Before ``start`` the worker sends the host's ``init`` (see ``workers/agenthost.py``); for a command agent
the host answers it and ``exec``s the command, which then gets ``start``. A command runs with its
workspace as the current directory and the template's and session's env.

Failures: a turn that runs past the template's ``isolation.turnTimeout`` kills the whole sandbox and
answers 504 ``turn_timeout``; a host killed by its memory cgroup answers 422 ``memory_limit_exceeded``;
any other death 500 ``agent_crashed``. The next call starts a new sandbox in the same slot from the state
of the last snapshot (the workspace files stay), so a failed turn never takes the session down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from typing import Any, AsyncIterator

from substrate.errors import SubstrateError
from workers.handler import Agent, AgentError, SessionContext
from workers.sandbox import WORKSPACE_PATH, HostProcess, Limits, SandboxPool, Slot

_STOP_GRACE_S = 2.0
_STATUS = {"turn_timeout": 504, "memory_limit_exceeded": 422, "agent_crashed": 500, "agent_error": 422,
           "agent_start_failed": 500}


class TurnFailed(SubstrateError):
    """A turn (or start/snapshot) failed in the agent's process; ``code`` says how."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, code=code)
        self.status = _STATUS.get(code, 500)


class HostedAgent(Agent):
    """The ``Agent`` interface over a sandboxed agent host (Python ``entrypoint`` or ``command``).

    ``ctx.env`` is the already-validated template + session env. ``state`` given to ``start`` and
    returned by ``snapshot`` is plain JSON; the worker never unpickles anything an agent wrote.
    """

    def __init__(self, ctx: SessionContext, *, pool: SandboxPool, slot: Slot, limits: Limits,
                 entrypoint: str | None, argv: list[str] | None) -> None:
        super().__init__(ctx)
        self.pool = pool
        self.slot = slot
        self.limits = limits
        self.entrypoint = entrypoint
        # a template that starts "python"/"python3" means this runtime's interpreter (and its packages),
        # not whichever python is first on PATH (the sandbox binds that interpreter read-only)
        if argv and argv[0] in ("python", "python3"):
            argv = [sys.executable, *argv[1:]]
        self.argv = argv
        self.host: HostProcess | None = None
        self._state: dict[str, Any] | None = None
        self._first = True
        #: set when the agent process was started again within this activation (it died or was killed:
        #: crash, memory limit, turn timeout): its state since the last snapshot is gone, and answers say so
        self.restarted = False
        #: a call is waiting for the host's answer (a stop meanwhile kills instead of talking)
        self._reading = False

    @property
    def workspace_in_sandbox(self) -> str:
        return WORKSPACE_PATH if self.limits.sandboxed else str(self.slot.workspace)

    # ------------------------------------------------------------------------------------- transport
    async def _send(self, msg: dict[str, Any]) -> None:
        host = self.host
        if host is None or host.proc.stdin is None:
            raise TurnFailed("agent process is not running", "agent_crashed")
        try:
            host.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            await host.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise await self._died(f"agent process went away ({e.__class__.__name__})") from e

    async def _recv(self, deadline: float) -> dict[str, Any]:
        host = self.host
        assert host is not None and host.proc.stdout is not None
        self._reading = True
        try:
            line = await asyncio.wait_for(host.proc.stdout.readline(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            await self._kill()
            raise TurnFailed(f"turn ran over isolation.turnTimeout ({self.limits.turn_timeout_s:g} s); every "
                             "process of the session was killed and it restarts from its last snapshot",
                             "turn_timeout") from None
        except (ValueError, asyncio.LimitOverrunError) as e:  # a line over the reader's limit
            await self._kill()
            raise TurnFailed(f"agent wrote an answer line that is too long: {e}", "agent_crashed") from e
        finally:
            self._reading = False
        if not line:
            raise await self._died("agent process exited")
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError) as e:
            await self._kill()
            raise TurnFailed(f"agent wrote a line that is not JSON: {line[:200]!r}", "agent_crashed") from e
        if not isinstance(msg, dict):
            await self._kill()
            raise TurnFailed(f"agent wrote a JSON line that is not an object: {line[:200]!r}", "agent_crashed")
        return msg

    async def _died(self, what: str) -> TurnFailed:
        host, self.host = self.host, None
        code = None
        if host is not None:
            host.kill()
            with contextlib.suppress(ProcessLookupError):
                code = await host.proc.wait()
        cg = self.slot.cgroup
        if cg is not None and cg.new_oom_kill():
            return TurnFailed(f"the session went over isolation.maxMemory "
                              f"({self.limits.memory_bytes} bytes) and its agent was killed; it restarts from "
                              "its last snapshot", "memory_limit_exceeded")
        return TurnFailed(f"{what} (exit status {code}); it restarts from its last snapshot", "agent_crashed")

    async def _kill(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            await host.close()

    def _deadline(self) -> float:
        return time.monotonic() + self.limits.turn_timeout_s

    # ------------------------------------------------------------------------------------ lifecycle
    async def _boot(self) -> None:
        if self._first:
            self.host = await self.pool.host_for(self.slot, self.limits)
            self._first = False
        else:
            self.restarted = True
            self.host = await self.pool.spawn(self.slot, self.limits)
        deadline = self._deadline()
        with_memory_rlimit = self.slot.cgroup is None
        await self._send({"op": "init", "entrypoint": self.entrypoint, "argv": self.argv,
                          "env": self.ctx.env, "session": self.ctx.session_id, "epoch": self.ctx.epoch,
                          "template": self.ctx.template, "workspace": self.workspace_in_sandbox,
                          "rlimits": self.limits.rlimits(with_memory_rlimit), "sandboxed": self.limits.sandboxed,
                          "limits": {"turnTimeoutS": self.limits.turn_timeout_s,
                                     "memoryBytes": self.limits.memory_bytes}})
        await self._expect_ok(await self._recv(deadline), "init")
        await self._send({"op": "start", "session": self.ctx.session_id, "epoch": self.ctx.epoch,
                          "workspace": self.workspace_in_sandbox, "state": self._state})
        await self._expect_ok(await self._recv(deadline), "start")

    async def _expect_ok(self, reply: dict[str, Any], what: str) -> None:
        if not reply.get("ok"):
            await self._kill()
            raise TurnFailed(f"agent failed to {what}: {reply.get('error', reply)}", "agent_start_failed")

    async def _ensure(self) -> None:
        if self.host is None or not self.host.alive:
            await self._kill()
            await self._boot()

    async def start(self, state: dict[str, Any] | None) -> None:
        self._state = state
        await self._boot()

    async def stream(self, input: Any) -> AsyncIterator[Any]:  # noqa: A002
        await self._ensure()
        deadline = self._deadline()
        await self._send({"op": "invoke", "input": input, "stream": True})
        while True:
            msg = await self._recv(deadline)
            if "chunk" in msg:
                yield msg["chunk"]
            elif "output" in msg:
                if not msg.get("streamed"):  # a command agent that answers without chunks
                    yield msg["output"]
                return
            else:
                raise self._error(msg)

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        await self._ensure()
        deadline = self._deadline()
        await self._send({"op": "invoke", "input": input, "stream": False})
        last = None
        while True:
            msg = await self._recv(deadline)
            if "chunk" in msg:
                last = msg["chunk"]
            elif "output" in msg:
                return msg["output"] if not msg.get("streamed") else last
            else:
                raise self._error(msg)

    @staticmethod
    def _error(msg: dict[str, Any]) -> Exception:
        code = str(msg.get("code") or "agent_error")
        text = str(msg.get("error", msg))
        if code == "agent_error":
            return AgentError(text)
        return TurnFailed(text, code if code in _STATUS else "agent_crashed")

    async def snapshot(self) -> dict[str, Any]:
        await self._ensure()
        await self._send({"op": "snapshot"})
        msg = await self._recv(self._deadline())
        if "state" not in msg:
            raise self._error(msg)
        state = msg.get("state") or {}
        if not isinstance(state, dict):
            raise TurnFailed("agent snapshot state is not a JSON object", "agent_crashed")
        self._state = state
        return state

    def freeze(self, frozen: bool) -> None:
        """Stop (or resume) every process of the session while its workspace is packed, so no agent
        process can swap a file for a link under the packer's feet (cgroup freezer; no-op without)."""
        if self.slot.cgroup is not None:
            self.slot.cgroup.freeze(frozen)

    async def stop(self) -> None:
        host = self.host
        if host is None or not host.alive or self._reading:  # mid-turn (a DELETE): kill, do not talk
            await self._kill()
            return
        try:
            await self._send({"op": "stop"})
            await asyncio.wait_for(host.proc.wait(), _STOP_GRACE_S)
        except (asyncio.TimeoutError, TurnFailed):
            pass
        finally:
            await self._kill()
