"""Pure arithmetic and rendering for trace-replay results (no network).

Units: times on the replay clock are wall seconds since the replay started (``*_s``); latencies
are milliseconds (``*_ms``); worker-seconds are wall seconds of one live worker process.

Record shapes (the ones :mod:`loadtest.replay` writes into ``result.json``):

TurnRecord
    ``session`` (session id), ``i`` (turn index in the session), ``at_s`` (scheduled send),
    ``sent_s`` (actual send), ``queue_s`` (sent - scheduled: waiting for the session's previous
    turn, a create, or the concurrency cap), ``work_s`` (requested work), ``trace_ok``,
    ``status`` (``ok`` | ``lost_state`` | ``error`` | ``timeout`` | ``not_run``), ``http``
    (status code or null), ``latency_ms`` (client-measured, send -> body read, retries included),
    ``added_ms`` (= latency_ms - work_s * 1000: what the runtime added), ``kind`` (``warm`` |
    ``wake``; null when no 200 came back), ``woke`` (bool|null), ``wake_ms`` (server-reported),
    ``state_before``, ``worker`` (X-Substrate-Worker), ``epoch`` (activation epoch),
    ``count`` (counter value returned), ``expected`` ([lo, hi] accepted counts),
    ``retries`` (503 retries), ``error`` (text|null).
SessionRecord
    ``id``, ``key`` (``owner#n``), ``owner``, ``start_s``, ``end_s`` (planned delete),
    ``hold_s`` (always-on hold: first arrival -> last turn end + idle split, wall s), ``turns``,
    ``created`` (bool), ``create_ms``, ``create_http``, ``create_retries``, ``deleted`` (bool),
    ``final_count``, ``error``.
StatsSample
    ``t_s``, ``inflight`` (client: invokes in flight = busy turns), ``alive`` (client: sessions
    created and not yet deleted), ``ok`` (stats read succeeded), and from the server (null when
    unknown): ``workers``, ``slots``, ``slotsUsed``, ``sessions`` ({state: n}),
    ``workerSeconds`` (cumulative since the runtime started).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.bench_report import markdown_table

LATENCY_QUANTILES = (50, 95, 99)
ERROR_STATUSES = frozenset({"error", "timeout"})


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); None for no values."""
    xs = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p95", "p99", "mean", "max"}`` of the values (None fields when empty)."""
    xs = [float(v) for v in values if v is not None]
    out: dict[str, float | int | None] = {"n": len(xs)}
    for q in LATENCY_QUANTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["max"] = max(xs) if xs else None
    return out


def sessions_per_slot(distinct_sessions: int, samples: Sequence[Mapping[str, Any]]) -> dict[str, float | int | None]:
    """How many sessions each warm slot carried.

    - ``per_slot_peak`` = distinct sessions served over the run / peak slots seen;
    - ``per_slot_mean`` = mean over samples (with slots > 0) of alive sessions / slots.
    """
    slots = [s["slots"] for s in samples if isinstance(s.get("slots"), (int, float))]
    peak = max(slots) if slots else None
    ratios = [
        s["alive"] / s["slots"]
        for s in samples
        if isinstance(s.get("slots"), (int, float)) and s["slots"] > 0 and s.get("alive") is not None
    ]
    return {
        "distinct_sessions": distinct_sessions,
        "peak_slots": peak,
        "mean_slots": (sum(slots) / len(slots)) if slots else None,
        "per_slot_peak": (distinct_sessions / peak) if peak else None,
        "per_slot_mean": (sum(ratios) / len(ratios)) if ratios else None,
    }


def worker_seconds_from_stats(samples: Sequence[Mapping[str, Any]]) -> tuple[float | None, str | None]:
    """Worker-seconds used during the sampled interval and where the figure came from.

    Prefers the server's cumulative ``workerSeconds`` (last - first sample that has it); else
    integrates the sampled ``workers`` count over time (each sample's count holds until the next
    sample). Returns ``(None, None)`` when neither is available.
    """
    ws = [(s["t_s"], float(s["workerSeconds"])) for s in samples if isinstance(s.get("workerSeconds"), (int, float))]
    if len(ws) >= 2:
        return max(0.0, ws[-1][1] - ws[0][1]), "stats.workerSeconds"
    pts = [(s["t_s"], float(s["workers"])) for s in samples if isinstance(s.get("workers"), (int, float))]
    if len(pts) >= 2:
        total = sum(w * (pts[i + 1][0] - t) for i, (t, w) in enumerate(pts[:-1]))
        return total, "integrated stats.workers"
    return None, None


def analytical_baseline_worker_seconds(holds_s: Iterable[float]) -> float:
    """Always-on (pod-per-session) cost: each session holds one worker for its whole hold
    (first arrival -> last turn end + idle split); the sum of holds, in the holds' unit."""
    return float(sum(max(0.0, h) for h in holds_s))


def session_hold_s(start_s: float, last_end_s: float, idle_split_s: float) -> float:
    """One session's always-on hold: ``last_end_s + idle_split_s - start_s`` (same unit in/out)."""
    return max(0.0, last_end_s + idle_split_s - start_s)


def clipped_holds_s(sessions: Sequence[Mapping[str, Any]], ended_s: float) -> float:
    """Analytical always-on worker-seconds of the part of the plan that ran: each session record's
    hold ``[start_s, end_s]`` clipped to ``[0, ended_s]`` (ended_s = when the replay stopped; a
    complete run clips nothing)."""
    return analytical_baseline_worker_seconds(
        min(s["end_s"], ended_s) - max(0.0, s["start_s"]) for s in sessions
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def summarize_target(
    turns: Sequence[Mapping[str, Any]],
    sessions: Sequence[Mapping[str, Any]],
    samples: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """One target's figures (see the module docstring for the record shapes)."""
    by_status: dict[str, int] = {}
    for t in turns:
        by_status[t["status"]] = by_status.get(t["status"], 0) + 1
    served = [t for t in turns if t.get("http") == 200 and t.get("added_ms") is not None]
    warm = [t["added_ms"] for t in served if t.get("kind") == "warm"]
    wake = [t["added_ms"] for t in served if t.get("kind") == "wake"]
    created = [s for s in sessions if s.get("created")]
    errors_by_kind: dict[str, int] = {}
    for t in turns:
        if t["status"] in ERROR_STATUSES:
            key = f"{t['status']}:{t.get('http') or '-'}"
            errors_by_kind[key] = errors_by_kind.get(key, 0) + 1
    ws, ws_source = worker_seconds_from_stats(samples)
    workers = [s["workers"] for s in samples if isinstance(s.get("workers"), (int, float))]
    used = [s["slotsUsed"] for s in samples if isinstance(s.get("slotsUsed"), (int, float))]
    return {
        "turns_planned": len(turns),
        "turns_run": sum(1 for t in turns if t["status"] != "not_run"),
        "ok": by_status.get("ok", 0),
        "errors": sum(by_status.get(k, 0) for k in ERROR_STATUSES),
        "lost_state": by_status.get("lost_state", 0),
        "not_run": by_status.get("not_run", 0),
        "trace_failed": sum(1 for t in turns if not t.get("trace_ok", True)),
        "errors_by_kind": errors_by_kind,
        "warm": len(warm),
        "wake": len(wake),
        "warm_hit_rate": (len(warm) / (len(warm) + len(wake))) if (warm or wake) else None,
        "added_ms": {
            "warm": latency_stats(warm),
            "wake": latency_stats(wake),
            "all": latency_stats(t["added_ms"] for t in served),
        },
        "latency_ms": latency_stats(t["latency_ms"] for t in served),
        "server_wake_ms": latency_stats(t["wake_ms"] for t in served if t.get("wake_ms") is not None),
        "queue_s": latency_stats(t["queue_s"] for t in turns if t.get("queue_s") is not None),
        "sessions": {
            "planned": len(sessions),
            "created": len(created),
            "create_failed": len(sessions) - len(created),
            "create_ms": latency_stats(s["create_ms"] for s in created if s.get("create_ms") is not None),
        },
        "capacity": {
            **sessions_per_slot(len(created), samples),
            "peak_workers": max(workers) if workers else None,
            "mean_workers": (sum(workers) / len(workers)) if workers else None,
            "peak_slots_used": max(used) if used else None,
            "peak_inflight": max((s.get("inflight") or 0 for s in samples), default=None),
        },
        "worker_seconds": ws,
        "worker_seconds_source": ws_source,
        "stats_samples": len(samples),
        "stats_ok_samples": sum(1 for s in samples if s.get("ok")),
    }


def compare(result: Mapping[str, Any]) -> dict[str, Any]:
    """Baseline block + ratios for a result holding ``targets.ours`` (and maybe ``targets.baseline``).

    The analytical always-on figure comes from ours' session records clipped to when ours stopped
    (:func:`clipped_holds_s`), else from ``plan.baseline_worker_seconds``. Ratios are
    baseline / ours (> 1: ours is cheaper / faster)."""
    ours = result["targets"]["ours"]["summary"]
    plan = result["plan"]
    base_target = result["targets"].get("baseline")
    compress = float(result["config"].get("compress") or 1.0)
    ours_target = result["targets"]["ours"]
    if ours_target.get("sessions") and ours_target.get("ended_s") is not None:
        analytical = clipped_holds_s(ours_target["sessions"], ours_target["ended_s"])
    else:
        analytical = plan.get("baseline_worker_seconds")
    if base_target is not None:
        bsum = base_target["summary"]
        mode = "measured"
        base_ws = bsum.get("worker_seconds")
        base_p99 = bsum["added_ms"]["all"]["p99"]
        note = (
            f"the same trace replayed concurrently against {base_target['host']} "
            "(one slot per worker, no idle suspension)"
        )
    else:
        mode = "analytical"
        base_ws = analytical
        base_p99 = None
        note = (
            "no baseline host; each session holds one always-on worker from its first "
            "arrival to its last turn end + the idle split (pod-per-session); its added latency is "
            "not measured (an always-on pod's is about our warm path)"
        )
    ours_ws = ours.get("worker_seconds")
    ours_p99 = ours["added_ms"]["all"]["p99"]
    return {
        "baseline": {
            "mode": mode,
            "worker_seconds": base_ws,
            "worker_seconds_trace": (base_ws * compress) if base_ws is not None else None,
            "analytical_worker_seconds": analytical,
            "p99_added_ms": base_p99,
            "note": note,
        },
        "ratios": {
            "worker_seconds_baseline_over_ours": ratio(base_ws, ours_ws),
            "p99_added_baseline_over_ours": ratio(base_p99, ours_p99),
        },
    }


# ---------------------------------------------------------------------------------------------
# rendering


def _ms(v: float | None) -> str:
    return "n/a" if v is None else (f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}")


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def target_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    a = summary["added_ms"]
    cap = summary["capacity"]
    return [
        ("turns (run / planned)", f"{summary['turns_run']} / {summary['turns_planned']}"),
        ("ok", str(summary["ok"])),
        ("errors", str(summary["errors"]) + (
            " (" + ", ".join(f"{k} x{v}" for k, v in sorted(summary["errors_by_kind"].items())) + ")"
            if summary.get("errors_by_kind") else "")),
        ("lost_state", str(summary["lost_state"])),
        ("trace-failed turns (replayed)", str(summary["trace_failed"])),
        ("sessions (created / planned)", f"{summary['sessions']['created']} / {summary['sessions']['planned']}"),
        ("warm-hit rate", _pct(summary["warm_hit_rate"])),
        ("added ms warm p50 / p95 / p99", " / ".join(_ms(a["warm"][f"p{q}"]) for q in LATENCY_QUANTILES)),
        ("added ms wake p50 / p95 / p99", " / ".join(_ms(a["wake"][f"p{q}"]) for q in LATENCY_QUANTILES)),
        ("added ms all p99", _ms(a["all"]["p99"])),
        ("turns warm / wake", f"{summary['warm']} / {summary['wake']}"),
        ("peak slots / peak workers", (f"{cap['peak_slots'] if cap['peak_slots'] is not None else 'n/a'} / "
         f"{cap['peak_workers'] if cap['peak_workers'] is not None else 'n/a'}")),
        ("sessions per slot (distinct/peak, mean)", f"{_num(cap['per_slot_peak'])}, {_num(cap['per_slot_mean'])}"),
        ("worker-seconds", _num(summary["worker_seconds"], "{:.1f}")
         + (f" ({summary['worker_seconds_source']})" if summary.get("worker_seconds_source") else "")),
    ]


def render_markdown(result: Mapping[str, Any]) -> str:
    """The human report (markdown) for a full result dict."""
    cfg, plan = result["config"], result["plan"]
    targets = result["targets"]
    names = [n for n in ("ours", "baseline") if n in targets]
    lines = [
        f"## Trace replay: {Path(str(cfg.get('trace', '?'))).name} ({cfg.get('format')})",
        "",
        (f"- window: {cfg.get('window_start_utc') or cfg.get('window_start_s')} + {cfg.get('duration_s') or 'all'} s "
        f"of trace time; compression {cfg.get('compress')}x; idle split {cfg.get('idle_split_s')} s"),
        (f"- plan: {plan['sessions']} sessions of {plan['owners']} owners, {plan['turns']} turns "
        f"({plan.get('trace_failed_turns', 0)} failed in the trace), {_num(plan.get('wall_span_s'), '{:.0f}')} s wall"),
        "- " + ", ".join(f"{n}: {targets[n]['host']} ({_num(targets[n].get('wall_s'), '{:.0f}')} s, "
                         f"stopped by {targets[n].get('stopped_by')})" for n in names),
        "",
    ]
    partial = [n for n in names if targets[n].get("stopped_by") not in (None, "done")]
    if partial:
        why = ", ".join(f"{n} stopped by {targets[n]['stopped_by']}" for n in partial)
        lines += [(f"**Partial run** ({why}): turns not sent are `not_run`; the analytical baseline "
                  "is clipped to the time run."), ""]
    rows_by_target = {n: dict(target_rows(targets[n]["summary"])) for n in names}
    keys = [k for k, _ in target_rows(targets["ours"]["summary"])]
    lines.append(markdown_table([{"": k, **{n: rows_by_target[n][k] for n in names}} for k in keys]))
    base, ratios = result.get("baseline") or {}, result.get("ratios") or {}
    if base:
        lines += [
            "",
            f"Baseline ({base['mode']}): {base['note']}.",
            "",
            markdown_table([
                {"": "worker-seconds (wall)", "baseline": _num(base.get("worker_seconds"), "{:.1f}"),
                 "ours": _num(targets["ours"]["summary"]["worker_seconds"], "{:.1f}"),
                 "baseline / ours": _num(ratios.get("worker_seconds_baseline_over_ours"), "{:.1f}x")},
                {"": "p99 added latency ms", "baseline": _ms(base.get("p99_added_ms")),
                 "ours": _ms(targets["ours"]["summary"]["added_ms"]["all"]["p99"]),
                 "baseline / ours": _num(ratios.get("p99_added_baseline_over_ours"), "{:.2f}x")},
            ]),
        ]
        if base.get("mode") == "measured" and base.get("analytical_worker_seconds") is not None:
            lines += ["", (f"(Analytical always-on worker-seconds for comparison: "
                          f"{base['analytical_worker_seconds']:.1f}.)")]
    return "\n".join(lines)


def _windows(turns: Sequence[Mapping[str, Any]], kind: str | None, window_s: float) -> tuple[list[float], list[float], list[float]]:
    buckets: dict[int, list[float]] = {}
    for t in turns:
        if (kind is None or t.get("kind") == kind) and t.get("added_ms") is not None and t.get("sent_s") is not None:
            buckets.setdefault(int(t["sent_s"] // window_s), []).append(t["added_ms"])
    xs, p50, p99 = [], [], []
    for b in sorted(buckets):
        xs.append((b + 0.5) * window_s)
        p50.append(percentile(buckets[b], 50))
        p99.append(percentile(buckets[b], 99))
    return xs, p50, p99


def plot_report(result: Mapping[str, Any], path: str | Path, window_s: float | None = None) -> Path:
    """Write ``report.png``: (1) added latency p50/p99 per time window, wake vs warm;
    (2) active (RUNNING) vs suspended sessions over time; (3) warm capacity (slots) vs demand
    (busy turns in flight, slots used). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = result["targets"]["ours"]
    turns, samples = ours["turns"], ours["stats"]
    span = max([t.get("sent_s") or 0 for t in turns] + [s["t_s"] for s in samples] + [1.0])
    window_s = window_s or max(1.0, span / 30.0)

    fig, axes = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    ax = axes[0]
    plotted = False
    for kind, color in (("warm", "tab:green"), ("wake", "tab:red")):
        xs, p50, p99 = _windows(turns, kind, window_s)
        if xs:
            ax.plot(xs, p50, "-o", color=color, ms=3, label=f"{kind} p50")
            ax.plot(xs, p99, "--", color=color, label=f"{kind} p99")
            plotted = True
    if "baseline" in result["targets"]:
        xs, p50, p99 = _windows(result["targets"]["baseline"]["turns"], None, window_s)
        if xs:
            ax.plot(xs, p99, ":", color="tab:gray", label="baseline p99")
            plotted = True
    ax.set_ylabel("added latency (ms)")
    ax.set_title(f"Added latency per {window_s:.0f} s window (latency - work)")
    if plotted:
        all_vals = [v for t in turns if (v := t.get("added_ms")) is not None]
        if all_vals and min(all_vals) > 0:
            ax.set_yscale("log")
        ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1]
    ts = [s["t_s"] for s in samples]
    running = [(s.get("sessions") or {}).get("RUNNING") for s in samples]
    suspended = [(s.get("sessions") or {}).get("SUSPENDED") for s in samples]
    if any(v is not None for v in running):
        ax.plot(ts, [v or 0 for v in running], color="tab:blue", label="active (RUNNING, server)")
    if any(v is not None for v in suspended):
        ax.plot(ts, [v or 0 for v in suspended], color="tab:orange", label="suspended (server)")
    ax.plot(ts, [s.get("alive") or 0 for s in samples], color="black", lw=0.8, alpha=0.6, label="alive (client)")
    ax.set_ylabel("sessions")
    ax.set_title("Active vs suspended sessions")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[2]
    if any(s.get("slots") is not None for s in samples):
        ax.step(ts, [s.get("slots") or 0 for s in samples], where="post", color="tab:purple", label="warm slots")
    if any(s.get("slotsUsed") is not None for s in samples):
        ax.plot(ts, [s.get("slotsUsed") or 0 for s in samples], color="tab:brown", alpha=0.7, label="slots used")
    ax.plot(ts, [s.get("inflight") or 0 for s in samples], color="tab:red", label="demand (busy turns)")
    ax.set_ylabel("slots / turns")
    ax.set_xlabel("replay time (s)")
    ax.set_title("Warm capacity vs demand")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
