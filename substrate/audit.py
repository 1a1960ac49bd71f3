"""The audit trail: one append-only record per state-changing call and per automatic transition.

A record says who (``who``: ``apikey:<id>``, a JWT subject, ``anonymous`` or ``system:<component>``),
for which tenant, session and template, what (``action``: ``create``, ``delete``, ``suspend``,
``resume``, ``wake``, ``recover``, ``evict``, ``deadline``; ``reason`` for automatic ones: ``idle``,
``pressure``, ``worker_lost``, ``agent_restarted``, an eviction's refusal code ...), on which worker, with how many GPUs claimed, the result (``ok`` or the error code),
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
import binascii
import contextvars
import logging
import re
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

    async def session_events(self, sid: str, *, after: str | None = None, limit: int = 100,
                             tenant: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """A page of the session ID's records, oldest first; with ``tenant``, only that tenant's records (an ID
        deleted by one tenant may be created again by another: each sees only its own sessions' trail)."""
        return await self._page(self.keys.session_audit(sid), after, limit, tenant)

    async def tenant_events(self, tenant: str, *, after: str | None = None, limit: int = 100
                            ) -> tuple[list[dict[str, Any]], str | None]:
        return await self._page(self.keys.tenant_audit(tenant), after, limit)

    @translated
    async def _page(self, key: str, after: str | None, limit: int, tenant: str | None = None
                    ) -> tuple[list[dict[str, Any]], str | None]:
        """Oldest first; ``after`` is the ``metadata.continue`` of the previous page (exclusive). With
        ``tenant``, records of other tenants are skipped; a continue token is given only when another
        matching record exists, so no page after the first is empty. The per-session stream is capped
        (``audit.session_maxlen``), which bounds the scan."""
        start = "-"
        if after:
            sid = decode_event_cursor(after)
            if sid == _MAX_STREAM_ID:  # nothing comes after it (and Redis refuses it as an exclusive start)
                return [], None
            start = "(" + sid
        if tenant is None:
            rows = await self.redis.xrange(key, min=start, max="+", count=limit + 1)
        else:
            rows, batch = [], max(limit + 1, 200)
            while len(rows) <= limit:
                got = await self.redis.xrange(key, min=start, max="+", count=batch)
                rows += [(rid, f) for rid, f in got if f.get("tenant") == tenant]
                if len(got) < batch:
                    break
                start = "(" + got[-1][0]
        more = len(rows) > limit
        rows = rows[:limit]
        items = [{"id": rid, **{k: _typed(k, v) for k, v in f.items()}} for rid, f in rows]
        nxt = encode_event_cursor(rows[-1][0]) if more and rows else None
        return items, nxt


#: a Redis stream ID ``<ms>-<seq>``, each part an unsigned 64-bit integer (ASCII digits only: ``int`` alone
#: would take " 1", "+1", "1_0" or "١")
_STREAM_ID_RE = re.compile(r"\A([0-9]{1,20})-([0-9]{1,20})\Z")
_U64_MAX = 2**64 - 1
_MAX_STREAM_ID = f"{_U64_MAX}-{_U64_MAX}"


def encode_event_cursor(stream_id: str) -> str:
    """The ``continue`` token of an events page that ends at ``stream_id`` (URL-safe base64, unpadded)."""
    return base64.urlsafe_b64encode(stream_id.encode()).decode().rstrip("=")


def decode_event_cursor(token: str) -> str:
    """The stream ID in a token made by ``encode_event_cursor``. Raises ``InvalidInput(code=
    "invalid_continue")`` for anything else, including IDs Redis would refuse (a part over 2^64-1): checked
    here, so a forged token is a 422, never a Redis error passed on as 503 ``directory_unavailable``."""
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii") + b"=" * (-len(token) % 4)).decode("ascii")
        m = _STREAM_ID_RE.fullmatch(raw)
        if m is None or any(int(part) > _U64_MAX for part in m.groups()):
            raise ValueError(raw)
        canonical = f"{int(m[1])}-{int(m[2])}"
        if encode_event_cursor(canonical) != token:  # e.g. characters b64decode skips, leading zeros
            raise ValueError(raw)
        return canonical
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidInput("bad continue token: not one this API made", code="invalid_continue") from None


def _typed(k: str, v: str) -> Any:
    if k == "time":
        return float(v)
    if k in ("gpus", "epoch"):
        return int(v) if v else None
    return v
