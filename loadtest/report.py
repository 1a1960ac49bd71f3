"""Pure arithmetic and rendering for trace-replay results (no network): the definitions, written once.

Definitions (every report of the project uses these; ``make bench`` and the replay report print them,
see :data:`DEFINITIONS`):

* **Cost** is counted in **slot-seconds**: provisioned session slots x time (a 6-slot worker alive for
  one second costs 6). **Process-seconds** count every process kept for sessions (worker processes and
  the always-on zygote that forks them; one per session for a pod-per-session baseline). Both come from
  the server's cumulative counters (``/v1/stats`` ``slotSeconds``/``processSeconds``), integrated by the
  pool controller every round, not from 1-second samples.
* **Busy slot-seconds** = the sum of the turns' durations: the lower bound of any system's cost.
  **Utilization** = busy / provisioned slot-seconds, for ours and for the baseline.
* **Baseline**: one always-on worker (one slot, one process) per session from its first turn's arrival
  to its last turn's end plus a hold ``L``, reported for ``L`` = 0 (a clairvoyant lower bound),
  ours' idle timeout (the same machinery as ours, pod per session), 5 minutes and 30 minutes (what a
  pod-per-session system that keeps state in the pod needs: it cannot know the user will not come back
  with the state expected, so it holds for the session's idle split). No warm spare unless ours gets
  one. Measured side by side (a second runtime with one slot per worker, sessions deleted after the idle
  split: ``L`` = idle split) when ``--baseline-host`` is given, with the analytical figures beside it.
* **Density** = time-averaged alive sessions per provisioned slot = (sum over sessions of the time
  they were alive: created to deleted) / provisioned slot-seconds. (Not "all sessions of the day / peak
  slots", which scores even the one-slot-per-session baseline at ~7.)
* **Latency** of a turn runs from its **scheduled arrival** (trace time, compressed) to its answer, so it
  includes the session's create (first turn), the wait behind the session's previous turn, the client's
  concurrency cap and 503 retries (no coordinated omission). **Added latency** = that minus the turn's
  work. Errors and timeouts are in the tail as +inf (a p99 over a run with more than 1 % failures is
  inf), never dropped. **Added over the ideal runtime** = the answer's time minus the turn's end on an
  ideal runtime (zero overhead, the same arrivals and work, a session's turns one at a time:
  :func:`loadtest.bounds.ideal_runs`): what the runtime adds, including the delay it passed on to the
  session's later turns, without the wait behind the previous turn that the trace itself causes (the
  plan's inherent wait, which "added" keeps). Router overhead (``make bench``) is the distribution of per-request **paired
  differences** (routed - direct, interleaved), never a difference of percentiles.
* **One percentile function** for the whole project: :func:`substrate.quantiles.percentile` (linear
  interpolation between closest ranks, numpy's default), re-exported here.

Units: times on the replay clock are wall seconds since the replay started (``*_s``); latencies
are milliseconds (``*_ms``); slot-/process-/worker-seconds are wall seconds.

Record shapes (the ones :mod:`loadtest.replay` writes into ``result.json``):

TurnRecord
    ``session`` (session id), ``i`` (turn index in the session), ``at_s`` (scheduled arrival),
    ``sent_s`` (actual send), ``done_s`` (answer or failure), ``queue_s`` (sent - scheduled: waiting for
    the session's create or previous turn, or the concurrency cap), ``work_s`` (requested work),
    ``trace_ok``, ``status`` (``ok`` | ``lost_state`` | ``error`` | ``timeout`` | ``not_run``), ``http``
    (status code or null), ``latency_ms`` (from scheduled arrival to answer: ``done_s - at_s``),
    ``service_ms`` (send -> body read, retries included), ``added_ms`` (= latency_ms - work_s * 1000;
    null when no 200 came back), ``kind`` (``warm`` | ``wake``; null when no 200 came back), ``woke``
    (bool|null), ``wake_ms`` (server-reported), ``state_before``, ``worker`` (X-Substrate-Worker),
    ``epoch`` (activation epoch), ``count`` (counter value returned), ``expected`` ([lo, hi] accepted
    counts), ``retries`` (503 retries), ``error`` (text|null), ``restored`` (the answer's
    ``X-Substrate-Restored``: the runtime said its state came back older, e.g. after a crash; null).
SessionRecord
    ``id``, ``key`` (``owner#n``), ``owner``, ``start_s`` (first arrival), ``last_end_s`` (latest turn
    end, planned), ``end_s`` (planned delete = last_end_s + idle split), ``hold_s``, ``turns``,
    ``created`` (bool), ``created_s``/``deleted_s`` (replay clock, null if it did not happen),
    ``create_ms``, ``create_http``, ``create_retries``, ``deleted`` (bool), ``final_count``, ``error``.
StatsSample
    ``t_s``, ``inflight`` (client: invokes in flight = busy turns), ``alive`` (client: sessions
    created and not yet deleted), ``ok`` (stats read succeeded), and from the server (null when
    unknown): ``workers``, ``slots``, ``slotsUsed``, ``sessions`` ({state: n}), and the cumulative
    ``workerSeconds``, ``slotSeconds``, ``processSeconds`` since the runtime started.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.bench_report import markdown_table
from loadtest.bounds import bound_worker_sizes, ideal_runs, plan_bounds, render_bounds
from substrate.loops import LAG_COUNT_OVER_S
from substrate.quantiles import percentile

#: the phases of a wake kept per turn from its ``Server-Timing`` (``api.proxy.server_timing``): the
#: router's slot wait (``place``) and activation call (``activate``), and the worker's parts of the
#: latter (``sandbox``: taking the slot's sandbox; ``restore``: download and unpack; ``agent``: its start)
WAKE_PHASES = ("place", "activate", "sandbox", "restore", "agent")

__all__ = ["DEFINITIONS", "percentile", "latency_stats", "summarize_target", "compare", "render_markdown",
           "plot_report", "baseline_holds"]

LATENCY_QUANTILES = (50, 95, 99)
ERROR_STATUSES = frozenset({"error", "timeout"})

#: the definitions every report prints (markdown bullet list)
DEFINITIONS = """\
- cost: slot-seconds (provisioned slots x time) and process-seconds (workers + the zygote; one per \
session for the baseline), from the server's counters
- utilization: busy slot-seconds (sum of turn durations) / provisioned slot-seconds
- baseline: one always-on worker per session from its first arrival to its last turn's end + hold L, \
for L = 0, ours' idle timeout, 5 min, 30 min; no warm spare unless ours has one
- density: time-averaged alive sessions per provisioned slot (sum of session lifetimes / slot-seconds)
- latency: scheduled arrival -> answer (includes create, queueing behind the previous turn, retries); \
added = latency - work; errors and timeouts count as +inf in the tail
- added over the ideal runtime: answer time - the turn's end on an ideal runtime (zero overhead, same \
arrivals and work, a session's turns one at a time): what the runtime adds, delays it passed on to the \
session's later turns included, the trace's own wait behind the previous turn left out
- router overhead: percentiles of per-request paired differences (routed - direct, interleaved)
- percentiles: one function (linear interpolation between closest ranks, numpy's default)
- bounds: the plan on an ideal runtime (zero overhead, a session's turns one at a time): the inherent \
wait behind a session's previous turn, and the utilization of fixed and reactive capacity (loadtest/bounds.py)
- event-loop lag: how late a once-a-second timer fired (substrate.loops.watch_lag), in the replay client (its \
own probes), in the target's router (agent_substrate_event_loop_lag_seconds, this run's probes) and in \
its workers (/v1/stats workerLoopLag, this run's probes of every worker): a request the process held \
waited at least as long"""


def latency_stats(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p95", "p99", "mean", "max"}`` of the values (None fields when empty; +inf values,
    failures, count in n and the percentiles; the mean is over the finite values)."""
    xs = [float(v) for v in values if v is not None]
    finite = [x for x in xs if math.isfinite(x)]
    out: dict[str, float | int | None] = {"n": len(xs)}
    for q in LATENCY_QUANTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["mean"] = sum(finite) / len(finite) if finite else None
    out["max"] = max(xs) if xs else None
    return out


def counter_delta(samples: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Increase of a cumulative server counter (``workerSeconds``, ``slotSeconds``, ...) between the
    first and the last sample that carry it; None with fewer than two."""
    vs = [float(s[key]) for s in samples if isinstance(s.get(key), (int, float))]
    return max(0.0, vs[-1] - vs[0]) if len(vs) >= 2 else None


#: the event-loop lag thresholds (ms) the report gives the share of late probes for: the ones the workers
#: count theirs by (``substrate.loops.LAG_COUNT_OVER_S``), each a bucket bound of the processes' histogram
LAG_THRESHOLDS_MS: tuple[int, ...] = tuple(round(b * 1000) for b in LAG_COUNT_OVER_S)


def lag_buckets(exposition: str) -> dict[float, float]:
    """The cumulative buckets (upper bound in seconds -> count) of ``agent_substrate_event_loop_lag_seconds``
    in a Prometheus text exposition (``/metrics``); empty if it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(exposition):
        if fam.name != "agent_substrate_event_loop_lag_seconds":
            continue
        for sample in fam.samples:
            if sample.name.endswith("_bucket"):
                out[float(sample.labels["le"])] = out.get(float(sample.labels["le"]), 0.0) + float(sample.value)
    return out


def lag_share_over(before: Mapping[float, float] | None, after: Mapping[float, float] | None
                   ) -> dict[str, Any] | None:
    """The run's own probes (``after - before`` of :func:`lag_buckets`): ``{"n": probes, "over_ms": {"5":
    share late by more than 5 ms, "10": ..., "25": ...}}`` for ``LAG_THRESHOLDS_MS`` (each a bucket bound of
    the histogram); None without both scrapes or without probes."""
    if not before and not after or after is None:
        return None
    before = before or {}
    delta = {le: max(0.0, after.get(le, 0.0) - before.get(le, 0.0)) for le in after}
    n = delta.get(math.inf, 0.0)
    if n <= 0:
        return None
    # string keys: the summary goes through JSON (result.json) and is rendered again from it
    over = {str(ms): (n - delta[ms / 1000.0]) / n for ms in LAG_THRESHOLDS_MS if ms / 1000.0 in delta}
    return {"n": int(n), "over_ms": over}


def worker_lag_share(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The target's workers' event-loop lag probes during the run, as :func:`lag_share_over` gives a
    process's: from ``workerLoopLag`` of ``/v1/stats`` (``{"probes", "over5ms", "over10ms", "over25ms"}``,
    counts since the directory was made, added by the workers' heartbeats) in the run's first and last
    sample that have it. None without two such samples (another kind of target, an older runtime)."""
    got = [s["workerLoopLag"] for s in samples if isinstance(s.get("workerLoopLag"), Mapping)]
    if len(got) < 2:
        return None

    def buckets(w: Mapping[str, Any]) -> dict[float, float]:
        n = float(w.get("probes") or 0)
        return {math.inf: n, **{ms / 1000.0: n - float(w.get(f"over{ms}ms") or 0) for ms in LAG_THRESHOLDS_MS}}

    return lag_share_over(buckets(got[0]), buckets(got[-1]))


def integrate(samples: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Integral over time of a sampled quantity (each sample's value holds until the next sample)."""
    pts = [(s["t_s"], float(s[key])) for s in samples if isinstance(s.get(key), (int, float))]
    if len(pts) < 2:
        return None
    return sum(v * (pts[i + 1][0] - t) for i, (t, v) in enumerate(pts[:-1]))


def worker_seconds_from_stats(samples: Sequence[Mapping[str, Any]]) -> tuple[float | None, str | None]:
    """Worker-seconds used during the sampled interval and where the figure came from: the server's
    cumulative ``workerSeconds``, else the integral of the sampled ``workers`` count."""
    d = counter_delta(samples, "workerSeconds")
    if d is not None:
        return d, "stats.workerSeconds"
    i = integrate(samples, "workers")
    return (i, "integrated stats.workers") if i is not None else (None, None)


def cost_from_stats(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``slot_seconds``, ``process_seconds``, ``worker_seconds`` (and where each came from)."""
    out: dict[str, Any] = {}
    for name, counter, sampled in (("slot_seconds", "slotSeconds", "slots"),
                                   ("process_seconds", "processSeconds", "workers"),
                                   ("worker_seconds", "workerSeconds", "workers")):
        d = counter_delta(samples, counter)
        if d is not None:
            out[name], out[f"{name}_source"] = d, f"stats.{counter}"
        else:
            i = integrate(samples, sampled)
            out[name] = i
            out[f"{name}_source"] = f"integrated stats.{sampled} (1 s samples)" if i is not None else None
    return out


def analytical_baseline_worker_seconds(holds_s: Iterable[float]) -> float:
    """Always-on (pod-per-session) cost: each session holds one worker for its whole hold; the sum."""
    return float(sum(max(0.0, h) for h in holds_s))


def session_hold_s(start_s: float, last_end_s: float, hold_after_s: float) -> float:
    """One session's always-on hold: ``last_end_s + hold_after_s - start_s`` (same unit in/out)."""
    return max(0.0, last_end_s + hold_after_s - start_s)


def clipped_holds_s(sessions: Sequence[Mapping[str, Any]], ended_s: float, hold_after_s: float | None = None) -> float:
    """Analytical always-on worker-seconds of the part of the plan that ran: each session's hold
    ``[start_s, last_end_s + hold_after_s]`` (default: its planned ``end_s``) clipped to ``[0, ended_s]``."""
    def end(s: Mapping[str, Any]) -> float:
        if hold_after_s is None or s.get("last_end_s") is None:
            return float(s["end_s"])
        return float(s["last_end_s"]) + hold_after_s
    return analytical_baseline_worker_seconds(min(end(s), ended_s) - max(0.0, s["start_s"]) for s in sessions)


def baseline_holds(idle_timeout_s: float | None, compress: float) -> list[tuple[str, float]]:
    """The holds ``L`` the baseline is reported for, as ``(label, wall seconds)``: 0, ours' idle
    timeout (wall, if known), 5 min and 30 min of trace time."""
    out = [("L = 0", 0.0)]
    if idle_timeout_s is not None:
        out.append((f"L = ours' idle timeout ({idle_timeout_s * compress:.0f} s)", idle_timeout_s))
    out += [("L = 5 min", 300.0 / compress), ("L = 30 min", 1800.0 / compress)]
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def busy_slot_seconds(turns: Sequence[Mapping[str, Any]]) -> float:
    """Sum of the work of every turn that was sent (the lower bound of any system's slot-seconds)."""
    return float(sum(t["work_s"] for t in turns if t.get("sent_s") is not None))


def alive_session_seconds(sessions: Sequence[Mapping[str, Any]], ended_s: float | None) -> float | None:
    """Sum over created sessions of (deleted - created) on the replay clock (open ones up to
    ``ended_s``); None when the records carry no ``created_s``."""
    if not any(s.get("created_s") is not None for s in sessions):
        return None
    total = 0.0
    for s in sessions:
        c = s.get("created_s")
        if c is None:
            continue
        d = s.get("deleted_s")
        d = d if d is not None else ended_s
        if d is not None:
            total += max(0.0, d - c)
    return total


def summarize_target(
    turns: Sequence[Mapping[str, Any]],
    sessions: Sequence[Mapping[str, Any]],
    samples: Sequence[Mapping[str, Any]],
    ended_s: float | None = None,
    *,
    client_lag_s: Sequence[float] = (),
    server_lag: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One target's figures (see the module docstring for the definitions and record shapes).
    ``client_lag_s``: the replay client's own event-loop lag probes (seconds); ``server_lag``: the target
    process's, from :func:`lag_share_over`."""
    by_status: dict[str, int] = {}
    for t in turns:
        by_status[t["status"]] = by_status.get(t["status"], 0) + 1
    served = [t for t in turns if t.get("http") == 200 and t.get("added_ms") is not None]
    failed = [t for t in turns if t["status"] in ERROR_STATUSES]
    warm = [t["added_ms"] for t in served if t.get("kind") == "warm"]
    wake = [t["added_ms"] for t in served if t.get("kind") == "wake"]
    created = [s for s in sessions if s.get("created")]
    errors_by_kind: dict[str, int] = {}
    for t in failed:
        key = f"{t['status']}:{t.get('http') or '-'}"
        errors_by_kind[key] = errors_by_kind.get(key, 0) + 1
    ideal_end = {id(t): end for t, _, end in ideal_runs(turns)}
    over = {id(t): (float(t["done_s"]) - ideal_end[id(t)]) * 1000 for t in served
            if id(t) in ideal_end and t.get("done_s") is not None}
    cost = cost_from_stats(samples)
    busy = busy_slot_seconds(turns)
    alive_s = alive_session_seconds(sessions, ended_s)
    workers = [s["workers"] for s in samples if isinstance(s.get("workers"), (int, float))]
    slots = [s["slots"] for s in samples if isinstance(s.get("slots"), (int, float))]
    used = [s["slotsUsed"] for s in samples if isinstance(s.get("slotsUsed"), (int, float))]
    return {
        "turns_planned": len(turns),
        "turns_run": sum(1 for t in turns if t["status"] != "not_run"),
        "ok": by_status.get("ok", 0),
        "errors": len(failed),
        "lost_state": by_status.get("lost_state", 0),
        # of those, answers on which the runtime itself said the state came back older (a worker or
        # agent was killed): a loss it reported, within its contract, but still a loss
        "lost_state_reported": sum(1 for t in turns if t["status"] == "lost_state" and t.get("restored")),
        "not_run": by_status.get("not_run", 0),
        "trace_failed": sum(1 for t in turns if not t.get("trace_ok", True)),
        "errors_by_kind": errors_by_kind,
        "warm": len(warm),
        "wake": len(wake),
        "warm_hit_rate": (len(warm) / (len(warm) + len(wake))) if (warm or wake) else None,
        "added_ms": {
            "warm": latency_stats(warm),
            "wake": latency_stats(wake),
            # every turn that ran: failures are +inf in the tail
            "all": latency_stats([t["added_ms"] for t in served] + [math.inf] * len(failed)),
        },
        # the answer's time minus the turn's end on the ideal runtime (the module docstring)
        "over_ideal_ms": {
            "warm": latency_stats(over[id(t)] for t in served if t.get("kind") == "warm" and id(t) in over),
            "wake": latency_stats(over[id(t)] for t in served if t.get("kind") == "wake" and id(t) in over),
            "all": latency_stats([over[id(t)] for t in served if id(t) in over] + [math.inf] * len(failed)),
        },
        # the same turns measured from when the client sent them (excludes the wait behind the session's
        # create or previous turn): shows how much of the added latency is queueing in the trace itself
        "service_added_ms": {
            kind: latency_stats(t["service_ms"] - t["work_s"] * 1000 for t in served
                                if t.get("kind") == kind and t.get("service_ms") is not None)
            for kind in ("warm", "wake")
        },
        "latency_ms": latency_stats([t["latency_ms"] for t in served] + [math.inf] * len(failed)),
        "service_ms": latency_stats(t.get("service_ms") for t in served),
        "server_wake_ms": latency_stats(t["wake_ms"] for t in served if t.get("wake_ms") is not None),
        # the runtime's own split of a wake (``Server-Timing``): waiting for a slot vs the worker's restore
        **{f"wake_{ph}_ms": latency_stats(t.get(f"{ph}_ms") for t in served if t.get(f"{ph}_ms") is not None)
           for ph in WAKE_PHASES},
        "queue_s": latency_stats(t["queue_s"] for t in turns if t.get("queue_s") is not None),
        "sessions": {
            "planned": len(sessions),
            "created": len(created),
            "create_failed": len(sessions) - len(created),
            "create_ms": latency_stats(s["create_ms"] for s in created if s.get("create_ms") is not None),
        },
        "capacity": {
            "peak_slots": max(slots) if slots else None,
            "peak_workers": max(workers) if workers else None,
            "mean_workers": (sum(workers) / len(workers)) if workers else None,
            "peak_slots_used": max(used) if used else None,
            "peak_inflight": max((s.get("inflight") or 0 for s in samples), default=None),
        },
        "cost": {
            **cost,
            "busy_slot_seconds": busy,
            "utilization": ratio(busy, cost.get("slot_seconds")),
            "alive_session_seconds": alive_s,
            "density": ratio(alive_s, cost.get("slot_seconds")),
        },
        "worker_seconds": cost.get("worker_seconds"),
        "worker_seconds_source": cost.get("worker_seconds_source"),
        "stats_samples": len(samples),
        "stats_ok_samples": sum(1 for s in samples if s.get("ok")),
        # what the shared cores did to the timing: the client's own loop (it sends and times every turn)
        # and the router's and workers', each late by as much as every request it held
        "client_lag_ms": latency_stats(x * 1000.0 for x in client_lag_s),
        "server_lag": server_lag,
        "worker_lag": worker_lag_share(samples),
    }


def compare(result: Mapping[str, Any]) -> dict[str, Any]:
    """The baseline block: the analytical always-on cost for every hold ``L`` (see
    :func:`baseline_holds`) clipped to the time ours ran, the measured baseline if one ran, and the
    ratios baseline / ours (> 1: ours is cheaper) in slot-seconds and process-seconds."""
    ours_target = result["targets"]["ours"]
    ours = ours_target["summary"]
    cfg = result["config"]
    compress = float(cfg.get("compress") or 1.0)
    ended = ours_target.get("ended_s")
    sessions = ours_target.get("sessions") or []
    busy = ours["cost"]["busy_slot_seconds"]
    ours_slot, ours_proc = ours["cost"].get("slot_seconds"), ours["cost"].get("process_seconds")
    rows = []
    for label, hold_wall_s in baseline_holds(cfg.get("ours_idle_timeout_s"), compress):
        if sessions and ended is not None:
            slot_s = clipped_holds_s(sessions, ended, hold_wall_s)
        else:
            slot_s = None
        rows.append({"hold": label, "hold_wall_s": hold_wall_s, "mode": "analytical",
                     "slot_seconds": slot_s, "process_seconds": slot_s,
                     "utilization": ratio(busy, slot_s),
                     "slot_ratio": ratio(slot_s, ours_slot), "process_ratio": ratio(slot_s, ours_proc)})
    measured = None
    base_target = result["targets"].get("baseline")
    if base_target is not None:
        b = base_target["summary"]
        bc = b["cost"]
        measured = {
            "hold": f"L = idle split ({float(cfg.get('idle_split_s') or 0):.0f} s), measured", "mode": "measured",
            "host": base_target["host"], "slot_seconds": bc.get("slot_seconds"),
            "process_seconds": bc.get("process_seconds"), "utilization": bc.get("utilization"),
            "slot_ratio": ratio(bc.get("slot_seconds"), ours_slot),
            "process_ratio": ratio(bc.get("process_seconds"), ours_proc),
            "p99_added_ms": b["added_ms"]["all"]["p99"],
        }
    return {"baseline": {"holds": rows, "measured": measured,
                         "note": ("one always-on worker (1 slot, 1 process) per session from its first arrival "
                                  "to its last turn's end + L; analytical rows are clipped to the time ours ran")}}


# ---------------------------------------------------------------------------------------------
# rendering


def _ms(v: float | None) -> str:
    if v is None:
        return "n/a"
    if math.isinf(v):
        return "inf (failures)"
    return f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def target_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    a = summary["added_ms"]
    cap = summary["capacity"]
    cost = summary["cost"]
    return [
        ("turns (run / planned)", f"{summary['turns_run']} / {summary['turns_planned']}"),
        ("ok", str(summary["ok"])),
        ("errors", str(summary["errors"]) + (
            " (" + ", ".join(f"{k} x{v}" for k, v in sorted(summary["errors_by_kind"].items())) + ")"
            if summary.get("errors_by_kind") else "")),
        ("lost_state", str(summary["lost_state"]) + (
            f" ({summary['lost_state_reported']} reported by X-Substrate-Restored)"
            if summary.get("lost_state_reported") else "")),
        ("trace-failed turns (replayed)", str(summary["trace_failed"])),
        ("sessions (created / planned)", f"{summary['sessions']['created']} / {summary['sessions']['planned']}"),
        ("warm-hit rate", _pct(summary["warm_hit_rate"])),
        ("added ms warm p50 / p95 / p99", " / ".join(_ms(a["warm"][f"p{q}"]) for q in LATENCY_QUANTILES)),
        ("added ms wake p50 / p95 / p99", " / ".join(_ms(a["wake"][f"p{q}"]) for q in LATENCY_QUANTILES)),
        ("added ms all (failures = inf) p50 / p99", f"{_ms(a['all']['p50'])} / {_ms(a['all']['p99'])}"),
        ("added over the ideal runtime ms warm p50 / p95 / p99", " / ".join(
            _ms((summary.get("over_ideal_ms") or {}).get("warm", {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("added over the ideal runtime ms wake p50 / p95 / p99", " / ".join(
            _ms((summary.get("over_ideal_ms") or {}).get("wake", {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        # in ms like the rows around it (it was the one row in seconds: fresh-user round 10)
        ("  of which queueing: turn wait ms p50 / p95 / p99", " / ".join(
            _ms(None if (v := summary["queue_s"][f"p{q}"]) is None else v * 1000.0) for q in LATENCY_QUANTILES)),
        ("  send -> answer added ms warm p50 / p95 / p99", " / ".join(
            _ms((summary.get("service_added_ms") or {}).get("warm", {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("  send -> answer added ms wake p50 / p95 / p99", " / ".join(
            _ms((summary.get("service_added_ms") or {}).get("wake", {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("  wake phases (Server-Timing) ms: slot wait p50 / p95 / p99", " / ".join(
            _ms((summary.get("wake_place_ms") or {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("  wake phases (Server-Timing) ms: activate (restore, agent start) p50 / p95 / p99", " / ".join(
            _ms((summary.get("wake_activate_ms") or {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("    of which the worker's sandbox (taking the slot's) p50 / p95 / p99", " / ".join(
            _ms((summary.get("wake_sandbox_ms") or {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("    of which the worker's restore (download and unpack) p50 / p95 / p99", " / ".join(
            _ms((summary.get("wake_restore_ms") or {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("    of which the agent's start p50 / p95 / p99", " / ".join(
            _ms((summary.get("wake_agent_ms") or {}).get(f"p{q}")) for q in LATENCY_QUANTILES)),
        ("  event-loop lag of the replay client (it sends and times each turn) ms p50 / p99 / max", " / ".join(
            _ms((summary.get("client_lag_ms") or {}).get(k)) for k in ("p50", "p99", "max"))),
        ("  event-loop lag of the target's router: share of its once-a-second probes late by > "
         + " / ".join(f"{ms}" for ms in LAG_THRESHOLDS_MS) + " ms", _lag_row(summary.get("server_lag"))),
        ("  event-loop lag of the target's workers: share of their once-a-second probes late by > "
         + " / ".join(f"{ms}" for ms in LAG_THRESHOLDS_MS) + " ms", _lag_row(summary.get("worker_lag"))),
        ("turns warm / wake", f"{summary['warm']} / {summary['wake']}"),
        ("create ms p50 / p99", f"{_ms(summary['sessions']['create_ms']['p50'])} / "
         f"{_ms(summary['sessions']['create_ms']['p99'])}"),
        ("peak slots / peak workers", (f"{cap['peak_slots'] if cap['peak_slots'] is not None else 'n/a'} / "
         f"{cap['peak_workers'] if cap['peak_workers'] is not None else 'n/a'}")),
        ("slot-seconds (provisioned)", _num(cost.get("slot_seconds"), "{:.1f}")),
        ("process-seconds", _num(cost.get("process_seconds"), "{:.1f}")),
        ("busy slot-seconds (sum of turns)", _num(cost.get("busy_slot_seconds"), "{:.1f}")),
        ("utilization (busy / provisioned)", _pct(cost.get("utilization"))),
        ("density (alive sessions per slot, time-avg)", _num(cost.get("density"))),
    ]


def _lag_row(lag: Mapping[str, Any] | None) -> str:
    if not lag:
        return "n/a"
    over = lag.get("over_ms") or {}
    return " / ".join(_pct(over.get(str(ms))) for ms in LAG_THRESHOLDS_MS) + f" of {lag['n']:,}"


def render_markdown(result: Mapping[str, Any]) -> str:
    """The human report (markdown) for a full result dict, definitions included."""
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
    idle_cut = [n for n in names if targets[n].get("stopped_by") == "wall_cap_in_final_idle"]
    if idle_cut:
        lines += [(f"**Every turn ran** ({', '.join(idle_cut)}); the wall cap cut the sessions' final idle hold "
                   "(each is deleted its idle split after its last turn): the cost figures cover the time run, "
                   "the analytical baseline is clipped to it."), ""]
    partial = [n for n in names if targets[n].get("stopped_by") not in (None, "done", "wall_cap_in_final_idle")]
    if partial:
        why = ", ".join(f"{n} stopped by {targets[n]['stopped_by']}" for n in partial)
        lines += [(f"**Partial run** ({why}): turns not sent are `not_run`; the analytical baseline "
                  "is clipped to the time run."), ""]
    rows_by_target = {n: dict(target_rows(targets[n]["summary"])) for n in names}
    keys = [k for k, _ in target_rows(targets["ours"]["summary"])]
    lines.append(markdown_table([{"": k, **{n: rows_by_target[n][k] for n in names}} for k in keys]))
    base = result.get("baseline") or {}
    if base:
        ours_cost = targets["ours"]["summary"]["cost"]
        rows = [{"baseline": r["hold"], "slot-seconds": _num(r["slot_seconds"], "{:.1f}"),
                 "process-seconds": _num(r["process_seconds"], "{:.1f}"), "utilization": _pct(r["utilization"]),
                 "baseline / ours (slots)": _num(r["slot_ratio"], "{:.2f}x"),
                 "baseline / ours (processes)": _num(r["process_ratio"], "{:.2f}x")}
                for r in base.get("holds", []) + ([base["measured"]] if base.get("measured") else [])]
        rows.append({"baseline": "ours", "slot-seconds": _num(ours_cost.get("slot_seconds"), "{:.1f}"),
                     "process-seconds": _num(ours_cost.get("process_seconds"), "{:.1f}"),
                     "utilization": _pct(ours_cost.get("utilization")),
                     "baseline / ours (slots)": "1x", "baseline / ours (processes)": "1x"})
        lines += ["", f"Always-on baseline: {base['note']}.", "", markdown_table(rows)]
    bounds = result.get("bounds")
    if bounds is None and targets["ours"].get("turns"):
        bounds = plan_bounds(targets["ours"]["turns"], worker_slots=bound_worker_sizes(result.get("config") or {}))
    if bounds:
        lines += ["", *render_bounds(bounds)]
    lines += ["", "Definitions:", "", DEFINITIONS]
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
