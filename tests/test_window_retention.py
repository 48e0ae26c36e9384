"""Thinned history (memory at 100,000 GPUs): `Window.retain` keeps a stream's rows older
than `recent_seconds` only for some keys, and straggler declares which (pipeline/core.py:
declared_retention): rank rows older than window_seconds + history_slack_seconds only for jobs
with a long step in the look-back, the only jobs it judges over more than window_seconds.

Data: constructed rank-progress rows (three 8-rank jobs with 0.5 s, 1.3 s and 9 s steps, one slow
rank each, as in tests/test_straggler_incremental.py) and a job whose steps become long mid-run.
"""

from __future__ import annotations

import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples

from gpuvigil import config, schemas
from gpuvigil.pipeline.levels import LevelSelector
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.detectors.oom_device import DeviceOomPredictor
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.detectors.straggler_device import DeviceStragglerDetector
from gpuvigil.pipeline.core import Pipeline, declared_retention
from gpuvigil.window import Window


def _row(ts, job, rank, step, wait):
    return {"ts": ts, "job": job, "rank": rank, "node": f"node-{job}-{rank // 4}", "gpu": rank % 4, "pg": "0", "last_enqueued_seq": 1,
            "last_completed_seq": 1, "current_op": None, "step": 1, "step_time_seconds": step, "collective_wait_seconds": wait}  # fmt: skip


def _jobs(names):
    rows = [{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": 1000.0, "n_gpus": 8} for j in names]
    return pl.DataFrame(rows, schema=schemas.JOBS)


def _ticks(n=260, long_from=None):
    """Jobs short (0.5 s steps), mid (1.3 s), long (9 s; judged over 72 s, by the refit); with
    `long_from`, job `turns` steps 1 s until that tick and 9 s after. One slow rank each."""
    jobs = [("short", 0.5, 3), ("mid", 1.3, 5), ("long", 9.0, 1)] + ([("turns", None, 2)] if long_from is not None else [])
    out = []
    for i in range(1, n):
        now = 2000.0 + i
        rows = []
        for job, step, slow in jobs:
            if step is None:
                step = 1.0 if i < long_from else 9.0
            for r in range(8):
                jitter = ((i * 31 + r * 7) % 11) * 0.003
                rows.append(_row(now - (r % 3) * 0.1, job, r, step + jitter, (0.04 if r == slow and i > 40 else 0.3) * step + jitter))
        out.append((now, pl.DataFrame(rows, schema=schemas.RANK_PROGRESS), _jobs([j for j, _, _ in jobs])))
    return out


def _run(ticks, retain, cfg=None):
    """Feed the ticks as the pipeline does: seal, detect every 5th tick and ingest between, then
    the retention the detector declares (from the next seal on). Returns the findings per
    detect and the window."""
    cfg = cfg or config.defaults()
    det, w = StragglerDetector(cfg), Window(180.0)
    found = []
    for i, (now, rows, jobs) in enumerate(ticks):
        w.add("rank_progress", rows)
        w.add("jobs", jobs)
        w.seal(now)
        if i % 5 == 0:
            found.append([f.to_json_dict() for f in det.detect(w)])
        else:
            det.ingest(w)
        if retain:
            w.retain("rank_progress", *det.window_retention()["rank_progress"])
    return found, w


def test_thinned_history_gives_the_same_findings_and_keeps_old_rows_only_for_long_step_jobs():
    ticks = _ticks()
    whole, w_whole = _run(ticks, retain=False)
    thin, w_thin = _run(ticks, retain=True)
    assert thin == whole
    # Findings were raised, the long-step job's among them (judged over 72 s, from the window).
    assert sum(bool(f) for f in whole) > 30
    assert {f["job"] for f in whole[-1]} == {"short", "mid", "long"}
    now = ticks[-1][0]
    old = w_thin.get("rank_progress").filter(pl.col("ts") < now - 65.0)
    assert old["job"].unique().to_list() == ["long"]
    assert old.height == w_whole.get("rank_progress").filter((pl.col("ts") < now - 65.0) & (pl.col("job") == "long")).height
    # Every job's last 65 s are whole (the rings' rebuild and the fast path read 60 s).
    recent = lambda w: w.get("rank_progress").filter(pl.col("ts") >= now - 65.0).sort("ts", "job", "rank")  # noqa: E731
    assert recent(w_thin).equals(recent(w_whole))
    # 180 s of the long job, 65 s of the two others: 8 x (180 + 2 x 65) of 8 x 3 x 180 rows.
    assert w_thin.get("rank_progress").height < 0.6 * w_whole.get("rank_progress").height


def test_a_rebuilt_detector_on_the_thinned_window_gives_the_same_findings():
    """A detector that starts on the thinned window (a replica taking over, a gap in ticks)
    rebuilds its rings and counts from it: the same findings as on the whole window."""
    ticks = _ticks()
    _, w_thin = _run(ticks, retain=True)
    _, w_whole = _run(ticks, retain=False)
    a = [f.to_json_dict() for f in StragglerDetector(config.defaults()).detect(w_thin)]
    b = [f.to_json_dict() for f in StragglerDetector(config.defaults()).detect(w_whole)]
    assert a == b and len(a) == 3


def test_a_job_whose_steps_turn_long_keeps_its_rows_from_its_first_long_step():
    """The documented limit: a job's older rows were thinned while its steps were short; from its
    first long step on, the window keeps them for the whole look-back again."""
    ticks = _ticks(long_from=150)
    _, w = _run(ticks, retain=True)
    _, whole = _run(ticks, retain=False)
    turns = w.get("rank_progress").filter(pl.col("job") == "turns")
    first_long = 2000.0 + 150
    # Rows kept from 65 s (window_seconds + slack) before the first long step was seen ...
    assert first_long - 65.0 - 1.0 <= turns["ts"].min() <= first_long - 60.0
    # ... and none of them thinned since: every row from then on is still there.
    since = pl.col("ts") >= first_long - 64.0
    assert turns.filter(since).sort("ts", "rank").equals(whole.get("rank_progress").filter(since & (pl.col("job") == "turns")).sort("ts", "rank"))
    assert turns.filter(since).height >= 8 * (ticks[-1][0] - first_long + 64)


def test_window_retain_keeps_old_rows_of_kept_keys_and_every_recent_row():
    w = Window(100.0)
    keep = pl.DataFrame({"job": ["a"]})
    for t in range(1, 21):
        w.add("rank_progress", pl.DataFrame([_row(float(t), j, 0, 1.0, 0.3) for j in ("a", "b", None)], schema=schemas.RANK_PROGRESS))
        w.seal(float(t))
        w.retain("rank_progress", 5.0, keep)
    df = w.get("rank_progress")
    # Sealed more than 5 s ago: only job a; the last 5 s (sealed at 16..20): every job.
    assert df.filter(pl.col("ts") < 15.0)["job"].unique().to_list() == ["a"]
    assert df.filter(pl.col("ts") >= 15.0).height == 3 * 6
    assert df.height == 14 + 18
    # A null key is kept when the keys hold a null.
    w.retain("rank_progress", 5.0, pl.DataFrame({"job": [None]}, schema={"job": pl.Utf8}))
    for t in range(21, 24):
        w.add("rank_progress", pl.DataFrame([_row(float(t), j, 0, 1.0, 0.3) for j in ("a", "b", None)], schema=schemas.RANK_PROGRESS))
        w.seal(float(t))
    thinned = w.get("rank_progress").filter(pl.col("ts").is_between(15.0, 18.0, closed="left"))
    assert thinned["job"].to_list() == [None, None, None]
    # Lifted: nothing more is thinned (rows thinned before do not come back).
    w.retain("rank_progress", 5.0, None)
    for t in range(24, 40):
        w.add("rank_progress", pl.DataFrame([_row(float(t), j, 0, 1.0, 0.3) for j in ("a", "b", None)], schema=schemas.RANK_PROGRESS))
        w.seal(float(t))
    assert w.get("rank_progress").filter(pl.col("ts") >= 18.0).height == 3 * (39 - 18 + 1)
    assert w.get("rank_progress").filter(pl.col("ts") < 15.0).height == 14


def test_window_retain_ages_a_stream_without_new_rows_and_leaves_other_streams():
    w = Window(100.0)
    for t in range(1, 4):
        w.add("rank_progress", pl.DataFrame([_row(float(t), j, 0, 1.0, 0.3) for j in ("a", "b")], schema=schemas.RANK_PROGRESS))
        w.add("allocator_stats", schemas.conform(pl.DataFrame({"ts": [float(t)], "job": ["b"], "rank": [0]}), schemas.ALLOCATOR_STATS, stream="allocator_stats"))
        w.seal(float(t))
    w.retain("rank_progress", 5.0, pl.DataFrame({"job": ["a"]}))
    for t in range(4, 12):
        w.seal(float(t))  # no new rows: the old ones still age and are thinned
    assert w.get("rank_progress")["job"].to_list() == ["a", "a", "a"]
    assert w.get("allocator_stats").height == 3


def test_declared_retention_only_where_every_history_reader_declares_it():
    cfg = config.defaults()
    strag = StragglerDetector(cfg)
    strag.streams = ("rank_progress",)

    class Fresh:
        name, streams = "fresh", ("rank_progress",)

        def lookback_seconds(self):
            return {"rank_progress": 0.0}

    class History:
        name, streams = "history", ("rank_progress",)

    rule = declared_retention([strag, Fresh()])["rank_progress"]
    assert rule is not None and rule[0] == 65.0 and rule[1].columns == ["job"]
    assert declared_retention([strag, History()])["rank_progress"] is None  # another reader of its history
    assert declared_retention([strag], needed=lambda d: False)["rank_progress"] is None  # not running: its keys are stale
    off = StragglerDetector({**cfg, "detectors": {**cfg["detectors"], "straggler": {**cfg["detectors"]["straggler"], "history_slack_seconds": None}}})
    assert declared_retention([off])["rank_progress"] is None
    slack = StragglerDetector({**cfg, "detectors": {**cfg["detectors"], "straggler": {**cfg["detectors"]["straggler"], "history_slack_seconds": 12.0}}})
    assert declared_retention([slack])["rank_progress"][0] == 72.0


def test_declared_retention_of_gpu_samples_is_the_union_of_both_l0_readers():
    """oom_device and straggler_device both read gpu_samples' history, each for the GPUs a
    resolver names: the stream keeps the union, the longest recent span; without a resolver, or
    if one reader does not declare, nothing is thinned."""
    cfg = config.defaults()
    oom, strag = DeviceOomPredictor(cfg), DeviceStragglerDetector(cfg)
    named = {"oom_device": [("n1", 0), ("n1", 1)], "straggler_device": [("n1", 1), ("n2", 0)]}

    def resolve(d, stream, name):
        assert (stream, name) == ("gpu_samples", "allocated")
        return pl.DataFrame(named[d.name], schema={"node": pl.Utf8, "gpu": pl.Int32}, orient="row")

    recent, keys = declared_retention([oom, strag], resolve=resolve)["gpu_samples"]
    assert recent == 10.0
    assert sorted(keys.rows()) == [("n1", 0), ("n1", 1), ("n2", 0)]
    assert declared_retention([oom, strag])["gpu_samples"] is None
    off = DeviceOomPredictor({**cfg, "detectors": {**cfg["detectors"], "oom_device": {**cfg["detectors"]["oom_device"], "history_recent_seconds": None}}})
    assert declared_retention([off, strag], resolve=resolve)["gpu_samples"] is None
    strag_off = DeviceStragglerDetector({**cfg, "detectors": {**cfg["detectors"], "straggler_device": {**cfg["detectors"]["straggler_device"], "history_recent_seconds": None}}})
    assert strag_off.window_retention() == {}
    assert declared_retention([oom, strag_off], resolve=resolve)["gpu_samples"] is None


def test_jobs_selecting_names_the_jobs_an_l0_detector_is_or_will_be_selected_for():
    """An L2 job (allocator rows seen) is not the L0 OOM detector's until its rows age out of
    memory_seconds (900 s); within the detector's look-back of that it is again."""
    oom_l0, oom_l2 = DeviceOomPredictor(config.defaults()), OomPredictor(config.defaults())
    levels = LevelSelector([oom_l0, oom_l2], memory_seconds=900.0, side_by_side=("L2.hang",))
    w = Window(600.0)
    w.add("allocator_stats", schemas.conform(pl.DataFrame({"ts": [1000.0], "job": ["hooked"], "rank": [0]}), schemas.ALLOCATOR_STATS, stream="allocator_stats"))
    w.add("allocations", schemas.frame([{"job": j, "rank": 0, "node": "n1", "gpu": g} for g, j in enumerate(("hooked", "plain"))], schemas.ALLOCATIONS))
    w.seal(1000.0)
    levels.observe(w)
    assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == {"plain"}
    assert levels.jobs_selecting(oom_l2, ["hooked", "plain"], 110.0) == {"hooked", "plain"}  # a higher level is never hidden
    for now, want in ((1000.0 + 900 - 110 - 1, {"plain"}), (1000.0 + 900 - 110 + 1, {"hooked", "plain"})):
        w.seal(now)
        levels.observe(w)
        assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == want
    # An L1 job (NCCL Inspector rows) falls back to L0 after fallback_seconds: selected.
    w.add("collective_progress", pl.DataFrame({"ts": [2000.0], "job": ["inspected"]}))
    w.seal(2000.0)
    levels.observe(w)
    assert "inspected" in levels.jobs_selecting(oom_l0, ["inspected"], 110.0)


def test_the_pipeline_thins_rank_progress_for_short_step_jobs():
    """The pipeline applies straggler's retention after each tick: with the shipped config, rank
    rows older than 65 s are kept only for the job with long steps."""
    ticks = _ticks(n=120)

    class Feed:
        name, streams, errors = "feed", {}, 0

        def __init__(self):
            self.i = 0

        def collect(self, now):
            _, rows, jobs = ticks[self.i]
            self.i += 1
            return {"rank_progress": rows, "jobs": jobs}

    p = Pipeline([Feed()], [StragglerDetector(config.defaults())], cfg=config.defaults())
    for now, _, _ in ticks:
        p.tick(now)
    df = p.window.get("rank_progress")
    old = df.filter(pl.col("ts") < ticks[-1][0] - 65.0)
    assert old.height > 0 and old["job"].unique().to_list() == ["long"]
    assert df.filter(pl.col("ts") >= ticks[-1][0] - 65.0)["job"].n_unique() == 3


GIB = 1 << 30


def _device_ticks(seconds=200):
    """Two 2-GPU jobs whose rank 1 adds a 1 GiB segment every 4 s (an OOM on its way); `hooked`
    also reports allocator rows (L2 for OOM: its findings are the allocator-level detector's),
    `plain` does not (L0: the device-level detector's)."""
    alloc = schemas.frame(
        [{"job": j, "rank": r, "node": n, "gpu": r} for j, n in (("hooked", "n1"), ("plain", "n2")) for r in (0, 1)], schemas.ALLOCATIONS
    )
    out = []
    for t in range(1, seconds + 1):
        used = {0: 40 * GIB, 1: 40 * GIB + (t // 4) * GIB}
        gs = schemas.frame(
            [{"ts": float(t), "node": n, "gpu": g, "memory_used_bytes": used[g], "memory_total_bytes": 150_754_820_096, "memory_reserved_bytes": 644_939_776} for n in ("n1", "n2") for g in (0, 1)],
            schemas.GPU_SAMPLES,
        )
        al = schemas.conform(
            pl.DataFrame({"ts": [float(t)] * 2, "job": ["hooked"] * 2, "rank": [0, 1], "node": ["n1"] * 2, "gpu": [0, 1], "allocated_bytes": [used[0], used[1]], "reserved_bytes": [used[0], used[1]]}),
            schemas.ALLOCATOR_STATS,
            stream="allocator_stats",
        )
        out.append((float(t), {"gpu_samples": gs, "allocations": alloc, "allocator_stats": al}))
    return out


def _device_pipeline(recent):
    cfg = config.defaults()
    # The hook's OOM findings alone for a hooked job (no side-by-side OOM): the device detector's
    # history is thinned to the jobs whose OOM findings it gives.
    cfg = {**cfg, "detectors": {**cfg["detectors"], "oom_device": {**cfg["detectors"]["oom_device"], "history_recent_seconds": recent}},
           "levels": {**cfg["levels"], "side_by_side": ["L2.hang"]}}
    ticks = _device_ticks()

    class Feed:
        name, streams, errors = "feed", {}, 0

        def __init__(self):
            self.i = 0

        def collect(self, now):
            frames = ticks[self.i][1]
            self.i += 1
            return frames

    p = Pipeline([Feed()], [DeviceOomPredictor(cfg), OomPredictor(cfg)], cfg=cfg)
    found = []
    for now, _ in ticks:
        r = p.tick(now)
        row = lambda f: (f.source, f.job, f.kind.value, f.severity.value, f.evidence.get("time_to_oom_seconds"))  # noqa: E731
        found.append((sorted(map(row, r.new_findings)), sorted(map(row, r.suppressed_findings))))
    return found, p.window


def test_gpu_samples_history_is_kept_for_the_gpus_of_l0_jobs_with_the_same_findings():
    thin, w = _device_pipeline(10.0)
    whole, w_whole = _device_pipeline(None)
    # The findings reported are the same on every tick, the L0 job's OOM (from device memory)
    # among them.
    assert [new for new, _ in thin] == [new for new, _ in whole]
    assert ("oom_device", "plain") in {f[:2] for new, _ in whole for f in new}
    # What changes: the device-level detector no longer fits the L2 job's GPUs, so its finding
    # for that job, which the level selection suppressed (and no sink reads: fr_dumps reads only
    # suppressed L0 hang findings), is not made.
    assert any(("oom_device", "hooked") == f[:2] for _, sup in whole for f in sup)
    assert not any(("oom_device", "hooked") == f[:2] for _, sup in thin for f in sup)
    assert all(set(a) <= set(b) for (_, a), (_, b) in zip(thin, whole, strict=True))
    old = w.get("gpu_samples").filter(pl.col("ts") < 200.0 - 10.0)
    assert old.height > 0 and old["node"].unique().to_list() == ["n2"]
    assert w_whole.get("gpu_samples").filter(pl.col("ts") < 200.0 - 10.0)["node"].n_unique() == 2
    assert w.get("gpu_samples").filter(pl.col("ts") >= 200.0 - 10.0).height == 4 * 11


def test_latest_still_has_a_thinned_key_that_went_silent():
    """The exporter's per-GPU series come from `latest`: a GPU whose older rows were thinned and
    that stopped reporting keeps its newest row until it leaves the horizon, as before."""
    w = Window(100.0, columns={"gpu_samples": ["memory_used_bytes"]})
    w.retain("gpu_samples", 5.0, pl.DataFrame({"node": ["n1"], "gpu": [0]}, schema={"node": pl.Utf8, "gpu": pl.Int32}))
    for t in range(1, 21):
        gpus = [("n1", 0)] + ([("n2", 0)] if t <= 8 else [])
        w.add("gpu_samples", schemas.frame([{"ts": float(t), "node": n, "gpu": g, "memory_used_bytes": t} for n, g in gpus], schemas.GPU_SAMPLES))
        w.seal(float(t))
    assert w.get("gpu_samples")["node"].unique().to_list() == ["n1"]  # n2's rows were thinned
    latest = w.latest("gpu_samples", ["node", "gpu"])
    assert latest.select("node", "gpu", "ts", "memory_used_bytes").rows() == [("n2", 0, 8.0, 8), ("n1", 0, 20.0, 20)]
    assert "power_w" in latest.columns  # every column of the newest row


def test_the_pipeline_benchmark_warms_up_to_the_longest_per_key_history():
    """`gpuvigil bench pipeline` measures the steady state: its default warm-up lasts until the
    longest history of gpu_samples, rank_progress and allocator_stats is full (at least 90 s)."""
    from benchmarks.pipeline import steady_warmup_ticks

    w = Window({"default": 600.0, "events": 3600.0, "gpu_samples": 110.0, "rank_progress": 180.0, "allocator_stats": 30.0})
    assert steady_warmup_ticks(w, 1.0) == 180
    assert steady_warmup_ticks(w, 2.0) == 90
    assert steady_warmup_ticks(Window({"default": 600.0, "gpu_samples": 10.0, "rank_progress": 65.0, "allocator_stats": 30.0}), 1.0) == 90


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ticks=st.lists(
        st.lists(st.tuples(st.sampled_from(["a", "b", "c", None]), st.integers(0, 3), st.sampled_from([0.0, 0.0, 0.4, 2.0, 9.0])), max_size=6),
        min_size=1,
        max_size=40,
    ),
    keep=st.sets(st.sampled_from(["a", "b", "c", None])),
    recent=st.sampled_from([0.0, 1.0, 3.0, 7.5]),
    horizon=st.sampled_from([5.0, 12.0, 100.0]),
    on=st.sampled_from([["job"], ["job", "rank"]]),
)
def test_a_thinned_window_is_the_whole_window_less_the_old_rows_of_other_keys(ticks, keep, recent, horizon, on):
    """With the same keys kept throughout, after every seal the thinned window holds exactly the
    whole window's rows that are newer than now - recent or whose key is kept, whatever the
    late rows, the empty ticks, the merging of small chunks and the horizon (one key column or
    two)."""
    keys = pl.DataFrame({"job": sorted(keep, key=str), "rank": [0] * len(keep)}, schema={"job": pl.Utf8, "rank": pl.Int32}).select(on)
    thin, whole = Window(horizon), Window(horizon)
    for i, rows in enumerate(ticks):
        now = 100.0 + i
        if rows:
            df = pl.DataFrame([_row(now - late, job, rank, 1.0, 0.3) for job, rank, late in rows], schema=schemas.RANK_PROGRESS)
            thin.add("rank_progress", df)
            whole.add("rank_progress", df)
        thin.seal(now)
        whole.seal(now)
        thin.retain("rank_progress", recent, keys)
        kept = pl.col(on[0]).is_in(keys[on[0]].implode(), nulls_equal=True) if on == ["job"] else pl.struct(on).is_in(keys.select(pl.struct(on)).to_series().implode(), nulls_equal=True)
        if i == 0:
            continue  # the rule applies from the next seal
        want = whole.get("rank_progress").filter((pl.col("ts") >= now - recent) | kept)
        got = thin.get("rank_progress")
        order = ["ts", "job", "rank"]
        assert got.sort(order, nulls_last=True).equals(want.sort(order, nulls_last=True)), f"tick {i}"


# Mutation testing of the retention code (docs/testing.md): jobs_selecting's edges.


def _selector_with(detectors, fallback=None):
    """A LevelSelector over `detectors` after one tick at t=1000 in which job `hooked` sent an
    allocator row (L2) and jobs `hooked` and `plain` were allocated a GPU each."""
    levels = LevelSelector(detectors, memory_seconds=900.0, fallback_seconds=fallback, side_by_side=("L2.hang",))
    w = Window(600.0)
    w.add("allocator_stats", schemas.conform(pl.DataFrame({"ts": [1000.0], "job": ["hooked"], "rank": [0]}), schemas.ALLOCATOR_STATS, stream="allocator_stats"))
    w.add("allocations", schemas.frame([{"job": j, "rank": 0, "node": "n1", "gpu": g} for g, j in enumerate(("hooked", "plain"))], schemas.ALLOCATIONS))
    w.seal(1000.0)
    levels.observe(w)
    return levels, w


def test_an_l2_job_is_selected_for_the_l0_detector_from_exactly_its_look_back_before_it_falls_to_l0():
    """The hook's row at t=1000 marks `hooked` L2 until t=1900 (memory_seconds 900, inclusive);
    the L0 detector's 110 s look-back must hold its rows from after t=1790. At exactly t=1790
    the job is not yet the L0 detector's; a second later it is."""
    oom_l0, oom_l2 = DeviceOomPredictor(config.defaults()), OomPredictor(config.defaults())
    levels, w = _selector_with([oom_l0, oom_l2])
    for now, want in ((1790.0, {"plain"}), (1791.0, {"hooked", "plain"})):
        w.seal(now)
        levels.observe(w)
        assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == want, now


def test_a_detector_without_a_capability_needs_every_job():
    """A detector that declares no capability (or has no such attribute) is never filtered by
    level, so its history is kept for every job."""

    class NoCapability:
        level = "L0"

    levels, _ = _selector_with([DeviceOomPredictor(config.defaults())])
    assert levels.jobs_selecting(NoCapability(), ["hooked", "plain"], 110.0) == {"hooked", "plain"}


def test_with_only_the_hook_detector_of_a_capability_every_job_is_its_own():
    """Only the L2 OOM detector is registered: a job without hook rows has no detector of its own
    for OOM but the L2 one (the best level defaults to L0, and L2 findings are never hidden), so
    both jobs are selected."""
    oom_l2 = OomPredictor(config.defaults())
    levels, _ = _selector_with([oom_l2])
    assert levels.jobs_selecting(oom_l2, ["hooked", "plain"], 110.0) == {"hooked", "plain"}


def test_a_selector_that_knows_no_detector_of_the_capability_selects_every_job():
    oom_l0 = DeviceOomPredictor(config.defaults())
    levels, _ = _selector_with([])
    assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == {"hooked", "plain"}


def test_a_higher_level_detector_that_declares_no_streams_is_never_available():
    """An L2 detector of the capability without `streams` is never a job's (as in `_best_for_streams`):
    the hooked job is still the L0 detector's."""

    class NoStreams:
        capability, level, name = "oom", "L2", "no_streams"

    oom_l0 = DeviceOomPredictor(config.defaults())
    levels, _ = _selector_with([oom_l0, NoStreams()])
    assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == {"hooked", "plain"}


def test_an_l2_job_whose_oom_falls_back_keeps_its_device_history():
    """With `L2.oom` given a fallback, an L2 job's L0 OOM findings may go out (after the
    fallback): the L0 detector needs the job's history now, not only once the hook goes quiet."""
    oom_l0, oom_l2 = DeviceOomPredictor(config.defaults()), OomPredictor(config.defaults())
    levels, _ = _selector_with([oom_l0, oom_l2], fallback={"L1": 60.0, "L2.oom": 30.0})
    assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == {"hooked", "plain"}
    levels, _ = _selector_with([oom_l0, oom_l2], fallback={"L1": 60.0, "L2.hang": 30.0})
    assert levels.jobs_selecting(oom_l0, ["hooked", "plain"], 110.0) == {"plain"}
