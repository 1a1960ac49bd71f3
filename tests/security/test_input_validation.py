"""The platform's own surfaces (issue 7 item 6): whole-string patterns, lone surrogates, the bearer check and
the body limit before any body is read (chunked too), ASCII-only ``continue``, and invoke JSON the router
refuses with 400 ``bad_json``. Each case: a clear JSON error, and nothing changed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import RuntimeProc

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RuntimeProc]:
    r = RuntimeProc(tmp_path_factory.mktemp("inp"), redis_url, replicas=1, slots=4,
                    env={"SUBSTRATE_API__AUTH_TOKEN": TOKEN})
    r.client.http.headers["Authorization"] = f"Bearer {TOKEN}"
    yield r
    r.stop()


def sessions(rt: RuntimeProc) -> int:
    return rt.r.zcard(rt.keys.sessions_index)


class Counted:
    """A chunked request body that counts what the server pulled from it."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.total, self.chunk, self.sent = total, chunk, 0

    def __iter__(self) -> Iterator[bytes]:
        while self.sent < self.total:
            self.sent += self.chunk
            yield b" " * self.chunk


@pytest.mark.parametrize("sid", ["abc%0A", "a%0a", "abc%0A%0A"])
def test_session_id_with_a_trailing_newline_is_refused(rt, sid):
    before = sessions(rt)
    r = rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter",
                                                  "id": sid.replace("%0A", "\n").replace("%0a", "\n")})
    assert r.status_code == 422 and r.json()["code"] == "invalid_session_id"
    r = rt.client.http.get(f"/v1/sessions/{sid}")
    assert r.status_code == 422 and r.json()["code"] == "invalid_session_id"
    r = rt.client.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_session_id"
    assert sessions(rt) == before


@pytest.mark.parametrize("field", ["labels", "id", "actorTemplate"])
def test_lone_surrogate_is_refused_and_the_list_keeps_working(rt, field):
    before = sessions(rt)
    # JSON allows the escape "\ud800"; the body itself is plain ASCII
    raw = {"labels": '{"actorTemplate": "counter", "labels": {"team": "\\ud800"}}',
           "id": '{"actorTemplate": "counter", "id": "x\\ud800"}',
           "actorTemplate": '{"actorTemplate": "x\\ud800"}'}[field]
    r = rt.client.http.post("/v1/sessions", content=raw.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/json"), r.text
    assert sessions(rt) == before
    assert rt.client.http.get("/v1/sessions").status_code == 200


@pytest.mark.parametrize("token", ["²", "١٢", "1\n", " 1", "+1", "1_0"])
def test_continue_takes_ascii_digits_only(rt, token):
    r = rt.client.http.get("/v1/sessions", params={"continue": token})
    assert r.status_code == 422 and r.json()["code"] == "invalid_continue"


def test_bearer_check_runs_before_the_body_is_read(rt):
    body = Counted(8 * 1024 * 1024)
    with httpx.Client(base_url=rt.url, timeout=30) as anon:
        r = anon.post("/v1/sessions/whatever/invoke", content=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
        r2 = anon.post("/v1/sessions", json={"actorTemplate": "counter"})
        assert r2.status_code == 401
    assert body.sent < body.total, "the router did not read the unauthenticated body"


@pytest.mark.parametrize("path", ["/v1/sessions/whatever/invoke", "/v1/sessions"])
def test_chunked_body_over_the_limit_gets_413_before_it_is_buffered(rt, path):
    before = sessions(rt)
    body = Counted(300 * 1024 * 1024)  # 300 MiB, sent chunked (no Content-Length)
    try:
        r = rt.client.http.post(path, content=body)
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    except httpx.HTTPError:
        pass  # the server may close the connection once it has answered
    assert body.sent < 32 * 1024 * 1024, "the router stopped reading soon after the 1 MiB limit"
    assert sessions(rt) == before


@pytest.mark.parametrize("raw", [
    b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",   # too deep for any parser
    b'{"input": ' + b"[" * 200 + b"]" * 200 + b"}",            # deeper than the router's limit
    b'{"input": ' + b"9" * 5000 + b"}",                        # over Python's int digit limit
    b'{"input": 1e999}', b'{"input": NaN}', b'{"input": "x"',  # overflow, non-JSON constant, truncated
    b'\xff\xfe', b"[]", b'{"no_input": 1}',
])
def test_bad_invoke_json_gets_400_from_the_router(rt, raw):
    s = rt.client.create_session("counter")
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/invoke", content=raw,
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] in ("bad_json", "missing_input"), r.text
    assert "x-substrate-worker" not in r.headers, "the request never reached a worker"
    assert rt.client.invoke(s["id"], "increment") == {"count": 1}
    rt.client.delete_session(s["id"])


@pytest.mark.parametrize("raw, says", [
    (b'\xff\xfe{"actorTemplate": "counter"}', "not valid JSON"),                       # fresh-user: was 400 http_error
    (b'{"actorTemplate": "counter", "actorTemplate": "shell"}', "duplicate key"),  # was: a shell session
    (b'{"actorTemplate": "counter", "labels": {"a": "1", "a": "2"}}', "duplicate key"),
    (b'{"actorTemplate": "counter", "labels": {"n": ' + b"9" * 5000 + b"}}", "4300 digits"),
    (b"NaN", "NaN is not JSON"),                                                     # fresh-user: was 422
    (b'{"actorTemplate": "counter", "labels": {"a": Infinity}}', "Infinity is not JSON"),  # was 422
    (b'{"actorTemplate": "counter", "labels": {"a": 1e999}}', "out of range"),
    (b"", "the body is empty"),                                                      # was 422 "Field required"
    (b"  ", "not valid JSON"),
])
def test_bad_create_json_gets_400_bad_json_and_creates_nothing(rt, raw, says):
    before = sessions(rt)
    r = rt.client.http.post("/v1/sessions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "bad_json", r.text
    assert says in r.json()["message"] and "sys.set_int_max_str_digits" not in r.json()["message"]
    assert sessions(rt) == before


def test_an_empty_invoke_body_is_told_as_create_tells_it(rt):
    s = rt.client.create_session("counter")
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/invoke", content=b"",
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "bad_json", r.text
    assert r.json()["message"].startswith("the body is empty: send a JSON object"), r.text
    rt.client.delete_session(s["id"])


def test_a_number_of_over_4300_digits_in_an_invoke_is_told_plainly(rt):
    s = rt.client.create_session("counter")
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/invoke", content=b'{"input": ' + b"9" * 5000 + b"}",
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "more than 4300 digits" in r.json()["message"], r.text
    rt.client.delete_session(s["id"])


@pytest.mark.parametrize("raw", [
    b'{"input": "echo \\ud800"}', b'{"input": {"\\udfff": "k"}}', b'{"input": ["ok", "\\udc00x"]}',
])
def test_lone_surrogate_in_invoke_input_is_refused_before_any_worker(rt, raw):
    s = rt.client.create_session("shell")
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/invoke", content=raw,
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_input", r.text
    assert "x-substrate-worker" not in r.headers, "the request never reached a worker"
    # a valid surrogate pair is ordinary text
    ok = rt.client.http.post(f"/v1/sessions/{s['id']}/invoke", content=b'{"input": "echo \\ud83d\\ude00"}',
                             headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json()["output"]["stdout"] == "\U0001f600\n", ok.text
    rt.client.delete_session(s["id"])


def test_the_raw_bytes_of_a_surrogate_are_not_utf8_so_not_json(rt):
    """Fresh-user run 35: ``ED A0 80`` (a surrogate's code point written as UTF-8) answered 422
    ``invalid_input``; it is no UTF-8 (RFC 3629), and a body that is not UTF-8 is 400 ``bad_json``."""
    s = rt.client.create_session("shell")
    for path in (f"/v1/sessions/{s['id']}/invoke", "/v1/sessions"):
        r = rt.client.http.post(path, content=b'{"input": "\xed\xa0\x80"}' if "invoke" in path
                                else b'{"actorTemplate": "\xed\xa0\x80"}', headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "bad_json", r.text
    rt.client.delete_session(s["id"])


def test_lone_surrogate_in_a_resume_body_is_422(rt):
    s = rt.client.create_session("counter")
    rt.client.suspend(s["id"])
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/resume", content=b'{"worker": "w\\ud800"}',
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_input", r.text
    rt.client.delete_session(s["id"])


def test_errors_echo_at_most_a_clipped_copy_of_the_input(rt):
    huge = "a" * 20_000
    answers = [
        rt.client.http.get(f"/v1/sessions/{huge.upper()}"),
        rt.client.http.post(f"/v1/sessions/{huge.upper()}/invoke", json={"input": 1}),
        rt.client.http.delete(f"/v1/sessions/{huge.upper()}"),
        rt.client.http.post("/v1/sessions", json={"actorTemplate": huge}),
        rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "id": huge}),
        rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "labels": {huge: "x"}}),
        rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "env": {huge: "x"}}),
        rt.client.http.post("/v1/sessions", json={"actorTemplate": "counter", "env": {"A" * 300: "x"}}),
    ]
    for r in answers:
        assert r.status_code in (404, 422), r.text[:300]
        assert len(r.content) < 2000, f"{r.json()['code']}: {len(r.content)} bytes echoed"
        assert "..." in r.text or "A" * 300 not in r.text


@pytest.mark.parametrize("raw, ctype, status, code", [
    (b"garbage", "application/json", 400, "bad_json"),      # fresh-user: suspended anyway
    (b'{"force": true}', "application/json", 422, "invalid_input"),  # options that are not read
    (b"[1]", "application/json", 422, "invalid_input"),
    (b'{"a": 1}', "text/plain", 415, "unsupported_media_type"),
])
def test_a_suspend_with_a_body_it_does_not_read_is_refused_and_suspends_nothing(rt, raw, ctype, status, code):
    s = rt.client.create_session("counter")
    r = rt.client.http.post(f"/v1/sessions/{s['id']}/suspend", content=raw, headers={"Content-Type": ctype})
    assert r.status_code == status and r.json()["code"] == code, r.text
    assert rt.client.get_session(s["id"])["state"] == "RUNNING", "nothing was suspended"
    # no body, an empty object or null (what clients send by default) suspend as before
    for ok in (None, b"{}", b"null", b"  "):
        if rt.client.get_session(s["id"])["state"] != "RUNNING":
            rt.client.resume(s["id"])
        r = rt.client.http.post(f"/v1/sessions/{s['id']}/suspend", content=ok,
                                headers={"Content-Type": "application/json"} if ok else {})
        assert r.status_code == 202 and r.json()["state"] == "SUSPENDED", (ok, r.text)
    rt.client.delete_session(s["id"])


@pytest.mark.parametrize("raw, status, code", [
    (b'{"force": true}', 422, "invalid_input"),  # fresh-user run: accepted, and the session deleted
    (b"garbage", 400, "bad_json"),
])
def test_a_delete_with_a_body_it_does_not_read_is_refused_and_deletes_nothing(rt, raw, status, code):
    s = rt.client.create_session("counter")
    r = rt.client.http.request("DELETE", f"/v1/sessions/{s['id']}", content=raw,
                               headers={"Content-Type": "application/json"})
    assert r.status_code == status and r.json()["code"] == code, r.text
    assert rt.client.get_session(s["id"])["state"] == "RUNNING", "nothing was deleted"
    r = rt.client.http.request("DELETE", f"/v1/sessions/{s['id']}", content=b"{}",
                               headers={"Content-Type": "application/json"})
    assert r.status_code == 204, r.text


@pytest.mark.parametrize("headers", [
    {"Sec-Fetch-Site": "cross-site"},                    # fresh-user: a page's body-less POST suspended it
    {"Sec-Fetch-Site": "same-site"},                     # another port of localhost is the same site
    {"Origin": "http://evil.example"},                   # an older browser: no Fetch Metadata, but Origin
    {"Origin": "null"},                                  # a sandboxed frame or a file:// page
])
def test_a_state_changing_call_from_another_site_is_refused_and_changes_nothing(rt, headers):
    s = rt.client.create_session("counter")
    for path in (f"/v1/sessions/{s['id']}/suspend", f"/v1/sessions/{s['id']}/resume"):
        r = rt.client.http.post(path, headers=headers)
        assert r.status_code == 403 and r.json()["code"] == "cross_origin_request", r.text
    r = rt.client.http.delete(f"/v1/sessions/{s['id']}", headers=headers)
    assert r.status_code == 403 and r.json()["code"] == "cross_origin_request"
    assert rt.client.get_session(s["id"])["state"] == "RUNNING", "nothing was suspended or deleted"
    # reads are not refused (a page cannot read the answer without CORS), and the API's own origin,
    # a user's own navigation and clients without either header are served
    assert rt.client.http.get(f"/v1/sessions/{s['id']}", headers=headers).status_code == 200
    own = rt.client.http.base_url
    for ok in ({"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"},
               {"Origin": f"{own.scheme}://{own.host}:{own.port}"}):
        r = rt.client.http.post(f"/v1/sessions/{s['id']}/suspend", headers=ok)
        assert r.status_code == 202, (ok, r.text)
        rt.client.resume(s["id"])
    rt.client.delete_session(s["id"])
