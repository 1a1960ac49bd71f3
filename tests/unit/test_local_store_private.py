"""The local snapshot store keeps its objects private to the runtime's user (fresh-user round 14: a
snapshot was 0644 under 0755 folders, and any local user could untar a session's workspace and state)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshot.store import LocalDirStore


def test_objects_and_the_stores_folder_are_the_owners_only(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # as an older version left it
    store = LocalDirStore(root, fsync=False)
    store._put("snapshots/s1/000001.tar.zst", io.BytesIO(b"workspace bytes"))
    assert root.stat().st_mode & 0o777 == 0o700
    obj = root / "snapshots" / "s1" / "000001.tar.zst"
    assert obj.read_bytes() == b"workspace bytes"
    assert obj.stat().st_mode & 0o077 == 0, oct(obj.stat().st_mode)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder every local user can enter (pytest's own temporary folders are 0700 all the way up)."""
    d = Path(tempfile.mkdtemp(prefix="substrate-private-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root to switch to it")
def test_another_local_user_cannot_read_a_snapshot(open_tmp: Path) -> None:
    tmp_path = open_tmp
    store = LocalDirStore(tmp_path / "snapshots", fsync=False)
    store._put("snapshots/s1/000001.tar.zst", io.BytesIO(b"secret"))
    r = subprocess.run(["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/bin/cat",
                        str(tmp_path / "snapshots" / "snapshots" / "s1" / "000001.tar.zst")], capture_output=True)
    assert r.returncode != 0 and b"secret" not in r.stdout
