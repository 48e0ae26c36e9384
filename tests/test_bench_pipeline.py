"""`gpuvigil bench pipeline` in reduced form: it runs and reports well-formed figures and a table.
(Speed targets are stated by the benchmark itself, never asserted here.)"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.pipeline import markdown


def test_bench_pipeline_reduced_run_reports_every_size():
    out = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "bench", "pipeline", "--gpus", "64,128", "--ticks", "2", "--warmup", "3", "--json", "--no-write", "--fleet", "hooked"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["gpus"] for r in result["sizes"]] == [64, 128]
    for row in result["sizes"]:
        assert row["gpu_metric_samples_per_second"] > 0
        assert row["tick_seconds_mean"] > 0 and row["peak_rss_bytes"] > 0
        assert row["ranks"] > 0, "rank streams flow in the benchmark cluster"
        assert abs(row["collect_seconds_per_tick"] + row["window_seconds_per_tick"] + row["detect_seconds_per_tick"] - row["tick_seconds_mean"]) < 1e-6
    table = markdown(result["sizes"])
    assert table.count("\n| 64 |") == 1 and "| 128 |" in table
    assert "samples/s" in table


def test_bench_pipeline_rejects_bad_sizes():
    out = subprocess.run([sys.executable, "-m", "gpuvigil", "bench", "pipeline", "--gpus", "lots"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def _bench(*extra: str) -> dict:
    return _bench_rows(*extra)[0]


def _bench_rows(*extra: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "bench", "pipeline", "--gpus", "64", "--ticks", "2", "--warmup", "20", "--json", "--no-write", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["sizes"]


def test_bench_pipeline_without_the_hook_is_an_l0_fleet_keeping_device_history():
    """simulated: --no-hook drops the hook's streams, so every job is an L0 job. The window then
    holds no allocator or rank history, and keeps the 20 s of gpu_samples history the device-level
    detectors (oom_device, straggler_device) declare for a rebuild of their rings for every
    allocated GPU. The hooked fleet (every job L2) keeps the same: its jobs' device detectors run
    beside the hook's (levels side by side), so their GPUs' history is not thinned
    (docs/detectors.md, "History kept at scale")."""
    hooked, bare = _bench("--fleet", "hooked"), _bench("--no-hook")
    assert (hooked["hook"], bare["hook"]) == (True, False)
    assert {"allocator_stats", "rank_progress"} <= set(hooked["window_horizon_seconds"])
    assert not {"allocator_stats", "rank_progress"} & set(bare["window_horizon_seconds"])
    assert bare["window_horizon_seconds"]["gpu_samples"] == 20.0
    assert bare["window_bytes_by_stream"]["gpu_samples"] == hooked["window_bytes_by_stream"]["gpu_samples"] > 0


def test_bench_pipeline_measures_both_fleets_by_default_each_with_its_own_table():
    """simulated: the default run measures the hooked fleet, then the L0 fleet; each gets its own
    section of docs/benchmarks.md (`pipeline`, `pipeline-l0`), so neither overwrites the other."""
    rows = _bench_rows()
    assert [r["hook"] for r in rows] == [True, False]
    hooked, l0 = markdown(rows[:1]), markdown(rows[1:])
    assert hooked.startswith("## Pipeline throughput, hooked fleet\n") and "Fleet: every job runs the in-process hook" in hooked
    assert l0.startswith("## Pipeline throughput, L0 fleet\n") and "Fleet: no job runs the hook" in l0
    for table in (hooked, l0):
        assert "Written by `gpuvigil bench pipeline`." in table and "**simulated** cluster" in table and "sampled once per 1 s tick" in table
