"""Trend detectors that keep running state give the findings of a from-scratch refit.

`oom` and `fragmentation_allocator` update per-(job, rank) state from each tick's new rows
(gpuvigil/detectors/incremental.py). Here each is fed the same rows as the refit it replaced
(tests/incremental_oracles.py, the code as it was) and must report the same findings on every
tick: detect() on every tick (state stepped), ingest() every tick with detect() now and then (the
pipeline's way), and detect() now and then with no ingest (state rebuilt from the window).

Generated series use times on a 1/4 s grid and byte counts in whole MiB, so every sum is exact in
float64 and the comparison is exact (no tolerance): incremental and refit may add in any order.
Rows arrive in time order (the oracle's first/last are by arrival, the new ones by timestamp; they
agree when arrival follows time).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples

from gpuvigil import config, schemas
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.window import Window

sys.path.insert(0, str(Path(__file__).parent))
from incremental_oracles import RefitFragmentationAllocator, RefitOom, check_against_refit  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


def _jobs_frame(starts: dict[str, float | None]) -> pl.DataFrame:
    """The scheduler's snapshot; a job with start None is not in it."""
    rows = [{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": s, "n_gpus": 8} for j, s in starts.items() if s is not None]
    return pl.DataFrame(rows, schema=schemas.JOBS)


@st.composite
def allocator_series(draw):
    """Ticks of allocator_stats rows for a few (job, rank) keys: trends, jitter, gaps, requeues."""
    t0 = draw(st.sampled_from([0.0, 1000.0, 1_700_000_000.0]))
    n_ticks = draw(st.integers(20, 70))
    steps = draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.0, 1.0, 2.0, 5.0]), min_size=n_ticks, max_size=n_ticks))
    jobs = ["job-a", "job-b"][: draw(st.integers(1, 2))]
    keys = [(j, r) for j in jobs for r in range(draw(st.integers(1, 3)))]
    cap = draw(st.sampled_from([80 * GIB, 140 * GIB]))
    per_key = {}
    for k in keys:
        per_key[k] = {
            "base": draw(st.integers(20, 60)) * GIB,
            "slope": draw(st.sampled_from([0, 0, 4, 32, 128, 512])) * MIB,  # per tick
            "gap_slope": draw(st.sampled_from([0, 16, 256])) * MIB,
            "foreign_slope": draw(st.sampled_from([0, 0, 64, 512])) * MIB,
            "jitter": draw(st.sampled_from([0, 8, 256])),
            "p_missing": draw(st.sampled_from([0.0, 0.0, 0.2])),
        }
    start = {j: draw(st.sampled_from([None, t0 - 100.0, t0 + 5.0])) for j in jobs}
    requeue_at = draw(st.one_of(st.none(), st.integers(5, n_ticks - 1)))
    requeue_job = draw(st.sampled_from(jobs))
    drop_at = draw(st.one_of(st.none(), st.integers(5, n_ticks - 1)))  # a job leaves the snapshot
    ticks = []
    now = t0
    retries = {k: 0 for k in keys}
    for i in range(n_ticks):
        now += steps[i]
        if requeue_at == i:
            start[requeue_job] = now - 0.25
        if drop_at == i:
            start[jobs[0]] = None
        rows = []
        for k, p in per_key.items():
            if p["p_missing"] and draw(st.floats(0, 1)) < p["p_missing"]:
                continue
            noise = draw(st.integers(-p["jitter"], p["jitter"])) * MIB if p["jitter"] else 0
            alloc = p["base"] + p["slope"] * i + noise
            peak = alloc + draw(st.integers(0, 2048)) * MIB
            gap = p["gap_slope"] * i + draw(st.integers(0, 64)) * MIB
            retries[k] += draw(st.sampled_from([0, 0, 0, 1]))
            rows.append(
                {
                    "ts": now - draw(st.sampled_from([0.0, 0.0, 0.25])),
                    "job": k[0],
                    "rank": k[1],
                    "node": f"n{k[1]}",
                    "gpu": k[1],
                    "allocated_bytes": alloc,
                    "reserved_bytes": peak + gap,
                    "inactive_split_bytes": gap * draw(st.sampled_from([0, 1])),
                    "largest_free_block_bytes": draw(st.integers(0, 4096)) * MIB,
                    "peak_allocated_bytes": peak,
                    "alloc_retries": retries[k] if draw(st.integers(0, 9)) else None,
                    "oom_count": 0,
                    "device_capacity_bytes": cap,
                    "foreign_used_bytes": p["foreign_slope"] * i if p["foreign_slope"] else None,
                }
            )
        ticks.append((now, pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS), _jobs_frame(start)))
    horizon = draw(st.sampled_from([1e9, 200.0]))
    return ticks, horizon


def _check_same(make_new, make_refit, ticks, horizon):
    return check_against_refit(make_new, make_refit, "allocator_stats", ticks, horizon)


OOM_CFG = {"oom": {"fit_window_seconds": 30.0, "warmup_seconds": 4.0, "min_samples": 6, "min_span_seconds": 8.0, "min_r2": 0.3, "min_rise_bytes": 64 * MIB, "predict_horizon_seconds": 1e7}}


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(allocator_series())
def test_oom_incremental_matches_refit(series):
    ticks, horizon = series
    cfg = config.load(overrides={"detectors": OOM_CFG})
    _check_same(lambda: OomPredictor(cfg), lambda: RefitOom(cfg), ticks, horizon)


def test_oom_incremental_matches_refit_on_default_config_with_findings():
    """A leak on two ranks and a flat one, default thresholds: findings raised, and identical."""
    cfg = config.defaults()
    ticks = []
    for i in range(1, 160):
        now = 500.0 + i
        rows = []
        for rank, slope in ((0, 64 * MIB), (1, 96 * MIB), (2, 0)):
            alloc = 30 * GIB + slope * i + (i % 5) * MIB
            rows.append({"ts": now, "job": "leaky", "rank": rank, "node": "n0", "gpu": rank, "allocated_bytes": alloc, "reserved_bytes": alloc + GIB,
                         "inactive_split_bytes": 0, "largest_free_block_bytes": GIB, "peak_allocated_bytes": alloc + 512 * MIB, "alloc_retries": i // 50,
                         "oom_count": 0, "device_capacity_bytes": 140 * GIB, "foreign_used_bytes": None})  # fmt: skip
        ticks.append((now, pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS), _jobs_frame({"leaky": 480.0})))
    positives = _check_same(lambda: OomPredictor(cfg), lambda: RefitOom(cfg), ticks, 180.0)
    assert positives > 50


def test_oom_state_survives_a_long_run_far_from_the_epoch():
    """Sums are kept relative to now: a long run at epoch times (t0 ~ 1.8e9 s) loses no precision."""
    cfg = config.defaults()
    det, refit, w = OomPredictor(cfg), RefitOom(cfg), Window(180.0)
    t0 = 1_764_000_000.123
    last = None
    for i in range(1, 1300):
        now = t0 + i * 1.0
        alloc = 30 * GIB + 80 * MIB * (i % 400) + (i * 7919 % 13) * MIB
        w.add("allocator_stats", pl.DataFrame([{"ts": now, "job": "j", "rank": 0, "node": "n", "gpu": 0, "allocated_bytes": alloc, "reserved_bytes": alloc + GIB,
                                                "inactive_split_bytes": 0, "largest_free_block_bytes": 0, "peak_allocated_bytes": alloc, "alloc_retries": 0,
                                                "oom_count": 0, "device_capacity_bytes": 140 * GIB, "foreign_used_bytes": None}], schema=schemas.ALLOCATOR_STATS))  # fmt: skip
        w.seal(now)
        got, want = det.detect(w), refit.detect(w)
        assert [(f.job, f.ranks, f.cause, f.severity) for f in got] == [(f.job, f.ranks, f.cause, f.severity) for f in want]
        for a, b in zip(got, want, strict=True):
            assert math.isclose(a.evidence["time_to_oom_seconds"], b.evidence["time_to_oom_seconds"], rel_tol=1e-6, abs_tol=0.11)
            assert abs(a.evidence["growth_bytes_per_second"] - b.evidence["growth_bytes_per_second"]) <= max(2, 1e-6 * abs(b.evidence["growth_bytes_per_second"]))
        last = want or last
    assert last, "the sawtooth's rising ramps were predicted"


FRAG_CFG = {"fragmentation_allocator": {"window_seconds": 30.0, "warmup_seconds": 4.0, "min_samples": 4, "min_gap_bytes": 256 * MIB, "min_gap_share": 0.0, "every_seconds": 0.0}}


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(allocator_series())
def test_fragmentation_allocator_incremental_matches_refit(series):
    ticks, horizon = series
    cfg = config.load(overrides={"detectors": FRAG_CFG})
    _check_same(lambda: AllocatorFragmentationDetector(cfg), lambda: RefitFragmentationAllocator(cfg), ticks, horizon)


def test_fragmentation_allocator_incremental_matches_refit_on_default_config_with_findings():
    """Reserved-but-unused memory growing in split blocks with retries, default thresholds: the
    ticket is raised (with the step's request above the largest free block), and identical."""
    # Evaluated on every call (every_seconds 0): the three feeding patterns call at different ticks.
    cfg = config.load(overrides={"detectors": {"fragmentation_allocator": {"every_seconds": 0.0}}})
    ticks = []
    for i in range(1, 200):
        now = 900.0 + i
        rows = []
        for rank, frag in ((0, 48 * MIB), (1, 32 * MIB), (2, 0)):
            alloc = 40 * GIB + (i % 7) * MIB
            peak = alloc + (3 + i % 3) * GIB
            gap = frag * i
            rows.append({"ts": now, "job": "frag", "rank": rank, "node": "n1", "gpu": rank, "allocated_bytes": alloc, "reserved_bytes": peak + gap,
                         "inactive_split_bytes": gap * 3 // 4, "largest_free_block_bytes": 2 * GIB, "peak_allocated_bytes": peak,
                         "alloc_retries": i // 20 if frag else 0, "oom_count": 0, "device_capacity_bytes": 140 * GIB, "foreign_used_bytes": None})  # fmt: skip
        ticks.append((now, pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS), _jobs_frame({"frag": 850.0})))
    positives = _check_same(lambda: AllocatorFragmentationDetector(cfg), lambda: RefitFragmentationAllocator(cfg), ticks, 180.0)
    assert positives > 40
    det = AllocatorFragmentationDetector(config.defaults())
    w = Window(180.0)
    for now, rows, jobs in ticks:
        w.add("allocator_stats", rows)
        w.add("jobs", jobs)
        w.seal(now)
    [f] = det.detect(w)
    assert f.ranks == [0] and f.evidence["rank"] == 0  # rank 1 holds 6.2 GiB < 5% of 140 GiB and f.evidence["largest_block_below_request"] is True
