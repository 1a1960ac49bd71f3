"""The pool controller's pure reconcile (no I/O)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from substrate.models import Autoscaling, WarmPool, WorkerPoolSpec, WorkerState
from substrate.pool import PoolObservation, WorkerObs, desired_replicas, reconcile

R, D = WorkerState.READY, WorkerState.DRAINING


def spec(**kw) -> WorkerPoolSpec:
    return WorkerPoolSpec(slots=10, autoscaling=Autoscaling(minReplicas=1, maxReplicas=5, targetUtilization=50),
                          warmPool=WarmPool(readyReplicas=1), **kw)


def test_fixed_replicas_without_autoscaling():
    s = WorkerPoolSpec(replicas=3, slots=4)
    assert reconcile(s, PoolObservation(workers=())).create == 3
    obs = PoolObservation(workers=tuple(WorkerObs(f"w{i}", R, 4, 0) for i in range(3)))
    plan = reconcile(s, obs)
    assert plan.create == 0 and plan.drain == ()


def test_scale_up_counts_active_slots_and_waiting_requests():
    # 9 active of 10 slots at 50 % target -> 2 workers by utilisation; +1 warm -> 2 (ceil(9/10)+1)
    obs = PoolObservation(workers=(WorkerObs("w1", R, 10, 10, active=9),), waiting=6)
    assert desired_replicas(spec().model_copy(), 15) == 3
    assert reconcile(spec(), obs).create == 2


def test_idle_sessions_are_not_demand():
    obs = PoolObservation(workers=(WorkerObs("w1", R, 10, 10, active=0),))
    plan = reconcile(spec(), obs)
    assert plan.desired == 1 and plan.create == 0


def test_expectations_prevent_over_creation():
    obs = PoolObservation(workers=(), starting=3)
    assert reconcile(spec(), obs).create == 0


def test_scale_down_drains_the_least_used_ready_worker_and_removes_only_empty_draining_ones():
    obs = PoolObservation(workers=(WorkerObs("a", R, 10, 3, active=0), WorkerObs("b", R, 10, 1, active=0),
                                   WorkerObs("c", D, 10, 2, active=0), WorkerObs("d", D, 10, 0)))
    plan = reconcile(spec(), obs, allow_scale_down=True)
    assert plan.drain == ("b",)
    assert plan.remove == ("d",)
    assert reconcile(spec(), obs, allow_scale_down=False).drain == ()


def test_dead_workers_are_not_capacity():
    obs = PoolObservation(workers=(WorkerObs("a", R, 10, 0, alive=False),))
    assert reconcile(spec(), obs).create == 1


@given(busy=st.integers(0, 500), mn=st.integers(0, 5), extra=st.integers(0, 20), slots=st.integers(1, 64),
       target=st.integers(1, 100), warm=st.integers(0, 3))
def test_desired_is_within_bounds_and_covers_demand(busy, mn, extra, slots, target, warm):
    s = WorkerPoolSpec(slots=slots, autoscaling=Autoscaling(minReplicas=mn, maxReplicas=max(1, mn + extra),
                                                            targetUtilization=target),
                       warmPool=WarmPool(readyReplicas=warm))
    d = desired_replicas(s, busy)
    assert mn <= d <= max(1, mn + extra)
    if d < max(1, mn + extra):
        assert d * slots >= busy, "below the ceiling, capacity covers demand"
