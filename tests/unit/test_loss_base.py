"""``loss_base``: the time the state a wake restores dates from (issue 8, the chaos run on ba39209)."""

from __future__ import annotations

from substrate.activator import loss_base
from substrate.models import SessionRecord, SessionState, SnapshotRef


def _rec(snapshot_at: float | None, lost_after: float | None) -> SessionRecord:
    snap = (SnapshotRef(key="k", epoch=3, createdAt=snapshot_at, sizeBytes=1, sha256="0" * 64)
            if snapshot_at is not None else None)
    return SessionRecord(id="s", state=SessionState.SUSPENDED, actorTemplate="t", pool="p", createdAt=1.0,
                         updatedAt=1.0, lastActiveAt=1.0, snapshot=snap, lostAfter=lost_after,
                         reason="worker_lost" if lost_after is not None else None)


def test_the_snapshot_dates_the_state_when_no_loss_is_kept() -> None:
    assert loss_base(_rec(100.0, None)) == 100.0
    assert loss_base(_rec(None, None)) is None


def test_a_kept_loss_dates_it_from_the_older_time() -> None:
    assert loss_base(_rec(200.0, 100.0)) == 100.0  # the drain's snapshot holds the state of 100
    assert loss_base(_rec(200.0, 0.0)) == 0.0  # it holds nothing older than the session's start
    # a corrupt newest snapshot rolled the pointer back past the kept date: the older of the two
    assert loss_base(_rec(50.0, 100.0)) == 50.0
