"""An agent that writes to its own agent host's protocol pipe, and the audit record of a dead agent's
automatic restart, on a real runtime (``substrate up``, real workers, real sandboxes).

* A notebook cell can reach the host's ``Host`` object (same process) and write a forged answer line.
  It used to become the turn's answer, every later answer was the previous turn's, a suspend crashed
  the worker's handler (aiohttp's plain-text 500) and the session never got a snapshot. Now the line is
  a protocol violation: the agent is killed, the turn answers 500 ``agent_protocol_violation`` and the
  session comes back from its last snapshot, answering correctly, and suspends normally.
* A replayed answer says what the activation that ran its turn had lost, however many crashes later and
  whether or not the retry woke the session; a failed turn says so on its first answer as on its replay.
* A turn timeout (the worker kills the agent and moves the session to SUSPENDED, ``agent_restarted``,
  on its own) leaves exactly one audit record of that move, by the system, with the dead activation's
  worker and epoch.

No timing is asserted.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from substrate.audit import SYSTEM
from substrate.client import ApiError
from tests.conftest import RuntimeProc

EXTRA = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: shell-turn2s}
spec:
  entrypoint: workers.agents.shell:Shell
  env: [{name: SHELL_TIMEOUT_S, value: "60"}]
  isolation: {turnTimeout: 2s}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: image-only}
spec:
  container: {image: busybox}
"""

def _command_template(name: str, source: str, spec: str = "") -> str:
    """An ActorTemplate document whose agent is ``source`` run by this Python (``spec.command``);
    ``spec``: more lines of its spec (YAML, two-space indented)."""
    return f"""
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {{name: {name}}}
spec:
{spec}  command:
  - "{sys.executable}"
  - "-u"
  - "-c"
  - |
{textwrap.indent(source, "    ")}"""


# a command agent (sandboxed, the default) that answers every turn and dies mid-turn on "die"
MIDCRASH = """import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    op = msg.get("op")
    if op == "stop":
        break
    if op == "invoke" and msg.get("input") == "die":
        os._exit(1)
    reply = {"output": {"echo": msg.get("input")}} if op == "invoke" else \\
        {"state": {}} if op == "snapshot" else {"ok": True}
    reply["id"] = msg.get("id")
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""
EXTRA += _command_template("midcrash", MIDCRASH)

# a command agent whose answers are what its input names: JSON that is not strict JSON or not Unicode,
# or an error code no turn may answer with
FORGER = """import json, sys
BAD = {"nan": '{"output": NaN', "inf": '{"output": 1e999', "surrogate": '{"output": "a\\\\ud800b"',
       "code": '{"error": "forged", "code": "state_load_failed"'}
for line in sys.stdin:
    msg = json.loads(line)
    op, rid = msg.get("op"), json.dumps(msg.get("id"))
    if op == "stop":
        break
    if op == "invoke" and msg.get("input") in BAD:
        sys.stdout.write(BAD[msg["input"]] + ', "id": ' + rid + '}\\n')
    else:
        reply = {"output": {"echo": msg.get("input")}} if op == "invoke" else \\
            {"state": {}} if op == "snapshot" else {"ok": True}
        reply["id"] = msg.get("id")
        sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""
EXTRA += _command_template("forger", FORGER)

# a command agent whose snapshot hangs once armed (its turns answer at once)
SLOWSNAP = """import json, sys, time
armed = False
for line in sys.stdin:
    msg = json.loads(line)
    op = msg.get("op")
    if op == "stop":
        break
    if op == "snapshot" and armed:
        time.sleep(600)
    if op == "invoke":
        armed = armed or msg.get("input") == "arm"
    reply = {"output": {"armed": armed}} if op == "invoke" else {"state": {}} if op == "snapshot" else {"ok": True}
    reply["id"] = msg.get("id")
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""
EXTRA += _command_template("slowsnap", SLOWSNAP, "  isolation: {turnTimeout: 2s}\n")

FORGE = ('import gc\nh = [o for o in gc.get_objects() if type(o).__name__ == "Host"][0]\n'
         'h.out.write(b\'{"output": "FORGED"}\\n\'); h.out.flush()\n"real"')


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RuntimeProc]:
    r = RuntimeProc(tmp_path_factory.mktemp("proto"), redis_url, replicas=1, slots=4, extra_yaml=EXTRA)
    yield r
    r.stop()


def _events(rt: RuntimeProc, sid: str) -> list[dict[str, Any]]:
    return list(rt.client.session_events(sid, limit=1000)["items"])


def test_a_forged_protocol_line_is_never_an_answer_and_the_session_recovers(rt: RuntimeProc) -> None:
    c = rt.client
    sid = c.create_session("notebook")["id"]
    try:
        assert c.invoke(sid, "x = 5\nx")["repr"] == "5"
        assert c.suspend(sid) is not None  # a snapshot holding x
        assert c.invoke(sid, "y = 7\ny")["repr"] == "7"
        with pytest.raises(ApiError) as e:
            c.invoke(sid, FORGE)
        assert (e.value.status, e.value.code) == (500, "agent_protocol_violation"), e.value
        assert "FORGED" not in e.value.message
        # back from its last snapshot (x, not y), and every answer is its own turn's
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "x"})
        assert r.status_code == 200 and r.json()["output"]["repr"] == "5", r.text
        assert r.headers.get("X-Substrate-Restored") == "agent_restarted"
        assert c.invoke(sid, "'y' in globals()")["repr"] == "False"
        assert c.invoke(sid, "1 + 1")["repr"] == "2"
        assert c.invoke(sid, "x * 3")["repr"] == "15"
        r = c.http.post(f"/v1/sessions/{sid}/suspend")
        assert r.status_code == 202, r.text
        assert c.invoke(sid, "x")["repr"] == "5"
        restarts = [ev for ev in _events(rt, sid) if ev["action"] == "recover"]
        assert [ev["reason"] for ev in restarts] == ["agent_restarted"], _events(rt, sid)
    finally:
        c.delete_session(sid)


def test_a_turn_timeout_leaves_one_record_of_the_agent_restarted_move(rt: RuntimeProc) -> None:
    c = rt.client
    s = c.create_session("shell-turn2s")
    sid = s["id"]
    try:
        epochs = []
        for _ in range(2):  # the tester's sequence: two timeouts, each on a fresh activation
            assert c.invoke(sid, "echo hi")["stdout"] == "hi\n"
            cur = c.get_session(sid)
            epochs.append((cur["worker"], cur["epoch"]))
            with pytest.raises(ApiError) as e:
                c.invoke(sid, "sleep 30")
            assert (e.value.status, e.value.code) == (504, "turn_timeout")
        evs = _events(rt, sid)
        moved = [ev for ev in evs if ev["reason"] == "agent_restarted" and ev["action"] != "wake"]
        assert len(moved) == 2, [(ev["action"], ev["reason"], ev["epoch"]) for ev in evs]
        for ev, (worker, epoch) in zip(moved, epochs):
            assert (ev["action"], ev["who"], ev["tenant"], ev["worker"], ev["epoch"], ev["result"],
                    ev["template"]) == ("recover", SYSTEM.who, "default", worker, epoch, "ok", "shell-turn2s"), ev
    finally:
        c.delete_session(sid)


def test_a_client_gone_mid_stream_loses_no_state_and_its_retry_is_answered(rt: RuntimeProc) -> None:
    # a fresh-user run: a client timing out on a streamed turn left the turn's last lines in the agent's
    # pipe; the next request read them as its own (500 agent_protocol_violation), the agent was killed and
    # the session rolled back to its last snapshot (or to nothing)
    import httpx

    c = rt.client
    sid = c.create_session("counter")["id"]
    try:
        for _ in range(3):
            c.invoke(sid, "increment")
        slow = {"input": {"op": "increment", "work_s": 1.0}}
        key = {"Idempotency-Key": "cut-stream-1"}
        with pytest.raises(httpx.ReadTimeout):  # gone before the turn's first line
            httpx.post(f"{rt.url}/v1/sessions/{sid}/invoke?stream=1", json=slow, headers=key, timeout=0.3)
        # the cut turn ran to its end (this call waits for it), nothing was rolled back
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"})
        assert r.status_code == 200 and r.json()["output"] == {"count": 4}, r.text
        assert "X-Substrate-Restored" not in r.headers
        # its retry with the same key is answered with the turn's whole stream, not run again
        r = c.http.post(f"/v1/sessions/{sid}/invoke?stream=1", json=slow, headers=key)
        assert r.status_code == 200 and r.headers.get("X-Substrate-Replayed") == "1", r.text
        assert r.text.rstrip().endswith('{"done": true}'), r.text
        assert c.invoke(sid, "get") == {"count": 4}
        # and the session snapshots and wakes as usual
        assert c.http.post(f"/v1/sessions/{sid}/suspend").status_code == 202
        assert c.invoke(sid, "increment") == {"count": 5}
        assert [ev for ev in _events(rt, sid) if ev["action"] == "recover"] == []
    finally:
        c.delete_session(sid)


def test_a_streamed_turn_that_kills_its_agent_is_answered_on_retry_not_run_again(rt: RuntimeProc) -> None:
    # a fresh-user run: the answer of a streamed turn that killed the agent was kept only after the dead
    # activation had ended and handed its failed answers to the record, so it was lost: every retry with
    # the same key ran the turn again (and killed the agent again); a plain turn's was kept
    c = rt.client
    sid = c.create_session("shell-turn2s")["id"]
    key = {"Idempotency-Key": "stream-timeout-1"}
    try:
        assert c.invoke(sid, "echo hi")["stdout"] == "hi\n"
        first = c.http.post(f"/v1/sessions/{sid}/invoke?stream=1", json={"input": "sleep 30"}, headers=key)
        # it failed before any output: answered as the plain turn is, 504 (fresh-user round 12)
        assert first.status_code == 504 and first.json()["code"] == "turn_timeout", first.text
        for _ in range(2):
            again = c.http.post(f"/v1/sessions/{sid}/invoke?stream=1", json={"input": "sleep 30"}, headers=key)
            assert again.status_code == 504 and again.headers.get("X-Substrate-Replayed") == "1", again.headers
            assert again.text == first.text
        restarts = [ev for ev in _events(rt, sid) if ev["action"] == "recover"]
        assert len(restarts) == 1, [(ev["action"], ev["reason"], ev["epoch"]) for ev in _events(rt, sid)]
    finally:
        c.delete_session(sid)


def test_a_container_only_template_is_refused_at_create_before_anything_is_placed(rt: RuntimeProc) -> None:
    """A seed's template with only ``spec.container`` loads (it is the YAML users write), but workers here
    run ``entrypoint``/``command`` agents: a create answered the worker's internal 400
    ``unsupported_template`` after a slot was claimed (fresh-user run). It is refused up front now, with
    the code the API documents, and nothing is created."""
    with pytest.raises(ApiError) as e:
        rt.client.create_session("image-only", id="img-1")
    assert e.value.status == 400 and e.value.code == "unsupported_template", e.value
    assert "spec.entrypoint" in e.value.message
    with pytest.raises(ApiError) as gone:
        rt.client.get_session("img-1")
    assert gone.value.status == 404


def test_a_replay_after_crashes_carries_the_marker_of_the_activation_that_ran_it(rt: RuntimeProc) -> None:
    # a tester's run: "hi" (k1) answered by an activation that had lost nothing, then "die" (k2) killed the
    # agent; after more crashes the retry of k1, which woke the session, said the wake's
    # `agent_restarted` while the retry of k2 (same activation, no wake) said nothing. The router added
    # the wake's marker to the replay; a failed turn had the marker only on a wake
    c = rt.client
    sid = c.create_session("midcrash")["id"]

    def turn(text: str, key: str) -> Any:
        return c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": text}, headers={"Idempotency-Key": key})

    try:
        first = turn("hi", "k1")
        assert first.status_code == 200 and "X-Substrate-Restored" not in first.headers, first.headers
        c.suspend(sid)  # its snapshot keeps k1's answer (a crash without one would lose it with the state)
        crashed = turn("die", "k2")  # a clean wake (nothing lost) whose turn kills the agent
        assert crashed.status_code == 500 and crashed.json()["code"] == "agent_crashed", crashed.text
        assert "X-Substrate-Restored" not in crashed.headers, crashed.headers
        for i in range(3):  # more restarts, each activation back from the snapshot and saying so
            r = turn("die", f"d{i}")
            assert r.status_code == 500 and r.headers.get("X-Substrate-Restored") == "agent_restarted", r.headers
        epoch = c.get_session(sid)["epoch"]
        # the retry wakes the session (agent_restarted): the answer is k1's, which had lost nothing
        r = turn("hi", "k1")
        assert r.status_code == 200 and r.headers.get("X-Substrate-Replayed") == "1", r.headers
        assert r.headers.get("X-Substrate-Woke") == "1" and r.text == first.text
        assert "X-Substrate-Restored" not in r.headers and "X-Substrate-Restored-Snapshot-At" not in r.headers
        # the epoch is the activation's that answered the retry (documented in the README)
        assert int(r.headers["X-Substrate-Epoch"]) > epoch
        # the crashed turn's replay, with no wake, agrees
        r = turn("die", "k2")
        assert r.headers.get("X-Substrate-Replayed") == "1" and "X-Substrate-Woke" not in r.headers, r.headers
        assert r.status_code == 500 and r.text == crashed.text and "X-Substrate-Restored" not in r.headers
        # a turn failing on this lossy activation (no wake) says so on its first answer as on its replay,
        # which comes from the next activation, woken by the retry
        lost = turn("die", "k3")
        assert lost.status_code == 500 and "X-Substrate-Woke" not in lost.headers, lost.headers
        again = turn("die", "k3")
        assert again.headers.get("X-Substrate-Replayed") == "1" and again.headers.get("X-Substrate-Woke") == "1"
        for h in ("X-Substrate-Restored", "X-Substrate-Restored-Snapshot-At"):
            assert lost.headers.get(h) is not None and again.headers.get(h) == lost.headers.get(h), (h, lost.headers)
        assert lost.headers["X-Substrate-Restored"] == "agent_restarted"
    finally:
        c.delete_session(sid)


def _not_json(name: str) -> None:
    raise AssertionError(f"{name} in an answer")


@pytest.mark.parametrize("what", ["nan", "inf", "surrogate"])
def test_an_answer_that_is_not_strict_json_never_reaches_the_client(rt: RuntimeProc, what: str) -> None:
    """Regression (fresh-user round 14): an agent's ``NaN``, ``1e999`` or lone surrogate ``"\\ud800"``
    was passed on as the turn's answer, invalid JSON labelled application/json (strict parsers such
    as JavaScript's JSON.parse or Go's fail on it). Such a line is not JSON: the agent is ended (500
    ``agent_crashed``) and the session comes back on its next turn."""
    c = rt.client
    sid = c.create_session("forger")["id"]
    try:
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": what})
        assert (r.status_code, r.json()["code"]) == (500, "agent_crashed"), r.text
        json.loads(r.content.decode("utf-8"), parse_constant=_not_json)  # strict JSON, valid UTF-8
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "next"})
        assert r.status_code == 200 and r.json()["output"] == {"echo": "next"}, r.text
    finally:
        c.delete_session(sid)


def test_an_error_code_a_turn_cannot_have_is_answered_as_a_crash(rt: RuntimeProc) -> None:
    """Regression (fresh-user round 14): a turn answered with the code ``state_load_failed`` (the
    agent's word, at a wake, that the saved state cannot be loaded) was passed on as 422
    ``state_load_failed`` while the session stayed RUNNING. A code the agent host never answers to a
    turn is the agent failing the turn: 500 ``agent_exception``; the session goes on."""
    c = rt.client
    sid = c.create_session("forger")["id"]
    try:
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "code"})
        assert (r.status_code, r.json()["code"]) == (500, "agent_exception"), r.text
        assert c.get_session(sid)["state"] == "RUNNING"
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "next"})
        assert r.status_code == 200 and "X-Substrate-Restored" not in r.headers, r.text
    finally:
        c.delete_session(sid)


def test_a_suspend_whose_snapshot_ends_the_agent_says_so_instead_of_202(rt: RuntimeProc) -> None:
    """Regression (fresh-user round 14): a suspend whose snapshot call hung past the turn timeout (or ran
    out of memory) answered 202 SUSPENDED with ``snapshot: null``: the state it asked to save was gone, and
    the trail had no record of the suspend. Now the suspend answers the failure (504 ``turn_timeout``),
    says the session is SUSPENDED from its last snapshot, and leaves its record."""
    c = rt.client
    sid = c.create_session("slowsnap")["id"]
    try:
        assert c.invoke(sid, "arm") == {"armed": True}
        r = c.http.post(f"/v1/sessions/{sid}/suspend")
        assert (r.status_code, r.json()["code"]) == (504, "turn_timeout"), r.text
        assert "could not snapshot" in r.json()["message"] and r.json()["details"]["state"] == "SUSPENDED"
        assert c.get_session(sid)["state"] == "SUSPENDED"
        records = [(ev["action"], ev["result"]) for ev in _events(rt, sid)]
        assert ("suspend", "turn_timeout") in records, records
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "x"})  # back, empty, and it says so
        assert r.status_code == 200 and r.json()["output"] == {"armed": False}, r.text
        assert r.headers.get("X-Substrate-Restored", "").startswith("agent_restarted"), r.headers
    finally:
        c.delete_session(sid)


# a command agent whose wake hangs in ``start`` once its saved state says so
HANGWAKE = """import json, sys, time
armed = False
for line in sys.stdin:
    msg = json.loads(line)
    op = msg.get("op")
    if op == "stop":
        break
    if op == "start" and (msg.get("state") or {}).get("hang"):
        time.sleep(600)
    if op == "invoke":
        armed = armed or msg.get("input") == "arm"
    reply = {"output": {"armed": armed}} if op == "invoke" else {"state": {"hang": armed}} if op == "snapshot" \\
        else {"ok": True}
    reply["id"] = msg.get("id")
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""


def test_a_resume_timeout_names_the_previous_wake_that_failed(runtime_factory) -> None:
    """Regression (fresh-user round 14): a session whose agent hangs in ``start`` answered 503
    ``resume_timeout`` "(its wake goes on: retry)" on every call, while each of those wakes failed
    (``agent_start_failed``) after the caller had been told to retry. A later ``resume_timeout`` now
    names the previous wake's failure."""
    import time

    extra = _command_template("hangwake", HANGWAKE, "  isolation: {turnTimeout: 2s}\n")
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=extra, env={"SUBSTRATE_API__PARK_TIMEOUT_S": "0.5"})
    c = rt.client
    sid = c.create_session("hangwake")["id"]
    assert c.invoke(sid, "arm") == {"armed": True}
    assert c.suspend(sid)["state"] == "SUSPENDED"
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "x"})
    assert (r.status_code, r.json()["code"]) == (503, "resume_timeout"), r.text
    assert "previousWake" not in (r.json().get("details") or {})
    deadline = time.monotonic() + 60
    while not any(ev["action"] == "wake" and ev["result"] == "agent_start_failed" for ev in _events(rt, sid)):
        assert time.monotonic() < deadline, _events(rt, sid)
        time.sleep(0.2)
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "x"})
    assert (r.status_code, r.json()["code"]) == (503, "resume_timeout"), r.text
    assert "its previous wake failed" in r.json()["message"], r.text
    assert r.json()["details"]["previousWake"]["code"] == "agent_start_failed", r.text
    c.delete_session(sid)


def test_a_keyless_turn_after_a_full_window_of_client_keys_is_replayed_not_run_again(runtime_factory) -> None:
    """Fresh-user round 23: after 64 (here 4) client-keyed turns, the next keyless turn's answer was never
    kept, so sending its X-Request-ID back (as the README says a client may) ran the turn again."""
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_WORKER__IDEMPOTENCY_KEYS": "4"})
    c = rt.client
    sid = c.create_session("counter")["id"]
    for i in range(4):
        assert c.invoke(sid, "increment", idempotency_key=f"key{i}") == {"count": i + 1}
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"})
    assert r.status_code == 200 and r.json()["output"] == {"count": 5}, r.text
    rid = r.headers["X-Request-ID"]
    for header in ("Idempotency-Key", "X-Request-ID"):
        again = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}, headers={header: rid})
        assert again.status_code == 200 and again.headers.get("X-Substrate-Replayed") == "1", again.headers
        assert again.json()["output"] == {"count": 5}
    # and every client key is still answered (the keyless turn pushed none of them out)
    first = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}, headers={"Idempotency-Key": "key0"})
    assert first.headers.get("X-Substrate-Replayed") == "1" and first.json()["output"] == {"count": 1}
    assert c.invoke(sid, "get") == {"count": 5}


def _suspend_with_its_worker_killed(runtime_factory) -> tuple[RuntimeProc, str, Any]:
    """A runtime, an armed ``slowsnap`` session, and the answer of its suspend whose worker was SIGKILLed
    while the snapshot hung (the record reads SUSPENDING)."""
    import concurrent.futures as cf

    rt = runtime_factory(replicas=1, slots=2, extra_yaml=EXTRA)
    c = rt.client
    sid = c.create_session("slowsnap")["id"]
    assert c.invoke(sid, "arm") == {"armed": True}
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(c.http.post, f"/v1/sessions/{sid}/suspend")
        rt.wait_for(lambda: rt.session_raw(sid).get("state") == "SUSPENDING", what="suspending")
        rt.kill_worker(rt.session_raw(sid)["worker"])
        return rt, sid, fut.result(timeout=30)


def test_a_suspend_whose_worker_dies_under_it_reads_suspended_worker_lost_within_the_lease(runtime_factory) -> None:
    """Fresh-user round 23: after a suspend answered 502 ``worker_unavailable`` (its worker killed under
    it), GET showed ``SUSPENDING`` with no reason. The record says what happened once the worker's lease
    has run out (the README gives that bound): SUSPENDED, ``reason: worker_lost``."""
    rt, sid, r = _suspend_with_its_worker_killed(runtime_factory)
    c = rt.client
    assert (r.status_code, r.json()["code"]) == (502, "worker_unavailable"), r.text
    lease_s = float(rt.env["SUBSTRATE_WORKER__LEASE_S"])
    rt.wait_for(lambda: c.get_session(sid)["state"] == "SUSPENDED", timeout_s=lease_s + 10, what="suspended")
    got = c.get_session(sid)
    assert got["reason"] == "worker_lost", got
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "x"})
    assert r.status_code == 200 and r.headers.get("X-Substrate-Restored", "").startswith("worker_lost"), r.headers


def test_a_turn_sent_right_after_a_suspend_lost_its_worker_waits_and_runs_on_the_recovered_state(
        runtime_factory) -> None:
    """The README's promise beside the one above: a turn sent while the record still reads SUSPENDING
    (the dead worker's lease not yet run out) waits for the recovery and is answered, saying so."""
    rt, sid, r = _suspend_with_its_worker_killed(runtime_factory)
    assert r.status_code == 502
    r = rt.client.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "x"})
    assert r.status_code == 200 and r.json()["output"] == {"armed": False}, r.text
    assert r.headers.get("X-Substrate-Restored", "").startswith("worker_lost"), r.headers


def test_the_sdks_own_keys_never_push_a_callers_key_out_of_the_window(runtime_factory) -> None:
    """Fresh-user round 25: the SDK and the CLI key every turn (for their retries); those keys counted like
    the caller's, so after 64 (here 4) plain `invoke` calls a turn sent again with its own key ran twice.
    They go as automatic keys now, which make room first, like the router's."""
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_WORKER__IDEMPOTENCY_KEYS": "4"})
    c = rt.client
    sid = c.create_session("counter")["id"]
    assert c.invoke(sid, "increment", idempotency_key="imp") == {"count": 1}
    for i in range(10):
        assert c.invoke(sid, "increment") == {"count": i + 2}
    again = c.invoke_answer(sid, "increment", idempotency_key="imp")
    assert again.replayed and again.output == {"count": 1}
    assert c.invoke(sid, "get") == {"count": 11}
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"},
                    headers={"Idempotency-Key": "x1", "X-Substrate-Key-Origin": "mine"})
    assert (r.status_code, r.json()["code"]) == (422, "invalid_idempotency_key"), r.text
    assert c.invoke(sid, "get") == {"count": 11}, "the refused turn ran nothing"


def test_the_turns_of_an_activation_whose_agent_died_are_counted(rt: RuntimeProc) -> None:
    """Fresh-user run: 3 turns answered, then a turn that killed the agent: the session read ``turns: 0``
    for good, as the turns no heartbeat had reported yet went with the ended activation."""
    c = rt.client
    sid = c.create_session("midcrash")["id"]
    try:
        for i in range(3):
            assert c.invoke(sid, f"t{i}") == {"echo": f"t{i}"}
        r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "die"})
        assert r.status_code == 500 and r.json()["code"] == "agent_crashed", r.text
        rt.wait_for(lambda: c.get_session(sid)["turns"] == 3, timeout_s=15, what="the 3 answered turns counted")
        assert c.get_session(sid)["state"] == "SUSPENDED"
    finally:
        c.delete_session(sid)
