"""Workers on IPv6: a worker told to listen on an IPv6 literal (``SUBSTRATE_WORKER__HOST=::1`` here; on an
IPv6-only or dual-stack cluster ``SUBSTRATE_WORKER_LISTEN_HOST=::`` with an IPv6 Pod IP) binds an IPv6
socket and registers ``http://[addr]:port``, and the router creates, forwards to, suspends and wakes
sessions on it. Workers listened on IPv4 only before (``AF_INET`` was fixed). Also: the address a worker
registers is never a wildcard (``0.0.0.0`` registered as such, fresh-user round 23)."""

from __future__ import annotations

import socket

import httpx
import pytest

from workers.server import advertised_host, bind_host, listen_socket, worker_url


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def test_a_worker_address_brackets_an_ipv6_literal() -> None:
    assert worker_url("fd00::5", 8081) == "http://[fd00::5]:8081"
    assert worker_url("[fd00::5]", 8081) == "http://[fd00::5]:8081"
    assert worker_url("10.0.0.7", 8081) == "http://10.0.0.7:8081"
    with listen_socket("::", 0) as s:  # dual stack: the wildcard takes IPv4 connections too
        s.listen()
        assert s.family == socket.AF_INET6
        with socket.create_connection(("127.0.0.1", s.getsockname()[1]), timeout=5):
            pass
    with listen_socket("127.0.0.1", 0) as s:
        assert s.family == socket.AF_INET
    # on Kubernetes the default listen address is 0.0.0.0: an IPv6 Pod IP makes it the IPv6 wildcard
    assert bind_host("0.0.0.0", "fd00::5") == "::"
    assert bind_host("0.0.0.0", "10.0.0.7") == "0.0.0.0" and bind_host("0.0.0.0", None) == "0.0.0.0"
    assert bind_host("127.0.0.1", "fd00::5") == "127.0.0.1"  # an address set on purpose is kept
    # what a worker registers: never a wildcard, which no client connects to (fresh-user round 23)
    assert advertised_host("0.0.0.0", None) == "127.0.0.1" and advertised_host("::", None) == "::1"
    assert advertised_host("0.0.0.0", "10.0.0.7") == "10.0.0.7" and advertised_host("10.0.0.8", None) == "10.0.0.8"


def test_sessions_run_suspend_and_wake_on_a_worker_listening_on_ipv6(runtime_factory) -> None:
    rt = runtime_factory(replicas=1, slots=2, env={"SUBSTRATE_WORKER__HOST": "::1"})
    (w,) = rt.workers().values()
    assert w["address"].startswith("http://[::1]:"), w["address"]
    s = rt.client.create_session("counter")
    assert rt.client.invoke(s["id"], "increment") == {"count": 1}
    rt.client.suspend(s["id"])
    rt.wait_for(lambda: rt.session_raw(s["id"]).get("state") == "SUSPENDED", what="suspended")
    assert rt.client.invoke(s["id"], "increment") == {"count": 2}  # woken on the IPv6 worker, state kept
    # the worker answers on its IPv6 address itself (what the router's client connected to)
    r = httpx.get(w["address"] + "/v1/activations", headers=rt.worker_headers(w["address"]), timeout=5)
    assert r.status_code == 200 and [a["session"] for a in r.json()["items"]] == [s["id"]]
