"""A small real runtime for the exporter/alerts tests: the real Pipeline and Scheduler, fed by a
deterministic collector (2 nodes × 2 GPUs, one 4-rank job, node-a's InfiniBand ports read from a
sysfs tree) and a detector that raises fixed
findings. Used where the full simulator would only slow the test down."""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.infiniband import InfinibandCollector
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import Pipeline, TickResult
from gpuvigil.scheduler.core import JobSpec, NodeSpec, Scheduler, SchedulerStateCollector

import sysfs_trees

GIB = 1 << 30
NODES = ["node-a", "node-b"]


class TinyCollector:
    name = "tiny"
    streams = {"gpu_samples": schemas.GPU_SAMPLES, "rank_progress": schemas.RANK_PROGRESS, "allocator_stats": schemas.ALLOCATOR_STATS}

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        gpu_rows = []
        for n, node in enumerate(NODES):
            for gpu in range(2):
                gpu_rows.append(
                    dict(
                        ts=now, node=node, gpu=gpu, gpu_uuid=f"GPU-{n}{gpu}", memory_used_bytes=(40 + gpu) * GIB,
                        memory_total_bytes=141 * GIB, util_ratio=0.9, mem_util_ratio=0.4, power_w=650.0 + gpu,
                        temperature_c=70.0 + gpu, sm_clock_mhz=1980.0, mem_clock_mhz=2619.0,
                        throttle_reasons=0x40 if (node, gpu) == ("node-b", 1) else 0, ecc_sbe_volatile_total=0,
                        ecc_dbe_volatile_total=1 if (node, gpu) == ("node-b", 1) else 0, retired_pages_total=0,
                        remap_failure=False, pcie_replay_total=0, xid_total=1 if (node, gpu) == ("node-b", 1) else 0,
                        last_xid=79 if (node, gpu) == ("node-b", 1) else None, nvlink_links_total=18, nvlink_links_up=18,
                        fabric_manager_status=3, row_remap_pending=False, retired_pages_pending=False,
                    )
                )
        rank_rows, mem_rows = [], []
        for job, placement in self.scheduler.placements().items():
            for rank, (node, gpu) in enumerate(placement):
                step = int(now)
                rank_rows.append(dict(ts=now, job=job, rank=rank, node=node, gpu=gpu, pg="0", last_enqueued_seq=4 * step + 1,
                                      last_completed_seq=4 * step, current_op="ALLREDUCE", step=step, step_time_seconds=1.0 + 0.1 * rank))
                mem_rows.append(dict(ts=now, job=job, rank=rank, node=node, gpu=gpu, allocated_bytes=30 * GIB, reserved_bytes=40 * GIB,
                                     inactive_split_bytes=GIB, largest_free_block_bytes=2 * GIB, peak_allocated_bytes=(60 + rank) * GIB,
                                     alloc_retries=0, oom_count=0, device_capacity_bytes=141 * GIB, foreign_used_bytes=0))
        return {
            "gpu_samples": schemas.frame(gpu_rows, schemas.GPU_SAMPLES),
            "rank_progress": schemas.frame(rank_rows, schemas.RANK_PROGRESS),
            "allocator_stats": schemas.frame(mem_rows, schemas.ALLOCATOR_STATS),
        }


class FixedFindings:
    """Reports the findings it was given (while `active` is true)."""

    name = "fixed"

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        self.active = True

    def detect(self, window) -> list[Finding]:
        return [f.model_copy(update={"ts": window.now}) for f in self.findings] if self.active else []


DEFAULT_FINDINGS = [
    Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0, node="node-b", gpu=1, xid=79,
            evidence={"fatal": True, "xid": 79}, summary="XID 79 on node-b GPU 1: GPU has fallen off the bus"),
    Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.TICKET, ts=0, job="train", node="node-a", gpu=0, ranks=[0],
            evidence={"time_to_oom_seconds": 420.0, "growth_bytes_per_step": 1 << 28}, summary="train rank 0 runs out of memory in ~7 min"),
]


@dataclass
class TinyRuntime:
    pipeline: Pipeline
    scheduler: Scheduler
    detector: FixedFindings
    cluster: None = None
    now: float = 0.0
    last_result: TickResult | None = None
    sinks: list = field(default_factory=list)

    def step(self) -> TickResult:
        self.now += self.pipeline.config.tick_seconds
        self.last_result = self.pipeline.tick(self.now)
        return self.last_result


# Hints that leave the job running, so its rank series stay (the real rules would requeue it).
QUIET_HINTS = {"hints": {"rules": [{"kind": "xid", "actions": ["cordon_node"]}, {"kind": "oom_predicted", "actions": []}]}}


def tiny_runtime(findings: list[Finding] | None = None, sinks=()) -> TinyRuntime:
    from gpuvigil import config
    from gpuvigil.kinds import clear_after_defaults

    sched = Scheduler([NodeSpec(n, rack="rack-0", n_gpus=2) for n in NODES])
    sched.submit(JobSpec("train", n_gpus=3, tenant="research", priority="P0", submit_ts=0.0))
    sched.submit(JobSpec("big", n_gpus=2, tenant="vision", priority="P1", submit_ts=0.0))
    detector = FixedFindings(DEFAULT_FINDINGS if findings is None else findings)
    # Findings clear 5 s after their last report (instead of up to an hour) to keep tests short.
    clear = {kind: 5.0 for kind in [*config.defaults()["pipeline"]["clear_after_seconds"], *clear_after_defaults()]}
    cfg = config.load(overrides={**QUIET_HINTS, "pipeline": {"clear_after_seconds": clear}})
    # node-a's InfiniBand ports: the sysfs tree of tests/data/sysfs (two NDR HCAs and a RoCE NIC)
    ib = InfinibandCollector(sysfs_trees.tree("two_gpu_ndr"), node=NODES[0])
    pipeline = Pipeline([TinyCollector(sched), SchedulerStateCollector(sched), ib], [detector], sinks=[sched, *sinks], cfg=cfg)
    sched.cycle(0.0)
    return TinyRuntime(pipeline, sched, detector)


def alert_settings_for_tests(webhook_url: str, **overrides):
    """The shipped `alerts` settings with every receiver pointed at a local webhook
    (`<url>/<severity>/<team>`) and short Alertmanager timings; generated by the same code."""
    from gpuvigil import config
    from gpuvigil.alerts.settings import load_settings

    shipped = load_settings()
    teams = {
        team: {
            severity: {"webhook_configs": [{"url": f"{webhook_url}/{severity}/{team}", "send_resolved": True}]}
            for severity in ("page", "ticket")
        }
        for team in shipped.teams
    }
    timing = {"group_wait": "1s", "group_interval": "2s", "repeat_interval": {"page": "1h", "ticket": "1h"}}
    return load_settings(config.load(overrides={"alerts": {"teams": teams, **timing, **overrides}}))
