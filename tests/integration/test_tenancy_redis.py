"""Tenancy building blocks against a real Redis: keyset listing, quota script, API keys and their
revocation, activation tokens and key rotation, OIDC JWT verification against a JWKS, audit paging."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import jwt
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from api.auth import Authenticator, JwksVerifier
from substrate.apikeys import ApiKeyStore, hash_key
from substrate.audit import Actor, AuditLog
from substrate.directory import Directory
from substrate.errors import Forbidden, InvalidInput, StaleEpoch, TooManyRequests, Unauthorized
from substrate.keys import Keys
from substrate.listing import list_page
from substrate.models import ActorTemplate, QuotaLimits, SessionRecord, SessionState
from substrate.quotas import Quotas
from substrate.settings import ApiKeySpec, AuditSettings, QuotaSettings, Settings
from substrate.tokens import SigningKeyRing, TokenMinter, TokenVerifier, mint_token


@pytest.fixture
async def redis_prefix(redis_url: str):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    r = aioredis.from_url(redis_url, decode_responses=True)
    yield r, Keys(prefix), prefix
    async for k in r.scan_iter(f"{prefix}:*"):
        await r.delete(k)
    await r.aclose()


def _template(name: str = "counter", gpus: int = 0, quota: dict[str, int] | None = None) -> ActorTemplate:
    return ActorTemplate.model_validate({"metadata": {"name": name}, "spec": {
        "entrypoint": "workers.agents.counter:Counter", "resources": {"gpus": gpus}, "quota": quota}})


# ------------------------------------------------------------------------------------------ listing
async def test_a_tenants_listing_never_shows_another_tenants_session_of_a_stale_index_entry(redis_url,
                                                                                            redis_prefix):
    """A record removed without its index entry (a PENDING create past its deadline, a failed removal)
    left the ID in its tenant's index; once another tenant made a session of that ID, the first tenant's
    listing showed it. The listing now skips and drops such entries."""
    r, keys, prefix = redis_prefix
    d = Directory(redis_url, prefix)
    try:
        now = time.time()
        for sid, tenant in (("s-mine", "a"), ("s-reused", "b")):
            await d.create_session(SessionRecord(id=sid, state=SessionState.RUNNING, actorTemplate="counter",
                                                 pool="default", tenant=tenant, createdAt=now, updatedAt=now,
                                                 lastActiveAt=now))
        assert await r.zscore(keys.tenant_sessions("b"), "s-reused") is not None, "the create indexes it"
        await r.zadd(keys.tenant_sessions("a"), {"s-reused": now - 1})  # a's entry from a removed record
        items, _ = await list_page(r, keys, keys.tenant_sessions("a"), tenant="a")
        assert [x.id for x in items] == ["s-mine"]
        assert await r.zscore(keys.tenant_sessions("a"), "s-reused") is None, "the stale entry is dropped"
        assert [x.id for x in (await list_page(r, keys, keys.tenant_sessions("b"), tenant="b"))[0]] == ["s-reused"]
    finally:
        await d.close()


async def test_keyset_listing_skips_no_survivor_when_items_are_deleted_between_pages(redis_url, redis_prefix):
    r, keys, prefix = redis_prefix
    d = Directory(redis_url, prefix)
    try:
        t0 = 1_700_000_000.0
        ids = [f"s-{i:03d}" for i in range(30)]
        for i, sid in enumerate(ids):  # pairs share a creation time: ties are ordered by ID
            now = t0 + i // 2
            await d.create_session(SessionRecord(id=sid, state=SessionState.RUNNING, actorTemplate="counter",
                                                 pool="default", tenant="a", createdAt=now, updatedAt=now,
                                                 lastActiveAt=now))
            await r.zadd(keys.tenant_sessions("a"), {sid: now})
        seen: list[str] = []
        items, cur = await list_page(r, keys, keys.tenant_sessions("a"), limit=7)
        seen += [x.id for x in items]
        deleted = set()
        while cur:
            # delete two already-listed items and one not yet listed before each next page
            for sid in seen[-2:] + [ids[min(len(seen) + 3, 29)]]:
                if sid not in deleted:
                    deleted.add(sid)
                    await d.delete_session(sid)
            items, cur = await list_page(r, keys, keys.tenant_sessions("a"), limit=7, cursor=cur)
            seen += [x.id for x in items]
        survivors = [s for s in ids if s not in deleted]
        assert len(seen) == len(set(seen)), "no item twice"
        assert set(survivors) <= set(seen), "no survivor skipped"
        assert seen == sorted(seen), "oldest first, ties by ID"
        other, _ = await list_page(r, keys, keys.tenant_sessions("b"), limit=7)
        assert other == []
        # a page that ends exactly on the last session says so (no cursor to an empty page)
        left = len((await list_page(r, keys, keys.tenant_sessions("a"), limit=1000))[0])
        if left % 2:  # two pages of equal size
            await d.delete_session(survivors[0])
            left -= 1
        first, cur = await list_page(r, keys, keys.tenant_sessions("a"), limit=left // 2)
        last, end = await list_page(r, keys, keys.tenant_sessions("a"), limit=left // 2, cursor=cur)
        assert cur is not None and end is None and len(first) + len(last) == left, (left, cur, end)
        whole, end = await list_page(r, keys, keys.tenant_sessions("a"), limit=left)
        assert len(whole) == left and end is None
        with pytest.raises(Exception) as e:
            await list_page(r, keys, keys.tenant_sessions("a"), cursor="%%%")
        assert getattr(e.value, "code", "") == "invalid_continue"
    finally:
        await d.close()


# ------------------------------------------------------------------------------------------- quotas
async def test_quota_script_is_exact_under_100_concurrent_acquires_from_several_clients(redis_url, redis_prefix):
    _, keys, _ = redis_prefix
    settings = QuotaSettings(tenants={"a": QuotaLimits(maxRunning=7, maxTotal=9)})
    clients = [aioredis.from_url(redis_url, decode_responses=True) for _ in range(4)]
    quotas = [Quotas(c, keys, settings) for c in clients]
    t = _template()

    async def one(i: int) -> str:
        try:
            await quotas[i % 4].acquire("a", t, f"s{i}", create=True)
            return "ok"
        except TooManyRequests as e:
            return e.code
    res = await asyncio.gather(*(one(i) for i in range(100)))
    assert res.count("ok") == 7 and set(res) == {"ok", "quota_max_running"}
    u = await quotas[0].usage("a")
    assert (u.running, u.total) == (7, 7)
    ok_ids = [f"s{i}" for i, x in enumerate(res) if x == "ok"]
    # release is idempotent; suspended (released) sessions keep their total place
    await quotas[0].release("a", "counter", ok_ids[0])
    await quotas[1].release("a", "counter", ok_ids[0])
    assert (await quotas[0].usage("a")).running == 6
    await quotas[0].acquire("a", t, "n1", create=True)
    await quotas[0].release("a", "counter", "n1")
    await quotas[0].acquire("a", t, "n2", create=True)
    with pytest.raises(TooManyRequests) as e:
        await quotas[0].acquire("a", t, "n3", create=True)
    assert e.value.code == "quota_max_total" and e.value.details["scope"] == "tenant"
    # re-acquiring for a session already counted takes nothing more (a retried wake leaks nothing)
    await quotas[0].acquire("a", t, ok_ids[1], create=False)
    assert (await quotas[0].usage("a")).running == 7
    for c in clients:
        await c.aclose()


async def test_quota_reconcile_is_two_phase(redis_prefix):
    r, keys, _ = redis_prefix
    q = Quotas(r, keys, QuotaSettings())
    t = _template(gpus=1)
    await q.acquire("a", t, "gone", create=True)
    await q.acquire("a", t, "suspended", create=True)
    await q.acquire("a", t, "running", create=True)
    now = time.time()
    recs = {sid: SessionRecord(id=sid, state=st, actorTemplate="counter", pool="p", tenant="a", createdAt=now,
                               updatedAt=now, lastActiveAt=now)
            for sid, st in (("suspended", SessionState.SUSPENDED), ("running", SessionState.RUNNING))}
    assert await q.reconcile(recs) == (0, 0), "first sight: only suspected (a create may be one step away)"
    await q.reconcile(recs)
    u = await q.usage("a")
    assert (u.running, u.total, u.gpus) == (1, 2, 1)


# ------------------------------------------------------------------------------------- API keys
async def test_api_keys_create_import_revoke_and_immediate_effect(redis_prefix, tmp_path):
    r, keys, prefix = redis_prefix
    settings = Settings(redis={"url": "redis://unused", "key_prefix": prefix},
                        auth={"api_keys": [ApiKeySpec(tenant="env-t", key="sk_env_" + "x" * 30)]})
    auth = Authenticator(settings, r, keys)
    await auth.start()
    try:
        assert auth.enabled
        p = await auth.authenticate({"authorization": "Bearer sk_env_" + "x" * 30})
        assert p.tenant == "env-t" and not p.admin
        store = ApiKeyStore(r, keys)
        rec, key = await store.create("team-a", admin=True, name="ci")
        assert key not in json.dumps(await r.hgetall(keys.api_keys)) and hash_key(key) in await r.hkeys(keys.api_keys)
        assert (await auth.authenticate({"authorization": f"Bearer {key}"})).admin
        await store.revoke(rec.id)
        await asyncio.sleep(0.05)  # pub/sub delivery on loopback
        with pytest.raises(Unauthorized):
            await auth.authenticate({"authorization": f"Bearer {key}"})
        # a key given by env, once revoked, is not re-imported at the next start
        await store.revoke("sk_env_" + "x" * 30)
        assert await store.import_specs(settings.auth.api_keys) == 0
        await asyncio.sleep(0.05)
        with pytest.raises(Unauthorized):
            await auth.authenticate({"authorization": "Bearer sk_env_" + "x" * 30})
        with pytest.raises(Unauthorized):
            await auth.authenticate({})
    finally:
        await auth.stop()


async def test_a_key_removed_from_the_key_file_stops_working_at_the_next_start(redis_prefix):
    """Second fresh-user run: `substrate keys revoke --file` removed the key from the file, but the copy
    imported into Redis kept working after a restart (and the embedded Redis' password is not shown)."""
    r, keys, prefix = redis_prefix
    store = ApiKeyStore(r, keys)
    a, b = "sk_filea_" + "a" * 30, "sk_fileb_" + "b" * 30
    made, made_key = await store.create("team-c")  # made with the CLI: the file does not govern it
    assert await store.import_specs([ApiKeySpec(tenant="t1", key=a), ApiKeySpec(tenant="t2", key=b)]) == 2
    assert await store.lookup(hash_key(a)) and await store.lookup(hash_key(b))
    assert await store.import_specs([ApiKeySpec(tenant="t2", key=b)]) == 0  # a was removed from the file
    assert await store.lookup(hash_key(a)) is None, "a key no longer in the file is revoked"
    assert await store.lookup(hash_key(b)) is not None
    assert await store.lookup(hash_key(made_key)) is not None, "keys made with `keys create` are kept"
    # listed again, it is imported again (fresh-user round 10: it stayed refused for ever, without a word)
    assert await store.import_specs([ApiKeySpec(tenant="t1", key=a), ApiKeySpec(tenant="t2", key=b)]) == 1
    assert (await store.lookup(hash_key(a))).tenant == "t1"
    # with every file key gone and the CLI's key revoked, the API stays closed (keys were configured)
    await store.revoke(made.id)
    assert await store.import_specs([]) == 0 and await store.count() == 0 and await store.ever_configured()


async def test_a_file_key_is_known_by_its_name_or_the_id_inside_its_key(redis_prefix):
    """A key given by file or env is listed and revoked by its ``name``; without one, by the ``<id>`` of
    its ``sk_<id>_<secret>`` (a fresh-user run: ``keys revoke aaaa1111`` said api_key_not_found for
    ``sk_aaaa1111_...``, whose ID had been ``file-`` and the start of its hash); a ``sha256`` entry by
    ``file-`` and the start of the hash."""
    r, keys, prefix = redis_prefix
    store = ApiKeyStore(r, keys)
    plain, named, digest = "sk_aaaa1111_" + "a" * 30, "sk_bbbb2222_" + "b" * 30, "cd" * 32
    assert await store.import_specs([ApiKeySpec(tenant="t1", key=plain), ApiKeySpec(tenant="t2", key=named, name="ci"),
                                     ApiKeySpec(tenant="t3", sha256=digest)]) == 3
    assert sorted(k.id for k in await store.list()) == ["aaaa1111", "ci", "file-cdcdcdcd"]
    assert (await store.revoke("aaaa1111")).tenant == "t1"
    assert await store.lookup(hash_key(plain)) is None and await store.lookup(hash_key(named)) is not None


async def test_a_key_revoked_with_the_cli_stays_revoked_though_the_file_lists_it(redis_prefix, caplog):
    r, keys, prefix = redis_prefix
    store = ApiKeyStore(r, keys)
    a = "sk_filea_" + "a" * 30
    assert await store.import_specs([ApiKeySpec(tenant="t1", key=a)]) == 1
    await store.revoke(a)
    with caplog.at_level("WARNING", logger="substrate.apikeys"):
        assert await store.import_specs([ApiKeySpec(tenant="t1", key=a)]) == 0
    assert await store.lookup(hash_key(a)) is None
    assert "API key entry 0 (ID " in caplog.text
    assert "of tenant 't1' (file or env; entries count from 0) was revoked with `substrate keys revoke`" in caplog.text
    assert a not in caplog.text


async def test_open_mode_without_keys(redis_prefix):
    r, keys, prefix = redis_prefix
    auth = Authenticator(Settings(redis={"key_prefix": prefix}), r, keys)
    await auth.start()
    try:
        assert not auth.enabled
        p = await auth.authenticate({})
        assert p.tenant == "default" and not p.admin
    finally:
        await auth.stop()


async def test_open_mode_comes_back_when_a_restarted_redis_answers_and_no_key_exists(tmp_path):
    """The fresh-user finding (issue 11): the embedded Redis was killed and restarted; the follower's
    re-read failed once and the API answered 401 to every open-mode call until `substrate up` restarted."""
    from substrate.embedded import EmbeddedRedis
    from substrate.errors import DirectoryUnavailable

    with EmbeddedRedis(tmp_path / "redis", watch_interval_s=0.1) as srv:
        r = aioredis.from_url(srv.url, decode_responses=True, socket_timeout=1)
        keys = Keys("t-restart")
        auth = Authenticator(Settings(redis={"key_prefix": "t-restart"}), r, keys)
        await auth.start()
        try:
            assert not auth.enabled
            assert srv.proc is not None
            srv.proc.kill()
            # unknown while Redis is away: a call without a token is told why (503), never "keys were used"
            for _ in range(100):
                if auth.keys_unknown:
                    break
                await asyncio.sleep(0.05)
            assert auth.keys_unknown and not auth.have_keys
            with pytest.raises(DirectoryUnavailable):
                await auth.authenticate({})
            # the watcher restarts the server on its port; the follower re-reads and opens the API again
            for _ in range(200):
                if not auth.enabled:
                    break
                await asyncio.sleep(0.05)
            assert srv.restarts >= 1
            assert not auth.enabled
            assert (await auth.authenticate({})).tenant == "default"
            # and a key made afterwards still closes it (sticky, as before)
            await ApiKeyStore(r, keys).create("t1")
            for _ in range(100):
                if auth.have_keys:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(Unauthorized):
                await auth.authenticate({})
        finally:
            await auth.stop()
            await r.aclose()


# ------------------------------------------------------------------------------ activation tokens
async def test_activation_tokens_bind_session_epoch_worker_and_survive_rotation(redis_prefix):
    r, keys, _ = redis_prefix
    ring = await _ring(r, keys)
    minter = TokenMinter(ring, ttl_s=60)
    verifier = TokenVerifier(await _ring(r, keys), "http://w1")
    tok = minter.mint(session="s1", epoch=3, worker_address="http://w1", tenant="a")
    assert minter.mint(session="s1", epoch=3, worker_address="http://w1", tenant="a") == tok, "reused"
    c = await verifier.verify(tok, session="s1", epoch=3)
    assert (c.session, c.epoch, c.tenant) == ("s1", 3, "a")
    with pytest.raises(Forbidden):
        await verifier.verify(tok, session="s2", epoch=3)
    with pytest.raises(StaleEpoch):
        await verifier.verify(tok, session="s1", epoch=4)
    with pytest.raises(Unauthorized):
        await TokenVerifier(ring, "http://w2").verify(tok, session="s1", epoch=3)
    old_kid = ring.current
    expired = mint_token(ring.secrets[old_kid], old_kid, session="s1", epoch=3, audience="http://w1",
                         ttl_s=1, now=time.time() - 30)
    with pytest.raises(Unauthorized) as e:
        await verifier.verify(expired, session="s1", epoch=3)
    assert e.value.code == "token_expired"
    # rotation: a token of the new key is accepted by a verifier that never saw it (reload on unknown kid)
    new_kid, prev = await ring.rotate()
    assert prev == old_kid
    tok2 = minter.mint(session="s1", epoch=3, worker_address="http://w1", tenant="a")
    assert jwt.get_unverified_header(tok2)["kid"] == new_kid
    verifier.ring.loaded_at = 0  # past the reload rate limit
    assert (await verifier.verify(tok2, session="s1", epoch=3)).session == "s1"
    fresh = TokenVerifier(await _ring(r, keys), "http://w1")
    assert (await fresh.verify(tok, session="s1", epoch=3)).epoch == 3, "previous key still accepted"
    await ring.rotate(keep_s=0)
    fresh = TokenVerifier(await _ring(r, keys), "http://w1")
    with pytest.raises(Unauthorized):
        await fresh.verify(tok, session="s1", epoch=3)  # two rotations ago, kept no longer: refused


async def test_rotations_faster_than_a_refresh_keep_the_key_routers_still_sign_with(redis_prefix):
    """A router signs with the key current at its last refresh: three rotations back to back used to drop
    it (a fresh-user run: 401 invalid_token for good calls). Keys current within ``keep_s`` stay; older ones
    go, the previous one never."""
    r, keys, _ = redis_prefix
    router_ring = await _ring(r, keys)
    minter = TokenMinter(router_ring)
    tok = minter.mint(session="s1", epoch=1, worker_address="http://w1")  # signed with the key of its load
    rotating = SigningKeyRing(r, keys)
    for _ in range(3):
        await rotating.rotate()
    assert rotating.rotation_keep_s == 60.0
    worker = TokenVerifier(await _ring(r, keys), "http://w1")
    assert (await worker.verify(tok, session="s1", epoch=1)).session == "s1"
    assert len(worker.ring.secrets) == 4
    # a key that stopped being current an hour ago goes at the next rotation; the previous one stays
    now = int(time.time())
    await r.hset(keys.signing_keys, mapping={f"k{now - 7200}-aaaaaa": "old", f"k{now - 3600}-bbbbbb": "older-successor"})
    await r.hset(keys.signing_keys, mapping={"legacy-id": "x"})  # not of the k<time>- form: not kept
    await rotating.rotate()
    left = set(await r.hkeys(keys.signing_keys)) - {"current"}
    assert f"k{now - 7200}-aaaaaa" not in left and "legacy-id" not in left
    # the hour-old key was followed by keys made now: it was current until then, and stays
    assert f"k{now - 3600}-bbbbbb" in left
    assert len(left) == 6  # the four kept above, the hour-old one and the new current
    await rotating.rotate(keep_s=0)
    assert len(set(await r.hkeys(keys.signing_keys)) - {"current"}) == 2  # the new current and the previous


async def _ring(r: Any, keys: Keys) -> SigningKeyRing:
    ring = SigningKeyRing(r, keys)
    await ring.load()
    return ring


# -------------------------------------------------------------------------------------- OIDC JWT
async def test_oidc_jwt_against_jwks_with_key_rotation():
    keys = {"k1": rsa.generate_private_key(public_exponent=65537, key_size=2048)}
    served: dict[str, Any] = {}

    def jwks() -> dict[str, Any]:
        out = []
        for kid, k in keys.items():
            d = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(k.public_key()))
            d.update(kid=kid, alg="RS256", use="sig")
            out.append(d)
        return {"keys": out}

    async def discovery(req: web.Request) -> web.Response:
        return web.json_response({"issuer": served["iss"], "jwks_uri": served["iss"] + "/jwks"})

    async def jwks_route(req: web.Request) -> web.Response:
        return web.json_response(jwks())

    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", discovery)
    app.router.add_get("/jwks", jwks_route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    served["iss"] = f"http://127.0.0.1:{port}"
    try:
        s = Settings(auth={"oidc_issuer": served["iss"], "oidc_audience": "substrate"})
        v = JwksVerifier(s)

        def token(kid: str, **claims: Any) -> str:
            body = {"iss": served["iss"], "aud": "substrate", "sub": "alice", "tenant": "team-a",
                    "exp": int(time.time()) + 60, **claims}
            return jwt.encode(body, keys[kid], algorithm="RS256", headers={"kid": kid})

        p = await v.verify(token("k1"))
        assert (p.tenant, p.subject, p.admin, p.via) == ("team-a", "alice", False, "jwt")
        assert (await v.verify(token("k1", roles=["substrate-admin"]))).admin
        for bad, code in ((token("k1", aud="other"), "invalid_token"), (token("k1", iss="http://evil"), "invalid_token"),
                          (token("k1", exp=int(time.time()) - 60), "token_expired")):
            with pytest.raises(Unauthorized) as e:
                await v.verify(bad)
            assert e.value.code == code
        with pytest.raises(Forbidden) as e2:
            await v.verify(token("k1", tenant="Not A Tenant"))
        assert e2.value.code == "no_tenant"
        # the issuer rotates: a token with a new key ID makes the verifier reload the JWKS
        keys["k2"] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        v._loaded_at -= 5
        assert (await v.verify(token("k2"))).tenant == "team-a"
        forged = jwt.encode({"iss": served["iss"], "aud": "substrate", "sub": "x", "tenant": "team-a",
                             "exp": int(time.time()) + 60},
                            rsa.generate_private_key(public_exponent=65537, key_size=2048), algorithm="RS256",
                            headers={"kid": "k1"})
        with pytest.raises(Unauthorized):
            await v.verify(forged)
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------------------------- audit
async def test_audit_records_page_per_session_and_tenant(redis_prefix):
    r, keys, _ = redis_prefix
    log = AuditLog(r, keys, AuditSettings())
    for i in range(5):
        await log.record("create" if i == 0 else "suspend", session="s1", tenant="a", template="t",
                         who=Actor("apikey:x", "a", f"req{i}"))
    await log.record("create", session="s2", tenant="b", template="t")
    items, cur = await log.session_events("s1", limit=2)
    all_ids = [x["id"] for x in items]
    while cur:
        items, cur = await log.session_events("s1", limit=2, after=cur)
        all_ids += [x["id"] for x in items]
    assert len(all_ids) == 5 == len(set(all_ids))
    t_items, _ = await log.tenant_events("a")
    assert [x["requestId"] for x in t_items] == [f"req{i}" for i in range(5)]
    assert (await log.tenant_events("b"))[0][0]["who"] == "system:control-plane"
    # the ID is deleted by tenant a and created again by tenant b: each sees only its own records, and
    # a filtered page is never followed by an empty one
    for i in range(3):
        await log.record("create" if i == 0 else "suspend", session="s1", tenant="b", template="t",
                         who=Actor("apikey:y", "b", f"b{i}"))
    seen = {}
    for tenant in ("a", "b"):
        ids, cur, pages = [], None, 0
        while True:
            items, cur = await log.session_events("s1", limit=2, after=cur, tenant=tenant)
            pages += 1
            assert items and all(x["tenant"] == tenant for x in items)
            ids += [x["requestId"] for x in items]
            if not cur:
                break
        seen[tenant] = ids
    assert seen == {"a": [f"req{i}" for i in range(5)], "b": ["b0", "b1", "b2"]}
    assert len((await log.session_events("s1", limit=100))[0]) == 8  # an admin sees both
    assert (await log.session_events("nope", tenant="a"))[0] == []


async def test_a_limit_of_zero_is_refused_without_a_retry_after(redis_url, redis_prefix):
    """A quota of 0 admits nothing: "this limit admits none", and no ``Retry-After`` (it said 1 s, which
    a client would follow for ever)."""
    _, keys, _ = redis_prefix
    client = aioredis.from_url(redis_url, decode_responses=True)
    quotas = Quotas(client, keys, QuotaSettings(tenants={"zero": QuotaLimits(maxTotal=0), "one": QuotaLimits(maxTotal=1)}))
    with pytest.raises(TooManyRequests) as e:
        await quotas.acquire("zero", _template(), "s1", create=True)
    assert e.value.code == "quota_max_total" and "admits none" in e.value.message
    assert e.value.retry_after_s is None
    await quotas.acquire("one", _template(), "s1", create=True)
    with pytest.raises(TooManyRequests) as full:
        await quotas.acquire("one", _template(), "s2", create=True)
    # only a delete makes room under maxTotal, so no Retry-After either (a client would poll for ever)
    assert full.value.code == "quota_max_total" and full.value.retry_after_s is None
    assert "delete sessions" in full.value.message
    await client.aclose()


@pytest.mark.parametrize("limits,gpus,code", [
    ({"maxRunning": 0}, 0, "quota_max_running"), ({"maxGpus": 0}, 1, "quota_max_gpus"),
    ({"maxCreatesPerMinute": 0}, 0, "quota_max_creates_per_minute"),
    ({"maxTotal": 0}, 0, "quota_max_total")])
async def test_every_limit_of_zero_admits_none_and_says_so(redis_url, redis_prefix, limits, gpus, code):
    """A fresh-user run: ``maxCreatesPerMinute: 0`` failed inside the quota script (no oldest create in an
    empty window: arithmetic on nil) and answered 503 ``directory_unavailable``, "Redis unavailable",
    with ``Retry-After: 1``. Every limit of 0 is a 429 of its own code, "admits none", no Retry-After,
    and takes nothing."""
    _, keys, _ = redis_prefix
    client = aioredis.from_url(redis_url, decode_responses=True)
    quotas = Quotas(client, keys, QuotaSettings(tenants={"z": QuotaLimits(**limits)}))
    with pytest.raises(TooManyRequests) as e:
        await quotas.acquire("z", _template(gpus=gpus), "s1", create=True)
    assert e.value.code == code and "admits none" in e.value.message and e.value.retry_after_s is None
    u = await quotas.usage("z")
    assert (u.running, u.total, u.gpus) == (0, 0, 0)  # nothing taken
    await client.aclose()


@pytest.mark.parametrize("limits,gpus,code", [
    ({"maxRunning": 1}, 0, "quota_max_running"),  # idle sessions get suspended
    ({"maxGpus": 1}, 1, "quota_max_gpus"),  # idle GPU sessions get suspended
    ({"maxCreatesPerMinute": 1}, 0, "quota_max_creates_per_minute"),  # the window slides
])
async def test_a_full_limit_that_clears_by_itself_keeps_its_retry_after(redis_url, redis_prefix, limits, gpus, code):
    """Waiting makes room under these (unlike ``maxTotal``), so their 429 says when to look again."""
    _, keys, _ = redis_prefix
    client = aioredis.from_url(redis_url, decode_responses=True)
    quotas = Quotas(client, keys, QuotaSettings(tenants={"a": QuotaLimits(**limits)}))
    await quotas.acquire("a", _template(gpus=gpus), "s1", create=True)
    with pytest.raises(TooManyRequests) as full:
        await quotas.acquire("a", _template(gpus=gpus), "s2", create=True)
    assert full.value.code == code and full.value.retry_after_s is not None and full.value.retry_after_s >= 1
    await client.aclose()


async def test_a_failing_script_is_a_bug_not_an_unavailable_redis(redis_url, redis_prefix):
    """A Lua error of ours (Redis answers ``user_script:<line>: ...``) is 500 ``internal`` saying it is a
    bug, not 503 ``directory_unavailable`` (which clients retry and readiness reads as Redis down)."""
    from substrate import quotas as quotas_mod
    from substrate.errors import DirectoryUnavailable, SubstrateError

    _, keys, _ = redis_prefix
    client = aioredis.from_url(redis_url, decode_responses=True)
    q = Quotas(client, keys, QuotaSettings(tenants={"a": QuotaLimits(maxRunning=1)}))
    q._acquire = client.register_script("return 1 + nil")  # a script that fails as it runs
    with pytest.raises(SubstrateError) as e:
        await q.acquire("a", _template(), "s1", create=True)
    assert not isinstance(e.value, DirectoryUnavailable)
    assert (e.value.status, e.value.code) == (500, "internal") and "a bug" in e.value.message
    assert quotas_mod.script_failure(ConnectionError("refused")) is None  # the rest stays 503
    await client.aclose()


async def test_an_id_two_keys_share_revokes_neither_and_says_how(redis_prefix):
    """Fresh-user run: two file keys named alike share an ID; ``keys revoke same`` took out the first (a
    team's key) and left the other (an admin key) working, without a word."""
    r, keys, prefix = redis_prefix
    store = ApiKeyStore(r, keys)
    a, b = "sk_aaaa_" + "a" * 30, "sk_bbbb_" + "b" * 30
    assert await store.import_specs([ApiKeySpec(tenant="team-c", key=a, name="same"),
                                     ApiKeySpec(tenant="team-d", key=b, name="same", admin=True)]) == 2
    with pytest.raises(InvalidInput) as e:
        await store.revoke("same")
    assert "2 keys have the ID 'same'" in e.value.message and "team-c, team-d" in e.value.message
    assert await store.lookup(hash_key(a)) and await store.lookup(hash_key(b)), "nothing revoked"
    assert (await store.revoke(b)).tenant == "team-d"  # by the key itself: exact
    assert await store.lookup(hash_key(b)) is None and await store.lookup(hash_key(a))
    assert (await store.revoke("same")).tenant == "team-c"  # one left with that ID: unambiguous


async def test_a_file_key_named_as_another_keys_id_is_warned_about(redis_prefix, caplog):
    """Fresh-user run: a file entry named ``d6b79712``, the ID of a key made with ``keys create``, was
    imported without a word; ``keys revoke d6b79712`` then named two keys."""
    r, keys, prefix = redis_prefix
    store = ApiKeyStore(r, keys)
    made, _ = await store.create("team-a")
    with caplog.at_level("WARNING", logger="substrate.apikeys"):
        assert await store.import_specs([ApiKeySpec(tenant="team-b", key="sk_filex_" + "x" * 30, name=made.id)]) == 1
    assert f"is named {made.id!r}, the ID of another key (tenant 'team-a')" in caplog.text


async def test_a_key_with_a_bad_name_is_not_created(redis_prefix):
    from substrate.errors import InvalidInput

    r, keys, _ = redis_prefix
    store = ApiKeyStore(r, keys)
    with pytest.raises(InvalidInput) as e:
        await store.create("team-a", name="line\nbreak")
    assert e.value.code == "invalid_key_name"
    assert await store.list() == []


async def test_a_ring_lost_from_redis_is_written_back_from_memory(redis_prefix):
    """A fresh-user run flushed the runtime's Redis: routers refused calls 500 ``no_signing_key`` and
    workers refused tokens of a key made anew 401 ``invalid_token``. The first process to reload writes
    its ring back, so tokens signed before the loss stay good and new ones are signed with the same key."""
    r, keys, _ = redis_prefix
    router_ring = await _ring(r, keys)
    kid = router_ring.current
    tok = TokenMinter(router_ring).mint(session="s1", epoch=1, worker_address="http://w1")
    await r.delete(keys.signing_keys)  # the data is lost
    await router_ring.load(create=False)  # a refresh
    assert router_ring.current == kid and (await r.hget(keys.signing_keys, "current")) == kid
    worker = TokenVerifier(await _ring(r, keys), "http://w1")
    assert (await worker.verify(tok, session="s1", epoch=1)).session == "s1"
    fresh = SigningKeyRing(r, keys)  # a process with nothing in memory makes nothing without ``create``
    await r.delete(keys.signing_keys)
    await fresh.load(create=False)
    assert fresh.current == "" and not await r.exists(keys.signing_keys)


async def test_keys_lost_with_redis_data_leave_the_api_closed_not_open(redis_prefix, tmp_path):
    """A fresh-user run: keys made with the CLI live only in Redis; a flush (or a restart without
    persistence) lost them, and the next start of the runtime ran open without a word. The embedded
    default's data folder now remembers that keys existed."""
    r, keys, prefix = redis_prefix
    marker = tmp_path / "var" / f"auth-closed-{prefix}"
    settings = Settings(redis={"key_prefix": prefix})
    first = Authenticator(settings, r, keys, closed_marker=marker)
    await first.start()
    try:
        assert not first.enabled and not marker.exists()  # open mode, nothing recorded
        await ApiKeyStore(r, keys).create("team-a")
        for _ in range(100):  # the follower hears of the key
            if first.enabled:
                break
            await asyncio.sleep(0.02)
        assert first.enabled and marker.exists()
    finally:
        await first.stop()
    async for k in r.scan_iter(f"{prefix}:*"):  # the data is lost
        await r.delete(k)
    again = Authenticator(settings, r, keys, closed_marker=marker)
    await again.start()
    try:
        assert again.enabled, "closed: the keys were lost, not never made"
        with pytest.raises(Unauthorized):
            await again.authenticate({})
    finally:
        await again.stop()
    marker.unlink()  # the operator's way back to open mode
    opened = Authenticator(settings, r, keys, closed_marker=marker)
    await opened.start()
    try:
        assert not opened.enabled
    finally:
        await opened.stop()


async def test_revoking_by_a_keys_name_says_which_id_that_name_is(redis_prefix):
    """Fresh-user tester 54: ``keys revoke "first key"`` (the ``--name``) answered only ``no API key``."""
    from substrate.errors import NotFound

    r, keys, prefix = redis_prefix
    store = ApiKeyStore(r, keys)
    made, _ = await store.create("t1", name="first key")
    with pytest.raises(NotFound) as info:
        await store.revoke("first key")
    assert info.value.code == "api_key_not_found"
    assert f"'first key' is the name of key {made.id}: revoke by the ID" in info.value.message
    assert [k.id for k in await store.list()] == [made.id], "nothing was revoked"
    with pytest.raises(NotFound) as info:
        await store.revoke("nothing-like-it")
    assert "as `substrate keys list` shows it" in info.value.message
