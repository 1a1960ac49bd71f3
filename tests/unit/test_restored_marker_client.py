"""The SDK and the CLI pass on what an answer's headers say (fresh-user round 23: a session whose worker
was killed came back empty, and `substrate sessions invoke` / ``SubstrateClient.invoke`` showed only
``{"count": 0}``: the ``X-Substrate-Restored`` marker reached raw-HTTP users only)."""

from __future__ import annotations

import json
import warnings

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import app
from substrate.client import Answer, StateRestoredWarning, SubstrateClient

RESTORED = {"X-Substrate-Restored": "worker_lost;snapshot=none", "X-Request-ID": "r1", "X-Substrate-Worker": "w1"}


def _client(headers: dict[str, str], *, stream: bool = False) -> SubstrateClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("stream"):
            return httpx.Response(200, headers={**headers, "Content-Type": "application/x-ndjson"},
                                  content=b'{"chunk": 1}\n{"chunk": 2}\n{"done": true}\n')
        return httpx.Response(200, headers=headers, json={"output": {"count": 0}})

    return SubstrateClient("http://api", transport=httpx.MockTransport(handler))


def test_invoke_warns_when_the_state_came_back_older_every_time() -> None:
    c = _client(RESTORED)
    with warnings.catch_warnings(record=True) as seen:
        for _ in range(2):  # the same call site twice: both warn (a loss is never folded into another)
            assert c.invoke("s1", "get") == {"count": 0}
    assert [w.category for w in seen] == [StateRestoredWarning, StateRestoredWarning]
    assert "worker_lost;snapshot=none" in str(seen[0].message) and "'s1'" in str(seen[0].message)
    with warnings.catch_warnings(record=True) as seen:
        assert _client({}).invoke("s1", "get") == {"count": 0}
    assert seen == [], "an ordinary answer warns nothing"


def test_invoke_answer_gives_the_headers_meaning() -> None:
    a = _client({**RESTORED, "X-Substrate-Replayed": "1", "X-Substrate-Restored-Snapshot-At": "1700000000.5"}
                ).invoke_answer("s1", "get")
    assert a == Answer(output={"count": 0}, restored="worker_lost;snapshot=none", restored_snapshot_at=1700000000.5,
                       replayed=True, woke=False, worker="w1", request_id="r1")


def test_a_streamed_turn_warns_or_hands_the_answer_over() -> None:
    with warnings.catch_warnings(record=True) as seen:
        assert list(_client(RESTORED).invoke_stream("s1", "get")) == [1, 2]
    assert [w.category for w in seen] == [StateRestoredWarning]
    got: list[Answer] = []
    with warnings.catch_warnings(record=True) as seen:
        assert list(_client(RESTORED).invoke_stream("s1", "get", on_answer=got.append)) == [1, 2]
    assert seen == [] and got[0].restored == "worker_lost;snapshot=none" and got[0].output is None


@pytest.mark.parametrize("stream", [False, True])
def test_the_cli_says_so_on_stderr_and_keeps_stdout_the_output(monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    import substrate.cli as cli

    headers = {**RESTORED, "X-Substrate-Replayed": "1", "X-Substrate-Restored-Snapshot-At": "1700000000"}
    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: _client(headers))
    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "get", *(["--stream"] if stream else [])])
    assert r.exit_code == 0, r.output
    assert "warning: session s1 answered from an older state from its snapshot of 2023-11-14 22:13:20 UTC " \
           "(worker_lost;snapshot=none)" in r.stderr
    assert "note: replayed" in r.stderr
    out, text, at = [], r.stdout.strip(), 0
    while at < len(text):  # the printed JSON values, one after the other (pretty-printed)
        value, end = json.JSONDecoder().raw_decode(text, at)
        out.append(value)
        at = len(text) - len(text[end:].lstrip())
    assert out == ([1, 2] if stream else [{"count": 0}])
