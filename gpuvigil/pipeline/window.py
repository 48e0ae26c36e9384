"""Bounded, columnar windows over the streams a pipeline ingests."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from gpuvigil import schemas

# State streams are snapshots: each collect replaces the previous frame instead of appending.
SNAPSHOT_STREAMS = frozenset({"jobs", "nodes", "allocations", "gpu_jobs"})


class Window:
    """The last `horizon_seconds` of every time-series stream, plus the latest state snapshots.

    Appends are batched: frames are buffered and concatenated once per tick (`seal`), so the
    cost per tick is one concat and one filter per stream, whatever the number of GPUs.
    """

    def __init__(self, horizon_seconds: Mapping[str, float] | float = 600.0):
        self._horizon = horizon_seconds
        self._frames: dict[str, pl.DataFrame] = {}
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
            self._fresh[stream] = pl.concat(parts, how="vertical_relaxed") if len(parts) > 1 else parts[0]
            old = self._frames.get(stream)
            frames = ([old] if old is not None and old.height else []) + parts
            df = pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]
            cutoff = now - self.horizon(stream)
            if df.height and df["ts"].min() < cutoff:  # type: ignore[operator]
                df = df.filter(pl.col("ts") >= cutoff)
            self._frames[stream] = df
        self._pending.clear()

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
