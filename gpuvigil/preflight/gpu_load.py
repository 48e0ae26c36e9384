"""The preflight's checks that load the GPUs through torch: memory written and read back plus a
matmul for a few seconds on each GPU, and an all-reduce across the node's GPUs (NCCL; a single GPU
is a loopback). Skipped where torch is not installed; torch is imported only here, only when run."""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuvigil.preflight.config import NcclCheckConfig, TorchLoadCheckConfig
from gpuvigil.preflight.result import CheckResult, Problem
from gpuvigil.util.textsafe import printable

_CHUNK = 256 << 20  # memory is written and verified in chunks this size: a check never needs twice the memory


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def load_device(device: str, *, seconds: float, memory_bytes: int, n: int, chunk_bytes: int = _CHUNK) -> dict[str, Any]:
    """Fill `memory_bytes` of `device` with seeded random words, run an n×n matmul for `seconds`,
    then read the memory back. Returns what went wrong (mismatched chunks, a wrong or non-finite
    product) and the matmul's TFLOP/s."""
    import torch

    dev = torch.device(device)
    words = chunk_bytes // 4
    chunks = [torch.empty(words, dtype=torch.int32, device=dev) for _ in range(max(1, memory_bytes // chunk_bytes))]
    gen = torch.Generator(device=dev)

    def pattern(k: int) -> Any:
        gen.manual_seed(1_000_003 * (k + 1))
        return torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device=dev, generator=gen)

    for k, c in enumerate(chunks):
        c.copy_(pattern(k))
    dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    gen.manual_seed(7)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    c = a @ b
    _sync(torch, dev)
    iters, start = 0, time.perf_counter()
    while True:
        c = a @ b
        iters += 1
        if iters % 8 == 0:
            _sync(torch, dev)
            if time.perf_counter() - start >= seconds:
                break
    _sync(torch, dev)
    elapsed = time.perf_counter() - start
    # The product checked against float32 on a slice: a GPU that computes wrongly but fast fails.
    ref = a[:32].float() @ b.float()
    got = c[:32].float()
    finite = bool(torch.isfinite(c).all())
    rel = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    bad_chunks = [k for k, ch in enumerate(chunks) if not torch.equal(ch, pattern(k))]
    del chunks
    return {
        "device": str(dev),
        "tflops": 2.0 * n**3 * iters / elapsed / 1e12,
        "iterations": iters,
        "memory_bytes": max(1, memory_bytes // chunk_bytes) * chunk_bytes,
        "chunks": max(1, memory_bytes // chunk_bytes),
        "bad_chunks": bad_chunks,
        "finite": finite,
        "relative_error": rel,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _sync(torch: Any, dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check_torch_load(cfg: TorchLoadCheckConfig, nvml_gpus: int) -> CheckResult:
    torch = _torch()
    if torch is None:
        return CheckResult.skipped("torch_load", "torch not installed")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        if cfg.no_cuda == "ignore":
            return CheckResult.skipped("torch_load", "torch sees no CUDA device")
        return CheckResult.of("torch_load", [Problem(level=cfg.no_cuda, message=f"torch sees no CUDA device while NVML lists {nvml_gpus} GPU(s)")])
    problems: list[Problem] = []
    results: list[dict[str, Any]] = []
    count = torch.cuda.device_count()
    if count != nvml_gpus:
        problems.append(Problem(level="warn", message=f"torch sees {count} CUDA device(s), NVML {nvml_gpus}"))
    for i in range(count):
        try:
            free, _total = torch.cuda.mem_get_info(i)
            r = load_device(f"cuda:{i}", seconds=cfg.seconds, memory_bytes=int(free * cfg.memory_share), n=cfg.matrix_size)
        except Exception as exc:  # noqa: BLE001 - a CUDA error here is the finding
            problems.append(Problem(level="fail", message=f"GPU {i}: load failed: {printable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, 200)}"))
            continue
        finally:
            torch.cuda.empty_cache()
        results.append(r)
        problems.extend(judge_load(i, r, cfg))
    best = min((r["tflops"] for r in results), default=0.0)
    return CheckResult.of("torch_load", problems, note=f"{len(results)} GPU(s), slowest {best:.1f} TFLOP/s", detail={"gpus": results})


def judge_load(gpu: int, r: dict[str, Any], cfg: TorchLoadCheckConfig) -> list[Problem]:
    out: list[Problem] = []
    if r["bad_chunks"]:
        out.append(Problem(level="fail", message=f"GPU {gpu}: memory read back wrong in {len(r['bad_chunks'])} of {r['chunks']} chunk(s)"))
    if not r["finite"] or r["relative_error"] > 0.05:
        out.append(Problem(level="fail", message=f"GPU {gpu}: matmul result wrong (relative error {r['relative_error']:.3g}, finite {r['finite']})"))
    if cfg.min_tflops is not None and r["tflops"] < cfg.min_tflops:
        out.append(Problem(level="warn", message=f"GPU {gpu}: matmul {r['tflops']:.1f} TFLOP/s, expected at least {cfg.min_tflops:g}"))
    return out


# ------------------------------------------------------------------------------- all-reduce


def _allreduce_worker(rank: int, world: int, backend: str, store: str, size_bytes: int, iterations: int, timeout_s: float, out_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dev = torch.device(f"cuda:{rank}")
        else:
            dev = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        t = torch.empty(max(1, size_bytes // 4), dtype=torch.float32, device=dev)
        t.fill_(rank + 1.0)
        dist.all_reduce(t)  # warm-up; also the correctness check
        expected = world * (world + 1) / 2.0
        result["correct"] = bool(torch.all(t == expected))
        _sync(torch, dev)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(t)
        _sync(torch, dev)
        elapsed = time.perf_counter() - start
        alg = t.numel() * 4 * iterations / elapsed / 1e9
        # nccl-tests' bus bandwidth: what each link carried, comparable across world sizes.
        result["bus_gbps"] = alg * (2.0 * (world - 1) / world) if world > 1 else alg
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which judges
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_allreduce(world: int, cfg: NcclCheckConfig) -> list[dict[str, Any]]:
    """All-reduce across `world` processes (one per GPU for NCCL); each rank's result, or an
    `error` for a rank that did not report within the timeout."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gpuvigil-preflight-") as tmp:
        store = str(Path(tmp) / "store")
        args = (world, cfg.backend, store, int(cfg.size_mib * (1 << 20)), cfg.iterations, cfg.timeout_seconds, tmp)
        procs = [ctx.Process(target=_allreduce_worker, args=(r, *args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg.timeout_seconds + 30  # spawning and importing torch come first
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        out = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(5)
            path = Path(tmp) / f"rank{r}.json"
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                out.append({"rank": r, "error": "did not finish in time" if p.exitcode is None or p.exitcode < 0 else f"exited {p.exitcode} without a result"})
        return out


def check_nccl(cfg: NcclCheckConfig, nvml_gpus: int) -> CheckResult:
    torch = _torch()
    if torch is None:
        return CheckResult.skipped("nccl", "torch not installed")
    if cfg.backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return CheckResult.skipped("nccl", "torch sees no CUDA device (reported by torch_load)")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return CheckResult.skipped("nccl", "this torch has no NCCL")
        world = torch.cuda.device_count()
    else:
        world = max(2, nvml_gpus)
    return judge_allreduce(run_allreduce(world, cfg), cfg)


def judge_allreduce(results: list[dict[str, Any]], cfg: NcclCheckConfig) -> CheckResult:
    problems: list[Problem] = []
    for r in results:
        if r.get("error"):
            problems.append(Problem(level="fail", message=f"rank {r['rank']}: {cfg.backend} all-reduce failed: {printable(r['error'], 200)}"))
        elif not r.get("correct"):
            problems.append(Problem(level="fail", message=f"rank {r['rank']}: {cfg.backend} all-reduce gave a wrong sum"))
    bws = [r["bus_gbps"] for r in results if "bus_gbps" in r]
    slowest = min(bws, default=0.0)
    if bws and cfg.min_bus_gbps is not None and slowest < cfg.min_bus_gbps:
        problems.append(Problem(level="warn", message=f"{cfg.backend} all-reduce bus bandwidth {slowest:.1f} GB/s, expected at least {cfg.min_bus_gbps:g}"))
    note = f"{len(results)} rank(s), {cfg.size_mib:g} MiB, bus {slowest:.1f} GB/s"
    return CheckResult.of("nccl", problems, note=note, detail={"ranks": results})
