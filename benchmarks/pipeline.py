"""`gpuvigil bench pipeline`: GPU-metric samples per second through collect → window → detect.

Each cluster size runs in its own process with polars limited to one thread (one core), so the
figures and the peak memory are those of one pipeline. The cluster is the simulated one, 80% of
GPUs busy with 64-GPU jobs, so rank-progress and allocator streams flow too. Windows are warmed
until every per-key stream's history is at its full horizon (steady state) before timing. Targets: at least
3,000,000 GPU-metric samples/s; a tick for 100,000 GPUs under 1 s, both the mean and the worst
tick on which every detector is due at once; peak memory under 2 GB.

Both wall and CPU time are reported: on a shared machine the wall clock also counts time the
process waited for a core, CPU time (process/thread time) does not. The simulator's own cost
(`collect`) is reported apart from gpuvigil's (window, detectors, findings, hints).
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

TARGET_SAMPLES_PER_SECOND = 3_000_000
TARGET_PEAK_RSS_BYTES = 2 * 10**9
TARGET_TICK_SECONDS_AT_100K = 1.0
WARMUP_SECONDS = 90.0
SNAPSHOTS = ("jobs", "nodes", "allocations", "gpu_jobs")


def _rss_bytes() -> int:
    """Current resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def resident_bytes(df) -> int:
    """Bytes a frame's buffers hold. polars' estimated_size counts a string column's characters
    but not its 16-byte views (one per row, strings of up to 12 bytes inline, longer ones stored
    besides), so string-heavy frames take ~1.3-2x what it says."""
    import polars as pl

    total = 0
    for name, dtype in df.schema.items():
        col = df.get_column(name)
        if dtype == pl.String:
            long = col.str.len_bytes()
            total += 16 * col.len() + int(long.filter(long > 12).sum() or 0)
        else:
            total += col.estimated_size()
    return total


def _scenario(gpus: int):
    from gpuvigil.sim.scenario import Scenario

    nodes = max(1, gpus // 8)
    job_gpus = 64 if gpus >= 640 else 8
    n_jobs = int(gpus * 0.8) // job_gpus
    jobs = [
        {"name": f"job-{i:05d}", "gpus": job_gpus, "gpus_per_node": 8, "step_time_seconds": 0.5 + (i % 7) * 0.4, "checkpoint_every_steps": 1000}
        for i in range(n_jobs)
    ]
    return Scenario.model_validate({"name": f"bench-{gpus}", "nodes": nodes, "duration_seconds": 1e6, "jobs": jobs})


def steady_warmup_ticks(window, tick_seconds: float) -> int:
    """Ticks until the longest history among the per-key streams is full (at least the OOM fit's
    90 s look-back)."""
    from gpuvigil.window import LATEST_KEYS

    longest = max([WARMUP_SECONDS, *(window.horizon(s) for s in LATEST_KEYS)])
    return int(math.ceil(longest / tick_seconds))


HOOK_STREAMS = ("rank_progress", "allocator_stats")


class _WithoutHook:
    """The simulated collector with the in-process hook's streams dropped: every job is then an
    L0 job (device telemetry, logs and the scheduler only), as on a fleet whose operators cannot
    change their users' training code. What reads gpu_samples' history then runs for every job."""

    def __init__(self, inner: Any):
        self.inner, self.name = inner, inner.name
        self.streams = {s: v for s, v in inner.streams.items() if s not in HOOK_STREAMS}

    @property
    def errors(self) -> int:
        return self.inner.errors

    def collect(self, now: float) -> dict[str, Any]:
        return {s: df for s, df in self.inner.collect(now).items() if s not in HOOK_STREAMS}


def measure(gpus: int, ticks: int, warmup_ticks: int | None = None, hook: bool = True) -> dict[str, Any]:
    """Run in the worker process: warm up, then time `ticks` ticks stage by stage."""
    import polars as pl

    from gpuvigil import schemas
    from gpuvigil.app.runtime import build_simulated

    t_build = time.perf_counter()
    rss_start = _rss_bytes()
    rt = build_simulated(_scenario(gpus), seed=0)
    build_s = time.perf_counter() - t_build
    rss_built = _rss_bytes()  # imports, the simulated cluster and the scheduler: before any tick
    pipe = rt.pipeline
    if not hook:
        pipe.collectors = [_WithoutHook(c) if c.name == "simulated" else c for c in pipe.collectors]
    # Steady state: warm up until the history of every per-key stream (gpu_samples, rank_progress,
    # allocator_stats) is at its full horizon, so the peak RSS is that of a long run,
    # not extrapolated. Sparse streams (events, kept an hour, a few rows) are not waited for.
    warmup = steady_warmup_ticks(pipe.window, rt.tick_seconds) if warmup_ticks is None else warmup_ticks
    for _ in range(warmup):
        rt.step()
    metric_cols = [c for c, t in schemas.GPU_SAMPLES.items() if c not in ("ts", "node", "gpu", "gpu_uuid")]

    class Timed:
        """Times a collector and counts the rows it emits, inside the real pipeline tick."""

        def __init__(self, inner):
            self.inner, self.name, self.streams = inner, inner.name, inner.streams
            self.seconds, self.cpu_seconds, self.gpu_rows, self.other_rows = 0.0, 0.0, 0, 0

        @property
        def errors(self) -> int:
            return self.inner.errors

        def collect(self, now: float) -> dict[str, pl.DataFrame]:
            t0, c0 = time.perf_counter(), time.process_time()
            frames = self.inner.collect(now)
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0
            for stream, df in frames.items():
                if stream == "gpu_samples":
                    self.gpu_rows += df.height
                else:
                    self.other_rows += df.height
            return frames

    timed = [Timed(c) for c in pipe.collectors]
    pipe.collectors = timed
    # CPU time per detector (detect and, on ticks it is not due, ingest), measured in place so
    # the pipeline still sees the detector itself (its level, streams, ingest).
    detector_cpu = {d.name: 0.0 for d in pipe.detectors}
    tick_detector_cpu: dict[str, float] = {}

    def cpu_timed(name, fn):
        def run(window):
            c0 = time.process_time()
            try:
                return fn(window)
            finally:
                spent = time.process_time() - c0
                detector_cpu[name] += spent
                tick_detector_cpu[name] = tick_detector_cpu.get(name, 0.0) + spent

        return run

    for d in pipe.detectors:
        d.detect = cpu_timed(d.name, d.detect)
        if getattr(d, "ingest", None) is not None:
            d.ingest = cpu_timed(d.name, d.ingest)
    tick_times, tick_cpu, all_due_wall, all_due_cpu = [], [], [], []
    all_due_detectors: dict[str, float] = {}
    detector_totals = {d.name: 0.0 for d in pipe.detectors}
    collect_cpu_before = 0.0
    for _ in range(ticks):
        # The production tick: detectors run at their configured periods
        # (config pipeline.detector_every_seconds), findings merged, hints issued.
        tick_detector_cpu.clear()
        c0 = time.process_time()
        result = rt.step()
        cpu = time.process_time() - c0
        collect_cpu_now = sum(t.cpu_seconds for t in timed)
        gpuvigil_cpu = cpu - (collect_cpu_now - collect_cpu_before)  # the simulator's collect apart
        collect_cpu_before = collect_cpu_now
        tick_times.append(result.duration_seconds)
        tick_cpu.append(gpuvigil_cpu)
        for name, sec in result.detector_seconds.items():
            detector_totals[name] += sec
        ran = {n for n, t in pipe._detector_last_run.items() if t == result.now}
        if ran and ran >= set(pipe._detector_last_run):
            # Every detector that runs at all was due on this tick: the worst case.
            all_due_wall.append(result.duration_seconds)
            all_due_cpu.append(gpuvigil_cpu)
            if gpuvigil_cpu >= max(all_due_cpu):
                all_due_detectors = dict(tick_detector_cpu)
    collect_s = sum(t.seconds for t in timed)
    collect_cpu = sum(t.cpu_seconds for t in timed)
    gpu_rows = sum(t.gpu_rows for t in timed)
    other_rows = sum(t.other_rows for t in timed)
    detect_s = sum(detector_totals.values())
    window_s = sum(tick_times) - collect_s - detect_s  # window seal, findings lifecycle, hints, sinks
    total = collect_s + window_s + detect_s
    window_rows = {s: pipe.window.get(s).height for s in pipe.window.streams()}
    # Resident bytes per stream, and what it holds once every stream's horizon is full (the
    # timed run ends after warm-up + ticks seconds: a stream kept longer than that grows by the
    # same rows per second until then; extrapolated, not measured).
    win = pipe.window
    resident = {s: resident_bytes(win.get(s)) for s in win.streams()}
    latest = {s: resident_bytes(df) for s, df in getattr(win, "_latest", {}).items()}
    covered = (warmup + ticks) * rt.tick_seconds
    full = {
        s: int(b * win.horizon(s) / covered) if s not in SNAPSHOTS and win.horizon(s) > covered and win.get(s).height else b
        for s, b in resident.items()
    }
    straggler = next((d for d in pipe.detectors if d.name == "straggler"), None)
    ring = getattr(straggler, "_ring", None)
    ring_bytes = sum(a.nbytes for a in ring._arrays()) if ring is not None else 0
    array_bytes = {d.name: _array_bytes(d) for d in pipe.detectors}
    window_bytes = sum(pipe.window.get(s).estimated_size() for s in pipe.window.streams())
    samples = gpu_rows * len(metric_cols)
    gv_cpu = sum(tick_cpu)
    return {
        "gpus": gpus,
        "ticks": ticks,
        "warmup_ticks": warmup,
        "ranks": sum(j.cfg.gpus for j in rt.cluster.jobs.values()) if rt.cluster else 0,
        "metrics_per_gpu_sample": len(metric_cols),
        "gpu_metric_samples_per_second": samples / total,
        # One core's worth: samples over gpuvigil's own CPU time (the simulator's collect apart).
        "gpu_metric_samples_per_cpu_second": samples / gv_cpu if gv_cpu > 0 else 0.0,
        "tick_cpu_seconds_mean": gv_cpu / ticks,
        "tick_cpu_seconds_max": max(tick_cpu),
        "all_due_ticks": len(all_due_cpu),
        "all_due_tick_cpu_seconds_max": max(all_due_cpu) if all_due_cpu else None,
        "all_due_tick_seconds_max": max(all_due_wall) if all_due_wall else None,
        "all_due_detector_cpu_seconds": {k: v for k, v in sorted(all_due_detectors.items())},
        "collect_cpu_seconds_per_tick": collect_cpu / ticks,
        "detector_cpu_seconds_per_tick": {k: v / ticks for k, v in sorted(detector_cpu.items())},
        "window_bytes": window_bytes,
        "window_bytes_by_stream": {s: pipe.window.get(s).estimated_size() for s in pipe.window.streams()},
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
        "rss_start_bytes": rss_start,
        "rss_after_build_bytes": rss_built,
        "rss_end_bytes": _rss_bytes(),
        "window_resident_bytes_by_stream": resident,
        "window_latest_rows_bytes": sum(latest.values()),
        "window_columns": {s: win.columns(s) for s in win.streams() if win.columns(s) is not None},
        "window_horizon_seconds": {s: win.horizon(s) for s in win.streams()},
        "window_resident_bytes_full_horizon": full,
        "straggler_ring_bytes": ring_bytes,
        "detector_array_bytes": {k: v for k, v in sorted(array_bytes.items()) if v},
        "covered_seconds": covered,
        "build_seconds": build_s,
        "sample_seconds": rt.tick_seconds,
        "hook": hook,
    }


def _array_bytes(obj: Any, depth: int = 2) -> int:
    """Bytes of the numpy arrays a detector holds: its attributes, and theirs (its rings, slots)."""
    import numpy as np

    total = 0
    for v in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(v, np.ndarray):
            total += v.nbytes
        elif isinstance(v, dict):
            total += sum(a.nbytes for a in v.values() if isinstance(a, np.ndarray))
        elif depth > 1 and hasattr(v, "__dict__") and not isinstance(v, type):
            total += _array_bytes(v, depth - 1)
    return total


def run_worker(gpus: int, ticks: int, warmup: int | None, hook: bool = True) -> dict[str, Any]:
    env = dict(os.environ, POLARS_MAX_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "benchmarks.pipeline", "--worker", str(gpus), str(ticks), "" if warmup is None else str(warmup), "hook" if hook else "nohook"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark worker for {gpus} GPUs failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kept(row: dict[str, Any]) -> str:
    from gpuvigil import schemas

    cols, horizon = row.get("window_columns", {}), row.get("window_horizon_seconds", {})
    return "; ".join(
        f"{s} {horizon[s]:.0f} s" + (f", {len(cols[s])} of {len(schemas.STREAMS[s])} columns" if s in cols else "")
        for s in ("gpu_samples", "allocator_stats", "rank_progress")
        if s in horizon
    )


FLEETS = {
    "hooked": "every job runs the in-process hook (L2: rank progress and allocator statistics besides device telemetry)",
    "l0": "no job runs the hook (`--fleet l0`): every job is an L0 job, seen through device telemetry, per-process memory and the scheduler's job map only: what most operators have, since they cannot change their users' training code",
}


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, bool | None]]:
    """(what, threshold, measured, ok): the tick targets hold at 100,000 GPUs, so a run without
    that size leaves them not measured; throughput is judged at the largest size run, memory on
    every size run."""
    big = next((r for r in rows if r["gpus"] >= 100_000), None)
    out: list[tuple[str, str, str, bool | None]] = []
    if big is None:
        largest = max(r["gpus"] for r in rows)
        why = f"– (largest size run: {largest:,} GPUs; `--gpus 100000` measures it)"
        out += [("100,000-GPU tick, gpuvigil CPU, mean", f"< {TARGET_TICK_SECONDS_AT_100K:g} s", why, None),
                ("100,000-GPU tick, gpuvigil CPU, worst tick with every detector due", f"< {TARGET_TICK_SECONDS_AT_100K:g} s", why, None)]
    else:
        worst = big["all_due_tick_cpu_seconds_max"]
        out += [("100,000-GPU tick, gpuvigil CPU, mean", f"< {TARGET_TICK_SECONDS_AT_100K:g} s", f"{big['tick_cpu_seconds_mean']:.3f} s",
                 big["tick_cpu_seconds_mean"] < TARGET_TICK_SECONDS_AT_100K),
                ("100,000-GPU tick, gpuvigil CPU, worst tick with every detector due", f"< {TARGET_TICK_SECONDS_AT_100K:g} s",
                 "– (no tick had every detector due)" if worst is None else f"{worst:.3f} s", None if worst is None else worst < TARGET_TICK_SECONDS_AT_100K)]
    # Throughput is a target at scale: per-tick fixed costs dominate a small cluster.
    top = max(rows, key=lambda r: r["gpus"])
    out.append(("GPU-metric samples per gpuvigil CPU-second, largest size run", f"≥ {TARGET_SAMPLES_PER_SECOND:,}",
                f"{top['gpu_metric_samples_per_cpu_second']:,.0f} (at {top['gpus']:,} GPUs)", top["gpu_metric_samples_per_cpu_second"] >= TARGET_SAMPLES_PER_SECOND))
    high = max(rows, key=lambda r: r["peak_rss_bytes"])
    if all(_steady(r) for r in rows):
        out.append(("peak RSS at steady state, every size run", f"< {TARGET_PEAK_RSS_BYTES / 1e9:.0f} GB",
                    f"{high['peak_rss_bytes'] / 1e9:.2f} GB (at {high['gpus']:,} GPUs)", high["peak_rss_bytes"] < TARGET_PEAK_RSS_BYTES))
    else:
        out.append(("peak RSS at steady state, every size run", f"< {TARGET_PEAK_RSS_BYTES / 1e9:.0f} GB",
                    f"– (histories not at their full horizon: `--warmup` cut short; {high['peak_rss_bytes'] / 1e9:.2f} GB so far)", None))
    return out


def _steady(row: dict[str, Any]) -> bool:
    """Whether every per-key stream's history was at its full horizon when the run ended."""
    horizon = row.get("window_horizon_seconds", {})
    return row.get("covered_seconds", 0.0) >= max([0.0, *(horizon.get(s, 0.0) for s in ("gpu_samples", "allocator_stats", "rank_progress"))])


def markdown(rows: list[dict[str, Any]], cmd: str | None = None) -> str:
    from benchmarks.report import provenance, targets_table

    l0 = not rows[-1].get("hook", True)
    rate = rows[-1].get("sample_seconds", 1.0)
    head = (
        ("## Pipeline throughput, L0 fleet\n\n" if l0 else "## Pipeline throughput, hooked fleet\n\n")
        + provenance(
            cmd or "gpuvigil bench pipeline",
            f"**simulated** cluster (gpuvigil's simulator, no real GPUs; every stream sampled once per {rate:g} s tick, faster than "
            "dcgm-exporter's 30 s or a Prometheus history's 15-60 s), 80% of GPUs in 64-GPU jobs. "
            f"Fleet: {FLEETS['l0' if l0 else 'hooked']}.",
        )
        + "\n\n"
        + "\n".join(targets_table(targets(rows)))
        + "\n\n"
        "The production tick (`Pipeline.tick`: detectors at their configured periods, findings merged, hints to the scheduler), one core (polars single-threaded), "
        + (f"windows warmed until every per-key stream's history is at its full horizon (steady state: {rows[-1]['warmup_ticks']} warm-up ticks at the largest size, "
           if _steady(rows[-1]) else f"windows warmed for {rows[-1]['warmup_ticks']} ticks only, short of the steady state (`--warmup`; "
           )
        + f"{rows[-1]['ticks']} timed ticks; "
        "each stream's history is kept as long as its longest reader looks back and holds only the columns some detector reads ("
        + _kept(rows[-1])
        + "; the latest tick and each key's newest row keep every column; "
        + (
            "the device-level detectors keep their own per-GPU rings of the few values they read, so gpu_samples' history in the window is short)). "
            if l0
            else "rows older than a few seconds only for the keys their readers still need, `Window.retain`: rank_progress beyond 65 s only for jobs with long steps, "
            "gpu_samples beyond 10 s only for GPUs of L0/L1 jobs, none in this all-L2 simulated cluster)). "
        )
        + f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end of the run; "
        "wall times count waiting for a core on a shared machine, CPU time (process time) does not, so CPU time is the figure the targets read. "
        "`gpuvigil` columns exclude the simulator's own `collect`, which is reported apart (a real NVML/DCGM collector is I/O-bound instead).\n\n"
        "| GPUs | ranks | gpuvigil tick CPU mean (s) | worst tick CPU, all detectors due (s) | same, wall (s) | simulator collect CPU (s) | GPU-metric samples/s per gpuvigil CPU-second | GPU-metric samples/s, wall, incl. simulator | tick wall mean (s) | window rows | RSS before the first tick (MiB) | peak RSS (MiB) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    body = "".join(
        f"| {r['gpus']:,} | {r['ranks']:,} | {r['tick_cpu_seconds_mean']:.3f} | {num(r['all_due_tick_cpu_seconds_max'], '.3f')} | {num(r['all_due_tick_seconds_max'], '.3f')} | "
        f"{r['collect_cpu_seconds_per_tick']:.3f} | {r['gpu_metric_samples_per_cpu_second']:,.0f} | {r['gpu_metric_samples_per_second']:,.0f} | "
        f"{r['tick_seconds_mean']:.3f} | {r['window_rows']:,} | {r.get('rss_after_build_bytes', 0) / 2**20:,.0f} | {r['peak_rss_bytes'] / 2**20:,.0f} |\n"
        for r in rows
    )
    notes = []
    if len(rows) > 1 and rows[0]["tick_cpu_seconds_mean"] > 0:
        a, b = rows[0], rows[-1]
        notes.append(
            f"- Cost growth {a['gpus']:,} → {b['gpus']:,} GPUs ({b['gpus'] / a['gpus']:.0f}×): gpuvigil tick CPU ×{b['tick_cpu_seconds_mean'] / a['tick_cpu_seconds_mean']:.0f} mean, "
            + (f"×{b['all_due_tick_cpu_seconds_max'] / a['all_due_tick_cpu_seconds_max']:.0f} worst; " if a["all_due_tick_cpu_seconds_max"] and b["all_due_tick_cpu_seconds_max"] else "")
            + f"simulator collect ×{b['collect_cpu_seconds_per_tick'] / max(a['collect_cpu_seconds_per_tick'], 1e-9):.0f}."
        )
    big = rows[-1]
    costly = sorted(big["all_due_detector_cpu_seconds"].items(), key=lambda kv: -kv[1])[:6]
    if costly:
        notes.append(f"- Detector CPU on the worst tick at {big['gpus']:,} GPUs: " + ", ".join(f"{k} {v:.3f} s" for k, v in costly) + ".")
    mean = sorted(big["detector_cpu_seconds_per_tick"].items(), key=lambda kv: -kv[1])[:6]
    notes.append(f"- Detector CPU per tick at {big['gpus']:,} GPUs (mean over the timed ticks): " + ", ".join(f"{k} {v:.3f} s" for k, v in mean) + ".")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        notes.append(
            "- Peak RSS by size: " + " → ".join(f"{r['gpus']:,}: {r['peak_rss_bytes'] / 2**20:,.0f} MiB" for r in rows)
            + f" (×{b['peak_rss_bytes'] / a['peak_rss_bytes']:.0f} for ×{b['gpus'] / a['gpus']:.0f} GPUs)."
        )
    res = big.get("window_resident_bytes_by_stream")
    if res:
        held = sorted(res.items(), key=lambda kv: -kv[1])[:3]
        full = big["window_resident_bytes_full_horizon"]
        grow = sum(full.values()) - sum(res.values())
        notes.append(
            f"- Where {big['gpus']:,} GPUs' peak RSS goes: {big['rss_after_build_bytes'] / 2**20:,.0f} MiB before the first tick (interpreter, libraries, the simulated cluster); "
            f"the window's buffers at the end {sum(res.values()) / 2**20:,.0f} MiB after {big['covered_seconds']:.0f} s (" + ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in held)
            + f"; every column of each key's newest row {big['window_latest_rows_bytes'] / 2**20:,.0f}); "
            + "detectors' numpy state (rings, slots) "
            + (", ".join(f"{k} {v / 2**20:,.0f}" for k, v in sorted(big.get("detector_array_bytes", {}).items(), key=lambda kv: -kv[1])[:3] if v >= 2**20) or "under 1")
            + " MiB; "
            "the rest is detector state, one tick's transient frames and allocator slack."
        )
        if _steady(big):
            notes.append(
                f"- Steady state: every per-key stream's history was at its full horizon ({big['warmup_ticks']} warm-up ticks), so the peak RSS above is measured, not extrapolated"
                + "."
            )
        else:
            notes.append(
                f"- Full horizons (extrapolated, not measured): the window would hold {sum(full.values()) / 2**20:,.0f} MiB "
                + "(" + ", ".join(f"{k} {full[k] / 2**20:,.0f} MiB for {big['window_horizon_seconds'][k]:.0f} s" for k, _ in held) + "), "
                f"so the steady-state peak is about {(big['peak_rss_bytes'] + grow) / 2**20:,.0f} MiB"
                + f" ({(big['peak_rss_bytes'] + grow) / 1e9:.2f} GB)."
            )
    else:
        held = sorted(big.get("window_bytes_by_stream", {}).items(), key=lambda kv: -kv[1])[:3]
        if held:
            notes.append(
                f"- Window at the end, {big['gpus']:,} GPUs (polars estimated size): {big['window_bytes'] / 2**30:.2f} GiB, of which "
                + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in held)
                + "."
            )
    return head + body + "\n" + "\n".join(notes) + "\n"


def cmd_bench_pipeline(args) -> int:
    from gpuvigil.errors import UserError

    try:
        sizes = [int(x) for x in args.gpus.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--gpus takes comma-separated whole numbers, got {args.gpus!r}") from None
    if not sizes or any(s < 8 for s in sizes):
        raise UserError("--gpus: each size must be >= 8")
    fleets = ["l0"] if args.no_hook else (["hooked", "l0"] if args.fleet == "both" else [args.fleet])
    rows = []
    by_fleet: dict[str, list[dict[str, Any]]] = {}
    for fleet in fleets:
        for gpus in sizes:
            row = run_worker(gpus, args.ticks, args.warmup, hook=fleet == "hooked")
            rows.append(row)
            by_fleet.setdefault(fleet, []).append(row)
            if not args.json:
                print(
                    f"{fleet:>6} {gpus:>8,} GPUs: {row['gpu_metric_samples_per_cpu_second']:>14,.0f} GPU-metric samples/CPU-s, tick CPU {row['tick_cpu_seconds_mean']:.3f} s "
                    f"(worst, all due: {row['all_due_tick_cpu_seconds_max'] or 0:.3f} s), simulator {row['collect_cpu_seconds_per_tick']:.3f} s, peak {row['peak_rss_bytes'] / 2**20:,.0f} MiB",
                    file=sys.stderr,
                )
    if not args.no_write:
        from benchmarks.report import command, write_section

        for fleet, fleet_rows in by_fleet.items():
            write_section("pipeline" if fleet == "hooked" else "pipeline-l0", markdown(fleet_rows, command("pipeline")))
    if args.json:
        print(json.dumps({"sizes": rows}, sort_keys=True))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="samples/s through collect → window → detect, and tick time")
    p.add_argument("--gpus", default="1000,10000,100000", help="comma-separated cluster sizes (GPUs)")
    p.add_argument("--ticks", type=int, default=10, help="timed ticks per size")
    p.add_argument("--warmup", type=int, default=None, help="warm-up ticks (default: until every per-key stream's history is at its full horizon, the steady state)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--fleet", choices=("hooked", "l0", "both"), default="both", help="hooked: every job runs the in-process hook (L2); l0: none does (device telemetry only); both (default): one after the other, each its own table")
    p.add_argument("--no-hook", action="store_true", help="the same as --fleet l0: drop the in-process hook's streams (rank_progress, allocator_stats), every job is an L0 job")
    p.set_defaults(func=cmd_bench_pipeline)


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--worker":
    warm = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
    print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]), warm, hook=len(sys.argv) <= 5 or sys.argv[5] != "nohook")))
