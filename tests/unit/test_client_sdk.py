"""The SDK refuses what would silently name another resource, and treats redirects as errors (fresh-user
run: `substrate sessions delete ''` printed "deleted" because DELETE /v1/sessions/ answered 307)."""

from __future__ import annotations

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


@pytest.mark.parametrize("call", ["get_session", "delete_session", "suspend", "resume"])
def test_an_empty_session_id_is_refused_before_any_request(call: str) -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(ApiError) as e:
        getattr(_client(seen), call)("")
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
