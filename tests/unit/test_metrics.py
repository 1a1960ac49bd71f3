"""The metric names the alert rules and dashboards depend on are exported, with their labels.

The names are spelled out literally here on purpose: renaming a metric in ``substrate/metrics.py``
must fail this test (and then the rules in ``deploy/monitoring`` must be updated too).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from substrate import metrics as m
from substrate.models import SessionState, WorkerState

#: exported sample name -> label names it must carry (``le`` added for ``_bucket``)
REQUIRED: dict[str, set[str]] = {
    "agent_substrate_cold_start_duration_seconds_bucket": {"template", "pool", "kind", "le"},
    "agent_substrate_warm_pool_ready": {"pool"},
    "agent_substrate_gpu_memory_fragmented": {"pool"},
    "agent_substrate_gpu_memory_total": {"pool"},
    "agent_substrate_activation_duration_seconds_bucket": {"template", "le"},
    "agent_substrate_resume_duration_seconds_bucket": {"template", "le"},
    "agent_substrate_suspend_duration_seconds_bucket": {"template", "le"},
    "agent_substrate_wake_wait_duration_seconds_bucket": {"template", "le"},
    "agent_substrate_sessions": {"state"},
    "agent_substrate_parked_requests": set(),
    "agent_substrate_snapshot_bytes_bucket": {"template", "le"},
    "agent_substrate_snapshot_duration_seconds_bucket": {"template", "op", "le"},
    "agent_substrate_slots": {"pool", "status"},
    "agent_substrate_workers": {"pool", "state"},
    "agent_substrate_requests_total": {"route", "code"},
    "agent_substrate_proxy_duration_seconds_bucket": {"le"},
    "agent_substrate_errors_total": {"code"},
    "agent_substrate_suspensions_total": {"template", "reason"},
    "agent_substrate_recoveries_total": {"reason"},
    "agent_substrate_event_loop_lag_seconds_bucket": {"le"},
}


def _observe_everything() -> None:
    m.COLD_START_DURATION_SECONDS.labels(template="t", pool="p", kind="create").observe(0.2)
    m.COLD_START_DURATION_SECONDS.labels(template="t", pool="p", kind="resume").observe(0.05)
    m.ACTIVATION_DURATION_SECONDS.labels(template="t").observe(0.01)
    m.RESUME_DURATION_SECONDS.labels(template="t").observe(0.012)
    m.SUSPEND_DURATION_SECONDS.labels(template="t").observe(0.03)
    m.WAKE_WAIT_DURATION_SECONDS.labels(template="t").observe(0.02)
    m.set_slot_counts("p", free=6, used=2, ready_free=6)
    m.GPU_MEMORY_FRAGMENTED.labels(pool="p").set(0)
    m.GPU_MEMORY_TOTAL.labels(pool="p").set(0)
    m.set_session_counts({SessionState.RUNNING: 2, "SUSPENDED": 5})
    m.set_worker_counts("p", {WorkerState.READY: 1})
    m.PARKED_REQUESTS.inc()
    m.PARKED_REQUESTS.dec()
    m.SNAPSHOT_BYTES.labels(template="t").observe(1_048_576)
    for op in m.SNAPSHOT_OPS:
        m.SNAPSHOT_DURATION_SECONDS.labels(template="t", op=op).observe(0.004)
    m.REQUESTS_TOTAL.labels(route="/v1/sessions/{id}/invoke", code="200").inc()
    m.PROXY_DURATION_SECONDS.observe(0.0004)
    m.ERRORS_TOTAL.labels(code="no_capacity").inc()
    m.SUSPENSIONS_TOTAL.labels(template="t", reason="idle").inc()
    m.RECOVERIES_TOTAL.labels(reason="worker_lost").inc()
    m.EVENT_LOOP_LAG_SECONDS.observe(0.003)


def _exported() -> dict[str, set[str]]:
    payload, content_type = m.render_latest()
    assert content_type.startswith("text/plain")
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(payload.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_every_required_name_is_exported_with_its_labels() -> None:
    _observe_everything()
    exported = _exported()
    missing = sorted(set(REQUIRED) - set(exported))
    assert not missing, f"metric names the alert rules depend on are not exported: {missing}"
    for name, labels in REQUIRED.items():
        assert exported[name] == labels, f"{name}: labels {sorted(exported[name])} != {sorted(labels)}"


def test_sample_names_matches_what_is_exported() -> None:
    """``sample_names()`` (used to check PromQL in deploy/) describes the real exposition."""
    _observe_everything()
    exported = _exported()
    declared = m.sample_names()
    ours = {name for name in exported if name.startswith("agent_substrate_")}
    assert ours <= set(declared), sorted(ours - set(declared))
    for name in REQUIRED:
        assert set(declared[name]) == REQUIRED[name]


def test_session_gauge_zeroes_states_that_emptied() -> None:
    m.set_session_counts({"RESUMING": 3})
    m.set_session_counts({"RUNNING": 1})
    assert m.SESSIONS.labels(state="RESUMING")._value.get() == 0
    assert m.SESSIONS.labels(state="RUNNING")._value.get() == 1
    exported_states = {
        s.labels["state"]
        for f in text_string_to_metric_families(m.render_latest()[0].decode())
        if f.name == "agent_substrate_sessions"
        for s in f.samples
    }
    assert "DELETED" not in exported_states
    assert {"PENDING", "STARTING", "RUNNING", "SUSPENDING", "SUSPENDED", "RESUMING", "FAILED"} <= exported_states


def test_forget_pool_drops_its_series() -> None:
    m.set_slot_counts("gone", free=1, used=1, ready_free=1)
    m.set_worker_counts("gone", {"READY": 1})
    m.forget_pool("gone")
    m.forget_pool("never-existed")  # no error
    assert 'pool="gone"' not in m.render_latest()[0].decode()


def test_latency_buckets_cover_sub_ms_to_30s() -> None:
    assert m.LATENCY_BUCKETS[0] <= 0.0005 and m.LATENCY_BUCKETS[-1] >= 30
    assert list(m.LATENCY_BUCKETS) == sorted(m.LATENCY_BUCKETS)


async def test_asgi_app_serves_the_exposition() -> None:
    _observe_everything()
    app = m.metrics_asgi_app()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": []}, receive, send)
    assert sent[0]["status"] == 200
    assert b"agent_substrate_cold_start_duration_seconds_bucket" in sent[1]["body"]


def test_short_aliases_are_the_same_collectors() -> None:
    assert m.COLD_START is m.COLD_START_DURATION_SECONDS
    assert m.RESUME_DURATION is m.RESUME_DURATION_SECONDS
    assert m.SUSPEND_DURATION is m.SUSPEND_DURATION_SECONDS
    assert m.ACTIVATION_DURATION is m.ACTIVATION_DURATION_SECONDS
    assert m.WAKE_WAIT is m.WAKE_WAIT_DURATION_SECONDS
    assert m.PARKED is m.PARKED_REQUESTS
    assert m.SUSPENSIONS is m.SUSPENSIONS_TOTAL
    assert m.RECOVERIES is m.RECOVERIES_TOTAL
    assert m.SNAPSHOT_DURATION is m.SNAPSHOT_DURATION_SECONDS
    assert m.REQUESTS is m.REQUESTS_TOTAL
    assert m.PROXY_DURATION is m.PROXY_DURATION_SECONDS
    assert m.ERRORS is m.ERRORS_TOTAL
