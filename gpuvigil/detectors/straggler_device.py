"""L0 straggler: a GPU that persistently lags its job's peers in device telemetry.

Two signatures (docs/detectors.md):
- *host-side* straggler (slow input, CPU contention on one rank): its GPU idles while its peers spin
  in the collective waiting for it, so its utilisation lags the peers' (whose spinning reads 100%);
- *device-side* straggler (power-capped, throttled or degraded GPU): its SM clock lags the peers'
  while it stays busy; the peers, waiting for it, are the ones whose SM activity and power drop
  (traceml#252: DDP equalises step times, so the slow rank is not the one that looks idle).
Healthy spread in real jobs is wide (Megatron/savanna logs: ±13 °C, ±60 MHz, one rank at 45%
util in a snapshot): the thresholds are relative to the job's median and must hold over a
window and on consecutive evaluations. A job whose GPUs wait together (a hang) is skipped.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.common import Persistence, allocated_gpu_retention, rank_at, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window


class StragglerDeviceConfig(BaseModel):
    window_seconds: float = 90.0
    min_samples: int = 20
    min_gpus: int = 4
    min_util_lag: float = 0.15  # host-side: util below the peers' median by this much ...
    min_peer_util: float = 0.8  # ... while the peers are busy or spinning
    min_clock_lag: float = 0.08  # device-side: busy SM clock this share below the peers' median
    max_idle_share: float = 0.5  # a GPU idle (util < 0.1) most of the window is absent, not slow
    persist_evaluations: int = 3
    recent_seconds: float = 20.0  # skip a job whose GPUs wait together (util pinned, power collapsed): a hang
    # Memory at scale (issue 11): gpu_samples rows older than this are kept only for the GPUs of
    # jobs whose findings this detector gives (pipeline/core.py: declared_retention); null: all.
    history_recent_seconds: float | None = Field(10.0, ge=0)


class DeviceStragglerDetector:
    name = "straggler_device"
    level = "L0"
    capability = "straggler"
    streams = ("gpu_samples", "allocations")

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("straggler_device", StragglerDeviceConfig, cfg)
        self._persistence = Persistence()

    def lookback_seconds(self) -> dict[str, float]:
        """History read from the window (pipeline/core.py: declared_horizons, declared_columns)."""
        return {"gpu_samples": max(self.config.window_seconds, self.config.recent_seconds)}

    def window_retention(self) -> dict[str, tuple[float, str]]:
        return allocated_gpu_retention(self.config.history_recent_seconds)

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        return {"gpu_samples": ("ts", "node", "gpu", "util_ratio", "sm_clock_mhz", "power_w")}

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        gs = window.get("gpu_samples").filter(pl.col("ts") >= now - c.window_seconds)
        alloc = window.get("allocations").select("job", "rank", "node", "gpu")
        if gs.height == 0 or alloc.height == 0:
            return []
        jobs = window.get("jobs")
        df = gs.select("ts", "node", "gpu", "util_ratio", "sm_clock_mhz", "power_w").join(alloc, on=["node", "gpu"], how="inner")
        if jobs.height:
            df = df.join(jobs.select("job", pl.col("start_ts").alias("_s")), on="job", how="left").filter(pl.col("_s").is_null() | (pl.col("ts") >= pl.col("_s") + 30.0))
        per = df.group_by(["job", "rank", "node", "gpu"]).agg(
            pl.len().alias("n"),
            pl.col("util_ratio").mean().alias("util"),
            (pl.col("util_ratio") < 0.1).mean().alias("idle_share"),
            pl.col("sm_clock_mhz").filter(pl.col("util_ratio") >= 0.5).median().alias("clock"),
            (pl.col("power_w").filter(pl.col("ts") >= now - c.recent_seconds).median() / pl.col("power_w").quantile(0.9)).alias("recent_power_share"),
            pl.col("util_ratio").filter(pl.col("ts") >= now - c.recent_seconds).median().alias("recent_util"),
        )
        peers = per.group_by("job").agg(
            pl.len().alias("gpus"),
            pl.col("n").min().alias("min_n"),
            pl.col("util").median().alias("peer_util"),
            pl.col("clock").median().alias("peer_clock"),
            ((pl.col("recent_util") >= 0.9) & (pl.col("recent_power_share") <= 0.45)).mean().alias("pinned_share"),
        )
        scored = per.join(peers, on="job").with_columns(
            (pl.col("peer_util") - pl.col("util")).alias("util_lag"),
            (1.0 - pl.col("clock") / pl.col("peer_clock")).alias("clock_lag"),
        )
        flagged = scored.filter(
            (pl.col("gpus") >= c.min_gpus)
            & (pl.col("min_n") >= c.min_samples)
            & (pl.col("pinned_share") < 0.5)  # most GPUs pinned for the whole recent past: a hang, not a straggler
            & (pl.col("idle_share") <= c.max_idle_share)
            & (
                ((pl.col("util_lag") >= c.min_util_lag) & (pl.col("peer_util") >= c.min_peer_util))
                | (pl.col("clock_lag") >= c.min_clock_lag).fill_null(False)
            )
        )
        out = self._persistence.persistent(flagged, c.persist_evaluations)
        findings = []
        for rows in out.sort(["job", "rank"]).partition_by("job", maintain_order=True) if out.height else []:
            w = rows.row(0, named=True)
            device_side = (w["clock_lag"] or 0) >= c.min_clock_lag
            why = (
                f"its SM clock runs {100 * w['clock_lag']:.0f}% below its peers' ({w['clock']:.0f} vs {w['peer_clock']:.0f} MHz): a slow device"
                if device_side
                else f"its utilisation lags its peers' ({100 * w['util']:.0f}% vs {100 * w['peer_util']:.0f}%): it waits on its host while they wait on it"
            )
            findings.append(
                Finding(
                    kind=FindingKind.STRAGGLER,
                    severity=Severity.TICKET,
                    ts=now,
                    job=w["job"],
                    ranks=rows["rank"].to_list(),
                    culprit_ranks=rows["rank"].to_list(),
                    node=w["node"],
                    gpu=w["gpu"],
                    cause="device" if device_side else "host",
                    source=self.name,
                    evidence={
                        "level": "L0",
                        "util": round(float(w["util"]), 3),
                        "peer_util": round(float(w["peer_util"]), 3),
                        "clock_mhz": None if w["clock"] is None else round(float(w["clock"])),
                        "peer_clock_mhz": None if w["peer_clock"] is None else round(float(w["peer_clock"])),
                        "gpus_in_job": int(w["gpus"]),
                        "window_seconds": c.window_seconds,
                    },
                    summary=f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])} is a straggler (L0): {why}.",
                )
            )
        return findings
