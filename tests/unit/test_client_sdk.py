"""The SDK refuses what would silently name another resource, and treats redirects as errors (fresh-user
run: `substrate sessions delete ''` printed "deleted" because DELETE /v1/sessions/ answered 307)."""

from __future__ import annotations

import json
import httpx
import pytest

from substrate.client import ApiError, SubstrateClient


def _client(seen: list[httpx.Request], status: int = 200) -> SubstrateClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if status == 307:
            return httpx.Response(307, headers={"location": "/v1/sessions"})
        return httpx.Response(status, json={"id": "x", "state": "RUNNING"})

    return SubstrateClient("http://test", transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("sid", ["", ".", ".."])  # dots: the HTTP library resolved them as path segments
@pytest.mark.parametrize("call", ["get_session", "delete_session", "suspend", "resume"])
def test_an_empty_or_dot_session_id_is_refused_before_any_request(call: str, sid: str) -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(ApiError) as e:
        getattr(_client(seen), call)(sid)
    assert e.value.status == 422 and e.value.code == "invalid_session_id"
    assert seen == [], "nothing was sent"


def test_an_id_with_a_slash_stays_one_path_segment() -> None:
    seen: list[httpx.Request] = []
    _client(seen).get_session("a/../b")
    assert seen[0].url.raw_path == b"/v1/sessions/a%2F..%2Fb"


def test_a_redirect_is_an_error_not_a_success() -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(ApiError) as e:
        _client(seen, status=307).delete_session("abc")
    assert e.value.status == 307


def test_a_token_pasted_with_its_newline_is_sent_without_it() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"id": "s1", "state": "RUNNING"})

    with SubstrateClient("http://t", token="  sk_ab12_secret\r\n", transport=httpx.MockTransport(handler)) as c:
        c.get_session("s1")
    assert seen[0].headers["authorization"] == "Bearer sk_ab12_secret"


@pytest.mark.parametrize("token", ["sk_ab12_sec ret", "sk_ab12_secr\x01et", "sk_ab12_s\u00e9cret", "sk_ab12_\u2019secret"])
def test_a_token_a_header_cannot_carry_is_refused_without_echoing_it(token: str) -> None:
    """A fresh-user run: a key with a CR inside printed ``Illegal header value b'Bearer sk_..._<secret>'``
    (the whole secret, in a terminal or a CI log); a non-ASCII one, an 84-line traceback."""
    with pytest.raises(ApiError) as e:
        SubstrateClient("http://t", token=token)
    assert e.value.status == 401 and e.value.code == "invalid_token"
    assert "secr" not in str(e.value) and "cret" not in str(e.value) and "position" in e.value.message


def test_the_cli_refuses_such_a_token_in_one_line_without_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from substrate.cli import app

    monkeypatch.setenv("SUBSTRATE_TOKEN", "sk_ab12_topsecret\rX")
    r = CliRunner().invoke(app, ["sessions", "get", "x", "--server", "http://127.0.0.1:1"], env={"COLUMNS": "300"})
    assert r.exit_code == 1, r.output
    assert "invalid_token" in r.output and "topsecret" not in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_server_url_without_a_scheme_says_which_to_use() -> None:
    """A fresh-user run: ``--server localhost:19080`` gave ``UnsupportedProtocol ... 'localhost://'``."""
    with pytest.raises(ApiError) as e:
        SubstrateClient("localhost:19080")
    assert e.value.code == "invalid_server_url" and "http://localhost:19080" in e.value.message


@pytest.mark.parametrize("url, says", [
    ("notaurl", "has no scheme: use http://notaurl"),
    ("ftp://x", "has scheme 'ftp': use http:// or https://"),
    ("http://", "names no host"),
    ("http://:80", "names no host"),
    ("http://a b", "has a space in it"),
    # fresh-user tester 52: every call went to /v1/v1/... (404 no route), or dropped the query
    ("http://127.0.0.1:8080/v1", "ends in /v1, which every call adds: use http://127.0.0.1:8080"),
    ("http://h/proxy/v1/", "ends in /v1, which every call adds: use http://h/proxy"),
    ("http://127.0.0.1:8080?x=1", "has a query or a fragment"),
    ("http://127.0.0.1:8080/#top", "has a query or a fragment"),
    # fresh-user tester 53: a bare "?" sent every call to "/"; ports out of range were "connection
    # refused"; surrounding spaces read as "has scheme ''"
    ("http://127.0.0.1:8080/?", "has a query or a fragment"),
    ("http://127.0.0.1:99999", "names port 99999: a port is 1 to 65535"),
    ("http://127.0.0.1:0", "names port 0: a port is 1 to 65535"),
    ("  http://127.0.0.1:8080 ", "has spaces around it"),
])
def test_a_server_url_that_names_no_server_is_a_bad_argument_of_the_cli(url: str, says: str) -> None:
    """Fresh-user round 11: ``--server notaurl`` printed ``error 400 invalid_server_url`` (it read as an
    HTTP answer) and exited 1; ``ftp://x`` and ``http://`` were "cannot reach the API". Each is now a bad
    argument: one line naming --server, exit 2, before any request."""
    from typer.testing import CliRunner

    from substrate.cli import app

    with pytest.raises(ApiError) as e:
        SubstrateClient(url)
    assert e.value.code == "invalid_server_url" and says in e.value.message
    r = CliRunner().invoke(app, ["--server", url, "sessions", "list"], env={"COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: --server (or SUBSTRATE_SERVER): ") and says in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    SubstrateClient("http://127.0.0.1:8080").close()  # a good one is taken
    SubstrateClient("https://api.example.com/base/").close()


@pytest.mark.parametrize("key, says", [
    ("é", "printable ASCII (space to ~): U+00E9 at position 1"),
    ("ok\nno", "U+000A at position 3"),
    ("k" * 201, "over 200 characters"),
    ("", "empty"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_idempotency_key_the_api_would_refuse_is_refused_before_any_request(key: str, says: str,
                                                                              stream: bool) -> None:
    """Fresh-user run: ``sessions invoke c1 get -k 'é'`` printed a raw ``UnicodeEncodeError`` (the key
    cannot be put in a header); the SDK raised it too, not ``ApiError``."""
    seen: list[httpx.Request] = []
    c = _client(seen)
    with pytest.raises(ApiError) as e:
        if stream:
            list(c.invoke_stream("s1", "x", idempotency_key=key))
        else:
            c.invoke("s1", "x", idempotency_key=key)
    assert e.value.status == 422 and e.value.code == "invalid_idempotency_key" and says in e.value.message
    assert seen == [], "nothing was sent"


def test_a_valid_idempotency_key_is_sent_as_given() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"output": 1})

    c = SubstrateClient("http://test", transport=httpx.MockTransport(handler))
    assert c.invoke("s1", "x", idempotency_key="turn 7 ~ok") == 1
    assert seen[0].headers["idempotency-key"] == "turn 7 ~ok"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"a": {1, 2}}, object(), {"v": "\ud800"}])
def test_an_input_that_is_not_json_is_refused_before_anything_is_sent(bad: object) -> None:
    """Fresh-user run: ``invoke(sid, float("nan"))`` raised a bare ``ValueError`` from the HTTP library,
    while the SDK's other checks raise ``ApiError``."""
    sent: list[httpx.Request] = []
    c = SubstrateClient("http://127.0.0.1:9")
    c.http = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(
        lambda req: sent.append(req) or httpx.Response(200, json={"output": 1})))
    for call in (lambda: c.invoke("s1", bad), lambda: list(c.invoke_stream("s1", bad))):
        with pytest.raises(ApiError) as e:
            call()
        assert (e.value.status, e.value.code) == (422, "invalid_input")
        assert ("lone surrogate" if isinstance(bad, dict) and "v" in bad else "not JSON") in str(e.value)
    assert sent == [], "nothing was sent"
    assert c.invoke("s1", {"fine": [1.5, None]}) == 1  # strict JSON goes through


def test_a_create_body_that_is_not_json_is_refused_before_anything_is_sent() -> None:
    sent: list[httpx.Request] = []
    c = SubstrateClient("http://127.0.0.1:9")
    c.http = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(
        lambda req: sent.append(req) or httpx.Response(201, json={"id": "s1"})))
    for env, labels in (({"A": float("nan")}, None), (None, {"k": "\ud800"})):
        with pytest.raises(ApiError) as e:
            c.create_session("t", env=env, labels=labels)  # type: ignore[arg-type]
        assert (e.value.status, e.value.code) == (422, "invalid_input") and "body" in str(e.value)
    assert sent == []
    assert c.create_session("t", env={"A": "1"})["id"] == "s1"


def test_a_path_prefix_is_kept_and_an_empty_worker_pin_is_sent() -> None:
    """A reverse proxy's path prefix stays in every call; ``resume(worker="")`` sends the empty name (the
    API refuses it) instead of dropping the pin (fresh-user tester 52: it resumed on any worker)."""
    seen: list[tuple[str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.content))
        return httpx.Response(202, json={"id": "s1", "state": "RUNNING"})

    c = SubstrateClient("http://h/proxy", transport=httpx.MockTransport(handler))
    c.resume("s1", worker="")
    c.resume("s1")
    assert seen[0][0] == "/proxy/v1/sessions/s1/resume" and json.loads(seen[0][1]) == {"worker": ""}
    assert seen[1][1] == b""


def test_a_lone_surrogate_in_a_body_is_named_as_the_character() -> None:
    """Fresh-user tester 53: ``sessions create counter -l $'k=\\xff'`` said "'utf-8' codec can't encode
    character '\\udcff' in position 55: surrogates not allowed" (a position in the encoded body)."""
    from substrate.client import json_body

    with pytest.raises(ApiError) as e:
        json_body({"labels": {"k": "\udcff"}}, "the create body")
    assert e.value.code == "invalid_input" and "the create body holds U+DCFF, a lone surrogate" in e.value.message
    assert "position" not in e.value.message
