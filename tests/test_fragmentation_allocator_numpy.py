"""fragmentation_allocator's per-key numpy state against the from-scratch refit
(tests/incremental_oracles.py: RefitFragmentationAllocator) over the rows the detector was shown
(`Shown`: every row of every tick it saw in turn, or what the window holds after a rebuild):
identical findings (to_json_dict, evidence and summary included) on every tick, for each way the pipeline may call it (detect() every tick; ingest()
every tick and detect() every 3rd; detect() only every k-th tick, which rebuilds from the
window). Scenarios are constructed here (allocator_stats rows and jobs snapshots per tick); a
hypothesis stream mixes them."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples

from gpuvigil import config, schemas
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.window import Window

sys.path.insert(0, str(Path(__file__).parent))
from incremental_oracles import refit_fragmentation_allocator  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
CAP = 140 * GIB

# Small thresholds so that short streams find ranks.
SMALL = {"window_seconds": 30.0, "warmup_seconds": 4.0, "min_samples": 4, "min_gap_bytes": 256 * MIB, "min_gap_share": 0.0, "every_seconds": 0.0}


def cfg(**over):
    return config.load(overrides={"detectors": {"fragmentation_allocator": {**SMALL, **over}}})


def row(ts, job="j", rank=0, *, i=0, leak=64, node=None, gpu=None, nulls=(), retries=None, **over):
    """A rank whose gap grows `leak` MiB a sample, mostly in split blocks, retrying every 3rd."""
    gap = GIB + leak * MIB * i + (i * 7 % 5) * 8 * MIB
    r = {"ts": float(ts), "job": job, "rank": rank, "node": node if node is not None else f"n{rank}", "gpu": gpu if gpu is not None else rank,
         "allocated_bytes": 30 * GIB + (i % 4) * MIB, "reserved_bytes": 40 * GIB + gap, "inactive_split_bytes": int(0.8 * gap),
         "largest_free_block_bytes": 256 * MIB + (i % 3) * 512 * MIB, "peak_allocated_bytes": 40 * GIB, "alloc_retries": i // 3 if retries is None else retries,
         "oom_count": 0, "device_capacity_bytes": CAP, "foreign_used_bytes": None}  # fmt: skip
    r.update(over)
    for c in nulls:
        r[c] = None
    return r


def jobs_frame(starts):
    rows = [{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": s, "n_gpus": 8} for j, s in starts.items()]
    return pl.DataFrame(rows, schema=schemas.JOBS)


def frame(rows):
    return pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS) if rows else schemas.empty("allocator_stats")


def compare(make_cfg, ticks, horizon, label=""):
    """Feed ticks ((now, rows, jobs) each) to pairs (numpy detector, refit oracle) called the same
    way: detect() every tick; ingest() every tick and detect() every 3rd; detect() only every 2nd /
    5th tick with nothing between. Each answer equals its oracle's. Returns the ticks on which the
    every-tick oracle found something."""

    def dicts(fs):
        return [f.to_json_dict() for f in fs]

    def pair():
        return AllocatorFragmentationDetector(make_cfg()), refit_fragmentation_allocator(make_cfg())

    every, ingested, sparse = pair(), pair(), [(k, pair()) for k in (2, 5)]
    w = Window(horizon)
    positives = 0
    for i, (now, rows, jobs) in enumerate(ticks):
        if rows.height:
            w.add("allocator_stats", rows)
        if jobs is not None:
            w.add("jobs", jobs)
        w.seal(now)
        want = dicts(every[1].detect(w))
        positives += bool(want)
        assert dicts(every[0].detect(w)) == want, f"{label}tick {i} at {now} (every tick)"
        if i % 3 == 0:
            assert dicts(ingested[0].detect(w)) == dicts(ingested[1].detect(w)), f"{label}tick {i} at {now} (ingested)"
        else:
            ingested[0].ingest(w)
            ingested[1].ingest(w)
        for k, (new, old) in sparse:
            if i % k == 0:
                assert dicts(new.detect(w)) == dicts(old.detect(w)), f"{label}tick {i} at {now} (every {k})"
    return positives


def steady(n=60, keys=(("a", 0), ("a", 1), ("b", 0)), t0=100.0, dt=1.0, **kw):
    return [(t0 + s * dt, frame([row(t0 + s * dt, j, r, i=s, **kw) for j, r in keys]), jobs_frame({"a": 0.0, "b": 0.0})) for s in range(n)]


def scenario(name):
    """(ticks, horizon) of a named scenario."""
    if name == "leak":
        return steady(), 1e9
    if name == "requeued":
        t = steady(70)
        return [(now, rows, jobs_frame({"a": 0.0 if s < 40 else now - 0.5, "b": 0.0})) for s, (now, rows, _) in enumerate(t)], 1e9
    if name == "job_gone_and_new":
        t = steady(70)
        out = []
        for s, (now, rows, _) in enumerate(t):
            starts = {"a": 0.0} if s >= 30 else {"a": 0.0, "b": 0.0}  # b leaves the snapshot
            if s >= 20:
                rows = pl.concat([rows, frame([row(now, "c", 3, i=s - 20)])])  # c appears, then gets a start
                if s >= 45:
                    starts["c"] = now - 10.0
            out.append((now, rows, jobs_frame(starts)))
        return out, 1e9
    if name == "keys_stop":
        t = steady(80)
        return [(now, rows.filter(~((pl.col("rank") == 1) & (pl.lit(s) >= 25))), j) for s, (now, rows, j) in enumerate(t)], 1e9
    if name == "late_and_out_of_order":
        t = steady(60)
        out = []
        for s, (now, rows, j) in enumerate(t):
            late = frame([row(now - 7.5, "a", 0, i=s - 7), row(now - 0.5, "b", 0, i=s, leak=80)]) if s % 4 == 0 else frame([])
            out.append((now, pl.concat([rows.reverse(), late]), j))
        return out, 1e9
    if name == "equal_ts_and_duplicates":
        t = steady(50)
        return [(now, pl.concat([rows, rows, rows.with_columns(pl.col("reserved_bytes") + GIB)]), j) for now, rows, j in t], 1e9
    if name == "resent":
        # each tick resends the previous tick's rows with other values: same ts as the key's newest,
        # the later arrival is the newest (and the oldest stays the earlier arrival)
        t = steady(50)
        out = [t[0]]
        for s, ((now, rows, j), (_, prev, _)) in enumerate(zip(t[1:], t[:-1])):
            again = prev.with_columns(pl.col("reserved_bytes") + 2 * GIB, pl.col("inactive_split_bytes") + GIB)
            out.append((now, again if s % 4 == 0 else pl.concat([again, rows]), j))  # every 4th tick: only the resent rows
        return out, 1e9
    if name == "missed_and_jump":
        t = steady(90)
        # a gap of 3 ticks, then a jump longer than the look-back (and than the horizon)
        t = [x for s, x in enumerate(t) if not 20 <= s < 23]
        t = [(now + (200.0 if s >= 50 else 0.0), rows.with_columns(pl.col("ts") + (200.0 if s >= 50 else 0.0)), j) for s, (now, rows, j) in enumerate(t)]
        return t, 45.0
    if name == "nulls":
        keys = (("a", 0), ("a", 1), ("b", 0))
        out = []
        for s in range(60):
            now = 100.0 + s
            nulls = [(), ("largest_free_block_bytes",), ("gpu", "allocated_bytes"), ("alloc_retries",), ("reserved_bytes",), ("device_capacity_bytes",)][s % 6]
            out.append((now, frame([row(now, j, r, i=s, nulls=nulls if r == 1 else ("largest_free_block_bytes",) if j == "b" else ()) for j, r in keys]), jobs_frame({"a": 0.0, "b": None})))
        return out, 1e9
    if name == "request_once_a_block":
        # rank a/0's step request (peak - allocated) is known only at each 5 s block's first row
        # (allocated_bytes null after it): a block's max request stays that first row's
        keys = (("a", 0), ("a", 1), ("b", 0))
        out = []
        for s in range(60):
            now = 100.0 + s
            rows = [row(now, j, r, i=s, allocated_bytes=30 * GIB - s * MIB, nulls=("allocated_bytes",) if (j, r) == ("a", 0) and s % 5 else ()) for j, r in keys]
            out.append((now, frame(rows), jobs_frame({"a": 0.0, "b": 0.0})))
        return out, 1e9
    if name == "moves":
        out = []
        for s in range(60):
            now = 100.0 + s
            out.append((now, frame([row(now, "a", 0, i=s, node="n9" if s >= 30 else "n0", gpu=7 if s >= 30 else 0), row(now, "a", 1, i=s)]), jobs_frame({"a": 0.0})))
        return out, 1e9
    if name == "no_jobs_snapshot":
        return [(now, rows, None) for now, rows, _ in steady(40)], 1e9
    if name == "sub_second":
        return steady(80, dt=0.25), 1e9
    raise KeyError(name)


NAMES = ["leak", "resent", "request_once_a_block", "requeued", "job_gone_and_new", "keys_stop", "late_and_out_of_order", "equal_ts_and_duplicates", "missed_and_jump", "nulls", "moves", "no_jobs_snapshot", "sub_second"]


@pytest.mark.parametrize("declared", [False, True])
@pytest.mark.parametrize("blocks", [6, 0])
@pytest.mark.parametrize("name", NAMES)
def test_scenario_equals_the_refit(name, blocks, declared):
    """`declared`: the window keeps only the history the detector declares (as the pipeline's)."""
    ticks, horizon = scenario(name)
    make = lambda: cfg(lookback_blocks=blocks, block_slack_seconds=3.0)  # noqa: E731
    if declared:
        horizon = min(horizon, AllocatorFragmentationDetector(make()).lookback_seconds()["allocator_stats"])
    positives = compare(make, ticks, horizon, f"{name} blocks={blocks}: ")
    if name != "no_jobs_snapshot" and not (name == "missed_and_jump" and blocks == 0 and declared):
        assert positives > 0, name


def test_default_config_every_five_seconds():
    """Default thresholds, evaluated every 5 s: the leak is found by both, on the same ticks."""
    ticks = []
    for s in range(200):
        now = 1_700_000_000.0 + s
        ticks.append((now, frame([row(now, "big", r, i=s, leak=48 + 16 * r) for r in range(3)]), jobs_frame({"big": 1_700_000_000.0 - 60})))
    make = lambda: config.load(overrides={"detectors": {"fragmentation_allocator": {"min_samples": 8}}})  # noqa: E731
    assert compare(make, ticks, 1e9) > 50


@st.composite
def streams(draw):
    t0 = draw(st.sampled_from([0.0, 1000.0, 1_700_000_000.0]))
    n = draw(st.integers(15, 60))
    keys = [(j, r) for j in ("a", "b") for r in range(draw(st.integers(1, 3)))]
    leak = {k: draw(st.sampled_from([0, 16, 64, 256])) for k in keys}
    starts = {"a": draw(st.sampled_from([None, t0 - 50.0, t0 + 3.0])), "b": t0 - 50.0}
    ticks, now = [], t0
    for s in range(n):
        now += draw(st.sampled_from([0.25, 1.0, 1.0, 2.0, 5.0, 40.0]))
        if draw(st.integers(0, 19)) == 0:
            starts["a"] = draw(st.sampled_from([None, now - 0.5]))  # requeued, or gone from the snapshot
        rows = []
        for k in keys:
            if draw(st.integers(0, 9)) == 0:
                continue  # this rank sent nothing this tick
            for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):
                ts = now - draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 3.0, 12.0]))
                nulls = draw(st.sampled_from([(), (), (), ("largest_free_block_bytes",), ("alloc_retries",), ("allocated_bytes", "gpu"), ("reserved_bytes",)]))
                rows.append(row(ts, k[0], k[1], i=s, leak=leak[k], nulls=nulls, node=draw(st.sampled_from([f"n{k[1]}", f"n{k[1]}", "m"]))))
        if draw(st.booleans()):
            rows.reverse()
        ticks.append((now, frame(rows), jobs_frame({j: v for j, v in starts.items() if v is not None})))
    return ticks, draw(st.sampled_from([1e9, 60.0, 8.0])), draw(st.sampled_from([0, 3, 6]))


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(streams())
def test_hypothesis_stream_equals_the_refit(stream):
    ticks, horizon, blocks = stream
    compare(lambda: cfg(lookback_blocks=blocks, block_slack_seconds=3.0), ticks, horizon)


def test_state_is_numpy_and_forgets_keys_that_left():
    """The per-key state is int64 arrays (bytes stay exact), and keys whose rows all left the
    look-back are compacted away once they outnumber the live ones."""
    det = AllocatorFragmentationDetector(cfg(lookback_blocks=6, block_slack_seconds=3.0))
    w = Window(40.0)
    for s in range(120):
        now = 100.0 + s
        # every 10 s a new job of 300 ranks replaces the previous one
        w.add("allocator_stats", frame([row(now, f"j{s // 10}", r, i=s) for r in range(300)]))
        w.seal(now)
        det.ingest(w)
    assert det.i["gap"].dtype.name == "int64" and det.bi["req"].dtype.name == "int64"
    assert det.keys.n <= 3 * 1024
    assert det._state.height == det._state.select("job", "rank").unique().height
