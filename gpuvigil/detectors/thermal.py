"""Sustained thermal/power throttling from NVML clock-event reasons."""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil import throttle
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window


class ThermalConfig(BaseModel):
    window_seconds: float = 30.0
    min_samples: int = 10
    min_throttled_share: float = 0.8
    reason_mask: int = 0xE8


class ThermalDetector:
    name = "thermal"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("thermal", ThermalConfig, cfg)
        self._state: pl.DataFrame | None = None

    def _update(self, window: Window) -> pl.DataFrame:
        """Per GPU: an exponentially weighted share of recent samples that were throttled
        (time constant `window_seconds`), updated from this tick's samples only."""
        c = self.config
        fresh = window.fresh("gpu_samples").filter(pl.col("throttle_reasons").is_not_null()).select(
            "node", "gpu", "ts", "temperature_c", "sm_clock_mhz", "power_w", pl.col("throttle_reasons").alias("reasons"),
            ((pl.col("throttle_reasons") & c.reason_mask) != 0).cast(pl.Float64).alias("_hit"),
        )
        # One row per GPU: a tick may bring several samples of one GPU (a fast sampler, or NVML
        # and DCGM both on); joined row by row they would multiply the state every tick.
        fresh = fresh.sort("ts").group_by(["node", "gpu"], maintain_order=True).agg(
            pl.col("ts", "temperature_c", "sm_clock_mhz", "power_w", "reasons").last(), pl.col("_hit").mean()
        )
        if self._state is None:
            state = fresh.with_columns(pl.col("_hit").alias("share"), pl.lit(1).alias("n"))
        else:
            prev = self._state.select("node", "gpu", pl.col("ts").alias("_pts"), pl.col("share").alias("_ps"), pl.col("n").alias("_pn"))
            alpha = 1.0 - (-(pl.col("ts") - pl.col("_pts")) / c.window_seconds).exp()
            updated = fresh.join(prev, on=["node", "gpu"], how="left").with_columns(
                pl.when(pl.col("_ps").is_null()).then(pl.col("_hit")).otherwise(alpha * pl.col("_hit") + (1 - alpha) * pl.col("_ps")).alias("share"),
                (pl.col("_pn").fill_null(0) + 1).alias("n"),
            ).drop("_pts", "_ps", "_pn")
            kept = self._state.join(fresh.select("node", "gpu"), on=["node", "gpu"], how="anti")
            state = pl.concat([kept, updated], how="vertical_relaxed")
        self._state = state
        return state

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        state = self._update(window)
        hot = (
            state.filter((pl.col("n") >= c.min_samples) & (pl.col("share") >= c.min_throttled_share) & (pl.col("_hit") > 0))
            .rename({"temperature_c": "max_temp", "sm_clock_mhz": "clock", "power_w": "power"})
            .join(gpu_jobs(window), on=["node", "gpu"], how="left")
        )
        findings = []
        for row in hot.iter_rows(named=True):
            reasons = int(row["reasons"] or 0)
            kinds = throttle.active(reasons, c.reason_mask, short=True)
            findings.append(
                Finding(
                    kind=FindingKind.THERMAL_THROTTLE,
                    severity=Severity.TICKET,
                    ts=now,
                    job=row["job"],
                    ranks=[int(row["rank"])] if row["rank"] is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    cause="hardware",
                    source=self.name,
                    evidence={
                        "throttled_share": round(float(row["share"]), 2),
                        "max_temperature_c": float(row["max_temp"] or 0),
                        "sm_clock_mhz": float(row["clock"] or 0),
                        "reasons": kinds,
                        "reasons_bitmask": reasons,
                        "power_w": round(float(row["power"] or 0), 1),
                    },
                    summary=(
                        f"{row['node']} GPU {row['gpu']} is throttling ({', '.join(kinds) or 'clock events'}) at "
                        f"{row['max_temp']:.0f} °C, SM clock {row['clock'] or 0:.0f} MHz"
                        + (f", slowing job {row['job']} rank {row['rank']}" if row["job"] else "")
                        + ": check its cooling."
                    ),
                )
            )
        return findings
