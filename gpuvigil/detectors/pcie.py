"""PCIe replay growth: a GPU whose link keeps retransmitting packets is failing.

NVML's PCIe replay counter is cumulative and a few replays over a GPU's life are normal; a
sustained rate is not (a degrading riser, connector or retimer, often followed by XID 79). The
rate is measured per GPU over `window_seconds` from this tick's counters against a per-GPU
baseline (O(GPUs) per tick). It is reported as kind `anomaly` with cause `pcie_replay` at
severity ticket: worth a look and a maintenance slot, not a page.

A growing replay counter is tested on simulated data only: the real H200 capture's counter is 0
and never moves (there it is a hard negative; docs/testing.md).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window


class PcieConfig(BaseModel):
    window_seconds: float = 60.0
    min_replays_per_minute: float = 100.0


class PcieReplayDetector:
    name = "pcie"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("pcie", PcieConfig, cfg)
        self._base: pl.DataFrame | None = None
        self._flagged: pl.DataFrame | None = None

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        fresh = window.fresh("gpu_samples").filter(pl.col("pcie_replay_total").is_not_null()).select("node", "gpu", "ts", pl.col("pcie_replay_total").alias("count"))
        # One row per GPU (its latest reading): several samples of one GPU in a tick would
        # otherwise multiply the baseline rows on every join.
        fresh = fresh.sort("ts").group_by(["node", "gpu"], maintain_order=True).last()
        if fresh.height:
            if self._base is None:
                self._base = fresh
            else:
                joined = fresh.join(self._base.rename({"ts": "ts0", "count": "count0"}), on=["node", "gpu"], how="left")
                due = joined.filter(pl.col("ts0").is_null() | (pl.col("ts") - pl.col("ts0") >= c.window_seconds))
                if due.height:
                    rated = due.filter(pl.col("ts0").is_not_null()).with_columns(
                        ((pl.col("count") - pl.col("count0")) * 60.0 / (pl.col("ts") - pl.col("ts0"))).alias("per_minute")
                    )
                    hot = rated.filter(pl.col("per_minute") >= c.min_replays_per_minute)
                    # Re-evaluated GPUs replace their previous verdict; others keep theirs.
                    kept = self._flagged.join(due.select("node", "gpu"), on=["node", "gpu"], how="anti") if self._flagged is not None else None
                    self._flagged = hot if kept is None else pl.concat([kept, hot], how="vertical_relaxed")
                    self._base = pl.concat([self._base.join(due.select("node", "gpu"), on=["node", "gpu"], how="anti"), due.select("node", "gpu", "ts", "count")])
        if self._flagged is None or self._flagged.height == 0:
            return []
        findings = []
        for row in self._flagged.join(gpu_jobs(window), on=["node", "gpu"], how="left").iter_rows(named=True):
            findings.append(
                Finding(
                    kind=FindingKind.ANOMALY,
                    severity=Severity.TICKET,
                    ts=window.now,
                    job=row["job"],
                    ranks=[int(row["rank"])] if row["rank"] is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    cause="pcie_replay",
                    source=self.name,
                    evidence={
                        "pcie_replays_per_minute": round(float(row["per_minute"]), 1),
                        "pcie_replay_total": int(row["count"]),
                        "window_seconds": round(float(row["ts"] - row["ts0"]), 1),
                    },
                    summary=(
                        f"{row['node']} GPU {row['gpu']} PCIe link replays {row['per_minute']:.0f} packets/min ({int(row['count'])} so far): "
                        "the link is degrading; schedule the node for maintenance before the GPU falls off the bus."
                    ),
                )
            )
        return findings
