"""L0 collective hang from device telemetry alone (NVML/DCGM + the scheduler's job map).

A hung collective looks like this on the GPUs of a job (docs/detectors.md, with sources): every
GPU *waiting* in the collective has its utilisation pinned at 100% (the NCCL kernel spins) while
the work collapses: power falls towards idle, and where present NVLink/PCIe bytes and the DCGM
SM/tensor/DRAM activity ratios fall too. The culprit is the GPU whose signature differs: util
≈ 0 (its rank never entered the collective: stuck on the host) or no telemetry at all (the GPU
fell off the bus). If every GPU waits alike the culprit is inside the device or the network and
L0 cannot name it; the finding says so.

A checkpoint save, a data-loader stall and an evaluation pass are not hangs: the first two drop
util with the power, the last keeps power and SM activity up. A job whose waiting phases end on
their own (a host-side straggler makes its peers spin every step) raises its own bar: the hold
time is at least `recovered_factor` × the longest such phase seen.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel

from gpuvigil.policies import implicates_hardware
from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import node_names, rank_at, settings
from gpuvigil.detectors.per_gpu import GpuSlots, grow, last_per_slot
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class HangDeviceConfig(BaseModel):
    util_pinned: float = 0.9  # waiting: util at least this (a spinning NCCL kernel reads 100%)
    util_absent: float = 0.1  # the odd one out: util at most this (its rank never entered)
    quiet_power_ratio: float = 0.45  # waiting: power at most this share of the GPU's busy baseline
    quiet_sm_active: float = 0.35  # ... and, where DCGM profiling exists, SM active below this
    quiet_tensor_active: float = 0.05
    quiet_link_ratio: float = 0.1  # ... and NVLink/PCIe bytes below this share of the busy baseline
    baseline_alpha: float = 0.05  # EWMA weight of a busy sample in the per-GPU baseline
    min_baseline_samples: int = 5
    min_waiting_share: float = 0.5  # at least this share of the job's GPUs wait
    hold_seconds: float = 25.0
    gap_tolerance_seconds: float = 5.0  # a waiting phase survives readings that break it this briefly
    recovered_factor: float = 1.5
    max_hold_seconds: float = 600.0
    min_gpus: int = 2
    hardware_lookback_seconds: float = 120.0


def _nz(col: str) -> pl.Expr:
    return pl.col(col).fill_null(0.0)


class DeviceHangDetector(Declared):
    spec = DetectorSpec(
        name="hang_device",
        config=HangDeviceConfig,
        emits=(FindingKind.COLLECTIVE_HANG,),
        reads={"gpu_samples": FRESH, "allocations": HISTORY, "events": HISTORY},
        order=30,
        level="L0",
        capability="hang",
        streams=("gpu_samples", "allocations"),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("hang_device", HangDeviceConfig, cfg)
        # The per-GPU busy baseline, in numpy slots (detectors/per_gpu.py): EWMA of power (bp)
        # and link bytes (bl) over busy samples, and how many (bn; 0: none yet, bp/bl unset).
        # A tick folds in its samples and reads the allocations through slot indices, where
        # joins on (node, gpu) over the fleet cost ~0.2 s a tick at 100,000 GPUs.
        self._slots = GpuSlots()
        self._bp = np.zeros(0)
        self._bl = np.zeros(0)
        self._bn = np.zeros(0, dtype=np.int64)
        self._since: dict[str, float] = {}  # job → candidate since
        self._last_cand: dict[str, float] = {}
        self._recovered: dict[str, float] = {}  # job → longest waiting phase that ended by itself

    @property
    def _base(self) -> pl.DataFrame:
        """The baseline, one row per GPU with a busy sample (for inspection and tests)."""
        n = len(self._slots)
        have = np.flatnonzero(self._bn[:n] > 0)
        return pl.DataFrame(
            {
                "node": [self._slots.keys[i][0] for i in have],
                "gpu": [self._slots.keys[i][1] for i in have],
                "bp": self._bp[have],
                "bl": self._bl[have],
                "bn": self._bn[have],
            },
            schema={"node": pl.Utf8, "gpu": pl.Int32, "bp": pl.Float64, "bl": pl.Float64, "bn": pl.Int64},
        )

    def _baseline_at(self, slots: np.ndarray) -> pl.DataFrame:
        """bp, bl, bn of these slots (null where the GPU has no busy sample yet)."""
        unset = pl.Series(self._bn[slots] == 0)
        return pl.DataFrame({"bp": self._bp[slots], "bl": self._bl[slots], "bn": self._bn[slots], "_unset": unset}).select(
            *(pl.when(pl.col("_unset")).then(None).otherwise(pl.col(c)).alias(c) for c in ("bp", "bl", "bn"))
        )

    def _update_baseline(self, fresh: pl.DataFrame, slots: np.ndarray) -> None:
        """Per GPU (one row of `fresh` each, at `slots`): EWMA of power and link bytes over busy
        samples (util high and power not collapsed)."""
        c = self.config
        link = _nz("nvlink_tx_bytes_per_second") + _nz("nvlink_rx_bytes_per_second") + _nz("pcie_tx_bytes_per_second") + _nz("pcie_rx_bytes_per_second")
        joined = pl.concat([fresh.select("util_ratio", "power_w", link.alias("link")), self._baseline_at(slots)], how="horizontal")
        busy = (pl.col("util_ratio") >= 0.5) & (pl.col("bp").is_null() | (pl.col("power_w") > c.quiet_power_ratio * pl.col("bp")))
        a = c.baseline_alpha
        upd = joined.with_columns(pl.Series("_slot", slots)).filter(busy & pl.col("power_w").is_not_null()).select(
            "_slot",
            pl.when(pl.col("bp").is_null()).then(pl.col("power_w")).otherwise((1 - a) * pl.col("bp") + a * pl.col("power_w")).alias("bp"),
            pl.when(pl.col("bl").is_null()).then(pl.col("link")).otherwise((1 - a) * pl.col("bl") + a * pl.col("link")).alias("bl"),
            (pl.col("bn").fill_null(0) + 1).alias("bn"),
        )
        at = upd.get_column("_slot").to_numpy()
        self._bp[at] = upd.get_column("bp").to_numpy()
        self._bl[at] = upd.get_column("bl").to_numpy()
        self._bn[at] = upd.get_column("bn").to_numpy()

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        fresh = window.fresh("gpu_samples")
        alloc = window.get("allocations")
        if fresh.height == 0 or alloc.height == 0:
            return []
        fresh, slots = self._latest_samples(fresh)
        g = self._mark_gpus(self._allocated_gpus(alloc, fresh, slots))
        cand_jobs = self._waiting_jobs(g, now)
        if not cand_jobs:
            return []
        events = window.get("events").filter(implicates_hardware(now - self.config.hardware_lookback_seconds))
        findings = []
        for rows in g.filter(pl.col("job").is_in(list(cand_jobs))).partition_by("job"):
            finding = self._job_finding(rows, events, now)
            if finding is not None:
                findings.append(finding)
        return findings

    def _latest_samples(self, fresh: pl.DataFrame) -> tuple[pl.DataFrame, np.ndarray]:
        """Each GPU's latest sample this tick and its slot; the busy baselines take them in."""
        # (rows without a node or a GPU never match an allocation: they were never read)
        if fresh.get_column("node").null_count() or fresh.get_column("gpu").null_count():
            fresh = fresh.filter(pl.col("node").is_not_null() & pl.col("gpu").is_not_null())
        idx = self._slots.of(fresh.get_column("node"), fresh.get_column("gpu"), "fresh")
        rows, slots = last_per_slot(idx, fresh.get_column("ts").to_numpy())  # each GPU's latest sample
        fresh = fresh[rows]
        n = len(self._slots)
        self._bp, self._bl, self._bn = grow(self._bp, n, 0.0), grow(self._bl, n, 0.0), grow(self._bn, n, 0)
        self._update_baseline(fresh, slots)
        return fresh, slots

    def _allocated_gpus(self, alloc: pl.DataFrame, fresh: pl.DataFrame, slots: np.ndarray) -> pl.DataFrame:
        """One row per allocated rank: job, rank, node, gpu, its GPU's latest sample (or nulls) and baseline."""
        # Each allocated GPU's latest sample this tick (none: null) and its baseline.
        alloc = alloc.select("job", "rank", "node", "gpu")
        placed = (alloc.get_column("node").is_not_null() & alloc.get_column("gpu").is_not_null()).to_numpy()
        a_slot = np.full(alloc.height, -1, dtype=np.int64)
        if placed.all():
            a_slot[:] = self._slots.of(alloc.get_column("node"), alloc.get_column("gpu"), "alloc")
        elif placed.any():
            a_slot[placed] = self._slots.of(alloc.get_column("node").filter(pl.Series(placed)), alloc.get_column("gpu").filter(pl.Series(placed)), "alloc")
        n = len(self._slots)
        self._bp, self._bl, self._bn = grow(self._bp, n, 0.0), grow(self._bl, n, 0.0), grow(self._bn, n, 0)
        pos = np.full(n, -1, dtype=np.int64)
        pos[slots] = np.arange(slots.shape[0])
        a_row = np.where(a_slot >= 0, pos[np.maximum(a_slot, 0)], -1)
        has = pl.Series(a_row >= 0)
        cols = [x for x in fresh.columns if x not in ("node", "gpu", "job", "rank")]
        vals = fresh.select(cols)[np.maximum(a_row, 0)] if fresh.height else pl.DataFrame(schema=fresh.select(cols).schema).clear(alloc.height)
        vals = vals.with_columns(pl.Series("_has", has)).select(pl.when(pl.col("_has")).then(pl.col(x)).otherwise(None).alias(x) for x in cols)
        base = self._baseline_at(np.maximum(a_slot, 0)).with_columns(pl.Series("_placed", placed)).select(
            pl.when(pl.col("_placed")).then(pl.col(x)).otherwise(None).alias(x) for x in ("bp", "bl", "bn")
        )
        return pl.concat([alloc, vals, base], how="horizontal")

    def _mark_gpus(self, g: pl.DataFrame) -> pl.DataFrame:
        """Each GPU silent (no sample), waiting (pinned util on little power and traffic) or absent (idle)."""
        c = self.config
        link = _nz("nvlink_tx_bytes_per_second") + _nz("nvlink_rx_bytes_per_second") + _nz("pcie_tx_bytes_per_second") + _nz("pcie_rx_bytes_per_second")
        has_link = pl.any_horizontal([pl.col(x).is_not_null() for x in ("nvlink_tx_bytes_per_second", "pcie_tx_bytes_per_second")])
        quiet = (
            (pl.col("bn") >= c.min_baseline_samples)
            & (pl.col("power_w") <= c.quiet_power_ratio * pl.col("bp"))
            & (pl.col("sm_active_ratio").is_null() | (pl.col("sm_active_ratio") <= c.quiet_sm_active))
            & (pl.col("tensor_active_ratio").is_null() | (pl.col("tensor_active_ratio") <= c.quiet_tensor_active))
            & (~has_link | (pl.col("bl") <= 0) | (link <= c.quiet_link_ratio * pl.col("bl")))
        )
        return g.with_columns(
            pl.col("util_ratio").is_null().alias("silent"),
            ((pl.col("util_ratio") >= c.util_pinned) & quiet).fill_null(False).alias("waiting"),
            (pl.col("util_ratio") <= c.util_absent).fill_null(False).alias("absent"),
        )

    def _waiting_jobs(self, g: pl.DataFrame, now: float) -> set[str]:
        """Jobs whose GPUs all wait, idle or went silent; a job that stopped being one ends its phase."""
        c = self.config
        per_job = g.group_by("job").agg(
            pl.len().alias("n"),
            pl.col("waiting").sum().alias("n_wait"),
            pl.col("absent").sum().alias("n_absent"),
            pl.col("silent").sum().alias("n_silent"),
        )
        cand = per_job.filter(
            (pl.col("n") >= c.min_gpus)
            & (pl.col("n_wait") >= (pl.col("n") * c.min_waiting_share).ceil())
            & (pl.col("n_wait") + pl.col("n_absent") + pl.col("n_silent") == pl.col("n"))
        )
        cand_jobs = set(cand["job"].to_list())
        for job in list(self._since):
            if job not in cand_jobs and now - self._last_cand.get(job, now) > c.gap_tolerance_seconds:
                # The waiting phase ended by itself: remember how long such phases last.
                run = self._last_cand.get(job, now) - self._since.pop(job)
                self._recovered[job] = max(self._recovered.get(job, 0.0), run)
        return cand_jobs

    def _job_finding(self, rows: pl.DataFrame, events: pl.DataFrame, now: float) -> Finding | None:
        """The hang finding of a waiting job's GPUs, once it has waited past its hold."""
        c = self.config
        job = rows["job"][0]
        since = self._since.setdefault(job, now)
        self._last_cand[job] = now
        hold = min(c.max_hold_seconds, max(c.hold_seconds, c.recovered_factor * self._recovered.get(job, 0.0)))
        stalled = now - since
        if stalled < hold:
            return None
        waiting = rows.filter(pl.col("waiting"))
        odd = rows.filter(~pl.col("waiting")).sort("rank")
        culprit_ranks = odd["rank"].to_list()
        nodes = node_names(odd["node"])
        hw = events.filter(pl.col("node").is_in(nodes)) if nodes else events.clear()
        # No telemetry from a GPU it was placed on: the GPU is gone (hardware). A rank placed on
        # no GPU yet never started: the job waits for it, which requeueing fixes (software).
        unplaced = odd.filter(pl.col("node").is_null() | pl.col("gpu").is_null())["rank"].to_list()
        silent = odd.filter(pl.col("silent") & pl.col("node").is_not_null() & pl.col("gpu").is_not_null())["rank"].to_list()
        cause = "hardware" if (silent or hw.height) else ("software" if culprit_ranks else None)
        first = odd.row(0, named=True) if odd.height else None
        where = ", ".join(rank_at(r["rank"], r["node"], r["gpu"]) for r in odd.head(4).iter_rows(named=True))
        if culprit_ranks:
            why = "no telemetry: the GPU is gone" if silent else ("not placed on a GPU: its rank never started" if unplaced else "util 0: its rank never entered the collective")
            head = f"{where}{' and more' if odd.height > 4 else ''} differ(s) ({why})"
        else:
            head = "every GPU waits alike: the culprit is inside a device kernel or the network (L0 cannot name it; L1 Flight Recorder can)"
        wp = waiting["power_w"].median()
        bp = waiting["bp"].median()
        return Finding(
            kind=FindingKind.COLLECTIVE_HANG,
            severity=Severity.PAGE,
            ts=now,
            job=job,
            ranks=culprit_ranks,
            culprit_ranks=culprit_ranks,
            node=first["node"] if first else None,
            gpu=first["gpu"] if first and odd.height == 1 else None,
            cause=cause,
            source=self.name,
            evidence={
                "level": "L0",
                "stalled_seconds": round(stalled, 1),
                "hold_seconds": round(hold, 1),
                "waiting_gpus": int(waiting.height),
                "gpus": int(rows.height),
                "culprit_gpus": [f"{r['node']}:{r['gpu']}" for r in odd.head(16).iter_rows(named=True)],
                "silent_ranks": silent,
                "waiting_util_median": _r(waiting["util_ratio"].median()),
                "waiting_power_w_median": _r(wp),
                "busy_power_w_median": _r(bp),
                "waiting_sm_active_median": _r(waiting["sm_active_ratio"].median()),
                "xids": sorted({int(x) for x in hw["xid"].drop_nulls().to_list()}),
            },
            summary=(
                f"{job} looks hung from its GPUs (L0): {waiting.height} of {rows.height} GPUs spin at "
                f"{100 * (waiting['util_ratio'].median() or 0):.0f}% util on {_r(wp)} W (busy: {_r(bp)} W) for {stalled:.0f} s; {head}."
            ),
        )


def _r(v: Any) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 3)
