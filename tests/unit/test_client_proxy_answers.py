"""The SDK and answers a reverse proxy can send (a fresh-user tester): ``Retry-After`` as an HTTP-date
raised ``ValueError`` from ``float``, a JSON list as an error body ``AttributeError``, a proxy's page as
a success body ``JSONDecodeError``. Each is now ``ApiError`` with the status, code ``error`` (the code
the SDK gives any answer that is not the API's JSON) and a message saying what came. Also the
constructor's checks of its numbers and ``list_sessions``' state in any case."""

from __future__ import annotations

import email.utils
import math
import time

import httpx
import pytest

from substrate.client import ApiError, SubstrateClient, retry_after_s


def _client(handler, **kw) -> SubstrateClient:
    return SubstrateClient("http://proxy.example/prefix", transport=httpx.MockTransport(handler), **kw)


def test_the_testers_two_answers_are_api_errors() -> None:
    def h(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/invoke"):
            return httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"},
                                  text="<html>bad gateway</html>")
        return httpx.Response(502, json=["oops"])

    c = _client(h, retry_backoff_s=0)
    with pytest.raises(ApiError) as e:
        c.invoke("a", "b")
    assert e.value.status == 503 and e.value.code == "error"
    assert "not JSON" in e.value.message and "<html>bad gateway</html>" in e.value.message
    assert "text/plain" in e.value.message
    assert e.value.retry_after_s is not None and e.value.retry_after_s >= 0
    with pytest.raises(ApiError) as e:
        c.list_sessions()
    assert e.value.status == 502 and e.value.code == "error"
    assert "not an object (an array)" in e.value.message and "oops" in e.value.message


def test_a_retry_after_date_is_seconds_from_now_and_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    when = email.utils.formatdate(time.time() + 3, usegmt=True)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    calls = []

    def h(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": when}, text="busy")
        return httpx.Response(200, json={"output": {"count": 1}})

    assert _client(h, retry_backoff_s=0.01).invoke("a", "increment") == {"count": 1}
    assert len(calls) == 2 and len(slept) == 1 and 1.5 <= slept[0] <= 3.0, slept


@pytest.mark.parametrize("value,expected", [
    ("5", 5.0), ("0", 0.0), ("1.5", 1.5), (" 7 ", 7.0), (None, None), ("", None),
    ("soon", None), ("-3", None), ("nan", None), ("inf", None), ("Wed, 99 Foo 2026 07:28:00 GMT", None),
    ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),  # a date past: now
])
def test_retry_after_values(value: str | None, expected: float | None) -> None:
    assert retry_after_s(value) == expected


def test_a_retry_after_date_in_every_form_rfc_9110_names() -> None:
    at = time.time() + 100
    for form in (email.utils.formatdate(at, usegmt=True),  # IMF-fixdate
                 time.strftime("%A, %d-%b-%y %H:%M:%S GMT", time.gmtime(at)),  # obsolete RFC 850
                 time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(at))):  # asctime
        got = retry_after_s(form)
        assert got is not None and 95 <= got <= 100, (form, got)


@pytest.mark.parametrize("answer,why", [
    (httpx.Response(502, json=["oops"]), "not an object (an array)"),
    (httpx.Response(502, json="oops"), "not an object (a string)"),
    (httpx.Response(502, json=3), "not an object (a number)"),
    (httpx.Response(502, content=b"null", headers={"content-type": "application/json"}), "not an object (null)"),
    (httpx.Response(504, text="<html>gateway timeout</html>", headers={"content-type": "text/html"}), "not JSON"),
    (httpx.Response(502), "not JSON"),
    (httpx.Response(502, content=b"\xff\xfe\x00"), "not JSON"),
])
@pytest.mark.parametrize("call", ["list_sessions", "get_session", "events", "invoke", "pools"])
def test_an_error_body_that_is_not_a_json_object_is_an_api_error(answer: httpx.Response, why: str,
                                                                 call: str) -> None:
    c = _client(lambda req: answer, retries=0)
    args = {"get_session": ("s1",), "invoke": ("s1", "x")}.get(call, ())
    with pytest.raises(ApiError) as e:
        getattr(c, call)(*args)
    assert (e.value.status, e.value.code) == (answer.status_code, "error")
    assert why in e.value.message and "proxy" in e.value.message, e.value.message
    if not answer.content:
        assert "an empty body" in e.value.message


@pytest.mark.parametrize("body", [{"code": 7, "message": ["x"], "details": "d"}, {"detail": "Not Found"}])
def test_an_error_object_of_another_shape_keeps_its_status(body: dict) -> None:
    c = _client(lambda req: httpx.Response(404, json=body))
    with pytest.raises(ApiError) as e:
        c.get_session("s1")
    assert (e.value.status, e.value.code, e.value.details) == (404, "error", {})
    assert isinstance(e.value.message, str)


def test_the_apis_own_error_is_unchanged() -> None:
    c = _client(lambda req: httpx.Response(429, json={"code": "quota_max_running", "message": "m", "details": {"a": 1}},
                                           headers={"Retry-After": "2"}))
    with pytest.raises(ApiError) as e:
        c.get_session("s1")
    assert (e.value.status, e.value.code, e.value.message, e.value.details, e.value.retry_after_s) == (
        429, "quota_max_running", "m", {"a": 1}, 2.0)


def test_a_redirect_names_where_it_points() -> None:
    c = _client(lambda req: httpx.Response(301, headers={"location": "https://proxy.example/prefix/v1/sessions/s1"}))
    with pytest.raises(ApiError) as e:
        c.get_session("s1")
    assert e.value.status == 301 and "https://proxy.example/prefix/v1/sessions/s1" in e.value.message


@pytest.mark.parametrize("answer", [
    httpx.Response(200, text="<html>login</html>", headers={"content-type": "text/html"}),
    httpx.Response(200, json=["x"]),
    httpx.Response(200, json={"result": 1}),
])
def test_a_success_status_with_a_body_the_api_never_sends_is_an_api_error(answer: httpx.Response) -> None:
    c = _client(lambda req: answer)
    with pytest.raises(ApiError) as e:
        c.invoke("s1", "x")
    assert (e.value.status, e.value.code) == (200, "error") and "proxy" in e.value.message
    if answer.headers.get("content-type") == "text/html" or answer.json() == ["x"]:
        with pytest.raises(ApiError) as e:
            c.list_sessions()
        assert (e.value.status, e.value.code) == (200, "error")


def test_a_streamed_line_that_is_not_a_json_object_is_an_api_error_after_the_chunks() -> None:
    body = b'{"chunk": 1}\n<html>oops</html>\n'
    c = _client(lambda req: httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=body))
    got = []
    with pytest.raises(ApiError) as e:
        for chunk in c.invoke_stream("s1", "x"):
            got.append(chunk)
    assert got == [1] and e.value.chunks == [1] and e.value.details["mid_stream"] and e.value.code == "error"
    assert "<html>oops</html>" in e.value.message


# ------------------------------------------------------------------------------------- the constructor
@pytest.mark.parametrize("kw,name", [
    ({"retries": -1}, "retries"), ({"retries": 1.5}, "retries"), ({"retries": True}, "retries"),
    ({"retries": "3"}, "retries"),
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1}, "timeout_s"), ({"timeout_s": math.inf}, "timeout_s"),
    ({"timeout_s": math.nan}, "timeout_s"), ({"timeout_s": "5"}, "timeout_s"),
    ({"retry_backoff_s": -0.1}, "retry_backoff_s"), ({"retry_backoff_s": math.nan}, "retry_backoff_s"),
])
def test_the_constructor_refuses_numbers_out_of_range_naming_them(kw: dict, name: str) -> None:
    with pytest.raises(ValueError) as e:
        SubstrateClient("http://127.0.0.1:8080", **kw)
    msg = str(e.value)
    assert msg.startswith(f"{name} must be ") and (">= 0" in msg or "> 0" in msg), msg


def test_the_constructor_takes_the_edges() -> None:
    for kw in ({"retries": 0}, {"timeout_s": 0.001}, {"timeout_s": 5}, {"retry_backoff_s": 0}):
        SubstrateClient("http://127.0.0.1:8080", **kw).close()


def test_no_retries_means_one_attempt() -> None:
    calls = []

    def h(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        return httpx.Response(503, json={"code": "no_capacity", "message": "m"})

    with pytest.raises(ApiError) as e:
        _client(h, retries=0).invoke("s1", "x")
    assert e.value.code == "no_capacity" and len(calls) == 1


# ------------------------------------------------------------------------------------- list_sessions
@pytest.mark.parametrize("given", ["running", "Running", " RUNNING "])
def test_list_sessions_takes_the_state_in_any_case(given: str) -> None:
    seen: list[httpx.Request] = []

    def h(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(200, json={"items": [], "metadata": {"continue": None}})

    _client(h).list_sessions(state=given)
    list(_client(h).iter_sessions(state=given))
    assert [r.url.params["state"] for r in seen] == ["RUNNING", "RUNNING"]


@pytest.mark.parametrize("body", [{"status": "ok"}, {"items": {"a": 1}}, {"items": [], "metadata": {"continue": 3}},
                                  {"items": []}])
def test_a_200_object_that_is_no_page_is_an_api_error_on_every_list_call(body) -> None:
    """A gateway's JSON object with a 200: ``pools()`` and ``templates()`` raised ``KeyError`` on
    ``["items"]``, and the listings handed it on to ``iter_sessions``, which raised it there."""
    c = _client(lambda req: httpx.Response(200, json=body))
    calls = [c.list_sessions, lambda: list(c.iter_sessions()), lambda: c.session_events("s1"), c.events]
    if "items" not in body or not isinstance(body["items"], list):  # unpaged lists need items only
        calls += [c.pools, c.templates]
    for call in calls:
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 200 and e.value.code == "error" and "no page of items" in e.value.message


def test_a_page_is_a_page() -> None:
    c = _client(lambda req: httpx.Response(200, json={"items": [{"id": "s1"}], "metadata": {"continue": None}}))
    assert c.list_sessions()["items"] == [{"id": "s1"}] and c.pools() == [{"id": "s1"}]
    assert [s["id"] for s in c.iter_sessions()] == ["s1"]


@pytest.mark.parametrize("base_url", [None, b"http://127.0.0.1:8080", 8080, httpx.URL("http://127.0.0.1:8080")])
def test_a_base_url_that_is_no_str_is_a_type_error_naming_it(base_url) -> None:
    """``SubstrateClient(None)`` raised ``TypeError: argument of type 'NoneType' is not iterable``."""
    with pytest.raises(TypeError) as e:
        SubstrateClient(base_url)
    assert str(e.value).startswith("base_url must be ") and "http://127.0.0.1:8080" in str(e.value)
    assert type(base_url).__name__ in str(e.value)


@pytest.mark.parametrize("token", [b"key", 123])
def test_a_token_that_is_no_str_is_a_type_error_naming_it(token) -> None:
    """``token=b"key"`` raised ``TypeError: '<=' not supported between instances of 'str' and 'int'``,
    ``token=123`` ``AttributeError``."""
    with pytest.raises(TypeError) as e:
        SubstrateClient("http://127.0.0.1:8080", token=token)
    assert str(e.value).startswith("token must be ")
