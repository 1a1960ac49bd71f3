"""A zygote found dead is said in the log when a new one is started (fresh-user round 16: killing it was
silent; its workers go on serving, and a new zygote came only at the next scale-up, unannounced)."""

from __future__ import annotations

import logging
import subprocess

from substrate.backends.local import LocalBackend
from substrate.settings import Settings


async def test_a_dead_zygote_is_named_when_it_is_replaced(caplog) -> None:
    backend = LocalBackend(Settings(), python="/bin/true")  # the "zygote" exits at once
    dead = subprocess.Popen(["/bin/sh", "-c", "exit 9"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    dead.wait()
    backend._zygote = dead
    with caplog.at_level(logging.WARNING, logger="substrate.backends.local"):
        new = backend._ensure_zygote()
    try:
        assert new is not dead
        said = [r.getMessage() for r in caplog.records if "zygote" in r.getMessage()]
        assert said == [f"the zygote (pid {dead.pid}) exited with status 9; starting a new one (workers start cold until it is ready)"]
    finally:
        new.wait(10)
        await backend.close()
