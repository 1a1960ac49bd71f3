"""``continue`` tokens are parsed strictly (fresh-user run): a token this API did not make is 422
``invalid_continue``, never a Redis error passed on (503 ``directory_unavailable``) nor a page read from a
forged position."""

from __future__ import annotations

import base64

import pytest

from substrate.audit import decode_event_cursor, encode_event_cursor
from substrate.errors import InvalidInput
from substrate.listing import decode_cursor, encode_cursor


def _b64(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


@pytest.mark.parametrize("sid", ["0-0", "1712345678123-7", f"{2**64 - 1}-{2**64 - 1}"])
def test_event_tokens_round_trip(sid: str) -> None:
    assert decode_event_cursor(encode_event_cursor(sid)) == sid


@pytest.mark.parametrize("raw", ["99999999999999999999-0", "18446744073709551615-18446744073709551616",
                                 "18446744073709551616-0", "1-", "-1", "1", "1-2-3", " 1-0", "+1-0", "1_0-0",
                                 "١-0", "01-0", "1-0\n", ""])
def test_event_tokens_out_of_range_or_malformed_are_invalid_continue(raw: str) -> None:
    with pytest.raises(InvalidInput) as e:
        decode_event_cursor(_b64(raw))
    assert e.value.code == "invalid_continue" and e.value.status == 422


@pytest.mark.parametrize("token", ["!!", "MS0w!", "MS0w==", "é"])
def test_event_tokens_not_in_canonical_base64_are_invalid_continue(token: str) -> None:
    with pytest.raises(InvalidInput) as e:
        decode_event_cursor(token)
    assert e.value.code == "invalid_continue"


@pytest.mark.parametrize("created,sid", [(1712345678.123456, "s-0123abcd"), (1.0, "a"), (0.0, "x.y_z-1"),
                                         (1e16, "a" * 128)])
def test_session_tokens_round_trip(created: float, sid: str) -> None:
    assert decode_cursor(encode_cursor(created, sid)) == (created, sid)


@pytest.mark.parametrize("raw", ["1|a|b", " 1|a", "1_000|a", "1|BAD ID", "1.0|a|b", "1.0| a", "1.0|",
                                 "|a", "1.0", "inf|a", "nan|a", "1e999|a", "1.0|-a", "1.0|" + "a" * 129,
                                 "١.0|a", "1.50|a", "1|a", "0x1p0|a", "1.0|a\n"])
def test_forged_session_tokens_are_invalid_continue(raw: str) -> None:
    with pytest.raises(InvalidInput) as e:
        decode_cursor(_b64(raw))
    assert e.value.code == "invalid_continue" and e.value.status == 422


@pytest.mark.parametrize("token", ["abc", "99999999999999999999999999", "MS4wfGE!", "MS4wfGE=", "é"])
def test_session_tokens_not_in_canonical_base64_are_invalid_continue(token: str) -> None:
    with pytest.raises(InvalidInput):
        decode_cursor(token)
