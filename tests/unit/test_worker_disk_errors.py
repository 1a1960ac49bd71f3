"""A condition of the worker itself (its disk full, out of files) is a retryable 503, never a verdict on the
session's workspace or snapshot (fresh-user round 15: a disk-full minute on a worker made each wake
condemn a sound snapshot as ``snapshot_corrupt``, and a few retries left the session empty for good);
and a Redis refusing writes for a reason of its own is unavailable, not a bug of ours."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ResponseError

from snapshot.commit import SnapshotManager
from substrate.errors import InvalidInput, SnapshotCorrupt, StoreUnavailable, script_failure
from substrate.models import SnapshotRef
from substrate.settings import SnapshotSettings


class _FailingStore:
    def __init__(self, err: OSError) -> None:
        self.err = err

    async def read(self, key: str, consume: Any) -> Any:
        raise self.err


def _ref() -> SnapshotRef:
    return SnapshotRef(key="snapshots/s1/000000000001-1-a.tar.zst", epoch=1, createdAt=time.time(), sizeBytes=10,
                       sha256="0" * 64, files=1)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EMFILE])
async def test_a_restore_failing_on_the_workers_own_disk_is_503_and_condemns_nothing(tmp_path: Path, code: int) -> None:
    m = SnapshotManager(_FailingStore(OSError(code, os.strerror(code))), None, SnapshotSettings(),  # type: ignore[arg-type]
                        tmp_path / "tmp")
    with pytest.raises(StoreUnavailable) as e:
        await m.restore("s1", _ref(), tmp_path / "ws")
    assert e.value.status == 503 and e.value.details["reason"] == "worker_disk"
    assert "stays SUSPENDED with its snapshot" in e.value.message and "retry" in e.value.message


async def test_a_restore_this_filesystem_cannot_hold_is_still_corrupt(tmp_path: Path) -> None:
    m = SnapshotManager(_FailingStore(OSError(errno.ENAMETOOLONG, "File name too long")), None,  # type: ignore[arg-type]
                        SnapshotSettings(), tmp_path / "tmp")
    with pytest.raises(SnapshotCorrupt):
        await m.restore("s1", _ref(), tmp_path / "ws")


async def test_a_snapshot_failing_on_the_workers_own_disk_is_503_not_the_workspaces_fault(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    import snapshot.commit as commit

    def full(*a: Any, **kw: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(commit, "pack", full)
    m = SnapshotManager(_FailingStore(OSError()), None, SnapshotSettings(), tmp_path / "tmp")  # type: ignore[arg-type]
    (tmp_path / "ws").mkdir()
    with pytest.raises(StoreUnavailable) as e:
        await m.capture("s1", 1, "t", tmp_path / "ws", {})
    assert e.value.details["reason"] == "worker_disk" and "keeps running" in e.value.message

    def unreadable(*a: Any, **kw: Any) -> Any:
        raise OSError(errno.EACCES, "Permission denied")  # no file name: none is said, never "(None)"

    monkeypatch.setattr(commit, "pack", unreadable)
    with pytest.raises(InvalidInput) as e2:
        await m.capture("s1", 1, "t", tmp_path / "ws", {})
    assert e2.value.code == "workspace_unreadable" and "None" not in e2.value.message


def test_a_redis_refusing_writes_is_unavailable_not_a_bug() -> None:
    misconf = ResponseError("user_script:12: MISCONF Errors writing to the AOF file: No space left on device "
                            "script: 1a2b, on @user_script:12.")
    assert script_failure(misconf) is None
    assert script_failure(ResponseError("user_script:3: attempt to perform arithmetic on a nil value")) is not None
