"""Quotas per tenant and per task class (ActorTemplate), checked and taken in one atomic Redis step.

Bookkeeping is by membership, not by counters, so every release is idempotent and a repair scan can
rebuild it from the session records: per tenant (all keys share the hash tag ``{t:<tenant>}``, so the
Lua script touches one Redis Cluster slot)

* ``running`` set of session IDs holding a live activation (STARTING/RUNNING/RESUMING/SUSPENDING);
  suspended sessions hold none,
* ``total`` set of session IDs that exist,
* ``gpus`` hash session ID -> GPUs its live activation holds (``spec.resources.gpus``),
* ``creates`` sorted set of create times (a sliding one-minute window),

and the same four per (tenant, template) for the template's ``spec.quota``. ``acquire`` is one Lua
script: it checks every configured limit and takes what the call needs only if all pass, so 100
concurrent creates through any number of routers never exceed a limit (no read-then-write). Taking is
idempotent (a session already counted is not counted twice), so a retried wake cannot leak quota.

Releases happen where a session stops holding: suspend, crash recovery, deadline rollback, failed
create or resume, delete. ``reconcile`` (run by the state manager's repair pass) drops members whose
session no longer holds, so a crash between a transition and its release leaks quota for one repair
period at most.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from substrate.errors import DirectoryUnavailable, TooManyRequests
from substrate.keys import Keys
from substrate.models import ActorTemplate, QuotaLimits, SessionRecord, SessionState
from substrate.settings import QuotaSettings

#: states in which a session holds running quota (and its GPUs)
HOLDING = frozenset({SessionState.STARTING, SessionState.RUNNING, SessionState.RESUMING,
                     SessionState.SUSPENDING, SessionState.PENDING})

_LIMIT_CODES = {"maxRunning": "quota_max_running", "maxTotal": "quota_max_total",
                "maxGpus": "quota_max_gpus", "maxCreatesPerMinute": "quota_max_creates_per_minute"}

# KEYS: tenant running, total, gpus, creates, then template running, total, gpus, creates (one hash tag).
# ARGV[1] JSON {sid, now, gpus, create, run, limits: [tenant limits, template limits]}
# -> {0} taken | {1, limit name, scope index (1 tenant, 2 template), retry-after seconds}
_ACQUIRE = """
local a = cjson.decode(ARGV[1])
local sid, now, gpus = a['sid'], tonumber(a['now']), tonumber(a['gpus'])
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
return {0}
"""


T = TypeVar("T")


def translated(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Redis errors become ``DirectoryUnavailable`` (503), as in the directory."""
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as e:
            raise DirectoryUnavailable(f"session directory (Redis) unavailable: {e}") from e
    return wrapper


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
        #: members found stale by the previous reconcile pass (dropped only if still stale now)
        self._suspects: set[tuple[str, str]] = set()

    def limits_of(self, tenant: str) -> QuotaLimits:
        return self.settings.tenants.get(tenant, self.settings.default)

    def _keys(self, tenant: str, template: str) -> list[str]:
        k = self.keys.quota
        return [k(tenant, "running"), k(tenant, "total"), k(tenant, "gpus"), k(tenant, "creates"),
                k(tenant, f"running:{template}"), k(tenant, f"total:{template}"), k(tenant, f"gpus:{template}"),
                k(tenant, f"creates:{template}")]

    @translated
    async def acquire(self, tenant: str, template: ActorTemplate, sid: str, *, create: bool) -> None:
        """Take a running place (and GPUs) for ``sid``, and with ``create`` a total place and a create in
        the rate window, if every limit allows; else raise ``TooManyRequests`` and take nothing."""
        t_lim = self.limits_of(tenant).model_dump(exclude_none=True)
        c_lim = template.spec.quota.model_dump(exclude_none=True) if template.spec.quota else {}
        # with no limit configured the membership is still kept: usage stays visible and a limit added
        # later starts from the truth
        args = {"sid": sid, "now": repr(time.time()), "gpus": template.spec.resources.gpus,
                "create": create, "run": True, "limits": [t_lim or {"none": 0}, c_lim or {"none": 0}]}
        res = await self._acquire(keys=self._keys(tenant, template.name), args=[json.dumps(args)])
        if int(res[0]) == 0:
            return
        name, scope, retry = str(res[1]), int(res[2]), float(res[3] or 0)
        lim = (t_lim if scope == 1 else c_lim).get(name)
        where = f"tenant {tenant!r}" if scope == 1 else f"tenant {tenant!r} for ActorTemplate {template.name!r}"
        raise TooManyRequests(
            f"{name} quota of {where} is {lim}; " + (
                "suspended sessions hold none" if name == "maxRunning" else "retry later"),
            code=_LIMIT_CODES[name], retry_after_s=max(self.retry_after_s, math.ceil(retry)),
            details={"limit": name, "scope": "tenant" if scope == 1 else "template", "tenant": tenant,
                     "template": template.name, "max": lim})

    @translated
    async def release(self, tenant: str, template: str, sid: str, *, total: bool = False) -> None:
        """Give back ``sid``'s running place and GPUs (and its total place with ``total``). Idempotent."""
        k = self.keys.quota
        async with self.redis.pipeline(transaction=False) as p:
            for suffix in ("", f":{template}"):
                p.srem(k(tenant, f"running{suffix}"), sid)
                p.hdel(k(tenant, f"gpus{suffix}"), sid)
                if total:
                    p.srem(k(tenant, f"total{suffix}"), sid)
            await p.execute()

    @translated
    async def usage(self, tenant: str) -> Usage:
        k = self.keys.quota
        async with self.redis.pipeline(transaction=False) as p:
            p.scard(k(tenant, "running"))
            p.scard(k(tenant, "total"))
            p.hvals(k(tenant, "gpus"))
            running, total, gpus = await p.execute()
        return Usage(int(running), int(total), sum(int(g) for g in gpus))

    async def reconcile(self, records: dict[str, SessionRecord]) -> int:
        """Drop members whose session no longer holds (``records``: every existing session by ID).

        Two-phase, like the slot repair: quota is taken one step before the record is written (create)
        or moves (wake), so a member is dropped only if it was already stale at the previous pass.
        Returns how many members were dropped."""
        dropped = 0
        suspects: set[tuple[str, str]] = set()
        pattern = f"{self.keys.prefix}:{{t:*}}:quota:*"
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            kind = key.rsplit(":quota:", 1)[1].split(":", 1)[0]
            if kind == "creates":
                continue
            members = await (self.redis.hkeys(key) if kind == "gpus" else self.redis.smembers(key))
            stale = []
            for sid in members:
                rec = records.get(sid)
                if rec is None or (kind != "total" and rec.state not in HOLDING):
                    suspects.add((key, sid))
                    if (key, sid) in self._suspects:
                        stale.append(sid)
            if stale:
                dropped += len(stale)
                await (self.redis.hdel(key, *stale) if kind == "gpus" else self.redis.srem(key, *stale))
        self._suspects = suspects
        return dropped
