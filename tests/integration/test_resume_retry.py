"""An explicit resume whose worker dies while restoring the session wakes it again elsewhere, as an invoke's
wake does (fresh-user finding: ``POST /v1/sessions/{id}/resume`` answered 502 at once). Against a real
Redis with an in-memory fake of the workers' internal API."""

from __future__ import annotations

import time
from typing import Any

import pytest

from substrate.activator import Activator, WorkerView
from substrate.directory import Directory
from substrate.errors import WorkerUnavailable
from substrate.models import SessionRecord, SessionState, WorkerRecord
from substrate.settings import Settings
from tests.integration.test_audit_once import CATALOG


class DiesOnFirstRestore:
    """The first ``activate`` fails as a worker that died mid-restore does; later ones succeed."""

    def __init__(self) -> None:
        self.activated: list[tuple[str, int]] = []

    async def activate(self, address: str, *, session: str, epoch: int, **_: Any) -> dict[str, Any]:
        self.activated.append((address, epoch))
        if len(self.activated) == 1:
            raise WorkerUnavailable(f"worker at {address} closed the connection", code="worker_unavailable")
        return {}

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        pass


async def _setup(d: Directory) -> Activator:
    now = time.time()
    for wid in ("w1", "w2"):
        await d.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}", slots=4,
                                             leaseExpiresAt=now + 60, startedAt=now))
    await d.create_session(SessionRecord(id="s1", state=SessionState.SUSPENDED, actorTemplate="counter",
                                         pool="default", tenant="team-a", epoch=3, createdAt=now,
                                         updatedAt=now, lastActiveAt=now))
    view = WorkerView(d, 60)
    await view.refresh()
    return Activator(Settings(), d, CATALOG, DiesOnFirstRestore(), view)  # type: ignore[arg-type]


async def test_a_resume_whose_worker_dies_mid_restore_is_woken_again(directory: Directory) -> None:
    act = await _setup(directory)
    route, woke = await act.wake_retrying("s1", tenant="team-a", audit_action=None)
    fake: DiesOnFirstRestore = act.client  # type: ignore[assignment]
    assert woke and len(fake.activated) == 2, fake.activated
    rec = await directory.get_session("s1")
    assert rec.state == SessionState.RUNNING and rec.epoch == route.epoch and rec.worker == route.worker
    assert route.epoch > fake.activated[0][1], "the failed activation's epoch is not reused"


async def test_a_pinned_resume_is_not_moved_to_another_worker(directory: Directory) -> None:
    """``worker`` pins the placement: a pinned worker that fails is the answer (502), tried once."""
    act = await _setup(directory)
    with pytest.raises(WorkerUnavailable) as e:
        await act.wake_retrying("s1", worker="w1", tenant="team-a", audit_action=None)
    assert e.value.code == "worker_unavailable"
    fake: DiesOnFirstRestore = act.client  # type: ignore[assignment]
    assert fake.activated == [("http://w1", 4)]
    assert (await directory.get_session("s1")).state == SessionState.SUSPENDED


async def test_a_resume_overtaken_by_a_concurrent_suspend_is_409_not_200_naming_suspending(
        directory: Directory) -> None:
    """A suspend that takes the session between the resume's wake and its read of the record: the resume
    answered 200 with state SUSPENDING (fresh-user race, 15 of 80 resumes); it is 409 ``conflict``."""
    from substrate.errors import Conflict

    act = await _setup(directory)
    wake = act.wake_retrying

    async def wake_then_suspended_meanwhile(*a: Any, **kw: Any) -> Any:
        got = await wake(*a, **kw)
        rec = await directory.get_session("s1")
        assert rec.state == SessionState.RUNNING
        await directory.transition("s1", from_states=[SessionState.RUNNING], epoch=rec.epoch,
                                   to=SessionState.SUSPENDING)
        return got

    act.wake_retrying = wake_then_suspended_meanwhile  # type: ignore[method-assign]
    with pytest.raises(Conflict) as e:
        await act.resume_explicit("s1", tenant="team-a")
    assert e.value.code == "conflict" and e.value.details["state"] == "SUSPENDING", e.value.details
    # without the race the same call answers the RUNNING record
    await directory.transition("s1", from_states=[SessionState.SUSPENDING], to=SessionState.RUNNING)
    act.wake_retrying = wake  # type: ignore[method-assign]
    route, rec = await act.resume_explicit("s1", tenant="team-a")
    assert rec.state == SessionState.RUNNING and rec.epoch == route.epoch
