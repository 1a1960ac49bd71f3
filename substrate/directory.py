"""The session directory: session records, the worker registry and slot tables, in Redis.

Protocol (DESIGN invariant 1, single activation):
* Every state change of a session is one compare-and-set Lua script on the session's hash (``_CAS``):
  it checks the expected states, epoch and worker, optionally bumps the activation epoch, and writes.
  Claiming an activation (``STARTING``/``RESUMING``) bumps the epoch, so exactly one claimant wins and
  the epoch it got is the fencing token workers check on every call.
* A worker slot is claimed by one Lua script on that worker's slot table (``_CLAIM_SLOT``), which also
  checks the worker is READY. Slot and session live in different hash slots (Redis Cluster), so claiming
  a slot and claiming the activation are two steps; the loser of the second step gives the slot back, and
  the state manager frees slots whose session no longer points at them (a crash between the two steps).
* A snapshot commit (``_COMMIT``) succeeds only if the record still carries the committing epoch, so a
  zombie activation can never move the snapshot pointer.

All redis-py errors become ``DirectoryUnavailable`` (503) so the API answers clearly when Redis is down.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from substrate.errors import Conflict, DirectoryUnavailable, NotFound, public_detail, script_failure
from substrate.keys import Keys
from substrate.models import (
    TRANSITIONAL,
    SessionRecord,
    SessionState,
    SnapshotRef,
    WorkerRecord,
    WorkerState,
)
from substrate.redispack import use_hiredis_packer

P = ParamSpec("P")
T = TypeVar("T")

_JSON_FIELDS = {"labels", "env", "snapshot", "previousSnapshot", "restoredFrom", "carriedAnswers"}
_INT_FIELDS = {"epoch", "slot", "turns"}
_FLOAT_FIELDS = {"createdAt", "updatedAt", "lastActiveAt", "stateDeadline", "lostAfter"}

# KEYS[1] session hash. ARGV[1] JSON {from?, epoch?, worker?, to?, bump?, set?, del?, now}
# -> {1, state, epoch, previous state, tenant} on success, {0, state, epoch} on a failed check, {-1} if
# absent.
_CAS = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {-1} end
local a = cjson.decode(ARGV[1])
local cur = redis.call('HMGET', h, 'state', 'epoch', 'worker', 'tenant')
local state, epoch, worker = cur[1], tonumber(cur[2]) or 0, cur[3] or ''
local prev = state
if a['from'] then
  local ok = false
  for _, s in ipairs(a['from']) do if s == state then ok = true end end
  if not ok then return {0, state, epoch} end
end
if a['epoch'] and tonumber(a['epoch']) ~= epoch then return {0, state, epoch} end
if a['worker'] and a['worker'] ~= worker then return {0, state, epoch} end
if a['bump'] then epoch = epoch + 1; redis.call('HSET', h, 'epoch', epoch) end
if a['to'] then state = a['to']; redis.call('HSET', h, 'state', state) end
if a['set'] then for k, v in pairs(a['set']) do redis.call('HSET', h, k, v) end end
if a['del'] then for _, k in ipairs(a['del']) do redis.call('HDEL', h, k) end end
redis.call('HSET', h, 'updatedAt', a['now'])
return {1, state, epoch, prev, cur[4] or ''}
"""

# KEYS[1] session hash, KEYS[2] its committed-snapshot set. ARGV[1] JSON {epoch, states, ref, key,
# createdAt, retention, to?, set?, del?, now}. Moves snapshot -> previousSnapshot and sets snapshot =
# ref, only if epoch and state match; keeps the newest ``retention`` committed snapshots in the set and
# returns the keys that fell out (``previousSnapshot`` is cleared if it fell out: retention 1).
# -> {1, previous state, tenant, dropped key ...} | {0, state, epoch} | {-1}
_COMMIT = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {-1} end
local a = cjson.decode(ARGV[1])
local cur = redis.call('HMGET', h, 'state', 'epoch', 'snapshot', 'previousSnapshot', 'tenant')
local state, epoch = cur[1], tonumber(cur[2]) or 0
if tonumber(a['epoch']) ~= epoch then return {0, state, epoch} end
local ok = false
for _, s in ipairs(a['states']) do if s == state then ok = true end end
if not ok then return {0, state, epoch} end
if redis.call('ZCARD', KEYS[2]) == 0 then
  for _, old in ipairs({cur[4], cur[3]}) do
    if old then local r = cjson.decode(old); redis.call('ZADD', KEYS[2], tonumber(r['createdAt']) or 0, r['key']) end
  end
end
if cur[3] then redis.call('HSET', h, 'previousSnapshot', cur[3]) end
redis.call('HSET', h, 'snapshot', a['ref'])
redis.call('ZADD', KEYS[2], tonumber(a['createdAt']), a['key'])
local out = {1, state, cur[5] or ''}
local n = redis.call('ZCARD', KEYS[2])
local keep = math.max(1, tonumber(a['retention']) or 2)
if n > keep then
  local old = redis.call('ZRANGE', KEYS[2], 0, n - keep - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, n - keep - 1)
  for _, k in ipairs(old) do
    out[#out + 1] = k
    if cur[3] and cjson.decode(cur[3])['key'] == k then redis.call('HDEL', h, 'previousSnapshot') end
  end
end
if a['to'] then redis.call('HSET', h, 'state', a['to']) end
if a['set'] then for k, v in pairs(a['set']) do redis.call('HSET', h, k, v) end end
if a['del'] then for _, k in ipairs(a['del']) do redis.call('HDEL', h, k) end end
if a['turns'] then redis.call('HINCRBY', h, 'turns', a['turns']) end
redis.call('HSET', h, 'updatedAt', a['now'])
return out
"""

# KEYS[1] session hash, KEYS[2] its epoch floor (tombstone of a deleted session of this ID); ARGV
# field/value pairs. Creates the record only if the ID is free, with an epoch above the floor (epochs
# never repeat for an ID) -> {1, epoch written} | {0} if the ID is taken.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local floor = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local epoch = 1
for i = 1, #ARGV, 2 do if ARGV[i] == 'epoch' then epoch = tonumber(ARGV[i + 1]) or 1 end end
if floor > 0 and epoch <= floor then epoch = floor + 1 end
redis.call('HSET', KEYS[1], unpack(ARGV))
redis.call('HSET', KEYS[1], 'epoch', epoch)
return {1, epoch}
"""

# KEYS[1] session hash, KEYS[2] its epoch floor. -> -1 if the ID is taken (a record, even DELETED), else the
# epoch ``_CREATE`` would write now: 1, or one above the floor.
_CREATE_EPOCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
return (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) + 1
"""

# KEYS[1] session hash, KEYS[2] epoch floor, KEYS[3] snapshot set. ARGV[1] floor TTL (s).
# Deletes the record and its snapshot set, leaving the epoch it reached as the floor of the next one.
# -> {floor, state the record had ('' if none), its tenant ('' if none)}
_DELETE = """
local e = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') or 0
local st = redis.call('HGET', KEYS[1], 'state') or ''
local tenant = redis.call('HGET', KEYS[1], 'tenant') or ''
local f = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if e > f then f = e end
if f > 0 then redis.call('SET', KEYS[2], f, 'EX', tonumber(ARGV[1])) end
redis.call('DEL', KEYS[1], KEYS[3])
return {f, st, tenant}
"""

# KEYS[1] worker hash, KEYS[2] its slot table. ARGV[1] lease expiry (s), ARGV[2] active slots, ARGV[3] warm
# slots ('' = leave), ARGV[4] when the active slots were counted (s; '' = not said); warm slots are stored
# with the slot table's size then (``warmSlotsAtUsed``: claims since take warm hosts, ``list_workers``).
# Renews only an existing record (a worker declared dead must not come back unseen) -> 1 | 0.
_RENEW = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'leaseExpiresAt', ARGV[1])
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'activeSlots', ARGV[2])
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'activeSlotsAt', ARGV[4]) end
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'warmSlots', ARGV[3], 'warmSlotsAtUsed', redis.call('HLEN', KEYS[2]))
end
return 1
"""

# KEYS[1] worker hash. ARGV[1] state. Never creates a record -> 1 | 0.
_SET_WORKER_STATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
return 1
"""

# KEYS: worker hash, its slot table, the next worker's hash, its slot table ... -> {fields of the first
# (HGETALL's flat list), used slots of the first (HLEN), ...}. Read-only; standalone Redis only (the keys
# of different workers lie in different cluster hash slots). One command instead of two per worker: the
# client's own cost of a 30-worker registry read fell from 0.9 to 0.3 ms (redis-py packs and parses
# each pipelined command in Python), and the registry is read several times a second
_READ_WORKERS = """
local out = {}
for i = 1, #KEYS, 2 do
  out[#out + 1] = redis.call('HGETALL', KEYS[i])
  out[#out + 1] = redis.call('HLEN', KEYS[i + 1])
end
return out
"""

# KEYS[1] the sessions index. ARGV[1], ARGV[2] first and last rank (ZRANGE), ARGV[3], ARGV[4] what goes
# before and after a session ID in its record's key. -> {sid, state, tenant, actorTemplate, epoch, worker,
# slot, stateDeadline, sid, ...}: eight entries per indexed ID, a missing field as nil. Standalone Redis
# only: the records' keys are not declared (on a cluster they lie in other hash slots).
_READ_SUMMARIES = """
local out, n = {}, 0
for _, sid in ipairs(redis.call('ZRANGE', KEYS[1], ARGV[1], ARGV[2])) do
  local f = redis.call('HMGET', ARGV[3] .. sid .. ARGV[4], 'state', 'tenant', 'actorTemplate', 'epoch',
                       'worker', 'slot', 'stateDeadline')
  out[n + 1] = sid
  for i = 1, 7 do out[n + 1 + i] = f[i] end
  n = n + 8
end
return out
"""

#: the record fields a :class:`SessionSummary` holds, in its order after the ID
_SUMMARY_FIELDS = ("state", "tenant", "actorTemplate", "epoch", "worker", "slot", "stateDeadline")

# KEYS[1] worker hash, KEYS[2] its slot table. ARGV[1] now (s), ARGV[2] grace (s), ARGV[3] '1' = force.
# Removes the worker only if its lease expired more than ``grace`` ago (or ``force``: its process is
# known to be gone). -> {1, slot, sid, slot, sid ...} removed (with the slot table it had) | {0} alive.
_EXPIRE_WORKER = """
local lease = tonumber(redis.call('HGET', KEYS[1], 'leaseExpiresAt') or '0') or 0
local exists = redis.call('EXISTS', KEYS[1]) == 1
if exists and ARGV[3] ~= '1' and lease + tonumber(ARGV[2]) >= tonumber(ARGV[1]) then return {0} end
local out = {1}
local taken = redis.call('HGETALL', KEYS[2])
for i = 1, #taken do out[#out + 1] = taken[i] end
redis.call('DEL', KEYS[1], KEYS[2])
return out
"""

# KEYS[1] worker hash, KEYS[2] its slot table. ARGV[1] session id, ARGV[2] now (epoch s), written to the
# worker's ``placedAt`` with the claim (the pool controller keeps a worker just placed on: substrate.pool)
# -> slot index >= 0 | -1 full | -2 worker not READY | -3 worker unknown
_CLAIM_SLOT = """
local st = redis.call('HMGET', KEYS[1], 'state', 'slots')
if not st[1] then return -3 end
if st[1] ~= 'READY' then return -2 end
local n = tonumber(st[2])
local taken = redis.call('HGETALL', KEYS[2])
local used = {}
for i = 1, #taken, 2 do used[taken[i]] = true end
for i = 0, n - 1 do
  if not used[tostring(i)] then
    redis.call('HSET', KEYS[2], i, ARGV[1])
    redis.call('HSET', KEYS[1], 'placedAt', ARGV[2])
    return i
  end
end
return -1
"""

# KEYS[1] slot table. ARGV[1] slot, ARGV[2] session id: frees the slot only if that session holds it.
# KEYS[1] session hash; ARGV[1] lastActiveAt, ARGV[2] turns to add. Never creates a record.
_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'lastActiveAt', ARGV[1])
if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[1], 'turns', ARGV[2]) end
return 1
"""

_RELEASE_SLOT = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


async def _scripts_loaded() -> None:
    """A pipeline's ``load_scripts`` once the directory loaded every script (``Directory._ready``)."""


def _translate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as e:
            if (bug := script_failure(e)) is not None:  # Redis answered: not unavailable
                raise bug from e
            if args and isinstance(args[0], Directory):  # see Directory.unavailable_within
                args[0].unavailable_at_m = time.monotonic()
            raise DirectoryUnavailable(f"session directory (Redis) unavailable: {public_detail(e)}") from e

    return wrapper


def _encode(fields: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in fields.items():
        if v is None:
            continue
        if k in _JSON_FIELDS:
            out[k] = json.dumps(v.model_dump() if hasattr(v, "model_dump") else v, separators=(",", ":"))
        elif hasattr(v, "value"):  # enums
            out[k] = str(v.value)
        else:
            out[k] = str(v)
    return out


def decode_session(raw: dict[str, str]) -> SessionRecord:
    """Build a ``SessionRecord`` from a Redis hash (str -> str)."""
    data: dict[str, Any] = {}
    for k, v in raw.items():
        if k in _JSON_FIELDS:
            data[k] = json.loads(v)
        elif k in _INT_FIELDS:
            data[k] = int(v)
        elif k in _FLOAT_FIELDS:
            data[k] = float(v)
        else:
            data[k] = v
    return SessionRecord.model_validate(data)


class _Queued:
    """What a queued pipeline command returns: awaiting it does nothing (like redis-py's pipelines)."""

    def __await__(self) -> Any:
        if False:  # pragma: no cover - makes this a generator
            yield
        return None


class _SequentialPipeline:
    """The subset of a redis-py pipeline the directory uses, run command by command (Redis Cluster)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._queue: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    async def __aenter__(self) -> "_SequentialPipeline":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._queue.clear()

    def __getattr__(self, name: str) -> Callable[..., _Queued]:
        def queue(*args: Any, **kwargs: Any) -> _Queued:
            self._queue.append((name, args, kwargs))
            return _Queued()
        return queue

    async def execute(self) -> list[Any]:
        out = []
        for name, args, kwargs in self._queue:
            out.append(await getattr(self._client, name)(*args, **kwargs))
        self._queue.clear()
        return out


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """The part of a session record that the repair pass and the quota reconciliation read of every
    session (``substrate.models.SessionRecord`` for the field meanings): read without the JSON fields and
    without model validation, so a pass over 20,000 sessions costs a tenth of what reading whole records
    did (``Directory.session_summaries``)."""

    id: str
    state: SessionState
    tenant: str
    actorTemplate: str  # noqa: N815 - the record's field name
    epoch: int
    worker: str | None
    slot: int | None
    stateDeadline: float | None  # noqa: N815


def _summary(sid: str, f: list[Any]) -> SessionSummary | None:
    """A summary from ``sid`` and its record's ``_SUMMARY_FIELDS`` values (None: no such record, or a
    DELETED one, as ``get_sessions`` skips)."""
    state, tenant, template, epoch, worker, slot, deadline = f
    if state is None or template is None or state == SessionState.DELETED.value:
        return None
    return SessionSummary(sid, SessionState(state), tenant or "default", template, int(epoch or 0),
                          worker or None, None if slot in (None, "") else int(slot),
                          None if deadline in (None, "") else float(deadline))


@dataclass(frozen=True)
class CasResult:
    """Outcome of a compare-and-set: ``ok``, and the state and epoch the record has now."""

    ok: bool
    state: SessionState | None
    epoch: int
    found: bool = True


class Directory:
    """Async directory client. One instance per process; safe to share between tasks.

    ``redis_url`` is any redis-py URL; ``prefix`` namespaces every key (one per deployment/test run).
    Methods raise ``DirectoryUnavailable`` when Redis cannot be reached, ``NotFound``/``Conflict`` as said.
    """

    #: how long a deleted session's last epoch is remembered (a re-created session of that ID starts
    #: above it); far beyond any worker lease, so no zombie activation of the old session outlives it
    epoch_floor_ttl_s = 7 * 24 * 3600

    def __init__(self, redis_url: str, prefix: str = "substrate", *, socket_timeout_s: float = 2.0,
                 cluster: bool | None = None) -> None:
        """``cluster``: talk to a Redis Cluster (redis-py's cluster client); default: on when the URL's
        query has ``cluster=1`` or the scheme is ``redis+cluster://``."""
        self.keys = Keys(prefix)
        #: monotonic time (s) this process last failed to reach Redis; -inf: never
        self.unavailable_at_m = float("-inf")
        if cluster is None:
            cluster = redis_url.startswith("redis+cluster://") or "cluster=1" in redis_url.partition("?")[2]
        self.cluster = cluster
        if cluster:
            from redis.asyncio.cluster import RedisCluster

            url = redis_url.replace("redis+cluster://", "redis://", 1).split("?")[0]
            self.redis = RedisCluster.from_url(  # type: ignore[assignment]
                url, decode_responses=True, socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s, max_connections=256)
        else:
            # one retry, on a new connection, of a command whose connection turned out closed: after Redis
            # restarted (the embedded one is restarted when it dies), every pooled connection to the dead
            # process failed its next command once, so up to a pool's worth of requests answered 503
            # ``directory_unavailable`` while /readyz was green (fresh-user run: 21 of 60 creates, 15 s
            # later). A timeout is not retried: only a closed connection, which a command that the server
            # executed meets only if the server died between executing and answering it; the scripts' own
            # compare-and-set then refuses the repeat (the caller sees a lost race, as for any retry)
            self.redis: aioredis.Redis = aioredis.from_url(
                redis_url, decode_responses=True, socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s, health_check_interval=0, max_connections=256,
                retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError],
            )
            # commands packed in C (substrate.redispack). Not for the cluster client: it fixes its
            # nodes' connection class itself, per node discovered
            use_hiredis_packer(self.redis.connection_pool)
        self._cas = self.redis.register_script(_CAS)
        self._create = self.redis.register_script(_CREATE)
        self._create_epoch = self.redis.register_script(_CREATE_EPOCH)
        self._commit = self.redis.register_script(_COMMIT)
        self._claim = self.redis.register_script(_CLAIM_SLOT)
        self._release = self.redis.register_script(_RELEASE_SLOT)
        self._touch = self.redis.register_script(_TOUCH)
        self._delete = self.redis.register_script(_DELETE)
        self._renew = self.redis.register_script(_RENEW)
        self._expire = self.redis.register_script(_EXPIRE_WORKER)
        self._set_state = self.redis.register_script(_SET_WORKER_STATE)
        self._read_workers = self.redis.register_script(_READ_WORKERS)  # standalone only (list_workers)
        self._read_summaries = self.redis.register_script(_READ_SUMMARIES)  # standalone only
        self._scripts = (self._cas, self._create, self._commit, self._claim, self._release, self._touch,
                         self._delete, self._renew, self._expire, self._set_state, self._read_workers,
                         self._read_summaries, self._create_epoch)
        #: every script is loaded on the server(s) as far as this process knows (see ``_ready``)
        self._loaded = False

    async def _ready(self) -> None:
        """Load every script once (one round trip; on a cluster, on every primary: a script queued in a
        cluster pipeline runs as EVALSHA, which the cluster client does not reload on its own). On a
        standalone Redis a pipeline then sends its scripts' EVALSHAs without first asking SCRIPT EXISTS
        (redis-py asks at every pipeline that holds a script: a round trip more for each create and
        each state transition); a server that lost them (restarted) answers NOSCRIPT, and
        ``_scripted`` loads them again and runs the pipeline once more."""
        if self._loaded:
            return
        if self.cluster:
            for sc in self._scripts:
                await self.redis.script_load(sc.script)  # the cluster client sends it to every primary
        else:
            async with self.redis.pipeline(transaction=False) as p:
                for sc in self._scripts:
                    p.script_load(sc.script)
                await p.execute()
        self._loaded = True

    def pipeline(self, transaction: bool = False) -> Any:
        """A pipeline. On a cluster, whose client refuses scripts in pipelines, the queued commands run
        one after the other instead (every script's keys share one hash slot, so each stays atomic). On a
        standalone Redis whose scripts are loaded (``_ready``), without redis-py's SCRIPT EXISTS
        round trip before the commands."""
        if self.cluster:
            return _SequentialPipeline(self.redis)
        p = self.redis.pipeline(transaction=transaction)
        if self._loaded:
            p.load_scripts = _scripts_loaded  # type: ignore[method-assign]
        return p

    async def _scripted(self, queue: Callable[[Any], Awaitable[None]],
                        undo: Callable[[], Awaitable[None]] | None = None) -> list[Any]:
        """Run a pipeline that holds one script (called once or more): ``queue(p)`` queues its commands;
        returns the replies. NOSCRIPT (the server lost its scripts: it restarted since ``_ready``) means
        the script did not run while the pipeline's other commands did: ``undo()`` takes back those that
        may not run twice (counter moves; index entries set or removed are idempotent), the scripts are
        loaded again, and the whole pipeline runs once more."""
        await self._ready()
        for attempt in (0, 1):
            async with self.pipeline() as p:
                await queue(p)
                try:
                    return list(await p.execute())
                except NoScriptError:
                    if attempt:
                        raise
                    self._loaded = False
                    if undo is not None:
                        await undo()
                    await self._ready()
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.redis.aclose()

    @_translate
    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # sessions ---------------------------------------------------------------------------------------
    @_translate
    async def create_session(self, rec: SessionRecord) -> int:
        """Write a new record, with its entries in the runtime's and its tenant's session index, in one round
        trip; ``Conflict(code="session_exists")`` if the ID is taken (even if DELETED).

        Returns the epoch written: ``rec.epoch``, or above the last epoch a deleted session of this ID
        reached (epochs never repeat for an ID); ``rec.epoch`` is updated to it."""
        key = self.keys.session(rec.id)
        fields = _encode(rec.model_dump())
        flat = [x for kv in fields.items() for x in kv]
        # one round trip: the create-if-absent script and the index entries (NX: a failed create of a
        # taken ID leaves the existing entries as they are)
        # the state counter too, optimistically (undone below if the ID was taken): no round trip more
        counted = rec.state != SessionState.DELETED

        tenant_index = self.keys.tenant_sessions(rec.tenant)

        async def queue(p: Any) -> None:
            await self._create(keys=[key, self.keys.session_epoch_floor(rec.id)], args=flat, client=p)
            p.zadd(self.keys.sessions_index, {rec.id: rec.createdAt}, nx=True)
            # the tenant's index too (it was a round trip of its own after this one)
            p.zadd(tenant_index, {rec.id: rec.createdAt}, nx=True)
            if rec.state in TRANSITIONAL and rec.stateDeadline:
                p.zadd(self.keys.deadlines, {rec.id: rec.stateDeadline}, nx=True)
            if counted:
                self._queue_count(p, None, rec.state.value, tenant=rec.tenant)

        async def uncount() -> None:
            if counted:
                await self._count_states(rec.state.value, None, tenant=rec.tenant)

        done = await self._scripted(queue, uncount)
        created = done[0]
        if int(created[0]) != 1:
            if int(done[2]):  # the ID is another tenant's session (or a removed one's): not in this index
                await self.redis.zrem(tenant_index, rec.id)
            await uncount()
            raise Conflict(f"session {rec.id!r} already exists", code="session_exists")
        rec.epoch = int(created[1])
        return rec.epoch

    @_translate
    async def create_epoch(self, sid: str) -> int | None:
        """The epoch a create of ``sid`` would write now (1, or one above the last epoch a deleted session of
        this ID reached: see :meth:`create_session`), or None if the ID is taken (a record, even DELETED).
        One round trip, as an EXISTS alone. The epoch is a forecast: a namesake deleted in between raises it."""
        res = int(await self._create_epoch(keys=[self.keys.session(sid), self.keys.session_epoch_floor(sid)]))
        return None if res < 0 else res

    @_translate
    async def get_session(self, sid: str) -> SessionRecord:
        """The record, or ``NotFound(code="session_not_found")`` (also for DELETED records)."""
        raw = await self.redis.hgetall(self.keys.session(sid))
        if not raw or raw.get("state") == SessionState.DELETED.value or "actorTemplate" not in raw:
            raise NotFound(f"session {sid!r} not found", code="session_not_found")
        return decode_session(raw)

    @_translate
    async def get_deleting(self, sid: str) -> SessionRecord | None:
        """The record of ``sid`` if it is marked DELETED (a delete, or an undone create, still under way:
        ``get_session`` calls it gone already), else None."""
        raw = await self.redis.hgetall(self.keys.session(sid))
        if raw.get("state") != SessionState.DELETED.value or "actorTemplate" not in raw:
            return None
        return decode_session(raw)

    @_translate
    async def transition(self, sid: str, *, from_states: Iterable[SessionState] | None = None,
                         epoch: int | None = None, worker: str | None = None,
                         to: SessionState | None = None, bump: bool = False,
                         set: dict[str, Any] | None = None, unset: Iterable[str] = (),
                         deadline_s: float | None = None, tenant: str | None = None,
                         likely: SessionState | None = None) -> CasResult:
        """Compare-and-set on one session (see module doc). ``deadline_s`` sets ``stateDeadline`` to
        now + deadline_s for a transitional ``to`` state; leaving a transitional state clears it.

        ``tenant``: the session's tenant as the caller knows it. With one ``from_states`` (or several and
        ``likely``, the state the caller last read), its state counters move in the same round trip as the
        step (optimistically, like the runtime-wide ones); without it (or if it was wrong: the step reports
        the record's tenant and the state it left), they move in a round trip after the step."""
        now = time.time()
        fields = dict(set or {})
        dels = list(unset)
        if to is not None:
            if to in TRANSITIONAL and deadline_s is not None:
                fields["stateDeadline"] = now + deadline_s
            elif to not in TRANSITIONAL:
                dels.append("stateDeadline")
        args: dict[str, Any] = {"now": repr(now)}
        if from_states is not None:
            args["from"] = [s.value for s in from_states]
        if epoch is not None:
            args["epoch"] = epoch
        if worker is not None:
            args["worker"] = worker
        if to is not None:
            args["to"] = to.value
        if bump:
            args["bump"] = True
        if fields:
            args["set"] = _encode(fields)
        if dels:
            args["del"] = dels
        # The deadline index (another hash slot) rides in the same round trip, optimistically: if the CAS
        # fails, the index may be off for this session; the record's own ``stateDeadline`` is the truth
        # and the state manager's repair scan rolls any session past it.
        # With one state to move from, the state counters move in the same round trip, optimistically
        # (moved back below if the compare-and-set fails); else after it, from the state it reports
        froms = args.get("from") or []
        guess = froms[0] if len(froms) == 1 else (likely.value if likely is not None and likely.value in froms
                                                    else None)
        moved = (guess, to.value) if to is not None and guess is not None and guess != to.value else None

        async def queue(p: Any) -> None:
            await self._cas(keys=[self.keys.session(sid)], args=[json.dumps(args)], client=p)
            if to is not None and to in TRANSITIONAL and "stateDeadline" in fields:
                p.zadd(self.keys.deadlines, {sid: fields["stateDeadline"]})
            elif to is not None and to not in TRANSITIONAL:
                p.zrem(self.keys.deadlines, sid)
            if moved is not None:
                self._queue_count(p, *moved, tenant=tenant)

        async def unmove() -> None:
            if moved is not None:
                await self._count_states(moved[1], moved[0], tenant=tenant)

        res = (await self._scripted(queue, unmove))[0]
        if res[0] != 1:
            await unmove()
        if res[0] == -1:
            return CasResult(False, None, 0, found=False)
        if res[0] == 1:
            actual = str(res[4]) if len(res) > 4 and res[4] else None
            if moved is None:
                if len(res) > 3 and res[3] != res[1]:
                    await self._count_states(res[3], res[1], tenant=actual)
            elif actual != tenant or res[3] != moved[0]:  # moved on a wrong guess (tenant or state)
                left = str(res[3])  # the state the step moved the session from
                async with self.pipeline() as p:
                    if left != moved[0]:
                        self._queue_count(p, moved[1], moved[0])
                        self._queue_count(p, left, moved[1])
                    if tenant:
                        self._queue_count(p, moved[1], moved[0], tenant=tenant, runtime=False)
                    if actual:
                        self._queue_count(p, left, moved[1], tenant=actual, runtime=False)
                    await p.execute()
        return CasResult(res[0] == 1, SessionState(res[1]), int(res[2]))

    @_translate
    async def commit_snapshot(self, sid: str, *, epoch: int, ref: SnapshotRef,
                              states: Iterable[SessionState] = (SessionState.RUNNING, SessionState.SUSPENDING),
                              to: SessionState | None = None, set: dict[str, Any] | None = None,
                              unset: Iterable[str] = (), retention: int = 2,
                              add_turns: int = 0) -> tuple[bool, list[str]]:
        """Point the session at snapshot ``ref`` if it still carries ``epoch`` (and is in ``states``).
        ``add_turns``: turns the activation ran that its worker's heartbeat has not reported yet, added to
        the record's ``turns`` in the same atomic step (only if it commits): a suspend folds them in, as
        no heartbeat reports them once the activation is gone.

        Returns ``(committed, dropped)``: ``dropped`` are the object keys of committed snapshots beyond
        the newest ``retention`` (``snapshot.retention``, at least 1), to be deleted from the store.
        With retention 1 ``previousSnapshot`` is cleared, as its object goes.
        """
        args: dict[str, Any] = {"epoch": epoch, "states": [s.value for s in states], "key": ref.key,
                                "createdAt": ref.createdAt, "retention": retention,
                                "ref": ref.model_dump_json(), "now": repr(time.time())}
        dels = list(unset)
        if to is not None:
            args["to"] = to.value
            if to not in TRANSITIONAL:
                dels.append("stateDeadline")
        if set:
            args["set"] = _encode(set)
        if dels:
            args["del"] = dels
        if add_turns > 0:
            args["turns"] = int(add_turns)
        await self._ready()
        res = await self._commit(keys=[self.keys.session(sid), self.keys.session_snapshots(sid)],
                                 args=[json.dumps(args)])
        if res[0] != 1:
            return False, []
        if to is not None and to not in TRANSITIONAL:
            await self.redis.zrem(self.keys.deadlines, sid)
        if to is not None and res[1] != to.value:
            await self._count_states(res[1], to.value, tenant=res[2])
        return True, [str(k) for k in res[3:]]

    @_translate
    async def forget_snapshot(self, sid: str, key: str) -> None:
        """Drop ``key`` from the session's committed set (a corrupt snapshot: the sweep may delete it)."""
        await self.redis.zrem(self.keys.session_snapshots(sid), key)

    @_translate
    async def committed_snapshots(self, sid: str) -> list[str]:
        """Object keys of the session's committed snapshots still kept (oldest first)."""
        return list(await self.redis.zrange(self.keys.session_snapshots(sid), 0, -1))

    @_translate
    async def delete_session(self, sid: str, *, tenant: str | None = None,
                             slot: tuple[str, int] | None = None) -> None:
        """Remove the record and its index entries (idempotent), ``tenant``'s index too when given (its
        entry is otherwise dropped by that tenant's next listing), in one round trip. The epoch it reached
        stays behind as the floor of a re-created session of the same ID (for ``epoch_floor_ttl_s``).
        ``slot``: (worker ID, slot index) the session held, freed first in the same round trip if the
        session still holds it (as :meth:`release_slot`)."""
        async def queue(p: Any) -> None:
            if slot is not None:
                await self._release(keys=[self.keys.worker_slots(slot[0])], args=[slot[1], sid], client=p)
            await self._delete(keys=[self.keys.session(sid), self.keys.session_epoch_floor(sid),
                                     self.keys.session_snapshots(sid)], args=[self.epoch_floor_ttl_s], client=p)
            p.zrem(self.keys.sessions_index, sid)
            p.zrem(self.keys.deadlines, sid)
            if tenant is not None:
                p.zrem(self.keys.tenant_sessions(tenant), sid)

        res = (await self._scripted(queue))[0 if slot is None else 1]
        if res[1] and res[1] != SessionState.DELETED.value:  # a DELETED record is counted nowhere
            await self._count_states(res[1], None, tenant=res[2])

    @_translate
    async def get_sessions(self, sids: list[str]) -> list[SessionRecord]:
        """Records for ``sids`` in order, skipping missing ones (one pipelined round trip)."""
        if not sids:
            return []
        await self._ready()
        async with self.pipeline() as p:
            for sid in sids:
                p.hgetall(self.keys.session(sid))
            raws = await p.execute()
        return [decode_session(r) for r in raws if r and "actorTemplate" in r and
                r.get("state") != SessionState.DELETED.value]

    @_translate
    async def list_sessions(self, *, state: SessionState | None = None, template: str | None = None,
                            limit: int = 100, offset: int = 0, scan_cap: int = 5000
                            ) -> tuple[list[SessionRecord], int | None]:
        """A page of sessions ordered by creation time, filtered by state/template.

        Returns ``(items, next_offset)``; ``next_offset`` is None at the end. Scans at most ``scan_cap``
        index entries per call, so a selective filter over a huge directory answers in bounded time
        (with fewer items and a ``next_offset`` to continue from).
        """
        items: list[SessionRecord] = []
        pos = offset
        scanned = 0
        batch = max(limit, 100)
        while len(items) < limit and scanned < scan_cap:
            sids = await self.redis.zrange(self.keys.sessions_index, pos, pos + batch - 1)
            if not sids:
                return items, None
            for i, rec in enumerate(await self._get_sessions_aligned(sids)):
                if rec is not None and (state is None or rec.state == state) and \
                        (template is None or rec.actorTemplate == template):
                    items.append(rec)
                    if len(items) == limit:
                        pos += i + 1
                        break
            else:
                pos += len(sids)
            scanned += len(sids)
        total = await self.redis.zcard(self.keys.sessions_index)
        return items, (pos if pos < total else None)

    async def _get_sessions_aligned(self, sids: list[str]) -> list[SessionRecord | None]:
        await self._ready()
        async with self.pipeline() as p:
            for sid in sids:
                p.hgetall(self.keys.session(sid))
            raws = await p.execute()
        return [decode_session(r) if r and "actorTemplate" in r and r.get("state") != "DELETED" else None
                for r in raws]

    @_translate
    async def session_summaries(self, *, offset: int = 0, limit: int = 1000
                                ) -> tuple[list[SessionSummary], int | None]:
        """Summaries of the sessions at ranks ``offset`` .. ``offset + limit - 1`` of the creation-ordered
        index (missing and DELETED records left out) and the next offset (None at the end): one round
        trip on a standalone Redis (a script reads the index range and each record's fields), two on a
        cluster (the range, then the records' fields pipelined by node). For passes over every session
        (the repair, the quota reconciliation), where ``list_sessions`` parsed and validated whole records."""
        prefix, _, suffix = self.keys.session("\0").partition("\0")
        if self.cluster:
            sids = await self.redis.zrange(self.keys.sessions_index, offset, offset + limit - 1)
            async with self.redis.pipeline(transaction=False) as p:
                for sid in sids:
                    p.hmget(self.keys.session(sid), *_SUMMARY_FIELDS)
                rows = await p.execute() if sids else []
        else:
            await self._ready()
            flat = await self._read_summaries(keys=[self.keys.sessions_index],
                                              args=[offset, offset + limit - 1, prefix, suffix])
            sids = flat[::8]
            rows = [flat[i + 1:i + 8] for i in range(0, len(flat), 8)]
        out = [s for s in (_summary(sid, row) for sid, row in zip(sids, rows)) if s is not None]
        return out, (offset + len(sids) if len(sids) == limit else None)

    @_translate
    async def summaries_of(self, sids: list[str]) -> list[SessionSummary]:
        """Summaries of ``sids`` in order, missing and DELETED ones left out (one pipelined round trip)."""
        if not sids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for sid in sids:
                p.hmget(self.keys.session(sid), *_SUMMARY_FIELDS)
            rows = await p.execute()
        return [s for s in (_summary(sid, row) for sid, row in zip(sids, rows)) if s is not None]

    @_translate
    async def session_activity(self, sids: list[str]) -> list[tuple[str, str, float, str]]:
        """``(id, state, lastActiveAt, tenant)`` of each of ``sids`` that exists, in order (one pipelined
        round trip of ``HMGET``; missing and DELETED records left out): what choosing pressure victims
        needs, without reading and validating whole records (a full pool's scan did that for every
        session: about a fifth of the router's CPU in a creation burst, 2026-12-06)."""
        if not sids:
            return []
        await self._ready()
        async with self.pipeline() as p:
            for sid in sids:
                p.hmget(self.keys.session(sid), "state", "lastActiveAt", "tenant", "actorTemplate")
            rows = await p.execute()
        return [(sid, state, float(last or 0.0), tenant or "default")
                for sid, (state, last, tenant, template) in zip(sids, rows)
                if template is not None and state is not None and state != SessionState.DELETED.value]

    @_translate
    async def tenant_session_count(self, tenant: str) -> int:
        """Sessions in ``tenant``'s index (O(1))."""
        return int(await self.redis.zcard(self.keys.tenant_sessions(tenant)))

    @_translate
    async def count_sessions(self) -> int:
        return int(await self.redis.zcard(self.keys.sessions_index))

    @_translate
    async def all_session_ids(self) -> list[str]:
        return list(await self.redis.zrange(self.keys.sessions_index, 0, -1))

    @_translate
    async def expired_deadlines(self, now: float | None = None, limit: int = 500) -> list[str]:
        """Session IDs whose transitional-state deadline has passed."""
        return list(await self.redis.zrangebyscore(self.keys.deadlines, "-inf", now or time.time(),
                                                   start=0, num=limit))

    # workers ----------------------------------------------------------------------------------------
    @_translate
    async def register_worker(self, rec: WorkerRecord) -> None:
        """Add or refresh a worker record and its lease."""
        fields = {k: str(v.value if hasattr(v, "value") else v) for k, v in rec.model_dump().items()
                  if v is not None and k != "freeSlots"}
        await self._ready()
        async with self.pipeline() as p:
            p.hset(self.keys.worker(rec.id), mapping=fields)
            p.zadd(self.keys.workers_index, {rec.id: rec.leaseExpiresAt})
            await p.execute()

    @_translate
    async def heartbeat(self, wid: str, lease_expires_at: float,
                        last_active: dict[str, float] | None = None, turns: dict[str, int] | None = None,
                        active_slots: int | None = None, warm_slots: int | None = None,
                        counted_at: float | None = None, loop_lag: dict[str, int] | None = None) -> bool:
        """Renew a worker's lease (one atomic script that renews only an existing record) and record its
        sessions' last activity (s since epoch) and the turns each ran since the last heartbeat, and, when
        given, its ``activeSlots`` (with ``counted_at``, epoch s when they were counted: ``activeSlotsAt``)
        and ``warmSlots`` (free slots whose pre-started host has booted). ``loop_lag``: stats fields
        (``substrate.loops.LagCounts.fields``) to add to the directory's stats, in the same round trip as
        the rest (not added when the record is gone).

        Returns False if the worker record is gone (it was declared dead: the worker must stop serving).
        """
        await self._ready()
        alive = await self._renew(keys=[self.keys.worker(wid), self.keys.worker_slots(wid)],
                                  args=[repr(lease_expires_at), "" if active_slots is None else active_slots,
                                        "" if warm_slots is None else warm_slots,
                                        "" if counted_at is None else repr(counted_at)])
        if not alive:
            return False
        turns = turns or {}
        lag = {k: n for k, n in (loop_lag or {}).items() if n}

        async def queue(p: Any) -> None:
            p.zadd(self.keys.workers_index, {wid: lease_expires_at}, xx=True)
            for field, n in lag.items():
                p.hincrby(self.keys.stats, field, n)
            for sid, ts in (last_active or {}).items():
                # only touch records that exist: a deleted session must not be resurrected
                await self._touch(keys=[self.keys.session(sid)], args=[repr(ts), turns.get(sid, 0)], client=p)

        async def uncount() -> None:  # the pipeline runs again after a NOSCRIPT: its counts must not double
            async with self.pipeline() as p:
                for field, n in lag.items():
                    p.hincrby(self.keys.stats, field, -n)
                await p.execute()

        if last_active:
            await self._scripted(queue, uncount if lag else None)
        elif lag:
            async with self.pipeline() as p:
                await queue(p)
                await p.execute()
        else:
            await self.redis.zadd(self.keys.workers_index, {wid: lease_expires_at}, xx=True)
        return True

    @_translate
    async def add_turns(self, sid: str, turns: int, last_active: float) -> bool:
        """Add ``turns`` answered turns to a session's count (and its ``lastActiveAt``), as a heartbeat
        does, for an activation no heartbeat will report any more. Never creates a record; returns
        whether the session exists."""
        await self._ready()
        return bool(await self._touch(keys=[self.keys.session(sid)], args=[repr(last_active), int(turns)]))

    @_translate
    async def set_worker_state(self, wid: str, state: WorkerState) -> bool:
        """Set an existing worker's state (never creates a record). Returns whether it exists."""
        await self._ready()
        return bool(await self._set_state(keys=[self.keys.worker(wid)], args=[state.value]))

    @_translate
    async def deregister_worker(self, wid: str) -> dict[int, str]:
        """Remove a worker unconditionally (it is stopping, or its process is known to be gone);
        returns its slot table (slot -> session) as it was, for recovery."""
        return await self.expire_worker(wid, force=True) or {}

    def unavailable_within(self, window_s: float) -> bool:
        """True if this process failed to reach Redis in the last ``window_s`` seconds. Workers could
        not renew their leases then either, so a lease that lapsed during such an outage says nothing
        about the worker (see ``Activator.recover_worker``)."""
        return time.monotonic() - self.unavailable_at_m < window_s

    @_translate
    async def expire_worker(self, wid: str, *, grace_s: float = 0.0, force: bool = False,
                            now: float | None = None) -> dict[int, str] | None:
        """Remove worker ``wid`` if its lease expired more than ``grace_s`` ago (or ``force``), in one
        atomic step with reading its slot table. Returns that table (slot -> session) if removed, None
        if the lease is still valid (death is decided by lease expiry, never by one failed call)."""
        await self._ready()
        res = await self._expire(keys=[self.keys.worker(wid), self.keys.worker_slots(wid)],
                                 args=[repr(now or time.time()), repr(grace_s), "1" if force else "0"])
        if int(res[0]) != 1:
            return None
        await self.redis.zrem(self.keys.workers_index, wid)
        flat = res[1:]
        return {int(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}

    @_translate
    async def list_workers(self) -> list[WorkerRecord]:
        """Every registered worker with its free-slot count: two round trips, the index and then one
        script that reads every worker's record and slot count (on a cluster, whose workers' keys lie in
        different hash slots, two commands per worker, pipelined)."""
        wids = await self.redis.zrange(self.keys.workers_index, 0, -1)
        if not wids:
            return []
        await self._ready()
        if self.cluster:
            async with self.pipeline() as p:
                for wid in wids:
                    p.hgetall(self.keys.worker(wid))
                    p.hlen(self.keys.worker_slots(wid))
                res = await p.execute()
        else:
            res = await self._read_workers(
                keys=[k for wid in wids for k in (self.keys.worker(wid), self.keys.worker_slots(wid))])
            res = [dict(zip(r[::2], r[1::2])) if i % 2 == 0 else r for i, r in enumerate(res)]
        out = []
        for i, wid in enumerate(wids):
            raw, used = res[2 * i], res[2 * i + 1]
            if not raw or "address" not in raw:
                continue
            rec = WorkerRecord.model_validate(raw)
            rec.freeSlots = max(0, rec.slots - int(used))
            if rec.warmSlots is not None and rec.warmSlotsAtUsed is not None:
                # slots claimed since the report took warm hosts (a freed slot's host boots anew: not warm)
                rec.warmSlots = max(0, min(rec.freeSlots, rec.warmSlots - max(0, int(used) - rec.warmSlotsAtUsed)))
            out.append(rec)
        return out

    @_translate
    async def get_worker(self, wid: str) -> WorkerRecord | None:
        raw = await self.redis.hgetall(self.keys.worker(wid))
        if not raw or "address" not in raw:
            return None
        return WorkerRecord.model_validate(raw)

    @_translate
    async def worker_slots(self, wid: str) -> dict[int, str]:
        return {int(k): v for k, v in (await self.redis.hgetall(self.keys.worker_slots(wid))).items()}

    @_translate
    async def slots_of(self, wids: list[str]) -> dict[str, dict[int, str]]:
        """``worker_slots`` of each of ``wids`` (worker id -> slot -> session id), one pipelined round
        trip."""
        if not wids:
            return {}
        async with self.pipeline() as p:
            for wid in wids:
                p.hgetall(self.keys.worker_slots(wid))
            raws = await p.execute()
        return {wid: {int(k): v for k, v in (raw or {}).items()} for wid, raw in zip(wids, raws)}

    @_translate
    async def claim_slot(self, wid: str, sid: str, now: float | None = None) -> int:
        """Claim a free slot of worker ``wid`` for ``sid``. Every call claims its own slot (two routers
        racing to resume one session must not share one: the loser frees exactly the slot it took). A
        successful claim also sets the worker record's ``placedAt`` to ``now`` (epoch s, default: this
        clock), in the same atomic step: whichever router placed there, the pool controller sees it.

        Returns the slot index, or -1 (full), -2 (worker not READY), -3 (worker unknown).
        """
        return int(await self._claim(keys=[self.keys.worker(wid), self.keys.worker_slots(wid)],
                                     args=[sid, repr(time.time() if now is None else now)]))

    @_translate
    async def release_slot(self, wid: str, slot: int, sid: str) -> bool:
        """Free ``slot`` of ``wid`` if ``sid`` holds it. Returns whether it was freed."""
        return bool(await self._release(keys=[self.keys.worker_slots(wid)], args=[slot, sid]))

    # stats ------------------------------------------------------------------------------------------
    @_translate
    async def add_worker_seconds(self, seconds: float) -> None:
        await self.redis.hincrbyfloat(self.keys.stats, "workerSeconds", seconds)

    @_translate
    async def add_capacity_seconds(self, *, worker_s: float, slot_s: float, process_s: float) -> None:
        """Add to the cumulative cost integrals: worker-seconds (worker processes), slot-seconds
        (provisioned slots x time) and process-seconds (every process kept for sessions: workers and the
        zygote that forks them)."""
        async with self.pipeline() as p:
            p.hincrbyfloat(self.keys.stats, "workerSeconds", worker_s)
            p.hincrbyfloat(self.keys.stats, "slotSeconds", slot_s)
            p.hincrbyfloat(self.keys.stats, "processSeconds", process_s)
            await p.execute()

    @_translate
    async def get_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in (await self.redis.hgetall(self.keys.stats)).items()}

    # session counts by state: counters moved by the transitions, corrected by a slow scan -------------
    async def _count_states(self, from_state: str | None, to_state: str | None, *, tenant: str | None = None,
                            runtime: bool = True) -> None:
        """Move one session between state counters (a second round trip beside the atomic step, like
        the indexes: derived data that :meth:`reconcile_state_counts` repairs; DELETED is not counted):
        the runtime-wide ones unless ``runtime`` is False, and ``tenant``'s when given."""
        async with self.pipeline() as p:
            self._queue_count(p, from_state, to_state, tenant=tenant, runtime=runtime)
            await p.execute()

    def _queue_count(self, p: Any, from_state: str | None, to_state: str | None, *, tenant: str | None = None,
                     runtime: bool = True) -> None:
        """Queue on pipeline ``p`` the counter moves of one session from ``from_state`` to ``to_state``:
        the runtime-wide counters unless ``runtime`` is False, and ``tenant``'s (its own hash slot) when
        given."""
        keys = ([self.keys.state_counts] if runtime else []) + ([self.keys.tenant_state_counts(tenant)] if tenant else [])
        for key in keys:
            if from_state and from_state != SessionState.DELETED.value:
                p.hincrby(key, from_state, -1)
            if to_state and to_state != SessionState.DELETED.value:
                p.hincrby(key, to_state, 1)

    @_translate
    async def state_counts(self) -> dict[str, int]:
        """Sessions per lifecycle state (except DELETED) from the counters: O(states), not O(sessions)."""
        return {k: max(0, v) for k, v in self._counts_of(await self.redis.hgetall(self.keys.state_counts)).items()}

    @_translate
    async def tenant_state_counts(self, tenants: list[str]) -> dict[str, dict[str, int]]:
        """Each tenant's sessions per lifecycle state (except DELETED) from its counters, moved by the
        transitions like the runtime-wide ones (:meth:`state_counts`): one pipelined round trip,
        O(tenants x states). Derived data: :meth:`tenant_counts_checked` says whether to trust them."""
        async with self.pipeline() as p:
            for t in tenants:
                p.hgetall(self.keys.tenant_state_counts(t))
            raws = await p.execute() if tenants else []
        return {t: self._counts_of(raw) for t, raw in zip(tenants, raws)}

    @_translate
    async def tenant_counts_checked(self, tenant: str) -> dict[str, int] | None:
        """``tenant``'s counters (:meth:`tenant_state_counts`) if they add up to the sessions its index
        holds (read in the same round trip), else None: then they have drifted (a crash between a step
        and its counter move, until the repair pass corrects them) or a create or delete moved one and
        not yet the other, and the caller counts the index instead."""
        async with self.pipeline() as p:
            p.hgetall(self.keys.tenant_state_counts(tenant))
            p.zcard(self.keys.tenant_sessions(tenant))
            raw, size = await p.execute()
        counts = self._counts_of(raw)
        return counts if sum(counts.values()) == int(size) and all(v >= 0 for v in counts.values()) else None

    @staticmethod
    def _counts_of(raw: dict[str, Any]) -> dict[str, int]:
        """A counter hash as ``{state: n}`` with every state but DELETED (missing: 0). A negative count
        (a drift) is kept as it is, for the caller to see."""
        out = {s.value: 0 for s in SessionState if s != SessionState.DELETED}
        for k, v in (raw or {}).items():
            if k in out:
                out[k] = int(v)
        return out

    @_translate
    async def reconcile_tenant_state_counts(self, scanned: dict[str, dict[str, int]],
                                            before: dict[str, dict[str, int]]) -> list[str]:
        """For each tenant of ``before`` (its counters read just before a full scan), overwrite its
        counters with ``scanned[tenant]`` (the scan's counts; none: all 0) if they still equal ``before``
        (nothing of that tenant moved while the scan ran, so the scan is exact for it). Tenants not in
        ``before`` are left for the next pass. Returns the tenants corrected."""
        tenants = sorted(before)
        now = await self.tenant_state_counts(tenants)
        fixed: list[str] = []
        async with self.pipeline() as p:
            for t in tenants:
                want = {**{s.value: 0 for s in SessionState if s != SessionState.DELETED}, **scanned.get(t, {})}
                if now[t] != before[t] or now[t] == want:
                    continue
                if any(want.values()):
                    p.hset(self.keys.tenant_state_counts(t), mapping={k: str(v) for k, v in want.items()})
                else:  # a tenant with no session left: no hash left behind either
                    p.delete(self.keys.tenant_state_counts(t))
                fixed.append(t)
            if fixed:
                await p.execute()
        return fixed

    @_translate
    async def reconcile_state_counts(self, scanned: dict[str, int], before: dict[str, int]) -> bool:
        """Overwrite the counters with ``scanned`` (a full scan's counts) if they still equal ``before``
        (read just before the scan started): nothing moved during the scan, so the scan is exact. Returns
        whether the counters were corrected."""
        now = await self.state_counts()
        want = {s.value: scanned.get(s.value, 0) for s in SessionState if s != SessionState.DELETED}
        if now != before or now == want:
            return False
        await self.redis.hset(self.keys.state_counts, mapping={k: str(v) for k, v in want.items()})
        return True
