"""Mutation testing: the per-GPU slot helpers (`gpuvigil/detectors/per_gpu.py`) that the
fast thermal, PCIe, XID and ECC detectors fold each tick into.

Data: constructed arrays (these are pure array helpers; the detectors that use them are tested
on the public and H200 captures in their own files). The oracle for `last_per_slot` is its own
docstring, written as polars: `sort("ts", maintain_order=True).group_by(slot, maintain_order=True).last()`.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from gpuvigil.detectors.per_gpu import GpuSlots, grow, last_per_slot


def test_grow_keeps_an_array_that_is_big_enough():
    a = np.arange(5, dtype=np.float32)
    assert grow(a, 5, 0.0) is a and grow(a, 3, 0.0) is a


def test_grow_sizes_double_with_a_floor_of_64_and_at_least_n():
    assert grow(np.zeros(0), 1, 0.0).shape == (64,)
    assert grow(np.zeros(100), 101, 0.0).shape == (200,)
    assert grow(np.zeros(10), 500, 0.0).shape == (500,)


def test_grow_keeps_values_dtype_and_fills_the_rest():
    a = np.array([3, 4], dtype=np.int32)
    out = grow(a, 3, -1)
    assert out.dtype == np.int32 and out[:2].tolist() == [3, 4] and set(out[2:].tolist()) == {-1}
    f = grow(np.array([1.5], dtype=np.float32), 2, np.nan)
    assert f.dtype == np.float32 and np.isnan(f[1:]).all()
    b = grow(np.array([True]), 2, False)
    assert b.dtype == np.bool_ and not b[1:].any()


def _oracle(idx: np.ndarray, ts: np.ndarray) -> tuple[list[int], list[int]]:
    df = pl.DataFrame({"row": np.arange(len(idx)), "slot": idx, "ts": ts}).sort("ts", maintain_order=True)
    last = df.group_by("slot", maintain_order=True).last()
    return last["row"].to_list(), last["slot"].to_list()


def test_last_per_slot_is_the_latest_row_later_row_on_ties_slots_by_first_sample():
    rng = np.random.default_rng(16)
    for n, slots, times in ((2000, 100, 20), (300, 300, 5), (50, 7, 50)):
        idx = rng.integers(0, slots, n)
        ts = rng.integers(0, times, n).astype(float)  # many equal times: the tie rule matters
        rows, order = last_per_slot(idx, ts)
        assert (rows.tolist(), order.tolist()) == _oracle(idx, ts)


def test_a_slot_whose_only_sample_comes_first_in_time():
    idx, ts = np.array([5, 3, 3]), np.array([0.0, 1.0, 2.0])
    rows, order = last_per_slot(idx, ts)
    assert rows.tolist() == [0, 2] and order.tolist() == [5, 3]


def test_gpu_slots_are_stable_and_grow_as_gpus_appear():
    s = GpuSlots()
    a = s.of(pl.Series(["n1", "n1", "n2"]), pl.Series([0, 1, 0]))
    assert a.tolist() == [0, 1, 2] and len(s) == 3
    b = s.of(pl.Series(["n2", "n3", "n1"]), pl.Series([0, 0, 1]))
    assert b.tolist() == [2, 3, 1] and s.keys == [("n1", 0), ("n1", 1), ("n2", 0), ("n3", 0)]
    c = s.of(pl.Series(["n2", "n3", "n1"]), pl.Series([0, 0, 1]))  # the same order as last tick
    assert c.tolist() == [2, 3, 1]
    d = s.of(pl.Series(["n2", "n3"]), pl.Series([0, 0]))
    assert d.tolist() == [2, 3]
