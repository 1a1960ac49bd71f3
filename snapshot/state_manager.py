"""The state manager: suspends idle sessions, recovers crashed ones, never leaves one stuck.

Every ``scan_interval_s`` (level-triggered; an error in one step is logged and the loop goes on):

1. **Dead workers**: a worker whose lease expired is declared dead; its sessions go to SUSPENDED
   (``reason: worker_lost``) and come back from their last committed snapshot on the next request, or
   at once with ``eager_recovery``.
2. **Idle sessions**: a RUNNING session idle past its template's ``maxIdleTime`` is suspended through its
   worker (which refuses if a turn arrived meanwhile), in a task beside the scan (a hanging suspend
   holds up no other duty). A failure (object store down) leaves it RUNNING and is retried with
   exponential back-off (tenacity's wait policy).
3. **Deadlines**: a session past its transitional state's deadline is rolled forward or back:
   PENDING -> deleted (it never ran); STARTING/RESUMING -> SUSPENDED (the half-made activation is fenced
   by the next epoch bump); SUSPENDING -> RUNNING if its worker is alive, else SUSPENDED.
4. **Repairs** (every 10th scan, at most ``state.repair_max_share`` of the time): sessions pointing at a
   worker that is gone are recovered; slot-table entries whose session does not point back at them are
   freed; the per-state counters and the quota bookkeeping are corrected. It reads every session, so it
   runs in a task beside the scan, one at a time (a pass over 100,000 sessions took 10-11 s when it read
   whole records, and held up the dead-worker and deadline duties for as long; about 1-2 s now).
5. **Orphan sweep** (every ``snapshot.sweep_interval_s``): objects in the store that no kept snapshot
   of an existing session names (uploads of failed or rejected commits, corrupt snapshots set aside,
   snapshots of deleted sessions whose clean-up failed) are deleted once they have been found orphaned
   for ``snapshot.orphan_min_age_s`` (two sightings that far apart, so an upload in flight is never
   taken for garbage). At most ``sweep_max_deletes`` per pass. It runs in a task beside the scan, one at
   a time: a store that hangs (frozen, or slow past boto's read timeout) holds up no other duty (a
   full-suite run: the first sweep hung on a frozen store and no deadline was enforced for 30 s).
"""

from __future__ import annotations

import asyncio
import logging
import time

from tenacity import wait_exponential

from snapshot.guard import MARKER_NAME
from snapshot.store import ObjectStore
from substrate import metrics
from substrate.activator import Activator
from substrate.audit import SYSTEM
from substrate.directory import Directory, SessionSummary
from substrate.errors import NotFound, SubstrateError
from substrate.loops import cancel_and_wait, run_forever
from substrate.models import UNANSWERED, SessionRecord, SessionState
from substrate.settings import Settings
from substrate.specs import Catalog

log = logging.getLogger(__name__)


class StateManager:
    def __init__(self, settings: Settings, directory: Directory, catalog: Catalog, activator: Activator,
                 store: ObjectStore | None = None) -> None:
        self.settings = settings
        self.directory = directory
        self.catalog = catalog
        self.activator = activator
        self.store = store
        self._task: asyncio.Task[None] | None = None
        self._retry_at: dict[str, tuple[float, int]] = {}  # session -> (next attempt time, attempts)
        self._scans = 0
        #: no repair pass before this (``time.monotonic()``): see ``repair_due_s``
        self._repair_after = 0.0
        #: the repair pass in flight, if any (it runs beside the scan, see the module docstring)
        self._repair: asyncio.Task[None] | None = None
        self._idle_scan_at = 0.0
        self._orphans: set[tuple[str, int, str]] = set()
        #: tenants whose state counters the next repair pass checks (those the last pass saw)
        self._tenants: set[str] = set()
        #: the templates the last repair pass found sessions of that the catalog lacks (warned once per change)
        self._missing_templates: dict[str, int] = {}
        self._orphan_objects: dict[str, float] = {}  # object key -> first seen orphaned (s)
        self._swept_at = 0.0
        self.sweep_max_deletes = 1000
        self._wait = wait_exponential(multiplier=settings.state.suspend_retry_base_s,
                                      max=settings.state.suspend_retry_max_s)
        #: idle suspends in flight, by session: they run beside the scan, never inside it (see suspend_idle)
        self._suspending: dict[str, asyncio.Task[None]] = {}
        self._idle_sem = asyncio.Semaphore(8)
        #: the orphan sweep in flight, if any (it runs beside the scan, see the module docstring)
        self._sweep: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(run_forever(self.scan_once, self.settings.state.scan_interval_s,
                                                     "state manager scan", first_delay=True))

    async def stop(self) -> None:
        await cancel_and_wait([self._task, *self._suspending.values(), self._sweep, self._repair])

    async def scan_once(self) -> None:
        """One pass of every duty (see module docstring)."""
        self._scans += 1
        for step in (self.recover_dead_workers, self.suspend_idle, self.enforce_deadlines, self.export_counts):
            try:
                await step()
            except Exception:  # noqa: BLE001
                log.warning("state manager step failed", extra={"step": step.__name__}, exc_info=True)
        if (self._scans % 10 == 1 and (self._repair is None or self._repair.done())
                and time.monotonic() >= self._repair_after):
            self._repair = asyncio.create_task(self._repair_quietly())
        if (self.store is not None and (self._sweep is None or self._sweep.done())
                and time.time() - self._swept_at >= self.settings.snapshot.sweep_interval_s):
            self._swept_at = time.time()
            self._sweep = asyncio.create_task(self._sweep_quietly())

    async def _repair_quietly(self) -> None:
        t0 = time.monotonic()
        try:
            await self.repair()
        except Exception:  # noqa: BLE001 - the next due pass tries again
            log.warning("repair failed", exc_info=True)
        finally:
            self._repair_after = time.monotonic() + self.repair_due_s(time.monotonic() - t0)

    def repair_due_s(self, took_s: float) -> float:
        """The least wait (s) after a repair pass that took ``took_s`` seconds before the next may run:
        ``took_s * (1 / state.repair_max_share - 1)``, so that passes take at most that share of the
        time (5 %: a pass of 1 s, about 100,000 sessions here, waits 19 s; a small directory's pass keeps
        the every-tenth-scan cadence)."""
        return took_s * (1.0 / self.settings.state.repair_max_share - 1.0)

    async def _sweep_quietly(self) -> None:
        try:
            await self.sweep_orphans()
        except SubstrateError as e:  # e.g. the store unreachable: its message says it, one line
            log.warning("orphan sweep failed: %s", e.message)
        except Exception:  # noqa: BLE001 - the next interval tries again
            log.warning("orphan sweep failed", exc_info=True)

    async def export_counts(self) -> None:
        """``agent_substrate_sessions`` from the directory's per-state counters (O(states))."""
        metrics.set_session_counts(await self.directory.state_counts())

    async def recover_dead_workers(self) -> None:
        now = time.time()
        grace = self.settings.worker.lease_grace_s
        for w in await self.directory.list_workers():
            if w.leaseExpiresAt + grace < now:
                log.warning("worker lease expired", extra={"worker": w.id})
                # conditional on the lease in Redis: a worker that renewed meanwhile stays
                recovered = await self.activator.recover_worker(w.id, force=False)
                if recovered and self.settings.state.eager_recovery:
                    for sid in recovered:
                        asyncio.create_task(self._eager_wake(sid))

    async def _eager_wake(self, sid: str) -> None:
        try:
            await self.activator.wake(sid)
        except SubstrateError as e:
            log.info("eager recovery deferred to the next request", extra={"session": sid, "code": e.code})

    async def _active_records(self) -> list[SessionRecord]:
        sids: list[str] = []
        for w in list(self.activator.view.workers.values()):  # a recovery may drop workers meanwhile
            sids.extend((await self.directory.worker_slots(w.id)).values())
        return await self.directory.get_sessions(sids)

    async def suspend_idle(self) -> None:
        """Start suspending every RUNNING session idle past its template's ``maxIdleTime`` (at most 8 at
        once; a session whose suspend is still in flight is skipped). The suspends run as tasks beside
        the scan: one that hangs (object store frozen; the worker call is bounded only by the invoke
        timeout) must not hold up the other duties, least of all the deadline that rolls it back."""
        idles = [t.spec.stateManagement.max_idle_time_s for t in self.catalog.templates.values()]
        shortest = min((i for i in idles if i), default=None)
        if shortest is None:
            return  # no template suspends on idle: nothing to read
        now = time.time()
        # reading every active record costs O(active sessions): do it about four times per shortest
        # maxIdleTime, not on every scan
        if now - self._idle_scan_at < min(max(self.settings.state.scan_interval_s, shortest / 4), 30.0):
            return
        self._idle_scan_at = now
        due: list[tuple[SessionRecord, float]] = []
        for rec in await self._active_records():
            if rec.state != SessionState.RUNNING:
                continue
            t = self.catalog.templates.get(rec.actorTemplate)
            max_idle = t.spec.stateManagement.max_idle_time_s if t else None
            if not max_idle or now - rec.lastActiveAt < max_idle:
                continue
            retry = self._retry_at.get(rec.id)
            if (retry and retry[0] > now) or rec.id in self._suspending:
                continue
            due.append((rec, max_idle))

        async def one(rec: SessionRecord, max_idle: float) -> None:
            async with self._idle_sem:
                try:
                    await self.activator.suspend(rec, idle_s=max_idle, reason="idle")
                    self._retry_at.pop(rec.id, None)
                except SubstrateError as e:
                    if e.code in ("busy", "invalid_state", "not_active", "stale_epoch"):
                        return
                    attempts = self._retry_at.get(rec.id, (0.0, 0))[1] + 1

                    class _RS:  # the shape tenacity's wait policies read
                        attempt_number = attempts

                    self._retry_at[rec.id] = (time.time() + self._wait(_RS()), attempts)  # type: ignore[arg-type]
                    log.warning("idle suspend failed; will retry", extra={"session": rec.id, "code": e.code,
                                                                          "attempts": attempts})
                except Exception:  # noqa: BLE001 - a task of its own (no scan step catches it); next scan retries
                    log.warning("idle suspend failed", extra={"session": rec.id}, exc_info=True)

        for rec, max_idle in due:
            task = asyncio.create_task(one(rec, max_idle))
            self._suspending[rec.id] = task
            task.add_done_callback(lambda _t, sid=rec.id: self._suspending.pop(sid, None))

    async def enforce_deadlines(self) -> None:
        for sid in await self.directory.expired_deadlines():
            try:
                rec = await self.directory.get_session(sid)
            except NotFound:
                await self.directory.delete_session(sid)
                continue
            await self._roll(rec)

    async def _roll(self, rec: SessionRecord) -> None:
        d = self.directory
        if not rec.state.transitional:
            await d.redis.zrem(d.keys.deadlines, rec.id)
            return
        log.warning("session past its deadline", extra={"session": rec.id, "state": rec.state.value})
        metrics.RECOVERIES_TOTAL.labels(reason="deadline").inc()
        if rec.state == SessionState.PENDING:
            # the places first, while the record still keeps the ID taken (as a DELETE does): given back
            # after it, they could be a create's of the same ID that came in between
            await self.activator.release_quota(rec, epoch=None, total=True)
            await d.delete_session(rec.id, tenant=rec.tenant)
            await self.activator.record("deadline", rec, reason="PENDING->deleted", who=SYSTEM)
            return
        if rec.state == SessionState.SUSPENDING:
            w = await d.get_worker(rec.worker or "")
            if w is not None and w.leaseExpiresAt > time.time():
                cas = await d.transition(rec.id, from_states=[SessionState.SUSPENDING], epoch=rec.epoch,
                                         to=SessionState.RUNNING)
                if cas.ok:
                    await self.activator.record("deadline", rec, reason="SUSPENDING->RUNNING", who=SYSTEM)
                return
        # a start or wake cut off before its first answer lost nothing: no loss marker of its own (one
        # still unreported from before stays); a suspend cut off may have lost the turns since its
        # last snapshot
        loss = None if rec.state in UNANSWERED else {
            "reason": "deadline", "message": f"{rec.state.value} did not finish in time"}
        cas = await d.transition(rec.id, from_states=[rec.state], epoch=rec.epoch, to=SessionState.SUSPENDED,
                                 set=loss, unset=("worker", "slot"))
        if cas.ok:  # suspended sessions hold no running quota (a wake since owns a newer epoch's place)
            await self.activator.release_quota(rec, epoch=rec.epoch)
            await self.activator.record("deadline", rec, reason=f"{rec.state.value}->SUSPENDED",
                                         who=SYSTEM)
        if cas.ok and rec.worker is not None and rec.slot is not None:
            w = await d.get_worker(rec.worker)
            if w is not None:
                try:  # only that epoch's activation (or older); the worker's reconciliation backs this up
                    await self.activator.client.deactivate(w.address, rec.id, rec.epoch)
                except SubstrateError:
                    pass
            await d.release_slot(rec.worker, rec.slot, rec.id)

    async def repair(self) -> None:
        """Recover sessions on vanished workers; roll transitional sessions past a deadline the index
        missed; free slots nobody points at; correct the per-state counters and the quota bookkeeping.

        Reads every session once, as a :class:`~substrate.directory.SessionSummary` (the fields these
        checks need: no JSON fields, no model validation), and the records of the sessions that hold
        slots again, fresh, for the orphan check. Measured here (2 vCPUs; ``loadtest/bench_repair.py``,
        ``docs/bench/2026-12-06-repair-scale-ab.md``): a pass over 20,000 sessions took 2.2-2.6 s of CPU
        when it read every whole record twice, 0.14-0.23 s now; see ``repair_due_s`` for how often it runs."""
        d = self.directory
        counted_before = await d.state_counts()
        # each tenant's counters too: those of the tenants the previous pass saw (a tenant new since is
        # corrected from the next pass on)
        tenants_before = await d.tenant_state_counts(sorted(self._tenants))
        counts: dict[str, int] = {}
        by_tenant: dict[str, dict[str, int]] = {}
        workers = {w.id: w for w in await d.list_workers()}
        summaries: dict[str, SessionSummary] = {}
        offset: int | None = 0
        while offset is not None:
            # 250 a call: each call's script holds Redis for about 1.5 ms (6 ms at 1,000, measured)
            page, offset = await d.session_summaries(offset=offset, limit=250)
            now = time.time()
            for rec in page:
                summaries[rec.id] = rec
                counts[rec.state.value] = counts.get(rec.state.value, 0) + 1
                mine = by_tenant.setdefault(rec.tenant, {})
                mine[rec.state.value] = mine.get(rec.state.value, 0) + 1
                if rec.worker and rec.worker not in workers and rec.state in (
                        SessionState.RUNNING, SessionState.SUSPENDING):
                    await self.activator.recover_session(rec.id, rec.worker, reason="worker_lost")
                elif rec.state.transitional and rec.stateDeadline and rec.stateDeadline < now:
                    # past its deadline but missing from the deadline index: rolled from its whole record
                    for full in await d.get_sessions([rec.id]):
                        await self._roll(full)
        # A slot claim precedes the record write by one round trip, so an entry is freed only if it was
        # already orphaned at the previous repair pass (two-phase: no race with a placement in flight).
        orphans: set[tuple[str, int, str]] = set()
        slots_of = await d.slots_of(list(workers))
        held = {r.id: r for r in await d.summaries_of([sid for slots in slots_of.values() for sid in slots.values()])}
        for wid, slots in slots_of.items():
            for slot, sid in slots.items():
                r = held.get(sid)
                if r is None or r.worker != wid or r.slot != slot:
                    orphans.add((wid, slot, sid))
        for wid, slot, sid in orphans & self._orphans:
            await d.release_slot(wid, slot, sid)
        self._orphans = orphans - self._orphans
        # the per-state counters are moved by the transitions; this slow scan corrects any drift (a crash
        # between a transition and its counter update) when nothing moved while it ran
        if await d.reconcile_state_counts(counts, counted_before):
            log.info("session state counters corrected", extra={"counts": counts})
        fixed = await d.reconcile_tenant_state_counts(by_tenant, tenants_before)
        if fixed:
            log.info("tenants' session state counters corrected", extra={"tenants": fixed[:20]})
        # a tenant with no session left is looked at once more (its counters emptied), then forgotten
        self._tenants = set(by_tenant) | {t for t in tenants_before if t not in fixed and any(tenants_before[t].values())}
        self._warn_missing_templates(summaries)
        metrics.set_session_counts(await d.state_counts())
        if self.activator.quotas is not None:  # quota bookkeeping is derived data: rebuild it from the records
            def gpus_of(name: str) -> int:
                t = self.activator.catalog.templates.get(name)
                return t.spec.resources.gpus if t else 0
            await self.activator.quotas.reconcile(summaries, gpus_of)

    def _warn_missing_templates(self, summaries: dict[str, SessionSummary]) -> None:
        """Log a warning when the sessions whose ActorTemplate this runtime no longer defines change (a
        template removed from the config: each such session's next call answers 422 ``unknown_template``,
        and nothing said so at the start: fresh-user tester 54). Once per change, not per pass."""
        templates = self.activator.catalog.templates
        missing: dict[str, int] = {}
        for rec in summaries.values():
            if rec.actorTemplate not in templates:
                missing[rec.actorTemplate] = missing.get(rec.actorTemplate, 0) + 1
        if missing and set(missing) != set(self._missing_templates):
            log.warning("sessions of ActorTemplates this runtime no longer defines: %s; their calls answer 422 "
                        "unknown_template until the template is back in the config (their snapshots are kept) "
                        "or they are deleted", ", ".join(f"{t!r} ({n})" for t, n in sorted(missing.items())))
        self._missing_templates = missing

    async def sweep_orphans(self, now: float | None = None) -> list[str]:
        """One orphan sweep (see the module docstring). Returns the keys deleted."""
        if self.store is None:
            return []
        now = time.time() if now is None else now
        root = self.settings.snapshot.prefix.strip("/")
        root = f"{root}/" if root else ""
        by_session: dict[str, list[str]] = {}
        for key in await self.store.list_keys(root):
            sid, _, name = key[len(root):].partition("/")
            # a snapshot's key is exactly ``<prefix>/<session>/<file>``: a deeper key or a marker object
            # belongs to another directory whose prefix is nested in this one's (``snapshots/b`` in
            # ``snapshots``: this sweep deleted that runtime's snapshots and its marker, round 21)
            if sid and name and "/" not in name and name != MARKER_NAME and sid != MARKER_NAME:
                by_session.setdefault(sid, []).append(key)
        d = self.directory
        recs = {r.id: r for r in await d.get_sessions(list(by_session))}
        orphans: set[str] = set()
        for sid, keys in by_session.items():
            rec = recs.get(sid)
            keep: set[str] = set()
            if rec is not None:
                keep.update(await d.committed_snapshots(sid))
                keep.update(r.key for r in (rec.snapshot, rec.previousSnapshot) if r is not None)
            orphans.update(k for k in keys if k not in keep)
        self._orphan_objects = {k: self._orphan_objects.get(k, now) for k in orphans}
        due = [k for k, t in self._orphan_objects.items() if now - t >= self.settings.snapshot.orphan_min_age_s]
        deleted = []
        for key in due[:self.sweep_max_deletes]:
            try:
                await self.store.delete(key)
                deleted.append(key)
                self._orphan_objects.pop(key, None)
            except Exception:  # noqa: BLE001 - retried by the next sweep
                log.warning("orphan delete failed", extra={"key": key}, exc_info=True)
        if deleted:
            log.info("orphaned snapshot objects deleted", extra={"count": len(deleted)})
        return deleted
