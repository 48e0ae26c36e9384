"""incremental.BlockRing, the ring of per-block arrays under fragmentation_allocator's block mode
and oom_device's bucket maxima: which block each row holds as the ring advances, is emptied or
is relayed into a longer ring, and keys added, emptied and dropped. And KeyIndex's one-off
frames (`cache=False`, fragmentation_allocator's rebuilds and leaving rows): numbered like any
other, without displacing the tick's remembered frame."""

from __future__ import annotations

import numpy as np
import polars as pl

from gpuvigil.detectors.incremental import BlockRing, KeyIndex


def ring(length: int = 4, keys: int = 3) -> BlockRing:
    return BlockRing(length, {"n": (np.int32, 0), "v": (np.float32, np.nan)}, keys)


def test_advance_empties_the_blocks_it_moves_onto_and_keeps_the_newer_ones():
    r = ring()
    r.advance(2)
    r["n"][r.rows(0, 2)] = [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    r["v"][2 % 4] = 7.0
    r.advance(2)  # not newer: nothing moves
    r.advance(4)  # block 4 takes block 0's row; 3 takes an empty one
    assert r.top == 4
    assert r["n"][r.rows(1, 4)].tolist() == [[2, 2, 2], [3, 3, 3], [0, 0, 0], [0, 0, 0]]
    assert r["v"][2].tolist() == [7.0] * 3 and np.isnan(r["v"][0]).all()
    r.advance(100)  # past the whole ring: every row empty
    assert not r["n"].any() and np.isnan(r["v"]).all()


def test_cleared_blocks_and_keys_are_empty_and_the_others_stay():
    r = ring()
    r["n"][:] = 5
    r["v"][:] = 1.0
    r.clear_blocks([6], names=["n"])  # row 2, count only
    assert r["n"][:, 0].tolist() == [5, 5, 0, 5] and (r["v"] == 1.0).all()
    r.clear(np.array([False, True, False]))
    assert r["n"][:, 1].tolist() == [0] * 4 and np.isnan(r["v"][:, 1]).all()
    assert r["n"][:, 2].tolist() == [5, 5, 0, 5]


def test_keys_widen_empty_and_keep_renumbers_in_order():
    r = ring(keys=2)
    r["n"][:] = [[1, 2]] * 4
    r.widen(5)
    assert r.keys == 5 and r["n"][0].tolist() == [1, 2, 0, 0, 0] and np.isnan(r["v"][:, 2:]).all()
    r["n"][:, 4] = 9
    r.keep(np.array([1, 4]))
    assert r.keys == 2 and r["n"][3].tolist() == [2, 9]


def test_relay_moves_the_held_blocks_into_a_ring_of_another_length():
    r = ring(length=3, keys=1)
    for b in (4, 5, 6):
        r["n"][b % 3] = b
    r.relay(5, range(4, 7))  # blocks 4..6 now in rows 4, 0, 1
    assert r.length == 5
    assert r["n"][:, 0].tolist() == [5, 6, 0, 0, 4]
    assert np.isnan(r["v"]).all()


def test_a_one_off_frame_is_numbered_and_leaves_the_remembered_frame_alone():
    idx = KeyIndex({"job": pl.Utf8(), "rank": pl.Int64()})
    tick = pl.DataFrame({"job": ["a", "a", "b"], "rank": [0, 1, 0]}, schema={"job": pl.Utf8, "rank": pl.Int64})
    assert idx.index(tick).tolist() == [0, 1, 2] and idx.run == slice(0, 3)
    remembered = idx._last
    once = pl.DataFrame({"job": ["c", "a", "c"], "rank": [5, 1, 5]}, schema={"job": pl.Utf8, "rank": pl.Int64})
    assert idx.index(once, shape=False, cache=False).tolist() == [3, 1, 3]
    assert idx._last is remembered and idx.n == 4
    assert idx.index(once, shape=False, cache=False).tolist() == [3, 1, 3] and idx.n == 4
    assert idx.index(tick).tolist() == [0, 1, 2]
    # Without cache=False a frame replaces the remembered one (shape=False: none is kept).
    idx.index(once, shape=False)
    assert idx._last is None
