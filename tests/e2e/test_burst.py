"""A burst on a pool that can still grow (issue 11, fresh-user run): every request succeeds and nobody is
suspended to make room for it.

The fresh-user run of ``substrate up`` (8 workers x 16 slots) sent 120 concurrent creates and then a turn to
each: 61 x 503 ``resume_timeout``, 15 x ``no_capacity``, 1 x ``worker_fenced``, although 128 slots would
have held them. Sessions were pressure-suspended within a second of their creation while the pool was
still growing, and the pool drained workers mid-burst (the creates in flight were not counted as demand).
This is the same burst, smaller: a pool of at most 4 x 10 slots that starts with one worker, 10 sessions
that are idle by the time 30 more creates arrive, then a turn to each of the 40. The 40 sessions fit the
pool's maximum, so any pressure or drain suspension is a session suspended while the demand exceeded only
capacity the pool could still grow to.

The first 10 sessions are idle past the pressure threshold (1 s: placement may suspend them) but, with no
turn run yet, still demand for the pool controller: a session counts as active until its first turn for
``worker.first_turn_window_s`` (30 s; the active window, 2 s, applies once it has run a turn). Before that
window the test needed ``SUBSTRATE_WORKER__ACTIVE_WINDOW_S=600``: on a loaded machine the first creates
and the burst's arrival took seconds, the 10 sessions counted as idle capacity by the time the controller
sized the pool for the burst, and the controller made room by suspending them instead of growing (the
fresh-user run of ``python -m loadtest.burst --n 100``, default settings: 8 pressure suspensions on a
pool that could hold all 100).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.burst import suspensions_by_reason

POOL = """
apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec:
  slots: 10
  autoscaling: {minReplicas: 1, maxReplicas: 4, targetUtilization: 100}
  warmPool: {readyReplicas: 0}
"""


def _suspensions(url: str) -> dict[str, float]:
    """``agent_substrate_suspensions_total`` of the runtime by reason (absent if never counted)."""
    return collections.defaultdict(float, suspensions_by_reason(httpx.get(f"{url}/metrics", timeout=10).text))


def _post(http: httpx.Client, path: str, body: dict) -> tuple[str, dict]:
    r = http.post(path, json=body)
    data = r.json()
    return (str(r.status_code) if r.status_code < 400 else f"{r.status_code} {data.get('code')}"), data


def test_a_burst_on_a_growing_pool_succeeds_without_suspending_anyone(runtime_factory):
    rt = runtime_factory(replicas=1, pool_yaml=POOL)  # default windows (see the docstring)
    with httpx.Client(base_url=rt.url, timeout=120) as http, cf.ThreadPoolExecutor(40) as ex:
        first = list(ex.map(lambda _: _post(http, "/v1/sessions", {"actorTemplate": "counter"}), range(10)))
        assert [c for c, _ in first] == ["201"] * 10, first
        # the first worker is full of sessions idle past the pressure threshold (1 s) when the rest come:
        # the old placement suspended them at once to make room instead of waiting for the pool to grow
        time.sleep(1.5)
        rest = list(ex.map(lambda _: _post(http, "/v1/sessions", {"actorTemplate": "counter"}), range(30)))
        created = collections.Counter(c for c, _ in rest)
        assert created == {"201": 30}, created
        sids = [d["id"] for _, d in first + rest]
        turns = list(ex.map(lambda sid: _post(http, f"/v1/sessions/{sid}/invoke", {"input": "increment"}), sids))
        answered = collections.Counter(c for c, _ in turns)
        assert answered == {"200": 40}, answered
        # each session's first turn ran on its own state (nobody restored or lost anything)
        assert [d["output"] for _, d in turns] == [{"count": 1}] * 40
    suspended = _suspensions(rt.url)
    assert suspended.get("pressure", 0) == 0 and suspended.get("drain", 0) == 0, dict(suspended)
    assert 1 < len(rt.workers()) <= 4, "the pool grew for the burst"


FULL_POOL = """
apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec:
  slots: 40
  autoscaling: {minReplicas: 1, maxReplicas: 1, targetUtilization: 100}
  warmPool: {readyReplicas: 0}
"""


def test_a_session_counts_as_active_until_its_first_turn_then_for_the_active_window(runtime_factory):
    """The worker's heartbeat reports a new session as an active slot (demand, not evictable capacity)
    before its first turn, past the active window; once it has run a turn, only for the active window."""
    rt = runtime_factory(replicas=1, env={"SUBSTRATE_WORKER__ACTIVE_WINDOW_S": "0.2"})
    s = rt.client.create_session("counter")
    rt.wait_for(lambda: rt.workers()[s["worker"]].get("activeSlots") == "1", timeout_s=30, what="a heartbeat")
    beats: dict[str, str | None] = {}

    def a_second_of_beats() -> bool:
        w = rt.workers()[s["worker"]]
        beats.setdefault(w["leaseExpiresAt"], w.get("activeSlots"))
        return max(map(float, beats)) - min(map(float, beats)) >= 1.0

    # every heartbeat for a second more (five times the 0.2 s active window) counts it
    rt.wait_for(a_second_of_beats, timeout_s=30, what="a second of heartbeats")
    assert set(beats.values()) == {"1"}, beats
    assert rt.client.invoke(s["id"], "increment") == {"count": 1}
    rt.wait_for(lambda: rt.workers()[s["worker"]].get("activeSlots") == "0", timeout_s=30,
                what="idle 0.2 s after its turn")


def test_a_burst_on_a_full_pool_that_cannot_grow_is_served_by_suspending_idle_sessions(runtime_factory):
    """Fresh-user run: 100 creates on a pool at maxReplicas holding 120 idle sessions got 52 x 503
    ``no_capacity``: room was made 8 suspensions a round and every create still waiting after
    ``slot_wait_s`` gave up. The wait now counts from the queue's last progress. Here a full one-worker pool
    of 40 idle sessions and 30 creates whose ``slot_wait_s`` (0.3 s) is far shorter than the 30 suspensions."""
    rt = runtime_factory(replicas=1, pool_yaml=FULL_POOL,
                         env={"SUBSTRATE_API__SLOT_WAIT_S": "0.3", "SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "0.5"})
    with httpx.Client(base_url=rt.url, timeout=120) as http, cf.ThreadPoolExecutor(30) as ex:
        first = list(ex.map(lambda _: _post(http, "/v1/sessions", {"actorTemplate": "counter"}), range(40)))
        assert [c for c, _ in first] == ["201"] * 40, first
        time.sleep(1.0)  # the pool is full, all 40 idle past the pressure threshold
        rest = list(ex.map(lambda _: _post(http, "/v1/sessions", {"actorTemplate": "counter"}), range(30)))
        created = collections.Counter(c for c, _ in rest)
        assert created == {"201": 30}, created
    suspended = _suspensions(rt.url)
    assert suspended.get("pressure", 0) >= 30, dict(suspended)  # each create's slot came from an idle session
    assert len(rt.workers()) == 1


def test_the_burst_tool_sends_its_token_counts_suspensions_and_fails_when_a_request_fails(runtime_factory):
    """``python -m loadtest.burst`` against a runtime with API keys: with ``--token`` every create and turn
    succeeds, nobody is suspended for the burst and it exits 0; without a token (a fresh-user run: it
    had no way to send one) every create is 401 and it exits 1, not 0."""
    from tests.e2e.test_tenancy import KEY_A, _keys_env

    rt = runtime_factory(replicas=1, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env()})

    def burst(*extra: str) -> tuple[int, dict]:
        p = subprocess.run([sys.executable, "-m", "loadtest.burst", "--url", rt.url, "--n", "6", "--sample-s", "0.2",
                            *extra], capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
                           cwd=Path(__file__).resolve().parents[2])
        return p.returncode, json.loads(p.stdout.splitlines()[0])

    rc, ok = burst("--token", KEY_A)
    assert (rc, ok["create"], ok["invoke"], ok["suspensions"]) == (0, {"201": 6}, {"200": 6}, {}), ok
    rc, refused = burst()
    assert (rc, refused["create"]) == (1, {"401 unauthorized": 6}), refused
