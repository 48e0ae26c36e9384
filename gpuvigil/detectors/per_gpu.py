"""Per-GPU running state in numpy arrays, for detectors that fold each tick's samples in.

A polars join of this tick's samples onto a state frame, an anti-join and a concat cost a few
milliseconds per tick at 1,000 GPUs whatever the data; replaying a month is 86,400 ticks. Here
each (node, gpu) gets a fixed slot, found with one dict lookup per row, or none at all when a
tick lists the GPUs in the same order as the previous one (a fleet's scrape usually does).
"""

from __future__ import annotations

import numpy as np
import polars as pl


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


def grow(arr: np.ndarray, n: int, fill: float | int | bool) -> np.ndarray:
    """`arr` extended to at least `n` slots with `fill` (amortised doubling)."""
    if arr.shape[0] >= n:
        return arr
    out = np.full(max(n, 2 * arr.shape[0], 64), fill, dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


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
