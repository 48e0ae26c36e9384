"""What the simulated cluster shows below the in-process hook: L0 device telemetry (NVML/DCGM) and
L1 switches (NCCL Inspector, Flight Recorder dumps on demand; `SimulatedCluster.inspector` and
`.fr_folder` turn them on).

Each tick every GPU of a running job is in one *state* for the sample (NVML averages over 1/6–1 s,
so a sample sees one phase of a step). The readings of a state are means from public reports
(sources in docs/detectors.md, "simulator model"), with multiplicative noise:

| state | util | SM active | tensor | DRAM | power (share of idle→max) | NVLink | PCIe |
|---|---|---|---|---|---|---|---|
| compute | 0.92 | 0.80 | job 0.25–0.55 | 0.30 | job 0.75–0.95 × clock | job 40–250 GB/s | job 2–20 GB/s |
| spin (waiting in a collective) | 1.0 | 0.15 | 0 | 0.01 | 0.08 | ~0 | ~0 |
| checkpoint save | 0.04 | 0.02 | 0 | 0.05 | 0.05 | 0 | 12 GB/s (D2H) |
| pause (data loader, start-up) | 0.04 | 0 | 0 | 0 | 0.02 | 0 | 0.05 GB/s |
| evaluation (forward only) | 0.9 | 0.6 | 0.6 × job | 0.25 | 0.55 × job | 3% of job | half of job |
| host-stuck (never entered) | 0 | 0 | 0 | 0 | 0 | 0 | 0 |

A waiting rank spins an NCCL kernel on a few SMs: util reads 100% while power falls towards idle
(NVIDIA-NeMo#9291: 100 W of 700 W at 100% util; accelerate#3104: the culprit at 0%). A rank stuck
inside a device kernel reads like its waiting peers (nccl#1063): the `inside` hang mode.

`telemetry: nvml` hides the DCGM profiling ratios (null), `dcgm` has them; per-process memory
(`gpu_processes`) comes with NVML only. The device footprint of a process is the caching
allocator's reserved memory plus the context, rounded up above its healthy plateau in 1 GiB
segments (a leaked or fragmented pool grows by whole segments; NVML never sees the sawtooth of
allocated memory inside it). The in-process hook's `allocator_stats` keep reporting the exact
reserved bytes, as before.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import polars as pl

from gpuvigil import schemas
from gpuvigil.gpu import throttle

GIB = 1 << 30
SEGMENT_BYTES = GIB
GB = 1e9

IDLE, COMPUTE, SPIN, CKPT, PAUSE, EVAL, HOST = range(7)
UTIL = np.array([0.0, 0.92, 1.0, 0.04, 0.04, 0.9, 0.0])
SM_ACTIVE = np.array([0.0, 0.80, 0.15, 0.02, 0.0, 0.6, 0.0])
DRAM_ACTIVE = np.array([0.0, 0.30, 0.01, 0.05, 0.0, 0.25, 0.0])
# Shares of the job's own compute figures (tensor, power, NVLink, PCIe) per state.
TENSOR_SHARE = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 0.6, 0.0])
POWER_ABS = np.array([0.0, 0.0, 0.08, 0.05, 0.02, 0.0, 0.0])
POWER_SHARE = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 0.55, 0.0])
NVLINK_SHARE = np.array([0.0, 1.0, 1e-5, 0.0, 0.0, 0.03, 0.0])
PCIE_ABS = np.array([0.0, 0.0, 2e6, 12 * GB, 0.05 * GB, 0.0, 0.0])
PCIE_SHARE = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0])
THROTTLE_SW_POWER_CAP = throttle.bit("sw_power_cap")


class DeviceModel:
    """Per-GPU state of one tick and the L0/L1 frames it yields. Its own RNG stream, so the
    hook-level signals (and their figures) are the same with or without it."""

    def __init__(self, n_gpus: int, seed: int, telemetry: str = "dcgm", noise: float = 0.02):
        self.rng = np.random.default_rng([seed, 0x4C30])
        self.telemetry = telemetry
        self.noise = max(noise, 0.01)
        self.state = np.zeros(n_gpus, dtype=np.int64)  # the dominant state of the sample
        # Share of the sample period spent in each state: NVML util and power, and DCGM's
        # profiling ratios, are averages over their sample period, not instants.
        self.frac = np.zeros((n_gpus, len(UTIL)))
        self.clock_cap = np.ones(n_gpus)  # a power-capped (slow) GPU runs at this share of its clock
        self.job_tensor = np.zeros(n_gpus)
        self.job_power = np.zeros(n_gpus)
        self.job_nvlink = np.zeros(n_gpus)
        self.job_pcie = np.zeros(n_gpus)
        self.dev_mem = np.zeros(n_gpus)
        self._profiles: dict[str, tuple[float, float, float, float]] = {}
        self._procs: dict[str, list] = {k: [] for k in schemas.GPU_PROCESSES}
        self._insp: dict[str, list] = {k: [] for k in schemas.COLLECTIVE_PROGRESS}
        self._pipes_emitted: dict[str, float] = {}

    def profile(self, job: str, gpus: int, gpus_per_node: int | None) -> tuple[float, float, float, float]:
        """The job's compute figures (tensor share, power share, NVLink B/s, PCIe B/s): drawn once,
        from the job's name, so a restart keeps them."""
        p = self._profiles.get(job)
        if p is None:
            r = np.random.default_rng([zlib.crc32(job.encode()), 7])
            per_node = min(gpus, gpus_per_node or 8)
            nvlink = float(r.uniform(40, 250)) * GB if per_node > 1 else 0.0
            pcie = float(r.uniform(2, 20)) * GB if gpus > per_node else float(r.uniform(0.5, 3)) * GB
            p = (float(r.uniform(0.25, 0.55)), float(r.uniform(0.75, 0.95)), nvlink, pcie)
            self._profiles[job] = p
        return p

    def begin(self) -> None:
        self.state[:] = IDLE
        self.frac[:] = 0.0
        self.frac[:, IDLE] = 1.0
        self.job_tensor[:] = 0
        self.job_power[:] = 0
        self.job_nvlink[:] = 0
        self.job_pcie[:] = 0
        self.dev_mem[:] = 0

    def place(self, job: str, gpus: int, gpus_per_node: int | None, idx: np.ndarray, states: np.ndarray) -> None:
        """`states`: (ranks,) for the whole sample, or (sub-samples, ranks) spread over it."""
        t, p, nv, pc = self.profile(job, gpus, gpus_per_node)
        states = np.atleast_2d(states)
        frac = np.zeros((states.shape[1], len(UTIL)))
        for k in range(states.shape[0]):
            frac[np.arange(states.shape[1]), states[k]] += 1.0 / states.shape[0]
        self.frac[idx] = frac
        self.state[idx] = frac.argmax(axis=1)
        self.job_tensor[idx] = t
        self.job_power[idx] = p
        self.job_nvlink[idx] = nv
        self.job_pcie[idx] = pc

    # -- memory as the device sees it ---------------------------------------------------------
    def footprint(self, reserved: np.ndarray, healthy_reserved: np.ndarray, room: np.ndarray) -> np.ndarray:
        """Reserved bytes rounded up to whole segments above the healthy plateau, within `room`."""
        plateau = healthy_reserved * 1.005  # the hook's per-step jitter is not a new segment
        extra = np.maximum(reserved - plateau, 0.0)
        dev = np.minimum(reserved, plateau) + np.ceil(extra / SEGMENT_BYTES - 1e-9) * SEGMENT_BYTES
        return np.minimum(dev, np.maximum(room, reserved))

    def process_rows(self, now: float, job: str, ranks: np.ndarray, nodes: list, gpus: list, uuids: list, used: np.ndarray, pid_base: int) -> None:
        if self.telemetry != "nvml" or not len(ranks):
            return
        c = self._procs
        k = len(ranks)
        c["ts"].extend([now] * k)
        c["node"].extend(nodes)
        c["gpu"].extend(gpus)
        c["gpu_uuid"].extend(uuids)
        c["pid"].extend((pid_base + ranks).tolist())
        c["used_memory_bytes"].extend(used.astype(np.int64).tolist())
        c["slurm_job"].extend([job] * k)
        c["pod_uid"].extend([None] * k)
        c["container_id"].extend([None] * k)
        c["job"].extend([job] * k)
        c["rank"].extend(ranks.tolist())

    def foreign_rows(self, now: float, nodes: list, gpus: list, uuids: list, used: np.ndarray) -> None:
        if self.telemetry != "nvml" or not len(used):
            return
        c = self._procs
        k = len(used)
        for name, vals in (("ts", [now] * k), ("node", nodes), ("gpu", gpus), ("gpu_uuid", uuids), ("pid", [4242] * k),
                           ("used_memory_bytes", used.astype(np.int64).tolist()), ("slurm_job", [None] * k), ("pod_uid", [None] * k),
                           ("container_id", [None] * k), ("job", [None] * k), ("rank", [None] * k)):
            c[name].extend(vals)

    # -- NCCL Inspector ------------------------------------------------------------------------
    def inspector_rows(self, now: float, job: str, ranks: np.ndarray, nodes: list, gpus: list, completed: np.ndarray, wait_per_coll: np.ndarray, n_ranks: int) -> None:
        """One snapshot per rank per tick (the Prometheus-textfile mode's view: the latest
        completed collective and its execution time on this rank)."""
        k = len(ranks)
        if not k:
            return
        _, _, nv, pc = self.profile(job, n_ranks, None)
        msg = 256 << 20
        bw = max(nv, pc, 1 * GB)
        xfer = msg * 2 * (n_ranks - 1) / max(n_ranks, 1) / bw
        exec_s = (wait_per_coll + xfer) * (1.0 + self.noise * self.rng.standard_normal(k)).clip(0.5, 1.5)
        c = self._insp
        c["ts"].extend([now] * k)
        c["job"].extend([job] * k)
        c["rank"].extend(ranks.tolist())
        c["node"].extend(nodes)
        c["gpu"].extend(gpus)
        c["comm_id"].extend([f"0x{zlib.crc32(job.encode()):08x}"] * k)
        c["n_ranks"].extend([n_ranks] * k)
        c["coll"].extend(["AllReduce"] * k)
        c["coll_sn"].extend(completed.astype(np.int64).tolist())
        c["msg_size_bytes"].extend([msg] * k)
        c["exec_time_us"].extend((exec_s * 1e6).tolist())
        c["busbw_gbs"].extend((msg * 2 * (n_ranks - 1) / max(n_ranks, 1) / np.maximum(exec_s, 1e-6) / GB).tolist())

    def pipe_rows(self, now: float, job: str, generation: int, ranks: np.ndarray, nodes: list, every: float = 60.0) -> pl.DataFrame | None:
        """The debug-info pipes a node agent finds for a job (re-announced every `every` s)."""
        key = f"{job}#{generation}"
        last = self._pipes_emitted.get(key)
        if last is not None and now - last < every:
            return None
        self._pipes_emitted[key] = now
        return pl.DataFrame(
            {"ts": [now] * len(ranks), "job": [job] * len(ranks), "rank": ranks.tolist(), "node": nodes, "path": [f"sim://{job}/pipe_{r}.pipe" for r in ranks.tolist()]},
            schema=schemas.FR_PIPES,
        )

    # -- GPU columns ---------------------------------------------------------------------------
    def columns(self, util: np.ndarray, sm_clock_ratio: np.ndarray, idle_w: float, max_w: float) -> dict[str, np.ndarray]:
        n = len(self.state)
        f = self.frac
        z = lambda: (1.0 + self.noise * self.rng.standard_normal(n)).clip(0.3, 1.7)  # noqa: E731
        ratio = sm_clock_ratio * self.clock_cap
        act = (f @ POWER_ABS + (f @ POWER_SHARE) * self.job_power * ratio) * z()
        out = {
            "power_w": np.clip(idle_w + (max_w - idle_w) * act, idle_w * 0.6, max_w * 1.05),
            "pcie_tx_bytes_per_second": (f @ PCIE_ABS + (f @ PCIE_SHARE) * self.job_pcie) * z() * 0.5,
            "pcie_rx_bytes_per_second": (f @ PCIE_ABS * 0.1 + (f @ PCIE_SHARE) * self.job_pcie) * z() * 0.5,
            "nvlink_tx_bytes_per_second": (f @ NVLINK_SHARE) * self.job_nvlink * z() * 0.5,
            "nvlink_rx_bytes_per_second": (f @ NVLINK_SHARE) * self.job_nvlink * z() * 0.5,
        }
        if self.telemetry == "dcgm":
            out["sm_active_ratio"] = np.clip((f @ SM_ACTIVE) * z(), 0, 1)
            out["tensor_active_ratio"] = np.clip((f @ TENSOR_SHARE) * self.job_tensor * z(), 0, 1)
            out["dram_active_ratio"] = np.clip((f @ DRAM_ACTIVE) * z(), 0, 1)
        return out

    def util(self) -> np.ndarray:
        return self.frac @ UTIL

    def frames(self) -> dict[str, pl.DataFrame]:
        out = {
            "gpu_processes": pl.DataFrame(self._procs, schema=schemas.GPU_PROCESSES),
            "collective_progress": pl.DataFrame(self._insp, schema=schemas.COLLECTIVE_PROGRESS),
        }
        self._procs = {k: [] for k in schemas.GPU_PROCESSES}
        self._insp = {k: [] for k in schemas.COLLECTIVE_PROGRESS}
        return out


def write_fr_dumps(folder: str | Path, job: str, n_ranks: int, completed: int, entered: np.ndarray, started: np.ndarray, now: float, op: str = "all_reduce", keep: int = 8) -> list[Path]:
    """Flight Recorder dumps as torch writes them (`_dump_fr_trace_json` layout, one file per rank,
    rank in the file name): the last `keep` collectives of process group 0. Ranks with
    `entered` hold a record of collective `completed + 1`; `started` says whether its kernel
    started (a rank stuck in a compute kernel has it only scheduled)."""
    d = Path(folder) / job
    d.mkdir(parents=True, exist_ok=True)
    t_ns = int(now * 1e9)
    paths = []
    for r in range(n_ranks):
        entries = []
        last = completed + (1 if entered[r] else 0)
        for seq in range(max(1, last - keep + 1), last + 1):
            done = seq <= completed
            state = "completed" if done else ("started" if started[r] else "scheduled")
            entries.append(
                {
                    "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "op_id": seq, "pg_id": 0,
                    "process_group": ["0", "default_pg"], "profiling_name": f"nccl:{op}", "record_id": seq - 1,
                    "input_sizes": [[1 << 26]], "output_sizes": [[1 << 26]], "input_dtypes": ["BFloat16"], "output_dtypes": ["BFloat16"],
                    "state": state, "retired": done, "time_created_ns": t_ns - (last - seq + 1) * 10**9,
                    "time_discovered_started_ns": t_ns if state != "scheduled" else 0,
                    "time_discovered_completed_ns": t_ns if done else 0, "timeout_ms": 600000,
                }
            )
        dump = {
            "version": "2.10", "comm_lib_version": "2.28.9", "nccl_comm_state": {},
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(n_ranks)))}},
            "pg_status": {"0": {"last_enqueued_collective": str(last), "last_started_collective": str(last if started[r] else last - 1), "last_completed_collective": str(completed)}},
            "entries": entries,
        }
        p = d / f"fr_dump_{r}"
        tmp = d / f".fr_dump_{r}.tmp"
        tmp.write_text(json.dumps(dump))
        os.replace(tmp, p)
        paths.append(p)
    return paths
