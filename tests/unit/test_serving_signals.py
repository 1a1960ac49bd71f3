"""The server ``substrate up``/``router`` run: a doubled Ctrl-C is one stop request, a later one forces
the exit: at once, with one line on stderr and status 130."""

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


@pytest.fixture(autouse=True)
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The statuses the server exited with (``os._exit`` would end the test run)."""
    got: list[int] = []
    monkeypatch.setattr(serving, "_exit", got.append)
    return got


def _server(**kw) -> serving.Server:
    return serving.Server(uvicorn.Config("api.main:app"), **kw)


def test_a_sigint_repeated_at_once_is_the_same_stop_request(clock, exits):
    s = _server()
    s.handle_exit(signal.SIGINT, None)
    clock[0] += 0.005  # the terminal's SIGINT, then the one `uv run` forwards
    s.handle_exit(signal.SIGINT, None)
    assert s.should_exit and not s.force_exit
    assert s._captured_signals == [signal.SIGINT]  # re-raised once after the graceful shutdown
    assert exits == []


def test_a_second_ctrl_c_after_a_moment_exits_at_once(clock, exits, capfd):
    """Fresh-user run: uvicorn's force_exit did not stop the lifespan shutdown under way (Runtime.stop):
    the process lingered 15-23 s and logged a CancelledError traceback."""
    s = _server()
    s.handle_exit(signal.SIGINT, None)
    assert exits == []
    clock[0] += serving.REPEAT_SIGNAL_WINDOW_S + 0.5
    s.handle_exit(signal.SIGINT, None)
    assert s.force_exit and exits == [130]
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("forced exit") and "cut" in err


def test_every_further_signal_exits_at_once_too(clock, exits):
    """Fresh-user run 36: a third Ctrl-C re-entered the forced exit inside its cleanup (stopping the
    embedded Redis, under a lock) and the process hung for good. The exit does nothing that waits now,
    and each further signal exits the same way."""
    s = _server()
    s.handle_exit(signal.SIGTERM, None)
    clock[0] += serving.REPEAT_SIGNAL_WINDOW_S + 0.5
    s.handle_exit(signal.SIGINT, None)  # Ctrl-C after a SIGTERM forces too, as in uvicorn
    clock[0] += 0.03
    s.handle_exit(signal.SIGINT, None)
    assert exits == [130, 130]


def test_sigterm_stops_gracefully_as_in_uvicorn(clock, exits):
    s = _server()
    s.handle_exit(signal.SIGTERM, None)
    clock[0] += 5
    s.handle_exit(signal.SIGTERM, None)
    assert s.should_exit and not s.force_exit and exits == []


def test_the_served_config_keeps_idle_connections_longer_than_clients_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn closes an idle keep-alive connection after 5 s, aiohttp's client reuses one for 15 s: a turn
    sent on a connection the server was closing at that instant got ``ServerDisconnectedError`` (the 11-26
    replay at 400x on 34f4aa9, a fresh-user burst). Both commands serve with ``keep_alive_timeout_s``."""
    from substrate.serving import server_config
    from substrate.settings import Settings

    cfg = server_config(Settings().api, "127.0.0.1", 8080)
    assert cfg.timeout_keep_alive == 75 and cfg.timeout_keep_alive > 15  # aiohttp's client keeps 15 s
    monkeypatch.setenv("SUBSTRATE_API__KEEP_ALIVE_TIMEOUT_S", "120")
    assert server_config(Settings().api, "127.0.0.1", 8080).timeout_keep_alive == 120
    assert server_config(Settings().api, "127.0.0.1", 8080).http.header_read_timeout_s == 10.0


async def test_a_stop_with_requests_in_flight_says_what_it_waits_for(capsys: pytest.CaptureFixture[str]) -> None:
    """Fresh-user round 11: a stop with a 30 s turn in flight took 28 s and said only uvicorn's JSON
    "Waiting for connections to close". It now says in one plain line what it waits for, and how long."""
    import asyncio

    class Lifespan:
        async def shutdown(self) -> None:
            pass

    s = _server()
    s.config.timeout_graceful_shutdown = 5
    s.servers, s.lifespan = [], Lifespan()
    await s.shutdown()
    assert "stopping:" not in capsys.readouterr().err, "nothing in flight: nothing said"
    turn = asyncio.ensure_future(asyncio.sleep(0.05))
    s.server_state.tasks.add(turn)
    turn.add_done_callback(s.server_state.tasks.discard)
    await s.shutdown()
    assert ("stopping: waiting up to 5 s for 1 request in flight (a second Ctrl-C, SIGTERM or SIGHUP forces the "
            "exit), then the workers suspend their sessions\n") in capsys.readouterr().err
    assert turn.done(), "the graceful wait itself is uvicorn's, unchanged"


class _Lifespan:
    async def shutdown(self) -> None:
        pass


async def test_the_graceful_shutdown_calls_before_shutdown_first_and_survives_its_error(caplog):
    """``substrate up`` stops its pools from creating workers there (fresh-user tester 54)."""
    calls: list[str] = []
    s = _server()
    s.servers, s.lifespan = [], _Lifespan()
    s.before_shutdown = lambda: calls.append("quiesce")
    await s.shutdown()
    assert calls == ["quiesce"]

    def broken() -> None:
        raise RuntimeError("boom")

    s = _server()
    s.servers, s.lifespan = [], _Lifespan()
    s.before_shutdown = broken
    with caplog.at_level("WARNING", logger="substrate.serving"):
        await s.shutdown()  # does not raise
    assert any("before_shutdown failed" in r.getMessage() for r in caplog.records)
