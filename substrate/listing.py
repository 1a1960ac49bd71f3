"""Keyset pagination of sessions: pages stay consistent when sessions are deleted between them.

The cursor is the (createdAt, session ID) of the last item a page looked at, opaque to clients (URL-safe
base64). The next page starts strictly after it in the index's order (a Redis sorted set: score
``createdAt``, ties broken by member, i.e. by session ID), so deleting any item between two pages can
neither skip a survivor nor repeat one, unlike an offset. Each tenant has its own index (``Keys.
tenant_sessions``), so a tenant's listing costs O(its page), however many sessions other tenants hold;
admins list the global index. Index entries whose record is gone (derived data, see ``keys.py``), and in a
tenant's index those whose record is another tenant's, are skipped and removed on the way: such an entry
is left by a step that removed a record but not its index entry (a deadline's removal of a PENDING record,
a failed removal), and once another tenant made a session of that ID again it would have listed that
session to the first tenant.
"""

from __future__ import annotations

import base64
import math
import re

import redis.asyncio as aioredis

from substrate.directory import decode_session
from substrate.errors import InvalidInput
from substrate.keys import Keys
from substrate.labelselector import Selector
from substrate.models import SESSION_ID_RE, SessionRecord, SessionState
from substrate.quotas import translated


def encode_cursor(created_at: float, sid: str) -> str:
    """The ``continue`` token of a page that ends at (``created_at``, ``sid``): URL-safe base64, unpadded,
    of ``"<repr(created_at)>|<sid>"``."""
    return base64.urlsafe_b64encode(f"{created_at!r}|{sid}".encode()).decode().rstrip("=")


#: what ``repr`` writes for a finite float (ASCII only: ``float`` alone takes " 1", "1_000", "١")
_FLOAT_RE = re.compile(r"\A-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?\Z")


def decode_cursor(token: str) -> tuple[float, str]:
    """Raises ``InvalidInput(code="invalid_continue")`` for anything not made by ``encode_cursor``: exactly
    one ``|``, a plain finite decimal before it, a valid session ID (``SESSION_ID_RE``) after it, and the
    token exactly as ``encode_cursor`` writes it."""
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii") + b"=" * (-len(token) % 4)).decode("ascii")
        if raw.count("|") != 1:
            raise ValueError(raw)
        score, sid = raw.split("|")
        if not _FLOAT_RE.fullmatch(score) or not SESSION_ID_RE.fullmatch(sid):
            raise ValueError(raw)
        value = float(score)
        # the round trip refuses what b64decode skips over and non-canonical numbers ("1.50", "1e0")
        if not math.isfinite(value) or encode_cursor(value, sid) != token:
            raise ValueError(raw)
        return value, sid
    except (ValueError, UnicodeError):
        raise InvalidInput("bad continue token: not one this API made", code="invalid_continue") from None


@translated
async def list_page(redis: aioredis.Redis, keys: Keys, index: str, *, limit: int = 100,
                    cursor: str | None = None, state: SessionState | None = None, template: str | None = None,
                    scan_cap: int = 5000, tenant: str | None = None, selector: Selector | None = None
                    ) -> tuple[list[SessionRecord], str | None]:
    """One page of the sessions in sorted set ``index`` after ``cursor``, filtered by state/template and
    by label ``selector`` (``substrate.labelselector``).
    ``tenant``: ``index`` is that tenant's (``Keys.tenant_sessions``); records of other tenants in it are
    stale entries, skipped and removed (see the module docstring).

    Returns ``(items, next_cursor)``; ``next_cursor`` is None at the end. At most ``scan_cap`` index
    entries are read per call, so a selective filter answers in bounded time (fewer items, and a cursor
    to go on from): a filtered page may hold fewer than ``limit`` items, even none, and still a cursor; only
    a None cursor means the end."""
    after = decode_cursor(cursor) if cursor else None
    items: list[SessionRecord] = []
    scanned = 0
    offset = 0
    batch = max(limit, 100)
    while scanned < scan_cap:
        lo = repr(after[0]) if after else "-inf"
        rows = await redis.zrangebyscore(index, lo, "+inf", start=offset, num=batch, withscores=True)
        if not rows:
            return items, None
        fresh = [(m, s) for m, s in rows if after is None or (s, m) > (after[0], after[1])]
        if not fresh:  # a run of equal scores longer than a batch: step over it
            offset += len(rows)
            continue
        offset = 0
        async with redis.pipeline(transaction=False) as p:
            for m, _ in fresh:
                p.hgetall(keys.session(m))
            raws = await p.execute()
        stale = []
        looked = 0
        for (m, s), raw in zip(fresh, raws):
            after = (s, m)
            scanned += 1
            looked += 1
            if not raw or "actorTemplate" not in raw or raw.get("state") == SessionState.DELETED.value:
                if not raw:
                    stale.append(m)
                continue
            if tenant is not None and raw.get("tenant") != tenant:
                stale.append(m)
                continue
            rec = decode_session(raw)
            if ((state is None or rec.state == state) and (template is None or rec.actorTemplate == template)
                    and (selector is None or selector.matches(rec.labels))):
                items.append(rec)
                if len(items) == limit:
                    break
        if stale:
            await redis.zrem(index, *stale)
        # the index ends within this batch and every entry of it was looked at: no cursor (a page that
        # ended exactly on the last session gave one, and the next request an empty page: fresh-user run)
        if len(rows) < batch and looked == len(fresh):
            return items, None
        if len(items) == limit:
            break
    assert after is not None
    return items, encode_cursor(after[0], after[1])
