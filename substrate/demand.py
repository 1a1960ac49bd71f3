"""Demand and capacity notes shared through Redis by router processes and the pool controller.

On Kubernetes the routers (any number of processes) and the pool controller (the leading ``substrate
controller``) share nothing but Redis, yet each needs what the other knows:

* **routers -> controller (demand)**: placements waiting for a free slot, sessions parked on a wake and
  activations in flight are counted in the router process that holds them. Each process without a pool
  controller writes its counts per pool into one field of the hash ``Keys.pool_demand`` (its process id ->
  ``{"at", "pools": {pool: [waiting, inFlight, activations]}}``) every ``pool.demand_publish_s`` while any
  is nonzero or activations started, once more when they drop to zero, and at once when a placement
  starts waiting; that moment also PUBLISHes the pool's name on ``Keys.pool_demand_channel`` so the
  controller reconciles at once rather than on its next tick. The controller reads the hash once per tick (one HGETALL) and ignores
  entries older than ``pool.demand_ttl_s`` (a router that died or hung does not hold capacity forever).
* **controller -> routers (capacity on its way)**: per pool, how many workers are starting (created, not
  registered yet, not refused by the scheduler) and why none can come (``blocked``: the scheduler's
  ``Unschedulable`` message, a failure back-off), with the time it was written and the time the
  controller last read the demand (``seen_at``), in the hash ``Keys.pool_capacity`` (one HSET per tick).
  A router reads one field (one HGET) only when a placement found no free slot for ``api.slot_wait_s``:
  it keeps waiting (up to ``api.start_wait_s``) while workers are starting, and also while the controller
  has not yet read the demand this placement published (``DemandBoard.seen``: at most ``demand_ttl_s``);
  otherwise it answers 503 ``no_capacity`` with the blocked reason at once. A note older than
  ``pool.demand_ttl_s`` (no controller leads) says nothing. Times compare clocks of two processes, as
  the workers' leases already do (clocks are assumed synchronised well within a second).

Neither is on the hot path (DESIGN invariant 5): a request for a RUNNING session never reads or writes
them, and no Kubernetes API call is made on any request path.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from substrate.keys import Keys
from substrate.loops import reraise_lost_cancel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolDemand:
    """One process's demand for one pool: placements ``waiting`` for a slot (parked wakes that have not
    reached placement included), activations ``in_flight`` (slot claimed, not yet counted by their
    worker's heartbeat: still starting, or RUNNING since the worker's last count) and the
    process's cumulative ``activations`` counter (creates + wakes since it started, for the forecast)."""

    waiting: int = 0
    in_flight: int = 0
    activations: int = 0

    def busy(self) -> bool:
        return self.waiting > 0 or self.in_flight > 0


#: ``CapacityNote.code`` values (a 503 ``no_capacity``'s ``details.reason``)
UNSCHEDULABLE = "unschedulable"
START_BACKOFF = "start_backoff"


@dataclass(frozen=True)
class CapacityNote:
    """What the pool controller says about one pool: ``starting`` workers on their way (created, not
    registered yet, placeable), ``blocked`` why capacity cannot come (empty: nothing blocks), and ``at``
    when it was written (s since epoch)."""

    starting: int = 0
    blocked: str = ""
    at: float = 0.0
    #: when the controller last read the routers' demand before writing this note (s since epoch)
    seen_at: float = 0.0
    #: ``blocked``'s stable code for clients (``details.reason`` of a 503 ``no_capacity``):
    #: ``unschedulable`` (the scheduler places none of the pool's Pods) or ``start_backoff`` (its workers
    #: failed in a row: ``substrate.backends.backoff``)
    code: str = ""
    #: how long the block lasts, when known (a back-off's pause left, s; 0: unknown)
    retry_after_s: float = 0.0


class DemandBoard:
    """Reads and writes the two notes of the module docstring. ``redis`` is a redis-py asyncio client
    with ``decode_responses=True``; ``process_id`` names this process's field (unique per process);
    ``ttl_s`` is how old an entry may be before readers ignore it. Redis errors propagate from the write
    methods (callers run them in loops that survive errors); the read methods used on request paths
    (``capacity``) answer "nothing known" instead."""

    def __init__(self, redis: Any, keys: Keys, process_id: str, *, ttl_s: float = 5.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.redis = redis
        self.keys = keys
        self.process_id = process_id
        self.ttl_s = ttl_s
        self._last: dict[str, PoolDemand] | None = None
        #: capacity notes read recently, per pool: (monotonic time read, note)
        self._notes: dict[str, tuple[float, CapacityNote]] = {}
        self.cache_s = 0.2
        #: (started, done) times (s since epoch) of this process's last demand writes
        self._writes: collections.deque[tuple[float, float]] = collections.deque(maxlen=32)
        #: per (process, pool): the last activations counter seen, to turn counters into a sum of increases
        self._seen: dict[tuple[str, str], int] = {}
        self._activations: dict[str, int] = {}

    # ------------------------------------------------------------------------------------- routers
    async def publish_demand(self, by_pool: dict[str, PoolDemand], *, force: bool = False) -> bool:
        """Write this process's demand (all pools in one field). Skipped (False) when nothing is busy,
        nothing was busy at the last write and no activation started since (the forecast counts
        arrivals), unless ``force``: an idle router writes nothing."""
        busy = any(d.busy() for d in by_pool.values())
        last = self._last or {}
        was_busy = any(d.busy() for d in last.values())
        arrived = any(d.activations != last.get(p, PoolDemand()).activations for p, d in by_pool.items())
        if not (busy or was_busy or arrived or force):
            return False
        started = time.time()
        doc = {"at": started, "pools": {p: [d.waiting, d.in_flight, d.activations] for p, d in by_pool.items()}}
        await self.redis.hset(self.keys.pool_demand, self.process_id, json.dumps(doc, separators=(",", ":")))
        self._last = dict(by_pool)
        self._writes.append((started, time.time()))
        return True

    def seen(self, note: CapacityNote, since: float) -> bool:
        """True if ``note`` was written after the controller read a demand write of this process that
        began at or after ``since`` (s since epoch): the controller has counted what waits since then."""
        done = next((d for s, d in self._writes if s >= since), None)
        return done is not None and note.seen_at >= done

    async def wanted(self, pool: str) -> None:
        """A placement of ``pool`` found no free slot: tell the pool controller now (PUBLISH)."""
        await self.redis.publish(self.keys.pool_demand_channel, pool)

    async def capacity(self, pool: str) -> CapacityNote:
        """The controller's note for ``pool`` (one HGET, shared by the placements of this process that ask
        within ``cache_s``: a thousand waiting requests do not make a thousand reads); an empty note when
        unknown, stale or unreadable."""
        now_m = time.monotonic()
        hit = self._notes.get(pool)
        if hit is not None and now_m - hit[0] < self.cache_s:
            note = hit[1]
        else:
            try:
                raw = await self.redis.hget(self.keys.pool_capacity, pool)
            except Exception:  # noqa: BLE001 - a placement must not fail on a note: it answers no_capacity
                log.warning("capacity note unreadable", extra={"pool": pool}, exc_info=True)
                return CapacityNote()
            note = _parse_note(raw) or CapacityNote()
            self._notes[pool] = (now_m, note)
        if time.time() - note.at > self.ttl_s:
            return CapacityNote()
        return note

    # ---------------------------------------------------------------------------------- controller
    async def read_demand(self, *, exclude: str | None = None) -> dict[str, PoolDemand]:
        """Every live process's demand summed per pool (``exclude``: a process counted another way).
        ``activations`` is the sum of the increases of every process's counter seen by this board (a
        restarted router's counter starting again from zero does not count as negative arrivals).
        Entries older than ``ttl_s`` are skipped; entries older than ten TTLs are deleted."""
        raw = await self.redis.hgetall(self.keys.pool_demand)
        now = time.time()
        out: dict[str, list[int]] = {}
        stale: list[str] = []
        for proc, text in raw.items():
            try:
                doc = json.loads(text)
                at = float(doc["at"])
                pools = doc["pools"]
            except (ValueError, KeyError, TypeError):
                stale.append(proc)  # not ours to understand: a writer of another version; drop it
                continue
            for pool, vals in pools.items():
                try:
                    waiting, in_flight, activations = (int(v) for v in vals)
                except (ValueError, TypeError):
                    continue
                last = self._seen.get((proc, pool))
                self._seen[(proc, pool)] = activations
                if last is not None and activations > last:
                    self._activations[pool] = self._activations.get(pool, 0) + activations - last
                if proc == exclude or now - at > self.ttl_s:
                    continue
                acc = out.setdefault(pool, [0, 0])
                acc[0] += max(0, waiting)
                acc[1] += max(0, in_flight)
            if now - at > 10 * self.ttl_s:
                stale.append(proc)
        if stale:
            await self.redis.hdel(self.keys.pool_demand, *stale)
        gone = set(stale) | (set(p for p, _ in self._seen) - set(raw))
        for key in [k for k in self._seen if k[0] in gone]:  # routers long gone: forget their counters
            del self._seen[key]
        pools = set(out) | set(self._activations)
        return {p: PoolDemand(*out.get(p, [0, 0]), self._activations.get(p, 0)) for p in pools}

    async def publish_capacity(self, notes: dict[str, CapacityNote], *, seen_at: float) -> None:
        """Write the notes of every pool (one HSET); ``at`` is set to now, ``seen_at`` is when the demand
        they answer was read (``read_demand``'s start, s since epoch)."""
        if not notes:
            return
        now = time.time()
        await self.redis.hset(self.keys.pool_capacity, mapping={
            p: json.dumps({"at": now, "seenAt": seen_at, "starting": n.starting, "blocked": n.blocked,
                           "code": n.code, "retryAfterS": n.retry_after_s}, separators=(",", ":"))
            for p, n in notes.items()})

    async def follow(self, wanted: asyncio.Event, subscribed: asyncio.Event | None = None) -> None:
        """Set ``wanted`` whenever a router says a placement found no slot; runs until cancelled and
        resubscribes after a lost connection (the controller's timer tick covers the gap)."""
        while True:
            reraise_lost_cancel()  # here and below: see substrate/loops.py
            ps = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await ps.subscribe(self.keys.pool_demand_channel)
                if subscribed is not None:
                    subscribed.set()
                reraise_lost_cancel()
                async for msg in ps.listen():
                    if msg.get("type") == "message":
                        wanted.set()
                    reraise_lost_cancel()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a follower never dies: reconnect after a pause
                log.warning("demand channel subscription lost; resubscribing", exc_info=True)
                await asyncio.sleep(1.0)
            finally:
                try:
                    await ps.aclose()
                except Exception:  # noqa: BLE001
                    pass


def _parse_note(raw: str | None) -> CapacityNote | None:
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        return CapacityNote(int(doc.get("starting", 0)), str(doc.get("blocked") or ""), float(doc["at"]),
                            float(doc.get("seenAt") or 0.0), str(doc.get("code") or ""),
                            float(doc.get("retryAfterS") or 0.0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
