"""The test harness's runtime (``tests.conftest.RuntimeProc``) starts again on another port when the one it
picked was taken before ``substrate up`` bound it (a full-suite run failed a test on "cannot listen on
127.0.0.1:61064: Address already in use": two test processes picked the same free port)."""

from __future__ import annotations

import socket

import pytest

import tests.conftest as harness


def test_a_runtime_whose_port_was_taken_meanwhile_starts_on_another(tmp_path, redis_url,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda: next(picks, None) or real())
    rt = harness.RuntimeProc(tmp_path, redis_url, replicas=1, slots=1)
    try:
        assert rt.port != taken.getsockname()[1]
        assert rt.client.create_session("counter")["state"] == "RUNNING"
        assert "Address already in use" in rt.logs()  # the first start did fail on the taken port
    finally:
        rt.stop()
        taken.close()
