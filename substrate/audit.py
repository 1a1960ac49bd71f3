"""The audit trail: one append-only record per state-changing call and per automatic transition.

A record says who (``who``: ``apikey:<id>``, a JWT subject, ``anonymous`` or ``system:<component>``),
for which tenant, session and template, what (``action``: ``create``, ``delete``, ``suspend``,
``resume``, ``wake``, ``recover``, ``deadline``; ``reason`` for automatic ones: ``idle``, ``pressure``,
``worker_lost`` ...), on which worker, with how many GPUs claimed, the result (``ok`` or the error code),
the request ID and the time. It is written with one pipelined round trip to two capped Redis streams
(``XADD ... MAXLEN ~``): the session's (``GET /v1/sessions/{id}/events``) and the tenant's
(``GET /v1/events``), and mirrored to the JSON log (logger ``substrate.audit``). A deleted session's
stream expires after ``deleted_retention_s``; the tenant stream keeps its records until trimmed.

If Redis refuses the write the record still reaches the log and the operation goes on (an audit write
never turns a done operation into an error); ``substrate_audit_write_errors`` counts such losses.

Who is calling travels with the request in a context variable (``actor``): the API sets it after
authentication, tasks started from the request inherit it, and control loops run as ``system:...``.
"""

from __future__ import annotations

import base64
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from substrate.errors import InvalidInput
from substrate.keys import Keys
from substrate.quotas import translated
from substrate.settings import AuditSettings

log = logging.getLogger("substrate.audit")


@dataclass(frozen=True)
class Actor:
    """Who causes what happens in this context."""

    who: str
    tenant: str = ""
    request_id: str = ""


SYSTEM = Actor("system:control-plane")
actor: contextvars.ContextVar[Actor] = contextvars.ContextVar("substrate_actor", default=SYSTEM)

FIELDS = ("time", "action", "reason", "who", "tenant", "session", "template", "worker", "gpus", "epoch",
          "result", "requestId")


class AuditLog:
    """Writes and reads audit records (see the module docstring)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: AuditSettings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.write_errors = 0

    async def record(self, action: str, *, session: str, tenant: str, template: str = "",
                     worker: str | None = None, gpus: int = 0, epoch: int | None = None, result: str = "ok",
                     reason: str = "", who: Actor | None = None) -> dict[str, str]:
        """Append one record; returns it. Never raises for a storage failure (see module docstring)."""
        a = who or actor.get()
        rec = {"time": repr(time.time()), "action": action, "reason": reason, "who": a.who,
               "tenant": tenant, "session": session, "template": template, "worker": worker or "",
               "gpus": str(gpus), "epoch": "" if epoch is None else str(epoch), "result": result,
               "requestId": a.request_id}
        log.info("audit", extra={"audit": rec})
        try:
            async with self.redis.pipeline(transaction=False) as p:
                p.xadd(self.keys.session_audit(session), rec, maxlen=self.settings.max_per_session,
                       approximate=True)
                p.xadd(self.keys.tenant_audit(tenant), rec, maxlen=self.settings.max_per_tenant,
                       approximate=True)
                if action == "delete" and result == "ok":
                    p.expire(self.keys.session_audit(session), int(self.settings.deleted_retention_s))
                await p.execute()
        except (RedisError, OSError):
            self.write_errors += 1
            log.warning("audit record not stored (kept in this log only)", extra={"audit": rec}, exc_info=True)
        return rec

    async def session_events(self, sid: str, *, after: str | None = None, limit: int = 100
                             ) -> tuple[list[dict[str, Any]], str | None]:
        return await self._page(self.keys.session_audit(sid), after, limit)

    async def tenant_events(self, tenant: str, *, after: str | None = None, limit: int = 100
                            ) -> tuple[list[dict[str, Any]], str | None]:
        return await self._page(self.keys.tenant_audit(tenant), after, limit)

    @translated
    async def session_tenant(self, sid: str) -> str | None:
        """The tenant of a session's records (for a deleted session whose record is gone), or None."""
        first = await self.redis.xrange(self.keys.session_audit(sid), count=1)
        return first[0][1].get("tenant") if first else None

    @translated
    async def _page(self, key: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
        """Oldest first; ``after`` is the ``metadata.continue`` of the previous page (exclusive)."""
        start = "-"
        if after:
            try:
                sid = base64.urlsafe_b64decode(after.encode() + b"==").decode()
                ms, seq = sid.split("-")
                int(ms), int(seq)
            except (ValueError, UnicodeDecodeError):
                raise InvalidInput("bad continue token", code="invalid_continue") from None
            start = "(" + sid
        rows = await self.redis.xrange(key, min=start, max="+", count=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        items = [{"id": rid, **{k: _typed(k, v) for k, v in f.items()}} for rid, f in rows]
        nxt = base64.urlsafe_b64encode(rows[-1][0].encode()).decode().rstrip("=") if more and rows else None
        return items, nxt


def _typed(k: str, v: str) -> Any:
    if k == "time":
        return float(v)
    if k in ("gpus", "epoch"):
        return int(v) if v else None
    return v
