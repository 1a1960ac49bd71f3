"""A Jepsen-style checker for the history of acknowledged turns recorded by the fault-injection harness.

The harness drives each session with one sequential client: every turn is retried with the same
idempotency key until it is acknowledged (HTTP 200), so each turn is acknowledged exactly once and
the expected answer of every turn is known from the ones before it:

* **counter** sessions: turn ``increment`` answers ``{"count": n}``;
* **log** sessions (the shell agent): turn ``k`` appends line ``k`` to a file and answers every line of it.

Checks (issue 8), each reported as a ``Violation`` with the turn that shows it:

1. ``lost-unreported``: an answer shows acknowledged turns missing (a count went back, lines vanished)
   and is not the first answer of a new activation carrying ``X-Substrate-Restored``;
2. ``duplicated``: an answer shows a turn applied twice or out of order (count jumped, a line doubled);
3. ``lost-before-snapshot``: turns reported lost were acknowledged before the snapshot the session was
   restored from was taken (they should have been in it);
4. ``split-brain``: two workers answered for one session in the same epoch, or an answer came from an
   older epoch after one from a newer epoch (a zombie activation answered);
5. ``stuck``/``slots`` are added by the harness from the final directory and worker state.

The module is pure (no I/O) so the checker itself is unit-tested against made-up histories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One acknowledged turn.

    ``seq``: the client's turn number in its session (1, 2, ...); ``sent_at``/``acked_at``: wall clock
    (s) of the first attempt and of the acknowledgement; ``epoch``/``worker``: from the answer's headers;
    ``restored``: the ``X-Substrate-Restored`` header or None; ``value``: the count (counter) or the
    list of lines (log); ``restored_snapshot_at``: createdAt (s) of the snapshot the answer's state came
    back from (its ``X-Substrate-Restored-Snapshot-At``, else the record's ``restoredFrom`` for this
    epoch), None if unknown.
    """

    session: str
    kind: str  # "counter" | "log"
    seq: int
    sent_at: float
    acked_at: float
    epoch: int
    worker: str
    restored: str | None
    value: Any
    attempts: int = 1
    router: str = ""
    restored_snapshot_at: float | None = None
    #: the answer was a replay (``X-Substrate-Replayed``): the turn ran earlier, maybe in an older
    #: activation, whose restored marker and snapshot time the answer carries
    replayed: bool = False


@dataclass(frozen=True)
class Violation:
    kind: str
    session: str
    seq: int
    detail: str


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    turns: int = 0
    #: acknowledged turns that later answers showed lost (each such answer carried the restored header)
    lost_reported: int = 0
    #: answers that carried the restored header
    restored_answers: int = 0
    max_turn_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations


def check(turns: list[Turn]) -> Verdict:
    """Check a history (any order; grouped by session and ordered by ``seq`` here)."""
    v = Verdict(turns=len(turns))
    by_session: dict[str, list[Turn]] = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t)
        v.max_turn_s = max(v.max_turn_s, t.acked_at - t.sent_at)
    for sid, ts in by_session.items():
        ts.sort(key=lambda t: t.seq)
        _check_session(sid, ts, v)
    return v


def _check_session(sid: str, ts: list[Turn], v: Verdict) -> None:
    state: list[int] = []  # the acknowledged effects the session should hold (counter: 1..n; log: lines)
    acked_at: dict[int, float] = {}  # effect -> when the turn that made it was acknowledged
    epoch_worker: dict[int, str] = {}
    max_epoch = 0
    for t in ts:
        # 4. split brain: one worker per epoch, epochs never go back
        w = epoch_worker.setdefault(t.epoch, t.worker)
        if w != t.worker:
            v.violations.append(Violation("split-brain", sid, t.seq,
                                          f"epoch {t.epoch} answered by {w} and by {t.worker}"))
        if t.epoch < max_epoch:
            v.violations.append(Violation("split-brain", sid, t.seq,
                                          f"answer from epoch {t.epoch} after one from epoch {max_epoch}"))
        prev_epoch = max_epoch
        max_epoch = max(max_epoch, t.epoch)
        got = _effects(t, state)
        if got is None:
            v.violations.append(Violation("bad-answer", sid, t.seq, f"unexpected answer {t.value!r}"))
            continue
        expected = [*state, t.seq]
        if t.restored:
            v.restored_answers += 1
        if got == expected:
            state = got
            acked_at[t.seq] = t.acked_at
            continue
        # something differs: the only legal difference is a loss of a suffix of earlier turns, reported
        if got[-1:] != [t.seq] or got[:-1] != state[:len(got) - 1]:
            kind = "duplicated" if len(got) > len(expected) or len(set(got)) != len(got) else "diverged"
            v.violations.append(Violation(kind, sid, t.seq, f"expected {_short(expected)}, got {_short(got)}"))
            state = got
            acked_at[t.seq] = t.acked_at
            continue
        lost = state[len(got) - 1:]
        if not t.restored or t.epoch <= prev_epoch:
            # a loss is legal only where an activation restored older state: the first answer of a new
            # epoch that says so; within one activation nothing acknowledged may vanish
            why = "no restored header" if not t.restored else f"within epoch {t.epoch}"
            v.violations.append(Violation("lost-unreported", sid, t.seq,
                                          f"turns {_short(lost)} acknowledged, gone ({why})"))
        else:
            v.lost_reported += len(lost)
            if t.restored_snapshot_at is not None:
                early = [x for x in lost if acked_at.get(x, float("inf")) < t.restored_snapshot_at - 0.001]
                if early:
                    v.violations.append(Violation(
                        "lost-before-snapshot", sid, t.seq,
                        f"turns {_short(early)} were acknowledged before the snapshot it came back from"))
        state = got
        acked_at[t.seq] = t.acked_at


def _effects(t: Turn, state: list[int]) -> list[int] | None:
    """The turns an answer shows applied, as turn numbers, given the turns applied before (``state``).

    A log shows its lines. A counter at ``n`` shows only how many: the first ``n - 1`` of ``state`` plus
    this turn (a count above ``len(state) + 1`` shows a turn applied twice: marked with a repeat)."""
    if t.kind == "counter":
        n = t.value
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return None
        if n == 0:
            return []
        if n - 1 > len(state):
            return [*state, *([t.seq] * (n - len(state)))]
        return [*state[:n - 1], t.seq]
    if t.kind == "log":
        if not isinstance(t.value, list):
            return None
        try:
            return [int(x) for x in t.value]
        except (TypeError, ValueError):
            return None
    return None


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, ... {xs[-2]}, {xs[-1]}] ({len(xs)})"
