"""Regression tests for what the chaos runs of issue 8 found, through real processes (``substrate up``,
worker processes, sandboxed agents). Each builds the history a client would record and runs the chaos
harness's history checker (``loadtest.history``) on it, the way ``make chaos`` judges a run; each failed
on the code before its fix. None asserts on timing.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from loadtest.chaos import restored_snapshot_at
from loadtest.history import Turn, check

EXTRA = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter-periodic}
spec:
  entrypoint: workers.agents.counter:Counter
  stateManagement: {snapshotInterval: 10s, maxIdleTime: "0"}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter-short-turns}
spec:
  entrypoint: workers.agents.counter:Counter
  isolation: {turnTimeout: 1s}
"""


class Client:
    """A client as the chaos harness is one: every acknowledged turn goes into ``history``."""

    def __init__(self, rt: Any, sid: str) -> None:
        self.rt, self.sid = rt, sid
        self.history: list[Turn] = []

    def turn(self, seq: int, key: str, body: Any = "increment", *, ack: bool = True) -> httpx.Response:
        """Send turn ``seq`` with ``key``; with ``ack`` record its answer (else the client "never got it")."""
        sent = time.time()
        r = self.rt.client.http.post(f"/v1/sessions/{self.sid}/invoke", json={"input": body},
                                     headers={"Idempotency-Key": key})
        if ack:
            assert r.status_code == 200, r.text
            restored = r.headers.get("x-substrate-restored")
            epoch = int(r.headers["x-substrate-epoch"])
            at = restored_snapshot_at(r.headers)
            if restored and at is None:  # as the harness does: the record's restoredFrom for this epoch
                rec = self.rt.client.get_session(self.sid)
                if rec["epoch"] == epoch and rec.get("restoredFrom"):
                    rf = rec["restoredFrom"]
                    at = rf["lostAfter"] if rf.get("lostAfter") is not None else rf.get("snapshotCreatedAt") or 0.0
            self.history.append(Turn(session=self.sid, kind="counter", seq=seq, sent_at=sent, acked_at=time.time(),
                                     epoch=epoch, worker=r.headers["x-substrate-worker"], restored=restored,
                                     value=r.json()["output"]["count"], restored_snapshot_at=at,
                                     replayed=r.headers.get("x-substrate-replayed") == "1"))
        return r

    def verdict(self) -> list[str]:
        return [f"{v.kind} turn {v.seq}: {v.detail}" for v in check(self.history).violations]


def _worker_of(rt: Any, sid: str) -> str:
    return rt.session_raw(sid)["worker"]


def _snapshot_key(rt: Any, sid: str) -> str | None:
    import json

    raw = rt.session_raw(sid).get("snapshot")
    return json.loads(raw)["key"] if raw else None


@pytest.mark.parametrize("then", ["clean_suspend", "second_crash"])
def test_a_replayed_answer_says_what_the_activation_that_ran_it_had_lost(runtime_factory, then):
    """Chaos (merged code, both violations): a turn run right after a lossy restore, whose answer the
    client did not get, was first acknowledged by its replay in a later activation. With a clean suspend
    in between (the commit clears the lossy reason) the replay showed the loss with no restored header
    (``lost-unreported``); after a second crash it named the newer snapshot, taken after the lost turn
    was acknowledged (``lost-before-snapshot``). A stored answer now keeps the restored marker and
    snapshot time of the activation that ran it."""
    rt = runtime_factory(replicas=2, slots=4, extra_yaml=EXTRA)
    c = rt.client
    template = "counter" if then == "clean_suspend" else "counter-periodic"
    sid = c.create_session(template)["id"]
    cl = Client(rt, sid)
    cl.turn(1, "k1")
    cl.turn(2, "k2")
    c.suspend(sid)  # snapshot S0: count 2
    s0 = c.get_session(sid)["snapshot"]
    cl.turn(3, "k3")  # acknowledged after S0, in no snapshot
    rt.kill_worker(_worker_of(rt, sid))
    assert _snapshot_key(rt, sid) == s0["key"], "setup: turn 3 must not be in a snapshot (10 s interval)"
    # turn 4 runs on the state of S0 (turn 3 lost, said so); its answer never reaches the client
    lost = cl.turn(4, "k4", ack=False)
    assert lost.status_code == 200 and lost.json()["output"]["count"] == 3, lost.text
    assert lost.headers["x-substrate-restored"] == "worker_lost"
    if then == "clean_suspend":
        c.suspend(sid)  # commits count 3 (and the answer of k4); the lossy reason is cleared
    else:
        rt.wait_for(lambda: _snapshot_key(rt, sid) != s0["key"], timeout_s=60, what="a periodic snapshot")
        rt.kill_worker(_worker_of(rt, sid))
    r = cl.turn(4, "k4")  # the client's retry: answered from the stored answer, not run again
    assert r.headers.get("x-substrate-replayed") == "1" and r.json()["output"]["count"] == 3
    assert cl.verdict() == []
    assert r.headers.get("x-substrate-restored") == "worker_lost", r.headers
    assert float(r.headers["x-substrate-restored-snapshot-at"]) == pytest.approx(s0["createdAt"], abs=1e-3)
    cl.turn(5, "k5")
    assert cl.verdict() == [] and cl.history[-1].value == 4


@pytest.mark.parametrize("first_snapshot", [True, False], ids=["older_snapshot", "no_snapshot"])
def test_a_snapshot_taken_before_the_loss_was_reported_keeps_the_loss(runtime_factory, first_snapshot):
    """Chaos on ba39209 (one ``lost-before-snapshot``): after a lossy recovery, an activation that had
    answered no turn was suspended (a drain), and its commit cleared the loss from the record. The next
    wake restored that newer snapshot with no marker of its own; the answer named the drain's snapshot
    as the state's date, 10 s after the lost turns. Now such a commit keeps the loss and its date
    (``lostAfter``): the next answer says ``worker_lost`` and the first snapshot's time (or, when the loss
    came before any snapshot, ``snapshot=none``)."""
    rt = runtime_factory(replicas=2, slots=4, extra_yaml=EXTRA)
    c = rt.client
    sid = c.create_session("counter")["id"]
    cl = Client(rt, sid)
    cl.turn(1, "k1")
    base = None
    if first_snapshot:
        c.suspend(sid)  # snapshot S0: count 1
        base = c.get_session(sid)["snapshot"]["createdAt"]
    cl.turn(2, "k2")  # acknowledged after S0 (or with no snapshot at all): lost with the worker
    rt.kill_worker(_worker_of(rt, sid))
    rt.wait_for(lambda: c.get_session(sid)["state"] == "SUSPENDED" and c.get_session(sid).get("reason") == "worker_lost",
                timeout_s=60, what="the recovery of the killed worker's session")
    c.resume(sid)  # a wake that runs no turn (the drain in the chaos run woke it by a turn that failed)
    c.suspend(sid)  # its commit: the state of S0 (or nothing), no client told of the loss yet
    rec = c.get_session(sid)
    assert rec["reason"] == "worker_lost", "the loss stays on the record until a turn reports it"
    assert rec["lostAfter"] == pytest.approx(base if first_snapshot else 0.0, abs=1e-3), rec
    assert rec["snapshot"]["createdAt"] > (base or 0.0)
    r = cl.turn(3, "k3")
    assert r.json()["output"]["count"] == (2 if first_snapshot else 1), "turn 2 (and with no snapshot, 1) gone"
    if first_snapshot:
        assert r.headers.get("x-substrate-restored") == "worker_lost", r.headers
        assert float(r.headers["x-substrate-restored-snapshot-at"]) == pytest.approx(base, abs=1e-3)
    else:
        assert r.headers.get("x-substrate-restored") == "worker_lost;snapshot=none", r.headers
        assert "x-substrate-restored-snapshot-at" not in r.headers
    assert c.get_session(sid)["restoredFrom"]["lostAfter"] == pytest.approx(base or 0.0, abs=1e-3)
    assert cl.verdict() == [] and check(cl.history).lost_reported == (1 if first_snapshot else 2)
    # a turn reported the loss: the next commit clears it, and the next wake is a plain resume
    c.suspend(sid)
    rec = c.get_session(sid)
    assert rec.get("reason") is None and rec.get("lostAfter") is None, rec
    r = cl.turn(4, "k4")
    assert "x-substrate-restored" not in r.headers
    assert r.json()["output"]["count"] == (3 if first_snapshot else 2)
    assert cl.verdict() == []


def test_an_agent_that_dies_ends_its_activation(runtime_factory):
    """Chaos suspect (issue 8): an agent whose process died inside an activation (here a turn past its
    turnTimeout; also a crash or the memory limit) was restarted in the same activation from its last
    snapshot: acknowledged turns vanished within one epoch, which no client can tell from a worker loss.
    Now the activation ends: the session comes back from its last committed snapshot under a new epoch,
    ``restoredFrom`` says so and so do the answers."""
    rt = runtime_factory(replicas=1, slots=4, extra_yaml=EXTRA)
    c = rt.client
    sid = c.create_session("counter-short-turns")["id"]
    cl = Client(rt, sid)
    cl.turn(1, "k1")
    cl.turn(2, "k2")
    c.suspend(sid)  # snapshot: count 2
    s0 = c.get_session(sid)["snapshot"]
    cl.turn(3, "k3")  # acknowledged, in no snapshot
    epoch = cl.history[-1].epoch
    r = cl.turn(4, "k4", {"op": "increment", "work_s": 30}, ack=False)
    assert r.status_code == 504 and r.json()["code"] == "turn_timeout", r.text
    rec = c.get_session(sid)
    assert rec["state"] == "SUSPENDED" and rec["reason"] == "agent_restarted", rec
    assert all(rt.slots(w) == {} for w in rt.workers()), "its slot is free"
    # the client (the SDK retries a 504) resends the turn: answered with its error, not run again
    again = cl.turn(4, "k4", {"op": "increment", "work_s": 30}, ack=False)
    assert again.status_code == 504 and again.headers.get("x-substrate-replayed") == "1", again.text
    r = cl.turn(5, "k5")
    assert r.json()["output"]["count"] == 3, "back from the snapshot (turn 3 lost, turn 4 left nothing)"
    assert cl.verdict() == []
    assert r.headers["x-substrate-restored"] == "agent_restarted", r.headers
    assert "x-substrate-replayed" not in r.headers
    assert float(r.headers["x-substrate-restored-snapshot-at"]) == pytest.approx(s0["createdAt"], abs=1e-3)
    assert cl.history[-1].epoch > epoch, "a new epoch"
    assert c.get_session(sid)["restoredFrom"]["reason"] == "agent_restarted"
    assert check(cl.history).lost_reported == 1


def _processes_with(marker: str) -> list[int]:
    """Pids (host view) whose command line contains ``marker``."""
    import os

    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read().replace(b"\0", b" "):
                        out.append(int(name))
            except OSError:
                pass
    return out


def test_an_agent_killed_between_turns_comes_back_under_a_new_epoch(runtime_factory):
    """The same for an agent process that dies between two turns (the test kills it): the next turn is
    not failed, it runs in a new activation restored from the last snapshot, and its answer says so
    (before: the agent restarted inside the same epoch)."""
    import os
    import signal
    import uuid

    rt = runtime_factory(replicas=1, slots=4)
    c = rt.client
    sid = c.create_session("notebook")["id"]
    c.invoke(sid, "kept = 1")
    c.suspend(sid)  # snapshot: kept = 1
    epoch = c.get_session(sid)["epoch"] + 1  # the wake below bumps it
    mark = f"60{uuid.uuid4().int % 10**6}"
    # a child that lives as long as the sandbox; its parent is the agent's process, which the test kills
    out = c.invoke(sid, f"import subprocess\nlost = 2\nsubprocess.Popen(['sleep', '{mark}'])")
    assert not out.get("error"), out
    rt.wait_for(lambda: _processes_with(f"sleep {mark}") != [], timeout_s=30, what="the child started")
    child = _processes_with(f"sleep {mark}")[0]
    with open(f"/proc/{child}/status") as f:
        host = int(next(line.split()[1] for line in f if line.startswith("PPid:")))
    with open(f"/proc/{host}/cmdline", "rb") as f:
        assert b"workers.agenthost" in f.read(), "the child's parent is the agent host"
    os.kill(host, signal.SIGKILL)
    rt.wait_for(lambda: _processes_with(f"sleep {mark}") == [], timeout_s=30, what="the sandbox gone")
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "(kept, 'lost' in dir())"})
    assert r.status_code == 200, r.text
    assert r.json()["output"]["repr"] == "(1, False)", "back from the snapshot"
    assert r.headers.get("x-substrate-restored") == "agent_restarted", r.headers
    assert int(r.headers["x-substrate-epoch"]) > epoch, "a new epoch, not a restart inside the old one"
    c.delete_session(sid)
