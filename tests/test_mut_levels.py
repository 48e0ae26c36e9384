"""Level selector (gpuvigil/pipeline/levels.py): behaviour that mutation testing (`make mutate`,
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
from gpuvigil.pipeline.levels import LevelSelector
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
    of `stream`'s level, with the selector's built-in fallback times (no fallback argument;
    side-by-side selection off, or the L2 hang would go out at once)."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, side_by_side=())
    for now in range(10, 10 + seconds + 5):
        _tick(sel, float(now), stream)
        kept, _ = sel.select(by["hang_device"], [_finding("j", "hang_device")])
        if kept:
            return now - 10, kept[0].evidence["fallback_from"]
    return None


def test_built_in_fallback_is_60_s_for_l1_and_30_s_for_an_l2_hang():
    assert _fallback_tick("fr_pipes", 60) == (60, "L1")
    assert _fallback_tick("rank_progress", 30) == (30, "L2")


def test_built_in_side_by_side_sends_an_l2_jobs_device_hang_at_once():
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets)
    _tick(sel, 10.0, "rank_progress")
    [out], dropped = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert dropped == [] and "fallback_from" not in out.evidence and out.evidence["level"] == "L0"
    # An L1 job's device finding still waits for the Flight Recorder (60 s).
    sel = LevelSelector(dets)
    _tick(sel, 10.0, "fr_pipes")
    assert sel.select(by["hang_device"], [_finding("j", "hang_device")])[0] == []


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


# -- mutation testing: which capability detectors run for a job of each level ------------------
# Source: constructed scheduler allocations and one row of the stream that sets the job's level.
import polars as pl  # noqa: E402
import pytest  # noqa: E402

from gpuvigil.window import Window as _Window  # noqa: E402

_DETS = ["hang_device", "hang_fr", "hang", "oom_device", "oom", "straggler_device", "straggler_inspector", "straggler"]


@pytest.mark.parametrize(
    ("streams", "needed"),
    [
        # Only the scheduler knows the job: every capability at L0.
        ((), {"hang_device", "oom_device", "straggler_device"}),
        # Flight Recorder pipes: hang at L1; the L0 hang detector still runs (it triggers the dumps).
        (("fr_pipes",), {"hang_device", "hang_fr", "oom_device", "straggler_device"}),
        # NCCL Inspector rows serve both L1 detectors.
        (("collective_progress",), {"hang_device", "hang_fr", "oom_device", "straggler_device", "straggler_inspector"}),
        # The hook's progress: hang at L2, its L0 and L1 detectors beside it (side by side).
        # Rows without a collective wait (as the real hook sends them) leave stragglers to L0.
        (("rank_progress",), {"hang_device", "hang_fr", "hang", "oom_device", "straggler_device"}),
        # The hook's allocator stats: OOM at L2 with the device's OOM detector beside it (side
        # by side); hang and straggler stay at L0.
        (("allocator_stats",), {"hang_device", "oom", "oom_device", "straggler_device"}),
    ],
    ids=["L0", "L1-fr", "L1-inspector", "L2-progress", "L2-allocator"],
)
def test_the_detectors_needed_for_a_job_are_its_best_level_and_what_falls_back_to(streams, needed):
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **config.defaults()["levels"])
    w = _Window(1e9)
    w.add("allocations", schemas.frame([{"job": "j", "rank": 0, "node": "n0", "gpu": 0}], schemas.ALLOCATIONS))
    for stream in streams:
        w.add(stream, schemas.frame([{"ts": 10.0, "job": "j", "rank": 0}], stream))
    w.seal(10.0)
    sel.observe(w)
    assert {n for n in _DETS if sel.needed(by[n])} == needed
    assert sel.needed(by["xid"])  # no capability: always runs


def test_l2_straggler_detector_serves_only_jobs_whose_hook_sends_a_collective_wait():
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **config.defaults()["levels"])
    w = _Window(1e9)
    w.add("allocations", schemas.frame([{"job": j, "rank": 0, "node": "n0", "gpu": g} for g, j in enumerate(("a", "b"))], schemas.ALLOCATIONS))
    w.add("rank_progress", schemas.frame([{"ts": 10.0, "job": "a", "rank": 0, "collective_wait_seconds": 0.2}, {"ts": 10.0, "job": "b", "rank": 0}], "rank_progress"))
    w.seal(10.0)
    sel.observe(w)
    assert sel.job_levels() == {"a": "L2", "b": "L2"}
    assert (sel.best("straggler", "a"), sel.best("straggler", "b")) == ("L2", "L0")
    assert sel.needed(by["straggler"]) and sel.needed(by["straggler_device"])
    l0 = Finding(kind=FindingKind.STRAGGLER, severity=Severity.TICKET, ts=10.0, job="b", summary="x", source="straggler_device")
    l0_a = Finding(kind=FindingKind.STRAGGLER, severity=Severity.TICKET, ts=10.0, job="a", summary="x", source="straggler_device")
    # side by side (the default): the device's finding for the hooked job goes out too
    kept, dropped = sel.select(by["straggler_device"], [l0, l0_a])
    assert kept == [l0, l0_a] and dropped == []
    # without it, the hook's detector alone serves the job that sends a wait
    only = LevelSelector(dets, **{**config.defaults()["levels"], "side_by_side": ["L2.hang"]})
    only.observe(w)
    kept, dropped = only.select(by["straggler_device"], [l0, l0_a])
    assert kept == [l0] and dropped == [l0_a]


def test_with_no_job_no_capability_detector_is_needed():
    dets = default_detectors(config.defaults())
    sel = LevelSelector(dets, **config.defaults()["levels"])
    w = _Window(1e9)
    w.seal(10.0)
    sel.observe(w)
    assert [d.name for d in dets if sel.needed(d)] == [d.name for d in dets if not getattr(d, "capability", None)]


def test_the_levels_frame_lists_each_job_with_its_level():
    dets = default_detectors(config.defaults())
    sel = LevelSelector(dets, **config.defaults()["levels"])
    w = _Window(1e9)
    w.add("allocations", schemas.frame([{"job": j, "rank": 0, "node": "n0", "gpu": g} for g, j in enumerate(("a", "b"))], schemas.ALLOCATIONS))
    w.add("rank_progress", schemas.frame([{"ts": 10.0, "job": "b", "rank": 0}], "rank_progress"))
    w.seal(10.0)
    sel.observe(w)
    frame = sel.frame()
    assert frame.schema == pl.Schema({"job": pl.Utf8, "level": pl.Utf8})
    assert frame.rows() == [("a", "L0"), ("b", "L2")]
    empty = LevelSelector(dets).frame()
    assert empty.schema == pl.Schema({"job": pl.Utf8, "level": pl.Utf8}) and empty.height == 0


# -- mutation testing: `select` over several findings of one call, and its time edges ----------
from gpuvigil.model import Finding, FindingKind, Severity  # noqa: E402


def _hang(job, source):
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0.0, job=job, summary="x", source=source)


def _tick_j0_j2(sel, now):
    """j2 has the hook (L2), j0 only the scheduler (L0); the default fallbacks (L2.hang 30 s)."""
    w = _Window(1e9)
    w.add("allocations", schemas.frame([{"job": j, "rank": 0, "node": "n0", "gpu": g} for g, j in enumerate(("j0", "j2"))], schemas.ALLOCATIONS))
    w.add("rank_progress", schemas.frame([{"ts": now, "job": "j2", "rank": 0}], "rank_progress"))
    w.seal(now)
    sel.observe(w)


def _selector():
    """The configured selector with side-by-side selection off: the fallback clock's edges."""
    dets = default_detectors(config.defaults())
    return LevelSelector(dets, **{**config.defaults()["levels"], "side_by_side": []}), {d.name: d for d in dets}


def test_select_sorts_each_finding_of_one_call_into_kept_or_suppressed():
    sel, by = _selector()
    _tick_j0_j2(sel, 10.0)
    jobless, l2_job, l0_job, l2_again = _hang(None, "hang_device"), _hang("j2", "hang_device"), _hang("j0", "hang_device"), _hang("j2", "hang_device")
    kept, dropped = sel.select(by["hang_device"], [jobless, l2_job, l0_job, l2_again])
    # A finding without a job is never the subject of a level; j0's best hang level is L0 itself;
    # j2's is L2, whose detector gets 30 s first.
    assert kept == [jobless, l0_job] and kept[0] is jobless and kept[1] is l0_job
    assert len(dropped) == 2 and dropped[0] is l2_job and dropped[1] is l2_again
    assert all(f.evidence["level"] == "L0" for f in (jobless, l2_job, l0_job, l2_again))
    # An L2 finding for a job whose best level is L0 is kept: better evidence is never hidden.
    above, l0_next = _hang("j0", "hang"), _hang("j0", "hang_device")
    l2_own = _hang("j2", "hang")
    kept, dropped = sel.select(by["hang"], [above, l2_own])
    assert kept == [above, l2_own] and kept[0] is above and kept[1] is l2_own and dropped == []
    kept, _ = sel.select(by["hang_device"], [_hang("j2", "hang_device"), l0_next])
    assert kept == [l0_next]


def test_each_job_has_its_own_quiet_clock():
    """j2 and j3 (both L2): suppression of j2 starts at 10 s, of j3 at 35 s. At 40 s j2's L0
    finding goes out (30 s quiet), j3's does not."""
    sel, by = _selector()
    w_jobs = ("j2", "j3")

    def tick(now):
        w = _Window(1e9)
        w.add("allocations", schemas.frame([{"job": j, "rank": 0, "node": "n0", "gpu": g} for g, j in enumerate(w_jobs)], schemas.ALLOCATIONS))
        w.add("rank_progress", schemas.frame([{"ts": now, "job": j, "rank": 0} for j in w_jobs], "rank_progress"))
        w.seal(now)
        sel.observe(w)

    tick(10.0)
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0] == []
    tick(35.0)
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device"), _hang("j3", "hang_device")])[0] == []
    tick(40.0)
    kept, dropped = sel.select(by["hang_device"], [_hang("j2", "hang_device"), _hang("j3", "hang_device")])
    assert [f.job for f in kept] == ["j2"] and [f.job for f in dropped] == ["j3"]
    assert kept[0].evidence["fallback_from"] == "L2"


def test_a_gap_of_exactly_the_fallback_keeps_the_quiet_clock_running():
    """Suppressed at 10 s, then nothing until exactly 40 s (30 s, the L2.hang fallback): still the
    same suspicion, so it goes out; one more second of gap would have started it over."""
    sel, by = _selector()
    _tick_j0_j2(sel, 10.0)
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0] == []
    _tick_j0_j2(sel, 40.0)
    assert [f.job for f in sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0]] == ["j2"]
    sel, by = _selector()
    _tick_j0_j2(sel, 10.0)
    sel.select(by["hang_device"], [_hang("j2", "hang_device")])
    _tick_j0_j2(sel, 41.0)
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0] == []


def test_the_selected_detector_speaking_on_the_tick_the_suspicion_starts_counts():
    """hang (L2) reports j2 at 10 s, the same tick hang_device's suspicion starts: the selected
    detector spoke, so 30 s later the L0 finding is still held back."""
    sel, by = _selector()
    _tick_j0_j2(sel, 10.0)
    assert sel.select(by["hang"], [_hang("j2", "hang")])[0]
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0] == []
    _tick_j0_j2(sel, 40.0)
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0] == []


def test_a_detector_that_declares_no_level_is_l0():
    from gpuvigil.pipeline.levels import level_of

    class Plugin:
        name = "plugin"

    assert level_of(Plugin()) == "L0"


def test_fallback_seconds_given_to_the_selector_replace_the_built_in_ones():
    """L2.hang after 5 s instead of the built-in 30 s."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, fallback_seconds={"L2.hang": 5.0}, side_by_side=())
    _tick_j0_j2(sel, 10.0)
    assert sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0] == []
    _tick_j0_j2(sel, 15.0)
    assert [f.job for f in sel.select(by["hang_device"], [_hang("j2", "hang_device")])[0]] == ["j2"]


def test_a_job_is_listed_until_exactly_the_memory_after_its_last_row():
    """With the default 900 s memory: j (allocated, and its rank progress seen, at 10 s only) is
    still listed at 910 s, as L2; k (only allocated at 10 s) as L0. At 910.5 s both are gone."""
    sel = LevelSelector(default_detectors(config.defaults()))
    _tick(sel, 10.0, "rank_progress")
    for now, levels in ((910.0, {"j": "L2"}), (910.5, {})):
        w = window()
        w.seal(now)
        sel.observe(w)
        assert sel.job_levels() == levels, now
    sel = LevelSelector(default_detectors(config.defaults()))
    w = window()
    w.add("allocations", allocations("k", NODE8))
    w.seal(10.0)
    sel.observe(w)
    for now, levels in ((910.0, {"k": "L0"}), (910.5, {})):
        w = window()
        w.seal(now)
        sel.observe(w)
        assert sel.job_levels() == levels, now


def test_an_l1_job_runs_the_l0_detector_even_with_no_fallback_configured():
    """With no fallbacks at all, an L1 job (Flight Recorder pipes) still needs the L0 hang
    detector: its findings are what trigger the L1 dumps."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, fallback_seconds={})
    w = _Window(1e9)
    w.add("allocations", schemas.frame([{"job": "j", "rank": 0, "node": "n0", "gpu": 0}], schemas.ALLOCATIONS))
    w.add("fr_pipes", schemas.frame([{"ts": 10.0, "job": "j", "rank": 0}], "fr_pipes"))
    w.seal(10.0)
    sel.observe(w)
    assert sel.needed(by["hang_device"]) and sel.needed(by["hang_fr"]) and not sel.needed(by["hang"])


def test_a_job_seen_only_in_a_stream_is_listed_until_exactly_the_memory():
    """Job h sends rank progress at 10 s but is in no allocation: listed (L2) at 910 s, not at 910.5 s."""
    sel = LevelSelector(default_detectors(config.defaults()))
    _tick(sel, 10.0, "rank_progress", jobs=("h",), allocated=())
    for now, levels in ((910.0, {"h": "L2"}), (910.5, {})):
        w = window()
        w.seal(now)
        sel.observe(w)
        assert sel.job_levels() == levels, now
