"""`substrate keys revoke` of a key it does not find says which runtime it looked in (fresh-user round 16: it
used ./var's runtime without a word, while the key lived, and kept working, in another one)."""

from __future__ import annotations

import uuid

import pytest
from typer.testing import CliRunner

from substrate.cli import app


def test_a_key_not_found_names_the_redis_and_prefix_it_looked_in(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("SUBSTRATE_REDIS_URL", redis_url)
    monkeypatch.setenv("SUBSTRATE_REDIS__KEY_PREFIX", prefix)
    r = CliRunner().invoke(app, ["keys", "revoke", "7d21fa80"])
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())  # the console wraps long lines
    assert "api_key_not_found" in text and f"key prefix {prefix}" in text, text
    assert "SUBSTRATE_DATA_DIR or SUBSTRATE_REDIS_URL picks another" in text
