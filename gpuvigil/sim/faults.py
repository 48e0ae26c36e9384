"""Fault models of the simulated cluster: shapes and parameters taken from published or captured
behaviour, never from the detectors. No module of `gpuvigil.sim` imports a detector, a parser or
their configuration (tests/test_sim_independence.py checks it), so a benchmark on the simulator
measures the detectors against faults they were not written to match.

Sources:
- PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): every request is rounded
  up to 512 B (kMinBlockSize); requests up to 1 MiB (kSmallSize) come from 2 MiB segments
  (kSmallBuffer), requests below 10 MiB (kMinLargeAlloc) from 20 MiB segments (kLargeBuffer),
  larger ones are rounded up to 2 MiB (kRoundLarge) and get a segment of their own. A request no
  cached block can serve calls cudaMalloc; when that fails the allocator frees its cached blocks
  and retries (`num_alloc_retries`), and raises the OOM when the retry fails too. Retries thus
  start when the *device* is full, however much is cached.
- The H200 captures (tests/data/h200): 139.80 GiB usable; the fragmentation OOM held 24 GiB as
  0.4 GiB slivers of 1 GiB segments (s3), the capacity OOM had 0 bytes cached (s2).
- OOM wordings: PyTorch 2.x (the H200 capture), 2.0/2.1 (`torch.cuda.OutOfMemoryError`, "total
  capacty", "Process N has ... memory in use"), 1.x ("(GPU 0; X total capacity; Y already
  allocated; Z free; W reserved in total by PyTorch)"), and `CUDA error: out of memory` raised
  from cuBLAS or NCCL with no figures at all (public threads: tests/data/public/oom_wordings.log
  and its README). Logs often carry a message split over lines (wrapped by the logger, or the
  traceback's "See documentation ..." on its own line).
- NCCL collectives (NCCL documentation; "Massively Scale Your Deep Learning Training with NCCL
  2.4", NVIDIA 2019): a ring all-reduce on n ranks takes 2(n-1) steps, each moving 1/n of the
  buffer, so its time is 2(n-1)/n * S/B + 2(n-1) * latency; a tree all-reduce takes about
  2 log2(n) latency steps. When one rank never arrives, its ring neighbours block at once and the
  others block as the ring drains, each at its own chunk; ranks launch later collectives
  asynchronously before blocking (gradient buckets), so peers stop 1-3 collectives ahead.
  Pipeline-parallel jobs block in point-to-point send/recv instead. A rank can also enter and
  stay stuck inside the kernel (a GPU fault, a NIC down): then every rank has entered.
- Fault onset, duration and kind mix for cluster-level runs: the InfiniteHBD fault trace
  (/work/shared/traces/infinitehbd-faults) is used by the scheduler benchmark; here the
  magnitudes below are drawn from ranges wide enough to straddle the detectors' defaults, so
  the detector benchmark reports honest misses near the edges.
"""

from __future__ import annotations

import math

import numpy as np

GIB = 1 << 30
MIB = 1 << 20

# -- PyTorch caching allocator (c10/cuda/CUDACachingAllocator.cpp constants) -------------------------
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize
SMALL_BUFFER = 2 * MIB  # kSmallBuffer
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
LARGE_BUFFER = 20 * MIB  # kLargeBuffer
ROUND_LARGE = 2 * MIB  # kRoundLarge


def round_request(nbytes: float) -> int:
    """The block size the allocator hands out for a request of `nbytes`."""
    n = max(int(math.ceil(nbytes)), 1)
    return ((n + MIN_BLOCK - 1) // MIN_BLOCK) * MIN_BLOCK


def segment_size(nbytes: float) -> int:
    """The cudaMalloc'd segment a request that no cached block serves gets."""
    n = round_request(nbytes)
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ((n + ROUND_LARGE - 1) // ROUND_LARGE) * ROUND_LARGE


def needs_retry(request: float, largest_cached: np.ndarray, device_free: np.ndarray) -> np.ndarray:
    """Per rank: does this step's recurring request make the allocator free its cache and retry
    cudaMalloc? Only when no cached block fits it *and* the device has no room for a new segment."""
    seg = segment_size(request)
    return (largest_cached < round_request(request)) & (device_free < seg)


# -- CUDA OOM messages, as different PyTorch releases and libraries word them ------------------------
# (wording, weight): what share of simulated OOMs use it. Recent PyTorch dominates real logs.
OOM_WORDINGS: tuple[tuple[str, float], ...] = (
    ("torch_2x", 0.50),
    ("torch_2_0", 0.20),
    ("torch_1x", 0.15),
    ("cublas", 0.08),
    ("nccl", 0.07),
)
# Wordings whose message carries no figures (no request, no free memory): ground truth for the
# benchmark, which cannot expect a cause to be read from them after the fact.
OOM_WORDINGS_WITHOUT_FIGURES = frozenset({"cublas", "nccl"})
OOM_SPLIT_SHARE = 0.2  # messages split over lines (wrapped, or the doc hint on its own line)


def _g(b: float) -> str:
    """PyTorch's format_size: B, KiB, MiB, GiB with two decimals."""
    b = max(float(b), 0.0)
    if b < 1024:
        return f"{int(b)} bytes"
    if b < MIB:
        return f"{b / 1024:.2f} KiB"
    if b < GIB:
        return f"{b / MIB:.2f} MiB"
    return f"{b / GIB:.2f} GiB"


def oom_message(
    rng: np.random.Generator,
    *,
    request: float,
    capacity: float,
    process_in_use: float,
    allocated: float,
    unallocated: float,
    foreign: float,
    rank: int,
    wording: str | None = None,
    split: bool | None = None,
) -> tuple[str, str]:
    """(wording, message) of one CUDA OOM. `process_in_use` includes the CUDA context."""
    if wording is None:
        names = [w for w, _ in OOM_WORDINGS]
        p = np.array([p for _, p in OOM_WORDINGS])
        wording = str(rng.choice(names, p=p / p.sum()))
    request = round_request(request)
    free = max(capacity - process_in_use - foreign, 0.0)
    pid = int(rng.integers(1000, 99999))
    if wording == "torch_2x":
        others = f"Process {pid} has {_g(foreign)} memory in use. " if foreign > 0 else ""
        parts = [
            f"[rank{rank}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {_g(request)}. GPU 0 has a total capacity of {_g(capacity)} of which {_g(free)} is free. "
            f"{others}Including non-PyTorch memory, this process has {_g(process_in_use)} memory in use. Of the allocated memory {_g(allocated)} is allocated by PyTorch, "
            f"and {_g(unallocated)} is reserved by PyTorch but unallocated.",
            "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
            "See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        ]
    elif wording == "torch_2_0":
        # 2.0/2.1: "capacty", and every process on the GPU listed as "Process N has".
        others = f"Process {pid} has {_g(foreign)} memory in use. " if foreign > 0 else ""
        parts = [
            f"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate {_g(request)}. GPU 0 has a total capacty of {_g(capacity)} of which {_g(free)} is free. "
            f"{others}Process {pid + 1} has {_g(process_in_use)} memory in use. Of the allocated memory {_g(allocated)} is allocated by PyTorch, and {_g(unallocated)} is reserved by PyTorch but unallocated.",
            "If reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        ]
    elif wording == "torch_1x":
        parts = [
            f"RuntimeError: CUDA out of memory. Tried to allocate {_g(request)} (GPU 0; {_g(capacity)} total capacity; {_g(allocated)} already allocated; {_g(free)} free; "
            f"{_g(allocated + unallocated)} reserved in total by PyTorch)",
            "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        ]
    elif wording == "cublas":
        parts = [
            "RuntimeError: CUDA error: out of memory",
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
        ]
    elif wording == "nccl":
        parts = [
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
            "ncclUnhandledCudaError: Call to CUDA function failed.",
            "Last error:",
            "Cuda failure 2 'out of memory'",
        ]
    else:
        raise ValueError(f"unknown OOM wording {wording!r}")
    if split is None:
        split = bool(rng.random() < OOM_SPLIT_SHARE)
    if split and wording.startswith("torch_") and len(parts[0]) > 120:
        # Wrapped by the logger at a word boundary near the middle of the first sentence block.
        cut = parts[0].rfind(" ", 0, len(parts[0]) // 2)
        parts = [parts[0][:cut], parts[0][cut + 1 :], *parts[1:]]
    sep = "\n" if split or wording in ("cublas", "nccl") else " "
    return wording, sep.join(parts)


# -- NCCL hang shapes ------------------------------------------------------------------------------------
# (shape, weight). `missing`: the culprits never enter the collective. `p2p`: a pipeline stage
# stops sending; its peers block in recv (other stages drain first). `in_kernel`: every rank
# entered, the culprits' kernels never finish (a GPU or NIC fault): nobody is "missing".
HANG_SHAPES: tuple[tuple[str, float], ...] = (("missing", 0.6), ("p2p", 0.2), ("in_kernel", 0.2))
RUN_AHEAD_MAX = 3  # collectives a rank may have launched asynchronously beyond the stuck one
COLLECTIVE_OPS = ("ALLREDUCE", "ALLREDUCE", "REDUCE_SCATTER", "ALLGATHER", "_ALLGATHER_BASE")
P2P_OPS = ("SEND", "RECV")


def draw_hang_shape(rng: np.random.Generator, n: int, culprits: list[int]) -> dict:
    """A hang's frozen shape, drawn once when it starts."""
    names = [s for s, _ in HANG_SHAPES]
    p = np.array([w for _, w in HANG_SHAPES])
    shape = str(rng.choice(names, p=p / p.sum())) if n > 1 else "missing"
    ahead = rng.integers(0, RUN_AHEAD_MAX + 1, size=n)  # async launches past the stuck collective
    ahead[culprits] = 0
    op = str(rng.choice(P2P_OPS if shape == "p2p" else COLLECTIVE_OPS))
    return {"shape": shape, "ahead": ahead, "op": op}


def hang_progress(shape: dict, n: int, done: int, culprits: list[int]) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """(last enqueued, last completed, op in flight) per rank while the job is hung at `done`."""
    ahead = shape["ahead"]
    enq = done + 1 + ahead
    comp = np.full(n, done)
    if shape["shape"] in ("missing", "p2p"):
        enq[culprits] = done
    else:  # in_kernel: the culprits entered too, and never finish
        enq[culprits] = done + 1
    ops = [shape["op"] if e > c else None for e, c in zip(enq, comp)]
    return enq, comp, ops


def ring_allreduce_seconds(n: int, nbytes: float, bus_bytes_per_second: float, latency_seconds: float = 10e-6) -> float:
    """NCCL ring all-reduce time: 2(n-1) steps of nbytes/n each."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bus_bytes_per_second + 2 * (n - 1) * latency_seconds


def tree_allreduce_seconds(n: int, nbytes: float, bus_bytes_per_second: float, latency_seconds: float = 10e-6) -> float:
    """NCCL tree all-reduce time: reduce up and broadcast down a binary tree, pipelined."""
    if n <= 1:
        return 0.0
    return 2 * nbytes / bus_bytes_per_second + 2 * math.log2(n) * latency_seconds


# -- magnitudes for randomised runs (benchmarks/detectors.py draws from these) --------------------------
# Each range is wide on purpose: it covers faults too small or too slow to matter as well as
# blatant ones, so a detector's recall near its own thresholds is measured, not assumed.
FAULT_RANGES: dict[str, tuple[float, float]] = {
    # A rank's compute slowdown: 2% (noise-level) to 2x (a badly degraded GPU or host).
    "straggler_slowdown": (1.02, 2.0),
    # Every rank alike (hard negative): same span.
    "uniform_slowdown": (1.02, 2.0),
    # Hot-spot temperature a failing fan or blocked airflow drives a GPU to (°C).
    "thermal_temperature_c": (80.0, 97.0),
    # PCIe replays per second of a degrading link: from a handful per minute to a storm (log-uniform).
    "pcie_replays_per_second": (0.2, 50.0),
    # Seconds from onset to a real OOM for leaks, fragmentation and foreign processes.
    "time_to_oom_seconds": (120.0, 360.0),
}
