"""Session lifecycle operations shared by the router and the state manager.

``Activator`` runs the protocols of DESIGN.md on top of the directory (Redis), placement and the
workers' internal API:

* **create**: quota places (409 on an ID whose create is under way) -> an activation permit -> claim a
  slot -> write the record already STARTING on it (create-if-absent: 409 on a taken ID) -> worker
  activates -> CAS STARTING->RUNNING. Any failure undoes every step (the record is deleted, the slot
  and the places given back): nothing half-written.
* **wake** (resume): claim a slot -> CAS SUSPENDED|FAILED->RESUMING (epoch bump: of any number of
  routers exactly one wins; losers give their slot back and wait) -> worker restores the snapshot ->
  CAS RESUMING->RUNNING with ``restoredFrom``. Concurrent wakes of one session in one router share one
  future (single flight). A corrupt snapshot sends the session to FAILED with the reason and rolls its
  pointer back to the previous good snapshot; an unreachable store rolls it back to SUSPENDED (503).
  An agent host that reports its restored state unloadable (422 ``state_load_failed``) sends the
  session to FAILED with its snapshot kept, and does not count against the tenant's breaker.
* **capacity**: no free slot -> suspend the least-recently-used idle session of the pool (lazy
  suspension: ``maxIdleTime`` is a ceiling, not a floor), else wait up to ``slot_wait_s``, else 503.
* **recover_worker**: a dead worker's sessions go to SUSPENDED (marked ``worker_lost``); they come
  back from their last committed snapshot on the next request. Death is decided by lease expiry (plus
  ``worker.lease_grace_s``; the worker itself stops serving at expiry), or by the backend knowing the
  process is gone, never by one failed call or probe.
* **lost activations**: a worker answering ``not_active`` for the record's current worker and epoch
  lost the activation; ``repair_lost_activation`` moves the record (guarded by epoch and worker) to
  SUSPENDED, marked ``activation_lost``, and the caller wakes it again.
* **capacity waits for what it is creating**: while the pool controller starts a worker for the pool,
  a placement waits for it (bounded by ``api.start_wait_s``, not ``park_timeout_s`` as issue 8 says:
  a cold worker start on a loaded machine measured 4-6 s, over the 5 s park timeout) instead of
  answering ``no_capacity``. A wake is still bounded by ``park_timeout_s`` for the waiting request.
  The pool controller may run in another process (Kubernetes): then the starting workers and the reason
  none can come (``Unschedulable``) are read from its note in Redis, and this process's waiting
  placements reach it the same way (``substrate.demand``; ``board``). A pool whose workers cannot be
  placed answers 503 ``no_capacity`` with ``Retry-After`` after ``slot_wait_s``, not after the start wait.
* **admission** (``substrate.admission``): a create or wake takes a permit of its pool's adaptive
  activation limiter before it claims a slot and gives it back when it is RUNNING or failed; those
  beyond the limit wait (FIFO, up to ``api.start_wait_s``, holding no slot) and are not demand for new
  workers: on a saturated machine more workers only slow every activation further.
* **tenancy** (issue 10): creates take quota first, wakes check it first and take it right after
  winning the claim, for the epoch they won (``substrate.quotas``: one atomic check; released on every
  way out of a live state, each release only up to the epoch of the activation that ended, so a suspend
  racing a resume never gives back the resumed activation's place), pass the tenant's circuit breaker and parked share
  (``substrate.fairness``), and automatic transitions (wake on invoke, idle/pressure suspend, crash
  recovery) leave one audit record each (``substrate.audit``); explicit API calls are recorded by the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from substrate import metrics
from substrate.admission import ActivationLimiter, LimiterSettings, LimiterTimeout
from substrate.audit import SYSTEM, Actor, AuditLog
from substrate.demand import CapacityNote, DemandBoard, PoolDemand
from substrate.directory import CasResult, Directory
from substrate.errors import (
    Conflict,
    DirectoryUnavailable,
    InvalidInput,
    NoCapacity,
    NotFound,
    SessionDeleted,
    SnapshotCorrupt,
    StaleEpoch,
    StateLoadFailed,
    StoreUnavailable,
    SubstrateError,
    TooManyRequests,
    WorkerUnavailable,
)
from substrate.fairness import ParkedShare, TenantBreaker, victim_order
from substrate.leasewatch import LeaseWatch
from substrate.loops import cancel_and_wait, run_forever
from substrate.models import (
    ActorTemplate,
    RestoredFrom,
    SessionRecord,
    SessionState,
    SnapshotRef,
    UNANSWERED,
    WorkerRecord,
    WorkerState,
)
from substrate.placement import candidates, lru_victims
from substrate.quotas import Quotas, translated
from substrate.settings import Settings
from substrate.slotqueue import SlotQueue
from substrate.specs import Catalog
from substrate.workerclient import DEACTIVATE_TIMEOUT_S, WorkerClient

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_WAKEABLE = (SessionState.SUSPENDED, SessionState.FAILED)
#: reasons whose next activation comes back from older state than was acknowledged (the answers say so):
#: ``agent_restarted`` and ``evicted`` are set by a worker that ended an activation itself (its agent died:
#: crash, memory limit, turn timeout; or a pressure suspend its own content refused: ``workers.server``);
#: snapshot_corrupt: the newest snapshot was set aside and the previous good one is used
_LOSSY = ("worker_lost", "deadline", "activation_lost", "agent_restarted", "snapshot_corrupt", "evicted")
_LIVE = (SessionState.RUNNING, SessionState.SUSPENDING, SessionState.STARTING, SessionState.RESUMING)
#: the live states whose activation may have answered turns: losing it loses them (see ``UNANSWERED``)
_ANSWERED = (SessionState.RUNNING, SessionState.SUSPENDING)
#: every state but DELETED: what a delete may move to DELETED (``Activator.delete``)
_NOT_DELETED = tuple(s for s in SessionState if s != SessionState.DELETED)
#: how long a delete that lost to a concurrent one waits for that one to remove the record (s), beyond the
#: winner's call to the session's worker (``Activator.delete_wait_s``); the record stays DELETED longer
#: only if the process that marked it died (the state manager's scans repair it)
DELETE_WAIT_S = 5.0
#: a ``resume_timeout`` names the session's previous failed wake if it failed at most this long ago
_WAKE_FAILURE_SAID_S = 600.0
#: codes of an automatic suspend that was skipped, not attempted (mid-turn, moved on, gone): no audit record
_SKIPPED = ("busy", "invalid_state", "not_active", "stale_epoch", "conflict")


@dataclass
class _Admission:
    """One admitted activation: ``latency_s`` is set to its worker call's duration once it succeeded
    (what the limiter learns from)."""

    latency_s: float | None = None


#: the longest one read of a pool's sessions serves its pressure suspensions (s; ``_suspend_lru``)
_LRU_SCAN_TTL_S = 1.0


@dataclass
class _LruScan:
    """One read of a pool's sessions for pressure suspension (``Activator._suspend_lru``)."""

    #: when it was read (``time.monotonic()``)
    at: float
    #: ``(lastActiveAt, session id, tenant)`` of its RUNNING sessions, least recently used first, less
    #: those tried since
    order: list[tuple[float, str, str]]
    #: slots of the pool held per tenant (less the sessions suspended from this scan since)
    held: dict[str, int]
    #: slots of the pool's READY workers
    pool_slots: int


@dataclass
class _Activated:
    """One activation under way (``Activator._activation``): its caller sets ``worker`` once the
    activation it made is RUNNING there."""

    worker: str | None = None


class _LostRace(Conflict):
    """Another process won a session's activation CAS and its wake failed: that process records the
    wake, this one must not (one record per transition)."""


class _DeletedMeanwhile(NotFound):
    """The session was deleted while this process woke it (the delete records itself; the wake that
    lost to it leaves no record and answers 404 ``session_not_found`` like any call after a delete)."""


def _elsewhere(e: SubstrateError) -> bool:
    """Whether a create that failed with ``e`` may be placed again on another worker: the worker was past
    its lease (``worker_fenced``) or refused the connection (``WorkerUnavailable.reached`` False), so
    nothing of the session ran there."""
    return e.code == "worker_fenced" or (isinstance(e, WorkerUnavailable) and not e.reached)


class _LeaseLost(WorkerUnavailable):
    """A call to a worker abandoned because the worker's lease ran out while it waited
    (``Activator._within_lease``)."""


class _WorkerLostCreate(Exception):
    """A create's worker could not take the session, refused the connection, or lost its lease during
    the activation (``error``: ``worker_fenced`` or ``worker_unavailable``); ``kept``: the session was not undone (the worker's
    recovery or the deadline roll had made it SUSPENDED first). ``Activator.create`` places it again."""

    def __init__(self, error: SubstrateError, *, kept: bool) -> None:
        super().__init__(error.message)
        self.error, self.kept = error, kept


def blames_tenant(e: SubstrateError) -> bool:
    """Whether a failed create or wake counts toward its tenant's circuit breaker. Not: a quota or
    fairness refusal (429), a fenced worker (the worker's lease), and an outage of the platform's own
    stores, Redis or the object store (``directory_unavailable``, ``snapshot_store_unavailable``), which
    every tenant meets at once: counting those opened the breaker of whoever was busy when the store came
    back, for ``breaker_open_s`` more (chaos run on d8fe6b3: 1,409 answers 429 ``tenant_circuit_open``
    after store and Redis pauses, recovery up to 31.6 s); nor a worker that died or stopped answering
    (``worker_unavailable``: agents run outside the worker process, so its loss is the platform's; e2e
    chaos on 5828cab: four worker SIGKILLs under load failed 11 wakes of the one tenant and opened its
    breaker); nor a create whose session a DELETE removed while it started (``session_deleted``); nor a
    race between the tenant's own calls on one ID (``conflict``, ``stale_epoch``, ``session_not_found``:
    a create, delete and create of one ID at once) or a full worker (``no_capacity``): none says the
    template's activations fail (fresh-user run: 10 creates racing deletes of the same IDs, 5 ``conflict``
    and 5 ``stale_epoch``, opened the breaker, and 4,825 creates got 429 ``tenant_circuit_open``)."""
    return (not isinstance(e, (TooManyRequests, DirectoryUnavailable, StoreUnavailable, WorkerUnavailable,
                               SessionDeleted, Conflict, NotFound, NoCapacity))
            and e.code != "worker_fenced")


def loss_base(rec: SessionRecord) -> float | None:
    """The time (Unix s) the state a wake of ``rec`` restores dates from: the current snapshot's
    ``createdAt``, or the record's ``lostAfter`` when that is older (the snapshot was committed by an
    activation that had itself restored older state and answered no turn: its state is that older
    state); 0.0 when no state comes back (a lossy recovery before any snapshot, kept by such a commit);
    None when there is no snapshot and no kept loss."""
    at = rec.snapshot.createdAt if rec.snapshot is not None else None
    if rec.lostAfter is None:
        return at
    return rec.lostAfter if at is None else min(rec.lostAfter, at)


def worker_phases(answer: object) -> tuple[tuple[str, float], ...]:
    """The ``phasesMs`` of a worker's activation answer as ``((name, ms), ...)`` in the worker's order;
    () when absent or malformed (an older worker, a fake): timing is never worth failing a wake for."""
    got = answer.get("phasesMs") if isinstance(answer, dict) else None
    if not isinstance(got, dict):
        return ()
    return tuple((str(k), float(v)) for k, v in got.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and str(k).isidentifier())


@dataclass(frozen=True)
class Route:
    """Where a RUNNING session lives: the hot path's cache entry."""

    worker: str
    address: str
    epoch: int
    #: why the activation that made this route restored older state (``worker_lost``, ``deadline``), if so
    restored: str | None = None
    #: the tenant owning the session (the hot path checks it against the caller's)
    tenant: str = "default"
    #: for the activation that made this route: ms waiting for a slot (placement, with any wait for
    #: capacity) and ms the worker took to activate (restore, agent start); the woken answer's
    #: ``Server-Timing`` (W3C Server Timing) reports them
    #: (not part of the route's identity: two routers' routes to one activation are equal)
    place_ms: float | None = field(default=None, compare=False)
    activate_ms: float | None = field(default=None, compare=False)
    #: within ``activate_ms``: the worker's own phases in order, ``(name, ms)`` (``sandbox``, ``restore``,
    #: ``recheck``, ``agent``: ``workers.server._phases_ms``), then ``running`` (the RUNNING write)
    phases_ms: tuple[tuple[str, float], ...] = field(default=(), compare=False)


class WorkerView:
    """A process-local, periodically refreshed copy of the worker registry (no Redis on the hot path)."""

    def __init__(self, directory: Directory, refresh_s: float) -> None:
        self.directory = directory
        self.refresh_s = refresh_s
        self.workers: dict[str, WorkerRecord] = {}
        self.refreshed_at = 0.0
        #: when the read that ``workers`` holds began (``time.time()``): a worker registered before it is in it
        self.read_at = 0.0
        self._task: asyncio.Task[None] | None = None
        #: registry reads started, and the number of the newest one that completed (see ``refresh``)
        self._reads_started = 0
        self._read_done = 0
        self._read_lock = asyncio.Lock()
        #: workers a call could not reach while their lease still ran, each with the lease expiry (epoch s)
        #: that only a renewal after the call can reach and when the mark lapses anyway (epoch s): not
        #: placed on until a registry read shows such a lease (the worker is alive), the worker gone, or
        #: the mark lapsed (``mark_unreachable``)
        self.unreachable: dict[str, tuple[float, float]] = {}

    async def refresh(self) -> None:
        """Read the worker registry again (``Directory.list_workers``: O(workers)). Calls share reads:
        every call sees a read that began after it was made, and calls made while a read is under way
        all wait for the one next read (one at a time, FIFO), not one read each. A burst of placements
        that found no slot re-read the registry once per placement (1.2 reads per create in a
        1,000-create burst). Raises ``DirectoryUnavailable`` if the read this call waits on fails."""
        ticket = self._reads_started  # reads begun before this call: one of them is too old
        async with self._read_lock:
            if self._read_done > ticket:  # a read begun after this call has completed meanwhile
                return
            self._reads_started += 1
            n = self._reads_started
            began = time.time()
            workers = await self.directory.list_workers()
            self.workers = {w.id: w for w in workers}
            for wid, (renewed_past, lapses_at) in list(self.unreachable.items()):
                w = self.workers.get(wid)
                # gone, or renewed since (alive after all), or marked long enough
                if w is None or w.leaseExpiresAt > renewed_past or began > lapses_at:
                    del self.unreachable[wid]
            self.refreshed_at, self.read_at = time.time(), began
            self._read_done = n

    @property
    def reads(self) -> int:
        """Registry reads this view has begun."""
        return self._reads_started

    def start(self) -> None:
        self._task = asyncio.create_task(run_forever(self.refresh, self.refresh_s, "worker view refresh"))

    async def stop(self) -> None:
        await cancel_and_wait([self._task])

    def address(self, wid: str | None) -> str | None:
        w = self.workers.get(wid or "")
        return w.address if w else None

    def mark_unreachable(self, wid: str, lease_s: float) -> None:
        """A call to ``wid`` could not reach it (refused, reset, or outlived its lease) while its lease
        still runs. Its death is not declared here (only a lapsed lease does that:
        ``Activator.check_worker``), but a wake retried at once was placed on it again and again: a kill
        -9'd worker whose lease still ran took 5 epochs and 5 failure records of one resume (fresh-user
        tester 42). So placements skip it until a registry read shows a lease renewed after now (expiring
        more than ``lease_s``, the workers' lease, from now: a lease renewed before the call, after this
        view's last read, is no sign of life; a kill -9 right after a heartbeat sent a retried wake back
        to the dead worker). The mark lapses after two leases in any case (a dead worker is declared dead
        by then; a live one whose lease setting is shorter than this process's would be skipped for
        good). Its lease in the view is left as it is: the turns still in flight there are not abandoned
        for this (a worker that stopped listening may be draining them)."""
        if wid in self.workers:
            now = time.time()
            self.unreachable[wid] = (now + lease_s, now + 2 * lease_s)

    def leased(self, wid: str, now: float | None = None) -> bool:
        """True while ``wid``'s lease (as last seen) is valid: a route to a worker past its lease is not
        used (the worker stopped serving; its sessions may be moving elsewhere)."""
        w = self.workers.get(wid)
        return w is not None and w.leaseExpiresAt > (now or time.time())


class Activator:
    """See the module docstring. One per process; safe to share between tasks."""

    def __init__(self, settings: Settings, directory: Directory, catalog: Catalog, client: WorkerClient,
                 view: WorkerView, *, parked_gauge: Callable[[int], None] | None = None,
                 quotas: Quotas | None = None, audit: AuditLog | None = None) -> None:
        self.settings = settings
        self.quotas = quotas
        self.audit = audit
        self.breaker = TenantBreaker(settings.quota)
        self.parked_share = ParkedShare(settings.api.max_parked, settings.quota.tenant_parked_share)
        self.directory = directory
        self.catalog = catalog
        self.client = client
        self.view = view
        #: calls in flight to workers, abandoned when a worker's lease runs out (``_within_lease``; the
        #: router's turns use it too, ``api.proxy``): checked as often as the view is read again, 4x/s at most
        self.lease_watch = LeaseWatch(view, grace_s=settings.worker.lease_grace_s,
                                      check_s=max(0.25, settings.api.worker_refresh_s))
        self._wakes: dict[str, asyncio.Future[Route]] = {}
        #: when (monotonic s) a suspension to make room last failed for want of the snapshot store, and why
        self._room_failed: tuple[float, StoreUnavailable | None] = (float("-inf"), None)
        self.parked = 0
        #: placements waiting for a slot, per pool (demand for the pool controller)
        self.waiting_by_pool: dict[str, int] = {}
        self._activating: dict[str, int] = {}
        #: sessions with a wake in flight in this process (parked requests share one), per pool
        self.parked_by_pool: dict[str, int] = {}
        #: activations started since the process started, per pool (the arrival-rate forecast's counter)
        self.activations_total: dict[str, int] = {}
        self._queues: dict[str, SlotQueue[WorkerRecord]] = {}
        #: per pool, the background suspension that keeps ``pool.headroom_slots`` free (``_keep_headroom``)
        self._headroom: dict[str, asyncio.Task[None]] = {}
        #: per pool, no headroom search before this (monotonic s): the last one found nobody to suspend
        self._headroom_quiet_until: dict[str, float] = {}
        #: per pool, the last read of its sessions for pressure suspension (``_suspend_lru``)
        self._lru_scans: dict[str, _LruScan] = {}
        #: pool -> workers being started for it (set by the pool controller of this process)
        self.starting: dict[str, int] = {}
        #: pool -> why no worker of it can start now (absent when one can; set by this process's pool
        #: controller): ``blocked`` the sentence, ``code`` and ``retry_after_s`` for the 503
        self.capacity_blocked: dict[str, CapacityNote] = {}
        #: set when a placement found no free slot: wakes the pool controller at once
        self.capacity_wanted = asyncio.Event()
        #: demand/capacity notes shared with a pool controller in another process (None: same process)
        self.board: DemandBoard | None = None
        self._announce: asyncio.Task[None] | None = None
        #: how often a placement past ``slot_wait_s`` re-reads whether capacity is still on its way
        self.capacity_recheck_s = 0.5
        #: session -> error code of its automatic suspend failing right now (bounded; see ``suspend``)
        self._suspend_failing: OrderedDict[str, str] = OrderedDict()
        #: reconcile rounds of this process's pool controller (it bumps this after each round)
        self.capacity_ticks = 0
        #: pool -> session -> ``capacity_ticks`` when its placement found no free slot
        self._wanted_at: dict[str, dict[str, int]] = {}
        #: sessions whose placement waits for a slot (a parked wake of one waits for a starting worker)
        self._placing: set[str] = set()
        #: background repairs under way (``_background``): referenced so they are not collected mid-run
        self._repairs: set[asyncio.Task[None]] = set()
        #: parked wakes whose wait for a slot or a permit has ended: ``perf_counter()`` then (the
        #: restore's park timeout counts from it; dropped when the wake ends)
        self._wait_ended: dict[str, float] = {}
        #: the last wake of a session that failed in this process, as (monotonic time, code, message): a
        #: later ``resume_timeout`` says so (fresh-user round 14: a wake whose agent start hung answered
        #: "its wake goes on: retry" on every call while each wake failed); bounded, oldest dropped
        self._wake_failed: OrderedDict[str, tuple[float, str, str]] = OrderedDict()
        #: retries of an activation on another worker when the chosen one is fenced (past its lease)
        self.max_fenced_retries = 3
        #: pool -> adaptive bound on this process's activations under way (``substrate.admission``)
        self.limiters: dict[str, ActivationLimiter] = {}
        #: activations waiting for a permit, per pool, and their sessions (not demand for new workers)
        self.gated_by_pool: dict[str, int] = {}
        self._gated: set[str] = set()
        #: pool -> (epoch s it became RUNNING, worker) of this process's activations not yet in their
        #: worker's ``activeSlots`` (``_uncounted``), for at most one active window
        self._uncounted_by_pool: dict[str, deque[tuple[float, str]]] = {}

    # ------------------------------------------------------------------------------------ helpers
    @property
    def waiting_demand(self) -> int:
        """Demand not visible in slot counts: requests waiting for a slot plus requests parked on a
        resume (the pool controller adds it to the busy slots)."""
        return self.waiting_for_slots + self.parked

    def route_of(self, rec: SessionRecord) -> Route | None:
        """The route of a RUNNING record whose worker is known and within its lease, else None."""
        if rec.state != SessionState.RUNNING or not rec.worker:
            return None
        address = self.view.address(rec.worker)
        if address is None or not self.view.leased(rec.worker):
            return None
        return Route(rec.worker, address, rec.epoch, tenant=rec.tenant)

    async def record(self, action: str, rec: SessionRecord, *, result: str = "ok", reason: str = "",
                     worker: str | None = None, epoch: int | None = None, who: Actor | None = None) -> None:
        """Leave one audit record of ``action`` on ``rec`` (worker and epoch default to the record's).

        ``who``: the actor; None = the calling context's (a request's caller). Automatic transitions pass
        ``SYSTEM``: they may run inside another tenant's request (a placement making room, a failed call
        finding a dead worker), whose key ID and request ID must not show in this session's trail."""
        if self.audit is None:
            return
        t = self.catalog.templates.get(rec.actorTemplate)
        await self.audit.record(action, session=rec.id, tenant=rec.tenant, template=rec.actorTemplate,
                                worker=worker if worker is not None else rec.worker,
                                gpus=t.spec.resources.gpus if t else 0,
                                epoch=epoch if epoch is not None else rec.epoch, result=result, reason=reason,
                                who=who)

    @translated
    async def _exists(self, sid: str) -> bool:
        return bool(await self.directory.redis.exists(self.directory.keys.session(sid)))

    async def _being_deleted(self, sid: str) -> bool:
        """Whether ``sid``'s record is gone or marked DELETED (a delete under way). False if Redis fails."""
        try:
            return await self.directory.get_deleting(sid) is not None or not await self._exists(sid)
        except SubstrateError:
            return False

    @property
    def delete_wait_s(self) -> float:
        """The longest (s) a delete that lost to a concurrent one waits for the winner to remove the record:
        the winner's call that ends the activation (bounded by the worker's lease and grace when the
        worker froze, ``_within_lease``, and by ``DEACTIVATE_TIMEOUT_S`` on a live one) plus
        ``DELETE_WAIT_S`` for the rest. It was ``DELETE_WAIT_S`` alone: with the worker frozen, the losers
        answered 404 a second before the winner's 204, their records first (fresh-user tester 43)."""
        w = self.settings.worker
        return max(w.lease_s + w.lease_grace_s, DEACTIVATE_TIMEOUT_S) + DELETE_WAIT_S

    async def _wait_removed(self, sid: str) -> None:
        """Wait (at most ``delete_wait_s``, polling every 20 ms) until ``sid``'s record is gone: one marked
        DELETED is a delete (or an undone create) still under way. Returns at once if there is none."""
        gone_by = time.monotonic() + self.delete_wait_s
        while await self._exists(sid) and time.monotonic() < gone_by:
            await asyncio.sleep(0.02)

    async def release_quota(self, rec: SessionRecord, *, epoch: int | None, total: bool = False) -> None:
        """Give back ``rec``'s running place held for activation ``epoch`` or older (None: whatever it
        holds, for a session that is gone), and with ``total`` its total place. Never raises."""
        if self.quotas is None:
            return
        try:
            await self.quotas.release(rec.tenant, rec.actorTemplate, rec.id, epoch=epoch, total=total)
        except Exception:  # noqa: BLE001 - the repair pass reconciles quota from the records
            log.warning("quota release failed", extra={"session": rec.id}, exc_info=True)

    def _want_capacity(self, pool: str, sid: str) -> None:
        """``sid``'s placement found no free slot in ``pool``: wake the pool controller; remember when."""
        self._wanted_at.setdefault(pool, {}).setdefault(sid, self.capacity_ticks)
        self.capacity_wanted.set()

    def may_make_room(self, pool: str, sid: str | None = None) -> bool:
        """Whether a placement waiting in ``pool`` (``sid``'s; None: the oldest one) may lazy-suspend an
        idle session now.

        Not while this process's pool controller is starting a worker for the pool, nor before it has
        run a whole round since the placement asked (it may decide to start one): capacity the pool can
        still grow to is waited for (bounded by ``api.start_wait_s``), not taken from sessions that were
        just created or woken (fresh-user burst: 120 creates suspended their own first sessions while
        the pool grew, and the turns then timed out waking them). With no pool controller in this
        process (a router on Kubernetes) lazy suspension stays the answer to a full pool."""
        if pool not in self.starting:  # no pool controller in this process
            return True
        if self.starting[pool] > 0:
            return False
        # the placement's ask: +2 rounds, as a round already under way when it asked may have read the
        # demand before it (later arrivals do not hold back room for the oldest)
        # (insertion order is ask order and ticks only grow: the first entry is the oldest, O(1))
        wanted = self._wanted_at.get(pool, {})
        asked = next(iter(wanted.values()), None) if sid is None else wanted.get(sid)
        if asked is not None and self.capacity_ticks < asked + 2:
            self.capacity_wanted.set()  # run the rounds now rather than at the next timer
            return False
        return True

    def room_for(self, pool: str, sids: list[str]) -> int:
        """How many of the placements ``sids`` waiting in ``pool`` (queue order) room may be made for
        now: those ``may_make_room`` allows, i.e. whose demand the pool controller has had its rounds to
        size the pool for (all of them with no pool controller in this process). A burst's later
        arrivals wait for the controller's decision: room made for a whole queue on the word of rounds
        that saw only its first waiter suspended 8 sessions of an e2e burst on a loaded machine, and the
        next round started 3 workers for the same waiters."""
        if pool not in self.starting:
            return len(sids)
        return sum(1 for sid in sids if self.may_make_room(pool, sid))

    async def _within_lease(self, worker: str, call: Awaitable[_T]) -> _T:
        """Await ``call``, a call to ``worker``, abandoned once the worker's lease has run out plus
        ``worker.lease_grace_s`` (``substrate.leasewatch``): a frozen or cut-off worker fails it as
        ``_LeaseLost``, a ``WorkerUnavailable`` (``reached``: the worker may have acted on it; a create is
        then placed again on another worker, once its undo fenced it) within about the lease, where
        it held the call for the call's whole timeout (fresh-user tester 39: a create and a suspend on a
        SIGSTOPped worker waited until the worker was resumed, 50 and 100 s, then answered from a session
        the lost worker's recovery had changed meanwhile)."""
        task = asyncio.current_task()
        assert task is not None
        watch = self.lease_watch
        watch.add(worker, task)
        try:
            return await call
        except asyncio.CancelledError:
            # the watch's (the lease ran out) unless something else cancelled the task too (a server stop)
            if task in watch.lost and task.uncancel() == 0:
                raise _LeaseLost(f"worker {worker} stopped answering during the call (its lease ran out)") from None
            raise
        finally:
            watch.discard(worker, task)

    def _skip_worker(self, wid: str) -> None:
        """``wid`` answered ``worker_fenced`` (past its own lease) or refused a connection: place
        elsewhere until a registry read shows it renewed."""
        self.view.mark_unreachable(wid, self.settings.worker.lease_s)
        w = self.view.workers.get(wid)
        if w is not None:
            w.leaseExpiresAt = 0.0
            w.freeSlots = 0

    async def _worker_address(self, wid: str) -> str | None:
        address = self.view.address(wid)
        if address is None:
            w = await self.directory.get_worker(wid)
            address = w.address if w else None
        return address

    async def place(self, sid: str, template: ActorTemplate, *, worker: str | None = None,
                    tenant: str = "default") -> tuple[WorkerRecord, int]:
        """:meth:`_place`, then keep the pool's headroom (:meth:`_keep_headroom`)."""
        got = await self._place(sid, template, worker=worker, tenant=tenant)
        self._keep_headroom(self.catalog.pool_for(template).name)
        return got

    def _keep_headroom(self, pool: str) -> None:
        """After a placement: if the pool's free slots on READY workers (this process's view, no I/O)
        are fewer than ``pool.headroom_slots``, suspend that many least recently used idle sessions
        (idle at least ``api.pressure_min_idle_s``; anyone's: there is no requesting tenant) in the
        background, one such task per pool at a time. Not while the pool grows or its controller has
        yet to size it for a waiting placement (``may_make_room``): capacity it is creating is not taken
        from sessions. Errors are logged; the next placement tries again."""
        want = self.settings.pool.headroom_slots
        if want <= 0 or time.monotonic() < self._headroom_quiet_until.get(pool, 0.0) or not self.may_make_room(pool):
            return
        running = self._headroom.get(pool)
        if running is not None and not running.done():
            return
        free = sum(w.freeSlots for w in self.view.workers.values()
                   if w.pool == pool and w.state == WorkerState.READY)
        if free >= want:
            return
        min_idle_s = self.settings.api.pressure_min_idle_s

        async def make_room() -> None:
            try:
                freed = await self._suspend_lru(pool, min_idle_s, tenant="", count=want - free)
            except Exception:  # noqa: BLE001 - a background helper; lazy suspension still serves need
                log.warning("keeping free slots failed", extra={"pool": pool}, exc_info=True)
                freed = 0
            if not freed:
                # nobody idle long enough (a pool busy with turns): the search reads every session of the
                # pool, so it is not repeated per placement; a session idle now qualifies after min_idle_s
                self._headroom_quiet_until[pool] = time.monotonic() + max(min_idle_s, 0.1)

        self._headroom[pool] = asyncio.create_task(make_room())

    async def _place(self, sid: str, template: ActorTemplate, *, worker: str | None = None,
                     tenant: str = "default") -> tuple[WorkerRecord, int]:
        """Claim a slot for ``sid`` in the template's pool (only on ``worker`` if given). With no free
        slot: wakes the pool controller, joins the pool's FIFO of waiters (``substrate.slotqueue``: served
        as slots free up, lazy-suspending idle sessions to make room, fair to ``tenant``) for up to
        ``slot_wait_s``, then raises ``NoCapacity``. While the pool grows for the waiters (see
        ``may_make_room``) nobody is suspended for them and the wait is for the new worker, up to
        ``start_wait_s``: capacity never refuses what it is creating."""
        wp = self.catalog.pool_for(template)
        pool, spec = wp.name, wp.spec
        if spec.replicas == 0 and spec.autoscaling is None:
            # no worker, and nothing will start one: waiting cannot help, so no Retry-After (a client that
            # honours it polled for ever: fresh-user round 9); said at once, not after slot_wait_s
            err = NoCapacity(f"pool {pool!r} has no workers and cannot grow: its spec.replicas is 0 and it has no "
                             "spec.autoscaling; set one of them", details={"pool": pool, "reason": "no_replicas"})
            err.retry_after_s = None
            raise err
        queue = self._slot_queue(pool)
        if not len(queue):  # nobody queued ahead of us: try the view, then a fresh view
            got = await self._claim_in(pool, sid, worker)
            if got is not None:
                return got
            self.capacity_wanted.set()
            await self.view.refresh()
            got = await self._claim_in(pool, sid, worker)
            if got is not None:
                return got
        self._want_capacity(pool, sid)
        self.waiting_by_pool[pool] = self.waiting_by_pool.get(pool, 0) + 1
        self._placing.add(sid)
        t_wait, t_wait_m = time.time(), time.monotonic()
        self._announce_demand(pool)
        api = self.settings.api
        max_s = max(api.start_wait_s, api.slot_wait_s)
        blocked: CapacityNote | None = None
        waiter: asyncio.Future[tuple[WorkerRecord, int]] | None = None
        try:
            if self.board is None:
                # this process's pool controller: the queue asks may_make_room at each slot_wait_s
                try:
                    return await queue.wait(sid, worker, api.slot_wait_s, tenant=tenant,
                                            hold=lambda: not self.may_make_room(pool, sid), max_s=max_s)
                except asyncio.TimeoutError:
                    raise self._no_room(pool, t_wait_m) or self._pinned_full(pool, worker) or self._no_capacity(
                        pool, self.capacity_blocked.get(pool)) from None
            # a pool controller in another process (substrate.demand): one place in the FIFO for the whole
            # wait; past slot_wait_s it goes on while that controller says capacity is coming (or has yet
            # to count this demand), and one slot_wait_s more once it stopped coming (the new slots must
            # have the time to reach this waiter), up to start_wait_s
            park_deadline = time.monotonic() + max_s
            waiter = asyncio.ensure_future(queue.wait(sid, worker, max_s, tenant=tenant))
            done, _ = await asyncio.wait({waiter}, timeout=api.slot_wait_s)
            was_coming = False
            while not done:
                starting, blocked, undecided = await self._capacity_coming(pool, t_wait)
                left = park_deadline - time.monotonic()
                # room being made for the queue (suspensions serving the waiters ahead) counts as coming
                coming = starting > 0 or undecided or queue.progressing(api.slot_wait_s)
                if left <= 0 or not (coming or was_coming):
                    break
                if was_coming and not coming:
                    # what was coming has come (its workers are ready, the controller's note says): the
                    # queue re-reads the registry now, not after its backed-off pause (up to max_poll_s, longer
                    # than the one slot_wait_s left here: a k8s test with slot_wait_s 0.2 got 503 under load)
                    queue.notify()
                was_coming = coming
                step = self.capacity_recheck_s if coming else api.slot_wait_s
                done, _ = await asyncio.wait({waiter}, timeout=min(left, step))
            if not waiter.done():
                waiter.cancel()
            try:
                return await waiter
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise asyncio.CancelledError
            raise self._no_room(pool, t_wait_m) or self._pinned_full(pool, worker) or self._no_capacity(
                pool, blocked) from None
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()
            self.waiting_by_pool[pool] -= 1
            self._placing.discard(sid)
            self._wanted_at.get(pool, {}).pop(sid, None)
            self._waited(sid)

    def _no_capacity(self, pool: str, blocked: CapacityNote | None) -> NoCapacity:
        """The answer to a wait for a slot of ``pool`` that ran out: 503 ``no_capacity``; when the pool
        controller said why no capacity can come (``blocked``), the message says it, ``details.reason`` is
        its stable code (``unschedulable``, ``start_backoff``) and ``Retry-After`` covers the block's
        known length (a back-off's pause; it said 1 s during a 34 s pause: fresh-user tester 47)."""
        api = self.settings.api
        if blocked is None or not blocked.blocked:
            return NoCapacity(f"no free slot in pool {pool!r}; retry later", retry_after_s=api.retry_after_s,
                              details={"pool": pool})
        return NoCapacity(f"no free slot in pool {pool!r}: {blocked.blocked}; retry later",
                          retry_after_s=max(api.retry_after_s, math.ceil(blocked.retry_after_s)),
                          details={"pool": pool, "reason": blocked.code or "blocked"})

    def _pinned_full(self, pool: str, worker: str | None) -> NoCapacity | None:
        """The answer to a wait for a slot on ``worker`` (a resume pinned to it) that ran out: that worker is
        full, whatever the rest of the pool has (this process's view). It said "no free slot in pool" with
        16 slots free on the pool's other worker (fresh-user run): room is made pool-wide, not on one
        worker, so say how to get a slot. None for a placement not pinned to a worker."""
        if worker is None:
            return None
        elsewhere = sum(w.freeSlots for w in self.view.workers.values()
                        if w.pool == pool and w.id != worker and w.state == WorkerState.READY)
        return NoCapacity(f"no free slot on worker {worker!r}, which this resume is pinned to ({elsewhere} free "
                          f"elsewhere in pool {pool!r}): resume without `worker` to be placed anywhere, or suspend "
                          "one of that worker's sessions; retry later", retry_after_s=self.settings.api.retry_after_s,
                          details={"pool": pool, "worker": worker, "freeElsewhere": elsewhere})

    def _no_room(self, pool: str, since_m: float) -> StoreUnavailable | None:
        """The answer to a wait for a slot of ``pool`` that ran out (begun at monotonic ``since_m``) when
        suspending an idle session to make room failed meanwhile because the snapshot store is
        unavailable: that is why there was no slot, and what to fix (it was 503 ``no_capacity``, which
        points at the pool's size: fresh-user run). None otherwise."""
        at, e = self._room_failed
        if e is None or at < since_m:
            return None
        return StoreUnavailable(f"no free slot in pool {pool!r}, and making room (suspending an idle session) "
                                f"failed: {e.message}", retry_after_s=e.retry_after_s or self.settings.api.retry_after_s,
                                details={**(e.details or {}), "pool": pool})

    async def _capacity_coming(self, pool: str, since: float) -> tuple[int, CapacityNote | None, bool]:
        """(workers starting for ``pool``, why none can come (None: nothing blocks), whether the
        controller has yet to count what waits since ``since``): from this process's pool controller, or from the note of the
        controller in another process (one Redis read; see ``substrate.demand``). Undecided lasts at
        most ``pool.demand_ttl_s`` from ``since``; with no (fresh) note nothing is coming."""
        local = self.starting.get(pool, 0)
        if local > 0 or self.board is None:
            return local, self.capacity_blocked.get(pool), False
        note = await self.board.capacity(pool)
        if note.at == 0:
            return 0, None, False
        undecided = not self.board.seen(note, since) and time.time() - since < self.board.ttl_s
        return note.starting, note if note.blocked else None, undecided

    def demand_by_pool(self) -> dict[str, PoolDemand]:
        """This process's demand per pool, as the pool controller counts it (``substrate.demand``)."""
        pools = set(self.waiting_by_pool) | set(self._activating) | set(self.parked_by_pool)
        flight = self.in_flight_by_pool
        out = {}
        for p in pools | set(self.activations_total):
            w, f, g = self.waiting_by_pool.get(p, 0), flight.get(p, 0), self.gated_by_pool.get(p, 0)
            # a parked wake not yet at placement counts as waiting, once (as PoolController counts it);
            # one waiting for an activation permit is not demand (substrate.admission)
            out[p] = PoolDemand(w + max(0, self.parked_by_pool.get(p, 0) - w - f - g), f,
                                self.activations_total.get(p, 0))
        return out

    async def publish_demand(self) -> None:
        """Write this process's demand for a pool controller in another process (no-op without a board)."""
        if self.board is not None:
            await self.board.publish_demand(self.demand_by_pool())

    def _announce_demand(self, pool: str) -> None:
        """A placement starts waiting: publish the demand and poke the controller now, off the request's
        path (one announcement in flight at a time; the periodic publish covers the rest)."""
        if self.board is None or (self._announce is not None and not self._announce.done()):
            return
        board = self.board

        async def go() -> None:
            try:
                await board.publish_demand(self.demand_by_pool(), force=True)
                await board.wanted(pool)
            except Exception:  # noqa: BLE001 - the periodic publish retries
                log.warning("demand announcement failed", extra={"pool": pool}, exc_info=True)

        self._announce = asyncio.create_task(go())

    @property
    def waiting_for_slots(self) -> int:
        """Placements waiting for a slot, all pools."""
        return sum(self.waiting_by_pool.values())

    async def _claim_in(self, pool: str, sid: str, worker: str | None) -> tuple[WorkerRecord, int] | None:
        """Claim a free slot on the best candidate of the view (None if none has one)."""
        pinned = [w for w in self.view.workers.values() if worker is None or w.id == worker]
        # a pinned placement tries its worker even if a call could not reach it: the caller named it, and
        # its failure (``worker_unavailable``) says more than a wait for a slot there (``no_capacity``)
        for w in candidates(pinned, pool, pack=self.settings.pool.placement == "pack",
                            exclude=self.view.unreachable if worker is None else ()):
            slot = await self.directory.claim_slot(w.id, sid)
            if slot >= 0:
                w.freeSlots = max(0, w.freeSlots - 1)
                if w.warmSlots:  # this placement takes one (the worker reports the rest at its next beat)
                    w.warmSlots -= 1
                return w, slot
            w.freeSlots = 0  # the view was stale: skip it until the next refresh
        return None

    def _slot_queue(self, pool: str) -> SlotQueue[WorkerRecord]:
        q = self._queues.get(pool)
        if q is None:
            async def claim(sid: str, pin: str | None) -> tuple[WorkerRecord, int] | None:
                return await self._claim_in(pool, sid, pin)

            async def make_room(tenant: str, count: int) -> int:
                # only for the waiters the pool controller has sized the pool for: for the others a
                # worker is (or may be) starting: they wait for it
                count = min(count, self.room_for(pool, self._queues[pool].pending()))
                if count <= 0:
                    return 0
                # the controller allowed it on capacity it saw; the queue's view may be older (a worker
                # that registered since its last refresh, whose registration is what let the controller
                # say no more is starting): read the registry again, decided above, and serve the
                # waiters from what it shows before suspending anyone (an e2e burst on a slow machine
                # suspended 2 sessions with 10 free slots registered)
                await self.view.refresh()
                if candidates(self.view.workers.values(), pool, exclude=self.view.unreachable):
                    self._queues[pool].notify()
                    return 0
                return await self._suspend_lru(pool, self.settings.api.pressure_min_idle_s, tenant=tenant,
                                               count=count)

            async def release(w: WorkerRecord, slot: int, sid: str) -> None:
                await self.directory.release_slot(w.id, slot, sid)

            q = self._queues[pool] = SlotQueue(claim, refresh=self.view.refresh, make_room=make_room,
                                               release=release)
        return q

    def slot_freed(self, pool: str | None = None) -> None:
        """This process freed a slot (or a worker came up): serve the waiters now."""
        for name, q in self._queues.items():
            if pool is None or name == pool:
                q.notify()

    @contextlib.contextmanager
    def _activation(self, pool: str) -> Iterator[_Activated]:
        """Count one activation (create or wake) from its start to RUNNING or failure; one the block
        made RUNNING (it set the yielded ``worker``) stays in flight until its worker counted it
        (``_uncounted``)."""
        self.activations_total[pool] = self.activations_total.get(pool, 0) + 1
        self._activating[pool] = self._activating.get(pool, 0) + 1
        made = _Activated()
        try:
            yield made
            if made.worker is not None:
                q = self._uncounted_by_pool.setdefault(pool, deque())
                now = time.time()
                q.append((now, made.worker))
                # pruned here too, oldest first: ``_uncounted`` runs only while placements wait, and the
                # deque must not grow meanwhile
                while q and q[0][0] < now - self.settings.worker.active_window_s:
                    q.popleft()
        finally:
            self._activating[pool] -= 1
            self.slot_freed(pool)  # a failed activation gave its slot back; a done one may free others

    def limiter(self, pool: str) -> ActivationLimiter:
        """``pool``'s activation limiter in this process (made on first use from ``settings.api``)."""
        lim = self.limiters.get(pool)
        if lim is None:
            api = self.settings.api
            lim = self.limiters[pool] = ActivationLimiter(LimiterSettings(
                initial=api.activation_limit_initial, min_limit=api.activation_limit_min,
                max_limit=api.activation_limit_max, tolerance=api.activation_latency_tolerance))
        return lim

    @contextlib.asynccontextmanager
    async def _admitted(self, pool: str, sid: str) -> AsyncIterator[_Admission]:
        """Hold one of ``pool``'s activation permits for the block (``substrate.admission``); waits for
        it up to ``api.start_wait_s``, then raises ``NoCapacity`` (503 ``no_capacity``, reason
        ``activations_saturated``). The block sets the yielded ``latency_s`` when its worker call
        succeeded."""
        lim = self.limiter(pool)
        self.gated_by_pool[pool] = self.gated_by_pool.get(pool, 0) + 1
        self._gated.add(sid)
        metrics.ACTIVATIONS_QUEUED.labels(pool=pool).set(self.gated_by_pool[pool])
        try:
            await lim.acquire(self.settings.api.start_wait_s)
        except LimiterTimeout as e:
            raise NoCapacity(f"activations of pool {pool!r} are saturated ({e}); retry later",
                             retry_after_s=self.settings.api.retry_after_s,
                             details={"pool": pool, "reason": "activations_saturated"}) from None
        finally:
            self.gated_by_pool[pool] -= 1
            self._gated.discard(sid)
            self._waited(sid)
            metrics.ACTIVATIONS_QUEUED.labels(pool=pool).set(self.gated_by_pool[pool])
        adm = _Admission()
        try:
            yield adm
        finally:
            lim.release(adm.latency_s)
            metrics.ACTIVATION_LIMIT.labels(pool=pool).set(lim.limit.value)

    @property
    def in_flight_by_pool(self) -> dict[str, int]:
        """Activations past placement that their worker's heartbeat has not counted yet, per pool: those
        under way that are not waiting for a slot or a permit (their slots are claimed or about to be)
        and, while placements of the pool wait for a slot, those RUNNING since their worker last counted
        its active slots (``_uncounted``): only then does the demand decide between starting a worker
        and suspending idle sessions; counted always, they cost 7-11 % more slot-seconds on a 400x replay
        and slowed back-to-back wakes (a worker started for sessions already deleted)."""
        return {p: max(0, n - self.waiting_by_pool.get(p, 0) - self.gated_by_pool.get(p, 0))
                + (self._uncounted(p) if self.waiting_by_pool.get(p, 0) > 0 else 0)
                for p, n in self._activating.items()}

    def _uncounted(self, pool: str) -> int:
        """How many of this process's activations of ``pool`` became RUNNING after their worker last
        counted its ``activeSlots`` (``WorkerRecord.activeSlotsAt``, as the view last read it): their
        slots show as used but not active, so without them the pool controller saw a burst's new
        sessions as neither in flight nor active for up to a heartbeat, sized the pool below the
        waiters still to come, and let them suspend idle sessions (an e2e burst on a loaded machine:
        8 pressure suspensions while the pool could still grow by a worker). One is dropped once a
        count after it is seen, its worker is gone from the view, or ``worker.active_window_s`` after
        it became RUNNING: an activation is activity, held as long as a turn's would be counted (held
        until the next heartbeat and view refresh, it also doubled as demand with the count that had
        it). Activity shorter than a heartbeat used to go uncounted: on a 400x replay, whose compressed
        active window (0.3 s) is shorter than the heartbeat (1 s), counting it costs 7-11 % more
        slot-seconds (docs/replays/gentd26-2024-11-26/report-2026-12-05-uncounted-ab.md). A count taken
        between the worker's activation and this process's RUNNING keeps it until then (a brief
        overcount). O(activations of one active window)."""
        q = self._uncounted_by_pool.get(pool)
        if not q:
            return 0
        horizon = time.time() - self.settings.worker.active_window_s
        workers = self.view.workers
        keep: deque[tuple[float, str]] = deque()
        per_worker: dict[str, int] = {}
        for t, wid in q:
            w = workers.get(wid)
            if t > horizon and w is not None and (w.activeSlotsAt is None or w.activeSlotsAt < t):
                keep.append((t, wid))
                per_worker[wid] = per_worker.get(wid, 0) + 1
        self._uncounted_by_pool[pool] = keep
        # at most a worker's used slots that its count does not call active: a session suspended or
        # deleted since holds no slot (back-to-back wakes, each session deleted after its turn, were held
        # as demand, grew the pool mid-benchmark and slowed the wakes: p50 +5-10 ms)
        total = 0
        for wid, n in per_worker.items():
            w = workers[wid]
            total += min(n, max(0, (w.slots - w.freeSlots) - w.activeSlots))
        return total

    async def _suspend_lru(self, pool: str, min_idle_s: float = 1.0, *, tenant: str = "default",
                           count: int = 1) -> int:
        """Suspend up to ``count`` least-recently-used idle RUNNING sessions of ``pool`` (idle at least
        ``min_idle_s``); returns how many were suspended. Fairness: a ``tenant`` at or over its share of
        the pool's slots only displaces its own sessions.

        The pool's sessions are read once per ``min(_LRU_SCAN_TTL_S, min_idle_s)`` (``_LruScan``), not
        at each call: the slot queue asks for room every round (``poll_s``) while its waiters find no
        slot, and the read is O(sessions of the pool). A session missing from a scan became RUNNING
        after it, so it cannot have been idle ``min_idle_s`` before the next scan; each candidate's
        record is read again when it is chosen, and its worker refuses it if it is busy or was active
        within ``min_idle_s``."""
        scan = self._lru_scans.get(pool)
        ttl = min(_LRU_SCAN_TTL_S, min_idle_s)
        if scan is None or time.monotonic() - scan.at >= ttl:
            scan = self._lru_scans[pool] = await self._scan_lru(pool)
        now = time.time()
        order = victim_order(tenant, scan.held, scan.pool_slots,
                             [(sid, owner) for last, sid, owner in scan.order if now - last >= min_idle_s])
        return await self._suspend_victims(order, count, min_idle_s, skipped="pressure suspend skipped",
                                           scan=scan, requester=tenant)

    async def _scan_lru(self, pool: str) -> _LruScan:
        """One read of ``pool``'s sessions on READY workers: their slot maps and, per session, only its
        state, last activity and tenant (two pipelined round trips)."""
        workers = [w for w in list(self.view.workers.values())  # a recovery may drop workers while we await
                   if w.pool == pool and w.state == WorkerState.READY]
        slots = await self.directory.slots_of([w.id for w in workers])
        sids = [sid for m in slots.values() for sid in m.values()]
        held: dict[str, int] = {}
        order: list[tuple[float, str, str]] = []
        for sid, state, last, owner in await self.directory.session_activity(sids):
            held[owner] = held.get(owner, 0) + 1
            if state == SessionState.RUNNING.value:
                order.append((last, sid, owner))
        order.sort()
        return _LruScan(at=time.monotonic(), order=order, held=held, pool_slots=sum(w.slots for w in workers))

    async def _suspend_victims(self, order: list[str], count: int, min_idle_s: float, *, skipped: str,
                               recs: dict[str, SessionRecord] | None = None, scan: _LruScan | None = None,
                               requester: str = "") -> int:
        """Suspend up to ``count`` of the sessions ``order`` names (least recently used first), reason
        ``pressure``; a session that refuses (busy since it was read, or moved) is logged as
        ``skipped`` and the next one is tried. ``recs``: their records, if read already; else each
        batch's records are read now, and one no longer RUNNING or idle ``min_idle_s`` is passed
        over. ``scan``: the ``_LruScan`` ``order`` came from; every session tried is taken out of it
        (another call does not try it again before the next scan), and its holdings move: the victim's
        tenant holds one slot fewer, ``requester`` (the tenant whose waiter the freed slot serves; "" none)
        one more, so a later call before the next scan judges fairness on what the pool holds now (a
        fresh-user run: each own session suspended for a tenant at its share counted as a slot it had
        given up, and its next waiter then suspended another tenant's). Returns how many were suspended."""
        async def one(rec: SessionRecord) -> bool:
            try:
                await self.suspend(rec, idle_s=min_idle_s, reason="pressure")
            except SubstrateError as e:
                if e.code != "session_evicted":  # evicted: its slot is free all the same (``Worker._evict``)
                    log.info(skipped, extra={"session": rec.id, "code": e.code})
                    if isinstance(e, StoreUnavailable):  # the waiters' answer names it (see ``_no_room``)
                        self._room_failed = (time.monotonic(), e)
                    return False
                log.warning("session evicted under slot pressure: its suspend was refused",
                            extra={"session": rec.id, "code": (e.details or {}).get("refused")})
            if scan is not None:
                scan.held[rec.tenant] = max(0, scan.held.get(rec.tenant, 0) - 1)
                if requester:
                    scan.held[requester] = scan.held.get(requester, 0) + 1
            return True

        # ``count`` distinct victims at once (a queue of waiters needs as many slots; suspending them one
        # after the other would make the last waiter wait for all the snapshots); the next ones in LRU
        # order only for victims that refused (busy). Spares suspended alongside used to take 3 of a
        # tenant's sessions for one waiter's 1 slot.
        freed, i = 0, 0
        while freed < count and i < len(order):
            batch = order[i:i + count - freed]
            i += len(batch)
            if scan is not None:
                tried = set(batch)
                scan.order = [c for c in scan.order if c[1] not in tried]
            if recs is not None:
                chosen = [recs[sid] for sid in batch]
            else:
                now = time.time()
                chosen = [r for r in await self.directory.get_sessions(batch)
                          if r.state == SessionState.RUNNING and now - r.lastActiveAt >= min_idle_s]
            freed += sum(await asyncio.gather(*(one(r) for r in chosen)))
        return freed

    async def _with_running_room(self, rec: SessionRecord, template: ActorTemplate,
                                 take: Callable[[], Awaitable[None]]) -> None:
        """``take()`` (a quota check or take for ``rec``); if it is refused by a full ``maxRunning``
        (429 ``quota_max_running``, the tenant's or ``template``'s) and ``quota.suspend_idle_for_running``
        is on, suspend the tenant's least recently used session idle at least ``api.pressure_min_idle_s``
        (reason ``pressure``; of ``template`` for the template's limit) and ``take()`` once more. Raises
        the refusal if no session could be suspended, and whatever the second ``take()`` raises (another
        call may have taken the freed place first). A fresh-user run: a tenant at its limit got 429 while
        its own sessions sat idle, until their maxIdleTime; slot pressure suspends idle sessions, the
        running quota did not."""
        try:
            await take()
        except TooManyRequests as e:
            if e.code != "quota_max_running" or not self.settings.quota.suspend_idle_for_running:
                raise
            only = template.name if (e.details or {}).get("scope") == "template" else None
            if not await self._suspend_for_running(rec.tenant, only, exclude=rec.id):
                raise
            await take()

    async def _suspend_for_running(self, tenant: str, template: str | None, *, exclude: str) -> bool:
        """Suspend one of ``tenant``'s sessions holding a running place (of ``template``, if given), least
        recently used first among those idle at least ``api.pressure_min_idle_s`` (never ``exclude``);
        True once one is suspended, False if none could be."""
        assert self.quotas is not None
        min_idle_s = self.settings.api.pressure_min_idle_s
        sids = [s for s in await self.quotas.running(tenant, template) if s != exclude]
        recs = {r.id: r for r in await self.directory.get_sessions(sids) if r.tenant == tenant}
        order = lru_victims([(r.id, r.lastActiveAt, r.state == SessionState.RUNNING) for r in recs.values()],
                            min_idle_s=min_idle_s)
        return await self._suspend_victims(order, 1, min_idle_s, skipped="quota suspend skipped", recs=recs) > 0

    # ------------------------------------------------------------------------------------- create
    async def create(self, rec: SessionRecord, template: ActorTemplate) -> SessionRecord:
        """Create and start a session in three directory round trips: claim a slot; write the record
        already STARTING on that slot, with the epoch read with the ID check (1, or above a deleted
        namesake's; create-if-absent: 409 on a taken ID, and the slot is given back); after the worker activated it, CAS STARTING->RUNNING. Raises Conflict, NoCapacity,
        WorkerUnavailable, DirectoryUnavailable; on any error nothing of the session remains, unless the
        state manager's deadline had already rolled it to SUSPENDED (see ``_undo_create``)."""
        with self._activation(self.catalog.pool_for(template).name) as made:
            for attempt in range(self.max_fenced_retries + 1):
                try:
                    done = await self._create(rec, template)
                    made.worker = done.worker
                    return done
                except _WorkerLostCreate as lost:
                    # the worker chosen was past its own lease (a loaded machine delayed its heartbeat),
                    # refused the connection (it died and its lease has not run out yet: fresh-user tester
                    # 37 got 502 for a second after a kill -9 while other workers had free slots), or
                    # went away during the activation (killed, frozen past its lease: tester 39)
                    if attempt >= self.max_fenced_retries:
                        raise lost.error from None
                    if lost.kept:
                        # the lost worker's recovery (or the deadline roll) kept the session SUSPENDED
                        # before the undo: it is this create's own session, with nothing in it yet (no turn
                        # ran); placing it again as a new create could only answer 409 session_exists
                        # (tester 39), so it is woken on another worker instead
                        log.info("create's session kept; woken on another worker",
                                 extra={"session": rec.id, "code": lost.error.code})
                        try:
                            await self.wake_retrying(rec.id, tenant=rec.tenant)
                            done = await self.directory.get_session(rec.id)
                        except NotFound as gone:
                            # a DELETE won the race meanwhile, as in ``_create_admitted``: 410, not the wake's
                            # 404 (tester 43: a create answered 404 ``session_not_found``)
                            raise SessionDeleted(f"session {rec.id!r} was deleted while it was starting") from gone
                        made.worker = done.worker
                        return done
                    # undone: nothing of the session remains, so place it again on another worker
                    log.info("create retried on another worker", extra={"session": rec.id, "code": lost.error.code})
            raise AssertionError("unreachable")

    @property
    def create_hold_s(self) -> float:
        """The longest (s) a create can take from taking its quota places to writing its record: the
        repair pass keeps record-less places that long (``substrate.quotas``, "Creates in flight").

        In between, ``_create`` waits for an activation permit (``_admitted``: up to ``api.start_wait_s``)
        and for a slot (``_place``: the slot queue's ``max(api.start_wait_s, api.slot_wait_s)``; with a
        pool controller in another process, the same deadline), and makes a few Redis round trips
        outside those waits (slot claims, a registry read, a capacity note, the record write), each up to
        ``redis.socket_timeout_s`` and retried once on a closed connection: ten socket timeouts cover
        them and a loaded machine's event-loop lag. Too long only delays the drop of a crashed create's
        places; too short lets the repair drop a live create's places (and admit creates over the
        limits). The repair adds slack: it drops at the second pass that finds the hold over."""
        api, redis_timeout_s = self.settings.api, self.settings.redis.socket_timeout_s
        return api.start_wait_s + max(api.start_wait_s, api.slot_wait_s) + 10 * redis_timeout_s

    async def _create(self, rec: SessionRecord, template: ActorTemplate) -> SessionRecord:
        t0 = time.perf_counter()
        self.breaker.check(rec.tenant, rec.actorTemplate)
        # the epoch the record will get, read with the ID check (no round trip more): the running place is
        # taken for it at once, so no release naming an older epoch (a deleted namesake's late suspend)
        # can take it; the record is written with at least this epoch (``_create_admitted``)
        epoch = await self.directory.create_epoch(rec.id)
        if epoch is None:
            raise Conflict(f"session {rec.id!r} already exists", code="session_exists")
        rec.epoch = epoch
        # the quota place is taken before placing, so a create over its tenant's quota never holds a slot
        # others need (a full-suite run: with the place taken after the record, 100 concurrent creates
        # over maxRunning 5 took every slot and 11 got 503 no_capacity instead of 429). A second create
        # of an ID whose create is under way is refused here (409), so it holds no place to give back
        if self.quotas is not None:
            quotas = self.quotas
            hold_s = self.create_hold_s
            await self._with_running_room(rec, template, lambda: quotas.acquire(
                rec.tenant, template, rec.id, create=True, epoch=epoch, hold_s=hold_s))
        placing = False
        try:
            async with self._admitted(self.catalog.pool_for(template).name, rec.id) as adm:
                placing = True  # from here on _create_admitted gives the quota back on every way out
                return await self._create_admitted(rec, template, adm, t0)
        except BaseException:
            if not placing:  # not admitted (saturated, or the caller gave up while waiting)
                await self.release_quota(rec, epoch=None, total=True)
            raise

    async def _create_admitted(self, rec: SessionRecord, template: ActorTemplate, adm: _Admission,
                               t0: float) -> SessionRecord:
        """``_create`` from placement on, holding an activation permit (``adm``)."""
        try:
            worker, slot = await self.place(rec.id, template, tenant=rec.tenant)
        except BaseException:
            await self.release_quota(rec, epoch=None, total=True)
            raise
        now = time.time()
        owned = rec.epoch  # the epoch its running place was taken for (``_create``)
        rec.state, rec.worker, rec.slot = SessionState.STARTING, worker.id, slot
        rec.stateDeadline = now + self.settings.state.transition_deadline_s
        try:
            epoch = await self.directory.create_session(rec)  # above any epoch a deleted namesake reached
        except BaseException:
            await self.directory.release_slot(worker.id, slot, rec.id)
            # the places are this create's also when the ID turned out taken: the quota refuses a second
            # create of an ID its own tenant holds or is creating, so a record found here is another
            # tenant's session (IDs are one namespace), and keeping the places leaked them for good (a
            # fresh-user run: 18 places held under another tenant's sessions, then 429 quota_max_total)
            await self.release_quota(rec, epoch=None, total=True)
            raise
        try:
            if self.quotas is not None and epoch != owned:  # a namesake deleted since ``_create`` read it
                self._background(self._own_created_place(rec, template, epoch))
            t_act = time.perf_counter()
            await self._within_lease(worker.id, self.client.activate(
                worker.address, session=rec.id, epoch=epoch, template=template, slot=slot, env=rec.env,
                snapshot=None, tenant=rec.tenant))
            adm.latency_s = time.perf_counter() - t_act
            now = time.time()
            done = await self.directory.transition(
                rec.id, from_states=[SessionState.STARTING], epoch=epoch, to=SessionState.RUNNING,
                set={"lastActiveAt": now}, tenant=rec.tenant)
            if not done.ok:
                if not done.found or done.state == SessionState.DELETED:
                    # a DELETE won the race: this create's session is gone, as a turn's is when a delete
                    # stops it (it was 409 ``conflict`` next to the delete's 204: fresh-user round 12)
                    raise SessionDeleted(f"session {rec.id!r} was deleted while it was starting")
                raise Conflict(f"session {rec.id!r} changed while starting", code="conflict")
        except BaseException as e:
            undone = await self._undo_create(rec, worker, slot, e, epoch)
            if not undone:
                # kept SUSPENDED by its deadline: it holds its total quota, no running one (a wake since
                # then owns a newer epoch's place: the guard leaves it)
                await self.release_quota(rec, epoch=epoch)
            if isinstance(e, SubstrateError) and (_elsewhere(e) or isinstance(e, _LeaseLost)):
                # the worker's doing, not the tenant's: placed again elsewhere (``create``). A worker whose
                # lease ran out during the activation left nothing that can run: the undo fenced its epoch
                # (a call that timed out on a worker within its lease is the caller's to retry: that
                # worker may still be starting the session)
                self._skip_worker(worker.id)
                raise _WorkerLostCreate(e, kept=not undone) from e
            if isinstance(e, SubstrateError) and blames_tenant(e):
                self.breaker.failure(rec.tenant, rec.actorTemplate)
            raise
        self.breaker.success(rec.tenant, rec.actorTemplate)
        metrics.COLD_START_DURATION_SECONDS.labels(template=template.name, pool=worker.pool, kind="create").observe(
            time.perf_counter() - t0)
        rec.state, rec.lastActiveAt, rec.stateDeadline = SessionState.RUNNING, now, None
        return rec

    async def _own_created_place(self, rec: SessionRecord, template: ActorTemplate, epoch: int) -> None:
        """Make the running place a create took this activation's, ``epoch``, when the record got a newer
        epoch than the one the place was taken for (a namesake deleted between ``_create``'s read and the
        record write): a release naming an older epoch, such as a suspend of a deleted session of the same
        ID that answers late, then leaves it alone. A place owned by an older epoch gives way to any such
        release, and the new session ran uncounted until the repair pass (a fresh-user run: 5 RUNNING
        against a running quota of 2 after create/delete/suspend churn on four IDs). Off the create's
        path; never raises (the repair pass reconciles what this misses)."""
        quotas = self.quotas
        if quotas is None:
            return
        try:
            await quotas.acquire(rec.tenant, template, rec.id, create=False, epoch=epoch)
        except Exception:  # noqa: BLE001 - the repair pass reconciles quota from the records
            log.info("could not mark a created session's running place as its own", extra={"session": rec.id},
                     exc_info=True)

    async def _undo_create(self, rec: SessionRecord, worker: WorkerRecord | None, slot: int,
                           cause: BaseException, epoch: int) -> bool:
        """Undo a create that failed after its record was written. True if the session is gone; False if
        the state manager's deadline had already rolled it STARTING -> SUSPENDED: it then stays (a
        retried create was told ``409 session_exists`` about it; deleting it made that session vanish,
        chaos run 2026-12-01), and only this attempt's activation and slot are given back. When the session
        goes, its quota places go first, while its fenced record still keeps the ID taken (a create of the
        same ID right after the delete takes places this release must not give back)."""
        sid = rec.id
        try:
            # fence first: mark the record DELETED with a new epoch, so the worker's reconciliation frees
            # an activation this undo cannot reach (a worker that timed out may still finish activating)
            done = await self.directory.transition(sid, from_states=[SessionState.STARTING], epoch=epoch,
                                                   to=SessionState.DELETED, bump=True)
            if not done.ok:
                if worker is not None and slot >= 0:
                    await self._abandon(sid, worker, slot, epoch)
                return False
            if worker is not None and slot >= 0:
                if isinstance(cause, WorkerUnavailable):
                    await self.check_worker(worker.id)
                try:
                    await self._within_lease(worker.id, self.client.deactivate(worker.address, sid, epoch))
                except SubstrateError:
                    pass
                await self.directory.release_slot(worker.id, slot, sid)
            await self.release_quota(rec, epoch=None, total=True)
            # a stale index entry left by a failure here is skipped (and dropped) by the next listing
            await self.directory.delete_session(sid, tenant=rec.tenant)
        except Exception:  # noqa: BLE001 - the state manager's scans repair what is left
            log.warning("undo of a failed create incomplete", extra={"session": sid}, exc_info=True)
        return True

    # --------------------------------------------------------------------------------------- wake
    async def wake(self, sid: str, *, worker: str | None = None, tenant: str | None = None,
                   audit_action: str | None = "wake", on_started: Callable[[], None] | None = None
                   ) -> tuple[Route, bool]:
        """Make ``sid`` RUNNING and return its route and whether this call woke it.

        Parks the caller while the session resumes (one resume per session per process; other
        processes are arbitrated by the epoch CAS). Bounded by ``park_timeout_s`` and ``max_parked``.
        Raises NotFound, TooManyParked, ResumeTimeout, NoCapacity, StoreUnavailable, SnapshotCorrupt,
        TooManyRequests (quota, tenant share, circuit breaker).

        ``tenant``: the caller's tenant; a session of another tenant is ``NotFound`` (checked before
        anything is woken). ``audit_action``: the audit record's action for the wake (None: the caller
        records it, as the explicit resume API does). ``on_started``: called when this call starts the
        wake (not when it finds the session running or joins a wake under way): the caller that records
        the wake itself records it only then (a fresh-user run: four ``resume ok`` for one wake).
        """
        from substrate.errors import TooManyParked

        rec = await self.directory.get_session(sid)
        if tenant is not None and rec.tenant != tenant:
            raise NotFound(f"session {sid!r} not found", code="session_not_found")
        route = self.route_of(rec)
        if route is not None:
            return route, False
        if self.parked >= self.settings.api.max_parked:
            raise TooManyParked(f"{self.parked} requests already wait for resumes; retry later",
                                retry_after_s=self.settings.api.retry_after_s)
        self.breaker.check(rec.tenant, rec.actorTemplate)
        self.parked_share.enter(rec.tenant, self.settings.api.retry_after_s)
        try:
            return await self._park(sid, rec, worker, audit_action, on_started)
        finally:
            self.parked_share.leave(rec.tenant)

    async def wake_retrying(self, sid: str, *, worker: str | None = None, tenant: str | None = None,
                            audit_action: str | None = "wake", deadline: float | None = None,
                            on_started: Callable[[], None] | None = None) -> tuple[Route, bool]:
        """``wake``, woken again when the session moved while it was being woken.

        Retries StaleEpoch and Conflict with codes ``stale_epoch``/``conflict`` (a deadline roll, another
        router's wake) and WorkerUnavailable ``worker_unavailable`` (the worker chosen for it died while
        restoring it; not when ``worker`` pins the placement: that worker is the answer). At most 12
        attempts, until ``deadline`` (``time.monotonic()`` seconds; default: ``park_timeout_s + lease_s +
        lease_grace_s`` from now, time for a dead worker's lease to lapse), sleeping 0.05 s x attempt
        (at most 0.5 s) between them. Raises what ``wake`` raises, and WorkerUnavailable
        ``session_moving`` when the attempts run out.
        """
        s = self.settings
        if deadline is None:
            deadline = time.monotonic() + s.api.park_timeout_s + s.worker.lease_s + s.worker.lease_grace_s
        retried = ("stale_epoch", "conflict") if worker is not None else ("stale_epoch", "conflict",
                                                                           "worker_unavailable")
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self.wake(sid, worker=worker, tenant=tenant, audit_action=audit_action,
                                       on_started=on_started)
            except NotFound:
                # a delete under way answers after its own record, as a losing delete does (a resume's
                # ``session_not_found`` record came before the delete's ``ok``: fresh-user round 10)
                await self._wait_removed(sid)
                raise
            except (StaleEpoch, Conflict, WorkerUnavailable) as e:
                if e.code not in retried:
                    raise
                if time.monotonic() > deadline or attempt >= 12:
                    raise WorkerUnavailable(f"session {sid!r} kept moving between workers; retry",
                                            code="session_moving", retry_after_s=s.api.retry_after_s) from e
                await asyncio.sleep(min(0.05 * attempt, 0.5))

    async def resume_explicit(self, sid: str, *, worker: str | None = None, tenant: str | None = None,
                              on_started: Callable[[], None] | None = None) -> tuple[Route, SessionRecord]:
        """The explicit resume (``POST /v1/sessions/{id}/resume``): ``wake_retrying``, then the record, which
        must be RUNNING. Returns (route, record). A wake this call starts records itself as ``resume``
        with its own outcome when it ends, as an invoke's wake does (also when the caller's wait ends
        first, 503 ``resume_timeout``: tester 40 found the caller's timeout recorded instead, with no
        worker and the suspended epoch, for a wake that failed later on a frozen worker); the caller
        records the rest (``api.app``). Raises what
        ``wake_retrying`` raises, and Conflict ``conflict`` (409, ``details.state``/``epoch``) when a
        concurrent suspend took the session between the wake and the read: a 200 naming SUSPENDING told
        the caller a resume had held that did not (fresh-user race: 15 of 80 resumes), and a suspend that
        meets a concurrent resume is 409 the same way (``_moved_on``). ``on_started``: as ``wake``'s."""
        route, _ = await self.wake_retrying(sid, worker=worker, tenant=tenant, audit_action="resume",
                                            on_started=on_started)
        cur = await self.directory.get_session(sid)
        if cur.state != SessionState.RUNNING:
            raise Conflict(f"session {sid!r} was suspended by a concurrent call right after this resume woke it "
                           f"(it is {cur.state.value} now, epoch {cur.epoch}); retry",
                           code="conflict", details={"state": cur.state.value, "epoch": cur.epoch})
        return route, cur

    async def _park(self, sid: str, rec: SessionRecord, worker: str | None, audit_action: str | None,
                    on_started: Callable[[], None] | None = None) -> tuple[Route, bool]:
        from substrate.errors import ResumeTimeout

        fut = self._wakes.get(sid)
        if fut is None:
            if on_started is not None:
                on_started()
            fut = asyncio.get_running_loop().create_future()
            self._wakes[sid] = fut
            task = asyncio.create_task(self._wake_once(sid, worker, audit_action, rec))

            def _done(t: asyncio.Task[Route], f: asyncio.Future[Route] = fut) -> None:
                self._wakes.pop(sid, None)
                self._wait_ended.pop(sid, None)
                exc = None if t.cancelled() else t.exception()
                if isinstance(exc, SubstrateError) and exc.status >= 500 and not isinstance(exc, ResumeTimeout):
                    self._wake_failed[sid] = (time.monotonic(), exc.code, exc.message)
                    self._wake_failed.move_to_end(sid)
                    while len(self._wake_failed) > 10_000:
                        self._wake_failed.popitem(last=False)
                elif exc is None and not t.cancelled():
                    self._wake_failed.pop(sid, None)
                if f.done():
                    return
                if t.cancelled():
                    f.cancel()
                elif exc is not None:
                    f.set_exception(exc)
                else:
                    f.set_result(t.result())
            task.add_done_callback(_done)
            fut.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
            # a session parked on its wake wants a slot (demand for the pool controller) until it is woken
            self.parked_by_pool[rec.pool] = self.parked_by_pool.get(rec.pool, 0) + 1
            fut.add_done_callback(lambda _f, p=rec.pool: self.parked_by_pool.__setitem__(
                p, self.parked_by_pool.get(p, 1) - 1))
        self.parked += 1
        metrics.PARKED_REQUESTS.set(self.parked)
        t0 = time.perf_counter()
        budget_s = self.restore_budget_s(rec)
        try:
            try:
                route = await asyncio.wait_for(asyncio.shield(fut), budget_s)
            except asyncio.TimeoutError:
                # a wake still waiting for a permit or a slot has its own bounds (the slot queue's,
                # start_wait_s): waited for; the park timeout is for the restore once it is placed,
                # counted from then: a wake placed just before it ran out had almost no time to restore
                # (an e2e burst under load: 503 resume_timeout for wakes that waited for a new worker)
                ended = self._wait_ended.get(sid)
                if self._waits_for_start(sid, rec.pool):
                    route = await self._wait_for_start(sid, rec.pool, fut, t0, budget_s)
                elif ended is not None and ended > t0:
                    left = ended + budget_s - time.perf_counter()
                    if left <= 0:
                        raise
                    route = await asyncio.wait_for(asyncio.shield(fut), left)
                else:
                    raise
        except asyncio.TimeoutError:
            if await self._deleted_meanwhile(sid, rec.createdAt):  # by another router: no retry brings it back
                raise NotFound(f"session {sid!r} not found", code="session_not_found") from None
            # the time this request waited, not only the restore's budget: a wake waiting for a starting
            # worker waits up to start_wait_s, and "within 5s" after 30 s misled (fresh-user tester 48)
            waited_s = time.perf_counter() - t0
            msg = (f"session {sid!r} did not resume within the {waited_s:.1f} s this request waited (its wake goes "
                   f"on: retry; a wake has {budget_s:g} s to restore once it has a slot)")
            details: dict[str, object] = {}
            blocked = self.capacity_blocked.get(rec.pool)
            if blocked is not None and blocked.blocked:  # why it may not have had a slot
                msg += f"; pool {rec.pool!r}: {blocked.blocked}"
                details["reason"] = blocked.code
            last = self._wake_failed.get(sid)
            if last is not None and time.monotonic() - last[0] < _WAKE_FAILURE_SAID_S:
                ago = time.monotonic() - last[0]
                msg += f"; its previous wake failed {ago:.0f} s ago: {last[1]}: {last[2][:300]}"
                details["previousWake"] = {"code": last[1], "message": last[2][:300], "agoSeconds": round(ago, 1)}
            raise ResumeTimeout(msg, retry_after_s=self.settings.api.retry_after_s, details=details or None) from None
        finally:
            self.parked -= 1
            metrics.PARKED_REQUESTS.set(self.parked)
        metrics.WAKE_WAIT_DURATION_SECONDS.labels(template=rec.actorTemplate).observe(time.perf_counter() - t0)
        return route, True

    def _waited(self, sid: str) -> None:
        """Note that ``sid``'s wait for a slot or a permit ended now, if a parked wake waits on it."""
        if sid in self._wakes:
            self._wait_ended[sid] = time.perf_counter()

    def _waits_for_start(self, sid: str, pool: str) -> bool:
        """True while ``sid``'s activation waits for a permit (``substrate.admission``: bounded by
        ``start_wait_s`` there) or its placement waits for a slot (bounded by the slot queue: no progress
        for ``slot_wait_s``, ``start_wait_s`` in all). Either way the wake has its own bound, and the
        park timeout is for its restore: cutting a wait still served in order, while the pool grew or
        room was made, answered 503 ``resume_timeout`` to 27 of 100 wakes at once after a restart (a
        fresh-user run; only a wait for a worker being started counted before). ``pool``: unused, kept
        for the callers' shape."""
        return sid in self._gated or sid in self._placing

    def restore_budget_s(self, rec: SessionRecord) -> float:
        """How long (s) a request parked on ``rec``'s wake waits for its restore once placed:
        ``api.park_timeout_s``, plus ``api.restore_s_per_file`` for each file of the snapshot it restores
        (``SnapshotRef.files``; a restore's time grows with its files, not its bytes: a 60,000-file
        workspace took ~7 s and its first call got 503 ``resume_timeout`` while the wake went on)."""
        files = rec.snapshot.files if rec.snapshot is not None else 0
        return self.settings.api.park_timeout_s + files * self.settings.api.restore_s_per_file

    async def _wait_for_start(self, sid: str, pool: str, fut: asyncio.Future[Route], t0: float,
                              budget_s: float) -> Route:
        """Wait on a parked wake's future while it waits for a starting worker, until
        ``api.start_wait_s`` after ``t0`` (perf_counter); raises ``TimeoutError`` after. Once placed, the
        restore has ``budget_s`` (``restore_budget_s``)."""
        limit = t0 + max(self.settings.api.start_wait_s, budget_s)
        while True:
            left = limit - time.perf_counter()
            if left <= 0:
                raise asyncio.TimeoutError
            if not self._waits_for_start(sid, pool):
                # placed on the new worker (restoring now): the restore gets one park timeout, as a
                # wake that found a slot at once does
                return await asyncio.wait_for(asyncio.shield(fut), min(left, budget_s))
            try:  # look again each second whether it still waits for the worker (not a tight poll)
                return await asyncio.wait_for(asyncio.shield(fut), min(left, 1.0))
            except asyncio.TimeoutError:
                continue

    async def _wait_settled(self, sid: str, timeout_s: float) -> SessionRecord:
        """Poll until the session leaves its transitional state (another process is moving it)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while True:
            rec = await self.directory.get_session(sid)
            if not rec.state.transitional or time.monotonic() >= deadline:
                return rec
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _wake_once(self, sid: str, worker: str | None = None, audit_action: str | None = None,
                         first: SessionRecord | None = None) -> Route:
        # bounded in time (the caller waits ``park_timeout_s`` at most; this may go on a little longer
        # so that a worker past its lease is recovered and the next request finds the session moved).
        # ``first``: the record the caller has just read (saves a directory round trip on the wake path;
        # a stale one costs nothing but a lost epoch compare-and-set, after which the loop reads again)
        w = self.settings.worker
        deadline = time.monotonic() + self.settings.api.park_timeout_s + w.lease_s + w.lease_grace_s
        fenced = 0
        while time.monotonic() < deadline:
            rec, first = (first, None) if first is not None else (await self.directory.get_session(sid), None)
            route = self.route_of(rec)
            if route is not None:
                return route
            if rec.state.transitional:
                rec = await self._wait_settled(sid, self.settings.api.park_timeout_s)
                continue
            if rec.state == SessionState.RUNNING:  # worker unknown to the view, or past its lease
                await self.view.refresh()
                if self.route_of(rec) is None and not await self.check_worker(rec.worker or "", sid=sid):
                    await asyncio.sleep(0.1)  # alive by its lease: it renews, or expires and is recovered
                continue
            if rec.state not in _WAKEABLE:
                raise NotFound(f"session {sid!r} not found", code="session_not_found")
            try:
                return await self._resume(rec, worker, audit_action)
            except SubstrateError as e:
                # the worker chosen was past its own lease: the resume was rolled back, wake elsewhere
                fenced += 1
                if e.code != "worker_fenced" or fenced > self.max_fenced_retries:
                    raise
        raise Conflict(f"session {sid!r} did not settle while waking; retry", code="conflict")

    async def _resume(self, rec: SessionRecord, pin: str | None = None, audit_action: str | None = None) -> Route:
        try:
            route, woke = await self._resume_held(rec, pin)
        except SubstrateError as e:
            if not isinstance(e, (_LostRace, _DeletedMeanwhile, DirectoryUnavailable)) \
                    and await self._being_deleted(rec.id):
                # lost to a delete (its compare-and-set marked the record DELETED first): like any call
                # after a delete, a 404 with no record of its own; a "wake conflict" (or "wake
                # session_not_found") record was left, and the client told 404 (fresh-user round 10,
                # 4 of 8 races). Whatever the wake failed with: one that waited for a slot in vain
                # while the delete went through left "wake no_capacity" after "delete ok" (tester 34)
                raise _DeletedMeanwhile(f"session {rec.id!r} not found", code="session_not_found") from e
            if audit_action and not isinstance(e, (_LostRace, _DeletedMeanwhile)):
                # the activation it claimed, if it got that far (the record's was the suspended one's: a
                # failed wake of epoch 2 was recorded as epoch 1, fresh-user run 35)
                on, epoch = getattr(e, "claimed", (None, None))
                await self.record(audit_action, rec, result=e.code, reason=rec.reason or "", worker=on, epoch=epoch)
            # a session whose own saved state cannot be loaded is its fault alone: counting it would let
            # one poisoned session close the breaker on every other session of its tenant
            if not isinstance(e, (NoCapacity, Conflict, StateLoadFailed, _DeletedMeanwhile)) and blames_tenant(e):
                self.breaker.failure(rec.tenant, rec.actorTemplate)
            raise
        if audit_action and woke:  # a wake won by another process is recorded there
            await self.record(audit_action, rec, worker=route.worker, epoch=route.epoch, reason=rec.reason or "")
        self.breaker.success(rec.tenant, rec.actorTemplate)
        return route

    async def _resume_held(self, rec: SessionRecord, pin: str | None = None) -> tuple[Route, bool]:
        """``_resume`` within the running quota. Returns the route and whether this call made the
        activation (False: another process won it). Raises ``TooManyRequests`` (429 ``quota_*``) before
        anything is claimed if the quota is full now (a dry check: a wake that will be refused must not
        lazy-suspend anyone for its slot); the binding take follows the claim (``_resume_placed``)."""
        if rec.actorTemplate not in self.catalog.templates:
            # the session's own template, not one the request named: say so, and what can be done
            # (fresh-user round 15: "unknown actorTemplate 'shell' (known: ...)" read as a bad request)
            raise InvalidInput(f"session {rec.id!r} uses actorTemplate {rec.actorTemplate!r}, which this runtime "
                               "no longer defines: restore the template in the config (its snapshot is kept) "
                               "or DELETE the session", code="unknown_template",
                               details={"actorTemplate": rec.actorTemplate, "reason": "template_removed"})
        template = self.catalog.template(rec.actorTemplate)
        if self.quotas is not None:
            quotas = self.quotas
            await self._with_running_room(rec, template, lambda: quotas.acquire(
                rec.tenant, template, rec.id, create=False, epoch=rec.epoch + 1, dry=True))
        pool = self.catalog.pool_for(template).name
        with self._activation(pool) as made:
            t0 = time.perf_counter()  # the wake's place phase includes the wait for a permit
            async with self._admitted(pool, rec.id) as adm:
                route, woke = await self._resume_placed(rec, template, pin, adm, t0)
            if woke:  # a wake another process won is counted by that process
                made.worker = route.worker
            return route, woke

    async def _resume_placed(self, rec: SessionRecord, template: ActorTemplate, pin: str | None,
                             adm: _Admission, t0: float) -> tuple[Route, bool]:
        worker, slot = await self.place(rec.id, template, worker=pin, tenant=rec.tenant)
        placed = time.perf_counter()
        cas = await self.directory.transition(
            rec.id, from_states=_WAKEABLE, epoch=rec.epoch, to=SessionState.RESUMING, bump=True,
            # the pool it runs in now: its template's pool may have been renamed or moved since (a session
            # kept naming a pool that no longer existed, fresh-user run 35)
            set={"worker": worker.id, "slot": slot, "pool": worker.pool}, unset=("suspendReason",),
            deadline_s=self.settings.state.transition_deadline_s, tenant=rec.tenant)
        if not cas.ok:  # another router won the activation: give the slot back and follow it
            await self.directory.release_slot(worker.id, slot, rec.id)
            settled = await self._wait_settled(rec.id, self.settings.api.park_timeout_s)
            route = self.route_of(settled)
            if route is None:
                raise _LostRace(f"session {rec.id!r} is {settled.state.value}", code="conflict")
            return route, False
        epoch = cas.epoch
        if self.quotas is not None:
            # the running place is taken for this activation only now that it is ours: its epoch is unique,
            # so every release below (and a concurrent suspend's, naming the epoch before) gives back only
            # what this call took; taken before the claim, a lost claim or a suspend racing this resume
            # made the place's release ambiguous (fresh-user run: RUNNING sessions left uncounted)
            try:
                await self.quotas.acquire(rec.tenant, template, rec.id, create=False, epoch=epoch)
            except BaseException:
                # refused (a create or wake took the last place since the dry check) or Redis failed:
                # undo the claim, guarded by its epoch; a deadline roll does it if this cannot
                try:
                    await self.directory.transition(rec.id, from_states=[SessionState.RESUMING], epoch=epoch,
                                                    to=SessionState.SUSPENDED, unset=("worker", "slot"),
                                                    tenant=rec.tenant)
                    await self.directory.release_slot(worker.id, slot, rec.id)
                except DirectoryUnavailable:  # retried as soon as Redis answers (see _activate_claimed)
                    self._background(self._roll_back_when_reachable(rec.id, epoch, worker, slot))
                except SubstrateError:
                    pass
                await self.release_quota(rec, epoch=epoch)  # in case Redis failed after taking it
                raise
        try:
            return await self._activate_claimed(rec, template, worker, slot, epoch, t0, placed, adm)
        except BaseException as e:
            # whatever way this activation failed, its place goes (only this epoch's: a wake that claimed
            # the session since owns a newer one)
            if isinstance(e, SubstrateError):  # its audit record names the activation that failed
                e.claimed = (worker.id, epoch)  # type: ignore[attr-defined]
            await self.release_quota(rec, epoch=epoch)
            raise

    async def _activate_claimed(self, rec: SessionRecord, template: ActorTemplate, worker: WorkerRecord,
                                slot: int, epoch: int, t0: float, placed: float,
                                adm: _Admission | None = None) -> tuple[Route, bool]:
        """Activate claimed activation ``epoch`` of ``rec`` on ``worker``'s ``slot`` and move the record
        RESUMING -> RUNNING (see ``_resume_placed``); every failure rolls the record back first.
        ``t0``/``placed``: ``time.perf_counter()`` before and after placement (the route's phase times)."""
        activating = time.perf_counter()
        restored_what = None
        lost_after = loss_base(rec)
        if rec.reason in _LOSSY:
            # say whether older state came back, or none did (no snapshot had been taken yet)
            restored_what = rec.reason if lost_after else f"{rec.reason};snapshot=none"
        phases: tuple[tuple[str, float], ...] = ()
        try:
            answer = await self._within_lease(worker.id, self.client.activate(
                worker.address, session=rec.id, epoch=epoch, template=template, slot=slot, env=rec.env,
                snapshot=rec.snapshot, restored=restored_what, tenant=rec.tenant,
                answers=rec.carriedAnswers or None, restored_at=lost_after if rec.lostAfter is not None else None))
            if adm is not None:
                adm.latency_s = time.perf_counter() - activating
            phases = worker_phases(answer)
        except SubstrateError as e:
            if not isinstance(e, (DirectoryUnavailable, StateLoadFailed)) and \
                    await self._deleted_meanwhile(rec.id, rec.createdAt):
                # a DELETE took the session (and its snapshot objects) while it was being woken: 404, as any
                # call after a delete gets, not the failure the delete caused (fresh-user races: 500
                # snapshot_corrupt "object is missing" after the delete's 204; then, in the store's grace,
                # 503 snapshot_store_unavailable "object missing", 14 of 200)
                await self._abandon(rec.id, worker, slot, epoch)
                raise _DeletedMeanwhile(f"session {rec.id!r} not found", code="session_not_found") from e
            if isinstance(e, SnapshotCorrupt):
                await self._fail_corrupt(rec, epoch, worker, slot, e)
                raise
            if isinstance(e, StateLoadFailed):
                await self._fail_state_load(rec, epoch, worker, slot, e)
                raise
            # back to SUSPENDED (guarded by the epoch: a deadline roll may have done it already), then
            # fence the half-made activation on the worker; its reconciliation frees what this misses.
            # Redis refusing that write too (down, its disk full) is retried in the background as soon as
            # it answers: left to the deadline roll, the session stayed RESUMING, every call 503, for up to
            # a minute after Redis was back (fresh-user round 17)
            try:
                await self.directory.transition(rec.id, from_states=[SessionState.RESUMING], epoch=epoch,
                                                to=SessionState.SUSPENDED, unset=("worker", "slot"),
                                                tenant=rec.tenant)
            except DirectoryUnavailable:
                self._background(self._roll_back_when_reachable(rec.id, epoch, worker, slot))
                raise e from None
            await self._abandon(rec.id, worker, slot, epoch)
            if isinstance(e, WorkerUnavailable):
                if not await self.check_worker(worker.id):
                    # not known dead yet (its lease runs): the wake retried (``wake_retrying``) goes elsewhere
                    # until the worker renews its lease (refused, frozen, or reset: a pooled keep-alive
                    # connection to a killed worker fails as a reset, not a refusal)
                    self.view.mark_unreachable(worker.id, self.settings.worker.lease_s)
            elif e.code == "worker_fenced":
                self._skip_worker(worker.id)
            raise
        reason = rec.message if rec.reason in _LOSSY else None
        restored = RestoredFrom(
            snapshotKey=rec.snapshot.key if rec.snapshot else None,
            snapshotCreatedAt=rec.snapshot.createdAt if rec.snapshot else None,
            snapshotEpoch=rec.snapshot.epoch if rec.snapshot else None,
            reason=rec.reason or "resume", lostAfter=(lost_after or 0.0) if restored_what else None)
        # ``reason`` stays until a newer snapshot is committed (snapshot/commit.py clears it): if this
        # activation is lost before any of its answers is acknowledged, the next wake still restores
        # from the same snapshot and must still say so (chaos run: a loss reported only on answers the
        # client never received)
        settling = time.perf_counter()
        done = await self._settle_running(rec.id, epoch, worker, slot, {"restoredFrom": restored,
                                                                       "lastActiveAt": time.time()},
                                          tenant=rec.tenant)
        phases += (("running", round((time.perf_counter() - settling) * 1000, 1)),)
        if not done.ok:
            # a deadline roll (or a delete) got there first: the activation just made is not the
            # session's any more; drop it and give the slot back, or the worker holds it for good
            await self._abandon(rec.id, worker, slot, epoch)
            raise Conflict(f"session {rec.id!r} changed while resuming", code="conflict")
        if reason:
            metrics.RECOVERIES_TOTAL.labels(reason=rec.reason if rec.reason in ("agent_restarted", "evicted")
                                            else "worker_lost").inc()
        elapsed = time.perf_counter() - t0
        metrics.COLD_START_DURATION_SECONDS.labels(template=template.name, pool=worker.pool, kind="resume").observe(elapsed)
        metrics.RESUME_DURATION_SECONDS.labels(template=template.name).observe(elapsed)
        return Route(worker.id, worker.address, epoch, restored=restored_what, tenant=rec.tenant,
                     place_ms=(placed - t0) * 1000, activate_ms=(time.perf_counter() - activating) * 1000,
                     phases_ms=phases), True

    async def _settle_running(self, sid: str, epoch: int, worker: WorkerRecord, slot: int,
                              fields: dict[str, object], *, tenant: str | None = None) -> CasResult:
        """RESUMING -> RUNNING for activation ``epoch`` (made on ``worker``), riding out a short Redis
        outage: the step is retried with exponential back-off (50 ms doubling to 1 s) for up to half the
        park timeout; a retry that finds the record already RUNNING at ``epoch`` on ``worker`` (the first
        try's answer was lost) counts as done. Returns the transition result. If Redis stays away,
        raises ``DirectoryUnavailable`` and leaves a background task that rolls the claim back (guarded
        by the epoch) once Redis answers: a wake cut off by a Redis restart left the session RESUMING,
        every call to it 503 ``resume_timeout``, until its 60 s deadline (fresh-user run)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.api.park_timeout_s / 2
        delay, tried = 0.05, False
        while True:
            try:
                done = await self.directory.transition(sid, from_states=[SessionState.RESUMING], epoch=epoch,
                                                       to=SessionState.RUNNING, set=fields, tenant=tenant)
                if not done.ok and tried:
                    try:
                        cur = await self.directory.get_session(sid)
                    except NotFound:  # deleted meanwhile: the caller drops the activation
                        return done
                    if cur.state == SessionState.RUNNING and cur.epoch == epoch and cur.worker == worker.id:
                        return CasResult(ok=True, state=SessionState.RUNNING, epoch=epoch)
                return done
            except DirectoryUnavailable:
                tried = True
                if loop.time() + delay > give_up:
                    self._background(self._roll_back_when_reachable(sid, epoch, worker, slot))
                    raise
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def _roll_back_when_reachable(self, sid: str, epoch: int, worker: WorkerRecord, slot: int) -> None:
        """Undo claim ``epoch`` of ``sid`` (RESUMING -> SUSPENDED, then drop the activation and free the
        slot) once Redis answers again, retrying for up to the transition deadline (after which the
        state manager's deadline roll does the same)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.settings.state.transition_deadline_s
        delay = 0.1
        while loop.time() < end:
            try:
                await self.directory.transition(sid, from_states=[SessionState.RESUMING], epoch=epoch,
                                                to=SessionState.SUSPENDED, unset=("worker", "slot"))
                await self._abandon(sid, worker, slot, epoch)
                return
            except DirectoryUnavailable:
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
            except Exception:  # noqa: BLE001 - a background repair never raises; the deadline roll is left
                log.warning("rolling back a wake cut off by Redis failed", extra={"session": sid}, exc_info=True)
                return

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        """Run ``coro`` as a task this activator keeps a reference to until it ends."""
        task = asyncio.create_task(coro)
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _deleted_meanwhile(self, sid: str, created_at: float | None = None) -> bool:
        """Whether ``sid`` was deleted (record gone or DELETED) since this call read it, or, with
        ``created_at`` (the ``createdAt`` of the record read), deleted and made again under the same ID (a
        fresh-user run: a wake restoring a snapshot that the delete's GC removed answered 503 "object
        missing" because the ID already named a new session); False if the directory cannot say (the
        caller then treats the failure as it is)."""
        try:
            cur = await self.directory.get_session(sid)
        except NotFound:
            return True
        except SubstrateError:
            return False
        return cur.state == SessionState.DELETED or (created_at is not None and cur.createdAt != created_at)

    async def _abandon(self, sid: str, worker: WorkerRecord, slot: int, epoch: int) -> None:
        """Drop activation ``epoch`` of ``sid`` on ``worker`` (only that epoch or older) and free its
        slot unless the record points at it again. Best effort: the worker's reconciliation and the
        state manager's repair pass free whatever is left."""
        try:
            await self._within_lease(worker.id, self.client.deactivate(worker.address, sid, epoch))
        except SubstrateError:
            pass
        try:
            cur = await self.directory.get_session(sid)
            if cur.worker == worker.id and cur.slot == slot:
                return
        except NotFound:
            pass
        await self.directory.release_slot(worker.id, slot, sid)

    async def _fail_corrupt(self, rec: SessionRecord, epoch: int, worker: WorkerRecord, slot: int,
                            e: SnapshotCorrupt) -> None:
        """FAILED with the reason; the pointer rolls back to the previous good snapshot (if any)."""
        fields: dict[str, object] = {"reason": "snapshot_corrupt", "message": e.message}
        unset: list[str] = ["worker", "slot"]
        if rec.previousSnapshot is not None:
            fields["snapshot"] = rec.previousSnapshot
            unset.append("previousSnapshot")
        else:
            unset.append("snapshot")
        fields["badSnapshot"] = rec.snapshot.key if rec.snapshot else ""
        await self.directory.transition(rec.id, from_states=[SessionState.RESUMING], epoch=epoch,
                                        to=SessionState.FAILED, set=fields, unset=unset, tenant=rec.tenant)
        if rec.snapshot is not None:  # no longer a kept snapshot: the orphan sweep removes the object
            await self.directory.forget_snapshot(rec.id, rec.snapshot.key)
        await self.directory.release_slot(worker.id, slot, rec.id)
        metrics.RECOVERIES_TOTAL.labels(reason="snapshot_corrupt").inc()

    async def _fail_state_load(self, rec: SessionRecord, epoch: int, worker: WorkerRecord, slot: int,
                               e: StateLoadFailed) -> None:
        """The agent host said the session's restored state cannot be loaded: RESUMING -> FAILED with
        reason ``state_load_failed`` and the message, keeping the snapshot pointer. Not rolled back to
        an older snapshot (that would drop acknowledged turns without a word, and an older one of the
        same agent likely holds the same data); kept so that a fixed template can load it on a later
        wake, while DELETE works as for any session. The half-made activation and its slot are given
        back. Guarded by ``epoch`` (a deadline roll that got there first wins)."""
        await self.directory.transition(
            rec.id, from_states=[SessionState.RESUMING], epoch=epoch, to=SessionState.FAILED,
            set={"reason": "state_load_failed", "message": e.message}, unset=("worker", "slot"), tenant=rec.tenant)
        await self._abandon(rec.id, worker, slot, epoch)

    # -------------------------------------------------------------------------------- suspend/delete
    async def suspend(self, rec: SessionRecord, *, idle_s: float | None = None,
                      reason: str = "explicit") -> SnapshotRef | None:
        """Suspend a RUNNING session through its worker (snapshot, commit, free slot). An explicit
        suspend waits at most ``api.suspend_wait_s`` for a running turn to end (then Conflict ``busy``);
        a drain waits for it; an idle one (``idle_s``) never does. Returns the snapshot the suspend
        committed, None if the session's worker is unknown (``check_worker`` ran instead).

        Raises Conflict (busy / not RUNNING), StoreUnavailable (stays RUNNING), WorkerUnavailable."""
        if rec.state != SessionState.RUNNING or not rec.worker:
            raise Conflict(f"session {rec.id!r} is {rec.state.value}, not RUNNING", code="invalid_state")
        address = await self._worker_address(rec.worker)
        if address is None:
            await self.check_worker(rec.worker)
            return None
        t0 = time.perf_counter()
        auto = reason != "explicit"  # automatic: no API call records it, so this does (as the system)
        try:
            ref = await self._within_lease(rec.worker, self.client.suspend(
                address, rec.id, rec.epoch, idle_s=idle_s, tenant=rec.tenant,
                wait_s=self.settings.api.suspend_wait_s if reason == "explicit" else None, reason=reason))
        except SubstrateError as e:
            if isinstance(e, WorkerUnavailable):
                await self.check_worker(rec.worker)
            if e.code == "session_evicted":  # the worker ended it and freed its slot (and recorded it)
                self._suspend_failing.pop(rec.id, None)
                self.slot_freed(rec.pool or None)
            elif auto and e.code not in _SKIPPED:  # an attempt that failed (the session stays RUNNING)
                await self._record_suspend_failure(rec, reason, e.code)
            raise
        # only the place of the activation this suspend ended: a resume racing it may have claimed the
        # next epoch and taken the place again already
        await self.release_quota(rec, epoch=rec.epoch)
        if auto:
            self._suspend_failing.pop(rec.id, None)
            await self.record("suspend", rec, reason=reason, who=SYSTEM)
        metrics.SUSPEND_DURATION_SECONDS.labels(template=rec.actorTemplate).observe(time.perf_counter() - t0)
        metrics.SUSPENSIONS_TOTAL.labels(template=rec.actorTemplate, reason=reason).inc()
        self.slot_freed(rec.pool or None)
        return ref

    async def suspend_explicit(self, rec: SessionRecord, *, on_committed: Callable[[], None] | None = None
                               ) -> SessionRecord:
        """The suspend API's answer for ``rec`` (as the caller read it): the SUSPENDED record, whatever
        concurrent suspends and resumes do (a fresh-user run got 202s naming SUSPENDING, RUNNING or
        RESUMING, and stale snapshots):

        * SUSPENDED: returned as it is (a suspend is idempotent);
        * RUNNING: suspended; returns the record as this suspend's commit left it (``committed_view``),
          also when a concurrent resume has moved the session on since;
        * SUSPENDING (a suspend under way): waits for it to end (``suspend_wait_s`` plus the snapshot's
          ``transition_deadline_s`` at most), then returns the SUSPENDED record; if that suspend failed
          and the session is RUNNING again at the same epoch, suspends it itself;
        * RESUMING, or moved on to a newer activation (a concurrent wake): ``Conflict`` 409 ``conflict``
          with ``details.state``: retry;
        * any other state (PENDING, STARTING, FAILED: no suspend applies): ``Conflict`` 409
          ``invalid_state``;
        * deleted meanwhile: ``NotFound`` 404 once the record is gone, so that the delete's audit record
          (written just before its removal) comes first in the trail, as a concurrent delete's 404 does
          (fresh-user run: the suspend's ``session_not_found`` came before the ``delete ok``, 4 of 4).

        ``on_committed`` is called when this call's own suspend committed the snapshot (not when it found
        the session suspended, waited for another call's suspend or lost to one): the audit trail records
        the transition, not each call (a fresh-user run saw five ``suspend ok`` records for one)."""
        try:
            return await self._suspend_explicit(rec, on_committed)
        except NotFound:
            await self._wait_removed(rec.id)
            raise

    async def _suspend_explicit(self, rec: SessionRecord, on_committed: Callable[[], None] | None = None
                                ) -> SessionRecord:
        """:meth:`suspend_explicit` but for the wait on a delete under way."""
        cur = rec
        for _ in range(3):  # a suspend we waited for may fail (RUNNING again): try it ourselves, bounded
            if cur.state == SessionState.SUSPENDED:
                return cur
            if cur.epoch != rec.epoch or cur.state == SessionState.RESUMING:
                raise self._moved_on(cur)
            if cur.state == SessionState.SUSPENDING:
                cur = await self._suspend_ended(cur)
                continue
            if cur.state != SessionState.RUNNING or not cur.worker:
                raise Conflict(f"session {rec.id!r} is {cur.state.value}; only a RUNNING session can be suspended",
                               code="invalid_state", details={"state": cur.state.value})
            try:
                ref = await self.suspend(cur)
            except WorkerUnavailable:
                # the worker went away after its commit, before its answer arrived: the commit stands, and
                # the caller is told it succeeded (fresh-user round 15: 502 for a suspend that had
                # committed, in 4 of 12 kills of the worker right after the call)
                if (done := await self._committed_by_lost_worker(cur)) is not None:
                    if on_committed is not None:
                        on_committed()
                    return done
                raise
            except SubstrateError as e:
                # the activation read is gone (a concurrent suspend, resume or crash), or the worker found
                # the record no longer RUNNING: the directory decides the answer (never the worker's code)
                if e.code not in ("not_active", "stale_epoch", "invalid_state"):
                    raise
                return await self.after_lost_suspend(cur, e)
            if ref is None:  # the worker is unknown: check_worker recovered the session, or it stays
                cur = await self.directory.get_session(rec.id)
                if cur.state == SessionState.RUNNING and cur.epoch == rec.epoch:  # not a 202 naming RUNNING
                    raise WorkerUnavailable(f"session {rec.id!r}: its worker {cur.worker!r} is not known "
                                            "to this router; retry")
                continue
            if on_committed is not None:
                on_committed()
            return await self.committed_view(cur, ref)
        raise self._moved_on(cur)

    async def _committed_by_lost_worker(self, before: SessionRecord) -> SessionRecord | None:
        """The record if a suspend of ``before`` (RUNNING) committed: SUSPENDED at the same epoch with a
        snapshot of that epoch other than the one it had, and no loss marked (a recovery of a dead worker
        bumps the epoch and marks one). None otherwise, or if the directory cannot say."""
        try:
            cur = await self.directory.get_session(before.id)
        except SubstrateError:
            return None
        snap = cur.snapshot
        if cur.state == SessionState.SUSPENDED and cur.epoch == before.epoch and not cur.reason and snap is not None \
                and snap.epoch == before.epoch and (before.snapshot is None or snap.key != before.snapshot.key):
            return cur
        return None

    def _moved_on(self, cur: SessionRecord) -> Conflict:
        return Conflict(f"session {cur.id!r} was resumed or suspended by a concurrent call while this suspend "
                        f"reached it (it is {cur.state.value} now, epoch {cur.epoch}); retry",
                        code="conflict", details={"state": cur.state.value, "epoch": cur.epoch})

    async def _suspend_ended(self, rec: SessionRecord) -> SessionRecord:
        """Wait until the suspend under way of ``rec`` (SUSPENDING) ends and return the record then. It
        is bounded: the suspend waits for no turn once SUSPENDING, and the state manager rolls one past
        its ``transition_deadline_s`` back to RUNNING. Past that (and ``suspend_wait_s``): ``Conflict``."""
        limit = time.monotonic() + self.settings.api.suspend_wait_s + self.settings.state.transition_deadline_s
        delay = 0.005
        while True:
            cur = await self.directory.get_session(rec.id)
            if cur.state != SessionState.SUSPENDING or cur.epoch != rec.epoch:
                return cur
            if time.monotonic() >= limit:
                raise self._moved_on(cur)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def committed_view(self, before: SessionRecord, ref: SnapshotRef) -> SessionRecord:
        """The record as an explicit suspend of ``before`` (RUNNING) left it by committing ``ref``. Read
        back if it still shows that commit; when a concurrent resume (or delete) has moved it on since,
        made from ``before`` with what the commit changed (state, snapshot, ``suspendReason`` explicit,
        worker and slot cleared: the 202 said ``suspendReason: null``, which the README keeps for
        recoveries, in a fresh-user run of suspends racing resumes), and the
        turns and loss fields of the current record if it still holds ``ref`` (a resume leaves them),
        so the answer never names a later state or a snapshot other than the one committed."""
        try:
            cur = await self.directory.get_session(before.id)
        except NotFound:
            cur = None
        if cur is not None and cur.state == SessionState.SUSPENDED and cur.epoch == before.epoch \
                and cur.snapshot is not None and cur.snapshot.key == ref.key:
            return cur
        update: dict[str, object] = {
            "state": SessionState.SUSPENDED, "snapshot": ref, "worker": None, "slot": None,
            "suspendReason": "explicit", "stateDeadline": None, "updatedAt": time.time(),
            "previousSnapshot": (before.snapshot or before.previousSnapshot)
            if self.settings.snapshot.retention > 1 else None}
        if cur is not None and cur.snapshot is not None and cur.snapshot.key == ref.key:
            update.update(turns=max(cur.turns, before.turns), reason=cur.reason, message=cur.message,
                          lostAfter=cur.lostAfter, previousSnapshot=cur.previousSnapshot)
        return before.model_copy(update=update)

    async def after_lost_suspend(self, rec: SessionRecord, e: SubstrateError) -> SessionRecord:
        """An explicit suspend of ``rec`` (read RUNNING) was refused by its worker with ``not_active`` or
        ``stale_epoch``: the activation it named is gone. Decide from the directory what the caller is
        told (never those worker codes: a public answer names the session's state):

        * suspended now, by a concurrent suspend or an agent's crash: returns the record (202, as for a
          suspended session); suspending: waits for that suspend to end (``_suspend_ended``), and returns
          the SUSPENDED record, never a SUSPENDING one;
        * recovered from a lost worker meanwhile (SUSPENDED, ``worker_lost``, a newer epoch): raises
          ``WorkerUnavailable`` (502 ``worker_unavailable``, ``details.state`` SUSPENDED), as a suspend
          whose worker dies under it answers;
        * still RUNNING at that epoch on that worker, which says it has no such activation: the activation
          was lost; repaired to SUSPENDED (``repair_lost_activation``), returns the record;
        * anything else (resumed again by a concurrent call, moving): raises ``Conflict`` (409
          ``conflict``) naming the state, to retry. ``NotFound`` (404) if the session was deleted."""
        cur = await self.directory.get_session(rec.id)
        if (e.code == "not_active" and cur.state == SessionState.RUNNING and cur.epoch == rec.epoch
                and cur.worker == rec.worker and rec.worker):
            await self.repair_lost_activation(rec.id, rec.worker, rec.epoch)
            cur = await self.directory.get_session(rec.id)
        if cur.state == SessionState.SUSPENDING:
            cur = await self._suspend_ended(cur)
        if cur.state == SessionState.SUSPENDED and cur.reason == "worker_lost" and cur.epoch != rec.epoch:
            # not suspended but recovered: its worker was declared lost while this suspend reached it (a
            # worker frozen past its lease answers once it runs again: tester 39 got 202 with no snapshot
            # for the acknowledged state that was lost); the README's answer to a suspend whose worker
            # dies under it
            raise WorkerUnavailable(f"session {rec.id!r}: its worker {rec.worker} was lost during the suspend; "
                                    f"{cur.message or 'the session is SUSPENDED from its last snapshot'}",
                                    details={"state": cur.state.value})
        if cur.state == SessionState.SUSPENDED:
            return cur
        raise self._moved_on(cur)

    async def _record_suspend_failure(self, rec: SessionRecord, reason: str, code: str) -> None:
        """Record a failed automatic suspend once per streak: when the session starts failing, and again
        only if the error changes. The loops retry (idle: with back-off; a drain: every 0.2 s for over a
        minute), and a record per retry would flood the session's capped trail and push out its history."""
        if self._suspend_failing.get(rec.id) == code:
            return
        self._suspend_failing[rec.id] = code
        self._suspend_failing.move_to_end(rec.id)
        while len(self._suspend_failing) > 10_000:
            self._suspend_failing.popitem(last=False)
        await self.record("suspend", rec, reason=reason, result=code, who=SYSTEM)

    async def delete(self, sid: str, snapshot_gc: Callable[[str, int], Awaitable[None]] | None = None, *,
                     before_removal: Callable[[], Awaitable[None]] | None = None,
                     read: SessionRecord | None = None) -> None:
        """End a session wherever it is and remove its record (and its snapshots, via ``snapshot_gc(sid,
        last_epoch)``, in the background).
        Of concurrent deletes one does it and the others get ``NotFound``, as a delete after it does (the
        move to DELETED is a compare-and-set from any other state: both of two deletes that read the
        record before either marked it answered 204, and each released its slot and quota).

        ``before_removal``: awaited by the delete that does it after the session's activation ended and
        before its record goes (the API writes its audit record there). A concurrent delete that lost
        the compare-and-set answers ``NotFound`` only once the record is gone (at most
        ``delete_wait_s``), so its own record follows the winner's: the losers' ``session_not_found``
        records came before the winner's ``ok`` in the trail (fresh-user run, 6 of 6).

        ``read``: the record as the caller just read it (the API, to check who owns it): not read again. It
        is as good as a read here: the move to DELETED takes any state, and an activation that moved in
        between is freed by its worker's reconciliation, as one that moves between a read here and the
        move would be."""
        rec = read
        if rec is None:
            try:
                rec = await self.directory.get_session(sid)
            except NotFound:
                await self._wait_removed(sid)
                raise
        cas = await self.directory.transition(sid, from_states=_NOT_DELETED, to=SessionState.DELETED, bump=True,
                                              tenant=rec.tenant, likely=rec.state)
        if not cas.ok:  # gone, or marked DELETED by a concurrent delete (or an undone create)
            await self._wait_removed(sid)
            raise NotFound(f"session {sid!r} not found", code="session_not_found")
        parked = self._wakes.get(sid)
        if parked is not None and not parked.done():
            # the turns parked on this router's wake of the session learn of the delete now, not when the
            # wake's own next step meets the DELETED record (after its restore and agent start: a
            # fresh-user run had 404s 1-5 s after the 204, and 503 resume_timeout "retry" after it); they
            # answer once the record is gone (``wake_retrying``), after this delete's own audit record
            parked.set_exception(NotFound(f"session {sid!r} not found", code="session_not_found"))
        if rec.worker:
            address = await self._worker_address(rec.worker)
            if address:
                try:  # the worker ends the activation at once, even mid-turn; if it cannot be reached
                    # its reconciliation frees it (the record is gone, and epochs never repeat)
                    await self._within_lease(rec.worker, self.client.deactivate(address, sid, cas.epoch))
                except SubstrateError as e:
                    log.info("deactivate on delete failed; the worker's reconciliation frees it",
                             extra={"session": sid, "worker": rec.worker, "code": e.code})
        # the slot is freed in the record removal's round trip (the activation has ended: no round trip more)
        held = (rec.worker, rec.slot) if rec.worker and rec.slot is not None else None
        if before_removal is not None:
            await before_removal()
        # the places go while the DELETED record still keeps the ID taken, as in ``_undo_create``: given
        # back after the record, they could be a create's of the same ID that came in between
        await self.release_quota(rec, epoch=None, total=True)
        await self.directory.delete_session(sid, tenant=rec.tenant, slot=held)
        if held is not None:
            self.slot_freed(rec.pool or None)
        if snapshot_gc is not None:
            # up to the deleted session's last epoch: a session made again under this ID starts above it,
            # and its snapshots may be under the same prefix before this task lists it
            asyncio.create_task(snapshot_gc(sid, cas.epoch))

    # ------------------------------------------------------------------------------------- recovery
    async def check_worker(self, wid: str, *, sid: str | None = None) -> bool:
        """After a failed call to ``wid``: declare it dead only if its lease expired more than
        ``lease_grace_s`` ago (the worker stopped serving at expiry, so nobody else serves its
        sessions meanwhile), and recover its sessions. A record gone already (declared dead elsewhere)
        recovers ``sid`` if it still points there. Returns True if ``wid`` is (now) known dead."""
        if not wid:
            return True
        w = await self.directory.get_worker(wid)
        if w is None:
            self.view.workers.pop(wid, None)
            if sid is not None:
                await self.recover_session(sid, wid, reason="worker_lost")
            return True
        return await self.recover_worker(wid, force=False) is not None

    async def repair_lost_activation(self, sid: str, wid: str, epoch: int) -> bool:
        """Worker ``wid`` answered ``not_active`` for activation ``epoch`` of ``sid``: if the record still
        says RUNNING there at that epoch, the activation is lost; move it (guarded by epoch and worker)
        to SUSPENDED marked ``activation_lost`` and free its slot, so the next wake restores it from its
        last snapshot (the answer says so). Returns whether it repaired."""
        try:
            rec = await self.directory.get_session(sid)
        except NotFound:
            return False
        what = (f"activation {epoch} on worker {wid} was lost; state since the last snapshot "
                f"({'at %.3f' % rec.snapshot.createdAt if rec.snapshot else 'none: fresh start'}) is gone")
        cas = await self.directory.transition(
            sid, from_states=[SessionState.RUNNING], epoch=epoch, worker=wid, to=SessionState.SUSPENDED,
            set={"reason": "activation_lost", "message": what}, unset=("worker", "slot"), tenant=rec.tenant)
        if cas.ok:
            log.warning("lost activation repaired", extra={"session": sid, "worker": wid, "epoch": epoch})
            metrics.RECOVERIES_TOTAL.labels(reason="activation_lost").inc()
            if rec.slot is not None:
                await self.directory.release_slot(wid, rec.slot, sid)
            await self.release_quota(rec, epoch=epoch)
            await self.record("recover", rec, reason="activation_lost", worker=wid, who=SYSTEM)
        return cas.ok

    async def recover_worker(self, wid: str, *, reason: str = "worker_lost", force: bool = True
                             ) -> list[str] | None:
        """Declare ``wid`` dead and move each of its sessions to SUSPENDED, marked with ``reason``, to come
        back from its last snapshot. ``force``: the process is known to be gone (the backend reaped
        it); otherwise only if its lease expired more than ``lease_grace_s`` ago and this process has
        reached Redis without error for a whole lease since (a worker cannot renew while Redis is out, so
        a lease that lapsed in a directory outage is no sign of death: the worker gets one full lease
        after the outage to renew, fenced meanwhile; CI found a 3 s Redis pause losing a turn without
        this). Returns the sessions recovered, or None if the worker is still taken as alive."""
        w = self.settings.worker
        if not force and self.directory.unavailable_within(w.lease_s + w.lease_grace_s):
            return None
        slots = await self.directory.expire_worker(wid, grace_s=self.settings.worker.lease_grace_s,
                                                   force=force)
        if slots is None:
            return None
        self.view.workers.pop(wid, None)
        recovered = []
        for sid in slots.values():
            if await self.recover_session(sid, wid, reason=reason):
                recovered.append(sid)
        if slots:
            log.warning("worker declared dead; sessions recovered",
                        extra={"worker": wid, "sessions": len(recovered)})
        return recovered

    async def recover_session(self, sid: str, wid: str, *, reason: str) -> bool:
        """Move one session that lived on dead worker ``wid`` to SUSPENDED (bounded loss: it resumes from
        its last committed snapshot; ``restoredFrom`` will say which)."""
        try:
            rec = await self.directory.get_session(sid)
        except NotFound:
            return False
        what = (f"worker {wid} was lost; state since the last snapshot "
                f"({'at %.3f' % rec.snapshot.createdAt if rec.snapshot else 'none: fresh start'}) is gone")
        # bump: the dead worker's activation epoch is fenced for good (its reconciliation, should it come
        # back, sees a newer epoch and frees the slot). A start or wake cut off before its first answer
        # lost nothing: no marker of its own (it had been "worker_lost", a false loss on the next answer)
        if rec.state in UNANSWERED:
            cas = await self.directory.transition(sid, from_states=UNANSWERED, epoch=rec.epoch, worker=wid,
                                                  to=SessionState.SUSPENDED, bump=True, unset=("worker", "slot"))
        if rec.state not in UNANSWERED or not cas.ok:  # RUNNING or SUSPENDING (then or since)
            cas = await self.directory.transition(sid, from_states=_ANSWERED, worker=wid, to=SessionState.SUSPENDED,
                                                  bump=True, set={"reason": reason, "message": what},
                                                  unset=("worker", "slot"))
        if cas.ok:  # the bumped epoch is nobody's activation: every place up to it goes
            await self.release_quota(rec, epoch=cas.epoch)
            await self.record("recover", rec, reason=reason, worker=wid, who=SYSTEM)
        return cas.ok


__all__ = ["Activator", "Route", "WorkerView", "DirectoryUnavailable"]
