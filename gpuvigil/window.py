"""Bounded, columnar windows over the streams a pipeline ingests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import polars as pl

from gpuvigil import schemas

# State streams are snapshots: each collect replaces the previous frame instead of appending.
SNAPSHOT_STREAMS = frozenset({"jobs", "nodes", "allocations", "gpu_jobs"})
# Chunks smaller than this are merged with a small neighbour when sealed.
SMALL_CHUNK_ROWS = 16_384
# The key of `latest` for a stream whose history keeps only some columns: every column of a
# key's newest row is kept apart, so the exporter still sees it (see Window, `columns`).
LATEST_KEYS: Mapping[str, tuple[str, ...]] = {"gpu_samples": ("node", "gpu"), "rank_progress": ("job", "rank"), "allocator_stats": ("job", "rank")}


def _min_ts(df: pl.DataFrame) -> float:
    lo = df["ts"].min()
    return float(lo) if lo is not None else float("-inf")  # type: ignore[arg-type]


class Window:
    """The last `horizon_seconds` of every time-series stream, plus the latest state snapshots.

    Appends are batched: frames are buffered and concatenated once per tick (`seal`). A stream is
    kept as one chunk per seal, and `get` returns the chunks stacked without copying them, so a
    seal costs O(new rows): whole chunks older than the horizon are dropped, and only a chunk
    that straddles it is filtered (the old layout copied the whole window on every seal, which
    doubled its memory for a moment and cost O(window) per tick).

    `columns` names, per stream, the columns its history keeps (pipeline/core.py:
    declared_columns, from what the detectors that read its history declare). Memory is the
    window's cost at scale (at 100,000 GPUs a full `gpu_samples` row is ~250 bytes, the columns
    read over time ~85), so for such a stream `get` returns only those columns (plus `ts` and the
    `LATEST_KEYS`), `fresh` still returns every column of the latest tick, and `latest` every
    column of each key's newest row, kept apart (one row per key). Streams not named keep all.

    `retain` thins a stream's history further: rows older than some seconds only for the keys its
    readers still need (memory at scale: at 100,000 GPUs straggler needs rank rows older than 65 s only
    for jobs with long steps, the device-level detectors need gpu_samples only for L0/L1 jobs).
    """

    def __init__(self, horizon_seconds: Mapping[str, float] | float = 600.0, columns: Mapping[str, Sequence[str]] | None = None):
        self._horizon = horizon_seconds
        self._columns: dict[str, list[str]] = {}
        for stream, cols in (columns or {}).items():
            if stream in SNAPSHOT_STREAMS or stream not in LATEST_KEYS:
                continue  # snapshots are small and whole; a stream without a latest key keeps all
            keep = {"ts", *LATEST_KEYS[stream], *cols}
            order = list(schemas.STREAMS[stream]) if stream in schemas.STREAMS else []
            self._columns[stream] = [c for c in order if c in keep] + sorted(keep - set(order))
        self._latest: dict[str, pl.DataFrame] = {}  # pruned streams: every column of each key's newest row
        self._frames: dict[str, pl.DataFrame] = {}  # snapshots, and time series stacked (cache)
        # time series: (min ts, rows, min ts of the rows `retain` has not thinned yet, or None) per seal
        self._chunks: dict[str, list[tuple[float, pl.DataFrame, float | None]]] = {}
        self._retain: dict[str, tuple[float, pl.DataFrame]] = {}  # see `retain`
        self._pending: dict[str, list[pl.DataFrame]] = {}
        self._fresh: dict[str, pl.DataFrame] = {}
        self.now: float = 0.0
        self.rows_ingested: dict[str, int] = {}
        # Bumped by every seal: a detector that keeps running state from `fresh()` knows it saw
        # every tick (seq advanced by one) or must rebuild from the window.
        self.seq = 0

    def horizon(self, stream: str) -> float:
        if isinstance(self._horizon, Mapping):
            return float(self._horizon.get(stream, self._horizon.get("default", 600.0)))
        return float(self._horizon)

    def add(self, stream: str, df: pl.DataFrame) -> None:
        if df.height == 0 and stream not in SNAPSHOT_STREAMS:
            return
        self.rows_ingested[stream] = self.rows_ingested.get(stream, 0) + df.height
        if stream in SNAPSHOT_STREAMS:
            self._frames[stream] = df
            return
        self._pending.setdefault(stream, []).append(df)

    def seal(self, now: float) -> None:
        """Fold buffered frames in and drop rows older than each stream's horizon."""
        self.now = now
        self.seq += 1
        self._fresh = {}
        for stream, parts in self._pending.items():
            fresh = pl.concat(parts, how="vertical_relaxed") if len(parts) > 1 else parts[0]
            self._fresh[stream] = fresh
            keep = self._columns.get(stream)
            if keep is not None:
                self._fold_latest(stream, fresh, now)
                # select shares the fresh frame's buffers: the dropped columns are freed with it.
                fresh = fresh.select([c for c in keep if c in fresh.columns])
            chunks = self._chunks.setdefault(stream, [])
            old = self._frames.get(stream)
            add = fresh
            if chunks and old is not None and fresh.schema != old.schema:
                # Other dtypes (a null column, a narrower int): stacked as vertical_relaxed would.
                target = pl.concat([old.clear(), fresh.clear()], how="vertical_relaxed").schema
                if target == old.schema:
                    add = fresh.cast(dict(target))  # type: ignore[arg-type]
                else:  # the window's own dtypes widen: one chunk, once
                    merged = pl.concat([old, fresh], how="vertical_relaxed")
                    chunks[:] = [(_min_ts(merged), merged, _min_ts(merged))]
                    add = None
            if add is not None:
                chunks.append((_min_ts(add), add, _min_ts(add)))
                if len(chunks) > 1 and chunks[-1][1].height < SMALL_CHUNK_ROWS and chunks[-2][1].height < SMALL_CHUNK_ROWS:
                    # A sparse stream (events: a few rows a tick, kept an hour) would otherwise
                    # hold thousands of tiny chunks; small neighbours are merged (O(small)).
                    (lo_a, a, todo_a), (lo_b, b, todo_b) = chunks[-2], chunks[-1]
                    todo = min((t for t in (todo_a, todo_b) if t is not None), default=None)
                    chunks[-2:] = [(min(lo_a, lo_b), pl.concat([a, b], how="vertical", rechunk=True), todo)]
            self._evict(stream, now)
            self._thin(stream, now)
            self._frames[stream] = self._stack(chunks, fresh)
        # A stream with no rows this tick still ages: without this, its rows older than the
        # horizon stayed until its next row arrived (detectors that cut at now - horizon
        # themselves then disagreed with those that read the window).
        for stream, chunks in self._chunks.items():
            if stream not in self._pending and (self._evict(stream, now) | self._thin(stream, now)):
                self._frames[stream] = self._stack(chunks, self._frames[stream])
                if stream in self._latest:
                    self._latest[stream] = self._latest[stream].filter(pl.col("ts") >= now - self.horizon(stream))
        self._pending.clear()

    def _evict(self, stream: str, now: float) -> bool:
        """Drop the stream's rows older than its horizon; True if any were dropped."""
        chunks = self._chunks[stream]
        cutoff = now - self.horizon(stream)
        if not any(lo < cutoff for lo, _, _ in chunks):
            return False
        kept = []
        for lo, df, todo in chunks:
            if lo < cutoff:
                df = df.filter(pl.col("ts") >= cutoff)
                if df.height == 0:
                    continue
                lo = _min_ts(df)
                todo = max(todo, lo) if todo is not None else None
            kept.append((lo, df, todo))
        chunks[:] = kept
        return True

    def retain(self, stream: str, recent_seconds: float, keep: pl.DataFrame | None) -> None:
        """Thin the stream's older history: rows older than `recent_seconds` (by ts) are kept (up
        to the horizon) only where their key (the columns of `keep`) is one of `keep`'s rows; None
        lifts it. Applied from the next seal, to each chunk once its oldest row not yet thinned
        is that old (O(rows sealed a tick) per tick): a key added to `keep` later keeps its rows
        from then, the rows thinned before do not come back. The pipeline sets it from what the
        stream's history readers declare (pipeline/core.py: declared_retention); `latest` still
        has each key's newest row within the horizon."""
        if keep is None:
            self._retain.pop(stream, None)
        else:
            self._retain[stream] = (float(recent_seconds), keep)

    def retention(self, stream: str) -> tuple[float, pl.DataFrame] | None:
        """The `retain` rule the stream's next (or, read between a seal and the end of its tick,
        latest) seal thins by: (recent_seconds, keep), or None. A detector that keeps its own
        copy of some rows (oom_device's rings) drops what the window drops."""
        return self._retain.get(stream)

    def _thin(self, stream: str, now: float) -> bool:
        """Apply `retain` to the chunks with rows older than `recent_seconds` not yet thinned;
        True if any changed."""
        rule = self._retain.get(stream)
        if rule is None:
            return False
        recent, keep = rule
        cutoff = now - recent
        chunks = self._chunks.get(stream, [])
        if not any(todo is not None and todo < cutoff for _, _, todo in chunks):
            return False
        on = keep.columns
        kept = []
        for lo, df, todo in chunks:
            if todo is not None and todo < cutoff:
                since, todo = todo, None
                if all(c in df.columns for c in on):
                    key = keep if keep.schema == df.select(on).schema else keep.cast(dict(df.select(on).schema))  # type: ignore[arg-type]
                    if len(on) == 1:
                        kept_key = pl.col(on[0]).is_in(key[on[0]].implode(), nulls_equal=True)
                    else:
                        kept_key = pl.struct(on).is_in(key.select(pl.struct(on)).to_series().implode(), nulls_equal=True)
                    # Rows older than `since` were thinned before (with the keys of then).
                    df = df.filter((pl.col("ts") >= cutoff) | (pl.col("ts") < since) | kept_key)
                    if df.height == 0:
                        continue
                    lo = _min_ts(df)
                    newer = df["ts"].filter(df["ts"] >= cutoff).min()
                    todo = float(newer) if newer is not None else None  # type: ignore[arg-type]
            kept.append((lo, df, todo))
        chunks[:] = kept
        return True

    def _fold_latest(self, stream: str, fresh: pl.DataFrame, now: float) -> None:
        """Keep every column of each key's newest row (by ts; ties: the later arrival)."""
        keys = list(LATEST_KEYS[stream])
        prev = self._latest.get(stream)
        if prev is not None and prev.height == fresh.height and prev.schema == fresh.schema and prev.select(keys).equals(fresh.select(keys)) and bool((fresh["ts"] >= prev["ts"]).all()):
            # The usual tick: every key once, in the same order, each newer than before.
            self._latest[stream] = fresh
            return
        both = fresh if prev is None else pl.concat([prev, fresh], how="vertical_relaxed")
        newest = both.sort("ts", maintain_order=True).unique(keys, keep="last", maintain_order=True)
        # A key whose newest row left the horizon has no row in the window any more.
        self._latest[stream] = newest.filter(pl.col("ts") >= now - self.horizon(stream))

    def columns(self, stream: str) -> list[str] | None:
        """The columns `get(stream)` returns, or None where the stream keeps every column."""
        keep = self._columns.get(stream)
        return list(keep) if keep is not None else None

    @staticmethod
    def _stack(chunks: list[tuple[float, pl.DataFrame, float | None]], like: pl.DataFrame) -> pl.DataFrame:
        if not chunks:
            return like.clear()
        if len(chunks) == 1:
            return chunks[0][1]
        # rechunk=False: the result refers to the chunks' buffers, nothing is copied.
        return pl.concat([df for _, df, _ in chunks], how="vertical", rechunk=False)

    def get(self, stream: str) -> pl.DataFrame:
        df = self._frames.get(stream)
        if df is None:
            if stream not in schemas.STREAMS:
                return pl.DataFrame()
            keep = self._columns.get(stream)
            return schemas.empty(stream) if keep is None else schemas.empty(stream).select(keep)
        return df

    def fresh(self, stream: str) -> pl.DataFrame:
        """Only the rows that arrived in the latest tick (for detectors that keep running state)."""
        df = self._fresh.get(stream)
        if df is None:
            return schemas.empty(stream) if stream in schemas.STREAMS else pl.DataFrame()
        return df

    def __getitem__(self, stream: str) -> pl.DataFrame:
        return self.get(stream)

    def latest(self, stream: str, by: list[str]) -> pl.DataFrame:
        """The most recent row per key (e.g. per node+gpu)."""
        df = self.get(stream)
        if df.height == 0:
            if stream not in self._columns:
                return df
            rows = self._latest.get(stream)
            return rows.clear() if rows is not None else schemas.empty(stream)
        if stream not in self._columns:
            return df.sort("ts").group_by(by, maintain_order=True).last()
        if tuple(by) != LATEST_KEYS[stream]:
            raise ValueError(f"window: the history of {stream!r} keeps {self._columns[stream]}; its latest rows are kept per {list(LATEST_KEYS[stream])}, not {list(by)}")
        # The keys in the order the whole-window expression above gives them (first row of each
        # after the same sort of the same ts column), with every column of their newest row.
        order = df.select(*by, "ts").sort("ts").unique(list(by), keep="first", maintain_order=True).select(by)
        rows = self._latest[stream]
        if stream in self._retain:
            # A key whose older rows were thinned (`retain`) and that sent nothing recently is
            # still within the horizon: its newest row stays (first: its rows are the oldest).
            gone = rows.select(*by, "ts").join(order.cast(dict(rows.select(by).schema)), on=list(by), how="anti", nulls_equal=True)  # type: ignore[arg-type]
            if gone.height:
                order = pl.concat([gone.sort("ts", maintain_order=True).select(by).cast(dict(order.schema)), order])  # type: ignore[arg-type]
        if order.schema != rows.select(by).schema:
            order = order.cast(dict(rows.select(by).schema))  # type: ignore[arg-type]
        rest = [c for c in rows.columns if c not in by]
        return order.join(rows, on=list(by), how="left", maintain_order="left", nulls_equal=True).select(*by, *rest)

    def streams(self) -> list[str]:
        return sorted(self._frames)
