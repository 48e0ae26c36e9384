"""Bounded, columnar windows over the streams a pipeline ingests."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from gpuvigil import schemas

# State streams are snapshots: each collect replaces the previous frame instead of appending.
SNAPSHOT_STREAMS = frozenset({"jobs", "nodes", "allocations", "gpu_jobs"})
# Chunks smaller than this are merged with a small neighbour when sealed.
SMALL_CHUNK_ROWS = 16_384


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
    """

    def __init__(self, horizon_seconds: Mapping[str, float] | float = 600.0):
        self._horizon = horizon_seconds
        self._frames: dict[str, pl.DataFrame] = {}  # snapshots, and time series stacked (cache)
        self._chunks: dict[str, list[tuple[float, pl.DataFrame]]] = {}  # time series: (min ts, rows) per seal
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
                    chunks[:] = [(_min_ts(merged), merged)]
                    add = None
            if add is not None:
                chunks.append((_min_ts(add), add))
                if len(chunks) > 1 and chunks[-1][1].height < SMALL_CHUNK_ROWS and chunks[-2][1].height < SMALL_CHUNK_ROWS:
                    # A sparse stream (events: a few rows a tick, kept an hour) would otherwise
                    # hold thousands of tiny chunks; small neighbours are merged (O(small)).
                    (lo_a, a), (lo_b, b) = chunks[-2], chunks[-1]
                    chunks[-2:] = [(min(lo_a, lo_b), pl.concat([a, b], how="vertical", rechunk=True))]
            cutoff = now - self.horizon(stream)
            if chunks[0][0] < cutoff or any(lo < cutoff for lo, _ in chunks):
                kept = []
                for lo, df in chunks:
                    if lo < cutoff:
                        df = df.filter(pl.col("ts") >= cutoff)
                        if df.height == 0:
                            continue
                        lo = _min_ts(df)
                    kept.append((lo, df))
                chunks[:] = kept
            self._frames[stream] = self._stack(chunks, fresh)
        self._pending.clear()

    @staticmethod
    def _stack(chunks: list[tuple[float, pl.DataFrame]], like: pl.DataFrame) -> pl.DataFrame:
        if not chunks:
            return like.clear()
        if len(chunks) == 1:
            return chunks[0][1]
        # rechunk=False: the result refers to the chunks' buffers, nothing is copied.
        return pl.concat([df for _, df in chunks], how="vertical", rechunk=False)

    def get(self, stream: str) -> pl.DataFrame:
        df = self._frames.get(stream)
        if df is None:
            return schemas.empty(stream) if stream in schemas.STREAMS else pl.DataFrame()
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
            return df
        return df.sort("ts").group_by(by, maintain_order=True).last()

    def streams(self) -> list[str]:
        return sorted(self._frames)
