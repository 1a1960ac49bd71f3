"""The snapshot store a directory's sessions use is recorded at the first start; a later start configured
for another one is refused while sessions exist (substrate/storeloc.py; fresh-user round 18: a mistyped
bucket woke every session empty), against a real Redis."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from substrate import storeloc
from substrate.directory import Directory
from substrate.models import SessionRecord, SessionState
from substrate.settings import SnapshotSettings


@pytest.fixture
def d(directory: Directory) -> Directory:
    """The shared ``directory`` fixture (tests/integration/conftest.py) under this file's short name."""
    return directory


def s3(bucket: str, prefix: str = "snapshots", **kw) -> SnapshotSettings:
    return SnapshotSettings(store="s3", bucket=bucket, prefix=prefix, **kw)


async def _a_session(d: Directory) -> None:
    now = time.time()
    await d.create_session(SessionRecord(id="s1", state=SessionState.SUSPENDED, actorTemplate="counter",
                                         pool="default", createdAt=now, updatedAt=now, lastActiveAt=now))


def test_the_location_names_the_bucket_or_folder_and_the_prefix_and_not_the_endpoint(tmp_path: Path) -> None:
    assert storeloc.location_of(s3("snaps", "/p/")) == "s3://snaps/p"
    assert storeloc.location_of(s3("snaps", endpoint_url="http://a:9000")) == storeloc.location_of(
        s3("snaps", endpoint_url="http://b:9000"))
    local = SnapshotSettings(store="local", local_dir=tmp_path / "x")
    assert storeloc.location_of(local) == f"file://{(tmp_path / 'x').resolve()}/snapshots"


async def test_a_start_for_another_store_is_refused_while_sessions_exist_and_changes_nothing(d) -> None:
    assert await storeloc.check(d.redis, d.keys, s3("fresh18-snaps")) is None  # the first start records it
    await _a_session(d)
    assert await storeloc.check(d.redis, d.keys, s3("fresh18-snaps")) is None  # the same store again
    why = await storeloc.check(d.redis, d.keys, s3("fresh18-snapz"))
    assert why is not None
    assert "keep their snapshots in s3://fresh18-snaps/snapshots" in why
    assert "configured for s3://fresh18-snapz/snapshots" in why and "ACCEPT_NEW_LOCATION" in why
    assert await storeloc.check(d.redis, d.keys, s3("fresh18-snaps", prefix="other")) is not None
    assert await d.redis.get(d.keys.snapshot_location) == "s3://fresh18-snaps/snapshots#snapshots", "nothing changed"


async def test_a_new_store_is_recorded_when_nothing_can_be_lost_and_an_accepted_move_once_its_marker_matched(
        d) -> None:
    assert await storeloc.check(d.redis, d.keys, s3("first")) is None
    assert await storeloc.check(d.redis, d.keys, s3("second")) is None  # no session: nothing to lose
    assert await d.redis.get(d.keys.snapshot_location) == "s3://second/snapshots#snapshots"
    await _a_session(d)
    assert await storeloc.check(d.redis, d.keys, s3("third", accept_new_location=True)) is None
    # accepted, not recorded: a mistyped location accepted by mistake must not be remembered (fresh-user
    # round 20: going back to the right one was then refused); snapshot.guard records it once the marker matched
    assert await d.redis.get(d.keys.snapshot_location) == "s3://second/snapshots#snapshots"
    await storeloc.record(d.redis, d.keys, s3("third"))
    assert await storeloc.check(d.redis, d.keys, s3("third")) is None


async def test_a_second_runtime_of_the_directory_on_another_store_is_refused_while_the_first_runs(d) -> None:
    """Fresh-user round 24: two ``substrate up`` on one Redis and key prefix, each with its own data folder
    (a local store each), started with no session yet: both ran, shared one pool and each other's
    sessions, and a session woken on the other's worker read its snapshot as missing, was condemned and
    woke empty. A live worker of the directory means a runtime uses the recorded store now."""
    assert await storeloc.check(d.redis, d.keys, s3("first")) is None
    await d.redis.zadd(d.keys.workers_index, {"w-of-the-first": time.time() + 30})  # its lease runs
    why = await storeloc.check(d.redis, d.keys, s3("second"))
    assert why is not None and "another runtime of this directory (Redis and key prefix: 1 live worker(s))" in why
    assert "s3://first/snapshots" in why and "configured for s3://second/snapshots" in why
    assert await d.redis.get(d.keys.snapshot_location) == "s3://first/snapshots#snapshots", "nothing changed"
    assert await storeloc.check(d.redis, d.keys, s3("first")) is None  # a second process on the same store
    await d.redis.zadd(d.keys.workers_index, {"w-of-the-first": time.time() - 1})  # its lease ran out
    assert await storeloc.check(d.redis, d.keys, s3("second")) is None  # nothing runs: nothing to share
    assert await d.redis.get(d.keys.snapshot_location) == "s3://second/snapshots#snapshots"


async def test_a_changed_prefix_is_refused_even_as_an_accepted_move(d) -> None:
    """Every snapshot's key begins with the prefix: objects moved under another prefix are never found, so a
    move with ``ACCEPT_NEW_LOCATION`` condemned every session (fresh-user round 20)."""
    assert await storeloc.check(d.redis, d.keys, s3("bkt")) is None
    await _a_session(d)
    why = await storeloc.check(d.redis, d.keys, s3("moved", prefix="snaps", accept_new_location=True))
    assert why is not None and "SUBSTRATE_SNAPSHOT__PREFIX must stay 'snapshots'" in why
    assert await storeloc.check(d.redis, d.keys, s3("moved", accept_new_location=True)) is None  # same prefix


def test_up_configured_for_another_store_says_so_in_one_line_and_serves_nothing(tmp_path: Path, redis_url: str,
                                                                                  monkeypatch) -> None:
    """`substrate up` with a mistyped snapshot folder on a directory whose sessions keep their snapshots
    elsewhere: exit 2 with the objection, before the API or any worker starts."""
    import asyncio
    import socket

    from typer.testing import CliRunner

    from substrate.cli import app

    prefix = f"sl{uuid.uuid4().hex[:8]}"

    async def seed() -> None:
        d = Directory(redis_url, prefix)
        try:
            assert await storeloc.check(d.redis, d.keys, SnapshotSettings(local_dir=tmp_path / "snaps")) is None
            await _a_session(d)
        finally:
            await d.close()

    async def cleanup() -> str | None:
        d = Directory(redis_url, prefix)
        try:
            recorded = await d.redis.get(d.keys.snapshot_location)
            async for key in d.redis.scan_iter(f"{prefix}:*"):
                await d.redis.delete(key)
            return recorded
        finally:
            await d.close()

    asyncio.run(seed())
    for k, v in {"SUBSTRATE_DATA_DIR": str(tmp_path / "var"), "SUBSTRATE_REDIS_URL": redis_url,
                 "SUBSTRATE_REDIS__KEY_PREFIX": prefix, "SUBSTRATE_SNAPSHOT__LOCAL_DIR": str(tmp_path / "snapz")}.items():
        monkeypatch.setenv(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(port)])
    finally:
        recorded = asyncio.run(cleanup())
    assert r.exit_code == 2, r.output
    assert f"keep their snapshots in file://{(tmp_path / 'snaps').resolve()}/snapshots" in " ".join(r.output.split())
    assert "Traceback" not in r.output and "serving on" not in r.output
    assert recorded == f"file://{(tmp_path / 'snaps').resolve()}/snapshots#snapshots", "the recorded store is kept"
    assert not (tmp_path / "var" / "workers").exists() or not any((tmp_path / "var" / "workers").iterdir())
