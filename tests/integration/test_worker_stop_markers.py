"""A worker whose graceful stop runs out of time moves its sessions out of their live states itself: one
whose activation had answered turns (RUNNING) is marked ``worker_lost`` (the turns since its snapshot are
gone), one whose wake had not settled (RESUMING: no turn was ever sent there) is not, since nothing was
lost (it had been marked, and its next answer claimed a loss). Real Redis; the agents are stand-ins."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from snapshot.commit import SnapshotManager
from snapshot.store import MemoryStore
from substrate.directory import Directory
from substrate.models import SessionRecord, SessionState
from substrate.settings import Settings
from workers.server import Activation, Worker


class _Sandboxes:
    warm_slots = staticmethod(lambda: 0)
    on_host_ready = None

    async def release(self, slot: object, host: object, lease: int | None = None) -> None:
        return None

    async def close(self) -> None:
        return None


class _Agent:
    async def stop(self) -> None:
        return None


async def test_a_stop_out_of_time_marks_a_loss_only_where_turns_were_answered(directory: Directory,
                                                                              tmp_path: Path) -> None:
    settings = Settings()
    settings.worker.shutdown_grace_s = 0.05
    worker = Worker(settings, directory, SnapshotManager(MemoryStore(), directory, settings.snapshot, tmp_path),
                    worker_id="w1", pool="default", slots=4, root=tmp_path,
                    sandboxes=_Sandboxes())  # type: ignore[arg-type]
    now = time.time()
    for slot, (sid, state) in enumerate([("ran", SessionState.RUNNING), ("waking", SessionState.RESUMING)]):
        await directory.create_session(SessionRecord(
            id=sid, state=state, actorTemplate="counter", pool="default", epoch=3, worker="w1", slot=slot,
            createdAt=now, updatedAt=now, lastActiveAt=now))
        act = Activation.__new__(Activation)
        act.sid, act.epoch, act.slot, act.template, act.tenant = sid, 3, slot, "counter", "default"
        act.closing, act.dropped, act.agent = False, False, _Agent()
        act.sandbox_slot, act.sandbox_lease = SimpleNamespace(index=slot), None
        act.spec = SimpleNamespace(resources=SimpleNamespace(gpus=0))
        worker.activations[sid] = act

    async def suspend_all_hangs() -> None:  # an object store that hangs: nothing suspends in time
        await asyncio.sleep(60)

    worker._suspend_all = suspend_all_hangs  # type: ignore[method-assign]
    await asyncio.wait_for(worker.shutdown(), 10)
    ran, waking = await directory.get_session("ran"), await directory.get_session("waking")
    assert ran.state == SessionState.SUSPENDED and ran.reason == "worker_lost" and ran.epoch == 4
    assert waking.state == SessionState.SUSPENDED and waking.reason is None and waking.epoch == 4
    assert ran.worker is None and waking.worker is None
