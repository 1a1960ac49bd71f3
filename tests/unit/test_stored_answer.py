"""The answers a worker keeps by idempotency key travel in snapshots with the restored marker of the
activation that ran the turn (chaos run, issue 8); snapshots written before that still load."""

from __future__ import annotations

import json

import pytest

from workers.server import Activation, StoredAnswer, Worker


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
