"""Session counts by state: counters moved by the directory's transitions (``/v1/stats`` reads them in
O(states)), corrected by the state manager's slow scan when they drift."""

from __future__ import annotations

import asyncio
import time


from substrate.directory import Directory
from substrate.models import SessionRecord, SessionState, SnapshotRef


def _rec(sid: str, state: SessionState, epoch: int = 1) -> SessionRecord:
    now = time.time()
    return SessionRecord(id=sid, state=state, actorTemplate="counter", pool="default", epoch=epoch,
                         createdAt=now, updatedAt=now, lastActiveAt=now)


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
