"""API keys of the embedded default (and of any deployment without an OIDC issuer), kept in Redis.

A key is ``sk_<id>_<secret>`` (32 random bytes of secret). Only its SHA-256 is stored: the secret is
high-entropy, so a fast hash is enough (a slow password hash protects low-entropy secrets; this one needs
none, and the router checks it on every call). Records: hash ``auth:apikeys`` sha256 hex -> JSON
``{id, tenant, admin, name, createdAt}``; hashes revoked with ``substrate keys revoke`` are remembered in
``auth:revoked`` so a key given by file or env is not re-imported at the next start, and those of keys a
start no longer found in the file or env in ``...:removed`` (listed again, they are imported again). Every change bumps ``auth:version`` and publishes the
new version on the channel of the same name: routers drop their verified-key cache when it arrives, so a
revocation is effective at once in every router (within the pub/sub delivery, well under a millisecond on
loopback; the cache's ``key_cache_ttl_s`` bounds it if a router missed the message while reconnecting).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import yaml
from pydantic import ValidationError

from substrate.errors import InvalidInput, NotFound, clip
from substrate.keys import Keys
from substrate.settings import TENANT_RE, ApiKeySpec, closest, duplicate_api_key, key_name_problem
from substrate.specs import parse_yaml_documents

log = logging.getLogger("substrate.apikeys")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    """SHA-256 hex of an API key (what is stored and compared)."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant(name: str) -> str:
    """Return ``name`` or raise ``InvalidInput(code="invalid_tenant")``."""
    if not TENANT_RE.fullmatch(name):  # not match: "$" would let "team-a\n" through
        raise InvalidInput(f"invalid tenant name {clip(name)}: use 1-63 lower-case letters, digits and '-', starting and ending with a letter or digit",
                           code="invalid_tenant")
    return name


@dataclass(frozen=True)
class ApiKey:
    """One stored key (never the key itself)."""

    id: str
    tenant: str
    admin: bool
    name: str
    createdAt: float
    sha256: str


#: the ``<id>`` of a key ``sk_<id>_<secret>`` (``keys create`` makes 8 hex digits)
_KEY_ID = re.compile(r"sk_([A-Za-z0-9]{1,64})_")


def file_key_id(name: str | None, key: str | None, digest: str) -> str:
    """The ID of a key given by file or env: its ``name``; without one, the ``<id>`` of its
    ``sk_<id>_<secret>`` key, the ID ``keys create`` printed with it (a fresh-user run revoked a file key
    by that ID and got ``api_key_not_found``: it had been ``file-`` and the start of its hash); for a
    ``sha256`` entry, ``file-`` and the first 8 hex digits of the hash."""
    if name:
        return name
    if key and (m := _KEY_ID.match(key)):
        return m.group(1)
    return f"file-{digest[:8]}"


class ApiKeyStore:
    """Create, revoke, list and look up API keys (one Redis round trip each)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    @property
    def revoked_key(self) -> str:
        return f"{self.keys.api_keys}:revoked"

    async def _changed(self) -> int:
        version = int(await self.redis.incr(self.keys.auth_version))
        await self.redis.publish(self.keys.auth_version, str(version))
        return version

    async def create(self, tenant: str, *, admin: bool = False, name: str = "") -> tuple[ApiKey, str]:
        """Make a new key for ``tenant``; returns the record and the key (shown once, never stored). Raises
        ``InvalidInput`` (``invalid_tenant``, ``invalid_key_name``: ``settings.key_name_problem``) before
        anything is written."""
        check_tenant(tenant)
        if (why := key_name_problem(name)) is not None:
            raise InvalidInput(why, code="invalid_key_name")
        kid = secrets.token_hex(4)
        key = f"sk_{kid}_{secrets.token_urlsafe(32)}"
        rec = ApiKey(kid, tenant, admin, name, time.time(), hash_key(key))
        await self._put(rec)
        await self._changed()
        return rec, key

    async def _put(self, rec: ApiKey, *, only_new: bool = False) -> bool:
        body = json.dumps({k: v for k, v in asdict(rec).items() if k != "sha256"})
        if only_new:
            return bool(await self.redis.hsetnx(self.keys.api_keys, rec.sha256, body))
        await self.redis.hset(self.keys.api_keys, rec.sha256, body)
        return True

    @property
    def imported_key(self) -> str:
        return f"{self.keys.api_keys}:imported"

    @property
    def removed_key(self) -> str:
        """The hashes of keys an earlier start imported from file or env and a later start no longer found
        there: gone from the keys, but importable again (they count as configured, see ``ever_configured``)."""
        return f"{self.keys.api_keys}:removed"

    async def import_specs(self, specs: list[ApiKeySpec]) -> int:
        """Make the keys given by file or env the ones that hold: add new ones (skipping ones already
        present) and take out every key an earlier start imported from file or env that is no longer given
        (the file is the source of truth for its keys: a key removed from it stops working at the next
        start, and works again once it is listed again). A key revoked with ``substrate keys revoke``
        stays revoked even if the file still lists it, with a warning naming the entry (such an entry
        was skipped without a word: fresh-user round 10). Keys made with ``substrate keys create`` are
        not touched. Returns how many were added. Raises ``InvalidInput`` for a spec without a usable
        hash or key."""
        added = 0
        given: set[str] = set()
        revoked = set(await self.redis.smembers(self.revoked_key))
        existing = await self.list()
        for i, s in enumerate(specs):
            digest = (s.sha256 or "").lower().removeprefix("sha256:") or (hash_key(s.key) if s.key else "")
            if s.name and (clash := next((r for r in existing if r.id == s.name and r.sha256 != digest), None)):
                # its name is its ID: ``keys revoke NAME`` would then name two keys (it refuses both)
                log.warning("API key entry %d of tenant %r (file or env; entries count from 0) is named %r, the ID "
                            "of another key (tenant "
                            "%r): `substrate keys revoke %s` names both and revokes neither; give it another name",
                            i, s.tenant, s.name, clash.tenant, s.name)
            check_tenant(s.tenant)
            if not _HEX64.match(digest):
                raise InvalidInput(f"API key entry {i} of tenant {s.tenant!r} needs `sha256` (64 hex) or `key`",
                                   code="invalid_api_key_spec")
            given.add(digest)
            if digest in revoked:
                log.warning("API key entry %d (ID %r) of tenant %r (file or env; entries count from 0) was revoked "
                            "with `substrate keys revoke`: it stays revoked; remove it from the file or env, or give "
                            "a new key", i, file_key_id(s.name, s.key, digest), s.tenant)
                continue
            rec = ApiKey(file_key_id(s.name, s.key, digest), s.tenant, s.admin, s.name, time.time(), digest)
            added += await self._put(rec, only_new=True)
        before = set(await self.redis.smembers(self.imported_key))
        gone = before - given
        async with self.redis.pipeline(transaction=False) as p:
            if given:
                p.sadd(self.imported_key, *given)
                p.srem(self.removed_key, *given)
            for digest in gone:  # noted as removed first, as ``revoke`` does: never a moment with no trace
                p.sadd(self.removed_key, digest)
                p.hdel(self.keys.api_keys, digest)
                p.srem(self.imported_key, digest)
            await p.execute()
        if added or gone:
            await self._changed()
        return added

    async def revoke(self, key_or_id: str) -> ApiKey:
        """Revoke by key ID (as ``keys list`` shows it) or by the key itself. Raises ``NotFound``, and
        ``InvalidInput`` for an ID that more than one key has (then none is revoked: revoke by the key or
        its sha256)."""
        recs = await self.list()
        by_id = [r for r in recs if r.id == key_or_id]
        if len(by_id) > 1 and not any(hash_key(key_or_id) == r.sha256 or key_or_id == r.sha256 for r in recs):
            raise InvalidInput(f"{len(by_id)} keys have the ID {clip(key_or_id)} (tenants "
                               f"{', '.join(sorted({r.tenant for r in by_id}))}): nothing was revoked; revoke by "
                               "the key itself or by its sha256, and give the keys distinct names")
        for rec in recs:
            if key_or_id in (rec.id, rec.sha256) or hash_key(key_or_id) == rec.sha256:
                # revoked first: a crash between the two steps leaves a key refused, never re-importable
                async with self.redis.pipeline(transaction=False) as p:
                    p.sadd(self.revoked_key, rec.sha256)
                    p.hdel(self.keys.api_keys, rec.sha256)
                    await p.execute()
                await self._changed()
                return rec
        named = [r.id for r in recs if r.name and r.name == key_or_id]
        # a key's name is a label only, but it is what the user remembers (tester 54: `keys revoke "first
        # key"` answered just "no API key")
        hint = (f" ({clip(key_or_id)} is the name of key{'s' if len(named) > 1 else ''} {', '.join(named)}: "
                "revoke by the ID)") if named else " (revoke by the key's ID, as `substrate keys list` shows it)"
        raise NotFound(f"no API key {clip(key_or_id)}{hint}", code="api_key_not_found")

    async def list(self) -> list[ApiKey]:
        raw = await self.redis.hgetall(self.keys.api_keys)
        return sorted((_decode(h, v) for h, v in raw.items()), key=lambda r: r.createdAt)

    async def lookup(self, digest: str) -> ApiKey | None:
        raw = await self.redis.hget(self.keys.api_keys, digest)
        return _decode(digest, raw) if raw else None

    async def count(self) -> int:
        return int(await self.redis.hlen(self.keys.api_keys))

    async def ever_configured(self) -> bool:
        """Whether any key exists or ever was revoked: revoking the last key must not open the API."""
        async with self.redis.pipeline(transaction=False) as p:
            p.hlen(self.keys.api_keys)
            p.scard(self.revoked_key)
            p.scard(self.removed_key)
            n, revoked, removed = await p.execute()
        return bool(n or revoked or removed)

    async def version(self) -> int:
        return int(await self.redis.get(self.keys.auth_version) or 0)


def _decode(digest: str, raw: str) -> ApiKey:
    d: dict[str, Any] = json.loads(raw)
    return ApiKey(str(d["id"]), str(d["tenant"]), bool(d.get("admin")), str(d.get("name", "")),
                  float(d.get("createdAt", 0.0)), digest)


def load_key_file(path: Path) -> list[ApiKeySpec]:
    """Read a YAML or JSON list of ``{tenant, sha256|key, admin?, name?}``. Raises ``InvalidInput``."""
    try:
        # a key repeated in one entry (``key:`` twice) is refused, not the last one kept: the entry was
        # imported with a key nobody meant (fresh-user round 10)
        docs = parse_yaml_documents(Path(path).read_text())
        if len(docs) > 1:
            raise InvalidInput(f"API key file {path} holds {len(docs)} YAML documents: give one list of keys",
                               code="invalid_api_key_spec")
        data = docs[0] if docs else None
    except OSError as e:
        raise InvalidInput(f"cannot read API key file {path}: {e.strerror or e}", code="invalid_api_key_spec") from e
    except yaml.YAMLError as e:  # one line: the parser's problem and where (its message spans several)
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InvalidInput(f"API key file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}",
                           code="invalid_api_key_spec") from e
    if isinstance(data, dict) and "keys" in data:
        data = data["keys"]
    if data is None:
        # refused rather than read as "no keys": with no other key the API would then be open, and the file
        # was surely meant to close it (a fresh-user run took the refusal for a parse bug, as `keys create
        # --file` appends to an empty file): say what to do
        raise InvalidInput(f"API key file {path} is empty: with no key the API would be open to anyone; add one "
                           f"with `substrate keys create TENANT --file {path}`, or unset "
                           "SUBSTRATE_AUTH__API_KEYS_FILE for open mode", code="invalid_api_key_spec")
    if not isinstance(data, list):
        raise InvalidInput(f"API key file {path} must hold a list of keys", code="invalid_api_key_spec")
    out: list[ApiKeySpec] = []
    for i, x in enumerate(data):
        try:
            out.append(ApiKeySpec.model_validate(x))
        except ValidationError as e:  # one line, the first problem (pydantic's text spans lines, with a link)
            first = e.errors()[0]
            at = ".".join(map(str, first.get("loc", ())))
            msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
            if first.get("type") == "extra_forbidden":
                close = closest(str(first["loc"][-1]), ApiKeySpec.model_fields)
                msg = "not a field of a key" + (f" (did you mean {close!r}?)" if close else
                                                f" (its fields: {', '.join(ApiKeySpec.model_fields)})")
            raise InvalidInput(f"API key file {path}: entry {i}{' ' + at if at else ''}: {msg}",
                               code="invalid_api_key_spec") from e
    if why := duplicate_api_key(out, [f"entry {i}" for i in range(len(out))]):
        raise InvalidInput(f"API key file {path}: {why}", code="invalid_api_key_spec")
    return out


__all__ = ["ApiKey", "ApiKeyStore", "hash_key", "check_tenant", "load_key_file", "TENANT_RE", "NotFound"]
