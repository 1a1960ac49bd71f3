"""``GET /v1/sessions?labelSelector=`` on a real Redis directory (labels were stored but could not be
queried: a fresh-user tester). The route runs with a runtime of the directory alone and a tenant's
principal; sessions are written straight to the directory."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, AsyncIterator

import httpx
import pytest
from fastapi import Request

from api.app import _auth, create_app
from api.auth import Principal
from substrate.directory import Directory
from substrate.labelselector import parse_selector
from substrate.listing import list_page
from substrate.models import SessionRecord, SessionState
from substrate.settings import Settings

T0 = 1_700_000_000.0
N = 25


def _labels(i: int) -> dict[str, str]:
    labels = {"team": "a" if i % 3 else "b"}
    if i % 5 == 0:
        labels["gpu"] = "yes"
    if i % 2:
        labels["env"] = "prod"
    return labels


@pytest.fixture
async def api(directory: Directory) -> AsyncIterator[tuple[httpx.AsyncClient, Directory]]:
    for i in range(N):  # pairs share a creation time: ties are ordered by ID
        now = T0 + i // 2
        await directory.create_session(SessionRecord(
            id=f"s-{i:03d}", state=SessionState.RUNNING if i % 4 else SessionState.SUSPENDED,
            actorTemplate="counter", pool="default", tenant="acme", labels=_labels(i), createdAt=now,
            updatedAt=now, lastActiveAt=now))
    # another tenant's session with matching labels: never listed to acme
    await directory.create_session(SessionRecord(id="s-other", state=SessionState.RUNNING, actorTemplate="counter",
                                                 pool="default", tenant="zeta", labels={"team": "a"},
                                                 createdAt=T0, updatedAt=T0, lastActiveAt=T0))
    app = create_app(Settings())
    app.state.runtime = SimpleNamespace(settings=Settings(), auth=None, directory=directory,
                                        catalog=SimpleNamespace(templates={}))

    async def as_acme(request: Request) -> None:
        request.state.principal = Principal(tenant="acme", subject="t", via="api_key")
    app.dependency_overrides[_auth] = as_acme
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c, directory


def _expected(selector: str, state: str | None = None) -> list[str]:
    s = parse_selector(selector)
    return [f"s-{i:03d}" for i in range(N) if s.matches(_labels(i))
            and (state is None or (state == "RUNNING") == bool(i % 4))]


async def _all(c: httpx.AsyncClient, **params: Any) -> tuple[list[str], int]:
    ids: list[str] = []
    pages = 0
    token = None
    while True:
        r = await c.get("/v1/sessions", params={**params, **({"continue": token} if token else {})})
        assert r.status_code == 200, r.text
        pages += 1
        ids += [s["id"] for s in r.json()["items"]]
        token = r.json()["metadata"]["continue"]
        if not token:
            return ids, pages


@pytest.mark.parametrize("selector", ["team=a", "team==b", "team!=a", "gpu", "!gpu", "team=a,env=prod,!gpu",
                                      "team in (a,b),gpu", "env notin (prod)", "team=c", "", "team = a , gpu"])
async def test_a_selector_lists_the_matching_sessions_over_several_pages(api, selector: str) -> None:
    c, _ = api
    ids, pages = await _all(c, labelSelector=selector, limit=3)
    assert ids == _expected(selector), "each match once, oldest first, ties by ID"
    assert pages >= len(ids) // 3
    one, _ = await _all(c, labelSelector=selector, limit=1000)
    assert one == ids


async def test_a_selector_combines_with_the_state_filter_and_shows_the_labels(api) -> None:
    c, _ = api
    ids, _ = await _all(c, labelSelector="env=prod", state="RUNNING", limit=2)
    assert ids == _expected("env=prod", "RUNNING") and ids
    r = await c.get("/v1/sessions", params={"labelSelector": "gpu", "limit": 1})
    (item,) = r.json()["items"]
    assert item["labels"]["gpu"] == "yes" and r.json()["metadata"]["continue"]


@pytest.mark.parametrize("selector,says", [
    ("team=a,", "requirement 2 is empty"), ("!team=a", "'!' goes before a bare key only"),
    ("team in a", "values in parentheses"), ("-x", "is no label key"), ("team in (a", "never closed"),
])
async def test_a_malformed_selector_is_422_naming_it_and_changes_nothing(api, selector: str, says: str) -> None:
    c, d = api
    # a stale index entry: a listing that ran would have removed it
    await d.redis.zadd(d.keys.tenant_sessions("acme"), {"s-gone": T0 - 1})
    r = await c.get("/v1/sessions", params={"labelSelector": selector})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "invalid_input" and body["message"].startswith("query.labelSelector: "), body
    assert says in body["message"]
    assert body["details"]["errors"][0]["loc"] == ["query", "labelSelector"]
    assert await d.redis.zscore(d.keys.tenant_sessions("acme"), "s-gone") is not None, "nothing was done"


async def test_a_selective_filter_pages_may_be_short_or_empty_and_still_go_on(directory: Directory) -> None:
    """The contract the other filters have: a page holds at most ``limit`` items, possibly fewer (the scan
    per call is capped: ``scan_cap``, checked per batch of 100), and only a null cursor ends the listing;
    no match is skipped or repeated."""
    now = time.time()
    for i in range(250):
        await directory.create_session(SessionRecord(
            id=f"s-{i:03d}", state=SessionState.RUNNING, actorTemplate="counter", pool="default", tenant="acme",
            labels={"rare": "1"} if i in (2, 17, 249) else {}, createdAt=now + i, updatedAt=now, lastActiveAt=now))
    r, keys = directory.redis, directory.keys
    sel = parse_selector("rare")
    got: list[str] = []
    sizes: list[int] = []
    cursor = None
    while True:
        items, cursor = await list_page(r, keys, keys.tenant_sessions("acme"), limit=2, cursor=cursor,
                                        tenant="acme", selector=sel, scan_cap=100)
        got += [x.id for x in items]
        sizes.append(len(items))
        if cursor is None:
            break
    assert got == ["s-002", "s-017", "s-249"]
    assert sizes[0] == 2 and 0 in sizes and sizes[-1] == 1, sizes


def test_the_openapi_document_describes_the_parameter() -> None:
    doc = create_app(Settings()).openapi()
    (param,) = [p for p in doc["paths"]["/v1/sessions"]["get"]["parameters"] if p["name"] == "labelSelector"]
    assert param["in"] == "query" and "key!=value" in param["description"] and "notin" in param["description"]
