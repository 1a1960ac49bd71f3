"""Session counts by state: counters moved by the directory's transitions (``/v1/stats`` reads them in
O(states)), corrected by the state manager's slow scan when they drift."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from substrate.directory import Directory
from substrate.models import SessionRecord, SessionState, SnapshotRef


@pytest.fixture
async def directory(directory_url):
    """On the standalone Redis and on the local Redis Cluster (a tenant's counters live in its own hash
    slot, apart from the session records and the runtime-wide counters)."""
    d = Directory(directory_url, f"sc{uuid.uuid4().hex[:8]}")
    yield d
    async for key in d.redis.scan_iter(f"{d.keys.prefix}:*"):
        await d.redis.delete(key)
    await d.close()


def _rec(sid: str, state: SessionState, epoch: int = 1, tenant: str = "default") -> SessionRecord:
    now = time.time()
    return SessionRecord(id=sid, state=state, actorTemplate="counter", pool="default", epoch=epoch,
                         createdAt=now, updatedAt=now, lastActiveAt=now, tenant=tenant)


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


async def _scan(d: Directory) -> dict[str, int]:
    counts: dict[str, int] = {}
    items, _ = await d.list_sessions(limit=1000)
    for r in items:
        counts[r.state.value] = counts.get(r.state.value, 0) + 1
    return counts


async def test_counters_follow_create_transition_commit_and_delete(directory):
    d = directory
    for i in range(5):
        await d.create_session(_rec(f"s{i}", SessionState.STARTING))
    for i in range(5):
        assert (await d.transition(f"s{i}", from_states=[SessionState.STARTING], to=SessionState.RUNNING)).ok
    # a failed CAS moves nothing
    assert not (await d.transition("s0", from_states=[SessionState.SUSPENDED], to=SessionState.RESUMING)).ok
    # concurrent claims: exactly one wins and is counted once
    await d.transition("s1", to=SessionState.SUSPENDED)
    await asyncio.gather(*(d.transition("s1", from_states=[SessionState.SUSPENDED], to=SessionState.RESUMING,
                                        bump=True) for _ in range(20)))
    ref = SnapshotRef(key="snapshots/s2/1-0", epoch=1, createdAt=time.time(), sizeBytes=1, sha256="0" * 64)
    ok, _ = await d.commit_snapshot("s2", epoch=1, ref=ref, to=SessionState.SUSPENDED)
    assert ok
    await d.transition("s3", to=SessionState.DELETED, bump=True)
    await d.delete_session("s3")
    await d.delete_session("s4")  # deleted straight from RUNNING (an undone create does this)
    await d.delete_session("never-was")
    counts = await d.state_counts()
    assert counts == {**{s.value: 0 for s in SessionState if s != SessionState.DELETED},
                      "RUNNING": 1, "RESUMING": 1, "SUSPENDED": 1}
    assert {k: v for k, v in counts.items() if v} == await _scan(d)


async def test_the_slow_scan_corrects_drift_only_when_nothing_moved(directory):
    d = directory
    await d.create_session(_rec("a", SessionState.RUNNING))
    await d.redis.hincrby(d.keys.state_counts, "RUNNING", 5)  # drift: e.g. a crash between two steps
    before = await d.state_counts()
    assert before["RUNNING"] == 6
    # something moved while the scan ran: no correction (the scan may be stale)
    assert not await d.reconcile_state_counts({"RUNNING": 1}, {**before, "RUNNING": 7})
    assert (await d.state_counts())["RUNNING"] == 6
    assert await d.reconcile_state_counts(await _scan(d), before)
    assert (await d.state_counts())["RUNNING"] == 1
    assert not await d.reconcile_state_counts(await _scan(d), await d.state_counts()), "already right"


async def test_each_tenants_counters_follow_its_sessions_whether_or_not_the_caller_names_it(directory):
    """Per-tenant counters (``/v1/stats`` of one tenant in a shared runtime, O(states)): moved with the
    runtime-wide ones by create, transition (the tenant given, given wrongly, or not given: the step
    reports the record's), snapshot commit and delete."""
    d = directory
    for i in range(3):
        await d.create_session(_rec(f"a{i}", SessionState.STARTING, tenant="team-a"))
    await d.create_session(_rec("b0", SessionState.STARTING, tenant="team-b"))
    await d.transition("a0", from_states=[SessionState.STARTING], to=SessionState.RUNNING, tenant="team-a")
    await d.transition("a1", from_states=[SessionState.STARTING], to=SessionState.RUNNING)  # not named
    await d.transition("a2", from_states=[SessionState.STARTING], to=SessionState.RUNNING, tenant="team-b")  # wrong
    await d.transition("b0", from_states=[SessionState.STARTING, SessionState.PENDING], to=SessionState.RUNNING)
    # a failed step moves nothing, whoever it names
    assert not (await d.transition("a0", from_states=[SessionState.SUSPENDED], to=SessionState.RESUMING,
                                   tenant="team-a")).ok
    ref = SnapshotRef(key="snapshots/a1/1-0", epoch=1, createdAt=time.time(), sizeBytes=1, sha256="0" * 64)
    assert (await d.commit_snapshot("a1", epoch=1, ref=ref, to=SessionState.SUSPENDED))[0]
    await d.delete_session("a2")
    got = await d.tenant_state_counts(["team-a", "team-b", "team-c"])
    assert _nonzero(got["team-a"]) == {"RUNNING": 1, "SUSPENDED": 1}
    assert _nonzero(got["team-b"]) == {"RUNNING": 1}
    assert _nonzero(got["team-c"]) == {}
    assert _nonzero(await d.state_counts()) == {"RUNNING": 2, "SUSPENDED": 1}


async def test_a_step_from_any_state_moves_the_counters_from_the_state_the_caller_read(directory):
    """A step from several states (a delete: from any but DELETED) moves the counters in its own round trip
    from ``likely``, the state the caller read; a wrong guess (the session moved since, or another tenant's)
    is corrected from the state and tenant the step reports, and a failed step moves nothing."""
    d = directory
    anything = [s for s in SessionState if s != SessionState.DELETED]
    for sid in ("r", "m", "t", "f"):
        await d.create_session(_rec(sid, SessionState.RUNNING, tenant="team-a"))
    await d.transition("m", from_states=[SessionState.RUNNING], to=SessionState.SUSPENDED, tenant="team-a")
    await d.transition("f", to=SessionState.DELETED)
    assert (await d.transition("r", from_states=anything, to=SessionState.DELETED, bump=True, tenant="team-a",
                               likely=SessionState.RUNNING)).ok
    assert (await d.transition("m", from_states=anything, to=SessionState.DELETED, bump=True, tenant="team-a",
                               likely=SessionState.RUNNING)).ok  # read RUNNING, suspended since
    assert (await d.transition("t", from_states=anything, to=SessionState.FAILED, tenant="team-b",
                               likely=SessionState.RUNNING)).ok  # the wrong tenant named
    assert not (await d.transition("f", from_states=anything, to=SessionState.DELETED, tenant="team-a",
                                   likely=SessionState.RUNNING)).ok
    got = await d.tenant_state_counts(["team-a", "team-b"])
    assert _nonzero(got["team-a"]) == {"FAILED": 1} and _nonzero(got["team-b"]) == {}
    assert _nonzero(await d.state_counts()) == {"FAILED": 1}


async def test_a_tenants_counters_are_trusted_only_when_they_add_up_to_its_index(directory):
    d = directory
    for i in range(2):
        await d.create_session(_rec(f"t{i}", SessionState.RUNNING, tenant="team-t"))
        await d.redis.zadd(d.keys.tenant_sessions("team-t"), {f"t{i}": float(i)})  # the activator's index entry
    assert _nonzero(await d.tenant_counts_checked("team-t") or {}) == {"RUNNING": 2}
    await d.redis.hincrby(d.keys.tenant_state_counts("team-t"), "FAILED", 1)  # drift: 3 counted, 2 indexed
    assert await d.tenant_counts_checked("team-t") is None
    await d.redis.hincrby(d.keys.tenant_state_counts("team-t"), "FAILED", -2)  # sums up, but a count below 0
    assert await d.tenant_counts_checked("team-t") is None


async def test_the_slow_scan_corrects_a_tenants_drift_only_when_nothing_of_it_moved(directory):
    d = directory
    await d.create_session(_rec("x", SessionState.RUNNING, tenant="team-x"))
    await d.create_session(_rec("y", SessionState.RUNNING, tenant="team-y"))
    await d.redis.hincrby(d.keys.tenant_state_counts("team-x"), "RUNNING", 4)
    await d.redis.hincrby(d.keys.tenant_state_counts("team-y"), "FAILED", 1)
    await d.redis.hincrby(d.keys.tenant_state_counts("gone"), "SUSPENDED", 2)  # a tenant with no session left
    before = await d.tenant_state_counts(["team-x", "team-y", "gone"])
    scanned = {"team-x": {"RUNNING": 1}, "team-y": {"RUNNING": 1}}
    # team-y moved while the scan ran: left as it is; team-z was not looked at before the scan: left too
    await d.redis.hincrby(d.keys.tenant_state_counts("team-y"), "RUNNING", 1)
    fixed = await d.reconcile_tenant_state_counts({**scanned, "team-z": {"RUNNING": 9}}, before)
    assert sorted(fixed) == ["gone", "team-x"]
    got = await d.tenant_state_counts(["team-x", "team-y", "gone", "team-z"])
    assert _nonzero(got["team-x"]) == {"RUNNING": 1}
    assert _nonzero(got["team-y"]) == {"RUNNING": 2, "FAILED": 1}
    assert _nonzero(got["gone"]) == {} and not await d.redis.exists(d.keys.tenant_state_counts("gone"))
    assert _nonzero(got["team-z"]) == {}
    assert await d.reconcile_tenant_state_counts(scanned, {"team-x": got["team-x"]}) == [], "already right"
