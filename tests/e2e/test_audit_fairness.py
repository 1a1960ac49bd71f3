"""Issue 10, the two items first shown only in part: exactly one audit record for each automatic
transition not covered by ``test_tenancy.py`` (pressure suspend, drain suspend by SIGTERM, deadline
rollbacks, failed automatic suspends; the scale-down drain's record is checked in
``test_sessions_api.py::test_pool_scales_from_zero_on_demand_and_back``), and fairness between tenants
on a full pool (parked-wake share, fair placement, circuit breaker). Real runtimes (``substrate up``),
real workers, API keys, a moto S3 server in its own process where a test freezes the object store.

No test asserts on timing; sleeps only let sessions become idle (``pressureMinIdle``) or let a straggling
duplicate record show up before the records are counted.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
import uuid
from typing import Any

import httpx
import pytest

from substrate.audit import SYSTEM
from substrate.client import ApiError, SubstrateClient
from tests.e2e.test_tenancy import KEY_A, KEY_B, _client, _keys_env

PRESSURE = {"SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "0.5", "SUBSTRATE_API__SLOT_WAIT_S": "20",
            "SUBSTRATE_API__PARK_TIMEOUT_S": "20"}


def _events(c: SubstrateClient, sid: str) -> list[dict[str, Any]]:
    return list(c.session_events(sid, limit=1000)["items"])


def _actions(c: SubstrateClient, sid: str) -> list[tuple[str, str, str]]:
    return [(e["action"], e["reason"], e["result"]) for e in _events(c, sid)]


def _one(c: SubstrateClient, sid: str, action: str, reason: str) -> dict[str, Any]:
    """The only record of ``action``/``reason`` on ``sid`` (fails on zero or several)."""
    got = [e for e in _events(c, sid) if e["action"] == action and e["reason"] == reason]
    assert len(got) == 1, (action, reason, _actions(c, sid))
    return got[0]


def _system(e: dict[str, Any], *, tenant: str, worker: str, epoch: int, result: str = "ok") -> None:
    """An automatic transition's record: the system did it, on that worker and activation epoch."""
    assert (e["who"], e["tenant"], e["worker"], e["epoch"], e["result"], e["requestId"]) == \
        (SYSTEM.who, tenant, worker, epoch, result, ""), e


def _state(c: SubstrateClient, sid: str) -> str:
    return str(c.get_session(sid)["state"])


# ----------------------------------------------------------------------------------- audit: pressure
def test_fair_placement_and_one_record_per_pressure_suspend(runtime_factory):
    """Pool full of tenant A's idle sessions: B's create suspends exactly one of A's (B is under its
    fair share); A's own wake, with A over its share, displaces one of A's sessions and not B's even
    though B's is the least recently used. Each pressure suspend leaves one record, by the system
    (not by the tenant whose request needed the room: its key and request ID stay out of A's trail)."""
    rt = runtime_factory(replicas=1, slots=4, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env(), **PRESSURE})
    a, b = _client(rt.url, KEY_A), _client(rt.url, KEY_B)
    ours = [a.create_session("counter") for _ in range(4)]
    time.sleep(1.0)  # all four idle past pressureMinIdle (0.5 s)
    rid = uuid.uuid4().hex
    r = b.http.post("/v1/sessions", json={"actorTemplate": "counter"}, headers={"X-Request-ID": rid})
    assert r.status_code == 201, r.text
    theirs = r.json()
    states = {s["id"]: _state(a, s["id"]) for s in ours}
    assert list(states.values()).count("SUSPENDED") == 1, f"one slot needed, one session suspended: {states}"
    lru = ours[0]
    assert states[lru["id"]] == "SUSPENDED", "the least recently used one"
    assert _actions(a, lru["id"]) == [("create", "", "ok"), ("suspend", "pressure", "ok")]
    _system(_one(a, lru["id"], "suspend", "pressure"), tenant="team-a", worker=lru["worker"], epoch=lru["epoch"])
    assert all(e["requestId"] != rid for e in a.events(limit=1000)["items"]), "B's request ID is not in A's trail"

    # B's session becomes the least recently used; A (3 of 4 slots, share 2) wakes its suspended one
    for s in ours[1:]:
        a.invoke(s["id"], "increment")
    b_active = float(rt.session_raw(theirs["id"])["lastActiveAt"])
    rt.wait_for(lambda: all(float(rt.session_raw(s["id"])["lastActiveAt"]) > b_active for s in ours[1:]),
                what="the turns reported (B's session is the least recently used now)")
    time.sleep(1.0)  # ... and every session idle past pressureMinIdle again
    assert a.invoke(lru["id"], "get") == {"count": 0}
    assert _state(b, theirs["id"]) == "RUNNING", "A over its share must not displace B's session"
    suspended = [s for s in ours[1:] if _state(a, s["id"]) == "SUSPENDED"]
    assert len(suspended) == 1, [(s["id"], _state(a, s["id"])) for s in ours]
    victim = suspended[0]
    _system(_one(a, victim["id"], "suspend", "pressure"), tenant="team-a", worker=victim["worker"],
            epoch=victim["epoch"])
    time.sleep(0.5)  # a duplicate written late would show up now
    assert _actions(a, victim["id"]) == [("create", "", "ok"), ("suspend", "pressure", "ok")]
    assert _actions(b, theirs["id"]) == [("create", "", "ok")]
    wake = _one(a, lru["id"], "wake", "")
    assert wake["who"].startswith("apikey:") and wake["result"] == "ok" and wake["epoch"] > lru["epoch"]


# -------------------------------------------------------------------------------------- audit: drain
def test_worker_sigterm_drain_leaves_one_record_per_session(runtime_factory):
    """SIGTERM to a worker: it suspends its sessions itself (no router call records that); each
    session gets exactly one ``suspend``/``drain`` record by the system, on that worker and epoch."""
    rt = runtime_factory(replicas=2, slots=2, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env(),
                                                   "SUBSTRATE_QUOTA__TENANTS": '{"team-a": {"maxRunning": 1}}'})
    a = _client(rt.url, KEY_A)
    s = a.create_session("counter")
    assert a.invoke(s["id"], "increment") == {"count": 1}
    # (and the request-ID rule at the edge: a value that could not be stored as sent is refused, and the
    # refused calls change and record nothing)
    for path, body in ((f"/v1/sessions/{s['id']}/suspend", None), (f"/v1/sessions/{s['id']}/invoke", {"input": 1})):
        for bad in ("x" * 129, "two words"):
            r = a.http.post(path, json=body, headers={"X-Request-ID": bad})
            assert r.status_code == 422 and r.json()["code"] == "invalid_request_id", (path, r.text)
    assert _state(a, s["id"]) == "RUNNING" and a.invoke(s["id"], "get") == {"count": 1}
    wid = s["worker"]
    pid = int(rt.workers()[wid]["pid"])
    running = rt.keys.quota("team-a", "running")
    assert rt.r.sismember(running, s["id"])
    os.kill(pid, signal.SIGTERM)
    rt.wait_for(lambda: _state(a, s["id"]) == "SUSPENDED", timeout_s=30, what="drained")
    rt.wait_for(lambda: len(_events(a, s["id"])) == 2, timeout_s=10, what="the drain's record")
    # the worker gave the running place back with it (the repair pass would take two passes)
    assert not rt.r.sismember(running, s["id"]), "a suspended session holds no running quota"
    rt.wait_for(lambda: wid not in rt.workers(), timeout_s=30, what="the worker deregistered")
    time.sleep(0.5)
    assert _actions(a, s["id"]) == [("create", "", "ok"), ("suspend", "drain", "ok")]
    _system(_one(a, s["id"], "suspend", "drain"), tenant="team-a", worker=wid, epoch=s["epoch"])
    assert a.invoke(s["id"], "get") == {"count": 1}, "nothing acknowledged was lost (and maxRunning 1 admits it)"


def test_worker_stopped_while_the_store_is_down_leaves_one_failed_drain_and_one_recovery(runtime_factory,
                                                                                         moto_proc):
    """SIGTERM while the object store is gone (moto stopped: connections refused): the worker's drain
    suspend fails (every attempt), so it moves the session to SUSPENDED from its last snapshot itself.
    Records: one ``suspend``/``drain`` carrying the error code, one ``recover``/``worker_lost``, both
    by the system, on that worker and epoch."""
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env(), **moto_proc.env()})
    a = _client(rt.url, KEY_A)
    s = a.create_session("counter")
    a.invoke(s["id"], "increment")
    wid = s["worker"]
    moto_proc.stop()
    os.kill(int(rt.workers()[wid]["pid"]), signal.SIGTERM)
    rt.wait_for(lambda: _state(a, s["id"]) == "SUSPENDED", timeout_s=40, what="released by the stopping worker")
    rt.wait_for(lambda: len(_events(a, s["id"])) >= 3, timeout_s=10, what="its records")
    time.sleep(0.5)
    got = _actions(a, s["id"])
    assert len(got) == 3 and got[0] == ("create", "", "ok") and got[2] == ("recover", "worker_lost", "ok"), got
    failed = _one(a, s["id"], "suspend", "drain")
    assert failed["result"] not in ("ok", ""), got
    _system(failed, tenant="team-a", worker=wid, epoch=s["epoch"], result=failed["result"])
    _system(_one(a, s["id"], "recover", "worker_lost"), tenant="team-a", worker=wid, epoch=s["epoch"])


# ----------------------------------------------------------------------------------- audit: deadline
FAST_DEADLINE = {"SUBSTRATE_STATE__TRANSITION_DEADLINE_S": "4", "SUBSTRATE_API__PARK_TIMEOUT_S": "1"}


def _fresh(c: SubstrateClient, *, suspended: bool = False, template: str = "counter") -> dict[str, Any]:
    """A session of ``template`` (a counter) at count 1 (``suspended``: then suspended), made before the store is frozen.
    With a short transition deadline a loaded machine can miss it while setting up (the create or the
    suspend is rolled back whole: 409 ``conflict``, 503 ``suspend_timeout``); then start over with a new
    session, so the one under test has a clean trail."""
    for attempt in range(5):
        try:
            s = c.create_session(template)
        except ApiError as e:
            if e.code != "conflict" or attempt == 4:
                raise
            continue
        c.invoke(s["id"], "increment")
        if not suspended:
            return s
        try:
            c.suspend(s["id"])
            return s
        except ApiError as e:
            if e.code != "suspend_timeout" or attempt == 4:
                raise
            c.delete_session(s["id"])
    raise AssertionError("unreachable")


def test_deadline_rollback_of_a_suspend_leaves_one_record(runtime_factory, moto_proc):
    """Object store frozen during a suspend: the worker gives up at 0.9 of SUSPENDING's deadline and puts
    the session back to RUNNING itself; the suspend call's own record carries the error code it answered
    (``suspend_timeout``). Should the state manager's deadline roll come first (a loaded machine), it
    leaves one ``deadline`` record by the system, before the call's."""
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env(), **moto_proc.env(),
                                                   **FAST_DEADLINE})
    a = _client(rt.url, KEY_A)
    s = _fresh(a)
    moto_proc.freeze()
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(a.http.post, f"/v1/sessions/{s['id']}/suspend")
            rt.wait_for(lambda: _state(a, s["id"]) == "SUSPENDING", what="suspending")
            rt.wait_for(lambda: _state(a, s["id"]) == "RUNNING", timeout_s=20, what="rolled back")
            moto_proc.thaw()
            r = fut.result(timeout=60)
    finally:
        moto_proc.thaw()
    assert r.status_code == 503 and r.json()["code"] == "suspend_timeout", r.text
    time.sleep(1.0)  # two state-manager scans: a second roll would be recorded by now
    actions = _actions(a, s["id"])
    assert actions in ([("create", "", "ok"), ("suspend", "explicit", "suspend_timeout")],
                       [("create", "", "ok"), ("deadline", "SUSPENDING->RUNNING", "ok"),
                        ("suspend", "explicit", "suspend_timeout")]), actions
    if len(actions) == 3:
        _system(_one(a, s["id"], "deadline", "SUSPENDING->RUNNING"), tenant="team-a", worker=s["worker"],
                epoch=s["epoch"])
    call = _one(a, s["id"], "suspend", "explicit")
    assert call["who"].startswith("apikey:") and call["epoch"] == s["epoch"]
    assert a.invoke(s["id"], "get") == {"count": 1}


def test_deadline_rollback_of_a_wake_leaves_one_record(runtime_factory, moto_proc):
    """Object store frozen during a wake: 503 ``resume_timeout`` to the caller, the deadline sets the
    session back to SUSPENDED (one ``deadline`` record by the system, on the epoch the wake claimed),
    and the wake itself leaves one record carrying its error code, not ``ok``."""
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env(), **moto_proc.env(),
                                                   **FAST_DEADLINE, "SUBSTRATE_WORKER__RECONCILE_S": "0.5"})
    a = _client(rt.url, KEY_A)
    s = _fresh(a, suspended=True)
    wid = s["worker"]
    moto_proc.freeze()
    try:
        r = a.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "get"})
        assert r.status_code == 503 and r.json()["code"] == "resume_timeout", r.text
        rt.wait_for(lambda: _state(a, s["id"]) == "SUSPENDED", timeout_s=20, what="wake rolled back")
    finally:
        moto_proc.thaw()
    # the wake task ends once the store answers again (the late activation is refused or times out)
    rt.wait_for(lambda: any(e[0] == "wake" for e in _actions(a, s["id"])), timeout_s=60, what="wake record")
    time.sleep(1.0)
    got = _actions(a, s["id"])  # the wake's record may come before or after the roll's
    assert [x for x in got if x[0] != "wake"] == [("create", "", "ok"), ("suspend", "explicit", "ok"),
                                                  ("deadline", "RESUMING->SUSPENDED", "ok")], got
    assert len(got) == 4, got
    wake = _one(a, s["id"], "wake", "")
    assert wake["result"] not in ("ok", ""), "a failed wake carries its error code"
    _system(_one(a, s["id"], "deadline", "RESUMING->SUSPENDED"), tenant="team-a", worker=wid,
            epoch=s["epoch"] + 1)
    assert a.invoke(s["id"], "get") == {"count": 1}, "woken afterwards, state intact"


# ----------------------------------------------------------------------------- fairness: parked share
def _parked(rt) -> float:
    for line in httpx.get(rt.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("agent_substrate_parked_requests "):
            return float(line.split()[1])
    raise AssertionError("no parked gauge")


def test_one_tenants_burst_of_wakes_takes_at_most_its_share_of_parked_places(runtime_factory):
    """Full pool (3 slots held by sessions too recently active to be displaced), ``max_parked`` 4,
    share 0.5: two of A's wakes park, A's third is refused at once (429 ``tenant_parked_share``), B's
    wake still parks; once slots free up, every parked wake succeeds."""
    rt = runtime_factory(replicas=1, slots=3, env={
        "SUBSTRATE_AUTH__API_KEYS": _keys_env(), "SUBSTRATE_API__MAX_PARKED": "4",
        "SUBSTRATE_QUOTA__TENANT_PARKED_SHARE": "0.5", "SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "600",
        "SUBSTRATE_API__SLOT_WAIT_S": "60", "SUBSTRATE_API__PARK_TIMEOUT_S": "60"})
    a, b = _client(rt.url, KEY_A), _client(rt.url, KEY_B)
    mine = [a.create_session("counter")["id"] for _ in range(3)]
    for sid in mine:
        a.suspend(sid)
    other = b.create_session("counter")["id"]
    b.suspend(other)
    blockers = [b.create_session("counter")["id"] for _ in range(3)]  # the pool is full now
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(_client(rt.url, KEY_A).invoke, sid, "get") for sid in mine[:2]]
        rt.wait_for(lambda: _parked(rt) == 2, what="A's two wakes parked")
        with pytest.raises(ApiError) as e:  # refused at once (were it parked, the 10 s timeout would fail it)
            SubstrateClient(rt.url, token=KEY_A, timeout_s=10, retries=0).invoke(mine[2], "get")
        assert e.value.status == 429 and e.value.code == "tenant_parked_share" and e.value.retry_after_s
        assert _state(a, mine[2]) == "SUSPENDED", "the refused wake changed nothing"
        fut_b = ex.submit(_client(rt.url, KEY_B).invoke, other, "get")
        rt.wait_for(lambda: _parked(rt) == 3, what="B's wake parked beside A's")
        assert all(not f.done() for f in [*futs, fut_b]), "all three still wait for a slot"
        for sid in blockers:
            b.delete_session(sid)
        assert [f.result(timeout=60) for f in futs] == [{"count": 0}, {"count": 0}]
        assert fut_b.result(timeout=60) == {"count": 0}
    assert _actions(a, mine[2]) == [("create", "", "ok"), ("suspend", "explicit", "ok")], "no record of a refused wake"


# ---------------------------------------------------------------------------- fairness: the breaker
def test_a_tenant_whose_wakes_keep_failing_is_cut_off_and_another_is_not(runtime_factory, tmp_path):
    """A's sessions need a credential that goes missing while they are suspended: each wake fails
    (422 ``secret_unavailable``, recorded with that code); after ``breaker_failures`` (2) A's wakes and
    creates of that template get 429 ``tenant_circuit_open`` with Retry-After at once, while A's other
    templates and B on the same router wake and create as before (the breaker is per tenant and
    template)."""
    secrets = tmp_path / "secrets"
    for tenant in ("team-a", "team-b"):
        (secrets / tenant / "model-keys").mkdir(parents=True)
        (secrets / tenant / "model-keys" / "k").write_text(f"{tenant}-value\n")
    extra = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: keyed-counter}
spec:
  entrypoint: workers.agents.counter:Counter
  env:
    - {name: MODEL_KEY, valueFrom: {secretKeyRef: {name: model-keys, key: k}}}
"""
    rt = runtime_factory(replicas=1, slots=4, extra_yaml=extra, env={
        "SUBSTRATE_AUTH__API_KEYS": _keys_env(), "SUBSTRATE_AUTH__SECRETS_DIR": str(secrets),
        "SUBSTRATE_QUOTA__BREAKER_FAILURES": "2", "SUBSTRATE_QUOTA__BREAKER_OPEN_S": "60"})
    a, b = _client(rt.url, KEY_A), _client(rt.url, KEY_B)
    sa, sb = a.create_session("keyed-counter")["id"], b.create_session("keyed-counter")["id"]
    a.invoke(sa, "increment")
    b.invoke(sb, "increment")
    a.suspend(sa)
    b.suspend(sb)
    (secrets / "team-a" / "model-keys" / "k").unlink()  # A's credential is gone
    for _ in range(2):
        with pytest.raises(ApiError) as e:
            a.invoke(sa, "get")
        assert (e.value.status, e.value.code) == (422, "secret_unavailable")
    assert [x for x in _actions(a, sa) if x[0] == "wake"] == [("wake", "", "secret_unavailable")] * 2
    # each names the activation it claimed (epochs 2 and 3 after the suspend of epoch 1), and where: a
    # failed wake was recorded with the suspended epoch (fresh-user run 35)
    failed = [e for e in _events(a, sa) if e["action"] == "wake"]
    assert [e["epoch"] for e in failed] == [2, 3] and all(e["worker"] for e in failed), failed
    for call in (lambda: a.invoke(sa, "get"), lambda: a.create_session("keyed-counter")):
        with pytest.raises(ApiError) as e:
            call()
        assert (e.value.status, e.value.code) == (429, "tenant_circuit_open")
        assert e.value.retry_after_s and e.value.retry_after_s >= 1
        assert e.value.details["actorTemplate"] == "keyed-counter"
    assert _state(a, sa) == "SUSPENDED"
    assert a.create_session("counter")["tenant"] == "team-a", "A's other templates are not cut off"
    assert b.invoke(sb, "get") == {"count": 1}, "B's wake on the same router is unaffected"
    assert b.create_session("counter")["tenant"] == "team-b"
    assert len([x for x in _actions(a, sa) if x[0] == "wake"]) == 2, "a refused call touched nothing"


def test_a_template_that_cannot_start_cuts_off_only_itself(runtime_factory):
    """A fresh-user run: 10 creates of a template whose command does not exist opened the (open-mode,
    so everyone's) tenant breaker, and creates of good templates and wakes got 429 for 30 s. Now the
    breaker is per tenant and template: the broken template is refused at once after
    ``breaker_failures``, the good one is created and woken as before; the start failure's message does
    not promise a restart from a snapshot that a create never had."""
    extra = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: nocmd}
spec:
  command: ["/nonexistent/binary"]
"""
    rt = runtime_factory(replicas=1, slots=4, extra_yaml=extra, env={"SUBSTRATE_QUOTA__BREAKER_FAILURES": "2",
                                                                    "SUBSTRATE_QUOTA__BREAKER_OPEN_S": "60"})
    c = rt.client
    good = c.create_session("counter")["id"]
    c.invoke(good, "increment")
    c.suspend(good)
    for _ in range(2):
        with pytest.raises(ApiError) as e:
            c.create_session("nocmd")
        assert (e.value.status, e.value.code) == (500, "agent_start_failed"), e.value
        assert "restarts from its last snapshot" not in str(e.value), str(e.value)
        assert "command '/nonexistent/binary' not found inside the sandbox, which sees /usr" in e.value.message, \
            e.value.message  # not just "exit 127", and why a program at a host path is not found
    with pytest.raises(ApiError) as e:
        c.create_session("nocmd")
    assert (e.value.status, e.value.code) == (429, "tenant_circuit_open")
    assert e.value.details["actorTemplate"] == "nocmd"
    assert c.invoke(good, "get") == {"count": 1}, "a wake of another template is not cut off"
    assert c.create_session("counter")["state"] == "RUNNING", "nor a create of another template"


def test_a_failed_idle_suspend_is_recorded_with_its_error_code(runtime_factory, moto_proc):
    """Object store frozen while the state manager suspends an idle session: the attempt fails within
    SUSPENDING's deadline (the worker gives up at 0.9 of it and puts the session back to RUNNING; should
    the deadline roll come first on a loaded machine, that roll has its own record; a hanging suspend
    used to block the whole scan, deadlines included, until the store came back), the attempt's record
    carries the code it failed with, and the retry once the store is back leaves one ``ok`` record: one
    record per attempt and per transition."""
    extra = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: idle-counter}
spec:
  entrypoint: workers.agents.counter:Counter
  stateManagement: {snapshotInterval: 0, maxIdleTime: 1s}
"""
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=extra, env={
        "SUBSTRATE_AUTH__API_KEYS": _keys_env(), **moto_proc.env(), **FAST_DEADLINE,
        "SUBSTRATE_STATE__SUSPEND_RETRY_BASE_S": "0.5", "SUBSTRATE_STATE__SUSPEND_RETRY_MAX_S": "1"})
    a = _client(rt.url, KEY_A)
    moto_proc.freeze()
    try:
        s = _fresh(a, template="idle-counter")  # a create reads and writes no snapshot
        rt.wait_for(lambda: ("suspend", "idle", "suspend_timeout") in _actions(a, s["id"]), timeout_s=30,
                    what="the hanging idle suspend failed within its deadline")
        assert _state(a, s["id"]) == "RUNNING"
    finally:
        moto_proc.thaw()
    rt.wait_for(lambda: ("suspend", "idle", "ok") in _actions(a, s["id"]), timeout_s=30, what="suspended on a retry")
    assert _state(a, s["id"]) == "SUSPENDED"
    time.sleep(0.5)
    got = _actions(a, s["id"])
    failed = [e for e in _events(a, s["id"]) if e["action"] == "suspend" and e["result"] != "ok"]
    assert failed and all((e["reason"], e["result"]) == ("idle", "suspend_timeout") for e in failed), got
    for e in failed:
        _system(e, tenant="team-a", worker=s["worker"], epoch=s["epoch"], result="suspend_timeout")
    # one record per roll, one per failure streak (retries failing the same way are not recorded again;
    # on a loaded machine the retry too may miss the deadline), one for the success
    assert len(failed) == 1, got
    rolls = got.count(("deadline", "SUSPENDING->RUNNING", "ok"))
    assert got[0] == ("create", "", "ok") and got[-1] == ("suspend", "idle", "ok"), got
    assert len(got) == 1 + rolls + 1 + 1, got


def test_concurrent_and_repeated_suspends_and_resumes_leave_one_record_per_transition(runtime_factory):
    """Fresh-user run: four concurrent suspends and one more after them each answered 202 and left five
    ``suspend explicit ok`` records, all of one epoch, for one transition; concurrent resumes likewise.
    The call whose suspend committed, or whose resume started the wake, leaves the record; one that found
    the session there already or waited for another call's leaves none (a record is of the transition,
    not of the call)."""
    rt = runtime_factory(replicas=1, slots=4, env={"SUBSTRATE_AUTH__API_KEYS": _keys_env()})
    a = _client(rt.url, KEY_A)
    sid = a.create_session("counter")["id"]
    a.invoke(sid, "increment")
    with cf.ThreadPoolExecutor(4) as ex:
        states = list(ex.map(lambda _: a.suspend(sid)["state"], range(4)))
    assert states == ["SUSPENDED"] * 4
    assert a.suspend(sid)["state"] == "SUSPENDED"
    time.sleep(0.5)  # a straggling duplicate record would show up by now
    assert _actions(a, sid) == [("create", "", "ok"), ("suspend", "explicit", "ok")]
    # the same for resumes: three at once share one wake, and a fourth finds the session running
    with cf.ThreadPoolExecutor(3) as ex:
        states = list(ex.map(lambda _: a.resume(sid)["state"], range(3)))
    assert states == ["RUNNING"] * 3
    assert a.resume(sid)["state"] == "RUNNING"
    time.sleep(0.5)
    assert _actions(a, sid) == [("create", "", "ok"), ("suspend", "explicit", "ok"), ("resume", "", "ok")]
    assert a.invoke(sid, "get") == {"count": 1}
