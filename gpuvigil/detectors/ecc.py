"""Uncorrectable ECC errors and row-remap failures: the GPU's memory cannot be trusted."""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.gpu import xid as xid_table
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec, Reads
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window


class EccConfig(BaseModel):
    report_seconds: float = 3600.0
    ecc_codes: list[int] = [48, 63, 64, 92, 94, 95]


class EccDetector(Declared):
    spec = DetectorSpec(
        name="ecc",
        config=EccConfig,
        emits=(FindingKind.ECC,),
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
        # past); the pipeline keeps the finding active for `clear_after_seconds.ecc`.
        since = now - self.config.report_seconds if self._last_now is None else self._last_now
        self._last_now = now
        # Counters: compare this tick's readings with the previous ones. Only GPUs that ever had
        # a DBE or a remap failure are kept: O(GPUs) filter per tick, tiny state.
        fresh = window.fresh("gpu_samples").select("node", "gpu", "ecc_dbe_volatile_total", "retired_pages_total", "remap_failure")
        # (two column reductions tell whether any row qualifies: cheaper than the filter itself)
        dbe_max = fresh.get_column("ecc_dbe_volatile_total").max()
        if (dbe_max is not None and dbe_max > 0) or fresh.get_column("remap_failure").any():  # type: ignore[operator]
            # One reading per GPU: a tick may bring several samples of one (NVML and DCGM both on,
            # a fast sampler). Its counters only grow, so the highest is the newest (a reset inside
            # one tick shows on the next). Kept as two rows, each was compared with the other's
            # previous value and a DBE seen once paged every tick. (Only GPUs with a DBE or a remap
            # failure are here: a handful of rows.)
            gs = (
                fresh.filter((pl.col("ecc_dbe_volatile_total") > 0) | pl.col("remap_failure").fill_null(False))
                .group_by("node", "gpu", maintain_order=True)
                .agg(pl.col("ecc_dbe_volatile_total").max(), pl.col("retired_pages_total").max(), pl.col("remap_failure").any())
            )
        else:
            gs = fresh.clear()
        events = window.get("events")
        # Most ticks bring no event since the last one and no counter change: skip the frame
        # work below (it would find nothing; the state it would keep is `gs` itself).
        latest = events.get_column("ts").max() if events.height else None
        if latest is None or latest <= since:  # type: ignore[operator]
            if gs.height == 0:
                return []
            prev = self._counters
            if prev is not None and not gs.get_column("remap_failure").fill_null(False).any() and gs.equals(prev):
                return []
        ev = (
            events.filter(
                (pl.col("ts") > since)
                & (pl.col("kind").is_in(["ecc_dbe", "ecc"]) | ((pl.col("kind") == "xid") & pl.col("xid").is_in(self.config.ecc_codes)))
            )
            .group_by(["node", "gpu"])
            .agg(pl.col("xid").drop_nulls().unique().sort().alias("xids"), pl.col("ts").max().alias("event_ts"), pl.col("job").drop_nulls().last().alias("event_job"))
        )
        if ev.height == 0 and gs.height == 0:
            return []
        prev = self._counters
        self._counters = gs if prev is None else pl.concat([prev.join(gs.select("node", "gpu"), on=["node", "gpu"], how="anti"), gs])
        if prev is None:
            prev = gs.clear()
        counters = (
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
        hits = ev.join(counters, on=["node", "gpu"], how="full", coalesce=True).join(gpu_jobs(window), on=["node", "gpu"], how="left")
        findings = []
        for row in hits.iter_rows(named=True):
            xids = row["xids"] or []
            job = row["job"] or row["event_job"]
            actions = sorted({xid_table.xid_info(x).action for x in xids if xid_table.xid_info(x)})
            findings.append(
                Finding(
                    kind=FindingKind.ECC,
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
                    summary=(
                        (
                            f"Row remapping failed on {place(row['node'], row['gpu'])}"
                            if row["remap_failure"] and not (row["dbe_delta"] or 0) and not set(xids) & {48, 63, 94, 95}
                            else f"Uncorrectable ECC error on {place(row['node'], row['gpu'])}"
                        )
                        + (f" (XID {', '.join(map(str, xids))})" if xids else "")
                        + (f", under job {job}" if job else "")
                        + ": drain the node and reset the GPU before it runs anything again."
                    ),
                )
            )
        return findings
