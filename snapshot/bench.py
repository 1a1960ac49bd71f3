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
from collections.abc import Mapping
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


async def bench_resume(stores: Mapping[str, ObjectStore], sizes_bytes: tuple[int, ...] = (1 << 20, 16 << 20, 64 << 20),
                       repeats: int = 10, *, work_dir: Path | None = None) -> list[dict[str, Any]]:
    """Time suspend (pack + ``put_file``) and resume (the restore's own path: ``read`` streamed into the
    sha256-verified ``unpack_stream``, as ``SnapshotManager.restore`` does) per store and size.

    The stores are measured **in alternation**, each repeat in the opposite order to the one before
    (A B, B A, ...), so they see the same machine state. Measured one after the other (all of S3, then all
    of the local store, as ``make bench`` did), the second store looked twice as slow: on this machine's
    ext4 (mounted with ``discard``) every restore got slower as the run wrote and deleted hundreds of MiB,
    whichever store served it (``docs/bench/2026-12-03-local-vs-s3.md``).

    Each size: one workspace built by :func:`build_workspace`; per repeat and store one suspend (to a new
    key) and one resume of that store's first key into a fresh directory (as a new activation does);
    clean-up is outside the timed region. Returns one dict per (size, store): ``store``, ``sizeBytes``,
    ``files``, ``archiveBytes``, ``resumeP50Ms``, ``resumeP95Ms``, ``suspendP50Ms``, ``suspendP95Ms``,
    ``repeats`` (percentiles by linear interpolation, the project's one definition).
    """
    results: list[dict[str, Any]] = []
    names = list(stores)
    for size in sizes_bytes:
        with tempfile.TemporaryDirectory(prefix="snapbench-", dir=work_dir) as tmp:
            root = Path(tmp)
            ws = root / "ws"
            ws.mkdir()
            files = build_workspace(ws, size)
            session = f"bench-{size}"
            suspend_s: dict[str, list[float]] = {n: [] for n in names}
            resume_s: dict[str, list[float]] = {n: [] for n in names}
            keys: dict[str, list[str]] = {n: [] for n in names}
            sha: dict[str, str] = {}
            archive_bytes = 0
            order = [names[::-1] if i % 2 else names for i in range(repeats)]
            for i, turn in enumerate(order):
                for name in turn:
                    archive = root / f"out-{i}.tar.zst"
                    t0 = time.perf_counter()
                    _, archive_bytes, sha[name] = await asyncio.to_thread(
                        pack, ws, {"turn": i}, session=session, epoch=1, template="bench", out_path=archive)
                    key = snapshot_key("bench", session, 1, i)
                    await stores[name].put_file(key, archive)
                    suspend_s[name].append(time.perf_counter() - t0)
                    keys[name].append(key)
                    archive.unlink()
            for i, turn in enumerate(order):
                for name in turn:
                    dest = root / f"restored-{name}-{i}"
                    t0 = time.perf_counter()
                    await stores[name].read(keys[name][-1], functools.partial(
                        unpack_stream, workspace=dest, expect_session=session, expect_sha256=sha[name]))
                    resume_s[name].append(time.perf_counter() - t0)
                    shutil.rmtree(dest)
            for name in names:
                for key in keys[name]:
                    await stores[name].delete(key)
                results.append({
                    "store": name, "sizeBytes": size, "files": files, "archiveBytes": archive_bytes,
                    "repeats": repeats,
                    "resumeP50Ms": _pct(resume_s[name], 50), "resumeP95Ms": _pct(resume_s[name], 95),
                    "suspendP50Ms": _pct(suspend_s[name], 50), "suspendP95Ms": _pct(suspend_s[name], 95),
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
        with tempfile.TemporaryDirectory(prefix="snapbench-store-") as d:
            stores = {"S3 (moto, loopback)": s3, "local dir (fsync)": LocalDirStore(Path(d))}
            rows += [(r["store"], r) for r in await bench_resume(stores, sizes, repeats)]
        s3.close()
    finally:
        server.stop()
    print(markdown_table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sizes-mib", default="1,16,64", help="comma-separated workspace sizes in MiB")
    args = parser.parse_args()
    asyncio.run(_main(tuple(int(s) << 20 for s in args.sizes_mib.split(",")), args.repeats))
