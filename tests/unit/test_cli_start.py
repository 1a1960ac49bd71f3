"""`substrate` start-up and client credentials (fresh-user run findings):

* the client's token is ``SUBSTRATE_TOKEN``; ``SUBSTRATE_API__AUTH_TOKEN`` (the server's admin token) holding a
  tenant's API key is refused at start, because `substrate up` from a shell where the README once told CLI users
  to export their key made that key an admin;
* ``--token`` works before the subcommand, like ``--server``;
* a taken port is refused before Redis or any worker starts, in one line;
* `up` run in-process (as these tests run it) leaves no logging handler on the runner's closed stream, which
  made later CLI tests of the same process print ``--- Logging error ---`` into their output (user trial).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from substrate.cli import app


def _mock_client(monkeypatch: pytest.MonkeyPatch, handler) -> None:  # noqa: ANN001
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))


@pytest.mark.parametrize("token, says", [
    # an API key would make a tenant's key an admin token (the CLI once read this variable)
    ("sk_abc123_secretsecret", ["SUBSTRATE_API__AUTH_TOKEN", "SUBSTRATE_TOKEN"]),
    # the admin token reaches every tenant's sessions: ``a`` was taken without a word (fresh-user run),
    # while API keys shorter than 19 characters are refused. 16 characters at least
    ("a", ["shorter than 16 characters", "openssl rand"]),
    ("x" * 15, ["shorter than 16 characters", "openssl rand"]),
])
def test_an_admin_token_that_is_an_api_key_or_short_is_refused_before_anything_starts(
        token: str, says: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_API__AUTH_TOKEN", token)
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["up", "--port", "1"])
    assert r.exit_code == 2, r.output
    assert all(x in r.output for x in says), r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(port)])
    assert r.exit_code == 2, r.output
    assert f"127.0.0.1:{port}" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "redis").exists()


@pytest.mark.parametrize("argv, env", [
    (["--token", "sk_top_level", "stats"], {}),
    (["stats", "--token", "sk_top_level"], {}),
    (["stats"], {"SUBSTRATE_TOKEN": "sk_top_level"}),
])
def test_the_client_token_reaches_the_server(argv: list[str], env: dict[str, str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"sessions": 0})

    _mock_client(monkeypatch, handler)
    monkeypatch.delenv("SUBSTRATE_TOKEN", raising=False)
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    assert seen == ["Bearer sk_top_level"]


def test_the_admin_token_variable_is_not_the_client_token(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"sessions": 0})

    _mock_client(monkeypatch, handler)
    monkeypatch.delenv("SUBSTRATE_TOKEN", raising=False)
    monkeypatch.setenv("SUBSTRATE_API__AUTH_TOKEN", "admin-secret-0123456789")
    r = CliRunner().invoke(app, ["stats"])
    assert r.exit_code == 0, r.output
    assert seen == [None]


def test_up_runs_the_embedded_default_whatever_role_it_inherits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell with SUBSTRATE_ROLE=router (set up for `substrate router`) made `up` serve the API with no
    worker pool: never ready, and nothing said why (found through a test that leaked it to later runtimes)."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SUBSTRATE_ROLE", "router")
    with socket.socket() as s:  # a taken port: `up` stops after its checks, before anything starts
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(s.getsockname()[1])])
    assert r.exit_code == 2, r.output
    assert "SUBSTRATE_ROLE=router ignored" in r.output
    assert os.environ["SUBSTRATE_ROLE"] == "embedded"  # what api.main (the app `up` serves) reads


@pytest.mark.parametrize("url", ["redis://:s3cret-pw@127.0.0.1:1/0", "redis://user:s3cret-pw@127.0.0.1:1/0",
                                 "redis://127.0.0.1:1/0"])
def test_an_unreachable_external_redis_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              url: str) -> None:
    """Fresh-user run: a traceback from the API's start-up and exit 3."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SUBSTRATE_REDIS_URL", url)
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: the port check passes
    r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(port)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: SUBSTRATE_REDIS_URL=redis://"), r.output
    assert "127.0.0.1:1/0" in lines[0] and "unset SUBSTRATE_REDIS_URL" in lines[0]
    assert "s3cret-pw" not in r.output and "Traceback" not in r.output
    assert not (tmp_path / "workers").exists() and not (tmp_path / "redis").exists()  # nothing was started


@pytest.mark.parametrize("port", ["0", "99999", "-1", "18535.0", "080", "1e4", " "])
def test_a_demo_port_out_of_range_is_one_error_before_anything_starts(port: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: `substrate demo --port 99999` started the demo's server, which printed its own
    usage text, then "the server exited" (exit 1); the port is checked up front now, as `up` checks it."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["demo", "--port", port])
    assert r.exit_code == 2, r.output
    assert "--port" in r.output and "Usage: python -m substrate.cli up" not in r.output
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_a_demo_on_a_taken_port_is_one_error_and_never_talks_to_the_server_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: with the port held by another runtime, the demo's own server could not listen,
    but its readiness poll found the other one ready, and the demo ran there, left its sessions and
    exited 0. Now the taken port is refused before anything starts and nothing is sent to it."""
    import http.server
    import threading

    seen: list[str] = []

    class Foreign(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the demo would make its data folder
    try:
        r = CliRunner().invoke(app, ["demo", "--port", str(server.server_address[1])])
    finally:
        server.shutdown()
        server.server_close()
    assert r.exit_code == 2, r.output
    assert "cannot listen on 127.0.0.1" in r.output and "--port" in r.output, r.output
    assert seen == []  # not even a readiness poll
    assert not list(tmp_path.glob("substrate-demo-*"))  # no data folder was made


@pytest.mark.parametrize(("arg", "sent"), [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"),
                                           ("7", 7), ('{"a": [1, "b"]}', {"a": [1, "b"]}), ("hello", "hello")])
def test_invoke_sends_json_input_as_json_and_anything_else_as_a_string(arg: str, sent: object,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: `sessions invoke ID NaN` failed with a raw `ValueError: Out of range float values
    are not JSON compliant`; NaN and Infinity are not JSON, so they go as the strings typed."""
    import json

    bodies: list[object] = []

    def handler(req: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(req.content))
        return httpx.Response(200, json={"output": "ok"})

    _mock_client(monkeypatch, handler)
    r = CliRunner().invoke(app, ["sessions", "invoke", "s-1", "--", arg])
    assert r.exit_code == 0, r.output
    assert bodies == [{"input": sent}]


@pytest.mark.parametrize("stream", [False, True])
def test_invoke_sends_the_idempotency_key_given(stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: retry safety could not be used from the CLI (every command made a new key)."""
    keys: list[str | None] = []

    def handler(req: httpx.Request) -> httpx.Response:
        keys.append(req.headers.get("idempotency-key"))
        if stream:
            return httpx.Response(200, content=b'{"chunk": "ok"}\n{"done": true}\n',
                                  headers={"content-type": "application/x-ndjson"})
        return httpx.Response(200, json={"output": "ok"})

    _mock_client(monkeypatch, handler)
    for _ in range(2):
        r = CliRunner().invoke(app, ["sessions", "invoke", "s-1", "get", "-k", "turn-7", *(["--stream"] if stream else [])])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["sessions", "invoke", "s-1", "get", *(["--stream"] if stream else [])])
    assert keys[:2] == ["turn-7", "turn-7"] and keys[2] != "turn-7", keys


@pytest.mark.parametrize(("arg", "why"), [('"\\ud800"', "lone surrogate"), ("1e999", "out of range")])
def test_invoke_input_no_json_body_can_carry_is_one_error_and_nothing_is_sent(
        arg: str, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[httpx.Request] = []
    _mock_client(monkeypatch, lambda req: sent.append(req) or httpx.Response(200, json={"output": 1}))
    r = CliRunner().invoke(app, ["sessions", "invoke", "s-1", "--", arg])
    assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
    assert sent == []


@pytest.mark.parametrize("command", [["up"], ["router", "--files"], ["controller"], ["worker", "--pool", "p"]])
@pytest.mark.parametrize("port", ["18535.0", "080", "+80", "8O80"])
def test_a_port_that_is_not_plain_digits_is_a_usage_error_on_every_command(command: list[str], port: str,
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: `substrate up --port 18535.0` listened on 18535 and `--port 080` on 80 (typos
    read as something else). Every command that takes a port refuses them before starting anything."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    r = CliRunner().invoke(app, [*command, "--port", port], env={"COLUMNS": "300"})  # one line, unwrapped
    assert r.exit_code == 2, r.output
    assert "is not a port" in r.output and "--port" in r.output
    assert not (tmp_path / "redis").exists()


def test_a_worker_port_from_the_environment_is_checked_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_WORKER_PORT", "8081.5")
    r = CliRunner().invoke(app, ["worker", "--pool", "p"], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "is not a port" in r.output, r.output


def test_a_label_key_given_twice_is_refused_before_any_request() -> None:
    """A fresh-user run: ``-l team=a -l team=b`` created the session with team=b, silently."""
    r = CliRunner().invoke(app, ["sessions", "create", "counter", "-l", "team=a", "-l", "x=1", "-l", "team=b",
                                 "--server", "http://127.0.0.1:9"])
    assert r.exit_code == 2, r.output
    assert "-l/--label: team given twice" in r.output and "Traceback" not in r.output


def test_up_in_process_leaves_later_commands_a_working_log_handler(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` configures logging (``configure_logging``) before its port check, under ``CliRunner``'s stderr,
    which is closed when the command returns. The root handler follows ``sys.stderr`` instead of keeping
    that stream: a later command's record reaches the later command's own stderr."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    monkeypatch.setenv("SUBSTRATE_LOG_JSON", "false")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(s.getsockname()[1])])
    assert r.exit_code == 2, r.output
    root = logging.getLogger()
    assert root.handlers and not [h for h in root.handlers if getattr(h.stream, "closed", False)], root.handlers

    later = typer.Typer()

    @later.command()
    def warn() -> None:
        logging.getLogger("substrate.later").warning("a record of a later command")

    r = CliRunner().invoke(later, [])
    assert r.exit_code == 0, r.output
    assert "Logging error" not in r.output and "a record of a later command" in r.output, r.output


@pytest.mark.parametrize("host,bound,note", [
    ("localhost", ["127.0.0.1"], " (listening on 127.0.0.1 only)"),
    ("localhost", ["::1", "127.0.0.1"], " (listening on 127.0.0.1, ::1 only)"),
    ("127.0.0.1", ["127.0.0.1"], ""), ("::1", ["::1"], ""), ("0.0.0.0", ["0.0.0.0"], ""), ("localhost", [], ""),
])
def test_serving_on_a_name_says_the_addresses_it_listens_on(host: str, bound: list[str], note: str) -> None:
    """Fresh-user tester 50: ``--host localhost`` listened on 127.0.0.1 only and said "serving on
    http://localhost:P"; a client that resolved localhost to ::1 was refused."""
    from substrate.cli import listen_note

    assert listen_note(host, bound) == note
