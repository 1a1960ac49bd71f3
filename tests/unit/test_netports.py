"""Ports picked for tests and for the embedded Redis stay out of the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from substrate import netports


def test_ports_are_outside_the_ephemeral_range_and_never_repeat() -> None:
    lo, hi = netports.ephemeral_range()
    ports = [netports.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p < lo or p > hi for p in ports)
    assert all(p >= 10000 for p in ports)


def test_a_bound_port_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        monkeypatch.setattr(netports, "ephemeral_range", lambda: (taken + 1, 65535))
        monkeypatch.setattr(netports, "_LOWEST", taken - 100)  # a span of 101 ports around the bound one
        picks = {netports.free_port() for _ in range(50)}
    assert taken not in picks


def test_high_caps_the_pick() -> None:
    cap = netports.ephemeral_range()[0] - 10001
    assert all(netports.free_port(high=cap) <= cap for _ in range(50))


def test_the_range_file_is_read_and_a_missing_one_has_a_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    monkeypatch.setattr(netports, "_RANGE_FILE", f)
    assert netports.ephemeral_range() == (40000, 50000)
    monkeypatch.setattr(netports, "_RANGE_FILE", tmp_path / "missing")
    assert netports.ephemeral_range() == (32768, 60999)


def test_no_room_outside_the_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netports, "ephemeral_range", lambda: (1024, 65535))
    p = netports.free_port()
    assert 0 < p <= 65535
