"""oom_device's slow-growth fit (gpuvigil/detectors/oom_device.py, "Slow growth"): OOM ahead at
the resolutions real sources give (dcgm-exporter every 30 s, Prometheus history at 57-60 s, NVML
at 1 s) and over the time scales real leaks take (tens of minutes to hours).

Sources:
- tests/data/public/alibaba-genai-2026/: the real GPU memory series of 5 inference pods of
  Alibaba's cluster-trace-v2026-GenAI (57 s step, ~22.8 h; see its README), one with a leak
  seeded on top of its real series (benchmarks/replay_real.py: add_leak);
- constructed series: the ideal smooth leak 20 -> 80 GiB over 40 min, and an allocator warm-up
  from an idle GPU to a 78 of 80 GiB plateau (the shape PyTorch's caching allocator gives: whole
  segments while the first iterations run, then flat).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from levels_helpers import cfg_with, window

from benchmarks.replay_real import add_leak
from gpuvigil import schemas
from gpuvigil.detectors.oom_device import DeviceOomPredictor, OomDeviceConfig
from gpuvigil.model import FindingKind, Severity

GIB = float(1 << 30)
CAPACITY = 80 * GIB
EXCERPT = Path(__file__).parent / "data" / "public" / "alibaba-genai-2026" / "pod_gpu_memory_used_bytes_excerpt.csv.gz"
EVIDENCE_KEYS = {"fit_start_ts", "fit_end_ts", "slope_bytes_per_s", "intercept_bytes", "predicted_full_ts", "capacity_bytes", "sample_interval_s", "confidence"}


def replay(series: dict[str, tuple[np.ndarray, np.ndarray]], tick: float, *, detect_every: float = 5.0, cfg=None, capacity: float = CAPACITY):
    """Each pod's GPU (its own node, GPU 0, allocated to job = the pod) through oom_device, one
    tick every `tick` s as the pipeline runs it: detect every `detect_every` s (its
    detector_every_seconds), `ingest` on the other ticks. Returns [(tick, finding)]."""
    det = DeviceOomPredictor(cfg)
    w = window()
    pods = sorted(series)
    alloc = schemas.frame([{"job": p, "rank": 0, "node": f"node-{i}", "gpu": 0} for i, p in enumerate(pods)], schemas.ALLOCATIONS)
    rows = pl.concat(
        [pl.DataFrame({"ts": ts, "node": f"node-{i}", "used": used.round().astype(np.int64)}) for i, (ts, used) in ((i, series[p]) for i, p in enumerate(pods))]
    ).sort("ts")
    at = rows["ts"].to_numpy()
    t0, t1 = float(at.min()), float(at.max())
    found, pos, last_detect = [], 0, -math.inf
    for i in range(int((t1 - t0) // tick) + 2):
        now = t0 + i * tick
        end = int(np.searchsorted(at, now, side="right"))
        fresh = rows.slice(pos, end - pos)
        pos = end
        if fresh.height:
            w.add("gpu_samples", schemas.frame(
                [{"ts": ts, "node": n, "gpu": 0, "memory_used_bytes": u, "memory_total_bytes": int(capacity)} for ts, n, u in fresh.iter_rows()], schemas.GPU_SAMPLES))
        w.add("allocations", alloc)
        w.seal(now)
        if now - last_detect >= detect_every:
            last_detect = now
            found.extend((now, f) for f in det.detect(w))
        else:
            det.ingest(w)
    return found


def ideal_leak(step: float) -> tuple[np.ndarray, np.ndarray, float]:
    """20 -> 80 GiB in 40 min, sampled every `step` s, from t=1.7e9; returns (ts, used, the time it is full)."""
    t0 = 1.7e9
    ts = t0 + np.arange(0.0, 2400.0 + step / 2, step)
    return ts, 20 * GIB + (ts - t0) / 2400.0 * 60 * GIB, t0 + 2400.0


@pytest.mark.parametrize("step, tick", [(1.0, 1.0), (30.0, 30.0), (60.0, 60.0)])
def test_an_ideal_slow_leak_is_paged_at_least_ten_minutes_before_it_fills(step, tick):
    """The smooth 20 -> 80 GiB leak over 40 min pages at least 10 min before the GPU is full, at
    NVML's 1 s, dcgm-exporter's 30 s and a 60 s Prometheus history, with the projection's
    reasoning in its evidence."""
    ts, used, full = ideal_leak(step)
    found = replay({"job": (ts, used)}, tick)
    pages = [(now, f) for now, f in found if f.severity == Severity.PAGE]
    assert pages, "no page"
    now, f = pages[0]
    assert full - now >= 600, f"paged only {full - now:.0f} s before the GPU was full"
    ev = f.evidence
    assert EVIDENCE_KEYS <= set(ev)
    assert (f.kind, f.cause, f.job, ev["level"]) == (FindingKind.OOM_PREDICTED, "leak", "job", "L0")
    # The fit: 1.5 GiB/min, drawn from fit_start_ts to now, full when the line meets capacity − margin.
    assert ev["slope_bytes_per_s"] == pytest.approx(60 * GIB / 2400.0, rel=0.05)
    assert ev["fit_end_ts"] == now and ev["fit_start_ts"] < now
    assert ev["capacity_bytes"] == CAPACITY and ev["sample_interval_s"] == pytest.approx(step, rel=0.1)
    assert 0.5 <= ev["confidence"] <= 1.0
    line_at_full = ev["intercept_bytes"] + ev["slope_bytes_per_s"] * (ev["predicted_full_ts"] - ev["fit_end_ts"])
    assert line_at_full == pytest.approx(CAPACITY - ev["safety_margin_bytes"], rel=1e-6)
    # The projection is right within a minute or two (the envelope's buckets are 60 s).
    assert abs(ev["predicted_full_ts"] - (full - 2400.0 / 60)) <= 150


def warm_up(step: float, minutes: float = 4.0, hours: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """An idle GPU (a CUDA context) loads a model (20 GiB in 20 s), then the allocator adds 1 GiB
    segments while the first iterations run, for `minutes`, up to 78 GiB of 80, and stays there
    (the sawtooth of allocated memory is inside the reserved segments: the device sees it flat)."""
    t0 = 1.7e9
    ts = t0 + np.arange(0.0, hours * 3600 + step / 2, step)
    rel = ts - t0 - 60
    used = np.where(rel < 0, 0.5 * GIB, np.where(rel < 20, 20 * GIB, np.minimum(20 * GIB + np.floor((rel - 20) / (minutes * 60) * 58) * GIB, 78 * GIB)))
    return ts, used


@pytest.mark.parametrize("step, minutes", [(1.0, 4.0), (1.0, 1.0), (30.0, 4.0), (60.0, 8.0)])
def test_a_warm_up_that_plateaus_near_capacity_does_not_page(step, minutes):
    """78 of 80 GiB and staying there is a healthy job: no page, at 1 s or at 30-60 s, whatever
    the warm-up's pace."""
    ts, used = warm_up(step, minutes)
    found = replay({"job": (ts, used)}, step)
    assert [f for _, f in found if f.severity == Severity.PAGE] == []


def test_a_warm_up_without_the_idle_gpu_at_its_start_still_pages_as_a_fast_leak_would():
    """The grace is the idle GPU's: the same ramp seen from 20 GiB on (the detector started
    after the model was loaded) is indistinguishable from a leak while it lasts, and the fast fit
    warns (the time scale it was built for)."""
    ts, used = warm_up(1.0, 4.0, hours=0.2)
    keep = used >= 20 * GIB
    found = replay({"job": (ts[keep], used[keep])}, 1.0)
    assert any(f.severity == Severity.PAGE for _, f in found)


def read_excerpt() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    df = pl.read_csv(EXCERPT).sort("container_ip", "timestamp_anon")
    return {pod[:8]: (g["timestamp_anon"].to_numpy(), g["value"].to_numpy()) for (pod,), g in df.group_by("container_ip", maintain_order=True)}


@pytest.fixture(scope="module")
def real_pods():
    return read_excerpt()


def test_the_real_pods_as_recorded_raise_nothing(real_pods):
    """Five real inference pods (bursts to 45 GiB that fall back, a restart from 0, a step to a
    42.7 GiB plateau) replayed at their 57 s step: no finding at all, not even a ticket."""
    assert len(real_pods) == 5 and all(ts.size > 1000 for ts, _ in real_pods.values())
    assert replay(real_pods, 57.0) == []


@pytest.mark.parametrize("minutes, tick", [(45.0, 57.0), (30.0, 30.0)])
def test_a_leak_seeded_on_a_real_pod_is_paged_ten_minutes_ahead_and_the_others_stay_quiet(real_pods, minutes, tick):
    """A leak on top of pod 00800b6d's real series, bringing its usual peak to 80 GiB in
    `minutes`, starting 8 h into the recording: paged at least 600 s before the OOM, after the
    leak began; the four other real pods raise nothing. Replayed at the series' 57 s and with
    30 s ticks (a tick sees whatever the history holds by then)."""
    pods = dict(real_pods)
    ts, used = pods["00800b6d"]
    start = ts[0] + 8 * 3600
    lts, lused, oom, rate = add_leak(ts, used, start, minutes * 60, CAPACITY)
    assert math.isfinite(oom) and rate > 0
    pods["00800b6d"] = (lts, lused)
    found = replay(pods, tick)
    assert {f.job for _, f in found} == {"00800b6d"}
    pages = [now for now, f in found if f.severity == Severity.PAGE]
    assert all(now >= start for now, _ in found), "a finding before the leak began"
    assert pages and oom - pages[0] >= 600, f"lead {oom - pages[0]:.0f} s"


def test_trend_windows_must_be_whole_blocks_of_buckets():
    with pytest.raises(ValueError, match="trend window"):
        OomDeviceConfig(trend_windows_seconds=[650.0])
    with pytest.raises(ValueError, match="trend_min_block_rises"):
        OomDeviceConfig(trend_blocks=3, trend_min_block_rises=3)


def test_the_trend_thresholds_are_config_data():
    """A minimum growth above what the ideal leak adds over every window: no finding from the
    trend fit (at 60 s the fast fit's 110 s holds two samples, one step: it cannot warn)."""
    ts, used, _ = ideal_leak(60.0)
    assert replay({"job": (ts, used)}, 60.0) != []
    cfg = cfg_with("oom_device", trend_min_growth_bytes=int(100 * GIB))
    assert replay({"job": (ts, used)}, 60.0, cfg=cfg) == []


def test_a_gpu_mapped_to_its_pod_without_a_rank_is_named_by_its_place():
    """dcgm-exporter's pod labels map a GPU to its job with no rank: the finding names the GPU."""
    ts, used, _ = ideal_leak(60.0)
    det = DeviceOomPredictor()
    w = window()
    alloc = schemas.frame([{"job": "ns/infer-0", "rank": None, "node": "genai-node-00", "gpu": 3}], schemas.ALLOCATIONS)
    found = []
    for t, u in zip(ts, used):
        w.add("gpu_samples", schemas.frame([{"ts": float(t), "node": "genai-node-00", "gpu": 3, "memory_used_bytes": int(u), "memory_total_bytes": int(CAPACITY)}], schemas.GPU_SAMPLES))
        w.add("allocations", alloc)
        w.seal(float(t))
        found += det.detect(w)
    assert found
    f = found[0]
    assert (f.job, f.ranks, f.node, f.gpu, f.evidence["rank"]) == ("ns/infer-0", [], "genai-node-00", 3, None)
    assert f.summary.startswith("ns/infer-0 on genai-node-00 GPU 3 will run out of GPU memory in about ")
