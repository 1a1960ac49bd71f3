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


def test_a_pool_that_backs_off_says_why_under_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "3 worker process(s) of pool 'default' failed in a row; the next start is backed off for 2.0 s more"
    _serve(monkeypatch, [{"metadata": {"name": "default"}, "spec": {"replicas": 2},
                          "status": {"replicas": 1, "readyReplicas": 1, "slots": 1, "freeSlots": 0,
                                     "conditions": [
                                         {"type": "Ready", "status": "True", "reason": "WorkersReady", "message": ""},
                                         {"type": "Scaling", "status": "False", "reason": "steady", "message": ""},
                                         {"type": "WorkersHealthy", "status": "False", "reason": "BackOff",
                                          "message": why}]}}])
    r = CliRunner().invoke(app, ["pools"])
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if line.startswith("pool default:")]
    assert said == [f"pool default: WorkersHealthy=False (BackOff): {why}"], r.output
