"""Garbage-collector settings for the long-lived serving processes (router, worker).

CPython's cyclic collector runs a generation-0 pass every 700 net allocations of container objects and
a full pass, which walks every tracked object, every ~100 of those; on a request path that allocates a
few hundred objects per call this is a pause every few requests, and the full passes (the import-time
heap of FastAPI, pydantic, aiohttp, redis-py: some 10^5 objects) are the slow tail. After start-up:

* ``gc.freeze()`` moves everything alive into the permanent generation, which no pass walks (objects
  made at start-up live as long as the process; the CPython docs recommend this for pre-fork servers);
* the generation-0 threshold is raised to ``GEN0_THRESHOLD``: fewer, larger young passes (the work is
  the same per object, the number of pauses is lower).

Reference counting frees almost everything anyway; the collector only finds cycles, which these
processes make rarely (exceptions with tracebacks, asyncio tasks).
"""

from __future__ import annotations

import gc

#: allocations (net, container objects) between two generation-0 passes; CPython's default is 700
GEN0_THRESHOLD = 20_000


def tune_after_startup() -> None:
    """Freeze the start-up heap and raise the young-generation threshold (see the module docstring).
    Call once, when the process is ready to serve. Idempotent enough: a second call freezes what has
    accumulated since, which is also long-lived by then."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
