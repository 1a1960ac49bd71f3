"""Without DRA objects (local backend, or any backend with no ``gpu_memory``), the GPU gauges carry what
the workers read from ``nvidia-smi`` (``WorkerRecord.gpuMemoryBytes``); memory of workers not READY is
fragmented (issue 9 item 4)."""

from __future__ import annotations

import time
import uuid

import pytest

from substrate import metrics
from substrate.directory import Directory
from substrate.models import WorkerRecord, WorkerState
from substrate.pool import PoolController
from substrate.settings import Settings
from substrate.specs import load_documents

GIB = 1 << 30


class Backend:
    def __init__(self, wids: list[str]) -> None:
        self.wids = wids

    async def create(self, pool, worker_id):
        pass  # a replacement for the draining worker: not started here (not what this test is about)

    async def delete(self, worker_id):
        pass

    def running(self):
        return {w: "gpus" for w in self.wids}

    def reap(self):
        return []

    async def close(self):
        pass


@pytest.fixture
async def d(redis_url):
    d = Directory(redis_url, f"gg{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


async def test_gauges_from_worker_reported_gpu_memory(d) -> None:
    now = time.time()
    for wid, state, mem in (("w1", WorkerState.READY, 80 * GIB), ("w2", WorkerState.DRAINING, 40 * GIB),
                            ("w3", WorkerState.READY, None)):
        await d.register_worker(WorkerRecord(id=wid, pool="gpus", address=f"http://{wid}", slots=1, state=state,
                                             leaseExpiresAt=now + 60, startedAt=now, gpus=1 if mem else None,
                                             gpuMemoryBytes=mem))
    docs = [{"kind": "WorkerPool", "metadata": {"name": "gpus"}, "spec": {"replicas": 3, "slots": 1}}]
    pc = PoolController(Settings(), d, load_documents(docs), Backend(["w1", "w2", "w3"]), None,
                        scale_down_delay_s=600)
    await pc.tick()
    assert metrics.GPU_MEMORY_TOTAL.labels(pool="gpus")._value.get() == 120 * GIB
    assert metrics.GPU_MEMORY_FRAGMENTED.labels(pool="gpus")._value.get() == 40 * GIB
    assert (await d.get_worker("w1")).gpuMemoryBytes == 80 * GIB  # the record round-trips through Redis


async def test_the_ready_condition_says_the_ready_count_it_is_shown_beside(d) -> None:
    """``/v1/workerpools`` reads the workers live and the conditions from the controller's last round: a
    fresh-user run saw ``readyReplicas: 2`` beside Ready False "0 ready of 2 desired". With the live count
    given, the Ready condition says it, with the last round's desired count."""
    docs = [{"kind": "WorkerPool", "metadata": {"name": "gpus"}, "spec": {"replicas": 2, "slots": 1}}]
    pc = PoolController(Settings(), d, load_documents(docs), Backend([]), None, scale_down_delay_s=600)
    assert [c.message for c in pc.conditions("gpus", ready=0)] == ["0 ready"], "before the first round"
    await pc.tick()  # no worker registered yet: the round sees none ready, and wants 2
    assert next(c for c in pc.conditions("gpus") if c.type == "Ready").message == "0 ready of 2 desired"
    ready = next(c for c in pc.conditions("gpus", ready=2) if c.type == "Ready")
    assert (ready.status, ready.reason, ready.message) == ("True", "WorkersReady", "2 ready of 2 desired")
    assert [c.type for c in pc.conditions("gpus", ready=2)] == ["Ready", "Scaling", "WorkersHealthy"]


@pytest.mark.parametrize("spec", [{"replicas": 0, "slots": 1},
                                  {"slots": 1, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}])
async def test_a_pool_with_no_worker_desired_is_ready(d, spec: dict) -> None:
    """Fresh-user tester 51: a pool set to zero on purpose showed Ready False ``NoReadyWorker`` "0 ready of
    0 desired" on every ``substrate pools``. As a Deployment scaled to 0 is Available, it is Ready
    (``NoWorkersDesired``); a pool that wants a worker and has none is not."""
    docs = [{"kind": "WorkerPool", "metadata": {"name": "gpus"}, "spec": spec}]
    pc = PoolController(Settings(), d, load_documents(docs), Backend([]), None, scale_down_delay_s=600)
    await pc.tick()
    for ready in (next(c for c in pc.conditions("gpus") if c.type == "Ready"),
                  next(c for c in pc.conditions("gpus", ready=0) if c.type == "Ready")):
        assert (ready.status, ready.reason, ready.message) == ("True", "NoWorkersDesired", "0 ready of 0 desired")
    docs = [{"kind": "WorkerPool", "metadata": {"name": "gpus"}, "spec": {"replicas": 1, "slots": 1}}]
    pc = PoolController(Settings(), d, load_documents(docs), Backend([]), None, scale_down_delay_s=600)
    await pc.tick()
    ready = next(c for c in pc.conditions("gpus", ready=0) if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "NoReadyWorker")

async def test_conditions_follow_the_api_conventions_and_keep_their_transition_time(d) -> None:
    """Fresh-user tester 47: ``lastTransitionTime`` was a Unix float renewed at every round, and the
    Scaling condition's reason was free text ("need=2 above capacity") with an empty message, False while
    the pool wanted to grow. Now: RFC 3339, changed only with the status; CamelCase reasons; the demand in
    the message."""
    import re

    docs = [{"kind": "WorkerPool", "metadata": {"name": "gpus"}, "spec": {"replicas": 2, "slots": 1}}]
    pc = PoolController(Settings(), d, load_documents(docs), Backend([]), None, scale_down_delay_s=600)
    await pc.tick()  # no worker registered: it wants 2
    first = {c.type: c for c in pc.conditions("gpus")}
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", c.lastTransitionTime) for c in first.values())
    scaling = first["Scaling"]
    assert (scaling.status, scaling.reason) == ("True", "ScalingUp")
    assert scaling.message == "0 slot(s) wanted, 2 worker(s) desired", scaling.message
    for c in first.values():  # an old transition, to tell it from a renewed one
        c.lastTransitionTime = "2020-01-01T00:00:00Z"
    pc._state["gpus"].conditions = list(first.values())
    await pc.tick()
    again = {c.type: c for c in pc.conditions("gpus")}
    assert {t: c.lastTransitionTime for t, c in again.items()} == dict.fromkeys(first, "2020-01-01T00:00:00Z")
    assert pc.conditions("gpus", ready=0)[0].lastTransitionTime == "2020-01-01T00:00:00Z"  # Ready: still False
    assert pc.conditions("gpus", ready=2)[0].lastTransitionTime != "2020-01-01T00:00:00Z"  # it changed


async def test_an_autoscaled_pool_says_its_replicas_is_not_used(d) -> None:
    """Tester 49: ``/v1/workerpools`` showed ``spec.replicas: 2`` on an autoscaled pool with nothing saying
    the autoscaler decides; the Kubernetes status had the condition, the local one did not."""
    docs = [{"kind": "WorkerPool", "metadata": {"name": "gpus"},
             "spec": {"replicas": 2, "slots": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}}]
    pc = PoolController(Settings(), d, load_documents(docs), Backend([]), None, scale_down_delay_s=600)
    await pc.tick()
    managed = [c for c in pc.conditions("gpus") if c.type == "ScalingManaged"]
    assert [(c.status, c.reason, c.message) for c in managed] == [
        ("True", "SlotAutoscaler", "spec.autoscaling decides between 1 and 3 workers; spec.replicas (2) is not used")]
    # a pool whose YAML sets no replicas is not told that the model's default is unused
    docs2 = [{"kind": "WorkerPool", "metadata": {"name": "auto"},
              "spec": {"slots": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}}]
    pc2 = PoolController(Settings(), d, load_documents(docs2), Backend([]), None, scale_down_delay_s=600)
    await pc2.tick()
    assert [c.message for c in pc2.conditions("auto") if c.type == "ScalingManaged"] == [
        "spec.autoscaling decides between 1 and 3 workers"]
    managed[0].lastTransitionTime = "2020-01-01T00:00:00Z"
    await pc.tick()
    assert next(c for c in pc.conditions("gpus") if c.type == "ScalingManaged").lastTransitionTime == \
        "2020-01-01T00:00:00Z"
