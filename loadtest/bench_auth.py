"""``make bench`` rows for tenancy: what authentication and per-activation tokens cost on the hot path.

* **Router overhead, auth off vs on**: runtimes started one after the other (never at once, so they do
  not share the CPU; off, on, on, off, each setting's two runs pooled, so a load drift biases neither),
  the same 1-worker pool and counter session; for each turn, one call through the router and one
  straight to the worker (with a valid activation token), interleaved; the overhead is the
  percentile of the paired differences (routed - direct), as DESIGN.md asks. "On" means an API key on
  every call (``Authorization: Bearer sk_...``) and tenant checks; the worker verifies an activation
  token in both runs (there is no "off" for it).
* **In-process costs** of the pieces (microseconds per call, one core, warm caches where the hot path has
  them): API-key check (cache hit), activation-token mint (cache hit) and verify (cache hit), and the
  PyJWT sign/verify the caches avoid.

What it leaves out: JWT (OIDC) callers cost the same as API keys once their token is cached (one dict
lookup); the first call of a new JWT costs one RS256 verify (~0.1-0.3 ms). Loopback only, shared machine.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import aiohttp

from substrate.quantiles import percentile


def worker_headers(redis_url: str, prefix: str, address: str, session: str, epoch: int | None,
                   tenant: str = "default", pepper: str | None = None) -> dict[str, str]:
    """Headers for a direct call to a worker: an activation token signed with the runtime's current key."""
    import redis

    from substrate.keys import Keys
    from substrate.tokens import derive_secret, mint_token

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    raw = r.hgetall(Keys(prefix).signing_keys)
    kid = raw["current"]
    token = mint_token(derive_secret(raw[kid], pepper), kid, session=session, epoch=epoch, audience=address, tenant=tenant,
                       ttl_s=3600)
    h = {"Authorization": f"Bearer {token}"}
    if epoch is not None:
        h["X-Substrate-Epoch"] = str(epoch)
    return h


def _pct(xs: list[float], q: float) -> float:
    """The project's one percentile definition (``substrate.quantiles``), ``q`` in 0..1."""
    v = percentile(xs, q * 100)
    assert v is not None, "no samples"
    return v


async def _overhead(n: int, key: str | None) -> tuple[list[float], list[float]]:
    """(routed - direct) paired differences and routed latencies (s) on a fresh runtime."""
    from loadtest.bench import Server, _post

    env = {}
    if key:
        # an admin key: the readiness poll (Server.ready) reads the pools' live status, which an ordinary
        # tenant is not shown; a key is verified the same way whatever its role
        env["SUBSTRATE_AUTH__API_KEYS"] = json.dumps([{"tenant": "bench", "key": key, "admin": True}])
    srv = Server(replicas=1, slots=8, env=env)
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    diffs: list[float] = []
    routed: list[float] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16), headers=auth) as http:
            await srv.ready(http, 1)
            st, s, _ = await _post(http, f"{srv.url}/v1/sessions", {"actorTemplate": "counter"})
            assert st == 201, s
            await srv.settle()  # the pool's host pre-starts would otherwise land in one side's pairs
            import redis

            url = os.environ["SUBSTRATE_REDIS_URL"]
            address = redis.Redis.from_url(url, decode_responses=True).hget(
                f"{srv.prefix}:{{w:{s['worker']}}}:worker", "address")
            direct_h = worker_headers(url, srv.prefix, address, s["id"], s["epoch"], s["tenant"])
            body = {"input": "get"}
            inv = f"{srv.url}/v1/sessions/{s['id']}/invoke"
            d_url = f"{address}/v1/activations/{s['id']}/invoke"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as bare:
                for _ in range(200):  # warm-up: connection pools, route cache, token caches
                    await _post(http, inv, body)
                    await _post(bare, d_url, body, direct_h)
                for _ in range(n):
                    st1, _, r = await _post(http, inv, body)
                    st2, _, d = await _post(bare, d_url, body, direct_h)
                    assert st1 == 200 and st2 == 200, (st1, st2)
                    routed.append(r)
                    diffs.append(r - d)
    finally:
        srv.stop()
    return diffs, routed


def _micro(n: int = 20000) -> list[dict[str, Any]]:
    """In-process costs (us per call)."""
    import jwt

    from substrate.tokens import ActivationClaims, TokenMinter, TokenVerifier, mint_token

    class Ring:  # the parts of SigningKeyRing the minter/verifier read, without Redis
        current = "k1"
        secrets = {"k1": b"x" * 32}
        loaded_at = time.monotonic()

        async def refresh_if_stale(self) -> bool:
            return False

    rows = []

    def timed(case: str, fn: Any, count: int = n) -> None:
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        us = (time.perf_counter() - t0) / count * 1e6
        rows.append({"case": f"  auth micro: {case}", "n": count, "value": round(us, 2), "unit": "us/call"})

    minter = TokenMinter(Ring())  # type: ignore[arg-type]
    tok = minter.mint(session="s", epoch=1, worker_address="http://w", tenant="t")
    timed("activation token mint, cached", lambda: minter.mint(session="s", epoch=1, worker_address="http://w",
                                                               tenant="t"))
    timed("activation token sign (PyJWT HS256, uncached)",
          lambda: mint_token(b"x" * 32, "k1", session="s", epoch=1, audience="http://w"), 5000)
    timed("activation token verify (PyJWT HS256, uncached)",
          lambda: jwt.decode(tok, b"x" * 32, algorithms=["HS256"], audience="http://w"), 5000)
    ver = TokenVerifier(Ring(), "http://w")  # type: ignore[arg-type]

    def verify_cached() -> ActivationClaims:
        coro = ver.verify(tok, session="s", epoch=1)
        try:
            coro.send(None)
        except StopIteration as e:
            return e.value  # type: ignore[no-any-return]
        raise AssertionError("cached verify must not wait")
    verify_cached()  # fills the cache (the key is known: no await either)
    timed("activation token verify, cached", verify_cached)
    # what api.auth does per call for an API key in the steady state: SHA-256 of the key + a dict lookup
    # (loadtest may not import api: the import rule; this is the same work without the coroutine frame)
    from substrate.apikeys import hash_key

    key = "sk_bench_" + "y" * 43
    cache = {hash_key(key): ("bench", time.monotonic() + 3600)}

    def check() -> object:
        return cache.get(hash_key(key))
    timed("API key check (sha256 + cache lookup)", check)
    return rows


async def bench_auth(n: int) -> list[dict[str, Any]]:
    """Rows: router overhead with auth off and on (paired differences), their difference, micro costs.

    Each setting runs twice with ``n // 2`` turns, in the order off, on, on, off (ABBA), and its two runs
    are pooled: a machine whose load drifts during the bench (a shared one) then biases neither side."""
    rows: list[dict[str, Any]] = []
    labels = {"off": "off (open mode)", "on": "on (API key + tenant checks)"}
    keys = {"off": None, "on": "sk_bench_" + "z" * 43}
    results: dict[str, list[float]] = {"off": [], "on": []}
    half = max(1, n // 2)
    for which in ("off", "on", "on", "off"):
        diffs, _ = await _overhead(half, keys[which])
        results[which] += diffs
    for which, diffs in results.items():
        rows.append({"case": f"router overhead, auth {labels[which]}: routed - direct, paired (ABBA, 2 runtimes)",
                     "n": len(diffs), "p50_ms": _pct(diffs, .50) * 1000, "p95_ms": _pct(diffs, .95) * 1000,
                     "p99_ms": _pct(diffs, .99) * 1000})
    off, on = results["off"], results["on"]
    rows.append({"case": "  auth cost on the hot path (on - off, medians of the overheads)", "n": len(on),
                 "p50_ms": (_pct(on, .5) - _pct(off, .5)) * 1000})
    rows += _micro()
    return rows
