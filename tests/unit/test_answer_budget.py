"""The worker's kept answers (idempotency): bounded by count and by bytes (``workers.server.keep_answer``)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.server import NOT_KEPT_STATUS, AnswerLog, StoredAnswer, _not_kept, keep_answer


def test_an_answer_over_the_budget_leaves_a_marker():
    a = AnswerLog()
    keep_answer(a, "k", StoredAnswer(200, "x" * 5000, "d", "worker_lost", 1.0), keys=4, budget=1000)
    status, text, digest = a["k"].status, a["k"].text, a["k"].digest
    assert a["k"].restored == "worker_lost", "a marker keeps the restored marker of the turn"
    assert status == NOT_KEPT_STATUS and json.loads(text)["code"] == "answer_not_kept" and digest == "d"
    assert "5000-byte" in json.loads(text)["message"]


def test_the_sum_stays_under_the_budget_and_every_recent_key_stays_known():
    a = AnswerLog()
    for i in range(10):
        keep_answer(a, f"k{i}", StoredAnswer(200, "y" * 400, f"d{i}"), keys=8, budget=1000)
        assert sum(len(v.text) for v in a.values() if v.status == 200) <= 1000
    assert list(a) == [f"k{i}" for i in range(2, 10)], "the count bound drops the oldest keys"
    full = [k for k, v in a.items() if v.status == 200]
    assert full == ["k8", "k9"], "the newest answers are kept whole"
    assert sum(len(a[k].text) for k in full) <= 1000
    assert all(a[k].status == NOT_KEPT_STATUS for k in list(a)[:-2])


def _reference(answers: OrderedDict[str, StoredAnswer], key: str, answer: StoredAnswer, *, keys: int,
               budget: int) -> None:
    """The rule written plainly: every kept answer summed on each call, the router's keys found by a scan."""
    if len(answer.text) > budget and answer.status != NOT_KEPT_STATUS:
        answer = replace(answer, status=NOT_KEPT_STATUS, text=_not_kept(answer.status, len(answer.text), budget))
    answers[key] = answer
    answers.move_to_end(key)
    limit = keys + 1 if answer.routers and keys > 0 else keys  # the newest, router-keyed, always kept
    while len(answers) > limit:  # the oldest of the router's own keys, else the oldest
        answers.pop(next((k for k, v in answers.items() if v.routers), next(iter(answers))))
    total = sum(len(v.text) for v in answers.values() if v.status != NOT_KEPT_STATUS)
    for k, old in list(answers.items()):
        if total <= budget:
            break
        if old.status == NOT_KEPT_STATUS:
            continue
        answers[k] = replace(old, status=NOT_KEPT_STATUS, text=_not_kept(old.status, len(old.text), budget))
        total -= len(old.text)


@settings(max_examples=300, deadline=None)
@given(keys=st.integers(0, 6), budget=st.integers(0, 2000),
       calls=st.lists(st.tuples(st.integers(0, 9), st.sampled_from([200, 422, 500, NOT_KEPT_STATUS]),
                                st.integers(0, 1500), st.booleans()), max_size=40))
def test_the_running_byte_count_keeps_the_same_answers_as_summing_them_all(keys, budget, calls):
    """``AnswerLog.kept_bytes`` and ``AnswerLog.routers`` are kept up to date instead of summing and
    scanning every kept answer on each turn: the answers kept are exactly those of the plain rule, and the
    count is the sum, after every call (keys given again, by the router or a client, included)."""
    ours, ref = AnswerLog(), OrderedDict()
    for key, status, size, routers in calls:
        answer = StoredAnswer(status, "z" * size, f"d{key}", routers=routers)
        keep_answer(ours, f"k{key}", answer, keys=keys, budget=budget)
        _reference(ref, f"k{key}", answer, keys=keys, budget=budget)
        assert list(ours.items()) == list(ref.items())
        assert ours.kept_bytes == sum(len(v.text) for v in ours.values() if v.status != NOT_KEPT_STATUS)
        assert list(ours.routers) == [k for k, v in ours.items() if v.routers]


def test_the_routers_own_keys_make_room_first_and_survive_a_snapshot():
    """A client's key outlives any number of turns keyed by the router (a fresh-user run: 70 keyless turns
    pushed a keyed turn out, and its retry ran it again); a snapshot keeps which keys are the router's."""
    a = AnswerLog()
    keep_answer(a, "E1", StoredAnswer(200, "one", "d"), keys=4, budget=1000)
    for i in range(70):
        keep_answer(a, f"r{i}", StoredAnswer(200, "x", f"d{i}", routers=True), keys=4, budget=1000)
    assert list(a) == ["E1", "r66", "r67", "r68", "r69"]  # `keys`, and one more for the newest turn's
    for i in range(4):
        keep_answer(a, f"c{i}", StoredAnswer(200, "y", "d"), keys=4, budget=1000)
    assert list(a) == ["c0", "c1", "c2", "c3"], "client keys: the window of the last `keys`"


def test_the_turn_just_answered_is_kept_when_every_kept_key_is_a_clients():
    """Fresh-user round 23: with the last 64 turns keyed by the client, the 65th turn's router-made key
    made room for itself first and was never kept: the client sending its X-Request-ID back (or the
    router retrying after a lost connection) ran the turn again."""
    a = AnswerLog()
    for i in range(4):
        keep_answer(a, f"c{i}", StoredAnswer(200, "y", "d"), keys=4, budget=1000)
    keep_answer(a, "r0", StoredAnswer(200, "x", "d", routers=True), keys=4, budget=1000)
    assert list(a) == ["c0", "c1", "c2", "c3", "r0"], "no client key pushed out, and the turn kept"
    keep_answer(a, "r1", StoredAnswer(200, "x", "d", routers=True), keys=4, budget=1000)
    assert list(a) == ["c0", "c1", "c2", "c3", "r1"], "the older router key makes room"
    keep_answer(a, "z", StoredAnswer(200, "x", "d", routers=True), keys=0, budget=1000)
    assert "z" not in a, "keys=0 keeps nothing, as before"
    back = StoredAnswer.load(StoredAnswer(200, "x", "d", "", 1.0, routers=True).dump())
    assert back.routers and not StoredAnswer.load([200, "x", "d", "", 1.0]).routers, "an older snapshot's form"


def test_a_marker_over_a_tiny_budget_is_kept_as_it_is():
    """A fresh-user run: with a 100-byte budget a streamed turn's marker (made by the worker, over the
    budget itself) was wrapped again and said the turn "answered 410" with the marker's own size."""
    a = AnswerLog()
    marker = StoredAnswer(NOT_KEPT_STATUS, _not_kept(200, 355, 100), "d")
    keep_answer(a, "k", marker, keys=4, budget=100)
    assert a["k"] == marker and "answered 200" in a["k"].text and "355-byte" in a["k"].text
