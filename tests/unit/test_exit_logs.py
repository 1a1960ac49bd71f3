"""A runtime's start keeps only the newest ``EXIT_LOGS_KEPT`` ``*.after-runtime-exit.log`` files of workers
that outlived a stopped runtime (fresh-user round 16: one per worker per hard stop, never removed)."""

from __future__ import annotations

import os
from pathlib import Path

from substrate.backends.local import EXIT_LOGS_KEPT, LocalBackend
from substrate.settings import Settings


async def test_start_keeps_the_newest_exit_logs_and_removes_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "workers"
    root.mkdir()
    for i in range(EXIT_LOGS_KEPT + 5):
        p = root / f"default-{i:02d}.after-runtime-exit.log"
        p.write_text("tracebacks")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    (root / "default-keep").mkdir()  # a worker's folder is not a log
    settings = Settings()
    settings.worker.root_dir = root
    backend = LocalBackend(settings, fork_server=False)
    await backend.start()
    left = sorted(p.name for p in root.glob("*.after-runtime-exit.log"))
    assert left == [f"default-{i:02d}.after-runtime-exit.log" for i in range(5, EXIT_LOGS_KEPT + 5)]
    assert (root / "default-keep").is_dir()
