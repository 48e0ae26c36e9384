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


def builtin_names() -> list[str]:
    folder = resources.files(__package__).joinpath("scenarios")
    return sorted(e.name[:-5] for e in folder.iterdir() if e.name.endswith(".yaml"))


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
    if text_name in builtin_names():
        entry = resources.files(__package__).joinpath("scenarios", f"{text_name}.yaml")
        return _parse(entry.read_text(), f"scenario {text_name}")
    path = Path(name_or_path)
    if not path.suffix:
        raise UserError(f"unknown scenario {text_name!r} (built-in: {', '.join(builtin_names())})")
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
