"""The snapshot archive: one zstd-compressed tar stream per snapshot.

Layout (members in this order)::

    state.json        the agent's state (a JSON object)
    workspace/        the workspace root directory
    workspace/...     every directory, regular file and symlink under the workspace, depth first, sorted
    MANIFEST.json     a :class:`Manifest` -- always the LAST member

``Manifest.contentSha256`` is the sha256 of the uncompressed tar bytes that precede the manifest header;
the sha256 of the whole compressed file is returned by :func:`pack` and is what the directory commits and
:func:`unpack` verifies. The zstd frame also carries zstd's own content checksum.

What :func:`pack` keeps and drops:

* regular files (content, permission bits, whole-second mtime), directories, symlinks *as symlinks*
  (never followed, whatever their target -- an absolute ``.venv/bin/python -> /usr/bin/python3`` is
  restored as the same link);
* hard links are stored as independent regular files (the link between the names is lost);
* sockets, FIFOs and device nodes are skipped (counted in ``Manifest.skipped``); so are files that vanish
  while the workspace is being walked. Ownership (uid/gid) is never stored.

Safety of :func:`unpack` (equivalent to, and stricter than, ``tarfile``'s ``filter="data"``, whose
implementation in this Python (3.11.7) predates the 2025 fixes for filter bypasses through symlink chains):

* member names must be ``state.json``, ``MANIFEST.json``, ``workspace`` or ``workspace/<relative path>``
  with no empty, ``.`` or ``..`` component and no leading ``/``;
* only regular files, directories and symlinks are accepted (no hard links, devices, FIFOs, sparse files);
* nothing is ever created *through* a symlink: every parent of a member must be a directory created by this
  extraction, files are opened with ``O_EXCL | O_NOFOLLOW``, so a link (to anywhere) can never make the
  extraction write outside the staging directory;
* permission bits are sanitised like the data filter (no setuid/setgid/sticky, no group/other write; the
  owner can always read and write files and has full access to directories); ownership is never restored.

Everything is extracted into a fresh staging directory beside the workspace and swapped in only once the
whole archive has been read and verified, so a refused archive leaves the existing workspace untouched.
:func:`unpack_stream` does the same from a stream, as the bytes arrive from the object store (the wake
path): the archive's sha256 is then checked at the end of the stream, before the swap, instead of before
the first byte is decompressed (issue 11: a 1 MiB wake spent ~10 ms downloading to a temp file and
~7 ms unpacking it afterwards; streamed, the two overlap).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import tarfile
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from substrate.errors import SnapshotCorrupt

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_MEMBER = "state.json"
MANIFEST_MEMBER = "MANIFEST.json"
WORKSPACE_MEMBER = "workspace"
_WS_PREFIX = WORKSPACE_MEMBER + "/"

#: chunk size for file and archive I/O (bytes)
CHUNK_BYTES = 1 << 20
_BLOCK = tarfile.BLOCKSIZE  # 512
_ZERO_BLOCK = b"\0" * _BLOCK
_TAR_FORMAT = tarfile.PAX_FORMAT
_ENCODING = "utf-8"
_ERRORS = "surrogateescape"

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC


@dataclass(kw_only=True)
class Manifest:
    """What a snapshot holds; stored as the archive's last member ``MANIFEST.json``.

    ``createdAt`` is a Unix time in seconds; ``workspaceBytes`` the sum of regular file sizes (bytes);
    ``stateBytes`` the size of ``state.json`` (bytes); ``files`` the number of regular files and symlinks;
    ``contentSha256`` the hex sha256 of the uncompressed tar stream before the manifest; ``skipped`` the
    number of workspace entries not archived (sockets, FIFOs, devices, files that vanished mid-walk).
    """

    format: int = FORMAT_VERSION
    session: str
    epoch: int
    template: str
    createdAt: float
    workspaceBytes: int
    stateBytes: int
    files: int
    contentSha256: str
    skipped: int = 0

    def to_json(self) -> str:
        """The manifest as a compact JSON object (str)."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Manifest:
        """Parse a manifest; unknown keys are ignored (forward compatible).

        Raises ``SnapshotCorrupt`` (reason ``bad_format``) for invalid JSON, missing or mistyped fields, or a
        format version other than :data:`FORMAT_VERSION`.
        """
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _corrupt("bad_format", f"manifest is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise _corrupt("bad_format", "manifest is not a JSON object")
        if data.get("format") != FORMAT_VERSION:
            raise _corrupt("bad_format", f"unsupported snapshot format {data.get('format')!r}")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.name == "skipped":
                    continue
                raise _corrupt("bad_format", f"manifest lacks field {f.name!r}")
            value = data[f.name]
            want = {"str": str, "int": int, "float": (int, float)}[str(f.type)]
            if isinstance(value, bool) or not isinstance(value, want):
                raise _corrupt("bad_format", f"manifest field {f.name!r} has the wrong type")
            kwargs[f.name] = float(value) if f.type == "float" else value
        return cls(**kwargs)


def _corrupt(reason: str, message: str, **details: Any) -> SnapshotCorrupt:
    return SnapshotCorrupt(f"snapshot refused: {message}", details={"reason": reason, **details})


# --------------------------------------------------------------------------------------------------- pack


class _HashingWriter:
    """Raw file writer that hashes and counts what passes through (the compressed archive bytes)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        view = memoryview(data)
        while view:
            n = self._raw.write(view)
            view = view[n:]
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        self._raw.flush()


class _TarWriter:
    """Writes tar records into a zstd stream, hashing the uncompressed bytes (for ``contentSha256``)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self.content_sha = hashlib.sha256()
        self._hash = True

    def write(self, data: bytes) -> None:
        if self._hash:
            self.content_sha.update(data)
        self._sink.write(data)

    def stop_hashing(self) -> str:
        self._hash = False
        return self.content_sha.hexdigest()

    def header(self, name: str, *, type_: bytes, size: int = 0, mode: int = 0o644, mtime: int = 0,
               linkname: str = "") -> None:
        ti = tarfile.TarInfo(name)
        ti.type = type_
        ti.size = size
        ti.mode = mode
        ti.mtime = mtime
        ti.linkname = linkname
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        self.write(ti.tobuf(_TAR_FORMAT, _ENCODING, _ERRORS))

    def blob(self, name: str, data: bytes, *, mtime: int) -> None:
        self.header(name, type_=tarfile.REGTYPE, size=len(data), mtime=mtime)
        self.write(data)
        self.pad(len(data))

    def pad(self, size: int) -> None:
        rem = size % _BLOCK
        if rem:
            self.write(_ZERO_BLOCK[: _BLOCK - rem])


def _copy_file(tw: _TarWriter, path: str, size: int) -> None:
    """Stream exactly ``size`` bytes of ``path`` (already announced in the header) into the archive.

    A file that shrank meanwhile is padded with zeros, one that grew is cut at ``size``: the archive stays
    well-formed, the snapshot of a file written concurrently is simply torn (as with any live copy).
    """
    remaining = size
    fd = os.open(path, _READ_FLAGS)
    try:
        while remaining:
            chunk = os.read(fd, min(CHUNK_BYTES, remaining))
            if not chunk:
                log.warning("file shrank while being archived, padded with zeros: %s", path)
                while remaining:
                    n = min(CHUNK_BYTES, remaining)
                    tw.write(bytes(n))
                    remaining -= n
                break
            tw.write(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    tw.pad(size)


class WorkspaceNotArchivable(ValueError):
    """The workspace breaks a bound that its restore would refuse (apparent bytes, member count, name
    length): the snapshot is not taken, so a session never commits a snapshot it cannot come back from.
    ``code`` is the stable error code (``workspace_too_large`` or ``workspace_name_too_long``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def pack(workspace: Path, state: dict[str, Any], *, session: str, epoch: int, template: str,
         out_path: Path, zstd_level: int = 3, max_bytes: int | None = None,
         max_members: int | None = None) -> tuple[Manifest, int, str]:
    """Archive ``workspace`` and the agent ``state`` into one zstd-compressed tar at ``out_path``.

    Streams: memory stays at a few MiB whatever the workspace size. Symlinks are stored as links, never
    followed. ``out_path`` is created or truncated, and removed again if packing fails.

    Returns ``(manifest, compressed_size_bytes, sha256_hex_of_the_compressed_file)``.
    Raises ``TypeError``/``ValueError`` if ``state`` is not JSON-serialisable, ``ValueError`` if ``out_path``
    lies inside the workspace, ``FileNotFoundError``/``NotADirectoryError`` if the workspace is missing or
    not a directory, ``OSError`` on I/O failures, ``WorkspaceNotArchivable`` when the workspace's apparent
    bytes exceed ``max_bytes`` (default and ceiling :data:`MAX_TOTAL_BYTES`; a sparse file counts at its
    apparent size, which is what a restore writes), its members exceed ``max_members`` (default and ceiling
    :data:`MAX_MEMBERS`) or a name exceeds the restore's name bounds: the same bounds ``unpack`` enforces.
    """
    max_bytes = min(max_bytes or MAX_TOTAL_BYTES, MAX_TOTAL_BYTES)
    max_members = min(max_members or MAX_MEMBERS, MAX_MEMBERS)
    workspace = Path(workspace)
    out_path = Path(out_path)
    state_bytes = json.dumps(state, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    root = os.fspath(workspace)
    root_st = os.stat(root)
    if not stat.S_ISDIR(root_st.st_mode):
        raise NotADirectoryError(root)
    if out_path.resolve().is_relative_to(workspace.resolve()):
        raise ValueError(f"the archive {out_path} cannot be written inside the workspace it archives")
    now = time.time()
    cctx = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True)
    files = ws_bytes = skipped = n_members = 0
    try:
        with open(out_path, "wb", buffering=0) as raw:
            out = _HashingWriter(raw)
            zw = cctx.stream_writer(out, write_size=CHUNK_BYTES, closefd=False)
            tw = _TarWriter(zw)
            tw.blob(STATE_MEMBER, state_bytes, mtime=0)  # mtime 0: same content, same contentSha256
            tw.header(WORKSPACE_MEMBER, type_=tarfile.DIRTYPE, mode=stat.S_IMODE(root_st.st_mode),
                      mtime=int(root_st.st_mtime))
            # iterative depth-first walk, directories before their contents, names sorted
            stack: list[tuple[str, str]] = [(root, WORKSPACE_MEMBER)]
            while stack:
                dir_path, dir_name = stack.pop()
                try:
                    with os.scandir(dir_path) as it:
                        entries = sorted(it, key=lambda e: e.name)
                except FileNotFoundError:
                    skipped += 1
                    continue
                subdirs: list[tuple[str, str]] = []
                for e in entries:
                    name = f"{dir_name}/{e.name}"
                    n_members += 1
                    if n_members > max_members:
                        raise WorkspaceNotArchivable("workspace_too_large", f"the workspace has over "
                                                     f"{max_members} files and folders")
                    raw_name = name.encode(_ENCODING, _ERRORS)
                    if len(raw_name) > MAX_NAME_BYTES or len(e.name.encode(_ENCODING, _ERRORS)) > MAX_COMPONENT_BYTES:
                        raise WorkspaceNotArchivable("workspace_name_too_long", f"a path in the workspace is "
                                                     f"over {MAX_NAME_BYTES} bytes: {name[:120]!r}...")
                    try:
                        st = e.stat(follow_symlinks=False)
                        mode = st.st_mode
                        if stat.S_ISREG(mode):
                            if ws_bytes + st.st_size > max_bytes:
                                raise WorkspaceNotArchivable("workspace_too_large", f"the workspace holds over "
                                                             f"{max_bytes} bytes (sparse files count in full)")
                            tw.header(name, type_=tarfile.REGTYPE, size=st.st_size, mode=stat.S_IMODE(mode),
                                      mtime=int(st.st_mtime))
                            _copy_file(tw, e.path, st.st_size)
                            files += 1
                            ws_bytes += st.st_size
                        elif stat.S_ISDIR(mode):
                            tw.header(name, type_=tarfile.DIRTYPE, mode=stat.S_IMODE(mode), mtime=int(st.st_mtime))
                            subdirs.append((e.path, name))
                        elif stat.S_ISLNK(mode):
                            tw.header(name, type_=tarfile.SYMTYPE, mode=0o777, mtime=int(st.st_mtime),
                                      linkname=os.readlink(e.path))
                            files += 1
                        else:
                            log.info("not archived (socket, FIFO or device): %s", e.path)
                            skipped += 1
                    except FileNotFoundError:
                        # vanished between listing and reading; a file whose header is already written
                        # cannot vanish (the fd is open while copying), so the stream stays consistent
                        skipped += 1
                stack.extend(reversed(subdirs))
            content_sha = tw.stop_hashing()
            manifest = Manifest(session=session, epoch=epoch, template=template, createdAt=now,
                                workspaceBytes=ws_bytes, stateBytes=len(state_bytes), files=files,
                                contentSha256=content_sha, skipped=skipped)
            tw.blob(MANIFEST_MEMBER, manifest.to_json().encode(), mtime=int(now))
            tw.write(_ZERO_BLOCK * 2)  # end-of-archive marker
            zw.flush(zstandard.FLUSH_FRAME)
            zw.close()
    except OSError as e:
        _unlink_quietly(out_path)
        if e.errno == errno.ENAMETOOLONG:  # a path deeper than the OS can open: not restorable either
            raise WorkspaceNotArchivable("workspace_name_too_long",
                                         f"a path in the workspace is too long: {str(e.filename)[:120]}...") from e
        raise
    except BaseException:
        _unlink_quietly(out_path)
        raise
    return manifest, out.bytes, out.sha.hexdigest()


# ------------------------------------------------------------------------------------------------- unpack


class _HashingReader:
    """Reads the compressed file, hashing every byte (sha256 of the whole archive file) unless
    ``hashing`` is off (bytes already verified in memory: hashing them again proves nothing)."""

    def __init__(self, raw: BinaryIO, hashing: bool = True) -> None:
        self._raw = raw
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.hashing = hashing

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if self.hashing:
            self.sha.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK_BYTES):
            pass


class _ContentHasher:
    """Wraps the decompressed stream; can give the sha256 of its first N bytes after the fact.

    tarfile reads ahead, so when the manifest header is found the stream has already moved past its
    offset; the hasher state before each of the last few chunks is kept so the digest of exactly
    ``[0, offset)`` can be finished from there.
    """

    _KEEP = 8

    def __init__(self, raw: Any, enabled: bool) -> None:
        self._raw = raw
        self._enabled = enabled
        self._sha = hashlib.sha256()
        self._pos = 0
        self._recent: deque[tuple[Any, int, bytes]] = deque(maxlen=self._KEEP)

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if self._enabled and data:
            self._recent.append((self._sha.copy(), self._pos, data))
            self._sha.update(data)
        self._pos += len(data)
        return data

    def digest_upto(self, offset: int) -> str | None:
        """Hex sha256 of the stream's first ``offset`` bytes, or None if disabled or out of the window."""
        if not self._enabled:
            return None
        for before, start, data in reversed(self._recent):
            if start <= offset <= start + len(data):
                h = before.copy()
                h.update(data[: offset - start])
                return h.hexdigest()
        if offset == self._pos:
            return self._sha.hexdigest()
        return None


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _file_mode(mode: int) -> int:
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _dir_mode(mode: int) -> int:
    return (mode & 0o755) | 0o700


def _check_name(name: str) -> str:
    """Return the workspace-relative path of a member ('' for the root) or raise ``_Refused``."""
    if name == WORKSPACE_MEMBER:
        return ""
    if not name.startswith(_WS_PREFIX):
        raise _Refused("unsafe_path", f"member {name!r} is outside workspace/")
    rel = name[len(_WS_PREFIX):]
    for part in rel.split("/"):
        if part in ("", ".", "..") or "\0" in part:
            raise _Refused("unsafe_path", f"member {name!r} has an unsafe path")
    return rel


class _Extractor:
    """Creates members under ``root`` (a fresh, empty staging directory) without following any link;
    with ``owner`` (a uid), every entry it creates is given to that uid and its group of the same number
    as it is made (``fchown``/``lchown``: no walk afterwards, never through a link)."""

    def __init__(self, root: str, owner: int | None = None) -> None:
        self.root = root
        self.owner = owner
        self.dirs: dict[str, tuple[int, int]] = {"": (0o755, 0)}  # rel -> (mode, mtime) created by us
        self.others: set[str] = set()  # files and symlinks created by us
        self.buf = bytearray(CHUNK_BYTES)

    def _parent_ok(self, rel: str) -> None:
        parent = rel.rpartition("/")[0]
        if parent in self.dirs:
            return
        # the archive omitted a directory entry: create the missing ones, never through a link or file
        parts = parent.split("/")
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            if prefix in self.dirs:
                continue
            if prefix in self.others:
                raise _Refused("unsafe_path", f"member {rel!r} would be written through link or file {prefix!r}")
            os.mkdir(os.path.join(self.root, prefix), 0o700)
            self._own(os.path.join(self.root, prefix))
            self.dirs[prefix] = (0o755, 0)

    def _own(self, path: str) -> None:
        if self.owner is not None:
            os.lchown(path, self.owner, self.owner)

    def add(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> tuple[int, int]:
        """Extract one workspace member; returns (regular_file_bytes, files_counted)."""
        rel = _check_name(m.name)
        if rel == "":
            if not m.isdir():
                raise _Refused("bad_format", "workspace root is not a directory")
            self.dirs[""] = (m.mode, int(m.mtime))
            return 0, 0
        if rel in self.dirs or rel in self.others:
            raise _Refused("unsafe_path", f"member {m.name!r} appears twice")
        self._parent_ok(rel)
        path = os.path.join(self.root, rel)
        if m.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
            self._write_file(tar, m, path)
            self.others.add(rel)
            return m.size, 1
        if m.isdir():
            os.mkdir(path, 0o700)
            self._own(path)
            self.dirs[rel] = (m.mode, int(m.mtime))
            return 0, 0
        if m.issym():
            os.symlink(m.linkname, path)
            self._own(path)
            self.others.add(rel)
            return 0, 1
        kind = "hard link" if m.islnk() else "special or sparse file"
        raise _Refused("unsafe_path", f"member {m.name!r} is a {kind}, which snapshots never contain")

    def _write_file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> None:
        src = tar.extractfile(m)
        assert src is not None
        fd = os.open(path, _CREATE_FLAGS, 0o600)
        try:
            remaining = m.size
            buf = self.buf
            view = memoryview(buf)
            while remaining:
                n = src.readinto(view[: min(remaining, CHUNK_BYTES)])
                if not n:
                    raise _Refused("truncated", f"archive ends inside {m.name!r}")
                out = view[:n]
                while out:
                    out = out[os.write(fd, out):]
                remaining -= n
            if self.owner is not None:  # before fchmod: a chown clears no bits that fchmod then sets
                os.fchown(fd, self.owner, self.owner)
            os.fchmod(fd, _file_mode(m.mode))
            os.utime(fd, (m.mtime, m.mtime))
        finally:
            os.close(fd)

    def finish(self) -> None:
        """Apply directory modes and mtimes, deepest first (creating entries bumps a directory's mtime)."""
        for rel in sorted(self.dirs, key=len, reverse=True):
            mode, mtime = self.dirs[rel]
            path = os.path.join(self.root, rel) if rel else self.root
            os.chmod(path, _dir_mode(mode))
            if mtime:
                os.utime(path, (mtime, mtime))


def _read_member(tar: tarfile.TarFile, m: tarfile.TarInfo, limit: int) -> bytes:
    if not m.isreg() or m.type == tarfile.GNUTYPE_SPARSE:
        raise _Refused("bad_format", f"{m.name} is not a regular file")
    if m.size > limit:
        raise _Refused("bad_format", f"{m.name} is implausibly large ({m.size} bytes)")
    src = tar.extractfile(m)
    assert src is not None
    data = src.read(m.size)
    if len(data) != m.size:
        raise _Refused("truncated", f"archive ends inside {m.name}")
    return data


_MAX_STATE_BYTES = 1 << 30
_MAX_MANIFEST_BYTES = 1 << 20
#: bounds checked while streaming (a restore is hostile input): total uncompressed file bytes, members,
#: bytes of a member's path and of one path component (Linux PATH_MAX / NAME_MAX)
MAX_TOTAL_BYTES = 64 << 30
MAX_MEMBERS = 1_000_000
MAX_NAME_BYTES = 4096
MAX_COMPONENT_BYTES = 255


def _check_bounds(m: tarfile.TarInfo, members: int, total: int) -> None:
    if members > MAX_MEMBERS:
        raise _Refused("too_large", f"archive has over {MAX_MEMBERS} members")
    if total > MAX_TOTAL_BYTES:
        raise _Refused("too_large", f"archive expands to over {MAX_TOTAL_BYTES} bytes")
    raw = m.name.encode(_ENCODING, _ERRORS)
    if len(raw) > MAX_NAME_BYTES or any(len(p) > MAX_COMPONENT_BYTES for p in raw.split(b"/")):
        raise _Refused("unsafe_path", f"member name of {len(raw)} bytes is too long: {m.name[:80]!r}...")
    if len(m.linkname.encode(_ENCODING, _ERRORS)) > MAX_NAME_BYTES:
        raise _Refused("unsafe_path", f"link target of {m.name[:80]!r} is too long")


def _extract(raw: _HashingReader, staging: str, verify_content: bool,
             owner: int | None = None) -> tuple[Manifest, dict[str, Any]]:
    """Extract the whole archive into ``staging``; raise ``_Refused`` or let zstd/tar errors through."""
    dctx = zstandard.ZstdDecompressor()
    zr = dctx.stream_reader(raw, read_size=CHUNK_BYTES, read_across_frames=False)
    content = _ContentHasher(zr, enabled=verify_content)
    ex = _Extractor(staging, owner)
    ex._own(staging)
    state: dict[str, Any] | None = None
    manifest: Manifest | None = None
    ws_bytes = files = members = total = 0
    # mode "r|": a forward-only stream, never the whole archive in memory
    with tarfile.open(fileobj=content, mode="r|", bufsize=16 * 1024) as tar:
        for m in tar:
            members += 1
            total += max(0, m.size)
            _check_bounds(m, members, total)
            if manifest is not None:
                raise _Refused("bad_format", f"member {m.name!r} follows {MANIFEST_MEMBER}")
            if m.name == MANIFEST_MEMBER:
                content_sha = content.digest_upto(m.offset)
                manifest = Manifest.from_json(_read_member(tar, m, _MAX_MANIFEST_BYTES))
                if verify_content:
                    if content_sha is None:
                        raise _Refused("bad_format", "cannot locate the manifest to verify the content")
                    if content_sha != manifest.contentSha256:
                        raise _Refused("checksum_mismatch", "content sha256 does not match the manifest")
            elif m.name == STATE_MEMBER:
                if state is not None:
                    raise _Refused("bad_format", f"{STATE_MEMBER} appears twice")
                try:
                    state = json.loads(_read_member(tar, m, _MAX_STATE_BYTES))
                except (ValueError, UnicodeDecodeError) as e:
                    raise _Refused("bad_format", f"{STATE_MEMBER} is not valid JSON: {e}") from e
                if not isinstance(state, dict):
                    raise _Refused("bad_format", f"{STATE_MEMBER} is not a JSON object")
            else:
                n, f = ex.add(tar, m)
                ws_bytes += n
                files += f
        # read the zstd frame to its end: this is where zstd checks its own content checksum
        while zr.read(CHUNK_BYTES):
            pass
    if manifest is None:
        raise _Refused("truncated", f"archive ends before {MANIFEST_MEMBER}")
    if state is None:
        raise _Refused("bad_format", f"archive has no {STATE_MEMBER}")
    if manifest.workspaceBytes != ws_bytes or manifest.files != files:
        raise _Refused("bad_format", "workspace contents do not match the manifest's counts")
    ex.finish()
    return manifest, state


def _classify(e: BaseException) -> _Refused | None:
    if isinstance(e, _Refused):
        return e
    if isinstance(e, SnapshotCorrupt):
        return _Refused(e.details.get("reason", "bad_format"), e.message.removeprefix("snapshot refused: "))
    if isinstance(e, zstandard.ZstdError):
        msg = str(e)
        if "Unknown frame descriptor" in msg:
            return _Refused("bad_format", f"not a zstd archive ({msg})")
        return _Refused("checksum_mismatch", f"compressed data is corrupt ({msg})")
    if isinstance(e, tarfile.ReadError):
        msg = str(e)
        if "unexpected end" in msg or "empty file" in msg:
            return _Refused("truncated", f"archive is truncated ({msg})")
        return _Refused("bad_format", f"not a valid tar stream ({msg})")
    if isinstance(e, tarfile.TarError):
        return _Refused("bad_format", f"not a valid tar stream ({e})")
    if isinstance(e, (UnicodeError, ValueError)):
        return _Refused("bad_format", f"not a valid tar stream ({e})")
    return None


def file_sha256(path: Path) -> str:
    """Hex sha256 of a whole file, read in ``CHUNK_BYTES`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


#: archives up to this size are read into memory once: the bytes whose sha256 is checked are the very
#: bytes decompressed (one read and one hash instead of two, and no window between check and use);
#: larger ones are hashed in a first pass over the file and again while they are streamed
IN_MEMORY_ARCHIVE_BYTES = 16 << 20


def unpack(archive_path: Path, workspace: Path, *, expect_session: str,
           expect_sha256: str | None, owner: int | None = None) -> tuple[Manifest, dict[str, Any]]:
    """Restore an archive made by :func:`pack` into ``workspace``, replacing what was there.

    ``owner``: a uid that every restored entry (the workspace root included) is given to, with the
    group of the same number, as it is created (None: left to the caller's uid).

    The sha256 of the whole file is checked against ``expect_sha256`` (when given) before anything is
    decompressed (an archive of up to :data:`IN_MEMORY_ARCHIVE_BYTES` is read into memory once and
    decompressed from the bytes checked); then one streamed pass decompresses and extracts into a fresh staging directory beside
    ``workspace``, bounding members (:data:`MAX_MEMBERS`), total bytes (:data:`MAX_TOTAL_BYTES`) and name
    lengths as it goes (reason ``too_large`` / ``unsafe_path``); only when the archive is complete and well-formed and its manifest names ``expect_session``, the
    staging directory is swapped in (``renameat2(RENAME_EXCHANGE)`` where available, else two renames) and
    the old workspace removed. When ``expect_sha256`` is None, ``Manifest.contentSha256`` is verified
    instead (with a matching file sha256 it is implied and skipped).

    Returns ``(manifest, state)``. Raises ``SnapshotCorrupt`` with ``details["reason"]`` one of
    ``checksum_mismatch``, ``truncated``, ``foreign_session``, ``bad_format``, ``unsafe_path``; on any
    error the existing workspace is untouched. ``FileNotFoundError`` if ``archive_path`` does not exist,
    ``OSError`` on local I/O failures.
    """
    archive_path = Path(archive_path)
    workspace = Path(workspace)
    parent = workspace.parent
    parent.mkdir(parents=True, exist_ok=True)
    in_memory: bytes | None = None
    if expect_sha256 is not None:  # verify before decompressing a single byte (sha256 runs at ~GB/s)
        with open(archive_path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size <= IN_MEMORY_ARCHIVE_BYTES:
                in_memory = f.read(IN_MEMORY_ARCHIVE_BYTES + 1)
        actual = hashlib.sha256(in_memory).hexdigest() if in_memory is not None else file_sha256(archive_path)
        if actual != expect_sha256.lower():
            raise _corrupt("checksum_mismatch", f"archive sha256 {actual} != expected {expect_sha256}",
                           path=str(archive_path), sha256=actual, expected=expect_sha256)
    with (io.BytesIO(in_memory) if in_memory is not None else open(archive_path, "rb", buffering=0)) as f:
        return _restore(_HashingReader(f, hashing=in_memory is None), workspace, expect_session=expect_session,
                        expect_sha256=expect_sha256, owner=owner, source=str(archive_path))


def unpack_stream(source: BinaryIO, workspace: Path, *, expect_session: str, expect_sha256: str | None,
                  owner: int | None = None) -> tuple[Manifest, dict[str, Any]]:
    """Restore an archive made by :func:`pack` from ``source`` (a readable binary stream, e.g. an object
    store's response body) into ``workspace`` in one pass, as the bytes arrive: download and extraction
    overlap instead of following each other.

    Same checks, refusals and return value as :func:`unpack`, with one difference in order: the sha256 of
    the archive (``expect_sha256``) is computed over the very bytes decompressed and checked when the
    stream ends, **before** the staging directory is swapped in, rather than before the first byte is
    decompressed. Until then everything lives in a fresh staging directory that a refused archive never
    leaves, and extraction is bounded as for any hostile archive (members, total bytes, names; no link
    is followed), so a corrupt or tampered object can cost work and staging space, never the workspace.
    Whatever ``source.read`` raises (a cut connection, a short read reported by the store) goes through
    unchanged, so the caller can tell a store failure from a corrupt snapshot.
    """
    workspace = Path(workspace)
    workspace.parent.mkdir(parents=True, exist_ok=True)
    return _restore(_HashingReader(source), workspace, expect_session=expect_session,
                    expect_sha256=expect_sha256, owner=owner, source="stream")


def _restore(raw: _HashingReader, workspace: Path, *, expect_session: str, expect_sha256: str | None,
             owner: int | None, source: str) -> tuple[Manifest, dict[str, Any]]:
    """Extract ``raw`` into a staging directory beside ``workspace``, check it, swap it in (see
    :func:`unpack`). ``raw`` not hashing: its bytes were verified against ``expect_sha256`` already."""
    staging = tempfile.mkdtemp(prefix=f".{workspace.name}.unpack-", dir=workspace.parent)
    try:
        refused: _Refused | None = None
        try:
            manifest, state = _extract(raw, staging, verify_content=expect_sha256 is None, owner=owner)
        except Exception as e:  # zstd, tar and our own refusals; local OSErrors (ENOSPC...) go through
            refused = _classify(e)
            if refused is None:
                raise
        raw.drain()  # hash whatever the decompressor did not need (trailing bytes, or after an error)
        actual = raw.sha.hexdigest() if raw.hashing else (expect_sha256 or "").lower()
        if expect_sha256 is not None and actual != expect_sha256.lower():
            reason = "truncated" if refused is not None and refused.reason == "truncated" else "checksum_mismatch"
            raise _corrupt(reason, f"archive sha256 {actual} != expected {expect_sha256}"
                           + (f" ({refused.message})" if refused else ""),
                           path=source, sha256=actual, expected=expect_sha256)
        if refused is not None:
            raise _corrupt(refused.reason, refused.message, path=source)
        if manifest.session != expect_session:
            raise _corrupt("foreign_session", f"archive belongs to session {manifest.session!r}, "
                           f"not {expect_session!r}", session=manifest.session, expected=expect_session)
        _swap_in(staging, workspace)
    except BaseException:
        _rmtree(staging)
        raise
    return manifest, state


# ------------------------------------------------------------------------------------------- filesystem

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
except (AttributeError, OSError):  # not glibc >= 2.28 / not Linux
    _renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False if the platform or filesystem cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _swap_in(staging: str, workspace: Path) -> None:
    """Make ``staging`` the workspace and remove the previous one (``staging`` is gone afterwards)."""
    target = os.fspath(workspace)
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        _rmtree(staging)  # now holds the old workspace
        return
    old = f"{staging}.old"
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    _rmtree(old)


def _rmtree(path: str) -> None:
    """Remove a tree even if some directories lost their owner write/exec bit; never raises."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        _unlink_quietly(Path(path))
        return

    def onerror(func: Any, p: str, exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            log.warning("could not remove %s", p)

    shutil.rmtree(path, onerror=onerror)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
