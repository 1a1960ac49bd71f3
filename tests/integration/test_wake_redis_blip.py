"""A wake cut off by a short Redis outage (a fresh-user run: the embedded Redis killed with -9 and back
within 0.1 s left a waking session RESUMING, every call to it 503 ``resume_timeout``, until its 60 s
deadline). The last step of a wake, RESUMING -> RUNNING, rides out a short outage; a longer one rolls the
claim back as soon as Redis answers. Real Redis, an in-memory fake of the workers' internal API."""

from __future__ import annotations

import asyncio
import time

import pytest

from substrate.errors import DirectoryUnavailable
from substrate.models import SessionRecord, SessionState
from tests.integration.test_placement_growth import _worker, env  # noqa: F401 - env is a fixture

__all__ = ["env"]


async def _suspended(d, sid: str) -> None:
    now = time.time()
    await d.create_session(SessionRecord(id=sid, state=SessionState.SUSPENDED, actorTemplate="counter",
                                         pool="default", epoch=1, createdAt=now, updatedAt=now, lastActiveAt=now))


def _fail_running(d, times: int, *, applied: bool = False) -> list[int]:
    """Make the next ``times`` RESUMING -> RUNNING steps raise DirectoryUnavailable (``applied``: after
    taking effect, as when Redis's answer is lost). Returns the list of attempts seen."""
    real = d.transition
    seen: list[int] = []

    async def flaky(sid, **kw):
        if kw.get("to") == SessionState.RUNNING:
            seen.append(1)
            if len(seen) <= times:
                if applied:
                    await real(sid, **kw)
                raise DirectoryUnavailable("session directory (Redis) unavailable: Connection refused")
        return await real(sid, **kw)

    d.transition = flaky
    return seen


@pytest.mark.parametrize("applied", [False, True], ids=["refused", "answer lost"])
async def test_a_wake_rides_out_a_redis_blip_at_its_last_step(env, applied):  # noqa: F811
    d, act, workers = env
    await _worker(d, "w1", slots=2)
    await act.view.refresh()
    await _suspended(d, "s1")
    seen = _fail_running(d, 2, applied=applied)
    route, woke = await act.wake("s1")
    assert woke and route.worker == "w1"
    rec = await d.get_session("s1")
    assert rec.state == SessionState.RUNNING and rec.epoch == route.epoch and rec.worker == "w1"
    assert len(seen) >= 2, "the step was retried"


async def test_a_longer_outage_fails_the_wake_and_rolls_its_claim_back_once_redis_answers(env):  # noqa: F811
    d, act, workers = env
    act.settings.api.park_timeout_s = 0.4  # the step is retried for half of it
    await _worker(d, "w1", slots=2)
    await act.view.refresh()
    await _suspended(d, "s1")
    real = d.transition
    down = True

    async def outage(sid, **kw):
        if down:
            raise DirectoryUnavailable("session directory (Redis) unavailable: Connection refused")
        return await real(sid, **kw)

    async def cut_after_claim(sid, **kw):  # Redis goes away once the claim (RESUMING) is written
        if kw.get("to") == SessionState.RESUMING:
            out = await real(sid, **kw)
            d.transition = outage
            return out
        return await real(sid, **kw)

    d.transition = cut_after_claim
    with pytest.raises(DirectoryUnavailable):
        await act.wake("s1")
    assert (await d.get_session("s1")).state == SessionState.RESUMING  # Redis is "down": nothing undone yet
    down = False
    for _ in range(100):  # bounded: a missing rollback fails here, long before the 60 s deadline
        rec = await d.get_session("s1")
        if rec.state == SessionState.SUSPENDED:
            break
        await asyncio.sleep(0.05)
    assert rec.state == SessionState.SUSPENDED and rec.worker is None
    for _ in range(100):
        if await d.worker_slots("w1") == {}:
            break
        await asyncio.sleep(0.05)
    assert await d.worker_slots("w1") == {}, "the claimed slot is free again"


async def test_a_session_deleted_during_the_blip_has_its_new_activation_dropped(env):  # noqa: F811
    from substrate.errors import Conflict

    d, act, workers = env
    await _worker(d, "w1", slots=2)
    await act.view.refresh()
    await _suspended(d, "s1")
    real = d.transition
    dropped: list[str] = []

    async def deactivate(address, session, epoch=None):
        dropped.append(session)

    workers.deactivate = deactivate

    async def blip_then_deleted(sid, **kw):
        if kw.get("to") == SessionState.RUNNING and not dropped and not getattr(blip_then_deleted, "done", False):
            blip_then_deleted.done = True
            await d.redis.delete(d.keys.session(sid))  # the delete's end: the record is gone
            raise DirectoryUnavailable("session directory (Redis) unavailable: Connection refused")
        return await real(sid, **kw)

    d.transition = blip_then_deleted
    with pytest.raises((Conflict, Exception)):
        await act.wake("s1")
    assert dropped == ["s1"], "the activation made for a deleted session is dropped on its worker"
    assert await d.worker_slots("w1") == {}
