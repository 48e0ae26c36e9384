"""The `api:` config section (no FastAPI import: `config.load` validates every section, and
commands that never serve the API should not pay for loading the web framework)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from gpuvigil import config
from gpuvigil.model import Severity


class NodeHealthRules(BaseModel):
    unhealthy_severities: list[Severity] = [Severity.PAGE]
    degraded_severities: list[Severity] = [Severity.TICKET]


class ApiConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8787, ge=0, le=65535)
    max_page: int = Field(5000, ge=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413, before they are read whole")
    stream_poll_seconds: float = Field(0.25, gt=0, le=10)
    stream_keepalive_seconds: float = Field(15.0, gt=0)
    node_health: NodeHealthRules = NodeHealthRules()
    slurm: dict[str, Any] = Field(default_factory=dict)  # validated by gpuvigil.scheduler.slurm
    kubernetes: dict[str, Any] = Field(default_factory=dict)  # validated by gpuvigil.scheduler.kubernetes


def api_config(cfg: dict[str, Any] | None = None) -> ApiConfig:
    return config.section("api", ApiConfig, cfg)


__all__ = ["ApiConfig", "NodeHealthRules", "api_config"]
