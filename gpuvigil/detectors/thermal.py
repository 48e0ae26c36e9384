"""Sustained thermal/power throttling from NVML clock-event reasons."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel

from gpuvigil.gpu import throttle
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec, Reads
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.detectors.per_gpu import GpuSlots, grow, last_per_slot
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window


_LAST = ("temperature_c", "sm_clock_mhz", "power_w")  # the latest sample's values, for the evidence


class ThermalConfig(BaseModel):
    window_seconds: float = 15.0
    min_samples: int = 10
    min_throttled_share: float = 0.8
    reason_mask: int = 0xE8


class ThermalDetector(Declared):
    spec = DetectorSpec(
        name="thermal",
        config=ThermalConfig,
        emits=(FindingKind.THERMAL_THROTTLE,),
        reads={"gpu_samples": Reads(history=False, columns=("ts", "node", "gpu", "throttle_reasons", "temperature_c", "power_w", "sm_clock_mhz")), "allocations": HISTORY},
        order=110,
        level="L0",
        streams=("gpu_samples",),
        every_seconds=2.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("thermal", ThermalConfig, cfg)
        # Per GPU, in numpy slots (detectors/per_gpu.py): the folded share and sample count and
        # the latest sample's values. A tick costs O(its samples), not a join over the fleet.
        self._slots = GpuSlots()
        self._ts = np.zeros(0)
        self._share = np.zeros(0)
        self._n = np.zeros(0, dtype=np.int64)
        self._hit = np.zeros(0)
        self._reasons = np.zeros(0, dtype=np.int64)
        self._vals = {c: np.zeros(0) for c in _LAST}
        self._null = {c: np.zeros(0, dtype=bool) for c in _LAST}
        self._order = np.zeros(0, dtype=np.int64)  # when each GPU was last updated (report order)
        self._updates = 0

    @property
    def _state(self) -> pl.DataFrame:
        """The state, one row per GPU seen (for inspection and tests)."""
        n = len(self._slots)
        return pl.DataFrame(
            {
                "node": [k[0] for k in self._slots.keys],
                "gpu": [k[1] for k in self._slots.keys],
                "ts": self._ts[:n],
                "share": self._share[:n],
                "n": self._n[:n],
                "_hit": self._hit[:n],
            }
        )

    def _update(self, window: Window) -> None:
        """Per GPU: an exponentially weighted share of recent samples that were throttled
        (time constant `window_seconds`), updated from this tick's samples only."""
        c = self.config
        fresh = window.fresh("gpu_samples")
        if fresh.height == 0:
            return
        # (columns are read straight off the frame: a select or a filter of 1,000 rows costs
        # ~0.1 ms, more than the whole update; filter only when some row must go)
        if fresh.get_column("throttle_reasons").null_count() or fresh.get_column("node").null_count() or fresh.get_column("gpu").null_count():
            fresh = fresh.filter(pl.col("throttle_reasons").is_not_null() & pl.col("node").is_not_null() & pl.col("gpu").is_not_null())
            if fresh.height == 0:
                return
        idx = self._slots.of(fresh.get_column("node"), fresh.get_column("gpu"))
        n_slots = len(self._slots)
        if self._share.shape[0] < n_slots:
            self._ts, self._share, self._hit = (grow(a, n_slots, 0.0) for a in (self._ts, self._share, self._hit))
            self._n, self._reasons, self._order = (grow(a, n_slots, 0) for a in (self._n, self._reasons, self._order))
            self._vals = {k: grow(a, n_slots, 0.0) for k, a in self._vals.items()}
            self._null = {k: grow(a, n_slots, True) for k, a in self._null.items()}
        ts = fresh.get_column("ts").to_numpy()
        reasons = fresh.get_column("throttle_reasons").to_numpy()
        hit = ((reasons & c.reason_mask) != 0).astype(np.float64)
        # One update per GPU: a tick may bring several samples of one GPU (a fast sampler, or
        # NVML and DCGM both on): their mean hit, the latest values.
        rows, slots = last_per_slot(idx, ts)
        if rows.shape[0] != idx.shape[0]:
            hit_mean = np.bincount(idx, weights=hit, minlength=n_slots)[slots] / np.bincount(idx, minlength=n_slots)[slots]
        else:
            hit_mean = hit[rows]
        t_new = ts[rows]
        seen = self._n[slots] > 0
        # (a sample older than the GPU's last one overflows exp to inf, as it did in polars: quietly)
        with np.errstate(over="ignore", invalid="ignore"):
            alpha = 1.0 - np.exp(-(t_new - self._ts[slots]) / c.window_seconds)
            self._share[slots] = np.where(seen, alpha * hit_mean + (1 - alpha) * self._share[slots], hit_mean)
        self._n[slots] += 1
        self._ts[slots] = t_new
        self._hit[slots] = hit_mean
        self._reasons[slots] = reasons[rows]
        for col in _LAST:
            s = fresh.get_column(col)
            if s.null_count():
                self._vals[col][slots] = s.fill_null(0.0).to_numpy()[rows]
                self._null[col][slots] = s.is_null().to_numpy()[rows]
            else:
                self._vals[col][slots] = s.to_numpy()[rows]
                self._null[col][slots] = False
        self._order[slots] = self._updates + np.arange(1, slots.shape[0] + 1)
        self._updates += slots.shape[0]

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        self._update(window)
        k = len(self._slots)
        hot_slots = np.flatnonzero((self._n[:k] >= c.min_samples) & (self._share[:k] >= c.min_throttled_share) & (self._hit[:k] > 0))
        if hot_slots.shape[0] == 0:
            return []
        hot_slots = hot_slots[np.argsort(self._order[hot_slots], kind="stable")]  # least recently updated first

        def last(col: str) -> list[float | None]:
            return [None if self._null[col][i] else float(self._vals[col][i]) for i in hot_slots]

        hot = pl.DataFrame(
            {
                "node": [self._slots.keys[i][0] for i in hot_slots],
                "gpu": [self._slots.keys[i][1] for i in hot_slots],
                "share": self._share[hot_slots],
                "reasons": self._reasons[hot_slots],
                "max_temp": last("temperature_c"),
                "clock": last("sm_clock_mhz"),
                "power": last("power_w"),
            },
            schema_overrides={"gpu": pl.Int32, "max_temp": pl.Float64, "clock": pl.Float64, "power": pl.Float64},
        ).join(gpu_jobs(window), on=["node", "gpu"], how="left")
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
                        f"{place(row['node'], row['gpu'])} is throttling ({', '.join(kinds) or 'clock events'})"
                        # a replay may have clock-event reasons but no temperature series
                        + (f" at {row['max_temp']:.0f} °C" if row["max_temp"] is not None else "")
                        + f", SM clock {row['clock'] or 0:.0f} MHz"
                        + (f", slowing job {row['job']} rank {row['rank']}" if row["job"] else "")
                        + ": check its cooling."
                    ),
                )
            )
        return findings
