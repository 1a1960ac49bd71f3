"""The shell agent: runs a command line in the session's workspace, inside the session's sandbox.

Input is a command line (run by ``/bin/sh -c`` with the workspace as working directory and ``HOME``);
output ``{"stdout", "stderr", "exitCode"}`` (each stream capped at 1 MiB). Files the commands create in
the workspace persist across turns and across suspend/resume. The timeout per command is
``SHELL_TIMEOUT_S`` from the template env (default 30 s; a session cannot override it); on timeout
``exitCode`` is -9.

A turn ends when the shell exits (or times out): then every other process of the session is killed
(inside the sandbox the agent host sees only its own PID namespace, so that is "everything but the host";
without a sandbox, the command's process group). Output goes to files, not pipes, so a background child
that inherited them can never keep the turn open; nothing a command starts outlives its turn.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
from typing import Any

from workers.handler import Agent, AgentError

_MAX_OUTPUT_BYTES = 1 << 20


def sweep_namespace() -> int:
    """SIGKILL every process in this PID namespace except its init (pid 1) and this one; returns how
    many. Only meaningful inside a sandbox (its own PID namespace)."""
    me = os.getpid()
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            os.kill(int(name), signal.SIGKILL)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


class Shell(Agent):
    def _run(self, command: str, timeout_s: float) -> dict[str, Any]:
        env = {**os.environ, "HOME": str(self.ctx.workspace)}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=self.ctx.workspace, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = -9
            # the turn is over: nothing it started may outlive it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.ctx.sandboxed:
                sweep_namespace()
            proc.wait()
            streams = []
            for f in (out, err):
                f.seek(0)
                streams.append(f.read(_MAX_OUTPUT_BYTES).decode(errors="replace"))
        return {"stdout": streams[0], "stderr": streams[1], "exitCode": code}

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        if not isinstance(input, str) or not input.strip():
            raise AgentError("shell input must be a non-empty command line (a string)")
        if "\0" in input:
            raise AgentError("shell input must not contain NUL")
        timeout_s = float(self.ctx.env.get("SHELL_TIMEOUT_S", "30"))
        return await asyncio.to_thread(self._run, input, timeout_s)
