"""A seeded, deterministic simulated GPU cluster with fault injection: the world the simulated
collector (`gpuvigil.collectors.simulated.SimulatedCollector`) reads.

It plays the hardware and the training processes. The scheduler decides where jobs run (as
Slurm or Kubernetes would); each tick the simulator reads the scheduler's placements, advances
every running job, and emits what real collectors would see: NVML-like `gpu_samples`, in-process
hook `rank_progress` and `allocator_stats`, and kernel/torch `events` (XIDs, CUDA OOMs) in their
real wording. A job that crashes (OOM, lost GPU, ECC error) is reported to the scheduler, which
requeues it from its last checkpoint.

Magnitudes come from the H200 captures in tests/data/h200: 139.8 GiB usable memory, ~125 W
idle and ~700 W busy, 1,980 MHz SM clock, 35 °C idle.

Synchronous data-parallel model: in each step every rank computes for `step_time × slowdown_r`
and enters `collectives_per_step` collectives spread over its compute; collective k completes
when the slowest rank enters it. So a straggler slows the whole job but waits least, and a rank
that stops entering collectives leaves its peers blocked one sequence number ahead of it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from gpuvigil import schemas
from gpuvigil.gpu import throttle
from gpuvigil.sim import device as dev
from gpuvigil.sim import faults
from gpuvigil.sim.scenario import FaultConfig, JobConfig, Scenario
from gpuvigil.sim.sources import DeviceSampler
from gpuvigil.scheduler.core import JobSpec, NodeSpec, Scheduler

GIB = 1 << 30
IDLE_POWER_W = 125.0
MAX_POWER_W = 700.0
SM_CLOCK_MHZ = 1980.0
MEM_CLOCK_MHZ = 3201.0
CONTEXT_BYTES = int(0.6 * GIB)  # CUDA context + NCCL buffers outside the caching allocator
THROTTLE_SW_THERMAL = throttle.bit("sw_thermal_slowdown")
THROTTLE_HW_THERMAL = throttle.bit("hw_thermal_slowdown")
THROTTLE_IDLE = throttle.bit("gpu_idle")


def node_specs(scenario: Scenario) -> list[NodeSpec]:
    """The simulated cluster's nodes: `node-000`…, racks of `nodes_per_rack`."""
    return [
        NodeSpec(
            f"node-{i:03d}",
            rack=f"rack-{i // scenario.nodes_per_rack:02d}",
            n_gpus=scenario.gpus_per_node,
            gpu_memory_bytes=int(scenario.gpu_memory_gib * GIB),
        )
        for i in range(scenario.nodes)
    ]


@dataclass
class InjectedFault:
    """Ground truth of one fault, as it actually happened in the simulation."""

    kind: str
    ts: float
    job: str | None
    ranks: list[int]
    node: str | None
    gpu: int | None

    def to_json_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SimJob:
    cfg: JobConfig
    generation: int = -1  # scheduler restart count this state belongs to
    placement: list[tuple[str, int]] = field(default_factory=list)
    phase: float = 0.0  # steps done + fraction of the current step
    start_step: int = 0
    startup_left: float = 0.0
    ckpt_left: float = 0.0
    next_ckpt_step: int = 0
    hung_seq: int | None = None  # completed seq at which the job froze
    hang_culprits: list[int] = field(default_factory=list)
    dead_ranks: set[int] = field(default_factory=set)
    slowdown: np.ndarray = field(default_factory=lambda: np.ones(0))
    leak_bytes_per_step: np.ndarray = field(default_factory=lambda: np.zeros(0))
    frag_bytes_per_step: np.ndarray = field(default_factory=lambda: np.zeros(0))
    steps_since_restart: float = 0.0
    # Leaked / fragmented bytes so far in this run: they accrue from the fault's onset (or the
    # restart), not retroactively from the start of the run.
    leaked: np.ndarray = field(default_factory=lambda: np.zeros(0))
    fragmented: np.ndarray = field(default_factory=lambda: np.zeros(0))
    gpu_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    stall_checkpoints: bool = True  # a long pause that ends with a checkpoint (False: data-loader stall)
    retries: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last_step_seconds: float = 0.0
    long_ckpt_until: float = -1.0
    # L0/L1 model (gpuvigil.sim.device): how a hang's culprit looks, what a long pause is, and
    # which ranks are slow on the host side (their GPU idles) rather than on the GPU.
    hang_mode: str = "outside"
    pause_kind: str = "checkpoint"
    host_slow: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    hang_since: float | None = None
    timeout_dumped: bool = False
    dev_footprint: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # The in-process hook's publishing clock (SourcesConfig.hook): steps seen, next publish.
    hook_step_seen: int = -1
    hook_next: float = 0.0


class SimulatedCluster:
    """A simulated cluster driven by a `Scenario` and the `Scheduler` that places its jobs.

    `observe(now)` runs the simulation up to `now` and returns what the cluster's instruments
    report (`gpu_samples`, `rank_progress`, `allocator_stats`, `events`); a collector reads it."""

    def __init__(self, scenario: Scenario, scheduler: Scheduler | None = None, seed: int = 0):
        self.scenario = scenario
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.gpu_memory_bytes = int(scenario.gpu_memory_gib * GIB)
        g = scenario.gpus_per_node
        self.node_names = [spec.name for spec in node_specs(scenario)]
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        n_gpus = scenario.nodes * g
        self.gpu_node = np.repeat(np.arange(scenario.nodes), g)
        self.gpu_local = np.tile(np.arange(g), scenario.nodes)
        self.gpu_uuid = [f"GPU-{seed:04x}{i:04x}-sim0-4c7e-9a1b-{i:012x}" for i in range(n_gpus)]
        self.temp_c = np.full(n_gpus, 35.0)
        self.ecc_dbe = np.zeros(n_gpus, dtype=np.int64)
        self.ecc_sbe = np.zeros(n_gpus, dtype=np.int64)
        self.retired = np.zeros(n_gpus, dtype=np.int64)
        self.xid_total = np.zeros(n_gpus, dtype=np.int64)
        self.last_xid = np.full(n_gpus, -1, dtype=np.int64)
        self.pcie_replay = np.zeros(n_gpus, dtype=np.int64)
        self.lost = np.zeros(n_gpus, dtype=bool)
        self.thermal_target = np.full(n_gpus, np.nan)
        self.foreign_bytes = np.zeros(n_gpus)
        self.foreign_rate = np.zeros(n_gpus)  # bytes/s taken by a foreign process
        self.pcie_rate = np.zeros(n_gpus)  # replays/s of a failing link
        self.power_excess = np.zeros(n_gpus)  # W drawn beyond what the work needs (power_excursion)
        self.remap_failed = np.zeros(n_gpus, dtype=bool)
        # Ground truth of every CUDA OOM the simulation raised: (ts, job, rank, cause).
        self.oom_events: list[dict] = []
        # The wording of each of those OOMs' messages (same order): some carry no figures at all
        # (cuBLAS, NCCL), from which no cause can be read after the fact.
        self.oom_wordings: list[str] = []
        self.scheduler = scheduler or Scheduler(node_specs(scenario))
        self.jobs: dict[str, SimJob] = {}
        self.injected: list[InjectedFault] = []
        self._pending_faults = sorted(scenario.faults, key=lambda f: f.at)
        self._events: list[dict] = []
        self.now = 0.0
        self.device = dev.DeviceModel(n_gpus, seed, scenario.telemetry, scenario.noise)
        # Flight Recorder: where ranks' dumps land (None: no L1 switches), dumps asked for.
        self.fr_folder: str | None = None
        # NCCL Inspector output (L1) costs a row per rank per tick: only when asked for.
        self.inspector = False
        self.fr_watchdog_seconds = 600.0
        self._fr_requests: set[str] = set()
        src = scenario.sources
        self.sources = src
        self.sampler = DeviceSampler(
            self.node_names, src.device_seconds, drop_share=src.drop_share, late_share=src.late_share,
            late_seconds=src.late_seconds, jitter=src.jitter_seconds, seed=seed, mode=src.device_mode,
        )
        # Stragglers that come and go: (fault, job, ranks, onset, generation) of each.
        self._episodes: list[list] = []  # [fault, job, ranks, onset, generation, slow now]
        self._submit_jobs()

    # -- set-up -------------------------------------------------------------------------------
    def _add_job(self, cfg: JobConfig) -> None:
        self.jobs[cfg.name] = SimJob(cfg)
        self.scheduler.submit(
            JobSpec(cfg.name, cfg.gpus, tenant=cfg.tenant, priority=cfg.priority, submit_ts=cfg.submit_at, gpus_per_node=cfg.gpus_per_node),
            0.0,
        )

    def _submit_jobs(self) -> None:
        s = self.scenario
        for cfg in s.jobs:
            self._add_job(cfg)
        bg = s.background
        for i in range(bg.jobs):
            lo, hi = bg.step_time_seconds
            plo, phi = bg.memory_peak_gib
            peak = float(self.rng.uniform(plo, phi))
            self._add_job(
                JobConfig(
                    name=f"bg-{i:03d}",
                    gpus=int(self.rng.choice(bg.sizes)),
                    step_time_seconds=float(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))),
                    memory_base_gib=peak * float(self.rng.uniform(0.3, 0.6)),
                    memory_peak_gib=peak,
                    checkpoint_every_steps=int(self.rng.integers(200, 2000)),
                    priority="P2",
                    tenant=str(self.rng.choice(["research", "prod", "eval"])),
                )
            )
        if s.fragmented_cluster is not None:
            self._scatter_small_jobs(s.fragmented_cluster.small_job_gpus, s.fragmented_cluster.free_per_node)
            gang = s.fragmented_cluster.gang.model_copy(update={"submit_at": max(1.0, s.fragmented_cluster.gang.submit_at)})
            self._add_job(gang)
            self.injected.append(InjectedFault("cluster_fragmentation", gang.submit_at, gang.name, [], None, None))

    def _scatter_small_jobs(self, sizes: list[int], free_per_node: tuple[int, int]) -> None:
        """Small jobs placed so every node keeps a few free GPUs but none is wholly free."""
        g = self.scenario.gpus_per_node
        k = 0
        for node in self.node_names:
            free = int(self.rng.integers(free_per_node[0], free_per_node[1] + 1))
            to_fill = max(0, g - free)
            while to_fill > 0:
                size = min(int(self.rng.choice(sizes)), to_fill)
                name = f"small-{k:03d}"
                k += 1
                cfg = JobConfig(name=name, gpus=size, step_time_seconds=float(self.rng.uniform(0.5, 3.0)), memory_base_gib=20, memory_peak_gib=60, priority="P2", tenant="eval")
                self.jobs[name] = SimJob(cfg)
                self.scheduler.submit(JobSpec(name, size, tenant="eval", priority="P2", submit_ts=0.0), 0.0)
                self.scheduler.jobs[name].preferred_nodes = [node]
                # Pin it there now so the scatter is exactly as drawn.
                ns = self.scheduler.nodes[node]
                gpus = ns.free_gpus()[:size]
                for gpu in gpus:
                    ns.used[gpu] = name
                js = self.scheduler.jobs[name]
                js.placement = [(node, gpu) for gpu in gpus]
                js.state, js.start_ts = "running", 0.0
                to_fill -= size

    # -- faults -------------------------------------------------------------------------------
    def _gpu_index(self, node: str, gpu: int) -> int:
        return self.node_index[node] * self.scenario.gpus_per_node + gpu

    def _activate(self, f: FaultConfig) -> None:
        job = self.jobs.get(f.job) if f.job else None
        if job is None or not job.placement:
            # The target job is not running (yet): the fault will hit when it does.
            self._deferred.append(f)
            return
        ranks = f.ranks or [int(self.rng.integers(0, job.cfg.gpus))]
        node, gpu = job.placement[ranks[0]]
        if f.type == "memory_leak":
            job.leak_bytes_per_step[ranks] = f.leak_gib_per_step * GIB
        elif f.type == "fragmentation":
            job.frag_bytes_per_step[ranks] = f.fragmentation_gib_per_step * GIB
        elif f.type == "nccl_hang":
            job.hang_culprits = list(ranks)
            job.hang_mode = f.mode or "outside"
            job._hang_mode_fixed = f.mode is not None  # type: ignore[attr-defined]  # else drawn (sim/faults.py)
        elif f.type == "gpu_lost":
            idx = self._gpu_index(node, gpu)
            self.lost[idx] = True
            dead = [r for r, (n, g_) in enumerate(job.placement) if (n, g_) == (node, gpu)]
            job.dead_ranks |= set(dead)
            ranks = dead
            self._xid_event(idx, 79, "GPU has fallen off the bus.", job.cfg.name)
        elif f.type == "ecc_dbe":
            idx = self._gpu_index(node, gpu)
            self.ecc_dbe[idx] += 1
            self.retired[idx] += 1
            self._xid_event(idx, 48, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.", job.cfg.name)
            self._crash(job, f"CUDA error: uncorrectable ECC error encountered on rank {ranks[0]} ({node} GPU {gpu})")
        elif f.type == "thermal":
            for r in ranks:
                n, g_ = job.placement[r]
                self.thermal_target[self._gpu_index(n, g_)] = f.temperature_c
        elif f.type == "straggler":
            self._set_straggler(job, f, ranks, True)
            if f.lasts_seconds is not None:
                self._episodes.append([f, job.cfg.name, list(ranks), self.now, job.generation, True])
        elif f.type == "long_checkpoint":
            job.long_ckpt_until = self.now + f.duration_seconds
            job.stall_checkpoints = True
            job.pause_kind = "checkpoint"
            ranks = list(range(job.cfg.gpus))
            node, gpu = None, None
        elif f.type in ("dataloader_stall", "eval_phase"):
            job.long_ckpt_until = self.now + f.duration_seconds
            job.stall_checkpoints = False
            job.pause_kind = "eval" if f.type == "eval_phase" else "dataloader"
            ranks = list(range(job.cfg.gpus))
            node, gpu = None, None
        elif f.type == "uniform_slowdown":
            job.slowdown[:] = f.slowdown
            job.host_slow[:] = True
            ranks = list(range(job.cfg.gpus))
            node, gpu = None, None
        elif f.type == "restart":
            ranks = list(range(job.cfg.gpus))
            node, gpu = None, None
            self.scheduler.job_failed(job.cfg.name, self.now, "preempted for maintenance")
            job.placement = []
        elif f.type == "foreign_process":
            self.foreign_rate[self._gpu_index(node, gpu)] = f.foreign_gib_per_second * GIB
        elif f.type == "pcie_replay":
            self.pcie_rate[self._gpu_index(node, gpu)] = f.pcie_replays_per_second
        elif f.type == "power_excursion":
            self.power_excess[self._gpu_index(node, gpu)] = f.power_excess_w
        elif f.type == "remap_failure":
            idx = self._gpu_index(node, gpu)
            self.remap_failed[idx] = True
            self.retired[idx] += 1
            self._xid_event(idx, 64, "ECC page retirement or row remapper recording failure.", job.cfg.name)
        kind = {"long_checkpoint": "checkpoint_pause"}.get(f.type, f.type)
        self.injected.append(InjectedFault(kind, self.now, job.cfg.name, sorted(ranks), node, gpu))

    def _set_straggler(self, job: SimJob, f: FaultConfig, ranks: list[int], slow: bool) -> None:
        job.slowdown[ranks] = f.slowdown if slow else 1.0
        if f.mode == "gpu":
            self.device.clock_cap[job.gpu_idx[ranks]] = 1.0 / f.slowdown if slow else 1.0
        else:
            job.host_slow[ranks] = slow

    def _play_episodes(self) -> None:
        """Stragglers that come and go: slow for `lasts_seconds` of every `recurs_every_seconds`.
        Each return is ground truth of its own (an injected fault at its start)."""
        keep = []
        for ep in self._episodes:
            f, name, ranks, onset, gen, slow_before = ep
            job = self.jobs[name]
            if job.generation != gen or not job.placement:
                continue  # the job left that hardware: the slowness stayed behind
            keep.append(ep)
            since = self.now - onset
            period = f.recurs_every_seconds
            slow = (since % period if period else since) < (f.lasts_seconds or 0.0)
            if slow != slow_before:
                ep[5] = slow
                self._set_straggler(job, f, ranks, slow)
                if slow:
                    node, gpu = job.placement[ranks[0]]
                    self.injected.append(InjectedFault("straggler", self.now, name, sorted(ranks), node, gpu))
        self._episodes = keep

    def _xid_event(self, idx: int, xid: int, text: str, job: str | None) -> None:
        node = self.node_names[self.gpu_node[idx]]
        gpu = int(self.gpu_local[idx])
        self.xid_total[idx] += 1
        self.last_xid[idx] = xid
        bus = 0x18 + 0x10 * gpu
        self._events.append(
            {
                "ts": self.now,
                "node": node,
                "gpu": gpu,
                "source": "kernel",
                "kind": "xid",
                "xid": xid,
                "job": job if self.sources.logs_name_job else None,
                "message": f"NVRM: Xid (PCI:0000:{bus:02x}:00): {xid}, pid=<unknown>, name=<unknown>, {text}",
            }
        )

    def _crash(self, job: SimJob, reason: str, rank: int | None = None, oom_message: str | None = None) -> None:
        if oom_message is not None and rank is not None:
            node, gpu = job.placement[rank]
            self._events.append(
                {"ts": self.now, "node": node, "gpu": gpu, "source": "torch", "kind": "oom", "message": oom_message,
                 # A log whose path names no job says neither job nor rank (the rank may be in the text).
                 **({"job": job.cfg.name, "rank": rank} if self.sources.logs_name_job else {"job": None, "rank": None})}
            )
        self.scheduler.job_failed(job.cfg.name, self.now, reason)
        job.placement = []

    # -- per-tick dynamics --------------------------------------------------------------------
    def _sync_with_scheduler(self) -> None:
        placements = self.scheduler.placements()
        for name, job in self.jobs.items():
            js = self.scheduler.jobs[name]
            placement = placements.get(name)
            if placement is None:
                job.placement = []
                continue
            if js.restarts != job.generation or placement != job.placement:
                self._restart(job, placement, js.restarts, js.last_checkpoint_step)

    def _restart(self, job: SimJob, placement: list[tuple[str, int]], generation: int, from_step: int) -> None:
        n = job.cfg.gpus
        first_start = job.generation < 0
        job.generation = generation
        job.placement = list(placement)
        job.phase = float(from_step)
        job.start_step = from_step
        job.startup_left = job.cfg.startup_seconds
        job.ckpt_left = 0.0
        every = job.cfg.checkpoint_every_steps
        job.next_ckpt_step = (from_step // every + 1) * every
        job.hang_culprits = []
        job.dead_ranks = set()
        job.steps_since_restart = 0.0
        job.retries = np.zeros(n)
        job.leaked = np.zeros(n)
        job.fragmented = np.zeros(n)
        job.gpu_idx = np.array([self._gpu_index(nd, g) for nd, g in placement], dtype=np.int64)
        job.host_slow = np.zeros(n, dtype=bool)
        job.dev_footprint = np.zeros(0)
        job.hang_since = None
        job.timeout_dumped = False
        job.hook_step_seen = from_step
        job.hook_next = self.now + self.sources.hook_seconds
        if first_start:
            job.slowdown = np.ones(n)
            job.leak_bytes_per_step = np.zeros(n)
            job.frag_bytes_per_step = np.zeros(n)
        # A restart clears leaked and fragmented memory but not the bug behind it (the leak
        # comes back); expandable segments cure fragmentation. A straggler or hot GPU was a
        # property of the hardware the job left, so slowness does not follow it.
        js = self.scheduler.jobs[job.cfg.name]
        if "expandable_segments:True" in js.alloc_conf:
            job.frag_bytes_per_step = np.zeros(n)
        if not first_start:
            job.slowdown = np.ones(n)

    def _advance(self, job: SimJob, dt: float) -> None:
        if not job.placement or job.hang_culprits or job.dead_ranks:
            return
        if job.startup_left > 0:
            job.startup_left -= dt
            return
        if job.ckpt_left > 0 or self.now < job.long_ckpt_until:
            job.ckpt_left -= dt
            if job.ckpt_left <= 0 and self.now >= job.long_ckpt_until and job.stall_checkpoints:
                self.scheduler.checkpoint(job.cfg.name, int(job.phase), self.now)
            return
        thermal = self._thermal_slowdown(job)
        noise = 1.0 + self.scenario.noise * float(self.rng.standard_normal())
        per_rank = job.cfg.step_time_seconds * job.slowdown * thermal
        step = float(per_rank.max()) * max(0.5, noise)
        job.last_step_seconds = step
        steps = dt / step
        before = job.phase
        job.phase += steps
        job.steps_since_restart += steps
        job.leaked += job.leak_bytes_per_step * steps
        job.fragmented += job.frag_bytes_per_step * steps
        if job.cfg.total_steps is not None and job.phase >= job.cfg.total_steps:
            self.scheduler.job_completed(job.cfg.name, self.now)
            job.placement = []
            return
        if job.phase >= job.next_ckpt_step > before:
            job.phase = float(job.next_ckpt_step)
            job.next_ckpt_step += job.cfg.checkpoint_every_steps
            job.ckpt_left = job.cfg.checkpoint_seconds
            if job.ckpt_left <= 0:
                self.scheduler.checkpoint(job.cfg.name, int(job.phase), self.now)

    def _request_bytes(self, job: SimJob) -> float:
        """The largest allocation a step makes again and again (an activation block)."""
        scale = self.scheduler.jobs[job.cfg.name].memory_scale
        span = (job.cfg.memory_peak_gib - job.cfg.memory_base_gib) * GIB * scale
        return float(np.clip(span / 8, 1 * GIB, 8 * GIB))

    def _hook_reports_starts(self, name: str) -> bool:
        """Whether this job's hook rows carry collective starts (sources.hook_without_starts_share).
        Drawn from the job's name, not the run's random stream, so that choosing a share leaves
        every other draw of the run as it was."""
        share = self.sources.hook_without_starts_share
        return share <= 0 or zlib.crc32(name.encode()) / 2**32 >= share

    def _thermal_slowdown(self, job: SimJob) -> np.ndarray:
        clock = self._sm_clock(job.gpu_idx)
        return SM_CLOCK_MHZ / clock

    def _sm_clock(self, idx: np.ndarray) -> np.ndarray:
        # Clocks drop about 5% per degree above 85 °C, floored at 55% of nominal.
        over = np.clip(self.temp_c[idx] - 85.0, 0, None)
        return SM_CLOCK_MHZ * np.clip(1.0 - 0.05 * over, 0.55, 1.0)

    def _memory(self, job: SimJob) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-rank (allocated now, per-step peak allocated, reserved) in bytes."""
        js = self.scheduler.jobs[job.cfg.name]
        scale = js.memory_scale
        n = job.cfg.gpus
        base = job.cfg.memory_base_gib * GIB * scale
        peak = job.cfg.memory_peak_gib * GIB * scale
        frac = job.phase - math.floor(job.phase)
        in_step = job.startup_left <= 0 and job.ckpt_left <= 0 and not job.hang_culprits
        # Activations build up through forward and are freed through backward.
        saw = math.sin(math.pi * frac) if in_step else 0.0
        leak = job.leaked
        frag = job.fragmented
        jitter = 1.0 + 0.002 * self.rng.standard_normal(n)
        allocated = (base + (peak - base) * saw) * jitter + leak
        peak_alloc = np.full(n, peak) * jitter + leak
        reserved = peak_alloc + frag + 0.01 * peak
        if job.startup_left > 0:
            allocated = allocated * 0.3
            peak_alloc = peak_alloc * 0.3
            reserved = reserved * 0.3
        return allocated, peak_alloc, reserved

    # -- observe ------------------------------------------------------------------------------
    def observe(self, now: float) -> dict[str, pl.DataFrame]:
        dt = now - self.now if now > self.now else 1.0
        self.pipeline_tick = dt
        self.now = now
        self._deferred: list[FaultConfig] = []
        due = [f for f in self._pending_faults if f.at <= now]
        self._pending_faults = [f for f in self._pending_faults if f.at > now]
        self._sync_with_scheduler()
        for f in due:
            self._activate(f)
        self._pending_faults = sorted(self._pending_faults + self._deferred, key=lambda f: f.at)
        if self._episodes:
            self._play_episodes()

        rp_cols: dict[str, list] = {k: [] for k in schemas.RANK_PROGRESS}
        al_cols: dict[str, list] = {k: [] for k in schemas.ALLOCATOR_STATS}
        n_gpus = len(self.gpu_node)
        self.foreign_bytes = np.minimum(self.foreign_bytes + self.foreign_rate * dt, 0.9 * self.gpu_memory_bytes)
        self.pcie_replay += self.rng.poisson(self.pcie_rate * dt)
        gpu_mem = self.foreign_bytes.copy()
        gpu_busy = np.zeros(n_gpus)
        self.device.begin()
        self._pipes: list[pl.DataFrame] = []
        for job in list(self.jobs.values()):
            self._advance(job, dt)
            if not job.placement:
                continue
            if self._hook_publishes(job, now):
                self._emit_job(job, now, rp_cols, al_cols, gpu_mem, gpu_busy)
            else:
                # The job runs on (its state and draws are the same), its hook says nothing now.
                self._emit_job(job, now, {k: [] for k in rp_cols}, {k: [] for k in al_cols}, gpu_mem, gpu_busy)
        foreign = np.nonzero(self.foreign_bytes > 0)[0]
        self.device.foreign_rows(now, [self.node_names[self.gpu_node[i]] for i in foreign], self.gpu_local[foreign].tolist(), [self.gpu_uuid[i] for i in foreign], self.foreign_bytes[foreign])
        frames = {
            "gpu_samples": self._gpu_frame(now, gpu_mem, gpu_busy),
            "rank_progress": pl.DataFrame(rp_cols, schema=schemas.RANK_PROGRESS),
            "allocator_stats": pl.DataFrame(al_cols, schema=schemas.ALLOCATOR_STATS),
            "events": schemas.frame(self._events, schemas.EVENTS),
            **self.device.frames(),
        }
        if self._pipes:
            frames["fr_pipes"] = pl.concat(self._pipes)
        self._events = []
        self._fr_requests.clear()
        return self.sampler.deliver(now, frames)

    def _hook_publishes(self, job: SimJob, now: float) -> bool:
        """Whether the job's in-process hook publishes a record per rank on this tick."""
        mode = self.sources.hook
        if mode == "tick":
            return True
        if mode == "none":
            return False
        due = now + 1e-9 >= job.hook_next
        if mode == "step":
            # Hook.step(): at the end of a step, once the interval has passed since the last
            # record; a rank stuck in a collective, a checkpoint or start-up ends no step.
            step = int(math.floor(job.phase))
            ended = step > job.hook_step_seen
            job.hook_step_seen = max(job.hook_step_seen, step)
            due = due and ended
        if due:
            period = self.sources.hook_seconds
            # Hook.step() waits a whole interval from its last record; a background thread keeps its beat.
            job.hook_next = now + period if mode == "step" else job.hook_next + period * (math.floor((now - job.hook_next) / period) + 1)
        return due

    def request_fr_dump(self, job: str) -> bool:
        """A write to the job's debug-info pipes: every live rank dumps its Flight Recorder on the
        next tick (torch's watchdog thread polls the pipe). False if the job has no pipes."""
        if self.fr_folder is None or job not in self.jobs or not self.jobs[job].placement:
            return False
        self._fr_requests.add(job)
        return True

    def _fr_dump(self, job: SimJob, now: float, done: int, enq: np.ndarray) -> None:
        n = job.cfg.gpus
        entered = enq > done
        started = entered.copy()
        if job.hang_culprits and job.hang_mode == "inside":
            # Stuck in a compute kernel: the collective was enqueued but its kernel never started.
            entered[job.hang_culprits] = True
            started[job.hang_culprits] = False
        folder = self.fr_folder
        assert folder is not None
        paths = dev.write_fr_dumps(folder, job.cfg.name, n, done, entered, started, now)
        for r in sorted(job.dead_ranks):
            paths[r].unlink(missing_ok=True)  # a dead process writes nothing

    def _emit_job(self, job: SimJob, now: float, rp: dict, al: dict, gpu_mem: np.ndarray, gpu_busy: np.ndarray) -> None:
        cfg = job.cfg
        n = cfg.gpus
        allocated, peak_alloc, reserved = self._memory(job)
        foreign = self.foreign_bytes[job.gpu_idx]
        if self._raise_oom(job, peak_alloc, foreign):
            return

        step = int(math.floor(job.phase))
        frac = job.phase - step
        running = job.startup_left <= 0 and job.ckpt_left <= 0 and now >= job.long_ckpt_until
        hung_ops = None
        if job.hang_culprits or job.dead_ranks:
            enq, comp, started, step_now, wait, hung_ops = self._hung_progress(job, step, frac)
        else:
            enq, comp, started, step_now, wait = self._running_progress(job, step, frac, running)
        alive = np.ones(n, dtype=bool)
        alive[list(job.dead_ranks)] = False
        ranks = np.arange(n)[alive]
        nodes = [job.placement[r][0] for r in ranks]
        gpus = [job.placement[r][1] for r in ranks]
        rows = (now, ranks, nodes, gpus, alive)
        self._emit_rank_progress(job, rp, rows, enq, comp, started, step_now, wait, hung_ops)
        self._emit_allocator_stats(job, al, rows, allocated, peak_alloc, reserved, foreign)
        self._emit_device(job, rows, foreign, comp, wait, running, frac, step, gpu_mem, gpu_busy)
        if self.fr_folder is not None:
            self._emit_flight_recorder(job, now, ranks, nodes, comp, enq)

    def _raise_oom(self, job: SimJob, peak_alloc: np.ndarray, foreign: np.ndarray) -> bool:
        """Crash the job with a CUDA OOM if a rank's step no longer fits; True if it did."""
        capacity = self.gpu_memory_bytes
        # PyTorch's allocator, on a failed cudaMalloc, releases every cached segment that holds no
        # live block and retries; it raises the OOM only if that fails too (sim/faults.py). So
        # the healthy slack never causes an OOM; the live tensors, the step's request and the
        # slivers of split segments (fragmentation, not releasable) do.
        held_min = peak_alloc + job.fragmented
        over = np.nonzero(held_min + CONTEXT_BYTES + foreign > capacity)[0]
        if not (len(over) and not job.dead_ranks):
            return False
        r = int(over[0])
        request = self._request_bytes(job)
        # The failing allocation is the step's next recurring one; after the release the
        # process holds its live tensors plus the unreleasable slivers.
        live = peak_alloc[r] - request
        held = live + job.fragmented[r]
        # Worded as one of the PyTorch releases / libraries would (sim/faults.py), sometimes
        # without figures at all (cuBLAS, NCCL), sometimes split over lines.
        wording, message = faults.oom_message(
            self.rng, request=request, capacity=capacity, process_in_use=held + CONTEXT_BYTES, allocated=live,
            unallocated=float(job.fragmented[r]), foreign=float(foreign[r]), rank=r,
        )
        cause = "foreign_process" if foreign[r] > 0 else "fragmentation" if job.fragmented[r] > job.leaked[r] else "capacity"
        node, gpu = job.placement[r]
        self.oom_events.append({"ts": self.now, "job": job.cfg.name, "rank": r, "node": node, "gpu": gpu, "cause": cause})
        self.oom_wordings.append(wording)
        self._crash(job, f"CUDA out of memory on rank {r}", rank=r, oom_message=message)
        return True

    def _hung_progress(self, job: SimJob, step: int, frac: float) -> tuple:
        """Sequence numbers of a hung job: (enqueued, completed, started, step, wait, current ops)."""
        n = job.cfg.gpus
        C = job.cfg.collectives_per_step
        if job.hung_seq is None or job.generation != getattr(job, "_hung_gen", None):
            job.hung_seq = step * C + int(frac * C)
            job._hung_gen = job.generation  # type: ignore[attr-defined]
        done = job.hung_seq
        stuck = job.hang_culprits or sorted(job.dead_ranks)
        # The hang's shape (sim/faults.py): culprits missing, a p2p stage stopped, or stuck
        # inside a kernel every rank entered; peers ran 0-3 collectives ahead first.
        key = (job.generation, done)
        if getattr(job, "_hang_shape_key", None) != key:
            shape = faults.draw_hang_shape(self.rng, n, stuck)
            if job.dead_ranks and not job.hang_culprits:
                shape["shape"] = "missing"  # a dead rank enters nothing
            elif getattr(job, "_hang_mode_fixed", False):
                shape["shape"] = "in_kernel" if job.hang_mode == "inside" else "missing"
            else:
                job.hang_mode = "inside" if shape["shape"] == "in_kernel" else "outside"
            job._hang_shape = shape  # type: ignore[attr-defined]
            job._hang_shape_key = key  # type: ignore[attr-defined]
        enq, comp, hung_ops = faults.hang_progress(job._hang_shape, n, done, stuck)  # type: ignore[attr-defined]
        # Started: the pending collective's kernel runs (spinning) on every rank that entered
        # it, not on one stuck in a kernel before it; nothing later starts behind it.
        started = np.where(enq > done, done + 1, done)
        if job._hang_shape["shape"] == "in_kernel":  # type: ignore[attr-defined]
            started[stuck] = done
        return enq, comp, started, done // C, np.zeros(n), hung_ops

    def _running_progress(self, job: SimJob, step: int, frac: float, running: bool) -> tuple:
        """Sequence numbers of a job that is not hung: (enqueued, completed, started, step, wait)."""
        cfg = job.cfg
        n = cfg.gpus
        C = cfg.collectives_per_step
        job.hung_seq = None
        thermal = self._thermal_slowdown(job)
        per_rank = cfg.step_time_seconds * job.slowdown * thermal
        step_len = float(per_rank.max())
        if running:
            tau = frac * step_len
            entered = np.minimum(C, np.floor(tau * C / per_rank)).astype(np.int64)
            enq = step * C + entered
            comp = np.full(n, step * C + int(entered.min()))
        else:
            enq = np.full(n, step * C)
            comp = enq.copy()
        wait = np.clip(job.last_step_seconds - per_rank, 0, None) if job.last_step_seconds else np.zeros(n)
        wait = wait * (1.0 + self.scenario.noise * self.rng.standard_normal(n)).clip(0.5, 1.5)
        return enq, comp, enq, step, wait

    def _emit_rank_progress(self, job: SimJob, rp: dict, rows: tuple, enq, comp, started, step_now, wait, hung_ops) -> None:
        cfg = job.cfg
        now, ranks, nodes, gpus, alive = rows
        rp["ts"].extend([now] * len(ranks))
        rp["job"].extend([cfg.name] * len(ranks))
        rp["rank"].extend(ranks.tolist())
        rp["node"].extend(nodes)
        rp["gpu"].extend(gpus)
        rp["pg"].extend(["0"] * len(ranks))
        rp["last_enqueued_seq"].extend(enq[alive].tolist())
        rp["last_completed_seq"].extend(comp[alive].tolist())
        if job.hang_culprits or job.dead_ranks:
            rp["current_op"].extend([hung_ops[r] for r in ranks])
        else:
            rp["current_op"].extend(["ALLREDUCE" if e > c else None for e, c in zip(enq[alive], comp[alive])])
        rp["step"].extend([int(step_now)] * len(ranks))
        rp["step_time_seconds"].extend([job.last_step_seconds or cfg.step_time_seconds] * len(ranks))
        rp["collective_wait_seconds"].extend(wait[alive].tolist())
        rp["last_started_seq"].extend(started[alive].tolist() if self._hook_reports_starts(cfg.name) else [None] * len(ranks))

    def _emit_allocator_stats(self, job: SimJob, al: dict, rows: tuple, allocated, peak_alloc, reserved, foreign) -> None:
        cfg = job.cfg
        capacity = self.gpu_memory_bytes
        now, ranks, nodes, gpus, alive = rows
        frag = reserved - peak_alloc
        retries = job.retries
        # cudaMalloc is retried (after freeing the cache) when no cached block fits the step's
        # request and the device has no room for a new segment (sim/faults.py, PyTorch's allocator).
        request_now = self._request_bytes(job)
        cached_fit = np.where(job.fragmented > frag * 0.5, np.minimum(frag, request_now * 0.3), np.minimum(frag, request_now * 1.5))
        retries += faults.needs_retry(request_now, cached_fit, capacity - reserved - CONTEXT_BYTES - foreign)
        al["ts"].extend([now] * len(ranks))
        al["job"].extend([cfg.name] * len(ranks))
        al["rank"].extend(ranks.tolist())
        al["node"].extend(nodes)
        al["gpu"].extend(gpus)
        al["allocated_bytes"].extend(allocated[alive].astype(np.int64).tolist())
        al["reserved_bytes"].extend(reserved[alive].astype(np.int64).tolist())
        al["inactive_split_bytes"].extend((job.fragmented[alive] * 0.9 + frag[alive] * 0.05).astype(np.int64).tolist())
        # Largest block the allocator could hand out: device memory outside the pool, or a
        # cached block. A fragmented pool's free blocks are slivers smaller than the step's
        # recurring request; a healthy pool's slack fits it.
        request = self._request_bytes(job)
        cached = np.where(job.fragmented > frag * 0.5, np.minimum(frag, request * 0.3), np.minimum(frag, request * 1.5))
        largest_free = np.maximum(np.maximum(capacity - reserved - CONTEXT_BYTES - foreign, 0), cached)
        al["largest_free_block_bytes"].extend(largest_free[alive].astype(np.int64).tolist())
        al["peak_allocated_bytes"].extend(peak_alloc[alive].astype(np.int64).tolist())
        al["alloc_retries"].extend(retries[alive].astype(np.int64).tolist())
        al["oom_count"].extend([0] * len(ranks))
        al["device_capacity_bytes"].extend([capacity] * len(ranks))
        al["foreign_used_bytes"].extend(foreign[alive].astype(np.int64).tolist())

    def _emit_device(self, job: SimJob, rows: tuple, foreign, comp, wait, running: bool, frac: float, step: int, gpu_mem: np.ndarray, gpu_busy: np.ndarray) -> None:
        """The device's view of the job: memory footprint, utilisation, process and inspector rows."""
        cfg = job.cfg
        n = cfg.gpus
        C = cfg.collectives_per_step
        idx = job.gpu_idx
        capacity = self.gpu_memory_bytes
        now, ranks, nodes, gpus, alive = rows
        # The device's view: the allocator's footprint in whole segments above its healthy
        # plateau, plus the context; NVML never sees the sawtooth inside it.
        scale = self.scheduler.jobs[cfg.name].memory_scale
        healthy = np.full(n, cfg.memory_peak_gib * GIB * scale * 1.01) * (0.3 if job.startup_left > 0 else 1.0)
        # The footprint is the allocator's segments: the healthy plateau plus what leaked or
        # fragmented, not the hook's per-sample jitter of the reserved figure.
        grown = (job.leaked + job.fragmented) * (0.3 if job.startup_left > 0 else 1.0)
        footprint = self.device.footprint(healthy + grown, healthy, capacity - CONTEXT_BYTES - foreign)
        # Segments are kept until empty_cache() or a restart: the footprint never shrinks in a run
        # (and per-step jitter of the hook's numbers does not show at the device).
        if job.startup_left <= 0:
            if len(job.dev_footprint) != n:
                job.dev_footprint = footprint.copy()
            job.dev_footprint = np.maximum(job.dev_footprint, footprint)
            footprint = job.dev_footprint
        np.add.at(gpu_mem, idx[alive], footprint[alive] + CONTEXT_BYTES)
        states = self._device_states(job, running, frac, step, C)
        self.device.place(cfg.name, n, cfg.gpus_per_node, idx[alive], states[:, alive])
        np.maximum.at(gpu_busy, idx[alive], self.device.util()[idx[alive]])
        uuids = [self.gpu_uuid[i] for i in idx[alive]]
        self.device.process_rows(now, cfg.name, ranks, nodes, gpus, uuids, footprint[alive] + CONTEXT_BYTES, 100000 + 2000 * max(job.generation, 0))
        if self.inspector:
            self.device.inspector_rows(now, cfg.name, ranks, nodes, gpus, comp[alive], wait[alive] / C, n)

    def _emit_flight_recorder(self, job: SimJob, now: float, ranks, nodes, comp, enq) -> None:
        """NCCL pipe rows, and the Flight Recorder's dumps: on request, or when the watchdog fires."""
        cfg = job.cfg
        pipes = self.device.pipe_rows(now, cfg.name, job.generation, ranks, nodes)
        if pipes is not None:
            self._pipes.append(pipes)
        hung = bool(job.hang_culprits or job.dead_ranks)
        if hung and job.hang_since is None:
            job.hang_since = now
        timeout = hung and not job.timeout_dumped and job.hang_since is not None and now - job.hang_since >= self.fr_watchdog_seconds
        if cfg.name in self._fr_requests or timeout:
            # TORCH_NCCL_DUMP_ON_TIMEOUT: the watchdog dumps every rank when it fires.
            job.timeout_dumped = job.timeout_dumped or timeout
            self._fr_dump(job, now, int(comp.min()), enq)

    def _device_states(self, job: SimJob, running: bool, frac: float, step: int, C: int, k: int = 8) -> np.ndarray:
        """What each rank's GPU did over the sample period: (k sub-samples, ranks) of
        gpuvigil.sim.device states, spread over the last tick (readings are period averages)."""
        n = job.cfg.gpus
        if job.hang_culprits or job.dead_ranks:
            states = np.full(n, dev.SPIN)  # blocked in the collective: the NCCL kernel spins
            if job.hang_culprits and job.hang_mode == "outside":
                states[job.hang_culprits] = dev.HOST  # never entered it: nothing runs on its GPU
            return states[None, :]
        if job.startup_left > 0:
            return np.full((1, n), dev.PAUSE)
        if not running:
            if job.ckpt_left > 0 or job.pause_kind == "checkpoint":
                return np.full((1, n), dev.CKPT)
            return np.full((1, n), dev.EVAL if job.pause_kind == "eval" else dev.PAUSE)
        # In each of the step's C collective intervals a rank computes, (host-slow ranks) waits
        # on its CPU side, then spins in the collective until the slowest rank arrives.
        thermal = self._thermal_slowdown(job)
        per_rank = job.cfg.step_time_seconds * job.slowdown * thermal
        step_len = float(per_rank.max())
        host = np.where(job.host_slow, per_rank - job.cfg.step_time_seconds * thermal, 0.0)
        compute = per_rank - host
        interval = step_len / C
        period = self.pipeline_tick if self.pipeline_tick > 0 else 1.0
        tau = frac * step_len - period * (np.arange(k)[:, None] + 0.5) / k
        t_in = np.mod(tau, interval)
        return np.where(t_in < compute / C, dev.COMPUTE, np.where(t_in < per_rank / C, dev.HOST, dev.SPIN))

    def _gpu_frame(self, now: float, gpu_mem: np.ndarray, gpu_busy: np.ndarray) -> pl.DataFrame:
        n = len(gpu_mem)
        rng = self.rng
        noise = self.scenario.noise
        util = np.clip(gpu_busy * (1 + noise * rng.standard_normal(n)), 0, 1)
        # A resident (spinning) kernel reads exactly 100%: NVML counts time with any kernel running.
        util = np.where(gpu_busy >= 1.0, 1.0, util)
        hot = ~np.isnan(self.thermal_target)
        # A GPU drawing excess power runs a little warmer (150 W: +6 °C), well below throttling.
        target = np.where(hot, self.thermal_target, 35.0 + 40.0 * util + 0.04 * self.power_excess)
        # A tenth of the gap closes per second (a 10 s time constant), whatever the tick.
        self.temp_c += (target - self.temp_c) * (1.0 - 0.9**self.pipeline_tick) + 0.3 * rng.standard_normal(n)
        sm = self._sm_clock(np.arange(n)) * np.where(util > 0.01, 1.0, 0.2)
        sm = np.maximum(sm, 345.0)
        capped = self.device.clock_cap < 1.0
        throttle = (
            np.where(self.temp_c > 85.0, THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL, 0) | np.where(util < 0.01, THROTTLE_IDLE, 0) | np.where(capped & (util > 0.01), dev.THROTTLE_SW_POWER_CAP, 0)
        )
        sm = np.where(capped & (util > 0.01), np.maximum(sm * self.device.clock_cap, 345.0), sm)
        extra = self.device.columns(util, sm / SM_CLOCK_MHZ, IDLE_POWER_W, MAX_POWER_W)
        # Power follows the work done, not util: a spinning NCCL kernel reads 100% near idle power.
        power = extra.pop("power_w") + self.power_excess * (util > 0.01)
        lost = self.lost
        # Counters are copied: polars may share a numpy buffer, and a frame already in the
        # window must not change when the simulation moves on.
        df = pl.DataFrame(
            {
                "ts": np.full(n, now),
                "node": np.array(self.node_names, dtype=object)[self.gpu_node],
                "gpu": self.gpu_local.astype(np.int32),
                "gpu_uuid": self.gpu_uuid,
                "memory_used_bytes": gpu_mem.astype(np.int64),
                "memory_total_bytes": np.full(n, self.gpu_memory_bytes, dtype=np.int64),
                "util_ratio": util,
                "mem_util_ratio": util * 0.6,
                "power_w": power,
                "temperature_c": np.round(self.temp_c, 1),
                "sm_clock_mhz": np.round(sm),
                "mem_clock_mhz": np.full(n, MEM_CLOCK_MHZ),
                "throttle_reasons": throttle.astype(np.int64),
                "ecc_sbe_volatile_total": self.ecc_sbe.copy(),
                "ecc_dbe_volatile_total": self.ecc_dbe.copy(),
                "retired_pages_total": self.retired.copy(),
                "remap_failure": self.remap_failed.copy(),
                "pcie_replay_total": self.pcie_replay.copy(),
                "xid_total": self.xid_total.copy(),
                "last_xid": self.last_xid.copy(),
                **extra,
            },
            schema_overrides={"node": pl.Utf8},
        )
        # A GPU that fell off the bus answers nothing: its readings are null.
        metrics = ["memory_used_bytes", "util_ratio", "mem_util_ratio", "power_w", "temperature_c", "sm_clock_mhz", "mem_clock_mhz", "throttle_reasons", *extra]
        df = df.with_columns(
            [pl.when(pl.Series(lost)).then(None).otherwise(pl.col(c)).alias(c) for c in metrics]
            + [pl.when(pl.col("last_xid") < 0).then(None).otherwise(pl.col("last_xid")).alias("last_xid")]
        )
        return schemas.conform(df, schemas.GPU_SAMPLES)


def _fmt_gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def _oom_message(request: float, capacity: float, reserved: float, allocated: float, rank: int, foreign_bytes: float = 0.0) -> str:
    """The CUDA OOM text exactly as PyTorch 2.x words it (see tests/data/h200/s2_oom_ramp.log)."""
    in_use = reserved + CONTEXT_BYTES
    free = max(capacity - in_use - foreign_bytes, 0)
    unalloc = max(reserved - allocated, 0)
    others = f"Process 4242 has {_fmt_gib(foreign_bytes)} memory in use. " if foreign_bytes > 0 else ""
    return (
        f"[rank{rank}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {_fmt_gib(request)}. "
        f"GPU 0 has a total capacity of {_fmt_gib(capacity)} of which {_fmt_gib(free)} is free. "
        f"{others}Including non-PyTorch memory, this process has {_fmt_gib(in_use)} memory in use. "
        f"Of the allocated memory {_fmt_gib(allocated)} is allocated by PyTorch, and {_fmt_gib(unalloc)} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
