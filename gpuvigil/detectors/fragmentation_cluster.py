"""Cluster-level fragmentation: free GPUs scattered so pending gang jobs cannot be placed.

Measure (in the spirit of FGD, ATC'23): the expected share of free GPUs that the current mix of
pending job shapes cannot use. A node's free GPUs are unusable by a job that needs more GPUs on
one node than that node has free. Also reported: the largest gang that fits per node and per rack.
The fix is a `compact` hint: the moves that empty one node for the blocked gang.
"""

from __future__ import annotations

import itertools
from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class FragmentationClusterConfig(BaseModel):
    min_pending_seconds: float = 10.0


def unusable_share(free_per_node: list[int], need_per_node: list[int]) -> float:
    """Expected share of free GPUs unusable by a job drawn uniformly from `need_per_node`."""
    total = sum(free_per_node)
    if total == 0 or not need_per_node:
        return 0.0
    lost = sum(sum(f for f in free_per_node if f < need) for need in need_per_node) / len(need_per_node)
    return lost / total


def plan_compaction(node_free: dict[str, int], node_jobs: dict[str, dict[str, int]], need: int) -> tuple[str, list[dict]] | None:
    """Moves that give one node `need` free GPUs: whole jobs go to other nodes, best fit first."""
    order = sorted(node_free, key=lambda n: (-node_free[n], n))
    for target in order:
        deficit = need - node_free[target]
        if deficit <= 0:
            return target, []
        free = {n: f for n, f in node_free.items() if n != target}
        moves = []
        for job, size in sorted(node_jobs.get(target, {}).items(), key=lambda kv: (-kv[1], kv[0])):
            if deficit <= 0:
                break
            fits = [n for n, f in free.items() if f >= size]
            if not fits:
                continue
            dest = min(fits, key=lambda n: (free[n], n))
            free[dest] -= size
            deficit -= size
            moves.append({"job": job, "from_node": target, "to_node": dest, "gpus": size})
        if deficit <= 0:
            return target, moves
        # Largest-first can strand the target (a big job takes the only room two small ones needed):
        # then search the target's jobs exactly, fewest moves first.
        moves = _fewest_moves(target, node_jobs.get(target, {}), {n: f for n, f in node_free.items() if n != target}, need - node_free[target])
        if moves is not None:
            return target, moves
    return None


def _fewest_moves(target: str, jobs: dict[str, int], free: dict[str, int], deficit: int) -> list[dict] | None:
    """The smallest set of the target's jobs that frees `deficit` GPUs and fits elsewhere (exact:
    a node holds at most a handful of jobs, and nodes with the same free count are interchangeable)."""
    items = sorted(jobs.items(), key=lambda kv: (-kv[1], kv[0]))
    for k in range(1, len(items) + 1):
        for subset in itertools.combinations(items, k):
            if sum(size for _, size in subset) < deficit:
                continue
            dests = _pack([size for _, size in subset], dict(free))
            if dests is not None:
                return [{"job": job, "from_node": target, "to_node": d, "gpus": size} for (job, size), d in zip(subset, dests)]
    return None


def _pack(sizes: list[int], free: dict[str, int]) -> list[str] | None:
    """Destinations for `sizes` (largest first) within `free`, tightest fit first; None if none."""
    if not sizes:
        return []
    size, tried = sizes[0], set()
    for node in sorted(free, key=lambda n: (free[n], n)):
        if free[node] < size or free[node] in tried:
            continue
        tried.add(free[node])
        free[node] -= size
        rest = _pack(sizes[1:], free)
        free[node] += size
        if rest is not None:
            return [node, *rest]
    return None


class ClusterFragmentationDetector(Declared):
    spec = DetectorSpec(
        name="fragmentation_cluster",
        config=FragmentationClusterConfig,
        emits=(FindingKind.FRAGMENTATION_CLUSTER,),
        reads={"jobs": HISTORY, "nodes": HISTORY, "allocations": HISTORY},
        order=160,
        level="L0",
        streams=("jobs", "nodes", "allocations"),
        every_seconds=5.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("fragmentation_cluster", FragmentationClusterConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        jobs, nodes, allocs = window.get("jobs"), window.get("nodes"), window.get("allocations")
        if jobs.height == 0 or nodes.height == 0:
            return []
        pending = jobs.filter((pl.col("state") == "pending") & (pl.col("submit_ts") <= now - self.config.min_pending_seconds))
        if pending.height == 0:
            return []
        up = nodes.filter(pl.col("state") == "up")
        free = dict(zip(up["node"].to_list(), up["free_gpus"].to_list()))
        capacity = int(up["n_gpus"].max() or 0)
        total_free = sum(free.values())
        per_node_need = [
            int(r["gpus_per_node"] or min(r["n_gpus"], capacity)) for r in pending.iter_rows(named=True)
        ]
        share = unusable_share(list(free.values()), per_node_need)
        rack_free = up.group_by("rack").agg(pl.col("free_gpus").sum())["free_gpus"].to_list()
        node_jobs: dict[str, dict[str, int]] = {}
        for r in allocs.group_by(["node", "job"]).agg(pl.len().alias("n")).iter_rows(named=True):
            node_jobs.setdefault(r["node"], {})[r["job"]] = int(r["n"])
        # Jobs spread over several nodes are not moved by compaction (too costly).
        multi = set(allocs.group_by("job").agg(pl.col("node").n_unique().alias("k")).filter(pl.col("k") > 1)["job"].to_list())
        node_jobs = {n: {j: k for j, k in js.items() if j not in multi} for n, js in node_jobs.items()}
        findings = []
        for row in pending.sort("submit_ts").iter_rows(named=True):
            per_node = int(row["gpus_per_node"] or 0)
            n = int(row["n_gpus"])
            if per_node:
                fits_nodes = sum(1 for f in free.values() if f >= per_node)
                blocked = fits_nodes * per_node < n and total_free >= n
            else:
                blocked = False  # any spread allowed: it is capacity, not fragmentation, that blocks it
            if not blocked:
                continue
            plan = plan_compaction(free, node_jobs, per_node) if n == per_node else None
            target, moves = plan if plan else (None, [])
            findings.append(
                Finding(
                    kind=FindingKind.FRAGMENTATION_CLUSTER,
                    severity=Severity.TICKET,
                    ts=now,
                    job=row["job"],
                    node=target,
                    source=self.name,
                    evidence={
                        "pending_gpus": n,
                        "gpus_per_node": per_node,
                        "free_gpus": total_free,
                        "unusable_free_share": round(share, 3),
                        "largest_gang_per_node": max(free.values(), default=0),
                        "largest_gang_per_rack": int(max(rack_free, default=0)),
                        "pending_seconds": round(now - float(row["submit_ts"]), 1),
                        "moves": moves,
                    },
                    summary=(
                        f"{row['job']} ({n} GPUs, {per_node} per node) has waited {now - row['submit_ts']:.0f} s although {total_free} GPUs are free: "
                        f"they are scattered (largest free block {max(free.values(), default=0)} GPUs on one node)"
                        + (f"; moving {len(moves)} small job(s) off {target} frees a slot." if moves else ".")
                    ),
                )
            )
        return findings
