"""The agent host writes strict JSON (RFC 8259) only: an agent's answer holding NaN, an infinity or a lone
surrogate becomes an error line, and the agent goes on (fresh-user round 14: such answers reached clients
as invalid JSON labelled application/json)."""

from __future__ import annotations

import io
import json

import pytest

from workers.agenthost import Host


def _parse_strict(line: bytes) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} written")

    return json.loads(line.decode("utf-8"), parse_constant=refuse)


@pytest.mark.parametrize("output", [float("nan"), float("inf"), -float("inf"), "a\ud800b", {"\udc00": 1},
                                    [1, {"x": float("nan")}]])
def test_an_answer_that_is_not_strict_json_becomes_an_error_line(output: object) -> None:
    out = io.BytesIO()
    host = Host(io.BytesIO(), out)
    host.rid = "r1"
    assert host.send({"output": output}) is False
    msg = _parse_strict(out.getvalue())
    assert msg["code"] == "agent_error" and msg["id"] == "r1" and "not JSON" in msg["error"]
    assert "output" not in msg


def test_non_ascii_text_is_written_as_utf_8_and_read_back_unchanged() -> None:
    out = io.BytesIO()
    host = Host(io.BytesIO(), out)
    assert host.send({"output": "héllo 😀 \u200b"}) is True
    assert _parse_strict(out.getvalue()) == {"output": "héllo 😀 \u200b"}
