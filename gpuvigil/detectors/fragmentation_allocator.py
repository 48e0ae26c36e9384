"""Allocator-level fragmentation: a rank's caching allocator holds memory it cannot use.

Signature of fragmentation in PyTorch's caching allocator, per rank, all from `allocator_stats`:
- reserved − per-step peak allocated (memory held but never used at the peak) is large and
  rising,
- most of it sits in inactive split blocks (slivers left by splitting large segments),
- the allocator had to free its cache and retry cudaMalloc (alloc retries rising), and
- the largest free block is smaller than the step's recurring request (peak − live memory), so
  the next large allocation cannot be served from the cache.
It is a ticket (it costs memory and time, and is cured by `expandable_segments:True`); the OOM
predictor pages when it is heading for an OOM.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.common import current_run, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

GIB = float(1 << 30)


class FragmentationAllocatorConfig(BaseModel):
    window_seconds: float = 120.0
    warmup_seconds: float = 30.0
    min_samples: int = 8
    min_gap_bytes: int = 4 << 30  # held-but-unused memory worth a ticket
    min_gap_share: float = 0.05  # ... and at least this share of the device
    min_inactive_split_share: float = 0.5
    min_retries: int = 1
    every_seconds: float = 5.0  # a trend over minutes: evaluating it every tick buys nothing


class AllocatorFragmentationDetector:
    name = "fragmentation_allocator"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("fragmentation_allocator", FragmentationAllocatorConfig, cfg)
        self._last_run: float | None = None
        self._last: list[Finding] = []

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        if self._last_run is not None and now - self._last_run < self.config.every_seconds - 1e-9:
            return self._last
        self._last_run = now
        self._last = self._evaluate(window)
        return self._last

    def _evaluate(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        df = current_run(window, "allocator_stats", since=now - c.window_seconds, warmup=c.warmup_seconds)
        if df.height == 0:
            return []
        # The window is in arrival (time) order, so first/last below are oldest/newest.
        per_rank = (
            df.group_by(["job", "rank"])
            .agg(
                pl.len().alias("n"),
                (pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")).last().alias("gap"),
                (pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")).first().alias("gap0"),
                pl.col("inactive_split_bytes").last().alias("split"),
                (pl.col("alloc_retries").last() - pl.col("alloc_retries").first()).alias("retries"),
                pl.col("largest_free_block_bytes").last().alias("largest_free"),
                # The step's recurring large request: what a step allocates above its live floor.
                (pl.col("peak_allocated_bytes") - pl.col("allocated_bytes")).max().alias("step_request"),
                pl.col("device_capacity_bytes").last().alias("capacity"),
                pl.col("node").last(),
                pl.col("gpu").last(),
            )
            .filter(
                (pl.col("n") >= c.min_samples)
                & (pl.col("gap") >= c.min_gap_bytes)
                & (pl.col("gap") >= c.min_gap_share * pl.col("capacity"))
                & (pl.col("gap") > pl.col("gap0"))
                & (pl.col("split") >= c.min_inactive_split_share * pl.col("gap"))
                & (pl.col("retries") >= c.min_retries)
            )
            .sort(["job", "gap", "rank"], descending=[False, True, False])  # rank breaks ties: same input, same finding
        )
        findings = []
        for rows in per_rank.partition_by("job", maintain_order=True):
            w = rows.row(0, named=True)
            starved = w["largest_free"] is not None and w["step_request"] is not None and w["largest_free"] < w["step_request"]
            findings.append(
                Finding(
                    kind=FindingKind.FRAGMENTATION_ALLOCATOR,
                    severity=Severity.TICKET,
                    ts=now,
                    job=w["job"],
                    ranks=sorted(rows["rank"].to_list()),
                    node=w["node"],
                    gpu=int(w["gpu"]),
                    cause="fragmentation",
                    source=self.name,
                    evidence={
                        "rank": int(w["rank"]),
                        "reserved_unused_bytes": int(w["gap"]),
                        "reserved_unused_growth_bytes": int(w["gap"] - w["gap0"]),
                        "inactive_split_bytes": int(w["split"]),
                        "alloc_retries_delta": int(w["retries"]),
                        "largest_free_block_bytes": int(w["largest_free"] or 0),
                        "step_request_bytes": int(w["step_request"] or 0),
                        "largest_block_below_request": bool(starved),
                        "ranks_fragmented": rows.height,
                    },
                    summary=(
                        f"{w['job']} rank {w['rank']} ({w['node']} GPU {w['gpu']}): the caching allocator holds {w['gap'] / GIB:.1f} GiB it cannot use "
                        f"(+{(w['gap'] - w['gap0']) / GIB:.1f} GiB in {c.window_seconds:.0f} s, {int(w['retries'])} cudaMalloc retries"
                        + (f", largest free block {w['largest_free'] / GIB:.2f} GiB < the step's {w['step_request'] / GIB:.2f} GiB request" if starved else "")
                        + "): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
                    ),
                )
            )
        return findings
