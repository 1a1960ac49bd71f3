"""Findings of a fresh-user review of the public API, end to end (a real runtime with API keys for two
tenants and an admin, real workers, real HTTP and raw sockets):

* L5: a JSON body sent without ``Content-Type: application/json`` (``curl -d`` labels it
  ``application/x-www-form-urlencoded``) got a 422 naming "missing" fields; now 415
  ``unsupported_media_type`` naming the header, on every JSON-body route; no ``Content-Type`` = JSON;
* L6: ``/v1/stats`` showed a tenant the fleet's capacity; now only its own figures (admins: all);
* L10: a body that never finishes held a connection and a handler for ever; now 408 ``request_timeout``
  after ``api.body_read_timeout_s`` and the connection is closed;
* L12: the suspend answer showed ``turns`` from before the worker's last heartbeat (and the turns the
  heartbeat had not reported were lost with the activation); now the suspend's commit counts them.
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import RuntimeProc
from tests.e2e.test_tenancy import KEY_A, KEY_ADMIN, KEY_B, _client, _keys_env

#: the test runtime's heartbeat period (s): long enough that three quick turns are surely not reported
#: yet when the suspend comes (L12), with a lease well above it on a loaded machine
HEARTBEAT_S = 2.0
BODY_READ_TIMEOUT_S = 1.0
HEADER_READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RuntimeProc]:
    r = RuntimeProc(tmp_path_factory.mktemp("api-review"), redis_url, replicas=1, slots=6,
                    env={"SUBSTRATE_AUTH__API_KEYS": _keys_env(),
                         "SUBSTRATE_API__BODY_READ_TIMEOUT_S": str(BODY_READ_TIMEOUT_S),
                         "SUBSTRATE_API__HEADER_READ_TIMEOUT_S": str(HEADER_READ_TIMEOUT_S),
                         "SUBSTRATE_WORKER__HEARTBEAT_S": str(HEARTBEAT_S), "SUBSTRATE_WORKER__LEASE_S": "8"})
    yield r
    r.stop()


def _http(rt: RuntimeProc, key: str) -> httpx.Client:
    return httpx.Client(base_url=rt.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _create(c: httpx.Client, template: str = "counter") -> dict[str, Any]:
    r = c.post("/v1/sessions", json={"actorTemplate": template})
    assert r.status_code == 201, r.text
    return r.json()


def _count(c: httpx.Client) -> int:
    return len(c.get("/v1/sessions", params={"limit": 1000}).json()["items"])


# ------------------------------------------------------------------------------------ L5 content type
FORM = "application/x-www-form-urlencoded"  # what `curl -d` sends without -H


@pytest.mark.parametrize("ctype", [FORM, "text/plain", "text/plain;charset=UTF-8", "multipart/form-data; b=x",
                                   "application/jsonx", None])
def test_create_without_a_json_content_type_is_415_and_creates_nothing(rt: RuntimeProc, ctype: str | None) -> None:
    with _http(rt, KEY_A) as a:
        before = _count(a)
        r = a.post("/v1/sessions", content=b'{"actorTemplate":"counter"}',
                   headers={"Content-Type": ctype} if ctype else {})
        if ctype is None:  # httpx sends raw content without one: the case under test
            assert "content-type" not in r.request.headers
        assert r.status_code == 415, r.text
        err = r.json()
        assert err["code"] == "unsupported_media_type"
        assert "'Content-Type: application/json'" in err["message"]
        assert (ctype or "no Content-Type").split(";")[0] in err["message"]
        assert _count(a) == before


@pytest.mark.parametrize("ctype", ["application/json", "Application/JSON; charset=utf-8",
                                   "application/vnd.substrate+json"])
def test_create_with_a_json_content_type_works(rt: RuntimeProc, ctype: str) -> None:
    with _http(rt, KEY_A) as a:
        r = a.post("/v1/sessions", content=b'{"actorTemplate":"counter"}', headers={"Content-Type": ctype})
        assert r.status_code == 201, r.text
        a.delete(f"/v1/sessions/{r.json()['id']}")


@pytest.mark.parametrize("ctype", [FORM, None])
def test_invoke_and_resume_without_a_json_content_type_are_415_and_change_nothing(rt: RuntimeProc,
                                                                                  ctype: str | None) -> None:
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        for path, body in [(f"/v1/sessions/{sid}/invoke", b'{"input":"increment"}'),
                           (f"/v1/sessions/{sid}/invoke?stream=true", b'{"input":"increment"}'),
                           (f"/v1/sessions/{sid}/resume", b"{}")]:
            r = a.post(path, content=body, headers={"Content-Type": ctype} if ctype else {})
            assert r.status_code == 415, (path, r.text)
            assert r.json()["code"] == "unsupported_media_type" and "application/json" in r.json()["message"]
        assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
        # no body (curl -X POST, or -d ''): nothing to refuse, whatever the header says
        r = a.post(f"/v1/sessions/{sid}/resume", content=b"", headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 200, r.text
        a.delete(f"/v1/sessions/{sid}")


def test_curl_d_without_a_header_is_told_what_to_send(rt: RuntimeProc) -> None:
    """The finding as a user met it: ``curl -d '{...}'`` with no ``-H``."""
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {KEY_A}",
                          "-d", '{"actorTemplate":"counter"}', rt.url + "/v1/sessions"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    body, _, status = out.rpartition("\n")
    assert status == "415" and json.loads(body)["code"] == "unsupported_media_type"
    assert "application/x-www-form-urlencoded" in json.loads(body)["message"]


def test_openapi_lists_the_new_codes(rt: RuntimeProc) -> None:
    spec = httpx.get(rt.url + "/openapi.json", timeout=30).json()
    create = spec["paths"]["/v1/sessions"]["post"]["responses"]
    assert "unsupported_media_type" in create["415"]["description"]
    assert "request_timeout" in create["408"]["description"]
    assert {"unsupported_media_type", "request_timeout"} <= set(spec["components"]["schemas"]["Error"]
                                                               ["properties"]["code"]["enum"])


# --------------------------------------------------------------------------------------- L6 stats
FLEET = {"workers", "slots", "slotsUsed", "workerSeconds", "slotSeconds", "processSeconds", "parked",
         "routeCacheEntries"}


def test_stats_show_a_tenant_only_its_own_figures_and_an_admin_the_fleet(rt: RuntimeProc) -> None:
    with _http(rt, KEY_A) as a, _http(rt, KEY_B) as b, _http(rt, KEY_ADMIN) as admin:
        mine = [_create(a)["id"]]
        theirs = [_create(b)["id"] for _ in range(2)]
        try:
            sa = a.get("/v1/stats").json()
            assert set(sa) == {"sessions", "tenant", "quota"}, sa  # nothing fleet-wide
            assert sa["tenant"] == "team-a" and sa["quota"]["tenant"] == "team-a"
            assert sa["sessions"]["RUNNING"] == 1 and sa["quota"]["running"] == 1  # not B's two
            sb = b.get("/v1/stats").json()
            assert not FLEET & set(sb) and sb["sessions"]["RUNNING"] == 2
            r = a.get("/v1/stats", params={"tenant": "team-b"})
            assert (r.status_code, r.json()["code"]) == (403, "forbidden")
            # the admin sees the fleet and every tenant's sessions, or one tenant's
            sx = admin.get("/v1/stats").json()
            assert FLEET <= set(sx) and sx["workers"] == 1 and sx["slots"] == 6 and sx["slotsUsed"] >= 3
            assert sx["tenant"] is None and sx["sessions"]["RUNNING"] >= 3
            sxb = admin.get("/v1/stats", params={"tenant": "team-b"}).json()
            assert FLEET <= set(sxb) and sxb["tenant"] == "team-b" and sxb["sessions"]["RUNNING"] == 2
        finally:
            for sid in mine:
                a.delete(f"/v1/sessions/{sid}")
            for sid in theirs:
                b.delete(f"/v1/sessions/{sid}")


def test_workerpools_show_live_capacity_to_admins_only(rt: RuntimeProc) -> None:
    """Same leak as the stats' (fresh-user review): the pools' live status is fleet-wide capacity."""
    with _http(rt, KEY_A) as a, _http(rt, KEY_ADMIN) as admin:
        pa = a.get("/v1/workerpools")
        assert pa.status_code == 200
        items = pa.json()["items"]
        assert items and all(set(p["status"]) == {"observedGeneration"} for p in items), items
        assert all(p["spec"]["slots"] == 6 for p in items)  # the spec (configuration) stays readable
        assert all("replicas" not in p["spec"] for p in items), "the autoscaler's live size is not shown"
        px = admin.get("/v1/workerpools").json()["items"]
        assert px[0]["status"]["readyReplicas"] == 1 and px[0]["status"]["slots"] == 6


# ------------------------------------------------------------------------------ L10 body read timeout
def _read_answer(s: socket.socket, *, expect_close: bool) -> tuple[int, dict[str, Any], bool]:
    """Read one whole HTTP/1.1 answer from ``s`` (its head and ``Content-Length`` bytes of body, however
    many segments they come in). With ``expect_close``, also read on to learn whether the server closed
    the connection after it. Returns the status, the JSON body, and whether the connection was closed."""
    data = b""
    closed = False
    while True:
        chunk = s.recv(65536)
        if not chunk:
            closed = True
            break
        data += chunk
        top, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":", 1)[1]) for line in top.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(rest) >= length:
                if expect_close:  # the answer is whole: the server must close now, not wait for more
                    closed = s.recv(1) == b""
                break
    top, _, rest = data.partition(b"\r\n\r\n")
    return int(top.split(b" ", 2)[1]), json.loads(rest), closed


def _raw(rt: RuntimeProc, head: str, partial: bytes) -> tuple[int, dict[str, Any], bool]:
    """Send ``head`` (request line and headers) and ``partial`` of the body, then nothing more. Returns
    the answer's status, its JSON body, and whether the server closed the connection after it."""
    with socket.create_connection(("127.0.0.1", rt.port), timeout=30) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + partial)
        return _read_answer(s, expect_close=True)


@pytest.mark.parametrize("route", ["create", "invoke"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_that_never_finishes_gets_408_and_the_connection_is_closed(rt: RuntimeProc, route: str,
                                                                           framing: str) -> None:
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        before = _count(a)
        path, body = ((f"/v1/sessions/{sid}/invoke", b'{"input":"increment"}') if route == "invoke"
                      else ("/v1/sessions", b'{"actorTemplate":"counter"}'))
        if framing == "chunked":
            frame, partial = "Transfer-Encoding: chunked", b"%x\r\n%s\r\n" % (8, body[:8])
        else:
            frame, partial = f"Content-Length: {len(body)}", body[:8]
        head = (f"POST {path} HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY_A}\n"
                f"Content-Type: application/json\n{frame}\n")
        status, err, closed = _raw(rt, head, partial)
        assert (status, err["code"]) == (408, "request_timeout"), err
        assert "did not arrive" in err["message"]
        assert closed, "the connection is closed after a 408"
        # nothing changed, and the API serves as before
        assert _count(a) == before
        assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
        a.delete(f"/v1/sessions/{sid}")


def test_a_stalled_body_of_an_unauthenticated_caller_is_401_at_once(rt: RuntimeProc) -> None:
    """The front door authenticates before it waits for a body (the invoke route too)."""
    head = "POST /v1/sessions/x/invoke HTTP/1.1\nHost: t\nContent-Type: application/json\nContent-Length: 50\n"
    status, err, _ = _raw(rt, head, b'{"in')
    assert (status, err["code"]) == (401, "unauthorized")


def test_a_body_sent_in_pieces_within_the_timeout_is_read(rt: RuntimeProc) -> None:
    with _http(rt, KEY_A) as a:
        before = _count(a)
        body = b'{"actorTemplate":"counter"}'
        with socket.create_connection(("127.0.0.1", rt.port), timeout=30) as s:
            s.sendall(f"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY_A}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:5])
            time.sleep(BODY_READ_TIMEOUT_S / 4)
            s.sendall(body[5:])
            # the head and the body may come in separate segments (the CI run that read only the head)
            status, created, _ = _read_answer(s, expect_close=False)
        assert status == 201, created
        assert _count(a) == before + 1
        sid = created["id"]
        a.delete(f"/v1/sessions/{sid}")


# ------------------------------------------------------------------------------------ L12 suspend turns
def test_suspend_answer_counts_the_turns_not_reported_yet(rt: RuntimeProc) -> None:
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        for _ in range(3):
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}).status_code == 200
        r = a.post(f"/v1/sessions/{sid}/suspend")
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "SUSPENDED" and r.json()["turns"] == 3
        time.sleep(HEARTBEAT_S * 1.5)  # a heartbeat in flight at the suspend must not count them again
        assert a.get(f"/v1/sessions/{sid}").json()["turns"] == 3
        # the count goes on from there after a wake
        assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}).json()["output"] == {"count": 4}
        assert a.post(f"/v1/sessions/{sid}/suspend").json()["turns"] == 4
        a.delete(f"/v1/sessions/{sid}")


# ----------------------------------------------------------------- second fresh-user review (fix-api2)
def _b64(raw: str) -> str:
    import base64

    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _refused(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()
    assert err["code"] == code and err["message"], err
    return err


@pytest.mark.parametrize("raw", ["99999999999999999999-0", "18446744073709551615-18446744073709551616"])
def test_an_out_of_range_events_token_is_422_not_a_redis_error(rt: RuntimeProc, raw: str) -> None:
    """A forged stream ID Redis refuses answered 503 ``directory_unavailable`` with Redis's text."""
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            for path in ("/v1/events", f"/v1/sessions/{sid}/events"):
                err = _refused(a.get(path, params={"continue": _b64(raw)}), 422, "invalid_continue")
                assert "stream" not in err["message"].lower(), err  # nothing of Redis's own words
        finally:
            a.delete(f"/v1/sessions/{sid}")


def test_the_largest_events_token_is_an_empty_last_page(rt: RuntimeProc) -> None:
    """The largest valid stream ID: nothing after it (Redis refuses it as an exclusive start)."""
    with _http(rt, KEY_A) as a:
        r = a.get("/v1/events", params={"continue": _b64(f"{2**64 - 1}-{2**64 - 1}")})
        assert r.status_code == 200, r.text
        assert r.json() == {"items": [], "metadata": {"continue": None}}


@pytest.mark.parametrize("raw", ["1|a|b", " 1|a", "1_000|a", "1|BAD ID", "1.0|BAD ID", "1.0|a|b", "nan|a"])
def test_a_forged_session_list_token_is_422(rt: RuntimeProc, raw: str) -> None:
    with _http(rt, KEY_A) as a:
        _refused(a.get("/v1/sessions", params={"continue": _b64(raw)}), 422, "invalid_continue")


def test_session_list_tokens_the_api_made_still_page(rt: RuntimeProc) -> None:
    with _http(rt, KEY_A) as a:
        ids = [_create(a)["id"] for _ in range(3)]
        try:
            seen, token = [], None
            while True:
                page = a.get("/v1/sessions", params={"limit": 1, **({"continue": token} if token else {})})
                assert page.status_code == 200, page.text
                seen += [s["id"] for s in page.json()["items"]]
                token = page.json()["metadata"]["continue"]
                if token is None:
                    break
            assert set(ids) <= set(seen) and len(seen) == len(set(seen))
        finally:
            for sid in ids:
                a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("value", ["maybe", "yes", "", "TRUE2", "2"])
def test_an_unknown_stream_value_is_422_and_runs_no_turn(rt: RuntimeProc, value: str) -> None:
    """``?stream=maybe`` answered plain JSON, silently, after running the turn."""
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            r = a.post(f"/v1/sessions/{sid}/invoke", params={"stream": value}, json={"input": "increment"})
            err = _refused(r, 422, "invalid_input")
            assert "stream" in err["message"] and err["details"]["errors"][0]["loc"] == ["query", "stream"]
            got = a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()
            assert got["output"] == {"count": 0}, "the refused call ran no turn"
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("value,streams", [("1", True), ("true", True), ("0", False), ("false", False),
                                           (None, False)])
def test_the_stream_values_that_are_accepted(rt: RuntimeProc, value: str | None, streams: bool) -> None:
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            r = a.post(f"/v1/sessions/{sid}/invoke", params={"stream": value} if value is not None else {},
                       json={"input": "increment"})
            assert r.status_code == 200, r.text
            if streams:
                assert r.headers["content-type"].startswith("application/x-ndjson")
                assert [json.loads(line) for line in r.text.splitlines()][0] == {"chunk": {"count": 1}}
            else:
                assert r.json()["output"] == {"count": 1}
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/events", "/v1/stats"])
@pytest.mark.parametrize("tenant", ["BAD X", "", "a" * 300, "team-a\n", "-team"])
def test_an_admin_tenant_filter_that_is_no_tenant_name_is_422(rt: RuntimeProc, path: str, tenant: str) -> None:
    """It answered 200 with nothing in it (and an empty ``tenant=`` meant no filter at all)."""
    with _http(rt, KEY_ADMIN) as admin:
        err = _refused(admin.get(path, params={"tenant": tenant}), 422, "invalid_tenant")
        assert "tenant" in err["message"]
        assert admin.get(path, params={"tenant": "team-a"}).status_code == 200


def test_a_reused_request_id_is_named_as_the_key_that_was_reused(rt: RuntimeProc) -> None:
    """Without ``Idempotency-Key`` the request ID is the key: the message named an Idempotency-Key the
    client never sent."""
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            rid = {"X-Request-ID": f"rid-{sid}"}
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}, headers=rid).status_code == 200
            r = a.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}, headers=rid)
            err = _refused(r, 422, "idempotency_key_reused")
            assert f"X-Request-ID 'rid-{sid}'" in err["message"] and "no Idempotency-Key was sent" in err["message"]
            # with the header, the message names it as before
            key = {"Idempotency-Key": f"k-{sid}"}
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}, headers=key).status_code == 200
            r = a.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}, headers={**key, **rid})
            err = _refused(r, 422, "idempotency_key_reused")
            assert f"Idempotency-Key 'k-{sid}'" in err["message"] and "X-Request-ID" not in err["message"]
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
        finally:
            a.delete(f"/v1/sessions/{sid}")


#: statuses each route must document (the fresh-user run found these missing)
_DOCUMENTED = {("/v1/sessions", "post"): {400, 409, 422},
               ("/v1/sessions/{sid}/invoke", "post"): {400, 404, 409, 410, 422, 500, 502, 504},
               ("/v1/sessions/{sid}/suspend", "post"): {400, 404, 409, 415, 422, 502},
               ("/v1/sessions/{sid}/resume", "post"): {400, 404, 409, 422},
               ("/v1/sessions", "get"): {422}, ("/v1/events", "get"): {422}, ("/v1/stats", "get"): {422}}


def test_openapi_lists_every_status_of_each_route_with_the_error_schema(rt: RuntimeProc) -> None:
    spec = httpx.get(rt.url + "/openapi.json", timeout=30).json()
    for (path, method), statuses in _DOCUMENTED.items():
        responses = spec["paths"][path][method]["responses"]
        assert {str(s) for s in statuses} <= set(responses), (path, method, sorted(responses))
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")):  # every error answer is an Error, 422 too
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref == "#/components/schemas/Error", (path, method, status)
    assert "HTTPValidationError" not in json.dumps(spec)
    create = spec["paths"]["/v1/sessions"]["post"]["responses"]
    assert "bad_json" in create["400"]["description"] and "session_exists" in create["409"]["description"]
    assert "invalid_tenant" in spec["components"]["schemas"]["Error"]["properties"]["code"]["enum"]
    # fresh-user run: invoke's request and answer headers were in the README only
    invoke = spec["paths"]["/v1/sessions/{sid}/invoke"]["post"]
    headers = {p["name"]: p for p in invoke["parameters"] if p["in"] == "header"}
    assert set(headers) == {"Idempotency-Key", "X-Request-ID", "X-Substrate-Key-Origin"}
    assert "never run twice" in headers["Idempotency-Key"]["description"]
    assert "invalid_request_id" in headers["X-Request-ID"]["description"]
    assert {"X-Substrate-Worker", "X-Substrate-Epoch", "X-Substrate-Woke", "X-Substrate-Wake-Ms",
            "X-Substrate-Restored", "X-Substrate-Restored-Snapshot-At",
            "X-Substrate-Replayed", "Server-Timing"} <= set(invoke["responses"]["200"]["headers"])
    # fresh-user run: the 200 had headers but no body schema
    ok = invoke["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["required"] == ["output"]
    assert set(ok["application/x-ndjson"]["schema"]["properties"]) == {"chunk", "done", "error"}
    for path, ops in spec["paths"].items():  # the request ID: every /v1 route reads and checks it
        for method, op in ops.items():
            if path.startswith("/v1"):
                names = [p["name"] for p in op.get("parameters", []) if p["in"] == "header"]
                assert names.count("X-Request-ID") == 1, (path, method, names)


def test_suspend_and_resume_answers_have_the_session_view_of_get(rt: RuntimeProc) -> None:
    with _http(rt, KEY_A) as a:
        created = _create(a)
        sid = created["id"]
        try:
            suspended = a.post(f"/v1/sessions/{sid}/suspend")
            assert suspended.status_code == 202, suspended.text
            assert set(suspended.json()) == set(a.get(f"/v1/sessions/{sid}").json()) == set(created)
            assert suspended.json()["sandboxed"] is True
            resumed = a.post(f"/v1/sessions/{sid}/resume")
            assert resumed.status_code == 200, resumed.text
            assert set(resumed.json()) == set(created) and resumed.json()["sandboxed"] is True
        finally:
            a.delete(f"/v1/sessions/{sid}")


def test_an_admin_creates_a_session_for_a_tenant_and_nobody_else_may(rt: RuntimeProc) -> None:
    """``POST /v1/sessions?tenant=`` was ignored: an admin's session for team-a became the admin's own.
    Now it is team-a's (team-a sees and owns it, the admin's tenant does not); a tenant naming another is
    403, a bad name 422, and neither creates anything."""
    with _http(rt, KEY_A) as a, _http(rt, KEY_B) as b, _http(rt, KEY_ADMIN) as admin:
        before_a, before_b = _count(a), _count(b)
        r = admin.post("/v1/sessions", params={"tenant": "team-a"}, json={"actorTemplate": "counter"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            assert r.json()["tenant"] == "team-a"
            assert a.get(f"/v1/sessions/{sid}").status_code == 200
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}).json()["output"] == {"count": 1}
            assert _count(a) == before_a + 1
            assert sid not in {s["id"] for s in admin.get("/v1/sessions", params={"tenant": "ops"}).json()["items"]}
            assert a.get("/v1/stats").json()["quota"]["running"] >= 1
            err = _refused(b.post("/v1/sessions", params={"tenant": "team-a"}, json={"actorTemplate": "counter"}),
                           403, "forbidden")
            assert err["message"] == "only an admin may create another tenant's sessions", err
            _refused(admin.post("/v1/sessions", params={"tenant": "BAD X"}, json={"actorTemplate": "counter"}),
                     422, "invalid_tenant")
            # naming one's own tenant is the same as naming none
            own = b.post("/v1/sessions", params={"tenant": "team-b"}, json={"actorTemplate": "counter"})
            assert own.status_code == 201 and own.json()["tenant"] == "team-b"
            b.delete(f"/v1/sessions/{own.json()['id']}")
            # the SDK says the same
            sdk = _client(rt.url, KEY_ADMIN).create_session("counter", tenant="team-b")
            assert sdk["tenant"] == "team-b" and b.get(f"/v1/sessions/{sdk['id']}").status_code == 200
            b.delete(f"/v1/sessions/{sdk['id']}")
            assert (_count(a), _count(b)) == (before_a + 1, before_b)
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nAuthoriz"])
def test_a_head_that_never_finishes_gets_408_and_the_connection_is_closed(rt: RuntimeProc, sent: bytes) -> None:
    """uvicorn waited for ever for a request's headers (a connection that sent nothing, or half its
    headers, held a file descriptor of the router); ``substrate up`` now serves with a deadline on them."""
    with _http(rt, KEY_A) as a:
        before = _count(a)
        with socket.create_connection(("127.0.0.1", rt.port), timeout=30) as s:
            s.sendall(sent)
            status, err, closed = _read_answer(s, expect_close=True)
        assert (status, err["code"]) == (408, "request_timeout"), err
        assert "header_read_timeout_s" in err["message"] and closed
        assert _count(a) == before and a.get("/healthz").status_code == 200


def test_every_authenticated_answer_carries_its_request_id(rt: RuntimeProc) -> None:
    """Only invoke answered ``X-Request-ID``: a create, get, suspend or stats made by the router could not be
    matched to its audit record. The client's own ID comes back as sent, once."""
    with _http(rt, KEY_A) as a:
        r = a.post("/v1/sessions", json={"actorTemplate": "counter"})
        assert r.status_code == 201 and len(r.headers["X-Request-ID"]) == 32  # made by the router
        sid = r.json()["id"]
        try:
            for method, path in (("GET", f"/v1/sessions/{sid}"), ("POST", f"/v1/sessions/{sid}/suspend"),
                                 ("GET", "/v1/stats"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/nope"),
                                 ("POST", f"/v1/sessions/{sid}/invoke")):
                kw = {"json": {"input": "get"}} if path.endswith("invoke") else {}
                r = a.request(method, path, headers={"X-Request-ID": f"mine-{method}-{len(path)}"}, **kw)
                assert r.headers.get_list("X-Request-ID") == [f"mine-{method}-{len(path)}"], (path, r.headers)
            events = a.get("/v1/events", params={"limit": 1000}).json()["items"]
            assert any(e.get("requestId") == f"mine-POST-{len(f'/v1/sessions/{sid}/suspend')}" for e in events), events[-3:]
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("params, says", [
    ({"template": "x" * 5000}, "is no ActorTemplate name"),
    ({"template": "a\x00b"}, "is no ActorTemplate name"),
    ({"template": "Counter"}, "is no ActorTemplate name"),
    ({"state": "DELETED"}, "a deleted session is gone"),
    ({"state": "running"}, "is no state a listing shows"),
])
def test_list_filters_that_can_match_nothing_are_422(rt: RuntimeProc, params: dict[str, str], says: str) -> None:
    """They answered 200 with an empty list (fresh-user run); a template no longer configured still lists.
    The error names the parameter as every query error does (``query.NAME``, ``details.errors[].loc``)."""
    with _http(rt, KEY_A) as a:
        err = _refused(a.get("/v1/sessions", params=params), 422, "invalid_input")
        assert says in err["message"], err
        name = next(iter(params))
        assert err["message"].startswith(f"query.{name}: "), err
        assert err["details"]["errors"][0]["loc"] == ["query", name], err
        assert a.get("/v1/sessions", params={"template": "gone-from-config"}).json()["items"] == []


@pytest.mark.parametrize("route", ["create", "invoke"])
@pytest.mark.parametrize("headers, says", [
    ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, "Content-Encoding 'gzip' is not supported"),
    ({"Content-Type": "application/json; charset=latin-1"}, "charset 'latin-1' is not supported"),
])
def test_a_compressed_or_non_utf8_body_is_415_and_changes_nothing(rt: RuntimeProc, route: str,
                                                                  headers: dict[str, str], says: str) -> None:
    """A gzip body was 400 "not UTF-8 text", and a latin-1 label was read as UTF-8 (fresh-user run)."""
    import gzip

    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            before = _count(a)
            raw = b'{"input":"increment"}' if route == "invoke" else b'{"actorTemplate":"counter"}'
            body = gzip.compress(raw) if "Content-Encoding" in headers else raw
            path = f"/v1/sessions/{sid}/invoke" if route == "invoke" else "/v1/sessions"
            err = _refused(a.post(path, content=body, headers=headers), 415, "unsupported_media_type")
            assert says in err["message"], err
            assert _count(a) == before
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
            ok = a.post(path, content=raw, headers={"Content-Type": "application/json; charset=UTF-8",
                                                     "Content-Encoding": "identity"})
            assert ok.status_code in (200, 201), ok.text
            if route == "create":
                a.delete(f"/v1/sessions/{ok.json()['id']}")
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("route", ["create", "invoke"])
def test_every_line_of_a_repeated_content_encoding_is_checked(rt: RuntimeProc, route: str) -> None:
    """``Content-Encoding: identity`` then ``Content-Encoding: gzip`` was checked by its first line only: the
    gzip body reached the JSON parser (400 "UTF-16 or UTF-32 text"), and a plain body passed (fresh-user
    run). Repeated lines are one list (RFC 9110 5.3): any coding but identity is 415."""
    import gzip

    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            before = _count(a)
            raw = b'{"input":"increment"}' if route == "invoke" else b'{"actorTemplate":"counter"}'
            path = f"/v1/sessions/{sid}/invoke" if route == "invoke" else "/v1/sessions"
            for body in (gzip.compress(raw), raw):
                r = a.post(path, content=body, headers=[("Content-Type", "application/json"),
                                                        ("Content-Encoding", "identity"), ("Content-Encoding", "gzip")])
                err = _refused(r, 415, "unsupported_media_type")
                assert "identity, gzip" in err["message"], err
            assert _count(a) == before
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
            if route == "invoke":  # the key-origin header, given twice, is refused whichever comes first
                for pair in (("auto", "bogus"), ("bogus", "auto")):
                    r = a.post(path, content=raw, headers=[("Content-Type", "application/json"),
                                                           *(("X-Substrate-Key-Origin", v) for v in pair)])
                    _refused(r, 422, "invalid_idempotency_key")
                assert a.post(path, json={"input": "get"}).json()["output"] == {"count": 0}, "nothing ran"
                # "auto" on two lines is still auto; whitespace around a value is not part of it (sent raw:
                # httpx refuses to send it)
                r = a.post(path, content=raw, headers=[("Content-Type", "application/json"),
                                                       ("X-Substrate-Key-Origin", "auto"), ("X-Substrate-Key-Origin", "auto")])
                assert r.status_code == 200, r.text
                out = _exchange(rt, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY_A}\r\n"
                                    f"Connection: close\r\nContent-Type: application/json\r\nX-Substrate-Key-Origin:  auto \t\r\n"
                                    f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
                assert out.startswith(b"HTTP/1.1 200 "), out[:300]
        finally:
            a.delete(f"/v1/sessions/{sid}")


def _exchange(rt: RuntimeProc, request: bytes) -> bytes:
    """Send ``request`` as is on a new connection; everything the server sends until it closes (or 10 s)."""
    import socket

    host, port = rt.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pytest.fail(f"no close within 10 s; got {out[:300]!r}")
    return out


@pytest.mark.parametrize("upgrade", [b"h2c", b"websocket"])
def test_an_upgrade_request_with_a_body_is_refused_at_once_and_one_without_is_plain_http(
        rt: RuntimeProc, upgrade: bytes) -> None:
    """The HTTP parser stops at the head of a request asking for a protocol upgrade, so its body never
    arrives: ``curl --http2`` (an h2c upgrade over http://) got 400 "the body is empty" for a good create,
    and a POST with WebSocket headers was held open with no answer, before any credentials were checked
    (fresh-user run). Such a request is refused at once: 400 ``bad_request`` naming the upgrade, with a
    request ID, connection closed, nothing created. Without a body the upgrade is ignored (RFC 9110 7.8):
    the request is served as plain HTTP/1.1."""
    key = KEY_A.encode()
    body = b'{"actorTemplate":"counter"}'
    with _http(rt, KEY_A) as a:
        before = _count(a)
    for auth in (b"Authorization: Bearer " + key + b"\r\n", b""):  # refused before authentication too
        out = _exchange(rt, b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
                   b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: " + upgrade + b"\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
                   b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head, _, payload = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), out[:300]
        assert b"\r\nx-request-id: " in head.lower() and b"connection: close" in head.lower(), head
        assert b'"code":"bad_request"' in payload and b"no protocol upgrade (Upgrade: " + upgrade in payload, payload
    with _http(rt, KEY_A) as a:
        assert _count(a) == before, "nothing was created"
    # served as plain HTTP/1.1, and the connection closed after it: the parser reads nothing after an upgrade
    # request's head, so a request pipelined behind it was never answered nor run and its client hung
    # (fresh-user run); closing tells the client to send it again. On /v1 and elsewhere alike
    for path in (b"/v1/sessions?limit=1", b"/healthz"):
        out = _exchange(rt, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + key +
                        b"\r\nConnection: Upgrade\r\nUpgrade: " + upgrade + b"\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                        b"Sec-WebSocket-Version: 13\r\n\r\n"
                        b"DELETE /v1/sessions/never-pipelined HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200 ") and out.count(b"HTTP/1.1 ") == 1, out[:400]
        assert b"connection: close" in out.partition(b"\r\n\r\n")[0].lower(), out[:400]


def test_a_content_length_with_whitespace_around_it_is_read(rt: RuntimeProc) -> None:
    """``Content-Length:  27 `` (optional whitespace around a field value, RFC 9110 5.5) was 400 "malformed
    Content-Length" (fresh-user run)."""
    body = b'{"actorTemplate":"counter"}'
    out = _exchange(rt, b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY_A.encode() +
                    b"\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length:  " +
                    str(len(body)).encode() + b" \t\r\n\r\n" + body)
    assert out.startswith(b"HTTP/1.1 201 "), out[:300]
    sid = json.loads(out.partition(b"\r\n\r\n")[2])["id"]
    with _http(rt, KEY_A) as a:
        assert a.delete(f"/v1/sessions/{sid}").status_code in (200, 202, 204)


def test_the_v1_root_answers_with_a_request_id(rt: RuntimeProc) -> None:
    """``GET /v1`` (no trailing slash) was the one /v1 answer without ``X-Request-ID`` (fresh-user run)."""
    with _http(rt, KEY_A) as a:
        r = a.get("/v1", headers={"X-Request-ID": "root-1"})
    assert r.status_code == 404 and r.headers.get_list("X-Request-ID") == ["root-1"], (r.status_code, r.headers)
    assert r.json()["code"] == "not_found"


def test_answers_given_before_authentication_echo_a_valid_request_id(rt: RuntimeProc) -> None:
    """413, 400 bad_json on create and the front door's 401 dropped the client's X-Request-ID (fresh-user
    run 2): they are given before the call is authenticated, so it had no ID yet. An invalid ID is never
    echoed: the answer names a new one (the front door makes or checks the ID first, 2026-12-04; it is
    answered 422 once the caller is authenticated)."""
    with _http(rt, KEY_A) as a:
        rid = {"X-Request-ID": "early-1"}
        big = a.post("/v1/sessions", content=b"x" * (2 << 20), headers={**rid, "Content-Type": "application/json"})
        assert big.status_code == 413 and big.headers.get_list("X-Request-ID") == ["early-1"], big.headers
        bad = a.post("/v1/sessions", content=b'{"actorTemplate":"counter"', headers={**rid, "Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.headers.get_list("X-Request-ID") == ["early-1"], bad.text
        gz = a.post("/v1/sessions", content=b"\x1f\x8b", headers={**rid, "Content-Type": "application/json",
                                                                  "Content-Encoding": "gzip"})
        assert gz.status_code == 415 and gz.headers.get_list("X-Request-ID") == ["early-1"], gz.text
    anon = httpx.post(f"{rt.url}/v1/sessions", json={"actorTemplate": "counter"}, headers={"X-Request-ID": "anon-1"})
    assert anon.status_code == 401 and anon.headers.get_list("X-Request-ID") == ["anon-1"]
    junk = httpx.post(f"{rt.url}/v1/sessions", json={"actorTemplate": "counter"}, headers={"X-Request-ID": "a b"})
    assert junk.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", junk.headers["X-Request-ID"]), junk.headers


# ------------------------------------------------------------------------------ JSON bodies are UTF-8
def _utf16(doc: Any) -> bytes:
    return json.dumps(doc).encode("utf-16")  # with its BOM


def _utf8_bom(doc: Any) -> bytes:
    return b"\xef\xbb\xbf" + json.dumps(doc).encode()


def _utf16le(doc: Any) -> bytes:
    return json.dumps(doc).encode("utf-16-le")  # no BOM: json.loads of bytes guessed it from the NULs


@pytest.mark.parametrize("encode", [_utf16, _utf8_bom, _utf16le])
def test_a_json_body_that_is_not_utf8_is_400_bad_json_on_every_route_and_changes_nothing(
        rt: RuntimeProc, encode: Any) -> None:
    """Fresh-user run: invoke (and create, resume, suspend: Python's ``json.loads`` of bytes guesses the
    encoding) took a UTF-16 body with its BOM and a UTF-8 body with a BOM. JSON bodies are UTF-8 without
    a BOM (RFC 8259 8.1): every route now refuses them alike, 400 ``bad_json`` saying so, and runs
    nothing: no session made, no turn run, no suspend, no resume."""
    json_h = {"Content-Type": "application/json"}
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            before = _count(a)
            r = a.post("/v1/sessions", content=encode({"actorTemplate": "counter"}), headers=json_h)
            assert "UTF-8" in _refused(r, 400, "bad_json")["message"]
            assert _count(a) == before, "no session was made"
            for path in (f"/v1/sessions/{sid}/invoke", f"/v1/sessions/{sid}/invoke?stream=true"):
                r = a.post(path, content=encode({"input": "increment"}), headers=json_h)
                assert "UTF-8" in _refused(r, 400, "bad_json")["message"]
            r = a.post(f"/v1/sessions/{sid}/suspend", content=encode({}), headers=json_h)
            assert "UTF-8" in _refused(r, 400, "bad_json")["message"]
            assert a.get(f"/v1/sessions/{sid}").json()["state"] == "RUNNING", "nothing suspended"
            assert a.post(f"/v1/sessions/{sid}/suspend").status_code == 202
            turns = a.get(f"/v1/sessions/{sid}").json()["turns"]
            r = a.post(f"/v1/sessions/{sid}/resume", content=encode({}), headers=json_h)
            assert "UTF-8" in _refused(r, 400, "bad_json")["message"]
            r = a.post(f"/v1/sessions/{sid}/invoke", content=encode({"input": "increment"}), headers=json_h)
            _refused(r, 400, "bad_json")
            got = a.get(f"/v1/sessions/{sid}").json()
            assert (got["state"], got["turns"]) == ("SUSPENDED", turns), "nothing woke it, no turn ran"
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
        finally:
            a.delete(f"/v1/sessions/{sid}")


def test_invoke_refuses_unknown_top_level_fields_as_create_does_and_runs_nothing(rt: RuntimeProc) -> None:
    """Fresh-user run: invoke dropped unknown top-level fields silently (``{"input": .., "strem": true}``
    ran the turn), while create answers 422 ``invalid_input`` for an unknown field. Invoke now does too."""
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            err = _refused(a.post("/v1/sessions", json={"actorTemplate": "counter", "lables": {}}), 422,
                           "invalid_input")
            assert err["details"]["errors"][0]["loc"] == ["body", "lables"]
            for path in (f"/v1/sessions/{sid}/invoke", f"/v1/sessions/{sid}/invoke?stream=1"):
                err = _refused(a.post(path, json={"input": "increment", "strem": True}), 422, "invalid_input")
                assert err["details"]["errors"] == [{"loc": ["body", "strem"], "msg": "Extra inputs are not permitted"}]
            got = a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()
            assert got["output"] == {"count": 0}, "the refused calls ran no turn"
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("path, query, name", [
    ("/v1/sessions", "limit=5&limit=7", "limit"), ("/v1/events", "limit=1&limit=1", "limit"),
    ("/v1/sessions", "state=RUNNING&state=FAILED", "state")])
def test_a_query_parameter_given_twice_is_422_naming_it(rt: RuntimeProc, path: str, query: str, name: str) -> None:
    """``?limit=5&limit=7`` silently took one of them; which one the client meant is unknown."""
    with _http(rt, KEY_A) as a:
        err = _refused(a.get(f"{path}?{query}"), 422, "invalid_input")
        assert f"query.{name}" in err["message"] and err["details"]["errors"][0]["loc"] == ["query", name]
        assert a.get(f"{path}?limit=5").status_code == 200


def test_a_repeated_query_parameter_on_invoke_runs_no_turn(rt: RuntimeProc) -> None:
    with _http(rt, KEY_A) as a:
        sid = _create(a)["id"]
        try:
            _refused(a.post(f"/v1/sessions/{sid}/invoke?stream=0&stream=0", json={"input": "increment"}), 422,
                     "invalid_input")
            assert a.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"}).json()["output"] == {"count": 0}
        finally:
            a.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate, chunked", "x-custom, chunked",
                                    "gzip\nTransfer-Encoding: chunked"])  # two lines: one list (run 36)
def test_a_transfer_coding_other_than_chunked_is_501_and_changes_nothing(rt: RuntimeProc, coding: str) -> None:
    """Fresh-user run 35: ``Transfer-Encoding: gzip, chunked`` was answered 201, its body taken as if
    plain (the parser decodes only ``chunked``). RFC 9112 6.1: a coding the server does not understand
    is 501; the connection is closed (the body's framing is not the server's to read)."""
    with _http(rt, KEY_A) as a:
        before = _count(a)
        body = b'{"actorTemplate":"counter"}'
        head = (f"POST /v1/sessions HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY_A}\n"
                f"Content-Type: application/json\nTransfer-Encoding: {coding}\n")
        status, err, closed = _raw(rt, head, b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        assert (status, err["code"]) == (501, "unsupported_transfer_encoding"), err
        assert coding.split("\n")[0] in err["message"] and closed
        assert _count(a) == before


@pytest.mark.parametrize("version", ["2.0"])
def test_a_request_line_of_another_major_http_version_is_505_and_changes_nothing(rt: RuntimeProc,
                                                                                  version: str) -> None:
    """Fresh-user run 36: a request line ending ``HTTP/2.0`` (plain text, not HTTP/2's binary preface) was
    served as HTTP/1.1. RFC 9110 15.6.6: 505 for a major version the server does not speak. (The parser
    itself refuses ``HTTP/3.0`` and above as malformed: 400 ``bad_request``; the front door's own check
    is unit-tested for those too.)"""
    with _http(rt, KEY_A) as a:
        before = _count(a)
        body = b'{"actorTemplate":"counter"}'
        head = (f"POST /v1/sessions HTTP/{version}\r\nHost: t\r\nAuthorization: Bearer {KEY_A}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        with socket.create_connection(("127.0.0.1", rt.port), timeout=30) as s:
            s.sendall(head.encode() + body)
            status, err, _ = _read_answer(s, expect_close=False)
        assert (status, err["code"]) == (505, "http_version_not_supported"), err
        assert f"HTTP/{version}" in err["message"]
        assert _count(a) == before
        # the same request as HTTP/1.1 is served: only the version line was refused
        with socket.create_connection(("127.0.0.1", rt.port), timeout=30) as s:
            s.sendall(head.replace(f"HTTP/{version}", "HTTP/1.1").encode() + body)
            status, created, _ = _read_answer(s, expect_close=False)
        assert status == 201, created
        a.delete(f"/v1/sessions/{created['id']}")


def _requests_counted(rt: RuntimeProc, route: str, code: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{rt.url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "agent_substrate_requests"
               for s in fam.samples if s.name == "agent_substrate_requests_total"
               and s.labels.get("route") == route and s.labels.get("code") == code)


def test_a_transfer_coding_the_parser_refuses_is_answered_once_counted_once_and_logs_no_error(
        rt: RuntimeProc) -> None:
    """Fresh-user tester 37: ``Transfer-Encoding: gzip`` (not ending in chunked: no body length) got the
    documented 400 from the HTTP parser, but the front door's 501 for the same request then failed on the
    half-closed connection ("Cannot call write() after write_eof()", an ERROR traceback per request,
    from anyone, no credentials needed) and was counted too: 400 ``unparsed`` and 501 ``/v1/sessions``."""
    unparsed, front = _requests_counted(rt, "unparsed", "400"), _requests_counted(rt, "/v1/sessions", "501")
    logged = len(rt.logs())
    for _ in range(3):
        status, err, closed = _raw(rt, "POST /v1/sessions HTTP/1.1\nHost: t\nContent-Type: application/json\n"
                                   "Transfer-Encoding: gzip\n", b"")
        assert (status, err["code"], closed) == (400, "bad_request", True), err
    assert _requests_counted(rt, "unparsed", "400") == unparsed + 3
    assert _requests_counted(rt, "/v1/sessions", "501") == front, "the front door's answer was not counted too"
    time.sleep(0.5)  # what the dropped answer would have logged is logged by now
    since = rt.logs()[logged:]
    assert "write_eof" not in since and "Exception in ASGI application" not in since, since[-2000:]


def test_a_client_that_goes_away_mid_body_is_counted_499_not_as_a_server_error(rt: RuntimeProc) -> None:
    """Tester 37: a body cut short by the client's close was counted ``code="500"``, which a 5xx alert
    reads as the server's failure."""
    before = (_requests_counted(rt, "/v1/sessions", "499"), _requests_counted(rt, "/v1/sessions", "500"))
    with socket.create_connection(("127.0.0.1", rt.port), timeout=30) as s:
        s.sendall((f"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY_A}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 27\r\n\r\n{\"actorT").encode())
        time.sleep(0.3)
    for _ in range(100):  # counted once the front door saw the disconnect
        if _requests_counted(rt, "/v1/sessions", "499") > before[0]:
            break
        time.sleep(0.05)
    assert (_requests_counted(rt, "/v1/sessions", "499"), _requests_counted(rt, "/v1/sessions", "500")) == \
        (before[0] + 1, before[1])
