"""The shell agent's answer says when it cut a stream (it used to cut stdout/stderr at 1 MiB silently)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from workers.agents.shell import _MAX_OUTPUT_BYTES, Shell
from workers.handler import SessionContext


def _run(tmp_path: Path, command: str) -> dict:
    agent = Shell(SessionContext(session_id="s", epoch=1, template="shell", workspace=tmp_path))
    return asyncio.run(agent.invoke(command))


def test_a_cut_stream_is_flagged_with_its_full_size(tmp_path: Path) -> None:
    big = _MAX_OUTPUT_BYTES + 12345
    out = _run(tmp_path, f"yes a | tr -d '\\n' | head -c {big}; head -c {big + 1} /dev/zero >&2; exit 2")
    assert out["exitCode"] == 2
    assert out["stdout"] == "a" * _MAX_OUTPUT_BYTES
    assert (out["stdoutTruncated"], out["stdoutBytes"]) == (True, big)
    assert len(out["stderr"]) == _MAX_OUTPUT_BYTES
    assert (out["stderrTruncated"], out["stderrBytes"]) == (True, big + 1)


def test_output_at_the_limit_is_not_flagged(tmp_path: Path) -> None:
    out = _run(tmp_path, f"yes b | tr -d '\\n' | head -c {_MAX_OUTPUT_BYTES}; echo err >&2")
    assert out == {"stdout": "b" * _MAX_OUTPUT_BYTES, "stderr": "err\n", "exitCode": 0}


def test_a_command_killed_by_the_timeout_says_so(tmp_path: Path) -> None:
    """Fresh-user run: a timeout answered ``exitCode: -9`` and nothing else, like a crash or an OOM kill."""
    agent = Shell(SessionContext(session_id="s", epoch=1, template="shell", workspace=tmp_path,
                                 env={"SHELL_TIMEOUT_S": "0.5"}))
    out = asyncio.run(agent.invoke("echo started; sleep 30; echo never"))
    assert out == {"stdout": "started\n", "stderr": "", "exitCode": -9, "timedOut": True}


def test_a_command_that_kills_itself_is_not_a_timeout(tmp_path: Path) -> None:
    out = _run(tmp_path, "kill -9 $$")
    assert out["exitCode"] == -9 and "timedOut" not in out
