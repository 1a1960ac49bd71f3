"""Which snapshot store a directory's sessions keep their snapshots in, recorded in Redis at the first
start, so that a later start configured for another place is refused instead of reading every
snapshot as missing.

A snapshot ref names an object key only, never its bucket or folder: a start with a mistyped
``SUBSTRATE_SNAPSHOT__BUCKET`` (or prefix, local folder, store kind) read each session's snapshots as
missing, set them aside as corrupt one by one, and woke the sessions empty, while the real objects sat
untouched in the right bucket, unreferenced, until the orphan sweep deleted them (fresh-user round 18).
So the first start records the configured location (``Keys.snapshot_location``) and later starts
compare: another location while the directory holds sessions is a configuration error, said in one
line before anything runs. An operator who moved the objects on purpose starts once with
``SUBSTRATE_SNAPSHOT__ACCEPT_NEW_LOCATION=true``, which records the new location. With no session in
the directory nothing can be lost and the new location is recorded silently. The endpoint URL is not
part of the location: one bucket is reached by several names (a cluster's service name, loopback).

The record is written by compare-and-set: of two starts that read it at the same moment, each
configured for its own store, one records its store and the other is refused. And every running
runtime holds its store in Redis (:func:`hold`, renewed every ``HOLD_S / 3`` s, let go at a clean stop):
a start configured for another store is refused while one holds (a runtime whose pool has no worker yet,
e.g. ``minReplicas: 0`` before any session, was taken for a stopped one and its record overwritten).

This check reads Redis only, so ``substrate up`` can refuse in one line before anything starts. What
proves a store is this directory's is its marker object (``snapshot.guard``): a wrong endpoint, a
bucket emptied or made again, or a mistyped location accepted with the flag above is fenced there
(503, nothing condemned), not here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import uuid

from substrate.keys import Keys
from substrate.settings import SnapshotSettings

log = logging.getLogger(__name__)

#: this process, as a holder of its snapshot store (:func:`hold`)
HOLDER_ID = uuid.uuid4().hex
#: how long a hold lasts unless renewed (s): a runtime that died without letting go holds this long
HOLD_S = 30.0

#: KEYS[1] holders hash. ARGV[1] holder, ARGV[2] location, ARGV[3] now, ARGV[4] until (s). Drops expired
#: holds; if another holder holds another location -> that location (nothing held); else holds -> nil
_HOLD = """
local other = false
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local sep = string.find(all[i + 1], ' ', 1, true)
  local untl = tonumber(string.sub(all[i + 1], 1, sep - 1)) or 0
  local loc = string.sub(all[i + 1], sep + 1)
  if untl < tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= ARGV[1] and loc ~= ARGV[2] then
    other = loc
  end
end
if other then return other end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4] .. ' ' .. ARGV[2])
return false
"""


async def hold(redis: Any, keys: Keys, snapshot: SnapshotSettings, *, now: float | None = None) -> str | None:
    """Hold the configured store for this process (``HOLDER_ID``) for ``HOLD_S`` from ``now``, atomically
    with the check that no other live runtime of this directory holds another store. Returns that other
    store's location (then nothing is held), or None once held. Raises redis-py's errors."""
    t = time.time() if now is None else now
    other = await redis.eval(_HOLD, 1, keys.snapshot_location_holders, HOLDER_ID, _recorded(snapshot),
                             repr(t), repr(t + HOLD_S))
    if other is None:
        return None
    return other.decode() if isinstance(other, bytes) else str(other)


async def release(redis: Any, keys: Keys) -> None:
    """Let go of this process's hold (a clean stop: another store may start at once)."""
    await redis.hdel(keys.snapshot_location_holders, HOLDER_ID)


def location_of(snapshot: SnapshotSettings) -> str:
    """The configured store as one string: ``s3://<bucket>/<prefix>`` or ``file://<absolute folder>/<prefix>``
    (every snapshot key begins with the prefix, so it is part of where the snapshots are)."""
    prefix = snapshot.prefix.strip("/")
    if snapshot.store == "s3":
        return f"s3://{snapshot.bucket}/{prefix}"
    folder = str(snapshot.local_dir.resolve())
    return f"file://{folder}/{prefix}" if prefix else f"file://{folder}"


def _prefix_of(location: str) -> str:
    """The prefix part of a ``location_of`` string recorded with ``record`` (after ``#``)."""
    return location.rpartition("#")[2]


def _recorded(snapshot: SnapshotSettings) -> str:
    """What is recorded: the location and, after ``#``, the prefix alone (compared on its own)."""
    return f"{location_of(snapshot)}#{snapshot.prefix.strip('/')}"


def problem(recorded: str | None, configured: str, sessions: int, *, accept: bool = False,
            live_workers: int = 0) -> str | None:
    """Why a start configured for ``configured`` must not run on a directory of ``sessions`` sessions
    whose snapshots are recorded as kept in ``recorded`` (both as ``_recorded`` makes them; None: no
    objection). ``accept``: the operator says the objects were moved there; a changed prefix is refused
    even then, since every snapshot's key begins with the old one. ``live_workers``: workers of this
    directory whose lease runs: with no session yet but a runtime already running on the recorded store,
    a start configured for another one is refused too (two ``substrate up`` on one Redis and key prefix
    with their own data folders shared one pool and each other's sessions, whose snapshots the other's
    workers then could not find: they were condemned and woke empty; fresh-user round 24)."""
    if recorded is None or recorded == configured:
        return None
    was, now = recorded.rpartition("#")[0], configured.rpartition("#")[0]
    if sessions == 0:
        if live_workers == 0 or accept:
            return None
        return (f"another runtime of this directory (Redis and key prefix: {live_workers} live worker(s)) keeps "
                f"its snapshots in {was} (or stopped less than SUBSTRATE_WORKER__LEASE_S ago), but this start is configured "
                f"for {now}: the two would share one pool "
                "and each other's sessions, and neither could read the other's snapshots. Give this runtime its "
                "own SUBSTRATE_REDIS__KEY_PREFIX (another directory), or the same snapshot store")
    old_prefix, new_prefix = _prefix_of(recorded), _prefix_of(configured)
    if old_prefix != new_prefix:
        return (f"the {sessions} session(s) in this directory keep their snapshots in {was}, under keys that begin "
                f"with {old_prefix + '/' if old_prefix else 'no prefix'}, but this start is configured for {now}: "
                f"SUBSTRATE_SNAPSHOT__PREFIX must stay {old_prefix!r} while they exist (their snapshots' keys name "
                "it; a store may move to another bucket, endpoint or folder, not to another prefix)")
    if accept:
        return None
    return (f"the {sessions} session(s) in this directory keep their snapshots in {was}, but this start is "
            f"configured for {now}: every snapshot would read as missing and the sessions would wake "
            "empty. Fix SUBSTRATE_SNAPSHOT__STORE, __BUCKET or __LOCAL_DIR; if the snapshot objects "
            "were moved there (with their .substrate-store marker), start once with "
            "SUBSTRATE_SNAPSHOT__ACCEPT_NEW_LOCATION=true")


async def check(redis: Any, keys: Keys, snapshot: SnapshotSettings, *, holding: bool = False) -> str | None:
    """Compare the configured store with the one recorded for this directory (``redis``: a redis-py
    asyncio client). Returns the objection (see :func:`problem`), having changed nothing, or None. With
    no session in the directory (nothing to lose) the configured store is recorded now; a store accepted
    as moved (``snapshot.accept_new_location``) is recorded only once its marker proves it holds this
    directory's snapshots (:func:`record`, called by ``snapshot.guard``): a mistyped location accepted
    by mistake is then not remembered. A running runtime holding another store is an objection too;
    ``holding``: hold the configured store for this process first (:func:`hold`; the runtime renews it),
    let go again if there is an objection. Raises redis-py's errors when Redis does not answer."""
    configured = _recorded(snapshot)
    other = await hold(redis, keys, snapshot) if holding else await _held_elsewhere(redis, keys, configured)
    if other is not None:
        return (f"another runtime of this directory (Redis and key prefix) is running with its snapshots in "
                f"{other.rpartition('#')[0]} (or stopped less than {HOLD_S:g} s ago without a clean stop), but "
                f"this start is configured for {configured.rpartition('#')[0]}: the two would share one pool and "
                "each other's sessions, and neither could read the other's snapshots. Give this runtime its own "
                "SUBSTRATE_REDIS__KEY_PREFIX (another directory), or the same snapshot store")
    why = await _check_record(redis, keys, snapshot, configured)
    if why is not None and holding:
        await release(redis, keys)
    return why


async def live_holders(redis: Any, holders_key: str, now: float | None = None) -> dict[str, str]:
    """The live holds in hash ``holders_key`` (``Keys.snapshot_location_holders`` of some prefix): holder
    id -> the store location it holds (as ``_recorded`` makes it). Read only."""
    t = time.time() if now is None else now
    out: dict[str, str] = {}
    for holder, raw in (await redis.hgetall(holders_key)).items():
        holder = holder.decode() if isinstance(holder, bytes) else str(holder)
        until, _, loc = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(" ")
        try:
            if float(until) >= t:
                out[holder] = loc
        except ValueError:
            pass
    return out


async def _held_elsewhere(redis: Any, keys: Keys, configured: str) -> str | None:
    """The store another live runtime holds, if it is not ``configured`` (read only)."""
    held = await live_holders(redis, keys.snapshot_location_holders)
    return next((loc for holder, loc in held.items() if holder != HOLDER_ID and loc != configured), None)


async def _check_record(redis: Any, keys: Keys, snapshot: SnapshotSettings, configured: str) -> str | None:
    """``check`` against the recorded location (see there)."""
    raw = await redis.get(keys.snapshot_location)
    recorded = raw.decode() if isinstance(raw, bytes) else raw
    if recorded == configured:
        return None
    sessions = int(await redis.zcard(keys.sessions_index))
    live = int(await redis.zcount(keys.workers_index, time.time(), "+inf")) if recorded is not None else 0
    why = problem(recorded, configured, sessions, accept=snapshot.accept_new_location, live_workers=live)
    if why is not None:
        return why
    if recorded is None or sessions == 0:
        # compare-and-set: of two starts that read the same record at the same moment (each with its own
        # store), only one records its store; the other is refused below instead of both running, each
        # with its own store, on one pool (the check before was a read, then a write)
        if recorded is None:
            won = bool(await redis.set(keys.snapshot_location, configured, nx=True))
        else:
            won = bool(await redis.eval(_SET_IF_UNCHANGED, 1, keys.snapshot_location, recorded, configured))
        if not won:
            raw = await redis.get(keys.snapshot_location)
            now = raw.decode() if isinstance(raw, bytes) else raw
            if now != configured:
                return (f"another runtime of this directory (Redis and key prefix) recorded its snapshot store "
                        f"{(now or '').rpartition('#')[0] or '(none)'} just now, while this start is configured for "
                        f"{configured.rpartition('#')[0]}: the two would share one pool and each other's sessions, "
                        "and neither could read the other's snapshots. Give this runtime its own "
                        "SUBSTRATE_REDIS__KEY_PREFIX (another directory), or the same snapshot store")
    return None


#: KEYS[1] the recorded location; ARGV[1] the value read, ARGV[2] the new one: set only if unchanged -> 1 | 0
_SET_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


async def record(redis: Any, keys: Keys, snapshot: SnapshotSettings) -> None:
    """Record the configured store as the place of this directory's snapshots (its marker matched)."""
    configured = _recorded(snapshot)
    raw = await redis.get(keys.snapshot_location)
    recorded = raw.decode() if isinstance(raw, bytes) else raw
    if recorded != configured:
        if recorded is not None:
            log.warning("snapshot store location changed from %s to %s", recorded.rpartition("#")[0],
                        configured.rpartition("#")[0])
        await redis.set(keys.snapshot_location, configured)


async def forget(redis: Any, keys: Keys, snapshot: SnapshotSettings) -> bool:
    """Drop the recorded location if it is the configured store (True if dropped): called when that store
    turned out to hold another directory's snapshots before this directory ever showed its marker there,
    so the record named a store its sessions never used (a start pointed at another deployment's folder
    by mistake was recorded, and the corrected start was then refused: fresh-user round 25)."""
    configured = _recorded(snapshot)
    raw = await redis.get(keys.snapshot_location)
    recorded = raw.decode() if isinstance(raw, bytes) else raw
    if recorded != configured:
        return False
    await redis.delete(keys.snapshot_location)
    return True
