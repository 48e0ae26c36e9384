"""Level selector (gpuvigil/detectors/levels.py): behaviour that mutation testing (`make mutate`,
docs/testing.md) showed no other test pinned down: the built-in fallback times (60 s for L1,
30 s for an L2 hang) exactly at their edge, which lower-level detector must keep running, a
selector asked before its first tick, and the memory of streams when many jobs report.

Source: constructed stream frames and findings, as in tests/test_levels.py (the selector reads
only which job showed which stream and when).
"""

from __future__ import annotations

from levels_helpers import allocations, window
from test_levels import NODE8, _finding

from gpuvigil import config, schemas
from gpuvigil.detectors.levels import LevelSelector
from gpuvigil.detectors.registry import default_detectors


def _tick(sel, now, stream, jobs=("j",), allocated=("j",)):
    w = window()
    for j in allocated:
        w.add("allocations", allocations(j, NODE8))
    w.add(stream, schemas.frame([{"ts": now, "job": j, "rank": 0} for j in jobs], stream))
    w.seal(now)
    sel.observe(w)


def _fallback_tick(stream, seconds):
    """The first tick (of one a second from t=10) on which the L0 hang finding goes out for a job
    of `stream`'s level, with the selector's built-in fallback times (no argument given)."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets)
    for now in range(10, 10 + seconds + 5):
        _tick(sel, float(now), stream)
        kept, _ = sel.select(by["hang_device"], [_finding("j", "hang_device")])
        if kept:
            return now - 10, kept[0].evidence["fallback_from"]
    return None


def test_built_in_fallback_is_60_s_for_l1_and_30_s_for_an_l2_hang():
    assert _fallback_tick("fr_pipes", 60) == (60, "L1")
    assert _fallback_tick("rank_progress", 30) == (30, "L2")


def test_which_lower_detectors_must_keep_running_for_an_l2_job():
    """An L2 job (rank progress seen): the L1 hang detector must run (L2 hangs fall back), the L1
    OOM side has no L2 fallback, so nothing below L2 is needed for OOM except the L0 one."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **config.defaults()["levels"])
    _tick(sel, 10.0, "rank_progress")
    assert sel.job_levels() == {"j": "L2"}
    l1_hang = next(d for d in dets if getattr(d, "capability", None) == "hang" and d.level == "L1")
    assert sel.needed(l1_hang)
    l1_oom = [d for d in dets if getattr(d, "capability", None) == "oom" and d.level == "L1"]
    assert all(not sel.needed(d) for d in l1_oom)
    assert sel.needed(by["hang_device"])


def test_a_selector_asked_before_its_first_tick_knows_no_job():
    sel = LevelSelector(default_detectors(config.defaults()))
    assert sel.job_levels() == {} and sel.frame().height == 0


def test_many_jobs_reporting_keep_their_levels_when_the_memory_is_pruned():
    """30 jobs report rank progress on one tick while the scheduler lists only one: the memory of
    streams is pruned (more entries than 4 per job per stream), but nothing recent is dropped."""
    sel = LevelSelector(default_detectors(config.defaults()))
    jobs = [f"j{i}" for i in range(30)]
    _tick(sel, 10.0, "rank_progress", jobs=jobs, allocated=("j0",))
    _tick(sel, 11.0, "rank_progress", jobs=jobs, allocated=("j0",))
    assert sel.job_levels() == {j: "L2" for j in jobs}


def test_a_stream_is_remembered_for_exactly_900_s_by_default():
    """Rank progress seen at t=10; later ticks bring only the scheduler's allocations. At t=910 the
    job is still L2 (seen exactly 900 s ago), at t=910.5 it is back to L0."""
    sel = LevelSelector(default_detectors(config.defaults()))
    _tick(sel, 10.0, "rank_progress")
    for now, level in ((910.0, "L2"), (910.5, "L0")):
        w = window()
        w.add("allocations", allocations("j", NODE8))
        w.seal(now)
        sel.observe(w)
        assert sel.job_levels() == {"j": level}, now
