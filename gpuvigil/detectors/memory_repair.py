"""Device memory repairs that wait for a reset, and retired pages past the replacement limit.

Reads each tick's fresh `gpu_samples` (NVML, or dcgm-exporter with the fields added to its
counters file) and keeps no history:

- `row_remap_pending` (ticket): the GPU (Ampere and later) remapped a row but the remap takes
  effect only after a GPU reset (`DCGM_FI_DEV_ROW_REMAP_PENDING`, NVML's `isPending`). Drain the
  node and reset the GPU at the next idle moment. A failed remap is the `row_remap_failure`
  kind's page (detectors/ecc.py, with the XIDs that come with it).
- `retired_pages` (ticket): pages wait for a reboot to be retired (GPUs before Ampere:
  `DCGM_FI_DEV_RETIRED_PENDING`), or the GPU's retired pages / remapped rows reached
  `retired_pages_limit` (NVIDIA's field guidance for replacing the board).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window


class MemoryRepairConfig(BaseModel):
    retired_pages_limit: int = Field(60, ge=1)


class MemoryRepairDetector(Declared):
    spec = DetectorSpec(
        name="memory_repair",
        config=MemoryRepairConfig,
        emits=(FindingKind.ROW_REMAP_PENDING, FindingKind.RETIRED_PAGES),
        reads={"gpu_samples": FRESH, "allocations": HISTORY},
        order=127,
        level="L0",
        streams=("gpu_samples",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("memory_repair", MemoryRepairConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        fresh = window.fresh("gpu_samples")
        if fresh.height == 0:
            return []
        limit = self.config.retired_pages_limit
        hit = pl.col("row_remap_pending").fill_null(False) | pl.col("retired_pages_pending").fill_null(False) | (pl.col("retired_pages_total") >= limit).fill_null(False)
        # (most ticks: nothing pending anywhere, decided by three column reductions)
        if not (fresh.get_column("row_remap_pending").any() or fresh.get_column("retired_pages_pending").any() or (fresh.get_column("retired_pages_total").max() or 0) >= limit):  # type: ignore[operator]
            return []
        latest = (
            fresh.filter(hit & pl.col("node").is_not_null() & pl.col("gpu").is_not_null())
            .sort("ts")
            .group_by("node", "gpu", maintain_order=True)
            .agg(pl.col("row_remap_pending").any(), pl.col("retired_pages_pending").any(), pl.col("retired_pages_total").max(), pl.col("remap_failure").any())
            .join(gpu_jobs(window), on=["node", "gpu"], how="left")
        )
        findings = []
        for r in latest.iter_rows(named=True):
            common = {"ts": window.now, "job": r["job"], "ranks": [int(r["rank"])] if r["rank"] is not None else [], "node": r["node"], "gpu": r["gpu"],
                      "cause": "hardware", "source": self.name}
            where = place(r["node"], r["gpu"]) + (f", under job {r['job']}" if r["job"] else "")
            total = r["retired_pages_total"]
            if r["row_remap_pending"]:
                findings.append(
                    Finding(
                        kind=FindingKind.ROW_REMAP_PENDING, severity=Severity.TICKET, **common,
                        evidence={"row_remap_pending": True, "remapped_rows": total, "remap_failure": bool(r["remap_failure"])},
                        summary=f"Row remap pending on {where}: the repair of a failing memory row takes effect only after a GPU reset; drain the node and reset the GPU when it is idle.",
                    )
                )
            over = total is not None and total >= self.config.retired_pages_limit
            if r["retired_pages_pending"] or over:
                why = []
                if r["retired_pages_pending"]:
                    why.append("pages wait for a reboot to be retired")
                if over:
                    why.append(f"{total} pages retired or rows remapped, at or past the limit of {self.config.retired_pages_limit}")
                findings.append(
                    Finding(
                        kind=FindingKind.RETIRED_PAGES, severity=Severity.TICKET, **common,
                        evidence={"retired_pages_pending": bool(r["retired_pages_pending"]), "retired_pages_total": total, "limit": self.config.retired_pages_limit},
                        summary=f"Retired memory on {where}: {'; '.join(why)}: "
                        + ("drain and reboot the node" if r["retired_pages_pending"] else "plan to replace the GPU") + ".",
                    )
                )
        return findings


__all__ = ["MemoryRepairConfig", "MemoryRepairDetector"]
