"""A worker that died where the runtime cannot see it exit (a Kubernetes router never sees a pod's process
exit; here its zygote is killed first, so nobody reports the worker's exit) stays in the registry until its
lease lapses. Fresh-user tester 42 found two things in that window:

- a turn to a session on such a worker was answered 502 ``session_moving`` after 1.5 s: every try failed
  at once (connection refused), and the router's 12 tries ran out long before the lease did;
- a resume placed on such a worker retried on it again and again (5 failed activations and records, 5
  epochs), because the placement kept choosing the worker the last try could not reach.

A whole runtime (``substrate up``, real worker processes; leases of 2 s here)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.reliability.test_failure_paths import _alive


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture
def blind(runtime_factory):
    """A runtime of two workers whose zygote is killed: the workers live on (reparented), and the exit of
    one killed later is seen by nobody. Yields (runtime, pids by worker); kills the workers at the end
    (an orphan is nobody's to stop)."""
    rt = runtime_factory(replicas=2, slots=4)
    pids = {wid: int(w["pid"]) for wid, w in rt.workers().items()}
    zygote = _ppid(next(iter(pids.values())))
    os.kill(zygote, signal.SIGKILL)
    rt.wait_for(lambda: all(_ppid(p) != zygote for p in pids.values() if _alive(p)),
                what="the workers reparented after their zygote's death")
    try:
        yield rt, pids
    finally:
        for p in pids.values():
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_turn_to_a_session_on_a_worker_that_died_unseen_waits_for_its_lease_and_is_answered(blind):
    rt, pids = blind
    c = rt.client
    s = c.create_session("counter")
    assert c.invoke(s["id"], "increment") == {"count": 1}
    os.kill(pids[s["worker"]], signal.SIGKILL)
    t0 = time.monotonic()
    r = c.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "get"},
                    headers={"Idempotency-Key": "after-unseen-death"})
    assert r.status_code == 200, (r.status_code, r.text, time.monotonic() - t0)
    assert r.headers["x-substrate-restored"].startswith("worker_lost"), r.headers
    assert c.get_session(s["id"])["worker"] != s["worker"]


def test_a_resume_placed_on_a_worker_that_died_unseen_goes_elsewhere_after_one_failure(blind):
    rt, pids = blind
    c = rt.client
    s = c.create_session("counter")
    dead = s["worker"]
    other = next(w for w in pids if w != dead)
    # two sessions on the other worker, so that once ``s`` is suspended the dead worker has the most free
    # slots (4 against 2) and a wake prefers it: before, the retried wakes went there until its free slots
    # in the router's view (one fewer per claim) fell to the other's, two failures at least
    on_other = 0
    for _ in range(12):
        x = c.create_session("counter")
        if x["worker"] == other:
            on_other += 1
            if on_other == 2:
                break
        else:
            c.delete_session(x["id"])
    assert on_other == 2
    suspended = c.suspend(s["id"])
    os.kill(pids[dead], signal.SIGKILL)
    r = c.http.post(f"/v1/sessions/{s['id']}/resume")
    assert r.status_code == 200, r.text
    assert r.json()["worker"] == other, r.json()
    resumes = [e for e in c.session_events(s["id"])["items"] if e["action"] == "resume"]
    failed = [e for e in resumes if e["result"] != "ok"]
    assert len(failed) <= 1 and all(e["worker"] == dead for e in failed), \
        [(e["worker"], e["epoch"], e["result"]) for e in resumes]
    assert r.json()["epoch"] <= suspended["epoch"] + 2, (suspended["epoch"], r.json()["epoch"])
