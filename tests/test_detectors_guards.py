"""Every guard of a detector (a condition that stops a finding) has a hard negative here: an input
that the guard alone keeps quiet, and the proof that it is the guard: the same input with that
guard relaxed in the configuration (thresholds are data) does raise the finding. A mutant that
deletes or inverts a guard fails one side of its pair.

Inputs are constructed frames (the guard's edge has to be placed exactly); the detectors' real-data
tests are in tests/test_detectors_real.py.
"""

from __future__ import annotations

import math

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.ecc import EccDetector
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.detectors.fragmentation_cluster import ClusterFragmentationDetector
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.detectors.pcie import PcieReplayDetector
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.detectors.thermal import ThermalDetector
from gpuvigil.detectors.xid import XidDetector
from gpuvigil.window import Window

GIB = 1 << 30
MIB = 1 << 20
CAP = 140 * GIB


def cfg(**blocks) -> dict:
    return config.load(overrides={"detectors": blocks}) if blocks else config.defaults()


def window(frames: dict[str, pl.DataFrame], now: float) -> Window:
    w = Window(1e9)
    for s, df in frames.items():
        w.add(s, df)
    w.seal(now)
    return w


def ticks(det, stream: str, df: pl.DataFrame, times: list[float], extra: dict | None = None) -> list[list]:
    """Feed rows tick by tick (each tick gets the rows since the previous one)."""
    w = Window(1e9)
    prev = -math.inf
    out = []
    for t in times:
        part = df.filter((pl.col("ts") > prev) & (pl.col("ts") <= t))
        if part.height:
            w.add(stream, part)
        for s, f in (extra or {}).items():
            w.add(s, f)
        w.seal(t)
        out.append(det.detect(w))
        prev = t
    return out


# -- OOM predictor ------------------------------------------------------------------------------------


def alloc_rows(times, footprint, *, gap=lambda t: 0.0, foreign=lambda t: 0.0, retries=lambda t: 0, job="j", rank=0, cap=CAP) -> pl.DataFrame:
    rows = []
    for t in times:
        peak = footprint(t) - gap(t)
        rows.append({"ts": float(t), "job": job, "rank": rank, "node": "n0", "gpu": rank, "allocated_bytes": int(peak * 0.6), "reserved_bytes": int(footprint(t)),
                     "inactive_split_bytes": int(gap(t)), "peak_allocated_bytes": int(peak), "alloc_retries": int(retries(t)), "oom_count": 0,
                     "device_capacity_bytes": cap, "foreign_used_bytes": int(foreign(t))})
    return schemas.frame(rows, schemas.ALLOCATOR_STATS)


NOW = 1000.0
SECS = [NOW - 90 + i for i in range(91)]  # one sample a second over the fit window


def leak(rate_mib=20.0, start_gib=125.0):
    return lambda t: start_gib * GIB + rate_mib * MIB * (t - (NOW - 90))


def oom(df: pl.DataFrame, extra: dict | None = None, **over) -> list:
    return OomPredictor(cfg(oom=over) if over else None).detect(window({"allocator_stats": df, **(extra or {})}, NOW))


def test_oom_positive_base_case_pages_with_the_leak_cause():
    [f] = oom(alloc_rows(SECS, leak()))
    assert (f.kind.value, f.cause, f.severity.value, f.ranks) == ("oom_predicted", "leak", "page", [0])
    # Headroom 140 - 1 (margin) - 126.76 GiB at 20 MiB/s: about 627 s.
    assert f.evidence["time_to_oom_seconds"] == pytest.approx((CAP - GIB - leak()(NOW)) / (20 * MIB), rel=0.02)
    assert f.evidence["growth_bytes_per_second"] == pytest.approx(20 * MIB, rel=0.01)


def _step(t):  # flat, then one step of 3 GiB in the middle of the window (a new training phase)
    return 125 * GIB + (3 * GIB if t >= NOW - 45 else 0)


def _late_only(t):  # nearly flat for most of the window, growing fast only in its last 20 s
    return 125 * GIB + (t - (NOW - 90)) * 0.2 * MIB + max(0.0, t - (NOW - 20)) * 60 * MIB


def _early_only(t):  # growing early, then flat for the last 20 s
    return 125 * GIB + min(t - (NOW - 90), 70) * 40 * MIB


def _noisy(t):  # a small trend under large alternating noise (r² near 0.1)
    return 125 * GIB + (t - (NOW - 90)) * 10 * MIB + (1.5 * GIB if int(t) % 2 else -1.5 * GIB)


def _sawtooth_high(t):  # per-step peaks at 97% of the device, flat
    return 0.97 * CAP + (0.05 * GIB if int(t) % 2 else 0)


@pytest.mark.parametrize(
    "name, times, footprint, relax",
    [
        ("too few samples", [NOW - 80, NOW - 60, NOW - 40, NOW - 19, NOW - 10, NOW], leak(), {"min_samples": 6}),
        ("too short a span", [NOW - 30 + i for i in range(31)], leak(), {"min_span_seconds": 20.0}),
        ("growth below the floor", SECS, leak(rate_mib=0.5, start_gib=138.9), {"min_growth_bytes_per_second": 0.1 * MIB, "min_rise_bytes": 10 * MIB}),
        ("rise below the floor", SECS, leak(rate_mib=4.0, start_gib=138.0), {"min_rise_bytes": 100 * MIB}),
        ("not a line (noise)", SECS, _noisy, {"min_r2": 0.0}),
        ("OOM beyond the horizon", SECS, leak(rate_mib=8.0, start_gib=100.0), {"predict_horizon_seconds": 1e6}),
        # (a hockey stick is also a poor line: r² is relaxed with it)
        ("growth only in the late half", SECS, _late_only, {"min_growth_bytes_per_second": 0.3 * MIB, "min_r2": 0.0}),
        ("growth only in the early half", SECS, _early_only, {"min_growth_bytes_per_second": 0.0}),
    ],
)
def test_oom_guard_keeps_quiet_and_relaxing_it_pages(name, times, footprint, relax):
    df = alloc_rows(times, footprint)
    assert oom(df) == [], name
    found = oom(df, **relax)
    assert [f.kind.value for f in found] == ["oom_predicted"], name


def test_oom_one_off_step_is_not_a_trend():
    """A new phase raises the footprint once: neither half grows, so no warning, although a line
    through the whole window rises 3 GiB."""
    df = alloc_rows(SECS, _step)
    assert oom(df) == []
    # Both halves' floors hold it (a step is also a poor line: r² is relaxed with them).
    assert oom(df, min_growth_bytes_per_second=-1.0, min_r2=0.0) != []


def test_oom_flat_sawtooth_at_97_percent_is_quiet():
    assert oom(alloc_rows(SECS, _sawtooth_high)) == []
    # ... and growing at 20 MiB/s from the same 97% it pages at once.
    [f] = oom(alloc_rows(SECS, lambda t: _sawtooth_high(t) - 2 * GIB + (t - (NOW - 90)) * 20 * MIB))
    assert f.severity.value == "page" and f.evidence["time_to_oom_seconds"] < 300


def test_oom_warmup_after_a_restart_is_not_extrapolated():
    jobs = schemas.frame([{"job": "j", "state": "running", "n_gpus": 1, "submit_ts": 0.0, "start_ts": NOW - 60}], schemas.JOBS)
    df = alloc_rows(SECS, leak())
    # Only the last 30 s are past the 30 s warm-up: too short a span.
    assert oom(df, {"jobs": jobs}) == []
    assert oom(df, {"jobs": jobs}, warmup_seconds=0.0, min_span_seconds=20.0) != []


@pytest.mark.parametrize(
    "rate_mib, severity",
    [(20.0, "page"), (10.0, "ticket")],  # ~627 s (page within 900 s) and ~1254 s (ticket)
)
def test_oom_severity_follows_time_left(rate_mib, severity):
    [f] = oom(alloc_rows(SECS, leak(rate_mib=rate_mib)))
    assert f.severity.value == severity
    assert (f.evidence["time_to_oom_seconds"] <= 900) == (severity == "page")


def test_oom_cause_foreign_and_fragmentation():
    base = lambda t: 125 * GIB  # noqa: E731
    grow = lambda t: (t - (NOW - 90)) * 20 * MIB  # noqa: E731
    [f] = oom(alloc_rows(SECS, base, foreign=grow))
    assert f.cause == "foreign_process"
    [f] = oom(alloc_rows(SECS, lambda t: base(t) + grow(t), gap=grow))
    assert f.cause == "fragmentation"
    # Gap growing at a quarter of the total, but cudaMalloc retried and the gap outgrows peaks.
    [f] = oom(alloc_rows(SECS, lambda t: base(t) + grow(t), gap=lambda t: grow(t) / 4 + 0 * t, retries=lambda t: int(t > NOW - 10)))
    assert f.cause == "leak"  # peaks grow 3x faster than the gap: still a leak


def test_oom_worst_rank_is_named_and_all_at_risk_listed():
    df = pl.concat([alloc_rows(SECS, leak(rate_mib=20.0), rank=0), alloc_rows(SECS, leak(rate_mib=30.0), rank=3), alloc_rows(SECS, lambda t: 60 * GIB, rank=1)])
    [f] = oom(df)
    assert f.ranks == [0, 3] and f.evidence["rank"] == 3 and f.gpu == 3 and f.evidence["ranks_at_risk"] == 2


# -- allocator fragmentation --------------------------------------------------------------------------


def frag_rows(n=12, gap_end=20 * GIB, split_share=0.9, retries_end=2, cap=CAP, gap_start=2 * GIB):
    rows = []
    for i in range(n):
        g = gap_start + (gap_end - gap_start) * i / (n - 1)
        rows.append({"ts": float(i * 5), "job": "j", "rank": 1, "node": "n0", "gpu": 1, "allocated_bytes": 60 * GIB, "reserved_bytes": int(100 * GIB + g),
                     "inactive_split_bytes": int(split_share * g), "largest_free_block_bytes": 512 * MIB, "peak_allocated_bytes": 100 * GIB,
                     "alloc_retries": retries_end if i == n - 1 else 0, "oom_count": 0, "device_capacity_bytes": cap, "foreign_used_bytes": 0})
    return schemas.frame(rows, schemas.ALLOCATOR_STATS)


def frag(df, **over):
    base = {"warmup_seconds": 0.0, "every_seconds": 0.0}
    return AllocatorFragmentationDetector(cfg(fragmentation_allocator={**base, **over})).detect(window({"allocator_stats": df}, float(df["ts"].max())))


def test_fragmentation_positive_names_rank_and_starved_request():
    [f] = frag(frag_rows())
    assert (f.kind.value, f.cause, f.ranks, f.gpu) == ("fragmentation_allocator", "fragmentation", [1], 1)
    assert f.evidence["reserved_unused_bytes"] == 20 * GIB and f.evidence["alloc_retries_delta"] == 2
    assert f.evidence["largest_block_below_request"] is True  # 0.5 GiB free block < the 40 GiB step request


@pytest.mark.parametrize(
    "name, rows, relax",
    [
        ("too few samples", frag_rows(n=6), {"min_samples": 4}),
        ("gap below the floor", frag_rows(gap_end=3 * GIB, gap_start=1 * GIB, cap=40 * GIB), {"min_gap_bytes": 2 * GIB}),
        ("gap a small share of a big device", frag_rows(gap_end=5 * GIB, gap_start=1 * GIB, cap=400 * GIB), {"min_gap_share": 0.01}),
        ("gap not growing", frag_rows(gap_start=20 * GIB), None),
        ("not in split blocks", frag_rows(split_share=0.2), {"min_inactive_split_share": 0.1}),
        ("no cudaMalloc retry", frag_rows(retries_end=0), {"min_retries": 0}),
    ],
)
def test_fragmentation_guard_keeps_quiet_and_relaxing_it_tickets(name, rows, relax):
    assert frag(rows) == [], name
    if relax is not None:
        assert [f.kind.value for f in frag(rows, **relax)] == ["fragmentation_allocator"], name


def test_fragmentation_not_growing_is_the_guard():
    """A large, steady reservation (a cache that simply holds memory) is not fragmenting; the
    same reservation ending 1 byte larger than it started is."""
    flat = frag_rows(gap_start=20 * GIB)
    grown = flat.with_columns(pl.when(pl.col("ts") == flat["ts"].max()).then(pl.col("reserved_bytes") + 1).otherwise(pl.col("reserved_bytes")).alias("reserved_bytes"))
    assert frag(flat) == [] and len(frag(grown)) == 1


def test_fragmentation_is_evaluated_every_few_seconds_only():
    det = AllocatorFragmentationDetector(cfg(fragmentation_allocator={"warmup_seconds": 0.0, "every_seconds": 5.0}))
    df = frag_rows()
    assert len(det.detect(window({"allocator_stats": df}, 55.0))) == 1
    assert len(det.detect(window({"allocator_stats": df.head(2)}, 57.0))) == 1  # cached verdict, not re-evaluated
    assert det.detect(window({"allocator_stats": df.head(2)}, 60.0)) == []  # re-evaluated: too few samples now


# -- collective hang ----------------------------------------------------------------------------------


def rank_rows(t, enq, comp, *, step_time=0.5, job="j", skip=()):
    return schemas.frame(
        [{"ts": t, "job": job, "rank": r, "node": f"n{r // 4}", "gpu": r % 4, "pg": "0", "last_enqueued_seq": e, "last_completed_seq": c,
          "current_op": "ALLREDUCE" if e > c else None, "step": 1, "step_time_seconds": step_time, "collective_wait_seconds": 0.0}
         for r, (e, c) in enumerate(zip(enq, comp)) if r not in skip],
        schemas.RANK_PROGRESS,
    )


def hang_run(frames_at, times, **over):
    det = HangDetector(cfg(hang=over) if over else None)
    w = Window(1e9)
    found = []
    for t in times:
        w.add("rank_progress", frames_at(t))
        w.seal(t)
        found.append(det.detect(w))
    return found


def _stuck(t, culprit=2, n=8):
    return rank_rows(t, [11 if r != culprit else 10 for r in range(n)], [10] * n)


def test_hang_positive_names_the_culprit_after_the_floor():
    found = hang_run(_stuck, [float(t) for t in range(0, 10)])
    first = next(i for i, fs in enumerate(found) if fs)
    assert first == 6  # stalled 6 s > 5 s floor (timed from the first tick it was seen)
    f = found[first][0]
    assert (f.culprit_ranks, f.node, f.gpu, f.cause, f.evidence["pending_seq"], f.evidence["waiting_ranks"]) == ([2], "n0", 2, "software", 11, 7)


@pytest.mark.parametrize(
    "name, frames_at, relax",
    [
        # Everybody idle between collectives (a checkpoint): nobody waits.
        ("nobody waiting", lambda t: rank_rows(t, [10] * 8, [10] * 8), None),
        # Everybody entered and waits (a network stall seen from the ranks): no culprit to name.
        ("everybody waiting", lambda t: rank_rows(t, [11] * 8, [10] * 8), None),
        # Stalled, but only for 4 s so far against a 5 s floor.
        ("stall below the floor", _stuck, {"min_stall_seconds": 3.0}),
    ],
)
def test_hang_guard_keeps_quiet(name, frames_at, relax):
    assert not any(hang_run(frames_at, [float(t) for t in range(0, 5)])), name
    if relax is not None:
        assert any(hang_run(frames_at, [float(t) for t in range(0, 5)], **relax)), name


def test_hang_floor_scales_with_the_job_step_time():
    slow = lambda t: rank_rows(t, [11 if r != 2 else 10 for r in range(8)], [10] * 8, step_time=10.0)  # noqa: E731
    found = hang_run(slow, [float(t) for t in range(0, 20)])
    assert next(i for i, fs in enumerate(found) if fs) == 16  # 1.5 x 10 s steps, not 5 s


def test_hang_job_that_stopped_reporting_is_not_judged():
    """All reports stale (the collector lost the job): no verdict on old data."""
    rows = _stuck(0.0)
    det = HangDetector()
    w = Window(1e9)
    w.add("rank_progress", rows)
    w.seal(0.0)
    det.detect(w)
    w.seal(20.0)  # 20 s later, nothing new from anybody
    assert det.detect(w) == []
    # The same stale rows are judged when staleness is allowed: it is the guard that held.
    det2 = HangDetector(cfg(hang={"stale_report_seconds": 100.0}))
    w2 = Window(1e9)
    w2.add("rank_progress", rows)
    w2.seal(0.0)
    det2.detect(w2)
    w2.seal(20.0)
    assert [f.culprit_ranks for f in det2.detect(w2)] == [[2]]


def test_hang_pause_outside_collectives_resets_the_clock():
    """A long checkpoint (everybody idle) followed by a normal collective wait is not a hang: the
    stall is timed from the end of the pause, not from the last completion before it."""
    def frames_at(t):
        if t < 60:
            return rank_rows(t, [10] * 8, [10] * 8)  # paused, idle, nothing completes
        return rank_rows(t, [11 if r != 2 else 10 for r in range(8)], [10] * 8)  # rank 2 late into #11
    found = hang_run(frames_at, [float(t) for t in range(0, 64)])
    assert not any(found)  # 3 s of waiting after a 60 s pause
    found = hang_run(frames_at, [float(t) for t in range(0, 70)])
    assert next(i for i, fs in enumerate(found) if fs) == 65  # 6 s after the last idle tick (59)


def test_hang_silent_rank_is_a_culprit():
    def frames_at(t):
        return rank_rows(t, [11] * 8, [10] * 8, skip=(5,) if t > 0 else ())
    found = hang_run(frames_at, [float(t) for t in range(0, 12)])
    f = next(fs[0] for fs in found if fs)
    assert f.culprit_ranks == [5] and f.evidence["silent_ranks"] == [5]


def test_hang_hardware_cause_from_an_xid_on_the_culprit_node():
    det = HangDetector()
    w = Window(1e9)
    xid = schemas.frame([{"ts": 0.0, "node": "n0", "gpu": 2, "source": "kernel", "kind": "xid", "xid": 79, "message": "fallen off the bus"}], schemas.EVENTS)
    for t in range(0, 8):
        w.add("rank_progress", _stuck(float(t)))
        if t == 0:
            w.add("events", xid)
        w.seal(float(t))
        found = det.detect(w)
    assert found and found[0].cause == "hardware" and found[0].evidence["xids"] == [79]


# -- straggler ----------------------------------------------------------------------------------------


def strag_rows(n_ranks=8, samples=30, slow_rank=3, slow_wait=0.02, peer_wait=0.3, step=1.0, t0=0.0):
    rows = []
    for i in range(samples):
        for r in range(n_ranks):
            rows.append({"ts": t0 + i * 2.0, "job": "j", "rank": r, "node": f"n{r // 4}", "gpu": r % 4, "pg": "0", "last_enqueued_seq": i, "last_completed_seq": i,
                         "step": i, "step_time_seconds": step, "collective_wait_seconds": slow_wait if r == slow_rank else peer_wait})
    return schemas.frame(rows, schemas.RANK_PROGRESS)


def strag(df, **over):
    return StragglerDetector(cfg(straggler=over) if over else None).detect(window({"rank_progress": df}, float(df["ts"].max())))


def test_straggler_positive_with_its_slowdown():
    [f] = strag(strag_rows())
    assert (f.culprit_ranks, f.node, f.gpu) == ([3], "n0", 3)
    assert f.evidence["slowdown"] == pytest.approx((1.0 - 0.02) / (1.0 - 0.3), rel=1e-3)


@pytest.mark.parametrize(
    "name, rows, relax",
    [
        ("too few ranks", strag_rows(n_ranks=3, slow_rank=1), {"min_ranks": 3}),
        ("too few samples", strag_rows(samples=10), {"min_samples": 5}),
        ("peers hardly wait", strag_rows(peer_wait=0.05, slow_wait=0.0), {"min_peer_wait_share": 0.01, "min_slowdown": 1.0}),
        ("its wait not far below its peers'", strag_rows(slow_wait=0.15), {"max_wait_share": 0.6}),
        ("slowdown below the floor", strag_rows(peer_wait=0.12, slow_wait=0.0, step=1.0), {"min_slowdown": 1.1}),
    ],
)
def test_straggler_guard_keeps_quiet_and_relaxing_it_tickets(name, rows, relax):
    assert strag(rows) == [], name
    assert [f.kind.value for f in strag(rows, **relax)] == ["straggler"], name


def test_straggler_window_stretches_for_slow_steps():
    """60 s steps: judged over 8 steps (480 s), so 30 samples every 2 s... are 60 s of them: too few
    steps' worth only if the window were 60 s; with 20 samples needed it still sees all 30."""
    rows = strag_rows(step=60.0, peer_wait=18.0, slow_wait=0.5)
    assert len(strag(rows)) == 1
    # A 10 s window cap cuts it down to 6 samples per rank: too few.
    assert strag(rows, max_window_seconds=10.0, window_seconds=10.0) == []


# -- thermal, PCIe --------------------------------------------------------------------------------------


def gpu_rows(t, **vals):
    return schemas.frame([{"ts": t, "node": "n0", "gpu": 0, **vals}], schemas.GPU_SAMPLES)


def thermal_run(reason_at, times, **over):
    det = ThermalDetector(cfg(thermal=over) if over else None)
    w = Window(1e9)
    out = []
    for t in times:
        w.add("gpu_samples", gpu_rows(t, throttle_reasons=reason_at(t), temperature_c=90.0, sm_clock_mhz=1500.0, power_w=600.0))
        w.seal(t)
        out.append(det.detect(w))
    return out


def test_thermal_sustained_throttle_tickets_with_reasons():
    out = thermal_run(lambda t: 0x20 | 0x40, [float(t) for t in range(30)])
    f = out[-1][0]
    assert (f.kind.value, f.cause, f.evidence["reasons"]) == ("thermal_throttle", "hardware", ["sw_thermal", "hw_thermal"])
    assert next(i for i, fs in enumerate(out) if fs) == 9  # the 10th sample: min_samples


@pytest.mark.parametrize(
    "name, reason_at, relax",
    [
        ("idle/app-clock reasons only", lambda t: 0x1 | 0x4, {"reason_mask": 0xFF}),
        ("throttled now and then", lambda t: 0x20 if int(t) % 3 == 2 else 0, {"min_throttled_share": 0.0}),
        ("not throttled right now", lambda t: 0x20 if t < 28 else 0, None),
    ],
)
def test_thermal_guard_keeps_quiet(name, reason_at, relax):
    out = thermal_run(reason_at, [float(t) for t in range(30)])
    assert out[-1] == [], name
    if relax is not None:
        assert thermal_run(reason_at, [float(t) for t in range(30)], **relax)[-1] != [], name


def test_thermal_several_samples_of_one_gpu_per_tick_keep_one_state_row():
    """A tick may carry several samples of a GPU (NVML and DCGM both on, a fast replay): the state
    stays one row per GPU (it used to multiply on every tick)."""
    det = ThermalDetector()
    w = Window(1e9)
    for t in range(20):
        w.add("gpu_samples", pl.concat([gpu_rows(t + k / 4, throttle_reasons=0x20, temperature_c=90.0) for k in range(4)]))
        w.seal(float(t + 1))
        found = det.detect(w)
    assert det._state.height == 1 and len(found) == 1


def pcie_run(rate_per_s, seconds=130, **over):
    det = PcieReplayDetector(cfg(pcie=over) if over else None)
    w = Window(1e9)
    out = []
    for t in range(seconds):
        w.add("gpu_samples", pl.concat([gpu_rows(float(t) + k / 2, pcie_replay_total=int(rate_per_s * (t + k / 2))) for k in range(2)]))
        w.seal(float(t))
        out.append(det.detect(w))
    return out, det


def test_pcie_replay_rate_tickets_and_keeps_one_baseline_row():
    out, det = pcie_run(5.0)  # 300/min
    f = next(fs[0] for fs in out if fs)
    assert (f.kind.value, f.cause, f.severity.value) == ("pcie_replay", "hardware", "ticket")
    assert f.evidence["pcie_replays_per_minute"] == pytest.approx(300.0, rel=0.05)
    assert det._base.height == 1


def test_pcie_slow_replays_are_quiet_until_relaxed():
    assert not any(pcie_run(1.0)[0])  # 60/min < 100/min
    assert any(pcie_run(1.0, min_replays_per_minute=30.0)[0])


# -- XID, ECC, cluster fragmentation ----------------------------------------------------------------------


def ev(rows):
    return schemas.frame(rows, schemas.EVENTS)


def test_xid_old_events_and_memory_xids_are_left_out():
    rows = [{"ts": 0.0, "node": "n0", "gpu": 1, "source": "kernel", "kind": "xid", "xid": 79, "message": "fallen off the bus"},
            {"ts": 990.0, "node": "n0", "gpu": 2, "source": "kernel", "kind": "xid", "xid": 48, "message": "DBE"}]
    assert XidDetector().detect(window({"events": ev(rows)}, 1000.0)) == []  # 79 is 1000 s old; 48 belongs to ECC
    [f] = XidDetector(cfg(xid={"report_seconds": 2000.0})).detect(window({"events": ev(rows)}, 1000.0))
    assert (f.xid, f.severity.value) == (79, "page")
    found = XidDetector(cfg(xid={"ecc_codes": []})).detect(window({"events": ev(rows)}, 1000.0))
    assert [f.xid for f in found] == [48]


def test_ecc_counter_increase_pages_once_and_a_reset_counts_anew():
    det = EccDetector()
    w = Window(1e9)
    got = []
    for t, dbe in [(0, 0), (1, 2), (2, 2), (3, 1)]:
        w.add("gpu_samples", gpu_rows(float(t), ecc_dbe_volatile_total=dbe, retired_pages_total=0, remap_failure=False))
        w.seal(float(t))
        got.append([f.evidence["dbe_new"] for f in det.detect(w)])
    assert got == [[], [2], [], [1]]


def test_ecc_events_are_reported_once_on_arrival():
    det = EccDetector()
    rows = [{"ts": 5.0, "node": "n0", "gpu": 1, "source": "kernel", "kind": "xid", "xid": 94, "message": "contained ECC"}]
    w = window({"events": ev(rows)}, 10.0)
    assert [f.xid for f in det.detect(w)] == [94]
    w.seal(11.0)
    assert det.detect(w) == []


def cluster_state(free, pending_per_node, pending_gpus, waited=60.0):
    now = 1000.0
    nodes = schemas.frame([{"node": f"n{i}", "rack": "r0", "n_gpus": 8, "free_gpus": f, "state": "up"} for i, f in enumerate(free)], schemas.NODES)
    jobs = schemas.frame([{"job": "gang", "state": "pending", "n_gpus": pending_gpus, "gpus_per_node": pending_per_node, "submit_ts": now - waited, "priority": "P1"}], schemas.JOBS)
    allocs = schemas.frame([{"node": f"n{i}", "gpu": g, "job": f"s{i}", "rank": g} for i, f in enumerate(free) for g in range(8 - f)], schemas.ALLOCATIONS)
    return {"nodes": nodes, "jobs": jobs, "allocations": allocs}, now


def test_cluster_fragmentation_blocked_gang_gets_a_compaction_plan():
    frames, now = cluster_state([4, 4, 3], 8, 8)
    [f] = ClusterFragmentationDetector().detect(window(frames, now))
    assert f.job == "gang" and f.evidence["free_gpus"] == 11 and f.evidence["largest_gang_per_node"] == 4
    assert f.node == "n0" and [m["job"] for m in f.evidence["moves"]] == ["s0"]


@pytest.mark.parametrize(
    "name, free, per_node, gpus, waited, relax",
    [
        ("just submitted", [4, 4, 3], 8, 8, 5.0, {"min_pending_seconds": 1.0}),
        ("any spread allowed", [4, 4, 3], None, 8, 60.0, None),
        ("not enough free GPUs at all", [3, 2, 2], 8, 8, 60.0, None),
        ("fits on a node", [8, 4, 3], 8, 8, 60.0, None),
    ],
)
def test_cluster_fragmentation_guard_keeps_quiet(name, free, per_node, gpus, waited, relax):
    frames, now = cluster_state(free, per_node, gpus, waited)
    assert ClusterFragmentationDetector().detect(window(frames, now)) == [], name
    if relax is not None:
        assert len(ClusterFragmentationDetector(cfg(fragmentation_cluster=relax)).detect(window(frames, now))) == 1, name
