"""The one shape every periodic control loop here has: call a step, log and survive any error, sleep;
and the two things every such loop's owner needs to stop it for sure.

Why a loop checks for a lost cancellation: on Python 3.11, ``asyncio.wait_for`` (redis-py wraps every
command's send in it) can swallow a ``cancel()`` that arrives as the awaited operation completes
(CPython gh-86296, fixed in 3.12). The step then returns normally, a ``while True`` loop goes on to its
next sleep and step, and the task never ends: ``asyncio.run`` waits for it at shutdown for ever. Seen here
as ``substrate up`` hanging on Ctrl-C in about one stop in ten (the signing-key refresh loop, cancelled in
the middle of its ``HGETALL``). ``Task.cancelling()`` still counts the request, so a loop that asks it
after each step ends as it was told to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

log = logging.getLogger(__name__)


def reraise_lost_cancel() -> None:
    """Raise ``asyncio.CancelledError`` if the running task has been asked to stop (``cancel()``) and
    the request did not reach it as an exception (see the module docstring). Call it where a loop would
    otherwise go round again; a no-op outside a task."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def run_forever(step: Callable[[], Awaitable[object]], interval_s: float, what: str, *,
                      first_delay: bool = False) -> None:
    """Run ``step`` every ``interval_s`` seconds until cancelled. An exception from ``step`` is logged
    (as ``"<what> failed"``) and the loop goes on: a control loop never dies. A cancellation the step
    swallowed still ends it (:func:`reraise_lost_cancel`)."""
    if first_delay:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
        except Exception:  # noqa: BLE001 - a control loop never dies
            log.warning("%s failed", what, exc_info=True)
        reraise_lost_cancel()
        await asyncio.sleep(interval_s)


async def cancel_and_wait(tasks: Iterable[asyncio.Future[object] | None], timeout_s: float = 5.0) -> int:
    """Cancel every task (``None`` entries are skipped) and wait up to ``timeout_s`` seconds for all of
    them to end, so that nothing they hold (a Redis connection, a worker's HTTP client) is closed under
    them. Never raises for a task's own outcome. Returns how many were still running at the end (0:
    all stopped); each of those is logged by name, and is left to ``asyncio.run``'s final cancel."""
    pending = [t for t in tasks if t is not None and not t.done()]
    for t in pending:
        t.cancel()
    if not pending:
        return 0
    _, still = await asyncio.wait(pending, timeout=timeout_s)
    for t in still:
        log.warning("a task did not stop within %.1f s of its cancel", timeout_s,
                    extra={"task": t.get_name() if isinstance(t, asyncio.Task) else repr(t)})
    return len(still)


#: a lag past this is logged (at most once per ``LAG_LOG_EVERY_S``): the process served nothing meanwhile
LAG_WARN_S = 0.5
LAG_LOG_EVERY_S = 60.0
#: the probe's period: a 100 ms probe in the router and every worker cost about 5 ms at the replay's warm
#: send -> answer p99 on 2 shared vCPUs (docs/replays, 2026-12-07); once a second still catches every hold
#: long enough to matter (a hold shorter than the period is caught in proportion to its share of time)
LAG_PROBE_INTERVAL_S = 1.0
#: the lags (s) a fleet counts its probes beyond (``LagCounts``; the replay report's shares of late probes)
LAG_COUNT_OVER_S: tuple[float, ...] = (0.005, 0.01, 0.025)


class LagCounts:
    """A process's event-loop lag probes counted for a fleet-wide total: how many probes, and how many
    were late by more than each of ``LAG_COUNT_OVER_S``, since the last ``take``. Workers report them
    with their heartbeat (``Directory.heartbeat``'s ``loop_lag``), as the ``workerLoopLag*`` fields of
    the directory's stats: a worker lives minutes, so its own ``/metrics`` histogram is gone before a
    replay can read it."""

    def __init__(self) -> None:
        self.probes = 0
        self.over = [0] * len(LAG_COUNT_OVER_S)

    def observe(self, lag_s: float) -> None:
        """Count one probe that was ``lag_s`` seconds late."""
        self.probes += 1
        for i, bound in enumerate(LAG_COUNT_OVER_S):
            if lag_s > bound:
                self.over[i] += 1

    def fields(self) -> dict[str, int]:
        """The counts as the stats fields they add to: ``workerLoopLagProbes``, ``workerLoopLagOver5ms``,
        ``...Over10ms``, ``...Over25ms``."""
        return {"workerLoopLagProbes": self.probes,
                **{f"workerLoopLagOver{round(b * 1000)}ms": n for b, n in zip(LAG_COUNT_OVER_S, self.over)}}

    @staticmethod
    def totals(stats: Mapping[str, float]) -> dict[str, int]:
        """The fleet's counts in the directory's ``stats`` (fields of ``fields()``, added up) as ``/v1/stats``
        shows them: ``{"probes", "over5ms", "over10ms", "over25ms"}``."""
        return {"probes": int(stats.get("workerLoopLagProbes", 0)),
                **{f"over{round(b * 1000)}ms": int(stats.get(f"workerLoopLagOver{round(b * 1000)}ms", 0))
                   for b in LAG_COUNT_OVER_S}}

    def take(self, fields: dict[str, int]) -> None:
        """Subtract ``fields`` (a ``fields()`` reported since) from the counts."""
        self.probes -= fields.get("workerLoopLagProbes", 0)
        for i, b in enumerate(LAG_COUNT_OVER_S):
            self.over[i] -= fields.get(f"workerLoopLagOver{round(b * 1000)}ms", 0)


async def watch_lag(observe: Callable[[float], None], interval_s: float = LAG_PROBE_INTERVAL_S) -> None:
    """Measure this event loop's lag until cancelled: sleep ``interval_s`` seconds, and pass ``observe``
    how much later than asked the loop woke (seconds, >= 0), as Node's ``monitorEventLoopDelay`` and
    uvloop users' lag probes do. Lag is time every task of the loop waited, whether the loop ran
    CPU-bound callbacks or the process had no CPU. A lag over ``LAG_WARN_S`` is logged as a warning, at
    most once per ``LAG_LOG_EVERY_S``. Costs one timer per ``interval_s``; never raises but
    ``CancelledError``."""
    loop = asyncio.get_running_loop()
    logged_at = -LAG_LOG_EVERY_S
    while True:
        t0 = loop.time()
        await asyncio.sleep(interval_s)
        lag_s = max(0.0, loop.time() - t0 - interval_s)
        try:
            observe(lag_s)
        except Exception:  # noqa: BLE001 - a probe never dies
            log.debug("event loop lag observer failed", exc_info=True)
        if lag_s > LAG_WARN_S and loop.time() - logged_at >= LAG_LOG_EVERY_S:
            logged_at = loop.time()
            log.warning("event loop held for %.0f ms: every request of this process waited as long (CPU-bound "
                        "work on the loop, or no CPU for the process)", lag_s * 1000)
        reraise_lost_cancel()
