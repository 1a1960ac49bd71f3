"""Time-compressed replay of a real request trace against the runtime's REST API.

    substrate-replay TRACE [--host URL] [--compress 100] [--start 2d|2024-11-20] [--duration 1d]
                           [--idle-split 30m] [--max-sessions N] [--baseline-host URL] [--out DIR]

What it does:

1. Loads TRACE (GenTD26 / Azure / OpenHands / plain CSV; see :mod:`loadtest.traces`), keeps the
   window ``[start, start + duration)`` of trace time, cuts each owner's turns into sessions at
   idle gaps longer than ``--idle-split``, keeps the first ``--max-sessions``.
2. Compresses time by ``--compress``: a turn arriving ``a`` trace seconds after the window's first
   arrival is sent ``a / compress`` wall seconds after the replay starts and asks the counter
   agent for ``{"op": "increment", "work_s": duration / compress}``.
3. For each session: ``POST /v1/sessions`` (template ``counter``) at its first arrival, its turns
   in order (a session's turns never overlap: a turn waits for the previous one, and the wait
   is recorded as ``queue_s``), then ``DELETE`` at ``last turn end + idle split`` (when a
   pod-per-session deployment would have let it go).
4. Checks every answer: the count must be exactly the previous count + 1 (after a failed or
   timed-out turn, +1 or +2 ...: the failed increment may or may not have landed). Anything else is
   ``lost_state``, counted apart from errors.
5. Samples ``GET /v1/stats`` every second (falls back to ``GET /v1/workerpools``).
6. Writes ``result.json``, ``report.md`` and ``report.png`` to ``--out`` and prints the report.

Latency added by the runtime = client latency - work_s; it is split into ``wake`` (the request
found the session not RUNNING: ``session.woke`` or header ``X-Substrate-Woke: 1``, or
``state_before`` SUSPENDED/SUSPENDING/RESUMING/PENDING/STARTING) and ``warm`` (everything else).

Baseline (``--baseline``, on by default): with ``--baseline-host`` the same plan is replayed
concurrently against a runtime with one slot per worker and no idle suspension; without one, the
always-on cost is computed analytically (each session holds one worker from its first arrival to
its last turn end + idle split) and the report says so.

Bounded: ``--concurrency`` caps requests in flight, ``--request-timeout`` (+ work_s) caps each
request, ``--max-wall`` caps the whole run (default: planned span x 1.25 + 60 s); SIGINT stops
early and still writes the results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import secrets
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest import report as rpt
from loadtest.bounds import bound_worker_sizes, plan_bounds, render_bounds
from loadtest.traces import (
    FORMATS,
    TIMESTAMPED_FORMATS,
    AzureOptions,
    TraceError,
    Turn,
    detect_format,
    format_timestamp,
    load_trace,
    parse_duration,
    resolve_start,
    select_window,
    split_sessions,
)
from substrate.loops import cancel_and_wait, watch_lag

SCHEMA = "substrate-replay/v1"
WAKE_STATES = frozenset({"SUSPENDED", "SUSPENDING", "RESUMING", "PENDING", "STARTING"})


class ReplayError(RuntimeError):
    """The replay cannot run (bad input, unreachable host)."""


# ---------------------------------------------------------------------------------------------
# the plan: pure, computed before any request


@dataclass(slots=True)
class PlannedTurn:
    at_s: float  # wall seconds after replay start
    work_s: float  # wall seconds of work asked of the counter
    trace_ok: bool


@dataclass(slots=True)
class PlannedSession:
    id: str
    key: str  # owner#n
    owner: str
    start_s: float  # first arrival, wall s
    last_end_s: float  # latest turn end, wall s
    end_s: float  # delete time = last_end_s + idle split (wall s)
    turns: list[PlannedTurn] = field(default_factory=list)

    @property
    def hold_s(self) -> float:
        """Always-on hold in wall seconds (first arrival -> last end + idle split)."""
        return rpt.session_hold_s(self.start_s, self.last_end_s, self.end_s - self.last_end_s)


@dataclass(slots=True)
class Plan:
    sessions: list[PlannedSession]
    origin_s: float  # trace clock of wall time 0
    compress: float
    idle_split_s: float  # trace seconds
    owners: int
    trace_failed_turns: int

    @property
    def turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def wall_span_s(self) -> float:
        return max((s.end_s for s in self.sessions), default=0.0)

    @property
    def baseline_worker_seconds(self) -> float:
        """Analytical always-on worker-seconds (wall): sum of session holds."""
        return rpt.analytical_baseline_worker_seconds(s.hold_s for s in self.sessions)

    def summary(self) -> dict[str, Any]:
        return {
            "sessions": len(self.sessions),
            "turns": self.turns,
            "owners": self.owners,
            "trace_failed_turns": self.trace_failed_turns,
            "origin_s": self.origin_s,
            "trace_span_s": self.wall_span_s * self.compress,
            "wall_span_s": self.wall_span_s,
            "busy_s": sum(t.work_s for s in self.sessions for t in s.turns),
            "baseline_worker_seconds": self.baseline_worker_seconds,
        }


def build_plan(
    turns: list[Turn],
    *,
    compress: float,
    idle_split_s: float,
    max_sessions: int | None = None,
    failed_turns: str = "replay",
    run_id: str = "run",
    id_prefix: str = "rp",
) -> Plan:
    """Trace turns (already windowed) -> sessions on the compressed wall clock.

    Wall time 0 is the first arrival among the kept sessions. ``failed_turns="skip"`` drops the
    trace's failed turns; ``"replay"`` sends them like the others (they still occupied a worker).
    """
    if compress <= 0:
        raise ValueError("--compress must be > 0")
    kept = [t for t in turns if t.ok or failed_turns == "replay"]
    sessions = split_sessions(kept, idle_split_s)
    if max_sessions is not None:
        sessions = sessions[: max(0, max_sessions)]
    origin = sessions[0].start_s if sessions else 0.0
    idle_wall = idle_split_s / compress
    planned = []
    for n, s in enumerate(sessions):
        pts = [PlannedTurn((t.arrival_s - origin) / compress, t.duration_s / compress, t.ok) for t in s.turns]
        last_end = (s.last_end_s - origin) / compress
        planned.append(
            PlannedSession(
                id=f"{id_prefix}-{run_id}-{n:05d}",
                key=s.key,
                owner=s.owner,
                start_s=(s.start_s - origin) / compress,
                last_end_s=last_end,
                end_s=last_end + idle_wall,
                turns=pts,
            )
        )
    return Plan(
        sessions=planned,
        origin_s=origin,
        compress=compress,
        idle_split_s=idle_split_s,
        owners=len({s.owner for s in sessions}),
        trace_failed_turns=sum(1 for s in sessions for t in s.turns if not t.ok),
    )


# ---------------------------------------------------------------------------------------------
# response interpretation (pure)


def extract_count(payload: Any) -> int | None:
    """``{"output": {"count": N}}`` (or ``{"output": N}``) -> N; None if absent."""
    if not isinstance(payload, dict):
        return None
    out = payload.get("output")
    if isinstance(out, dict):
        out = out.get("count")
    if isinstance(out, bool):
        return None
    if isinstance(out, int):
        return out
    if isinstance(out, float) and out.is_integer():
        return int(out)
    return None


def classify(payload: Any, headers: dict[str, str] | Any) -> tuple[str, bool | None, float | None, str | None]:
    """-> (kind "wake"|"warm", woke, server wake_ms, state_before).

    The ``session`` block is optional; the headers ``X-Substrate-Woke: 1`` and
    ``X-Substrate-Wake-Ms`` stand in for ``woke`` and ``wake_ms``. ``woke`` is None when neither
    the block nor the header says anything."""
    block = payload.get("session") if isinstance(payload, dict) else None
    block = block if isinstance(block, dict) else {}
    woke_field = block.get("woke")
    header = (headers.get("X-Substrate-Woke") if headers is not None else None) or ""
    header_woke = header.strip().lower() in ("1", "true", "yes")
    state_before = block.get("state_before")
    woke: bool | None
    if woke_field is None and not header:
        woke = None
    else:
        woke = bool(woke_field) or header_woke
    wake_ms = block.get("wake_ms")
    if wake_ms is None and headers is not None and headers.get("X-Substrate-Wake-Ms"):
        with contextlib.suppress(ValueError):
            wake_ms = float(headers.get("X-Substrate-Wake-Ms"))
    wake_ms = float(wake_ms) if isinstance(wake_ms, (int, float)) and not isinstance(wake_ms, bool) else None
    is_wake = bool(woke) or (isinstance(state_before, str) and state_before.upper() in WAKE_STATES)
    return ("wake" if is_wake else "warm"), woke, wake_ms, state_before


def server_timing_ms(headers: dict[str, str] | Any) -> dict[str, float]:
    """``{name: dur}`` (ms) of every metric with a numeric ``dur`` in an answer's ``Server-Timing`` header
    (W3C Server Timing; ``api.proxy.server_timing``: ``place;dur=1.2, activate;dur=21.7, restore;dur=12.0,
    ..., wake;dur=24.0``), in the header's order; {} without the header."""
    value = headers.get("Server-Timing") if headers is not None else None
    found: dict[str, float] = {}
    for part in (value or "").split(","):
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):
                    found[name.strip()] = float(dur)
    return found


def check_count(count: int | None, prev: int, uncertain: int) -> tuple[str, tuple[int, int]]:
    """Is ``count`` a legal answer after ``prev`` with ``uncertain`` unanswered increments before it?

    Returns (status, (lo, hi)): ``ok`` when ``prev + 1 <= count <= prev + 1 + uncertain``,
    ``lost_state`` otherwise (a reset or lost increment reads low, a replayed one high), ``error``
    when there is no count at all.
    """
    lo, hi = prev + 1, prev + 1 + uncertain
    if count is None:
        return "error", (lo, hi)
    return ("ok" if lo <= count <= hi else "lost_state"), (lo, hi)


def retry_after_s(value: str | None, default: float = 1.0, cap: float = 5.0) -> float:
    try:
        return min(cap, max(0.0, float(value))) if value else default
    except ValueError:
        return default


_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(text: str) -> str:
    """A Kubernetes-style label value (<= 63 chars of [A-Za-z0-9_.-], alnum at both ends)."""
    v = _LABEL_BAD.sub("-", text)[:63].strip("-_.")
    return v or "x"


# ---------------------------------------------------------------------------------------------
# the runner


@dataclass(slots=True)
class ReplayConfig:
    host: str
    template: str = "counter"
    concurrency: int = 200
    request_timeout_s: float = 30.0
    retries: int = 3
    stats_interval_s: float = 1.0
    max_wall_s: float | None = None
    lead_in_s: float = 1.0
    delete_sessions: bool = True
    token: str | None = None
    run_id: str = "run"


#: wall seconds of refused connections (every stats sample) after which a host counts as gone and the
#: replay of it stops: a runtime killed mid-run was replayed against to the end of the plan, exit 0
#: (fresh-user round 10)
HOST_GONE_S = 5.0


class TargetRunner:
    """Replays one plan against one host; ``await run()`` -> target result dict."""

    def __init__(self, name: str, cfg: ReplayConfig, plan: Plan, stop: asyncio.Event, progress: Any = None):
        self.name, self.cfg, self.plan, self.stop, self.progress = name, cfg, plan, stop, progress
        self.host = cfg.host.rstrip("/")
        self.inflight = 0
        self.alive = 0
        self.samples: list[dict[str, Any]] = []
        self.stats_source: str | None = None
        self.sessions: list[dict[str, Any]] = []
        self.turns: list[dict[str, Any]] = []
        self._t0 = 0.0
        #: set when the host stopped answering (``HOST_GONE_S`` of refused connections): the run stops
        self.gone = asyncio.Event()
        self._unreachable_since: float | None = None
        self._live: set[str] = set()
        self._headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
        for ps in plan.sessions:
            self.sessions.append(
                {"id": ps.id, "key": ps.key, "owner": ps.owner, "start_s": ps.start_s, "last_end_s": ps.last_end_s,
                 "end_s": ps.end_s, "hold_s": ps.hold_s, "turns": len(ps.turns), "created": False,
                 "created_s": None, "deleted_s": None, "create_ms": None,
                 "create_http": None, "create_retries": 0, "deleted": False, "final_count": None, "error": None}
            )
            for i, pt in enumerate(ps.turns):
                self.turns.append(
                    {"session": ps.id, "i": i, "at_s": pt.at_s, "sent_s": None, "done_s": None, "queue_s": None,
                     "work_s": pt.work_s, "trace_ok": pt.trace_ok, "status": "not_run", "http": None,
                     "latency_ms": None, "service_ms": None, "added_ms": None, "kind": None, "woke": None, "wake_ms": None,
                     **{f"{ph}_ms": None for ph in rpt.WAKE_PHASES}, "state_before": None, "worker": None, "epoch": None, "count": None, "expected": None,
                     "retries": 0, "error": None}
                )

    # -- clock
    def now(self) -> float:
        return time.monotonic() - self._t0

    async def sleep_until(self, t_s: float) -> None:
        delay = t_s - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    # -- HTTP
    async def _request(self, http, method: str, path: str, *, json_body=None, timeout_s: float):
        import aiohttp

        async with http.request(
            method, self.host + path, json=json_body, headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            body = await resp.read()
            try:
                payload = json.loads(body) if body else None
            except ValueError:
                payload = None
            return resp.status, resp.headers, payload

    async def _scrape_lag(self, http) -> dict[float, float] | None:
        """The target's event-loop lag histogram (``/metrics``, no credentials needed); None if it has none
        or does not answer (another kind of target)."""
        import aiohttp

        try:
            async with http.get(self.host + "/metrics", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                if resp.status != 200:
                    return None
                return rpt.lag_buckets(await resp.text()) or None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    async def preflight(self, http) -> None:
        import aiohttp

        try:
            await self._request(http, "GET", "/healthz", timeout_s=5.0)
            # credentials and template before the plan runs: a missing token or an unknown template
            # failed every turn of the whole plan (401, 422), exit 0 (fresh-user round 10)
            status, _, payload = await self._request(http, "GET", "/v1/actortemplates", timeout_s=5.0)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise ReplayError(f"{self.name}: cannot reach {self.host}: {e!r}") from e
        code = payload.get("code") if isinstance(payload, dict) else None
        if status in (401, 403):
            raise ReplayError(f"{self.name}: {self.host} refused the credentials ({status} {code}): pass --token "
                              "(or SUBSTRATE_TOKEN) with an API key of the runtime")
        if status == 200 and isinstance(payload, dict):
            names = [((t.get("metadata") or {}).get("name")) for t in payload.get("items") or []]
            if self.cfg.template not in names:
                raise ReplayError(f"{self.name}: {self.host} has no ActorTemplate {self.cfg.template!r} (it has: "
                                  f"{', '.join(sorted(n for n in names if n)) or 'none'}): pass --template")
        try:
            status, _, payload = await self._request(http, "GET", "/v1/stats", timeout_s=5.0)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return
        if status == 200 and isinstance(payload, dict) and payload.get("slotSeconds") is None:
            print(f"substrate-replay: {self.name}: /v1/stats shows no fleet counters to these credentials (an "
                  "admin key or the open mode sees them): the cost figures will be n/a", file=sys.stderr)

    async def _create(self, http, ps: PlannedSession, srec: dict[str, Any]) -> bool:
        import aiohttp

        body = {"actorTemplate": self.cfg.template, "id": ps.id,
                "labels": {"replay": label_value(self.cfg.run_id), "owner": label_value(ps.owner)}}
        started = time.monotonic()
        for attempt in range(self.cfg.retries + 1):
            try:
                status, headers, payload = await self._request(
                    http, "POST", "/v1/sessions", json_body=body, timeout_s=self.cfg.request_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                srec["error"] = f"create: {e!r}"
                return False
            srec["create_http"] = status
            if status == 503 and attempt < self.cfg.retries:
                srec["create_retries"] += 1
                await asyncio.sleep(retry_after_s(headers.get("Retry-After")))
                continue
            break
        srec["create_ms"] = (time.monotonic() - started) * 1000.0
        if status in (200, 201):
            srec["created"] = True
            srec["created_s"] = self.now()
            return True
        code = payload.get("code") if isinstance(payload, dict) else None
        srec["error"] = f"create: HTTP {status} {code or ''}".strip()
        return False

    async def _invoke(self, http, sem: asyncio.Semaphore, pt: PlannedTurn, sid: str, rec: dict[str, Any],
                      prev: int, uncertain: int) -> None:
        import aiohttp

        body = {"input": {"op": "increment", "work_s": round(pt.work_s, 6)}}
        async with sem:
            rec["sent_s"] = self.now()
            rec["queue_s"] = max(0.0, rec["sent_s"] - pt.at_s)
            self.inflight += 1
            started = time.monotonic()
            status = headers = payload = None
            try:
                for attempt in range(self.cfg.retries + 1):
                    status, headers, payload = await self._request(
                        http, "POST", f"/v1/sessions/{sid}/invoke", json_body=body,
                        timeout_s=self.cfg.request_timeout_s + pt.work_s)
                    if status == 503 and attempt < self.cfg.retries:
                        rec["retries"] += 1
                        await asyncio.sleep(retry_after_s(headers.get("Retry-After")))
                        continue
                    break
            except TimeoutError:
                rec["status"], rec["error"] = "timeout", f"no answer within {self.cfg.request_timeout_s + pt.work_s:.1f} s"
            except (aiohttp.ClientError, OSError) as e:
                rec["status"], rec["error"] = "error", repr(e)
            finally:
                self.inflight -= 1
            service_ms = (time.monotonic() - started) * 1000.0
            rec["done_s"] = self.now()
        rec["http"] = status
        if rec["status"] in ("timeout", "error"):
            rec["expected"] = [prev + 1, prev + 1 + uncertain]
            return
        # latency runs from the turn's scheduled arrival, not from when the client got round to sending it
        latency_ms = (rec["done_s"] - pt.at_s) * 1000.0
        rec["latency_ms"], rec["service_ms"] = latency_ms, service_ms
        if status != 200:
            code = payload.get("code") if isinstance(payload, dict) else None
            rec["status"], rec["error"] = "error", f"HTTP {status} {code or ''}".strip()
            rec["expected"] = [prev + 1, prev + 1 + uncertain]
            return
        rec["added_ms"] = latency_ms - pt.work_s * 1000.0
        rec["kind"], rec["woke"], rec["wake_ms"], rec["state_before"] = classify(payload, headers)
        phases = server_timing_ms(headers)
        for ph in rpt.WAKE_PHASES:
            rec[f"{ph}_ms"] = phases.get(ph)
        rec["worker"] = headers.get("X-Substrate-Worker")
        # the runtime's own word that this answer's state came back older (a crash, a killed agent)
        rec["restored"] = headers.get("X-Substrate-Restored")
        block = payload.get("session") if isinstance(payload, dict) else None
        epoch = block.get("epoch") if isinstance(block, dict) else None
        if epoch is None and headers.get("X-Substrate-Epoch", "").isdigit():
            epoch = int(headers["X-Substrate-Epoch"])
        rec["epoch"] = epoch
        rec["count"] = extract_count(payload)
        rec["status"], (lo, hi) = check_count(rec["count"], prev, uncertain)
        rec["expected"] = [lo, hi]
        if rec["status"] == "error":
            rec["error"] = "no count in the output"

    async def _delete(self, http, sid: str, srec: dict[str, Any], timeout_s: float) -> None:
        import aiohttp

        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            status, _, _ = await self._request(http, "DELETE", f"/v1/sessions/{sid}", timeout_s=timeout_s)
            if status in (200, 202, 204, 404):
                srec["deleted"] = True
                srec["deleted_s"] = self.now()
                self._live.discard(sid)

    async def _session(self, http, sem: asyncio.Semaphore, ps: PlannedSession, srec: dict[str, Any],
                       recs: list[dict[str, Any]]) -> None:
        await self.sleep_until(ps.start_s)
        async with sem:
            created = await self._create(http, ps, srec)
        if not created:
            for rec in recs:
                rec["status"], rec["error"] = "error", f"session not created ({srec['error']})"
                rec["http"] = srec["create_http"]
            self._tick(len(recs))
            return
        self._live.add(ps.id)
        self.alive += 1
        try:
            prev, uncertain = 0, 0
            for pt, rec in zip(ps.turns, recs, strict=True):
                await self.sleep_until(pt.at_s)
                await self._invoke(http, sem, pt, ps.id, rec, prev, uncertain)
                if rec["status"] in ("ok", "lost_state"):
                    prev, uncertain = rec["count"], 0
                else:
                    uncertain += 1
                self._tick(1)
            srec["final_count"] = prev
            if self.cfg.delete_sessions:
                await self.sleep_until(ps.end_s)
                await self._delete(http, ps.id, srec, self.cfg.request_timeout_s)
        finally:
            self.alive -= 1

    def _tick(self, n: int) -> None:
        if self.progress is not None:
            self.progress.update(n)

    async def _sample_once(self, http) -> None:
        import aiohttp

        sample: dict[str, Any] = {"t_s": round(self.now(), 3), "inflight": self.inflight, "alive": self.alive,
                                  "ok": False, "workers": None, "slots": None, "slotsUsed": None,
                                  "sessions": None, "workerSeconds": None, "slotSeconds": None,
                                  "processSeconds": None, "workerLoopLag": None}
        try:
            if self.stats_source != "/v1/workerpools":
                status, _, payload = await self._request(http, "GET", "/v1/stats", timeout_s=2.0)
                if status == 200 and isinstance(payload, dict):
                    self.stats_source = "/v1/stats"
                    for k in ("workers", "slots", "slotsUsed", "sessions", "workerSeconds", "slotSeconds",
                              "processSeconds", "workerLoopLag"):
                        sample[k] = payload.get(k)
                    sample["ok"] = True
                elif status in (404, 405) and self.stats_source is None:
                    self.stats_source = "/v1/workerpools"
            if self.stats_source == "/v1/workerpools":
                status, _, payload = await self._request(http, "GET", "/v1/workerpools", timeout_s=2.0)
                if status == 200 and isinstance(payload, dict):
                    st = [i.get("status") or {} for i in payload.get("items") or []]
                    sample["workers"] = sum(int(s.get("replicas") or 0) for s in st)
                    sample["slots"] = sum(int(s.get("slots") or 0) for s in st)
                    sample["slotsUsed"] = sample["slots"] - sum(int(s.get("freeSlots") or 0) for s in st)
                    sample["ok"] = True
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError):
            # refused or dropped, not merely slow: the host may be gone (a loaded one answers late)
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            elif time.monotonic() - self._unreachable_since >= HOST_GONE_S:
                self.gone.set()
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, TypeError):
            pass
        if sample["ok"]:
            self._unreachable_since = None
        self.samples.append(sample)

    async def _sampler(self, http, done: asyncio.Event) -> None:
        interval = self.cfg.stats_interval_s
        next_t = self.now()
        while not done.is_set():
            await self._sample_once(http)
            next_t += interval
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=max(0.0, next_t - self.now()))
        await self._sample_once(http)  # closing sample

    async def run(self) -> dict[str, Any]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.cfg.concurrency + 4, limit_per_host=0)
        stats_connector = aiohttp.TCPConnector(limit=2)
        started_wall = time.time()
        stopped_by = "done"
        async with aiohttp.ClientSession(connector=connector) as http, \
                aiohttp.ClientSession(connector=stats_connector) as stats_http:
            await self.preflight(http)
            lag_before = await self._scrape_lag(stats_http)
            # this process's own lag: it sends and times every turn, on the same cores as the target
            client_lag: list[float] = []
            prober = asyncio.create_task(watch_lag(client_lag.append))
            sem = asyncio.Semaphore(self.cfg.concurrency)
            self._t0 = time.monotonic() + self.cfg.lead_in_s
            done = asyncio.Event()
            sampler = asyncio.create_task(self._sampler(stats_http, done))
            by_session: dict[str, list[dict[str, Any]]] = {}
            for rec in self.turns:
                by_session.setdefault(rec["session"], []).append(rec)
            tasks = [
                asyncio.create_task(self._session(http, sem, ps, srec, by_session.get(ps.id, [])))
                for ps, srec in zip(self.plan.sessions, self.sessions, strict=True)
            ]
            max_wall = self.cfg.max_wall_s or (self.plan.wall_span_s * 1.25 + 60.0)
            stopper = asyncio.create_task(self.stop.wait())
            gone = asyncio.create_task(self.gone.wait())
            all_done = asyncio.gather(*tasks, return_exceptions=True)
            finished, _ = await asyncio.wait(
                {all_done, stopper, gone}, timeout=max_wall + self.cfg.lead_in_s, return_when=asyncio.FIRST_COMPLETED)
            ended_s = self.now()
            gone.cancel()
            if all_done not in finished:
                stopped_by = "interrupted" if stopper in finished else "host_unreachable" if gone in finished \
                    else "wall_cap"
                if stopped_by == "wall_cap" and all(t["status"] != "not_run" for t in self.turns):
                    # every turn ran: only the sessions' final idle hold (--idle-split) was cut, which at a low
                    # --compress is most of the plan (a fresh-user run: 80 of 80 turns in 25 s, then a
                    # "Partial run" for a 1,825 s plan cut at 50 s)
                    stopped_by = "wall_cap_in_final_idle"
                if stopped_by == "host_unreachable":
                    print(f"substrate-replay: {self.name}: {self.host} refused connections for {HOST_GONE_S:g} s: "
                          "stopping (the figures cover the run up to then)", file=sys.stderr)
                for t in tasks:
                    t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await all_done
            stopper.cancel()
            for t, srec in zip(tasks, self.sessions, strict=True):
                if not t.cancelled() and t.exception() is not None and srec["error"] is None:
                    srec["error"] = f"replay bug: {t.exception()!r}"
            if self._live and self.cfg.delete_sessions and stopped_by != "host_unreachable":  # left behind
                srec_by_id = {s["id"]: s for s in self.sessions}
                await asyncio.wait(
                    [asyncio.create_task(self._delete(http, sid, srec_by_id[sid], 5.0)) for sid in list(self._live)],
                    timeout=15.0,
                )
            done.set()
            await sampler
            await cancel_and_wait([prober])
            server_lag = rpt.lag_share_over(lag_before, await self._scrape_lag(stats_http))
        result = {
            "name": self.name,
            "host": self.host,
            "started_at": datetime.fromtimestamp(started_wall, tz=UTC).isoformat(),
            "wall_s": round(time.time() - started_wall, 3),
            "stopped_by": stopped_by,
            "ended_s": round(ended_s, 3),
            "stats_source": self.stats_source,
            "turns": self.turns,
            "sessions": self.sessions,
            "stats": self.samples,
        }
        result["summary"] = rpt.summarize_target(self.turns, self.sessions, self.samples, ended_s,
                                                 client_lag_s=client_lag, server_lag=server_lag)
        return result


# ---------------------------------------------------------------------------------------------
# CLI


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only when it says something (not None/False, not already in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="substrate-replay",
        description="Replay a real request trace, time-compressed, against the agent session runtime "
        "(counter agent), verify no session state is lost, and compare worker-seconds and added latency "
        "with an always-on, pod-per-session baseline.",
        epilog="Durations accept 90s, 30m, 2h, 1d, 1h30m or plain seconds. Example: substrate-replay "
        "../shared/traces/gentd26_requests_2024-11-15_to_11-26.csv --host http://127.0.0.1:8080 "
        "--compress 100 --start 2d --duration 1d --idle-split 30m --max-sessions 500 --out replay-results/",
        formatter_class=_HelpFormatter,
    )
    ap.add_argument("trace", help="trace file: GenTD26 CSV, Azure LLM CSV, OpenHands .json/.jsonl, "
                    "or a plain session_id,arrival_s,duration_s CSV")
    ap.add_argument("--format", choices=("auto", *FORMATS), default="auto", help="trace format (auto: from header/extension)")
    ap.add_argument("--host", default="http://127.0.0.1:8080", help="runtime base URL")
    ap.add_argument("--compress", type=float, default=100.0, help="time compression: trace seconds per wall second")
    ap.add_argument("--start", default=None, help="window start: a date/time (2024-11-20, 2024-11-20T08:00, UTC) "
                    "or an offset from the first arrival (2d, 3600); default: the first arrival")
    ap.add_argument("--duration", default=None, help="window length in trace time (e.g. 1d); default: to the end")
    ap.add_argument("--idle-split", default="30m", help="a gap longer than this (trace time) starts a new session")
    ap.add_argument("--max-sessions", type=int, default=None, help="replay only the first N sessions (by start)")
    ap.add_argument("--overlay", type=int, default=1, help="lay N consecutive windows of --duration over the "
                    "first (N times the rate, same turn durations; owners of window k become owner@k)")
    ap.add_argument("--failed-turns", choices=("replay", "skip"), default="replay",
                    help="turns the trace recorded as failed: replay them (they used a worker) or drop them")
    ap.add_argument("--template", default="counter", help="ActorTemplate of the replayed sessions (counter semantics)")
    ap.add_argument("--concurrency", type=int, default=200, help="max requests in flight per host")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="per-request timeout in seconds (+ work_s)")
    ap.add_argument("--retries", type=int, default=3, help="retries of a 503 (no_capacity), honouring Retry-After (<= 5 s)")
    ap.add_argument("--max-wall", default=None, help="stop after this much wall time (default: plan span x 1.25 + 60 s)")
    ap.add_argument("--stats-interval", type=float, default=1.0, help="seconds between GET /v1/stats samples")
    ap.add_argument("--lead-in", type=float, default=1.0, help="wall seconds between start and the first create")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="compare with an always-on baseline (measured with --baseline-host, else analytical)")
    ap.add_argument("--baseline-host", default=None, help="runtime with 1 slot per worker and no idle suspension, "
                    "replayed concurrently with the same plan")
    ap.add_argument("--keep-sessions", action="store_true", help="do not delete sessions after their last turn + idle split")
    ap.add_argument("--token", default=None, help="bearer token for the API (env SUBSTRATE_TOKEN)")
    ap.add_argument("--run-id", default=None, help="session ids are rp-<run-id>-<n> (default: random)")
    ap.add_argument("--azure-owners", type=int, default=100, help="Azure trace: number K of synthetic owners")
    ap.add_argument("--azure-scheme", choices=("hash", "roundrobin"), default="hash",
                    help="Azure trace: owner = blake2b(seed:row) mod K, or row mod K")
    ap.add_argument("--azure-seed", type=int, default=0, help="Azure trace: seed of the hash scheme")
    ap.add_argument("--window-s", type=float, default=None, help="plot window for latency percentiles (default: span/30)")
    ap.add_argument("--out", default="replay-results/", help="directory for result.json, report.md, report.png")
    ap.add_argument("--dry-run", action="store_true", help="load and plan only; print the plan and the analytical baseline")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any turn errored or lost state")
    return ap


def overlay_windows(turns: list[Turn], start_s: float | None, duration_s: float | None, n: int) -> list[Turn]:
    """``n`` consecutive windows of ``duration_s`` laid over the first one (a day at ``n`` times its
    rate with the same turn durations, unlike a higher compression that also shortens the turns).
    Owners of window ``k`` > 0 are renamed ``owner@k`` so their sessions stay apart."""
    if duration_s is None or start_s is None:
        raise TraceError("--overlay needs --start and --duration")
    out: list[Turn] = []
    for k in range(n):
        for t in select_window(turns, start_s + k * duration_s, duration_s):
            owner = t.session_owner if k == 0 else f"{t.session_owner}@{k}"
            out.append(Turn(owner, t.arrival_s - k * duration_s, t.duration_s, t.ok))
    return sorted(out)


def load_and_plan(args: argparse.Namespace) -> tuple[Plan, dict[str, Any]]:
    """Trace file + CLI options -> (plan, config block of result.json)."""
    fmt = None if args.format == "auto" else args.format
    fmt = fmt or detect_format(args.trace)
    azure = AzureOptions(owners=args.azure_owners, scheme=args.azure_scheme, seed=args.azure_seed)
    turns = load_trace(args.trace, fmt, azure=azure)
    if not turns:
        raise TraceError(f"{args.trace}: no turns")
    start_s = resolve_start(args.start, turns[0].arrival_s, fmt in TIMESTAMPED_FORMATS)
    duration_s = parse_duration(args.duration) if args.duration else None
    window = select_window(turns, start_s, duration_s)
    overlay = max(1, int(getattr(args, "overlay", 1) or 1))
    if overlay > 1:
        window = overlay_windows(turns, start_s, duration_s, overlay)
    idle_split_s = parse_duration(args.idle_split)
    run_id = re.sub(r"[^a-z0-9-]", "-", (args.run_id or secrets.token_hex(3)).lower())[:40]
    plan = build_plan(window, compress=args.compress, idle_split_s=idle_split_s, max_sessions=args.max_sessions,
                      failed_turns=args.failed_turns, run_id=run_id)
    cfg = {
        "trace": str(args.trace),
        "format": fmt,
        "host": args.host,
        "baseline_host": args.baseline_host,
        "compress": args.compress,
        "start": args.start,
        "window_start_s": start_s,
        "window_start_utc": format_timestamp(start_s) if fmt in TIMESTAMPED_FORMATS else None,
        "duration_s": duration_s,
        "idle_split_s": idle_split_s,
        "max_sessions": args.max_sessions,
        "failed_turns": args.failed_turns,
        "template": args.template,
        "concurrency": args.concurrency,
        "request_timeout_s": args.request_timeout,
        "retries": args.retries,
        "max_wall_s": parse_duration(args.max_wall) if args.max_wall else None,
        "run_id": run_id,
        "overlay": overlay,
        "trace_turns_total": len(turns),
        "window_turns": len(window),
    }
    return plan, cfg


def _progress(total: int, desc: str, position: int, disable: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the loadtest extra
        return None
    return tqdm(total=total, desc=desc, position=position, unit="turn", disable=disable, leave=True,
                dynamic_ncols=True)


async def replay(plan: Plan, cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run the plan against --host (and --baseline-host) concurrently; -> the full result dict."""
    import os

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    token = args.token or os.environ.get("SUBSTRATE_TOKEN")
    hosts = [("ours", args.host)]
    if args.baseline and args.baseline_host:
        hosts.append(("baseline", args.baseline_host))
    runners = []
    for pos, (name, host) in enumerate(hosts):
        rc = ReplayConfig(host=host, template=args.template, concurrency=args.concurrency,
                          request_timeout_s=args.request_timeout, retries=args.retries,
                          stats_interval_s=args.stats_interval, max_wall_s=cfg["max_wall_s"],
                          lead_in_s=args.lead_in, delete_sessions=not args.keep_sessions, token=token,
                          run_id=cfg["run_id"])
        bar = _progress(plan.turns, name, pos, args.no_progress)
        runners.append((TargetRunner(name, rc, plan, stop, bar), bar))
    if cfg.get("ours_idle_timeout_s") is None or cfg.get("ours_worker_slots") is None:
        idle, slots = await template_facts(args.host, args.template, token)
        if cfg.get("ours_idle_timeout_s") is None:
            cfg["ours_idle_timeout_s"] = idle
        if cfg.get("ours_worker_slots") is None:
            cfg["ours_worker_slots"] = slots
    try:
        results = await asyncio.gather(*(r.run() for r, _ in runners))
    finally:
        for _, bar in runners:
            if bar is not None:
                bar.close()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": datetime.now(tz=UTC).isoformat(),
        "config": cfg,
        "plan": plan.summary(),
        "targets": {r["name"]: r for r in results},
    }
    if args.baseline:
        result.update(rpt.compare(result))
    result["bounds"] = plan_bounds(plan_turn_records(plan), worker_slots=bound_worker_sizes(cfg))
    return result



def plan_turn_records(plan: Plan) -> list[dict[str, Any]]:
    """The plan's turns as ``{"session", "at_s", "work_s"}`` records (what :func:`plan_bounds` reads)."""
    return [{"session": s.id, "at_s": t.at_s, "work_s": t.work_s} for s in plan.sessions for t in s.turns]


async def template_facts(host: str, template: str, token: str | None) -> tuple[float | None, int | None]:
    """``(idle timeout s, slots per worker)`` of ``template`` as ``host`` reports them: its
    ``maxIdleTime`` (the baseline's ``L`` = ours' idle timeout) and its pool's ``spec.slots`` (the worker
    size of the plan's reactive bounds); each None if it cannot be read."""
    import aiohttp

    from substrate.models import parse_duration_s

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = host.rstrip("/")
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(base + "/v1/actortemplates") as resp:
                items = (await resp.json()).get("items") or []
            spec = next(((t.get("spec") or {}) for t in items
                         if (t.get("metadata") or {}).get("name") == template), None)
            if spec is None:
                return None, None
            async with http.get(base + "/v1/workerpools") as resp:
                pools = (await resp.json()).get("items") or []
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
        return None, None
    raw = (spec.get("stateManagement") or {}).get("maxIdleTime")
    try:
        idle = parse_duration_s(raw) if raw is not None else None
    except (ValueError, TypeError):
        idle = None
    pool = spec.get("workerPool") or "default"
    slots = next(((p.get("spec") or {}).get("slots") for p in pools
                  if isinstance(p, dict) and (p.get("metadata") or {}).get("name") == pool), None)
    return idle, slots if isinstance(slots, int) and slots >= 1 else None


def write_outputs(result: dict[str, Any], out_dir: str | Path, window_s: float | None = None) -> dict[str, Path]:
    """Write result.json, report.md, report.png into ``out_dir``; -> their paths (no ``"png"`` when
    matplotlib is not installed: the run's results are kept and the missing package named on stderr)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "result.json", "md": out / "report.md", "png": out / "report.png"}
    paths["json"].write_text(json.dumps(result, indent=1, default=_json_default) + "\n", encoding="utf-8")
    paths["md"].write_text(rpt.render_markdown(result) + "\n", encoding="utf-8")
    try:
        rpt.plot_report(result, paths["png"], window_s=window_s)
    except ImportError as e:  # a plain `uv sync` has no loadtest extra: keep the run's results anyway
        print(f"substrate-replay: report.png not drawn ({e.name or e} is not installed: uv sync --extra loadtest)",
              file=sys.stderr)
        del paths["png"]
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


def _print_plan(plan: Plan, cfg: dict[str, Any]) -> None:
    s = plan.summary()
    print(f"trace {cfg['trace']} ({cfg['format']}): {cfg['trace_turns_total']} turns, window "
          f"{cfg['window_start_utc'] or cfg['window_start_s']} + {cfg['duration_s'] or 'all'} s -> {cfg['window_turns']} turns")
    print(f"plan: {s['sessions']} sessions / {s['owners']} owners / {s['turns']} turns "
          f"({s['trace_failed_turns']} trace-failed), idle split {cfg['idle_split_s']:.0f} s, "
          f"compress {cfg['compress']}x -> {s['wall_span_s']:.1f} s wall, {s['busy_s']:.1f} busy s")
    last_turn_end_s = max((ps.last_end_s for ps in plan.sessions), default=0.0)
    if s["wall_span_s"] - last_turn_end_s > 1.0:
        # said, or a short trace at a low --compress looks like a plan of idle split length for nothing
        print(f"  (the last turn ends at {last_turn_end_s:.1f} s; each session is deleted its idle split, "
              f"{cfg['idle_split_s'] / cfg['compress']:.1f} s wall, after its own last turn: --idle-split "
              "shortens that tail)")
    print(f"analytical always-on baseline: {s['baseline_worker_seconds']:.1f} worker-seconds (wall), "
          f"{s['baseline_worker_seconds'] * cfg['compress'] / 3600:.1f} worker-hours of trace time")


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``ap.error``: usage and exit 2) option values that cannot mean anything: ``--retries -1``
    ran no turn at all (each failed as a replay bug) and ``--concurrency 0`` sent nothing until the wall
    cap, both ending "stopped by done" with exit 0 under ``--strict`` (fresh-user round 10)."""
    least = {  # option -> (value, the least it may be, whether that least is allowed)
        "--compress": (args.compress, 0, False), "--max-sessions": (args.max_sessions, 1, True),
        "--overlay": (args.overlay, 1, True), "--concurrency": (args.concurrency, 1, True),
        "--request-timeout": (args.request_timeout, 0, False), "--retries": (args.retries, 0, True),
        "--stats-interval": (args.stats_interval, 0, False), "--lead-in": (args.lead_in, 0, True),
        "--azure-owners": (args.azure_owners, 1, True), "--window-s": (args.window_s, 0, False)}
    for durations in ("--duration", "--max-wall", "--idle-split"):
        text = getattr(args, durations.lstrip("-").replace("-", "_"))
        if text is not None:
            try:
                least[durations] = (parse_duration(text), 0, durations == "--idle-split")
            except ValueError as e:
                ap.error(f"{durations}: {e}")
    for name, (value, low, inclusive) in least.items():
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            ap.error(f"{name} must be {'at least' if inclusive else 'more than'} {low}, not {value:g}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``substrate-replay``; returns the exit code (2: cannot run; with ``--strict``, 1 for
    a run that did not run its whole plan cleanly)."""
    ap = _parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)
    try:
        plan, cfg = load_and_plan(args)
    except (TraceError, ValueError, OSError) as e:
        print(f"substrate-replay: {e}", file=sys.stderr)
        return 2
    _print_plan(plan, cfg)
    if not plan.sessions:  # a dry run too: a window that misses the trace is a mistake, not an empty plan
        print(f"substrate-replay: the window holds none of the trace's {cfg['trace_turns_total']} turns: check "
              "--start and --duration against the trace's dates", file=sys.stderr)
        return 2
    if args.dry_run:
        lines = render_bounds(plan_bounds(plan_turn_records(plan)))
        if lines:
            print("\n" + "\n".join(lines))
        return 0
    try:
        result = asyncio.run(replay(plan, cfg, args))
    except ReplayError as e:
        print(f"substrate-replay: {e}", file=sys.stderr)
        return 2
    paths = write_outputs(result, args.out, args.window_s)
    print()
    print(rpt.render_markdown(result))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    gone = [n for n, t in result["targets"].items() if t.get("stopped_by") == "host_unreachable"]
    if gone:
        print(f"substrate-replay: {', '.join(gone)}: the host stopped answering mid-run", file=sys.stderr)
        return 1
    ours = result["targets"]["ours"]
    summary = ours["summary"]
    if args.strict:
        # every planned turn run and answered, state kept, the plan run to its end (not cut by the wall
        # cap or an interrupt): a run with no turn at all passed before (fresh-user round 10)
        why = [w for w, bad in (
            (f"{summary['errors']} turns failed", summary["errors"]),
            (f"{summary['lost_state']} turns lost state", summary["lost_state"]),
            (f"{summary['turns_planned'] - summary['turns_run']} of {summary['turns_planned']} planned turns not run",
             summary["turns_run"] < summary["turns_planned"]),
            (f"stopped by {ours.get('stopped_by')}", ours.get("stopped_by") not in (None, "done"))) if bad]
        if why:
            print(f"substrate-replay: --strict: {'; '.join(why)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
