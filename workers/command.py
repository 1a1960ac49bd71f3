"""``command`` mode: run any executable per session, speaking JSON lines on stdin/stdout.

Protocol (one JSON object per line, request then answer; stderr is passed through to the worker log):

    -> {"op": "start", "session": "s1", "epoch": 3, "workspace": "/path", "state": {...} | null}
    <- {"ok": true}
    -> {"op": "invoke", "input": <any>}
    <- {"chunk": <any>}            (zero or more, for streaming)
    <- {"output": <any>}           (or {"error": "message"})
    -> {"op": "snapshot"}
    <- {"state": {...}}
    -> {"op": "stop"}               (the process should exit; it is killed after 5 s)

The process runs with its workspace as the current directory and the template's env, so agents in any
language work. A process that dies is restarted on the next turn with the last snapshot's state.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any, AsyncIterator

from workers.handler import Agent, AgentError, SessionContext


class CommandAgent(Agent):
    """Adapter from the ``Agent`` interface to a JSON-lines child process."""

    def __init__(self, ctx: SessionContext, argv: list[str]) -> None:
        super().__init__(ctx)
        # a template that starts "python"/"python3" means this runtime's interpreter (and its packages),
        # not whichever python is first on PATH
        self.argv = [sys.executable, *argv[1:]] if argv and argv[0] in ("python", "python3") else list(argv)
        self.proc: asyncio.subprocess.Process | None = None
        self._state: dict[str, Any] | None = None

    async def _spawn(self) -> None:
        env = {**os.environ, **self.ctx.env, "SUBSTRATE_SESSION_ID": self.ctx.session_id}
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, cwd=self.ctx.workspace, env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=16 * 1024 * 1024)
        await self._send({"op": "start", "session": self.ctx.session_id, "epoch": self.ctx.epoch,
                          "workspace": str(self.ctx.workspace), "state": self._state})
        reply = await self._recv()
        if not reply.get("ok"):
            raise AgentError(f"command agent failed to start: {reply}")

    async def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        await self.proc.stdin.drain()

    async def _recv(self) -> dict[str, Any]:
        assert self.proc and self.proc.stdout
        line = await self.proc.stdout.readline()
        if not line:
            code = await self.proc.wait()
            self.proc = None
            raise AgentError(f"command agent exited with code {code}")
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            raise AgentError(f"command agent wrote a line that is not JSON: {line[:200]!r}") from e

    async def _ensure(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            await self._spawn()

    async def start(self, state: dict[str, Any] | None) -> None:
        self._state = state
        await self._spawn()

    async def stream(self, input: Any) -> AsyncIterator[Any]:  # noqa: A002
        await self._ensure()
        await self._send({"op": "invoke", "input": input})
        while True:
            msg = await self._recv()
            if "chunk" in msg:
                yield msg["chunk"]
            elif "output" in msg:
                yield msg["output"]
                return
            else:
                raise AgentError(str(msg.get("error", msg)))

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        out = None
        chunks = []
        async for c in self.stream(input):
            chunks.append(c)
            out = c
        return out

    async def snapshot(self) -> dict[str, Any]:
        await self._ensure()
        await self._send({"op": "snapshot"})
        msg = await self._recv()
        self._state = msg.get("state") or {}
        return self._state

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            await self._send({"op": "stop"})
            await asyncio.wait_for(self.proc.wait(), 5)
        except (asyncio.TimeoutError, BrokenPipeError, ConnectionResetError):
            self.proc.kill()
            await self.proc.wait()
