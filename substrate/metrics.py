"""Prometheus metrics of the runtime: one module-level collector per metric.

Every name starts with ``agent_substrate_``; the alert rules (``deploy/monitoring/prometheusrule.yaml``)
and the Grafana dashboard depend on these exact names and label names, and
``tests/unit/test_manifests.py`` fails if they drift. The Python object of a metric is its name without the
``agent_substrate_`` prefix, upper-cased (``agent_substrate_cold_start_duration_seconds`` ->
``COLD_START_DURATION_SECONDS``); short aliases (``COLD_START``, ``RESUME_DURATION``, ``PARKED``, ``ERRORS``,
...) name the same objects.

Who sets what
-------------
* **Per process** (sum across replicas): request/proxy/error counters, ``parked_requests`` (router),
  latency histograms (router, worker or state manager, wherever the operation is timed), snapshot
  byte/duration histograms (worker), suspension/recovery counters (state manager).
* **Global views** derived from the directory (``sessions``, ``warm_pool_ready``, ``slots``, ``workers``,
  ``gpu_memory_*``) are set by the single process that owns the view (the pool controller / state
  manager). If several replicas export them, they agree; dashboards aggregate them with ``max``/``min``,
  never ``sum``. Use :func:`set_session_counts`, :func:`set_worker_counts`, :func:`set_slot_counts` so a
  label value that drops to zero is exported as ``0`` rather than left stale.

Label values are closed sets (see the ``*_KINDS``/``*_OPS``/``*_REASONS`` tuples below) or bounded names
(template, pool, route template, error code). Never use a session ID or worker ID as a label value.

All metrics live in prometheus_client's default ``REGISTRY`` (which also carries the ``process_*`` and
``python_*`` collectors). Serve them with :func:`metrics_asgi_app` or :func:`render_latest`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import CollectorRegistry

from .models import SessionState, WorkerState

NAMESPACE = "agent_substrate"

#: latencies from sub-millisecond hot-path hops (~0.35 ms proxy hop) to multi-second cold starts
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
#: snapshot archive sizes: 1 KiB .. 4 GiB, powers of 4
BYTES_BUCKETS: tuple[float, ...] = tuple(float(1024 * 4**i) for i in range(12))

#: ``kind`` of ``agent_substrate_cold_start_duration_seconds``
COLD_START_KINDS: tuple[str, ...] = ("create", "resume")
#: ``op`` of ``agent_substrate_snapshot_duration_seconds``
#: (``restore``: download and unpack streamed together, the wake path; they overlap, so no split)
SNAPSHOT_OPS: tuple[str, ...] = ("upload", "pack", "restore")
#: ``reason`` of ``agent_substrate_suspensions_total``
SUSPEND_REASONS: tuple[str, ...] = ("idle", "pressure", "explicit", "drain")
#: ``reason`` values of ``agent_substrate_recoveries_total``: ``worker_lost`` (its worker died or its lease
#: expired; restored from the last snapshot), ``deadline`` (found past its transitional-state deadline),
#: ``snapshot_corrupt`` (restore failed its checksum), ``failed`` (a FAILED session brought back),
#: ``activation_lost`` (its worker no longer had the activation), ``agent_restarted`` (woken after its agent
#: died), ``evicted`` (woken after a pressure suspend its own content refused ended it).
#: The alert rules use ``worker_lost`` and ``deadline``.
RECOVERY_REASONS: tuple[str, ...] = ("worker_lost", "deadline", "snapshot_corrupt", "failed", "activation_lost",
                                     "agent_restarted", "evicted")
#: ``status`` of ``agent_substrate_slots``
SLOT_STATUSES: tuple[str, ...] = ("free", "used")

# --- activation path ---------------------------------------------------------------------------------

COLD_START_DURATION_SECONDS = Histogram(
    "agent_substrate_cold_start_duration_seconds",
    "Time from a request that needs a new activation to the activation RUNNING; "
    "kind=create for a new session, kind=resume for waking a suspended one.",
    ["template", "pool", "kind"],
    buckets=LATENCY_BUCKETS,
)
"""Request-to-running time of an activation, labelled ``template``, ``pool``, ``kind`` (create|resume)."""

ACTIVATION_DURATION_SECONDS = Histogram(
    "agent_substrate_activation_duration_seconds",
    "Time a worker takes to start an activation of a new session in a slot (PENDING to RUNNING).",
    ["template"],
    buckets=LATENCY_BUCKETS,
)
"""Worker-side time to activate a new session (no snapshot), labelled ``template``."""

RESUME_DURATION_SECONDS = Histogram(
    "agent_substrate_resume_duration_seconds",
    "Time to resume a suspended session (RESUMING to RUNNING: restore of the snapshot, agent start, commit).",
    ["template"],
    buckets=LATENCY_BUCKETS,
)
"""Time to bring a suspended session back (RESUMING -> RUNNING), labelled ``template``."""

SUSPEND_DURATION_SECONDS = Histogram(
    "agent_substrate_suspend_duration_seconds",
    "Time to suspend a session (SUSPENDING to SUSPENDED: snapshot, upload, verify, commit, free slot).",
    ["template"],
    buckets=LATENCY_BUCKETS,
)
"""Time to suspend a session (SUSPENDING -> SUSPENDED), labelled ``template``."""

WAKE_WAIT_DURATION_SECONDS = Histogram(
    "agent_substrate_wake_wait_duration_seconds",
    "Time a request parked on a suspended session waited until the session was RUNNING.",
    ["template"],
    buckets=LATENCY_BUCKETS,
)
"""How long a parked request waited for its session to wake, labelled ``template``."""

# --- capacity ----------------------------------------------------------------------------------------

WARM_POOL_READY = Gauge(
    "agent_substrate_warm_pool_ready",
    "Free session slots on READY workers of the pool (capacity available without a cold worker start).",
    ["pool"],
)
"""Free slots on READY workers, labelled ``pool``."""

SLOTS = Gauge(
    "agent_substrate_slots",
    "Session slots of the pool's workers by status (free|used).",
    ["pool", "status"],
)
"""Slots per ``pool`` and ``status`` (free|used). Set with :func:`set_slot_counts`."""

WORKERS = Gauge(
    "agent_substrate_workers",
    "Registered workers of the pool by state (STARTING|READY|DRAINING).",
    ["pool", "state"],
)
"""Workers per ``pool`` and ``state`` (``WorkerState`` values). Set with :func:`set_worker_counts`."""

GPU_MEMORY_FRAGMENTED = Gauge(
    "agent_substrate_gpu_memory_fragmented",
    "Bytes of GPU memory allocated to the pool's ResourceClaims that no slot can use (0 when unknown).",
    ["pool"],
)
"""Unusable (fragmented) GPU memory in bytes per ``pool``; 0 unless the Kubernetes backend knows it."""

GPU_MEMORY_TOTAL = Gauge(
    "agent_substrate_gpu_memory_total",
    "Bytes of GPU memory allocated to the pool's ResourceClaims (0 when unknown).",
    ["pool"],
)
"""Total GPU memory in bytes allocated to the pool's ResourceClaims; 0 unless known."""

# --- sessions ----------------------------------------------------------------------------------------

SESSIONS = Gauge(
    "agent_substrate_sessions",
    "Sessions in the directory by lifecycle state (PENDING|STARTING|RUNNING|SUSPENDING|SUSPENDED|"
    "RESUMING|FAILED).",
    ["state"],
)
"""Sessions per lifecycle ``state`` (``SessionState`` values). Set with :func:`set_session_counts`."""

PARKED_REQUESTS = Gauge(
    "agent_substrate_parked_requests",
    "Requests currently parked in this router waiting for a suspended session to wake.",
)
"""Requests parked in this router process right now (inc on park, dec on release)."""

ACTIVATION_LIMIT = Gauge(
    "agent_substrate_activation_limit",
    "Adaptive bound on activations (creates + wakes) under way at once in this router process, per pool.",
    ["pool"],
)
"""Permits of the pool's activation limiter now (``substrate.admission``), set after each activation."""

ACTIVATIONS_QUEUED = Gauge(
    "agent_substrate_activations_queued",
    "Activations waiting for a permit of the pool's activation limiter in this router process.",
    ["pool"],
)
"""Activations waiting (FIFO, holding no slot) for one of the pool's permits right now."""

SUSPENSIONS_TOTAL = Counter(
    "agent_substrate_suspensions_total",
    "Sessions suspended, by template and reason (idle|pressure|explicit|drain).",
    ["template", "reason"],
)
"""Completed suspensions, labelled ``template`` and ``reason`` (see ``SUSPEND_REASONS``)."""

RECOVERIES_TOTAL = Counter(
    "agent_substrate_recoveries_total",
    "Sessions recovered from their last good snapshot, by reason (worker_lost|deadline|snapshot_corrupt|failed).",
    ["reason"],
)
"""Automatic recoveries, labelled ``reason`` (see ``RECOVERY_REASONS``)."""

# --- snapshots ---------------------------------------------------------------------------------------

SNAPSHOT_BYTES = Histogram(
    "agent_substrate_snapshot_bytes",
    "Size in bytes of committed snapshot archives.",
    ["template"],
    buckets=BYTES_BUCKETS,
)
"""Archive size of each committed snapshot, labelled ``template``."""

SNAPSHOT_DURATION_SECONDS = Histogram(
    "agent_substrate_snapshot_duration_seconds",
    "Time of one snapshot step, by template and op (upload|pack|restore).",
    ["template", "op"],
    buckets=LATENCY_BUCKETS,
)
"""Duration of one snapshot step, labelled ``template`` and ``op`` (see ``SNAPSHOT_OPS``)."""

# --- API ---------------------------------------------------------------------------------------------

REQUESTS_TOTAL = Counter(
    "agent_substrate_requests_total",
    "HTTP requests answered by the router, by route template and status code.",
    ["route", "code"],
)
"""Answered requests, labelled ``route`` (the route template, e.g. ``/v1/sessions/{id}/invoke``, never
the raw path) and ``code`` (HTTP status as a string; ``499`` when the client went away before an answer,
as nginx logs it: not a server error). A request the HTTP protocol refused before the app could answer it
is counted once, under ``route="unparsed"``."""

PROXY_DURATION_SECONDS = Histogram(
    "agent_substrate_proxy_duration_seconds",
    "Time of a proxied invoke for a RUNNING session: router overhead plus the worker's answer.",
    buckets=LATENCY_BUCKETS,
)
"""Router overhead plus worker time of one proxied call (hot path)."""

ERRORS_TOTAL = Counter(
    "agent_substrate_errors_total",
    "Errors by stable error code (see substrate.errors), e.g. no_capacity, snapshot_corrupt.",
    ["code"],
)
"""Errors by stable ``code`` (``SubstrateError.code``)."""

#: event-loop lag: from timer precision (~1 ms, epoll's millisecond timeout) to a loop held for seconds
LOOP_LAG_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

EVENT_LOOP_LAG_SECONDS = Histogram(
    "agent_substrate_event_loop_lag_seconds",
    "How late this process's event loop ran a timer (substrate.loops.watch_lag): time no request was served.",
    buckets=LOOP_LAG_BUCKETS,
)
"""Per process (the router/control plane and each worker): how much later than asked a periodic timer of
``substrate.loops.watch_lag`` fired, in seconds. Every request the process holds waits at least that long
too, so its upper buckets bound what CPU-bound work on the loop (or a starved CPU) adds to a turn."""

# --- short aliases (same objects) used by the core -----------------------------------------------------

COLD_START = COLD_START_DURATION_SECONDS
ACTIVATION_DURATION = ACTIVATION_DURATION_SECONDS
RESUME_DURATION = RESUME_DURATION_SECONDS
SUSPEND_DURATION = SUSPEND_DURATION_SECONDS
WAKE_WAIT = WAKE_WAIT_DURATION_SECONDS
PARKED = PARKED_REQUESTS
SUSPENSIONS = SUSPENSIONS_TOTAL
RECOVERIES = RECOVERIES_TOTAL
SNAPSHOT_DURATION = SNAPSHOT_DURATION_SECONDS
REQUESTS = REQUESTS_TOTAL
PROXY_DURATION = PROXY_DURATION_SECONDS
ERRORS = ERRORS_TOTAL

#: every collector of this module, by exported metric family name
ALL_METRICS: dict[str, Counter | Gauge | Histogram] = {
    m._name if not isinstance(m, Counter) else f"{m._name}_total": m  # type: ignore[attr-defined]
    for m in (
        COLD_START_DURATION_SECONDS, ACTIVATION_DURATION_SECONDS, RESUME_DURATION_SECONDS,
        SUSPEND_DURATION_SECONDS, WAKE_WAIT_DURATION_SECONDS, WARM_POOL_READY, SLOTS, WORKERS,
        GPU_MEMORY_FRAGMENTED, GPU_MEMORY_TOTAL, SESSIONS, PARKED_REQUESTS, ACTIVATION_LIMIT, ACTIVATIONS_QUEUED,
        SUSPENSIONS_TOTAL,
        RECOVERIES_TOTAL, SNAPSHOT_BYTES, SNAPSHOT_DURATION_SECONDS, REQUESTS_TOTAL,
        PROXY_DURATION_SECONDS, ERRORS_TOTAL, EVENT_LOOP_LAG_SECONDS,
    )
}


def sample_names() -> dict[str, tuple[str, ...]]:
    """Every sample name this module can export, mapped to its label names.

    Histograms expand to ``_bucket`` (plus label ``le``), ``_sum``, ``_count`` and ``_created``; counters
    to ``_total`` and ``_created``. Used by the manifest tests to check PromQL in alert rules and
    dashboards against the real names.
    """
    out: dict[str, tuple[str, ...]] = {}
    for m in ALL_METRICS.values():
        base: str = m._name  # type: ignore[attr-defined]
        labels: tuple[str, ...] = tuple(m._labelnames)  # type: ignore[attr-defined]
        if isinstance(m, Histogram):
            out[f"{base}_bucket"] = (*labels, "le")
            for suffix in ("_sum", "_count", "_created"):
                out[base + suffix] = labels
        elif isinstance(m, Counter):
            out[f"{base}_total"] = labels
            out[f"{base}_created"] = labels
        else:
            out[base] = labels
    return out


def set_session_counts(counts: Mapping[SessionState | str, int]) -> None:
    """Set ``agent_substrate_sessions`` for every lifecycle state except DELETED; missing states get 0."""
    by_state = {SessionState(k).value: v for k, v in counts.items()}
    for state in SessionState:
        if state is SessionState.DELETED:
            continue
        SESSIONS.labels(state=state.value).set(by_state.get(state.value, 0))


def set_worker_counts(pool: str, counts: Mapping[WorkerState | str, int]) -> None:
    """Set ``agent_substrate_workers`` of one pool for every worker state; missing states get 0."""
    by_state = {WorkerState(k).value: v for k, v in counts.items()}
    for state in WorkerState:
        WORKERS.labels(pool=pool, state=state.value).set(by_state.get(state.value, 0))


def set_slot_counts(pool: str, *, free: int, used: int, ready_free: int | None = None) -> None:
    """Set ``agent_substrate_slots`` (free/used) of one pool and, if given, ``warm_pool_ready``."""
    SLOTS.labels(pool=pool, status="free").set(free)
    SLOTS.labels(pool=pool, status="used").set(used)
    if ready_free is not None:
        WARM_POOL_READY.labels(pool=pool).set(ready_free)


def forget_pool(pool: str) -> None:
    """Drop every per-pool series of a deleted pool so dashboards do not show it forever."""
    for gauge in (WARM_POOL_READY, GPU_MEMORY_FRAGMENTED, GPU_MEMORY_TOTAL):
        _remove(gauge, pool)
    for status in SLOT_STATUSES:
        _remove(SLOTS, pool, status)
    for state in WorkerState:
        _remove(WORKERS, pool, state.value)


def _remove(metric: Gauge, *labelvalues: str) -> None:
    try:
        metric.remove(*labelvalues)
    except KeyError:
        pass


def metrics_asgi_app(registry: CollectorRegistry = REGISTRY) -> Callable[..., Any]:
    """An ASGI app serving the registry in the Prometheus/OpenMetrics text format (mount at ``/metrics``)."""
    return prometheus_client.make_asgi_app(registry=registry)


def render_latest(registry: CollectorRegistry = REGISTRY) -> tuple[bytes, str]:
    """The registry rendered in the Prometheus text format: ``(payload, content_type)``."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
