"""The snapshot commit protocol: capture -> upload (conditional) -> compare-and-set on the epoch.

1. ``capture``: pack the workspace and the agent's state into one archive (``snapshot.archive``) in a
   temp file, then upload it under a **new** key (``epoch`` and a sequence number in the name) with a
   conditional create (S3 ``If-None-Match: *``), so no upload can overwrite another.
2. ``commit``: one Lua compare-and-set in the directory moves the session's ``snapshot`` pointer to the
   new object only if the record still carries the activation epoch that wrote it (DESIGN invariant 1: a
   zombie's commit is rejected). The old pointer becomes ``previousSnapshot``; the one that falls out of
   that window stays while ``snapshot.retention`` allows (the directory keeps the set of the newest
   ``retention`` committed keys per session and returns the ones that fell out, deleted here). A
   rejected commit deletes its own upload; whatever a crash leaves behind is removed by the state
   manager's orphan sweep.
3. ``restore``: stream the object into the extractor (staging directory), verify sha256 and the manifest
   (session) at the end of the stream, swap in.

The slot of a suspending session is released by the caller only after ``commit`` returned True
(invariant 2). Snapshot bytes move between the worker and object storage only (invariant 7).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from snapshot.archive import WorkspaceNotArchivable, pack, unpack_stream
from snapshot.guard import MARKER_NAME
from snapshot.store import ObjectStore, parse_snapshot_key, session_prefix, snapshot_key
from substrate import metrics
from substrate.directory import Directory
from substrate.errors import InvalidInput, NotFound, SnapshotCorrupt, StoreUnavailable, public_detail
from substrate.models import SessionState, SnapshotRef
from substrate.settings import SnapshotSettings

log = logging.getLogger(__name__)



#: errnos of a condition of this worker (disk full, quota, out of files or memory), not of the workspace
#: or the snapshot: the operation is answered 503 and may be retried; nothing is refused or condemned
LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _local_failure(what: str, e: OSError, outcome: str) -> StoreUnavailable:
    """503 ``snapshot_store_unavailable`` (retryable) for ``e``, an error of this worker's own disk or
    limits, named with its reason (``details.reason`` ``worker_disk``)."""
    err = StoreUnavailable(f"{what}: this worker's disk or limits failed ({e.strerror or e}); {outcome}; "
                           "retry (free space on the worker's SUBSTRATE_WORKER__ROOT_DIR if it persists)",
                           details={"reason": "worker_disk", "errno": e.errno}, retry_after_s=5)
    return err

class SnapshotManager:
    """Capture, commit and restore snapshots for the activations of one worker.

    ``tmp_dir`` holds archives in flight (same filesystem as workspaces keeps restores cheap).
    """

    def __init__(self, store: ObjectStore, directory: Directory, settings: SnapshotSettings,
                 tmp_dir: Path) -> None:
        self.store = store
        self.directory = directory
        self.settings = settings
        self.tmp_dir = tmp_dir
        tmp_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # archives in flight: sessions' data
        self._seq = itertools.count(int(time.time() * 1000) % 1_000_000)

    async def capture(self, sid: str, epoch: int, template: str, workspace: Path,
                      state: dict[str, Any], *, max_bytes: int | None = None) -> SnapshotRef:
        """Pack and upload one snapshot; returns its (not yet committed) ref. ``max_bytes``: the
        template's ``isolation.maxDiskBytes`` (a workspace above it is not archived).

        Raises ``StoreUnavailable`` if object storage cannot be reached, ``InvalidInput`` 422
        (``workspace_too_large`` / ``workspace_name_too_long`` / ``workspace_unreadable``) when the
        workspace cannot be archived into something a restore accepts; nothing is committed then.
        """
        fd, tmp = tempfile.mkstemp(prefix=f"{sid}-", suffix=".tar.zst", dir=self.tmp_dir)
        os.close(fd)
        path = Path(tmp)
        try:
            t0 = time.perf_counter()
            try:
                manifest, size, sha = await asyncio.to_thread(
                    pack, workspace, state, session=sid, epoch=epoch, template=template, out_path=path,
                    zstd_level=self.settings.zstd_level, max_bytes=max_bytes)
            except WorkspaceNotArchivable as e:
                raise InvalidInput(f"snapshot of {sid!r} not taken: {e}", code=e.code) from e
            except (FileNotFoundError, NotADirectoryError):
                raise  # the activation went away meanwhile: the caller's concern
            except OSError as e:
                if e.errno in LOCAL_ERRNOS:  # this worker's disk or limits, not the workspace: retry
                    raise _local_failure(f"snapshot of {sid!r} not taken", e,
                                         "the session keeps running with all its state") from e
                # e.g. ENAMETOOLONG, EACCES on a file the agent made unreadable
                where = f" ({e.filename})" if e.filename else ""
                raise InvalidInput(f"snapshot of {sid!r} not taken: {e.strerror or e}{where}",
                                   code="workspace_unreadable") from e
            t1 = time.perf_counter()
            key = snapshot_key(self.settings.prefix, sid, epoch, next(self._seq))
            await self.store.put_file(key, path)
            t2 = time.perf_counter()
            metrics.SNAPSHOT_DURATION_SECONDS.labels(template=template, op="pack").observe(t1 - t0)
            metrics.SNAPSHOT_DURATION_SECONDS.labels(template=template, op="upload").observe(t2 - t1)
            metrics.SNAPSHOT_BYTES.labels(template=template).observe(size)
            return SnapshotRef(key=key, epoch=epoch, createdAt=manifest.createdAt, sizeBytes=size, sha256=sha,
                               files=manifest.files)
        finally:
            path.unlink(missing_ok=True)

    async def commit(self, sid: str, epoch: int, ref: SnapshotRef, *, suspend: bool = False,
                     turns: int = 0, unreported_loss: float | None = None,
                     suspend_reason: str | None = None) -> bool:
        """Point the session at ``ref`` if ``epoch`` is still current. With ``suspend`` the same atomic
        step moves the session to SUSPENDED and clears its worker and slot, and adds ``turns`` (the
        activation's turns no heartbeat reported yet) to the record's count, and records
        ``suspend_reason`` (one of ``models.SUSPEND_REASONS``) as the record's ``suspendReason``. Returns
        whether it committed.

        ``unreported_loss``: set when the committing activation restored older state (a lossy recovery)
        and has answered no turn since, so no client has been told of the loss: the time (Unix s) its
        state dates from (0: none came back). The record then keeps its ``reason`` and ``message`` and
        records that time as ``lostAfter``, so the next wake still says what was lost and since when
        (chaos run on ba39209: a drain right after a lossy restore cleared the loss, and the next
        answer named the drain's snapshot as the state's date). Otherwise the loss is cleared: this
        snapshot holds every turn acknowledged since the restore.
        """
        keep = max(1, self.settings.retention)
        # the snapshot also holds the answers the record carried (``carriedAnswers``)
        clear = ["carriedAnswers"] if unreported_loss is not None else ["reason", "message", "lostAfter",
                                                                          "carriedAnswers"]
        keep_loss = {"lostAfter": unreported_loss} if unreported_loss is not None else None
        if suspend:
            why = {"suspendReason": suspend_reason} if suspend_reason else {}
            ok, dropped = await self.directory.commit_snapshot(
                sid, epoch=epoch, ref=ref, states=(SessionState.SUSPENDING,), to=SessionState.SUSPENDED,
                set={**(keep_loss or {}), **why} or None, unset=("worker", "slot", *clear), retention=keep,
                add_turns=turns)
        else:
            ok, dropped = await self.directory.commit_snapshot(sid, epoch=epoch, ref=ref, retention=keep,
                                                               set=keep_loss, unset=clear)
        if not ok:
            log.warning("snapshot commit rejected (stale epoch or state)",
                        extra={"session": sid, "epoch": epoch, "key": ref.key})
            await self._delete_quietly(ref.key)
            return False
        for key in dropped:  # beyond ``snapshot.retention``; a failed delete is left to the sweep
            await self._delete_quietly(key)
        return True

    async def restore(self, sid: str, ref: SnapshotRef, workspace: Path, template: str = "",
                      owner: int | None = None) -> dict[str, Any]:
        """Download ``ref`` and restore it into ``workspace``; returns the agent state. ``owner``: the uid
        (and gid) every restored file is given to as it is created (the slot's sandbox uid), or None.

        Raises ``SnapshotCorrupt`` (checksum, truncation, foreign session, bounds, and any ``OSError``
        while extracting, reason ``os_error``; the activator then falls back to the previous good
        snapshot), ``NotFound`` (object missing, reported as corrupt: the pointer is dangling) or
        ``StoreUnavailable``.
        """
        t0 = time.perf_counter()
        try:
            # streamed: extraction runs as the bytes arrive (snapshot.archive.unpack_stream); a failure of
            # the transfer is StoreUnavailable (retried later), never mistaken for a corrupt snapshot
            _, state = await self.store.read(ref.key, functools.partial(
                unpack_stream, workspace=workspace, expect_session=sid, expect_sha256=ref.sha256, owner=owner))
        except NotFound as e:
            raise SnapshotCorrupt(f"snapshot object {ref.key!r} is missing", details={"reason": "missing"}) from e
        except OSError as e:
            if e.errno in LOCAL_ERRNOS:
                # this worker's disk is full (or out of files or memory) for the moment: the snapshot is
                # sound and stays the session's; condemning it made a few retries during a disk-full
                # minute discard every snapshot a session had (fresh-user round 15)
                raise _local_failure(f"snapshot {ref.key!r} not restored", e,
                                     "the session stays SUSPENDED with its snapshot") from e
            # name too long, ...: this snapshot cannot be restored here
            raise SnapshotCorrupt(f"snapshot {ref.key!r} cannot be restored: {public_detail(e)}",
                                  details={"reason": "os_error", "errno": e.errno}) from e
        metrics.SNAPSHOT_DURATION_SECONDS.labels(template=template, op="restore").observe(time.perf_counter() - t0)
        return state

    async def _delete_quietly(self, key: str) -> None:
        await delete_quietly(self.store, key)


async def delete_quietly(store: ObjectStore, key: str) -> bool:
    """Delete ``key``; False (logged) if the store failed: GC never fails a request, a later sweep retries."""
    try:
        await store.delete(key)
        return True
    except Exception:  # noqa: BLE001 - see above
        log.warning("snapshot delete failed", extra={"key": key}, exc_info=True)
        return False


async def delete_session_objects(store: ObjectStore, prefix: str, sid: str, *, up_to_epoch: int | None) -> int:
    """Delete the snapshot objects of deleted session ``sid`` (``snapshot.prefix`` ``prefix``): the keys
    :func:`~snapshot.store.snapshot_key` made directly under its prefix whose epoch is at most
    ``up_to_epoch`` (None: any). Returns how many were deleted; never raises (best effort: the orphan
    sweep takes what is left).

    Left alone:

    * a deeper key: another directory's whose prefix is nested here (a session ``b`` of a runtime on
      ``snapshots`` deleted the whole store of one on ``snapshots/b``, marker included: round 22);
    * any other name (the marker, foreign objects);
    * a newer epoch: a session created again under the same ID right after the delete (epochs never
      repeat for an ID) may have uploaded its first snapshots before this runs; deleting every key under
      the prefix took them too, and its wakes met "object missing" (a fresh-user run, 11 of them in
      a minute of create/delete/suspend/invoke on six IDs)."""
    deleted = 0
    try:
        under = session_prefix(prefix, sid)
        for key in await store.list_keys(under):
            name = key[len(under):]
            parsed = parse_snapshot_key(key)
            if "/" in name or name == MARKER_NAME or parsed is None:
                continue
            if up_to_epoch is not None and parsed[0] > up_to_epoch:
                continue
            deleted += await delete_quietly(store, key)
    except Exception:  # noqa: BLE001 - GC never fails a request
        log.warning("snapshot GC failed", extra={"session": sid}, exc_info=True)
    return deleted
