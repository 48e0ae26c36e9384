"""The `alerts` config section (gpuvigil/config/alerts.yaml): routing, intervals, thresholds."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuvigil import config
from gpuvigil import kinds

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
# Kinds routed to the hardware team whichever job holds the device (gpuvigil/kinds.py: owner).
HARDWARE_KINDS = frozenset(k.value for k in kinds.HARDWARE_KINDS)


def _check_duration(value: str) -> str:
    if not _DURATION.match(value):
        raise ValueError(f"{value!r} is not a Prometheus duration like 30s, 5m, 4h")
    return value


class RuleThresholds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_temperature_celsius: float = 87
    gpu_temperature_for: str = "5m"
    predicted_oom_seconds: float = Field(900, gt=0)
    memory_headroom_ratio: float = Field(0.03, ge=0, le=1)
    memory_headroom_for: str = "5m"
    collective_stall_for: str = "5m"
    queue_wait_seconds: dict[str, float] = Field(default_factory=lambda: {"P0": 900, "P1": 3600, "P2": 14400})
    fragmentation_ratio: float = Field(0.5, ge=0, le=1)
    fragmentation_for: str = "30m"
    pipeline_stall_for: str = "2m"
    collector_down_for: str = "2m"
    sbe_per_hour: float = Field(100, ge=0)
    # InfiniBand/RoCE ports: link drops within 10 minutes that make a flapping link, symbol
    # errors per minute, and how long a port below its node's fastest rate or a fabric not ready lasts.
    ib_link_flaps: float = Field(2, ge=1)
    ib_symbol_errors_per_minute: float = Field(10, gt=0)
    ib_degraded_for: str = "10m"
    fabric_not_ready_for: str = "5m"

    fleet_clock_lag_seconds: float = Field(120, gt=0)
    fleet_clock_lag_for: str = "2m"
    fleet_clock_skew_seconds: float = Field(10, gt=0)
    fleet_partitions_unjudged_for: str = "2m"
    fleet_consumer_pending_messages: float = Field(10000, gt=0)
    fleet_consumer_pending_for: str = "5m"
    fleet_replays_per_10m: float = Field(8, gt=0)

    @field_validator("gpu_temperature_for", "memory_headroom_for", "collective_stall_for", "fragmentation_for", "pipeline_stall_for", "collector_down_for", "ib_degraded_for",
                     "fabric_not_ready_for", "fleet_clock_lag_for", "fleet_partitions_unjudged_for", "fleet_consumer_pending_for")
    @classmethod
    def _duration(cls, v: str) -> str:
        return _check_duration(v)


class AlertSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hardware_team: str = Field(min_length=1)
    default_team: str = Field(min_length=1)
    tenants: dict[str, str] = Field(default_factory=dict)
    teams: dict[str, dict[str, dict[str, Any]]]
    group_by: list[str] = Field(default_factory=lambda: ["alertname", "job", "node"])
    finding_group_by: list[str] = Field(default_factory=lambda: ["incident"])
    group_wait: str = "30s"
    group_interval: str = "5m"
    repeat_interval: dict[str, str] = Field(default_factory=lambda: {"page": "4h", "ticket": "24h"})
    push_severities: list[str] = Field(default_factory=lambda: ["page", "ticket"])
    resend_seconds: float = Field(60, gt=0)
    end_after_seconds: float = Field(300, gt=0)
    retry_min_seconds: float = Field(1, gt=0)
    retry_max_seconds: float = Field(60, gt=0)
    fatal_hardware_kinds: list[str] = Field(default_factory=lambda: sorted(k.value for k in kinds.FATAL_KINDS))
    runbook_base_url: str = "https://github.com/gpuvigil/gpuvigil/blob/main/docs/runbooks.md"
    # Base URLs of the Alertmanagers gpuvigil pushes to: one, or every peer of a gossip cluster
    # (each alert goes to each peer, as Prometheus does; the cluster deduplicates notifications).
    alertmanagers: list[str] = Field(default_factory=list)
    rules: RuleThresholds = Field(default_factory=RuleThresholds)

    @field_validator("group_wait", "group_interval")
    @classmethod
    def _duration(cls, v: str) -> str:
        return _check_duration(v)

    @field_validator("alertmanagers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        for url in v:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"alertmanagers: {url!r} is not an http(s):// URL")
        if len({u.rstrip("/") for u in v}) != len(v):
            raise ValueError("alertmanagers: a peer is listed twice")
        return v

    @field_validator("repeat_interval")
    @classmethod
    def _durations(cls, v: dict[str, str]) -> dict[str, str]:
        for value in v.values():
            _check_duration(value)
        return v

    @model_validator(mode="after")
    def _teams_complete(self) -> AlertSettings:
        for team in {self.hardware_team, self.default_team, *self.tenants.values()}:
            if team not in self.teams:
                raise ValueError(f"team {team!r} has no receivers under 'teams'")
        for team, receivers in self.teams.items():
            missing = [s for s in ("page", "ticket") if s not in receivers]
            if missing:
                raise ValueError(f"team {team!r}: no receiver for severity {', '.join(missing)}")
        if self.end_after_seconds <= self.resend_seconds:
            raise ValueError("end_after_seconds must exceed resend_seconds, or active alerts would flap resolved between resends")
        if self.retry_max_seconds < self.retry_min_seconds:
            raise ValueError("retry_max_seconds must be >= retry_min_seconds")
        return self

    def team_of_tenant(self, tenant: str | None) -> str:
        return self.tenants.get(tenant or "", self.default_team)

    def runbook(self, anchor: str) -> str:
        return f"{self.runbook_base_url}#{anchor.lower()}"


def load_settings(cfg: dict[str, Any] | None = None) -> AlertSettings:
    return config.section("alerts", AlertSettings, cfg)
