"""``substrate events`` (the tenant's audit trail: ``GET /v1/events`` and the SDK's ``events()`` had no
command, a fresh-user tester) and ``-o`` on ``sessions events``, with the formats ``sessions list`` has
plus their JSON lines. Requests checked against a mock transport."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import app

T0 = 1_767_225_600.25  # 2026-01-01 00:00:00.250 UTC


def _record(n: int, page: int) -> dict:
    return {"id": f"{page}-{n}", "time": T0 + page, "action": "create" if page == 1 else "suspend",
            "reason": "" if page == 1 else "idle", "who": "apikey:k1", "tenant": "acme", "session": f"s-{page}",
            "template": "counter", "worker": "w-1", "gpus": 0, "epoch": page, "result": "ok", "requestId": "r"}


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    got: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request)
        page = 1 if "continue" not in request.url.params else 2
        return httpx.Response(200, json={"items": [_record(0, page)],
                                         "metadata": {"continue": "c2" if page == 1 else None}})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    return got


CMDS = [["events"], ["sessions", "events", "s-1"]]


@pytest.mark.parametrize("cmd", CMDS)
def test_json_lines_by_default_one_page_and_more_on_stderr(seen: list[httpx.Request], cmd: list[str]) -> None:
    r = CliRunner().invoke(app, cmd)
    assert r.exit_code == 0, r.output
    assert [json.loads(x) for x in r.stdout.splitlines()] == [_record(0, 1)]
    assert "more: --all, or --continue c2" in r.stderr and len(seen) == 1
    path = "/v1/events" if cmd == ["events"] else "/v1/sessions/s-1/events"
    assert seen[0].url.path == path and seen[0].url.params["limit"] == "100"


@pytest.mark.parametrize("cmd", CMDS)
def test_all_follows_the_pages_from_continue(seen: list[httpx.Request], cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "--all", "--limit", "7"])
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == ["1-0", "2-0"] and "more:" not in r.output
    assert [q.url.params.get("continue") for q in seen] == [None, "c2"]
    assert {q.url.params["limit"] for q in seen} == {"7"}
    r = CliRunner().invoke(app, [*cmd, "--continue", "c2"])
    assert r.exit_code == 0 and [json.loads(x)["id"] for x in r.stdout.splitlines()] == ["2-0"], r.output


@pytest.mark.parametrize("cmd", CMDS)
def test_json_is_the_apis_page_and_with_all_every_item(seen: list[httpx.Request], cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "-o", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"items": [_record(0, 1)], "metadata": {"continue": "c2"}}
    r = CliRunner().invoke(app, [*cmd, "--output", "json", "--all"])
    assert json.loads(r.stdout) == {"items": [_record(0, 1), _record(0, 2)], "metadata": {"continue": None}}


@pytest.mark.parametrize("cmd", CMDS)
def test_ids_are_one_record_id_a_line(seen: list[httpx.Request], cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "-o", "ids"])
    assert r.exit_code == 0 and r.stdout == "1-0\n", r.output
    assert "more: --all, or --continue c2" in r.stderr


@pytest.mark.parametrize("cmd", CMDS)
def test_a_table_with_times_in_utc_and_the_more_line(seen: list[httpx.Request], cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "-o", "table", "--all"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "TIME" in out and "ACTION" in out and "RESULT" in out
    assert "2026-01-01T00:00:01.250Z" in out and "2026-01-01T00:00:02.250Z" in out
    assert "suspend" in out and "idle" in out and "apikey:k1" in out
    # the tenant's trail names the session of each record; a session's own does not repeat it
    assert ("SESSION" in out and "s-2" in out) is (cmd == ["events"])
    r = CliRunner().invoke(app, [*cmd, "-o", "table"], env={"COLUMNS": "200"})
    assert "more: --all, or --continue c2" in r.stdout
    # on a narrow terminal, aligned lines whose fields split on whitespace (kubectl's form)
    r = CliRunner().invoke(app, [*cmd, "-o", "table"], env={"COLUMNS": "60"})
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["TIME", "ACTION"] and lines[1].split()[0] == "2026-01-01T00:00:01.250Z", r.output
    assert len(lines[0].split()) == len(lines[1].split())


@pytest.mark.parametrize("cmd", CMDS)
def test_another_output_or_a_limit_out_of_range_is_exit_2_and_nothing_sent(seen: list[httpx.Request],
                                                                           cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "-o", "yaml"])
    assert r.exit_code == 2 and "--output 'yaml' is none of jsonl, table, json, ids" in r.output, r.output
    for bad in ("0", "1001"):
        r = CliRunner().invoke(app, [*cmd, "--limit", bad])
        assert r.exit_code == 2 and "--limit" in r.output, r.output
    assert seen == []


def test_events_tenant_reaches_the_api_and_a_refusal_is_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    got: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request)
        if request.url.params.get("tenant") == "BAD":
            return httpx.Response(422, json={"code": "invalid_tenant", "message": "BAD is no tenant name"})
        return httpx.Response(200, json={"items": [], "metadata": {"continue": None}})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    r = CliRunner().invoke(app, ["events", "--tenant", "acme"])
    assert r.exit_code == 0 and r.stdout == "" and got[-1].url.params["tenant"] == "acme", r.output
    r = CliRunner().invoke(app, ["events", "--tenant", "BAD"])
    assert r.exit_code == 2 and "error 422 invalid_tenant" in r.output, r.output


def test_the_help_lists_the_events_command() -> None:
    r = CliRunner().invoke(app, ["--help"])
    assert "events" in r.output
