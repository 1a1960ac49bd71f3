"""The one percentile definition of the project (benchmarks, replay reports, snapshot benchmarks).

Linear interpolation between closest ranks (numpy's default, "type 7" of Hyndman & Fan, 1996): for
sorted values ``x[0..n-1]`` the q-th percentile is ``x[i] + (x[i+1] - x[i]) * f`` where
``i + f = (n - 1) * q / 100``. ``math.inf`` is a legal value (a request that never got an answer: an
error or a timeout belongs in the tail, never out of it) and a percentile that reaches it is ``inf``.
NaN and None are ignored. Lives here, in the bottom layer, so every package can import it
(``loadtest.report`` re-exports it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) of ``values``; None when there are none. Raises ValueError for q
    outside [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    xs = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    if frac == 0 or math.isinf(xs[lo]):
        return xs[lo]
    if math.isinf(xs[hi]):
        return xs[hi]
    return xs[lo] + (xs[hi] - xs[lo]) * frac
