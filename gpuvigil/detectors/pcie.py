"""PCIe replay growth: a GPU whose link keeps retransmitting packets is failing.

NVML's PCIe replay counter is cumulative and a few replays over a GPU's life are normal; a
sustained rate is not (a degrading riser, connector or retimer, often followed by XID 79). The
rate is measured per GPU over `window_seconds` from this tick's counters against a per-GPU
baseline (O(GPUs) per tick). It is reported as kind `pcie_replay` (a device's own fault: the
hardware team's, whichever job holds the GPU) at severity ticket, with a cordon hint: worth a
maintenance slot, not a page.

A growing replay counter is tested on simulated data only: the real H200 capture's counter is 0
and never moves (there it is a hard negative; docs/testing.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.detectors.per_gpu import GpuSlots, grow, last_per_slot
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class PcieConfig(BaseModel):
    window_seconds: float = 60.0
    min_replays_per_minute: float = 100.0


class PcieReplayDetector(Declared):
    spec = DetectorSpec(
        name="pcie",
        config=PcieConfig,
        emits=(FindingKind.PCIE_REPLAY,),
        reads={"gpu_samples": FRESH, "allocations": HISTORY},
        order=120,
        level="L0",
        streams=("gpu_samples",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("pcie", PcieConfig, cfg)
        # Per GPU, in numpy slots (detectors/per_gpu.py): the baseline reading (ts0, count0) and
        # the verdict of the last evaluation; a tick costs O(its samples).
        self._slots = GpuSlots()
        self._ts0 = np.zeros(0)
        self._count0 = np.zeros(0, dtype=np.int64)
        self._has_base = np.zeros(0, dtype=bool)
        self._hot = np.zeros(0, dtype=bool)
        self._rate = np.zeros(0)
        self._hot_ts = np.zeros(0)  # the evaluated reading and its baseline's time
        self._hot_count = np.zeros(0, dtype=np.int64)
        self._hot_ts0 = np.zeros(0)
        self._order = np.zeros(0, dtype=np.int64)  # when each verdict was given (report order)
        self._evaluations = 0

    @property
    def _base(self) -> pl.DataFrame:
        """The baselines, one row per GPU (for inspection and tests)."""
        b = np.flatnonzero(self._has_base[: len(self._slots)])
        return pl.DataFrame({"node": [self._slots.keys[i][0] for i in b], "gpu": [self._slots.keys[i][1] for i in b], "ts": self._ts0[b], "count": self._count0[b]})

    def _fold(self, fresh: pl.DataFrame) -> None:
        c = self.config
        idx = self._slots.of(fresh["node"], fresh["gpu"])
        n = len(self._slots)
        if self._has_base.shape[0] < n:
            self._ts0, self._rate, self._hot_ts, self._hot_ts0 = (grow(a, n, 0.0) for a in (self._ts0, self._rate, self._hot_ts, self._hot_ts0))
            self._count0, self._hot_count, self._order = (grow(a, n, 0) for a in (self._count0, self._hot_count, self._order))
            self._has_base, self._hot = (grow(a, n, False) for a in (self._has_base, self._hot))
        ts = fresh["ts"].to_numpy()
        rows, slots = last_per_slot(idx, ts)  # one reading per GPU: its latest
        t, count = ts[rows], fresh["count"].to_numpy()[rows]
        based = self._has_base[slots]
        due = ~based | (t - self._ts0[slots] >= c.window_seconds)
        slots, t, count, based = slots[due], t[due], count[due], based[due]
        if slots.shape[0] == 0:
            return
        # Re-evaluated GPUs replace their previous verdict (a GPU without a baseline: none).
        with np.errstate(divide="ignore", invalid="ignore"):  # window_seconds 0: as polars, inf/nan
            rate = np.where(based, (count - self._count0[slots]).astype(np.float64) * 60.0 / np.where(based, t - self._ts0[slots], 1.0), 0.0)
        hot = based & (rate >= c.min_replays_per_minute)
        self._hot[slots] = hot
        self._rate[slots] = rate
        self._hot_ts[slots] = t
        self._hot_count[slots] = count
        self._hot_ts0[slots] = self._ts0[slots]
        self._order[slots] = self._evaluations + np.arange(1, slots.shape[0] + 1)
        self._evaluations += slots.shape[0]
        self._ts0[slots] = t
        self._count0[slots] = count
        self._has_base[slots] = True

    def detect(self, window: Window) -> list[Finding]:
        fresh = window.fresh("gpu_samples")
        # (a fleet without PCIe counters, e.g. dcgm-exporter's default fields: nothing to fold)
        if fresh.height and fresh.get_column("pcie_replay_total").null_count() < fresh.height:
            fresh = fresh.select("node", "gpu", "ts", pl.col("pcie_replay_total").alias("count"))
            if fresh["count"].null_count() or fresh["node"].null_count() or fresh["gpu"].null_count():
                fresh = fresh.filter(pl.col("count").is_not_null() & pl.col("node").is_not_null() & pl.col("gpu").is_not_null())
            if fresh.height:
                self._fold(fresh)
        hot = np.flatnonzero(self._hot[: len(self._slots)])
        if hot.shape[0] == 0:
            return []
        hot = hot[np.argsort(self._order[hot], kind="stable")]  # earliest verdict first
        flagged = pl.DataFrame(
            {
                "node": [self._slots.keys[i][0] for i in hot],
                "gpu": [self._slots.keys[i][1] for i in hot],
                "ts": self._hot_ts[hot],
                "count": self._hot_count[hot],
                "ts0": self._hot_ts0[hot],
                "per_minute": self._rate[hot],
            },
            schema_overrides={"gpu": pl.Int32},
        )
        findings = []
        for row in flagged.join(gpu_jobs(window), on=["node", "gpu"], how="left").iter_rows(named=True):
            findings.append(
                Finding(
                    kind=FindingKind.PCIE_REPLAY,
                    severity=Severity.TICKET,
                    ts=window.now,
                    job=row["job"],
                    ranks=[int(row["rank"])] if row["rank"] is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    cause="hardware",
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
