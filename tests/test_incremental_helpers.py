"""The shared per-key state helpers of gpuvigil/detectors/incremental.py, one by one: growth
(`headroom`, `grow`, `resized`), block sums (`BlockSums`), key numbers (`KeyIndex`, as `KeyRing`
uses it) and per-slot samples in time order (`SlotSamples`).

Data: constructed arrays and frames (what the detectors feed these helpers); the detectors that
use them are held to their refits in tests/test_oom_numpy.py, tests/test_oom_device_incremental.py,
tests/test_straggler_incremental.py and tests/test_block_state.py.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from gpuvigil.detectors.incremental import BlockSums, KeyIndex, KeyRing, SlotSamples, grow, headroom, resized


def test_growth_keeps_what_is_held_and_fills_the_rest():
    assert [headroom(1, 0), headroom(65, 64), headroom(100, 64), headroom(1000, 1000)] == [64, 72, 100, 1125]
    a = np.array([1.0, 2.0])
    assert grow(a, 2, 0.0) is a  # room enough: no copy
    assert grow(a, 3, -1.0).tolist() == [1.0, 2.0] + [-1.0] * 62
    m = np.arange(6, dtype=np.int32).reshape(2, 3)
    wide = resized(m, 5, 9, axis=1)
    assert wide.dtype == np.int32 and wide.tolist() == [[0, 1, 2, 9, 9], [3, 4, 5, 9, 9]]
    assert resized(m, 3, 7).tolist() == [[0, 1, 2], [3, 4, 5], [7, 7, 7]]


def test_block_sums_hold_each_block_until_it_leaves():
    b = BlockSums(sums=2, firsts=1)
    first = b.at(10, 2)
    assert first.tolist()[:2] == [[0.0, 0.0], [0.0, 0.0]] and np.isnan(first[2]).all()
    first[0] += [1.0, 2.0]
    first[2, 0] = 100.0
    assert b.at(10, 5) is first  # held: not rebuilt, not widened here
    b.at(11, 2)[0] += [3.0, 4.0]
    b.at(12, 2)
    b.pad(3)  # a third key appears: every block gains an empty column
    assert {k: a.shape for k, a in b.blocks.items()} == {10: (3, 3), 11: (3, 3), 12: (3, 3)}
    assert b.blocks[10][0].tolist() == [1.0, 2.0, 0.0] and np.isnan(b.blocks[10][2, 1:]).all()
    b.clear(np.array([True, False, False]))
    assert b.blocks[11][0].tolist() == [0.0, 4.0, 0.0] and np.isnan(b.blocks[10][2, 0])
    b.keep(np.array([False, True, True]))  # key 0 gone: keys 1, 2 become 0, 1
    assert b.blocks[11][0].tolist() == [4.0, 0.0]
    assert [a[0].tolist() for a in b.oldest_first()] == [[2.0, 0.0], [4.0, 0.0], [0.0, 0.0]]
    left = b.leaving(12)
    assert [k for k, _ in left] == [10, 11] and set(b.blocks) == {12}
    assert b.leaving(12) == []


def test_key_numbers_are_stable_and_shared_with_the_ring():
    idx = KeyIndex({"job": pl.Utf8(), "rank": pl.Int32()})
    frame = pl.DataFrame({"job": ["a", "a", "b"], "rank": [0, 1, 0]}, schema={"job": pl.Utf8, "rank": pl.Int32})
    assert idx.index(frame).tolist() == [0, 1, 2] and idx.unique and idx.run == slice(0, 3)
    again = pl.DataFrame({"job": ["b", None, "a", "b"], "rank": [0, 3, 1, 0]}, schema={"job": pl.Utf8, "rank": pl.Int32})
    assert idx.index(again).tolist() == [2, 3, 1, 2] and not idx.unique and idx.run is None
    assert idx.keep(np.array([False, True, True, True])).tolist() == [-1, 0, 1, 2]
    assert idx.index(frame.slice(1)).tolist() == [0, 1]
    ring = KeyRing(["x"], [], capacity=2)
    k = ring.key_index(again)
    assert k.tolist() == [0, 1, 2, 0] and ring.n == 3 and ring.keys["job"].to_list() == ["b", None, "a"]
    assert ring.ts.shape[0] >= 3  # rows for every key numbered


def test_slot_samples_keep_each_slot_in_time_order():
    s = SlotSamples(("own", "frn"), latest=("used",), tracked=("frn",), chunk=2)
    s.grow_rows(3)
    assert s.rows == 64
    nan = np.nan
    # slot 1 gets a row older than its newest: it is marked unsorted, then sorted
    s.insert(np.array([1, 0, 1]), np.array([10.0, 11.0, 12.0]), {"own": np.array([1.0, 2.0, 3.0]), "frn": np.array([nan, nan, nan])}, {"used": np.array([5.0, 6.0, 7.0])}, keep_from=0.0, ticks=4)
    s.insert(np.array([1]), np.array([11.0]), {"own": np.array([9.0]), "frn": np.array([4.0])}, {"used": np.array([8.0])}, keep_from=0.0, ticks=4)
    assert s.n[:2].tolist() == [1, 3] and bool(s.unsorted[1]) and not s.unsorted[0]
    assert s.seen["frn"][:2].tolist() == [False, True]
    assert s.last["used"][:2].tolist() == [6.0, 7.0]  # the newest row's value, not the last to arrive
    s.sort_unsorted()
    assert s.ts[1, :3].tolist() == [10.0, 11.0, 12.0] and s.v["own"][1, :3].tolist() == [1.0, 9.0, 3.0]
    s.compact(np.array([1]), keep_from=11.0)  # rows below the look-back go
    assert s.n[1] == 2 and s.ts[1, :2].tolist() == [11.0, 12.0] and np.isnan(s.ts[1, 2])
    s.thin(np.array([1]), judged=12.0, cut=13.0)  # the newest row goes: the slot must be refilled
    assert s.n[1] == 1 and s.floor[1] == np.inf
    s.insert(np.array([2]), np.array([5.0]), {"own": np.array([1.0]), "frn": np.array([nan])}, {"used": np.array([1.0])}, keep_from=6.0, ticks=4)
    assert s.n[2] == 0  # older than keep_from: not kept
    s.clear(np.array([0, 1]))
    assert s.n[:2].tolist() == [0, 0] and not s.seen["frn"][1] and np.isnan(s.last["used"][:2]).all() and np.isnan(s.ts[:2]).all()
