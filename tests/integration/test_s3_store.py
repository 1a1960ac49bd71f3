"""S3Store against a real S3 API over HTTP (moto server on loopback)."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snapshot.archive import pack, unpack
from snapshot.store import S3Store, snapshot_key
from substrate.errors import Conflict, NotFound, StoreUnavailable

MiB = 1 << 20


def write(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


async def fetch(store: S3Store, key: str) -> bytes:
    """The whole object at ``key``, through the port's streamed ``read``."""
    return await store.read(key, lambda f: f.read())


async def test_put_read_round_trip(s3_store: S3Store, tmp_path: Path) -> None:
    src = write(tmp_path / "a", 300_000)
    await s3_store.put_file("snaps/s1/a.tar.zst", src)
    data = await fetch(s3_store, "snaps/s1/a.tar.zst")
    assert len(data) == 300_000
    assert data == src.read_bytes()


async def test_conditional_put_refuses_existing_key(s3_store: S3Store, tmp_path: Path) -> None:
    first, second = write(tmp_path / "1", 1000), write(tmp_path / "2", 1000)
    await s3_store.put_file("k/a", first)
    with pytest.raises(Conflict) as info:
        await s3_store.put_file("k/a", second)
    assert info.value.code == "snapshot_exists"
    assert await fetch(s3_store, "k/a") == first.read_bytes()


async def test_multipart_upload_with_conditional_complete(s3_store_factory: Callable[..., S3Store],
                                                          tmp_path: Path) -> None:
    store = s3_store_factory(multipart_threshold_bytes=5 * MiB, part_size_bytes=5 * MiB)
    await store.ensure_bucket()
    big = write(tmp_path / "big", 12 * MiB)
    await store.put_file("k/big", big)

    head = store._client.head_object(Bucket=store.bucket, Key="k/big")
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB: it really went multipart
    data = await fetch(store, "k/big")
    assert len(data) == 12 * MiB
    assert data == big.read_bytes()

    other = write(tmp_path / "other", 12 * MiB)
    with pytest.raises(Conflict):
        await store.put_file("k/big", other)
    # the refused upload was aborted, the object is the first one
    assert store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
    assert await fetch(store, "k/big") == big.read_bytes()


async def test_multipart_complete_is_what_refuses_a_concurrent_winner(
        s3_store_factory: Callable[..., S3Store], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # another writer creates the key while our parts are in flight: only the conditional
    # CompleteMultipartUpload can notice, and it must not overwrite the winner
    store = s3_store_factory(multipart_threshold_bytes=5 * MiB, part_size_bytes=5 * MiB)
    await store.ensure_bucket()
    real_complete = store._complete

    def complete_after_a_rival(full: str, upload_id: str, parts: list) -> None:
        store._client.put_object(Bucket=store.bucket, Key=full, Body=b"the rival won")
        real_complete(full, upload_id, parts)

    monkeypatch.setattr(store, "_complete", complete_after_a_rival)
    with pytest.raises(Conflict):
        await store.put_file("k/race", write(tmp_path / "a", 11 * MiB))
    assert await fetch(store, "k/race") == b"the rival won"
    assert store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


async def test_read_missing_is_not_found(s3_store: S3Store, s3_store_factory: Callable[..., S3Store]) -> None:
    called: list[object] = []
    with pytest.raises(NotFound) as info:
        await s3_store.read("k/missing", called.append)
    assert info.value.code == "snapshot_missing"
    assert called == []  # raised before the consumer is handed a stream
    no_bucket = s3_store_factory()  # bucket never created
    assert await no_bucket.list_keys("k/") == []


async def test_a_read_from_a_bucket_that_does_not_exist_is_the_store_unavailable_not_a_missing_snapshot(
        s3_store_factory: Callable[..., S3Store]) -> None:
    """A mistyped bucket read every snapshot as missing, and each session's snapshots were set aside as
    corrupt (fresh-user round 18): a missing bucket is the store not being the right one, a 503."""
    called: list[object] = []
    no_bucket = s3_store_factory()  # bucket never created
    with pytest.raises(StoreUnavailable) as info:
        await no_bucket.read("k/missing", called.append)
    assert info.value.code == "snapshot_store_unavailable" and called == []
    assert info.value.details["s3Code"] == "NoSuchBucket"
    assert f"the bucket {no_bucket.bucket!r} does not exist" in info.value.message


async def test_list_and_delete(s3_store: S3Store, tmp_path: Path) -> None:
    src = write(tmp_path / "a", 10)
    keys = [snapshot_key("snaps", "s1", e, 0) for e in (2, 1, 3)] + [snapshot_key("snaps", "s10", 1, 0)]
    for key in keys:
        await s3_store.put_file(key, src)
    assert await s3_store.list_keys("snaps/s1/") == sorted(keys[:3])
    await s3_store.delete(keys[0])
    await s3_store.delete(keys[0])  # idempotent
    assert await s3_store.list_keys("snaps/s1/") == sorted(keys[1:3])
    assert await s3_store.list_keys("snaps/") == sorted(keys[1:])


async def test_prefix_namespaces_keys_and_a_put_never_makes_a_missing_bucket(
        s3_store_factory: Callable[..., S3Store], tmp_path: Path) -> None:
    """A put into a bucket that does not exist is 503 (the bucket is made by snapshot.guard, once, in a new
    directory): an upload that made a deleted bucket again, empty, hid that the other snapshots were gone
    (fresh-user round 19)."""
    store = s3_store_factory(prefix="tenant-a")
    src = write(tmp_path / "a", 10)
    with pytest.raises(StoreUnavailable) as info:
        await store.put_file("snaps/s1/x", src)
    assert info.value.details["s3Code"] == "NoSuchBucket"
    assert store.bucket not in [b["Name"] for b in store._client.list_buckets()["Buckets"]]
    await store.ensure_bucket()
    await store.put_file("snaps/s1/x", src)
    assert await store.list_keys("snaps/") == ["snaps/s1/x"]
    raw = store._client.list_objects_v2(Bucket=store.bucket)["Contents"]
    assert [o["Key"] for o in raw] == ["tenant-a/snaps/s1/x"]


async def test_snapshot_round_trip_through_s3(s3_store: S3Store, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f.txt").write_text("hello")
    manifest, _, sha = pack(ws, {"n": 1}, session="s1", epoch=4, template="t", out_path=tmp_path / "a")
    key = snapshot_key("snaps", "s1", 4, 1)
    await s3_store.put_file(key, tmp_path / "a")
    (tmp_path / "b").write_bytes(await fetch(s3_store, key))
    got, state = unpack(tmp_path / "b", tmp_path / "restored", expect_session="s1", expect_sha256=sha)
    assert got == manifest and state == {"n": 1}
    assert (tmp_path / "restored" / "d" / "f.txt").read_text() == "hello"


async def test_unreachable_endpoint_is_store_unavailable(tmp_path: Path) -> None:
    store = S3Store("some-bucket", endpoint_url="http://127.0.0.1:1", access_key_id="k", secret_access_key="s",
                    max_attempts=2)
    src = write(tmp_path / "a", 10)
    try:
        for call in (store.put_file("k/a", src), store.read("k/a", lambda f: f.read()),
                     store.list_keys("k/"), store.delete("k/a"), store.ensure_bucket()):
            with pytest.raises(StoreUnavailable) as info:
                await call
            assert info.value.status == 503 and info.value.code == "snapshot_store_unavailable"
    finally:
        store.close()


@pytest.fixture
def failing_endpoint() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" at once

        def _fail(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _fail

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_server_errors_are_store_unavailable(failing_endpoint: str, tmp_path: Path) -> None:
    store = S3Store("some-bucket", endpoint_url=failing_endpoint, access_key_id="k", secret_access_key="s",
                    max_attempts=1)
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.put_file("k/a", write(tmp_path / "a", 10))
        assert info.value.details["httpStatus"] == 503
        called: list[object] = []
        with pytest.raises(StoreUnavailable):
            await store.read("k/a", called.append)
        assert called == []
    finally:
        store.close()


async def test_restore_streams_a_snapshot_from_s3(s3_store: S3Store, tmp_path: Path) -> None:
    from snapshot.commit import SnapshotManager
    from substrate.models import SnapshotRef
    from substrate.settings import SnapshotSettings

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "blob").write_bytes(os.urandom(3 * MiB))
    _, size, sha = pack(ws, {"n": 2}, session="s1", epoch=4, template="t", out_path=tmp_path / "a")
    key = snapshot_key("snaps", "s1", 4, 1)
    await s3_store.put_file(key, tmp_path / "a")
    mgr = SnapshotManager(s3_store, None, SnapshotSettings(), tmp_path / "tmp")  # type: ignore[arg-type]
    ref = SnapshotRef(key=key, epoch=4, createdAt=0.0, sizeBytes=size, sha256=sha)
    state = await mgr.restore("s1", ref, tmp_path / "restored", "t")
    assert state == {"n": 2} and (tmp_path / "restored" / "blob").read_bytes() == (ws / "blob").read_bytes()
    with pytest.raises(NotFound):
        await s3_store.read("k/none", lambda f: f.read())


@pytest.fixture
def cutting_endpoint() -> Iterator[tuple[str, bytes]]:
    """An S3 look-alike whose GET announces the whole object and drops the connection halfway."""
    body = os.urandom(2 * MiB)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", body
    finally:
        server.shutdown()
        server.server_close()


async def test_a_download_cut_halfway_is_store_unavailable_not_a_corrupt_snapshot(
        cutting_endpoint: tuple[str, bytes], tmp_path: Path) -> None:
    # a corrupt verdict would make the activator restore an older snapshot and lose turns: a cut
    # transfer must stay a store error (503, retried), and the workspace must stay as it was
    from snapshot.commit import SnapshotManager
    from substrate.models import SnapshotRef
    from substrate.settings import SnapshotSettings

    url, _ = cutting_endpoint
    store = S3Store("some-bucket", endpoint_url=url, access_key_id="k", secret_access_key="s", max_attempts=1)
    live = tmp_path / "live"
    live.mkdir()
    (live / "keep").write_text("precious")
    try:
        with pytest.raises(StoreUnavailable):
            await store.read("k/a", lambda f: f.read())
        mgr = SnapshotManager(store, None, SnapshotSettings(), tmp_path / "tmp")  # type: ignore[arg-type]
        ref = SnapshotRef(key="k/a", epoch=1, createdAt=0.0, sizeBytes=2 * MiB, sha256="0" * 64)
        with pytest.raises(StoreUnavailable):
            await mgr.restore("s1", ref, live, "t")
        assert [p.name for p in tmp_path.joinpath("live").parent.iterdir() if p.name.startswith(".live.")] == []
        assert (live / "keep").read_text() == "precious" and sorted(os.listdir(live)) == ["keep"]
    finally:
        store.close()
