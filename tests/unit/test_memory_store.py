"""The object-store contract on the in-memory fake and the local-directory store, plus key helpers."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest

from snapshot.store import (LocalDirStore, MemoryStore, ObjectStore, S3Store, make_store, parse_snapshot_key,
                            session_prefix, snapshot_key)
from substrate.errors import Conflict, NotFound, StoreUnavailable
from substrate.settings import SnapshotSettings


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "memory":
        return MemoryStore()
    return LocalDirStore(tmp_path / "store")


async def fetch(store: ObjectStore, key: str) -> bytes:
    """The whole object at ``key``, through the port's streamed ``read``."""
    return await store.read(key, lambda f: f.read())


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(200_000))
    return p


async def test_put_read_round_trip(store: ObjectStore, blob: Path) -> None:
    await store.put_file("snaps/s1/a.tar.zst", blob)
    data = await fetch(store, "snaps/s1/a.tar.zst")
    assert len(data) == blob.stat().st_size
    assert data == blob.read_bytes()


async def test_put_never_overwrites(store: ObjectStore, blob: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"other")
    await store.put_file("k/a", blob)
    with pytest.raises(Conflict) as info:
        await store.put_file("k/a", other)
    assert info.value.code == "snapshot_exists" and info.value.status == 409
    assert await fetch(store, "k/a") == blob.read_bytes()


async def test_concurrent_puts_of_one_key_have_one_winner(store: ObjectStore, tmp_path: Path) -> None:
    paths = []
    for i in range(8):
        p = tmp_path / f"v{i}"
        p.write_bytes(f"version {i}".encode() * 1000)
        paths.append(p)
    results = await asyncio.gather(*(store.put_file("race/key", p) for p in paths), return_exceptions=True)
    winners = [p for p, r in zip(paths, results) if r is None]
    assert len(winners) == 1
    assert all(isinstance(r, Conflict) for r in results if r is not None)
    assert await fetch(store, "race/key") == winners[0].read_bytes()


async def test_list_and_delete(store: ObjectStore, blob: Path) -> None:
    for key in ("p/s1/b", "p/s1/a", "p/s2/a", "p/s10/a", "q/s1/a"):
        await store.put_file(key, blob)
    assert await store.list_keys("p/s1/") == ["p/s1/a", "p/s1/b"]
    assert await store.list_keys("p/s1") == ["p/s1/a", "p/s1/b", "p/s10/a"]
    assert await store.list_keys("p/") == ["p/s1/a", "p/s1/b", "p/s10/a", "p/s2/a"]
    assert await store.list_keys("zzz/") == []
    await store.delete("p/s1/a")
    await store.delete("p/s1/a")  # idempotent
    await store.delete("never/existed")
    assert await store.list_keys("p/s1/") == ["p/s1/b"]
    await store.put_file("p/s1/a", blob)  # a deleted key can be created again
    assert await store.list_keys("p/s1/") == ["p/s1/a", "p/s1/b"]


async def test_put_of_missing_source_is_callers_error(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await store.put_file("k/a", tmp_path / "does-not-exist")
    assert await store.list_keys("k/") == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "dir/", "./a"])
async def test_invalid_keys_are_rejected(store: ObjectStore, blob: Path, key: str) -> None:
    with pytest.raises(ValueError):
        await store.put_file(key, blob)


# --------------------------------------------------------------------------------------------- fake only


async def test_memory_store_outage_switches(blob: Path) -> None:
    store = MemoryStore()
    store.fail_next(2)
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            await store.put_file("k/a", blob)
    assert store.objects == {}
    await store.put_file("k/a", blob)  # third call works again

    store.unavailable = True
    called = []
    with pytest.raises(StoreUnavailable) as info:
        await store.read("k/a", called.append)
    assert info.value.status == 503 and info.value.retry_after_s
    assert called == []
    with pytest.raises(StoreUnavailable):
        await store.list_keys("k/")
    store.unavailable = False
    assert await store.list_keys("k/") == ["k/a"]

    # the request lands but its answer is lost: the retry then sees Conflict
    store.lose_next_response()
    with pytest.raises(StoreUnavailable):
        await store.put_file("k/b", blob)
    assert "k/b" in store.objects
    with pytest.raises(Conflict):
        await store.put_file("k/b", blob)
    assert ("put", "k/b") in store.calls


# ---------------------------------------------------------------------------------------------- local only


async def test_local_store_leaves_no_temp_files_and_prunes_dirs(tmp_path: Path, blob: Path) -> None:
    root = tmp_path / "store"
    store = LocalDirStore(root)
    await store.put_file("p/s1/a", blob)
    with pytest.raises(Conflict):
        await store.put_file("p/s1/a", blob)
    assert sorted(p.name for p in (root / "p" / "s1").iterdir()) == ["a"]
    await store.delete("p/s1/a")
    assert not (root / "p").exists() and root.exists()


async def test_local_store_io_errors_become_store_unavailable(tmp_path: Path, blob: Path) -> None:
    root = tmp_path / "store"
    root.write_text("a file where the store directory should be")
    store = LocalDirStore(root)
    with pytest.raises(StoreUnavailable) as info:
        await store.put_file("p/s1/a", blob)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StoreUnavailable):
        await store.list_keys("p/")


# ---------------------------------------------------------------------------------------------------- keys


def test_snapshot_keys_are_unique_sorted_and_parseable() -> None:
    a = snapshot_key("snapshots", "sess-1", 3, 7)
    b = snapshot_key("snapshots", "sess-1", 3, 7)
    c = snapshot_key("snapshots", "sess-1", 12, 0)
    assert a != b
    assert a.startswith(session_prefix("snapshots", "sess-1")) and a.endswith(".tar.zst")
    assert a.startswith("snapshots/sess-1/000000000003-000007-")
    assert sorted([c, a]) == [a, c]  # epoch order is key order
    assert parse_snapshot_key(a) == (3, 7) and parse_snapshot_key(c) == (12, 0)
    assert parse_snapshot_key("snapshots/sess-1/other.txt") is None
    assert session_prefix("", "s") == "s/" and session_prefix("/x/", "s") == "x/s/"
    assert snapshot_key("", "s", 1, 1).startswith("s/000000000001-000001-")
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError):
            session_prefix("p", bad)


def test_make_store_picks_the_adapter(tmp_path: Path) -> None:
    local = make_store(SnapshotSettings(store="local", local_dir=tmp_path / "snaps"))
    assert isinstance(local, LocalDirStore) and local.root == tmp_path / "snaps"
    s3 = make_store(SnapshotSettings(store="s3", bucket="my-bucket", endpoint_url="http://127.0.0.1:9",
                                     access_key_id="k", secret_access_key="s", multipart_threshold_bytes=6 << 20))
    assert isinstance(s3, S3Store)
    assert s3.bucket == "my-bucket" and s3.multipart_threshold_bytes == 6 << 20
    assert isinstance(s3, ObjectStore) and isinstance(MemoryStore(), ObjectStore)
    s3.close()


async def test_read_streams_the_object_to_the_consumer(store: ObjectStore, blob: Path) -> None:
    await store.put_file("snaps/s1/a.tar.zst", blob)
    chunks: list[bytes] = []

    def consume(f: object) -> str:
        while chunk := f.read(65536):  # type: ignore[attr-defined]
            chunks.append(chunk)
        return "done"

    assert await store.read("snaps/s1/a.tar.zst", consume) == "done"
    assert b"".join(chunks) == blob.read_bytes() and len(chunks) > 1  # handed over in pieces


async def test_read_of_a_missing_key_is_not_found_and_never_calls_the_consumer(store: ObjectStore) -> None:
    called = []
    with pytest.raises(NotFound) as info:
        await store.read("nope/missing", called.append)
    assert info.value.code == "snapshot_missing" and info.value.status == 404 and called == []


async def test_read_passes_the_consumers_own_errors_through(store: ObjectStore, blob: Path) -> None:
    await store.put_file("k/a", blob)

    def consume(f: object) -> None:
        raise OSError(28, "No space left on device")  # a local failure, not the store's

    with pytest.raises(OSError) as info:
        await store.read("k/a", consume)
    assert not isinstance(info.value, StoreUnavailable) and info.value.errno == 28


def test_a_stream_that_ends_short_is_the_stores_error() -> None:
    from snapshot.store import _Transfer

    t = _Transfer(io.BytesIO(b"x" * 10), "get", "k/a", expected_bytes=25)
    assert t.read(100) == b"x" * 10
    with pytest.raises(StoreUnavailable, match="short read: 10 of 25"):
        t.read(100)
    whole = _Transfer(io.BytesIO(b"y" * 10), "get", "k/a", expected_bytes=10)
    assert whole.read(100) == b"y" * 10 and whole.read(100) == b""
