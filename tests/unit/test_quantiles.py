"""The project's one percentile function."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from substrate.quantiles import percentile


@settings(deadline=None)
@given(xs=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), q=st.floats(0, 100))
def test_matches_numpy_linear(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def test_errors_as_inf_stay_in_the_tail():
    xs = [1.0] * 98 + [math.inf, math.inf]
    assert percentile(xs, 50) == 1.0
    assert percentile(xs, 99) == math.inf  # two failures in 100: the p99 is a failure
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0


def test_empty_and_bad_q():
    assert percentile([], 50) is None
    assert percentile([None, float("nan")], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
