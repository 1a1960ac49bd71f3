"""Suspend/resume benchmark of the snapshot path: pack + upload, download streamed into a verified unpack.

``python -m snapshot.bench [--repeats N] [--sizes-mib 1,16,64]`` runs it against a moto S3 server on loopback
and against the local directory store, and prints a markdown table. Needs the dev extra (moto).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from snapshot.archive import pack, unpack_stream
from snapshot.store import ObjectStore, snapshot_key
from substrate.quantiles import percentile

_WORDS = [b"lorem", b"ipsum", b"dolor", b"agent", b"session", b"snapshot", b"def", b"return", b"self", b"import",
          b"async", b"await", b"value", b"count", b"=", b"(", b")", b":"]


def build_workspace(root: Path, size_bytes: int, *, seed: int = 1) -> int:
    """Fill ``root`` with about ``size_bytes``: half incompressible random data in files of up to 1 MiB,
    half source-like text in 32 KiB files spread over nested directories. Returns the number of files."""
    rng = random.Random(seed)
    files = 0
    remaining = size_bytes // 2
    while remaining > 0:
        n = min(1 << 20, remaining)
        d = root / "data" / f"shard{files % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"blob{files}.bin").write_bytes(rng.randbytes(n))
        remaining -= n
        files += 1
    remaining = size_bytes - size_bytes // 2
    i = 0
    while remaining > 0:
        n = min(32 << 10, remaining)
        d = root / "src" / f"pkg{i % 16}" / f"mod{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        lines = [b" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + b"\n" for _ in range(64)]
        body = b"".join(lines)
        (d / f"file{i}.py").write_bytes((body * (n // len(body) + 1))[:n])
        remaining -= n
        i += 1
        files += 1
    return files


def _pct(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) of samples in seconds, as milliseconds (the project's one
    percentile definition, :func:`substrate.quantiles.percentile`)."""
    return (percentile(samples, q) or 0.0) * 1000


async def bench_resume(store: ObjectStore, sizes_bytes: tuple[int, ...] = (1 << 20, 16 << 20, 64 << 20),
                       repeats: int = 10, *, work_dir: Path | None = None) -> list[dict[str, Any]]:
    """Time suspend (pack + ``put_file``) and resume (the restore's own path: ``read`` streamed into the
    sha256-verified ``unpack_stream``, as ``SnapshotManager.restore`` does) per size.

    Each size: one workspace built by :func:`build_workspace`, ``repeats`` suspends (each to a new key) and
    ``repeats`` resumes of one of them, each resume into a fresh directory (as a new activation does);
    clean-up is outside the timed region. Returns one dict per size: ``sizeBytes``, ``files``,
    ``archiveBytes``, ``resumeP50Ms``, ``resumeP95Ms``, ``suspendP50Ms``, ``suspendP95Ms``, ``repeats``
    (percentiles by linear interpolation, the project's one definition).
    """
    results: list[dict[str, Any]] = []
    for size in sizes_bytes:
        with tempfile.TemporaryDirectory(prefix="snapbench-", dir=work_dir) as tmp:
            root = Path(tmp)
            ws = root / "ws"
            ws.mkdir()
            files = build_workspace(ws, size)
            session = f"bench-{size}"
            suspend_s: list[float] = []
            keys: list[str] = []
            sha = ""
            archive_bytes = 0
            for i in range(repeats):
                archive = root / f"out-{i}.tar.zst"
                t0 = time.perf_counter()
                _, archive_bytes, sha = await asyncio.to_thread(
                    pack, ws, {"turn": i}, session=session, epoch=1, template="bench", out_path=archive)
                key = snapshot_key("bench", session, 1, i)
                await store.put_file(key, archive)
                suspend_s.append(time.perf_counter() - t0)
                keys.append(key)
                archive.unlink()
            resume_s: list[float] = []
            for i in range(repeats):
                dest = root / f"restored-{i}"
                t0 = time.perf_counter()
                await store.read(keys[-1], functools.partial(unpack_stream, workspace=dest, expect_session=session,
                                                             expect_sha256=sha))
                resume_s.append(time.perf_counter() - t0)
                shutil.rmtree(dest)
            for key in keys:
                await store.delete(key)
            results.append({
                "sizeBytes": size, "files": files, "archiveBytes": archive_bytes, "repeats": repeats,
                "resumeP50Ms": _pct(resume_s, 50), "resumeP95Ms": _pct(resume_s, 95),
                "suspendP50Ms": _pct(suspend_s, 50), "suspendP95Ms": _pct(suspend_s, 95),
            })
    return results


def markdown_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """Render ``(store name, bench_resume row)`` pairs as a markdown table."""
    out = ["| store | workspace | files | archive | resume p50 | resume p95 | suspend p50 | suspend p95 |",
           "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        out.append(f"| {name} | {r['sizeBytes'] / (1 << 20):.0f} MiB | {r['files']} | "
                   f"{r['archiveBytes'] / (1 << 20):.1f} MiB | {r['resumeP50Ms']:.1f} ms | "
                   f"{r['resumeP95Ms']:.1f} ms | {r['suspendP50Ms']:.1f} ms | {r['suspendP95Ms']:.1f} ms |")
    return "\n".join(out)


async def _main(sizes: tuple[int, ...], repeats: int) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    from snapshot.store import LocalDirStore, S3Store

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        s3 = S3Store("snapshot-bench", endpoint_url=f"http://{host}:{port}", region="us-east-1",
                     access_key_id="bench", secret_access_key="bench")
        await s3.ensure_bucket()
        rows += [("S3 (moto, loopback)", r) for r in await bench_resume(s3, sizes, repeats)]
        s3.close()
        with tempfile.TemporaryDirectory(prefix="snapbench-store-") as d:
            local = LocalDirStore(Path(d))
            rows += [("local dir (fsync)", r) for r in await bench_resume(local, sizes, repeats)]
    finally:
        server.stop()
    print(markdown_table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sizes-mib", default="1,16,64", help="comma-separated workspace sizes in MiB")
    args = parser.parse_args()
    asyncio.run(_main(tuple(int(s) << 20 for s in args.sizes_mib.split(",")), args.repeats))
