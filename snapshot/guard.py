"""A snapshot store that proves it is this directory's before it is used: a marker object.

A snapshot ref names an object key only, never the store. So a store that is not the one the refs
were written to (another S3 endpoint with a bucket of the same name, a bucket deleted and made again
empty, a mistyped bucket adopted on purpose) answered every wake "object missing": the snapshot was
set aside as corrupt, the session fell back to its previous one and then woke empty, while the real
objects sat untouched elsewhere until the orphan sweep deleted them (fresh-user rounds 18 and 19).

``GuardedStore`` wraps the real store. A directory's id is claimed in Redis
(``Keys.snapshot_store_id``, ``SET NX``: its processes agree on one) and written into a marker object,
``<prefix>/.substrate-store``. Every process checks, before its first use of the store, that the marker
there holds that id:

* it does: the store is used, and its location recorded as the directory's (``substrate.storeloc``);
* no marker, in a directory whose store never showed its marker (a new one, or one whose store was out
  of reach at every check so far) or that holds no session (nothing can be lost): the marker is
  written (the bucket made first, with ``snapshot.create_bucket``);
* no marker in a directory with sessions whose store showed it before, a marker holding another id (another runtime, or another
  ``SUBSTRATE_REDIS__KEY_PREFIX``, uses this store: adopting its marker let that directory's orphan
  sweep delete the first one's snapshots, fresh-user round 20), or no bucket: the store is **fenced**.
  Every call answers ``StoreUnavailable`` (503 ``snapshot_store_unavailable``) saying why, logged once;
  nothing is read, written or deleted, so no session's snapshot is condemned and none is written where
  it would be lost. The check runs again at most every ``recheck_s``: once the settings are fixed or
  the objects put back (a move that copies the objects copies the marker too), the store serves again.

The marker is read again before each upload (a suspend into a bucket emptied since the check wrote a
snapshot that no wake would find beside the others) and before each listing (the orphan sweep), and a
read that finds its object missing checks it again before it answers: if the marker is gone too, the
store was emptied or replaced, and the read answers ``StoreUnavailable`` instead of
``snapshot_missing`` (which the caller reports as corrupt). Only a missing object in a store that
still holds this directory's marker is a missing snapshot, and only once it has been missing
``snapshot.missing_grace_s`` (first sighting kept in Redis for twice the grace, deleted by a read that
finds the object again; the 503 meanwhile carries ``Retry-After`` of the seconds left, at most 10): the marker proves which store this is, not
that its objects are all there (a copy that put the marker back first, as key order does, condemned the
snapshots still on their way, round 21). What this cannot tell apart: a bucket put
back from an older copy holds the marker, so a session whose newer snapshot is missing from it falls
back to the older one (and its answer says so, ``X-Substrate-Restored: snapshot_corrupt``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from substrate.errors import Conflict, NotFound, StoreUnavailable, hide_internal
from substrate.keys import Keys
from substrate.settings import SnapshotSettings
from substrate import storeloc
from substrate.storeloc import location_of

log = logging.getLogger(__name__)

T = TypeVar("T")
#: the longest Retry-After while a missing object is in its grace (s): a copy under way may finish sooner
_MISSING_RETRY_CAP_S = 10

#: the marker object's name, under the store's prefix (the orphan sweep reads ``<prefix>/<session>/...``
#: only, so it never takes the marker for garbage)
MARKER_NAME = ".substrate-store"


def marker_key(prefix: str) -> str:
    """The marker object's key for the store-wide ``prefix`` (``SnapshotSettings.prefix``)."""
    prefix = prefix.strip("/")
    return f"{prefix}/{MARKER_NAME}" if prefix else MARKER_NAME


class GuardedStore:
    """An ``ObjectStore`` (``snapshot.store``) that is used only once its marker matches the directory's
    (module docstring). ``inner``: the real store; ``redis``/``keys``: the directory's Redis (a redis-py
    asyncio client) and key names. Each method raises what ``inner``'s does, and ``StoreUnavailable``
    while the store is fenced or cannot be checked."""

    def __init__(self, inner: Any, redis: Any, keys: Keys, settings: SnapshotSettings, *,
                 recheck_s: float = 5.0) -> None:
        self.inner = inner
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.recheck_s = recheck_s
        self.marker = marker_key(settings.prefix)
        #: why the store is fenced, or None; ``verified``: the marker matched at the last check
        self.fenced: str | None = None
        self.verified = False
        #: this directory's id as the last check that matched read it (the marker must hold it)
        self._id: str | None = None
        self._checked_at = float("-inf")
        self._lock = asyncio.Lock()
        #: object keys this process found missing (a first sighting in Redis): a later read that finds
        #: the object deletes the sighting, so a second disappearance gets its own grace
        self._sighted: set[str] = set()

    def __getattr__(self, name: str) -> Any:  # the real store's other attributes (ensure_bucket, close, ...)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------------------------------ check
    async def ready(self) -> None:
        """Return once the store is verified; raise ``StoreUnavailable`` (why) while it is fenced, or
        when the store or Redis cannot be reached for the check."""
        if self.verified:
            return
        async with self._lock:
            if self.verified:
                return
            if self.fenced is not None and time.monotonic() - self._checked_at < self.recheck_s:
                raise StoreUnavailable(hide_internal(self.fenced), details={"reason": "store_not_verified"})
            self._checked_at = time.monotonic()
            await self._check()

    async def _check(self) -> None:
        try:
            recorded = await self._directory_id()
            # no store ever showed this directory's marker (a new directory, or its store was out of reach
            # at every check so far: a store down at the first start was fenced for good once a session
            # existed, fresh-user round 21), or it holds no session: nothing can be lost
            new = await self._get(self.keys.snapshot_store_marked) is None
            sessions = int(await self.redis.zcard(self.keys.sessions_index))
        except StoreUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - Redis down: checked again at the next call
            raise StoreUnavailable(f"snapshot store not checked yet: Redis did not answer ({e.__class__.__name__})",
                                   details={"reason": "store_not_verified"}) from e
        assert recorded is not None
        # a bucket is made only where nothing can be lost: a new directory, or one with no session
        marker = await self._read_marker(create_bucket=(new or sessions == 0) and self.settings.create_bucket)
        if marker is None and (new or sessions == 0):
            marker = await self._write_marker(recorded)
        where = location_of(self.settings)
        if marker == recorded:
            self._id = recorded
            if self.fenced is not None:
                log.warning("snapshot store %s holds this directory's snapshots again: serving", where)
            self.fenced, self.verified = None, True
            try:
                await self.redis.set(self.keys.snapshot_store_marked, "1")
                await storeloc.record(self.redis, self.keys, self.settings)
            except Exception:  # noqa: BLE001 - recorded at the next check
                log.warning("recording the snapshot store's location failed", exc_info=True)
            return
        s3 = self.settings.store == "s3"  # the words of the store at hand (a local one was told of buckets)
        if marker is None:
            why = (f"the snapshot store {where} does not hold this directory's snapshots: its marker object "
                   f"{self.marker!r} is missing ("
                   + ("another endpoint with a bucket of that name, or the bucket was emptied or made again); fix "
                      "SUBSTRATE_SNAPSHOT__ENDPOINT_URL or __BUCKET" if s3 else
                      "another folder, or the folder was emptied or made again); fix SUBSTRATE_SNAPSHOT__LOCAL_DIR "
                      "(or SUBSTRATE_DATA_DIR)")
                   + ", or put the objects back: wakes and suspends answer 503 until then; if they are gone for "
                     "good, `substrate store adopt --yes` (POST /v1/snapshotstore/adopt) takes this store as this "
                     "directory's")
        else:
            if new:  # never this directory's store: the location recorded at the start named it by mistake
                try:
                    await storeloc.forget(self.redis, self.keys, self.settings)
                except Exception:  # noqa: BLE001 - Redis down: the start-up check says so, clearly, later
                    log.debug("could not forget the recorded snapshot location", exc_info=True)
            why = (f"the snapshot store {where} holds another directory's snapshots (its marker {self.marker!r} "
                   "is not this directory's: another runtime, or another SUBSTRATE_REDIS__KEY_PREFIX, uses it); "
                   f"give each directory its own {'bucket' if s3 else 'folder'} or SUBSTRATE_SNAPSHOT__PREFIX: wakes "
                   "and suspends answer 503 until then. If instead this directory's Redis lost its data (flushed, "
                   "or restarted without persistence: its sessions went with it) and no other runtime uses the "
                   f"store: delete the marker object {self.marker!r} from the store (the old snapshots stay, "
                   "unreferenced), then run `substrate store adopt --yes` (POST /v1/snapshotstore/adopt), or "
                   "restart: the store is then taken as new")
        self._fence(why)

    def status(self) -> dict[str, Any]:
        """This process's view of the store, no I/O: ``{"location": str, "verified": bool, "fenced": str |
        None}`` (``fenced``: why it is not used). For an admin's eyes: the location and the reason are
        whole, as the log has them."""
        return {"location": location_of(self.settings), "verified": self.verified, "fenced": self.fenced}

    async def check_now(self) -> None:
        """Check the store now: the marker is read again (one small object) even when the last check
        matched, so a store emptied since is found out here, not only at this process's next upload.
        Raises ``StoreUnavailable`` while it is fenced (a fenced store is checked again at most every
        ``recheck_s``)."""
        await self.ready()
        await self._still_ours()

    async def adopt(self) -> dict[str, Any]:
        """Take the store as this directory's where its marker is missing: write the marker (the bucket
        made first if it does not exist), and serve at once here; the runtime's other processes serve
        again at their next check (``recheck_s``, 5 s). For objects that are gone for good (a bucket
        deleted or emptied, a folder lost): the fence waits for them to come back, which they never will,
        and deleting every session, then restarting, was the only way out (fresh-user tester 54). A
        session whose snapshot went with them falls back at its next wake, once the object has been
        missing ``snapshot.missing_grace_s``, to an earlier snapshot or to a fresh start, and its answer
        says so (module docstring).

        Returns ``{"adopted": bool, "location": str}`` (False: the marker was this directory's already,
        nothing written). Raises ``Conflict`` (409 ``store_taken``) for a marker holding another
        directory's id (adopting it would let this directory's orphan sweep delete the other's
        snapshots: see the fence's message for a directory whose Redis lost its data), and
        ``StoreUnavailable`` if the store or Redis does not answer."""
        async with self._lock:
            try:
                recorded = await self._directory_id()
            except Exception as e:  # noqa: BLE001 - Redis down: nothing written
                raise StoreUnavailable(f"snapshot store not adopted: Redis did not answer ({e.__class__.__name__})",
                                       details={"reason": "store_not_verified"}) from e
            assert recorded is not None
            marker = await self._read_marker(create_bucket=True)
            adopted = marker is None
            if marker is None:
                marker = await self._write_marker(recorded)
            if marker != recorded:
                raise Conflict(
                    f"the snapshot store {location_of(self.settings)} holds another directory's marker "
                    f"({self.marker!r}): another runtime, or another SUBSTRATE_REDIS__KEY_PREFIX, uses it, and "
                    "adopting it would let this one's orphan sweep delete that one's snapshots; give each its own "
                    f"{'bucket' if self.settings.store == 's3' else 'folder'} or SUBSTRATE_SNAPSHOT__PREFIX",
                    code="store_taken")
            if adopted:
                log.warning("snapshot store %s adopted: its marker was missing and is written now; sessions "
                            "whose snapshots are not there fall back at their next wake", location_of(self.settings))
            self.verified = False
            await self._check()  # the marker matches now: verified, and its location recorded
        return {"adopted": adopted, "location": location_of(self.settings)}

    def _fence(self, why: str) -> None:
        """Fence the store for ``why`` (logged once per reason) and raise ``StoreUnavailable``."""
        if why != self.fenced:
            log.error("%s", why)
        self.fenced, self.verified = why, False
        self._checked_at = time.monotonic()
        # the log has the store's location; a tenant's 503 has the reason without it
        raise StoreUnavailable(hide_internal(why), details={"reason": "store_not_verified"})

    async def _directory_id(self) -> str | None:
        """This directory's id, claimed in Redis first if there is none (``SET NX``: its processes agree on
        one). Raises what Redis raises."""
        recorded = await self._get(self.keys.snapshot_store_id)
        if recorded is None:
            await self.redis.set(self.keys.snapshot_store_id, uuid.uuid4().hex, nx=True)
            recorded = await self._get(self.keys.snapshot_store_id)
        return recorded

    async def _get(self, key: str) -> str | None:
        raw = await self.redis.get(key)
        return raw.decode() if isinstance(raw, bytes) else raw

    async def _still_ours(self) -> None:
        """Read the marker again (one small object) and fence the store if it is gone or changed: before
        an upload (a suspend into a bucket emptied since the check wrote a snapshot no wake would find
        with the others) and before the orphan sweep lists the store."""
        marker = await self._read_marker(create_bucket=False)
        if marker is None or marker != self._id:
            self.verified = False
            async with self._lock:
                await self._check()

    async def _read_marker(self, *, create_bucket: bool) -> str | None:
        """The marker's content, or None if it is missing; with ``create_bucket``, a bucket that does
        not exist is created first (a new directory). Raises ``StoreUnavailable``."""
        try:
            return (await self.inner.read(self.marker, lambda f: f.read())).decode(errors="replace").strip()
        except NotFound:
            return None
        except StoreUnavailable as e:
            if (e.details or {}).get("s3Code") != "NoSuchBucket":
                raise
            if not create_bucket:
                self._fence(self._no_bucket())
            await self.inner.ensure_bucket()
            return None

    def _no_bucket(self) -> str:
        return (f"the snapshot store {location_of(self.settings)}: its bucket does not exist; fix "
                "SUBSTRATE_SNAPSHOT__ENDPOINT_URL or __BUCKET, or make the bucket and put the objects back: "
                "wakes and suspends answer 503 until then; if they are gone for good, `substrate store adopt "
                "--yes` (POST /v1/snapshotstore/adopt) makes the bucket and takes it as this directory's")

    async def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` of the real store; a bucket found missing fences the store (and says so in the log)."""
        try:
            return await fn(*args)
        except StoreUnavailable as e:
            if (e.details or {}).get("s3Code") == "NoSuchBucket":
                async with self._lock:
                    self._fence(self._no_bucket())
            raise

    async def _write_marker(self, content: str) -> str:
        """Write the marker with ``content`` unless one exists; the content the marker holds then."""
        fd, tmp = tempfile.mkstemp(prefix="marker-")
        try:
            os.write(fd, content.encode())
            os.close(fd)
            try:
                await self.inner.put_file(self.marker, Path(tmp))
                return content
            except Conflict:  # another process wrote it first: theirs counts
                found = await self._read_marker(create_bucket=False)
                return found if found is not None else content
        finally:
            os.unlink(tmp)

    # -------------------------------------------------------------------------------- the store's calls
    async def put_file(self, key: str, path: Path) -> None:
        await self.ready()
        await self._still_ours()
        await self._call(self.inner.put_file, key, path)

    async def read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        await self.ready()
        try:
            out = await self._call(self.inner.read, key, consume)
        except NotFound as e:
            # a missing object, or a store emptied or replaced since the check: look at the marker again
            async with self._lock:
                self.verified = False
                await self._check()
            await self._missing_long_enough(key, e)
            raise
        if self._sighted and key in self._sighted:  # it came back (a copy finished): forget the sighting
            self._sighted.discard(key)
            try:
                await self.redis.delete(self.keys.snapshot_missing(key))
            except Exception:  # noqa: BLE001 - it expires on its own (2x the grace)
                log.debug("could not delete a missing-object sighting", exc_info=True)
        return out

    async def _missing_long_enough(self, key: str, cause: NotFound) -> None:
        """Return if ``key`` has been missing at least ``snapshot.missing_grace_s`` (first seen missing now
        or earlier, kept in Redis); else raise ``StoreUnavailable``: the marker proves which store this
        is, not that its objects are all there (a copy that put the marker back first condemned the
        snapshots still on their way, round 21)."""
        grace = self.settings.missing_grace_s
        if grace <= 0:
            return
        now = time.time()
        try:
            k = self.keys.snapshot_missing(key)
            # kept twice the grace: long enough to condemn a lasting loss, short enough that an object
            # missing again much later (found in between by another process) gets a grace of its own
            await self.redis.set(k, repr(now), nx=True, ex=max(1, math.ceil(grace * 2)))
            self._sighted.add(key)
            first = float(await self._get(k) or now)
        except Exception as e:  # noqa: BLE001 - Redis down: not condemned now
            raise StoreUnavailable(f"snapshot object {key!r} is missing; not condemned while Redis does not answer",
                                   details={"reason": "object_missing", "key": key}) from e
        if now - first < grace:
            left_s = grace - (now - first)
            # a retry that soon may find the copy done; one every second for the whole grace only loads the store
            retry_s = float(min(max(1, math.ceil(left_s)), _MISSING_RETRY_CAP_S))
            raise StoreUnavailable(
                f"snapshot object {key!r} is missing from {location_of(self.settings)}; it counts as lost only "
                f"once it has been missing {grace:g} s (SUBSTRATE_SNAPSHOT__MISSING_GRACE_S; a copy or move of the "
                f"store may be under way): 503 until then, {left_s:.0f} s left",
                retry_after_s=retry_s,
                details={"reason": "object_missing", "key": key, "retry_after_s": retry_s}) from cause

    async def delete(self, key: str) -> None:
        await self.ready()
        await self._call(self.inner.delete, key)

    async def list_keys(self, prefix: str) -> list[str]:
        await self.ready()
        await self._still_ours()
        return await self._call(self.inner.list_keys, prefix)
