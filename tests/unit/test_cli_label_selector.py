"""Label selectors in the SDK (``list_sessions(label_selector=...)``) and the CLI (``sessions list
-l/--selector``), and the table's LABELS column (labels were stored but neither queryable nor shown: a
fresh-user tester). Requests checked against a mock transport."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import LABELS_CELL_CHARS, _labels_cell, app
from substrate.client import ApiError, SubstrateClient

ITEM = {"id": "s-a", "state": "RUNNING", "actorTemplate": "counter", "tenant": "acme", "worker": "w-1", "epoch": 1,
        "labels": {"team": "a", "env": "prod"}}


def _handler(got: list[httpx.Request]):
    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request)
        if request.url.params.get("labelSelector") == "!team=a":
            return httpx.Response(422, json={"code": "invalid_input", "message": "query.labelSelector: requirement "
                                             "1 ('!team=a'): '!' goes before a bare key only (!key)"})
        page = 1 if "continue" not in request.url.params else 2
        return httpx.Response(200, json={"items": [ITEM] if page == 1 else [],  # a filtered page may be empty
                                         "metadata": {"continue": "c2" if page == 1 else None}})
    return handler


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    import substrate.cli as cli

    got: list[httpx.Request] = []
    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(_handler(got))))
    return got


def test_the_sdk_sends_the_selector_and_follows_pages_with_it() -> None:
    got: list[httpx.Request] = []
    c = SubstrateClient("http://t", transport=httpx.MockTransport(_handler(got)))
    assert c.list_sessions(label_selector="team=a,env in (prod)")["items"] == [ITEM]
    assert got[-1].url.params["labelSelector"] == "team=a,env in (prod)"
    assert [s["id"] for s in c.iter_sessions(label_selector="team=a", limit=1)] == ["s-a"]
    assert [q.url.params["labelSelector"] for q in got[-2:]] == ["team=a", "team=a"]
    c.list_sessions()
    assert "labelSelector" not in got[-1].url.params
    with pytest.raises(ApiError) as e:
        c.list_sessions(label_selector="!team=a")
    assert (e.value.status, e.value.code) == (422, "invalid_input") and "labelSelector" in e.value.message


@pytest.mark.parametrize("flag", ["-l", "--selector"])
def test_the_cli_sends_the_selector(seen: list[httpx.Request], flag: str) -> None:
    r = CliRunner().invoke(app, ["sessions", "list", flag, "team=a", "-o", "ids"])
    assert r.exit_code == 0 and r.stdout == "s-a\n", r.output
    assert seen[-1].url.params["labelSelector"] == "team=a"
    r = CliRunner().invoke(app, ["sessions", "list", flag, "team=a", "--all", "-o", "json"])
    assert json.loads(r.stdout)["items"] == [ITEM]
    assert [q.url.params["labelSelector"] for q in seen[-2:]] == ["team=a", "team=a"]


def test_a_malformed_selector_is_one_line_and_exit_2(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "list", "-l", "!team=a"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error 422 invalid_input: query.labelSelector: ") and "'!' goes" in r.output


def test_the_table_has_a_labels_column_last(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "list"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    head = next(line for line in r.stdout.splitlines() if "ID" in line)
    assert head.index("EPOCH") < head.index("LABELS")
    assert "env=prod,team=a" in r.stdout


def test_a_label_value_is_printed_as_text_not_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    import substrate.cli as cli

    item = {**ITEM, "labels": {"note": "[red]x[/]"}}
    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(
            lambda req: httpx.Response(200, json={"items": [item], "metadata": {"continue": None}}))))
    r = CliRunner().invoke(app, ["sessions", "list"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "note=[red]x[/]" in r.stdout, r.output


@pytest.mark.parametrize("labels,cell", [
    ({}, "-"), (None, "-"), ({"team": "a"}, "team=a"), ({"team": "a", "env": "prod"}, "env=prod,team=a"),
    ({f"k{i}": "vvvvv" for i in range(10)}, "k0=vvvvv,k1=vvvvv,k2=vvvvv,k3=vvvvv,+6"),
    ({"k": "v" * 100}, "k=" + "v" * 35 + "..."),
    ({"k": "v" * 100, "z": "1"}, "k=" + "v" * 32 + "...,+1"),
])
def test_the_labels_cell_shows_whole_labels_then_how_many_more(labels: dict | None, cell: str) -> None:
    assert _labels_cell(labels) == cell and len(cell) <= LABELS_CELL_CHARS


def test_repeated_selectors_are_all_sent_and_a_repeated_state_or_template_is_refused(seen) -> None:
    """Fresh-user tester 55: ``-l team=a -l env=dev`` kept only the last selector (and ``--state`` the last
    state), without a word."""
    r = CliRunner().invoke(app, ["sessions", "list", "-l", "team=a", "-l", "env=dev", "-o", "ids"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert seen[-1].url.params["labelSelector"] == "team=a,env=dev"
    n = len(seen)
    for opt, a, b in (("--state", "running", "suspended"), ("--template", "counter", "shell")):
        r = CliRunner().invoke(app, ["sessions", "list", opt, a, opt, b], env={"COLUMNS": "200"})
        assert r.exit_code == 2 and f"{opt} is given 2 times" in r.output, r.output
    assert len(seen) == n, "a refused listing sent a request"


def test_a_label_value_no_selector_can_name_is_said_at_create_and_quoted_in_the_table(monkeypatch) -> None:
    """Fresh-user tester 55: ``-l 'k=v,k2=v2'`` made one label ``k`` = ``v,k2=v2``, shown in the table as
    ``k=v,k2=v2`` (two labels, to the eye), and no selector can name its value."""
    import substrate.cli as cli

    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(201, json={"id": "s1", "state": "RUNNING"})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    r = CliRunner().invoke(app, ["sessions", "create", "counter", "-l", "k=v,k2=v2", "-l", "ok=fine"],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert sent[-1]["labels"] == {"k": "v,k2=v2", "ok": "fine"}, "the label is kept as given"
    assert 'note: label k\'s value "v,k2=v2" holds whitespace' in r.output, r.output
    assert "one label per -l: -l k=v -l k2=v2" in r.output and "label ok" not in r.output, r.output
    assert _labels_cell({"k": "v,k2=v2", "ok": "fine"}) == 'k="v,k2=v2",ok=fine'
    assert _labels_cell({"k": "two words"}) == 'k="two words"'
