"""``api.proxy.check_json_content_type``: what counts as a JSON body's label (the e2e suite drives it
through every JSON route; these are the edge cases a fresh-user run found)."""

from __future__ import annotations

import pytest

from api.proxy import check_json_content_type
from substrate.errors import UnsupportedMediaType


@pytest.mark.parametrize("ct", ["application/json", "application/JSON; charset=UTF-8", "application/vnd.x+json",
                                "application/merge-patch+json; charset=utf8", "application/json; q=1"])
def test_json_labels_pass(ct: str) -> None:
    check_json_content_type(ct, b"{}")


@pytest.mark.parametrize("ct, says", [
    ("application/+json", "is not JSON"),  # a suffix with no name before it (RFC 6838 4.2.8)
    ("application/json; charset=utf-8; charset=latin1", "charset 'latin1'"),  # every charset is checked
    ("application/json; charset=latin-1", "charset 'latin-1'"),
    ("text/plain", "is not JSON"),
    (None, "no Content-Type"),
])
def test_other_labels_are_415(ct: str | None, says: str) -> None:
    with pytest.raises(UnsupportedMediaType) as e:
        check_json_content_type(ct, b"{}")
    assert e.value.code == "unsupported_media_type" and says in e.value.message, e.value.message


def test_an_empty_body_needs_no_label() -> None:
    check_json_content_type("text/plain", b"")
