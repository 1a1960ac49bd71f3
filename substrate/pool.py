"""The pool controller: keeps enough warm capacity (free slots on READY workers) ahead of demand.

Level-triggered, after Ray Serve's controller: every tick observes the registry, calls the pure
``reconcile(spec, observation)`` which returns a small ``PoolPlan``, and a thin executor applies it
through a backend (local processes here; Kubernetes Pods + ResourceClaims later). In-flight creates are
tracked as *expectations* (after agent-sandbox's warm pool) so a stale view never over-creates. A
worker leaves only after it was drained: marked DRAINING (placement skips it) and its sessions
suspended to object storage (DESIGN invariant 6). The loop logs and survives any error.

Sizing, with ``busy`` = active slots (mid-turn or active within the workers' active window; idle
sessions are evictable) + requests waiting for a slot and ``S`` = slots per worker:
``desired = clamp(max(ceil(busy / (S * target%)), ceil(busy / S) + warmPool.readyReplicas), min, max)``
with autoscaling, else ``spec.replicas``. Scale-down waits ``scale_down_delay_s`` of lower demand.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from substrate import metrics
from substrate.directory import Directory
from substrate.errors import SubstrateError
from substrate.models import Condition, SessionState, WorkerPool, WorkerPoolSpec, WorkerRecord, WorkerState
from substrate.settings import Settings
from substrate.specs import Catalog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerObs:
    """One worker as the reconciler sees it: ``used`` slots hold a session, ``active`` of them are
    mid-turn or were active within the worker's active window (the rest are evictable)."""

    id: str
    state: WorkerState
    slots: int
    used: int
    alive: bool = True
    active: int | None = None


@dataclass(frozen=True)
class PoolObservation:
    workers: tuple[WorkerObs, ...]
    #: workers being created that have not registered yet (expectations)
    starting: int = 0
    #: requests waiting for a slot in this pool right now
    waiting: int = 0


@dataclass(frozen=True)
class PoolPlan:
    desired: int
    create: int = 0
    drain: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    reason: str = ""


def desired_replicas(spec: WorkerPoolSpec, busy: int) -> int:
    """Workers wanted for ``busy`` slots in use or wanted (see the module docstring)."""
    a = spec.autoscaling
    if a is None or a.metrics:  # with HPA metrics, the HPA writes spec.replicas through /scale
        return spec.replicas
    s = spec.slots
    by_util = math.ceil(busy * 100 / (s * a.targetUtilization)) if busy else 0
    warm = spec.warmPool.readyReplicas if spec.warmPool else 0
    by_warm = math.ceil(busy / s) + warm
    return max(a.minReplicas, min(a.maxReplicas, max(by_util, by_warm)))


def reconcile(spec: WorkerPoolSpec, obs: PoolObservation, *, allow_scale_down: bool = True) -> PoolPlan:
    """Pure: what to do for one pool. Never drains more than the excess; removes only empty DRAINING
    workers; counts STARTING workers and expectations as capacity so it never over-creates."""
    alive = [w for w in obs.workers if w.alive]
    serving = [w for w in alive if w.state != WorkerState.DRAINING]
    # demand = active slots (idle sessions are evictable capacity: lazy suspension frees them on need)
    busy = sum(w.used if w.active is None else min(w.active, w.used) for w in alive) + obs.waiting
    desired = desired_replicas(spec, busy)
    current = len(serving) + obs.starting
    remove = tuple(w.id for w in alive if w.state == WorkerState.DRAINING and w.used == 0)
    if current < desired:
        return PoolPlan(desired, create=desired - current, remove=remove, reason=f"busy={busy} below capacity")
    drain: tuple[str, ...] = ()
    if current > desired and allow_scale_down and obs.starting == 0:
        excess = current - desired
        ready = sorted((w for w in serving if w.state == WorkerState.READY), key=lambda w: (w.used, w.id))
        drain = tuple(w.id for w in ready[:excess])
    return PoolPlan(desired, drain=drain, remove=remove, reason=f"busy={busy}")


class Backend(Protocol):
    """Where workers run. ``create`` starts one worker process/pod that registers itself."""

    async def create(self, pool: WorkerPool, worker_id: str) -> None: ...
    async def delete(self, worker_id: str) -> None: ...
    def running(self) -> dict[str, str]:
        """worker id -> pool name of workers this backend started and that still run."""
        ...
    def reap(self) -> list[str]:
        """Worker ids whose process/pod ended since the last call."""
        ...
    async def close(self) -> None: ...


@dataclass
class _PoolState:
    expectations: dict[str, float] = field(default_factory=dict)  # worker id -> create time
    below_since: float | None = None
    conditions: list[Condition] = field(default_factory=list)
    #: the last plan's desired worker count
    desired: int = 0


class PoolController:
    """Runs ``reconcile`` for every WorkerPool of the catalog against a backend."""

    def __init__(self, settings: Settings, directory: Directory, catalog: Catalog, backend: Backend,
                 activator: "object | None" = None, *, scale_down_delay_s: float | None = None,
                 create_timeout_s: float = 60.0) -> None:
        self.settings = settings
        self.directory = directory
        self.catalog = catalog
        self.backend = backend
        self.activator = activator
        self.scale_down_delay_s = (settings.pool.scale_down_delay_s if scale_down_delay_s is None
                                   else scale_down_delay_s)
        self.create_timeout_s = create_timeout_s
        self._state: dict[str, _PoolState] = {p: _PoolState() for p in catalog.pools}
        self._task: asyncio.Task[None] | None = None
        self._draining: set[str] = set()
        self._last_tick = time.monotonic()

    async def start(self) -> None:
        prepare = getattr(self.backend, "start", None)
        if prepare is not None:
            await prepare()
        await self.tick()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

        async def stop_one(wid: str) -> None:  # graceful: the worker suspends its sessions first
            try:
                await self.backend.delete(wid)
            except Exception:  # noqa: BLE001
                log.warning("stopping worker failed", extra={"worker": wid}, exc_info=True)

        await asyncio.gather(*(stop_one(wid) for wid in list(self.backend.running())))
        await self.backend.close()

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once every pool has the READY workers it wants at zero demand."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = await self.directory.list_workers()
            ready = collections.Counter(w.pool for w in workers if w.state == WorkerState.READY)
            if all(ready[p.name] >= desired_replicas(p.spec, 0) for p in self.catalog.pools.values()):
                return True
            await asyncio.sleep(0.05)
        return False

    def effective_spec(self, pool: WorkerPool) -> WorkerPoolSpec:
        """The spec ``reconcile`` sizes against (a backend-specific controller may add surge capacity)."""
        return pool.spec

    def conditions(self, pool: str) -> list[Condition]:
        return list(self._state.get(pool, _PoolState()).conditions)

    async def _loop(self) -> None:
        wanted: asyncio.Event | None = getattr(self.activator, "capacity_wanted", None)
        while True:
            if wanted is None:
                await asyncio.sleep(self.settings.pool.reconcile_interval_s)
            else:  # level-triggered on a timer, and edge-triggered when a placement found no slot
                try:
                    await asyncio.wait_for(wanted.wait(), self.settings.pool.reconcile_interval_s)
                except asyncio.TimeoutError:
                    pass
                wanted.clear()
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a control loop never dies
                log.warning("pool reconcile failed", exc_info=True)

    async def tick(self) -> None:
        """One observe-reconcile-apply round for every pool."""
        now_m = time.monotonic()
        dt, self._last_tick = now_m - self._last_tick, now_m
        running = self.backend.running()
        try:
            await self.directory.add_worker_seconds(dt * len(running))
        except SubstrateError:
            pass
        for wid in self.backend.reap():
            if self.activator is not None:
                try:
                    await self.activator.recover_worker(wid)  # type: ignore[attr-defined]
                except SubstrateError:
                    log.warning("recovery of a dead worker failed", extra={"worker": wid}, exc_info=True)
        workers = await self.directory.list_workers()
        now = time.time()
        for pool in self.catalog.pools.values():
            await self._reconcile_pool(pool, [w for w in workers if w.pool == pool.name], running, now)

    async def _reconcile_pool(self, pool: WorkerPool, workers: list[WorkerRecord], running: dict[str, str],
                              now: float) -> None:
        st = self._state.setdefault(pool.name, _PoolState())
        registered = {w.id for w in workers}
        for wid, t in list(st.expectations.items()):
            if wid in registered or wid not in running or time.monotonic() - t > self.create_timeout_s:
                st.expectations.pop(wid)
        # started (a Pending Pod, a process still importing) but not registered yet: capacity on its way,
        # also after its expectation expired, so a Pod the scheduler cannot place is never re-created
        unregistered = sum(1 for wid, p in running.items()
                           if p == pool.name and wid not in registered and wid not in st.expectations)
        obs = PoolObservation(
            workers=tuple(WorkerObs(w.id, w.state, w.slots, w.slots - w.freeSlots,
                                    alive=w.leaseExpiresAt > now and w.id in running,
                                    active=w.activeSlots) for w in workers),
            starting=len(st.expectations) + unregistered,
            # requests waiting for a slot and requests parked on a resume are demand too
            waiting=getattr(self.activator, "waiting_demand", 0))
        allow_down = st.below_since is not None and time.monotonic() - st.below_since >= self.scale_down_delay_s
        plan = reconcile(self.effective_spec(pool), obs, allow_scale_down=allow_down)
        st.desired = plan.desired
        serving = sum(1 for w in obs.workers if w.alive and w.state != WorkerState.DRAINING) + obs.starting
        if serving > plan.desired:
            st.below_since = st.below_since or time.monotonic()
        else:
            st.below_since = None
        for _ in range(plan.create):
            # unique across processes and hosts: two runtimes sharing one Redis never share a worker ID
            wid = f"{pool.name}-{uuid.uuid4().hex[:12]}"
            st.expectations[wid] = time.monotonic()
            self._publish_starting(pool.name, st)
            try:
                await self.backend.create(pool, wid)
            except Exception:  # noqa: BLE001
                st.expectations.pop(wid, None)
                log.warning("worker create failed", extra={"pool": pool.name}, exc_info=True)
        self._publish_starting(pool.name, st)
        for wid in plan.drain:
            if wid not in self._draining:
                self._draining.add(wid)
                asyncio.create_task(self._drain(wid))
        for wid in plan.remove:
            if wid in running and wid not in self._draining:
                await self.backend.delete(wid)
        ready = [w for w in workers if w.state == WorkerState.READY and w.leaseExpiresAt > now]
        metrics.WARM_POOL_READY.labels(pool=pool.name).set(sum(w.freeSlots for w in ready))
        metrics.SLOTS.labels(pool=pool.name, status="free").set(sum(w.freeSlots for w in ready))
        metrics.SLOTS.labels(pool=pool.name, status="used").set(sum(w.slots - w.freeSlots for w in workers))
        for state in WorkerState:
            metrics.WORKERS.labels(pool=pool.name, state=state.value).set(
                sum(1 for w in workers if w.state == state))
        st.conditions = [
            Condition(type="Ready", status="True" if ready else "False",
                      reason="WorkersReady" if ready else "NoReadyWorker",
                      message=f"{len(ready)} ready of {plan.desired} desired"),
            Condition(type="Scaling", status="True" if plan.create or plan.drain else "False",
                      reason=plan.reason),
        ]

    def _publish_starting(self, pool: str, st: _PoolState) -> None:
        """Tell this process's placements a worker is starting for ``pool`` (they wait for it rather
        than answer ``no_capacity``: capacity never refuses what it is creating)."""
        starting = getattr(self.activator, "starting", None)
        if isinstance(starting, dict):
            starting[pool] = len(st.expectations)

    async def _drain(self, wid: str) -> None:
        """Mark DRAINING, suspend every session on the worker, then stop it (invariant 6)."""
        try:
            await self.directory.set_worker_state(wid, WorkerState.DRAINING)
            # sessions still starting or resuming there settle (or roll back at their deadline) first
            deadline = time.monotonic() + self.settings.state.transition_deadline_s + 20
            while time.monotonic() < deadline:
                sids = list((await self.directory.worker_slots(wid)).values())
                if not sids:
                    break
                for rec in await self.directory.get_sessions(sids):
                    if rec.state == SessionState.RUNNING and rec.worker == wid and self.activator is not None:
                        try:
                            await self.activator.suspend(rec, reason="drain")  # type: ignore[attr-defined]
                        except SubstrateError as e:
                            log.info("drain suspend deferred", extra={"session": rec.id, "code": e.code})
                await asyncio.sleep(0.2)
            else:
                log.warning("drain gave up; worker kept", extra={"worker": wid})
                await self.directory.set_worker_state(wid, WorkerState.READY)
                return
            await self.backend.delete(wid)
        except Exception:  # noqa: BLE001 - retried by a later reconcile
            log.warning("drain failed", extra={"worker": wid}, exc_info=True)
        finally:
            self._draining.discard(wid)
