"""OOM predictor (gpuvigil/detectors/oom.py): the running sums of the per-step peaks, kept tick by
tick, decide the retries clause of the cause. Mutation testing left this unpinned (docs/testing.md,
`ingest__mutmut_175`: the shift of Σt·peak to the new tick's origin): in the other ticked tests
no rank's gap grows, so a wrong peak slope never changed a cause.

Source: constructed allocator_stats frames (one sample a second, built with the helpers of
tests/test_mut_oom.py), fed tick by tick. The real H200 ramp is a pure leak (no gap growth, no
retries), so it cannot reach this clause; tests/test_mut_oom.py covers it.
"""

from __future__ import annotations

import polars as pl
from test_mut_oom import GIB, MIB, rows

from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.window import Window


def test_ticked_fragmentation_by_the_retries_clause_keeps_its_cause():
    """200 s, ticks every 2 s: peaks grow 9 MiB/s from 120 GiB, the reserved-unallocated gap
    12 MiB/s (40% of the growth, under the 50% share), another process 9 MiB/s, and cudaMalloc
    retries go up every 40 s. The gap grows faster than the peaks and retries rose, so every
    finding says fragmentation, with the same figures as a fresh fit of the same window."""
    peak = lambda t: 120 * GIB + 9 * MIB * t + (t * 7 % 5) * 16 * MIB  # noqa: E731  (not a straight line)
    gap = lambda t: 12 * MIB * t  # noqa: E731
    df = rows(range(0, 201), lambda t: peak(t) + gap(t), peak=peak, foreign=lambda t: 9 * MIB * t, retries=lambda t: int(t // 40))
    kept = OomPredictor()
    w = Window(1e9)
    causes = []
    for t in range(0, 201, 2):
        w.add("allocator_stats", df.filter((pl.col("ts") > t - 2) & (pl.col("ts") <= t)))
        w.seal(float(t))
        mine = kept.detect(w)
        fresh = OomPredictor().detect(w)
        assert [(f.cause, f.evidence) for f in mine] == [(f.cause, f.evidence) for f in fresh], t
        causes += [f.cause for f in mine]
    assert len(causes) >= 50 and set(causes) == {"fragmentation"}
