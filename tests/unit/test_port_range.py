"""``SUBSTRATE_WORKER__PORT_RANGE``: workers and the embedded Redis listen on ports of a given range
(fresh-user tester 45: on a machine where each user keeps to a range, nothing kept them in one)."""

from __future__ import annotations

import errno
import socket

import pytest

from substrate.netports import free_port_in, free_span, parse_port_range, ports_in_random_order
from substrate.settings import WorkerSettings
from workers.server import listen_socket


def _span(n: int) -> tuple[int, int]:
    """``n`` consecutive ports, none bound now (outside the ephemeral range)."""
    return free_span(n)


@pytest.mark.parametrize("text,want", [("29610-29699", (29610, 29699)), (" 5-5 ", (5, 5)), ("1-65535", (1, 65535))])
def test_a_range_is_lo_dash_hi(text: str, want: tuple[int, int]) -> None:
    assert parse_port_range(text) == want
    assert WorkerSettings(port_range=text).ports == want


@pytest.mark.parametrize("text", ["", "29610", "9-2", "0-10", "1-65536", "+1-10", "1 - 10", "a-b", "1-10-20"])
def test_anything_else_is_refused_saying_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="a port range is LO-HI"):
        parse_port_range(text)


def test_unset_or_empty_is_no_range() -> None:
    assert WorkerSettings().ports is None and WorkerSettings(port_range="").ports is None


def test_every_port_of_the_range_is_tried_once() -> None:
    order = ports_in_random_order(100, 109)
    assert sorted(order) == list(range(100, 110))


def test_a_worker_binds_the_one_free_port_of_its_range_and_says_so_when_none_is_left() -> None:
    lo, hi = _span(5)
    held = []
    try:
        for port in range(lo, hi):  # all but the last one taken by listeners
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        sock = listen_socket("127.0.0.1", 0, (lo, hi))
        assert sock.getsockname()[1] == hi
        sock.listen()
        held.append(sock)
        with pytest.raises(OSError) as e:
            listen_socket("127.0.0.1", 0, (lo, hi))
        assert e.value.errno == errno.EADDRINUSE and f"PORT_RANGE {lo}-{hi}" in str(e.value)
        # a port given explicitly (Kubernetes' fixed worker port) is bound as it is, range or not
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", lo, (lo, hi))
    finally:
        for s in held:
            s.close()


def test_the_embedded_redis_port_is_a_free_one_of_the_range_each_handed_out_once() -> None:
    lo, hi = _span(3)
    got = {free_port_in(lo, hi) for _ in range(3)}
    assert got == {lo, lo + 1, hi}
    with pytest.raises(OSError) as e:
        free_port_in(lo, hi)
    assert e.value.errno == errno.EADDRINUSE


def _catalog(**specs: dict) -> object:
    from types import SimpleNamespace

    from substrate.models import WorkerPoolSpec

    return SimpleNamespace(pools={name: SimpleNamespace(name=name, spec=WorkerPoolSpec(**spec))
                                  for name, spec in specs.items()})


def _settings(port_range: str) -> object:
    from substrate.settings import Settings

    return Settings(worker=WorkerSettings(port_range=port_range))


def test_up_refuses_an_api_port_inside_the_range() -> None:
    """Fresh-user tester 46: a worker took the API's port, and `up` died (exit 3) after starting it all."""
    from substrate.backends.local import check_port_range

    with pytest.raises(ValueError, match="--port 29852 is inside SUBSTRATE_WORKER__PORT_RANGE 29852-29853"):
        check_port_range(_catalog(a={"replicas": 1}), _settings("29852-29853"), api_port=29852, embedded_redis=True)


def test_up_refuses_a_range_smaller_than_the_workers_the_pools_start_and_warns_below_their_most() -> None:
    """Fresh-user tester 46: `replicas: 6` in a 4-port range never became ready, and its creates waited 30 s
    for workers that could not listen while idle sessions were never suspended for them."""
    from substrate.backends.local import check_port_range

    fixed = _catalog(a={"replicas": 6, "slots": 2})
    with pytest.raises(ValueError, match=r"has 4 port\(s\); the pools start 6 worker\(s\) and the embedded Redis "
                                         r"takes one: widen the range to at least 7 ports"):
        check_port_range(fixed, _settings("29840-29843"), api_port=8080, embedded_redis=True)
    # an external Redis takes no port of the range
    assert check_port_range(fixed, _settings("29840-29845"), api_port=8080, embedded_redis=False) is None
    scaled = _catalog(a={"slots": 6, "autoscaling": {"minReplicas": 1, "maxReplicas": 64}})
    warned = check_port_range(scaled, _settings("29840-29849"), api_port=8080, embedded_redis=True)
    assert warned is not None and "the pools may run 64 worker(s)" in warned and "past 9 worker(s)" in warned
    assert check_port_range(scaled, _settings("29800-29899"), api_port=8080, embedded_redis=True) is None
    assert check_port_range(fixed, _settings(""), api_port=29840, embedded_redis=True) is None  # no range


def test_a_worker_that_finds_no_free_port_exits_2_with_one_line(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    with socket.socket() as held:
        # the range's one port is one this test holds: bound by the kernel's pick, so no other process can
        # have taken it first (a guessed "free" port was taken by a parallel test once: EADDRINUSE here)
        held.bind(("127.0.0.1", 0))
        held.listen()
        lo = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUBSTRATE_")}
        env["SUBSTRATE_WORKER"] = json.dumps({"port_range": f"{lo}-{lo}", "root_dir": str(tmp_path)})
        env["SUBSTRATE_REDIS_URL"] = "redis://127.0.0.1:1/0"  # never reached: the worker stops before
        p = subprocess.run([sys.executable, "-m", "workers.server", "--pool", "default", "--slots", "1",
                            "--worker-id", "w1"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"worker cannot listen: no free port in SUBSTRATE_WORKER__PORT_RANGE {lo}-{lo}" \
        in lines[0], p.stderr


def test_a_free_span_is_n_ports_none_bound_now_and_bad_sizes_are_refused() -> None:
    import socket as _socket

    lo, hi = free_span(4)
    assert hi - lo == 3 and lo >= 10000
    for port in range(lo, hi + 1):  # each one is free now: a range of workers can bind all of it
        with _socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with pytest.raises(ValueError, match="at least one port"):
        free_span(0)
    with pytest.raises(OSError) as e:  # no room below the cap
        free_span(10, high=10005)
    assert e.value.errno == errno.EADDRINUSE
