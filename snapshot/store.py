"""Object stores for snapshot archives: a small async port and its adapters.

* :class:`ObjectStore` -- the port: ``put_file`` (conditional create), ``read`` (streamed: a consumer reads
  the object while its bytes arrive; there is no download-to-file), ``delete``, ``list_keys``.
* :class:`S3Store` -- any S3-compatible service through boto3 (AWS S3, MinIO, Ceph RGW, moto, ...).
* :class:`LocalDirStore` -- files under a directory (the embedded default; one machine only).
* :class:`MemoryStore` -- an in-memory fake with outage switches, for tests.

Every adapter has the same semantics: ``put_file`` never overwrites (``Conflict(code="snapshot_exists")``),
``read`` of a missing key raises ``NotFound(code="snapshot_missing")`` before the consumer is called, ``delete`` is
idempotent, and every foreign failure (network, timeouts, 5xx, OS errors, a transfer cut short -- raised from
the stream's ``read``) becomes ``StoreUnavailable`` (``raise ... from e``), which the API answers with
503 + ``Retry-After``.

Keys are ``/``-separated relative paths; :func:`snapshot_key` makes the ones snapshots use.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol, TypeVar, runtime_checkable

from substrate.errors import Conflict, NotFound, StoreUnavailable, public_detail
from substrate.settings import SnapshotSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

_COPY_CHUNK = 1 << 20
#: S3's smallest allowed part (except the last) and largest part count
S3_MIN_PART_BYTES = 5 * 1024 * 1024
S3_MAX_PARTS = 10_000

_SNAPSHOT_NAME = re.compile(r"(?P<epoch>[0-9]{12})-(?P<seq>[0-9]{6})-(?P<rand>[0-9a-f]{8})\.tar\.zst")


# ------------------------------------------------------------------------------------------------- keys


def _check_segment(what: str, value: str) -> None:
    if not value or "/" in value or value in (".", "..") or "\0" in value:
        raise ValueError(f"{what} {value!r} cannot be used in an object key")


def session_prefix(prefix: str, session: str) -> str:
    """The key prefix (ending in ``/``) under which all snapshots of ``session`` live.

    ``prefix`` is the store-wide namespace (``SnapshotSettings.prefix``; ``""`` for none).
    Raises ``ValueError`` if ``session`` contains ``/`` or is empty, ``.`` or ``..``.
    """
    _check_segment("session", session)
    prefix = prefix.strip("/")
    return f"{prefix}/{session}/" if prefix else f"{session}/"


def snapshot_key(prefix: str, session: str, epoch: int, seq: int) -> str:
    """A fresh, never-reused object key for one snapshot of ``session``.

    Shape: ``{prefix}/{session}/{epoch:012d}-{seq:06d}-{random8hex}.tar.zst``; keys of one session sort by
    epoch then sequence number (``seq`` is taken modulo 10**6). The random suffix makes two uploads never
    share a key, so the conditional create only ever fails for a genuine duplicate.
    """
    if epoch < 0 or seq < 0:
        raise ValueError("epoch and seq must be >= 0")
    return f"{session_prefix(prefix, session)}{epoch:012d}-{seq % 1_000_000:06d}-{uuid.uuid4().hex[:8]}.tar.zst"


def parse_snapshot_key(key: str) -> tuple[int, int] | None:
    """``(epoch, seq)`` of a key made by :func:`snapshot_key`, or None for any other key."""
    m = _SNAPSHOT_NAME.fullmatch(key.rpartition("/")[2])
    return (int(m["epoch"]), int(m["seq"])) if m else None


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid object key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or "\0" in part:
            raise ValueError(f"invalid object key {key!r}")


def _exists(key: str) -> Conflict:
    return Conflict(f"snapshot object {key!r} already exists", code="snapshot_exists", details={"key": key})


def _missing(key: str) -> NotFound:
    return NotFound(f"snapshot object {key!r} does not exist", code="snapshot_missing", details={"key": key})


def _unavailable(op: str, key: str, e: BaseException | str) -> StoreUnavailable:
    why = e if isinstance(e, str) else public_detail(e)
    return StoreUnavailable(f"snapshot store unavailable during {op} of {key!r}: {why}",
                            details={"op": op, "key": key})


class _Transfer:
    """The stream :meth:`ObjectStore.read` hands its consumer: reads ``raw``, turning any failure of the
    transfer into ``StoreUnavailable`` and an end before ``expected_bytes`` (when known) into one too, so
    a consumer never mistakes a cut download for a short (corrupt) object."""

    def __init__(self, raw: Any, op: str, key: str, expected_bytes: int | None) -> None:
        self._raw = raw
        self._op, self._key = op, key
        self.expected_bytes = expected_bytes
        self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._raw.read(n)
        except Exception as e:  # noqa: BLE001 - urllib3/botocore/OS errors alike: the transfer failed
            raise _unavailable(self._op, self._key, e) from e
        self.bytes += len(data)
        if not data and n != 0 and self.expected_bytes is not None and self.bytes < self.expected_bytes:
            raise _unavailable(self._op, self._key, f"short read: {self.bytes} of {self.expected_bytes} bytes")
        return data


# ------------------------------------------------------------------------------------------------- port


@runtime_checkable
class ObjectStore(Protocol):
    """Where snapshot archives live. Keys are ``/``-separated relative paths (see :func:`snapshot_key`)."""

    async def put_file(self, key: str, path: Path) -> None:
        """Upload the file at ``path`` under ``key``, only if ``key`` does not exist yet.

        Raises ``Conflict(code="snapshot_exists")`` if it does (nothing is overwritten),
        ``StoreUnavailable`` if the store cannot be reached, ``FileNotFoundError`` if ``path`` is missing.
        """
        ...

    async def read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        """Open ``key`` and call ``consume(stream)`` in a worker thread while the bytes arrive (no temp
        file: the consumer's work overlaps the transfer); returns what ``consume`` returns.

        ``stream.read(n)`` gives the object's bytes in order and ``b""`` at its end. A failure of the
        transfer itself (connection lost, timeout, fewer bytes than the object holds) is raised *from*
        ``stream.read`` as ``StoreUnavailable``; whatever else ``consume`` raises passes through
        untranslated. Raises ``NotFound(code="snapshot_missing")`` before ``consume`` is called if the
        key does not exist, ``StoreUnavailable`` if the store cannot be reached.
        """
        ...

    async def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error. Raises ``StoreUnavailable``."""
        ...

    async def list_keys(self, prefix: str) -> list[str]:
        """All keys starting with ``prefix`` (a plain string prefix), sorted. Raises ``StoreUnavailable``."""
        ...


# ----------------------------------------------------------------------------------------------- memory


class MemoryStore:
    """In-memory :class:`ObjectStore` with switches to simulate outages (tests only).

    * ``unavailable = True``: every call raises ``StoreUnavailable`` until set back to False;
    * ``fail_next(n)``: the next ``n`` calls raise ``StoreUnavailable`` without doing anything;
    * ``lose_next_response(n)``: the next ``n`` calls do their work, then raise ``StoreUnavailable``
      (the request reached the store but its answer was lost -- a retried put then sees ``Conflict``);
    * ``latency_s``: each call first sleeps that long (lets tests interleave concurrent calls).

    ``objects`` maps key -> bytes; ``calls`` records ``(op, key)`` of every call, failed ones included.
    """

    def __init__(self, *, latency_s: float = 0.0) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []
        self.unavailable = False
        self.latency_s = latency_s
        self._fail_next = 0
        self._lose_next = 0

    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` calls fail with ``StoreUnavailable`` before doing anything."""
        self._fail_next += n

    def lose_next_response(self, n: int = 1) -> None:
        """Make the next ``n`` calls take effect and then fail with ``StoreUnavailable``."""
        self._lose_next += n

    async def _enter(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        else:
            await asyncio.sleep(0)
        if self.unavailable:
            raise _unavailable(op, key, "store marked unavailable")
        if self._fail_next > 0:
            self._fail_next -= 1
            raise _unavailable(op, key, "injected failure")

    def _leave(self, op: str, key: str) -> None:
        if self._lose_next > 0:
            self._lose_next -= 1
            raise _unavailable(op, key, "injected lost response")

    async def put_file(self, key: str, path: Path) -> None:
        _check_key(key)
        data = Path(path).read_bytes()
        await self._enter("put", key)
        if key in self.objects:
            raise _exists(key)
        self.objects[key] = data
        self._leave("put", key)

    async def read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        _check_key(key)
        await self._enter("get", key)
        data = self.objects.get(key)
        if data is None:
            raise _missing(key)
        out = await asyncio.to_thread(consume, _Transfer(io.BytesIO(data), "get", key, len(data)))  # type: ignore[arg-type]
        self._leave("get", key)
        return out

    async def delete(self, key: str) -> None:
        _check_key(key)
        await self._enter("delete", key)
        self.objects.pop(key, None)
        self._leave("delete", key)

    async def list_keys(self, prefix: str) -> list[str]:
        await self._enter("list", prefix)
        keys = sorted(k for k in self.objects if k.startswith(prefix))
        self._leave("list", prefix)
        return keys


# ------------------------------------------------------------------------------------------------ local

_TMP_MARK = ".partial-"


class LocalDirStore:
    """:class:`ObjectStore` over files under ``root`` (created on demand); for one machine only.

    ``put_file`` copies to a hidden temp file beside the target and publishes it with ``os.link``, which
    fails atomically if the key exists: a reader never sees a half-written object and two writers can
    never both win. With ``fsync`` (default) the object and its directory are flushed before ``put_file``
    returns, so a committed snapshot survives a machine crash.
    """

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self._private = False

    def _path(self, key: str) -> Path:
        _check_key(key)
        return self.root / key

    def _make_private(self) -> None:
        """The store's folder is its owner's only (0700), once per instance: snapshots hold sessions'
        workspaces and state, and were 0644 under a 0755 folder (a fresh-user run untarred them as
        ``nobody``). A folder of another owner is left as it is (a warning says so)."""
        if self._private:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            if self.root.stat().st_mode & 0o077:
                os.chmod(self.root, 0o700)
        except OSError as e:
            log.warning("cannot make the snapshot folder %s private to this user (%s): other local users "
                        "may read the snapshots", self.root, e.strerror or e)
        self._private = True

    def _put(self, key: str, src: Any) -> None:
        target = self._path(key)
        try:
            self._make_private()
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():  # cheap early answer; the link below is the real guard
                raise _exists(key)
            tmp = target.parent / f"{_TMP_MARK}{target.name}.{uuid.uuid4().hex[:8]}"
            try:
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as dst:
                    shutil.copyfileobj(src, dst, _COPY_CHUNK)
                    if self.fsync:
                        dst.flush()
                        os.fsync(dst.fileno())
                try:
                    os.link(tmp, target)
                except FileExistsError:
                    raise _exists(key) from None
            finally:
                tmp.unlink(missing_ok=True)
            if self.fsync:
                dfd = os.open(target.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        finally:
            src.close()

    def _delete(self, key: str) -> None:
        target = self._path(key)
        try:
            target.unlink()
        except FileNotFoundError:
            return
        # drop emptied directories (a deleted session leaves nothing behind); best effort
        parent = target.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def _list(self, prefix: str) -> list[str]:
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not base.is_dir():
            if os.path.lexists(self.root) and not self.root.is_dir():
                raise NotADirectoryError(f"snapshot store root {self.root} is not a directory")
            return []
        keys: list[str] = []
        root = os.fspath(self.root)
        for dirpath, _dirs, names in os.walk(base):
            rel_dir = os.path.relpath(dirpath, root)
            for name in names:
                if name.startswith(_TMP_MARK):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    async def _run(self, op: str, key: str, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except (Conflict, NotFound, ValueError):
            raise
        except OSError as e:
            raise _unavailable(op, key, e) from e

    async def put_file(self, key: str, path: Path) -> None:
        self._path(key)
        src = open(path, "rb")  # FileNotFoundError here is the caller's, not the store's
        await self._run("put", key, self._put, key, src)

    def _read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        try:
            src = open(self._path(key), "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError):
            raise _missing(key) from None
        except OSError as e:
            raise _unavailable("get", key, e) from e
        with src:
            return consume(_Transfer(src, "get", key, os.fstat(src.fileno()).st_size))  # type: ignore[arg-type]

    async def read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        return await asyncio.to_thread(self._read, key, consume)

    async def delete(self, key: str) -> None:
        await self._run("delete", key, self._delete, key)

    async def list_keys(self, prefix: str) -> list[str]:
        return await self._run("list", prefix, self._list, prefix)


# --------------------------------------------------------------------------------------------------- S3


class S3Store:
    """:class:`ObjectStore` over an S3-compatible bucket, through one thread-safe boto3 client.

    Calls run in worker threads (``asyncio.to_thread``). The client connects with a short timeout
    (``connect_timeout_s``), retries little (``max_attempts`` in total, botocore "standard" mode) and
    keeps up to ``max_pool_connections`` connections. Files of ``multipart_threshold_bytes`` or more are
    uploaded in parts of ``part_size_bytes`` (at least 5 MiB), up to ``max_concurrent_parts`` at once; the
    conditional create (``If-None-Match: *``) is then sent on ``CompleteMultipartUpload``, and the upload
    is aborted on any failure. A missing bucket is created on the first upload (or by
    :meth:`ensure_bucket`). ``prefix`` namespaces every key inside the bucket (``list_keys`` strips it).
    Automatic CRC request checksums are off (``when_required``) for compatibility with S3 clones;
    integrity is the archive's sha256, verified on restore.
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, access_key_id: str | None = None,
                 secret_access_key: str | None = None, multipart_threshold_bytes: int = 8 * 1024 * 1024,
                 part_size_bytes: int = 8 * 1024 * 1024, max_concurrent_parts: int = 4,
                 connect_timeout_s: float = 2.0, read_timeout_s: float = 30.0, max_attempts: int = 3,
                 max_pool_connections: int = 32) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.region = region
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.part_size_bytes = max(part_size_bytes, S3_MIN_PART_BYTES)
        self.max_concurrent_parts = max(1, max_concurrent_parts)
        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"total_max_attempts": max(1, max_attempts), "mode": "standard"},
            max_pool_connections=max_pool_connections,
            s3={"addressing_style": "path"} if endpoint_url else None,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session()  # sessions are not thread-safe; the client made here is
        self._client = session.client(
            "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
            aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key, config=config)

    # -------------------------------------------------------------------------------- helpers

    def _full(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _code(e: Any) -> tuple[str, int]:
        err = getattr(e, "response", {}) or {}
        code = str(err.get("Error", {}).get("Code", ""))
        status = int(err.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status

    def _translate(self, op: str, key: str, e: Exception) -> Exception:
        """Map a boto/OS error to ours; returns the exception to raise (``from e``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(e, ClientError):
            code, status = self._code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                return _exists(key)
            if code == "NoSuchBucket":
                # the whole bucket is not there: the store is not the one the snapshots were written to
                # (a mistyped bucket) or it was deleted, never one object lost; a read that said
                # "missing" set each session's snapshots aside as corrupt (fresh-user round 18)
                err = _unavailable(op, key, f"the bucket {self.bucket!r} does not exist (NoSuchBucket)")
                err.details.update(s3Code=code, httpStatus=status)
                return err
            if op == "get" and (code in ("NoSuchKey", "404") or status == 404):
                return _missing(key)
            err = _unavailable(op, key, f"{code or 'error'} (HTTP {status})")
            err.details.update(s3Code=code, httpStatus=status)
            return err
        if isinstance(e, (BotoCoreError, OSError, TimeoutError)):
            return _unavailable(op, key, e)
        return e

    async def _call(self, op: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (Conflict, NotFound, ValueError, FileNotFoundError):
            raise
        except Exception as e:
            raise self._translate(op, key, e) from e

    def _is_no_bucket(self, e: Exception) -> bool:
        return self._code(e)[0] == "NoSuchBucket"

    # -------------------------------------------------------------------------------- bucket

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            code, status = self._code(e)
            if status != 404 and code not in ("404", "NoSuchBucket", "NotFound"):
                raise
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region and self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self._client.create_bucket(**kwargs)
        except ClientError as e:
            if self._code(e)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist. Raises ``StoreUnavailable``."""
        await self._call("ensure_bucket", self.bucket, self._ensure_bucket)

    def close(self) -> None:
        """Release the client's pooled connections."""
        self._client.close()

    # -------------------------------------------------------------------------------- put

    def _put_single(self, full: str, path: Path, size: int) -> None:
        with open(path, "rb") as f:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=f, ContentLength=size, IfNoneMatch="*")

    def _create_multipart(self, full: str) -> str:
        return self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]

    def _upload_part(self, full: str, upload_id: str, path: Path, number: int, offset: int, length: int) -> dict:
        with open(path, "rb", buffering=0) as f:  # one handle per part: parts run in parallel threads
            body = os.pread(f.fileno(), length, offset)
        if len(body) != length:
            raise OSError(f"file shrank during upload (part {number})")
        etag = self._client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                                        Body=body, ContentLength=length)["ETag"]
        return {"PartNumber": number, "ETag": etag}

    def _complete(self, full: str, upload_id: str, parts: list[dict]) -> None:
        self._client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                               MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    def _abort(self, full: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - best effort; a bucket lifecycle rule reaps the rest
            log.warning("could not abort multipart upload %s of %s", upload_id, full, exc_info=True)

    async def _put_multipart(self, key: str, full: str, path: Path, size: int) -> None:
        part = max(self.part_size_bytes, math.ceil(size / S3_MAX_PARTS))
        upload_id = await self._call("put", key, self._create_multipart, full)
        try:
            sem = asyncio.Semaphore(self.max_concurrent_parts)
            failed = False

            async def one(number: int, offset: int) -> dict | None:
                nonlocal failed
                async with sem:
                    if failed:  # another part failed: do not start more
                        return None
                    try:
                        return await self._call("put", key, self._upload_part, full, upload_id, path, number,
                                                offset, min(part, size - offset))
                    except BaseException:
                        failed = True
                        raise

            results = await asyncio.gather(*(one(i + 1, off) for i, off in enumerate(range(0, size, part))),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            await self._call("put", key, self._complete, full, upload_id, list(results))
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._abort, full, upload_id))
            raise

    async def put_file(self, key: str, path: Path) -> None:
        full = self._full(key)
        size = os.stat(path).st_size  # FileNotFoundError is the caller's
        # a missing bucket is not made here: in a store that held snapshots, an upload into a bucket made
        # again empty hid that the others were gone (snapshot.guard makes it, once, in a new directory)
        if size >= self.multipart_threshold_bytes:
            await self._put_multipart(key, full, path, size)
        else:
            await self._call("put", key, self._put_single, full, path, size)

    # -------------------------------------------------------------------------------- read, delete, list

    def _read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        full = self._full(key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
        except Exception as e:
            raise self._translate("get", key, e) from e
        body = resp["Body"]
        try:
            return consume(_Transfer(body, "get", key, resp.get("ContentLength")))  # type: ignore[arg-type]
        finally:
            body.close()

    async def read(self, key: str, consume: Callable[[BinaryIO], T]) -> T:
        return await asyncio.to_thread(self._read, key, consume)

    async def delete(self, key: str) -> None:
        await self._call("delete", key, self._client.delete_object, Bucket=self.bucket, Key=self._full(key))

    def _list(self, prefix: str) -> list[str]:
        from botocore.exceptions import ClientError

        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", ()))
        except ClientError as e:
            if self._is_no_bucket(e):
                return []
            raise
        return sorted(keys)

    async def list_keys(self, prefix: str) -> list[str]:
        return await self._call("list", prefix, self._list, prefix)


# ---------------------------------------------------------------------------------------------- factory


def make_store(settings: SnapshotSettings) -> ObjectStore:
    """The store ``settings`` name: ``LocalDirStore(settings.local_dir)`` or an ``S3Store`` on
    ``settings.bucket`` (snapshot keys carry ``settings.prefix`` themselves, see :func:`snapshot_key`).
    """
    if settings.store == "local":
        return LocalDirStore(settings.local_dir)
    if settings.store == "s3":
        return S3Store(settings.bucket, endpoint_url=settings.endpoint_url, region=settings.region,
                       access_key_id=settings.access_key_id, secret_access_key=settings.secret_access_key,
                       multipart_threshold_bytes=settings.multipart_threshold_bytes)
    raise ValueError(f"unknown snapshot store {settings.store!r}")
