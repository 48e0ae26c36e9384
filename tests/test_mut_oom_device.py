"""L0 OOM predictor (gpuvigil/detectors/oom_device.py): behaviour that mutation testing (`make
mutate`, docs/testing.md) showed no other test pinned down: the foreign-process summary, a job
known to the scheduler (its start time bounds the fit), and the columns it declares reading.

Source: NVML device memory and per-process memory built as in tests/test_levels.py (1 GiB
segments every few seconds on a 140.4 GiB H200-sized device, tests/data/h200/nvml_inventory.json).
"""

from __future__ import annotations

from levels_helpers import play
from test_levels import GIB, _memory_ticks

from gpuvigil import schemas
from gpuvigil.detectors.oom_device import DeviceOomPredictor


def test_another_process_growing_says_so_in_the_summary():
    [f, *_] = play(DeviceOomPredictor(), _memory_ticks(lambda t: 60 * GIB, foreign=lambda t: (t // 4) * GIB))
    assert f.cause == "foreign_process" and "another process on the GPU is taking more and more memory" in f.summary


def test_a_job_the_scheduler_lists_is_fitted_from_its_start():
    """The same leak with the scheduler's job row (running since t=0): still predicted."""
    job = schemas.frame([{"job": "job", "state": "running", "n_gpus": 2, "submit_ts": 0.0, "start_ts": 0.0}], schemas.JOBS)
    ticks = ((t, {**frames, "jobs": job}) for t, frames in _memory_ticks(lambda t: 60 * GIB + (t // 5) * GIB))
    [f, *_] = play(DeviceOomPredictor(), ticks)
    assert (f.cause, f.job, f.evidence["level"]) == ("leak", "job", "L0")


def test_the_declared_columns_exist_in_the_stream():
    """The pipeline keeps only the declared columns of each stream's history."""
    cols = DeviceOomPredictor().window_columns()
    assert set(cols) == {"gpu_samples"} and set(cols["gpu_samples"]) <= set(schemas.GPU_SAMPLES.names())
