"""The replaced polars implementation of gpuvigil/detectors/fragmentation_allocator.py
(AllocatorFragmentationDetector before its per-key state became numpy arrays), copied verbatim,
kept as the oracle the numpy one must equal on every tick (tests/test_fragmentation_allocator_numpy.py). Test
support only: not to be called from the product."""

from __future__ import annotations

from typing import Any

import polars as pl

from gpuvigil.detectors.common import rank_at, settings
from gpuvigil.detectors.fragmentation_allocator import FragmentationAllocatorConfig
from gpuvigil.detectors.incremental import KEYS, SlidingRows, edges_from_rows
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

from polars_incremental import BlockStore, merge_edges, refresh_first

GIB = float(1 << 30)


# Per (job, rank): the oldest sample's gap and retries, the newest sample's values (by ts).
FIRST = ["gap", "retries"]
LAST = ["gap", "split", "retries", "largest_free", "capacity", "node", "gpu"]


def _values(df: pl.DataFrame) -> pl.DataFrame:
    return df.select(
        "job",
        "rank",
        "ts",
        (pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")).alias("gap"),
        pl.col("inactive_split_bytes").alias("split"),
        pl.col("alloc_retries").alias("retries"),
        pl.col("largest_free_block_bytes").alias("largest_free"),
        pl.col("device_capacity_bytes").alias("capacity"),
        "node",
        "gpu",
    )


def _block_rows(df: pl.DataFrame, v: pl.DataFrame) -> pl.DataFrame:
    """Per raw row (df) and its values (v = _values(df), same rows): what BlockStore keeps,
    with the step's large request (what a step allocates above its live floor)."""
    request = df.select((pl.col("peak_allocated_bytes") - pl.col("allocated_bytes")).alias("request")).to_series()
    return v.select(*KEYS, "ts", pl.lit(1, pl.Int64).alias("n"), *FIRST).with_columns(request)


def _build(v: pl.DataFrame) -> pl.DataFrame:
    counts = v.group_by(KEYS).agg(pl.len().cast(pl.Int64).alias("n"))
    return counts.join(edges_from_rows(v, FIRST, LAST), on=KEYS)


class PolarsAllocatorFragmentationDetector:
    name = "fragmentation_allocator"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("fragmentation_allocator", FragmentationAllocatorConfig, cfg)
        self._last_run: float | None = None
        self._last: list[Finding] = []
        c = self.config
        self._rows = SlidingRows("allocator_stats", c.window_seconds, c.warmup_seconds, blocks=c.lookback_blocks, reach=0.0)
        self._blocks = BlockStore(self._rows.B, ["n"], firsts=FIRST, maxes=["request"]) if c.lookback_blocks else None
        self._state: pl.DataFrame | None = None

    def lookback_seconds(self) -> dict[str, float]:
        """History of allocator_stats read from the window (pipeline/core.py: declared_horizons):
        block mode, block_slack_seconds (it reads only fresh rows while it steps; a rebuild reads
        what the window holds); else the look-back plus 30 s in which rows leaving it can still
        be subtracted (SlidingRows)."""
        c = self.config
        if c.lookback_blocks:
            return {"allocator_stats": c.block_slack_seconds}
        return {"allocator_stats": c.window_seconds + 30.0}

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        """Columns of allocator_stats' history it reads (`_values`; pipeline/core.py: declared_columns)."""
        cols = ("ts", "job", "rank", "node", "gpu", "reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes", "alloc_retries", "largest_free_block_bytes", "device_capacity_bytes")
        # ... and the step's request, for the ranks it finds (`_evaluate`).
        cols += ("allocated_bytes",)
        return {"allocator_stats": cols}

    def ingest(self, window: Window) -> None:
        """Per-key counts and oldest/newest samples, from this tick's rows (O(new rows))."""
        if self._state is None and window.get("allocator_stats").height == 0:
            # No allocator data yet (a replay of device series never has any): nothing to keep.
            # The first tick with rows rebuilds from the window, as after any gap.
            return
        step = self._rows.sync(window)
        if step.mode == "same" and self._state is not None:
            return
        if step.mode != "step" or self._state is None:
            rows = self._rows.rows_for_rebuild(window)
            v = _values(rows)
            self._state = _build(v)
            if self._blocks is not None:
                self._blocks.clear()
                self._blocks.add(_block_rows(rows, v))
            return
        assert step.fresh is not None and step.leaving is not None
        st0 = self._state
        parts = [st0.select(*KEYS, "n")]
        if step.fresh.height:
            parts.append(step.fresh.select(*KEYS, pl.lit(1, pl.Int64).alias("n")))
        if step.leaving.height:
            parts.append(step.leaving.select(*KEYS, pl.lit(-1, pl.Int64).alias("n")))
        gone = self._blocks.evict(step.lo_block) if self._blocks is not None else None
        if gone is not None and gone.height:
            parts.append(gone.select(*KEYS, -pl.col("n")))
        counts = pl.concat(parts, how="vertical_relaxed").group_by(KEYS).agg(pl.col("n").sum()) if len(parts) > 1 else parts[0]
        counts = counts.filter(pl.col("n") > 0)
        fresh = _values(step.fresh) if step.fresh.height else pl.DataFrame()
        if self._blocks is not None and fresh.height:
            self._blocks.add(_block_rows(step.fresh, fresh))
        edge = merge_edges(st0.drop("n"), fresh, FIRST, LAST)
        state = counts.join(edge, on=KEYS, how="left")
        state = refresh_first(
            self._rows, window, state, step.leaving, {"gap": pl.col("reserved_bytes") - pl.col("peak_allocated_bytes"), "retries": pl.col("alloc_retries")}
        )
        if gone is not None and gone.height and self._blocks is not None:
            # Keys that lost their oldest block take the oldest row of their next one.
            lost = gone.select(KEYS).unique().join(state.select(KEYS), on=KEYS, how="semi")
            if lost.height:
                first = self._blocks.first_rows(lost).rename({"ts_first": "_f_ts", **{c: f"_f_{c}" for c in FIRST}})
                names = ["ts", *FIRST]
                state = state.join(first, on=KEYS, how="left").with_columns(
                    pl.when(pl.col("_f_ts").is_not_null()).then(pl.col(f"_f_{k}")).otherwise(pl.col(f"{k}_first")).alias(f"{k}_first") for k in names
                ).drop(f"_f_{k}" for k in names)
        redo = step.rebuild_jobs(state)
        if redo:
            rows = self._rows.rows_for_rebuild(window, redo)
            v = _values(rows)
            again = _build(v)
            state = pl.concat([state.filter(~pl.col("job").is_in(redo)), again.select(state.columns)], how="vertical_relaxed")
            if self._blocks is not None:
                self._blocks.drop_jobs(redo)
                self._blocks.add(_block_rows(rows, v))
        self._state = state

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        self.ingest(window)
        if self._last_run is not None and now - self._last_run < self.config.every_seconds - 1e-9:
            return self._last
        self._last_run = now
        self._last = self._evaluate(window)
        return self._last

    def _evaluate(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        state = self._state
        if state is None or state.height == 0:
            return []
        per_rank = (
            state.select(
                *KEYS,
                "n",
                pl.col("gap_last").alias("gap"),
                pl.col("gap_first").alias("gap0"),
                pl.col("split_last").alias("split"),
                (pl.col("retries_last") - pl.col("retries_first")).alias("retries"),
                pl.col("largest_free_last").alias("largest_free"),
                pl.col("capacity_last").alias("capacity"),
                pl.col("node_last").alias("node"),
                pl.col("gpu_last").alias("gpu"),
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
        if per_rank.height:
            # The step's recurring large request (what a step allocates above its live floor),
            # over the look-back, only for the ranks that are fragmented: a max does not slide
            # (block mode: the max of each block's max).
            if self._blocks is not None:
                request = self._blocks.max_of(per_rank.select(KEYS)).rename({"request": "step_request"})
            else:
                rows = self._rows.rows_for_rebuild(window, per_rank["job"].unique().to_list()).join(per_rank.select(KEYS), on=KEYS, how="semi")
                request = rows.group_by(KEYS).agg((pl.col("peak_allocated_bytes") - pl.col("allocated_bytes")).max().alias("step_request"))
            per_rank = per_rank.join(request, on=KEYS, how="left", maintain_order="left")
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
                    gpu=w["gpu"],
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
                        f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])}: the caching allocator holds {w['gap'] / GIB:.1f} GiB it cannot use "
                        f"(+{(w['gap'] - w['gap0']) / GIB:.1f} GiB in {c.window_seconds:.0f} s, {int(w['retries'])} cudaMalloc retries"
                        + (f", largest free block {w['largest_free'] / GIB:.2f} GiB < the step's {w['step_request'] / GIB:.2f} GiB request" if starved else "")
                        + "): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
                    ),
                )
            )
        return findings
