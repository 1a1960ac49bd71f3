"""An API server that cannot be reached is one warning line without a traceback, repeated at most once a
minute, and no urllib3 "Retrying" warnings (fresh-user review: `substrate controller` with nothing on its
API URL printed 3 "Retrying" warnings and "lease attempt failed" with a traceback every 5 s, and no line
saying it could not reach the API); a watch that ends the normal way is logged at debug only."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
import urllib3.exceptions as u3

from substrate.k8s import api as kapi
from substrate.k8s.api import ApiReachability, Informer, Kube, make_api_client
from substrate.k8s.leader import LeaderElector
from substrate.settings import Settings


def _closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


def _kube(url: str, monkeypatch: pytest.MonkeyPatch) -> Kube:
    monkeypatch.setenv("SUBSTRATE_KUBERNETES__API_URL", url)
    return Kube(make_api_client(Settings()))


@pytest.fixture(autouse=True)
def fresh_reachability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kapi.REACHABILITY, "_since", None)
    monkeypatch.setattr(kapi.REACHABILITY, "_said", 0.0)


def test_the_lease_loop_says_once_that_it_cannot_reach_the_api(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    url = _closed_url()
    elector = LeaderElector(_kube(url, monkeypatch), "ns", "lease", "me", duration_s=0.3, renew_s=0.1)

    async def run_a_while() -> None:
        task = asyncio.create_task(elector.run())
        await asyncio.sleep(1.5)  # ~15 attempts
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    caplog.set_level(logging.DEBUG)
    asyncio.run(run_a_while())
    said = [r for r in caplog.records if "cannot reach the Kubernetes API" in r.getMessage()]
    assert [r.getMessage() for r in said] == [
        f"cannot reach the Kubernetes API at {url}: Connection refused; retrying every 0.1 s"]
    assert said[0].levelno == logging.WARNING and said[0].exc_info is None
    assert not [r for r in caplog.records if "lease attempt failed" in r.getMessage()]
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()], "urllib3 retries are off"
    assert not elector.is_leader


def test_it_is_said_again_at_most_every_repeat_interval_and_when_it_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    r = ApiReachability(repeat_s=0.2)
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        r.failed("http://k", "Connection refused", 5)
    time.sleep(0.25)
    r.failed("http://k", "Connection refused", 5)
    r.failed("http://k", "Connection refused", 5)
    r.ok("http://k")
    r.ok("http://k")
    msgs = [x.getMessage() for x in caplog.records]
    assert msgs[0] == "cannot reach the Kubernetes API at http://k: Connection refused; retrying every 5 s"
    assert msgs[1] == "cannot reach the Kubernetes API at http://k: Connection refused; retrying every 5 s (for 0 s)"
    assert msgs[2:] == ["the Kubernetes API at http://k answers again"]


def test_a_watch_against_an_unreachable_api_logs_no_traceback(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    kube = _kube(_closed_url(), monkeypatch)
    inf = Informer(kube, kube.core.list_namespaced_pod, "ns", name="pods")
    caplog.set_level(logging.DEBUG)
    inf.start()
    time.sleep(1.0)
    inf.stop()
    assert [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("error,normal", [
    (u3.ReadTimeoutError(None, "/api", "Read timed out."), True),  # type: ignore[arg-type]
    (u3.ProtocolError("Connection broken: IncompleteRead(0 bytes read)"), True),
    (RuntimeError("a bug"), False),
    (KeyError("metadata"), False),
])
def test_a_normal_watch_end_is_told_from_an_unexpected_error(error: Exception, normal: bool) -> None:
    assert kapi._normal_watch_end(error) is normal
