"""Allocator fragmentation (gpuvigil/detectors/fragmentation_allocator.py): behaviour that the
previous mutation run (71 surviving mutants in `ingest()`, docs/testing.md) showed no fast test
pinned down: state kept tick by tick must give the findings of a fresh evaluation of the same
window (rows leaving the look-back, ingest() and detect() on one tick), and the finding's figures.

Sources:
- constructed: allocator_stats frames built here (each edge placed where the test needs it);
- H200: tests/data/h200/s3_memory_stats_before/after.json, the real allocator statistics around a
  real fragmentation OOM (read as in tests/test_detectors_real.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from gpuvigil import config, schemas
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.window import Window

GIB = 1 << 30
MIB = 1 << 20
CAP = 140 * GIB
H200 = Path(__file__).parent / "data" / "h200"


def big(t):  # a gap growing 100 MiB/s from 6 GiB: past the 4 GiB and 5% floors from the start
    return 6 * GIB + 100 * MIB * t


def det(**over) -> AllocatorFragmentationDetector:
    return AllocatorFragmentationDetector(config.load(overrides={"detectors": {"fragmentation_allocator": {"warmup_seconds": 0.0, "every_seconds": 0.0, **over}}}))


def rows(times, *, rank=1, job="j", gap=lambda t: 2 * GIB + 40 * MIB * t, retries=lambda t: int(t // 50), split_share=0.9, largest_free=512 * MIB) -> pl.DataFrame:
    out = []
    for t in times:
        g = gap(t) + (t * 7 % 5) * 16 * MIB  # not a straight line: a row counted twice or missed shows
        out.append({"ts": float(t), "job": job, "rank": rank, "node": f"n{rank}", "gpu": rank, "allocated_bytes": 60 * GIB, "reserved_bytes": int(100 * GIB + g),
                    "inactive_split_bytes": int(split_share * g), "largest_free_block_bytes": largest_free, "peak_allocated_bytes": 100 * GIB,
                    "alloc_retries": retries(t), "oom_count": 0, "device_capacity_bytes": CAP, "foreign_used_bytes": 0})
    return schemas.frame(out, schemas.ALLOCATOR_STATS)


def test_ticked_state_gives_the_fresh_findings_on_every_tick():
    """constructed: 300 s of a growing gap on two ranks (one starting late), fed every 2 s: rows
    leave the 120 s look-back, retries rise every 50 s. On every tick the detector that kept state
    reports exactly what a fresh detector evaluating the same window reports."""
    df = pl.concat([rows(range(0, 301), rank=1), rows(range(100, 301), rank=2, gap=lambda t: 1 * GIB + 60 * MIB * (t - 100), retries=lambda t: int(t // 30))])
    kept, w, seen = det(), Window(1e9), 0
    for t in range(0, 301, 2):
        w.add("allocator_stats", df.filter((pl.col("ts") > t - 2) & (pl.col("ts") <= t)))
        w.seal(float(t))
        mine, fresh = kept.detect(w), det().detect(w)
        assert [(f.ranks, f.evidence, f.summary) for f in mine] == [(f.ranks, f.evidence, f.summary) for f in fresh], t
        seen += bool(mine)
    assert seen >= 50


def test_ingest_on_ticks_between_evaluations_counts_each_row_once():
    """constructed: the pipeline calls ingest() on ticks the detector is not due and detect() on
    the others (sometimes right after ingest() on the same tick); evaluated every 10 s."""
    df = rows(range(0, 241))
    kept, w = det(every_seconds=10.0), Window(1e9)
    for t in range(0, 241):
        w.add("allocator_stats", df.filter(pl.col("ts") == t))
        w.seal(float(t))
        kept.ingest(w)
        if t % 10 == 0:
            mine, fresh = kept.detect(w), det().detect(w)
            assert [f.evidence for f in mine] == [f.evidence for f in fresh], t
    assert mine and mine[0].evidence["ranks_fragmented"] == 1


def test_finding_figures_on_the_real_fragmentation_oom():
    """H200 s3: reserved 137.79 GiB, 113.29 GiB allocated, 24 GiB of it held in split blocks the
    8 GiB request could not use; one cudaMalloc retry between the two snapshots. Fed once a second
    (empty allocator for 4 s, then the `before` stats, then `after`), evaluated each tick."""
    before = json.loads((H200 / "s3_memory_stats_before.json").read_text())
    after = json.loads((H200 / "s3_memory_stats_after.json").read_text())
    series = [(float(t), {}) for t in range(4)] + [(float(t), before) for t in range(4, 8)] + [(float(t), after) for t in range(8, 12)]
    df = schemas.frame([
        {"ts": ts, "job": "s3", "rank": 0, "node": "h200-0", "gpu": 0, "allocated_bytes": s.get("allocated_bytes.all.current", 0), "reserved_bytes": s.get("reserved_bytes.all.current", 0),
         "inactive_split_bytes": s.get("inactive_split_bytes.all.current", 0), "largest_free_block_bytes": None, "peak_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
         "alloc_retries": s.get("num_alloc_retries", 0), "oom_count": s.get("num_ooms", 0), "device_capacity_bytes": CAP, "foreign_used_bytes": 0}
        for ts, s in series], schemas.ALLOCATOR_STATS)
    d, w, found = det(), Window(1e9), []
    for t in range(12):
        w.add("allocator_stats", df.filter(pl.col("ts") == t))
        w.seal(float(t))
        found.append(d.detect(w))
    first = next(i for i, fs in enumerate(found) if fs)
    [f] = found[first]
    gap = after["reserved_bytes.all.current"] - after["allocated_bytes.all.peak"]
    assert (first, f.kind.value, f.severity.value, f.cause, f.job, f.ranks, f.node, f.gpu) == (8, "fragmentation_allocator", "ticket", "fragmentation", "s3", [0], "h200-0", 0)
    assert f.evidence["reserved_unused_bytes"] == gap
    assert f.evidence["reserved_unused_growth_bytes"] == gap  # from an empty allocator 120 s back
    assert f.evidence["inactive_split_bytes"] == after["inactive_split_bytes.all.current"]
    assert f.evidence["alloc_retries_delta"] == after["num_alloc_retries"] - 0
    # The hook publishes no largest free block here: nothing claimed about it.
    assert (f.evidence["largest_free_block_bytes"], f.evidence["largest_block_below_request"]) == (0, False)
    assert f.summary.startswith(f"s3 rank 0 (h200-0 GPU 0): the caching allocator holds {gap / GIB:.1f} GiB it cannot use (+{gap / GIB:.1f} GiB in 120 s, 1 cudaMalloc retries)")
    assert f.summary.endswith("): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")


def test_worst_rank_first_and_starved_request_in_the_summary():
    """constructed: two ranks fragmenting, rank 2's gap the larger; rank 2's largest free block
    (512 MiB) is below its step's request (peak - allocated = 40 GiB)."""
    df = pl.concat([rows(range(0, 121), rank=1, gap=lambda t: 4 * GIB + 40 * MIB * t), rows(range(0, 121), rank=2, gap=lambda t: 3 * GIB + 60 * MIB * t)])
    [f] = det().detect(_sealed(df, 120.0))
    assert (f.ranks, f.evidence["rank"], f.node, f.gpu, f.evidence["ranks_fragmented"]) == ([1, 2], 2, "n2", 2, 2)
    assert f.evidence["step_request_bytes"] == 40 * GIB and f.evidence["largest_free_block_bytes"] == 512 * MIB
    assert f.evidence["largest_block_below_request"] is True
    assert ", largest free block 0.50 GiB < the step's 40.00 GiB request): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True." in f.summary


def _sealed(df: pl.DataFrame, now: float) -> Window:
    w = Window(1e9)
    w.add("allocator_stats", df)
    w.seal(now)
    return w


def test_a_rank_whose_samples_left_the_lookback_is_not_judged():
    """constructed: rank 1 fragments for 60 s (12 samples) and then its hook stops publishing. Once
    its samples have left the 120 s look-back (fewer than min_samples remain), it is not judged on
    a stale count; the detector that kept state agrees with a fresh one on every tick."""
    df = rows(range(0, 61, 5), gap=big, retries=lambda t: int(t // 20))
    kept, w, out = det(), Window(1e9), {}
    for t in range(0, 241, 5):
        part = df.filter((pl.col("ts") > t - 5) & (pl.col("ts") <= t))
        if part.height:
            w.add("allocator_stats", part)
        w.seal(float(t))
        out[t] = kept.detect(w)
        assert [f.evidence for f in out[t]] == [f.evidence for f in det().detect(w)], t
    assert out[60] and out[150] == [] and out[240] == []


def test_exactly_min_samples_is_enough():
    """constructed: the gap grows over exactly min_samples (8) samples: a ticket; over 7: none."""
    assert len(det().detect(_sealed(rows(range(0, 36, 5), gap=big, retries=lambda t: int(t > 30)), 35.0))) == 1
    assert det().detect(_sealed(rows(range(5, 36, 5), gap=big, retries=lambda t: int(t > 30)), 35.0)) == []


def test_requeued_job_is_rebuilt_and_other_jobs_kept():
    """constructed: jobs a and b fragment; a is requeued at t=150 (its new run's allocator is
    healthy), b carries on. Every tick, the kept state gives the fresh findings; after the requeue
    only b is reported, once."""
    df = pl.concat([rows(range(0, 150), job="a", rank=0), rows(range(150, 241), job="a", rank=0, gap=lambda t: 1 * GIB, retries=lambda t: 0),
                    rows(range(0, 241), job="b", rank=3)])
    kept, w, out = det(), Window(1e9), {}
    for t in range(0, 241, 3):
        w.add("allocator_stats", df.filter((pl.col("ts") > t - 3) & (pl.col("ts") <= t)))
        start = 0.0 if t < 150 else 150.0
        w.add("jobs", schemas.frame([{"job": "a", "state": "running", "n_gpus": 1, "submit_ts": 0.0, "start_ts": start},
                                     {"job": "b", "state": "running", "n_gpus": 1, "submit_ts": 0.0, "start_ts": 0.0}], schemas.JOBS))
        w.seal(float(t))
        out[t] = kept.detect(w)
        assert [(f.job, f.evidence) for f in out[t]] == [(f.job, f.evidence) for f in det().detect(w)], t
    assert [f.job for f in out[147]] == ["a", "b"]  # one finding per job, in job order
    assert [f.job for f in out[240]] == ["b"]


def test_equal_ranks_name_the_lower_rank_and_growth_is_last_minus_first():
    """constructed: ranks 4 and 2 with the same series: the lower rank is named (same input, same
    finding); the growth is the last gap minus the first in the look-back."""
    df = pl.concat([rows(range(0, 121), rank=4, gap=big), rows(range(0, 121), rank=2, gap=big)])
    [f] = det().detect(_sealed(df, 120.0))
    assert (f.evidence["rank"], f.ranks) == (2, [2, 4])
    first, last = df.filter(pl.col("rank") == 2).row(0, named=True), df.filter(pl.col("rank") == 2).row(-1, named=True)
    gap = lambda r: r["reserved_bytes"] - r["peak_allocated_bytes"]  # noqa: E731
    assert f.evidence["reserved_unused_growth_bytes"] == gap(last) - gap(first)


# --- mutation testing: every mutant of fragmentation_allocator.py run; what its survivors showed untested ---


def _flat(gap_last, *, split_share=0.9, capacity=CAP, retries0=0, largest_free=512 * MIB, allocated=60 * GIB):
    """constructed: 9 samples 5 s apart whose gap grows linearly to exactly `gap_last` (no noise),
    retries rising by one from `retries0`."""
    out = []
    for i, t in enumerate(range(0, 41, 5)):
        g = gap_last - (8 - i) * 64 * MIB
        out.append({"ts": float(t), "job": "j", "rank": 1, "node": "n1", "gpu": 1, "allocated_bytes": allocated, "reserved_bytes": 100 * GIB + g,
                    "inactive_split_bytes": int(split_share * g), "largest_free_block_bytes": largest_free, "peak_allocated_bytes": 100 * GIB,
                    "alloc_retries": retries0 + (i == 8), "oom_count": 0, "device_capacity_bytes": capacity, "foreign_used_bytes": 0})
    return schemas.frame(out, schemas.ALLOCATOR_STATS)


def test_a_gap_exactly_at_the_byte_floor_is_a_ticket():
    assert len(det(min_gap_share=0.0).detect(_sealed(_flat(4 * GIB), 40.0))) == 1
    assert det(min_gap_share=0.0).detect(_sealed(_flat(4 * GIB - 1), 40.0)) == []


def test_a_gap_exactly_at_the_device_share_floor_is_a_ticket():
    """1/16 of 140 GiB is 8.75 GiB (binary-exact)."""
    share = {"min_gap_share": 0.0625, "min_gap_bytes": 0}
    assert len(det(**share).detect(_sealed(_flat(8 * GIB + 768 * MIB), 40.0))) == 1
    assert det(**share).detect(_sealed(_flat(8 * GIB + 768 * MIB - 1), 40.0)) == []


def test_split_blocks_exactly_the_minimum_share_of_the_gap_is_a_ticket():
    assert len(det().detect(_sealed(_flat(8 * GIB, split_share=0.5), 40.0))) == 1
    assert det(min_inactive_split_share=0.5000001).detect(_sealed(_flat(8 * GIB, split_share=0.5), 40.0)) == []


def test_retries_are_counted_from_the_oldest_sample_of_the_look_back():
    """The allocator had retried 41 times before the look-back and once within it: a delta of 1."""
    [f] = det().detect(_sealed(_flat(8 * GIB, retries0=41), 40.0))
    assert f.evidence["alloc_retries_delta"] == 1
    assert "1 cudaMalloc retries" in f.summary
    assert det(min_retries=2).detect(_sealed(_flat(8 * GIB, retries0=41), 40.0)) == []


def test_the_summary_gives_the_growth_over_the_look_back():
    """The gap grows 8 x 64 MiB = 0.5 GiB over the look-back to 8 GiB."""
    [f] = det().detect(_sealed(_flat(8 * GIB), 40.0))
    assert f.source == "fragmentation_allocator"
    assert f.evidence["reserved_unused_growth_bytes"] == 512 * MIB
    assert f.summary.startswith("j rank 1 (n1 GPU 1): the caching allocator holds 8.0 GiB it cannot use (+0.5 GiB in 120 s, 1 cudaMalloc retries, ")


def test_a_largest_free_block_equal_to_the_request_is_not_starved():
    """The step's request is peak - allocated = 40 GiB; a free block of exactly 40 GiB serves it."""
    [f] = det().detect(_sealed(_flat(8 * GIB, largest_free=40 * GIB), 40.0))
    assert (f.evidence["step_request_bytes"], f.evidence["largest_block_below_request"]) == (40 * GIB, False)
    assert "largest free block" not in f.summary
    [f] = det().detect(_sealed(_flat(8 * GIB, largest_free=40 * GIB - 1), 40.0))
    assert f.evidence["largest_block_below_request"] is True


def test_a_hook_that_does_not_publish_live_memory_has_no_step_request():
    """allocated_bytes missing (null): no request is claimed (0) and no starvation."""
    [f] = det().detect(_sealed(_flat(8 * GIB, allocated=None), 40.0))
    assert (f.evidence["step_request_bytes"], f.evidence["largest_block_below_request"]) == (0, False)


def test_no_allocator_data_is_no_finding():
    w = Window(1e9)
    w.seal(10.0)
    assert det().detect(w) == []


def test_it_is_evaluated_every_every_seconds_not_sooner():
    """Evaluated at t=0 (no data yet), then at t=5: the fragmentation present from t=2 on is
    reported from t=5, the cached (empty) result before."""
    df = _flat(8 * GIB).with_columns((pl.col("ts") / 20.0).alias("ts"))  # 9 samples at t=0..2
    d, w, first = det(every_seconds=5.0), Window(1e9), None
    for t in range(0, 8):
        w.add("allocator_stats", df.filter((pl.col("ts") > t - 1) & (pl.col("ts") <= t)))
        w.seal(float(t))
        if d.detect(w) and first is None:
            first = t
    assert first == 5


def test_after_a_pause_longer_than_the_history_a_rank_with_no_rows_left_is_not_reported():
    """The pipeline's window keeps allocator_stats for the declared look-back (150 s). serve is
    suspended for 10 minutes after the rank was found fragmented: when it ticks again none of the
    rank's rows are left, and the old finding must not come back from kept state."""
    d = det()
    w = Window(d.lookback_seconds()["allocator_stats"])
    df = _flat(8 * GIB)
    for t in range(0, 41, 5):
        w.add("allocator_stats", df.filter(pl.col("ts") == t))
        w.seal(float(t))
        found = d.detect(w)
    assert found
    w.seal(640.0)
    assert w.get("allocator_stats").height == 0
    assert d.detect(w) == []


def test_a_steady_tick_folds_in_its_new_rows_without_rebuilding(monkeypatch):
    """O(new rows): once the state is built, a tick with new rows (and rows leaving the look-back)
    updates it without reading the window's rows again."""
    import gpuvigil.detectors.fragmentation_allocator as fa

    df = rows(range(0, 200))
    d, w = det(), Window(1e9)
    builds = []
    real = fa._build
    monkeypatch.setattr(fa, "_build", lambda v: builds.append(v.height) or real(v))
    for t in range(0, 200):
        w.add("allocator_stats", df.filter(pl.col("ts") == t))
        w.seal(float(t))
        d.ingest(w)
        d.ingest(w)  # a second call on the same tick changes nothing
    assert builds == [1]
    assert d.detect(w) == det().detect(w) != []


def test_a_rank_that_returns_after_its_rows_left_the_look_back_is_judged_on_its_new_rows():
    """constructed: rank 1 fragments for 60 s, its hook stops for 140 s (every row leaves the
    120 s look-back), then it publishes again with a smaller, growing gap. On every tick the
    detector that kept state reports what a fresh one reports on the same window."""
    df = pl.concat([rows(range(0, 61, 2), gap=big), rows(range(200, 331, 2), gap=lambda t: 5 * GIB + 30 * MIB * (t - 200), retries=lambda t: 3 + int(t // 40))])
    kept, w, seen = det(), Window(1e9), 0
    for t in range(0, 331, 2):
        part = df.filter((pl.col("ts") > t - 2) & (pl.col("ts") <= t))
        if part.height:
            w.add("allocator_stats", part)
        w.seal(float(t))
        mine = kept.detect(w)
        assert [(f.evidence, f.summary) for f in mine] == [(f.evidence, f.summary) for f in det().detect(w)], t
        seen += bool(mine) and t > 200
    assert seen


def test_a_rank_whose_rows_carry_no_gpu_is_reported_without_one():
    """constructed: allocator stats from a hook record without `gpu` (collectors/hook.py leaves it
    null): the ticket names the rank and node with `gpu` None instead of raising on `int(None)`."""
    [f] = det().detect(_sealed(_flat(8 * GIB).with_columns(pl.lit(None, pl.Int32).alias("gpu")), 40.0))
    assert (f.ranks, f.node, f.gpu) == ([1], "n1", None)
    assert f.summary.startswith("j rank 1 (n1): the caching allocator holds")
