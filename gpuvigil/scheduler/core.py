"""The built-in scheduler: queue, all-or-nothing gang placement, requeue from checkpoint,
cordon/drain, and the hints gpuvigil feeds it.

Public surface used by the simulator, the demo and the pipeline (keep it stable):
`submit`, `cycle`, `apply_hint`, `checkpoint`, `job_failed`, `job_completed`, `placements`,
`state_frames`, `on_tick` (a pipeline sink), `actions` (everything it did, in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.model import Hint, HintAction

GIB = 1 << 30


@dataclass
class NodeSpec:
    name: str
    rack: str = "rack-0"
    n_gpus: int = 8
    gpu_memory_bytes: int = 141 * GIB


@dataclass
class JobSpec:
    name: str
    n_gpus: int
    tenant: str = "default"
    priority: str = "P2"
    submit_ts: float = 0.0
    min_gpu_memory_bytes: int = 0
    duration_seconds: float | None = None  # for trace replay; None = runs until stopped


@dataclass
class Action:
    ts: float
    action: str  # placed | cordoned | drained | requeued | set_alloc_conf | resized | moved | avoid_gpu | failed | completed
    job: str | None = None
    node: str | None = None
    gpu: int | None = None
    detail: str = ""
    hint_id: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class NodeState:
    spec: NodeSpec
    state: str = "up"  # up | cordoned | draining | drained | down
    reason: str = ""
    used: dict[int, str] = field(default_factory=dict)  # gpu index → job
    avoid_gpus: set[int] = field(default_factory=set)

    def free_gpus(self) -> list[int]:
        return [g for g in range(self.spec.n_gpus) if g not in self.used and g not in self.avoid_gpus]

    @property
    def schedulable(self) -> bool:
        return self.state == "up"


@dataclass
class JobState:
    spec: JobSpec
    state: str = "pending"  # pending | running | completed | failed
    placement: list[tuple[str, int]] = field(default_factory=list)  # rank → (node, gpu)
    start_ts: float | None = None
    last_checkpoint_step: int = 0
    last_checkpoint_ts: float | None = None
    restarts: int = 0
    alloc_conf: str = ""
    excluded_nodes: set[str] = field(default_factory=set)
    memory_scale: float = 1.0  # < 1 after a resize to a smaller micro-batch
    preferred_nodes: list[str] = field(default_factory=list)
    lost_gpu_seconds: float = 0.0


class Scheduler:
    def __init__(self, nodes: list[NodeSpec]):
        self.nodes: dict[str, NodeState] = {n.name: NodeState(n) for n in nodes}
        self.jobs: dict[str, JobState] = {}
        self.actions: list[Action] = []

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, now: float | None = None) -> None:
        if spec.name in self.jobs:
            raise ValueError(f"job {spec.name!r} already submitted")
        if spec.n_gpus < 1:
            raise ValueError(f"job {spec.name!r}: n_gpus must be >= 1")
        self.jobs[spec.name] = JobState(spec)

    def checkpoint(self, job: str, step: int, now: float) -> None:
        js = self.jobs[job]
        js.last_checkpoint_step = step
        js.last_checkpoint_ts = now

    def _release(self, js: JobState) -> None:
        for node, gpu in js.placement:
            ns = self.nodes[node]
            if ns.used.get(gpu) == js.spec.name:
                del ns.used[gpu]
        js.placement = []

    def _requeue(self, js: JobState, now: float, why: str, hint_id: str | None = None) -> Action:
        if js.state == "running" and js.last_checkpoint_ts is not None:
            js.lost_gpu_seconds += (now - js.last_checkpoint_ts) * js.spec.n_gpus
        elif js.state == "running" and js.start_ts is not None:
            js.lost_gpu_seconds += (now - js.start_ts) * js.spec.n_gpus
        self._release(js)
        js.state = "pending"
        js.restarts += 1
        action = Action(
            now,
            "requeued",
            job=js.spec.name,
            detail=f"{why}; resumes from checkpoint step {js.last_checkpoint_step}"
            + (f", excluding {', '.join(sorted(js.excluded_nodes))}" if js.excluded_nodes else ""),
            hint_id=hint_id,
        )
        self.actions.append(action)
        return action

    def job_failed(self, job: str, now: float, reason: str) -> list[Action]:
        """A running job crashed (OOM, lost GPU): requeue it from its last checkpoint."""
        js = self.jobs[job]
        if js.state != "running":
            return []
        out = [Action(now, "failed", job=job, detail=reason)]
        self.actions.extend(out)
        out.append(self._requeue(js, now, f"crashed: {reason}"))
        return out

    def job_completed(self, job: str, now: float) -> None:
        js = self.jobs[job]
        self._release(js)
        js.state = "completed"
        self.actions.append(Action(now, "completed", job=job))

    # -- placement --------------------------------------------------------------------------
    def _candidate_nodes(self, js: JobState) -> list[NodeState]:
        return [
            ns
            for ns in self.nodes.values()
            if ns.schedulable
            and ns.spec.name not in js.excluded_nodes
            and ns.spec.gpu_memory_bytes >= js.spec.min_gpu_memory_bytes
        ]

    def _place(self, js: JobState) -> list[tuple[str, int]] | None:
        """All-or-nothing: fewest nodes first (whole job on one node if any fits), tightest fit."""
        need = js.spec.n_gpus
        cands = [(ns, ns.free_gpus()) for ns in self._candidate_nodes(js)]
        cands = [(ns, free) for ns, free in cands if free]
        if sum(len(f) for _, f in cands) < need:
            return None
        pref = set(js.preferred_nodes)
        single = [(ns, f) for ns, f in cands if len(f) >= need]
        if single:
            ns, free = min(single, key=lambda c: (c[0].spec.name not in pref, len(c[1]), c[0].spec.name))
            return [(ns.spec.name, g) for g in free[:need]]
        # Multi-node gang: whole free nodes first (largest free first), grouped by rack.
        cands.sort(key=lambda c: (c[0].spec.name not in pref, -len(c[1]), c[0].spec.rack, c[0].spec.name))
        out: list[tuple[str, int]] = []
        for ns, free in cands:
            take = free[: need - len(out)]
            out.extend((ns.spec.name, g) for g in take)
            if len(out) == need:
                return out
        return None

    def cycle(self, now: float) -> list[Action]:
        """Place pending jobs, highest priority and oldest first."""
        out: list[Action] = []
        pending = sorted(
            (js for js in self.jobs.values() if js.state == "pending" and js.spec.submit_ts <= now),
            key=lambda js: (js.spec.priority, js.spec.submit_ts, js.spec.name),
        )
        for js in pending:
            placement = self._place(js)
            if placement is None:
                continue
            for node, gpu in placement:
                self.nodes[node].used[gpu] = js.spec.name
            js.placement = placement
            js.state = "running"
            js.start_ts = now
            js.preferred_nodes = []
            nodes = sorted({n for n, _ in placement})
            a = Action(
                now,
                "placed",
                job=js.spec.name,
                node=nodes[0] if len(nodes) == 1 else None,
                detail=f"{js.spec.n_gpus} GPU(s) on {', '.join(nodes)}"
                + (f" (restart {js.restarts}, from step {js.last_checkpoint_step})" if js.restarts else ""),
            )
            out.append(a)
        self.actions.extend(out)
        return out

    # -- hints ------------------------------------------------------------------------------
    def apply_hint(self, hint: Hint, now: float) -> list[Action]:
        out: list[Action] = []
        act = hint.action
        if act in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE) and hint.node in self.nodes:
            ns = self.nodes[hint.node]
            if ns.state == "up":
                ns.state = "cordoned" if act == HintAction.CORDON_NODE else "draining"
                ns.reason = hint.reason
                out.append(Action(now, "cordoned" if act == HintAction.CORDON_NODE else "drained", node=hint.node, detail=hint.reason, hint_id=hint.id))
        elif act == HintAction.AVOID_GPU and hint.node in self.nodes and hint.gpu is not None:
            ns = self.nodes[hint.node]
            if hint.gpu not in ns.avoid_gpus:
                ns.avoid_gpus.add(hint.gpu)
                out.append(Action(now, "avoid_gpu", node=hint.node, gpu=hint.gpu, detail=f"GPU marked suspect: {hint.reason}", hint_id=hint.id))
        elif act == HintAction.REQUEUE_JOB and hint.job in self.jobs:
            js = self.jobs[hint.job]
            js.excluded_nodes |= set(hint.exclude_nodes)
            if js.state == "running":
                out.append(self._requeue(js, now, hint.reason, hint.id))
        elif act == HintAction.SET_ALLOC_CONF and hint.job in self.jobs:
            js = self.jobs[hint.job]
            conf = str(hint.params.get("alloc_conf", "expandable_segments:True"))
            if js.alloc_conf != conf:
                js.alloc_conf = conf
                out.append(Action(now, "set_alloc_conf", job=hint.job, detail=f"PYTORCH_CUDA_ALLOC_CONF={conf}", hint_id=hint.id))
                if js.state == "running":
                    out.append(self._requeue(js, now, f"restart with PYTORCH_CUDA_ALLOC_CONF={conf}", hint.id))
        elif act == HintAction.RESIZE_OR_MOVE_JOB and hint.job in self.jobs:
            js = self.jobs[hint.job]
            current = max((self.nodes[n].spec.gpu_memory_bytes for n, _ in js.placement), default=0)
            larger = [ns for ns in self.nodes.values() if ns.spec.gpu_memory_bytes > current and ns.schedulable]
            if larger:
                js.spec.min_gpu_memory_bytes = min(ns.spec.gpu_memory_bytes for ns in larger)
                detail = f"move to GPUs with >= {js.spec.min_gpu_memory_bytes / GIB:.0f} GiB"
            else:
                js.memory_scale *= 0.75
                detail = f"no larger-memory GPU free: restart with micro-batch x{js.memory_scale:.2f}"
            out.append(Action(now, "resized", job=hint.job, detail=detail, hint_id=hint.id))
            if js.state == "running":
                out.append(self._requeue(js, now, detail, hint.id))
        elif act == HintAction.COMPACT:
            for move in hint.params.get("moves", []):
                js = self.jobs.get(str(move.get("job")))
                target = move.get("to_node")
                if js is None or js.state != "running":
                    continue
                js.preferred_nodes = [target] if target else []
                out.append(Action(now, "moved", job=js.spec.name, node=target, detail=f"compact: move from {move.get('from_node')} to {target}", hint_id=hint.id))
                out.append(self._requeue(js, now, "compact to free a gang slot", hint.id))
                # Re-place the moved job right away so the freed slot goes to the gang job.
                placement = self._place(js)
                if placement is not None:
                    for node, gpu in placement:
                        self.nodes[node].used[gpu] = js.spec.name
                    js.placement, js.state, js.start_ts = placement, "running", now
        self.actions.extend(a for a in out if a not in self.actions)
        return out

    def on_tick(self, result, window) -> None:  # pipeline Sink
        for hint in result.new_hints:
            self.apply_hint(hint, result.now)
        self.cycle(result.now)

    # -- state ------------------------------------------------------------------------------
    def placements(self) -> dict[str, list[tuple[str, int]]]:
        return {name: list(js.placement) for name, js in self.jobs.items() if js.state == "running"}

    def state_frames(self) -> dict[str, pl.DataFrame]:
        jobs = schemas.frame(
            [
                {
                    "job": js.spec.name,
                    "tenant": js.spec.tenant,
                    "priority": js.spec.priority,
                    "n_gpus": js.spec.n_gpus,
                    "state": js.state,
                    "submit_ts": js.spec.submit_ts,
                    "start_ts": js.start_ts,
                    "last_checkpoint_step": js.last_checkpoint_step,
                    "restarts": js.restarts,
                    "alloc_conf": js.alloc_conf,
                    "excluded_nodes": ",".join(sorted(js.excluded_nodes)),
                }
                for js in self.jobs.values()
            ],
            schemas.JOBS,
        )
        nodes = schemas.frame(
            [
                {
                    "node": ns.spec.name,
                    "rack": ns.spec.rack,
                    "n_gpus": ns.spec.n_gpus,
                    "gpu_memory_bytes": ns.spec.gpu_memory_bytes,
                    "state": ns.state,
                    "reason": ns.reason,
                    "free_gpus": len(ns.free_gpus()) if ns.schedulable else 0,
                }
                for ns in self.nodes.values()
            ],
            schemas.NODES,
        )
        allocs = schemas.frame(
            [
                {"job": name, "rank": r, "node": node, "gpu": gpu}
                for name, js in self.jobs.items()
                if js.state == "running"
                for r, (node, gpu) in enumerate(js.placement)
            ],
            schemas.ALLOCATIONS,
        )
        return {"jobs": jobs, "nodes": nodes, "allocations": allocs}


class SchedulerStateCollector:
    """Publishes the scheduler's job/node/allocation state as snapshot streams."""

    name = "scheduler"
    streams = {"jobs": schemas.JOBS, "nodes": schemas.NODES, "allocations": schemas.ALLOCATIONS}

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        return self.scheduler.state_frames()
