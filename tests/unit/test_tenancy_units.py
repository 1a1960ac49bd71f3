"""Pure parts of tenancy: circuit breaker, parked share, placement fairness, credential resolution, and
the error-code catalogue being complete."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from api.errors_doc import ERROR_CODES, openapi_error_schema
from substrate.errors import TooManyRequests
from substrate.fairness import ParkedShare, TenantBreaker, fair_share, victim_order
from substrate.models import EnvVar
from substrate.secrets import SecretUnavailable, resolve_env
from substrate.settings import QuotaSettings

ROOT = Path(__file__).resolve().parents[2]


def test_breaker_opens_per_tenant_and_template_half_opens_and_closes():
    b = TenantBreaker(QuotaSettings(breaker_failures=3, breaker_window_s=10, breaker_open_s=5))
    for t in (0.0, 1.0):
        b.failure("a", "broken", now=t)
    b.check("a", "broken", now=1.5)  # two failures: still closed
    b.failure("a", "broken", now=2.0)
    with pytest.raises(TooManyRequests) as e:
        b.check("a", "broken", now=3.0)
    assert e.value.code == "tenant_circuit_open" and e.value.retry_after_s == pytest.approx(4.0)
    assert e.value.details == {"tenant": "a", "actorTemplate": "broken", "failures": 3}
    assert "broken" in e.value.message
    b.check("b", "broken", now=3.0)  # other tenants unaffected
    b.check("a", "counter", now=3.0)  # and the same tenant's other templates (a fresh-user run: one
    # broken template shut the whole tenant out of creates and wakes)
    b.check("a", "broken", now=7.5)  # open period over: one trial goes through (half-open) ...
    b.failure("a", "broken", now=7.6)  # ... and its failure reopens at once
    with pytest.raises(TooManyRequests):
        b.check("a", "broken", now=7.7)
    b.success("a", "counter")  # another template's success closes nothing
    with pytest.raises(TooManyRequests):
        b.check("a", "broken", now=7.8)
    b.success("a", "broken")
    b.check("a", "broken", now=7.9)
    # failures outside the window do not add up; failures of different templates do not add up either
    b2 = TenantBreaker(QuotaSettings(breaker_failures=2, breaker_window_s=1))
    b2.failure("a", "t", now=0.0)
    b2.failure("a", "t", now=5.0)
    b2.check("a", "t", now=5.1)
    b2.failure("a", "u", now=5.2)
    b2.check("a", "t", now=5.3)
    b2.check("a", "u", now=5.3)


def test_parked_share_caps_one_tenant():
    p = ParkedShare(max_parked=10, share=0.3)
    for _ in range(3):
        p.enter("a", 1)
    with pytest.raises(TooManyRequests) as e:
        p.enter("a", 1)
    assert e.value.code == "tenant_parked_share"
    p.enter("b", 1)
    p.leave("a")
    p.enter("a", 1)


def test_victim_order_fair_share():
    """A tenant under its fair share may displace other tenants' idle sessions, but only as many as it is
    short of its share; at or over it, only its own; no requester (headroom): anyone's."""
    cands = [("b1", "b"), ("a1", "a"), ("b2", "b"), ("c1", "c"), ("a2", "a")]
    assert fair_share("a", {"a": 3, "b": 13}, 16) == 8
    assert fair_share("c", {"a": 8, "b": 8}, 16) == 6, "a newcomer gets a share"
    assert victim_order("a", {"a": 6, "b": 10}, 16, cands) == ["b1", "a1", "b2", "a2"], "2 short: 2 others"
    assert victim_order("a", {"a": 7, "b": 9}, 16, cands) == ["b1", "a1", "a2"], "1 short: 1 other"
    assert victim_order("b", {"a": 3, "b": 13}, 16, cands) == ["b1", "b2"], "over its share: only its own"
    assert victim_order("a", {"a": 1, "b": 1}, 2, cands) == ["a1", "a2"], "at its share: only its own"
    assert victim_order("a", {}, 4, cands) == ["b1", "a1", "b2", "c1", "a2"], "alone: its share is the pool"
    assert victim_order("", {"a": 2, "b": 2}, 4, cands) == [s for s, _ in cands], "headroom: anyone's"


def test_resolve_env_tenant_first_then_shared(tmp_path):
    (tmp_path / "s" / "k").parent.mkdir(parents=True)
    (tmp_path / "s" / "k").write_text("shared\n")
    (tmp_path / "t1" / "s").mkdir(parents=True)
    (tmp_path / "t1" / "s" / "k").write_text("mine")
    env = [EnvVar(name="A", valueFrom={"secretKeyRef": {"name": "s", "key": "k"}}), EnvVar(name="B", value="plain"),
           EnvVar(name="C", valueFrom={"secretKeyRef": {"name": "x", "key": "y", "optional": True}})]
    assert resolve_env(env, tenant="t1", secrets_dir=tmp_path) == {"A": "mine"}
    assert resolve_env(env, tenant="t2", secrets_dir=tmp_path) == {"A": "shared"}
    for ref in ({"name": "../s", "key": "k"}, {"name": "nope", "key": "k"}):
        with pytest.raises(SecretUnavailable):
            resolve_env([EnvVar(name="A", valueFrom={"secretKeyRef": ref})], tenant="t1", secrets_dir=tmp_path)
    with pytest.raises(SecretUnavailable):
        resolve_env(env[:1], tenant="t1", secrets_dir=None)


#: codes only the workers' internal API or the CLI answer with (never a public API answer: the router turns
#: a worker's refusal into a retry through the directory or into worker_unavailable)
INTERNAL = {"not_active", "busy", "stale_epoch", "missing_token", "token_not_for_this_call", "epoch_mismatch",
            "api_key_not_found", "invalid_api_key_spec", "invalid_key_name",
            "snapshot_missing", "snapshot_exists", "session_failed", "unavailable",
            "worker_error", "http_error", "too_many_requests", "invalid_spec", "tenant_mismatch", "invalid_reason",
            "session_evicted",  # a worker's answer to the router's own pressure suspend (api.proxy._INTERNAL_CODES)
            "agent_module_not_found", "agent_class_not_found"}  # a config's start-up error (substrate.specs), never an API answer


def test_every_error_code_is_documented():
    found: set[str] = set()
    for folder in ("api", "substrate", "snapshot", "workers"):
        for p in (ROOT / folder).rglob("*.py"):
            text = p.read_text()
            found |= set(re.findall(r'code="([a-z_]+)"', text))
            found |= set(re.findall(r'code = "([a-z_]+)"', text))
            found |= set(re.findall(r'status, code = \d+, "([a-z_]+)"', text))
    missing = found - set(ERROR_CODES) - INTERNAL
    assert not missing, f"error codes without documentation in api/errors_doc.py: {sorted(missing)}"
    assert set(openapi_error_schema()["properties"]["code"]["enum"]) == set(ERROR_CODES)


def test_request_id_rule():
    """X-Request-ID: 1-128 visible ASCII characters kept as sent; absent or empty -> a fresh ID; any
    other value -> 422 invalid_request_id (never stored or echoed)."""
    from api.guard import MAX_REQUEST_ID_CHARS
    from api.proxy import request_id
    from substrate.errors import InvalidInput

    assert request_id({"x-request-id": "a" * MAX_REQUEST_ID_CHARS}) == "a" * MAX_REQUEST_ID_CHARS
    assert request_id({"x-request-id": "00-4bf92f3577b34da6-01:trace/x=y"}) == "00-4bf92f3577b34da6-01:trace/x=y"
    assert request_id({"x-request-id": " trace-9\t"}) == "trace-9"  # whitespace around a value is not part of it
    for absent in ({}, {"x-request-id": ""}, {"x-request-id": "  "}):
        rid = request_id(absent)
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
    # the message names what is wrong (fresh-user run: "bad id" was told "got 6 characters")
    for bad, says in (("a" * (MAX_REQUEST_ID_CHARS + 1), "it has 129 bytes"), ("has space", "a space at position 3"),
                      ("line\nbreak", "byte 0x0a at position 4"), ("ta\tb", "byte 0x09 at position 2"),
                      ("caf\u00c3\u00a9", "byte 0xc3 (non-ASCII) at position 3"), ("\x7f", "byte 0x7f at position 0")):
        with pytest.raises(InvalidInput) as e:
            request_id({"x-request-id": bad})
        assert e.value.code == "invalid_request_id" and e.value.status == 422
        assert e.value.message.endswith(says), e.value.message


async def test_guard_and_route_authenticate_once_per_request():
    """The front door authenticates every /v1 call (an invoke too: it reads the body, and only a known
    caller's) and the route's check reuses that principal (a JWT was verified twice per call)."""
    from types import SimpleNamespace

    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from api import proxy
    from api.auth import Principal
    from api.guard import Guard
    from substrate.errors import SubstrateError
    from substrate.settings import Settings

    class CountingAuth:
        calls = 0
        enabled = True  # credentials configured (not open mode)

        async def authenticate(self, headers):
            CountingAuth.calls += 1
            if headers.get("authorization") != "Bearer good":
                from substrate.errors import Unauthorized
                raise Unauthorized("no")
            return Principal(tenant="team-a", subject="jwt:alice", via="jwt")

    auth = CountingAuth()
    runtime = SimpleNamespace(auth=auth)

    async def endpoint(request: Request) -> Any:
        try:
            p = await proxy.authenticate(runtime, request)  # type: ignore[arg-type]
        except SubstrateError as e:
            return proxy.error_response(e)
        return JSONResponse({"tenant": p.tenant, "rid": request.state.request_id})

    async def chunked() -> Any:
        yield b'{"input"'
        yield b": 1}"

    app = Starlette(routes=[Route("/v1/sessions", endpoint, methods=["GET", "POST"]),
                            Route("/v1/sessions/{sid}/invoke", endpoint, methods=["POST"])])
    guarded = Guard(app, get_settings=lambda scope: (Settings(), auth))
    ok = {"Authorization": "Bearer good"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
        for method, path, kw in [("GET", "/v1/sessions", {}), ("POST", "/v1/sessions", {"json": {}}),
                                 ("POST", "/v1/sessions/s1/invoke", {"json": {"input": 1}}),
                                 ("POST", "/v1/sessions/s1/invoke", {"content": chunked()})]:
            CountingAuth.calls = 0
            r = await c.request(method, path, headers={**ok, "X-Request-ID": "r-1"}, **kw)
            assert r.status_code == 200 and r.json() == {"tenant": "team-a", "rid": "r-1"}, (path, r.text)
            assert CountingAuth.calls == 1, (method, path, kw.keys(), CountingAuth.calls)
        CountingAuth.calls = 0
        r = await c.get("/v1/sessions", headers={"Authorization": "Bearer bad"})
        assert r.status_code == 401 and CountingAuth.calls == 1
        r = await c.get("/v1/sessions", headers={**ok, "X-Request-ID": "x" * 129})
        assert r.status_code == 422 and r.json()["code"] == "invalid_request_id"


def test_quota_limits_from_the_nested_environment_form(monkeypatch) -> None:
    """``SUBSTRATE_QUOTA__TENANTS__ACME__MAXTOTAL=4`` failed to load: the environment form reaches the
    model lower-cased (``maxtotal``), which it refused as an unknown field. Any case is accepted now; an
    unknown name is still refused."""
    import pydantic

    from substrate.models import QuotaLimits
    from substrate.settings import Settings

    monkeypatch.setenv("SUBSTRATE_QUOTA__TENANTS__ACME__MAXTOTAL", "4")
    monkeypatch.setenv("SUBSTRATE_QUOTA__DEFAULT__MAXRUNNING", "2")
    s = Settings()
    assert s.quota.tenants["acme"].maxTotal == 4 and s.quota.default.maxRunning == 2
    with pytest.raises(pydantic.ValidationError):
        QuotaLimits.model_validate({"maxtotals": 1})


def test_quota_tenant_names_are_checked_and_underscore_stands_for_dash(monkeypatch) -> None:
    """The README's ``..._TEAM_A__MAXRUNNING`` made tenant ``team_a``, which no tenant can be named, and
    ``{"Bad Name": ...}`` was accepted: limits that could never apply. Now ``_`` reads as ``-`` and any
    other key that is no tenant name is refused."""
    import pydantic

    from substrate.settings import Settings

    monkeypatch.setenv("SUBSTRATE_QUOTA__TENANTS__TEAM_A__MAXRUNNING", "3")
    assert set(Settings().quota.tenants) == {"team-a"}
    monkeypatch.delenv("SUBSTRATE_QUOTA__TENANTS__TEAM_A__MAXRUNNING")
    for bad in ('{"Bad Name": {"maxRunning": 1}}', '{"team-a": {}, "team_a": {}}', '{"-x": {}}'):
        monkeypatch.setenv("SUBSTRATE_QUOTA__TENANTS", bad)
        with pytest.raises(pydantic.ValidationError):
            Settings()


def test_only_a_templates_own_failures_count_toward_its_tenants_breaker():
    """A race between a tenant's own calls on one ID, a full worker, or an outage of the platform's stores
    says nothing about the template's activations (fresh-user run: creates racing deletes of the same IDs,
    5 ``conflict`` and 5 ``stale_epoch``, opened the breaker for every create of the template)."""
    from substrate.activator import blames_tenant
    from substrate.errors import (Conflict, DirectoryUnavailable, NoCapacity, NotFound, SessionDeleted, StaleEpoch,
                                  StoreUnavailable, SubstrateError, TooManyRequests, WorkerUnavailable)

    races = [Conflict("x", code="conflict"), StaleEpoch("x"), NotFound("x", code="session_not_found"),
             SessionDeleted("x"), NoCapacity("x")]
    platform = [DirectoryUnavailable("x"), StoreUnavailable("x"), WorkerUnavailable("x"),
                TooManyRequests("x", code="quota_max_running"), SubstrateError("x", code="worker_fenced")]
    assert not any(blames_tenant(e) for e in races + platform)
    # what the template's own agent does: a crash at start, a start that fails
    assert blames_tenant(SubstrateError("x", code="agent_crashed"))
    assert blames_tenant(SubstrateError("x", code="agent_start_failed"))
