"""A worker's error answer rebuilt in the router (``substrate.workerclient.error_from``)."""

from __future__ import annotations

import pytest

from substrate import errors as E
from substrate.workerclient import error_from


def test_a_workers_retry_hint_becomes_the_routers_retry_after() -> None:
    body = {"code": "snapshot_store_unavailable", "message": "missing",
            "details": {"reason": "object_missing", "retry_after_s": 7}}
    err = error_from(503, body)
    assert isinstance(err, E.StoreUnavailable) and err.retry_after_s == 7.0
    assert err.details["reason"] == "object_missing"


@pytest.mark.parametrize("hint", [0, -1, 1e9, "7", True, None, float("nan")])
def test_a_hint_out_of_range_or_not_a_number_keeps_the_default(hint: object) -> None:
    err = error_from(503, {"code": "snapshot_store_unavailable", "message": "x", "details": {"retry_after_s": hint}})
    assert err.retry_after_s == E.StoreUnavailable.retry_after_s


def test_details_that_are_not_an_object_are_dropped() -> None:
    err = error_from(500, {"code": "weird", "message": "x", "details": ["not", "a", "dict"]})
    assert err.details == {} and err.status == 500 and err.code == "weird"


def test_the_workers_retry_after_reaches_the_router_answer_when_the_code_has_none() -> None:
    """Tester 37: the worker answered 503 ``suspend_timeout`` with ``Retry-After: 1``; the router's answer
    to the client carried none, though the README lists the code among those sent with it."""
    err = error_from(503, {"code": "suspend_timeout", "message": "x"}, "1")
    assert (err.status, err.code, err.retry_after_s) == (503, "suspend_timeout", 1.0)
    assert error_from(503, {"code": "suspend_timeout", "message": "x"}, "soon").retry_after_s is None
    assert error_from(503, {"code": "suspend_timeout", "message": "x"}, "0").retry_after_s is None
    hinted = error_from(503, {"code": "suspend_timeout", "message": "x", "details": {"retry_after_s": 7}}, "1")
    assert hinted.retry_after_s == 7.0, "the body's own hint wins"
