"""The built-in scheduler's state records: node and job specs, their live state, and the actions
it takes. The bottom layer of the scheduler (state <- framework <- plugins <- actions <- core):
everything above reads these types, and this module imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MILLI = 1000  # one whole GPU in milli-GPU
GIB = 1 << 30


@dataclass
class NodeSpec:
    name: str
    rack: str = "rack-0"
    n_gpus: int = 8
    gpu_memory_bytes: int = 141 * GIB
    nvlink_domain: str | None = None  # None = the node itself (one HGX board)
    cpu_milli: int = 0  # 0 = not tracked
    memory_mib: int = 0  # 0 = not tracked
    gpu_model: str = ""


@dataclass
class JobSpec:
    name: str
    n_gpus: int
    tenant: str = "default"
    priority: str = "P2"
    submit_ts: float = 0.0
    min_gpu_memory_bytes: int = 0
    duration_seconds: float | None = None  # for trace replay; None = runs until stopped
    gpus_per_node: int | None = None  # full-node gangs: exactly this many GPUs on each node used
    gpu_milli: int = MILLI  # share of one GPU (GPU-sharing tasks, n_gpus == 1); 1000 = whole GPUs
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def gpu_demand(self) -> float:
        """GPUs this job holds (fractional for a GPU-sharing task)."""
        return self.n_gpus * min(self.gpu_milli, MILLI) / MILLI


@dataclass
class Action:
    ts: float
    action: str  # placed | cordoned | drained | uncordoned | requeued | preempted | preempt_notice | set_alloc_conf | resized | moved | avoid_gpu | failed | completed | cancelled | node_down
    job: str | None = None
    node: str | None = None
    gpu: int | None = None
    detail: str = ""
    hint_id: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


class _TrackedDict(dict):
    """A dict that tells its node when it changes (callers may edit `used` directly)."""

    def __init__(self, owner: NodeState, *args: Any):
        super().__init__(*args)
        self._owner = owner

    def _touch(self) -> None:
        self._owner.touch()

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._touch()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._touch()

    def pop(self, *a):
        out = super().pop(*a)
        self._touch()
        return out

    def clear(self):
        super().clear()
        self._touch()

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self._touch()

    def setdefault(self, k, d=None):
        out = super().setdefault(k, d)
        self._touch()
        return out


class _TrackedSet(set):
    def __init__(self, owner: NodeState, *args: Any):
        super().__init__(*args)
        self._owner = owner

    def add(self, x):
        super().add(x)
        self._owner.touch()

    def discard(self, x):
        super().discard(x)
        self._owner.touch()

    def remove(self, x):
        super().remove(x)
        self._owner.touch()

    def clear(self):
        super().clear()
        self._owner.touch()

    def __ior__(self, other):
        out = super().__ior__(other)
        self._owner.touch()
        return out


_NODE_TRACKED = {"state", "used", "shared", "avoid_gpus", "cpu_used", "mem_used"}


@dataclass(eq=False)  # identity: two nodes are never "equal" by content
class NodeState:
    spec: NodeSpec
    state: str = "up"  # up | cordoned | draining | drained | down
    reason: str = ""
    used: dict[int, str] = field(default_factory=dict)  # whole GPU index → job
    avoid_gpus: set[int] = field(default_factory=set)
    shared: dict[int, dict[str, int]] = field(default_factory=dict)  # GPU → {job: milli} for GPU-sharing tasks
    cpu_used: int = 0
    mem_used: int = 0
    dirty: bool = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("used", "shared") and not isinstance(value, _TrackedDict):
            value = _TrackedDict(self, value)
        elif name == "avoid_gpus" and not isinstance(value, _TrackedSet):
            value = _TrackedSet(self, value)
        object.__setattr__(self, name, value)
        if name in _NODE_TRACKED:
            self.touch()

    def touch(self) -> None:
        object.__setattr__(self, "dirty", True)
        sink = self.__dict__.get("_sink")
        if sink is not None:
            sink.add(self.spec.name)

    def free_gpus(self) -> list[int]:
        """Whole GPUs nobody holds (not even a share) and nobody avoids."""
        return [g for g in range(self.spec.n_gpus) if g not in self.used and g not in self.avoid_gpus and not self.shared.get(g)]

    @property
    def schedulable(self) -> bool:
        return self.state == "up"

    def jobs(self) -> set[str]:
        out = set(self.used.values())
        for held in self.shared.values():
            out.update(held)
        return out


@dataclass(eq=False)  # identity: membership tests stay O(1) per comparison
class JobState:
    spec: JobSpec
    state: str = "pending"  # pending | running | completed | failed | cancelled
    placement: list[tuple[str, int]] = field(default_factory=list)  # rank → (node, gpu); gpu -1 for a CPU-only task
    start_ts: float | None = None
    last_checkpoint_step: int = 0
    last_checkpoint_ts: float | None = None
    restarts: int = 0
    alloc_conf: str = ""
    excluded_nodes: set[str] = field(default_factory=set)
    memory_scale: float = 1.0  # < 1 after a resize to a smaller micro-batch
    preferred_nodes: list[str] = field(default_factory=list)
    lost_gpu_seconds: float = 0.0
    # Queueing and preemption bookkeeping.
    pending_since: float | None = None
    first_start_ts: float | None = None
    queued_seconds: float = 0.0
    end_ts: float | None = None
    preemptions: int = 0
    borrowed: bool = False  # running on idle quota of other tenants (reclaimable)
    preempt_deadline: float | None = None  # victim: evicted at this time unless it finishes
    preempted_by: str | None = None
    preempt_notice_ts: float | None = None  # victim: when it was told
    preempt_via: str = ""  # the plugin that chose it: priority | quota (reclaim)
    awaiting_victims: list[str] = field(default_factory=list)  # preemptor: victims under notice
    awaiting_deadline: float | None = None
    awaiting_nodes: list[str] = field(default_factory=list)  # preemptor: the nodes its plan uses (held for it)

    @property
    def gpu_demand(self) -> float:
        return self.spec.gpu_demand


# -- decision records ("why is my job placed there / still waiting") ---------------------------


@dataclass
class Decision:
    """What one cycle decided for one job, and why. Never mutated once recorded (one object may
    be shared by many jobs held for the same reason in a cycle).

    outcome: placed | waiting | preempting | failed.
    reason: one line an on-call engineer can read.
    scores: for a placement, each score plugin's weighted contribution at the chosen option.
    alternatives: for a placement, the next best nodes and their total scores.
    rejected: for a wait, node classes that could not take the job: [{stage, reason, nodes,
      node_types, examples}], the stage being the node state, a filter plugin, or a resource.
    blocker: what holds the job besides the nodes (quota, gang, a reserving job, victims).
    """

    ts: float
    outcome: str
    reason: str
    nodes: list[str] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    blocker: str | None = None

    def key(self) -> tuple:
        k = self.__dict__.get("_key")
        if k is None:  # computed once: a shared decision is recorded for many jobs
            k = (self.outcome, self.reason, self.blocker, tuple(self.nodes), tuple((r["stage"], r["reason"], r["nodes"]) for r in self.rejected))
            self.__dict__["_key"] = k
        return k

    def to_json_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class DecisionLog:
    """Per-job decision history, bounded: at most `per_job` entries per job (a decision equal to
    the previous one only extends that entry: a job waiting for hours for the same reason costs
    one entry) and at most `max_jobs` jobs (the least recently decided are forgotten)."""

    def __init__(self, per_job: int = 8, max_jobs: int = 20000, enabled: bool = True):
        self.per_job = per_job
        self.max_jobs = max_jobs
        self.enabled = enabled
        # job -> entries [decision, key, first_ts, cycles, previous decision]; the latest wins.
        self._by_job: dict[str, list[list[Any]]] = {}

    def record(self, job: str, d: Decision) -> None:
        if not self.enabled:
            return
        hist = self._by_job.pop(job, None)  # re-inserted last: dict order is recency
        if hist is None:
            hist = []
            while len(self._by_job) >= self.max_jobs:
                self._by_job.pop(next(iter(self._by_job)))
        if hist and hist[-1][0].ts == d.ts:
            # Decided again in the same cycle (e.g. it also reserved nodes): the later decision
            # replaces the earlier one.
            last = hist[-1]
            if last[3] == 1:
                hist.pop()
            else:
                last[0], last[3] = last[4], last[3] - 1
        key = d.key()
        if hist and hist[-1][1] == key:
            last = hist[-1]
            last[4], last[0] = last[0], d
            last[3] += 1
        else:
            hist.append([d, key, d.ts, 1, d])
            del hist[: -self.per_job]
        self._by_job[job] = hist

    def history(self, job: str) -> list[dict[str, Any]]:
        """Oldest first: each decision with `first_ts` (its first cycle) and `cycles` (how many
        cycles in a row decided the same)."""
        return [{**d.to_json_dict(), "first_ts": first, "cycles": n} for d, _, first, n, _ in self._by_job.get(job, ())]

    def knows(self, job: str) -> bool:
        return job in self._by_job

    def __len__(self) -> int:
        return len(self._by_job)
