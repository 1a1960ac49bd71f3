"""``substrate up`` says so when it serves open mode beyond loopback (fresh-user round 24: `--host 0.0.0.0`
with no key gave no word, while open mode's Host check guards loopback only), and prints an IPv6 listen
address as a URL one can paste (``http://[::1]:port``, not ``http://::1:port``)."""

from __future__ import annotations

import uuid

import pytest
import redis

from substrate.cli import _is_loopback_host, _open_mode_on_a_network
from substrate.keys import Keys
from substrate.settings import Settings


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("[::1]", True),
                                           ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("192.0.2.7", False), ("example.com", False)])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert _is_loopback_host(host) is loopback


def test_open_mode_beyond_loopback_is_told_and_a_key_silences_it(redis_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("SUBSTRATE_REDIS__KEY_PREFIX", prefix)
    settings = Settings()
    assert _open_mode_on_a_network(settings, redis_url, "0.0.0.0")
    assert not _open_mode_on_a_network(settings, redis_url, "127.0.0.1")  # the Host check guards that
    r = redis.Redis.from_url(redis_url)
    try:
        r.hset(Keys(prefix).api_keys, "k1", "{}")  # a key made with `substrate keys create`
        assert not _open_mode_on_a_network(settings, redis_url, "0.0.0.0")
    finally:
        r.delete(Keys(prefix).api_keys)
    monkeypatch.setenv("SUBSTRATE_API__AUTH_TOKEN", "t" * 32)
    assert not _open_mode_on_a_network(Settings(), redis_url, "0.0.0.0")
