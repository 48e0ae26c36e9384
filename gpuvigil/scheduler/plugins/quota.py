"""Tenant quotas with borrowing: a tenant is guaranteed `quota.tenants[t].gpus`; beyond that it
may borrow idle GPUs (its jobs are marked borrowed), and borrowed GPUs are reclaimed — the
borrowing jobs evicted from their last checkpoint — when a tenant still under its quota needs
them. Tenants without a quota (default_gpus null) are never limited and never reclaimed."""

from __future__ import annotations

from collections import defaultdict

from gpuvigil.scheduler.framework import Session


class QuotaPlugin:
    name = "quota"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.cfg = scheduler.config.quota
        self.enabled = bool(self.cfg.tenants) or self.cfg.default_gpus is not None

    def usage(self) -> dict[str, float]:
        used: dict[str, float] = defaultdict(float)
        for js in self.scheduler._running.values():
            used[js.spec.tenant] += js.gpu_demand
        return used

    def _within(self, tenant: str, extra: float, used: dict[str, float]) -> bool:
        q = self.cfg.quota(tenant)
        return q is None or used.get(tenant, 0.0) + extra <= q + 1e-9

    def job_key(self, job, ssn: Session) -> tuple:
        # Within a priority class, jobs that fit their tenant's guarantee go before borrowers.
        if not self.enabled:
            return (0,)
        return (0 if self._within(job.spec.tenant, job.gpu_demand, self._usage_cached(ssn)) else 1,)

    def _usage_cached(self, ssn: Session) -> dict[str, float]:
        if getattr(ssn, "_quota_usage_at", None) != len(ssn.placed):
            ssn._quota_usage = self.usage()
            ssn._quota_usage_at = len(ssn.placed)
        return ssn._quota_usage

    def permit(self, job, plan, ssn: Session) -> str | None:
        if not self.enabled or self.cfg.borrow:
            return None
        if not self._within(job.spec.tenant, job.gpu_demand, self.usage()):
            q = self.cfg.quota(job.spec.tenant)
            return f"tenant {job.spec.tenant!r} would exceed its quota of {q:g} GPUs (borrowing disabled)"
        return None

    def on_bind(self, job, plan) -> None:
        if not self.enabled:
            return
        used = self.usage()
        q = self.cfg.quota(job.spec.tenant)
        job.borrowed = q is not None and used.get(job.spec.tenant, 0.0) > q + 1e-9

    def grace_seconds(self, preemptor, ssn: Session) -> float:
        return float(self.cfg.reclaim_grace_seconds)

    def victims(self, preemptor, ssn: Session) -> list:
        """Reclaim, for a tenant still under its quota: jobs of tenants over their quota, the most
        recently started first, as long as evicting them leaves that tenant at or above its
        quota (only what it borrows). Decided from usage now, not from a flag set at bind time:
        which of a tenant's jobs are "borrowed" changes as its other jobs finish."""
        if not self.enabled:
            return []
        used = self.usage()
        tenant = preemptor.spec.tenant
        if self.cfg.quota(tenant) is None or not self._within(tenant, preemptor.gpu_demand, used):
            return []
        by_tenant: dict[str, list] = defaultdict(list)
        for js in self.scheduler._running.values():
            if js.spec.tenant != tenant:
                by_tenant[js.spec.tenant].append(js)
        out = []
        for t, jobs in by_tenant.items():
            q = self.cfg.quota(t)
            if q is None:
                continue
            over = used.get(t, 0.0) - q
            # Jobs bound beyond the quota first, then the most recently started.
            for js in sorted(jobs, key=lambda j: (not j.borrowed, -(j.start_ts or 0.0), j.spec.name)):
                if over <= 1e-9:
                    break
                if js.gpu_demand <= over + 1e-9:
                    out.append(js)
                    over -= js.gpu_demand
        return out
