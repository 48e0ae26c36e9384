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
        out = [js for r, jobs in by_rank.items() if r > mine for js in jobs]
        quota = self.scheduler.plugin("quota")
        if quota is None or not quota.enabled:
            return out
        # Priority does not cross tenants' guarantees: another tenant's job is a victim only
        # while that tenant would stay at or above its quota without it (it runs on borrowed
        # GPUs). Otherwise a borrowing high-priority job evicts a guaranteed one, which reclaims
        # its quota back by evicting the borrower, and so on (preemption ping-pong).
        used = ssn.memo.get("priority.quota_usage")
        if used is None:
            used = ssn.memo["priority.quota_usage"] = quota.usage()
        tenant = preemptor.spec.tenant
        kept, others = [], {}
        for js in out:
            t = js.spec.tenant
            if t == tenant or quota.cfg.quota(t) is None:
                kept.append(js)
            else:
                others.setdefault(t, []).append(js)
        for t, jobs in others.items():
            over = used.get(t, 0.0) - quota.cfg.quota(t)  # what the tenant borrows
            # Lowest class first, then the most recently started, up to what it borrows.
            for js in sorted(jobs, key=lambda j: (-self.rank(j.spec.priority), -(j.start_ts or 0.0), j.spec.name)):
                if over <= 1e-9:
                    break
                if js.gpu_demand <= over + 1e-9:
                    kept.append(js)
                    over -= js.gpu_demand
        return kept
