"""Answers the API never sends, from a fresh-user tester's fake server: an empty success body (returned
as None), JSON nested too deep (``RecursionError``), ``NaN``/``Infinity`` (handed on as ``nan``). Each is
``ApiError`` with the answer's status and code ``error`` (see ``test_client_proxy_answers``)."""

from __future__ import annotations

from typing import Any, Callable

import httpx
import pytest

from substrate.client import ApiError, SubstrateClient

JSON = {"content-type": "application/json"}
NDJSON = {"content-type": "application/x-ndjson"}


def _client(handler: Callable[[httpx.Request], httpx.Response], **kw: Any) -> SubstrateClient:
    return SubstrateClient("http://fake.example", transport=httpx.MockTransport(handler), retries=0, **kw)


#: every call of the SDK, with the arguments it needs
CALLS: dict[str, Callable[[SubstrateClient], Any]] = {
    "create_session": lambda c: c.create_session("counter"),
    "get_session": lambda c: c.get_session("s1"),
    "list_sessions": lambda c: c.list_sessions(),
    "iter_sessions": lambda c: list(c.iter_sessions()),
    "invoke": lambda c: c.invoke("s1", "x"),
    "invoke_stream (a plain turn's replay)": lambda c: list(c.invoke_stream("s1", "x")),
    "suspend": lambda c: c.suspend("s1"),
    "resume": lambda c: c.resume("s1"),
    "pools": lambda c: c.pools(),
    "templates": lambda c: c.templates(),
    "session_events": lambda c: c.session_events("s1"),
    "events": lambda c: c.events(),
    "stats": lambda c: c.stats(),
    "snapshot_store": lambda c: c.snapshot_store(),
    "adopt_snapshot_store": lambda c: c.adopt_snapshot_store(),
}


# --------------------------------------------------------------------------------------- empty bodies
@pytest.mark.parametrize("status", [200, 201, 202, 204])
@pytest.mark.parametrize("call", CALLS)
def test_an_empty_success_body_is_an_api_error(call: str, status: int) -> None:
    """Every route but DELETE answers a JSON body: an empty one was returned as None (``get_session``,
    ``create_session``, ``stats``, ``snapshot_store``...)."""
    c = _client(lambda req: httpx.Response(status, headers={**JSON, "content-length": "0"}))
    with pytest.raises(ApiError) as e:
        CALLS[call](c)
    assert (e.value.status, e.value.code) == (status, "error"), e.value
    assert "is empty" in e.value.message and "an empty body" in e.value.message


def test_a_delete_answers_204_with_no_body() -> None:
    assert _client(lambda req: httpx.Response(204)).delete_session("s1") is None


def test_a_delete_answered_200_with_an_empty_body_is_an_api_error() -> None:
    with pytest.raises(ApiError) as e:
        _client(lambda req: httpx.Response(200, headers=JSON)).delete_session("s1")
    assert (e.value.status, e.value.code) == (200, "error") and "is empty" in e.value.message


# --------------------------------------------------------------------------------------- nesting too deep
DEEP = b"[" * 100_000


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("status", [200, 503])
def test_json_nested_too_deep_is_an_api_error_not_a_recursion_error(call: str, status: int) -> None:
    c = _client(lambda req: httpx.Response(status, headers=JSON, content=DEEP))
    with pytest.raises(ApiError) as e:
        CALLS[call](c)
    assert (e.value.status, e.value.code) == (status, "error") and "not JSON" in e.value.message


def test_a_streamed_line_nested_too_deep_is_an_api_error() -> None:
    c = _client(lambda req: httpx.Response(200, headers=NDJSON, content=b'{"chunk": 1}\n' + DEEP + b"\n"))
    got: list[Any] = []
    with pytest.raises(ApiError) as e:
        for chunk in c.invoke_stream("s1", "x"):
            got.append(chunk)
    assert got == [1] == e.value.chunks and e.value.code == "error" and e.value.details["mid_stream"]


# --------------------------------------------------------------------------------------- NaN and infinities
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinities_are_not_the_apis_json(constant: str) -> None:
    """The API's JSON is strict: ``{"output": NaN}`` was returned as ``nan``."""
    body = f'{{"output": {constant}}}'.encode()
    c = _client(lambda req: httpx.Response(200, headers=JSON, content=body))
    for call in (lambda: c.invoke("s1", "x"), lambda: list(c.invoke_stream("s1", "x")), lambda: c.get_session("s1")):
        with pytest.raises(ApiError) as e:
            call()
        assert (e.value.status, e.value.code) == (200, "error") and "not JSON" in e.value.message
    # an error answer's body likewise: not the API's, whatever its code says
    err = f'{{"code": "no_capacity", "message": "m", "details": {{"x": {constant}}}}}'.encode()
    c = _client(lambda req: httpx.Response(503, headers=JSON, content=err))
    with pytest.raises(ApiError) as e:
        c.get_session("s1")
    assert (e.value.status, e.value.code) == (503, "error") and "not JSON" in e.value.message
    # and a streamed line
    c = _client(lambda req: httpx.Response(200, headers=NDJSON, content=f'{{"chunk": {constant}}}\n'.encode()))
    with pytest.raises(ApiError) as e:
        list(c.invoke_stream("s1", "x"))
    assert e.value.code == "error" and e.value.details["mid_stream"]


def test_numbers_the_api_sends_still_parse() -> None:
    c = _client(lambda req: httpx.Response(200, json={"output": [1, -2.5e300, 0.0, "NaN"]}))
    assert c.invoke("s1", "x") == [1, -2.5e300, 0.0, "NaN"]


# --------------------------------------------------------------------------------------- continue tokens
def _pages(tokens: list[str | None]) -> tuple[Callable[[httpx.Request], httpx.Response], list[str | None]]:
    """A handler answering pages whose ``continue`` tokens are ``tokens`` in turn (the last one again after
    them), and the tokens it was sent."""
    sent: list[str | None] = []

    def h(req: httpx.Request) -> httpx.Response:
        sent.append(req.url.params.get("continue"))
        if len(sent) > 50:
            raise AssertionError("the client kept following the tokens")
        token = tokens[min(len(sent) - 1, len(tokens) - 1)]
        return httpx.Response(200, json={"items": [{"id": f"s{len(sent)}"}], "metadata": {"continue": token}})
    return h, sent


@pytest.mark.parametrize("tokens,start", [(["t1"], None), (["t1", "t2", "t2"], None), (["t1", "t2", "t1"], None),
                                          (["t0"], "t0")])
def test_iter_sessions_stops_at_a_repeated_continue_token(tokens: list[str], start: str | None) -> None:
    """A server answering the token it was sent (or one sent before) looped ``iter_sessions`` forever."""
    h, sent = _pages(tokens)
    with pytest.raises(ApiError) as e:
        list(_client(h).iter_sessions(continue_=start))
    assert (e.value.status, e.value.code) == (200, "error") and "repeated the continue token" in e.value.message
    assert len(sent) <= len(tokens) + 1


def test_iter_sessions_follows_tokens_to_the_end() -> None:
    h, sent = _pages(["t1", "t2", None])
    assert [s["id"] for s in _client(h).iter_sessions()] == ["s1", "s2", "s3"] and sent == [None, "t1", "t2"]


@pytest.mark.parametrize("cmd", [["events"], ["sessions", "events", "s1"]])
@pytest.mark.parametrize("output", ["jsonl", "json", "table", "ids"])
def test_the_clis_all_stops_at_a_repeated_continue_token(monkeypatch: pytest.MonkeyPatch, cmd: list[str],
                                                         output: str) -> None:
    from typer.testing import CliRunner

    from substrate import cli

    h, sent = _pages(["t1", "t1"])
    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(h)))
    r = CliRunner().invoke(cli.app, [*cmd, "--all", "-o", output])
    assert r.exit_code == 1 and "repeated the continue token 't1'" in r.stderr, (r.stdout, r.stderr)
    assert sent == [None, "t1"]


def test_the_clis_sessions_list_all_stops_at_a_repeated_continue_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from substrate import cli

    h, sent = _pages(["t1"])
    monkeypatch.setattr(cli, "SubstrateClient", lambda server, token=None: SubstrateClient(
        server, token=token, transport=httpx.MockTransport(h)))
    r = CliRunner().invoke(cli.app, ["sessions", "list", "--all"])
    assert r.exit_code == 1 and "repeated the continue token" in r.stderr and sent == [None, "t1"]
