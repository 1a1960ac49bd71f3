"""``SUBSTRATE_WORKER__PORT_RANGE``: workers and the embedded Redis listen on ports of a given range
(fresh-user tester 45: on a machine where each user keeps to a range, nothing kept them in one)."""

from __future__ import annotations

import errno
import socket

import pytest

from substrate.netports import free_port, free_port_in, parse_port_range, ports_in_random_order
from substrate.settings import WorkerSettings
from workers.server import listen_socket


def _span(n: int) -> tuple[int, int]:
    """``n`` consecutive ports after a free one (outside the ephemeral range; ``free_port`` hands out the
    free one itself, so it is left out)."""
    lo = free_port(high=60000) + 1
    return lo, lo + n - 1


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
