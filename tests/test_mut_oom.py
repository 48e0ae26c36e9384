"""OOM predictor (gpuvigil/detectors/oom.py): behaviour that mutation testing (`make mutate`,
docs/testing.md) showed no other test pinned down. Each test asserts what the finding means (kind,
cause, rank, time to OOM, the figures in its evidence and summary), not how it is computed.

Sources:
- constructed: allocator_stats frames built here, one sample a second, so that each behaviour's
  edge sits exactly where the test needs it (as in tests/test_detectors_guards.py);
- H200: tests/data/h200/s2_memory_stats.json `stats_before`, the real allocator readings of the
  allocation ramp that ended in a real OOM (loaded as in tests/test_detectors_real.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.window import Window

GIB = 1 << 30
MIB = 1 << 20
CAP = 140 * GIB
NOW = 1000.0
SECS = [NOW - 90 + i for i in range(91)]  # one sample a second over the default 90 s fit window
H200 = Path(__file__).parent / "data" / "h200"


def rows(times, reserved, *, peak=None, foreign=lambda t: 0, retries=lambda t: 0, rank=0, job="j", node="n0", cap=CAP) -> pl.DataFrame:
    """allocator_stats rows; `peak` (the step's peak allocated) defaults to `reserved`; a callable
    returning None leaves that column null (the reading is missing)."""
    peak = peak or reserved
    out = []
    for t in times:
        f, r = foreign(t), retries(t)
        out.append({"ts": float(t), "job": job, "rank": rank, "node": node, "gpu": rank, "allocated_bytes": int(peak(t) * 0.6),
                    "reserved_bytes": int(reserved(t)), "inactive_split_bytes": 0, "peak_allocated_bytes": int(peak(t)),
                    "alloc_retries": None if r is None else int(r), "oom_count": 0, "device_capacity_bytes": cap,
                    "foreign_used_bytes": None if f is None else int(f)})
    return schemas.frame(out, schemas.ALLOCATOR_STATS)


def window(df: pl.DataFrame, now: float = NOW, extra: dict | None = None) -> Window:
    w = Window(1e9)
    w.add("allocator_stats", df)
    for s, f in (extra or {}).items():
        w.add(s, f)
    w.seal(now)
    return w


def detect(df: pl.DataFrame, now: float = NOW, **over) -> list:
    cfg = config.load(overrides={"detectors": {"oom": over}}) if over else None
    return OomPredictor(cfg).detect(window(df, now))


def grow(rate_mib: float, start: float = 0.0):
    return lambda t: start + rate_mib * MIB * (t - SECS[0])


def test_leak_finding_states_its_figures_exactly():
    """constructed: 125 GiB growing 20 MiB/s on a 140 GiB device, nothing else moving. The evidence
    and the summary carry the figures an operator acts on, each checked against the input."""
    footprint = grow(20.0, 125 * GIB)
    [f] = detect(rows(SECS, footprint))
    last = footprint(NOW)
    headroom = CAP - GIB - last  # the 1 GiB safety margin
    tto = headroom / (20 * MIB)
    assert (f.kind.value, f.severity.value, f.cause, f.job, f.ranks, f.node, f.gpu, f.ts, f.source) == ("oom_predicted", "page", "leak", "j", [0], "n0", 0, NOW, "oom")
    ev = f.evidence
    assert ev["footprint_bytes"] == int(last)
    assert ev["capacity_bytes"] == CAP
    assert ev["headroom_bytes"] == int(headroom)
    assert ev["time_to_oom_seconds"] == pytest.approx(tto, abs=0.1)
    assert ev["growth_bytes_per_second"] == 20 * MIB
    assert ev["fragmentation_growth_bytes_per_second"] == 0
    assert ev["reserved_unallocated_bytes"] == 0
    assert ev["alloc_retries_delta"] == 0
    assert ev["fit_r2"] == 1.0
    assert (ev["rank"], ev["ranks_at_risk"]) == (0, 1)
    m = re.fullmatch(r"j rank 0 \(n0 GPU 0\) will run out of GPU memory in about ([\d.]+) min: (.*), \+([\d.]+) GiB/min, ([\d.]+) GiB left\.", f.summary)
    assert m, f.summary
    assert float(m[1]) == round(tto / 60, 1)
    assert m[2] == "allocated memory grows every step (a leak or growing activations)"
    assert float(m[3]) == round(20 * MIB * 60 / GIB, 2)
    assert float(m[4]) == round(headroom / GIB, 1)


def test_step_peak_counts_when_reserved_is_sampled_lower():
    """constructed: the hook samples `reserved` after the step's empty_cache() (flat 10 GiB) while
    the step's peak allocation climbs 20 MiB/s from 125 GiB: the peak is what runs out."""
    peak = grow(20.0, 125 * GIB)
    [f] = detect(rows(SECS, lambda t: 10 * GIB, peak=peak))
    assert (f.cause, f.severity.value) == ("leak", "page")
    assert f.evidence["footprint_bytes"] == int(peak(NOW))
    assert f.evidence["growth_bytes_per_second"] == 20 * MIB


def test_missing_foreign_reading_adds_nothing_to_the_footprint():
    """constructed: no NVML reading of other processes (foreign_used_bytes null): the footprint is
    PyTorch's own, to the byte, and the cause is not 'foreign process'."""
    footprint = grow(20.0, 125 * GIB)
    [f] = detect(rows(SECS, footprint, foreign=lambda t: None))
    assert f.cause == "leak"
    assert f.evidence["footprint_bytes"] == int(footprint(NOW))
    assert f.evidence["headroom_bytes"] == int(CAP - GIB - footprint(NOW))


def test_h200_ramp_footprint_and_headroom_are_the_capture_figures():
    """H200: s2_memory_stats.json `stats_before` (the real 4 GiB-step ramp to the real OOM), with
    no foreign-memory reading (null, as from a node without NVML access). Time constants divided
    by 20 as in test_detectors_real (the ramp lasts 5 s). The finding's footprint is the last real
    `reserved` reading and its headroom the real capacity left (minus the 1 GiB margin)."""
    ramp = json.loads((H200 / "s2_memory_stats.json").read_text())["stats_before"]
    total = int(json.loads((H200 / "nvml_inventory.json").read_text())["memory"]["total"])
    df = schemas.frame(
        [{"ts": r["t"], "job": "ramp", "rank": 0, "node": "h200-0", "gpu": 0, "allocated_bytes": r["allocated"], "reserved_bytes": r["reserved"],
          "peak_allocated_bytes": r["allocated"], "alloc_retries": 0, "oom_count": 0, "device_capacity_bytes": total, "foreign_used_bytes": None}
         for r in ramp],
        schemas.ALLOCATOR_STATS,
    )
    now = float(df["ts"].max())
    [f] = detect(df, now, fit_window_seconds=4.5, warmup_seconds=0.0, min_samples=8, min_span_seconds=2.0, predict_horizon_seconds=90.0, page_within_seconds=45.0)
    last = max(ramp[-1]["reserved"], ramp[-1]["allocated"])
    assert (f.cause, f.job, f.node) == ("leak", "ramp", "h200-0")
    assert f.evidence["footprint_bytes"] == last
    assert f.evidence["headroom_bytes"] == total - GIB - last
    assert f.evidence["capacity_bytes"] == total


@pytest.mark.parametrize(
    "peak_mib, gap_mib, foreign_mib, retries, cause",
    [
        # A little foreign growth under a leak is still a leak.
        (20.0, 0.0, 1.0, False, "leak"),
        # Foreign growth is half or more of the total: the other process.
        (10.0, 0.0, 10.0, False, "foreign_process"),
        # The gap grows at 40% of the total (under the 50% share), faster than the peaks, and
        # cudaMalloc was retried: fragmentation. Without the retries, the same growth is a leak.
        (9.0, 12.0, 9.0, True, "fragmentation"),
        (9.0, 12.0, 9.0, False, "leak"),
        # The gap grows at half the total: fragmentation without any retry.
        (10.0, 10.0, 0.0, False, "fragmentation"),
    ],
)
def test_cause_is_the_component_that_grows(peak_mib, gap_mib, foreign_mib, retries, cause):
    """constructed: footprint = peak + reserved-unallocated gap + other processes, each component
    growing at its own rate from 120 GiB of peaks."""
    peak = grow(peak_mib, 120 * GIB)
    gap = grow(gap_mib)
    df = rows(SECS, lambda t: peak(t) + gap(t), peak=peak, foreign=grow(foreign_mib), retries=(lambda t: int(t > NOW - 10) * 3) if retries else (lambda t: 0))
    [f] = detect(df)
    assert f.cause == cause
    what = {"leak": "allocated memory grows every step (a leak or growing activations)",
            "foreign_process": "another process on the GPU is taking memory",
            "fragmentation": "the caching allocator is fragmenting (reserved but unallocated memory keeps growing)"}[cause]
    assert f": {what}, +" in f.summary
    total = (peak_mib + gap_mib + foreign_mib) * MIB
    assert f.evidence["growth_bytes_per_second"] == pytest.approx(total, rel=1e-6)
    assert f.evidence["fragmentation_growth_bytes_per_second"] == pytest.approx(gap_mib * MIB, abs=1)
    assert f.evidence["reserved_unallocated_bytes"] == int(gap(NOW))
    assert f.evidence["alloc_retries_delta"] == (3 if retries else 0)


def test_retries_missing_in_early_samples_count_from_zero():
    """constructed: the hook's early samples carry no retry counter (null), the last 10 carry 2:
    two retries happened in the window (gap growing at 40%, faster than peaks: fragmentation)."""
    peak, gap = grow(9.0, 120 * GIB), grow(12.0)
    df = rows(SECS, lambda t: peak(t) + gap(t), peak=peak, foreign=grow(9.0), retries=lambda t: 2 if t > NOW - 10 else None)
    [f] = detect(df)
    assert (f.cause, f.evidence["alloc_retries_delta"]) == ("fragmentation", 2)


def test_worst_rank_of_each_job_and_jobs_apart():
    """constructed: two jobs; in job a rank 2 runs out first (30 MiB/s) and rank 1 (20 MiB/s) is
    also at risk; job b's one rank grows 25 MiB/s. One finding per job, each naming its worst rank
    with its own node and GPU, in order of time to OOM."""
    df = pl.concat([
        rows(SECS, grow(20.0, 125 * GIB), rank=1, job="a", node="na"),
        rows(SECS, grow(30.0, 125 * GIB), rank=2, job="a", node="na"),
        rows(SECS, lambda t: 50 * GIB, rank=3, job="a", node="na"),
        rows(SECS, grow(25.0, 125 * GIB), rank=0, job="b", node="nb"),
    ])
    found = detect(df)
    assert [(f.job, f.ranks, f.evidence["rank"], f.node, f.gpu, f.evidence["ranks_at_risk"]) for f in found] == [("a", [1, 2], 2, "na", 2, 2), ("b", [0], 0, "nb", 0, 1)]
    assert found[0].evidence["growth_bytes_per_second"] == 30 * MIB


def test_ticked_state_gives_the_refit_findings_on_every_tick():
    """constructed: 200 s of a leak on two ranks sampled each second, fed tick by tick (rows
    leaving the 90 s look-back and crossing from the late half of the fit into the early one). On
    every tick the detector that kept state since the start reports what a fresh detector fitting
    the same window from scratch reports: same finding, same figures."""
    # Not straight lines (a perfect line fits the same whatever rows are counted twice or missed):
    # each step's peak varies by up to 256 MiB in a fixed pattern.
    leak0 = lambda t: 105 * GIB + 20 * MIB * t + (t * 7 % 5) * 64 * MIB  # noqa: E731
    leak1 = lambda t: 110 * GIB + 12 * MIB * t + (t * 3 % 4) * 48 * MIB  # noqa: E731
    df = pl.concat([rows(range(0, 201), leak0, rank=0, retries=lambda t: int(t // 40)), rows(range(0, 201), leak1, rank=1, foreign=lambda t: 2 * MIB * t, retries=lambda t: int(t // 40))])
    kept = OomPredictor()
    w = Window(1e9)
    seen = 0
    for t in range(0, 201, 2):
        w.add("allocator_stats", df.filter((pl.col("ts") > t - 2) & (pl.col("ts") <= t)))
        w.seal(float(t))
        mine = kept.detect(w)
        fresh = OomPredictor().detect(w)
        assert [(f.cause, f.ranks, f.severity, f.evidence) for f in mine] == [(f.cause, f.ranks, f.severity, f.evidence) for f in fresh], t
        seen += bool(mine)
    assert seen >= 50  # the comparison covered findings, not only silence


def test_requeued_job_restarts_the_fit():
    """constructed: a job requeued at t=100 restarts from a checkpoint with fresh memory (its
    footprint falls from about 128 to 20 GiB, then leaks again): the old run's samples are not fitted,
    so no warning until the new run has its own 20 s past the 30 s warm-up, and then the finding's
    footprint is the new run's."""
    before = rows(range(0, 100), lambda t: 126 * GIB + 20 * MIB * t)
    after = rows(range(100, 201), lambda t: 20 * GIB + 20 * MIB * (t - 100))
    df = pl.concat([before, after])
    det = OomPredictor(config.load(overrides={"detectors": {"oom": {"predict_horizon_seconds": 1e5, "page_within_seconds": 1e5}}}))
    w = Window(1e9)
    out = {}
    for t in range(0, 201):
        w.add("allocator_stats", df.filter(pl.col("ts") == t))
        start = 0.0 if t < 100 else 100.0
        w.add("jobs", schemas.frame([{"job": "j", "state": "running", "n_gpus": 1, "submit_ts": 0.0, "start_ts": start}], schemas.JOBS))
        w.seal(float(t))
        out[t] = det.detect(w)
    assert out[99] and out[99][0].evidence["footprint_bytes"] > 120 * GIB
    assert all(out[t] == [] for t in range(100, 149))  # warm-up 30 s + 20 s span
    [f] = out[200]
    assert f.evidence["footprint_bytes"] == 20 * GIB + 100 * 20 * MIB
    assert f.evidence["growth_bytes_per_second"] == 20 * MIB
    assert math.isclose(f.evidence["time_to_oom_seconds"], (CAP - GIB - f.evidence["footprint_bytes"]) / (20 * MIB), abs_tol=0.1)


def test_ingest_then_detect_on_one_tick_counts_each_row_once():
    """constructed: the pipeline folds rows in with ingest() on ticks the fit is not due, and may
    call detect() on the same tick after it: every row still counts once (same finding, same
    figures as a fresh fit of the window)."""
    df = rows(range(0, 121), lambda t: 110 * GIB + 20 * MIB * t + (t * 7 % 5) * 64 * MIB)  # not a straight line (see above)
    det = OomPredictor()
    w = Window(1e9)
    for t in range(0, 121, 3):
        w.add("allocator_stats", df.filter((pl.col("ts") > t - 3) & (pl.col("ts") <= t)))
        w.seal(float(t))
        det.ingest(w)
        if t % 15 == 0:
            mine, fresh = det.detect(w), OomPredictor().detect(w)
            assert [f.evidence for f in mine] == [f.evidence for f in fresh], t
    [f] = det.detect(w)
    assert f.evidence["growth_bytes_per_second"] == pytest.approx(20 * MIB, rel=0.05) and f.evidence["footprint_bytes"] == 110 * GIB + 120 * 20 * MIB


def test_started_before_any_job_reports():
    """constructed: gpuvigil starts (and ticks) before the job's first allocator sample, as on a
    node that boots before its job; the leak that follows is found with the figures of a fresh fit."""
    df = rows(range(10, 131), lambda t: 110 * GIB + 20 * MIB * t)
    det = OomPredictor()
    w = Window(1e9)
    for t in range(0, 131, 2):
        part = df.filter((pl.col("ts") > t - 2) & (pl.col("ts") <= t))
        if part.height:
            w.add("allocator_stats", part)
        w.seal(float(t))
        mine = det.detect(w)
        if t < 10:
            assert mine == []
    fresh = OomPredictor().detect(w)
    assert [f.evidence for f in mine] == [f.evidence for f in fresh] and len(mine) == 1
    assert mine[0].evidence["footprint_bytes"] == 110 * GIB + 130 * 20 * MIB


def test_retries_are_counted_from_the_oldest_sample_of_the_window():
    """constructed: PyTorch's num_alloc_retries is cumulative since the process started; it reads
    5 at the start of the window and 6 at its end: one retry happened in the window, and one is
    enough (with the gap outgrowing the peaks: fragmentation)."""
    peak, gap = grow(9.0, 120 * GIB), grow(12.0)
    df = rows(SECS, lambda t: peak(t) + gap(t), peak=peak, foreign=grow(9.0), retries=lambda t: 6 if t > NOW - 10 else 5)
    [f] = detect(df)
    assert (f.cause, f.evidence["alloc_retries_delta"]) == ("fragmentation", 1)


@pytest.mark.parametrize("late_times, pages", [
    ([NOW - 10, NOW], False),  # two samples in the late half: no line through it
    ([NOW, NOW, NOW], False),  # three samples at one instant: no line either
    ([NOW - 10, NOW - 5, NOW], True),  # three at distinct times: a fit, and it grows
])
def test_each_half_needs_three_samples_at_distinct_times(late_times, pages):
    """constructed: a 20 MiB/s leak sampled each second over the early part of the window, then only
    `late_times` in the last min_span/2 (20 s by default): growth must be seen in both halves, and
    a half without three samples at distinct times shows none."""
    half = config.defaults()["detectors"]["oom"]["min_span_seconds"] / 2
    footprint = grow(20.0, 125 * GIB)
    times = [t for t in SECS if t < NOW - half] + late_times
    found = detect(rows(times, footprint))
    assert bool(found) == pages
    if pages:
        assert found[0].cause == "leak"


@pytest.mark.parametrize("half_name", ["early", "late"])
@pytest.mark.parametrize("rate_mib, pages", [(0.4, False), (0.6, True)])
def test_each_half_must_grow_at_half_the_floor(half_name, rate_mib, pages):
    """constructed: one half of the fit grows at `rate_mib` MiB/s, the other at 20 MiB/s. Each half
    must grow at least half the 1 MiB/s growth floor: 0.4 MiB/s is not growth, 0.6 is. (r², the
    rise floor and the horizon are relaxed: a line with a bend is a poor line, and at these rates
    the rise is small and the OOM hours away; none of them is what this test is about.)"""
    half = config.defaults()["detectors"]["oom"]["min_span_seconds"] / 2
    split = NOW - half
    early, late = (rate_mib, 20.0) if half_name == "early" else (20.0, rate_mib)
    base = 130 * GIB

    def footprint(t):
        if t < split:
            return base + early * MIB * (t - split)
        return base + late * MIB * (t - split)

    found = detect(rows(SECS, footprint), min_r2=0.0, min_rise_bytes=0, predict_horizon_seconds=1e6)
    assert bool(found) == pages


def test_span_of_exactly_the_minimum_is_enough():
    """constructed: a 20 MiB/s leak sampled each second from exactly min_span_seconds (40 s by
    default) before now: the span is enough (>=), and one second less is not."""
    span = config.defaults()["detectors"]["oom"]["min_span_seconds"]
    footprint = grow(20.0, 125 * GIB)
    assert len(detect(rows([NOW - span + i for i in range(int(span) + 1)], footprint))) == 1
    assert detect(rows([NOW - span + 1 + i for i in range(int(span))], footprint)) == []


def test_time_to_oom_is_given_to_a_tenth_of_a_second():
    """constructed: 19 MiB/s from 125 GiB: 12,626 MiB of headroom at now, 664.53 s: reported as 664.5."""
    [f] = detect(rows(SECS, grow(19.0, 125 * GIB)))
    assert f.evidence["time_to_oom_seconds"] == 664.5


def test_fit_r2_is_the_squared_correlation_to_three_decimals():
    """constructed: a 20 MiB/s leak with a fixed +-192 MiB step-to-step pattern: r² is below 1 and
    is reported as the squared correlation of time and footprint, to 3 decimals."""
    import numpy as np

    footprint = lambda t: 125 * GIB + 20 * MIB * (t - SECS[0]) + ((int(t) * 7) % 5 - 2) * 96 * MIB  # noqa: E731
    [f] = detect(rows(SECS, footprint))
    y = np.array([float(int(footprint(t))) for t in SECS])
    r2 = float(np.corrcoef(np.array(SECS), y)[0, 1] ** 2)
    assert 0.6 < r2 < 0.999 and round(r2, 3) != round(r2, 4)
    assert f.evidence["fit_r2"] == round(r2, 3)


def test_a_rank_whose_rows_carry_no_gpu_is_predicted_without_one():
    """constructed: the leak above, from a hook record without `gpu` (collectors/hook.py leaves it
    null and jobjoin cannot fill it): the finding names the rank and node with `gpu` None instead of
    the detector raising on `int(None)` (mutation testing found this in straggler.py)."""
    [f] = detect(rows(SECS, grow(20.0, 125 * GIB)).with_columns(pl.lit(None, pl.Int32).alias("gpu")))
    assert (f.cause, f.ranks, f.node, f.gpu) == ("leak", [0], "n0", None)
    assert f.summary.startswith("j rank 0 (n0) will run out of GPU memory")


# Mutation testing (docs/testing.md): every threshold exactly on its edge, the rebuild of a job
# whose start moved or appeared while rows kept arriving, and state kept over ticks where another
# process holds memory or rows arrive late. The straight lines below are binary-exact (rates of
# 2^k bytes a second, whole seconds, footprints in whole MiB), so that the least-squares figures
# land exactly on the thresholds rather than a rounding error away.


def line(rate_bytes: int, last_bytes: int):
    """A footprint growing `rate_bytes` a second that reads `last_bytes` at NOW."""
    return lambda t: last_bytes - rate_bytes * (NOW - t)


def test_growth_of_exactly_the_floor_is_growth():
    """constructed: a perfect line at exactly min_growth_bytes_per_second (1 MiB/s): it is growth
    (>=), and a floor one byte a second higher is not. (The rise and horizon floors are relaxed:
    at 1 MiB/s the 90 s fit rises 90 MiB and the OOM is hours away.)"""
    floor = config.defaults()["detectors"]["oom"]["min_growth_bytes_per_second"]
    assert floor == MIB
    df = rows(SECS, line(MIB, 125 * GIB))
    relaxed = {"min_rise_bytes": 0, "predict_horizon_seconds": 1e6}
    [f] = detect(df, **relaxed)
    assert f.evidence["growth_bytes_per_second"] == MIB
    assert detect(df, min_growth_bytes_per_second=MIB + 1, **relaxed) == []


def test_rise_of_exactly_the_floor_is_enough():
    """constructed: 8 MiB/s sampled each second over 64 s: the fitted rise (slope x span) is
    exactly min_rise_bytes (512 MiB) and pages (>=); over 63 s it is 504 MiB and does not."""
    assert config.defaults()["detectors"]["oom"]["min_rise_bytes"] == 512 * MIB
    footprint = line(8 * MIB, 125 * GIB)
    [f] = detect(rows([NOW - 64 + i for i in range(65)], footprint))
    assert (f.cause, f.evidence["growth_bytes_per_second"]) == ("leak", 8 * MIB)
    assert detect(rows([NOW - 63 + i for i in range(64)], footprint)) == []


@pytest.mark.parametrize("seconds_left, severity", [
    (900, "page"),  # exactly page_within_seconds: a page (<=)
    (900 + 1 / 16, "ticket"),  # 1 MiB more headroom: a ticket
    (1800, "ticket"),  # exactly predict_horizon_seconds: still predicted (<=)
    (1800 + 1 / 16, None),  # 1 MiB more: beyond the horizon, no finding
])
def test_time_to_oom_exactly_on_the_page_and_horizon_limits(seconds_left, severity):
    """constructed: a 16 MiB/s leak whose headroom at NOW (capacity - 1 GiB margin - footprint) is
    exactly `seconds_left` x 16 MiB: OOM exactly 900 s away pages, exactly 1800 s away is a
    ticket, and a MiB more headroom moves each across its limit."""
    d = config.defaults()["detectors"]["oom"]
    assert (d["page_within_seconds"], d["predict_horizon_seconds"], d["safety_margin_bytes"]) == (900, 1800, GIB)
    headroom = int(seconds_left * 16 * MIB)
    found = detect(rows(SECS, line(16 * MIB, CAP - GIB - headroom)))
    if severity is None:
        assert found == []
        return
    [f] = found
    assert (f.severity.value, f.evidence["headroom_bytes"], f.evidence["time_to_oom_seconds"]) == (severity, headroom, round(seconds_left, 1))


def test_r2_of_exactly_the_floor_is_a_fit():
    """constructed: a perfect line has r² exactly 1: with min_r2 raised to 1.0 it is still a fit
    (>=); the same line with one sample 1 MiB off is not."""
    footprint = line(20 * MIB, 125 * GIB)
    [f] = detect(rows(SECS, footprint), min_r2=1.0)
    assert f.evidence["fit_r2"] == 1.0
    bent = lambda t: footprint(t) + (MIB if t == NOW - 45 else 0)  # noqa: E731
    assert detect(rows(SECS, bent), min_r2=1.0) == []


@pytest.mark.parametrize("half_name", ["early", "late"])
def test_each_half_growing_at_exactly_half_the_floor_is_growth(half_name):
    """constructed: as test_each_half_must_grow_at_half_the_floor, with one half at exactly half
    the 1 MiB/s floor (512 KiB/s, a binary-exact line): that is growth (>=)."""
    half = config.defaults()["detectors"]["oom"]["min_span_seconds"] / 2
    split = NOW - half
    early, late = (MIB // 2, 20 * MIB) if half_name == "early" else (20 * MIB, MIB // 2)
    footprint = lambda t: 130 * GIB + (early if t < split else late) * (t - split)  # noqa: E731
    relaxed = {"min_r2": 0.0, "min_rise_bytes": 0, "predict_horizon_seconds": 1e6}
    assert len(detect(rows(SECS, footprint), **relaxed)) == 1
    slower = lambda t: 130 * GIB + (early - (half_name == "early")) * (t - split) if t < split else 130 * GIB + (late - (half_name == "late")) * (t - split)  # noqa: E731
    assert detect(rows(SECS, slower), **relaxed) == []


@pytest.mark.parametrize("gap_mib, cause", [(8, "leak"), (9, "fragmentation")])
def test_retries_make_fragmentation_only_when_the_gap_outgrows_the_peaks(gap_mib, cause):
    """constructed: peaks grow 8 MiB/s, the reserved-unallocated gap `gap_mib` MiB/s, cudaMalloc
    was retried, and the share is raised to 0.6 so that the gap's share of the growth (50% or
    53%) does not decide: the retries clause does. A gap growing exactly as fast as the peaks is a
    leak (strictly faster is needed); 1 MiB/s faster is fragmentation."""
    peak = line(8 * MIB, 120 * GIB)
    gap = line(gap_mib * MIB, 4 * GIB)
    df = rows(SECS, lambda t: peak(t) + gap(t), peak=peak, retries=lambda t: int(t > NOW - 10) * 3)
    [f] = detect(df, fragmentation_share=0.6)
    assert (f.cause, f.evidence["fragmentation_growth_bytes_per_second"], f.evidence["alloc_retries_delta"]) == (cause, gap_mib * MIB, 3)


def tick_and_compare(df: pl.DataFrame, ticks, jobs=lambda t: None, arrived=None) -> int:
    """Feed `df` tick by tick to one detector and, on every tick, compare its findings with a fresh
    detector fitting the same window from scratch. `jobs(t)` is the scheduler's snapshot at t (None:
    none); `arrived(t)` selects the rows delivered at tick t (default: stamped since the last tick).
    Returns how many ticks had a finding (a comparison of silences alone proves little)."""
    kept, w, prev, seen = OomPredictor(), Window(1e9), None, 0
    for t in ticks:
        part = df.filter(arrived(t) if arrived else ((pl.col("ts") > (prev if prev is not None else -1e9)) & (pl.col("ts") <= t)))
        if part.height:
            w.add("allocator_stats", part)
        snap = jobs(t)
        if snap is not None:
            w.add("jobs", schemas.frame(snap, schemas.JOBS))
        w.seal(float(t))
        mine, fresh = kept.detect(w), OomPredictor().detect(w)
        assert [(f.job, f.cause, f.ranks, f.severity, f.evidence) for f in mine] == [(f.job, f.cause, f.ranks, f.severity, f.evidence) for f in fresh], t
        seen += bool(mine)
        prev = t
    return seen


def uneven(base: float, rate_mib: float):
    """A leak whose step peaks vary by up to 256 MiB in a fixed pattern (a perfect line fits the
    same whatever rows are counted twice or missed)."""
    return lambda t: base + rate_mib * MIB * t + (t * 7 % 5) * 64 * MIB


def running(job: str, start: float) -> dict:
    return {"job": job, "state": "running", "n_gpus": 1, "submit_ts": 0.0, "start_ts": start}


def test_a_job_the_scheduler_lists_late_is_rebuilt_without_its_warmup_and_the_other_kept():
    """constructed: jobs a and b leak from t=0 and report each second; the scheduler's snapshot
    first lists a at t=60, running since t=0 (b is never listed). From then on a's first 30 s
    (the warm-up) are not fitted: a is rebuilt from the window, b's state is kept as it was. On
    every tick the kept state gives what a fresh fit of the window gives."""
    df = pl.concat([rows(range(0, 151), uneven(110 * GIB, 20.0), job="a"), rows(range(0, 151), uneven(112 * GIB, 25.0), job="b", node="n1")])
    seen = tick_and_compare(df, range(0, 151, 2), jobs=lambda t: [running("a", 0.0)] if t >= 60 else None)
    assert seen >= 50
    # Both jobs are at risk on the last tick: the comparison covered the kept job's findings too.
    assert sorted(f.job for f in OomPredictor().detect(window(df, 150.0, {"jobs": schemas.frame([running("a", 0.0)], schemas.JOBS)}))) == ["a", "b"]


def test_a_start_the_scheduler_moves_later_rebuilds_the_job_from_its_new_start():
    """constructed: the scheduler's snapshot says job a runs since t=0 until t=100, then (a requeue
    it saw late) since t=40: a's rows from t=70 (its new start plus the 30 s warm-up) are fitted
    again from the window on that tick; job b, listed throughout, is kept."""
    df = pl.concat([rows(range(0, 181), uneven(110 * GIB, 20.0), job="a"), rows(range(0, 181), uneven(112 * GIB, 25.0), job="b", node="n1")])
    seen = tick_and_compare(df, range(0, 181, 2), jobs=lambda t: [running("a", 0.0 if t < 100 else 40.0), running("b", 0.0)])
    assert seen >= 50
    assert sorted(f.job for f in OomPredictor().detect(window(df, 180.0, {"jobs": schemas.frame([running("a", 40.0), running("b", 0.0)], schemas.JOBS)}))) == ["a", "b"]


def test_another_process_holding_steady_memory_over_many_ticks_is_not_its_growth():
    """constructed: another process holds a steady 20 GiB on the GPU while the job leaks 20 MiB/s,
    fed tick by tick for 200 s: the kept state's foreign growth stays 0 (the cause is the leak),
    as a fresh fit of the window says on every tick."""
    df = rows(range(0, 201), uneven(100 * GIB, 20.0), foreign=lambda t: 20 * GIB)
    seen = tick_and_compare(df, range(0, 201, 2))
    assert seen >= 50
    [f] = OomPredictor().detect(window(df, 200.0))
    assert f.cause == "leak"


def test_rows_delivered_late_in_batches_count_in_the_half_they_belong_to():
    """constructed: the hook's rows reach gpuvigil in batches every 30 s (a hook that flushes every
    30 s, or a receiver that fell behind), so a third of each batch arrives already in the early
    half of the fit (more than min_span/2 = 20 s old). Tick each 30 s: the kept state gives a fresh
    fit's findings."""
    assert config.defaults()["detectors"]["oom"]["min_span_seconds"] / 2 < 30
    df = rows(range(0, 301), uneven(110 * GIB, 20.0))
    seen = tick_and_compare(df, range(30, 301, 30), arrived=lambda t: (pl.col("ts") > t - 30) & (pl.col("ts") <= t))
    assert seen >= 6


def test_a_newest_sample_without_reserved_still_pages_the_leak():
    """constructed: the leak above, its newest sample missing `reserved_bytes` (the hook could not
    read it): the footprint is the step's peak, and the held-but-unused figure is null instead of
    the detector raising on int(None) and losing the page."""
    df = rows(SECS, grow(20.0, 125 * GIB)).with_columns(pl.when(pl.col("ts") == NOW).then(None).otherwise(pl.col("reserved_bytes")).alias("reserved_bytes"))
    [f] = detect(df)
    assert (f.severity.value, f.cause, f.evidence["reserved_unallocated_bytes"]) == ("page", "leak", None)
    assert f.evidence["footprint_bytes"] == int(grow(20.0, 125 * GIB)(NOW))
