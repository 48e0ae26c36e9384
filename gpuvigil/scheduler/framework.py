"""The scheduling framework: a per-cycle session over array views of the cluster, the plugin
hooks (small Protocols), and the tentative placement (`Statement`) that commits all-or-nothing.

Shaped like Volcano / the Kubernetes scheduling framework. A cycle opens a `Session`, runs the
configured actions in order (enqueue, allocate, preempt, backfill) and closes it. Actions ask the
plugins:

- `order`   : `job_key(job, ssn)` sorts pending jobs (lowest key first);
- `filter`  : `filter(job, ssn) -> bool[N]` nodes the job may use at all;
- `score`   : `score(job, ssn, feasible) -> float[...]` higher is better; `feasible` is `bool[N]`
              for whole-GPU jobs and `bool[N, G]` (node, GPU) for GPU-sharing jobs;
- `permit`  : `permit(job, plan, ssn) -> str | None` a veto with its reason, before commit;
- `preempt` : `victims(preemptor, ssn) -> list[JobState]` running jobs this plugin lets the
              preemptor evict, and `grace_seconds(preemptor, ssn)` how long victims get.

Node state lives in `NodeState` (source of truth, dicts of which job holds which GPU); the
session reads dense numpy views of it (`ClusterView`) so filters and scores are one vector
operation over all nodes rather than a Python loop per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpuvigil.util.recentlog import RecentLog
from gpuvigil.scheduler.state import MILLI, Action, JobState, NodeState

# Layers, each importing only those below it: state <- framework <- plugins <- actions <- core.
# The framework never imports the core `Scheduler`; sessions and plugins see it as `SchedulerLike`.

UNTRACKED = np.int64(1) << 50  # capacity of a resource a node does not declare


class ClusterView:
    """Dense arrays mirroring the nodes, refreshed only for nodes that changed."""

    def __init__(self, nodes: list[NodeState]):
        self.nodes = nodes
        self.names = [ns.spec.name for ns in nodes]
        self.index = {name: i for i, name in enumerate(self.names)}
        n = len(nodes)
        self.max_gpus = max((ns.spec.n_gpus for ns in nodes), default=0)
        self.n_gpus = np.array([ns.spec.n_gpus for ns in nodes], dtype=np.int64)
        self.gpu_memory = np.array([ns.spec.gpu_memory_bytes for ns in nodes], dtype=np.int64)
        racks = sorted({ns.spec.rack for ns in nodes})
        rack_code = {r: i for i, r in enumerate(racks)}
        self.rack = np.array([rack_code[ns.spec.rack] for ns in nodes], dtype=np.int64)
        self.rack_names = racks
        domains = sorted({ns.spec.nvlink_domain or ns.spec.name for ns in nodes})
        dom_code = {d: i for i, d in enumerate(domains)}
        self.domain = np.array([dom_code[ns.spec.nvlink_domain or ns.spec.name] for ns in nodes], dtype=np.int64)
        self.gpu_model = [ns.spec.gpu_model for ns in nodes]
        self.cpu_total = np.array([ns.spec.cpu_milli or UNTRACKED for ns in nodes], dtype=np.int64)
        self.mem_total = np.array([ns.spec.memory_mib or UNTRACKED for ns in nodes], dtype=np.int64)
        # free milli-GPU per (node, GPU); a GPU a node does not have, a whole-GPU job's GPU and an
        # avoided GPU all read 0 (nothing to give, nothing counted as idle).
        self.free_milli = np.zeros((n, self.max_gpus), dtype=np.int64)
        self.cpu_free = self.cpu_total.copy()
        self.mem_free = self.mem_total.copy()
        self.schedulable = np.zeros(n, dtype=bool)
        self.generation = np.zeros(n, dtype=np.int64)  # bumps on every change of a node
        # Per-node aggregates kept current so whole-GPU placement reads N numbers, not N x G.
        self.free_total = np.zeros(n, dtype=np.int64)
        self.free_whole = np.zeros(n, dtype=np.int64)
        self.sync_many(list(range(n)))

    def refresh(self, rows) -> None:
        rows = np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64)
        if rows.size:
            fm = self.free_milli[rows]
            self.free_total[rows] = fm.sum(axis=1)
            self.free_whole[rows] = (fm == MILLI).sum(axis=1)

    def sync(self, i: int) -> None:
        self.sync_many([i])

    def sync_many(self, rows: list[int]) -> None:
        """Re-read these nodes from NodeState: plain Python per GPU, one numpy write per array."""
        if not rows:
            return
        g_max = self.max_gpus
        free_rows, cpu, mem, up = [], [], [], []
        for i in rows:
            ns = self.nodes[i]
            n = ns.spec.n_gpus
            row = [MILLI] * n + [0] * (g_max - n)
            for g in ns.used:
                if 0 <= g < n:
                    row[g] = 0
            for g, held in ns.shared.items():
                if held and 0 <= g < n:
                    row[g] = MILLI - sum(held.values())
            for g in ns.avoid_gpus:
                if 0 <= g < n:
                    row[g] = 0
            free_rows.append(row)
            cpu.append(ns.cpu_used)
            mem.append(ns.mem_used)
            up.append(ns.state == "up")
            object.__setattr__(ns, "dirty", False)
        idx = np.asarray(rows, dtype=np.int64)
        block = np.asarray(free_rows, dtype=np.int64).reshape(len(rows), g_max)
        self.free_milli[idx] = block
        self.cpu_free[idx] = self.cpu_total[idx] - np.asarray(cpu, dtype=np.int64)
        self.mem_free[idx] = self.mem_total[idx] - np.asarray(mem, dtype=np.int64)
        self.schedulable[idx] = up
        self.generation[idx] += 1
        self.free_total[idx] = block.sum(axis=1)
        self.free_whole[idx] = (block == MILLI).sum(axis=1)

    def copy_mutable(self) -> dict[str, np.ndarray]:
        return {
            "free_milli": self.free_milli.copy(),
            "cpu_free": self.cpu_free.copy(),
            "mem_free": self.mem_free.copy(),
            "free_total": self.free_total.copy(),
            "free_whole": self.free_whole.copy(),
        }


@dataclass
class Plan:
    """A tentative placement: rank → (node index, GPU index; -1 for a CPU-only task)."""

    job: JobState
    slots: list[tuple[int, int]]
    milli: int = MILLI
    victims: list[JobState] = field(default_factory=list)
    # Why here (for the decision record): weighted score per plugin at the chosen option, the
    # next best nodes, and a line for plans a planner made (multi-node gangs).
    scores: dict[str, float] = field(default_factory=dict)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    why: str = ""

    def nodes(self) -> list[int]:
        return sorted({n for n, _ in self.slots})


class Statement:
    """Tentative changes to the session's arrays, undone by `discard()`.

    Preemption releases candidate victims here first and plans the preemptor against the
    result; only if that plan is complete are the victims really evicted, so neither the
    victims nor the gang end up half handled.
    """

    def __init__(self, view: ClusterView):
        self.view = view
        self._saved = view.copy_mutable()
        self._rows: set[int] = set()

    def _touch(self, rows) -> None:
        # Caches keyed on a node's generation (FGD) must not read a tentative state as final.
        rows = list(rows)
        self._rows.update(rows)
        self.view.generation[rows] += 1
        self.view.refresh(rows)

    def give_back(self, job: JobState) -> None:
        """Tentatively release a running job's resources (a preemption candidate)."""
        v = self.view
        milli = job.spec.gpu_milli
        nodes = sorted({node for node, _ in job.placement})
        for node, g in job.placement:
            i = v.index[node]
            if g >= 0 and g not in v.nodes[i].avoid_gpus:
                v.free_milli[i, g] += milli if milli < MILLI else MILLI
        self._touch(v.index[node] for node in nodes)
        for node in nodes:
            i = v.index[node]
            per_node = sum(1 for s in job.placement if s[0] == node)
            share = per_node / max(1, len(job.placement))
            v.cpu_free[i] += int(round(job.spec.cpu_milli * share))
            v.mem_free[i] += int(round(job.spec.memory_mib * share))

    def discard(self) -> None:
        for key, arr in self._saved.items():
            getattr(self.view, key)[...] = arr
        if self._rows:
            self.view.generation[list(self._rows)] += 1
            self._rows.clear()


class SchedulerLike(Protocol):
    """What actions and plugins use of the scheduler (`gpuvigil.scheduler.core.Scheduler`),
    which sits above them: they are handed one, they never import it."""

    config: Any  # SchedulerConfig
    nodes: dict[str, NodeState]
    jobs: dict[str, JobState]
    actions: RecentLog[Action]  # the newest actions; append() records one
    decisions: Any  # state.DecisionLog
    plugins: Any  # plugins.Registry
    view: ClusterView
    total_gpus: int

    def plugin(self, name: str) -> Any: ...

    def commit(self, plan: Plan, now: float) -> Action: ...

    def sync_view(self) -> None: ...

    def find_plan(self, job: JobState, ssn: Session) -> Plan | None: ...

    def permitted(self, plan: Plan, ssn: Session) -> str | None: ...

    def work_since_checkpoint(self, js: JobState, now: float) -> float: ...

    def _set_state(self, js: JobState, state: str) -> None: ...

    def _requeue(self, js: JobState, now: float, why: str, hint_id: str | None = None, kind: str = "requeued") -> Action: ...


@dataclass
class Session:
    """One scheduling cycle's snapshot: time, the cluster view and the jobs it considers."""

    now: float
    scheduler: SchedulerLike
    view: ClusterView
    pending: list[JobState]
    # Requirement shapes that already failed this cycle: a later job needing at least as much
    # (and no special constraints) cannot fit either, so it is skipped without scoring.
    unschedulable_shapes: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    placed: list[Plan] = field(default_factory=list)
    blocked: list[JobState] = field(default_factory=list)
    # For each failed plain shape: the job that failed with it and its decision (a dominated job
    # waits for the same reason).
    shape_why: dict[tuple[int, int, int, int, int], tuple[str, Any]] = field(default_factory=dict)
    # Nodes held this cycle for blocked jobs of a reserving class (allocate): other jobs do not
    # get them, backfill (short jobs) may. `reserved_by` names the holder of each held node.
    reserved: Any = None  # np.ndarray[bool] | None
    reserved_by: dict[int, str] = field(default_factory=dict)
    # Nodes held for preemptors whose victims are under notice (`awaiting_nodes`): closed to
    # every other job, backfill included.
    held: Any = None  # np.ndarray[bool] | None
    held_by: dict[int, str] = field(default_factory=dict)
    backfilling: bool = False  # backfill runs: held nodes are open to short jobs
    version: int = 0  # bumps whenever this cycle binds or evicts (invalidates `memo`)
    memo: dict = field(default_factory=dict)

    def bump(self) -> None:
        self.version += 1
        self.memo.clear()

    @property
    def cfg(self):
        return self.scheduler.config


# -- plugin hooks ---------------------------------------------------------------------------


@runtime_checkable
class Plugin(Protocol):
    name: str


@runtime_checkable
class OrderPlugin(Protocol):
    name: str

    def job_key(self, job: JobState, ssn: Session) -> tuple: ...


@runtime_checkable
class FilterPlugin(Protocol):
    name: str

    def filter(self, job: JobState, ssn: Session) -> np.ndarray: ...


@runtime_checkable
class ScorePlugin(Protocol):
    name: str

    def score(self, job: JobState, ssn: Session, feasible: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class PermitPlugin(Protocol):
    name: str

    def permit(self, job: JobState, plan: Plan, ssn: Session) -> str | None: ...


@runtime_checkable
class PreemptPlugin(Protocol):
    name: str

    def victims(self, preemptor: JobState, ssn: Session) -> list[JobState]: ...

    def grace_seconds(self, preemptor: JobState, ssn: Session) -> float: ...


@runtime_checkable
class GangPlanner(Protocol):
    """Chooses nodes for a job that does not fit on one node (topology)."""

    name: str

    def plan_multi_node(self, job: JobState, ssn: Session, feasible: np.ndarray) -> list[tuple[int, int]] | None: ...


class SubmitListener(Protocol):
    """Told of every submitted job (e.g. to learn the target workload)."""

    def on_submit(self, job: JobState) -> None: ...


class BindListener(Protocol):
    """Told after a job's placement is committed (e.g. to mark borrowed quota)."""

    def on_bind(self, job: JobState, plan: Plan) -> None: ...


class ChangeListener(Protocol):
    """Told which nodes changed when the view is refreshed (caches keyed on nodes)."""

    def on_change(self, node_indices: list[int]) -> None: ...
