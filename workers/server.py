"""The worker agent: an HTTP server hosting up to N session activations (slots) of one pool.

Internal API, called by the router and the state manager only (never by clients):

    POST   /v1/activations                      activate {session, epoch, template, spec, env, snapshot?, slot}
    POST   /v1/activations/{sid}/invoke         one turn; body {"input": ...}; ?stream=1 for NDJSON chunks
    POST   /v1/activations/{sid}/snapshot       take and commit a snapshot now (crash recovery point)
    POST   /v1/activations/{sid}/suspend        snapshot, commit + SUSPENDED, free the slot; ?idle_s=N
                                                 refuses (409 busy) if the session was active < N s ago
    DELETE /v1/activations/{sid}                end the activation without a snapshot
    GET    /v1/activations                      what is active here
    GET    /healthz                             200 when serving

Every call carries a per-activation token (``Authorization: Bearer``, see ``substrate.tokens``) bound to
the session, its epoch, this worker and the tenant; the worker checks it on every call: no or a bad token
401, another session's token 403, a token whose epoch is not the activation's 409 ``stale_epoch``
(DESIGN invariant 1), an unknown session 404 ``not_active``. ``X-Substrate-Epoch``, if sent, must
match the token's epoch. Credentials the template asks for are resolved per activation
(``substrate.secrets``) into the agent's environment only.
The worker registers itself in the directory with a lease, renews it every ``heartbeat_s`` and reports
its sessions' last activity there (so the router's hot path writes nothing). If its record is gone (it
was declared dead) it stops serving and exits: its sessions may already live elsewhere.

Agents never run in this process: each activation's agent is a sandboxed child process
(``workers/sandbox.py``) driven over JSON lines (``workers/command.py``); a free slot keeps a pre-started
sandbox so an activation does not pay the spawn. The worker refuses to start when bubblewrap is missing
or unusable, unless every template of its pool opts out (``isolation.sandbox: false``).

Failure handling (issue 8):
* **Self-fencing**: the worker serves only while its own lease (as last renewed) is valid; past it every
  call gets 503 ``worker_fenced`` (the router retries), because others may place its sessions
  elsewhere ``lease_grace_s`` later. A renewal that succeeds again lifts the fence.
* **Reconciliation**: every ``reconcile_s`` and after every failed transition the worker compares its
  activations with the directory and frees any that the record does not name (worker and epoch): an
  activation is kept or dropped by the directory's epoch, never by an error alone.
* **Graceful stop**: SIGTERM marks the worker DRAINING and suspends every session (snapshot + commit)
  within ``shutdown_grace_s`` before it deregisters and exits.
* **Exactly-once turns**: a turn carries ``Idempotency-Key`` (the router sends the request ID or the
  client's key); the answers of the last ``idempotency_keys`` keys are kept per activation and in its
  snapshot, so a retried turn is answered again (``X-Substrate-Replayed: 1``), never run twice. They are
  bounded in bytes too (``answer_keep_bytes``, the worker's memory is outside every sandbox): an answer
  too big to keep leaves a marker, and its retry gets 410 ``answer_not_kept`` instead of a second run.
  One answer is at most ``max_answer_bytes`` (422 ``output_too_large``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from snapshot.commit import SnapshotManager
from snapshot.guard import GuardedStore
from snapshot.store import make_store
from substrate import metrics
from substrate.audit import SYSTEM, AuditLog
from substrate.quotas import Quotas
from substrate.directory import Directory
from substrate.errors import (
    BadRequest,
    Conflict,
    InvalidInput,
    NoCapacity,
    NotFound,
    StaleEpoch,
    StateLoadFailed,
    SubstrateError,
    error_json,
    public_detail,
)
from substrate.gctune import tune_after_startup
from substrate.logs import configure_logging
from substrate.loops import LagCounts, cancel_and_wait, reraise_lost_cancel, run_forever, watch_lag
from substrate.models import (
    SUSPEND_REASONS,
    UNANSWERED,
    ActorTemplateSpec,
    SessionState,
    SnapshotRef,
    WorkerRecord,
    WorkerState,
)
from substrate.netports import ports_in_random_order
from substrate.secrets import resolve_env
from substrate.settings import Settings, get_settings
from substrate.tokens import ANY_SESSION, ActivationClaims, SigningKeyRing, TokenNotForThisCall, TokenVerifier, bearer
from substrate.envpolicy import check_session_env
from workers.command import LINE_SLACK_BYTES, RESTART_HINT, AgentGone, HostedAgent, TurnFailed
from workers.devices import gpu_inventory
from workers import lifeline
from workers.handler import AgentError, SessionContext
from workers.sandbox import LimitNotApplied, Limits, SandboxPool, SandboxUnavailable, Slot, find_bwrap

log = logging.getLogger("substrate.worker")

EPOCH_HEADER = "X-Substrate-Epoch"
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: sent by the router, value ``router``, when the turn's idempotency key is a request ID it made itself (the
#: client sent neither ``Idempotency-Key`` nor ``X-Request-ID``): made for the router's own retry
KEY_ORIGIN_HEADER = "X-Substrate-Key-Origin"
#: where the worker keeps its own data (the idempotency answers) inside a snapshot's state
_STATE_KEY = "__substrate__"


@dataclass(frozen=True)
class StoredAnswer:
    """The answer of one turn, kept by idempotency key (in the activation and in its snapshots).

    ``status``: HTTP status; ``text``: the JSON body; ``digest``: sha256 (hex) of the request body ("" if
    unknown); ``restored``/``restored_at``: the ``restored`` marker and ``restored_at`` of the activation
    that *ran* the turn ("": it had lost nothing; None: kept by a version before the markers). A replay
    in a later activation sends those, not its own: the answer shows the
    state of the activation that ran it (chaos run: a turn run right after a lossy restore and first
    acknowledged by its replay, after a clean suspend and resume, showed the loss with no restored
    header, or with the newer snapshot's time).
    """

    status: int
    text: str
    digest: str = ""
    restored: str | None = None
    restored_at: float | None = None
    #: the key is a request ID the router made (``KEY_ORIGIN_HEADER``) for its own retry; a client learns
    #: it only from the answer's ``X-Request-ID``, so such answers make room first (``keep_answer``)
    routers: bool = False

    def dump(self) -> list[Any]:
        """The JSON form kept in a snapshot."""
        return [self.status, self.text, self.digest, self.restored, self.restored_at, self.routers]

    @classmethod
    def load(cls, v: Any) -> "StoredAnswer":
        """From ``dump``'s form; also the older ``[status, text(, digest)]``. Raises ``TypeError`` /
        ``ValueError`` / ``IndexError`` on anything else."""
        return cls(int(v[0]), str(v[1]), str(v[2]) if len(v) > 2 and v[2] is not None else "",
                   str(v[3]) if len(v) > 3 and v[3] is not None else None,
                   float(v[4]) if len(v) > 4 and v[4] is not None else None,
                   len(v) > 5 and v[5] is True)


#: codes of a snapshot the session's own content refused (its workspace or state over what a snapshot
#: takes, an agent refusing it): a pressure suspend meeting one evicts the session (``Worker._evict``);
#: any other failure (the store, a timeout) leaves it RUNNING with all its state
EVICTED_FOR = ("workspace_too_large", "workspace_name_too_long", "workspace_unreadable", "state_too_large",
               "agent_error")
#: the longest wait between periodic snapshots of an activation whose snapshots keep failing (s)
_SNAPSHOT_RETRY_MAX_S = 300.0


def _phases_ms(t0: float, marks: list[tuple[str, float]]) -> dict[str, float]:
    """``{phase: ms}`` from ``t0`` and the ``(phase, perf_counter)`` marks that end each phase, in order
    (``sandbox``: a slot's sandbox taken; ``restore``: the snapshot downloaded and unpacked; ``recheck``: the
    directory asked whether the claim still holds; ``agent``: the agent started). Each is that phase's own
    time, rounded to 0.1 ms, so they add up to the activation's time on this worker."""
    out: dict[str, float] = {}
    for name, at in marks:
        out[name] = round((at - t0) * 1000, 1)
        t0 = at
    return out


def snapshot_due(last_s: float, failures: int, interval_s: float, now: float) -> bool:
    """Whether an activation's next periodic snapshot is due: ``interval_s`` after the last one (``last_s``,
    Unix s, taken or failed), the wait doubling after each of ``failures`` failures in a row, up to
    ``_SNAPSHOT_RETRY_MAX_S`` (never below the interval): an agent that refuses every snapshot logged a
    warning each interval for as long as it ran (fresh-user run)."""
    wait = min(interval_s * 2 ** min(failures, 32), max(interval_s, _SNAPSHOT_RETRY_MAX_S))
    return now - last_s >= wait


@dataclass
class Activation:
    """One session live in a slot of this worker."""

    sid: str
    epoch: int
    template: str
    spec: ActorTemplateSpec
    slot: int
    agent: HostedAgent
    workspace: Path
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.time)
    touched: bool = True
    dirty_turns: int = 0
    #: turns not yet reported to the directory by the heartbeat
    unreported_turns: int = 0
    last_snapshot_at: float = field(default_factory=time.time)
    closing: bool = False
    #: why this activation restored older state (``worker_lost`` ...): sent with every answer
    restored: str | None = None
    #: with ``restored``: createdAt (Unix s) of the snapshot it came back from (None: no snapshot, a fresh
    #: start); sent as ``X-Substrate-Restored-Snapshot-At``
    restored_at: float | None = None
    #: a turn ran in this activation: with ``restored``, its answer told a client of the loss, so the
    #: next committed snapshot may clear it from the record (``SnapshotManager.commit``)
    ran_turn: bool = False
    #: the local sandbox slot (uid, cgroup, folder) the agent runs in, and the lease it holds on it
    sandbox_slot: Slot | None = None
    sandbox_lease: int | None = None
    #: ``_drop`` ran (or runs): the sandbox is released once, whoever ends the activation first
    dropped: bool = False
    #: periodic snapshots that failed in a row (each doubles the wait before the next one)
    snapshot_failures: int = 0
    #: idempotency key -> answer of recent turns, oldest first
    answers: AnswerLog = field(default_factory=lambda: AnswerLog())
    #: the tenant whose token activated it: a token of another tenant never drives it, even if a router's
    #: stale cache sends one (a deleted ID re-created by another tenant at the same epoch)
    tenant: str = ""


#: status of the marker kept for a turn whose answer was too big to keep (the turn ran; a retry gets this)
NOT_KEPT_STATUS = 410


class AnswerLog(OrderedDict[str, StoredAnswer]):
    """Idempotency key -> kept answer (:class:`StoredAnswer`) of an activation's recent turns, oldest first,
    and ``kept_bytes``: the bytes of its whole answers (markers excluded). Change it only through
    :func:`keep_answer`, which keeps ``kept_bytes`` up to date, so that keeping a turn's answer costs the
    same whatever the number of answers kept (it summed all of them on every turn: about 3 % of a busy
    worker's CPU at the default 64 keys, 2026-12-04). ``routers``: the keys of the answers with
    ``StoredAnswer.routers``, oldest first (the first to make room)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept_bytes = 0
        self.routers: OrderedDict[str, None] = OrderedDict()


def _whole_bytes(answer: "StoredAnswer") -> int:
    """What ``answer`` counts against the answer budget: its bytes, or 0 for a marker."""
    return 0 if answer.status == NOT_KEPT_STATUS else len(answer.text)


def keep_answer(answers: AnswerLog, key: str, answer: "StoredAnswer", *, keys: int,
                budget: int) -> None:
    """Keep ``answer`` (its ``text`` is a JSON answer, ASCII: its length is its bytes) for idempotency
    ``key``, newest last, within ``keys`` answers (one more while the newest is a router-keyed answer, so
    the turn just answered is always kept) and ``budget`` bytes of whole answers: an answer over the
    budget, and then the oldest answers while the sum is over it, become a small marker (status 410
    ``answer_not_kept``), so a retry of any of the last ``keys`` turns is answered and never runs the turn
    again. Markers keep the digest and restored marker of the turn."""
    if len(answer.text) > budget and answer.status != NOT_KEPT_STATUS:  # a marker stays as it is: made
        # again it named itself (410) and its own size (a fresh-user run, with a budget under ~300 bytes)
        answer = replace(answer, status=NOT_KEPT_STATUS, text=_not_kept(answer.status, len(answer.text), budget))
    replaced = answers.get(key)
    if replaced is not None:
        answers.kept_bytes -= _whole_bytes(replaced)
        answers.routers.pop(key, None)
    answers[key] = answer
    answers.move_to_end(key)
    answers.kept_bytes += _whole_bytes(answer)
    if answer.routers:
        answers.routers[key] = None
    # one place more for the newest turn's answer when the router keyed it: with ``keys`` client keys
    # kept, that answer made room for itself first and was never kept, so the router's own retry of the
    # turn after a lost connection (or the client sending its X-Request-ID back) ran it again
    # (fresh-user round 23: the 65th turn of a session whose last 64 had client keys)
    limit = keys + 1 if answer.routers and keys > 0 else keys
    while len(answers) > limit:
        # the router's own keys go first (the oldest; the newest is the last of them): a client's key
        # stays answerable for its next ``keys`` keyed turns, whatever number of turns without a key run
        # in between (a fresh-user run: 70 keyless turns, and a retry of a keyed turn before them ran it
        # again)
        if answers.routers:
            gone = answers.pop(answers.routers.popitem(last=False)[0])
        else:
            gone = answers.popitem(last=False)[1]
        answers.kept_bytes -= _whole_bytes(gone)
    # whole answers count against the budget; markers (a few hundred bytes, at most ``keys``) do not
    if answers.kept_bytes <= budget:
        return
    for k, old in list(answers.items()):
        if answers.kept_bytes <= budget:
            break
        if old.status == NOT_KEPT_STATUS:
            continue
        answers[k] = replace(old, status=NOT_KEPT_STATUS, text=_not_kept(old.status, len(old.text), budget))
        answers.kept_bytes -= len(old.text)


def _not_kept(status: int, size: int, budget: int) -> str:
    return error_json({"code": "answer_not_kept", "message": (
        f"the turn with this Idempotency-Key already ran (it answered {status}); its {size}-byte answer was "
        f"not kept (over the worker's {budget}-byte replay budget, SUBSTRATE_WORKER__ANSWER_KEEP_BYTES), and the turn "
        "is not run again")})


def _error(exc: SubstrateError, status: int | None = None) -> web.Response:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s)))
    return web.json_response(exc.to_dict(), status=status or exc.status, headers=headers, dumps=error_json)


@contextlib.asynccontextmanager
async def _holding(lock: asyncio.Lock, wait_s: float | None, sid: str) -> AsyncIterator[None]:
    """Hold an activation's turn ``lock``, waiting at most ``wait_s`` (None: as long as it takes) for a
    running turn to end; past that ``Conflict`` (``busy``)."""
    if wait_s is None:
        await lock.acquire()
    else:
        try:
            await asyncio.wait_for(lock.acquire(), wait_s)
        except asyncio.TimeoutError:
            # named as every other 409 of a suspend names it (a fresh-user run: this one alone had no state)
            raise Conflict(f"session {sid!r} has been in the middle of a turn for over {wait_s:g} s; suspend "
                           "it again once the turn has ended", code="busy", details={"state": "RUNNING"}) from None
    try:
        yield
    finally:
        lock.release()


#: the shortest gap between heartbeats brought forward by a host that booted (``Worker._host_ready``)
_WARM_BEAT_MIN_S = 0.1


class Worker:
    """The worker's state and behaviour; ``app()`` builds its aiohttp application."""

    def __init__(self, settings: Settings, directory: Directory, snapshots: SnapshotManager, *,
                 worker_id: str, pool: str, slots: int, root: Path, sandboxes: SandboxPool) -> None:
        self.settings = settings
        self.sandboxes = sandboxes
        self.directory = directory
        self.snapshots = snapshots
        self.id = worker_id
        self.pool = pool
        self.slots = slots
        self.root = root
        self.activations: dict[str, Activation] = {}
        #: sandbox slots taken by activations still starting (not yet registered nor given back), and the
        #: busy slots no activation held at the last reconciliation (``_free_stray_sandboxes``)
        self._starting: set[int] = set()
        self._stray: set[int] = set()
        self.address = ""
        self.started_at = time.time()
        self._tasks: list[asyncio.Task[Any]] = []
        #: periodic snapshots due while their session was mid-turn, each waiting for that turn to end
        #: (``_periodic_snapshot_loop``): one per session at a time
        self._snapshots_waiting: dict[str, asyncio.Task[None]] = {}
        #: set on SIGTERM/SIGINT or when declared dead: ``serve`` then runs ``shutdown``
        self.stopping = asyncio.Event()
        #: set when the worker's record was found gone: its sessions may live elsewhere already
        self.declared_dead = False
        #: the lease as last renewed (s since epoch): the worker serves only before it
        self.lease_expires_at = 0.0
        #: held by a heartbeat from reading the activations' unreported turns to marking them reported, and
        #: by a suspend's commit, which folds an activation's unreported turns into the record: no turn is
        #: counted twice (or lost with the activation)
        self._turns_lock = asyncio.Lock()
        self._closed = False
        self.signing = SigningKeyRing(directory.redis, directory.keys, refresh_s=settings.auth.signing_refresh_s,
                                      pepper=settings.worker.internal_token)
        self.verifier = TokenVerifier(self.signing)
        #: the worker's own transitions (suspends on SIGTERM, sessions left behind) are audited here;
        #: those the control plane asks for over HTTP are audited by the caller
        self.audit = AuditLog(directory.redis, directory.keys, settings.audit)
        self.quotas = Quotas(directory.redis, directory.keys, settings.quota)
        #: this process's event-loop lag probes not yet reported by a heartbeat (the fleet's counts)
        self.loop_lag = LagCounts()
        #: warm slots as last reported; a host booting while it is 0 makes the next heartbeat come soon
        self._reported_warm = 0
        self._beat_soon = asyncio.Event()
        if sandboxes is not None:  # (unit tests of the HTTP layer build a worker without slots)
            sandboxes.on_host_ready = self._host_ready

    def _host_ready(self) -> None:
        if self._reported_warm == 0:
            self._beat_soon.set()

    # ----------------------------------------------------------------------------------- lifecycle
    async def register(self, address: str) -> None:
        self.address = address
        self.verifier.audience = address  # tokens for another worker are refused
        await self.signing.load()
        inventory = await gpu_inventory(self.settings.worker.nvidia_smi)  # None without nvidia-smi
        lease = time.time() + self.settings.worker.lease_s
        await self.directory.register_worker(WorkerRecord(
            id=self.id, pool=self.pool, address=address, slots=self.slots, state=WorkerState.READY,
            leaseExpiresAt=lease, startedAt=self.started_at, pid=os.getpid(),
            warmSlots=self.sandboxes.warm_slots(),  # 0 while its first hosts boot: placement goes elsewhere
            gpus=inventory[0] if inventory else None, gpuMemoryBytes=inventory[1] if inventory else None))
        self.lease_expires_at = lease
        self._tasks = [asyncio.create_task(self._heartbeat_loop()),
                       asyncio.create_task(self._periodic_snapshot_loop()),
                       asyncio.create_task(self._reconcile_loop()),
                       asyncio.create_task(run_forever(self._reload_signing, self.signing.refresh_s,
                                                       "signing key refresh", first_delay=True)),
                       asyncio.create_task(watch_lag(self._observe_lag))]

    def _observe_lag(self, lag_s: float) -> None:
        """One event-loop lag probe: this process's histogram, and the counts the heartbeat adds to the
        fleet's (``LagCounts``)."""
        metrics.EVENT_LOOP_LAG_SECONDS.observe(lag_s)
        self.loop_lag.observe(lag_s)

    async def _reload_signing(self) -> None:
        await self.signing.load(create=False)

    def serving(self) -> bool:
        """True while this worker's own lease is valid (self-fencing; see the module docstring)."""
        return not self.declared_dead and time.time() < self.lease_expires_at

    def _check_serving(self) -> None:
        if not self.serving():
            err = SubstrateError(f"worker {self.id} is past its lease and does not serve; retry",
                                 code="worker_fenced", retry_after_s=1)
            err.status = 503
            raise err

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            try:
                async with self._turns_lock:
                    # a session with turns to report is written too (the directory writes turns only
                    # for the sessions it touches)
                    touched = {a.sid: a.last_active for a in self.activations.values()
                               if a.touched or a.unreported_turns}
                    counted = [(a, a.unreported_turns) for a in self.activations.values() if a.unreported_turns]
                    turns = {a.sid: n for a, n in counted}
                    now = time.time()
                    window = self.settings.worker.active_window_s
                    first = self.settings.worker.first_turn_window_s
                    # a session yet to run its first turn is active for first_turn_window_s from its
                    # activation (a fresh-user burst: 100 creates, then a turn each; the first creates,
                    # idle past the active window when the last arrived, were suspended for them while
                    # the pool could still grow, and their turns then had to wake them)
                    active = sum(1 for a in self.activations.values()
                                 if a.lock.locked() or now - a.last_active < (window if a.ran_turn else max(window, first)))
                    lease = now + self.settings.worker.lease_s  # the worker's clock starts it before the call
                    self._beat_soon.clear()
                    warm = self.sandboxes.warm_slots()
                    lag = self.loop_lag.fields()
                    alive = await self.directory.heartbeat(self.id, lease, touched, turns, active, warm, counted_at=now,
                                                           loop_lag=lag)
                    self.loop_lag.take(lag)
                    self._reported_warm = warm
                    if alive:
                        self.lease_expires_at = lease
                    for sid in touched:
                        if sid in self.activations:
                            self.activations[sid].touched = False
                    for a, n in counted:  # the activations counted, even if ended meanwhile (``_end_dead``
                        a.unreported_turns -= n  # reports what is left: it must not report these again)
                if not alive:
                    log.error("worker record gone (declared dead): stopping", extra={"worker": self.id})
                    self.declared_dead = True
                    self.stopping.set()
                    break
            except Exception:  # noqa: BLE001 - a control loop never dies
                log.warning("heartbeat failed", exc_info=True)
            reraise_lost_cancel()
            # the next beat at the interval, or sooner once a host has booted on a worker that reported
            # no warm slot (a new worker's first hosts), at most every ``_WARM_BEAT_MIN_S``
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_soon.wait(), self.settings.worker.heartbeat_s)
            if self._beat_soon.is_set():
                await asyncio.sleep(_WARM_BEAT_MIN_S)

    async def _reconcile_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.settings.worker.reconcile_s)
            try:
                await self.reconcile()
                await self._free_stray_sandboxes()
            except Exception:  # noqa: BLE001 - a control loop never dies
                log.warning("activation reconciliation failed", exc_info=True)
            reraise_lost_cancel()

    async def _free_stray_sandboxes(self) -> list[int]:
        """Give back the sandbox slots that are busy while no activation holds them and none is starting
        in them, found so at two reconciliations in a row (a release under way in between is not taken
        for a stray; a second release of the same lease is ignored by the pool). A backstop: such a slot
        is never freed otherwise, and each one took a slot from the pool for good (a fresh-user run: 3 of
        4 slots held by agents no session owned; its cause is fixed in ``activate``). Returns the slot
        indexes freed."""
        slots = getattr(self.sandboxes, "slots", None) or []
        held = {a.sandbox_slot.index for a in self.activations.values() if a.sandbox_slot is not None}
        stray = {s.index for s in slots if s.busy and s.index not in held and s.index not in self._starting}
        due, self._stray = stray & self._stray, stray - self._stray
        for s in slots:
            if s.index in due:
                log.warning("freeing a sandbox slot no activation holds", extra={"worker": self.id, "slot": s.index})
                await self.sandboxes.release(s, None, lease=s.lease)
        return sorted(due)

    async def reconcile(self, only: str | None = None) -> list[str]:
        """Free every activation (of ``only``, or all) the directory does not name: its record is gone,
        or names another worker or epoch, or is no longer live. Returns the sessions freed.

        Safe against activations made meanwhile: the list is taken before the records are read, and a
        record's epoch is bumped before any activation of that epoch is made."""
        acts = [a for a in self.activations.values() if only is None or a.sid == only]
        if not acts:
            return []
        recs = await self.directory.get_sessions([a.sid for a in acts])
        by_id = {r.id: r for r in recs}
        freed = []
        for act in acts:
            rec = by_id.get(act.sid)
            if rec is not None and rec.epoch == act.epoch and rec.worker == self.id and rec.state in (
                    SessionState.STARTING, SessionState.RESUMING, SessionState.RUNNING, SessionState.SUSPENDING):
                continue
            if self.activations.get(act.sid) is not act:
                continue
            log.warning("freeing an activation the directory does not name", extra={
                "session": act.sid, "epoch": act.epoch, "worker": self.id,
                "record_epoch": rec.epoch if rec else None, "record_worker": rec.worker if rec else None})
            await self._drop(act)
            if rec is None or rec.worker != self.id or rec.slot != act.slot:
                await self.directory.release_slot(self.id, act.slot, act.sid)
            freed.append(act.sid)
        return freed

    async def _reconcile_quietly(self, sid: str) -> None:
        try:
            await self.reconcile(sid)
        except Exception:  # noqa: BLE001 - the timer retries
            log.warning("activation reconciliation failed", extra={"session": sid}, exc_info=True)

    async def _periodic_snapshot_loop(self) -> None:
        """Every 0.5 s, snapshot each session whose ``snapshotInterval`` is due (``snapshot_due``) and that
        ran a turn since its last one. A session mid-turn gets a task that waits for that turn and
        snapshots before the next one (the activation's lock is FIFO): it was skipped, and a session busy
        with back-to-back turns was never snapshotted (fresh-user tester 44: 39 turns in 80 s and no
        snapshot, all lost to a kill -9), so the interval bounded nothing for the busiest sessions. Idle
        ones are snapshotted in this loop, one after the other, as before."""
        while not self.stopping.is_set():
            await asyncio.sleep(0.5)
            now = time.time()
            for act in list(self.activations.values()):
                interval = act.spec.stateManagement.snapshot_interval_s
                if not interval or act.closing or act.dirty_turns == 0 or act.sid in self._snapshots_waiting:
                    continue
                if not snapshot_due(act.last_snapshot_at, act.snapshot_failures, interval, now):
                    continue
                if act.lock.locked():
                    task = asyncio.create_task(self._periodic_snapshot(act, now))
                    self._snapshots_waiting[act.sid] = task
                    task.add_done_callback(lambda _t, sid=act.sid: self._snapshots_waiting.pop(sid, None))
                    continue
                await self._periodic_snapshot(act, now)

    async def _periodic_snapshot(self, act: Activation, due_at: float) -> None:
        """One periodic snapshot of ``act`` (waiting for its turn under way, if any). Never raises: a
        failure is logged and retried later (``snapshot_due`` backs off), an activation that ended
        meanwhile is let be."""
        # no audit record here, neither for a periodic snapshot nor for one that failed: it changes no
        # lifecycle state (the session stays RUNNING with all its state; a failed one commits nothing).
        # The one way it does change state, finding the agent dead, goes through ``_end_dead``, which
        # records that move
        try:
            await self.snapshot(act.sid, act.epoch)
            act.snapshot_failures = 0
        except NotFound:
            pass  # suspended, deleted or ended while this waited for its turn: nothing left to save here
        except Exception as e:  # noqa: BLE001 - retried later, not every tick
            act.last_snapshot_at = due_at  # (a workspace that cannot be archived logged 100+ tracebacks/min)
            act.snapshot_failures += 1
            log.warning("periodic snapshot failed: %s", e, extra={"session": act.sid},
                        exc_info=not isinstance(e, SubstrateError))

    async def shutdown(self) -> None:
        """Stop: when declared dead, drop every activation (its sessions may live elsewhere already);
        else mark DRAINING (no new placements), suspend every session within ``shutdown_grace_s``
        (snapshot + commit: nothing acknowledged is lost), then deregister. A session that cannot be
        suspended in time is moved to SUSPENDED from its last snapshot, guarded by epoch and worker."""
        self.stopping.set()
        # the suspends below save every session: snapshots waiting for a turn would only delay them
        await cancel_and_wait(list(self._snapshots_waiting.values()))
        if not self.declared_dead:
            try:
                await self.directory.set_worker_state(self.id, WorkerState.DRAINING)
            except Exception:  # noqa: BLE001
                log.warning("could not mark the worker DRAINING", exc_info=True)
            try:
                await asyncio.wait_for(self._suspend_all(), self.settings.worker.shutdown_grace_s)
            except asyncio.TimeoutError:
                # say what it costs (a stop while the object store hangs: fresh-user round 22)
                log.warning("graceful stop ran out of time: %d session(s) not suspended lose their state since "
                            "their last snapshot (they wake from it, and their next answer says so in X-Substrate-Restored)",
                            len(self.activations), extra={"worker": self.id, "left": len(self.activations),
                                                          "sessions": sorted(self.activations)[:20]})
        self._closed = True
        await cancel_and_wait([*self._tasks, *self._snapshots_waiting.values()])
        left = list(self.activations.values())
        for act in left:
            await self._drop(act)
        await self.sandboxes.close()
        if not self.declared_dead:
            for act in left:  # not suspended in time: back from the last snapshot, and the answer says so
                try:
                    # a start or wake not yet settled has answered nothing: no loss marker of its own
                    cas = await self.directory.transition(
                        act.sid, from_states=UNANSWERED, epoch=act.epoch, worker=self.id,
                        to=SessionState.SUSPENDED, bump=True, unset=("worker", "slot"))
                    if not cas.ok:
                        cas = await self.directory.transition(
                            act.sid, from_states=[SessionState.RUNNING, SessionState.SUSPENDING], epoch=act.epoch,
                            worker=self.id, to=SessionState.SUSPENDED, bump=True,
                            set={"reason": "worker_lost", "message": f"worker {self.id} stopped before the "
                                 "session could be suspended; state since the last snapshot is gone"},
                            unset=("worker", "slot"))
                    if cas.ok:
                        await self._left_live("recover", act, reason="worker_lost")
                except Exception:  # noqa: BLE001 - the state manager recovers it from the lease
                    log.warning("could not release a session", extra={"session": act.sid}, exc_info=True)
            try:
                await self.directory.deregister_worker(self.id)
            except Exception:  # noqa: BLE001
                log.warning("deregister failed", exc_info=True)

    async def _suspend_all(self) -> None:
        sem = asyncio.Semaphore(4)

        async def one(act: Activation) -> None:
            async with sem:
                failed = ""
                for attempt in range(3):
                    if self.activations.get(act.sid) is not act:
                        return
                    try:
                        await self.suspend(act.sid, act.epoch, None, reason="drain")
                        await self._left_live("suspend", act, reason="drain")
                        return
                    except SubstrateError as e:
                        if e.code in ("not_active", "stale_epoch"):
                            return
                        failed = e.code
                        log.warning("suspend on stop failed", extra={"session": act.sid, "code": e.code,
                                                                     "attempt": attempt})
                        await asyncio.sleep(0.5)
                if failed and self.activations.get(act.sid) is act:  # one record for the drain that failed
                    await self._record("suspend", act, reason="drain", result=failed)

        await asyncio.gather(*(one(a) for a in list(self.activations.values())))

    async def _left_live(self, action: str, act: Activation, *, reason: str) -> None:
        """Activation ``act`` was moved out of a live state by this worker on its own (SIGTERM): give back
        its running quota (a suspended session holds none; the control plane does this for the moves it
        asks for, and the state manager's repair would otherwise take two passes) and leave one audit
        record (as ``system:control-plane``, the trust domain that decided it). Never raises."""
        try:
            await self.quotas.release(act.tenant or "default", act.template, act.sid, epoch=act.epoch)
        except Exception:  # noqa: BLE001 - the state manager's repair reconciles quota from the records
            log.warning("quota release failed", extra={"session": act.sid}, exc_info=True)
        await self._record(action, act, reason=reason)

    async def _record(self, action: str, act: Activation, *, reason: str, result: str = "ok") -> None:
        """One audit record of what this worker did on its own to activation ``act`` (``result``: ``ok``
        or the error code of an attempt that failed). Never raises (``AuditLog.record``)."""
        await self.audit.record(action, session=act.sid, tenant=act.tenant or "default", template=act.template,
                                worker=self.id, gpus=act.spec.resources.gpus, epoch=act.epoch, reason=reason,
                                result=result, who=SYSTEM)

    # ---------------------------------------------------------------------------------- operations
    async def _start_agent(self, ctx: SessionContext, spec: ActorTemplateSpec, box: Slot,
                           state: dict[str, Any] | None, ref: SnapshotRef | None) -> HostedAgent:
        """Start the session's agent in ``box`` with its restored ``state``; raises ``SubstrateError``
        ``agent_start_failed`` if it cannot start, or ``StateLoadFailed`` (422 ``state_load_failed``) only
        when the agent host answered ``start`` with that code: its positive word that loading ``state``
        failed (never inferred from a start failure in general). (Treating a restored agent that failed twice as a
        corrupt snapshot was tried and undone: under faults a good snapshot's agent can fail to start for
        reasons of the moment, and setting the snapshot aside then lost acknowledged turns; chaos run on
        main, 2026-12-01.)"""
        agent = self._agent_for(ctx, spec, box)
        try:
            await agent.start(state)
        except TurnFailed as e:
            await agent.stop()
            if e.code == "state_load_failed":  # the host's explicit word: the state is at fault
                raise StateLoadFailed(e.message, details=e.details) from e
            msg = str(e) if str(e).startswith("agent failed") else f"agent failed to start: {e}"
            # a turn's death says the agent "restarts from its last snapshot"; an agent that never started
            # has nothing to restart (a create is undone, a wake leaves the session as it was)
            msg = msg.replace(RESTART_HINT, "")
            if e.code == "memory_limit_exceeded":  # the template's limit is too low to start in: 422, its own code
                raise InvalidInput(msg, code="memory_limit_exceeded") from e
            raise SubstrateError(msg, code="agent_start_failed") from e
        except LimitNotApplied as e:  # never run without them
            await agent.stop()
            if e.memory_busy:
                # the kernel could not reclaim the slot's memory down to the limit, even with the slot
                # emptied for a host spawned under it (a loaded run: charges its gone processes left): the
                # limit is too small to start in, as an agent host killed at boot says (422, not 500)
                raise InvalidInput(f"agent failed to start: isolation.maxMemory ({spec.isolation.memory_bytes} bytes) "
                                   "is below what the slot's memory can be brought down to; raise the template's "
                                   f"maxMemory ({e})", code="memory_limit_exceeded") from e
            raise SubstrateError(f"agent failed to start: the template's isolation limits could not be put in "
                                 f"force ({e})", code="agent_start_failed") from e
        except Exception as e:
            await agent.stop()
            msg = str(e) if str(e).startswith("agent failed") else f"agent failed to start: {e}"
            raise SubstrateError(msg, code="agent_start_failed") from e
        return agent

    def _agent_for(self, ctx: SessionContext, spec: ActorTemplateSpec, slot: Slot) -> HostedAgent:
        if spec.entrypoint or spec.command:
            return HostedAgent(ctx, pool=self.sandboxes, slot=slot, limits=Limits.of(spec),
                               entrypoint=spec.entrypoint, argv=list(spec.command) if spec.command else None,
                               max_answer_bytes=self.settings.worker.max_answer_bytes)
        raise BadRequest("template has no entrypoint or command this worker can run",
                         code="unsupported_template")

    def _get(self, sid: str, epoch: int | None) -> Activation:
        act = self.activations.get(sid)
        if act is None or act.closing:
            raise NotFound(f"session {sid!r} is not active on worker {self.id}", code="not_active")
        if epoch is not None and epoch != act.epoch:
            raise StaleEpoch(f"epoch {epoch} is not the current activation epoch {act.epoch} of {sid!r}",
                             details={"epoch": act.epoch})
        return act

    async def authorize(self, request: web.Request, sid: str, *, any_epoch: bool = False) -> ActivationClaims:
        """Check the call's activation token for session ``sid`` (see the module docstring)."""
        c = await self.verifier.claims(bearer(request.headers))
        if c.session != sid:
            raise TokenNotForThisCall(f"activation token is for session {c.session!r}, not {sid!r}")
        if c.epoch is None and not any_epoch:
            raise TokenNotForThisCall("activation token carries no epoch")
        hdr = request.headers.get(EPOCH_HEADER)
        if hdr is not None and c.epoch is not None and hdr.strip() != str(c.epoch):
            raise BadRequest(f"{EPOCH_HEADER} {hdr!r} does not match the token's epoch", code="epoch_mismatch")
        return c

    async def activate(self, body: dict[str, Any], claims: ActivationClaims | None = None) -> dict[str, Any]:
        """Start (or restore) an activation. Idempotent for the same epoch; a newer epoch replaces an
        older activation of the same session (the old one is a zombie). ``claims``: the verified token,
        which must name this session and epoch; its tenant selects the template's credentials."""
        try:
            sid, epoch, template = str(body["session"]), int(body["epoch"]), str(body["template"])
            spec = ActorTemplateSpec.model_validate(body["spec"])
            slot = int(body.get("slot", -1))
            env = {str(k): str(v) for k, v in (body.get("env") or {}).items()}
            ref = SnapshotRef.model_validate(body["snapshot"]) if body.get("snapshot") else None
            restored = str(body["restored"]) if body.get("restored") else None
            # the time the restored state dates from, when the router knows better than the snapshot's
            # own (a snapshot committed by an activation that had lost state and ran no turn); 0: none
            at = body.get("restoredAt")
            restored_at = None if not restored else (float(at) or None) if at is not None else \
                (ref.createdAt if ref is not None else None)
            carried = [(str(k), StoredAnswer.load(v)) for k, v in (body.get("answers") or [])]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise BadRequest(f"bad activation request: {e}") from e
        if claims is not None and (claims.session != sid or claims.epoch != epoch):
            raise TokenNotForThisCall(f"activation token is for {claims.session!r} at epoch {claims.epoch}, "
                                      f"not {sid!r} at {epoch}")
        if self.stopping.is_set():
            raise NoCapacity(f"worker {self.id} is stopping")
        self._check_serving()
        old = self.activations.get(sid)
        if old is not None:
            if old.epoch == epoch:
                return {"session": sid, "epoch": epoch, "restored": False, "worker": self.id}
            if old.epoch > epoch:
                raise StaleEpoch(f"activation epoch {epoch} is older than {old.epoch}", details={"epoch": old.epoch})
            await self._drop(old)
        if len(self.activations) >= self.slots:
            await self.reconcile()  # an activation left behind by a failed transition must not block
        if len(self.activations) >= self.slots:
            raise NoCapacity(f"worker {self.id} has no free slot")
        t0 = time.perf_counter()
        template_env = {e.name: e.value for e in spec.env if e.value is not None}
        env = {**check_session_env(env, [e.name for e in spec.env]), **template_env}  # defence in depth
        try:
            box = await self.sandboxes.acquire(prefer=slot if slot >= 0 else None)
        except LookupError:
            raise NoCapacity(f"worker {self.id} has no free sandbox slot") from None
        self._starting.add(box.index)
        box_lease = box.lease
        workspace = box.workspace
        # the worker's phases of this activation (ms), sent back to the router for its Server-Timing
        marks = [("sandbox", time.perf_counter())]
        try:
            state: dict[str, Any] | None = None
            answers = AnswerLog()
            if ref is not None:
                # restored files belong to the slot's uid as they are made (no chown walk afterwards)
                state = await self.snapshots.restore(sid, ref, workspace, template, owner=box.uid)
                marks.append(("restore", time.perf_counter()))
                if isinstance(state, dict) and isinstance(state.get(_STATE_KEY), dict):
                    state = dict(state)
                    own = state.pop(_STATE_KEY)
                    for k, v in (own.get("answers") or []):  # the same bounds as live answers
                        keep_answer(answers, str(k), StoredAnswer.load(v), keys=self.settings.worker.idempotency_keys,
                                    budget=self.settings.worker.answer_keep_bytes)
            for k, a in carried:  # failed turns of an activation whose agent died (the record kept them)
                keep_answer(answers, k, a, keys=self.settings.worker.idempotency_keys,
                            budget=self.settings.worker.answer_keep_bytes)
            # the restore may have outlived the claim (a deadline rolled the session back): activate only
            # what the directory still names, or this slot would be held for nobody
            try:
                cur = (await self.directory.get_sessions([sid]) or [None])[0]
            except SubstrateError:
                cur = None
            if cur is not None and (cur.epoch != epoch or cur.worker != self.id):
                raise StaleEpoch(f"activation {epoch} of {sid!r} is no longer current (now {cur.epoch} on "
                                 f"{cur.worker})", details={"epoch": cur.epoch})
            marks.append(("recheck", time.perf_counter()))
            # credentials the template asks for, for this activation only (never in a record or a snapshot)
            env.update(resolve_env(spec.env, tenant=claims.tenant if claims else "default",
                                   secrets_dir=self.settings.auth.secrets_dir))
            ctx = SessionContext(session_id=sid, epoch=epoch, template=template, workspace=workspace, env=env)
            agent = await self._start_agent(ctx, spec, box, state, ref)
            marks.append(("agent", time.perf_counter()))
        except BaseException:
            self._starting.discard(box.index)
            await self.sandboxes.release(box, None, lease=box_lease)
            raise
        self._starting.discard(box.index)  # registered or dropped below, without an await in between
        made = Activation(sid=sid, epoch=epoch, template=template, spec=spec, slot=slot,
                          agent=agent, workspace=workspace, answers=answers,
                          restored=restored, tenant=claims.tenant if claims else "",
                          restored_at=restored_at,
                          sandbox_slot=box, sandbox_lease=box_lease)
        # another activation of this session may have been registered while this one started (two creates
        # of one ID around a DELETE, each with its own epoch, both past the claim re-check): the newer one
        # stays, the other is dropped with its sandbox. Overwriting it leaked its sandbox slot for good (a
        # fresh-user run: 3 of 4 slots held by agents no session owned, creates 503 no_capacity)
        now_there = self.activations.get(sid)
        if now_there is not None and now_there.epoch >= epoch:
            await self._drop(made)
            if now_there.epoch == epoch:  # the same activation asked for twice at once: it exists
                return {"session": sid, "epoch": epoch, "restored": False, "worker": self.id}
            raise StaleEpoch(f"activation epoch {epoch} is older than {now_there.epoch}",
                             details={"epoch": now_there.epoch})
        self.activations[sid] = made  # before the older one's drop awaits: no third one slips in between
        if now_there is not None:
            await self._drop(now_there)
        if ref is None:  # a new session (a restore is timed by the resume histogram in the router)
            metrics.ACTIVATION_DURATION_SECONDS.labels(template=template).observe(time.perf_counter() - t0)
        return {"session": sid, "epoch": epoch, "restored": ref is not None, "worker": self.id,
                "sandboxed": spec.isolation.sandbox, "phasesMs": _phases_ms(t0, marks)}

    async def _capture(self, act: Activation, epoch: int, *, deadline: float | None = None) -> SnapshotRef:
        """The agent's state, then its workspace packed and uploaded (not committed). ``deadline`` (event
        loop time) bounds the pack and upload: ``asyncio.TimeoutError`` past it. The agent's own call is
        bounded by its turn timeout only: cut mid-answer, its line would arrive for no request."""
        state = self._with_answers(await act.agent.snapshot(), act)
        act.agent.freeze(True)  # no agent process runs while its workspace is packed
        try:
            upload = self.snapshots.capture(act.sid, epoch, act.template, act.workspace, state,
                                            max_bytes=act.spec.isolation.disk_bytes)
            if deadline is None:
                return await upload
            return await asyncio.wait_for(upload, max(0.1, deadline - asyncio.get_running_loop().time()))
        finally:
            act.agent.freeze(False)
        return {"session": sid, "epoch": epoch, "restored": ref is not None, "worker": self.id}

    async def snapshot(self, sid: str, epoch: int) -> SnapshotRef:
        """Take and commit a snapshot of a running activation (no state change)."""
        act = self._get(sid, epoch)
        async with act.lock:
            if act.closing:
                raise NotFound(f"session {sid!r} is not active", code="not_active")
            dirty = act.dirty_turns
            try:
                ref = await self._capture(act, epoch)
            except Exception as e:
                if act.agent.dead:  # nothing to snapshot any more: its state since the last one is gone
                    await self._end_dead(act, f"found dead by a snapshot: {e}")
                    raise NotFound(f"session {sid!r} is not active (its agent died)", code="not_active") from e
                raise
            if not await self.snapshots.commit(sid, epoch, ref, unreported_loss=self._unreported_loss(act)):
                # rejected: the directory decides whether this activation is still the session's
                asyncio.create_task(self._reconcile_quietly(sid))
                raise StaleEpoch(f"snapshot of {sid!r} rejected: epoch {epoch} is not current or the "
                                 "session is not RUNNING")
            act.dirty_turns -= dirty
            act.last_snapshot_at = time.time()
            if act.restored and act.ran_turn:
                # the state is saved again: later answers no longer come from older state (README: the
                # marker holds "until a newer snapshot is committed"; it stayed for the whole activation,
                # fresh-user run 36). Kept while no answer has told of the loss yet (``_unreported_loss``)
                act.restored = act.restored_at = None
            return ref

    async def suspend(self, sid: str, epoch: int, idle_s: float | None, wait_s: float | None = None,
                      reason: str = "explicit") -> SnapshotRef:
        """Snapshot, commit with the move to SUSPENDED in one step, then free the slot (invariant 2).

        ``idle_s``: only if idle that long, never waiting for a turn; ``wait_s``: wait at most that long
        for a running turn to end; neither: wait for it (a drain). Raises ``Conflict`` (``busy``) when
        it would have to wait longer. If object storage fails the session goes back to RUNNING on this
        slot and the error is raised. ``reason`` (``models.SUSPEND_REASONS``) becomes ``suspendReason``.
        """
        act = self._get(sid, epoch)
        if idle_s is not None and act.lock.locked():  # mid-turn: an idle/pressure suspend must not wait
            raise Conflict(f"session {sid!r} is in the middle of a turn", code="busy")
        async with _holding(act.lock, wait_s, sid):
            if act.closing:
                raise NotFound(f"session {sid!r} is not active", code="not_active")
            if idle_s is not None and time.time() - act.last_active < idle_s:
                raise Conflict(f"session {sid!r} was active {time.time() - act.last_active:.1f}s ago",
                               code="busy")
            cas = await self.directory.transition(
                sid, from_states=[SessionState.RUNNING], epoch=epoch, worker=self.id,
                to=SessionState.SUSPENDING, deadline_s=self.settings.state.transition_deadline_s,
                tenant=act.tenant or None)
            if not cas.ok:
                if cas.epoch != epoch or not cas.found:
                    await self.reconcile(sid)
                    raise StaleEpoch(f"session {sid!r} moved on to epoch {cas.epoch}")
                raise Conflict(f"session {sid!r} is {cas.state.value if cas.state else 'gone'}, not RUNNING",
                               code="invalid_state")
            try:
                # within SUSPENDING's deadline: past it the state manager rolls the session back to RUNNING,
                # and a store that hangs (each call retried, 30 s apiece) kept the caller waiting ~93 s for
                # a failure the directory had settled at 60 s (fresh-user round 15)
                budget_s = self.settings.state.transition_deadline_s * 0.9
                try:
                    ref = await self._capture(act, epoch, deadline=asyncio.get_running_loop().time() + budget_s)
                except asyncio.TimeoutError:
                    err = SubstrateError(f"suspend of {sid!r} did not finish within {budget_s:g} s (SUSPENDING's "
                                         "deadline): the object store is too slow or hangs; the session stays "
                                         "RUNNING with all its state", code="suspend_timeout", retry_after_s=5)
                    err.status = 503
                    raise err from None
            except BaseException as e:
                if act.agent.dead:  # suspended from its last snapshot instead, and the next answer says so
                    moved = await self._end_dead(act, f"found dead by a suspend: {e}")
                    if moved and reason == "explicit" and isinstance(e, TurnFailed) and not isinstance(e, AgentGone):
                        # this suspend's own snapshot call ended the agent (it hung past the turn timeout,
                        # ran out of memory, crashed): the caller is told, never a 202 naming a snapshot
                        # that holds none of the state it asked to save (fresh-user round 14)
                        raise TurnFailed(
                            f"the suspend could not snapshot the agent ({e}); its process was ended, so the "
                            "session is SUSPENDED from its last committed snapshot and its state since then "
                            "is gone (with no snapshot yet, its next wake starts it empty)",
                            e.code, details={"state": SessionState.SUSPENDED.value}) from e
                    raise NotFound(f"session {sid!r} is not active (its agent died)", code="not_active") from e
                if reason == "pressure" and isinstance(e, SubstrateError) and e.code in EVICTED_FOR:
                    raise await self._evict(act, e) from e
                await self.directory.transition(sid, from_states=[SessionState.SUSPENDING], epoch=epoch,
                                                to=SessionState.RUNNING, tenant=act.tenant or None)
                raise
            # the turns no heartbeat reported yet go into the same atomic step (none is in flight while the
            # lock is held): the suspend's answer counts every turn, and none is lost with the activation
            async with self._turns_lock:
                committed = await self.snapshots.commit(sid, epoch, ref, suspend=True, turns=act.unreported_turns,
                                                        unreported_loss=self._unreported_loss(act),
                                                        suspend_reason=reason)
                if committed:
                    act.unreported_turns = 0
            if not committed:
                # e.g. the object store was slow past the deadline and the session was rolled back to
                # RUNNING here: the activation stays (the directory names it); only the directory's
                # epoch decides whether it goes
                await self.reconcile(sid)
                if self.activations.get(sid) is act:
                    err = SubstrateError(f"suspend of {sid!r} did not finish before its deadline; the session "
                                         "stays RUNNING with all its state", code="suspend_timeout",
                                         retry_after_s=1)
                    err.status = 503
                    raise err
                raise StaleEpoch(f"suspend of {sid!r} rejected: epoch {epoch} is no longer current")
            act.closing = True
            if self.activations.get(sid) is act:
                del self.activations[sid]
            # the slot is free as soon as the state is safe; the sandbox is torn down after
            await self.directory.release_slot(self.id, act.slot, sid)
            await self._drop(act)
            return ref

    async def _evict(self, act: Activation, refused: SubstrateError) -> SubstrateError:
        """End ``act``, an idle session whose pressure suspend its own content refused (``refused.code`` in
        ``EVICTED_FOR``), as a dead agent's activation ends: SUSPENDED from its last committed snapshot under
        a new epoch, reason ``evicted``, the slot freed; its next answer says ``X-Substrate-Restored:
        evicted``. Without this such a session never gave its slot back, and one tenant's sessions over
        their disk limit held a fixed pool against every other tenant (fresh-user run 35). Kubernetes
        evicts a Pod over its ephemeral-storage limit the same way. Called with the activation's lock
        held (no turn runs). Returns the error the caller raises: 409 ``session_evicted`` if the record
        moved, else 404 ``not_active`` (a delete took it, or the router repairs it as ``activation_lost``)."""
        what = (f"evicted under slot pressure: its suspend was refused ({refused.code}: {str(refused)[:200]}); "
                "state since the last snapshot is gone")
        if not await self._end_dead(act, what, reason="evicted", message=what, action="evict",
                                    record_reason=refused.code):
            return NotFound(f"session {act.sid!r} is not active", code="not_active")
        return Conflict(f"session {act.sid!r} was evicted: {what}", code="session_evicted",
                        details={"refused": refused.code})

    def _with_answers(self, state: dict[str, Any], act: Activation) -> dict[str, Any]:
        """The agent's state plus the worker's own part (recent turns' answers by idempotency key)."""
        return {**state, _STATE_KEY: {"answers": [[k, v.dump()] for k, v in act.answers.items()]}}

    async def deactivate(self, sid: str, epoch: int | None) -> None:
        """End the activation of ``sid`` at once, even mid-turn (a delete or a fenced claim must not wait
        for a long turn). With ``epoch``: only an activation of that epoch or older (a newer one is the
        session's current activation and stays: 409)."""
        act = self.activations.get(sid)
        if act is None or act.closing:
            raise NotFound(f"session {sid!r} is not active on worker {self.id}", code="not_active")
        if epoch is not None and act.epoch > epoch:
            raise StaleEpoch(f"activation {act.epoch} of {sid!r} is newer than {epoch}", details={"epoch": act.epoch})
        act.closing = True
        await self._drop(act)

    async def _drop(self, act: Activation) -> None:
        """Stop the agent and release its sandbox slot, once per activation: a suspend that committed
        and the reconciler that saw the committed record both end the same activation, and a second
        release of the slot, after another session had taken it, killed that session's agent (its
        cgroup swept) and freed the slot under it (a 2x replay: five agents killed in a row)."""
        act.closing = True
        if self.activations.get(act.sid) is act:
            del self.activations[act.sid]
        if act.dropped:
            return
        act.dropped = True
        try:
            await act.agent.stop()
        except Exception:  # noqa: BLE001
            log.warning("agent stop failed", extra={"session": act.sid}, exc_info=True)
        # kills whatever is left of the session's processes, empties the workspace, pre-starts the next host
        if act.sandbox_slot is not None:
            await self.sandboxes.release(act.sandbox_slot, None, lease=act.sandbox_lease)

    # ------------------------------------------------------------------------------------ HTTP layer
    def app(self) -> web.Application:
        @web.middleware
        async def internal_auth(request: web.Request, handler: Any) -> web.StreamResponse:
            # only the control plane may call a worker (each handler checks what the token is bound to);
            # /healthz and /metrics stay open for probes and scrapers
            if request.path not in ("/healthz", "/metrics") and bearer(request.headers) is None:
                return _error(SubstrateError("missing activation token", code="missing_token"), 401)
            return await handler(request)

        @web.middleware
        async def unexpected_errors(request: web.Request, handler: Any) -> web.StreamResponse:
            # a bug here must still answer JSON with a stable code (500 ``internal``), logged with its
            # traceback, never aiohttp's plain-text "Server got itself in trouble" (which the router can
            # only pass on as an opaque ``worker_error``). aiohttp's own HTTP answers (404/405 of the
            # routing) are exceptions too and pass through
            try:
                return await handler(request)
            except web.HTTPException:
                raise
            except Exception as e:  # noqa: BLE001 - the catch-all
                log.exception("unhandled error in a worker call", extra={
                    "worker": self.id, "path": request.path, "method": request.method,
                    "request_id": request.headers.get("X-Request-ID")})
                return _error(SubstrateError(f"the worker failed unexpectedly ({e.__class__.__name__}); "
                                             "it is logged on the worker", code="internal"), 500)

        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[unexpected_errors, internal_auth])
        app.add_routes([
            web.get("/healthz", self._h_health),
            web.get("/metrics", self._h_metrics),
            web.get("/v1/activations", self._h_list),
            web.post("/v1/activations", self._h_activate),
            web.post("/v1/activations/{sid}/invoke", self._h_invoke),
            web.post("/v1/activations/{sid}/snapshot", self._h_snapshot),
            web.post("/v1/activations/{sid}/suspend", self._h_suspend),
            web.delete("/v1/activations/{sid}", self._h_delete),
        ])
        return app

    async def _h_health(self, request: web.Request) -> web.Response:
        if self.stopping.is_set():
            return web.json_response({"status": "stopping"}, status=503)
        return web.json_response({"status": "ok", "worker": self.id, "active": len(self.activations)})

    async def _h_metrics(self, request: web.Request) -> web.Response:
        """Prometheus metrics of this worker (snapshot sizes and durations are measured here)."""
        payload, ctype = metrics.render_latest()
        return web.Response(body=payload, headers={"Content-Type": ctype})

    async def _h_list(self, request: web.Request) -> web.Response:
        try:
            await self.authorize(request, ANY_SESSION, any_epoch=True)
        except SubstrateError as e:
            return _error(e)
        return web.json_response({"worker": self.id, "slots": self.slots, "items": [
            {"session": a.sid, "epoch": a.epoch, "slot": a.slot, "template": a.template,
             "lastActive": a.last_active, "busy": a.lock.locked()} for a in self.activations.values()]})

    async def _h_activate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            claims = await self.authorize(request, str(body.get("session", "")) if isinstance(body, dict) else "")
            return web.json_response(await self.activate(body, claims), status=201)
        except SubstrateError as e:
            return _error(e)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return _error(BadRequest("body is not JSON"))
        except Exception as e:  # noqa: BLE001 - always a JSON answer, never aiohttp's plain-text 500
            log.exception("activation failed", extra={"worker": self.id})
            return _error(SubstrateError(f"activation failed: {public_detail(e)}", code="activation_failed"))

    async def _h_invoke(self, request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        ran: Activation | None = None  # the activation this turn ran on, once it runs
        try:
            self._check_serving()
            claims = await self.authorize(request, sid)
            act = self._get(sid, claims.epoch)
            if act.tenant != claims.tenant:
                raise Conflict(f"session {sid!r} here belongs to another tenant", code="tenant_mismatch")
            raw = await request.read()
            digest = hashlib.sha256(raw).hexdigest()
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError, UnicodeDecodeError):  # also too deep / huge numbers
                raise BadRequest("body must be JSON: {\"input\": ...}", code="bad_json") from None
            if not isinstance(body, dict) or "input" not in body:
                raise BadRequest("body must be a JSON object with an 'input' field", code="missing_input")
            stream = request.query.get("stream") in ("1", "true")
            key = request.headers.get(IDEMPOTENCY_HEADER)
            routers = request.headers.get(KEY_ORIGIN_HEADER) == "router"
            async with act.lock:
                if act.closing:  # suspended or dropped while this request waited for the turn
                    raise NotFound(f"session {sid!r} is not active", code="not_active")
                if key is not None and key in act.answers:  # a retried turn: answered, never run twice
                    stored = act.answers[key]
                    if stored.digest and stored.digest != digest:  # another turn's key: replaying would mislead
                        raise InvalidInput(f"Idempotency-Key {key!r} was used for a turn with another body",
                                           code="idempotency_key_reused")
                    # in the form the turn first ran: a streamed turn's answer is its NDJSON lines (a JSON
                    # answer is one line: json.dumps writes no raw newline)
                    return web.Response(text=stored.text, status=stored.status,
                                        content_type="application/x-ndjson" if "\n" in stored.text
                                        else "application/json",
                                        headers={"X-Substrate-Replayed": "1", **self._restored(act, stored)})
                if act.agent.dead:  # died between turns (killed, or since the last call): nothing runs here
                    await self._end_dead(act, "the agent process was found dead")
                    raise NotFound(f"session {sid!r} is not active (its agent died)", code="not_active")
                self._check_serving()
                act.last_active = time.time()
                act.touched = True
                act.ran_turn = True
                ran = act
                try:
                    if stream:
                        return await self._stream_turn(request, act, body["input"], key, digest, routers=routers)
                    try:
                        output = await act.agent.invoke(body["input"])
                    except AgentError as e:
                        raise self._remember(act, key, digest, SubstrateError(str(e), code="agent_error"),
                                             routers=routers) from e
                    except AgentGone as e:  # died before this turn reached it: it runs in the next activation
                        await self._end_dead(act, f"{e.code}: {e}")
                        raise NotFound(f"session {sid!r} is not active (its agent died)", code="not_active") from e
                    except TurnFailed as e:  # timeout, memory limit, crash of the agent's process
                        self._remember(act, key, digest, e, routers=routers)
                        if act.agent.dead:
                            # its state since the last snapshot is gone: end the activation (the next turn
                            # brings the session back from that snapshot under a new epoch and says so); this
                            # answer travels with the record, so a retry is answered, not run again
                            await self._end_dead(act, f"{e.code}: {e}")
                        raise
                    except NotImplementedError as e:
                        raise SubstrateError("agent does not implement invoke", code="agent_error") from e
                    except Exception as e:  # noqa: BLE001 - an agent bug is the turn's answer
                        log.exception("agent crashed in a turn", extra={
                            "session": sid, "epoch": act.epoch, "worker": self.id,
                            "request_id": request.headers.get("X-Request-ID")})
                        raise self._remember(act, key, digest, SubstrateError(
                            f"agent raised {e.__class__.__name__}: {e}", code="agent_crashed"), routers=routers) from e
                    act.dirty_turns += 1
                    act.unreported_turns += 1
                    text = json.dumps({"output": output})
                    if key is not None:
                        self._store_answer(act, key, 200, text, digest, routers=routers)
                    # past the lease now (paused mid-turn)? the session may live elsewhere: do not
                    # acknowledge; a retry with the same key gets this answer if this activation stays
                    self._check_serving()
                    return web.Response(text=text, status=200, content_type="application/json",
                                        headers=self._restored(act))
                finally:
                    # reported by the next heartbeat: a turn longer than a heartbeat period had its
                    # flag cleared mid-turn, so its end (and its count) went unreported
                    act.last_active = time.time()
                    act.touched = True
        except SubstrateError as e:
            if e.code in ("agent_error",):
                e.status = 422
            resp = _error(e)
            if ran is not None:
                # a failed turn says what its activation had lost, as its kept answer's replay will (it
                # said so only when the router had just woken the session)
                resp.headers.update(self._restored(ran))
            return resp

    @staticmethod
    def _unreported_loss(act: Activation) -> float | None:
        """For a commit: the time ``act``'s state dates from if it restored older state and ran no turn
        yet (no answer has told a client of the loss: the record keeps it), 0 if no state came back;
        None when there is no such loss to keep."""
        if not act.restored or act.ran_turn:
            return None
        return act.restored_at if act.restored_at is not None else 0.0

    @staticmethod
    def _restored(act: Activation, stored: StoredAnswer | None = None) -> dict[str, str]:
        """``X-Substrate-Restored`` (and ``-Snapshot-At``) of an answer: the activation that ran the turn
        (``stored``, for a replay) says what its state had lost; else this activation."""
        # "" : the turn ran on an activation that had lost nothing (its replay carries no marker, whatever
        # this activation lost: fresh-user run); None: an answer kept before markers were (this one's)
        restored, at = (stored.restored, stored.restored_at) if stored is not None and stored.restored is not None \
            else (act.restored, act.restored_at)
        if not restored:
            return {}
        return {"X-Substrate-Restored": restored,
                **({"X-Substrate-Restored-Snapshot-At": f"{at:.6f}"} if at is not None else {})}

    async def _end_dead(self, act: Activation, what: str, failed_key: str | None = None, *,
                        reason: str = "agent_restarted", message: str | None = None, action: str = "recover",
                        record_reason: str | None = None) -> bool:
        """End an activation whose agent died (crash, memory limit, turn timeout): the record goes (guarded
        by epoch and worker) to SUSPENDED with a new epoch, marked ``agent_restarted``, so the next turn
        restores its last committed snapshot elsewhere or here, and every answer of that activation says
        so; then the sandbox goes and the slot is freed. Never raises: if the directory cannot be reached
        the record still names this activation, and the next call's ``not_active`` makes the router
        repair it (``activation_lost``, lossy too).

        The activation's failed answers (the turn that killed the agent among them) go with the record
        (``carriedAnswers``, the newest 16) to the next activation: a retry of that turn is answered with
        its error, never run again (an SDK retrying a 504 would otherwise rerun a turn that times out);
        ``failed_key``: the key of a streamed turn that killed the agent, whose kept answer (its NDJSON lines,
        ending in the error) has the stream's status 200 and goes with them. ``reason``/``message``: the
        record's (``_evict`` ends a live agent's activation this way: ``evicted``); ``action`` and
        ``record_reason``: its audit record's (default ``recover`` with ``reason``). Returns whether this
        call moved the record to SUSPENDED."""
        act.closing = True
        moved = deleted = False
        # ``failed_key``: a streamed turn that failed in-band (its kept answer's status is the stream's 200)
        carried = [[k, a.dump()] for k, a in act.answers.items() if a.status >= 400 or k == failed_key][-16:]
        for attempt in range(3):  # a short Redis pause must not leave the repair to a later request
            try:
                cas = await self.directory.transition(
                    act.sid, from_states=[SessionState.RUNNING, SessionState.SUSPENDING], epoch=act.epoch,
                    worker=self.id, to=SessionState.SUSPENDED, bump=True,
                    set={"reason": reason,
                         "message": message or f"the agent of activation {act.epoch} on worker {self.id} died "
                                               f"({what[:300]}); state since the last snapshot is gone",
                         **({"carriedAnswers": carried} if carried else {})},
                    unset=("worker", "slot"))
                moved = cas.ok
                deleted = not cas.ok and (not cas.found or cas.state == SessionState.DELETED)
                break
            except Exception:  # noqa: BLE001 - retried, then left to the router's repair
                log.warning("could not end the activation of a dead agent", extra={
                    "session": act.sid, "epoch": act.epoch, "attempt": attempt}, exc_info=True)
                await asyncio.sleep(0.3)
        if deleted:  # the delete stopped the agent: nothing died that restarts (fresh-user run: a warning)
            log.info("session deleted during a turn: activation ended", extra={
                "session": act.sid, "epoch": act.epoch, "worker": self.id})
        else:
            log.warning("agent died: activation ended" if reason == "agent_restarted" else f"activation ended: {reason}",
                        extra={"session": act.sid, "epoch": act.epoch, "worker": self.id, "moved": moved,
                               "why": what[:300]})
        await self._drop(act)
        if moved:
            # the turns it answered that no heartbeat reported yet (the next beat no longer sees it): the
            # session's ``turns`` lost them (fresh-user run: 3 turns, a crash, ``turns: 0``)
            async with self._turns_lock:
                n, act.unreported_turns = act.unreported_turns, 0
            if n:
                try:
                    await self.directory.add_turns(act.sid, n, act.last_active)
                except Exception:  # noqa: BLE001 - a count, not state: the session is recovered anyway
                    log.warning("could not count the turns of an ended activation", extra={"session": act.sid},
                                exc_info=True)
            try:
                await self.directory.release_slot(self.id, act.slot, act.sid)
            except Exception:  # noqa: BLE001 - the state manager's repair pass frees a slot nobody holds
                log.warning("slot release failed", extra={"session": act.sid}, exc_info=True)
            # this worker made the move on its own: it leaves the one record of it (epoch: the activation
            # that died, as the router's ``recover`` records do) and gives back the running quota. A move
            # that lost its CAS was made by someone else, who records it; one the directory never saw is
            # repaired (and recorded) by the router as ``activation_lost``
            await self._left_live(action, act, reason=record_reason or reason)
        return moved

    def _store_answer(self, act: Activation, key: str, status: int, text: str, digest: str, *,
                      routers: bool = False) -> None:
        keep_answer(act.answers, key, StoredAnswer(status, text, digest, act.restored or "", act.restored_at,
                                                   routers),
                    keys=self.settings.worker.idempotency_keys, budget=self.settings.worker.answer_keep_bytes)

    def _remember(self, act: Activation, key: str | None, digest: str, e: SubstrateError, *,
                  routers: bool = False) -> SubstrateError:
        """Record an agent's failed turn as the answer of ``key`` (it ran: a retry must not run it again)."""
        if key is not None:
            status = 422 if e.code == "agent_error" else e.status
            self._store_answer(act, key, status, error_json(e.to_dict()), digest, routers=routers)
        return e

    async def _stream_turn(self, request: web.Request, act: Activation, input: Any, key: str | None,  # noqa: A002
                           digest: str, *, routers: bool = False) -> web.StreamResponse:
        """Run one turn as NDJSON lines (``{"chunk": ...}``..., then ``{"done": true}`` or ``{"error": ...}``)
        and keep those lines as the answer of ``key``, as a plain turn's answer is kept: a retry with the
        same key is answered with them (``X-Substrate-Replayed``), never run again (a fresh-user run: a
        streamed increment retried with its key ran twice). Lines beyond the replay budget
        (``worker.answer_keep_bytes``) are not buffered; the turn then leaves the 410 marker."""
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", **self._restored(act)})
        await resp.prepare(request)
        budget = self.settings.worker.answer_keep_bytes
        kept: list[bytes] = []
        size = 0
        gone = False

        async def emit(line: bytes) -> None:
            nonlocal size, gone
            size += len(line)
            if size <= budget:
                kept.append(line)
            else:
                kept.clear()  # over the budget: only its size is remembered
            if gone:
                return
            try:
                await resp.write(line)
            except ConnectionError:  # the client (the router) went away: the turn still runs to its
                gone = True  # end and its answer is kept for a retry with the same key, as a whole turn's

        kept_once = False

        def keep() -> None:
            # the turn ran (whole, failed, or cut off): its retry is answered with it, never run again
            nonlocal kept_once
            if key is None or kept_once:
                return
            kept_once = True
            if size <= budget:
                self._store_answer(act, key, 200, b"".join(kept).decode(), digest, routers=routers)
            else:
                keep_answer(act.answers, key, StoredAnswer(NOT_KEPT_STATUS, _not_kept(200, size, budget), digest,
                                                           act.restored or "", act.restored_at, routers),
                            keys=self.settings.worker.idempotency_keys, budget=budget)

        try:
            try:
                # closed on every way out, while this turn still holds the activation's lock: a stream left
                # open mid-answer would leave its lines in the agent's pipe for the next request
                async with contextlib.aclosing(act.agent.stream(input)) as chunks:
                    async for chunk in chunks:
                        await emit(json.dumps({"chunk": chunk}).encode() + b"\n")
                act.dirty_turns += 1
                act.unreported_turns += 1
                await emit(b'{"done": true}\n')
            except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
                code = "agent_error" if isinstance(e, AgentError) else e.code if isinstance(e, TurnFailed) \
                    else "agent_crashed"
                await emit(error_json({"error": {"code": code, "message": str(e)}}).encode() + b"\n")
                if act.agent.dead:
                    # kept first: the dead activation's failed answers go with the record to the next one,
                    # so a retry is answered with this error, never run again (a fresh-user run: a streamed
                    # turn that killed its agent ran again, and killed it again, on every retry)
                    keep()
                    await self._end_dead(act, f"{code}: {e}", failed_key=key)
        finally:
            keep()
        if not gone:
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        return resp

    async def _h_snapshot(self, request: web.Request) -> web.Response:
        try:
            sid = request.match_info["sid"]
            ref = await self.snapshot(sid, (await self.authorize(request, sid)).epoch or 0)
            return web.json_response({"snapshot": ref.model_dump()})
        except SubstrateError as e:
            return _error(e)

    async def _h_suspend(self, request: web.Request) -> web.Response:
        try:
            idle, wait = request.query.get("idle_s"), request.query.get("wait_s")
            reason = request.query.get("reason", "explicit")
            if reason not in SUSPEND_REASONS:
                raise InvalidInput(f"reason must be one of {', '.join(SUSPEND_REASONS)}, not {reason[:40]!r}",
                                   code="invalid_reason")
            sid = request.match_info["sid"]
            ref = await self.suspend(sid, (await self.authorize(request, sid)).epoch or 0,
                                     float(idle) if idle else None, float(wait) if wait else None, reason=reason)
            return web.json_response({"snapshot": ref.model_dump()})
        except SubstrateError as e:
            return _error(e)

    async def _h_delete(self, request: web.Request) -> web.Response:
        try:
            sid = request.match_info["sid"]
            await self.deactivate(sid, (await self.authorize(request, sid, any_epoch=True)).epoch)
            return web.Response(status=204)
        except SubstrateError as e:
            return _error(e)


def pool_opts_out_of_sandbox(settings: Settings, pool: str) -> bool:
    """True only if the config names templates for ``pool`` and every one sets ``isolation.sandbox: false``."""
    from substrate.specs import load_catalog

    try:
        cat = load_catalog(settings.config_dir, log_warnings=False)  # the control plane logs them, once
    except Exception:  # noqa: BLE001 - no readable catalog (e.g. Kubernetes): the sandbox is required
        return False
    first = next(iter(cat.pools), None)
    mine = [t for t in cat.templates.values() if (t.spec.workerPool or first) == pool]
    return bool(mine) and all(not t.spec.isolation.sandbox for t in mine)


def listen_socket(host: str, port: int, port_range: tuple[int, int] | None = None) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port), not yet listening; or, for port 0 with
    ``port_range`` ``(LO, HI)``, bound to a free one of those (tried from a random one on) and listening. An IPv6 literal
    (``::``, ``fd00::5``) binds an IPv6 socket; ``::`` also takes IPv4 connections (dual stack,
    ``IPV6_V6ONLY`` off), so an IPv6-only or dual-stack cluster sets ``SUBSTRATE_WORKER_LISTEN_HOST=::``.
    Anything else (an IPv4 address, a name) binds IPv4 as before. Raises ``OSError`` as ``bind`` does;
    ``EADDRINUSE`` naming the range when every port of it is taken."""
    if port == 0 and port_range is not None:
        lo, hi = port_range
        for candidate in ports_in_random_order(lo, hi):
            try:
                sock = listen_socket(host, candidate)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
            try:
                # listening now claims the port: with SO_REUSEADDR two sockets that are not yet listening
                # may both bind it (two workers starting at once did), and the second failed later
                sock.listen(128)
            except OSError as e:
                sock.close()
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
            return sock
        raise OSError(errno.EADDRINUSE, f"no free port in SUBSTRATE_WORKER__PORT_RANGE {lo}-{hi} on {host}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_host(host: str, advertise_host: str | None) -> str:
    """The address a worker binds: ``host``, except the IPv4 wildcard ``0.0.0.0`` (the default) with an
    IPv6 address to advertise (an IPv6 Pod IP, on an IPv6-only or IPv6-first cluster) becomes ``::``,
    which the advertised address reaches (and, dual stack, IPv4 too)."""
    if host == "0.0.0.0" and advertise_host and ":" in advertise_host:
        return "::"
    return host


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host a worker registers: ``advertise_host`` when given (on Kubernetes its Pod IP), else the
    host it listens on, except a wildcard (``0.0.0.0``, ``::``), which no client can connect to by name:
    then this machine's loopback of that family, which the local runtime's router reaches (it registered
    ``http://0.0.0.0:port``: fresh-user round 23)."""
    if advertise_host:
        return advertise_host
    if host in ("0.0.0.0", "::", "[::]"):
        return "127.0.0.1" if host == "0.0.0.0" else "::1"
    return host


def worker_url(host: str, port: int) -> str:
    """The address a worker registers: ``http://host:port``, an IPv6 literal in brackets (RFC 3986 3.2.2:
    ``http://[fd00::5]:8081``; a Pod IP from ``SUBSTRATE_POD_IP`` is given bare)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve(settings: Settings, *, worker_id: str, pool: str, slots: int, host: str, port: int,
                ready_fd: int | None = None, advertise_host: str | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT or until it is declared dead. It listens on ``host:port`` and
    registers ``http://<advertise_host or host>:<port>`` (on Kubernetes: binds 0.0.0.0, advertises the
    Pod IP)."""
    import kubernetes.utils  # noqa: F401 - parse_quantity (isolation limits): seconds to import, never in a request
    directory = Directory(settings.redis.url or "redis://127.0.0.1:6379/0", settings.redis.key_prefix,
                          socket_timeout_s=settings.redis.socket_timeout_s)
    root = Path(settings.worker.root_dir) / worker_id
    store = GuardedStore(make_store(settings.snapshot), directory.redis, directory.keys, settings.snapshot)
    snapshots = SnapshotManager(store, directory, settings.snapshot, root / "tmp")
    try:  # first: a worker that cannot listen starts nothing
        sock = listen_socket(bind_host(host, advertise_host), port, settings.worker.ports)
    except OSError as e:
        # one line (its pool's next worker start backs off while none is free: substrate.backends.backoff)
        log.error(f"worker cannot listen: {e.strerror or e}", extra={"worker": worker_id, "pool": pool})
        await directory.close()
        raise SystemExit(2) from e
    try:
        sandboxes = SandboxPool(root, slots + settings.worker.sandbox_spares(), name=worker_id, bwrap=find_bwrap(),
                                uid_base=settings.worker.sandbox_uid_base, uid_span=settings.worker.sandbox_uid_span,
                                uid_lock_dir=settings.worker.sandbox_uid_lock_dir,
                                prestart=settings.worker.prestart_hosts,
                                read_limit=settings.worker.max_answer_bytes + LINE_SLACK_BYTES,
                                refill_delay_s=settings.worker.prestart_refill_delay_s,
                                require_sandbox=not pool_opts_out_of_sandbox(settings, pool))
    except SandboxUnavailable as e:
        log.error("worker refuses to start: agents must run sandboxed", extra={"worker": worker_id, "error": str(e)})
        print(f"worker {worker_id}: refusing to start: {e}. (Only a pool whose every ActorTemplate sets "
              "isolation.sandbox: false runs without bubblewrap.)", file=sys.stderr)
        sock.close()
        await directory.close()
        raise SystemExit(2) from e
    await sandboxes.start()
    worker = Worker(settings, directory, snapshots, worker_id=worker_id, pool=pool, slots=slots, root=root,
                    sandboxes=sandboxes)
    runner = web.AppRunner(worker.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    tune_after_startup()  # the worker's request path: see substrate/gctune.py
    address = worker_url(advertised_host(host, advertise_host), sock.getsockname()[1])
    await worker.register(address)
    log.info("worker ready", extra={"worker": worker_id, "pool": pool, "address": address, "slots": slots})
    if ready_fd is not None:
        os.write(ready_fd, (address + "\n").encode())
        os.close(ready_fd)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stopping.set)
    await worker.stopping.wait()
    await worker.shutdown()
    await runner.cleanup()
    await directory.close()
    shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m workers.server --pool P --slots N [--worker-id ID] [--port 0]``."""
    ap = argparse.ArgumentParser(description="Run one worker of a WorkerPool.")
    ap.add_argument("--pool", default="default")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--worker-id", default=None)
    ap.add_argument("--host", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--advertise-host", default=None, help="address to register (default: --host)")
    ap.add_argument("--ready-fd", type=int, default=None, help="write the address to this fd when ready")
    args = ap.parse_args(argv)
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json)
    wid = args.worker_id or f"{args.pool}-{uuid.uuid4().hex[:8]}"
    # a local worker stops with the runtime that started it, even one killed by SIGKILL (no-op elsewhere);
    # it escalates after the same grace the runtime's backend would have given it, and says what it does
    # then in a file of its own, not on the terminal the runtime has given back
    lifeline.watch_from_env(settings.worker.shutdown_grace_s + 5.0,
                            log_path=settings.worker.root_dir / f"{wid}.after-runtime-exit.log")
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(settings, worker_id=wid, pool=args.pool, slots=args.slots,
                      host=args.host or settings.worker.host, port=args.port, ready_fd=args.ready_fd,
                      advertise_host=args.advertise_host))
    sys.exit(0)


if __name__ == "__main__":
    main()
