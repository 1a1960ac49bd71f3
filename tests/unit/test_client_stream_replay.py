"""A plain call answered with a streamed turn's lines (its replay under the same key), and a stream that
fails after it began, in the SDK and the CLI (fresh-user round 24: a raw ``JSONDecodeError`` and exit 1
for the first; ``error 200 worker_unavailable`` with no way on for the second)."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import app
from substrate.client import ApiError, SubstrateClient

LINES = b'{"chunk": "a"}\n{"chunk": {"b": 1}}\n{"done": true}\n'
CUT = b'{"chunk": "a"}\n{"error": {"code": "worker_unavailable", "message": "worker failed mid-stream"}}\n'


def _client(body: bytes, seen: list[httpx.Request] | None = None, *, replayed: bool = True) -> SubstrateClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(200, headers={"Content-Type": "application/x-ndjson",
                                            **({"X-Substrate-Replayed": "1"} if replayed else {})}, content=body)

    return SubstrateClient("http://api", transport=httpx.MockTransport(handler))


def test_a_plain_call_answered_with_a_streamed_turns_lines_gives_its_chunks() -> None:
    a = _client(LINES).invoke_answer("s1", "x", idempotency_key="st-x")
    assert a.streamed and a.output == ["a", {"b": 1}] and a.replayed
    assert _client(LINES).invoke("s1", "x", idempotency_key="st-x") == ["a", {"b": 1}]
    with pytest.raises(ApiError) as info:  # a kept stream that had failed: its error, as the API's
        _client(CUT).invoke("s1", "x", idempotency_key="st-x")
    assert info.value.code == "worker_unavailable" and info.value.details == {"mid_stream": True}


def _output_values(text: str) -> list[object]:
    out, text, at = [], text.strip(), 0
    while at < len(text):
        value, end = json.JSONDecoder().raw_decode(text, at)
        out.append(value)
        at = len(text) - len(text[end:].lstrip())
    return out


def test_the_cli_prints_a_replayed_streams_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import substrate.cli as cli

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: _client(LINES))
    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "x", "-k", "st-x"])
    assert r.exit_code == 0, r.output
    assert _output_values(r.stdout) == ["a", {"b": 1}] and "note: replayed" in r.stderr


def test_a_stream_cut_after_it_began_says_what_to_resend(monkeypatch: pytest.MonkeyPatch) -> None:
    import substrate.cli as cli

    seen: list[httpx.Request] = []
    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: _client(CUT, seen, replayed=False))
    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "x", "--stream"], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and _output_values(r.stdout) == ["a"], r.output
    key = seen[0].headers["Idempotency-Key"]  # the CLI keyed the stream itself, so a resend is safe
    assert f"resend it with -k {key}" in r.stderr and "worker_unavailable: worker failed mid-stream" in r.stderr
    assert "error 200" not in r.stderr


AGENT_FAILED = b'{"chunk": {"n": 1}}\n{"error": {"code": "agent_error", "message": "boom after chunk"}}\n'


def _cli(monkeypatch: pytest.MonkeyPatch, client: SubstrateClient, *args: str):
    import substrate.cli as cli

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: client)
    return CliRunner().invoke(app, ["sessions", "invoke", "s1", "x", *args], env={"COLUMNS": "400"})


@pytest.mark.parametrize("stream", [False, True])
def test_a_kept_stream_that_failed_after_a_chunk_prints_the_chunk_and_the_error_once(
        monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """Fresh-user round 25: the plain replay dropped the chunk and said "error 200"; `--stream` advised a
    resend (which only replays the same failure) and added a stray "error: Exit: 1"."""
    r = _cli(monkeypatch, _client(AGENT_FAILED), "-k", "f1", *(["--stream"] if stream else []))
    assert r.exit_code == 1
    assert _output_values(r.stdout) == [{"n": 1}], r.output
    assert r.stderr.count("note: replayed") == 1, r.stderr
    assert "the turn failed after its answer began (agent_error: boom after chunk)" in r.stderr, r.stderr
    assert "resend" not in r.stderr and "Exit" not in r.stderr and "error 200" not in r.stderr, r.stderr


def test_a_lost_worker_mid_stream_prints_one_line_of_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _cli(monkeypatch, _client(CUT, replayed=False), "--stream", "-k", "mid")
    assert r.exit_code == 1 and "resend it with -k mid" in r.stderr
    assert "Exit" not in r.stderr and len([line for line in r.stderr.splitlines() if "error" in line]) == 1, r.stderr


def test_a_replayed_error_answer_says_it_is_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, headers={"X-Substrate-Replayed": "1"},
                              json={"code": "agent_error", "message": "bad input"})

    c = SubstrateClient("http://api", transport=httpx.MockTransport(handler))
    with pytest.raises(ApiError) as info:
        c.invoke("s1", "bogus", idempotency_key="e1")
    assert info.value.replayed and info.value.status == 422
    r = _cli(monkeypatch, SubstrateClient("http://api", transport=httpx.MockTransport(handler)), "-k", "e1")
    assert r.exit_code == 1 and "note: replayed" in r.stderr and "error 422 agent_error: bad input" in r.stderr
