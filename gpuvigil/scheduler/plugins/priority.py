"""Priority classes: order pending jobs by class; P0 may preempt any lower class at once, P1
may preempt lower classes after a grace period (victims get notice to checkpoint), P2 never
preempts. Classes and grace periods are config (`scheduler.priority`)."""

from __future__ import annotations

from gpuvigil.scheduler.framework import Session


class PriorityPlugin:
    name = "priority"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.cfg = scheduler.config.priority
        self.ranks = {c: i for i, c in enumerate(self.cfg.classes)}

    def rank(self, cls: str) -> int:
        return self.ranks.get(cls, len(self.ranks))

    def job_key(self, job, ssn: Session) -> tuple:
        return (self.rank(job.spec.priority),)

    def may_preempt(self, job) -> bool:
        return job.spec.priority in self.cfg.preempt_grace_seconds

    def grace_seconds(self, preemptor, ssn: Session) -> float:
        return float(self.cfg.preempt_grace_seconds.get(preemptor.spec.priority, 0.0))

    def victims(self, preemptor, ssn: Session) -> list:
        if not self.may_preempt(preemptor):
            return []
        mine = self.rank(preemptor.spec.priority)
        by_rank = ssn.memo.get("priority.running_by_rank")
        if by_rank is None:
            by_rank = {}
            for js in self.scheduler._running.values():
                by_rank.setdefault(self.rank(js.spec.priority), []).append(js)
            ssn.memo["priority.running_by_rank"] = by_rank
        return [js for r, jobs in by_rank.items() if r > mine for js in jobs]
