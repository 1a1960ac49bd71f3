"""The chaos run stops what its set-up started also when the set-up fails half-way (a full-suite run on
2026-12-06: router a could not start, and router b and the moto server were left running for good)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.chaos import Chaos, ChaosConfig, Router


def test_a_failed_setup_stops_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chaos = Chaos(ChaosConfig(out=tmp_path))
    started: list[subprocess.Popen[bytes]] = []

    async def half_setup() -> None:
        chaos.moto = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        router = Router("b", {}, tmp_path)
        router.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        chaos.routers.append(router)
        started.extend([chaos.moto, router.proc])
        raise RuntimeError("router a exited with 2")

    monkeypatch.setattr(chaos, "setup", half_setup)
    with pytest.raises(RuntimeError, match="router a exited"):
        asyncio.run(chaos.run())
    assert [p.poll() is not None for p in started] == [True, True], "both stopped"
