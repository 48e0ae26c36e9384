"""Fragmentation-aware placement: Fragmentation Gradient Descent (FGD), after Weng et al.,
"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent"
(USENIX ATC'23), implemented from the paper's definitions.

Fragmentation of node n for one task class m (the GPU capacity m could not use there):
  - m needs no GPU, or n cannot host m at all (too few GPUs with at least m's per-GPU demand
    free, or too little CPU): every idle milli-GPU of n is a fragment;
  - otherwise: the idle milli-GPU on GPUs whose free share is below m's per-GPU demand.
Node fragmentation for a target workload M (task classes with popularity p_m):
  F_n(M) = sum_m p_m * F_n(m).
FGD places a task where the *growth* of F_n(M) is smallest (the steepest descent of the
cluster's expected fragmentation), choosing the GPU on that node the same way for a sharing task.

FGD leaves host memory out of "can host". On the Alibaba trace memory helps strand the last
GPUs: past 95% load, most tasks that fail under FGD (324 of 340, seed 1000, all 1213 nodes) find
GPU+CPU on some node and GPU+memory on some node, but all three on none. So `ours` also counts a
class as unhostable where the node lacks the class's typical (median) memory. The `fgd`
placement keeps the published measure.

The growth for a task class on every (node, GPU) option only changes when that node changes,
so it is cached per task class and recomputed for the nodes whose generation moved.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from gpuvigil.scheduler.framework import MILLI, Session

# Growth vectors cached (task class, and memory for `ours`); oldest dropped first.
CACHE_KEYS = 512


@dataclass(frozen=True)
class Workload:
    """Task classes (cpu milli, GPUs, per-GPU milli) and their popularity (sums to 1); `mem`: the
    typical host memory (MiB) of each class, or None when memory is not part of the measure."""

    cpu: np.ndarray
    n_gpus: np.ndarray
    milli: np.ndarray
    p: np.ndarray
    mem: np.ndarray | None = None

    def with_memory(self, memory: dict[tuple[int, int, int], float]) -> Workload:
        mem = np.array([float(memory.get((int(c), int(n), int(m)), 0.0)) for c, n, m in zip(self.cpu, self.n_gpus, self.milli, strict=True)])
        return Workload(cpu=self.cpu, n_gpus=self.n_gpus, milli=self.milli, p=self.p, mem=mem)

    @classmethod
    def from_counts(cls, counts: dict[tuple[int, int, int], float], max_classes: int | None = None) -> Workload:
        items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if max_classes:
            items = items[:max_classes]
        if not items:
            raise ValueError("a target workload needs at least one task class")
        cpu, n, milli = (np.array(x, dtype=np.int64) for x in zip(*(k for k, _ in items), strict=True))
        w = np.array([c for _, c in items], dtype=np.float64)
        return cls(cpu=cpu, n_gpus=n, milli=np.where(n == 0, 0, milli), p=w / w.sum())


    @classmethod
    def typical(cls, counts: dict[tuple[int, int, int], float], popularity: float = 0.95) -> Workload:
        """The paper simulator's "typical pods": the most frequent task classes (CPU-only ones
        included) until they cover `popularity` of all tasks, renormalised to sum to 1."""
        if not counts:
            raise ValueError("a target workload needs at least one task class")
        # Most frequent first; among equal counts the larger class first, compared by CPU, then
        # per-GPU milli, then GPU count (the simulator's TargetPodList order, pkg/type/resource.go).
        items = sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], -kv[0][2], -kv[0][1]))
        total = float(sum(counts.values()))
        kept: dict[tuple[int, int, int], float] = {}
        covered = 0.0
        for key, c in items:
            if covered >= popularity * total:
                break
            kept[key] = c
            covered += c
        return cls.from_counts(kept)


def paper_score(growth_milli: np.ndarray) -> np.ndarray:
    """FGD's node score in the authors' simulator: int(100 x sigmoid(-growth / 1000)), growth of
    F_n(M) in milli-GPU. The truncation to integers makes near-equal options tie, and ties go
    to the lowest node (name order), then the lowest GPU."""
    return np.floor(100.0 / (1.0 + np.exp(np.clip(growth_milli, -50_000, 50_000) / 1000.0)))


def task_class(spec) -> tuple[int, int, int]:
    return (int(spec.cpu_milli), int(spec.n_gpus), int(min(spec.gpu_milli, MILLI)) if spec.n_gpus else 0)


def node_fragmentation(free: np.ndarray, cpu_free: np.ndarray, wl: Workload, mem_free: np.ndarray | None = None) -> np.ndarray:
    """F_n(M) for each node state: `free` is (..., G) idle milli-GPU per GPU, `cpu_free` (...);
    with `mem_free` (...) and a workload with memory, a class also needs its memory to be hostable."""
    total = free.sum(axis=-1)
    ok = free[..., None, :] >= wl.milli[:, None]  # (..., M, G): GPU g can take one unit of class m
    count = ok.sum(axis=-1)
    can = (count >= wl.n_gpus) & (cpu_free[..., None] >= wl.cpu) & (wl.milli > 0)
    if mem_free is not None and wl.mem is not None:
        can &= mem_free[..., None] >= wl.mem
    partial = np.where(ok, 0, free[..., None, :]).sum(axis=-1)
    frag = np.where(can, partial, total[..., None])
    return frag @ wl.p


def _take_whole(free: np.ndarray, k: int) -> np.ndarray:
    """State after a k-GPU task takes the first k wholly idle GPUs of each row."""
    whole = free == MILLI
    taken = whole & (np.cumsum(whole, axis=-1) <= k)
    return np.where(taken, 0, free)


class FragmentationPlugin:
    name = "fragmentation"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.cfg = scheduler.config.fragmentation
        self.observed: Counter = Counter()
        self.observed_mem: dict[tuple[int, int, int], deque] = {}
        self.workload: Workload | None = None
        # The baseline `fgd` placement scores with the published measure (no memory).
        self.memory_aware = scheduler.config.placement != "fgd"
        self.fixed = False
        self._since_refresh = 0
        self._cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._before: tuple[np.ndarray, np.ndarray] | None = None  # F_n(M) now, and its generations

    # -- target workload ------------------------------------------------------------------------
    def set_workload(self, counts: dict[tuple[int, int, int], float], memory: dict[tuple[int, int, int], float] | None = None) -> None:
        """Fix the target workload (task class → count or share), e.g. a trace's task mix, and
        optionally each class's typical host memory (MiB)."""
        self.workload = Workload.from_counts(counts)
        if memory:
            self.workload = self.workload.with_memory(memory)
        self.fixed = True
        self._cache.clear()
        self._before = None

    def on_submit(self, job) -> None:
        if self.fixed:
            return
        cls = task_class(job.spec)
        self.observed[cls] += 1
        if job.spec.memory_mib:
            self.observed_mem.setdefault(cls, deque(maxlen=256)).append(job.spec.memory_mib)
        self._since_refresh += 1
        if self.workload is None or self._since_refresh >= self.cfg.refresh_every_jobs:
            self.workload = self._observed_workload()
            self._since_refresh = 0
            self._cache.clear()
            self._before = None

    def _observed_workload(self) -> Workload:
        wl = Workload.from_counts(dict(self.observed), self.cfg.max_classes)
        if self.observed_mem:
            wl = wl.with_memory({c: float(np.median(m)) for c, m in self.observed_mem.items()})
        return wl

    # -- measure --------------------------------------------------------------------------------
    def cluster_fragmentation(self) -> float:
        """Sum of F_n(M) over schedulable nodes, in GPUs."""
        if self.workload is None:
            return 0.0
        v = self.scheduler.view
        f = node_fragmentation(v.free_milli, v.cpu_free, self.workload)
        return float((f * v.schedulable).sum() / MILLI)

    # -- score ----------------------------------------------------------------------------------
    def _uses_memory(self) -> bool:
        return self.memory_aware and self.workload is not None and self.workload.mem is not None

    def _deltas(self, rows: np.ndarray, cls: tuple, v) -> np.ndarray:
        """Growth of F_n(M) for placing one task of `cls` (cpu, GPUs, milli[, memory]) on each
        row (per GPU if sharing)."""
        cpu, n, milli = cls[:3]
        wl = self.workload
        free = v.free_milli[rows]
        cpu_free = v.cpu_free[rows]
        mem_after = v.mem_free[rows] - (cls[3] if len(cls) > 3 else 0) if self._uses_memory() else None
        before = self._current(v)[rows]
        if n == 1 and milli < MILLI:
            g = free.shape[1]
            after_free = np.repeat(free[:, None, :], g, axis=1)  # (R, option GPU, G)
            idx = np.arange(g)
            after_free[:, idx, idx] -= milli
            mem_g = None if mem_after is None else np.repeat(mem_after[:, None], g, axis=1)
            after = node_fragmentation(after_free, np.repeat((cpu_free - cpu)[:, None], g, axis=1), wl, mem_g)
            return after - before[:, None]
        after_free = _take_whole(free, n) if n else free
        after = node_fragmentation(after_free, cpu_free - cpu, wl, mem_after)
        return after - before

    def _node_frag(self, v, rows=slice(None)) -> np.ndarray:
        return node_fragmentation(v.free_milli[rows], v.cpu_free[rows], self.workload, v.mem_free[rows] if self._uses_memory() else None)

    def _current(self, v) -> np.ndarray:
        """F_n(M) of every node as it is now (shared by all task classes)."""
        if self._before is None or len(self._before[0]) != len(v.names):
            self._before = (self._node_frag(v), v.generation.copy())
        f, gens = self._before
        stale = np.flatnonzero(gens != v.generation)
        if stale.size:
            f[stale] = self._node_frag(v, stale)
            gens[stale] = v.generation[stale]
        return f

    def score(self, job, ssn: Session, feasible: np.ndarray) -> np.ndarray:
        if self.workload is None:
            self.observed[task_class(job.spec)] += 1
            self.workload = self._observed_workload()
            self._cache.clear()
            self._before = None
        v = ssn.view
        cls = task_class(job.spec)
        if self._uses_memory():
            cls = (*cls, int(job.spec.memory_mib))  # the task's own memory moves the node's state too
        cached = self._cache.get(cls)
        if cached is None:
            if len(self._cache) >= CACHE_KEYS:  # task memories vary: keep the cache bounded
                self._cache.pop(next(iter(self._cache)))
            rows = np.arange(len(v.names))
            delta = np.concatenate([self._deltas(rows[i : i + 256], cls, v) for i in range(0, len(rows), 256)]) if len(rows) else np.zeros(feasible.shape)
            self._cache[cls] = (delta, v.generation.copy())
        else:
            delta, gens = cached
            stale = np.flatnonzero(gens != v.generation)
            if stale.size:
                delta[stale] = self._deltas(stale, cls, v)
                gens[stale] = v.generation[stale]
        # Higher is better: minus the growth, in GPUs.
        return -delta / MILLI

    def growth(self, job, ssn: Session, feasible: np.ndarray) -> np.ndarray:
        """Growth of F_n(M) in GPUs for each option (the score with its sign flipped)."""
        return -self.score(job, ssn, feasible)


class PaperFgdScore:
    """FGD exactly as the paper's simulator scores it (`paper_score`): the `fgd` baseline.
    `ours` uses the unquantised growth instead (FragmentationPlugin.score)."""

    name = "fgd_paper"

    def __init__(self, frag: FragmentationPlugin):
        self.frag = frag

    def score(self, job, ssn: Session, feasible: np.ndarray) -> np.ndarray:
        return paper_score(self.frag.growth(job, ssn, feasible) * MILLI)
