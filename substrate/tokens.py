"""Per-activation tokens: what a worker accepts instead of one shared internal secret.

For every call to a worker the control plane (router, state manager, pool controller) presents a short-lived
JWT (RFC 7519, HS256 via PyJWT) in ``Authorization: Bearer``, bound to

* ``sub``  the session ID (``*`` only for the worker-wide listing ``GET /v1/activations``),
* ``ep``   the activation epoch (``null`` only for ``DELETE``, which ends whatever activation is there),
* ``aud``  the worker, by the address it registered (one address per worker process or pod),
* ``ten``  the tenant owning the session (the worker resolves the template's credentials for it),
* ``exp``  expiry (``ttl_s``, default 300 s).

The worker checks signature, expiry, audience, session and epoch on every call: a token of another
session, of another worker, expired, or of a stale epoch is refused (401 / 403 / 409 ``stale_epoch``), so a
leaked token drives one activation of one session for minutes, not the fleet.

Signing keys live in Redis (hash ``auth:signing``: key id -> secret, ``current`` -> key id) beside the
session directory every component already trusts; with ``worker.internal_token`` set (a Kubernetes
Secret) the key actually used is HMAC-SHA256(internal_token, stored secret), so read access to Redis
alone does not let anyone mint tokens a worker accepts. Rotation (``substrate keys rotate-signing``) adds a key,
makes it current and keeps the previous one and every key that was current within the last minute (or
four refresh periods, if longer): routers sign with the current key after their next refresh
(``refresh_s``), workers accept any key of the ring and reload the ring on an unknown key ID, so rotation
needs no restart and drops no call, also when rotations come faster than routers refresh. A call signed
with a key a later rotation removed is refused once the verifier's cache entry expires (at most ``ttl_s``).

Cost: PyJWT HS256 costs ~40 us to sign and ~100 us to verify here, so the minter reuses a token per
(session, epoch, worker, tenant) until half its lifetime is gone and the verifier caches verified tokens
until their expiry; a hot-path call costs two dict lookups.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jwt
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from substrate.errors import DirectoryUnavailable, Forbidden, StaleEpoch, public_detail, SubstrateError, Unauthorized
from substrate.keys import Keys

log = logging.getLogger(__name__)

ALGORITHM = "HS256"
ISSUER = "substrate-control-plane"
ANY_SESSION = "*"

# KEYS[1] signing hash. ARGV[1] new key id, ARGV[2] secret, ARGV[3] keep_s. Makes the new key current and
# keeps the previous current one and every key that was current within the last keep_s (by Redis' clock):
# a key's time as current ended when the next key was made, and a key ID starts with its making time
# (``k<unix s>-<hex>``). A key ID of another form is kept only as the previous one.
# -> the previous current key id ('' if none).
_ROTATE = """
local prev = redis.call('HGET', KEYS[1], 'current') or ''
local now = tonumber(redis.call('TIME')[1])
local keep_s = tonumber(ARGV[3])
local made = {}
for _, k in ipairs(redis.call('HKEYS', KEYS[1])) do
  if k ~= 'current' then
    local t = tonumber(string.match(k, '^k(%d+)-'))
    if t == nil then t = -1 end
    table.insert(made, {k, t})
  end
end
table.sort(made, function(a, b) return a[2] < b[2] end)
for i, e in ipairs(made) do
  local ended = now  -- the newest key stops being current now
  if i < #made then ended = made[i + 1][2] end
  if e[1] ~= prev and (e[2] < 0 or ended <= now - keep_s) then redis.call('HDEL', KEYS[1], e[1]) end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'current', ARGV[1])
return prev
"""

# KEYS[1] signing hash. ARGV[1] key id, ARGV[2] secret: create the first key if the ring is empty.
_INIT = """
if redis.call('HEXISTS', KEYS[1], 'current') == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'current', ARGV[1])
return 1
"""


class TokenNotForThisCall(Forbidden):
    """A valid token presented for something it is not bound to (another session)."""

    code = "token_not_for_this_call"


def derive_secret(stored: str, pepper: str | None) -> bytes:
    """The HMAC key of a stored signing secret: the secret itself, or HMAC-SHA256(pepper, secret)."""
    if not pepper:
        return stored.encode()
    return hmac.new(pepper.encode(), stored.encode(), hashlib.sha256).digest()


def _new_key() -> tuple[str, str]:
    return f"k{int(time.time())}-{secrets.token_hex(3)}", secrets.token_urlsafe(32)


#: a rotation keeps every key that was current within this many of the ring's refresh periods (and at
#: least a minute): routers sign with the key current at their last refresh (``SigningKeyRing.rotate``)
ROTATION_KEEP_REFRESHES = 4


class SigningKeyRing:
    """The signing keys, read from Redis and refreshed every ``refresh_s`` (and on an unknown key ID).

    ``current`` is the key ID new tokens are signed with; ``secrets`` maps every accepted key ID to its
    secret (bytes). Raises ``DirectoryUnavailable`` when Redis cannot be read at ``load``.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, refresh_s: float = 5.0,
                 pepper: str | None = None) -> None:
        self.redis = redis
        self.pepper = pepper
        self.keys = keys
        self.refresh_s = refresh_s
        self.current = ""
        self.secrets: dict[str, bytes] = {}
        #: the ring as stored (key id -> stored secret), to write it back if Redis loses it (``load``)
        self._stored: dict[str, str] = {}
        self.loaded_at = 0.0
        self._rotate = redis.register_script(_ROTATE)
        self._init = redis.register_script(_INIT)
        self._lock = asyncio.Lock()

    async def load(self, *, create: bool = True) -> None:
        """Read the ring; with ``create`` make the first key if there is none. A ring gone from Redis
        (its data lost: a flush, a restart without persistence) is written back from this one's memory,
        first come first kept (create-if-absent), so every process goes on with the same keys: reading
        it as empty made routers refuse every call 500 ``no_signing_key`` and workers refuse the tokens
        of a key made anew 401 ``invalid_token`` for seconds (a fresh-user run: FLUSHDB under a runtime)."""
        try:
            raw = await self.redis.hgetall(self.keys.signing_keys)
            if not raw.get("current") and (create or self.current in self._stored):
                kid, secret = ((self.current, self._stored[self.current]) if self.current in self._stored
                               else _new_key())
                await self._init(keys=[self.keys.signing_keys], args=[kid, secret])
                raw = await self.redis.hgetall(self.keys.signing_keys)
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(f"cannot read the token signing keys: {public_detail(e)}") from e
        self.current = raw.pop("current", "")
        self._stored = dict(raw)
        self.secrets = {k: derive_secret(v, self.pepper) for k, v in raw.items()}
        self.loaded_at = time.monotonic()

    async def refresh_if_stale(self, min_age_s: float = 0.5) -> bool:
        """Reload if the last load is older than ``min_age_s`` (rate limit for unknown-key reloads)."""
        if time.monotonic() - self.loaded_at < min_age_s:
            return False
        async with self._lock:
            if time.monotonic() - self.loaded_at >= min_age_s:
                await self.load(create=False)
        return True

    @property
    def rotation_keep_s(self) -> float:
        """How long (s) a rotation keeps a key that stopped being current (``rotate``'s default)."""
        return max(60.0, ROTATION_KEEP_REFRESHES * self.refresh_s)

    async def rotate(self, keep_s: float | None = None) -> tuple[str, str]:
        """Add a new current key; keep the previous one and every key that was current within the last
        ``keep_s`` seconds (default ``rotation_keep_s``); drop the
        others. Returns (new, previous) IDs.

        A router signs with the key that was current at its last refresh, up to ``refresh_s`` ago: with
        only the previous key kept, rotations closer together than that dropped the key routers still
        signed with, and good calls got 401 ``invalid_token`` (a fresh-user run: three rotations back to
        back under load, 54 of 1,100 calls)."""
        if keep_s is None:
            keep_s = self.rotation_keep_s
        kid, secret = _new_key()
        prev = await self._rotate(keys=[self.keys.signing_keys], args=[kid, secret, repr(float(keep_s))])
        await self.load(create=False)
        return kid, str(prev or "")


@dataclass(frozen=True)
class ActivationClaims:
    """What a verified token says (see the module docstring)."""

    session: str
    epoch: int | None
    tenant: str
    audience: str
    expires_at: float


def mint_token(secret: bytes, kid: str, *, session: str, epoch: int | None, audience: str, tenant: str = "",
               ttl_s: float = 300.0, now: float | None = None) -> str:
    """Sign one activation token (see the module docstring for the claims)."""
    now = time.time() if now is None else now
    claims: dict[str, Any] = {"iss": ISSUER, "sub": session, "ep": epoch, "aud": audience, "ten": tenant,
                              "iat": int(now), "exp": int(now + ttl_s)}
    return jwt.encode(claims, secret, algorithm=ALGORITHM, headers={"kid": kid})


class TokenMinter:
    """Signs activation tokens with the ring's current key; reuses one per binding for half its life."""

    def __init__(self, ring: SigningKeyRing, *, ttl_s: float = 300.0, max_cached: int = 100_000) -> None:
        self.ring = ring
        self.ttl_s = ttl_s
        self.max_cached = max_cached
        self._cache: dict[tuple[str, int | None, str, str, str], tuple[str, float]] = {}

    def mint(self, *, session: str, epoch: int | None, worker_address: str, tenant: str = "") -> str:
        """A token for one call (or many, for a while) to ``worker_address`` on ``session`` at ``epoch``.

        Raises ``DirectoryUnavailable`` (503, code ``no_signing_key``) before the ring was loaded."""
        kid = self.ring.current
        key = (session, epoch, worker_address, tenant, kid)
        now = time.time()
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        secret = self.ring.secrets.get(kid)
        if secret is None:  # transient: the ring is read at start-up, written back if Redis lost it
            raise DirectoryUnavailable("activation-token signing keys are not loaded (yet); retry",
                                       code="no_signing_key", retry_after_s=1)
        token = mint_token(secret, kid, session=session, epoch=epoch, audience=worker_address, tenant=tenant,
                           ttl_s=self.ttl_s, now=now)
        if len(self._cache) >= self.max_cached:
            self._cache.clear()
        self._cache[key] = (token, now + self.ttl_s / 2)
        return token


class TokenVerifier:
    """Checks activation tokens for one worker (``audience`` = its registered address).

    ``verify`` raises ``Unauthorized`` (401: missing, malformed, bad signature, expired, wrong worker),
    ``Forbidden`` (403: another session's token) or ``StaleEpoch`` (409: the token's epoch is not the
    activation's). Verified tokens are cached until they expire (bounded LRU), so the steady state costs
    dict lookups and comparisons, not HMACs.
    """

    def __init__(self, ring: SigningKeyRing, audience: str = "", *, max_cached: int = 100_000,
                 leeway_s: float = 2.0) -> None:
        self.ring = ring
        self.audience = audience
        self.max_cached = max_cached
        self.leeway_s = leeway_s
        self._cache: OrderedDict[str, ActivationClaims] = OrderedDict()

    async def claims(self, token: str | None) -> ActivationClaims:
        """Verify signature, issuer, audience and expiry of ``token``; returns its claims."""
        if not token:
            raise Unauthorized("missing activation token (Authorization: Bearer ...)", code="missing_token")
        now = time.time()
        c = self._cache.get(token)
        if c is not None:
            if c.expires_at + self.leeway_s < now:
                self._cache.pop(token, None)
                raise Unauthorized("activation token expired", code="token_expired")
            return c
        try:
            kid = jwt.get_unverified_header(token).get("kid", "")
        except jwt.PyJWTError as e:
            raise Unauthorized(f"malformed activation token: {e}", code="invalid_token") from None
        secret = self.ring.secrets.get(kid)
        if secret is None and await self.ring.refresh_if_stale():
            secret = self.ring.secrets.get(kid)
        if secret is None:
            raise Unauthorized(f"activation token signed with unknown key {kid!r}", code="invalid_token")
        try:
            raw = jwt.decode(token, secret, algorithms=[ALGORITHM], audience=self.audience, issuer=ISSUER,
                             leeway=self.leeway_s, options={"require": ["exp", "sub", "aud", "iss"]})
        except jwt.ExpiredSignatureError:
            raise Unauthorized("activation token expired", code="token_expired") from None
        except jwt.InvalidAudienceError:
            raise Unauthorized("activation token is for another worker", code="invalid_token") from None
        except jwt.PyJWTError as e:
            raise Unauthorized(f"invalid activation token: {e}", code="invalid_token") from None
        ep = raw.get("ep")
        c = ActivationClaims(session=str(raw["sub"]), epoch=int(ep) if ep is not None else None,
                             tenant=str(raw.get("ten") or ""), audience=str(raw["aud"]),
                             expires_at=float(raw["exp"]))
        self._cache[token] = c
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return c

    async def verify(self, token: str | None, *, session: str, epoch: int | None,
                     any_epoch: bool = False) -> ActivationClaims:
        """Verify ``token`` for a call on ``session`` whose current activation epoch is ``epoch``
        (``None``: no activation yet, e.g. activate). ``any_epoch`` accepts an epoch-less token (DELETE)."""
        c = await self.claims(token)
        if c.session != session:
            raise TokenNotForThisCall(f"activation token is for session {c.session!r}, not {session!r}")
        if c.epoch is None:
            if not any_epoch:
                raise TokenNotForThisCall("activation token carries no epoch")
        elif epoch is not None and c.epoch != epoch:
            raise StaleEpoch(f"token epoch {c.epoch} is not the current activation epoch {epoch} of {session!r}",
                             details={"epoch": epoch})
        return c


def bearer(headers: Any) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (any mapping with ``get``), or None."""
    h = headers.get("authorization") or headers.get("Authorization")
    if not h or not h[:7].lower() == "bearer ":
        return None
    return h[7:].strip() or None
