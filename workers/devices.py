"""The GPUs a worker can see, from ``nvidia-smi`` when the binary is present (issue 9 item 4).

A worker Pod sees only the devices its ResourceClaims were allocated (the NVIDIA driver's container
runtime hides the others), so ``nvidia-smi`` inside it reports exactly this worker's devices. The worker
runs ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`` once at
registration and records the device count and total memory in its registry record (``WorkerRecord.gpus``,
``gpuMemoryBytes``); the pool controller prefers these figures over the DRA objects' for the GPU gauges.
No binary (no GPU, or a CPU image): nothing is reported and nothing fails.

``memory.total`` with ``nounits`` is in MiB. Rows whose memory is not a number (``[N/A]``,
``[Not Supported]``) are counted as devices with unknown memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)

QUERY = ("--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class Gpu:
    """One device as ``nvidia-smi`` lists it; ``memory_bytes`` is None when it reports no number."""

    index: int
    uuid: str
    name: str
    memory_bytes: int | None


class NvidiaSmiError(Exception):
    """``nvidia-smi`` ran but its answer is unusable (exit status, timeout, output not in the asked form)."""


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of ``index, uuid, name, memory.total`` (CSV, no header, MiB) -> devices. Blank lines are
    skipped; raises ``NvidiaSmiError`` naming the line when a row does not have the four columns or its
    index is not an integer."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 4:
            raise NvidiaSmiError(f"nvidia-smi line {n}: expected index, uuid, name, memory.total: {line!r}")
        # a product name may itself contain commas: the first two and the last column are fixed
        index, uuid, name, mem = cols[0], cols[1], ", ".join(cols[2:-1]), cols[-1]
        try:
            i = int(index)
        except ValueError:
            raise NvidiaSmiError(f"nvidia-smi line {n}: index {index!r} is not an integer") from None
        try:
            mib: int | None = int(float(mem))
        except ValueError:
            mib = None  # [N/A], [Not Supported]
        out.append(Gpu(i, uuid, name, None if mib is None or mib < 0 else mib * 1024 * 1024))
    return out


async def query_gpus(binary: str = "nvidia-smi", timeout_s: float = 10.0) -> list[Gpu] | None:
    """The devices ``binary`` reports, or None when it is not installed (or ``binary`` is empty: off).
    Raises ``NvidiaSmiError`` when it runs but fails (non-zero exit, timeout, unreadable output)."""
    if not binary:
        return None
    path = shutil.which(binary)
    if path is None:
        return None
    proc = await asyncio.create_subprocess_exec(path, *QUERY, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its whole group: a wrapper script's children too
        await proc.wait()
        raise NvidiaSmiError(f"{path} did not answer within {timeout_s} s") from None
    if proc.returncode != 0:
        raise NvidiaSmiError(f"{path} exited with {proc.returncode}: {err.decode(errors='replace').strip()[:300]}")
    return parse_nvidia_smi(out.decode(errors="replace"))


async def gpu_inventory(binary: str = "nvidia-smi", timeout_s: float = 10.0) -> tuple[int, int] | None:
    """(device count, total memory bytes of the devices that report it) for the worker record, or None
    when there is nothing to report (no binary, or it failed: logged, never raised; a worker starts
    without its GPU figures rather than not at all)."""
    try:
        gpus = await query_gpus(binary, timeout_s)
    except (NvidiaSmiError, OSError) as e:
        log.warning("GPU inventory from nvidia-smi failed", extra={"error": str(e)})
        return None
    if not gpus:
        return None
    return len(gpus), sum(g.memory_bytes or 0 for g in gpus)
