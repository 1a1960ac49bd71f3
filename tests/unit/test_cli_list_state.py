"""`sessions list --state`: any case (`running` was sent as is and refused by the API, fresh-user run),
and a state no listing shows is one error line naming the ones it does (not DELETED), before any request."""

from __future__ import annotations

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
        return httpx.Response(200, json={"items": [{"id": "s-a", "state": "RUNNING", "actorTemplate": "counter",
                                                    "epoch": 1}], "metadata": {"continue": None}})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    return got


@pytest.mark.parametrize("given", ["running", "RUNNING", "Running"])
def test_the_state_is_taken_in_any_case(seen: list[httpx.Request], given: str) -> None:
    r = CliRunner().invoke(app, ["sessions", "list", "--state", given])
    assert r.exit_code == 0, r.output
    assert seen[-1].url.params["state"] == "RUNNING" and "s-a" in r.output


@pytest.mark.parametrize("given", ["napping", "DELETED", "deleted", ""])
def test_a_state_no_listing_shows_is_one_error_line_naming_the_valid_ones(seen: list[httpx.Request],
                                                                          given: str) -> None:
    r = CliRunner().invoke(app, ["sessions", "list", "--state", given])
    assert r.exit_code == 2 and not seen, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert "PENDING, STARTING, RUNNING, SUSPENDING, SUSPENDED, RESUMING, FAILED" in lines[0]
    assert "DELETED" not in lines[0].replace(repr(given), "")


LONG = "s-00bd36096e5e4c0f8a1b2c3d4e5f6a7b8c9d0e1f"


@pytest.fixture
def long_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"items": [{"id": LONG, "state": "SUSPENDED", "actorTemplate": "a-long-template-name",
                                                    "tenant": "team-with-a-long-name", "worker": "default-0123456789ab",
                                                    "epoch": 12}], "metadata": {"continue": "c1"}})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))


def test_the_table_never_cuts_an_id_on_a_narrow_terminal(long_ids: None) -> None:
    """A fresh-user run: on an 80-column terminal (or a pipe) IDs came out as ``s-00bd36096e5e4…``."""
    r = CliRunner().invoke(app, ["sessions", "list"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and LONG in r.output, r.output


def test_a_very_long_id_leaves_every_column_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: with a 128-character ID the table showed only the ID column, on 80 and on 120
    columns, and the continue token came out wrapped over several lines."""
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    huge, token = "s" * 128, "t" * 150

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"items": [
            {"id": huge, "state": "SUSPENDED", "actorTemplate": "counter", "tenant": "default", "worker": None,
             "epoch": 3},
            {"id": "s-short", "state": "RUNNING", "actorTemplate": "shell", "tenant": "default", "worker": "w-1",
             "epoch": 1}], "metadata": {"continue": token}})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    for columns in ("80", "120"):
        r = CliRunner().invoke(app, ["sessions", "list"], env={"COLUMNS": columns})
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        row = next(line for line in lines if line.startswith(huge))
        assert row.split() == [huge, "default", "SUSPENDED", "counter", "-", "3", "-"], row  # no labels: "-"
        assert any(line.split() == ["s-short", "default", "RUNNING", "shell", "w-1", "1", "-"] for line in lines)
        assert f"--continue {token}" in r.output, "the token on one line"


def test_ids_and_json_output_for_scripts(long_ids: None) -> None:
    import json

    r = CliRunner().invoke(app, ["sessions", "list", "-o", "ids"])
    # the IDs alone on stdout; on stderr, that more pages follow (a pipe took the first page for all)
    assert r.exit_code == 0 and r.stdout == LONG + "\n", r.output
    assert "more: --all, or --continue c1" in r.stderr
    r = CliRunner().invoke(app, ["sessions", "list", "--output", "json"])
    page = json.loads(r.output)
    assert page["items"][0]["id"] == LONG and page["metadata"]["continue"] == "c1"
    r = CliRunner().invoke(app, ["sessions", "list", "-o", "yaml"])
    assert r.exit_code == 2 and "table, json, ids" in r.output


def test_continue_and_limit_reach_the_api_and_a_limit_out_of_range_is_refused_here(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "list", "--continue", "tok-1", "--limit", "7"])
    assert r.exit_code == 0, r.output
    assert seen[-1].url.params["continue"] == "tok-1" and seen[-1].url.params["limit"] == "7"
    r = CliRunner().invoke(app, ["sessions", "events", "s-a", "--continue", "tok-2"])
    assert r.exit_code == 0, r.output
    assert seen[-1].url.path.endswith("/s-a/events") and seen[-1].url.params["continue"] == "tok-2"
    n = len(seen)
    for cmd in (["sessions", "list"], ["sessions", "events", "s-a"]):
        for bad in ("0", "1001"):
            r = CliRunner().invoke(app, [*cmd, "--limit", bad])
            assert r.exit_code == 2 and "--limit" in r.output, r.output
    assert len(seen) == n, "nothing was sent"


def test_a_pipe_gets_whole_lines_not_wrapped_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-user run: ``sessions delete ID > file`` split a 128-character ID over three lines and
    ``sessions list | ...`` wrapped the WORKER column at rich's default 80 columns."""
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    sid = "s" + "0123456789abcdef" * 7 + "x" * 15  # 128 characters
    worker = "default-55caf1f851fb-with-a-very-long-pool-name"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(200, json={"items": [{"id": sid, "state": "RUNNING", "actorTemplate": "counter",
                                                    "worker": worker, "epoch": 1}], "metadata": {"continue": None}})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    monkeypatch.delenv("COLUMNS", raising=False)
    r = CliRunner().invoke(app, ["sessions", "delete", sid])
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 1 and sid in r.output, r.output
    r = CliRunner().invoke(app, ["sessions", "list"])
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.output.splitlines() if sid in ln]
    assert len(rows) == 1 and worker in rows[0], r.output
