"""Settings refused at load (a clear message, nothing started): placeholders that would be a known secret."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from substrate.settings import Settings


@pytest.mark.parametrize("token", ["change-me-to-the-output-of-openssl-rand-hex-24", "CHANGE-ME-please-0123456789",
                                   "short-token"])
def test_a_placeholder_or_short_internal_token_is_refused(token):
    """Fresh-user review: the external-redis overlay's placeholder was accepted, a public HMAC secret."""
    with pytest.raises(ValidationError, match="openssl rand -hex 24"):
        Settings(worker={"internal_token": token})


def test_a_real_internal_token_and_none_are_accepted():
    assert Settings(worker={"internal_token": "dev-only-internal-token"}).worker.internal_token
    assert Settings().worker.internal_token is None
