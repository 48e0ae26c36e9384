"""The straggler detector keeps per-(job, rank) rings and per-job counts (O(new rows) per tick);
it must report exactly the findings of the refit over the window it replaced
(tests/incremental_oracles.py: RefitStraggler, the code as it was) on the same rows.

Fed three ways, as the other incremental detectors are (tests/test_detectors_incremental.py):
detect() every tick; ingest() every tick and detect() now and then (the pipeline's way); detect()
now and then with nothing between (rebuilt from the window). Generated series mix short steps
(judged from the rings) with long ones (the job's window grows: judged from the window), null
step times and waits, late rows, ranks that move node, requeues and jobs leaving the scheduler's
snapshot, and horizons shorter than the look-back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples

from gpuvigil import config, schemas
from gpuvigil.detectors.incremental import KeyRing, masked_median
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.window import Window

sys.path.insert(0, str(Path(__file__).parent))
from incremental_oracles import RefitStraggler, check_against_refit  # noqa: E402

SMALL = {"straggler": {"window_seconds": 10.0, "min_samples": 3, "min_ranks": 3, "min_steps": 2.0, "max_window_seconds": 40.0}}


def _jobs_frame(starts: dict[str, float | None]) -> pl.DataFrame:
    rows = [{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": s, "n_gpus": 8} for j, s in starts.items() if s is not None]
    return pl.DataFrame(rows, schema=schemas.JOBS)


def _row(ts, job, rank, node, gpu, step, wait):
    return {"ts": ts, "job": job, "rank": rank, "node": node, "gpu": gpu, "pg": "0", "last_enqueued_seq": 1, "last_completed_seq": 1,
            "current_op": None, "step": 1, "step_time_seconds": step, "collective_wait_seconds": wait}  # fmt: skip


@st.composite
def progress_series(draw):
    t0 = draw(st.sampled_from([0.0, 1000.0, 1_700_000_000.0]))
    n_ticks = draw(st.integers(15, 60))
    steps = draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.0, 1.0, 2.0, 4.0]), min_size=n_ticks, max_size=n_ticks))
    jobs = ["job-a", "job-b", "job-c"][: draw(st.integers(1, 3))]
    ranks = {j: draw(st.integers(2, 5)) for j in jobs}
    # Step times around the bound (min_steps x step <= window_seconds: 5 s) and far above it.
    step_time = {j: draw(st.sampled_from([0.5, 1.0, 4.75, 5.0, 5.25, 9.0])) for j in jobs}
    spread = {j: draw(st.sampled_from([0.0, 0.5, 3.0])) for j in jobs}
    slow = {j: draw(st.one_of(st.none(), st.integers(0, ranks[j] - 1))) for j in jobs}
    start = {j: draw(st.sampled_from([None, t0 - 100.0, t0 + 3.0])) for j in jobs}
    requeue_at = draw(st.one_of(st.none(), st.integers(3, n_ticks - 1)))
    requeue_job = draw(st.sampled_from(jobs))
    drop_at = draw(st.one_of(st.none(), st.integers(3, n_ticks - 1)))
    p_missing = draw(st.sampled_from([0.0, 0.0, 0.2]))
    p_null = draw(st.sampled_from([0.0, 0.0, 0.1]))
    ticks = []
    now = t0
    for i in range(n_ticks):
        now += steps[i]
        if requeue_at == i:
            start[requeue_job] = now - 0.5
        if drop_at == i:
            start[jobs[0]] = None
        rows = []
        for j in jobs:
            for r in range(ranks[j]):
                for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
                    if p_missing and draw(st.floats(0, 1)) < p_missing:
                        continue
                    st_s = step_time[j] + draw(st.integers(-4, 4)) * spread[j] / 4
                    wait = (0.05 if slow[j] == r else 0.4) * st_s + draw(st.integers(0, 8)) * 0.01
                    if p_null and draw(st.floats(0, 1)) < p_null:
                        wait = None
                    step = None if p_null and draw(st.floats(0, 1)) < p_null else st_s
                    node = f"n{r}" if draw(st.integers(0, 9)) else f"m{r}"  # a rank seen on another node now and then
                    ts = now - draw(st.sampled_from([0.0, 0.0, 0.0, 0.25, 3.0]))  # some late rows
                    rows.append(_row(ts, j, r, node, r, step, wait))
        ticks.append((now, pl.DataFrame(rows, schema=schemas.RANK_PROGRESS), _jobs_frame(start)))
    horizon = draw(st.sampled_from([1e9, 25.0, 8.0]))
    return ticks, horizon


def _check_same(cfg, ticks, horizon):
    return check_against_refit(lambda: StragglerDetector(cfg), lambda: RefitStraggler(cfg), "rank_progress", ticks, horizon)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(progress_series())
def test_straggler_incremental_matches_refit(series):
    ticks, horizon = series
    _check_same(config.load(overrides={"detectors": SMALL}), ticks, horizon)


def test_straggler_incremental_matches_refit_on_default_config_with_findings():
    """Default thresholds: three 8-rank jobs (steps 0.5 s, 1.3 s and 9 s, the last judged over
    72 s of its steps, from the window), one slow rank in each; findings raised, and identical."""
    cfg = config.defaults()
    ticks = []
    for i in range(1, 200):
        now = 2000.0 + i
        rows = []
        for job, step, slow_rank in (("short", 0.5, 3), ("mid", 1.3, 5), ("long", 9.0, 1)):
            for r in range(8):
                jitter = ((i * 31 + r * 7) % 11) * 0.003
                wait = (0.04 if r == slow_rank and i > 40 else 0.3) * step + jitter
                rows.append(_row(now - (r % 3) * 0.1, job, r, f"node-{job}-{r // 4}", r % 4, step + jitter, wait))
        ticks.append((now, pl.DataFrame(rows, schema=schemas.RANK_PROGRESS), _jobs_frame({"short": 1900.0, "mid": 1990.0, "long": None})))
    positives = _check_same(cfg, ticks, 180.0)
    assert positives > 100
    det, w = StragglerDetector(cfg), Window(180.0)
    for now, rows, jobs in ticks:
        w.add("rank_progress", rows)
        w.add("jobs", jobs)
        w.seal(now)
        found = det.detect(w)
    assert sorted((f.job, f.culprit_ranks) for f in found) == [("long", [1]), ("mid", [5]), ("short", [3])]


def test_masked_median_is_polars_median():
    rng = np.random.default_rng(7)
    values = rng.normal(size=(400, 9)) * rng.choice([1e-3, 1.0, 1e6], size=(400, 1)) + rng.choice([0.0, 1.7e9], size=(400, 1))
    valid = rng.random((400, 9)) < rng.random((400, 1))
    values[rng.random((400, 9)) < 0.1] = np.nan  # null step times
    med, n = masked_median(values, valid)
    for row in range(400):
        keep = values[row][valid[row] & ~np.isnan(values[row])]
        assert n[row] == keep.size
        want = pl.Series(keep, dtype=pl.Float64).median()
        assert (np.isnan(med[row]) and want is None) or med[row] == want


def test_key_ring_grows_and_keeps_arrival_order():
    ring = KeyRing(["v"], [], capacity=2)
    keys = pl.DataFrame({"job": ["a", "b", "a", "a", None], "rank": [0, 0, 0, 0, 1]}, schema={"job": pl.Utf8, "rank": pl.Int32})
    k = ring.key_index(keys)
    assert k.tolist() == [0, 1, 0, 0, 2]
    ring.insert(k, np.array([1.0, 1.0, 2.0, 3.0, 3.0]), {"v": np.array([10.0, 20.0, 11.0, 12.0, 30.0])}, {}, keep_from=0.0)
    assert ring.cap >= 3  # key a holds three live rows
    rows = np.array([0])
    valid = ring.valid(rows, np.array([0.0]))
    assert sorted(ring.f["v"][0][valid[0]].tolist()) == [10.0, 11.0, 12.0]
    assert ring.f["v"][0, ring.newest(rows, valid)[0]] == 12.0
    # Old rows are overwritten once below keep_from; the newest stays the latest arrival.
    ring.insert(ring.key_index(keys.head(1)), np.array([9.0]), {"v": np.array([13.0])}, {}, keep_from=2.5)
    valid = ring.valid(rows, np.array([2.5]))
    assert sorted(ring.f["v"][0][valid[0]].tolist()) == [12.0, 13.0]
    assert ring.f["v"][0, ring.newest(rows, valid)[0]] == 13.0


def test_declared_horizons_take_the_longest_lookback_capped_by_config():
    from gpuvigil.pipeline.core import declared_horizons

    class Reads:
        def __init__(self, name, streams, lookback=None):
            self.name, self.streams = name, streams
            if lookback is not None:
                self.lookback_seconds = lambda: lookback

    configured = {"default": 600.0, "rank_progress": 180.0, "allocator_stats": 180.0, "gpu_samples": 120.0}
    dets = [
        Reads("a", ("allocator_stats",), {"allocator_stats": 90.0}),
        Reads("b", ("allocator_stats", "gpu_samples"), {"allocator_stats": 120.0, "gpu_samples": 0.0}),
        Reads("c", ("gpu_samples",), {"gpu_samples": 3.0}),
        Reads("d", ("rank_progress",)),  # does not declare: the configured horizon stays
        Reads("e", ("rank_progress",), {"rank_progress": 30.0}),
        StragglerDetector(config.defaults()),
    ]
    dets[-1].streams = ("rank_progress",)
    h = declared_horizons(configured, dets, tick_seconds=1.0)
    assert h["allocator_stats"] == 120.0  # the longest reader's look-back
    assert h["gpu_samples"] == 10.0  # fresh-only readers: ten ticks for the latest rows
    assert h["rank_progress"] == 180.0
    assert h["default"] == 600.0
    assert declared_horizons(configured, dets[-1:], 1.0)["rank_progress"] == 180.0  # 900 s look-back, capped


def test_job_window_bound_is_exact_when_half_the_steps_are_short():
    """Step times alternate 7.0 s and 8.5 s (min_steps x 7.0 <= 60 s < min_steps x 8.5): on
    some ticks exactly half the job's steps are short, the median is 7.75 s and the job's window
    is 62 s, not 60 s; with min_samples 62 that decides whether the slow rank is reported. The
    counts must not take "half short" for "median short"."""
    cfg = config.load(overrides={"detectors": {"straggler": {"min_samples": 62}}})
    ticks = []
    for i in range(1, 200):
        now = 3000.0 + i
        step = 7.0 if i % 2 == 0 else 8.5
        rows = [_row(now, "alt", r, f"node-{r // 4}", r % 4, step, (0.04 if r == 3 else 0.3) * step + ((i * 13 + r * 5) % 7) * 0.002) for r in range(8)]
        ticks.append((now, pl.DataFrame(rows, schema=schemas.RANK_PROGRESS), _jobs_frame({})))
    positives = _check_same(cfg, ticks, 180.0)
    assert 0 < positives < len(ticks)
