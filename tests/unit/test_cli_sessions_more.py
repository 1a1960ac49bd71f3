"""CLI commands a fresh-user run found missing though the API and SDK have them: ``sessions events``,
``sessions resume --worker``, ``sessions create --env``. Requests checked against a mock transport."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import app


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    got: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request)
        if request.url.path.endswith("/events"):
            page = 1 if "continue" not in request.url.params else 2
            return httpx.Response(200, json={"items": [{"action": f"a{page}", "session": "s1"}],
                                             "metadata": {"continue": "c2" if page == 1 else None}})
        return httpx.Response(201 if request.method == "POST" else 200,
                              json={"id": "s1", "state": "RUNNING", "env": ["API_KEY"]})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    return got


def test_events_prints_json_lines_and_follows_pages_with_all(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "events", "s1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[0]) == {"action": "a1", "session": "s1"}, r.output
    assert "--continue c2" in r.output and len(seen) == 1
    r = CliRunner().invoke(app, ["sessions", "events", "s1", "--all", "--limit", "1"])
    assert [json.loads(x)["action"] for x in r.output.splitlines()] == ["a1", "a2"], r.output
    assert seen[-1].url.params["continue"] == "c2" and seen[-1].url.params["limit"] == "1"


def test_resume_on_a_worker_and_create_with_env(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "resume", "s1", "--worker", "w-7"])
    assert r.exit_code == 0, r.output
    assert json.loads(seen[-1].content) == {"worker": "w-7"}
    r = CliRunner().invoke(app, ["sessions", "create", "counter", "-e", "API_KEY=s3cret=x", "-l", "team=a"])
    assert r.exit_code == 0, r.output
    body = json.loads(seen[-1].content)
    assert body["env"] == {"API_KEY": "s3cret=x"} and body["labels"] == {"team": "a"}
    assert "s3cret" not in r.output


@pytest.mark.parametrize("args,message", [
    (["-e", "NOVALUE"], "-e/--env takes NAME=value, got NOVALUE"),
    (["-e", "A=1", "-e", "A=2"], "-e/--env: A given twice"),
    (["-l", "team"], "-l/--label takes key=value, got team"),
    (["-l", "=x"], "-l/--label takes key=value, got =x"),
])
def test_bad_env_options_send_nothing(seen: list[httpx.Request], args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, ["sessions", "create", "counter", *args])
    assert r.exit_code == 2 and message in r.output, r.output
    assert seen == []


def test_invoke_stream_prints_each_chunk_as_it_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: ``sessions invoke --stream`` printed nothing until the turn ended."""
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    order: list[str] = []

    def body():  # the server's NDJSON, line by line; records when each line is produced
        for i in range(3):
            order.append(f"sent {i}")
            yield (json.dumps({"chunk": f"c{i}"}) + "\n").encode()
        order.append("sent error")
        yield b'{"error": {"code": "worker_unavailable", "message": "worker failed mid-stream"}}\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=body())

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    monkeypatch.setattr(cli, "_print", lambda v: order.append(f"printed {v}"))
    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "go", "--stream"])
    assert order[:6] == ["sent 0", "printed c0", "sent 1", "printed c1", "sent 2", "printed c2"], order
    assert r.exit_code == 1 and "worker_unavailable" in r.output, r.output


def test_an_unreachable_server_is_one_line_naming_its_url() -> None:
    """Connection refused said only "[Errno 111] Connection refused" (fresh-user run): which URL?"""
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(app, ["sessions", "list", "--server", f"http://127.0.0.1:{port}"],
                           env={"COLUMNS": "400"})
    assert r.exit_code == 1
    out = r.output.strip()
    assert f"cannot reach the API at http://127.0.0.1:{port}" in out and "Traceback" not in out, out
    assert len(out.splitlines()) == 1, out


def test_a_401_names_the_clis_own_way_to_send_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user run: against an API with keys, ``sessions list`` said "Authorization: Bearer ..." but
    not how this CLI sends one."""
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"code": "unauthorized", "message": "this API needs a bearer token"})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    r = CliRunner().invoke(app, ["sessions", "get", "s1"])
    assert r.exit_code == 1
    assert "401 unauthorized" in r.output and "--token or SUBSTRATE_TOKEN" in r.output, r.output


@pytest.mark.parametrize("args,sent", [
    (["true"], True),  # JSON if it is JSON
    (["42"], 42),
    (["--text", "true"], "true"),  # a shell agent takes only a string: --text sends it as typed
    (["-t", "42"], "42"),
    (["-t", "null"], "null"),
    (["-t", '{"a": 1}'], '{"a": 1}'),
    (["-t", "1e999"], "1e999"),  # out of range as JSON, fine as text
])
def test_invoke_text_sends_input_as_a_string(monkeypatch: pytest.MonkeyPatch, args: list[str], sent: object) -> None:
    got = _capture_invokes(monkeypatch)
    r = CliRunner().invoke(app, ["sessions", "invoke", "sh1", *args])
    assert r.exit_code == 0, r.output
    assert json.loads(got[-1].content) == {"input": sent}
    assert type(json.loads(got[-1].content)["input"]) is type(sent)


@pytest.mark.parametrize(("args", "stdin", "sent", "note"), [
    (["-"], '{"op": "get"}\n', {"op": "get"}, False),  # a dash reads standard input (fresh-user run 35)
    (["-"], "increment\n", "increment", False),  # without its final line break (run 36)
    (["-", "--text"], "ls -la\r\n", "ls -la", False),
    (["-", "--text"], "two\nlines\n\n", "two\nlines\n", False),  # one line break only
    (['"-"'], "", "-", False),  # a lone dash as the input: as JSON
    (['{"unterminated'], "", '{"unterminated', True),  # looks like JSON, is not: sent as text, with a note
    (["[ -f a ] && echo yes"], "", "[ -f a ] && echo yes", True),
    (["plain words"], "", "plain words", False),
])
def test_invoke_reads_standard_input_and_says_when_json_looking_input_is_sent_as_text(
        monkeypatch: pytest.MonkeyPatch, args: list[str], stdin: str, sent: object, note: bool) -> None:
    got = _capture_invokes(monkeypatch)
    r = CliRunner().invoke(app, ["sessions", "invoke", "sh1", *args], input=stdin, env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert json.loads(got[-1].content) == {"input": sent}
    assert ("INPUT is not JSON" in r.output) is note, r.output


@pytest.mark.parametrize(("stdin", "says"), [(b"", "standard input is empty"), (b"\n", "standard input is empty"),
                                             (b"caf\xe9", "not UTF-8 text (byte 0xe9 at 3)")])
def test_invoke_from_empty_or_non_utf8_standard_input_sends_nothing(monkeypatch: pytest.MonkeyPatch, stdin: bytes,
                                                                    says: str) -> None:
    import substrate.cli as cli

    monkeypatch.setattr(cli, "SubstrateClient", lambda *a, **k: pytest.fail("nothing may be sent"))
    r = CliRunner().invoke(app, ["sessions", "invoke", "sh1", "-"], input=stdin, env={"COLUMNS": "300"})
    assert r.exit_code == 2 and says in r.output, r.output


def _capture_invokes(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    """Point the CLI's client at a mock transport that answers every call 200 ``{"output": "ok"}``; returns
    the list the requests it sent are collected in."""
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    got: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request)
        return httpx.Response(200, json={"output": "ok"})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    return got


@pytest.mark.parametrize("status,code,exit_code", [
    (422, "invalid_tenant", 2), (422, "invalid_continue", 2), (400, "bad_json", 2), (422, "invalid_env", 2),
    (422, "unknown_template", 2), (422, "unknown_worker", 2), (400, "unsupported_template", 2),
    (422, "agent_error", 1), (422, "state_load_failed", 1), (422, "unknown_pool", 1), (404, "session_not_found", 1),
    (503, "no_capacity", 1)])
def test_arguments_the_api_refuses_exit_2_like_those_the_cli_refuses(monkeypatch: pytest.MonkeyPatch, status: int,
                                                                       code: str, exit_code: int) -> None:
    """Fresh-user tester 45: ``sessions list --state bogus`` exited 2 (the CLI checks it) but ``--tenant BAD``
    and ``--continue garbage`` 1 (the API checks them): a script could not tell a bad command from a
    failure. The API's refusals of the arguments exit 2 now; the agent's own 422s and the rest still 1."""
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"code": code, "message": "refused"})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    r = CliRunner().invoke(app, ["sessions", "list", "--tenant", "BAD"], env={"COLUMNS": "300"})
    assert r.exit_code == exit_code, r.output
    assert f"error {status} {code}: refused" in r.output


def test_an_invoke_that_cannot_reach_the_server_names_the_key_to_resend_with() -> None:
    """Fresh-user tester 53: a server stopped mid-turn answered 503 router_stopping ("the turn may have
    run: retry with the same Idempotency-Key"), the SDK's retries then found it gone, and the CLI said
    only "cannot reach the API", with no key; the turn had run. The CLI makes the key, and names it."""
    import re
    import socket

    from typer.testing import CliRunner

    from substrate.cli import app

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "get", "--server", f"http://127.0.0.1:{port}"],
                           env={"COLUMNS": "400"})
    assert r.exit_code == 1, r.output
    assert re.search(r"note: the turn may have run on the server: send it again with -k [0-9a-f]{32} ", r.output), r.output
    assert "cannot reach the API" in r.output


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_idempotency_key_is_refused_not_taken_as_none(key: str) -> None:
    """Fresh-user tester 53: ``-k ''`` was silently no key, so the turn was not idempotent."""
    from typer.testing import CliRunner

    from substrate.cli import app

    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "get", "-k", key, "--server", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "invalid_idempotency_key" in r.output, r.output


@pytest.mark.parametrize(("status", "code", "hinted"), [
    (503, "router_stopping", True), (502, "worker_unavailable", True), (504, "turn_timeout", True),
    (503, "snapshot_store_unavailable", False), (503, "no_capacity", False), (503, "resume_timeout", False)])
def test_the_resend_note_comes_only_after_failures_the_turn_may_have_run_through(
        monkeypatch: pytest.MonkeyPatch, status: int, code: str, hinted: bool) -> None:
    """Fresh-user tester 54: a wake refused by a fenced store (503 ``snapshot_store_unavailable``) was
    followed by "the turn may have run on the server", though it never reached an agent."""
    import httpx
    from typer.testing import CliRunner

    import substrate.cli as cli
    from substrate.cli import app
    from substrate.client import SubstrateClient

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"code": code, "message": "refused"})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, retries=0, transport=httpx.MockTransport(handler)))
    r = CliRunner().invoke(app, ["sessions", "invoke", "s1", "get"], env={"COLUMNS": "400"})
    assert r.exit_code == 1, r.output
    assert f"error {status} {code}: refused" in r.output
    assert ("the turn may have run on the server" in r.output) is hinted, r.output


def test_delete_takes_several_ids_goes_on_past_a_failure_and_exits_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user tester 54: ``sessions delete p1 p2`` was refused (one ID only)."""
    import httpx
    from typer.testing import CliRunner

    import substrate.cli as cli
    from substrate.cli import app
    from substrate.client import SubstrateClient

    deleted: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sid = request.url.path.rsplit("/", 1)[1]
        if sid == "gone":
            return httpx.Response(404, json={"code": "session_not_found", "message": f"session {sid!r} not found"})
        deleted.append(sid)
        return httpx.Response(204)

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    r = CliRunner().invoke(app, ["sessions", "delete", "p1", "gone", "p2"], env={"COLUMNS": "300"})
    assert deleted == ["p1", "p2"], r.output
    assert r.exit_code == 1 and "deleted p1" in r.output and "deleted p2" in r.output, r.output
    assert "error 404 session_not_found" in r.output
    r = CliRunner().invoke(app, ["sessions", "delete", "p3"], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and r.output.strip() == "deleted p3", r.output
