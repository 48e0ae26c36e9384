"""One-shot check on a machine with a real NVIDIA GPU (run once on an H200):

1. the NVML collector samples every GPU for the whole run (every 0.5 s, from a thread) while a
   real CUDA training loop runs, and we record which GPU_SAMPLES fields came back non-null, the
   fields NVML reported NotSupported, the per-process rows (with attribution), and any events;
2. the in-process hook runs inside that training loop (~100 ms steps: bf16 MLP forward and
   backward, an NCCL all_reduce of the gradients in a world of one, so that the Flight Recorder
   is live) and its overhead is measured by alternating blocks of steps with and without it;
3. `gpuvigil bench hook --quick` runs there too (micro costs including the CUDA allocator path).

Results go to OUT/device_check.json (and the hook's per-rank JSONL file to OUT/hook/). On a
machine without a GPU it runs the same steps on the CPU with gloo, to test the script itself.

    python scripts/device_check.py --out DIR [--blocks 3] [--steps-per-block 30]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")


def sample_nvml(results: dict, stop: threading.Event) -> None:
    from gpuvigil.collectors.nvml import NvmlCollector, NvmlUnavailable

    try:
        collector = NvmlCollector(node="device-check")
    except NvmlUnavailable as exc:
        results["nvml_unavailable"] = str(exc)
        return
    frames, procs, events = [], [], []
    t_end = None
    try:
        results["nvml_event_types_registered"] = collector.event_types_registered
        while not stop.is_set():
            out = collector.collect(time.time())
            frames.append(out["gpu_samples"])
            procs.append(out["gpu_processes"])
            if "events" in out:
                events.append(out["events"])
            stop.wait(0.5)
        t_end = time.time()
    finally:
        collector.stop()
    import polars as pl

    samples = pl.concat(frames)
    results["nvml_samples"] = samples.height
    results["nvml_fields_non_null"] = sorted(c for c in samples.columns if samples[c].null_count() < samples.height)
    results["nvml_fields_null"] = sorted(c for c in samples.columns if samples[c].null_count() == samples.height)
    results["nvml_not_supported"] = collector.not_supported
    results["nvml_errors"] = collector.errors
    numeric = [c for c in ("memory_used_bytes", "memory_total_bytes", "util_ratio", "power_w", "temperature_c", "sm_clock_mhz", "mem_clock_mhz", "throttle_reasons",
                           "ecc_sbe_volatile_total", "ecc_dbe_volatile_total", "ecc_sbe_aggregate_total", "retired_pages_total", "pcie_replay_total") if c in samples.columns]
    results["nvml_ranges"] = {c: [samples[c].min(), samples[c].max()] for c in numeric}
    results["nvml_first_row"] = samples.row(0, named=True)
    p = pl.concat(procs)
    results["nvml_process_rows"] = p.height
    results["nvml_processes"] = p.unique(subset=["pid"]).select("gpu", "pid", "used_memory_bytes", "slurm_job", "pod_uid").rows()
    results["nvml_events"] = pl.concat(events).rows(named=True) if events else []
    results["nvml_seconds"] = t_end - results["t0"] if t_end else None


def training_loop(results: dict, out: Path, blocks: int, steps_per_block: int) -> None:
    import torch
    import torch.distributed as dist

    import gpuvigil.hook.instrument as gv

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda:0") if cuda else None)
    width = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)]).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(4096 if cuda else 256, width, device=device, dtype=dtype)

    def step(reps: int) -> float:
        for _ in range(reps):
            loss = model(x).float().pow(2).mean()
            loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # gradient sync: a real NCCL collective per step, recorded by the Flight Recorder
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # synchronises, as a real loop logging its loss does

    step(1)
    t0 = time.perf_counter()
    for _ in range(3):
        step(1)
    one = (time.perf_counter() - t0) / 3
    reps = max(1, round(0.100 / one))
    results["step_reps"] = reps
    results["device"] = torch.cuda.get_device_name() if cuda else "cpu"

    hook = gv.start(job="device-check", sink=gv.FileSink(out / "hook"), rank=0, node="device-check", gpu=0 if cuda else None, interval=1.0)
    with_hook, without = [], []
    for block in range(2 * blocks):
        use_hook = block % 2 == 1
        times = with_hook if use_hook else without
        for _ in range(steps_per_block):
            t = time.perf_counter()
            step(reps)
            if use_hook:
                hook.step()
            times.append(time.perf_counter() - t)
    publishes = hook.published
    hook.stop()
    dist.destroy_process_group()
    mean_with, mean_without = statistics.fmean(with_hook), statistics.fmean(without)
    results["hook"] = {
        "steps_each": len(with_hook),
        "step_ms_without_mean": mean_without * 1e3,
        "step_ms_with_mean": mean_with * 1e3,
        "step_ms_without_median": statistics.median(without) * 1e3,
        "step_ms_with_median": statistics.median(with_hook) * 1e3,
        "overhead_pct_mean": (mean_with - mean_without) / mean_without * 100,
        "overhead_pct_median": (statistics.median(with_hook) - statistics.median(without)) / statistics.median(without) * 100,
        "publishes": publishes,
        "errors": hook.errors,
        "last_error": hook.last_error,
    }
    from gpuvigil.collectors.hook import HookCollector

    frames = HookCollector([out / "hook"]).collect(time.time())
    results["hook_rank_progress_last"] = frames["rank_progress"].row(-1, named=True) if "rank_progress" in frames else None
    results["hook_allocator_stats_last"] = frames["allocator_stats"].row(-1, named=True) if "allocator_stats" in frames else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps-per-block", type=int, default=30)
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"t0": time.time(), "python": sys.version.split()[0]}
    try:
        import pynvml

        results["pynvml"] = getattr(pynvml, "__version__", None) or "present"
    except ImportError:
        results["pynvml"] = None

    if not args.no_bench:
        from benchmarks import hook as bench

        t = time.time()
        results["bench_hook"] = bench.run(quick=True)
        results["bench_hook_markdown"] = bench.markdown(results["bench_hook"])
        results["bench_seconds"] = time.time() - t

    stop = threading.Event()
    sampler = threading.Thread(target=sample_nvml, args=(results, stop), daemon=True)
    results["t0"] = time.time()
    sampler.start()
    try:
        training_loop(results, args.out, args.blocks, args.steps_per_block)
    finally:
        time.sleep(1.0)  # a last NVML sample after the load
        stop.set()
        sampler.join(timeout=30)
    (args.out / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    summary = {k: results.get(k) for k in ("device", "pynvml", "nvml_unavailable", "nvml_samples", "nvml_fields_non_null", "nvml_fields_null", "nvml_not_supported",
                                            "nvml_errors", "nvml_processes", "nvml_events", "hook", "hook_rank_progress_last", "hook_allocator_stats_last")}
    print(json.dumps(summary, indent=1, default=str))
    if results.get("bench_hook_markdown"):
        print(results["bench_hook_markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
