"""Configuration of the built-in scheduler (section `scheduler`, defaults in
gpuvigil/config/scheduler.yaml). Invalid values are rejected at load with the reason."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from gpuvigil import config

ACTIONS = ("enqueue", "allocate", "preempt", "backfill")
PLUGINS = ("priority", "quota", "gang", "topology", "fragmentation", "health")
PLACEMENTS = ("ours", "fgd", "best_fit", "first_fit")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PriorityConfig(_Strict):
    classes: list[str] = Field(default_factory=lambda: ["P0", "P1", "P2"], min_length=1)
    preempt_grace_seconds: dict[str, float] = Field(default_factory=lambda: {"P0": 0.0, "P1": 300.0})
    _ranks: dict[str, int] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _known_classes(self) -> PriorityConfig:
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes must be distinct, got {self.classes}")
        unknown = sorted(set(self.preempt_grace_seconds) - set(self.classes))
        if unknown:
            raise ValueError(f"preempt_grace_seconds names unknown class(es) {unknown}; classes are {self.classes}")
        bad = {k: v for k, v in self.preempt_grace_seconds.items() if v < 0}
        if bad:
            raise ValueError(f"grace periods must be >= 0 seconds, got {bad}")
        return self

    def rank(self, cls: str) -> int:
        """0 = highest; an unknown class ranks below every configured one."""
        if self._ranks is None:
            self._ranks = {c: i for i, c in enumerate(self.classes)}
        return self._ranks.get(cls, len(self.classes))


class TenantQuota(_Strict):
    gpus: float = Field(ge=0)


class QuotaConfig(_Strict):
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)
    default_gpus: float | None = Field(None, ge=0)
    borrow: bool = True
    reclaim_grace_seconds: float = Field(0.0, ge=0)

    def quota(self, tenant: str) -> float | None:
        q = self.tenants.get(tenant)
        return q.gpus if q is not None else self.default_gpus


class GangConfig(_Strict):
    min_available: Literal["all"] = "all"


class TopologyConfig(_Strict):
    levels: list[Literal["nvlink_domain", "rack"]] = Field(default_factory=lambda: ["nvlink_domain", "rack"])


class FragmentationConfig(_Strict):
    workload: Literal["observed"] = "observed"
    refresh_every_jobs: int = Field(200, ge=1)
    max_classes: int = Field(64, ge=1)


class AllocateConfig(_Strict):
    reserve_classes: list[str] = Field(default_factory=lambda: ["P0"])


class BackfillConfig(_Strict):
    max_duration_seconds: float = Field(3600.0, ge=0)


class ExplainConfig(_Strict):
    """Decision records served by `GET /v1/jobs/{id}/why` and `gpuvigil why`."""

    enabled: bool = True
    per_job: int = Field(8, ge=1, le=1000)  # distinct decisions kept per job (repeats merge)
    max_jobs: int = Field(20000, ge=1)  # jobs remembered; the least recently decided go first
    recent_actions: int = Field(5, ge=0, le=100)  # the job's last actions shown with its decisions
    actions_kept: int = Field(100_000, ge=1)  # the scheduler's newest actions kept in memory


class PreemptionConfig(_Strict):
    """How victims are evicted, whichever plugin chose them (priority or quota reclaim)."""

    # A preemption whose grace is 0 s (e.g. P0) still gives victims with work since their last
    # checkpoint this long to save it: they lose minutes of work instead of up to a checkpoint
    # interval, and the preemptor starts when they report the checkpoint. 0 = evict at once.
    checkpoint_notice_seconds: float = Field(120.0, ge=0)
    # A victim under notice that reports a checkpoint taken after the notice has what the grace
    # period was for: it is evicted at that cycle, not at the deadline.
    end_grace_on_checkpoint: bool = True


class HealthConfig(_Strict):
    restart_overhead_seconds: float = Field(0.0, ge=0)


class SchedulerConfig(_Strict):
    actions: list[str] = Field(default_factory=lambda: list(ACTIONS))
    plugins: list[str] = Field(default_factory=lambda: list(PLUGINS))
    placement: Literal["ours", "fgd", "best_fit", "first_fit"] = "ours"
    priority: PriorityConfig = Field(default_factory=PriorityConfig)
    quota: QuotaConfig = Field(default_factory=QuotaConfig)
    gang: GangConfig = Field(default_factory=GangConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    fragmentation: FragmentationConfig = Field(default_factory=FragmentationConfig)
    score_weights: dict[str, float] = Field(default_factory=lambda: {"fragmentation": 1.0, "binpack": 0.2, "topology": 0.01, "health": 10.0})
    allocate: AllocateConfig = Field(default_factory=AllocateConfig)
    backfill: BackfillConfig = Field(default_factory=BackfillConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    explain: ExplainConfig = Field(default_factory=ExplainConfig)

    @field_validator("actions")
    @classmethod
    def _actions(cls, v: list[str]) -> list[str]:
        unknown = [a for a in v if a not in ACTIONS]
        if unknown:
            raise ValueError(f"unknown action(s) {unknown}; known: {list(ACTIONS)}")
        if "allocate" not in v:
            raise ValueError("'allocate' must be enabled: without it nothing is ever placed")
        order = [ACTIONS.index(a) for a in v]
        if order != sorted(order) or len(set(v)) != len(v):
            raise ValueError(f"actions must be distinct and in the order {list(ACTIONS)}, got {v}")
        return v

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in PLUGINS]
        if unknown:
            raise ValueError(f"unknown plugin(s) {unknown}; known: {list(PLUGINS)}")
        if "gang" not in v:
            raise ValueError("'gang' cannot be disabled: placements are all-or-nothing by design")
        return v

    @field_validator("score_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        known = {"fragmentation", "binpack", "topology", "health"}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"unknown score weight(s) {unknown}; known: {sorted(known)}")
        neg = {k: w for k, w in v.items() if w < 0}
        if neg:
            raise ValueError(f"score weights must be >= 0, got {neg}")
        return v


def load_scheduler_config(cfg: dict[str, Any] | SchedulerConfig | None = None) -> SchedulerConfig:
    """`cfg` is a whole loaded config (all sections), a SchedulerConfig, or None for defaults."""
    if isinstance(cfg, SchedulerConfig):
        return cfg
    return config.section("scheduler", SchedulerConfig, cfg)
