"""Quotas per tenant and per task class (ActorTemplate), checked and taken in one atomic Redis step.

Bookkeeping is by membership, not by counters, so every release is idempotent and a repair scan can
rebuild it from the session records: per tenant (all keys share the hash tag ``{t:<tenant>}``, so the
Lua script touches one Redis Cluster slot)

* ``running`` set of session IDs holding a live activation (STARTING/RUNNING/RESUMING/SUSPENDING);
  suspended sessions hold none,
* ``total`` set of session IDs that exist,
* ``gpus`` hash session ID -> GPUs its live activation holds (``spec.resources.gpus``),
* ``creates`` sorted set of create times (a sliding one-minute window),
* ``owner`` hash session ID -> the activation epoch its running place belongs to (a create's: the epoch
  its record will get, read with its ID check before the record exists; 0 if not given),
* ``inflight`` sorted set session ID -> the time (s since the epoch) until which a create of it may still
  be on its way from taking its places to writing its record (see "Creates in flight" below),

and the same four (not ``owner`` nor ``inflight``) per (tenant, template) for the template's
``spec.quota``. ``acquire`` is one Lua script: it checks every configured limit and takes what the call
needs only if all pass, so 100 concurrent creates through any number of routers never exceed a limit (no
read-then-write). Taking is idempotent (a session already counted is not counted twice), so a retried
wake cannot leak quota.

**Ownership by epoch.** A running place is taken for one activation: a wake takes it right after its
compare-and-set won the activation (the epoch it got is unique to it) and records that epoch as the
place's owner; a release names the epoch of the activation that ended and gives the place back only if
its owner is that epoch or older. A suspend whose release arrives after a concurrent resume re-took the
place for the next activation therefore leaves it alone (fresh-user run: resume/suspend/resume races left
RUNNING sessions outside the set, and a tenant with ``maxRunning`` 2 ran 3). Releases without an epoch
(delete: the session is gone) are unconditional.

Releases happen where a session stops holding: suspend, crash recovery, deadline rollback, failed
create or resume, delete. ``reconcile`` (run by the state manager's repair pass) makes the bookkeeping
agree with the records both ways: it drops members whose session no longer holds and adds live sessions
that are missing, each only when seen so at two passes in a row, so a crash between a transition and its
quota step is repaired within two repair periods.

**Creates in flight.** A create takes its places before it waits for an activation permit and a slot
and writes its record only after (``substrate.activator``), so its places have no record for as long as
those waits last (a minute with the default ``api.start_wait_s``). Two repair passes in that time dropped
them: the created session ran with no total or running place, and creates over the limits got in (a
chaos run: 6 sessions against a tenant's ``maxTotal`` of 4). So a create's take also enters its ID in
``inflight``, in the same script (no round trip more), until the latest time its record can come (the
caller's ``hold_s``: ``Activator.create_hold_s``), and ``reconcile`` suspects no record-less place of an
ID entered there until then. The places of a create that died (its process crashed) are dropped at the
second pass after that time: within ``hold_s`` plus two repair periods. The entry's time is the
creating process's clock and is compared with the repairing one's: hosts' clocks differ by far less
than the slack in ``hold_s``. Each create's take prunes the expired entries; the key expires with its
latest entry.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from substrate.errors import Conflict, DirectoryUnavailable, TooManyRequests, public_detail, script_failure
from substrate.keys import Keys
from substrate.models import ActorTemplate, QuotaLimits, SessionState
from substrate.settings import QuotaSettings

#: states in which a session holds running quota (and its GPUs)
HOLDING = frozenset({SessionState.STARTING, SessionState.RUNNING, SessionState.RESUMING,
                     SessionState.SUSPENDING, SessionState.PENDING})
#: states a session reaches only after its running place was taken: a session in one of them that is
#: missing from the running set lost its place (the repair adds it back). Not RESUMING: a wake takes
#: its place one step after claiming RESUMING (and may be refused), so counting a RESUMING session
#: that has no place yet could let that pending take pass over the limit.
COUNTED = frozenset({SessionState.STARTING, SessionState.RUNNING, SessionState.SUSPENDING})

_LIMIT_CODES = {"maxRunning": "quota_max_running", "maxTotal": "quota_max_total",
                "maxGpus": "quota_max_gpus", "maxCreatesPerMinute": "quota_max_creates_per_minute"}

#: whether waiting alone can make room under each limit, i.e. whether its 429 carries ``Retry-After`` (a
#: client that honours Retry-After polls for ever on one that never clears by itself: a fresh-user finding)
_CLEARS_BY_ITSELF = {
    "maxRunning": True,  # idle sessions are suspended at their template's maxIdleTime and give their place back
    "maxGpus": True,  # GPUs are held by live activations only, which idle suspension ends as for maxRunning
    "maxCreatesPerMinute": True,  # a sliding window: the oldest create leaves it (Retry-After says when)
    "maxTotal": False,  # only a delete makes room: sessions exist until deleted, suspended ones included
}

# KEYS: tenant running, total, gpus, creates, then template running, total, gpus, creates, then the
# tenant's owner hash and inflight sorted set (one hash tag).
# ARGV[1] JSON {sid, now, gpus, create, run, epoch, dry, hold, limits: [tenant limits, template limits]}
# ``dry``: check only, take nothing. The owner of the running place becomes max(owner, epoch). A create
# with ``hold`` > 0 enters sid in inflight until now + hold (s) and prunes the entries expired by now.
# -> {0} taken (or would be) | {1, limit name, scope index (1 tenant, 2 template), retry-after seconds}
#    | {2} a create of an ID that already holds a total place (another create of it is under way, or
#    the session exists): nothing taken
_ACQUIRE = """
local a = cjson.decode(ARGV[1])
local sid, now, gpus = a['sid'], tonumber(a['now']), tonumber(a['gpus'])
if a['create'] and redis.call('SISMEMBER', KEYS[2], sid) == 1 then return {2} end
for scope = 1, 2 do
  local lim = a['limits'][scope]
  local base = (scope - 1) * 4
  local run_k, tot_k, gpu_k, cr_k = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  if a['create'] then
    if lim['maxTotal'] and redis.call('SISMEMBER', tot_k, sid) == 0
       and redis.call('SCARD', tot_k) >= tonumber(lim['maxTotal']) then
      return {1, 'maxTotal', scope, 0}
    end
    if lim['maxCreatesPerMinute'] then
      redis.call('ZREMRANGEBYSCORE', cr_k, '-inf', now - 60)
      if redis.call('ZCARD', cr_k) >= tonumber(lim['maxCreatesPerMinute']) then
        local oldest = redis.call('ZRANGE', cr_k, 0, 0, 'WITHSCORES')
        -- a limit of 0 has an empty window: no oldest create, and no wait makes room
        if oldest[2] == nil then return {1, 'maxCreatesPerMinute', scope, 0} end
        return {1, 'maxCreatesPerMinute', scope, tostring(tonumber(oldest[2]) + 60 - now)}
      end
    end
  end
  if a['run'] and redis.call('SISMEMBER', run_k, sid) == 0 then
    if lim['maxRunning'] and redis.call('SCARD', run_k) >= tonumber(lim['maxRunning']) then
      return {1, 'maxRunning', scope, 0}
    end
    if lim['maxGpus'] and gpus > 0 then
      local held = 0
      for _, v in ipairs(redis.call('HVALS', gpu_k)) do held = held + tonumber(v) end
      if held + gpus > tonumber(lim['maxGpus']) then return {1, 'maxGpus', scope, 0} end
    end
  end
end
if a['dry'] then return {0} end
for scope = 1, 2 do
  local base = (scope - 1) * 4
  if a['create'] then
    redis.call('SADD', KEYS[base + 2], sid)
    redis.call('ZADD', KEYS[base + 4], now, sid .. ':' .. tostring(now))
    redis.call('EXPIRE', KEYS[base + 4], 120)
  end
  if a['run'] then
    redis.call('SADD', KEYS[base + 1], sid)
    if gpus > 0 then redis.call('HSET', KEYS[base + 3], sid, gpus) end
  end
end
if a['run'] then
  local owner = tonumber(redis.call('HGET', KEYS[9], sid) or '-1') or -1
  if tonumber(a['epoch']) > owner then redis.call('HSET', KEYS[9], sid, a['epoch']) end
end
local hold = tonumber(a['hold'])
if a['create'] and hold > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now)
  redis.call('ZADD', KEYS[10], now + hold, sid)
  -- the key lives as long as its latest entry (never shortened by a caller with a shorter hold)
  if redis.call('TTL', KEYS[10]) < hold then redis.call('EXPIRE', KEYS[10], math.ceil(hold) + 1) end
end
return {0}
"""

# KEYS: tenant running, gpus, total, template running, gpus, total, tenant owner hash (one hash tag).
# ARGV[1] sid, ARGV[2] epoch of the activation that ended ('' = unconditional), ARGV[3] '1' = total too.
# The running place (and GPUs) go only if its owner is that epoch or older (or has none recorded):
# a newer owner is a later activation's. -> 1 released | 0 kept (a newer owner)
_RELEASE = """
local sid = ARGV[1]
if ARGV[2] ~= '' then
  local owner = tonumber(redis.call('HGET', KEYS[7], sid) or '-1') or -1
  if owner > tonumber(ARGV[2]) then
    if ARGV[3] == '1' then redis.call('SREM', KEYS[3], sid); redis.call('SREM', KEYS[6], sid) end
    return 0
  end
end
redis.call('SREM', KEYS[1], sid); redis.call('HDEL', KEYS[2], sid)
redis.call('SREM', KEYS[4], sid); redis.call('HDEL', KEYS[5], sid)
redis.call('HDEL', KEYS[7], sid)
if ARGV[3] == '1' then redis.call('SREM', KEYS[3], sid); redis.call('SREM', KEYS[6], sid) end
return 1
"""

# Reconcile steps, per session. KEYS as for _RELEASE (running, gpus, total, template running, gpus, total,
# owner), then the tenant's inflight sorted set. ARGV[1] JSON {sid, op, epoch, gpus, now}:
# op 'drop': give back the running place only if its owner is ``epoch`` or older (the record's epoch when
#   it was read: a wake that took the place since has a newer one); with ``epoch`` null (no record) also
#   the total place, unless a create of sid is in flight after ``now`` (one that took the places since
#   the pass read them);
# op 'add': take the running place (and GPUs) of a live session missing it, owner max(owner, epoch); no
#   limit check: the session runs, and counting it is what keeps later creates within the limit;
# op 'add_total': the total place of an existing session missing it (the same reasoning for maxTotal).
# -> 1 changed | 0 not
_RECONCILE = """
local a = cjson.decode(ARGV[1])
local sid = a['sid']
local owner = tonumber(redis.call('HGET', KEYS[7], sid) or '-1') or -1
if a['op'] == 'drop' then
  if a['epoch'] == cjson.null or a['epoch'] == nil then
    local until_s = tonumber(redis.call('ZSCORE', KEYS[8], sid) or '-1')
    if until_s > tonumber(a['now']) then return 0 end
    redis.call('SREM', KEYS[3], sid); redis.call('SREM', KEYS[6], sid)
  elseif owner > tonumber(a['epoch']) then
    return 0
  end
  local n = redis.call('SREM', KEYS[1], sid) + redis.call('SREM', KEYS[4], sid)
    + redis.call('HDEL', KEYS[2], sid) + redis.call('HDEL', KEYS[5], sid) + redis.call('HDEL', KEYS[7], sid)
  if n > 0 then return 1 end
  return 0
end
if a['op'] == 'add_total' then
  if redis.call('SADD', KEYS[3], sid) + redis.call('SADD', KEYS[6], sid) > 0 then return 1 end
  return 0
end
local n = redis.call('SADD', KEYS[1], sid) + redis.call('SADD', KEYS[4], sid)
if tonumber(a['gpus']) > 0 then
  redis.call('HSET', KEYS[2], sid, a['gpus']); redis.call('HSET', KEYS[5], sid, a['gpus'])
end
if tonumber(a['epoch']) > owner then redis.call('HSET', KEYS[7], sid, a['epoch']) end
if n > 0 then return 1 end
return 0
"""


T = TypeVar("T")


def translated(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Redis errors become ``DirectoryUnavailable`` (503), as in the directory."""
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as e:
            if (bug := script_failure(e)) is not None:
                raise bug from e
            raise DirectoryUnavailable(f"session directory (Redis) unavailable: {public_detail(e)}") from e
    return wrapper


class HeldRecord(Protocol):
    """What :meth:`Quotas.reconcile` reads of a session: a ``SessionRecord`` or the directory's
    ``SessionSummary`` (the repair pass reads only those)."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> SessionState: ...
    @property
    def tenant(self) -> str: ...
    @property
    def actorTemplate(self) -> str: ...  # noqa: N802 - the record's field name
    @property
    def epoch(self) -> int: ...


@dataclass(frozen=True)
class Usage:
    running: int
    total: int
    gpus: int


class Quotas:
    """Acquire/release/reconcile quota for sessions. Raises ``TooManyRequests`` (429) naming the limit."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: QuotaSettings, *,
                 retry_after_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.retry_after_s = retry_after_s
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)
        self._reconcile = redis.register_script(_RECONCILE)
        #: what the previous reconcile pass found wrong: ("drop", tenant, sid, epoch) of members whose
        #: session did not hold, ("add", tenant, sid, epoch) of live sessions missing (acted on only if
        #: found so again now)
        self._suspects: set[tuple[str, str, str, int | None]] = set()

    def limits_of(self, tenant: str) -> QuotaLimits:
        return self.settings.tenants.get(tenant, self.settings.default)

    def _keys(self, tenant: str, template: str) -> list[str]:
        k = self.keys.quota
        return [k(tenant, "running"), k(tenant, "total"), k(tenant, "gpus"), k(tenant, "creates"),
                k(tenant, f"running:{template}"), k(tenant, f"total:{template}"), k(tenant, f"gpus:{template}"),
                k(tenant, f"creates:{template}"), k(tenant, "owner"), k(tenant, "inflight")]

    def _release_keys(self, tenant: str, template: str) -> list[str]:
        k = self.keys.quota
        return [k(tenant, "running"), k(tenant, "gpus"), k(tenant, "total"),
                k(tenant, f"running:{template}"), k(tenant, f"gpus:{template}"), k(tenant, f"total:{template}"),
                k(tenant, "owner")]

    @translated
    async def acquire(self, tenant: str, template: ActorTemplate, sid: str, *, create: bool,
                      epoch: int = 0, dry: bool = False, hold_s: float = 0.0) -> None:
        """Take a running place (and GPUs) for activation ``epoch`` of ``sid`` (a create: the epoch its
        record will get, ``Directory.create_epoch``), and with ``create`` a total place and a create in the rate window, if every
        limit allows; else raise ``TooManyRequests`` (429, code ``quota_*``) and take nothing.

        ``hold_s`` (with ``create``): the longest the create can take from this call to writing its
        record; until then :meth:`reconcile` keeps its places though they have no record (module
        docstring, "Creates in flight"). 0: not kept (places taken by hand, as the tests and benches do).

        A place already held by ``sid`` is not counted again; its owner becomes ``epoch`` if that is newer
        (see the module docstring). A ``create`` of an ``sid`` that already holds a total place (a
        concurrent create of the same ID, or an existing session) raises ``Conflict`` (409
        ``session_exists``) and takes nothing: two creates of one ID used to share one set of places,
        and the loser's failure gave back the winner's. ``dry``: only check (raises the same way, takes nothing): a wake asks
        before it claims a slot, so a refused one makes nobody room, and takes after it won the claim."""
        t_lim = self.limits_of(tenant).model_dump(exclude_none=True)
        c_lim = template.spec.quota.model_dump(exclude_none=True) if template.spec.quota else {}
        # with no limit configured the membership is still kept: usage stays visible and a limit added
        # later starts from the truth
        args = {"sid": sid, "now": repr(time.time()), "gpus": template.spec.resources.gpus,
                "create": create, "run": True, "epoch": int(epoch), "dry": dry, "hold": float(hold_s),
                "limits": [t_lim or {"none": 0}, c_lim or {"none": 0}]}
        res = await self._acquire(keys=self._keys(tenant, template.name), args=[json.dumps(args)])
        if int(res[0]) == 0:
            return
        if int(res[0]) == 2:
            # the places belong to the other create (or the session): taking nothing here means this
            # create's failure cannot give them back
            raise Conflict(f"session {sid!r} already exists (or is being created)", code="session_exists",
                           details={"session": sid})
        name, scope, retry = str(res[1]), int(res[2]), float(res[3] or 0)
        lim = (t_lim if scope == 1 else c_lim).get(name)
        where = f"tenant {tenant!r}" if scope == 1 else f"tenant {tenant!r} for ActorTemplate {template.name!r}"
        # what makes room: a retry alone cannot while the limit is 0, or while sessions hold every place
        # (a fresh-user run: a wake answered 429 with Retry-After 1 while the tenant's own idle sessions held
        # every running place until their idle timeout; the quota does not suspend them: say how to)
        hint = {"maxRunning": "suspended sessions hold none: suspend one of this tenant's running sessions "
                              "(POST /v1/sessions/{id}/suspend) to make room" + (
                                  " (none was idle long enough to be suspended for this call)"
                                  if self.settings.suspend_idle_for_running else
                                  "; idle ones are suspended at their template's maxIdleTime"),
                "maxTotal": "delete sessions to make room",
                "maxGpus": "suspended sessions hold none: suspend one of this tenant's running GPU sessions "
                           "to make room"}.get(name, "retry later")
        if lim == 0:
            hint = "this limit admits none"
        err = TooManyRequests(
            f"{name} quota of {where} is {lim}; {hint}",
            code=_LIMIT_CODES[name], retry_after_s=max(self.retry_after_s, math.ceil(retry)),
            details={"limit": name, "scope": "tenant" if scope == 1 else "template", "tenant": tenant,
                     "template": template.name, "max": lim})
        if lim == 0 or not _CLEARS_BY_ITSELF[name]:
            err.retry_after_s = None  # no wait makes room (a fresh-user finding: it said Retry-After: 1)
        raise err

    @translated
    async def release(self, tenant: str, template: str, sid: str, *, epoch: int | None = None,
                      total: bool = False) -> bool:
        """Give back ``sid``'s running place and GPUs held for activation ``epoch`` or an older one (a
        place a later activation took stays); ``epoch`` None: whatever it holds (the session is gone).
        With ``total`` also its total place, always. Idempotent. Returns whether the running place went
        (or was not held); False: a newer activation owns it."""
        res = await self._release(keys=self._release_keys(tenant, template),
                                  args=[sid, "" if epoch is None else int(epoch), "1" if total else "0"])
        return bool(int(res))

    @translated
    async def running(self, tenant: str, template: str | None = None) -> list[str]:
        """The IDs of the sessions holding a running place of ``tenant`` (of its ``template``, if given)."""
        what = "running" if template is None else f"running:{template}"
        return sorted(str(m.decode() if isinstance(m, bytes) else m)
                      for m in await self.redis.smembers(self.keys.quota(tenant, what)))

    @translated
    async def usage(self, tenant: str) -> Usage:
        k = self.keys.quota
        async with self.redis.pipeline(transaction=False) as p:
            p.scard(k(tenant, "running"))
            p.scard(k(tenant, "total"))
            p.hvals(k(tenant, "gpus"))
            running, total, gpus = await p.execute()
        return Usage(int(running), int(total), sum(int(g) for g in gpus))

    @translated
    async def reconcile(self, records: Mapping[str, HeldRecord],
                        gpus_of: Callable[[str], int] | None = None, *, now: float | None = None
                        ) -> tuple[int, int]:
        """Make the bookkeeping agree with ``records`` (every existing session by ID, read just before):
        drop places of sessions that no longer hold one (also a tenant's place under an ID that is another
        tenant's session), add running places of live sessions missing one and total places of existing
        sessions missing one. Places of an ID with no record (of this tenant) whose create is still in
        flight (entered in ``inflight`` until after ``now``, s since the epoch, default the clock's) stay.
        ``gpus_of``: template name -> GPUs its activations hold (for an added place; default 0).

        Two-phase, like the slot repair: something is changed only if it was found the same way (same
        session, same record epoch) at the previous pass, as a wake takes its place one step after its
        claim (a create takes its places long before its record is written: they are kept by
        ``inflight`` instead, see the module docstring). A drop is also guarded by the epoch
        the record had (a wake that took the place since owns a newer epoch and keeps it). An add checks
        no limit: the session runs, and counting it is what keeps later creates within the limits.
        Returns ``(dropped, added)``."""
        now = time.time() if now is None else now
        found: set[tuple[str, str, str, int | None]] = set()
        in_flight: dict[str, set[str]] = {}  # tenant -> IDs of its creates in flight (read once a pass)
        template_of: dict[tuple[str, str], str] = {}
        members: dict[str, set[str]] = {}  # tenant -> session IDs in its running set
        totals: dict[str, set[str]] = {}  # tenant -> session IDs in its total set
        pattern = f"{self.keys.prefix}:{{t:*}}:quota:*"
        # SCAN walks the whole keyspace whatever the pattern (sessions, snapshots, other deployments'
        # keys): 10,000 keys a call (a few ms of Redis each) keeps that to a round trip per 10,000 keys
        # (at 1,000, a burst's repair made 0.56 round trips per create: docs/bench/2026-12-06-creation-round-trips-ab.md)
        async for key in self.redis.scan_iter(match=pattern, count=10_000):
            tag, _, what = key[len(self.keys.prefix) + 1:].partition("}:quota:")
            tenant = tag[len("{t:"):]
            kind, _, template = what.partition(":")
            if kind in ("creates", "inflight"):
                continue
            ids = await (self.redis.hkeys(key) if kind in ("gpus", "owner") else self.redis.smembers(key))
            if kind == "running" and not template:
                members.setdefault(tenant, set()).update(ids)
            if kind == "total" and not template:
                totals.setdefault(tenant, set()).update(ids)
            for sid in ids:
                rec = records.get(sid)
                if rec is None or rec.tenant != tenant:  # gone, or the ID is another tenant's session now
                    if tenant not in in_flight:
                        in_flight[tenant] = set(await self.redis.zrangebyscore(
                            self.keys.quota(tenant, "inflight"), f"({now!r}", "+inf"))
                    if sid in in_flight[tenant]:  # its create has yet to write its record
                        continue
                    found.add(("drop", tenant, sid, None))
                    if template or (tenant, sid) not in template_of:  # a template's key names it
                        template_of[(tenant, sid)] = template
                elif kind != "total" and rec.state not in HOLDING:
                    found.add(("drop", tenant, sid, rec.epoch))
        for rec in records.values():
            if rec.state in COUNTED and rec.id not in members.get(rec.tenant, ()):
                found.add(("add", rec.tenant, rec.id, rec.epoch))
            if rec.id not in totals.get(rec.tenant, ()):
                found.add(("add_total", rec.tenant, rec.id, rec.epoch))
        dropped = added = 0
        for op, tenant, sid, epoch in found & self._suspects:
            rec = records.get(sid)
            template = rec.actorTemplate if rec is not None and rec.tenant == tenant else \
                template_of.get((tenant, sid), "")
            gpus = gpus_of(template) if (gpus_of is not None and op == "add") else 0
            changed = await self._reconcile(
                keys=[*self._release_keys(tenant, template), self.keys.quota(tenant, "inflight")],
                args=[json.dumps({"sid": sid, "op": op, "epoch": epoch, "gpus": gpus, "now": now})])
            if int(changed):
                dropped += op == "drop"
                added += op in ("add", "add_total")
        self._suspects = found
        return dropped, added
