"""GPU memory from ``nvidia-smi`` on an emulated cluster: a worker Pod whose PATH has ``nvidia-smi`` (a fake
here: no GPU on these machines) records its devices at registration, and the controller's gauges carry
them with no DRA objects at all (issue 9 item 4)."""

from __future__ import annotations

import os

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.k8s.conftest import Cluster, pool_doc, wait_for
from tests.unit.test_nvidia_smi import A100, MIB, fake_smi


def test_worker_gpu_memory_from_nvidia_smi_reaches_the_gauges(cluster_factory, tmp_path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_smi(bin_dir, f"printf '{A100}'", monkeypatch)  # the test kubelet gives Pods this process's PATH
    assert os.environ["PATH"].startswith(str(bin_dir))
    c: Cluster = cluster_factory()
    c.apply(pool_doc(name="gpus", replicas=1, slots=2))
    c.controller()
    wait_for(lambda: len(c.ready_workers("gpus")) == 1, 90, "one worker")
    (rec,) = c.workers("gpus").values()
    assert rec["gpus"] == "2" and int(rec["gpuMemoryBytes"]) == 2 * 81920 * MIB

    def gauges() -> dict[str, float]:
        text = httpx.get(c.controller_urls["controller"] + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("agent_substrate_gpu_memory") and s.labels.get("pool") == "gpus"}
    wait_for(lambda: gauges().get("agent_substrate_gpu_memory_total") == 2 * 81920 * MIB, 30, "GPU memory gauge")
    assert gauges()["agent_substrate_gpu_memory_fragmented"] == 0
    assert (bin_dir / "args").exists()  # the worker ran it
