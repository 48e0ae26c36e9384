"""Per-GPU running state in numpy arrays, for detectors that fold each tick's samples in.

A polars join of this tick's samples onto a state frame, an anti-join and a concat cost a few
milliseconds per tick at 1,000 GPUs whatever the data; replaying a month is 86,400 ticks. Here
each (node, gpu) gets a fixed slot, found with one dict lookup per row, or none at all when a
tick lists the GPUs in the same order as the previous one (a fleet's scrape usually does).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from gpuvigil.detectors.incremental import grow


class GpuSlots:
    """(node, gpu) -> a slot index into per-GPU arrays that grow as GPUs appear."""

    def __init__(self) -> None:
        self._slot: dict[tuple[str, int], int] = {}
        self.keys: list[tuple[str, int]] = []
        # The last series looked up, per caller's cache name (a detector that maps both this
        # tick's samples and the allocations keeps one of each).
        self._last: dict[str, tuple[pl.Series, pl.Series, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def _add(self, key: tuple[str, int]) -> int:
        i = self._slot[key] = len(self.keys)
        self.keys.append(key)
        return i

    def of(self, node: pl.Series, gpu: pl.Series, cache: str = "") -> np.ndarray:
        """The slot of each row (rows must have a node and a gpu). The same series as the last
        call with this `cache` name cost no lookup."""
        last = self._last.get(cache)
        if last is not None and last[0].len() == node.len() and last[0].equals(node) and last[1].equals(gpu):
            return last[2]
        get = self._slot.get
        idx = np.fromiter(
            ((s if (s := get(k)) is not None else self._add(k)) for k in zip(node.to_list(), gpu.to_list(), strict=True)),
            dtype=np.int64,
            count=node.len(),
        )
        self._last[cache] = (node, gpu, idx)
        return idx


def last_per_slot(idx: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, slots): for each slot present, the row of its latest sample (the later row on equal
    times), slots in the order of their first sample by time (as `sort("ts").group_by(...,
    maintain_order=True)` orders groups)."""
    # A tick's rows usually come in time order already (one scrape): no sort then.
    order = np.arange(ts.shape[0]) if ts.shape[0] < 2 or bool(np.all(ts[1:] >= ts[:-1])) else np.argsort(ts, kind="stable")
    sidx = idx[order]
    if sidx.shape[0] == 0:
        return order, sidx
    # One sample per GPU (the usual tick): slots are small non-negative ints, so a count per
    # slot tells it in O(rows), where np.unique would sort or hash.
    if int(np.bincount(sidx).max()) <= 1:
        return order, sidx
    _, first_pos = np.unique(sidx, return_index=True)
    slots_in_order = sidx[np.sort(first_pos)]
    # the last position of each slot in time order (numpy leaves repeated fancy assignment
    # unordered, so take the maximum explicitly)
    last_pos = np.full(int(sidx.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(last_pos, sidx, np.arange(sidx.shape[0]))
    return order[last_pos[slots_in_order]], slots_in_order


class CounterRate:
    """Per GPU, the rate of a cumulative error counter (PCIe replays, NVLink CRC errors) over
    about `window_seconds`: each GPU's reading is compared with its baseline once a window has
    passed, the verdict (rate at or above `floor_per_minute`) holds until the next comparison,
    and the reading becomes the next baseline. O(samples) per tick, in numpy slots."""

    def __init__(self) -> None:
        self._slots = GpuSlots()
        self._ts0 = np.zeros(0)
        self._count0 = np.zeros(0, dtype=np.int64)
        self._has_base = np.zeros(0, dtype=bool)
        self._hot = np.zeros(0, dtype=bool)
        self._rate = np.zeros(0)
        self._hot_ts = np.zeros(0)  # the evaluated reading and its baseline's time
        self._hot_count = np.zeros(0, dtype=np.int64)
        self._hot_ts0 = np.zeros(0)
        self._order = np.zeros(0, dtype=np.int64)  # when each verdict was given (report order)
        self._evaluations = 0

    @property
    def _base(self) -> pl.DataFrame:
        """The baselines, one row per GPU (for inspection and tests)."""
        b = np.flatnonzero(self._has_base[: len(self._slots)])
        return pl.DataFrame({"node": [self._slots.keys[i][0] for i in b], "gpu": [self._slots.keys[i][1] for i in b], "ts": self._ts0[b], "count": self._count0[b]})

    def fold(self, fresh: pl.DataFrame, column: str, window_seconds: float, floor_per_minute: float) -> None:
        """Fold this tick's samples of `column` in (rows without a reading, node or GPU skipped)."""
        if fresh.height == 0 or fresh.get_column(column).null_count() == fresh.height:
            return  # e.g. dcgm-exporter's default fields carry no such counter: nothing to fold
        fresh = fresh.select("node", "gpu", "ts", pl.col(column).alias("count"))
        if fresh["count"].null_count() or fresh["node"].null_count() or fresh["gpu"].null_count():
            fresh = fresh.filter(pl.col("count").is_not_null() & pl.col("node").is_not_null() & pl.col("gpu").is_not_null())
        if fresh.height == 0:
            return
        idx = self._slots.of(fresh["node"], fresh["gpu"])
        n = len(self._slots)
        if self._has_base.shape[0] < n:
            self._ts0, self._rate, self._hot_ts, self._hot_ts0 = (grow(a, n, 0.0) for a in (self._ts0, self._rate, self._hot_ts, self._hot_ts0))
            self._count0, self._hot_count, self._order = (grow(a, n, 0) for a in (self._count0, self._hot_count, self._order))
            self._has_base, self._hot = (grow(a, n, False) for a in (self._has_base, self._hot))
        ts = fresh["ts"].to_numpy()
        rows, slots = last_per_slot(idx, ts)  # one reading per GPU: its latest
        t, count = ts[rows], fresh["count"].to_numpy()[rows]
        based = self._has_base[slots]
        due = ~based | (t - self._ts0[slots] >= window_seconds)
        slots, t, count, based = slots[due], t[due], count[due], based[due]
        if slots.shape[0] == 0:
            return
        # Re-evaluated GPUs replace their previous verdict (a GPU without a baseline: none).
        with np.errstate(divide="ignore", invalid="ignore"):  # window_seconds 0: as polars, inf/nan
            rate = np.where(based, (count - self._count0[slots]).astype(np.float64) * 60.0 / np.where(based, t - self._ts0[slots], 1.0), 0.0)
        hot = based & (rate >= floor_per_minute)
        self._hot[slots] = hot
        self._rate[slots] = rate
        self._hot_ts[slots] = t
        self._hot_count[slots] = count
        self._hot_ts0[slots] = self._ts0[slots]
        self._order[slots] = self._evaluations + np.arange(1, slots.shape[0] + 1)
        self._evaluations += slots.shape[0]
        self._ts0[slots] = t
        self._count0[slots] = count
        self._has_base[slots] = True

    def flagged(self) -> pl.DataFrame:
        """The GPUs whose latest verdict is hot, earliest verdict first: node, gpu, ts, count,
        ts0 (the baseline's time), per_minute."""
        hot = np.flatnonzero(self._hot[: len(self._slots)])
        hot = hot[np.argsort(self._order[hot], kind="stable")]
        return pl.DataFrame(
            {
                "node": [self._slots.keys[i][0] for i in hot],
                "gpu": [self._slots.keys[i][1] for i in hot],
                "ts": self._hot_ts[hot],
                "count": self._hot_count[hot],
                "ts0": self._hot_ts0[hot],
                "per_minute": self._rate[hot],
            },
            schema={"node": pl.Utf8, "gpu": pl.Int32, "ts": pl.Float64, "count": pl.Int64, "ts0": pl.Float64, "per_minute": pl.Float64},
        )
