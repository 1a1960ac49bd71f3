"""Every folder of the embedded default follows ``SUBSTRATE_DATA_DIR`` unless set on its own (fresh-user run:
the embedded Redis stayed in ./var/redis while snapshots and workspaces moved, so old session records pointed
at snapshots that were not there: 500 ``snapshot_corrupt``, then the state was reset)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from substrate.cli import app
from substrate.settings import Settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.upper().startswith("SUBSTRATE_"):
            monkeypatch.delenv(k)


def test_the_data_dir_moves_redis_workspaces_and_snapshots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "d2"))
    s = Settings()
    assert s.redis.data_dir == tmp_path / "d2" / "redis"
    assert s.worker.root_dir == tmp_path / "d2" / "workers"
    assert s.snapshot.local_dir == tmp_path / "d2" / "snapshots"


def test_an_explicit_folder_still_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "d2"))
    monkeypatch.setenv("SUBSTRATE_REDIS__DATA_DIR", str(tmp_path / "r"))
    s = Settings()
    assert s.redis.data_dir == tmp_path / "r"
    assert s.worker.root_dir == tmp_path / "d2" / "workers"


def test_another_redis_setting_does_not_pin_the_redis_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "d2"))
    monkeypatch.setenv("SUBSTRATE_REDIS__KEY_PREFIX", "p")
    assert Settings().redis.data_dir == tmp_path / "d2" / "redis"


def test_the_defaults_are_unchanged() -> None:
    s = Settings()
    assert (s.redis.data_dir, s.worker.root_dir, s.snapshot.local_dir) == \
        (Path("var/redis"), Path("var/workers"), Path("var/snapshots"))


def test_the_in_use_error_names_the_folder_under_the_data_dir(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    import substrate.embedded as embedded

    def _no_spawn(self: object) -> None:  # without the fix the lock is free: never start a real Redis
        raise RuntimeError("would have started a Redis")

    monkeypatch.setattr(embedded.EmbeddedRedis, "_spawn", _no_spawn)
    monkeypatch.chdir(tmp_path)  # a ./var/redis of this test's own, not the repository's
    data = tmp_path / "d2"
    (data / "redis").mkdir(parents=True)
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(data))
    fd = os.open(data / "redis" / "runtime.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another runtime holds this data folder
        os.pwrite(fd, b"4242", 0)
        from substrate.netports import free_port

        port = free_port()
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(port)])
    finally:
        os.close(fd)
    assert r.exit_code == 2, r.output
    assert f"data folder {(data / 'redis').resolve()} is in use by another runtime (pid 4242)" in r.output
    assert not (tmp_path / "var").exists()
