"""Topology: a multi-node gang goes into one NVLink domain if one fits it, else one rack, else
the fewest racks (largest free blocks first); single-node tasks are packed into the busiest
rack so whole racks stay free for the next big gang."""

from __future__ import annotations

import numpy as np

from gpuvigil.scheduler.framework import MILLI, Session


class TopologyPlugin:
    name = "topology"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.levels = scheduler.config.topology.levels

    def score(self, job, ssn: Session, feasible: np.ndarray) -> np.ndarray:
        v = ssn.view
        free = v.free_total * v.schedulable
        rack_free = np.bincount(v.rack, weights=free, minlength=len(v.rack_names))
        rack_cap = np.bincount(v.rack, weights=v.n_gpus * MILLI, minlength=len(v.rack_names))
        s = -(rack_free / np.maximum(rack_cap, 1))[v.rack]
        return s[:, None] + np.zeros(feasible.shape) if feasible.ndim == 2 else s

    def plan_multi_node(self, job, ssn: Session, candidates: np.ndarray) -> list[tuple[int, int]] | None:
        v = ssn.view
        k = job.spec.n_gpus
        per = job.spec.gpus_per_node
        whole = v.free_milli == MILLI
        free = whole.sum(axis=1)
        usable = candidates & (free >= (per or 1))
        give = np.where(usable, per if per else free, 0)
        if give.sum() < k:
            return None
        for level in self.levels:
            codes = v.domain if level == "nvlink_domain" else v.rack
            totals = np.bincount(codes, weights=give)
            fitting = np.flatnonzero(totals >= k)
            if fitting.size:
                group = fitting[np.argmin(totals[fitting])]  # tightest group that fits
                members = np.flatnonzero(usable & (codes == group))
                return self._take(members, give, whole, k, per)
        # Fewest racks: fill from the racks with the most free GPUs.
        rack_tot = np.bincount(v.rack, weights=give)
        members = np.flatnonzero(usable)
        order = np.lexsort((-give[members], -rack_tot[v.rack[members]]))
        return self._take(members[order], give, whole, k, per, presorted=True)

    @staticmethod
    def _take(members, give, whole, k, per, presorted=False) -> list[tuple[int, int]] | None:
        if not presorted:
            # Largest free blocks first: fewest nodes for the gang.
            members = members[np.argsort(-give[members], kind="stable")]
        slots: list[tuple[int, int]] = []
        for n in members:
            want = min(int(give[n]), k - len(slots))
            if per and want < per:
                break
            gpus = np.flatnonzero(whole[n])[:want]
            slots.extend((int(n), int(g)) for g in gpus)
            if len(slots) == k:
                return slots
        return None
