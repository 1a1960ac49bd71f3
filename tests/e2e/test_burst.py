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
import re
import time

import httpx

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
    """``agent_substrate_suspensions_total`` of the runtime by reason (0 if never counted)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = collections.defaultdict(float)
    for m in re.finditer(r'^agent_substrate_suspensions_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        reason = re.search(r'reason="([^"]+)"', m.group(1))
        out[reason.group(1) if reason else ""] += float(m.group(2))
    return out


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
