"""Reading a worker's GPUs from ``nvidia-smi`` (``workers.devices``), with fake ``nvidia-smi`` scripts on
PATH (no GPU on these machines): parsing, a missing binary, failures that must not stop a worker."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from workers.devices import Gpu, NvidiaSmiError, gpu_inventory, parse_nvidia_smi, query_gpus

MIB = 1024 * 1024
A100 = "0, GPU-6f1c, NVIDIA A100-SXM4-80GB, 81920\n1, GPU-77aa, NVIDIA A100-SXM4-80GB, 81920\n"


def fake_smi(tmp: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable ``nvidia-smi`` in ``tmp`` (first on PATH) running the shell ``body``; it records
    its arguments in ``tmp/args``."""
    p = tmp / "nvidia-smi"
    p.write_text(f'#!/bin/sh\necho "$@" > "{tmp}/args"\n{body}\n')
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}")
    return p


def test_parse_rows_names_with_commas_and_unknown_memory() -> None:
    gpus = parse_nvidia_smi("0, GPU-a, NVIDIA H100 80GB HBM3, 81559\n\n1, GPU-b, Tesla T4, [N/A]\n"
                            "2, GPU-c, Weird, Name, Inc, 1024\n")
    assert gpus == [Gpu(0, "GPU-a", "NVIDIA H100 80GB HBM3", 81559 * MIB), Gpu(1, "GPU-b", "Tesla T4", None),
                    Gpu(2, "GPU-c", "Weird, Name, Inc", 1024 * MIB)]
    assert parse_nvidia_smi("") == []


@pytest.mark.parametrize("text,message", [("0, GPU-a, 1024", "line 1: expected"),
                                          ("0, GPU-a, A, 1\nx, GPU-b, B, 2", "line 2: index 'x'")])
def test_parse_refuses_rows_not_in_the_asked_form(text: str, message: str) -> None:
    with pytest.raises(NvidiaSmiError, match=message):
        parse_nvidia_smi(text)


async def test_query_runs_the_binary_on_path_with_the_csv_query(tmp_path: Path, monkeypatch) -> None:
    fake_smi(tmp_path, f"printf '{A100}'", monkeypatch)
    gpus = await query_gpus()
    assert [g.memory_bytes for g in gpus or []] == [81920 * MIB, 81920 * MIB]
    assert (tmp_path / "args").read_text().split() == [
        "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
    assert await gpu_inventory() == (2, 2 * 81920 * MIB)


async def test_no_binary_or_disabled_reports_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    assert await query_gpus() is None and await gpu_inventory() is None
    fake_smi(tmp_path, f"printf '{A100}'", monkeypatch)
    assert await query_gpus("") is None  # SUBSTRATE_WORKER__NVIDIA_SMI="" turns it off


async def test_failures_raise_for_the_query_and_are_logged_not_raised_for_the_inventory(tmp_path, monkeypatch,
                                                                                        caplog) -> None:
    fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate' >&2; exit 9", monkeypatch)
    with pytest.raises(NvidiaSmiError, match="exited with 9: NVIDIA-SMI has failed"):
        await query_gpus()
    assert await gpu_inventory() is None
    assert "nvidia-smi failed" in caplog.text
    fake_smi(tmp_path, "sleep 30", monkeypatch)
    with pytest.raises(NvidiaSmiError, match="did not answer"):
        await query_gpus(timeout_s=0.3)
