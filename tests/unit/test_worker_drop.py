"""A worker ends an activation's sandbox once, however many paths end the activation at the same time.

A 2x replay lost a session's state on a quiet machine: a suspend had committed and the reconciler, which
had read the committed record, freed the same activation too. Both released the sandbox slot; the second
release came after another session had taken the slot, swept its cgroup (killing that agent) and freed it
again under its new holder, and the next sessions placed there died the same way.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from workers.server import Activation, Worker


class _Sandboxes:
    def __init__(self) -> None:
        self.released: list[tuple[object, int | None]] = []

    async def release(self, slot: object, host: object, lease: int | None = None) -> None:
        await asyncio.sleep(0.01)  # the real release awaits (host close, workspace reset)
        self.released.append((slot, lease))


class _Agent:
    def __init__(self) -> None:
        self.stops = 0

    async def stop(self) -> None:
        self.stops += 1
        await asyncio.sleep(0.01)


async def test_two_paths_ending_one_activation_release_its_slot_once():
    worker = Worker.__new__(Worker)  # only what _drop touches
    worker.activations = {}
    worker.sandboxes = _Sandboxes()
    slot = SimpleNamespace(index=0)
    act = Activation.__new__(Activation)
    act.sid, act.closing, act.dropped = "s1", False, False
    act.agent, act.sandbox_slot, act.sandbox_lease = _Agent(), slot, 7
    worker.activations["s1"] = act
    await asyncio.gather(worker._drop(act), worker._drop(act))  # the suspend and the reconciler
    assert worker.sandboxes.released == [(slot, 7)]
    assert act.agent.stops == 1 and act.closing and "s1" not in worker.activations
    await worker._drop(act)  # and any later one
    assert len(worker.sandboxes.released) == 1
