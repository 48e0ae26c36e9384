"""gpuvigil.util.backoff: the one backoff formula (exponential, capped, jittered)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvigil.util.backoff import backoff_seconds


@pytest.mark.parametrize(
    ("failures", "base", "cap", "full"),
    [(0, 1.0, 60.0, 0.0), (1, 1.0, 60.0, 1.0), (2, 1.0, 60.0, 2.0), (6, 1.0, 60.0, 32.0), (7, 1.0, 60.0, 60.0), (10**6, 5.0, 300.0, 300.0), (3, 0.0, 60.0, 0.0)],
)
def test_exponential_and_capped_without_jitter(failures, base, cap, full):
    assert backoff_seconds(failures, base, cap, jitter=0.0) == full


def test_jitter_spreads_instances_that_failed_together():
    delays = [backoff_seconds(4, 1.0, 60.0, rng=random.Random(seed)) for seed in range(200)]
    assert all(4.0 <= d <= 8.0 for d in delays)
    # Not lockstep: 200 instances land on (nearly) 200 different delays, over most of the range.
    assert len({round(d, 6) for d in delays}) > 190 and max(delays) - min(delays) > 3.0


def test_a_key_fixes_the_jitter():
    a = [backoff_seconds(3, 5.0, 300.0, key="hint-1:3") for _ in range(5)]
    assert len(set(a)) == 1 and 10.0 <= a[0] <= 20.0
    assert backoff_seconds(3, 5.0, 300.0, key="hint-2:3") != a[0]


def test_bad_jitter_is_refused():
    with pytest.raises(ValueError):
        backoff_seconds(1, 1.0, 2.0, jitter=1.5)


@given(failures=st.integers(-5, 10**9), base=st.floats(0, 1e6), cap=st.floats(0, 1e7), jitter=st.floats(0, 1), key=st.text(max_size=20))
def test_always_within_half_and_full(failures, base, cap, jitter, key):
    d = backoff_seconds(failures, base, cap, jitter=jitter, key=key)
    full = min(cap, base * 2.0 ** min(max(failures, 1) - 1, 1000)) if failures >= 1 and base > 0 else 0.0
    assert full * (1 - jitter) - 1e-9 <= d <= full + 1e-9
