"""Sliding per-key state for trend detectors: each tick costs O(new rows), not O(window).

A trend detector (OOM prediction, allocator fragmentation) aggregates, per (job, rank), the rows
of its look-back `[now - W, now]` from the job's current run (`common.current_run`). Refitting
that every tick costs the whole window. `SlidingRows` instead tells the detector, per tick, which
rows *entered* (this tick's fresh rows) and which *left* (older rows that fell below `now - W`),
so running sums are updated from those alone, as `hang` keeps its state from fresh rows.

It falls back to a full rebuild (the same rows a refit reads) whenever it cannot prove it saw
every tick: a different window, a missed seal (a detector called less often than the pipeline
ticks, with no `ingest` call in between), time going back, or a jump longer than the stream's
horizon leaves beyond the look-back. A job whose start changes (requeued, or gone from the
scheduler's snapshot) is rebuilt alone, from its rows in the window.

"First" and "last" values (oldest and newest sample of a key) are taken by timestamp, ties by
arrival; for rows that arrive in time order this is the window's arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from gpuvigil.pipeline.window import Window

KEYS = ["job", "rank"]


@dataclass
class Step:
    """What changed since the previous sync (mode 'step'), or 'rebuild' / 'same'."""

    mode: str
    now: float
    prev_now: float = 0.0
    fresh: pl.DataFrame | None = None  # included rows that arrived this tick
    old: pl.DataFrame | None = None  # every window row that was there before this tick
    leaving: pl.DataFrame | None = None  # included before, below now - W now
    changed_jobs: list[str] | None = None  # jobs whose known start moved or went away
    appeared_jobs: list[str] | None = None  # jobs newly given a start

    def rebuild_jobs(self, state: pl.DataFrame) -> list[str]:
        """Jobs to rebuild from the window alone: a start that moved (requeued) or vanished
        (its warm-up rows count again), or a new start for a job already holding rows."""
        jobs = list(self.changed_jobs or [])
        if self.appeared_jobs:
            jobs += state.filter(pl.col("job").is_in(self.appeared_jobs))["job"].unique().to_list()
        return jobs


class SlidingRows:
    def __init__(self, stream: str, window_seconds: float, warmup_seconds: float):
        self.stream = stream
        self.W = window_seconds
        self.warmup = warmup_seconds
        self._window: Window | None = None
        self._seq = -1
        self._now = 0.0
        self._starts: pl.DataFrame | None = None

    # -- the current-run filter, as common.current_run applies it ---------------------------
    @staticmethod
    def starts(window: Window) -> pl.DataFrame:
        jobs = window.get("jobs")
        if jobs.height == 0:
            return pl.DataFrame(schema={"job": pl.Utf8, "_start": pl.Float64})
        # A job listed twice: current_run's join would duplicate its rows; keep that behaviour
        # out of scope (the scheduler snapshot has one row per job) by taking the first.
        return jobs.select("job", pl.col("start_ts").cast(pl.Float64).alias("_start")).unique("job", keep="first", maintain_order=True)

    def included(self, df: pl.DataFrame, now: float, starts: pl.DataFrame) -> pl.DataFrame:
        """Rows a refit at `now` reads: ts >= now - W, after their job's (re)start + warm-up."""
        df = df.filter(pl.col("ts") >= now - self.W)
        return self.current(df, starts)

    def current(self, df: pl.DataFrame, starts: pl.DataFrame) -> pl.DataFrame:
        if df.height == 0 or starts.height == 0:
            return df
        return df.join(starts, on="job", how="left").filter(pl.col("_start").is_null() | (pl.col("ts") >= pl.col("_start") + self.warmup)).drop("_start")

    def rows_for_rebuild(self, window: Window, jobs: Sequence[str] | None = None) -> pl.DataFrame:
        df = window.get(self.stream)
        if jobs is not None:
            df = df.filter(pl.col("job").is_in(list(jobs)))
        return self.included(df, window.now, self.starts(window))

    # -- per tick ------------------------------------------------------------------------------
    def sync(self, window: Window) -> Step:
        now = window.now
        seq = getattr(window, "seq", None)
        starts = self.starts(window)
        horizon = window.horizon(self.stream)
        if window is self._window and seq == self._seq:
            return Step("same", now)
        stepping = (
            window is self._window
            and seq is not None
            and seq == self._seq + 1
            and now > self._now
            # Rows leaving the look-back must still be in the window to be subtracted.
            and now - self._now <= horizon - self.W
        )
        prev_now, prev_starts = self._now, self._starts
        self._window, self._seq, self._now, self._starts = window, seq if seq is not None else -1, now, starts
        if not stepping:
            return Step("rebuild", now)
        df = window.get(self.stream)
        fresh = window.fresh(self.stream)
        # The window is the previous rows followed by this tick's (those not past the horizon).
        kept_fresh = fresh.filter(pl.col("ts") >= now - horizon).height if fresh.height else 0
        old = df.head(df.height - kept_fresh) if kept_fresh else df
        leaving = self.current(old.filter((pl.col("ts") >= prev_now - self.W) & (pl.col("ts") < now - self.W)), starts)
        changed: list[str] = []
        appeared: list[str] = []
        if prev_starts is not None and (prev_starts.height or starts.height):
            both = prev_starts.join(starts, on="job", how="full", coalesce=True, suffix="_new")
            moved = both.filter(pl.col("_start").ne_missing(pl.col("_start_new")))
            changed = moved.filter(pl.col("_start").is_not_null())["job"].to_list()
            appeared = moved.filter(pl.col("_start").is_null())["job"].to_list()
        return Step("step", now, prev_now, self.included(fresh, now, starts) if fresh.height else fresh, old, leaving, changed, appeared)

    def first_rows(self, window: Window, keys: pl.DataFrame, values: dict[str, pl.Expr]) -> pl.DataFrame:
        """Per key in `keys`, `ts` and `values` of its oldest included row (ties: the first to
        arrive), as columns `_f_ts` and `_f_<name>`.

        Looked up in a band just above `now - W`, widened until every key is found: in steady
        state one tick's worth of rows, not the window.
        """
        now = window.now
        lo = now - self.W
        starts = self._starts if self._starts is not None else self.starts(window)
        df = window.get(self.stream)
        found: list[pl.DataFrame] = []
        band = 2.0
        todo = keys
        while todo.height:
            last_pass = band >= self.W * 4
            part = df.filter(pl.col("ts") >= lo) if last_pass else df.filter((pl.col("ts") >= lo) & (pl.col("ts") < lo + band))
            part = self.current(part, starts).join(todo, on=KEYS, how="semi")
            if part.height:
                got = (
                    part.select(*KEYS, pl.col("ts").alias("_f_ts"), *(e.alias(f"_f_{k}") for k, e in values.items()))
                    .sort("_f_ts", maintain_order=True)
                    .group_by(KEYS, maintain_order=True)
                    .first()
                )
                found.append(got)
                todo = todo.join(got.select(KEYS), on=KEYS, how="anti")
            if last_pass:
                break
            band *= 4
        if not found:
            return pl.DataFrame(schema={"job": pl.Utf8, "rank": pl.Int32, "_f_ts": pl.Float64}).with_columns(pl.lit(None).alias(f"_f_{k}") for k in values)
        return pl.concat(found, how="vertical_relaxed")


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


def edges_from_rows(v: pl.DataFrame, first: list[str], last: list[str]) -> pl.DataFrame:
    """Per key oldest/newest values of `v` (the rebuild path of merge_edges)."""
    return v.group_by(KEYS).agg(
        pl.col("ts").min().alias("ts_first"),
        *(pl.col(c).sort_by("ts", maintain_order=True).first().alias(f"{c}_first") for c in first),
        pl.col("ts").max().alias("ts_last"),
        *(pl.col(c).sort_by("ts", maintain_order=True).last().alias(f"{c}_last") for c in last),
    )
