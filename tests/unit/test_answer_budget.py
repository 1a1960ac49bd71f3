"""The worker's kept answers (idempotency): bounded by count and by bytes (``workers.server.keep_answer``)."""

from __future__ import annotations

import json
from collections import OrderedDict

from workers.server import NOT_KEPT_STATUS, StoredAnswer, keep_answer


def test_an_answer_over_the_budget_leaves_a_marker():
    a: OrderedDict[str, StoredAnswer] = OrderedDict()
    keep_answer(a, "k", StoredAnswer(200, "x" * 5000, "d", "worker_lost", 1.0), keys=4, budget=1000)
    status, text, digest = a["k"].status, a["k"].text, a["k"].digest
    assert a["k"].restored == "worker_lost", "a marker keeps the restored marker of the turn"
    assert status == NOT_KEPT_STATUS and json.loads(text)["code"] == "answer_not_kept" and digest == "d"
    assert "5000-byte" in json.loads(text)["message"]


def test_the_sum_stays_under_the_budget_and_every_recent_key_stays_known():
    a: OrderedDict[str, StoredAnswer] = OrderedDict()
    for i in range(10):
        keep_answer(a, f"k{i}", StoredAnswer(200, "y" * 400, f"d{i}"), keys=8, budget=1000)
        assert sum(len(v.text) for v in a.values() if v.status == 200) <= 1000
    assert list(a) == [f"k{i}" for i in range(2, 10)], "the count bound drops the oldest keys"
    full = [k for k, v in a.items() if v.status == 200]
    assert full == ["k8", "k9"], "the newest answers are kept whole"
    assert sum(len(a[k].text) for k in full) <= 1000
    assert all(a[k].status == NOT_KEPT_STATUS for k in list(a)[:-2])
