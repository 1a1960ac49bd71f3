"""``snapshot.guard.GuardedStore``: a snapshot store is used only once its marker object holds the id this
directory recorded; otherwise every call is 503 and nothing is read as missing (fresh-user rounds 18 and
19: a store that was not the one the refs were written to woke sessions empty). Real Redis; moto S3 over
HTTP and the local store."""

from __future__ import annotations

import asyncio

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from snapshot.guard import GuardedStore, marker_key
from snapshot.store import LocalDirStore, S3Store
from substrate.directory import Directory
from substrate.errors import NotFound, StoreUnavailable
from substrate.models import SessionRecord, SessionState
from substrate.settings import SnapshotSettings


@pytest.fixture
def d(directory: Directory) -> Directory:
    """The shared ``directory`` fixture (tests/integration/conftest.py) under this file's short name."""
    return directory


def guarded(d: Directory, inner, settings: SnapshotSettings, recheck_s: float = 0.0) -> GuardedStore:
    return GuardedStore(inner, d.redis, d.keys, settings, recheck_s=recheck_s)


def local(root: Path) -> tuple[LocalDirStore, SnapshotSettings]:
    return LocalDirStore(root), SnapshotSettings(store="local", local_dir=root)


async def test_a_new_directory_writes_the_marker_and_every_process_then_uses_the_store(d, tmp_path: Path) -> None:
    inner, settings = local(tmp_path / "snaps")
    first = guarded(d, inner, settings)
    await first.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    recorded = await d.redis.get(d.keys.snapshot_store_id)
    assert recorded and (tmp_path / "snaps" / marker_key("snapshots")).read_text() == recorded
    other = guarded(d, LocalDirStore(tmp_path / "snaps"), settings)  # another process: a worker
    assert await other.read("snapshots/s1/a", lambda f: f.read()) == b"one"
    assert await other.list_keys("snapshots/s1/") == ["snapshots/s1/a"], "the marker is no session's object"


async def test_another_store_is_fenced_nothing_is_written_and_a_missing_object_is_not_missing(d, tmp_path) -> None:
    inner, settings = local(tmp_path / "snaps")
    await guarded(d, inner, settings).put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    wrong_inner, wrong = local(tmp_path / "snapz")  # a mistyped folder, adopted on purpose or not
    store = guarded(d, wrong_inner, wrong)
    for call in (store.read("snapshots/s1/a", lambda f: f.read()), store.put_file("snapshots/s1/b", tmp_path / "a"),
                 store.delete("snapshots/s1/a"), store.list_keys("snapshots/")):
        with pytest.raises(StoreUnavailable) as info:
            await call
        assert info.value.details["reason"] == "store_not_verified"
        assert "does not hold this directory's snapshots" in info.value.message
        # in a local store's words, not a bucket's (fresh-user round 24)
        assert "fix SUBSTRATE_SNAPSHOT__LOCAL_DIR" in info.value.message and "bucket" not in info.value.message
    assert not (tmp_path / "snapz").exists() or not any((tmp_path / "snapz").rglob("*")), "nothing written there"


async def test_a_store_emptied_after_the_check_answers_503_then_serves_again_once_its_objects_are_back(
        d, tmp_path: Path) -> None:
    inner, settings = local(tmp_path / "snaps")
    store = guarded(d, inner, settings)
    await store.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    marker = tmp_path / "snaps" / marker_key("snapshots")
    saved = marker.read_bytes()
    marker.unlink()
    (tmp_path / "snaps" / "snapshots" / "s1" / "a").unlink()  # the store was emptied under the runtime
    with pytest.raises(StoreUnavailable):  # not NotFound: the caller would condemn the snapshot
        await store.read("snapshots/s1/a", lambda f: f.read())
    marker.write_bytes(saved)  # the operator puts the objects back, the marker first (a key-ordered copy)
    with pytest.raises(StoreUnavailable) as info:  # the marker is there, the object not yet: not condemned
        await store.read("snapshots/s1/a", lambda f: f.read())
    assert info.value.details["reason"] == "object_missing" and "counts as lost only once" in info.value.message
    # the answer's Retry-After: the seconds left of the 60 s grace, capped at 10 (the copy may finish sooner),
    # carried to the router in the details (substrate.workerclient.error_from)
    assert info.value.retry_after_s == 10 and info.value.details["retry_after_s"] == 10
    await d.redis.set(d.keys.snapshot_missing("snapshots/s1/a"), repr(time.time() - 57.5))
    with pytest.raises(StoreUnavailable) as info:
        await store.read("snapshots/s1/a", lambda f: f.read())
    assert info.value.retry_after_s == 3  # 2.5 s left, rounded up
    # still missing after snapshot.missing_grace_s: now it is a missing snapshot (the caller condemns it)
    await d.redis.set(d.keys.snapshot_missing("snapshots/s1/a"), repr(time.time() - 61))
    with pytest.raises(NotFound):
        await store.read("snapshots/s1/a", lambda f: f.read())


async def test_an_object_that_came_back_gets_a_grace_of_its_own_when_it_goes_missing_again(
        d, tmp_path: Path) -> None:
    inner, settings = local(tmp_path / "snaps")
    store = guarded(d, inner, settings)
    obj = tmp_path / "snaps" / "snapshots" / "s1" / "a"
    await store.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    saved = obj.read_bytes()
    obj.unlink()
    with pytest.raises(StoreUnavailable):  # first disappearance: its grace starts
        await store.read("snapshots/s1/a", lambda f: f.read())
    sighting = d.keys.snapshot_missing("snapshots/s1/a")
    assert 0 < await d.redis.ttl(sighting) <= 2 * settings.missing_grace_s
    await d.redis.set(sighting, repr(time.time() - 50))  # most of the grace has passed...
    obj.write_bytes(saved)  # ...when the copy brings it back
    assert await store.read("snapshots/s1/a", lambda f: f.read()) == b"one"
    assert not await d.redis.exists(sighting)  # found again: the sighting is gone
    obj.unlink()  # missing again: a new grace, not condemned at once on the old sighting
    with pytest.raises(StoreUnavailable) as info:
        await store.read("snapshots/s1/a", lambda f: f.read())
    assert info.value.details["reason"] == "object_missing"


async def test_a_start_pointed_at_another_directorys_store_does_not_keep_it_as_its_own(d, tmp_path: Path) -> None:
    """Fresh-user round 25: a new directory started by mistake on another deployment's snapshot folder had
    that folder recorded as its store; fenced (another's marker), its corrected start was then refused as
    "the sessions keep their snapshots in" that folder, where they had none."""
    from substrate import storeloc

    inner, settings = local(tmp_path / "theirs")
    await guarded(d, inner, settings).ready()  # another directory's store, with its marker
    await d.redis.delete(d.keys.snapshot_store_marked, d.keys.snapshot_location)
    await d.redis.set(d.keys.snapshot_store_id, "a-new-directory")  # this directory: new, its own id
    assert await storeloc.check(d.redis, d.keys, settings) is None  # the start records it (nothing to lose)
    with pytest.raises(StoreUnavailable) as info:
        await guarded(d, LocalDirStore(tmp_path / "theirs"), settings).ready()
    assert "holds another directory's snapshots" in info.value.message
    assert await d.redis.get(d.keys.snapshot_location) is None, "not this directory's store: forgotten"
    await _a_session(d)
    _, mine = local(tmp_path / "mine")
    assert await storeloc.check(d.redis, d.keys, mine) is None  # the corrected start is not refused


async def test_a_marker_of_another_directory_fences_the_store(d, tmp_path: Path) -> None:
    inner, settings = local(tmp_path / "snaps")
    await guarded(d, inner, settings).ready()
    await d.redis.set(d.keys.snapshot_store_id, "someone-else")
    with pytest.raises(StoreUnavailable) as info:
        await guarded(d, LocalDirStore(tmp_path / "snaps"), settings).ready()
    assert "holds another directory's snapshots" in info.value.message
    # a tenant's 503 names the reason, not where the deployment keeps its snapshots (the log does)
    assert str(tmp_path) not in info.value.message and "<internal>" in info.value.message


async def test_s3_a_new_directory_makes_its_bucket_and_a_recorded_one_never_makes_it_again(
        d, s3_store_factory: Callable[..., S3Store], tmp_path: Path) -> None:
    inner = s3_store_factory()
    settings = SnapshotSettings(store="s3", bucket=inner.bucket)
    await guarded(d, inner, settings).put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    # the same bucket name on another endpoint (or deleted and made again): it does not exist there
    elsewhere = s3_store_factory()
    elsewhere.bucket = inner.bucket + "-x"
    with pytest.raises(StoreUnavailable) as info:
        await guarded(d, elsewhere, SnapshotSettings(store="s3", bucket=elsewhere.bucket)).read(
            "snapshots/s1/a", lambda f: f.read())
    assert "its bucket does not exist" in info.value.message
    assert elsewhere.bucket not in [b["Name"] for b in elsewhere._client.list_buckets()["Buckets"]]


async def _a_session(d: Directory) -> None:
    """A session in the directory: from now on a store without its marker may hold what it would lose."""
    now = time.time()
    await d.create_session(SessionRecord(id="s1", state=SessionState.SUSPENDED, actorTemplate="counter",
                                         pool="default", createdAt=now, updatedAt=now, lastActiveAt=now))


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


async def test_a_second_directory_never_adopts_a_store_that_holds_another_ones_marker(d, redis_url, tmp_path) -> None:
    """Fresh-user round 20: a runtime with another SUBSTRATE_REDIS__KEY_PREFIX on the same bucket and prefix
    adopted the marker it found, and its orphan sweep deleted the first directory's snapshots."""
    inner, settings = local(tmp_path / "snaps")
    await guarded(d, inner, settings).put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    other = Directory(redis_url, f"sg{uuid.uuid4().hex[:8]}")
    try:
        store = guarded(other, LocalDirStore(tmp_path / "snaps"), settings)
        with pytest.raises(StoreUnavailable) as info:
            await store.list_keys("snapshots/")  # what the orphan sweep does first
        assert "holds another directory's snapshots" in info.value.message
    finally:
        async for key in other.redis.scan_iter(f"{other.keys.prefix}:*"):
            await other.redis.delete(key)
        await other.close()
    assert (tmp_path / "snaps" / "snapshots" / "s1" / "a").read_bytes() == b"one"


async def test_an_upload_into_a_store_emptied_since_the_check_is_refused(d, tmp_path: Path) -> None:
    """Fresh-user round 20: a suspend into a bucket emptied after the check was written there (202), and
    once the objects were put back its session fell back to an older snapshot."""
    inner, settings = local(tmp_path / "snaps")
    store = guarded(d, inner, settings, recheck_s=60)
    await store.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    (tmp_path / "snaps" / marker_key("snapshots")).unlink()  # emptied under the runtime
    with pytest.raises(StoreUnavailable):
        await store.put_file("snapshots/s1/b", _file(tmp_path / "b", b"two"))
    assert not (tmp_path / "snaps" / "snapshots" / "s1" / "b").exists()


async def test_the_location_of_an_accepted_move_is_recorded_once_the_marker_matched(d, tmp_path: Path) -> None:
    from substrate import storeloc

    inner, settings = local(tmp_path / "snaps")
    await guarded(d, inner, settings).ready()
    await _a_session(d)
    import shutil

    shutil.copytree(tmp_path / "snaps", tmp_path / "moved")  # a deliberate move, marker included
    moved = SnapshotSettings(store="local", local_dir=tmp_path / "moved", accept_new_location=True)
    assert await storeloc.check(d.redis, d.keys, moved) is None
    await guarded(d, LocalDirStore(tmp_path / "moved"), moved).ready()
    plain = SnapshotSettings(store="local", local_dir=tmp_path / "moved")
    assert await storeloc.check(d.redis, d.keys, plain) is None, "later starts need no flag"


async def test_s3_a_bucket_deleted_under_a_running_store_fences_it_and_says_so(
        d, s3_store_factory: Callable[..., S3Store], tmp_path: Path, caplog) -> None:
    """Fresh-user round 20: with the bucket deleted, calls answered 503 but the log said nothing."""
    inner = s3_store_factory()
    store = guarded(d, inner, SnapshotSettings(store="s3", bucket=inner.bucket), recheck_s=60)
    await store.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    for o in inner._client.list_objects_v2(Bucket=inner.bucket)["Contents"]:
        inner._client.delete_object(Bucket=inner.bucket, Key=o["Key"])
    inner._client.delete_bucket(Bucket=inner.bucket)
    with caplog.at_level("ERROR", logger="snapshot.guard"), pytest.raises(StoreUnavailable):
        await store.read("snapshots/s1/a", lambda f: f.read())
    assert store.fenced is not None and "its bucket does not exist" in store.fenced
    assert any("its bucket does not exist" in r.getMessage() for r in caplog.records)
    with pytest.raises(StoreUnavailable):  # fenced: not even tried until the recheck
        await store.delete("snapshots/s1/a")


class _Down:
    """A store that cannot be reached until ``up`` is set (then it is ``inner``)."""

    def __init__(self, inner) -> None:
        self.inner, self.up = inner, False

    def __getattr__(self, name):
        async def call(*a, **kw):
            if not self.up:
                raise StoreUnavailable("snapshot store unavailable: connection refused")
            return await getattr(self.inner, name)(*a, **kw)
        return call


async def test_a_store_down_at_the_first_start_gets_its_marker_once_it_answers(d, tmp_path: Path) -> None:
    """Fresh-user round 21: the id was claimed while the store was down; once a session existed the
    directory no longer counted as new, so the marker was never written and the store fenced for good."""
    inner, settings = local(tmp_path / "snaps")
    down = _Down(inner)
    store = guarded(d, down, settings)
    with pytest.raises(StoreUnavailable):
        await store.ready()
    await _a_session(d)  # sessions are created meanwhile (their suspends fail)
    down.up = True
    await store.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    assert (tmp_path / "snaps" / marker_key("snapshots")).read_text() == await d.redis.get(d.keys.snapshot_store_id)


class _BothRead:
    """``redis`` whose first ``get`` of each of two callers returns only once both have read: the two
    starts read the same record before either writes (two processes' round trips interleaving so)."""

    def __init__(self, redis) -> None:  # type: ignore[no-untyped-def]
        self.redis, self.barrier, self.waited = redis, asyncio.Barrier(2), 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.redis, name)

    async def get(self, key):  # type: ignore[no-untyped-def]
        value = await self.redis.get(key)
        if self.waited < 2:
            self.waited += 1
            await self.barrier.wait()
        return value


@pytest.mark.parametrize("before", ["none", "an old store"])
async def test_two_starts_reading_one_record_with_their_own_stores_do_not_both_run(d, tmp_path: Path,
                                                                                   before: str) -> None:
    """Two ``substrate up`` on one Redis and key prefix, each with its own snapshot store, that read the
    same record (none, or a stopped runtime's store with no session left) before either wrote: both wrote
    their own and both ran on one pool. The write is a compare-and-set now: one runs, the other is
    refused naming the store the first recorded; a third with the winner's store is not."""
    from substrate import storeloc

    if before != "none":
        _, old = local(tmp_path / "old")
        assert await storeloc.check(d.redis, d.keys, old) is None
    _, a = local(tmp_path / "a")
    _, b = local(tmp_path / "b")
    r = _BothRead(d.redis)
    answers = await asyncio.gather(storeloc.check(r, d.keys, a), storeloc.check(r, d.keys, b))
    assert sorted(x is None for x in answers) == [False, True], answers
    refused = next(x for x in answers if x is not None)
    winner = a if answers[0] is None else b
    assert "recorded its snapshot store" in refused and "just now" in refused
    assert storeloc.location_of(winner).rpartition("/")[0] in refused
    assert await storeloc.check(d.redis, d.keys, winner) is None


async def test_a_running_runtime_holds_its_store_until_it_stops_or_its_hold_lapses(d, tmp_path: Path) -> None:
    """A runtime whose pool has no worker yet (``minReplicas: 0``, no session) looked stopped: a second
    start with another store recorded its store over the first's and both ran on one pool. A running
    runtime holds its store now: another store is refused until it lets go (a clean stop) or its hold
    lapses (``HOLD_S`` after its last renewal); the same store may start beside it."""
    from substrate import storeloc

    _, a = local(tmp_path / "a")
    _, b = local(tmp_path / "b")
    assert await storeloc.check(d.redis, d.keys, a, holding=True) is None  # runtime A runs
    theirs = storeloc.HOLDER_ID
    try:
        storeloc.HOLDER_ID = "runtime-b"  # another process
        why = await storeloc.check(d.redis, d.keys, b, holding=True)
        assert why is not None and "is running with its snapshots in" in why
        assert storeloc.location_of(a).rpartition("/")[0] in why
        assert await storeloc.check(d.redis, d.keys, b) == why, "the read-only check of `up` says it too"
        held = await d.redis.hgetall(d.keys.snapshot_location_holders)
        assert set(held) == {theirs}, "the refused start holds nothing"
        assert await storeloc.check(d.redis, d.keys, a, holding=True) is None, "the same store may join"
        # A's hold lapses (it died without letting go): B may start
        assert await storeloc.hold(d.redis, d.keys, b, now=time.time() + storeloc.HOLD_S + 1) is None
        storeloc.HOLDER_ID = theirs
        assert await storeloc.hold(d.redis, d.keys, a) is not None, "A, back, finds B holding another store"
        storeloc.HOLDER_ID = "runtime-b"
        await storeloc.release(d.redis, d.keys)  # B stops cleanly
        storeloc.HOLDER_ID = theirs
        assert await storeloc.hold(d.redis, d.keys, a) is None
    finally:
        storeloc.HOLDER_ID = theirs


async def test_s3_a_bucket_lost_for_good_is_adopted_and_serves_again_in_every_process(
        d, s3_store_factory: Callable[..., S3Store], tmp_path: Path) -> None:
    """Fresh-user tester 54: the bucket was deleted and made again empty; every suspend answered 503 until
    every session was deleted and the runtime restarted. ``adopt`` writes the marker (the bucket made
    first if missing); this process serves at once, another (a worker) at its next check."""
    inner = s3_store_factory()
    settings = SnapshotSettings(store="s3", bucket=inner.bucket)
    store = guarded(d, inner, settings, recheck_s=60)
    await store.put_file("snapshots/s1/a", _file(tmp_path / "a", b"one"))
    await _a_session(d)
    worker = guarded(d, s3_store_factory(), settings)  # another process on the same bucket
    worker.inner.bucket = inner.bucket
    await worker.ready()
    for o in inner._client.list_objects_v2(Bucket=inner.bucket)["Contents"]:
        inner._client.delete_object(Bucket=inner.bucket, Key=o["Key"])
    inner._client.delete_bucket(Bucket=inner.bucket)  # lost for good
    with pytest.raises(StoreUnavailable):
        await store.put_file("snapshots/s2/a", _file(tmp_path / "b", b"two"))
    assert store.status()["fenced"] is not None and store.status()["verified"] is False
    assert "substrate store adopt --yes" in (store.status()["fenced"] or ""), "the way out is named"
    out = await store.adopt()
    assert out == {"adopted": True, "location": f"s3://{inner.bucket}/snapshots"}
    assert store.status() == {"location": out["location"], "verified": True, "fenced": None}
    await store.put_file("snapshots/s2/a", _file(tmp_path / "b", b"two"))  # suspends work again
    assert await worker.read("snapshots/s2/a", lambda f: f.read()) == b"two"
    assert await store.adopt() == {"adopted": False, "location": out["location"]}, "a second adopt writes nothing"


async def test_adopting_a_store_that_holds_another_directorys_marker_is_refused_and_writes_nothing(
        d, tmp_path: Path) -> None:
    from substrate.errors import Conflict

    inner, settings = local(tmp_path / "snaps")
    await guarded(d, inner, settings).ready()
    marker = tmp_path / "snaps" / marker_key("snapshots")
    marker.write_text("another-directory")
    store = guarded(d, LocalDirStore(tmp_path / "snaps"), settings)
    with pytest.raises(Conflict) as info:
        await store.adopt()
    assert info.value.code == "store_taken" and info.value.status == 409
    assert marker.read_text() == "another-directory"
    assert not store.verified


async def test_a_store_that_stops_answering_is_unreachable_not_fenced(d, tmp_path: Path) -> None:
    """Fresh-user tester 55: with the S3 endpoint down, the status said "verified", no word of it. The
    check of a verified store reads the marker again, and a store that does not answer raises without
    fencing (``GET /v1/snapshotstore`` then answers ``reachable: false`` with the error)."""
    inner, settings = local(tmp_path / "snaps")
    down = _Down(inner)
    down.up = True
    store = guarded(d, down, settings)
    await store.check_now()
    assert store.status()["verified"] is True
    down.up = False
    with pytest.raises(StoreUnavailable) as info:
        await store.check_now()
    assert "connection refused" in info.value.message and store.fenced is None
