"""`gpuvigil bench pipeline`: GPU-metric samples per second through collect → window → detect.

Each cluster size runs in its own process with polars limited to one thread (one core), so the
figures and the peak memory are those of one pipeline. The cluster is the simulated one, 80% of
GPUs busy with 64-GPU jobs, so rank-progress and allocator streams flow too. Windows are warmed
with 90 s of history (the longest detector look-back) before timing. Targets (issue 2): at least
1,000,000 GPU-metric samples/s, and a tick for 100,000 GPUs in under 1 s.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

TARGET_SAMPLES_PER_SECOND = 1_000_000
TARGET_TICK_SECONDS_AT_100K = 1.0
WARMUP_SECONDS = 90.0


def _scenario(gpus: int):
    from gpuvigil.collectors.scenario import Scenario

    nodes = max(1, gpus // 8)
    job_gpus = 64 if gpus >= 640 else 8
    n_jobs = int(gpus * 0.8) // job_gpus
    jobs = [
        {"name": f"job-{i:05d}", "gpus": job_gpus, "gpus_per_node": 8, "step_time_seconds": 0.5 + (i % 7) * 0.4, "checkpoint_every_steps": 1000}
        for i in range(n_jobs)
    ]
    return Scenario.model_validate({"name": f"bench-{gpus}", "nodes": nodes, "duration_seconds": 1e6, "jobs": jobs})


def measure(gpus: int, ticks: int, warmup_ticks: int | None = None) -> dict[str, Any]:
    """Run in the worker process: warm up, then time `ticks` ticks stage by stage."""
    import polars as pl

    from gpuvigil import schemas
    from gpuvigil.runtime import build_simulated

    t_build = time.perf_counter()
    rt = build_simulated(_scenario(gpus), seed=0)
    build_s = time.perf_counter() - t_build
    pipe = rt.pipeline
    # Warm up long enough that every detector's look-back (the longest is the OOM fit, 90 s) is
    # full and the windows hold that much history.
    warmup = int(WARMUP_SECONDS / rt.tick_seconds) if warmup_ticks is None else warmup_ticks
    for _ in range(warmup):
        rt.step()
    metric_cols = [c for c, t in schemas.GPU_SAMPLES.items() if c not in ("ts", "node", "gpu", "gpu_uuid")]

    class Timed:
        """Times a collector and counts the rows it emits, inside the real pipeline tick."""

        def __init__(self, inner):
            self.inner, self.name, self.streams = inner, inner.name, inner.streams
            self.seconds, self.gpu_rows, self.other_rows = 0.0, 0, 0

        @property
        def errors(self) -> int:
            return self.inner.errors

        def collect(self, now: float) -> dict[str, pl.DataFrame]:
            t0 = time.perf_counter()
            frames = self.inner.collect(now)
            self.seconds += time.perf_counter() - t0
            for stream, df in frames.items():
                if stream == "gpu_samples":
                    self.gpu_rows += df.height
                else:
                    self.other_rows += df.height
            return frames

    timed = [Timed(c) for c in pipe.collectors]
    pipe.collectors = timed
    tick_times, detector_totals = [], {d.name: 0.0 for d in pipe.detectors}
    for _ in range(ticks):
        # The production tick: detectors run at their configured periods
        # (config pipeline.detector_every_seconds), findings merged, hints issued.
        result = rt.step()
        tick_times.append(result.duration_seconds)
        for name, sec in result.detector_seconds.items():
            detector_totals[name] += sec
    collect_s = sum(t.seconds for t in timed)
    gpu_rows = sum(t.gpu_rows for t in timed)
    other_rows = sum(t.other_rows for t in timed)
    detect_s = sum(detector_totals.values())
    window_s = sum(tick_times) - collect_s - detect_s  # window seal, findings lifecycle, hints, sinks
    total = collect_s + window_s + detect_s
    window_rows = {s: pipe.window.get(s).height for s in pipe.window.streams()}
    samples = gpu_rows * len(metric_cols)
    return {
        "gpus": gpus,
        "ticks": ticks,
        "warmup_ticks": warmup,
        "ranks": sum(j.cfg.gpus for j in rt.cluster.jobs.values()) if rt.cluster else 0,
        "metrics_per_gpu_sample": len(metric_cols),
        "gpu_metric_samples_per_second": samples / total,
        "gpu_rows_per_second": gpu_rows / total,
        "all_rows_per_second": (gpu_rows + other_rows) / total,
        "tick_seconds_mean": total / ticks,
        "tick_seconds_max": max(tick_times),
        "collect_seconds_per_tick": collect_s / ticks,
        "window_seconds_per_tick": window_s / ticks,
        "detect_seconds_per_tick": detect_s / ticks,
        "window_rows": sum(window_rows.values()),
        "detector_seconds_per_tick": {k: v / ticks for k, v in sorted(detector_totals.items())},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "build_seconds": build_s,
    }


def run_worker(gpus: int, ticks: int, warmup: int | None) -> dict[str, Any]:
    env = dict(os.environ, POLARS_MAX_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "benchmarks.pipeline", "--worker", str(gpus), str(ticks), "" if warmup is None else str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark worker for {gpus} GPUs failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "## Pipeline throughput (`gpuvigil bench pipeline`)\n\n"
        f"The production tick (`Pipeline.tick`: detectors at their configured periods, findings merged, hints to the scheduler), one core (polars single-threaded), simulated cluster with 80% of GPUs in 64-GPU jobs, windows warmed with 90 s of history (the longest detector look-back). "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
        f"Targets: ≥ {TARGET_SAMPLES_PER_SECOND:,} GPU-metric samples/s; a tick for 100,000 GPUs < {TARGET_TICK_SECONDS_AT_100K:.0f} s.\n\n"
        "| GPUs | ranks | GPU-metric samples/s | rows/s (all streams) | tick mean (s) | tick max (s) | collect (s) | window + rest (s) | detect (s) | window rows | peak RSS (MiB) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r['gpus']:,} | {r['ranks']:,} | {r['gpu_metric_samples_per_second']:,.0f} | {r['all_rows_per_second']:,.0f} | "
        f"{r['tick_seconds_mean']:.3f} | {r['tick_seconds_max']:.3f} | {r['collect_seconds_per_tick']:.3f} | {r['window_seconds_per_tick']:.3f} | "
        f"{r['detect_seconds_per_tick']:.3f} | {r['window_rows']:,} | {r['peak_rss_bytes'] / 2**20:,.0f} |\n"
        for r in rows
    )
    notes = []
    for r in rows:
        if r["gpus"] >= 100_000:
            ok = r["tick_seconds_mean"] < TARGET_TICK_SECONDS_AT_100K
            notes.append(f"- 100,000-GPU tick: {r['tick_seconds_mean']:.3f} s mean — target {'met' if ok else 'NOT met'}.")
    best = max(r["gpu_metric_samples_per_second"] for r in rows)
    notes.append(f"- Best throughput: {best:,.0f} GPU-metric samples/s — target {'met' if best >= TARGET_SAMPLES_PER_SECOND else 'NOT met'}.")
    notes.append("- `collect` is the simulator generating the frames (and the scheduler's state snapshots); a real NVML/DCGM collector is I/O-bound instead.")
    big = rows[-1]
    costly = sorted(big["detector_seconds_per_tick"].items(), key=lambda kv: -kv[1])[:4]
    notes.append(f"- Detector cost per tick at {big['gpus']:,} GPUs (mean over the timed ticks): " + ", ".join(f"{k} {v:.3f} s" for k, v in costly) + ".")
    return head + body + "\n" + "\n".join(notes) + "\n"


def cmd_bench_pipeline(args) -> int:
    from gpuvigil.errors import UserError

    try:
        sizes = [int(x) for x in args.gpus.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--gpus takes comma-separated whole numbers, got {args.gpus!r}") from None
    if not sizes or any(s < 8 for s in sizes):
        raise UserError("--gpus: each size must be >= 8")
    rows = []
    for gpus in sizes:
        row = run_worker(gpus, args.ticks, args.warmup)
        rows.append(row)
        if not args.json:
            print(f"{gpus:>8,} GPUs: {row['gpu_metric_samples_per_second']:>14,.0f} GPU-metric samples/s, tick {row['tick_seconds_mean']:.3f} s, peak {row['peak_rss_bytes'] / 2**20:,.0f} MiB", file=sys.stderr)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section("pipeline", markdown(rows))
    if args.json:
        print(json.dumps({"sizes": rows}, sort_keys=True))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="samples/s through collect → window → detect, and tick time")
    p.add_argument("--gpus", default="1000,10000,100000", help="comma-separated cluster sizes (GPUs)")
    p.add_argument("--ticks", type=int, default=10, help="timed ticks per size")
    p.add_argument("--warmup", type=int, default=None, help="warm-up ticks (default: 90 s of simulated time)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.set_defaults(func=cmd_bench_pipeline)


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--worker":
    warm = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
    print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]), warm)))
