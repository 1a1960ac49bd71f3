"""The shell agent: runs a command line in the session's workspace.

Input is a command line (run by ``/bin/sh -c``); output ``{"stdout", "stderr", "exitCode"}``. Files the
commands create in the workspace persist across turns and across suspend/resume. The timeout per
command is ``SHELL_TIMEOUT_S`` from the template env (default 30 s); on timeout ``exitCode`` is -9.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from workers.handler import Agent, AgentError

_MAX_OUTPUT_BYTES = 1 << 20


class Shell(Agent):
    async def invoke(self, input: Any) -> Any:  # noqa: A002
        if not isinstance(input, str) or not input.strip():
            raise AgentError("shell input must be a non-empty command line (a string)")
        timeout_s = float(self.ctx.env.get("SHELL_TIMEOUT_S", "30"))
        env = {**os.environ, **self.ctx.env, "HOME": str(self.ctx.workspace)}
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", input, cwd=self.ctx.workspace, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
            code = proc.returncode
        except asyncio.TimeoutError:
            try:  # the whole process group: a child of the shell must not hold the pipes open
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = await proc.communicate()
            code = -9
        return {"stdout": out[:_MAX_OUTPUT_BYTES].decode(errors="replace"),
                "stderr": err[:_MAX_OUTPUT_BYTES].decode(errors="replace"), "exitCode": code}
