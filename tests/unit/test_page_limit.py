"""A list's ``?limit=`` takes plain decimal digits only (user trial: ``GET /v1/sessions?limit=1.0`` was
accepted, pydantic's lax int parses ``1.0``, `` 5`` and ``+5``). Every paginated list is covered: the
sessions, a session's events and the tenant's events. A refused value is 422 ``invalid_input`` naming
``query.limit``, answered before the route runs (this app has no runtime: a route that ran would answer
500), so nothing is done."""

from __future__ import annotations

import httpx
import pytest

from api.app import _auth, create_app
from substrate.settings import Settings

LISTS = ["/v1/sessions", "/v1/sessions/s1/events", "/v1/events"]
NOT_DIGITS = ["1.0", "1e3", " 5", "5 ", "+5", "-5", "0x10", "1_0", "5\n", "\uff15", "", "1000.0"]


def _app() -> httpx.AsyncClient:
    app = create_app(Settings())

    async def no_auth() -> None:  # the check under test comes before any credentials matter
        return None
    app.dependency_overrides[_auth] = no_auth
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://t")


@pytest.mark.parametrize("path", LISTS)
async def test_a_limit_that_is_not_plain_digits_is_422_naming_it(path: str) -> None:
    async with _app() as c:
        for value in NOT_DIGITS:
            r = await c.get(path, params={"limit": value})
            assert r.status_code == 422, (value, r.text)
            body = r.json()
            assert body["code"] == "invalid_input", (value, body)
            assert body["message"].startswith("query.limit: must be a whole number from 1 to 1000 in plain "
                                              "decimal digits"), (value, body)
            assert body["details"]["errors"][0]["loc"] == ["query", "limit"]


@pytest.mark.parametrize("path", LISTS)
async def test_a_limit_out_of_range_is_422_and_digits_in_range_pass(path: str) -> None:
    async with _app() as c:
        for value in ["0", "1001", "99999999999999999999"]:
            r = await c.get(path, params={"limit": value})
            assert r.status_code == 422 and r.json()["code"] == "invalid_input", (value, r.text)
            assert "query.limit" in r.json()["message"]
        for value in ["1", "5", "007", "1000"]:
            r = await c.get(path, params={"limit": value})
            assert "query.limit" not in r.text, (value, r.text)  # past the check: the runtime-less route fails
            assert r.status_code == 500, (value, r.text)


def test_the_openapi_document_still_says_integer_1_to_1000() -> None:
    doc = create_app(Settings()).openapi()
    for path in LISTS:
        p = path.replace("s1", "{sid}")
        (param,) = [x for x in doc["paths"][p]["get"]["parameters"] if x["name"] == "limit"]
        assert param["schema"]["type"] == "integer"
        assert (param["schema"]["minimum"], param["schema"]["maximum"], param["schema"]["default"]) == (1, 1000, 100)
