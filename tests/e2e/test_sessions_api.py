"""The core end to end: real Redis, real worker processes, real HTTP (issue 2)."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import uuid

import httpx
import pytest

from substrate.client import ApiError
from substrate.models import SESSION_ID_HINT


def _sid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def test_create_invoke_get_delete_counter(shared_runtime):
    c = shared_runtime.client
    s = c.create_session("counter", labels={"team": "a"})
    assert s["state"] == "RUNNING" and s["actorTemplate"] == "counter" and s["epoch"] == 1
    assert [c.invoke(s["id"], "increment")["count"] for _ in range(3)] == [1, 2, 3]
    assert c.invoke(s["id"], "get") == {"count": 3}
    got = c.get_session(s["id"])
    assert got["state"] == "RUNNING" and got["labels"] == {"team": "a"} and got["worker"] == s["worker"]
    shared_runtime.wait_for(lambda: c.get_session(s["id"])["turns"] == 4, what="turns reported by heartbeat")
    assert c.get_session(s["id"])["lastActiveAt"] > s["lastActiveAt"]
    c.delete_session(s["id"])
    with pytest.raises(ApiError) as e:
        c.get_session(s["id"])
    assert e.value.status == 404 and e.value.code == "session_not_found"
    # the slot it held is free again
    assert s["id"] not in shared_runtime.slots(s["worker"]).values()


def test_routes_to_the_worker_that_holds_the_session(shared_runtime):
    c = shared_runtime.client
    sessions = [c.create_session("counter") for _ in range(6)]
    for s in sessions:
        r = c.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "increment"})
        assert r.status_code == 200
        assert r.headers["x-substrate-worker"] == s["worker"] and len(r.headers["x-request-id"]) == 32
        acts = {a["session"] for a in shared_runtime.worker_activations(s["worker"])}
        assert s["id"] in acts
    assert len({s["worker"] for s in sessions}) == 2, "placement spreads sessions over both workers"
    for s in sessions:
        c.delete_session(s["id"])


def test_pack_placement_fills_one_worker_before_the_next(runtime_factory):
    """``SUBSTRATE_POOL__PLACEMENT=pack``: sessions go to the fullest worker with a free slot, so the
    other worker stays empty (the pool controller can drain it without suspending anyone)."""
    # no pre-started hosts: a worker with a warm slot comes first whatever the policy, and which one has
    # one while hosts re-boot after each create is a race this test is not about
    rt = runtime_factory(replicas=2, slots=4, env={"SUBSTRATE_POOL__PLACEMENT": "pack",
                                                   "SUBSTRATE_WORKER__PRESTART_HOSTS": "0"})
    rt.wait_for(lambda: len(rt.workers()) == 2, timeout_s=60, what="both workers registered")
    first = rt.client.create_session("counter")
    more = [rt.client.create_session("counter") for _ in range(3)]
    assert {s["worker"] for s in more} == {first["worker"]}, "the first worker is filled before the other"
    fifth = rt.client.create_session("counter")
    assert fifth["worker"] != first["worker"], "a full worker is skipped"


def test_notebook_shell_and_command_agents(shared_runtime):
    c = shared_runtime.client
    nb = c.create_session("notebook")
    c.invoke(nb["id"], "x = 40\nprint('hi')")
    out = c.invoke(nb["id"], "x + 2")
    assert out["repr"] == "42"
    assert "ZeroDivisionError" in c.invoke(nb["id"], "1/0")["error"]
    sh = c.create_session("shell")
    out = c.invoke(sh["id"], "echo hello > f.txt && cat f.txt && echo err >&2; exit 3")
    assert out == {"stdout": "hello\n", "stderr": "err\n", "exitCode": 3}
    assert c.invoke(sh["id"], "cat f.txt")["stdout"] == "hello\n"
    import time as _t
    t0 = _t.monotonic()
    with pytest.raises(ApiError) as e:  # a template setting is not the session's to change
        c.create_session("shell-fast", env={"SHELL_TIMEOUT_S": "100"})
    assert e.value.status == 422 and e.value.code == "invalid_env"
    sh2 = c.create_session("shell-fast")
    assert c.invoke(sh2["id"], "sleep 20; echo never")["exitCode"] == -9
    assert _t.monotonic() - t0 < 15, "the timeout kills the command's children too"
    c.delete_session(sh2["id"])
    cmd = c.create_session("echo-command")
    assert c.invoke(cmd["id"], {"a": 1}) == {"echo": {"a": 1}, "turns": 1}
    assert c.invoke(cmd["id"], "b")["turns"] == 2
    for s in (nb, sh, cmd):
        c.delete_session(s["id"])


def test_streaming_invoke(shared_runtime):
    c = shared_runtime.client
    s = c.create_session("counter")
    chunks = list(c.invoke_stream(s["id"], "increment"))
    assert chunks == [{"count": 1}]
    c.delete_session(s["id"])


def _ndjson(r: httpx.Response) -> list[dict]:
    import json

    return [json.loads(line) for line in r.text.splitlines() if line]


def test_a_streamed_turn_retried_with_its_key_is_answered_never_run_twice(shared_runtime):
    """Fresh-user run: a streamed increment sent again with the same Idempotency-Key ran again (count
    11 -> 12 -> 13): streamed answers were never kept. Now a retry, streamed or not, is answered with
    the turn's NDJSON lines (``X-Substrate-Replayed: 1``), another body under that key is 422, and a
    plain turn's answer replayed to a streaming call comes back as the JSON it was."""
    rt = shared_runtime
    sid = rt.client.create_session("counter")["id"]
    url = f"{rt.url}/v1/sessions/{sid}/invoke"
    inc = {"input": "increment"}
    with httpx.Client(timeout=30) as h:
        first = h.post(url + "?stream=1", json=inc, headers={"Idempotency-Key": "s1"})
        assert first.status_code == 200 and _ndjson(first) == [{"chunk": {"count": 1}}, {"done": True}]
        for query in ("?stream=1", ""):
            again = h.post(url + query, json=inc, headers={"Idempotency-Key": "s1"})
            assert again.headers.get("x-substrate-replayed") == "1", again.text
            assert again.headers["content-type"].startswith("application/x-ndjson")
            assert _ndjson(again) == _ndjson(first)
        other = h.post(url + "?stream=1", json={"input": "get"}, headers={"Idempotency-Key": "s1"})
        assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused", other.text
        plain = h.post(url, json=inc, headers={"Idempotency-Key": "p1"})
        assert plain.json() == {"output": {"count": 2}}
        replay = h.post(url + "?stream=1", json=inc, headers={"Idempotency-Key": "p1"})
        assert replay.headers.get("x-substrate-replayed") == "1"
        assert replay.headers["content-type"].startswith("application/json") and replay.json() == plain.json()
    sdk = rt.client  # the SDK's streamed call takes the key, and a replay of either form
    assert list(sdk.invoke_stream(sid, "increment", idempotency_key="p1")) == [{"count": 2}]
    assert list(sdk.invoke_stream(sid, "increment", idempotency_key="s1")) == [{"count": 1}]
    assert rt.client.invoke(sid, "get") == {"count": 2}, "each turn ran once"
    rt.client.delete_session(sid)


def test_turns_without_a_key_do_not_push_a_keyed_turn_out_of_its_retry_window(shared_runtime):
    """Fresh-user run: a turn sent with ``Idempotency-Key: E1``, then 70 turns without any key, then E1
    again: the turn ran a second time. The router keys a keyless turn with a request ID of its own, and
    those answers took the 64 places of the session's kept answers. Now they make room first, across a
    suspend and wake too: E1 is replayed, and each turn ran once."""
    rt = shared_runtime
    sid = rt.client.create_session("counter")["id"]
    url = f"{rt.url}/v1/sessions/{sid}/invoke"
    inc = {"input": "increment"}
    with httpx.Client(timeout=30) as h:
        first = h.post(url, json=inc, headers={"Idempotency-Key": "E1"})
        assert first.json() == {"output": {"count": 1}}, first.text
        for i in range(70):
            r = h.post(url + ("?stream=1" if i % 10 == 0 else ""), json=inc)  # neither key nor request ID
            assert r.status_code == 200, r.text
        assert h.post(f"{rt.url}/v1/sessions/{sid}/suspend").status_code == 202
        again = h.post(url, json=inc, headers={"Idempotency-Key": "E1"})
        assert again.status_code == 200 and again.headers.get("x-substrate-replayed") == "1", again.text
        assert again.json() == first.json()
        assert h.post(url, json={"input": "get"}).json() == {"output": {"count": 71}}, "each turn ran once"
    rt.client.delete_session(sid)


def test_a_streamed_turn_stopped_by_a_delete_says_session_deleted(shared_runtime):
    """Fresh-user run: DELETE during a streamed turn ended the stream with ``agent_crashed`` ("it restarts
    from its last snapshot") for a session that was gone; a plain turn answers 410 ``session_deleted``."""
    import time as _time
    from pathlib import Path

    rt = shared_runtime
    sid = rt.client.create_session("shell")["id"]
    mark = f"started-{uuid.uuid4().hex[:8]}"
    with cf.ThreadPoolExecutor(1) as ex, httpx.Client(timeout=60) as h:
        turn = ex.submit(h.post, f"{rt.url}/v1/sessions/{sid}/invoke?stream=1",
                         json={"input": f"touch {mark}; sleep 10"})
        for _ in range(400):
            if any(Path(rt.var).rglob(mark)) or turn.done():
                break
            _time.sleep(0.025)
        assert not turn.done()
        assert h.delete(f"{rt.url}/v1/sessions/{sid}").status_code == 204
        r = turn.result()
    # the turn had said nothing yet: answered as the plain turn is (fresh-user round 12), not 200 + a line
    assert (r.status_code, r.json()["code"]) == (410, "session_deleted"), r.text


def test_list_filters_and_pagination(shared_runtime):
    c = shared_runtime.client
    label = uuid.uuid4().hex[:6]
    mine = [c.create_session("counter", id=f"pg-{label}-{i}")["id"] for i in range(5)]
    mine.append(c.create_session("notebook", id=f"pg-{label}-nb")["id"])
    pages, token = [], None
    while True:
        page = c.list_sessions(template="counter", limit=2, continue_=token)
        assert len(page["items"]) <= 2
        pages.extend(i["id"] for i in page["items"])
        token = page["metadata"]["continue"]
        if not token:
            break
    assert set(mine[:5]) <= set(pages) and mine[5] not in pages
    assert all(i["state"] == "RUNNING" for i in c.list_sessions(state="RUNNING", limit=1000)["items"])
    assert c.list_sessions(state="SUSPENDED", template="notebook")["items"] == []
    for sid in mine:
        c.delete_session(sid)


def test_open_mode_stats_come_from_the_counters_not_a_walk_of_every_session(runtime_factory):
    """``/v1/stats`` of open mode's one tenant, which holds every session, read its whole index per call
    (200 ms at 2,109 sessions: a fresh-user run; the trace replay polls it every second). The tenant's own
    counters answer while they add up to its index; drifted, the runtime-wide counters answer while the
    tenant holds every session they count; else its index is walked. Shown by moving counts in the
    counters only: the answer follows whichever is trusted."""
    rt = runtime_factory(replicas=1, slots=4)
    c = rt.client
    sids = [c.create_session("counter")["id"] for _ in range(3)]
    assert c.http.get("/v1/stats").json()["sessions"]["RUNNING"] == 3
    mine = rt.keys.tenant_state_counts("default")
    rt.r.hincrby(mine, "RUNNING", -1)
    rt.r.hincrby(mine, "FAILED", 1)
    got = c.http.get("/v1/stats").json()["sessions"]
    assert (got["RUNNING"], got["FAILED"]) == (2, 1), "answered by the tenant's counters"
    rt.r.hincrby(mine, "SUSPENDED", 1)  # they no longer add up to the tenant's index: not trusted
    rt.r.hincrby(rt.keys.state_counts, "RUNNING", -1)
    rt.r.hincrby(rt.keys.state_counts, "STARTING", 1)
    got = c.http.get("/v1/stats").json()["sessions"]
    assert (got["RUNNING"], got["STARTING"], got["SUSPENDED"]) == (2, 1, 0), "the runtime-wide counters"
    rt.r.zadd(rt.keys.tenant_sessions("team-x"), {"s-other": 1.0})  # the index of another tenant ...
    rt.r.hincrby(rt.keys.state_counts, "SUSPENDED", 1)  # ... whose session the counters count
    got = c.http.get("/v1/stats").json()["sessions"]
    assert (got["RUNNING"], got["FAILED"], got["SUSPENDED"]) == (3, 0, 0), "default's own index walked"
    for sid in sids:
        c.delete_session(sid)


def test_pools_templates_stats_metrics_openapi(shared_runtime):
    c = shared_runtime.client
    pools = c.pools()
    assert pools[0]["metadata"]["name"] == "default"
    assert pools[0]["status"]["readyReplicas"] == 2 and pools[0]["status"]["slots"] == 16
    # fresh-user run: availableSlots stayed 0 while freeSlots counted the free slots
    assert pools[0]["status"]["availableSlots"] == pools[0]["status"]["freeSlots"] > 0
    # workers read the runtime's catalog, not the packaged examples (they warned about those before)
    assert "examples/pool.yaml" not in shared_runtime.logs()
    assert {t["metadata"]["name"] for t in c.templates()} >= {"counter", "notebook", "shell"}
    st = c.stats()
    assert st["workers"] == 2 and st["slots"] == 16
    m = c.http.get("/metrics").text
    assert "agent_substrate_warm_pool_ready" in m
    spec = c.http.get("/openapi.json").json()
    assert "/v1/sessions/{sid}/invoke" in spec["paths"] and "/v1/sessions" in spec["paths"]


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("method,path,body,status,code", [
    ("GET", "/v1/sessions/nope-does-not-exist", None, 404, "session_not_found"),
    ("POST", "/v1/sessions/nope-does-not-exist/invoke", {"input": "get"}, 404, "session_not_found"),
    ("DELETE", "/v1/sessions/nope-does-not-exist", None, 404, "session_not_found"),
    ("POST", "/v1/sessions/nope-does-not-exist/suspend", None, 404, "session_not_found"),
    ("GET", "/v1/sessions/Bad_ID", None, 422, "invalid_session_id"),
    ("POST", "/v1/sessions/-bad/invoke", {"input": "get"}, 422, "invalid_session_id"),
    ("POST", "/v1/sessions", {"actorTemplate": "counter", "id": "UPPER"}, 422, "invalid_session_id"),
    ("POST", "/v1/sessions", {"actorTemplate": "counter", "id": "x" * 129}, 422, "invalid_session_id"),
    ("POST", "/v1/sessions", {"actorTemplate": "no-such-template"}, 422, "unknown_template"),
    ("POST", "/v1/sessions", {"id": "abc"}, 422, "invalid_input"),
    ("POST", "/v1/sessions", {"actorTemplate": "counter", "bogus": 1}, 422, "invalid_input"),
    ("POST", "/v1/sessions", {"actorTemplate": "counter", "labels": {"": "x"}}, 422, "invalid_input"),
    ("POST", "/v1/sessions", {"actorTemplate": "counter", "labels": {"k": "v" * 300}}, 422, "invalid_input"),
    ("POST", "/v1/sessions", {"actorTemplate": "counter", "env": {"1BAD": "x"}}, 422, "invalid_env"),
    ("POST", "/v1/sessions", {"actorTemplate": 5}, 422, "invalid_input"),
    ("POST", "/v1/sessions", [], 422, "invalid_input"),
    ("GET", "/v1/sessions?limit=0", None, 422, "invalid_input"),
    ("GET", "/v1/sessions?state=NAPPING", None, 422, "invalid_input"),
    ("GET", "/v1/sessions?continue=abc", None, 422, "invalid_continue"),
    ("GET", "/v1/sessions?continue=99999999999999999999999999", None, 422, "invalid_continue"),
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("GET", "/v1/nothing-here?limit=5&limit=6", None, 404, "not_found"),  # was 422: a repeated parameter
    ("GET", "/v1/sessions/", None, 404, "not_found"),  # was 307 with an empty body
    ("DELETE", "/v1/sessions/", None, 404, "not_found"),
    ("POST", "/v1/sessions/", {"actorTemplate": "counter"}, 404, "not_found"),
])
def test_bad_input_gets_a_clear_error(shared_runtime, method, path, body, status, code):
    before = shared_runtime.r.zcard(shared_runtime.keys.sessions_index)
    r = shared_runtime.client.http.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code and r.json()["message"]
    if code == "invalid_session_id":  # every route says what an ID may be (invoke did not)
        assert r.json()["message"].endswith(SESSION_ID_HINT), r.json()
    if code == "not_found":  # names the path, and the way out of a trailing slash (it said "Not Found")
        assert r.json()["message"].startswith(f"no route for '{path.split('?')[0]}'"), r.json()
        if path.endswith("/"):
            assert r.json()["message"].endswith(f"without the trailing slash: '{path.rstrip('/')}'"), r.json()
    assert shared_runtime.r.zcard(shared_runtime.keys.sessions_index) == before, "nothing was written"


def test_null_labels_and_env_on_create_mean_none(shared_runtime):
    """As ``"id": null`` means "generate one", ``null`` labels and env mean none (they were 422)."""
    r = shared_runtime.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "id": None,
                                                              "labels": None, "env": None})
    assert r.status_code == 201, r.text
    assert r.json()["labels"] == {} and r.json()["env"] == []
    shared_runtime.client.delete_session(r.json()["id"])


def _one_format(raw: bytes) -> bytes:
    """``raw`` JSON written as every error body is: compact (no spaces after ``,`` and ``:``), ASCII."""
    return json.dumps(json.loads(raw), separators=(",", ":")).encode()


def test_every_error_body_has_one_json_format(shared_runtime):
    """Error bodies were written two ways: ``{"code":"x",...}`` by FastAPI's answers (validation, 404 of
    an unknown route, 405) and ``{"code": "x", ...}`` by the router's own (a session's 404, the front
    door's 422, bad JSON), the worker's (an agent's error) and a stream's error line. Now all compact."""
    c = shared_runtime.client
    sid = c.create_session("counter")["id"]
    J = {"content-type": "application/json"}
    calls = [
        ("GET", "/v1/sessions/nope-does-not-exist", None, 404, "session_not_found"),
        ("POST", "/v1/sessions/nope-does-not-exist/invoke", b'{"input": 1}', 404, "session_not_found"),
        ("GET", "/v1/sessions/Bad_ID", None, 422, "invalid_session_id"),
        ("POST", "/v1/sessions", b"{}", 422, "invalid_input"),
        ("POST", "/v1/sessions", b"{x", 400, "bad_json"),
        ("POST", f"/v1/sessions/{sid}/invoke", b"{x", 400, "bad_json"),
        ("PUT", "/v1/sessions", None, 405, "method_not_allowed"),
        ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("GET", "/v1/nothing-here?limit=5&limit=6", None, 404, "not_found"),  # was 422: a repeated parameter
        ("GET", "/v1/sessions?limit=1&limit=2", None, 422, "invalid_input"),
        ("POST", "/v1/sessions", b'{"actorTemplate": "counter"}', 415, "unsupported_media_type"),
        ("POST", f"/v1/sessions/{sid}/invoke", b'{"input": "explode"}', 422, "agent_error"),  # the worker's
        ("POST", f"/v1/sessions/{sid}/suspend", b'{"a": 1}', 422, "invalid_input"),
    ]
    for method, path, body, status, code in calls:
        headers = {} if code == "unsupported_media_type" else J
        r = c.http.request(method, path, content=body, headers=headers if body else {})
        assert (r.status_code, r.json()["code"]) == (status, code), (method, path, r.text)
        assert r.content == _one_format(r.content), (method, path, r.content)
    # streamed, a turn that fails before any output is answered as the plain one (fresh-user round 12: it
    # was 200 with an error line): nothing had reached the client, so its status can still say so
    plain = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "explode"})
    r = c.http.post(f"/v1/sessions/{sid}/invoke", params={"stream": "1"}, json={"input": "explode"})
    assert (r.status_code, r.headers["content-type"]) == (422, "application/json"), r.text
    assert r.json()["code"] == "agent_error" and r.json()["message"] == plain.json()["message"], (r.text, plain.text)
    assert r.content == _one_format(r.content), r.content
    c.delete_session(sid)


def test_head_and_options_answer_and_a_405_says_what_is_allowed(shared_runtime):
    """HEAD and OPTIONS were 405 on every route, and no 405 carried ``Allow``. HEAD on a GET route answers
    as GET without the body; OPTIONS is 204 with ``Allow`` listing every method of the path (GET and
    DELETE ``/v1/sessions/{id}`` are two routes); a 405 carries the same ``Allow`` (RFC 9110)."""
    c = shared_runtime.client
    sid = c.create_session("counter")["id"]
    for path in (f"/v1/sessions/{sid}", "/v1/sessions", f"/v1/sessions/{sid}/events", "/v1/workerpools", "/healthz"):
        g, h = c.http.get(path), c.http.head(path)
        assert (g.status_code, h.status_code) == (200, 200), (path, h.text)
        assert h.content == b"" and h.headers["content-type"] == g.headers["content-type"] == "application/json"
    assert c.http.head("/healthz").headers["content-length"] == c.http.get("/healthz").headers["content-length"]
    h = c.http.head("/v1/sessions/nope-does-not-exist")
    assert h.status_code == 404 and h.content == b"" and int(h.headers["content-length"]) > 0
    allow = {"/v1/sessions": "GET, HEAD, POST, OPTIONS",
             f"/v1/sessions/{sid}": "GET, HEAD, DELETE, OPTIONS",
             f"/v1/sessions/{sid}/invoke": "POST, OPTIONS",
             f"/v1/sessions/{sid}/suspend": "POST, OPTIONS",
             "/healthz": "GET, HEAD, OPTIONS"}
    for path, methods in allow.items():
        o = c.http.options(path)
        assert o.status_code == 204 and o.headers["allow"] == methods and o.content == b"", (path, o.text)
        r = c.http.put(path)
        assert r.status_code == 405 and r.json()["code"] == "method_not_allowed", (path, r.text)
        assert r.headers["allow"] == methods and methods in r.json()["message"], path
    r = c.http.get(f"/v1/sessions/{sid}/invoke")
    assert r.status_code == 405 and r.headers["allow"] == "POST, OPTIONS"
    r = c.http.options("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert c.invoke(sid, "get") == {"count": 0} and c.get_session(sid)["state"] == "RUNNING", "nothing ran"
    c.delete_session(sid)


def test_an_encoded_slash_is_part_of_the_session_id_not_a_separator(shared_runtime):
    """``%2F`` in a session's path segment was decoded before routing: ``POST /v1/sessions/abc%2Finvoke``
    ran a turn of ``abc``, ``%2Fsuspend`` suspended it. A session ID cannot hold '/': 422
    ``invalid_session_id`` (as any malformed ID), and nothing is done; elsewhere in a path 404."""
    c = shared_runtime.client
    sid = c.create_session("counter")["id"]
    for method, path, body in [("POST", f"/v1/sessions/{sid}%2Finvoke", {"input": "increment"}),
                               ("POST", f"/v1/sessions/{sid}%2finvoke?stream=1", {"input": "increment"}),
                               ("POST", f"/v1/sessions/{sid}%2Fsuspend", None),
                               ("POST", f"/v1/sessions/{sid}%2Fresume", None),
                               ("DELETE", f"/v1/sessions/{sid}%2F", None),
                               ("GET", f"/v1/sessions/{sid}%2Fevents", None),
                               ("GET", "/v1/sessions/a%2Fb", None)]:
        r = c.http.request(method, path, json=body)
        assert r.status_code == 422 and r.json()["code"] == "invalid_session_id", (method, path, r.text)
        assert "cannot hold '/'" in r.json()["message"]
    for path in ("/v1%2Fsessions", f"/v1/sessions/{sid}/events%2Fx"):
        r = c.http.get(path)
        assert r.status_code == 404 and r.json()["code"] == "not_found", (path, r.text)
    got = c.get_session(sid)
    assert got["state"] == "RUNNING" and got["epoch"] == 1 and c.invoke(sid, "get") == {"count": 0}, "nothing ran"
    c.delete_session(sid)


def test_of_two_concurrent_deletes_one_is_204_and_the_other_404(shared_runtime):
    """DELETE is not idempotent (a second one is 404): two at once both answered 204 (a fresh-user run).
    The deterministic race is tests/integration/test_delete_race.py; this is the API's side of it."""
    c = shared_runtime.client
    with cf.ThreadPoolExecutor(2) as ex:
        for _ in range(3):
            sid = c.create_session("counter")["id"]
            rs = list(ex.map(lambda _: c.http.delete(f"/v1/sessions/{sid}"), range(2)))
            assert sorted(r.status_code for r in rs) == [204, 404], [r.text for r in rs]
            assert next(r for r in rs if r.status_code == 404).json()["code"] == "session_not_found"
            assert c.http.delete(f"/v1/sessions/{sid}").status_code == 404


@pytest.mark.parametrize("state", ["NAPPING", "running"])
def test_an_unknown_list_state_names_the_states_a_listing_shows(shared_runtime, state):
    """FastAPI's enum error offered DELETED too, which a listing never shows (that one has its own message)."""
    r = shared_runtime.client.http.get("/v1/sessions", params={"state": state})
    assert r.status_code == 422 and r.json()["code"] == "invalid_input", r.text
    msg = r.json()["message"]
    assert "PENDING, STARTING, RUNNING, SUSPENDING, SUSPENDED, RESUMING, FAILED" in msg and "DELETED" not in msg
    r = shared_runtime.client.http.get("/v1/sessions", params={"state": "DELETED"})
    assert r.status_code == 422 and "a deleted session is gone" in r.json()["message"]


def test_malformed_json_on_create_is_400(shared_runtime):
    r = shared_runtime.client.http.post("/v1/sessions", content=b"{not json",
                                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "bad_json"


def test_bad_invoke_bodies(shared_runtime):
    c = shared_runtime.client
    s = c.create_session("counter")
    r = c.http.post(f"/v1/sessions/{s['id']}/invoke", content=b"not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "bad_json"
    r = c.http.post(f"/v1/sessions/{s['id']}/invoke", json={"no": "input"})
    assert r.status_code == 400 and r.json()["code"] == "missing_input"
    r = c.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "explode"})
    assert r.status_code == 422 and r.json()["code"] == "agent_error"
    assert c.invoke(s["id"], "get") == {"count": 0}, "failed turns change nothing"
    c.delete_session(s["id"])


def test_duplicate_id_is_409_and_keeps_the_first(shared_runtime):
    c = shared_runtime.client
    sid = _sid()
    c.create_session("counter", id=sid)
    c.invoke(sid, "increment")
    with pytest.raises(ApiError) as e:
        c.create_session("notebook", id=sid)
    assert e.value.status == 409 and e.value.code == "session_exists"
    got = c.get_session(sid)
    assert got["actorTemplate"] == "counter" and c.invoke(sid, "get") == {"count": 1}
    c.delete_session(sid)


def test_body_over_limit_is_413(runtime_factory):
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_API__MAX_BODY_BYTES": "1000"})
    s = rt.client.create_session("counter")
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/invoke", json={"input": "x" * 2000})
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    r = rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "labels": {"x": "y" * 2000}})
    assert r.status_code == 413
    big = b'{"actorTemplate": "counter", "labels": {"x": "' + b"y" * 2000 + b'"}}'
    r = rt.client.http.post("/v1/sessions", content=iter([big]), headers={"content-type": "application/json"})
    assert r.status_code == 413, "a chunked body (no Content-Length) is limited too"
    assert rt.client.invoke(s["id"], "get") == {"count": 0}
    assert rt.r.zcard(rt.keys.sessions_index) == 1


def test_no_free_slot_is_503_with_retry_after_not_a_hang(runtime_factory):
    rt = runtime_factory(replicas=1, slots=1, env={"SUBSTRATE_API__SLOT_WAIT_S": "0.3"})
    c = rt.client
    busy = c.create_session("counter")
    with cf.ThreadPoolExecutor(1) as ex:
        # the only slot is mid-turn, so it is not an idle victim for lazy suspension
        fut = ex.submit(c.invoke, busy["id"], {"op": "increment", "work_s": 3})
        rt.wait_for(lambda: any(a["busy"] for a in rt.worker_activations(busy["worker"])), what="busy turn")
        r = c.http.post("/v1/sessions", json={"actorTemplate": "counter", "id": "overflow"})
        assert r.status_code == 503 and r.json()["code"] == "no_capacity"
        assert int(r.headers["retry-after"]) >= 1
        assert rt.r.exists(rt.keys.session("overflow")) == 0, "nothing half-written"
        assert fut.result()["count"] == 1


def test_lazy_suspension_under_pressure(runtime_factory):
    rt = runtime_factory(replicas=1, slots=1)
    c = rt.client
    a = c.create_session("counter")
    c.invoke(a["id"], "increment")
    import time
    time.sleep(1.2)  # a becomes an idle victim (min idle 1 s)
    b = c.create_session("counter")
    assert b["state"] == "RUNNING"
    assert c.get_session(a["id"])["state"] == "SUSPENDED"
    assert c.invoke(b["id"], "increment") == {"count": 1}


def test_concurrent_creates_and_invokes_never_share_a_slot(runtime_factory):
    rt = runtime_factory(replicas=4, slots=32)
    c = rt.client
    with cf.ThreadPoolExecutor(32) as ex:
        created = list(ex.map(lambda i: c.create_session("counter", id=f"cc-{i}"), range(100)))
        outs = list(ex.map(lambda s: [c.invoke(s["id"], "increment")["count"] for _ in range(3)], created))
    assert all(o == [1, 2, 3] for o in outs)
    placements = collections.Counter((s["worker"], s["slot"]) for s in created)
    assert max(placements.values()) == 1, "two sessions in one slot"
    seen: dict[str, str] = {}
    for wid in rt.workers():
        for slot, sid in rt.slots(wid).items():
            assert sid not in seen, f"{sid} holds slots on {seen[sid]} and {wid}"
            seen[sid] = wid
        for act in rt.worker_activations(wid):
            assert seen.get(act["session"]) == wid, "session active on a worker that does not hold its slot"
    assert len(seen) == 100


def test_worker_rejects_a_stale_epoch(shared_runtime):
    c = shared_runtime.client
    s = c.create_session("counter")
    addr = shared_runtime.workers()[s["worker"]]["address"]
    url = f"{addr}/v1/activations/{s['id']}/invoke"
    def h(epoch: int) -> dict[str, str]:
        return shared_runtime.worker_headers(addr, s["id"], epoch)
    r = httpx.post(url, json={"input": "increment"}, headers=h(s["epoch"] - 1))
    assert r.status_code == 409 and r.json()["code"] == "stale_epoch"
    r = httpx.post(url, json={"input": "increment"}, headers=h(s["epoch"] + 1))
    assert r.status_code == 409
    assert c.invoke(s["id"], "get") == {"count": 0}, "rejected calls did nothing"
    r = httpx.post(url, json={"input": "increment"}, headers={"X-Substrate-Epoch": str(s["epoch"])})
    assert r.status_code == 401 and r.json()["code"] == "missing_token", "workers answer the control plane only"
    r = httpx.get(f"{addr}/v1/activations", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{addr}/healthz").status_code == 200
    r = httpx.post(url, json={"input": "increment"}, headers=h(s["epoch"]))
    assert r.status_code == 200 and r.json() == {"output": {"count": 1}}
    c.delete_session(s["id"])


def test_worker_killed_mid_request_is_retried_elsewhere_and_frees_the_slot(runtime_factory):
    """A turn in flight on a worker killed by SIGKILL was never answered: the router retries it (same
    idempotency key) on the session restored elsewhere, and the answer says what was restored."""
    rt = runtime_factory(replicas=2, slots=4)
    c = rt.client
    s = c.create_session("counter")
    c.invoke(s["id"], "increment")
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(c.http.post, f"/v1/sessions/{s['id']}/invoke",
                        json={"input": {"op": "increment", "work_s": 5}})
        rt.wait_for(lambda: any(a["busy"] for a in rt.worker_activations(s["worker"])), what="busy turn")
        rt.kill_worker(s["worker"])
        r = fut.result()
    # no snapshot was taken: it restarted from scratch, ran the retried turn once, and says so
    assert r.status_code == 200 and r.json() == {"output": {"count": 1}}
    assert r.headers["x-substrate-restored"] == "worker_lost;snapshot=none"
    assert r.headers["x-substrate-worker"] != s["worker"]
    assert s["worker"] not in rt.workers()
    got = c.get_session(s["id"])
    assert got["state"] == "RUNNING" and got["restoredFrom"]["reason"] == "worker_lost"
    assert c.invoke(s["id"], "get") == {"count": 1}
    held = [sid for w in rt.workers() for sid in rt.slots(w).values()]
    assert held == [s["id"]], "one slot, on the live worker"
    rt.wait_for(lambda: len(rt.workers()) == 2, what="the pool replaced the dead worker")


def test_redis_down_is_503_and_nothing_half_written(runtime_factory):
    from substrate.embedded import EmbeddedRedis

    with EmbeddedRedis() as own:
        rt = runtime_factory(redis_url=own.url, replicas=1, slots=2,
                             env={"SUBSTRATE_REDIS__SOCKET_TIMEOUT_S": "0.5"})
        c = rt.client
        s = c.create_session("counter")
        c.invoke(s["id"], "increment")
        # long enough for both calls (3 s ran out before the GET on a fresh-clone check of a loaded machine:
        # 200, not 503); the UNPAUSE below, itself paused, returns when the pause ends
        rt.r.execute_command("CLIENT", "PAUSE", "6000", "ALL")
        try:
            r = c.http.post("/v1/sessions", json={"actorTemplate": "counter", "id": "during-outage"})
            assert r.status_code == 503 and r.json()["code"] == "directory_unavailable"
            assert "retry-after" in r.headers
            r = c.http.get(f"/v1/sessions/{s['id']}")
            assert r.status_code == 503 and r.json()["code"] == "directory_unavailable"
        finally:
            rt.r.execute_command("CLIENT", "UNPAUSE")
        assert rt.r.exists(rt.keys.session("during-outage")) == 0
        assert c.invoke(s["id"], "get") == {"count": 1}
        rt.stop()


def test_a_pool_that_cannot_grow_refuses_at_once_without_retry_after(runtime_factory):
    """Fresh-user round 9: a pool with replicas 0 and no autoscaling answered every create 503 "retry
    later" with Retry-After: 1 after the slot wait, for ever. Nothing will start a worker for it: said at
    once, with no Retry-After, and warned of at start."""
    pool = """
apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec: {slots: 2, replicas: 0}
"""
    rt = runtime_factory(replicas=0, pool_yaml=pool)
    r = rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "id": "never-placed"})
    assert r.status_code == 503 and r.json()["code"] == "no_capacity", r.text
    assert "retry-after" not in r.headers and r.json()["details"] == {"pool": "default", "reason": "no_replicas"}
    assert "spec.replicas is 0 and it has no spec.autoscaling" in r.json()["message"]
    assert rt.client.http.get("/v1/sessions/never-placed").status_code == 404  # nothing was left behind
    assert "has spec.replicas 0 and no spec.autoscaling" in rt.logs()


def test_pool_scales_from_zero_on_demand_and_back(runtime_factory):
    pool = """
apiVersion: substrate.agent.dev/v1
kind: WorkerPool
metadata: {name: default}
spec:
  slots: 2
  autoscaling: {minReplicas: 0, maxReplicas: 3, targetUtilization: 100}
  warmPool: {readyReplicas: 0}
"""
    rt = runtime_factory(replicas=0, pool_yaml=pool, env={"SUBSTRATE_POOL__SCALE_DOWN_DELAY_S": "1",
                                                           "SUBSTRATE_WORKER__ACTIVE_WINDOW_S": "0.2"})
    c = rt.client
    assert rt.workers() == {} and c.http.get("/readyz").status_code == 200, "ready with no worker"
    s = c.create_session("counter")  # waits for a worker forked on demand
    assert s["state"] == "RUNNING" and len(rt.workers()) == 1
    assert c.invoke(s["id"], "increment") == {"count": 1}
    # no demand: the last worker is drained (its idle session suspended first) and removed
    rt.wait_for(lambda: rt.workers() == {}, timeout_s=30, what="scale to zero")
    assert c.get_session(s["id"])["state"] == "SUSPENDED"
    # the drain leaves exactly one audit record (issue 10), by the system, on that worker and epoch; the
    # worker's own SIGTERM drain that follows finds nothing left to suspend
    ev = [(e["action"], e["reason"], e["result"], e["who"], e["worker"], e["epoch"])
          for e in c.session_events(s["id"])["items"]]
    assert ev == [("create", "", "ok", "anonymous", s["worker"], s["epoch"]),
                  ("suspend", "drain", "ok", "system:control-plane", s["worker"], s["epoch"])], ev
    assert c.invoke(s["id"], "increment") == {"count": 2}, "woken on a new worker, state intact"


def test_a_delete_meeting_a_delete_under_way_answers_after_it_and_is_on_record(shared_runtime):
    """Fresh-user round 9 (4 of 4 runs): a DELETE arriving while another one was under way (the record
    already marked DELETED, not yet removed) answered 404 at once, before the winner's 204, and left no
    audit record, where one that read the record a moment earlier waits for the winner and records its
    ``session_not_found``. Here the winner is held mid-delete by marking the record DELETED by hand: the
    loser answers only after the record is gone, with its own record."""
    import threading

    rt = shared_runtime
    c = rt.client
    sid = c.create_session("counter")["id"]
    key = rt.keys.session(sid)
    rt.r.hset(key, mapping={"state": "DELETED", "epoch": 2})  # a delete under way (its CAS bumps the epoch)
    answered: list[tuple[int, str, bool]] = []
    removed = threading.Event()

    def delete() -> None:
        r = c.http.delete(f"/v1/sessions/{sid}")
        answered.append((r.status_code, r.json()["code"], removed.is_set()))

    t = threading.Thread(target=delete)
    t.start()
    t.join(0.5)
    assert not answered, "answered while the delete was under way"
    removed.set()  # the winner removes the record (and, in a real race, its slot and quota)
    rt.r.delete(key)
    t.join(10)
    assert answered == [(404, "session_not_found", True)]
    items = c.http.get(f"/v1/sessions/{sid}/events").json()["items"]
    assert (items[-1]["action"], items[-1]["result"], items[-1]["epoch"]) == ("delete", "session_not_found", 1), items
