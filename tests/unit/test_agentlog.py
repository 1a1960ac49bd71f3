"""The agent host's stderr as the worker logs it (``workers/agentlog.py``): bounded and escaped."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import pytest

from workers import agentlog


@dataclass
class Owner:
    session: str = "s1"
    epoch: int = 3


def run(data: bytes, budget: agentlog.StderrBudget | None = None) -> list[logging.LogRecord]:
    records: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = H()
    agentlog.log.addHandler(h)
    agentlog.log.setLevel(logging.INFO)
    try:
        async def main() -> None:
            r = asyncio.StreamReader()
            r.feed_data(data)
            r.feed_eof()
            await agentlog.drain(r, Owner(), 0, budget)
        asyncio.run(main())
    finally:
        agentlog.log.removeHandler(h)
    return records


def test_lines_are_escaped_labelled_and_cut():
    recs = run(b'{"level": "critical"}\n\x1b[2J\rok\xc2\x85\nnot-utf8 \xff\n' + b"y" * 10_000 + b"\ntail")
    texts = [r.text for r in recs]  # type: ignore[attr-defined]
    assert texts[0] == '{"level": "critical"}'
    assert texts[1] == "\\x1b[2J\\x0dok\\x85"
    assert texts[2] == "not-utf8 \ufffd"
    assert texts[3] == "y" * agentlog.MAX_LINE_BYTES and recs[3].cut_bytes == 10_000 - agentlog.MAX_LINE_BYTES  # type: ignore[attr-defined]
    assert texts[4] == "tail"
    assert all(r.session == "s1" and r.epoch == 3 for r in recs)  # type: ignore[attr-defined]


def test_a_line_longer_than_a_read_is_cut_and_the_next_line_survives():
    recs = run(b"z" * 300_000 + b"\nnext\n")
    assert [r.text for r in recs] == ["z" * agentlog.MAX_LINE_BYTES, "next"]  # type: ignore[attr-defined]


def test_rate_and_total_bounds_drop_but_keep_reading():
    recs = run(b"line\n" * 1000, agentlog.StderrBudget(rate=0.0, burst=10, total=1 << 20))
    assert len(recs) == 10  # the burst; the other 990 were read and dropped
    recs = run(b"a" * 100 + b"\n" + b"b" * 100 + b"\n" + b"c\n" * 50, agentlog.StderrBudget(total=150))
    assert [r.levelname for r in recs] == ["INFO", "INFO", "WARNING"]  # then everything is dropped


def test_budget_refills_and_reports_what_it_dropped():
    b = agentlog.StderrBudget(rate=1.0, burst=1, total=1 << 20)
    assert b.take(1, now=b.last) and not b.take(1, now=b.last) and b.dropped == 1
    assert b.take(1, now=b.last + 1.0)


def test_the_seccomp_program_builds():
    from workers import syscalls

    prog = syscalls.build_bpf()
    assert prog and len(prog) % 8 == 0  # struct sock_filter is 8 bytes
    fd = syscalls.bpf_fd(prog)
    try:
        import os
        assert os.read(fd, len(prog) + 1) == prog
    finally:
        os.close(fd)


@pytest.mark.parametrize("value,denied", [(0, False), (8, False), (0x20000, False), (0x20008, False),
                                          (0xFFFFFFFF, False), (0x0040000, True), (0x80000000, True),
                                          (0xFFFFFFFE, True), (0x1, True), (0x0400000, True)])
def test_personality_rules_deny_exactly_what_docker_denies(value, denied):
    from workers.syscalls import _personality_rules

    assert any(value & m == v for m, v in _personality_rules()) is denied
