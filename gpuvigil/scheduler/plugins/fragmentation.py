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

The growth for a task class on every (node, GPU) option only changes when that node changes,
so it is cached per task class and recomputed for the nodes whose generation moved.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from gpuvigil.scheduler.framework import MILLI, Session


@dataclass(frozen=True)
class Workload:
    """Task classes (cpu milli, GPUs, per-GPU milli) and their popularity (sums to 1)."""

    cpu: np.ndarray
    n_gpus: np.ndarray
    milli: np.ndarray
    p: np.ndarray

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
        # Most frequent first; among equal counts the larger class first (the simulator's order).
        items = sorted(counts.items(), key=lambda kv: (-kv[1], tuple(-x for x in kv[0])))
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


def node_fragmentation(free: np.ndarray, cpu_free: np.ndarray, wl: Workload) -> np.ndarray:
    """F_n(M) for each node state: `free` is (..., G) idle milli-GPU per GPU, `cpu_free` (...)."""
    total = free.sum(axis=-1)
    ok = free[..., None, :] >= wl.milli[:, None]  # (..., M, G): GPU g can take one unit of class m
    count = ok.sum(axis=-1)
    can = (count >= wl.n_gpus) & (cpu_free[..., None] >= wl.cpu) & (wl.milli > 0)
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
        self.workload: Workload | None = None
        self.fixed = False
        self._since_refresh = 0
        self._cache: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._before: tuple[np.ndarray, np.ndarray] | None = None  # F_n(M) now, and its generations

    # -- target workload ------------------------------------------------------------------------
    def set_workload(self, counts: dict[tuple[int, int, int], float]) -> None:
        """Fix the target workload (task class → count or share), e.g. a trace's task mix."""
        self.workload = Workload.from_counts(counts)
        self.fixed = True
        self._cache.clear()
        self._before = None

    def on_submit(self, job) -> None:
        if self.fixed:
            return
        self.observed[task_class(job.spec)] += 1
        self._since_refresh += 1
        if self.workload is None or self._since_refresh >= self.cfg.refresh_every_jobs:
            self.workload = Workload.from_counts(dict(self.observed), self.cfg.max_classes)
            self._since_refresh = 0
            self._cache.clear()
            self._before = None

    # -- measure --------------------------------------------------------------------------------
    def cluster_fragmentation(self) -> float:
        """Sum of F_n(M) over schedulable nodes, in GPUs."""
        if self.workload is None:
            return 0.0
        v = self.scheduler.view
        f = node_fragmentation(v.free_milli, v.cpu_free, self.workload)
        return float((f * v.schedulable).sum() / MILLI)

    # -- score ----------------------------------------------------------------------------------
    def _deltas(self, rows: np.ndarray, cls: tuple[int, int, int], v) -> np.ndarray:
        """Growth of F_n(M) for placing one task of `cls` on each row (per GPU if sharing)."""
        cpu, n, milli = cls
        wl = self.workload
        free = v.free_milli[rows]
        cpu_free = v.cpu_free[rows]
        before = self._current(v)[rows]
        if n == 1 and milli < MILLI:
            g = free.shape[1]
            after_free = np.repeat(free[:, None, :], g, axis=1)  # (R, option GPU, G)
            idx = np.arange(g)
            after_free[:, idx, idx] -= milli
            after = node_fragmentation(after_free, np.repeat((cpu_free - cpu)[:, None], g, axis=1), wl)
            return after - before[:, None]
        after_free = _take_whole(free, n) if n else free
        after = node_fragmentation(after_free, cpu_free - cpu, wl)
        return after - before

    def _current(self, v) -> np.ndarray:
        """F_n(M) of every node as it is now (shared by all task classes)."""
        if self._before is None or len(self._before[0]) != len(v.names):
            self._before = (node_fragmentation(v.free_milli, v.cpu_free, self.workload), v.generation.copy())
        f, gens = self._before
        stale = np.flatnonzero(gens != v.generation)
        if stale.size:
            f[stale] = node_fragmentation(v.free_milli[stale], v.cpu_free[stale], self.workload)
            gens[stale] = v.generation[stale]
        return f

    def score(self, job, ssn: Session, feasible: np.ndarray) -> np.ndarray:
        if self.workload is None:
            self.observed[task_class(job.spec)] += 1
            self.workload = Workload.from_counts(dict(self.observed), self.cfg.max_classes)
            self._cache.clear()
            self._before = None
        v = ssn.view
        cls = task_class(job.spec)
        cached = self._cache.get(cls)
        if cached is None:
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
