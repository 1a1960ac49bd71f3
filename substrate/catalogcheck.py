"""Every control-plane process of one deployment serves the same WorkerPools and ActorTemplates.

Processes of one deployment share its Redis and ``SUBSTRATE_REDIS__KEY_PREFIX``, and each loads its
pools and templates from its own config folder. Two such processes started with different folders
served the same sessions differently without a word: each refused the other's templates, and a session
created by one (its record naming pool ``default``) was woken by the other on a worker of its pool
``small`` (fresh-user run 35). Now each process publishes a fingerprint of what it serves (a digest of
each pool's and template's spec, by name) in ``Keys.catalogs`` every ``PUBLISH_S`` seconds, and logs one
warning per differing fingerprint it finds among the other live processes' (published within
``FRESH_S``), naming the pools and templates that differ. A rolling change of the config is such a
difference for a while: a warning, never a refusal. A process withdraws its entry when it stops; a
killed one's entry goes stale and is removed by the next reader. Processes whose catalog comes from
Kubernetes (one API server for all) do not take part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from substrate.keys import Keys
from substrate.specs import Catalog

log = logging.getLogger(__name__)

#: seconds between two publications of a process's fingerprint (and checks of the others')
PUBLISH_S = 60.0
#: a fingerprint published longer ago than this is a dead process's (s): removed, not compared
FRESH_S = 3 * PUBLISH_S + 10.0


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(catalog: Catalog) -> dict[str, Any]:
    """``{"digest": str, "pools": {name: spec digest}, "templates": {name: spec digest}}`` of ``catalog``.
    A pool's ``replicas`` is left out: an autoscaler sets it, so it may differ without a config change."""
    pools = {name: _digest(p.spec.model_dump(mode="json", exclude={"replicas"})) for name, p in catalog.pools.items()}
    templates = {name: _digest(t.spec.model_dump(mode="json")) for name, t in catalog.templates.items()}
    return {"digest": _digest([pools, templates]), "pools": pools, "templates": templates}


def describe(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """What differs between two fingerprints, e.g. ``pools only there: small; only here: default;
    templates that differ: counter``."""
    parts = []
    for kind in ("pools", "templates"):
        a, b = ours.get(kind) or {}, theirs.get(kind) or {}
        if only := sorted(set(b) - set(a)):
            parts.append(f"{kind} only there: {', '.join(only)}")
        if only := sorted(set(a) - set(b)):
            parts.append(f"{kind} only here: {', '.join(only)}")
        if changed := sorted(n for n in set(a) & set(b) if a[n] != b[n]):
            parts.append(f"{kind} that differ: {', '.join(changed)}")
    return "; ".join(parts) or "the same names, other specs"


class CatalogCheck:
    """Publishes this process's fingerprint and warns of other live processes' that differ (see the
    module docstring). ``check()`` is the periodic step (never raises but Redis errors, which the
    caller's loop logs); ``withdraw()`` at stop."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, catalog: Catalog) -> None:
        self.redis, self.keys = redis, keys
        self.ours = fingerprint(catalog)
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: digests already warned of (one warning each)
        self.warned: set[str] = set()

    async def check(self) -> list[str]:
        """Publish ours, compare with the others' live ones; returns the warnings it logged."""
        now = time.time()
        entry = {**self.ours, "at": now, "pid": os.getpid(), "host": socket.gethostname()}
        await self.redis.hset(self.keys.catalogs, self.me, json.dumps(entry))
        said = []
        for field, raw in (await self.redis.hgetall(self.keys.catalogs)).items():
            field = field.decode() if isinstance(field, bytes) else field
            if field == self.me:
                continue
            try:
                other = json.loads(raw)
                at, digest = float(other["at"]), str(other["digest"])
            except (ValueError, KeyError, TypeError):
                await self.redis.hdel(self.keys.catalogs, field)
                continue
            if now - at > FRESH_S:
                await self.redis.hdel(self.keys.catalogs, field)
                continue
            if digest == self.ours["digest"] or digest in self.warned:
                continue
            self.warned.add(digest)
            msg = (f"another control-plane process of this deployment (pid {other.get('pid')} on "
                   f"{other.get('host')}, the same Redis and SUBSTRATE_REDIS__KEY_PREFIX) serves other "
                   f"WorkerPools/ActorTemplates: {describe(self.ours, other)}; sessions resolve their template "
                   "and pool differently on each: give every process of one deployment the same config folder "
                   "(--config / SUBSTRATE_CONFIG_DIR), or another key prefix")
            log.warning(msg)
            said.append(msg)
        return said

    async def withdraw(self) -> None:
        """Remove this process's entry (at stop)."""
        await self.redis.hdel(self.keys.catalogs, self.me)
