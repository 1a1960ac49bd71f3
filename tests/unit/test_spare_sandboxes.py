"""A worker keeps ``worker.spare_sandboxes`` sandboxes beyond its slots (``workers.server.serve``).

A slot freed to make room (a pressure suspend for a waiting wake) has its next host still booting; the
activation that follows takes the warmest free sandbox (``SandboxPool.acquire``, covered by
``test_prestart.py``), which with a spare is a booted one. Here: the worker is built with the spare, and
with one slot and one spare an activation right after a release gets a booted host, not the booting one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import workers.server as server
from substrate.settings import Settings
from tests.unit.test_prestart import UNSANDBOXED, _pool, _until
from workers.sandbox import SandboxUnavailable


def test_spares_only_with_pre_started_hosts() -> None:
    assert Settings().worker.sandbox_spares() == 1
    assert Settings(worker={"spare_sandboxes": 3}).worker.sandbox_spares() == 3
    assert Settings(worker={"prestart_hosts": 0, "spare_sandboxes": 3}).worker.sandbox_spares() == 0


@pytest.mark.parametrize(("env", "expected"), [({}, 5), ({"spare_sandboxes": 0}, 4), ({"prestart_hosts": 0}, 4)])
async def test_a_worker_has_its_slots_and_its_spares_in_sandboxes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, Any], expected: int) -> None:
    made: list[int] = []

    def recording(root: Path, slots: int, **kw: Any) -> None:
        made.append(slots)
        raise SandboxUnavailable("recorded")  # the worker stops right there

    monkeypatch.setattr(server, "SandboxPool", recording)
    settings = Settings(worker={"root_dir": str(tmp_path / "w"), **env},
                        snapshot={"local_dir": str(tmp_path / "snapshots")})
    with pytest.raises(SystemExit):
        await server.serve(settings, worker_id="w-spare", pool="default", slots=4, host="127.0.0.1", port=0)
    assert made == [expected]


async def test_with_a_spare_an_activation_after_a_release_starts_in_a_booted_host(tmp_path: Path) -> None:
    pool = _pool(tmp_path, 1 + 1, prestart=2)  # one slot and its spare, as serve builds them
    try:
        await pool.start()
        await _until(lambda: pool.warm_slots() == 2, "both hosts booted")
        first = await pool.acquire()
        host = await pool.host_for(first, UNSANDBOXED)
        await pool.release(first, host, lease=first.lease)  # a pressure suspend: its next host boots now
        second = await pool.acquire()
        assert second.index != first.index
        assert second.ready is not None and second.ready.booted  # no boot to wait for
        await pool.release(second, await pool.host_for(second, UNSANDBOXED), lease=second.lease)
    finally:
        await pool.close()
        await asyncio.sleep(0)
