"""A window whose history keeps only the columns its detectors read (memory at 100k
GPUs) must return, for those columns, the rows a whole window returns, `latest` every column of
each key's newest row exactly as the whole window gives it, and `fresh` every column; and the
pipeline must keep only what the detectors declare."""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples
from polars.testing import assert_frame_equal

from gpuvigil import schemas
from gpuvigil.detectors.registry import default_detectors
from gpuvigil.pipeline.core import Pipeline, declared_columns
from gpuvigil.window import Window
from gpuvigil.app.runtime import build_simulated

KEPT = ["util_ratio"]


def _gpu_rows(now: float, keys: list[tuple[str, int]], seq: int, late: float) -> pl.DataFrame:
    rows = [
        {"ts": now - (late if i % 4 == 1 else 0.0), "node": node, "gpu": gpu, "gpu_uuid": f"GPU-{node}-{gpu}", "util_ratio": (seq + i) / 1000, "power_w": float(seq * 7 + i)}
        for i, (node, gpu) in enumerate(keys)
    ]
    return schemas.frame(rows, "gpu_samples")


@st.composite
def ticks(draw):
    universe = [(f"n{n}", g) for n in range(3) for g in range(3)]
    out, now, seq = [], 0.0, 0
    for _ in range(draw(st.integers(1, 30))):
        now += draw(st.sampled_from([1.0, 1.0, 1.0, 4.0, 30.0]))
        parts = []
        for _ in range(draw(st.integers(0, 2))):
            # The usual tick (every key, same order), or some keys, shuffled, some late.
            if draw(st.booleans()):
                keys = list(universe)
            else:
                keys = draw(st.lists(st.sampled_from(universe), min_size=0, max_size=9, unique=True))
            parts.append(_gpu_rows(now, keys, seq, draw(st.sampled_from([0.0, 0.5, 3.0]))))
            seq += 100
        out.append((now, parts))
    return out, draw(st.sampled_from([5.0, 20.0, 1e9]))


def _feed(window: Window, case) -> list[tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]]:
    seen = []
    for now, parts in case:
        for df in parts:
            window.add("gpu_samples", df)
        window.seal(now)
        seen.append((window.get("gpu_samples"), window.fresh("gpu_samples"), window.latest("gpu_samples", ["node", "gpu"])))
    return seen


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ticks())
def test_pruned_history_latest_and_fresh_match_the_whole_window(case):
    """Each key's rows carry distinct timestamps within a tick and across ticks, so `latest` has
    one newest row per key (the whole window's unstable sort decides ties; ours takes the later
    arrival, see Window._fold_latest)."""
    ticks_, horizon = case
    whole = _feed(Window({"default": horizon}), ticks_)
    pruned_window = Window({"default": horizon}, columns={"gpu_samples": KEPT})
    pruned = _feed(pruned_window, ticks_)
    kept = pruned_window.columns("gpu_samples")
    assert kept == ["ts", "node", "gpu", "util_ratio"]
    for (w_get, w_fresh, w_latest), (p_get, p_fresh, p_latest) in zip(whole, pruned, strict=True):
        assert p_get.columns == kept
        assert_frame_equal(p_get, w_get.select(kept))
        assert_frame_equal(p_fresh, w_fresh)
        assert_frame_equal(p_latest, w_latest)


def test_latest_keeps_a_gpu_that_missed_ticks_and_drops_one_past_the_horizon():
    w = Window({"default": 10.0}, columns={"gpu_samples": KEPT})
    w.add("gpu_samples", _gpu_rows(1.0, [("a", 0), ("b", 0)], 0, 0.0))
    w.seal(1.0)
    for now in (2.0, 3.0, 4.0):
        w.add("gpu_samples", _gpu_rows(now, [("a", 0)], int(now), 0.0))
        w.seal(now)
    latest = w.latest("gpu_samples", ["node", "gpu"])
    assert latest.columns[:3] == ["node", "gpu", "ts"] and "gpu_uuid" in latest.columns
    assert latest.select("node", "ts").rows() == [("a", 4.0), ("b", 1.0)]
    assert latest.filter(pl.col("node") == "b")["gpu_uuid"].to_list() == ["GPU-b-0"]  # a column the history dropped
    w.add("gpu_samples", _gpu_rows(12.0, [("a", 0)], 12, 0.0))
    w.seal(12.0)  # b's only row (ts 1) is now past the 10 s horizon
    assert w.latest("gpu_samples", ["node", "gpu"]).select("node", "ts").rows() == [("a", 12.0)]
    with pytest.raises(ValueError, match="latest rows are kept per"):
        w.latest("gpu_samples", ["node"])


class _Reader:
    def __init__(self, name, streams, lookback=None, columns=None):
        self.name, self.streams = name, streams
        if lookback is not None:
            self.lookback_seconds = lambda: lookback
        if columns is not None:
            self.window_columns = lambda: columns


def test_declared_columns_union_fresh_readers_free_undeclared_keep_all():
    cols = declared_columns(
        [
            _Reader("fresh", ("gpu_samples", "rank_progress"), lookback={"gpu_samples": 0, "rank_progress": 0}),
            _Reader("hist", ("gpu_samples",), lookback={"gpu_samples": 60}, columns={"gpu_samples": ["power_w"]}),
            _Reader("hist2", ("gpu_samples",), columns={"gpu_samples": ["util_ratio", "power_w"]}),
            _Reader("undeclared", ("allocator_stats",)),
        ]
    )
    assert cols == {"gpu_samples": ["power_w", "util_ratio"], "rank_progress": []}
    assert "allocator_stats" not in cols  # a reader of its history that declares nothing: every column


def test_default_pipeline_keeps_what_its_detectors_read_and_exports_every_column():
    rt = build_simulated("healthy", nodes=2, seed=0)
    pipe: Pipeline = rt.pipeline
    w = pipe.window
    # (sm_active_ratio is not kept: straggler_device declared it but never read it; no reader left)
    assert w.columns("gpu_samples") == [
        "ts", "node", "gpu", "memory_used_bytes", "memory_total_bytes", "util_ratio", "power_w", "sm_clock_mhz", "memory_reserved_bytes",
    ]  # fmt: skip
    assert "current_op" not in (w.columns("rank_progress") or []) and "oom_count" not in (w.columns("allocator_stats") or [])
    for _ in range(5):
        rt.step()
    assert w.fresh("gpu_samples").columns == list(schemas.GPU_SAMPLES)
    latest = w.latest("gpu_samples", ["node", "gpu"])
    assert latest.height == 16 and set(latest.columns) == set(schemas.GPU_SAMPLES)
    # Every detector of the default set reads only what it declared (a missing column raises).
    names = {d.name for d in default_detectors()}
    assert names == {d.name for d in pipe.detectors}
