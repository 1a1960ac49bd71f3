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
