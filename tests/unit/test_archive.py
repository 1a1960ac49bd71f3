"""The snapshot archive: round trips, manifest, and every way an archive is refused."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import stat
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshot.archive import MANIFEST_MEMBER, STATE_MEMBER, Manifest, pack, unpack, unpack_stream
from substrate.errors import SnapshotCorrupt, StoreUnavailable

STATE = {"count": 3, "history": ["a", "b"], "nested": {"x": None, "y": 1.5}}


def tree(root: Path) -> dict[str, tuple]:
    """Everything under ``root``: rel path -> ("dir",) | ("file", bytes, owner-exec) | ("link", target)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes(), bool(p.stat().st_mode & stat.S_IXUSR))
    return out


def make_workspace(root: Path) -> Path:
    ws = root / "ws"
    (ws / "src" / "pkg" / "deep").mkdir(parents=True)
    (ws / "empty-dir").mkdir()
    (ws / "README.md").write_text("hello\n")
    (ws / "empty.txt").write_bytes(b"")
    (ws / "src" / "pkg" / "mod.py").write_text("print('x')\n" * 100)
    (ws / "src" / "pkg" / "deep" / "blob.bin").write_bytes(os.urandom(300_000))
    (ws / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(ws / "run.sh", 0o755)
    (ws / ("long-name-" + "x" * 150 + ".txt")).write_text("long")
    (ws / "ünïcødé.txt").write_text("unicode")
    os.symlink("src/pkg/mod.py", ws / "link-to-mod")
    os.symlink("pkg", ws / "src" / "link-to-dir")
    os.symlink("does-not-exist", ws / "dangling")
    return ws


def pack_ws(ws: Path, out: Path, *, session: str = "sess-1", state: dict | None = None, epoch: int = 7):
    return pack(ws, STATE if state is None else state, session=session, epoch=epoch, template="counter",
                out_path=out)


def members(archive: Path) -> list[tarfile.TarInfo]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(archive.read_bytes())).read()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as t:
        return t.getmembers()


def craft(path: Path, entries: list) -> Path:
    """Write an arbitrary (possibly malicious) zstd tar archive; a ``manifest_entry()`` item becomes a
    manifest whose ``contentSha256`` is right for the bytes before it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for entry in entries:
            if isinstance(entry, dict):  # manifest placeholder
                sha = hashlib.sha256(buf.getvalue()[: t.offset]).hexdigest()
                m = Manifest(epoch=1, template="t", createdAt=time.time(), stateBytes=2, contentSha256=sha, **entry)
                ti, data = reg(MANIFEST_MEMBER, m.to_json().encode())
            else:
                ti, data = entry
            if data is not None:
                ti.size = len(data)
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return path


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def special(name: str, type_: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.linkname = linkname
    return ti, None


def manifest_entry(session: str = "sess-1", files: int = 0, ws_bytes: int = 0) -> dict:
    return {"session": session, "files": files, "workspaceBytes": ws_bytes}


def dir_entry(name: str = "workspace") -> tuple[tarfile.TarInfo, None]:
    return special(name, tarfile.DIRTYPE)


def refused(archive: Path, ws: Path, reason: str | None, *, session: str = "sess-1",
            sha: str | None = None) -> SnapshotCorrupt:
    with pytest.raises(SnapshotCorrupt) as info:
        unpack(archive, ws, expect_session=session, expect_sha256=sha)
    assert info.value.code == "snapshot_corrupt"
    if reason is not None:
        assert info.value.details["reason"] == reason, info.value.message
    return info.value


@pytest.fixture
def existing(tmp_path: Path) -> Path:
    """A live workspace that a refused restore must leave exactly as it is."""
    ws = tmp_path / "live"
    ws.mkdir()
    (ws / "keep.txt").write_text("precious")
    (ws / "sub").mkdir()
    (ws / "sub" / "data").write_bytes(b"\x00\x01")
    return ws


def assert_untouched(ws: Path, before: dict) -> None:
    assert tree(ws) == before
    leftovers = [p.name for p in ws.parent.iterdir() if p.name.startswith(f".{ws.name}.")]
    assert leftovers == []


# --------------------------------------------------------------------------------------------- round trip


def test_round_trip_restores_files_dirs_links_and_state(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    archive = tmp_path / "a.tar.zst"
    manifest, size, sha = pack_ws(ws, archive)

    assert size == archive.stat().st_size
    assert sha == hashlib.sha256(archive.read_bytes()).hexdigest()

    dest = tmp_path / "restored" / "ws"
    got_manifest, state = unpack(archive, dest, expect_session="sess-1", expect_sha256=sha)

    assert state == STATE
    assert got_manifest == manifest
    assert tree(dest) == tree(ws)
    assert tree(dest)["run.sh"][2] is True  # exec bit kept
    assert tree(dest)["src/link-to-dir"] == ("link", "pkg")
    assert (dest / "empty-dir").is_dir() and not any((dest / "empty-dir").iterdir())
    assert (dest / "src/pkg/mod.py").stat().st_mtime == int((ws / "src/pkg/mod.py").stat().st_mtime)
    assert (dest / "src/pkg").stat().st_mtime == int((ws / "src/pkg").stat().st_mtime)


def test_unpack_replaces_existing_workspace(tmp_path: Path, existing: Path) -> None:
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a")
    unpack(tmp_path / "a", existing, expect_session="sess-1", expect_sha256=sha)
    assert tree(existing) == tree(ws)
    assert not (existing / "keep.txt").exists()
    assert [p.name for p in existing.parent.iterdir() if p.name.startswith(".live.")] == []


def test_unpack_without_sha_verifies_and_round_trips(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    pack_ws(ws, tmp_path / "a")
    _, state = unpack(tmp_path / "a", tmp_path / "r", expect_session="sess-1", expect_sha256=None)
    assert state == STATE and tree(tmp_path / "r") == tree(ws)


def test_manifest_fields_and_member_order(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    before = time.time()
    manifest, _, _ = pack_ws(ws, tmp_path / "a", epoch=42)
    files = [p for p in ws.rglob("*") if p.is_symlink() or p.is_file()]

    assert manifest.format == 1
    assert (manifest.session, manifest.epoch, manifest.template) == ("sess-1", 42, "counter")
    assert before - 1 <= manifest.createdAt <= time.time() + 1
    assert manifest.files == len(files) == 10
    assert manifest.workspaceBytes == sum(p.stat().st_size for p in files if not p.is_symlink())
    assert manifest.stateBytes == len(json.dumps(STATE, separators=(",", ":")).encode())
    assert manifest.skipped == 0

    ms = members(tmp_path / "a")
    assert ms[0].name == STATE_MEMBER
    assert ms[-1].name == MANIFEST_MEMBER
    assert all(m.name == "workspace" or m.name.startswith("workspace/") for m in ms[1:-1])
    # contentSha256 = sha256 of the uncompressed tar stream before the manifest header
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO((tmp_path / "a").read_bytes())).read()
    assert hashlib.sha256(raw[: ms[-1].offset]).hexdigest() == manifest.contentSha256


def test_manifest_json_round_trip_and_validation() -> None:
    m = Manifest(session="s", epoch=1, template="t", createdAt=1.5, workspaceBytes=2, stateBytes=3, files=4,
                 contentSha256="ab" * 32)
    assert Manifest.from_json(m.to_json()) == m
    assert json.loads(m.to_json())["format"] == 1
    data = json.loads(m.to_json())
    with pytest.raises(SnapshotCorrupt):
        Manifest.from_json(json.dumps({**data, "format": 2}))
    with pytest.raises(SnapshotCorrupt):
        Manifest.from_json(json.dumps({k: v for k, v in data.items() if k != "session"}))
    with pytest.raises(SnapshotCorrupt):
        Manifest.from_json(json.dumps({**data, "epoch": "1"}))
    with pytest.raises(SnapshotCorrupt):
        Manifest.from_json(b"{not json")


def test_content_sha_is_deterministic(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    m1, _, _ = pack_ws(ws, tmp_path / "a")
    m2, _, _ = pack_ws(ws, tmp_path / "b")
    m3, _, _ = pack_ws(ws, tmp_path / "c", state={"count": 4})
    assert m1.contentSha256 == m2.contentSha256
    assert m3.contentSha256 != m1.contentSha256


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET")
    ws = tmp_path / "ws"
    ws.mkdir()
    os.symlink(outside, ws / "abs-link")
    os.symlink("../outside/secret.txt", ws / "rel-link")

    manifest, _, sha = pack_ws(ws, tmp_path / "a")
    names = [m.name for m in members(tmp_path / "a")]
    assert not any("secret" in n for n in names)
    assert manifest.workspaceBytes == 0 and manifest.files == 2

    unpack(tmp_path / "a", tmp_path / "r", expect_session="sess-1", expect_sha256=sha)
    assert os.readlink(tmp_path / "r" / "abs-link") == str(outside)
    assert os.readlink(tmp_path / "r" / "rel-link") == "../outside/secret.txt"


def test_sockets_and_fifos_are_skipped(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_text("x")
    os.mkfifo(ws / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.fspath(ws / "sock"))
    try:
        manifest, _, sha = pack_ws(ws, tmp_path / "a")
    finally:
        sock.close()
    assert manifest.skipped == 2 and manifest.files == 1
    unpack(tmp_path / "a", tmp_path / "r", expect_session="sess-1", expect_sha256=sha)
    assert tree(tmp_path / "r") == {"f": ("file", b"x", False)}


def test_pack_failure_leaves_no_file(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    with pytest.raises(TypeError):
        pack_ws(ws, tmp_path / "a", state={"x": object()})
    assert not (tmp_path / "a").exists()
    with pytest.raises(FileNotFoundError):
        pack_ws(tmp_path / "missing", tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError):
        pack_ws(ws, ws / "inside.tar.zst")
    assert not (ws / "inside.tar.zst").exists()


names = st.text(alphabet="abcXYZ019-_. ü", min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.lists(st.tuples(st.lists(names, min_size=1, max_size=3), st.binary(max_size=3000),
                               st.booleans()), max_size=10),
       state=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=4))
def test_round_trip_property(spec: list, state: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws = root / "ws"
        ws.mkdir()
        for parts, data, as_dir in spec:
            p = ws.joinpath(*parts)
            try:
                if as_dir:
                    p.mkdir(parents=True, exist_ok=True)
                else:
                    p.parent.mkdir(parents=True, exist_ok=True)
                    if not p.exists():
                        p.write_bytes(data)
            except (FileExistsError, NotADirectoryError):
                pass  # a file where a directory was wanted, or the reverse: skip that entry
        _, _, sha = pack(ws, state, session="s", epoch=1, template="t", out_path=root / "a")
        _, got = unpack(root / "a", root / "r", expect_session="s", expect_sha256=sha)
        assert got == state
        assert tree(root / "r") == tree(ws)


# ------------------------------------------------------------------------------------------------ refusals


def test_flipped_byte_is_a_checksum_mismatch(tmp_path: Path, existing: Path) -> None:
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a")
    data = bytearray((tmp_path / "a").read_bytes())
    data[len(data) // 2] ^= 0x40
    (tmp_path / "a").write_bytes(bytes(data))
    before = tree(existing)

    err = refused(tmp_path / "a", existing, "checksum_mismatch", sha=sha)
    assert err.details["expected"] == sha
    assert_untouched(existing, before)
    refused(tmp_path / "a", existing, None, sha=None)  # zstd's own checksum still catches it
    assert_untouched(existing, before)


def test_tampered_content_without_file_sha_fails_content_check(tmp_path: Path, existing: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f.txt").write_text("original-content")
    pack_ws(ws, tmp_path / "a")
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO((tmp_path / "a").read_bytes())).read()
    assert raw.count(b"original-content") == 1
    forged = raw.replace(b"original-content", b"modified-content")
    (tmp_path / "a").write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(forged))
    before = tree(existing)
    refused(tmp_path / "a", existing, "checksum_mismatch", sha=None)
    assert_untouched(existing, before)


@pytest.mark.parametrize("with_sha", [True, False])
def test_truncated_archive_is_refused(tmp_path: Path, existing: Path, with_sha: bool) -> None:
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a")
    data = (tmp_path / "a").read_bytes()
    (tmp_path / "a").write_bytes(data[: len(data) // 2])
    before = tree(existing)
    # with the expected sha256 the file is refused before anything is decompressed: a checksum mismatch
    refused(tmp_path / "a", existing, "checksum_mismatch" if with_sha else "truncated",
            sha=sha if with_sha else None)
    assert_untouched(existing, before)


def test_archive_missing_its_last_bytes_is_refused_with_sha(tmp_path: Path, existing: Path) -> None:
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a")
    data = (tmp_path / "a").read_bytes()
    (tmp_path / "a").write_bytes(data[:-3])
    before = tree(existing)
    refused(tmp_path / "a", existing, None, sha=sha)
    assert_untouched(existing, before)


def test_foreign_session_is_refused(tmp_path: Path, existing: Path) -> None:
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a", session="someone-else")
    before = tree(existing)
    err = refused(tmp_path / "a", existing, "foreign_session", session="sess-1", sha=sha)
    assert err.details["session"] == "someone-else"
    assert_untouched(existing, before)


def test_empty_and_non_zstd_files_are_refused(tmp_path: Path, existing: Path) -> None:
    before = tree(existing)
    (tmp_path / "empty").write_bytes(b"")
    refused(tmp_path / "empty", existing, None)
    (tmp_path / "junk").write_bytes(b"this is not an archive" * 100)
    refused(tmp_path / "junk", existing, "bad_format")
    assert_untouched(existing, before)


STATE_ENTRY = reg(STATE_MEMBER, b"{}")


@pytest.mark.parametrize("bad", [
    reg("workspace/../../evil.txt", b"pwned"),
    reg("../evil.txt", b"pwned"),
    reg("/tmp/evil-absolute.txt", b"pwned"),
    reg("workspace/./x", b"pwned"),
    reg("elsewhere/x", b"pwned"),
    special("workspace/hard", tarfile.LNKTYPE, linkname="/etc/passwd"),
    special("workspace/dev", tarfile.CHRTYPE),
    special("workspace/fifo", tarfile.FIFOTYPE),
], ids=["dotdot-inside", "dotdot", "absolute", "dot", "outside-prefix", "hardlink", "device", "fifo"])
def test_unsafe_members_are_refused(tmp_path: Path, existing: Path, bad: tuple) -> None:
    archive = craft(tmp_path / "evil.tar.zst", [STATE_ENTRY, dir_entry(), bad, manifest_entry(files=1, ws_bytes=5)])
    before = tree(existing)
    refused(archive, existing, "unsafe_path")
    assert_untouched(existing, before)
    assert not (tmp_path.parent / "evil.txt").exists()
    assert not (tmp_path / "evil.txt").exists()
    assert not Path("/tmp/evil-absolute.txt").exists()


def test_writing_through_a_symlink_is_refused(tmp_path: Path, existing: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    for target in (os.fspath(outside), "sub"):
        archive = craft(tmp_path / "evil.tar.zst", [
            STATE_ENTRY, dir_entry(), dir_entry("workspace/sub"),
            special("workspace/link", tarfile.SYMTYPE, linkname=target),
            reg("workspace/link/pwned", b"pwned"),
            manifest_entry(files=2, ws_bytes=5)])
        before = tree(existing)
        refused(archive, existing, "unsafe_path")
        assert_untouched(existing, before)
        assert list(outside.iterdir()) == []


def test_duplicate_member_is_refused(tmp_path: Path, existing: Path) -> None:
    archive = craft(tmp_path / "dup.tar.zst", [
        STATE_ENTRY, dir_entry(), special("workspace/a", tarfile.SYMTYPE, linkname="/etc/passwd"),
        reg("workspace/a", b"x"), manifest_entry(files=2, ws_bytes=1)])
    refused(archive, existing, "unsafe_path")


@pytest.mark.parametrize("entries", [
    [STATE_ENTRY, dir_entry(), manifest_entry(), reg("workspace/late", b"x")],  # member after the manifest
    [dir_entry(), manifest_entry()],  # no state.json
    [reg(STATE_MEMBER, b"[1, 2]"), dir_entry(), manifest_entry()],  # state is not an object
    [STATE_ENTRY, dir_entry(), reg(MANIFEST_MEMBER, b"{oops")],  # manifest is not JSON
    [STATE_ENTRY, dir_entry(), reg("workspace/x", b"abc"), manifest_entry(files=5, ws_bytes=3)],  # counts
], ids=["after-manifest", "no-state", "state-not-object", "manifest-not-json", "wrong-counts"])
def test_malformed_archives_are_bad_format(tmp_path: Path, existing: Path, entries: list) -> None:
    archive = craft(tmp_path / "bad.tar.zst", entries)
    before = tree(existing)
    refused(archive, existing, "bad_format")
    assert_untouched(existing, before)


def test_archive_without_manifest_is_truncated(tmp_path: Path, existing: Path) -> None:
    archive = craft(tmp_path / "nomanifest.tar.zst", [STATE_ENTRY, dir_entry(), reg("workspace/a", b"x")])
    refused(archive, existing, "truncated")


# --- pack refuses what unpack would refuse (second fresh-user run) -----------------------------------------
from snapshot.archive import WorkspaceNotArchivable  # noqa: E402


def test_pack_counts_a_sparse_file_at_its_apparent_size(tmp_path):
    """A 4 KiB-on-disk sparse file of 64 MiB was archived and came back as 64 MiB of real data."""
    ws = tmp_path / "ws"
    ws.mkdir()
    with open(ws / "sparse", "wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(WorkspaceNotArchivable) as e:
        pack(ws, {}, session="s", epoch=1, template="t", out_path=tmp_path / "a.tar.zst", max_bytes=32 << 20)
    assert e.value.code == "workspace_too_large"
    assert not (tmp_path / "a.tar.zst").exists(), "no half-written archive left"
    pack(ws, {}, session="s", epoch=1, template="t", out_path=tmp_path / "b.tar.zst", max_bytes=128 << 20)


def test_pack_bounds_members_and_name_lengths(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(12):
        (ws / f"f{i}").write_text("x")
    with pytest.raises(WorkspaceNotArchivable) as e:
        pack(ws, {}, session="s", epoch=1, template="t", out_path=tmp_path / "a.tar.zst", max_members=10)
    assert e.value.code == "workspace_too_large"
    deep = tmp_path / "ws2"
    deep.mkdir()
    here = os.getcwd()
    try:  # 17 x 250-byte names: a path over 4096 bytes (made step by step: the OS cannot open it whole)
        os.chdir(deep)
        for _ in range(17):
            os.mkdir("a" * 250)
            os.chdir("a" * 250)
    finally:
        os.chdir(here)
    with pytest.raises(WorkspaceNotArchivable) as e:
        pack(deep, {}, session="s", epoch=1, template="t", out_path=tmp_path / "c.tar.zst")
    assert e.value.code == "workspace_name_too_long"


# --------------------------------------------------------------------------------- read paths, ownership


@pytest.mark.parametrize("in_memory", [True, False])
def test_both_read_paths_round_trip_and_refuse_a_flipped_byte(tmp_path: Path, existing: Path, monkeypatch,
                                                             in_memory: bool) -> None:
    from snapshot import archive as archive_mod

    # small archives are read once into memory and decompressed from the bytes whose hash was checked;
    # larger ones are hashed in a first pass over the file and again while streamed: both must hold
    monkeypatch.setattr(archive_mod, "IN_MEMORY_ARCHIVE_BYTES", 16 << 20 if in_memory else 0)
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a")
    _, state = unpack(tmp_path / "a", tmp_path / "r", expect_session="sess-1", expect_sha256=sha.upper())
    assert state == STATE and tree(tmp_path / "r") == tree(ws)
    data = bytearray((tmp_path / "a").read_bytes())
    data[len(data) // 2] ^= 0x40
    (tmp_path / "a").write_bytes(bytes(data))
    before = tree(existing)
    refused(tmp_path / "a", existing, "checksum_mismatch", sha=sha)
    assert_untouched(existing, before)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_restored_entries_belong_to_the_owner_as_they_are_made(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    _, _, sha = pack_ws(ws, tmp_path / "a")
    dest = tmp_path / "r"
    unpack(tmp_path / "a", dest, expect_session="sess-1", expect_sha256=sha, owner=29999)
    entries = [dest, *dest.rglob("*")]
    assert len(entries) > 5 and any(p.is_symlink() for p in entries)
    assert {(p.lstat().st_uid, p.lstat().st_gid) for p in entries} == {(29999, 29999)}
    unpack(tmp_path / "a", tmp_path / "r2", expect_session="sess-1", expect_sha256=sha)  # no owner: ours
    assert {p.lstat().st_uid for p in [tmp_path / "r2", *(tmp_path / "r2").rglob("*")]} == {os.geteuid()}


# ----------------------------------------------------------------------------------- streamed restore


class _Cut:
    """A source that gives ``good`` bytes, then fails as a dropped connection does (the store's stream
    raises ``StoreUnavailable`` from ``read``)."""

    def __init__(self, data: bytes, good: int) -> None:
        self.data, self.good, self.pos = data, good, 0

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.good:
            raise StoreUnavailable("connection lost mid-body")
        n = self.good - self.pos if n < 0 else min(n, self.good - self.pos)
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def test_unpack_stream_round_trips_and_replaces_the_workspace(tmp_path: Path, existing: Path) -> None:
    ws = make_workspace(tmp_path)
    manifest, _, sha = pack_ws(ws, tmp_path / "a")
    got, state = unpack_stream(io.BytesIO((tmp_path / "a").read_bytes()), existing, expect_session="sess-1",
                               expect_sha256=sha)
    assert got == manifest and state == STATE and tree(existing) == tree(ws)
    assert [p.name for p in existing.parent.iterdir() if p.name.startswith(".live.")] == []


def test_unpack_stream_checks_the_sha256_before_the_swap(tmp_path: Path, existing: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(os.urandom(300_000))  # incompressible: zstd stores it, a flip stays a flip
    _, _, sha = pack_ws(ws, tmp_path / "a")
    data = bytearray((tmp_path / "a").read_bytes())
    data[len(data) // 2] ^= 0xFF
    before = tree(existing)
    with pytest.raises(SnapshotCorrupt) as info:
        unpack_stream(io.BytesIO(bytes(data)), existing, expect_session="sess-1", expect_sha256=sha)
    assert info.value.details["reason"] == "checksum_mismatch"
    assert_untouched(existing, before)


def test_unpack_stream_refuses_another_sessions_archive(tmp_path: Path, existing: Path) -> None:
    _, _, sha = pack_ws(make_workspace(tmp_path), tmp_path / "a", session="other")
    before = tree(existing)
    with pytest.raises(SnapshotCorrupt) as info:
        unpack_stream(io.BytesIO((tmp_path / "a").read_bytes()), existing, expect_session="sess-1",
                      expect_sha256=sha)
    assert info.value.details["reason"] == "foreign_session"
    assert_untouched(existing, before)


@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_a_transfer_cut_mid_stream_is_the_stores_error_not_a_corrupt_snapshot(
        tmp_path: Path, existing: Path, where: float) -> None:
    # a corrupt verdict makes the activator fall back to an older snapshot (losing turns); a cut
    # download must stay a store error, retried later, whatever the extractor was doing when it came
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(os.urandom(300_000))
    _, _, sha = pack_ws(ws, tmp_path / "a")
    data = (tmp_path / "a").read_bytes()
    before = tree(existing)
    with pytest.raises(StoreUnavailable):
        unpack_stream(_Cut(data, int(len(data) * where)), existing, expect_session="sess-1",  # type: ignore[arg-type]
                      expect_sha256=sha)
    assert_untouched(existing, before)
