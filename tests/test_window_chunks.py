"""The window keeps one chunk per seal (no copy of the whole window per tick); what it returns
must be the rows, in the order, that the old layout (one frame, concatenated and filtered on
every seal) returned, for any sequence of appends, late rows, widening dtypes and horizons."""

from __future__ import annotations

import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples
from polars.testing import assert_frame_equal

from gpuvigil.window import Window


class OldWindow:
    """The seal of gpuvigil/window.py before chunks (the oracle)."""

    def __init__(self, horizon):
        self.horizon, self.frames, self.pending = horizon, {}, {}

    def add(self, stream, df):
        if df.height:
            self.pending.setdefault(stream, []).append(df)

    def seal(self, now):
        for stream, parts in self.pending.items():
            old = self.frames.get(stream)
            frames = ([old] if old is not None and old.height else []) + parts
            self.frames[stream] = pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]
        # Every stream ages on every seal, rows or not (the old layout aged only the streams
        # that got rows: a quiet stream kept rows past its horizon; fixed in both).
        cutoff = now - self.horizon
        for stream, df in self.frames.items():
            if df.height and df["ts"].min() < cutoff:
                self.frames[stream] = df.filter(pl.col("ts") >= cutoff)
        self.pending.clear()


@st.composite
def appends(draw):
    ticks = []
    now = 0.0
    seq = 0
    for _ in range(draw(st.integers(1, 40))):
        now += draw(st.sampled_from([0.5, 1.0, 1.0, 3.0, 20.0]))
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            n = draw(st.sampled_from([0, 1, 3, 40, 20_000]))
            late = draw(st.sampled_from([0.0, 0.0, 2.0, 50.0]))
            wide = draw(st.integers(0, 9)) == 0  # an Int64 column in place of Int32, once in a while
            ts = [now - late * (i % 3) / 2 for i in range(n)]
            vals = list(range(seq, seq + n))
            seq += n
            parts.append(pl.DataFrame({"ts": ts, "v": vals, "tag": [None if i % 5 == 0 else f"r{i % 7}" for i in range(n)]},
                                      schema={"ts": pl.Float64, "v": pl.Int64 if wide else pl.Int32, "tag": pl.Utf8}))  # fmt: skip
        ticks.append((now, parts))
    return ticks, draw(st.sampled_from([5.0, 30.0, 1e9]))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(appends())
def test_chunked_window_returns_what_the_single_frame_window_did(case):
    ticks, horizon = case
    new, old = Window(horizon), OldWindow(horizon)
    for now, parts in ticks:
        for df in parts:
            new.add("s", df)
            old.add("s", df)
        new.seal(now)
        old.seal(now)
        if "s" in old.frames:
            assert_frame_equal(new.get("s"), old.frames["s"], check_dtypes=True)
            assert new.get("s").height == old.frames["s"].height


def test_sparse_stream_stays_in_few_chunks():
    w = Window(3600.0)
    for t in range(1, 2001):
        w.add("events", pl.DataFrame({"ts": [float(t)], "v": [t]}))
        w.seal(float(t))
    assert w.get("events").height == 2000
    assert len(w._chunks["events"]) <= 2
    assert w.get("events")["v"].to_list() == list(range(1, 2001))


def test_a_quiet_stream_still_ages_out():
    """A tick with no rows for a stream must still drop its rows older than the horizon (it
    used to keep them until the stream's next row: straggler's refit then read rows its
    incremental twin had already cut, tests/test_straggler_incremental.py)."""
    w = Window(8.0)
    w.add("rank_progress_like", pl.DataFrame({"ts": [1.0, 4.25, 6.0], "v": [1, 2, 3]}))
    w.seal(6.0)
    assert w.get("rank_progress_like")["v"].to_list() == [1, 2, 3]
    w.seal(12.5)  # no rows this tick: cutoff 4.5
    assert w.get("rank_progress_like")["v"].to_list() == [3]
    w.seal(30.0)
    assert w.get("rank_progress_like").height == 0
    assert w.get("rank_progress_like").columns == ["ts", "v"]
