"""The shell agent: runs a command line in the session's workspace, inside the session's sandbox.

Input is a command line (run by ``/bin/sh -c`` with the workspace as working directory and ``HOME``);
output ``{"stdout", "stderr", "exitCode"}``. Each stream is cut at ``_MAX_OUTPUT_BYTES`` (1 MiB); a cut
stream says so: ``stdoutTruncated: true`` and ``stdoutBytes`` (how many bytes the command wrote), the
same for stderr (``stderrTruncated``/``stderrBytes``); the fields are absent when nothing was cut. Files the commands create in
the workspace persist across turns and across suspend/resume. The timeout per command is
``SHELL_TIMEOUT_S`` from the template env (default 30 s; a session cannot override it); on timeout
the command is killed, ``exitCode`` is -9 and ``timedOut`` is true (absent otherwise), with the output
it wrote until then.

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
import time
from typing import Any

from workers.handler import Agent, AgentError

#: bytes of each stream a turn's answer carries (the rest is cut, and the answer says so)
_MAX_OUTPUT_BYTES = 1 << 20


def sweep_namespace(max_passes: int = 50) -> int:
    """SIGKILL every process in this PID namespace except its init (pid 1) and this one, pass after pass
    until a pass finds none still alive (a process forking while a pass lists /proc would otherwise
    outlive the turn: seen once in CI); returns how many kills were sent. Zombies (dead, waiting for
    init to reap them) are skipped. Only meaningful inside a sandbox (its own PID namespace)."""
    me = os.getpid()
    n = 0
    for _ in range(max_passes):
        alive = 0
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in (1, me):
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[-1].split()[:1] in ([b"Z"], [b"X"]):
                        continue
                os.kill(int(name), signal.SIGKILL)
                alive += 1
            except (OSError, ValueError):  # gone meanwhile
                pass
        n += alive
        if not alive:
            break
        time.sleep(0.001)  # let the kills land before the next look
    return n


def _oom_first() -> None:
    """In the command's process before it runs: ``oom_score_adj`` 1000 (any process may raise its own), so
    that a command over the slot's memory limit is what the kernel's OOM killer takes, never the agent host
    while the command lives: under load the host was once taken for a child's 300 MiB and the turn
    answered ``memory_limit_exceeded`` (a suite run beside a fresh-user trial)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # no writable /proc: the kernel's own choice stands
        pass


class Shell(Agent):
    def _run(self, command: str, timeout_s: float) -> dict[str, Any]:
        env = {**os.environ, "HOME": str(self.ctx.workspace)}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=self.ctx.workspace, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    preexec_fn=_oom_first)
            timed_out = False
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code, timed_out = -9, True
            # the turn is over: nothing it started may outlive it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.ctx.sandboxed:
                sweep_namespace()
            proc.wait()
            result: dict[str, Any] = {}
            for name, f in (("stdout", out), ("stderr", err)):
                written_bytes = os.fstat(f.fileno()).st_size  # a file, not a pipe: its size is all it got
                f.seek(0)
                result[name] = f.read(_MAX_OUTPUT_BYTES).decode(errors="replace")
                if written_bytes > _MAX_OUTPUT_BYTES:  # never cut without saying so
                    result[f"{name}Truncated"] = True
                    result[f"{name}Bytes"] = written_bytes
        result["exitCode"] = code
        if timed_out:  # -9 alone read like a crash or an OOM kill (fresh-user run)
            result["timedOut"] = True
        return result

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        if not isinstance(input, str) or not input.strip():
            raise AgentError("shell input must be a non-empty command line (a string)")
        if "\0" in input:
            raise AgentError("shell input must not contain NUL")
        timeout_s = float(self.ctx.env.get("SHELL_TIMEOUT_S", "30"))
        return await asyncio.to_thread(self._run, input, timeout_s)
