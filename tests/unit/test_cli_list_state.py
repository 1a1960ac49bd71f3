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
