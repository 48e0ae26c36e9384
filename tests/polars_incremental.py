"""The polars running-state helpers the replaced `oom` and `fragmentation_allocator` used
(BlockStore, merge_edges, refresh_first), moved out of gpuvigil/detectors/incremental.py when both
detectors moved to numpy state: kept verbatim for their polars oracles
(tests/oom_polars_oracle.py, tests/fragmentation_allocator_polars_oracle.py) and
tests/test_block_state.py. Not to be called from the product."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from gpuvigil.detectors.incremental import KEYS, SlidingRows, block_of
from gpuvigil.pipeline.window import Window


class BlockStore:
    """Per-(job, rank) aggregates of a look-back's rows in fixed time blocks (block mode of
    SlidingRows): block k holds the rows with ts in [kB, (k+1)B).

    Per key and block: the sum of each `sums` column, the oldest row's ts (`ts_first`) and
    `firsts` columns (oldest by ts, ties: the earlier arrival), and the max of each `maxes` column.
    A tick's rows are folded into their blocks (sums add, the oldest stays the oldest, maxima
    take the max: O(new rows + the keys of the blocks they touch)). `evict` removes whole blocks
    below the look-back's edge and returns them, so a detector subtracts a block's sums from its
    running totals instead of reading leaving rows.
    """

    def __init__(self, block_seconds: float, sums: Sequence[str], firsts: Sequence[str] = (), maxes: Sequence[str] = ()):
        self.B = block_seconds
        self.sums, self.firsts, self.maxes = list(sums), list(firsts), list(maxes)
        self.blocks: dict[int, list[pl.DataFrame]] = {}  # block index → parts (rows or aggregates)
        self._aggregated: set[int] = set()  # blocks held as one row per key

    def block_index(self) -> pl.Expr:
        return block_of(self.B).alias("_blk")

    def start(self, index: pl.Expr | int) -> pl.Expr | float:
        """A block's start time (the origin of its `tau` sums)."""
        return index * self.B

    def _agg(self, parts: list[pl.DataFrame]) -> pl.DataFrame:
        """One row per key: parts in arrival order, sorted by ts (stable: ties keep arrival)."""
        df = pl.concat(parts, how="vertical_relaxed") if len(parts) > 1 else parts[0]
        return df.sort("ts_first", maintain_order=True).group_by(KEYS, maintain_order=True).agg(
            *(pl.col(c).sum() for c in self.sums),
            pl.col("ts_first").first(),
            *(pl.col(c).first() for c in self.firsts),
            *(pl.col(c).max() for c in self.maxes),
        ).select(*KEYS, "ts_first", *self.sums, *self.firsts, *self.maxes)  # the parts' column order

    def add(self, rows: pl.DataFrame) -> None:
        """Fold rows in: KEYS, ts, the `sums` terms of each row (already relative to its block's
        start where they depend on time), `firsts` and `maxes`."""
        if rows.height == 0:
            return
        rows = rows.select(*KEYS, pl.col("ts").alias("ts_first"), *self.sums, *self.firsts, *self.maxes, self.block_index())
        lo, hi = rows["_blk"].min(), rows["_blk"].max()
        if lo == hi:
            split = {int(lo): rows.drop("_blk")}  # type: ignore[arg-type]
        else:
            split = {int(k): part for (k,), part in rows.partition_by("_blk", as_dict=True, include_key=False, maintain_order=True).items()}
        for k, part in split.items():
            self.blocks.setdefault(k, []).append(part)
            self._aggregated.discard(k)
            # Aggregated at once (one row per key): at 100,000 GPUs a block's 5 ticks of rows
            # held as parts would cost ~75 MiB more at the peak, for no measurable CPU saving.
            self.frame(k)

    def frame(self, k: int) -> pl.DataFrame:
        """Block k aggregated, one row per key."""
        if k not in self._aggregated:
            self.blocks[k] = [self._agg(self.blocks[k])]
            self._aggregated.add(k)
        return self.blocks[k][0]

    def evict(self, first_kept: int) -> pl.DataFrame | None:
        """Remove every block older than block `first_kept`; their parts (possibly several rows
        per key: sums add up), with the block's index as `_blk`."""
        gone = sorted(k for k in self.blocks if k < first_kept)
        if not gone:
            return None
        frames = [p.with_columns(pl.lit(k, pl.Int64).alias("_blk")) for k in gone for p in self.blocks.pop(k)]
        self._aggregated -= set(gone)
        return pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]

    def first_rows(self, keys: pl.DataFrame) -> pl.DataFrame:
        """Per key in `keys`: ts_first and `firsts` of its oldest block (its oldest row)."""
        found: list[pl.DataFrame] = []
        todo = keys.select(KEYS).unique()
        for k in sorted(self.blocks):
            if todo.height == 0:
                break
            got = self.frame(k).join(todo, on=KEYS, how="semi").select(*KEYS, "ts_first", *self.firsts)
            if got.height:
                found.append(got)
                todo = todo.join(got.select(KEYS), on=KEYS, how="anti")
        if not found:
            return pl.DataFrame(schema={"job": pl.Utf8, "rank": pl.Int32, "ts_first": pl.Float64})
        return pl.concat(found, how="vertical_relaxed")

    def max_of(self, keys: pl.DataFrame) -> pl.DataFrame:
        """Per key in `keys`: the max of each `maxes` column over every block."""
        parts = [p.join(keys.select(KEYS), on=KEYS, how="semi").select(*KEYS, *self.maxes) for ps in self.blocks.values() for p in ps]
        parts = [p for p in parts if p.height]
        if not parts:
            return pl.DataFrame(schema={"job": pl.Utf8, "rank": pl.Int32, **{c: pl.Float64 for c in self.maxes}})
        return pl.concat(parts, how="vertical_relaxed").group_by(KEYS).agg(pl.col(c).max() for c in self.maxes)

    def drop_jobs(self, jobs: Sequence[str]) -> None:
        for k, parts in list(self.blocks.items()):
            self.blocks[k] = [p.filter(~pl.col("job").is_in(list(jobs))) for p in parts]

    def clear(self) -> None:
        self.blocks = {}
        self._aggregated = set()


def merge_edges(edge: pl.DataFrame, fresh: pl.DataFrame, first: list[str], last: list[str]) -> pl.DataFrame:
    """Fold this tick's rows into per-key oldest/newest values.

    `edge` has per key ts_first, <c>_first (c in first), ts_last, <c>_last (c in last); `fresh`
    has ts and the raw columns. Oldest by ts (ties: earlier arrival), newest by ts (ties: later).
    """
    if fresh.height == 0:
        return edge
    new = (
        fresh.sort("ts", maintain_order=True)
        .group_by(KEYS, maintain_order=True)
        .agg(
            pl.col("ts").first().alias("_f_ts"),
            *(pl.col(c).first().alias(f"_f_{c}") for c in first),
            pl.col("ts").last().alias("_l_ts"),
            *(pl.col(c).last().alias(f"_l_{c}") for c in last),
        )
    )
    edge = edge.join(new, on=KEYS, how="full", coalesce=True)
    later = pl.col("ts_last").is_null() | (pl.col("_l_ts").is_not_null() & (pl.col("_l_ts") >= pl.col("ts_last")))
    earlier = pl.col("ts_first").is_null() | (pl.col("_f_ts").is_not_null() & (pl.col("_f_ts") < pl.col("ts_first")))
    return edge.select(
        *KEYS,
        pl.when(earlier).then(pl.col("_f_ts")).otherwise(pl.col("ts_first")).alias("ts_first"),
        *(pl.when(earlier).then(pl.col(f"_f_{c}")).otherwise(pl.col(f"{c}_first")).alias(f"{c}_first") for c in first),
        pl.when(later).then(pl.col("_l_ts")).otherwise(pl.col("ts_last")).alias("ts_last"),
        *(pl.when(later).then(pl.col(f"_l_{c}")).otherwise(pl.col(f"{c}_last")).alias(f"{c}_last") for c in last),
    )


def refresh_first(rows: SlidingRows, window: Window, state: pl.DataFrame, leaving: pl.DataFrame, values: dict[str, pl.Expr]) -> pl.DataFrame:
    """Keys that lost their oldest rows this tick take the next oldest (band lookup)."""
    if leaving.height == 0 or state.height == 0:
        return state
    lost = leaving.select(KEYS).unique().join(state.select(KEYS), on=KEYS, how="semi")
    if lost.height == 0:
        return state
    first = rows.first_rows(window, lost, values)
    names = ["ts", *values]
    return state.join(first, on=KEYS, how="left").with_columns(
        pl.when(pl.col("_f_ts").is_not_null()).then(pl.col(f"_f_{k}")).otherwise(pl.col(f"{k}_first")).alias(f"{k}_first") for k in names
    ).drop(f"_f_{k}" for k in names)
