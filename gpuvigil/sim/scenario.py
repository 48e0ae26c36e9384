"""Scenario files for the simulated cluster: jobs, background load and injected faults.

Scenarios ship in `gpuvigil/sim/scenarios/*.yaml`; a user may point at any YAML/JSON file
of the same shape. A bad file is a `UserError` naming the file and the first problem.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuvigil.errors import UserError

REALISTIC = "realistic"

FaultType = Literal[
    "memory_leak",  # allocated memory grows every step on the given ranks until OOM
    "fragmentation",  # reserved-but-unallocated grows every step; cured by expandable_segments
    "nccl_hang",  # the rank stops entering collectives; its peers block in the next one
    "gpu_lost",  # XID 79: the GPU falls off the bus, its ranks stop
    "ecc_dbe",  # XID 48: double-bit ECC error, the process on that GPU dies
    "thermal",  # GPU overheats and throttles its SM clock; its rank slows down
    "straggler",  # the rank computes `slowdown` × slower than its peers
    "long_checkpoint",  # all ranks pause together for a checkpoint save (hard negative)
    "foreign_process",  # another process on the rank's GPU takes more and more memory
    "pcie_replay",  # the GPU's PCIe link replays packets at a growing rate (a failing link)
    "eval_phase",  # all ranks run an evaluation pass (forward only, no gradient collectives): a hard negative at L0
    "power_excursion",  # the GPU draws power_excess_w more than its peers doing the same work; nothing else shows
    "remap_failure",  # HBM row remapping fails (XID 64): the GPU's memory cannot be trusted
    "dataloader_stall",  # all ranks wait on input together, outside collectives (hard negative)
    "restart",  # the job is preempted and restarts from its checkpoint (hard negative)
    "uniform_slowdown",  # every rank slows down alike, e.g. a slower input pipeline (hard negative)
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobConfig(_Strict):
    name: str = Field(min_length=1)
    gpus: int = Field(ge=1, le=65536)
    gpus_per_node: int | None = Field(None, ge=1, le=8)
    step_time_seconds: float = Field(gt=0, le=3600)
    collectives_per_step: int = Field(4, ge=1, le=64)
    checkpoint_every_steps: int = Field(500, ge=1)
    checkpoint_seconds: float = Field(15.0, ge=0)
    memory_base_gib: float = Field(30.0, ge=0)
    memory_peak_gib: float = Field(90.0, ge=0)
    priority: Literal["P0", "P1", "P2"] = "P1"
    tenant: str = "default"
    submit_at: float = Field(0.0, ge=0)
    startup_seconds: float = Field(10.0, ge=0)
    # The job completes (and leaves the cluster) after this many steps; None: it runs to the end.
    total_steps: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _peak_above_base(self) -> JobConfig:
        if self.memory_peak_gib < self.memory_base_gib:
            raise ValueError("memory_peak_gib must be >= memory_base_gib")
        return self


class BackgroundConfig(_Strict):
    jobs: int = Field(0, ge=0, le=10000)
    sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    step_time_seconds: tuple[float, float] = (0.3, 5.0)
    memory_peak_gib: tuple[float, float] = (20.0, 110.0)


class FaultConfig(_Strict):
    type: FaultType
    at: float = Field(ge=0)
    job: str | None = None
    ranks: list[int] = Field(default_factory=list)
    # fault-specific magnitudes (all optional, sensible defaults per type)
    leak_gib_per_step: float = Field(0.05, gt=0)
    fragmentation_gib_per_step: float = Field(0.05, gt=0)
    slowdown: float = Field(1.3, ge=1.0, le=10.0)
    duration_seconds: float = Field(120.0, gt=0)
    temperature_c: float = Field(93.0, ge=0, le=150)
    foreign_gib_per_second: float = Field(0.2, gt=0)
    pcie_replays_per_second: float = Field(20.0, gt=0)
    power_excess_w: float = Field(150.0, gt=0, le=1000)
    # nccl_hang: outside (the culprit never entered: host-side) | inside (stuck in a device kernel);
    # straggler: host (the rank waits on its CPU side, its GPU idles) | gpu (a power-capped GPU runs slower).
    mode: Literal["outside", "inside", "host", "gpu"] | None = None
    # straggler that comes and goes (a noisy neighbour, a host that swaps now and then): slow for
    # `lasts_seconds`, then back to normal, and slow again every `recurs_every_seconds` from the
    # onset. None: it stays slow (the fast scenarios' straggler).
    lasts_seconds: float | None = Field(None, gt=0)
    recurs_every_seconds: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _episodes(self) -> FaultConfig:
        if self.recurs_every_seconds is not None:
            if self.lasts_seconds is None:
                raise ValueError("recurs_every_seconds needs lasts_seconds")
            if self.recurs_every_seconds <= self.lasts_seconds:
                raise ValueError("recurs_every_seconds must be longer than lasts_seconds")
        if self.lasts_seconds is not None and self.type != "straggler":
            raise ValueError("lasts_seconds / recurs_every_seconds apply to straggler faults")
        return self


class SourcesConfig(_Strict):
    """How the cluster's instruments report: what a collector of each source receives, and when.

    The defaults are the simulator's fast model (every source answers on every pipeline tick,
    every sample arrives, logs name their job). Real sources differ: dcgm-exporter refreshes its
    fields every 30 s (its `-c 30000` default), NVML is polled at about 1 s, Prometheus keeps
    15-60 s history, the in-process hook publishes at the end of a step at most once per
    interval (gpuvigil.hook.instrument), scrapes fail, arrive late and drift, and most log files
    carry no job name."""

    # Device telemetry (gpu_samples and NVML's per-process memory): seconds between a node's
    # samples; None: every pipeline tick. Each node's exporter runs on its own phase.
    device_seconds: float | None = Field(None, gt=0, le=3600)
    # How those samples reach the pipeline (gpuvigil.sim.sources): `scraped` (the exporter
    # scraped every tick answers with its last refresh, stamped with the scrape's time) or
    # `history` (Prometheus history, as `replay` reads it: a row per sample, at its own time).
    device_mode: Literal["scraped", "history"] = "scraped"
    # The in-process hook: `tick` (a record per rank every pipeline tick), `step` (at the end
    # of a step, at most once per hook_seconds: a rank that makes no step publishes nothing),
    # `background` (a thread publishes every hook_seconds, steps or not), `none` (no hook: the
    # jobs are observed from device telemetry and logs alone).
    hook: Literal["tick", "step", "background", "none"] = "tick"
    hook_seconds: float = Field(1.0, gt=0, le=3600)
    # Share of jobs whose hook rows carry no collective starts (unknown, not "not started"):
    # gloo, `collective_timing=False`, or a hook started after the process group on a torch
    # without the runtime switch. 0: the documented use, `gv.start()` at the top of the script,
    # which turns on TORCH_NCCL_ENABLE_TIMING before NCCL reads it.
    hook_without_starts_share: float = Field(0.0, ge=0, le=1)
    # Device samples: share of a node's scrapes lost, share delivered late (and how late, s),
    # and the spread of the interval between a node's samples (s, uniform ±).
    drop_share: float = Field(0.0, ge=0, le=0.9)
    late_share: float = Field(0.0, ge=0, le=0.9)
    late_seconds: tuple[float, float] = (5.0, 60.0)
    jitter_seconds: float = Field(0.0, ge=0)
    # Whether kernel and torch log lines come with the job's name (a log path per job) or
    # without (a node's kernel log, a launcher's log whose path names no job): then the
    # pipeline must find the job from the GPU.
    logs_name_job: bool = True

    @model_validator(mode="after")
    def _check(self) -> SourcesConfig:
        lo, hi = self.late_seconds
        if not 0 <= lo <= hi:
            raise ValueError("late_seconds must be [low, high] with 0 <= low <= high")
        if self.device_seconds is not None and self.jitter_seconds >= self.device_seconds:
            raise ValueError("jitter_seconds must be shorter than device_seconds")
        return self


class PendingGangConfig(_Strict):
    """Fill the cluster with small jobs scattered across nodes, then submit a full-node gang."""

    small_job_gpus: list[int] = Field(default_factory=lambda: [1, 2, 3])
    free_per_node: tuple[int, int] = (2, 4)
    gang: JobConfig


class Scenario(_Strict):
    name: str
    description: str = ""
    duration_seconds: float = Field(600.0, gt=0, le=30 * 86400)
    nodes: int = Field(4, ge=1, le=20000)
    gpus_per_node: int = Field(8, ge=1, le=16)
    gpu_memory_gib: float = Field(139.8, gt=0)  # H200 as torch reports it (150,754,820,096 B)
    nodes_per_rack: int = Field(4, ge=1)
    noise: float = Field(0.02, ge=0, le=0.5)  # relative jitter of step times and telemetry
    # Device telemetry the cluster has: nvml (per-process memory, no profiling ratios) or dcgm (profiling ratios).
    telemetry: Literal["nvml", "dcgm"] = "dcgm"
    jobs: list[JobConfig] = Field(default_factory=list)
    background: BackgroundConfig = Field(default_factory=BackgroundConfig)
    fragmented_cluster: PendingGangConfig | None = None
    faults: list[FaultConfig] = Field(default_factory=list)
    sources: SourcesConfig = Field(default_factory=SourcesConfig)
    # The pipeline tick this scenario is meant to run at (None: the configured one). A scenario
    # of hours sampled every 30 s needs no 1 s tick: 6 h at 30 s is 720 ticks.
    tick_seconds: float | None = Field(None, gt=0, le=3600)
    # Ground truth for tests and benchmarks: finding kinds the detectors must raise (empty for
    # healthy runs and hard negatives, which must raise none).
    expect: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_refs(self) -> Scenario:
        names = [j.name for j in self.jobs]
        if len(set(names)) != len(names):
            raise ValueError("job names must be unique")
        by_name = {j.name: j for j in self.jobs}
        capacity = self.nodes * self.gpus_per_node
        for j in self.jobs:
            if j.gpus > capacity:
                raise ValueError(f"job {j.name!r} needs {j.gpus} GPUs but the cluster has {capacity}")
            if j.gpus_per_node and j.gpus % j.gpus_per_node:
                raise ValueError(f"job {j.name!r}: gpus must be a multiple of gpus_per_node")
        for i, f in enumerate(self.faults):
            if f.job is not None and f.job not in by_name:
                raise ValueError(f"faults[{i}]: unknown job {f.job!r}")
            if f.job is not None:
                bad = [r for r in f.ranks if not 0 <= r < by_name[f.job].gpus]
                if bad:
                    raise ValueError(f"faults[{i}]: rank(s) {bad} out of range for job {f.job!r}")
            if f.at > self.duration_seconds:
                raise ValueError(f"faults[{i}]: at={f.at} is after the end of the scenario")
        return self


def _names(*parts: str) -> list[str]:
    folder = resources.files(__package__).joinpath("scenarios", *parts)
    return sorted(e.name[:-5] for e in folder.iterdir() if e.name.endswith(".yaml"))


def builtin_names() -> list[str]:
    """The fast scenarios (`gpuvigil demo` with no --scenario): every source answers each 1 s
    tick and faults play out within minutes."""
    return _names()


def realistic_names() -> list[str]:
    """The scenarios on real time scales and sample rates (`scenarios/realistic/`): dcgm-exporter
    at 30 s, NVML at 1 s, leaks over tens of minutes to hours, stragglers that come and go, logs
    without job names, lost and late samples. `gpuvigil demo --scenario realistic` runs them."""
    return _names(REALISTIC)


def _parse(text: str, origin: str, json_only: bool = False) -> Scenario:
    try:
        data = json.loads(text) if json_only else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{origin}: not valid {'JSON' if json_only else 'YAML'}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{origin}: a scenario must be a mapping, got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "scenario"
        raise UserError(f"{origin}: {where}: {err['msg']}") from None


def load(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or a scenario file by path."""
    text_name = str(name_or_path)
    for parts in ((), (REALISTIC,)):
        if text_name in _names(*parts):
            entry = resources.files(__package__).joinpath("scenarios", *parts, f"{text_name}.yaml")
            return _parse(entry.read_text(), f"scenario {text_name}")
    path = Path(name_or_path)
    if not path.suffix:
        raise UserError(f"unknown scenario {text_name!r} (built-in: {', '.join(builtin_names())}; realistic: {', '.join(realistic_names())})")
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read scenario: {exc.strerror or exc}") from None
    return _parse(text, str(path), json_only=path.suffix == ".json")


def with_nodes(sc: Scenario, nodes: int) -> Scenario:
    """The scenario resized to `nodes` nodes; a size its jobs or faults do not fit is a UserError."""
    try:
        return Scenario.model_validate({**sc.model_dump(), "nodes": nodes})
    except ValidationError as exc:
        first = exc.errors()[0]
        msg = str(first.get("msg", exc)).removeprefix("Value error, ")
        raise UserError(f"scenario {sc.name} with --nodes {nodes}: {msg}") from None


def with_sources(sc: Scenario, device_seconds: float | None = None, tick_seconds: float | None = None) -> Scenario:
    """The scenario with its device telemetry sampled every `device_seconds` (and, if given,
    run at a pipeline tick of `tick_seconds`); a bad value is a UserError."""
    update: dict = {}
    if device_seconds is not None:
        update["sources"] = {**sc.sources.model_dump(), "device_seconds": device_seconds}
    if tick_seconds is not None:
        update["tick_seconds"] = tick_seconds
    try:
        return Scenario.model_validate({**sc.model_dump(), **update})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "scenario"
        msg = str(first.get("msg", exc)).removeprefix("Value error, ")
        raise UserError(f"scenario {sc.name} with --sample-interval {device_seconds}: {where}: {msg}") from None
