"""Concurrent deletes of one session: the losers answer 404 only after the winner's success is on record
(fresh-user run: the trail held ``delete session_not_found`` records before the winner's ``delete ok``, in 6
of 6 runs). Against a real Redis with an in-memory fake of the workers' internal API whose deactivate is
slow, as a worker ending a busy activation is."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.errors import NotFound
from substrate.models import SessionRecord, SessionState, WorkerRecord
from substrate.settings import Settings
from substrate.specs import load_documents

CATALOG = load_documents([
    {"kind": "WorkerPool", "metadata": {"name": "default"}, "spec": {"replicas": 1, "slots": 4}},
    {"kind": "ActorTemplate", "metadata": {"name": "counter"},
     "spec": {"entrypoint": "workers.agents.counter:Counter"}}])


class SlowDeactivate:
    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        await asyncio.sleep(0.3)


async def test_losers_of_concurrent_deletes_are_recorded_after_the_winner(directory: Directory) -> None:
    d = directory
    now = time.time()
    await d.register_worker(WorkerRecord(id="w1", pool="default", address="http://w1", slots=4,
                                         leaseExpiresAt=now + 60, startedAt=now))
    slot = await d.claim_slot("w1", "s1")
    await d.create_session(SessionRecord(id="s1", state=SessionState.RUNNING, actorTemplate="counter",
                                         pool="default", tenant="team-a", epoch=2, worker="w1", slot=slot,
                                         createdAt=now, updatedAt=now, lastActiveAt=now))
    view = WorkerView(d, 60)
    await view.refresh()
    act = Activator(Settings(), d, CATALOG, SlowDeactivate(), view)  # type: ignore[arg-type]
    trail: list[str] = []

    async def ok() -> None:
        trail.append("ok")

    async def one(i: int) -> None:
        await asyncio.sleep(0.01 * i)  # the first one wins; the others meet its delete under way
        try:
            await act.delete("s1", before_removal=ok)
        except NotFound as e:
            trail.append(e.code)

    await asyncio.gather(*(one(i) for i in range(6)))
    assert trail == ["ok"] + ["session_not_found"] * 5, trail
    assert not await d.redis.exists(d.keys.session("s1"))
