"""A worker reports its warm slots (free slots whose pre-started agent host has booted) in its record:
placement (``substrate.placement.candidates``) prefers a worker that has one. Real Redis; the worker's
slots are a stand-in that says how many are warm."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace

from snapshot.commit import SnapshotManager
from snapshot.store import MemoryStore
from substrate.directory import Directory
from substrate.settings import Settings
from workers.server import Worker


async def test_a_worker_registers_with_no_warm_slot_and_reports_its_first_booted_host_before_its_next_beat(
        directory: Directory, tmp_path: Path) -> None:
    settings = Settings()
    settings.worker.heartbeat_s = 600  # only the early beat a booted host asks for can report it in time
    warm = [0]
    slots = SimpleNamespace(warm_slots=lambda: warm[0], on_host_ready=None)
    worker = Worker(settings, directory, SnapshotManager(MemoryStore(), directory, settings.snapshot, tmp_path),
                    worker_id="w1", pool="default", slots=4, root=tmp_path, sandboxes=slots)  # type: ignore[arg-type]
    assert slots.on_host_ready is not None
    try:
        await worker.register("http://127.0.0.1:1")
        rec = await directory.get_worker("w1")
        assert rec is not None and rec.warmSlots == 0  # its hosts still boot: placement goes elsewhere first
        await asyncio.sleep(0.2)  # the first beat (at start) has run
        warm[0] = 1
        slots.on_host_ready()
        for _ in range(200):  # bounded: a broken early beat fails here, not by hanging
            rec = await directory.get_worker("w1")
            if rec is not None and rec.warmSlots == 1:
                break
            await asyncio.sleep(0.05)
        assert rec is not None and rec.warmSlots == 1
    finally:
        for t in worker._tasks:
            t.cancel()
        for t in worker._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
