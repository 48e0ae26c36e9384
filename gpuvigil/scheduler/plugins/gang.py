"""Gang scheduling: a job's ranks are placed all at once or not at all (the permit checks the
plan is complete and has the requested per-node shape); a preemption evicts whole gangs."""

from __future__ import annotations

from collections import Counter

from gpuvigil.scheduler.framework import Session


class GangPlugin:
    name = "gang"

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def permit(self, job, plan, ssn: Session) -> str | None:
        spec = job.spec
        want = max(1, spec.n_gpus)
        if len(plan.slots) != want:
            return f"gang incomplete: {len(plan.slots)} of {want} ranks placed"
        gpu_slots = [s for s in plan.slots if s[1] >= 0]
        if len(set(gpu_slots)) != len(gpu_slots):
            return "gang plan uses a GPU twice"
        if spec.gpus_per_node:
            per = Counter(n for n, _ in plan.slots)
            if any(c != spec.gpus_per_node for c in per.values()):
                return f"gang shape: want {spec.gpus_per_node} GPUs on each node, got {sorted(per.values())}"
        return None
