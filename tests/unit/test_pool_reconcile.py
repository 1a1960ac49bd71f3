"""The pool controller's pure reconcile (no I/O)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
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
                                   WorkerObs("d", D, 10, 0)))
    plan = reconcile(spec(), obs, allow_scale_down=True)
    assert plan.drain == ("b",)
    assert plan.remove == ("d",)
    assert reconcile(spec(), obs, allow_scale_down=False).drain == ()


def test_one_drain_at_a_time():
    # "c" is still being drained (it holds sessions): no second drain until it is done; the fresh-user
    # burst drained five workers within five seconds, one per reconcile round
    obs = PoolObservation(workers=(WorkerObs("a", R, 10, 3, active=0), WorkerObs("b", R, 10, 1, active=0),
                                   WorkerObs("c", D, 10, 2, active=0), WorkerObs("d", D, 10, 0)))
    plan = reconcile(spec(), obs)
    assert plan.drain == () and plan.remove == ("d",)


def test_never_drains_a_worker_whose_active_sessions_do_not_fit_elsewhere():
    # below the held size, but the least active worker still has 4 active sessions and the other has
    # only 2 free slots: draining it would suspend sessions current demand needs (churn)
    ws = (WorkerObs("a", R, 10, 8, active=1), WorkerObs("b", R, 10, 5, active=4))
    assert reconcile(dense(), PoolObservation(workers=ws, recent_desired=1)).drain == ("a",)
    # every slot taken (mostly by idle sessions): the active one of the least active worker would have
    # nowhere to go but another worker's lazy suspension
    full = (WorkerObs("a", R, 6, 6, active=1), WorkerObs("b", R, 6, 6, active=1), WorkerObs("c", R, 6, 6, active=2))
    assert reconcile(dense(), PoolObservation(workers=full, recent_desired=1)).drain == ()
    idle = (WorkerObs("a", R, 6, 6, active=0), WorkerObs("b", R, 6, 6, active=1), WorkerObs("c", R, 6, 6, active=2))
    assert reconcile(dense(), PoolObservation(workers=idle, recent_desired=1)).drain == ("a",)


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


# --- demand, forecast, hysteresis (the autoscaler that needs no per-day cap) -------------------------

from substrate.pool import SlidingWindow, demand  # noqa: E402


def dense(max_replicas: int = 64) -> WorkerPoolSpec:
    return WorkerPoolSpec(slots=6, autoscaling=Autoscaling(minReplicas=0, maxReplicas=max_replicas,
                                                           targetUtilization=100))


def test_demand_counts_active_and_the_larger_of_pending_and_the_forecast():
    obs = PoolObservation(workers=(WorkerObs("a", R, 6, 2, active=2),), waiting=1, in_flight=1,
                          arrival_rate_per_s=20.0, lead_time_s=0.25)
    # 2 active + round(20/s x 0.25 s) = 5 expected while a worker starts, more than the 2 pending
    assert demand(obs) == 2 + 5
    more = replace(obs, waiting=6)
    assert demand(more) == 2 + 6 + 1, "more pending than the forecast: the pending count"


def test_a_burst_is_counted_once_not_also_as_a_projected_rate():
    # the fresh-user burst (issue 11): 30 wakes at once on an idle pool, read as 30/s over a 1 s window
    # with a 1 s lead time; counting both started 11 six-slot workers for 30 sessions
    burst = PoolObservation(workers=(), waiting=30, arrival_rate_per_s=30.0, lead_time_s=1.0)
    assert demand(burst) == 30
    assert reconcile(dense(), burst).create == 5
    # an activation in flight is demand although its claimed slot shows as used but not active yet
    claimed = PoolObservation(workers=(WorkerObs("a", R, 6, 3, active=2),), in_flight=1)
    assert demand(claimed) == 3


def test_a_burst_of_creates_in_flight_holds_the_pool():
    # the fresh-user run (issue 11): 8 workers x 16 slots, 110 slots claimed by creates still starting
    # (105 in flight), 5 active; the old count (in flight only beyond used-but-not-active slots) read
    # need=20 and drained a worker every round mid-burst
    ws = tuple(WorkerObs(f"w{i}", R, 16, 14 if i < 6 else 13, active=1 if i < 5 else 0) for i in range(8))
    s = WorkerPoolSpec(slots=16, autoscaling=Autoscaling(minReplicas=1, maxReplicas=8, targetUtilization=70),
                       warmPool=WarmPool(readyReplicas=1))
    plan = reconcile(s, PoolObservation(workers=ws, in_flight=105, waiting=1, recent_desired=6))
    assert plan.need >= 110 and plan.drain == () and plan.desired == 8


def test_forecast_alone_starts_a_worker_before_anyone_waits():
    obs = PoolObservation(workers=(), arrival_rate_per_s=20.0, lead_time_s=0.1)
    assert reconcile(dense(), obs).create == 1
    trickle = PoolObservation(workers=(), arrival_rate_per_s=1 / 60, lead_time_s=1.0)
    assert reconcile(dense(), trickle).create == 0
    assert reconcile(dense(), PoolObservation(workers=())).create == 0  # no arrivals: scale to zero


def test_scale_up_is_immediate_and_not_capped_below_max():
    obs = PoolObservation(workers=(WorkerObs("a", R, 6, 6, active=6),), waiting=40)
    plan = reconcile(dense(), obs)
    assert plan.desired == 8 and plan.create == 7  # 46 slots wanted / 6 per worker


def test_scale_up_step_lets_the_pool_at_most_double_per_worker_start():
    # 46 slots wanted on one READY worker: 7 more wanted, but at most max(4, 1 READY) starting at once
    obs = PoolObservation(workers=(WorkerObs("a", R, 6, 6, active=6),), waiting=40)
    plan = reconcile(dense(), obs, scale_up_step=4)
    assert plan.desired == 8 and plan.create == 4
    # three of them still starting: one more may start; with 6 READY, 6 may start (100 %)
    assert reconcile(dense(), replace(obs, starting=3), scale_up_step=4).create == 1
    ready6 = PoolObservation(workers=tuple(WorkerObs(f"w{i}", R, 6, 6, active=6) for i in range(6)), waiting=60)
    assert reconcile(dense(), ready6, scale_up_step=4).create == 6
    # 0: no limit; a fixed replicas count is created at once whatever the step
    assert reconcile(dense(), obs, scale_up_step=0).create == 7
    assert reconcile(WorkerPoolSpec(replicas=9, slots=6), obs, scale_up_step=4).create == 8


def test_hysteresis_holds_capacity_wanted_within_the_window():
    idle = tuple(WorkerObs(f"w{i}", R, 6, 0, active=0) for i in range(3))
    assert reconcile(dense(), PoolObservation(workers=idle, recent_desired=3)).drain == ()
    plan = reconcile(dense(), PoolObservation(workers=idle, recent_desired=1))
    assert len(plan.drain) == 1, "one worker per round: no mass drain"
    assert reconcile(dense(), PoolObservation(workers=idle, recent_desired=None)).drain != ()


def test_scale_down_prefers_the_least_active_worker():
    ws = (WorkerObs("busy", R, 6, 2, active=2), WorkerObs("idle", R, 6, 5, active=0))
    plan = reconcile(dense(), PoolObservation(workers=ws, recent_desired=1))
    assert plan.drain == ("idle",)


def test_no_drain_while_workers_start():
    ws = (WorkerObs("a", R, 6, 0, active=0), WorkerObs("b", R, 6, 0, active=0))
    assert reconcile(dense(), PoolObservation(workers=ws, starting=1, recent_desired=0)).drain == ()


def test_sliding_window_max_and_rate():
    w = SlidingWindow(10.0)
    assert w.max() is None and w.rate() == 0.0
    for t, v in ((0, 0), (5, 50), (10, 100)):
        w.add(t, v)
    assert w.rate() == 10.0 and w.max() == 100
    w.add(21, 100)  # samples older than t - 10 fall out
    assert w.rate() == 0.0
    burst = SlidingWindow(10.0)
    burst.add(0, 0)
    burst.add(0.5, 5)  # 5 arrivals in half a second read as 5 per window, not 10/s
    assert burst.rate() == 0.5


@settings(deadline=None)
@given(workers=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.booleans()), max_size=12),
       waiting=st.integers(0, 100), in_flight=st.integers(0, 20), rate=st.floats(0, 200),
       lead=st.floats(0, 2), recent=st.one_of(st.none(), st.integers(0, 30)), starting=st.integers(0, 3))
def test_plan_invariants(workers, waiting, in_flight, rate, lead, recent, starting):
    ws = tuple(WorkerObs(f"w{i}", D if draining else R, 6, used, active=min(active, used))
               for i, (used, active, draining) in enumerate(workers))
    obs = PoolObservation(workers=ws, waiting=waiting, in_flight=in_flight, arrival_rate_per_s=rate,
                          lead_time_s=lead, recent_desired=recent, starting=starting)
    spec_ = dense()
    plan = reconcile(spec_, obs)
    serving = sum(1 for w in ws if w.state != D) + starting
    need = demand(obs)
    assert plan.need == need
    # capacity after the plan covers the demand (below the safety bound)
    if plan.create:
        assert (serving + plan.create) * 6 >= min(need, 64 * 6)
        assert plan.drain == ()
    # never drains more than one, never a draining one, never below the demand or the held size
    assert len(plan.drain) <= 1
    assert all(w.state == R for w in ws if w.id in plan.drain)
    if plan.drain:
        assert starting == 0
        assert (serving - 1) * 6 >= need
        assert serving - 1 >= (recent or 0)
        # one drain at a time, and the drained worker's active sessions and the waiters fit elsewhere
        assert not any(w.state == D and w.used for w in ws)
        (victim,) = [w for w in ws if w.id in plan.drain]
        others_free = sum(w.slots - w.used for w in ws if w.state != D and w.id != victim.id)
        assert victim.active + waiting <= others_free
    # every activation in flight and every active slot is demand
    assert need >= in_flight + sum(w.active for w in ws)
    # removes only empty draining workers
    assert all(w.state == D and w.used == 0 for w in ws if w.id in plan.remove)
    assert plan.desired <= 64


def test_a_worker_placed_on_within_the_delay_is_not_drained():
    # the Azure replay: the least loaded worker was drained 0.9 s after a session was woken on it (its
    # turn had not run yet, so it looked idle), and the parked request's retry had to wake it again
    ws = (WorkerObs("older", R, 6, 3, active=0), WorkerObs("fresh", R, 6, 1, active=0, placed_recently=True))
    plan = reconcile(dense(), PoolObservation(workers=ws, recent_desired=1))
    assert plan.drain == ("older",)
    only_fresh = (WorkerObs("fresh", R, 6, 1, active=0, placed_recently=True), WorkerObs("b", R, 6, 6, active=6))
    assert reconcile(dense(), PoolObservation(workers=only_fresh, recent_desired=1)).drain == ()


def test_a_reclaimable_draining_worker_is_taken_back_before_any_create():
    s = dense()
    obs = PoolObservation(workers=(WorkerObs("d", WorkerState.DRAINING, 6, 2, reclaimable=True),
                                   WorkerObs("e", WorkerState.DRAINING, 6, 0, reclaimable=True)),
                          waiting=8)
    plan = reconcile(s, obs)
    # 8 waiting on 6-slot workers: 2 wanted; both draining ones come back, the busier first
    assert plan.reclaim == ("d", "e") and plan.create == 0 and plan.remove == ()
    one = reconcile(s, replace(obs, waiting=3))
    assert one.reclaim == ("d",) and one.create == 0 and one.remove == ("e",)


def test_a_draining_worker_that_is_not_reclaimable_is_never_taken_back():
    obs = PoolObservation(workers=(WorkerObs("d", WorkerState.DRAINING, 6, 2, reclaimable=False),), waiting=3)
    plan = reconcile(dense(), obs)
    assert plan.reclaim == () and plan.create == 1
