"""Uncorrectable ECC errors and failed row remaps: the GPU's memory cannot be trusted.

One finding per GPU and incident, from the ECC XIDs and NVML/DCGM events since the last tick and
the counters' change since the previous reading:

- `row_remap_failure` (page): a row remap failed (NVML's `failureOccurred`,
  `DCGM_FI_DEV_ROW_REMAP_FAILURE`, or an XID in `remap_failure_codes`: 64). The GPU cannot repair
  its memory any more, NVIDIA's RMA criterion: drain the node and replace the GPU. An uncorrectable
  error that comes with it is this kind too (its XIDs and DBEs are the evidence): the GPU goes
  to RMA either way.
- `ecc` (page): an uncorrectable error without a failed remap (a new DBE in the counters, an XID
  in `ecc_codes`, an ECC event): drain the node and reset the GPU.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil import policies
from gpuvigil.gpu import xid as xid_table
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec, Reads
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window


class EccConfig(BaseModel):
    report_seconds: float = 3600.0
    ecc_codes: list[int] = [48, 63, 64, 92, 94, 95]
    # Of `ecc_codes`: the XIDs that say a row remap (or page retirement) failed...
    remap_failure_codes: list[int] = [64]
    # ...and those that say the memory took an uncorrectable error.
    uncorrectable_codes: list[int] = [48, 63, 94, 95]


class EccDetector(Declared):
    spec = DetectorSpec(
        name="ecc",
        config=EccConfig,
        emits=(FindingKind.ECC, FindingKind.ROW_REMAP_FAILURE),
        reads={"events": HISTORY, "allocations": HISTORY,
               "gpu_samples": Reads(history=False, columns=("ts", "node", "gpu", "ecc_dbe_volatile_total", "retired_pages_total", "remap_failure"))},
        order=100,
        level="L0",
        streams=("events", "gpu_samples"),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("ecc", EccConfig, cfg)
        self._counters: pl.DataFrame | None = None
        self._last_now: float | None = None

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        # Each incident is reported once, on the tick it arrives (on the first tick: the recent
        # past); the pipeline keeps the finding active for `clear_after_seconds.<kind>`.
        since = now - self.config.report_seconds if self._last_now is None else self._last_now
        self._last_now = now
        gs = self._readings(window)
        events = window.get("events")
        if self._quiet(events, since, gs):
            return []
        ev = self._events(events, since)
        if ev.height == 0 and gs.height == 0:
            return []
        counters = self._counter_changes(gs)
        hits = ev.join(counters, on=["node", "gpu"], how="full", coalesce=True).join(gpu_jobs(window), on=["node", "gpu"], how="left")
        return [self._finding(row, now) for row in hits.iter_rows(named=True)]

    # -- phases ------------------------------------------------------------------------------------

    def _readings(self, window: Window) -> pl.DataFrame:
        """This tick's counters of the GPUs that have a DBE or a failed remap: O(GPUs) filter per
        tick, tiny state."""
        fresh = window.fresh("gpu_samples").select("node", "gpu", "ecc_dbe_volatile_total", "retired_pages_total", "remap_failure")
        # (two column reductions tell whether any row qualifies: cheaper than the filter itself)
        dbe_max = fresh.get_column("ecc_dbe_volatile_total").max()
        if not ((dbe_max is not None and dbe_max > 0) or fresh.get_column("remap_failure").any()):  # type: ignore[operator]
            return fresh.clear()
        # One reading per GPU: a tick may bring several samples of one (NVML and DCGM both on, a
        # fast sampler). Its counters only grow, so the highest is the newest (a reset inside one
        # tick shows on the next). Kept as two rows, each was compared with the other's previous
        # value and a DBE seen once paged every tick.
        return (
            fresh.filter((pl.col("ecc_dbe_volatile_total") > 0) | pl.col("remap_failure").fill_null(False))
            .group_by("node", "gpu", maintain_order=True)
            .agg(pl.col("ecc_dbe_volatile_total").max(), pl.col("retired_pages_total").max(), pl.col("remap_failure").any())
        )

    def _quiet(self, events: pl.DataFrame, since: float, gs: pl.DataFrame) -> bool:
        """Most ticks bring no event since the last one and no counter change: the frame work
        would find nothing (the state it would keep is `gs` itself). A failed remap is reported
        on every tick it is read."""
        latest = events.get_column("ts").max() if events.height else None
        if latest is not None and latest > since:  # type: ignore[operator]
            return False
        if gs.height == 0:
            return True
        prev = self._counters
        return prev is not None and not gs.get_column("remap_failure").fill_null(False).any() and gs.equals(prev)

    def _events(self, events: pl.DataFrame, since: float) -> pl.DataFrame:
        """Per GPU: the ECC XIDs and events since the last tick, the newest time and job."""
        return (
            events.filter(
                (pl.col("ts") > since)
                & (pl.col("kind").is_in(["ecc_dbe", "ecc"]) | ((pl.col("kind") == "xid") & pl.col("xid").is_in(self.config.ecc_codes)))
            )
            .group_by(["node", "gpu"])
            .agg(pl.col("xid").drop_nulls().unique().sort().alias("xids"), pl.col("ts").max().alias("event_ts"), pl.col("job").drop_nulls().last().alias("event_job"))
        )

    def _counter_changes(self, gs: pl.DataFrame) -> pl.DataFrame:
        """The GPUs whose DBE counter rose since their previous reading, or whose remap failed;
        this reading becomes the previous one."""
        prev = self._counters
        self._counters = gs if prev is None else pl.concat([prev.join(gs.select("node", "gpu"), on=["node", "gpu"], how="anti"), gs])
        if prev is None:
            prev = gs.clear()
        return (
            gs.join(prev.select("node", "gpu", pl.col("ecc_dbe_volatile_total").alias("_dbe0")), on=["node", "gpu"], how="left")
            .select(
                "node",
                "gpu",
                # A counter lower than before was reset (GPU reset): all of it is new.
                pl.when(pl.col("ecc_dbe_volatile_total") < pl.col("_dbe0").fill_null(0))
                .then(pl.col("ecc_dbe_volatile_total"))
                .otherwise(pl.col("ecc_dbe_volatile_total") - pl.col("_dbe0").fill_null(0))
                .alias("dbe_delta"),
                pl.col("ecc_dbe_volatile_total").alias("dbe_total"),
                pl.col("retired_pages_total").alias("remapped"),
                pl.col("remap_failure").fill_null(False),
            )
            .filter((pl.col("dbe_delta") > 0) | pl.col("remap_failure"))
        )

    def _finding(self, row: dict[str, Any], now: float) -> Finding:
        xids = row["xids"] or []
        job = row["job"] or row["event_job"]
        actions = sorted({xid_table.xid_info(x).action for x in xids if xid_table.xid_info(x)})
        uncorrectable = bool(row["dbe_delta"] or 0) or bool(set(xids) & set(self.config.uncorrectable_codes))
        remap_failed = bool(row["remap_failure"]) or bool(set(xids) & set(self.config.remap_failure_codes))
        where = place(row["node"], row["gpu"])
        # A row the query keeps has a failed remap or a new DBE: it is one of the two.
        kind = policies.memory_fault(remap_failed, uncorrectable) or FindingKind.ECC
        if kind == FindingKind.ROW_REMAP_FAILURE:
            what = f"Row remapping failed on {where}" + (" after an uncorrectable ECC error" if uncorrectable else "")
        else:
            what = f"Uncorrectable ECC error on {where}"
        todo = f": {policies.MEMORY_REMEDY[kind]}."
        return Finding(
            kind=kind,
            severity=Severity.PAGE,
            ts=float(row["event_ts"] or now),
            job=job,
            node=row["node"],
            gpu=row["gpu"],
            xid=xids[0] if xids else None,
            cause="hardware",
            source=self.name,
            evidence={
                "xids": xids,
                "dbe_new": int(row["dbe_delta"] or 0),
                "dbe_volatile_total": int(row["dbe_total"] or 0),
                "remapped_rows": int(row["remapped"] or 0),
                "remap_failure": bool(row["remap_failure"]),
                "nvidia_action": ",".join(actions) or "DRAIN_AND_RESET",
            },
            summary=what + (f" (XID {', '.join(map(str, xids))})" if xids else "") + (f", under job {job}" if job else "") + todo,
        )
