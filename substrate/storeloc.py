"""Which snapshot store a directory's sessions keep their snapshots in, recorded in Redis at the first
start, so that a later start configured for another place is refused instead of reading every
snapshot as missing.

A snapshot ref names an object key only, never its bucket or folder: a start with a mistyped
``SUBSTRATE_SNAPSHOT__BUCKET`` (or prefix, local folder, store kind) read each session's snapshots as
missing, set them aside as corrupt one by one, and woke the sessions empty, while the real objects sat
untouched in the right bucket, unreferenced, until the orphan sweep deleted them (fresh-user round 18).
So the first start records the configured location (``Keys.snapshot_location``) and later starts
compare: another location while the directory holds sessions is a configuration error, said in one
line before anything runs. An operator who moved the objects on purpose starts once with
``SUBSTRATE_SNAPSHOT__ACCEPT_NEW_LOCATION=true``, which records the new location. With no session in
the directory nothing can be lost and the new location is recorded silently. The endpoint URL is not
part of the location: one bucket is reached by several names (a cluster's service name, loopback).

This check reads Redis only, so ``substrate up`` can refuse in one line before anything starts. What
proves a store is this directory's is its marker object (``snapshot.guard``): a wrong endpoint, a
bucket emptied or made again, or a mistyped location accepted with the flag above is fenced there
(503, nothing condemned), not here.
"""

from __future__ import annotations

import logging
from typing import Any

from substrate.keys import Keys
from substrate.settings import SnapshotSettings

log = logging.getLogger(__name__)


def location_of(snapshot: SnapshotSettings) -> str:
    """The configured store as one string: ``s3://<bucket>/<prefix>`` or ``file://<absolute folder>``."""
    if snapshot.store == "s3":
        return f"s3://{snapshot.bucket}/{snapshot.prefix.strip('/')}"
    return f"file://{snapshot.local_dir.resolve()}"


def problem(recorded: str | None, configured: str, sessions: int) -> str | None:
    """Why a start configured for ``configured`` must not run on a directory of ``sessions`` sessions
    whose snapshots are recorded as kept in ``recorded`` (None: no objection)."""
    if recorded is None or recorded == configured or sessions == 0:
        return None
    return (f"the {sessions} session(s) in this directory keep their snapshots in {recorded}, but this start is "
            f"configured for {configured}: every snapshot would read as missing and the sessions would wake "
            "empty. Fix SUBSTRATE_SNAPSHOT__STORE, __BUCKET, __PREFIX or __LOCAL_DIR; if the snapshot objects "
            "were moved there (with their .substrate-store marker), start once with "
            "SUBSTRATE_SNAPSHOT__ACCEPT_NEW_LOCATION=true")


async def check(redis: Any, keys: Keys, snapshot: SnapshotSettings) -> str | None:
    """Compare the configured store with the one recorded for this directory (``redis``: a redis-py
    asyncio client) and record it when there is no objection (or ``snapshot.accept_new_location``).
    Returns the objection (see :func:`problem`), having changed nothing, or None. Raises redis-py's
    errors when Redis does not answer."""
    configured = location_of(snapshot)
    raw = await redis.get(keys.snapshot_location)
    recorded = raw.decode() if isinstance(raw, bytes) else raw
    if recorded == configured:
        return None
    if not snapshot.accept_new_location:
        why = problem(recorded, configured, int(await redis.zcard(keys.sessions_index)))
        if why is not None:
            return why
    if recorded is not None:
        log.warning("snapshot store location changed from %s to %s", recorded, configured)
    await redis.set(keys.snapshot_location, configured)
    return None
