"""Two activations of one session started at once on one worker (two creates of one ID around a DELETE,
each with its own epoch, both past the claim re-check): whichever finishes last, the newer epoch stays
registered and the other is dropped with its sandbox slot. The later one to finish overwrote the other
and leaked its slot for good (a fresh-user run: 3 of 4 slots held by agents no session owned, creates
503 ``no_capacity``). Real Redis; the sandboxes and agents are stand-ins."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from snapshot.commit import SnapshotManager
from snapshot.store import MemoryStore
from substrate.directory import Directory
from substrate.errors import StaleEpoch
from substrate.models import SessionRecord, SessionState
from substrate.settings import Settings
from workers.server import Worker

_SPEC = {"entrypoint": "workers.agents.counter:Counter"}


class _Sandboxes:
    """Hands out numbered slots and records which are given back."""

    warm_slots = staticmethod(lambda: 0)
    on_host_ready = None

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.taken: list[int] = []
        self.released: list[int] = []

    async def acquire(self, wait_s: float = 5.0, prefer: int | None = None) -> Any:
        i = len(self.taken)
        self.taken.append(i)
        return SimpleNamespace(index=i, lease=1, workspace=self.tmp / f"slot{i}", uid=None)

    async def release(self, slot: Any, host: object, lease: int | None = None) -> None:
        self.released.append(slot.index)

    async def close(self) -> None:
        return None


class _Agent:
    def __init__(self) -> None:
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("newer_first", [True, False])
async def test_the_newer_of_two_activations_of_one_session_stays_and_the_other_gives_its_slot_back(
        directory: Directory, tmp_path: Path, newer_first: bool) -> None:
    boxes = _Sandboxes(tmp_path)
    worker = Worker(Settings(), directory, SnapshotManager(MemoryStore(), directory, Settings().snapshot, tmp_path),
                    worker_id="w1", pool="default", slots=4, root=tmp_path, sandboxes=boxes)  # type: ignore[arg-type]
    worker.lease_expires_at = time.time() + 60
    gates: dict[int, asyncio.Event] = {5: asyncio.Event(), 6: asyncio.Event()}
    agents: dict[int, _Agent] = {}

    async def start_agent(ctx: Any, spec: Any, box: Any, state: Any, ref: Any) -> _Agent:
        agents[ctx.epoch] = agent = _Agent()
        await gates[ctx.epoch].wait()  # each start held until the test lets it finish
        return agent

    worker._start_agent = start_agent  # type: ignore[method-assign]
    now = time.time()
    await directory.create_session(SessionRecord(id="s", state=SessionState.STARTING, actorTemplate="counter",
                                                 pool="default", epoch=5, worker="w1", slot=0, createdAt=now,
                                                 updatedAt=now, lastActiveAt=now))

    def body(epoch: int) -> dict[str, Any]:
        return {"session": "s", "epoch": epoch, "template": "counter", "spec": _SPEC, "slot": 0}

    older = asyncio.create_task(worker.activate(body(5)))
    while 5 not in agents:  # past the claim re-check (epoch 5 is the record's then)
        await asyncio.sleep(0.01)
    await directory.transition("s", to=SessionState.STARTING, bump=True)  # a delete and a create since: epoch 6
    newer = asyncio.create_task(worker.activate(body(6)))
    while 6 not in agents:
        await asyncio.sleep(0.01)
    for epoch in ((6, 5) if newer_first else (5, 6)):
        gates[epoch].set()
        await asyncio.sleep(0.05)
    with pytest.raises(StaleEpoch) if newer_first else contextlib.nullcontext():
        await older
    assert (await newer)["epoch"] == 6
    assert worker.activations["s"].epoch == 6
    # every slot taken is either held by the registered activation or given back: none leaked
    held = worker.activations["s"].sandbox_slot.index
    assert sorted(boxes.released + [held]) == sorted(boxes.taken) == [0, 1]
    assert agents[5].stopped and not agents[6].stopped



async def test_a_busy_sandbox_slot_no_activation_holds_is_freed_at_the_second_reconciliation(
        directory: Directory, tmp_path: Path) -> None:
    """The backstop for any other way a slot could be left behind: busy, held by no activation, none
    starting in it, at two reconciliations in a row. A slot an activation holds, or one still starting,
    is never freed."""
    boxes = _Sandboxes(tmp_path)
    boxes.slots = [SimpleNamespace(index=i, busy=True, lease=1) for i in range(4)]  # type: ignore[attr-defined]
    boxes.slots[3].busy = False
    worker = Worker(Settings(), directory, SnapshotManager(MemoryStore(), directory, Settings().snapshot, tmp_path),
                    worker_id="w1", pool="default", slots=4, root=tmp_path, sandboxes=boxes)  # type: ignore[arg-type]
    worker.activations["s"] = SimpleNamespace(sandbox_slot=boxes.slots[0])  # type: ignore[assignment]
    worker._starting.add(1)  # an activation starting in slot 1
    assert await worker._free_stray_sandboxes() == []  # slot 2 seen once: a release may be under way
    assert boxes.released == []
    assert await worker._free_stray_sandboxes() == [2]
    assert boxes.released == [2]
