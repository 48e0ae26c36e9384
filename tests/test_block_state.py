"""Block mode of the trend detectors' look-back (peak memory at 100,000 GPUs).

`oom` and `fragmentation_allocator` keep, per (job, rank), aggregates of fixed time blocks of
their look-back (gpuvigil/detectors/incremental.py: block mode) instead of having the pipeline's
window hold every raw row of it; the look-back's far edge moves a block at a time (it starts at
the start of the block holding now - W). Checked here:

- the detectors stepping over a window that keeps only what they declare (the pipeline's), against
  the from-scratch refit over a window that keeps everything, reading the same block-aligned
  look-back (tests/incremental_oracles.py: look_back): the findings must be identical on every
  tick. This is the claim that lets the window drop the look-back's rows;
- the declarations: the window keeps the OOM fit's late half + slack, not the look-back.

Generated series use times on a 1/4 s grid and byte counts in whole MiB, so sums are exact in
float64 (as in test_detectors_incremental.py) and the comparisons are equalities.
"""

from __future__ import annotations

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
from incremental_oracles import RefitFragmentationAllocator, RefitOom  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


@st.composite
def steady_series(draw):
    """Allocator rows at a steady cadence (gaps within the detectors' slack), trends and jitter:
    what a running pipeline feeds. No requeues: a job whose start moves is rebuilt from the rows
    the window still holds, which in block mode is documented as approximate."""
    t0 = draw(st.sampled_from([0.0, 1000.0, 1_700_000_000.0]))
    n_ticks = draw(st.integers(40, 110))
    steps = draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.0, 1.0, 2.0]), min_size=n_ticks, max_size=n_ticks))
    keys = [(j, r) for j in ["job-a", "job-b"][: draw(st.integers(1, 2))] for r in range(draw(st.integers(1, 3)))]
    per_key = {
        k: {
            "base": draw(st.integers(20, 60)) * GIB,
            "slope": draw(st.sampled_from([0, 4, 32, 128, 512])) * MIB,
            "gap_slope": draw(st.sampled_from([0, 16, 256])) * MIB,
            "foreign_slope": draw(st.sampled_from([0, 0, 64])) * MIB,
            "jitter": draw(st.sampled_from([0, 8, 256])),
            "p_missing": draw(st.sampled_from([0.0, 0.2])),
        }
        for k in keys
    }
    start = draw(st.sampled_from([None, t0 - 100.0, t0 + 5.0]))
    ticks = []
    now = t0
    retries = dict.fromkeys(keys, 0)
    for i in range(n_ticks):
        now += steps[i]
        rows = []
        for k, p in per_key.items():
            if p["p_missing"] and draw(st.floats(0, 1)) < p["p_missing"]:
                continue
            alloc = p["base"] + p["slope"] * i + (draw(st.integers(-p["jitter"], p["jitter"])) * MIB if p["jitter"] else 0)
            peak = alloc + draw(st.integers(0, 2048)) * MIB
            gap = p["gap_slope"] * i + draw(st.integers(0, 64)) * MIB
            retries[k] += draw(st.sampled_from([0, 0, 1]))
            rows.append({"ts": now - draw(st.sampled_from([0.0, 0.0, 0.25])), "job": k[0], "rank": k[1], "node": f"n{k[1]}", "gpu": k[1],
                         "allocated_bytes": alloc, "reserved_bytes": peak + gap, "inactive_split_bytes": gap * draw(st.sampled_from([0, 1])),
                         "largest_free_block_bytes": draw(st.integers(0, 4096)) * MIB, "peak_allocated_bytes": peak,
                         "alloc_retries": retries[k] if draw(st.integers(0, 9)) else None, "oom_count": 0, "device_capacity_bytes": 140 * GIB,
                         "foreign_used_bytes": p["foreign_slope"] * i if p["foreign_slope"] else None})  # fmt: skip
        jobs = pl.DataFrame([{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": start, "n_gpus": 8} for j in {k[0] for k in keys}] if start is not None else [], schema=schemas.JOBS)
        ticks.append((now, pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS), jobs))
    return ticks


def _blocks_held(det) -> bool:
    """Whether the detector holds per-block aggregates (oom's per-block sums, or
    fragmentation_allocator's ring of per-key block arrays)."""
    if isinstance(det, AllocatorFragmentationDetector):
        return det.R > 0 and bool(det.bn.any())
    return det._blocks is not None and bool(det._blocks.blocks)


def _short_window_equals_whole_refit(make_det, make_refit, ticks) -> int:
    """The detector over a window keeping only its declared history; the refit over everything."""
    det, refit = make_det(), make_refit()
    ((stream, seconds),) = det.lookback_seconds().items()
    short, whole = Window({stream: seconds, "default": 600.0}), Window(1e9)
    positives = 0
    for i, (now, rows, jobs) in enumerate(ticks):
        for w in (short, whole):
            if rows.height:
                w.add("allocator_stats", rows)
            w.add("jobs", jobs)
            w.seal(now)
        want = [f.to_json_dict() for f in refit.detect(whole)]
        positives += bool(want)
        assert [f.to_json_dict() for f in det.detect(short)] == want, f"tick {i} at {now}"
    assert _blocks_held(det), "block mode was exercised"
    return positives


OOM_CFG = {"oom": {"fit_window_seconds": 30.0, "warmup_seconds": 4.0, "min_samples": 6, "min_span_seconds": 8.0, "min_r2": 0.3, "min_rise_bytes": 64 * MIB, "predict_horizon_seconds": 1e7, "lookback_blocks": 6, "block_slack_seconds": 3.0}}
FRAG_CFG = {"fragmentation_allocator": {"window_seconds": 30.0, "warmup_seconds": 4.0, "min_samples": 4, "min_gap_bytes": 256 * MIB, "min_gap_share": 0.0, "every_seconds": 0.0, "lookback_blocks": 6, "block_slack_seconds": 3.0}}


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steady_series())
def test_oom_over_its_declared_history_equals_the_refit_over_the_whole_block_aligned_look_back(ticks):
    cfg = config.load(overrides={"detectors": OOM_CFG})
    _short_window_equals_whole_refit(lambda: OomPredictor(cfg), lambda: RefitOom(cfg), ticks)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steady_series())
def test_fragmentation_over_its_declared_history_equals_the_refit_over_the_whole_block_aligned_look_back(ticks):
    cfg = config.load(overrides={"detectors": FRAG_CFG})
    _short_window_equals_whole_refit(lambda: AllocatorFragmentationDetector(cfg), lambda: RefitFragmentationAllocator(cfg), ticks)


def test_default_config_leak_is_found_over_the_declared_history_as_over_the_whole_window():
    """Default thresholds (90 s fit in 18 blocks of 5 s, late half 20 s): a leak on two ranks and a
    flat one, 300 s; the window keeps 30 s of rows and the findings equal the whole refit's."""
    cfg = config.defaults()
    assert OomPredictor(cfg).lookback_seconds() == {"allocator_stats": 30.0}
    assert AllocatorFragmentationDetector(cfg).lookback_seconds() == {"allocator_stats": 10.0}
    ticks = []
    for i in range(1, 300):
        now = 500.0 + i
        rows = []
        for rank, slope in ((0, 64 * MIB), (1, 96 * MIB), (2, 0)):
            alloc = 30 * GIB + slope * (i % 200) + (i % 5) * MIB
            rows.append({"ts": now, "job": "leaky", "rank": rank, "node": "n0", "gpu": rank, "allocated_bytes": alloc, "reserved_bytes": alloc + GIB,
                         "inactive_split_bytes": 0, "largest_free_block_bytes": GIB, "peak_allocated_bytes": alloc + 512 * MIB, "alloc_retries": i // 50,
                         "oom_count": 0, "device_capacity_bytes": 140 * GIB, "foreign_used_bytes": None})  # fmt: skip
        ticks.append((now, pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS), pl.DataFrame([{**dict.fromkeys(schemas.JOBS), "job": "leaky", "state": "running", "start_ts": 480.0, "n_gpus": 8}], schema=schemas.JOBS)))
    assert _short_window_equals_whole_refit(lambda: OomPredictor(cfg), lambda: RefitOom(cfg), ticks) > 100


def test_a_block_leaves_whole_when_the_edge_passes_its_end():
    """Blocks of 5 s, W = 20: at now = 31 the look-back starts at 10 (the block holding 11); at
    now = 34.9 still 10; at 35 it starts at 15 and the rows of [10, 15) leave together."""
    det = AllocatorFragmentationDetector({"detectors": {"fragmentation_allocator": {"window_seconds": 20.0, "warmup_seconds": 0.0, "lookback_blocks": 4, "every_seconds": 0.0}}})
    w = Window({"allocator_stats": 10.0, "default": 600.0})
    counts = {}
    for k in range(1, 37):
        now = float(k) if k <= 34 else {35: 34.9, 36: 35.0}[k]
        row = {**dict.fromkeys(schemas.ALLOCATOR_STATS), "ts": now, "job": "j", "rank": 0, "node": "n", "gpu": 0, "reserved_bytes": 2 * GIB, "peak_allocated_bytes": GIB,
               "allocated_bytes": GIB, "inactive_split_bytes": 0, "alloc_retries": 0, "largest_free_block_bytes": 0, "device_capacity_bytes": 80 * GIB}  # fmt: skip
        w.add("allocator_stats", pl.DataFrame([row], schema=schemas.ALLOCATOR_STATS))
        w.seal(now)
        det.ingest(w)
        counts[now] = (det._state["n"][0], det._state["ts_first"][0])
    assert counts[31.0] == (22, 10.0)  # rows 10 .. 31
    assert counts[34.9] == (26, 10.0)  # rows 10 .. 34, 34.9
    assert counts[35.0] == (22, 15.0)  # rows 15 .. 34, 34.9, 35
