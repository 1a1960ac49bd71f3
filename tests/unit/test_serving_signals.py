"""The server ``substrate up``/``router`` run: a doubled Ctrl-C is one stop request, a later one forces."""

from __future__ import annotations

import signal

import pytest
import uvicorn

from substrate import serving


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(serving.time, "monotonic", lambda: now[0])
    return now


def _server() -> serving.Server:
    return serving.Server(uvicorn.Config("api.main:app"))


def test_a_sigint_repeated_at_once_is_the_same_stop_request(clock):
    s = _server()
    s.handle_exit(signal.SIGINT, None)
    clock[0] += 0.005  # the terminal's SIGINT, then the one `uv run` forwards
    s.handle_exit(signal.SIGINT, None)
    assert s.should_exit and not s.force_exit
    assert s._captured_signals == [signal.SIGINT]  # re-raised once after the graceful shutdown


def test_a_second_ctrl_c_after_a_moment_forces_the_exit(clock):
    s = _server()
    s.handle_exit(signal.SIGINT, None)
    clock[0] += serving.REPEAT_SIGNAL_WINDOW_S + 0.5
    s.handle_exit(signal.SIGINT, None)
    assert s.force_exit


def test_sigterm_stops_gracefully_as_in_uvicorn(clock):
    s = _server()
    s.handle_exit(signal.SIGTERM, None)
    clock[0] += 5
    s.handle_exit(signal.SIGTERM, None)
    assert s.should_exit and not s.force_exit
