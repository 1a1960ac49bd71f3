"""Worker starts back off per pool after workers fail (``substrate.backends.backoff``), in both backends.

A local worker that could not listen (its port range taken by other programs) was started again every
reconcile round, 58 times in 30 s, and the pool controller's "a worker is starting" held every waiting
create for ``api.start_wait_s`` (30 s, then 503 ``no_capacity`` saying nothing of why)."""

from __future__ import annotations

import subprocess
import time

import pytest

from substrate.backends.backoff import StartBackoff
from substrate.backends.local import LocalBackend, _Worker
from substrate.settings import PoolSettings, Settings, WorkerSettings


def test_the_pause_doubles_per_failure_up_to_the_max_and_names_the_pool() -> None:
    b = StartBackoff(0.5, 4.0, noun="worker process")
    assert b.reason("p", now=0.0) == "" and b.failures("p") == 0 and b.failing("p") == ""
    # each failure after the previous pause ended: the first in a row is retried at once (a one-off, which
    # a waiting create waits for), then 0.5 s doubling: 100 (no pause), 100 (-> 100.5), 101 (-> 102),
    # 103 (-> 105), 106 (-> 110), 111 (-> 115, capped)
    pauses = [b.failed("p", now=t) for t in (100.0, 100.0, 101.0, 103.0, 106.0, 111.0)]
    assert pauses == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    # workers started together that fail together (one cause) do not double it again (tester 49: 8 -> 32 s
    # within a second): a failure within the pause is counted, the pause left stays
    assert b.failed("p", now=112.0) == 3.0 and b.failed("p", now=112.0) == 3.0
    why = b.reason("p", now=112.0)
    assert why.startswith("8 worker processes of pool 'p' failed in a row (none started since") and \
        why.endswith("its next start is backed off for 3.0 s more"), why
    assert b.pause_left_s("p", now=112.0) == 3.0
    assert b.reason("other", now=112.0) == ""  # per pool
    assert b.reason("p", now=115.0) == ""  # the pause is over: a start may be tried...
    # ...and the pool still fails in a row until one starts (its condition stays False: tester 47)
    assert b.failing("p", now=115.0).endswith("the pause is over: the next start the pool needs goes ahead")
    assert b.failing("p", now=112.0).endswith("the next start in 3.0 s")
    one = StartBackoff(0.5, 4.0, noun="worker Pod")
    assert one.failed("q", now=0.0) == 0.0 and one.reason("q", now=0.0) == ""  # retried at once...
    assert one.failing("q", now=0.0).startswith("1 worker Pod of pool 'q' failed in a row")  # ...and said


def test_a_worker_that_starts_ends_the_run_of_failures() -> None:
    """Fresh-user tester 47: the count was kept through workers that started and served, so one later
    crash got the 60 s pause and left the pool at zero workers for a minute ("in a row" was false)."""
    b = StartBackoff(0.5, 60.0)
    t = 0.0
    for _ in range(8):
        t += b.failed("p", now=t)  # each one as the previous pause ends
    assert b.pause_left_s("p", now=t - 60.0) == 60.0
    b.started("p")
    assert b.failures("p", now=t) == 0 and b.reason("p", now=t) == "" and b.failing("p", now=t) == ""
    assert b.failed("p", now=t) == 0.0 and b.failed("p", now=t) == 0.5  # the next failure is the first again


def test_a_quiet_period_forgives_and_a_zero_base_never_holds_back() -> None:
    b = StartBackoff(1.0, 8.0)
    b.failed("p", now=0.0)  # no pause
    b.failed("p", now=0.0)  # pause 1 s, until 1
    assert b.failed("p", now=5.0) == 2.0  # within until + max: still counted (third in a row), until 7
    # quiet for longer than max past the last pause's end (7 + 8): the next failure is the first again
    assert b.failed("p", now=20.0) == 0.0 and b.failed("p", now=20.0) == 1.0
    z = StartBackoff(0.0, 60.0)
    z.failed("p")
    z.failed("p")
    assert z.reason("p") == ""
    with pytest.raises(ValueError, match="must not be negative"):
        StartBackoff(-1.0, 1.0)
    with pytest.raises(ValueError, match="over its maximum"):
        StartBackoff(10.0, 1.0)


def _local(tmp_path, base_s: float = 30.0) -> LocalBackend:  # noqa: ANN001
    return LocalBackend(Settings(worker=WorkerSettings(root_dir=tmp_path / "w"),
                                 pool=PoolSettings(restart_backoff_s=base_s)), fork_server=False)


def test_a_local_worker_that_exits_on_its_own_backs_its_pool_off(tmp_path) -> None:
    b = _local(tmp_path)
    p = subprocess.Popen(["sh", "-c", "exit 2"])  # a worker that could not listen exits 2
    p.wait(30)
    b.workers["w1"] = _Worker("dense", p.pid, p)
    assert b.workers["w1"].exit_code() == 2
    assert b.start_backoff.reason("dense") == ""
    assert b.reap() == ["w1"]
    assert b.start_backoff.failing("dense").startswith("1 worker process of pool 'dense' failed in a row")
    b.start_backoff.failed("dense")  # a second in a row: now the pool pauses
    assert b.start_backoff.reason("dense").startswith("2 worker processes of pool 'dense' failed in a row")
    assert b.unplaceable("dense") == (set(), b.start_backoff.reason("dense"))  # what routers elsewhere are told
    assert b.start_backoff.reason("other") == ""


async def test_a_local_worker_stopped_by_delete_does_not_back_its_pool_off(tmp_path) -> None:
    b = _local(tmp_path)
    p = subprocess.Popen(["sleep", "60"])
    b.workers["w1"] = _Worker("dense", p.pid, p)
    await b.delete("w1", grace_s=10)
    assert b.reap() == [] and b.start_backoff.failures("dense") == 0


class _Informer:
    def __init__(self) -> None:
        self.items: dict = {}

    def stop(self) -> None:
        pass


class _Kube:
    def __init__(self) -> None:
        self.created: list[str] = []
        self.deleted: list[str] = []

    def create_pod(self, ns, body):  # noqa: ANN001
        self.created.append(body["metadata"]["name"])

    def delete_pod(self, ns, name, grace_s=None):  # noqa: ANN001
        self.deleted.append(name)


async def test_a_failed_worker_pod_backs_its_pool_off_and_the_backend_creates_none_meanwhile() -> None:
    from substrate.backends.kubernetes import KubernetesBackend
    from substrate.k8s.pods import POOL_LABEL
    from substrate.specs import load_documents

    kube, inf = _Kube(), _Informer()
    b = KubernetesBackend(Settings(), kube, informer=inf)  # type: ignore[arg-type]
    inf.items["agents-1"] = {"metadata": {"name": "agents-1", "labels": {POOL_LABEL: "agents"}},
                             "status": {"phase": "Running"}}
    assert b.running() == {"agents-1": "agents"} and b.start_backoff.reason("agents") == ""
    inf.items["agents-1"]["status"] = {"phase": "Failed", "reason": "Evicted"}
    assert b.reap() == ["agents-1"]
    assert b.start_backoff.reason("agents") == ""  # the first failure in a row is re-created at once
    b.start_backoff.failed("agents")  # a second: the pool pauses
    why = b.start_backoff.reason("agents")
    assert why.startswith("2 worker Pods of pool 'agents' failed in a row"), why
    assert b.unplaceable("agents")[1] == why
    assert [p.reason for p in b.problems("agents")] == ["BackOff"]
    pool = load_documents([{"kind": "WorkerPool", "metadata": {"name": "agents"}, "spec": {"replicas": 1}}]).pools["agents"]
    await b.create(pool, "agents-2")
    assert kube.created == []  # held back
    b.start_backoff._pools["agents"].until = time.monotonic() - 1  # the pause is over: still in a row...
    assert b.start_backoff.reason("agents") == ""
    assert [p.reason for p in b.problems("agents")] == ["BackOff"], "...so PodsHealthy stays False (no flapping)"
    await b.close()


async def test_a_local_worker_frozen_in_its_start_is_killed_and_counted_as_a_failed_start(tmp_path) -> None:
    """Fresh-user tester 48: starts SIGSTOPped before they registered were waited on for ever (2 min 15 s
    with no capacity, until a SIGCONT by hand). The pool controller abandons them after its create timeout."""
    import signal

    b = _local(tmp_path, base_s=1.0)
    p = subprocess.Popen(["sleep", "60"])
    p.send_signal(signal.SIGSTOP)
    b.workers["w1"] = _Worker("dense", p.pid, p)
    (tmp_path / "w" / "w1").mkdir(parents=True)
    await b.abandon("w1")
    assert p.poll() == -signal.SIGKILL  # a stopped process is killed too
    assert "w1" not in b.workers and b.reap() == []  # gone, and not reported again as a death
    assert not (tmp_path / "w" / "w1").exists()
    assert b.start_backoff.failures("dense") == 1 and b.start_backoff.failing("dense")
    await b.abandon("w1")  # unknown by now: nothing happens
    assert b.start_backoff.failures("dense") == 1
