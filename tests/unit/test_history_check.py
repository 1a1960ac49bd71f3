"""The chaos harness's history checker finds each kind of violation in made-up histories."""

from __future__ import annotations

from loadtest.history import Turn, check


def _c(seq, value, *, epoch=1, worker="w1", restored=None, acked=None, snap=None, kind="counter"):
    return Turn(session="s", kind=kind, seq=seq, sent_at=float(seq), acked_at=acked if acked is not None else seq + 0.5,
                epoch=epoch, worker=worker, restored=restored, value=value, restored_snapshot_at=snap)


def test_a_clean_counter_history_passes():
    v = check([_c(i, i) for i in range(1, 6)])
    assert v.ok and v.turns == 5 and v.lost_reported == 0


def test_a_count_going_back_without_the_restored_header_is_a_violation():
    v = check([_c(1, 1), _c(2, 2), _c(3, 1, epoch=2, worker="w2")])
    assert [x.kind for x in v.violations] == ["lost-unreported"]


def test_a_reported_loss_after_the_snapshot_is_allowed_and_counted():
    h = [_c(1, 1, acked=1.0), _c(2, 2, acked=2.0), _c(3, 3, acked=3.0),
         _c(4, 2, epoch=2, worker="w2", restored="worker_lost", snap=1.5)]
    v = check(h)
    assert v.ok and v.lost_reported == 2 and v.restored_answers == 1


def test_a_loss_of_turns_older_than_the_snapshot_is_a_violation():
    h = [_c(1, 1, acked=1.0), _c(2, 2, acked=2.0), _c(3, 1, epoch=2, restored="worker_lost", snap=2.5)]
    assert [x.kind for x in check(h).violations] == ["lost-before-snapshot"]


def test_a_turn_applied_twice_is_a_violation():
    assert [x.kind for x in check([_c(1, 1), _c(2, 3)]).violations] == ["duplicated"]


def test_two_workers_in_one_epoch_and_a_zombie_answer_are_violations():
    v = check([_c(1, 1, epoch=3, worker="a"), _c(2, 2, epoch=3, worker="b")])
    assert [x.kind for x in v.violations] == ["split-brain"]
    v = check([_c(1, 1, epoch=4, worker="a"), _c(2, 2, epoch=3, worker="b")])
    assert [x.kind for x in v.violations] == ["split-brain"]


def test_log_histories():
    ok = [_c(1, ["1"], kind="log"), _c(2, ["1", "2"], kind="log"), _c(3, ["1", "3"], kind="log",
                                                                         epoch=2, restored="deadline")]
    v = check(ok)
    assert v.ok and v.lost_reported == 1
    bad = [_c(1, ["1"], kind="log"), _c(2, ["1", "2"], kind="log"), _c(3, ["2", "3"], kind="log")]
    assert [x.kind for x in check(bad).violations] == ["diverged"]
    dup = [_c(1, ["1"], kind="log"), _c(2, ["1", "2", "2"], kind="log")]
    assert [x.kind for x in check(dup).violations] == ["duplicated"]
    assert [x.kind for x in check([_c(1, "nonsense", kind="log")]).violations] == ["bad-answer"]


def test_a_loss_inside_one_restored_activation_is_a_violation():
    h = [_c(1, 1), _c(2, 1, epoch=2, restored="worker_lost", snap=0.0), _c(3, 2, epoch=2, restored="worker_lost"),
         _c(4, 1, epoch=2, restored="worker_lost")]
    v = check(h)
    assert [x.kind for x in v.violations] == ["lost-unreported"] and v.violations[0].seq == 4
