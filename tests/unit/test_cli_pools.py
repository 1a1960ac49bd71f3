"""`substrate pools` with a tenant's key (fresh-user run: a Rich traceback, ``KeyError: 'replicas'``): the API
answers an ordinary tenant each pool's status as ``{"observedGeneration": N}`` only, on purpose."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from substrate.cli import app


def _serve(monkeypatch: pytest.MonkeyPatch, items: list[dict]) -> None:
    import substrate.cli as cli
    from substrate.client import SubstrateClient

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/workerpools"
        return httpx.Response(200, json={"items": items})

    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(handler)))


def test_a_tenant_sees_the_pools_without_their_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    _serve(monkeypatch, [{"metadata": {"name": "default"}, "spec": {"slotsPerWorker": 8},
                          "status": {"observedGeneration": 1}}])
    r = CliRunner().invoke(app, ["pools", "--token", "sk_tenant_key"])
    assert r.exit_code == 0, r.output  # was 1 with a KeyError traceback
    row = next(line for line in r.output.splitlines() if "default" in line)
    assert [c.strip() for c in row.split("│")[2:6]] == ["-"] * 4
    assert "admins only" in r.output


def test_an_admin_sees_replicas_and_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    _serve(monkeypatch, [{"metadata": {"name": "default"}, "spec": {"replicas": 2},
                          "status": {"replicas": 2, "readyReplicas": 1, "slots": 8, "freeSlots": 5,
                                     "observedGeneration": 1}}])
    r = CliRunner().invoke(app, ["pools"])
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if "default" in line)
    assert [c.strip() for c in row.split("│")[2:6]] == ["2", "1", "8", "5"]
    assert "admins only" not in r.output
