"""The answers a worker keeps by idempotency key travel in snapshots with the restored marker of the
activation that ran the turn (chaos run, issue 8); snapshots written before that still load."""

from __future__ import annotations

import json

import pytest

from workers.server import Activation, AnswerLog, StoredAnswer, Worker


def test_a_stored_answer_round_trips_through_a_snapshot_with_its_marker():
    a = StoredAnswer(200, '{"output": 1}', "ab", "worker_lost", 1700000000.25)
    assert StoredAnswer.load(json.loads(json.dumps(a.dump()))) == a


@pytest.mark.parametrize("old", [[200, "{}"], [422, "{}", "cd"], [200, "{}", None]])
def test_answers_of_older_snapshots_load_without_a_marker(old):
    got = StoredAnswer.load(old)
    assert (got.status, got.text, got.restored, got.restored_at) == (old[0], "{}", None, None)
    assert got.digest == (old[2] if len(old) > 2 and old[2] else "")


def test_a_replay_says_what_the_activation_that_ran_the_turn_had_lost():
    act = Activation.__new__(Activation)  # only the fields _restored reads
    act.restored, act.restored_at = None, None
    ran = StoredAnswer(200, "{}", "", "worker_lost", 12.5)
    assert Worker._restored(act, ran) == {"X-Substrate-Restored": "worker_lost",
                                          "X-Substrate-Restored-Snapshot-At": "12.500000"}
    act.restored, act.restored_at = "activation_lost", 20.0
    assert Worker._restored(act, StoredAnswer(200, "{}")) == {
        "X-Substrate-Restored": "activation_lost", "X-Substrate-Restored-Snapshot-At": "20.000000"}
    act.restored, act.restored_at = "worker_lost;snapshot=none", None
    assert Worker._restored(act) == {"X-Substrate-Restored": "worker_lost;snapshot=none"}


def test_a_replay_of_a_turn_run_on_a_clean_activation_carries_no_marker_after_a_lossy_one():
    """A fresh-user run: turn k1 ran in epoch 1 (nothing lost, no marker); after a kill -9 the session came
    back ``worker_lost`` and k1's retry was answered from its kept answer with ``X-Substrate-Restored:
    worker_lost``, a loss that answer never had. An answer of a clean activation is kept with the marker
    "" (none), which survives a snapshot; only answers kept before markers existed take the current one."""
    act = Activation.__new__(Activation)
    act.restored, act.restored_at = "worker_lost", 20.0
    clean = StoredAnswer.load(json.loads(json.dumps(StoredAnswer(200, "{}", "ab", "").dump())))
    assert clean.restored == "" and Worker._restored(act, clean) == {}
    assert Worker._restored(act, StoredAnswer.load([200, "{}", "ab"]))["X-Substrate-Restored"] == "worker_lost"


def test_a_clean_activation_keeps_its_answers_with_the_empty_marker():
    from substrate.settings import Settings

    worker = Worker.__new__(Worker)
    worker.settings = Settings()
    act = Activation.__new__(Activation)
    act.restored, act.restored_at, act.answers = None, None, AnswerLog()
    worker._store_answer(act, "k1", 200, '{"output": 1}', "ab")
    assert act.answers["k1"].restored == ""


@pytest.mark.parametrize("found,state,level", [(False, None, "INFO"), (True, "DELETED", "INFO"),
                                               (True, "SUSPENDED", "WARNING")])
async def test_an_agent_stopped_by_a_delete_is_not_logged_as_a_death(found, state, level, caplog):
    """A fresh-user run: a DELETE during a turn logged a WARNING that the agent died and "restarts from its
    last snapshot"; nothing restarts. A record that is gone or DELETED is the delete's doing (info); one
    another step moved is still a warning."""
    import logging
    from types import SimpleNamespace

    from substrate.directory import CasResult
    from substrate.models import SessionState

    async def transition(*_a, **_k):
        return CasResult(ok=False, state=SessionState(state) if state else None, epoch=3, found=found)

    async def nothing(*_a, **_k):
        return None

    worker = Worker.__new__(Worker)
    worker.id = "w1"
    worker.directory = SimpleNamespace(transition=transition)
    worker._drop = nothing
    worker._left_live = nothing
    act = Activation.__new__(Activation)
    act.sid, act.epoch, act.slot, act.answers, act.closing = "s1", 2, 0, AnswerLog(), False
    with caplog.at_level(logging.INFO, logger="substrate"):
        await worker._end_dead(act, "agent_crashed")
    ended = [r for r in caplog.records if "activation ended" in r.getMessage()]
    assert [r.levelname for r in ended] == [level]
