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
