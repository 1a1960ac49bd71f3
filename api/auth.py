"""Who is calling: API keys (embedded default), OIDC JWT bearer tokens (production), or nobody (open mode).

``Authenticator.authenticate(headers) -> Principal`` runs on every ``/v1`` call, the invoke hot path
included, so it does no I/O in the steady state:

* **API keys** (``sk_...``, see ``substrate.apikeys``): the SHA-256 of the presented key is looked up in a
  process-local cache, filled from Redis on a miss. Each router subscribes to the ``auth:version``
  channel; any key change (create, revoke) clears the cache, so a revoked key stops working in every
  router at once. Unknown keys are cached as negative entries too (bounded), so a client hammering with a
  wrong key costs one Redis read per cache period, not one per request.
* **JWT** (anything else with two dots, when ``auth.oidc_issuer`` is set): verified with PyJWT against the
  issuer's JWKS (discovered from ``/.well-known/openid-configuration`` unless ``oidc_jwks_url`` is set),
  with issuer, audience and expiry checks. The JWKS is cached and reloaded after ``jwks_ttl_s`` or at once
  (rate-limited) when a token names an unknown key ID, so the issuer can rotate keys freely. Verified
  tokens are cached until they expire. The tenant comes from the ``tenant_claim`` claim; the admin role
  from ``roles_claim`` containing ``admin_role``.
* **Legacy shared token** ``api.auth_token``: still accepted, as an admin of tenant ``default``.
* **Open mode**: with no key in Redis, none by file or env, no issuer and no shared token, every caller
  is ``Principal(tenant="default")`` (the embedded default as it always was). As soon as a key exists
  (e.g. created by ``substrate keys create`` while routers run) every ``/v1`` call needs one, and it
  stays so when the last key is revoked (fail closed: revoking keys never opens the API). While Redis
  cannot say whether keys exist (at start-up, or after its connection was lost), a call without a token
  gets 503 ``directory_unavailable`` (fail closed, but not "401: keys were used": nobody knows yet); the
  follower re-reads every half second until Redis answers, then the API is open again if no key ever
  existed. (It used to stay closed for good after one failed read: an embedded Redis killed and
  restarted locked every open-mode caller out until ``substrate up`` restarted; fresh-user run, issue 11.)
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import aiohttp
import jwt
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from substrate.apikeys import ApiKeyStore, TENANT_RE, hash_key, load_key_file
from substrate.errors import DirectoryUnavailable, Forbidden, Unauthorized, clip, public_detail
from substrate.keys import Keys
from substrate.loops import cancel_and_wait, reraise_lost_cancel
from substrate.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    """The caller: ``tenant`` owns what it creates; ``admin`` sees and touches every tenant's sessions."""

    tenant: str
    subject: str
    admin: bool = False
    #: how it was authenticated: ``anonymous`` | ``api_key`` | ``jwt`` | ``shared_token``
    via: str = "anonymous"

    def owns(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant

    @property
    def sees_fleet(self) -> bool:
        """Whether the caller may read fleet-wide figures (workers, slots, cost integrals, the router's
        parked requests): admins, and the single caller of open mode (no credentials configured, so there
        are no tenants to keep apart). An ordinary tenant's key or JWT does not: capacity and load are
        other tenants' business too."""
        return self.admin or self.via == "anonymous"


ANONYMOUS = Principal(tenant="default", subject="anonymous")


class JwksVerifier:
    """Verifies OIDC JWTs (RS256/ES256/EdDSA/PS256) against the issuer's JWKS, with key caching."""

    ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "EdDSA"]

    def __init__(self, settings: Settings, http: aiohttp.ClientSession | None = None) -> None:
        a = settings.auth
        self.issuer = (a.oidc_issuer or "").rstrip("/")
        self.audience = a.oidc_audience
        self.jwks_url = a.oidc_jwks_url
        self.tenant_claim, self.roles_claim, self.admin_role = a.tenant_claim, a.roles_claim, a.admin_role
        self.ttl_s = a.jwks_ttl_s
        self._http = http
        self._keys: dict[str, Any] = {}
        self._loaded_at = 0.0
        self._lock = asyncio.Lock()
        self._cache: dict[str, tuple[Principal, float]] = {}

    async def _get(self, url: str) -> Any:
        own = self._http is None
        http = self._http or aiohttp.ClientSession()
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    raise Unauthorized(f"identity provider answered {r.status} for {url}", code="jwks_unavailable")
                return await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Unauthorized(f"identity provider unreachable: {e}", code="jwks_unavailable") from e
        finally:
            if own:
                await http.close()

    async def reload(self) -> None:
        """Fetch the JWKS (discovering its URL first if needed). Raises ``Unauthorized(jwks_unavailable)``."""
        async with self._lock:
            if not self.jwks_url:
                conf = await self._get(f"{self.issuer}/.well-known/openid-configuration")
                self.jwks_url = conf["jwks_uri"]
            data = await self._get(self.jwks_url)
            keys = {}
            for k in jwt.PyJWKSet.from_dict(data).keys:
                keys[k.key_id or ""] = k
            self._keys = keys
            self._loaded_at = time.monotonic()

    async def _key(self, kid: str) -> Any:
        age = time.monotonic() - self._loaded_at
        if kid not in self._keys and age > 1.0 or age > self.ttl_s:
            await self.reload()
        k = self._keys.get(kid)
        if k is None:
            raise Unauthorized(f"token signed with unknown key {clip(kid)}", code="invalid_token")
        return k

    async def verify(self, token: str) -> Principal:
        """Returns the caller; raises ``Unauthorized`` (bad/expired token) or ``Forbidden`` (no tenant)."""
        now = time.time()
        hit = self._cache.get(token)
        if hit is not None and hit[1] > now:
            return hit[0]
        try:
            kid = jwt.get_unverified_header(token).get("kid", "")
        except jwt.PyJWTError as e:
            raise Unauthorized(f"malformed token: {e}", code="invalid_token") from None
        key = await self._key(kid)
        try:
            claims = jwt.decode(token, key.key, algorithms=self.ALGORITHMS, audience=self.audience,
                                issuer=self.issuer, leeway=5,
                                options={"require": ["exp", "iss", "sub"], "verify_aud": self.audience is not None})
        except jwt.ExpiredSignatureError:
            raise Unauthorized("token expired", code="token_expired") from None
        except jwt.PyJWTError as e:
            raise Unauthorized(f"invalid token: {e}", code="invalid_token") from None
        tenant = claims.get(self.tenant_claim)
        if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise Forbidden(f"token has no valid {self.tenant_claim!r} claim", code="no_tenant")
        roles = claims.get(self.roles_claim) or []
        if isinstance(roles, str):
            roles = roles.split()
        p = Principal(tenant=tenant, subject=str(claims["sub"]), admin=self.admin_role in roles, via="jwt")
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[token] = (p, float(claims["exp"]))
        return p


#: the file, in the embedded default's data folder, that says API keys exist (``Authenticator.closed_marker``):
#: ``auth-closed-<key prefix>``, one per deployment that shares the folder
AUTH_CLOSED_MARKER = "auth-closed"


class Authenticator:
    """See the module docstring. One per router process: ``start`` before serving, ``stop`` after."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, keys: Keys,
                 http: aiohttp.ClientSession | None = None, *, closed_marker: Path | None = None) -> None:
        self.settings = settings
        #: a file that says keys existed here (the embedded default's data folder; None: none kept): a
        #: Redis that lost its data (a flush, a restart without persistence) lost the keys and the record
        #: that there were any, and the next start ran open without a word (fresh-user run)
        self.closed_marker = closed_marker
        self.store = ApiKeyStore(redis, keys)
        self.keys = keys
        self.redis = redis
        self.jwt = JwksVerifier(settings, http) if settings.auth.oidc_issuer else None
        self.shared_token = settings.api.auth_token
        #: Redis said keys exist or existed (sticky: revoking the last key never opens the API)
        self.have_keys = False
        #: Redis could not be read since the last successful read: whether keys exist is unknown
        self.keys_unknown = False
        self._cache: dict[str, tuple[Principal | None, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        """Whether callers must authenticate (see "Open mode")."""
        return self.have_keys or self.keys_unknown or self.jwt is not None or bool(self.shared_token)

    async def start(self) -> None:
        """Import keys given by file/env, count keys, and follow key changes (pub/sub)."""
        specs = list(self.settings.auth.api_keys)
        if self.settings.auth.api_keys_file:
            specs += load_key_file(self.settings.auth.api_keys_file)
        try:
            await self.store.import_specs(specs)  # also revokes file/env keys no longer given
            self.have_keys = bool(specs) or await self.store.ever_configured()
            if not self.have_keys and self.closed_marker is not None and self.closed_marker.exists():
                self.have_keys = True  # fail closed: the keys were lost, not never made
                log.error("this runtime had API keys (%s says so) but its Redis has none: its data was lost (a "
                          "flush, or a restart without persistence). The API stays closed: make a key with "
                          "`substrate keys create TENANT --admin`, or delete that file to run open",
                          self.closed_marker)
            self._mark_closed()
        except (RedisError, OSError) as e:
            # fail closed: if keys may exist we cannot tell, so demand them until Redis answers (the
            # follower re-reads until it does)
            self.keys_unknown = True
            log.warning("could not read API keys at start-up; authentication required", exc_info=e)
        self._task = asyncio.create_task(self._follow())
        try:
            await asyncio.wait_for(self._subscribed.wait(), 5)
        except asyncio.TimeoutError:
            log.warning("not subscribed to API key changes yet; revocations rely on key_cache_ttl_s")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])

    async def _follow(self) -> None:
        """Clear the cache on every key change; resubscribe (and clear) after a lost connection."""
        while True:
            reraise_lost_cancel()  # here and below: see substrate/loops.py
            ps = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await ps.subscribe(self.keys.auth_version)
                await self._reset()
                self._subscribed.set()
                reraise_lost_cancel()
                async for msg in ps.listen():
                    if msg.get("type") == "message":
                        await self._reset()
                    reraise_lost_cancel()
            except asyncio.CancelledError:
                await ps.aclose()
                raise
            except Exception:  # noqa: BLE001 - a follower never dies: reconnect after a pause
                log.warning("API key change subscription lost; resubscribing", exc_info=True)
                self._cache.clear()
                await asyncio.sleep(0.5)
            finally:
                try:
                    await ps.aclose()
                except Exception:  # noqa: BLE001
                    pass

    async def _reset(self) -> None:
        """Clear the cache and re-read whether keys exist. Raises the Redis error after marking the
        answer unknown (the follower then retries after a pause)."""
        self._cache.clear()
        try:
            configured = await self.store.ever_configured()
        except (RedisError, OSError):
            self.keys_unknown = True
            raise
        self.have_keys = self.have_keys or configured
        self.keys_unknown = False
        self._mark_closed()

    def _mark_closed(self) -> None:
        """Write ``closed_marker`` once keys exist (best effort: a folder that cannot take it is logged)."""
        if not self.have_keys or self.closed_marker is None or self.closed_marker.exists():
            return
        try:
            self.closed_marker.parent.mkdir(parents=True, exist_ok=True)
            self.closed_marker.write_text("API keys exist for this runtime: a start that finds none in Redis "
                                          "stays closed (delete this file to run open)\n")
        except OSError as e:
            log.warning("could not record that API keys exist in %s: %s", self.closed_marker, e)

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The caller of a request with ``headers``. Raises ``Unauthorized`` (401, ``WWW-Authenticate``
        semantics: missing, unknown, revoked or expired credentials) or ``Forbidden`` (403)."""
        if not self.enabled:
            return ANONYMOUS
        h = headers.get("authorization") or ""
        if not h[:7].lower() == "bearer ":
            if self.keys_unknown and not (self.have_keys or self.jwt is not None or self.shared_token):
                raise DirectoryUnavailable("cannot tell whether this API needs a bearer token: its Redis did not "
                                           "answer (API keys live there); retry when it is back")
            raise Unauthorized("this API needs a bearer token (Authorization: Bearer <API key or JWT>); once API "
                               "keys have been used with its Redis it never falls back open, even with every "
                               "key revoked: `substrate keys create TENANT` makes one", code="unauthorized")
        token = h[7:].strip()
        if self.shared_token and hmac.compare_digest(token, self.shared_token):
            return Principal(tenant="default", subject="shared-token", admin=True, via="shared_token")
        if token.startswith("sk_"):
            return await self._api_key(token)
        if self.jwt is not None and token.count(".") == 2:
            return await self.jwt.verify(token)
        raise Unauthorized("unknown or revoked credentials", code="unauthorized")

    async def _api_key(self, key: str) -> Principal:
        digest = hash_key(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is None or hit[1] < now:
            try:
                rec = await self.store.lookup(digest)
            except (RedisError, OSError) as e:
                raise DirectoryUnavailable(f"cannot check the API key: {public_detail(e)}") from e
            p = Principal(rec.tenant, f"apikey:{rec.id}", rec.admin, "api_key") if rec else None
            if len(self._cache) > 100_000:
                self._cache.clear()
            hit = self._cache[digest] = (p, now + self.settings.auth.key_cache_ttl_s)
        if hit[0] is None:
            raise Unauthorized("unknown or revoked API key", code="unauthorized")
        return hit[0]
