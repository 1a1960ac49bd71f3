"""What any runtime could achieve on a replay plan: bounds computed from the trace alone (no network).

A replay's targets (warm added p99, utilization) are only meaningful next to what the workload itself
allows. These figures come from the plan's turns (scheduled arrival ``at_s``, work ``work_s``, session)
run on an **ideal runtime**: zero overhead, a session's turns one after the other (a stateful session
runs one turn at a time, so a turn that arrives while its session's previous turn runs waits for it).

* **Inherent wait**: in the ideal schedule a turn starts at ``max(at_s, end of the session's previous
  turn)``; the wait is that minus ``at_s``. Every runtime's added latency measured from the scheduled
  arrival includes it, so its percentiles are a floor for "added ms" (module :mod:`loadtest.report`).
* **Fixed capacity**: with ``c`` slots always provisioned, a turn finds no free slot when ``c`` other
  turns are running at its start. ``c99`` is the smallest ``c`` for which at most 1 % of turns find no
  free slot (what a warm p99 needs: the other 1 % wait for a slot or a new worker), and
  ``utilization <= busy / (c99 x span)``.
* **Reactive capacity** (an autoscaler with instant scale-up and a scale-down delay ``d``): the
  provisioned slots at ``t`` are the most turns running at any time in ``[t - d, t]`` plus a spare
  ``k``. A turn whose start finds all of them busy needed a scale-up (with real workers: a cold start).
  For each ``(d, k)`` the report gives the utilization and the share of turns that needed a scale-up:
  high utilization is only reachable with capacity that shrinks within ``d`` of a turn's end, and then
  many turns find no free slot. The same rows are given for **workers of ``S`` slots** (capacity comes
  and goes a whole worker at a time: ``S x ceil((most running + k) / S)`` slots), for ``S`` = 1 and the
  replayed pool's slots per worker: what that worker size allows any autoscaler, before any latency.

All times are wall seconds on the replay clock (the plan is already compressed). The arithmetic is
exact for the inherent wait and the fixed-capacity share; the reactive figures use a grid of
``grid_s`` seconds (1 ms by default), which over-counts provisioned slots by at most one cell per step.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from substrate.quantiles import percentile

#: scale-down delays (wall seconds) and spares of the reactive rows
REACTIVE_DELAYS_S = (0.01, 0.1, 1.0)
REACTIVE_SPARES = (0, 1)
#: the share of turns that may find no free slot for a warm p99 (1 %)
P99_SHARE = 0.01


def ideal_runs(turns: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], float, float]]:
    """``(turn, start_s, end_s)`` of every turn on the ideal runtime: a session's turns run in arrival
    order (ties by turn index ``i``), one at a time, each starting at ``max(at_s, end of the previous)``.
    ``turns`` carry ``session``, ``at_s``, ``work_s`` (records without ``at_s`` or ``work_s`` are skipped)."""
    by_session: dict[str, list[tuple[float, int, float, Mapping[str, Any]]]] = {}
    for n, t in enumerate(turns):
        if t.get("at_s") is None or t.get("work_s") is None:
            continue  # not part of the plan's schedule
        order = int(t["i"]) if t.get("i") is not None else n
        by_session.setdefault(str(t["session"]), []).append(
            (float(t["at_s"]), order, max(0.0, float(t["work_s"])), t))
    out = []
    for items in by_session.values():
        items.sort(key=lambda x: (x[0], x[1]))
        free_at = float("-inf")
        for at, _, work, t in items:
            start = max(at, free_at)
            free_at = start + work
            out.append((t, start, free_at))
    return out


def ideal_schedule(turns: Iterable[Mapping[str, Any]]) -> tuple[list[float], list[tuple[float, float]]]:
    """``(waits_s, intervals)`` of the ideal runtime (:func:`ideal_runs`): one wait per turn (start -
    scheduled arrival) and the ``(start_s, end_s)`` each turn runs."""
    runs = ideal_runs(turns)
    return [start - float(t["at_s"]) for t, start, _ in runs], [(start, end) for _, start, end in runs]


def others_running_at_starts(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """For each interval, how many *other* intervals are running at its start (started earlier, or at
    the same instant but earlier in the list, and not yet ended). Exact, O(n log n)."""
    starts = sorted(s for s, _ in intervals)
    ends = sorted(e for _, e in intervals)
    out = []
    seen_at: dict[float, int] = {}
    for s, _ in intervals:
        before = bisect.bisect_left(starts, s)  # started strictly earlier
        tie = seen_at.get(s, 0)  # started at the same instant, counted once each
        seen_at[s] = tie + 1
        ended = bisect.bisect_right(ends, s)  # ended at or before s (a turn ending as s starts frees its slot)
        out.append(max(0, before + tie - ended))
    return out


def _concurrency_grid(intervals: Sequence[tuple[float, float]], t0: float, n: int, grid_s: float) -> list[int]:
    """Turns running in each grid cell ``[t0 + j*grid_s, t0 + (j+1)*grid_s)`` (a turn counts in every
    cell it overlaps)."""
    diff = [0] * (n + 1)
    for s, e in intervals:
        a = max(0, min(n - 1, int((s - t0) / grid_s)))
        b = max(a, min(n - 1, int((e - t0) / grid_s - 1e-12)))
        diff[a] += 1
        diff[b + 1] -= 1
    out, cur = [], 0
    for j in range(n):
        cur += diff[j]
        out.append(cur)
    return out


def _window_max(xs: Sequence[int], width: int) -> list[int]:
    """``out[j] = max(xs[j - width + 1 .. j])`` (monotonic deque, O(n))."""
    out, dq = [], deque()
    for j, x in enumerate(xs):
        while dq and xs[dq[-1]] <= x:
            dq.pop()
        dq.append(j)
        if dq[0] <= j - width:
            dq.popleft()
        out.append(xs[dq[0]])
    return out


def plan_bounds(
    turns: Sequence[Mapping[str, Any]],
    *,
    delays_s: Sequence[float] = REACTIVE_DELAYS_S,
    spares: Sequence[int] = REACTIVE_SPARES,
    grid_s: float = 0.001,
    worker_slots: Sequence[int] = (1,),
) -> dict[str, Any] | None:
    """The bounds of the module docstring for a plan's turns (records with ``session``, ``at_s``,
    ``work_s``; ``loadtest.replay`` turn records qualify). None for an empty plan.

    -> ``{"turns", "busy_s", "span_s", "mean_busy_slots", "inherent_wait_ms": {p50, p95, p99},
    "waiting_share", "fixed": [{"slots", "no_free_slot_share", "utilization_max"}...], "c99",
    "c99_utilization_max", "reactive": [{"delay_s", "spare", "worker_slots", "utilization",
    "scale_up_share"}...]}`` (reactive rows for each of ``worker_slots``, the slots per worker ``S``).
    Raises ValueError for ``grid_s <= 0`` or a worker size below 1.
    """
    if grid_s <= 0:
        raise ValueError("grid_s must be > 0")
    sizes = sorted(set(worker_slots))
    if not sizes or sizes[0] < 1:
        raise ValueError("worker_slots must be >= 1")
    waits, intervals = ideal_schedule(turns)
    if not intervals:
        return None
    busy = sum(e - s for s, e in intervals)
    t0 = min(s for s, _ in intervals)
    span = max(e for _, e in intervals) - t0
    others = others_running_at_starts(intervals)
    n = len(others)
    fixed, c99 = [], None
    c = 1
    while True:
        share = sum(1 for o in others if o >= c) / n
        fixed.append({"slots": c, "no_free_slot_share": share,
                      "utilization_max": busy / (c * span) if span > 0 else None})
        if share <= P99_SHARE and c99 is None:
            c99 = c
        if share == 0 or c >= 256:
            break
        c += 1
    reactive = []
    if span > 0:
        cells = max(1, int(span / grid_s) + 1)
        conc = _concurrency_grid(intervals, t0, cells, grid_s)
        for d in delays_s:
            wmax = _window_max(conc, max(1, int(round(d / grid_s)) + 1))
            for size in sizes:
                for k in spares:
                    # whole workers: the most turns running in the last d, plus the spare, rounded up
                    slots = [size * -(-(w + k) // size) for w in wmax]
                    provisioned = sum(slots) * grid_s
                    need = 0
                    for (s, _), o in zip(intervals, others, strict=True):
                        j = int((s - t0) / grid_s) - 1  # the last cell that ends at or before the start
                        if o >= (slots[j] if j >= 0 else size * -(-k // size)):
                            need += 1
                    reactive.append({"delay_s": d, "spare": k, "worker_slots": size,
                                     "utilization": busy / provisioned if provisioned else None,
                                     "scale_up_share": need / n})
    return {
        "turns": n,
        "busy_s": busy,
        "span_s": span,
        "mean_busy_slots": busy / span if span > 0 else None,
        "inherent_wait_ms": {f"p{q}": 1000.0 * percentile(waits, q) for q in (50, 95, 99)},
        "waiting_share": sum(1 for w in waits if w > 0) / n,
        "fixed": fixed,
        "c99": c99,
        "c99_utilization_max": (busy / (c99 * span)) if (c99 and span > 0) else None,
        "reactive": reactive,
    }


def bound_worker_sizes(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """Worker sizes of the plan's reactive bounds: 1 (capacity by the slot) and ours' slots per worker
    (``cfg["ours_worker_slots"]``, when known)."""
    ours = cfg.get("ours_worker_slots")
    return (1, ours) if isinstance(ours, int) and ours > 1 else (1,)


def render_bounds(b: Mapping[str, Any] | None) -> list[str]:
    """Markdown lines for :func:`plan_bounds`' result (empty for None)."""
    if not b:
        return []
    w = b["inherent_wait_ms"]
    lines = [
        "What the plan allows (any runtime; an ideal one with zero overhead and a session's turns one "
        "at a time, `loadtest/bounds.py`):",
        "",
        (f"- mean demand {b['mean_busy_slots']:.2f} busy slots ({b['busy_s']:.1f} busy s over "
         f"{b['span_s']:.1f} s)" if b.get("mean_busy_slots") is not None else "- mean demand n/a"),
        (f"- inherent wait behind the session's previous turn: {100 * b['waiting_share']:.2f} % of turns wait; "
         f"p50 / p95 / p99 {w['p50']:.1f} / {w['p95']:.1f} / {w['p99']:.1f} ms: a floor under every "
         "'added ms' row measured from the scheduled arrival"),
    ]
    if b.get("c99"):
        lines.append(
            f"- fixed capacity: {b['c99']} slots are the fewest with at most 1 % of turns finding none free; "
            f"utilization then <= {100 * b['c99_utilization_max']:.1f} %")
    if b.get("reactive"):
        lines += ["- reactive capacity (instant scale-up, scale-down after d, spare k, in workers of S slots: "
                  "capacity comes and goes a whole worker at a time): utilization, and the share of turns "
                  "that find no free slot and need a scale-up:", ""]
        lines += ["| d (wall s) | spare k | slots per worker S | utilization | turns needing a scale-up |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['delay_s']:g} | {r['spare']} | {r.get('worker_slots', 1)} | {100 * r['utilization']:.1f} % | "
                  f"{100 * r['scale_up_share']:.1f} % |" for r in b["reactive"] if r.get("utilization") is not None]
    return lines
