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


async def _setup(d: Directory, client: Any = None, *, sid: str = "s1", **session: Any) -> Activator:
    """Workers w1 and w2, session ``sid`` (SUSPENDED at epoch 3 unless ``session`` says otherwise), and an
    activator calling ``client`` (default ``DiesOnFirstRestore``) as the workers' internal API."""
    now = time.time()
    for wid in ("w1", "w2"):
        await d.register_worker(WorkerRecord(id=wid, pool="default", address=f"http://{wid}", slots=4,
                                             leaseExpiresAt=now + 60, startedAt=now))
    fields: dict[str, Any] = {"state": SessionState.SUSPENDED, "epoch": 3, **session}
    await d.create_session(SessionRecord(id=sid, actorTemplate="counter", pool="default", tenant="team-a",
                                         createdAt=now, updatedAt=now, lastActiveAt=now, **fields))
    view = WorkerView(d, 60)
    await view.refresh()
    return Activator(Settings(), d, CATALOG, client or DiesOnFirstRestore(), view)  # type: ignore[arg-type]


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


class CommitsThenDies:
    """A worker's suspend that commits (RUNNING -> SUSPENDED with the new snapshot, as the worker's
    commit script does) and then dies before its answer reaches the router."""

    def __init__(self, d: Directory, *, commit: bool) -> None:
        self.d = d
        self.commit = commit

    async def suspend(self, address: str, session: str, epoch: int, **_: Any) -> Any:
        from substrate.models import SnapshotRef

        if self.commit:
            cas = await self.d.transition(session, from_states=[SessionState.RUNNING], epoch=epoch, worker="w1",
                                          to=SessionState.SUSPENDING, deadline_s=60)
            assert cas.ok
            ref = SnapshotRef(key=f"snapshots/{session}/000000000004-1-x.tar.zst", epoch=epoch, createdAt=time.time(),
                              sizeBytes=1, sha256="0" * 64, files=0)
            ok, _ = await self.d.commit_snapshot(session, epoch=epoch, ref=ref, states=(SessionState.SUSPENDING,),
                                                 to=SessionState.SUSPENDED, unset=("worker", "slot"), retention=2)
            assert ok
        raise WorkerUnavailable(f"worker at {address} closed the connection", code="worker_unavailable")


@pytest.mark.parametrize("committed", [True, False])
async def test_a_suspend_whose_worker_dies_after_committing_is_answered_as_done(directory: Directory,
                                                                              committed: bool) -> None:
    """Regression (fresh-user round 15): a worker killed right after a suspend's commit made the suspend
    answer 502 ``worker_unavailable`` though the session was SUSPENDED with its new snapshot. The
    directory decides: committed is success; not committed stays the 502."""
    act = await _setup(directory, CommitsThenDies(directory, commit=committed), sid="s2",
                       state=SessionState.RUNNING, epoch=4, worker="w1", slot=0)
    rec = await directory.get_session("s2")
    act.check_worker = _no_check  # type: ignore[method-assign]  (the worker is not really gone here)
    told: list[bool] = []
    if committed:
        out = await act.suspend_explicit(rec, on_committed=lambda: told.append(True))
        assert out.state == SessionState.SUSPENDED and out.snapshot is not None and out.snapshot.epoch == 4
        assert told == [True]
    else:
        with pytest.raises(WorkerUnavailable):
            await act.suspend_explicit(rec, on_committed=lambda: told.append(True))
        assert told == []


async def _no_check(*_: Any, **__: Any) -> None:
    return None


class StartFails:
    async def activate(self, address: str, *, session: str, epoch: int, **_: Any) -> dict[str, Any]:
        from substrate.errors import SubstrateError

        err = SubstrateError("agent host did not start: timed out", code="agent_start_failed")
        err.status = 500
        raise err

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        pass


async def test_a_failed_wake_whose_rollback_meets_an_unavailable_redis_is_rolled_back_once_it_answers(
        directory: Directory, monkeypatch) -> None:
    """Regression (fresh-user round 17): a wake that failed while Redis refused writes (its disk full) could
    not put the session back to SUSPENDED; it stayed RESUMING, every call 503 ``resume_timeout``, until the
    state manager's deadline roll a minute later, though Redis was back within seconds. The rollback is now
    retried in the background as soon as Redis answers."""
    import asyncio

    from substrate.errors import DirectoryUnavailable, SubstrateError

    act = await _setup(directory, StartFails(), sid="s3")
    real = directory.transition
    refused: list[int] = []

    async def refusing_once(sid: str, **kw: Any) -> Any:
        if kw.get("to") == SessionState.SUSPENDED and kw.get("from_states") == [SessionState.RESUMING] and not refused:
            refused.append(1)
            raise DirectoryUnavailable("session directory (Redis) unavailable: MISCONF Errors writing to the AOF file")
        return await real(sid, **kw)

    monkeypatch.setattr(directory, "transition", refusing_once)
    with pytest.raises(SubstrateError) as e:
        await act.wake_retrying("s3", tenant="team-a", audit_action=None)
    assert e.value.code == "agent_start_failed" and refused == [1]
    for _ in range(100):  # bounded: the background retry's first delay is 0.1 s
        if (await directory.get_session("s3")).state == SessionState.SUSPENDED:
            break
        await asyncio.sleep(0.05)
    assert (await directory.get_session("s3")).state == SessionState.SUSPENDED
