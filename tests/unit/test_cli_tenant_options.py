"""An admin's CLI: `sessions list` shows whose each session is (every tenant's were listed with no TENANT
column, fresh-user run) and takes `--tenant`; `sessions create --tenant` creates for a tenant."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import app

SESSIONS = [{"id": "s-a", "tenant": "team-a", "state": "RUNNING", "actorTemplate": "counter", "worker": "w1",
             "epoch": 1},
            {"id": "s-b", "tenant": "team-b", "state": "SUSPENDED", "actorTemplate": "counter", "epoch": 2}]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    got: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request)
        if request.method == "GET":
            t = request.url.params.get("tenant")
            return httpx.Response(200, json={"items": [s for s in SESSIONS if t in (None, s["tenant"])],
                                             "metadata": {"continue": None}})
        body = json.loads(request.content)
        return httpx.Response(201, json={**SESSIONS[0], "id": "s-new", "actorTemplate": body["actorTemplate"],
                                         "tenant": request.url.params.get("tenant", "ops")})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))
    return got


def test_the_list_shows_each_sessions_tenant(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "list"])
    assert r.exit_code == 0, r.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.output.splitlines()
            if line.count("│") > 3 and "s-" in line}
    assert rows == {"s-a": "team-a", "s-b": "team-b"}


def test_list_and_create_pass_the_tenant(seen: list[httpx.Request]) -> None:
    r = CliRunner().invoke(app, ["sessions", "list", "--tenant", "team-b", "--all"])
    assert r.exit_code == 0 and "s-b" in r.output and "s-a" not in r.output, r.output
    assert seen[-1].url.params["tenant"] == "team-b"
    r = CliRunner().invoke(app, ["sessions", "create", "counter", "--tenant", "team-a"])
    assert r.exit_code == 0, r.output
    assert seen[-1].method == "POST" and seen[-1].url.params["tenant"] == "team-a"
    assert json.loads(seen[-1].content) == {"actorTemplate": "counter"}


def test_an_empty_tenant_is_sent_not_dropped(seen: list[httpx.Request]) -> None:
    """``--tenant ''`` created the session for the admin's own tenant (the SDK dropped the empty string);
    the API refuses an empty ``tenant=`` (422 invalid_tenant), so it must reach the API."""
    CliRunner().invoke(app, ["sessions", "create", "counter", "--tenant", ""])
    assert seen[-1].method == "POST" and seen[-1].url.params.get("tenant") == ""
