"""A snapshot store that proves it is this directory's before it is used: a marker object.

A snapshot ref names an object key only, never the store. So a store that is not the one the refs
were written to (another S3 endpoint with a bucket of the same name, a bucket deleted and made again
empty, a mistyped bucket adopted on purpose) answered every wake "object missing": the snapshot was
set aside as corrupt, the session fell back to its previous one and then woke empty, while the real
objects sat untouched elsewhere until the orphan sweep deleted them (fresh-user rounds 18 and 19).

``GuardedStore`` wraps the real store. The first use in a directory writes a marker object,
``<prefix>/.substrate-store`` holding a random id, and records the id in Redis
(``Keys.snapshot_store_id``). Every process then checks, before its first use of the store, that the
marker there holds the recorded id:

* it does: the store is used as it is (no cost on later calls);
* no id recorded yet (a new directory, or one from before markers): the marker found is adopted, or one
  is written (the bucket created first when ``snapshot.create_bucket``);
* the marker is missing or holds another id, or the bucket does not exist: the store is **fenced**.
  Every call answers ``StoreUnavailable`` (503 ``snapshot_store_unavailable``) saying why; nothing is
  read, written or deleted, so no session's snapshot is condemned and none is written where it would
  be lost. The check runs again at most every ``recheck_s``: once the operator fixes the settings or
  puts the objects back (a move that copies the objects copies the marker too), the store serves again.

A read that finds its object missing checks the marker again before it answers: if the marker is gone
too, the store was emptied or replaced, and the read answers ``StoreUnavailable`` instead of
``snapshot_missing`` (which the caller reports as corrupt). Only a missing object in a store that still
holds this directory's marker is a missing snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from substrate.errors import Conflict, NotFound, StoreUnavailable
from substrate.keys import Keys
from substrate.settings import SnapshotSettings
from substrate.storeloc import location_of

log = logging.getLogger(__name__)

T = TypeVar("T")

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
        self._checked_at = float("-inf")
        self._lock = asyncio.Lock()

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
                raise StoreUnavailable(self.fenced, details={"reason": "store_not_verified"})
            self._checked_at = time.monotonic()
            await self._check()

    async def _check(self) -> None:
        try:
            recorded = await self.redis.get(self.keys.snapshot_store_id)
        except Exception as e:  # noqa: BLE001 - Redis down: checked again at the next call
            raise StoreUnavailable(f"snapshot store not checked yet: Redis did not answer ({e.__class__.__name__})",
                                   details={"reason": "store_not_verified"}) from e
        recorded = recorded.decode() if isinstance(recorded, bytes) else recorded
        marker = await self._read_marker(create_bucket=recorded is None and self.settings.create_bucket)
        if recorded is None:
            if marker is None:
                marker = await self._write_marker(uuid.uuid4().hex)
            await self.redis.set(self.keys.snapshot_store_id, marker, nx=True)
            recorded = await self.redis.get(self.keys.snapshot_store_id)
            recorded = recorded.decode() if isinstance(recorded, bytes) else recorded
        where = location_of(self.settings)
        if marker == recorded:
            if self.fenced is not None:
                log.warning("snapshot store %s holds this directory's snapshots again: serving", where)
            self.fenced, self.verified = None, True
            return
        if marker is None:
            why = (f"the snapshot store {where} does not hold this directory's snapshots: its marker object "
                   f"{self.marker!r} is missing (another endpoint with a bucket of that name, or the bucket was "
                   "emptied or made again); fix SUBSTRATE_SNAPSHOT__ENDPOINT_URL, __BUCKET or __PREFIX, or put "
                   "the objects back: wakes and suspends answer 503 until then")
        else:
            why = (f"the snapshot store {where} holds another directory's snapshots (its marker {self.marker!r} "
                   "names another directory): fix SUBSTRATE_SNAPSHOT__ENDPOINT_URL, __BUCKET or __PREFIX, or "
                   "SUBSTRATE_REDIS__KEY_PREFIX: wakes and suspends answer 503 until then")
        if why != self.fenced:
            log.error("%s", why)
        self.fenced, self.verified = why, False
        raise StoreUnavailable(why, details={"reason": "store_not_verified"})

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
                where = location_of(self.settings)
                raise StoreUnavailable(f"the snapshot store {where}: its bucket does not exist; fix "
                                       "SUBSTRATE_SNAPSHOT__ENDPOINT_URL or __BUCKET, or make the bucket and put "
                                       "the objects back: wakes and suspends answer 503 until then",
                                       details={"reason": "store_not_verified"}) from e
            await self.inner.ensure_bucket()
            return None

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
        await self.inner.put_file(key, path)

    async def read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        await self.ready()
        try:
            return await self.inner.read(key, consume)
        except NotFound:
            # a missing object, or a store emptied or replaced since the check: look at the marker again
            async with self._lock:
                self.verified = False
                self._checked_at = time.monotonic()
                await self._check()
            raise

    async def delete(self, key: str) -> None:
        await self.ready()
        await self.inner.delete(key)

    async def list_keys(self, prefix: str) -> list[str]:
        await self.ready()
        return await self.inner.list_keys(prefix)
