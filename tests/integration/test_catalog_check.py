"""Processes of one deployment warn when they serve different WorkerPools/ActorTemplates (fresh-user run 35:
two `substrate up` on one Redis and key prefix with different config folders, silently)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from substrate import catalogcheck
from substrate.catalogcheck import CatalogCheck, describe, fingerprint
from substrate.keys import Keys
from substrate.specs import load_documents, parse_yaml_documents

POOL = "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: %s}\nspec: {replicas: %d, slots: 4}\n"
TEMPLATE = ("apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: %s}\n"
            "spec: {entrypoint: 'workers.agents.counter:Counter', workerPool: %s%s}\n")


def _catalog(pool: str, replicas: int = 1, extra: str = ""):
    return load_documents(parse_yaml_documents("---\n".join([POOL % (pool, replicas), TEMPLATE % ("counter", pool, extra)])),
                          log_warnings=False)


def test_a_fingerprint_names_what_differs_and_ignores_replicas() -> None:
    a, b = fingerprint(_catalog("default")), fingerprint(_catalog("small"))
    assert a["digest"] != b["digest"]
    assert describe(a, b) == "pools only there: small; pools only here: default; templates that differ: counter"
    assert fingerprint(_catalog("default", replicas=5))["digest"] == a["digest"]  # the autoscaler's field
    assert fingerprint(_catalog("default", extra=", stateManagement: {maxIdleTime: 5s}"))["digest"] != a["digest"]


@pytest.fixture
async def r(redis_url: str):
    client = aioredis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def test_two_processes_with_other_catalogs_warn_once_each_and_withdraw(r, caplog) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    a = CatalogCheck(r, keys, _catalog("default"))
    same = CatalogCheck(r, keys, _catalog("default", replicas=3))
    b = CatalogCheck(r, keys, _catalog("small"))
    try:
        with caplog.at_level(logging.WARNING, logger="substrate.catalogcheck"):
            assert await a.check() == []  # alone
            assert await same.check() == []  # the same config: no word
            said = await b.check()
            assert len(said) == 1 and "pools only there: default" in said[0] and "--config" in said[0]
            assert len(await a.check()) == 1  # the first process hears of it at its next check
            assert await a.check() == [] and await b.check() == []  # once per fingerprint
        assert sum("serves other WorkerPools" in rec.getMessage() for rec in caplog.records) == 2
        await b.withdraw()
        assert b.me not in await r.hgetall(keys.catalogs)
    finally:
        await r.delete(keys.catalogs)


async def test_a_dead_processs_entry_is_dropped_not_compared(r) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    stale = {**fingerprint(_catalog("small")), "at": time.time() - catalogcheck.FRESH_S - 1, "pid": 1, "host": "h"}
    await r.hset(keys.catalogs, mapping={"dead": json.dumps(stale), "garbage": "{not json"})
    a = CatalogCheck(r, keys, _catalog("default"))
    try:
        assert await a.check() == []
        assert set(await r.hgetall(keys.catalogs)) == {a.me}
    finally:
        await r.delete(keys.catalogs)


def test_a_second_substrate_up_with_another_config_says_so(runtime_factory) -> None:
    """The wiring: ``substrate up`` checks at its start (the loop's first step), so a second process of a
    deployment started with another config folder logs the warning at once."""
    extra = "\n---\n" + TEMPLATE % ("only-here", "default", "")
    first = runtime_factory(replicas=1, slots=2)
    second = runtime_factory(replicas=1, slots=2, share_with=first, extra_yaml=extra, wait_workers=False)
    deadline = time.monotonic() + 30
    log = ""
    while time.monotonic() < deadline and "serves other WorkerPools" not in log:
        time.sleep(0.2)
        log = Path(second.log.name).read_text(errors="replace")
    assert "templates only here: only-here" in log, log[-3000:]


def test_a_session_woken_in_another_pool_names_that_pool(runtime_factory) -> None:
    """Fresh-user run 35: a session woken after its template moved to another pool (renamed) kept naming
    the old one in its record. A wake writes the pool it placed the session in."""
    first = runtime_factory(replicas=1, slots=2)
    c = first.client
    sid = c.create_session("counter")["id"]
    assert c.get_session(sid)["pool"] == "default"
    c.invoke(sid, "increment")
    c.suspend(sid)
    # the same templates; the only pool, so every template's, is called otherwise now
    moved = "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: renamed}\nspec: {replicas: 1, slots: 2}\n"
    second = runtime_factory(share_with=first, pool_yaml=moved, replicas=1, slots=2)
    assert second.client.invoke(sid, "increment") == {"count": 2}
    rec = second.client.get_session(sid)
    assert rec["pool"] == "renamed" and rec["worker"].startswith("renamed-"), rec
