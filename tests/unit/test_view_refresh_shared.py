"""Concurrent refreshes of the worker view share registry reads, and each still sees a read that began
after it was asked for (a placement that found no slot must not be served a registry read older than
its miss)."""

from __future__ import annotations

import asyncio

import pytest

from substrate.activator import WorkerView
from substrate.errors import DirectoryUnavailable


class _Registry:
    """``list_workers`` that takes a while; records when each read began (by a counter of changes)."""

    def __init__(self) -> None:
        self.version = 0
        self.reads: list[int] = []  # the version each read saw when it began
        self.gate = asyncio.Event()
        self.fail_next = False

    async def list_workers(self) -> list:
        self.reads.append(self.version)
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise DirectoryUnavailable("session directory (Redis) unavailable: down")
        return []


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_calls_during_a_read_share_the_next_one_and_each_sees_a_read_begun_after_it() -> None:
    reg = _Registry()
    view = WorkerView(reg, 60)  # type: ignore[arg-type]
    first = asyncio.create_task(view.refresh())
    await _settle()
    assert reg.reads == [0]
    reg.version = 1  # a worker registers while the first read is under way
    later = [asyncio.create_task(view.refresh()) for _ in range(10)]
    await _settle()
    reg.gate.set()
    await asyncio.gather(first, *later)
    # the ten calls made during the first read did not take its (older) answer: one more read, begun
    # after the registration, served all ten
    assert reg.reads == [0, 1] and view.reads == 2
    await view.refresh()  # nothing under way: a read of its own
    assert view.reads == 3


async def test_a_failed_read_fails_its_caller_and_the_waiting_calls_read_again() -> None:
    reg = _Registry()
    view = WorkerView(reg, 60)  # type: ignore[arg-type]
    reg.fail_next = True
    first = asyncio.create_task(view.refresh())
    await _settle()
    waiting = asyncio.create_task(view.refresh())
    await _settle()
    reg.gate.set()
    with pytest.raises(DirectoryUnavailable):
        await first
    await waiting  # its own read succeeded
    assert view.reads == 2 and view.refreshed_at > 0
