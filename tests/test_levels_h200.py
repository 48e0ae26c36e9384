"""The L0 detectors on the real H200 NVML series (tests/data/h200/nvml_timeseries.csv, ~0.14 s
samples through the whole capture of /work/shared/fixtures/h200, see its README).

- `oom_ramp`: a real capacity OOM, 4 GiB allocations until `torch.OutOfMemoryError` at 136.5 GiB;
  the series is ~60× faster than a real leak, so the fit windows are scaled down (config data);
  the ramp starts from an idle GPU seconds after the process did, so the start-up grace (a job's
  and an idle GPU's warm-up) is off at this time scale.
- `nccl_timeout`: a real NCCL all_reduce stuck behind a 40 s GPU spin kernel until the watchdog
  fired: util 100% at ~123 W (busy: ~690 W in `matmul`): the L0 waiting signature, on one GPU, with
  nobody to single out.
"""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil.collectors.nvml import replay_csv
from gpuvigil.detectors.hang_device import DeviceHangDetector
from gpuvigil.detectors.oom_device import DeviceOomPredictor
from levels_helpers import H200, allocations, cfg_with, play

CSV = H200 / "nvml_timeseries.csv"


@pytest.fixture(scope="module")
def series():
    gs = replay_csv(CSV)
    raw = pl.read_csv(CSV)
    phase = dict(raw.select("t", "phase").iter_rows())
    alloc = allocations("h200", [("replay", 0)])
    ticks = [(float(t), {"gpu_samples": gs.filter(pl.col("ts") == t), "allocations": alloc}) for t in gs["ts"].to_list()]
    return ticks, phase, raw


def test_real_capacity_oom_ramp_is_predicted_before_the_oom(series):
    ticks, phase, raw = series
    cfg = cfg_with("oom_device", fit_window_seconds=10.0, warmup_seconds=0.0, startup_seconds=0.0, min_span_seconds=1.0, min_rises=3)
    found = play(DeviceOomPredictor(cfg), ticks)
    ramp = [f for f in found if phase[f.ts] == "oom_ramp"]
    assert ramp, "no warning on the real OOM ramp"
    first = ramp[0]
    ramp_rows = raw.filter(pl.col("phase") == "oom_ramp")
    oom_ts = ramp_rows.filter(pl.col("fb_used") == ramp_rows["fb_used"].max())["t"].min()
    lead = oom_ts - first.ts
    assert lead > 1.0, f"warned only {lead:.2f} s before the OOM"
    # The predicted time to OOM matches what happened within half of it.
    assert abs(first.evidence["time_to_oom_seconds"] - lead) <= 0.5 * lead
    assert first.cause == "leak" and first.evidence["fragmentation_visible"] is False
    assert first.evidence["level"] == "L0" and first.evidence["per_process_memory"] is False


def test_flat_phases_of_the_real_series_raise_no_oom_warning(series):
    ticks, phase, _ = series
    cfg = cfg_with("oom_device", fit_window_seconds=10.0, warmup_seconds=0.0, startup_seconds=0.0, min_span_seconds=1.0, min_rises=3)
    found = play(DeviceOomPredictor(cfg), ticks)
    for quiet in ("start", "matmul", "nccl_ok", "nccl_timeout", "nccl_two_ranks_one_gpu", "idle"):
        assert not [f for f in found if phase[f.ts] == quiet], quiet


def test_real_stuck_collective_reads_as_a_hang_and_nothing_else_does(series):
    ticks, phase, _ = series
    found = play(DeviceHangDetector(cfg_with("hang_device", min_gpus=1)), ticks)
    assert found and {phase[f.ts] for f in found} == {"nccl_timeout"}
    f = found[0]
    assert f.culprit_ranks == [] and f.evidence["level"] == "L0"
    assert f.evidence["waiting_power_w_median"] < 0.25 * f.evidence["busy_power_w_median"]
