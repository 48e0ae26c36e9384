"""Collective-hang detector (gpuvigil/detectors/hang.py): the exact edges and the per-job loop
that mutation testing left unpinned (docs/testing.md, "worth a test" in the previous round:
`detect__mutmut_162`, `_224`, `_235`, `_257`, `_275`, `_453`).

- a job whose reports stopped exactly `stale_report_seconds` ago still counts as reporting;
- a rank whose last report is exactly `stale_report_seconds` older than its job's newest is
  not yet silent;
- an XID exactly `hardware_lookback_seconds` old is still hardware evidence;
- a stalled job in which nobody is a culprit does not hide the jobs judged after it;
- no step time reported at all is reported as 0 s, not as some step.

Source: constructed rank_progress frames (the in-process hook's Flight Recorder `pg_status`),
built with the helpers of tests/test_mut_hang.py. Ticks on whole seconds land on the edges
exactly, as real ticks on a 1 s cadence do; the real gloo runs are in tests/test_detectors_real.py.
"""

from __future__ import annotations

import polars as pl
import pytest
from test_mut_hang import _event, rank_rows, run, stuck

from gpuvigil import schemas

EMPTY = schemas.frame([], schemas.RANK_PROGRESS)


def test_a_job_that_stopped_reporting_exactly_the_stale_limit_ago_still_pages():
    """Every rank reports up to t=2 (rank 2 never entered #11) and then nothing. The stall passes
    the 5 s floor at t=6; at t=7 the newest report is exactly 5 s old (still reporting), at t=8
    it is 6 s old: the job has gone quiet as a whole and is no longer judged."""
    found = run(lambda t: stuck()(t) if t <= 2 else EMPTY, [float(t) for t in range(0, 10)])
    assert [bool(f) for f in found] == [False] * 6 + [True, True] + [False] * 2
    assert found[7][0].culprit_ranks == [2]


def test_a_rank_exactly_the_stale_limit_behind_its_peers_is_not_yet_silent():
    """Everybody entered #11 and waits; rank 5 stops reporting after t=2. At t=7 its last report
    is exactly 5 s older than its peers' (not silent: no culprit, no page); at t=8 it is 6 s
    behind and is the silent culprit."""
    def frames(t):
        return rank_rows(t, [11] * 8, [10] * 8, skip=(5,) if t > 2 else ())
    found = run(frames, [float(t) for t in range(0, 10)])
    assert [bool(f) for f in found] == [False] * 8 + [True, True]
    f = found[8][0]
    assert (f.culprit_ranks, f.evidence["silent_ranks"]) == ([5], [5])


def test_a_culprit_exactly_the_stale_limit_behind_is_not_called_silent():
    """Rank 5 never entered #11 (a culprit on that ground) and stops reporting after t=2. At t=7
    it is exactly 5 s behind: named as not having entered; at t=8: named as silent."""
    def frames(t):
        return rank_rows(t, [10 if r == 5 else 11 for r in range(8)], [10] * 8, skip=(5,) if t > 2 else ())
    found = run(frames, [float(t) for t in range(0, 10)])
    assert [bool(f) for f in found] == [False] * 6 + [True] * 4
    assert (found[7][0].culprit_ranks, found[7][0].evidence["silent_ranks"]) == ([5], [])
    assert "(it never entered the collective)" in found[7][0].summary
    assert (found[8][0].culprit_ranks, found[8][0].evidence["silent_ranks"]) == ([5], [5])
    assert "(its process stopped reporting)" in found[8][0].summary


def test_an_xid_exactly_the_lookback_old_is_still_hardware_evidence():
    """The hang is found at t=106 and still there at t=107. An XID 79 on the culprit's node at
    t=-14 is exactly 120 s old at t=106 (counts) and 121 s old at t=107 (does not)."""
    times = [float(t) for t in range(100, 108)]
    found = run(stuck(), times, events=lambda t: _event(-14.0, "n0") if t == 100.0 else None)
    assert (found[6][0].cause, found[6][0].evidence["xids"]) == ("hardware", [79])
    assert (found[7][0].cause, found[7][0].evidence["xids"]) == ("software", [])


@pytest.mark.parametrize("order", ["quiet job first", "hung job first"])
def test_a_stalled_job_with_no_culprit_does_not_hide_the_next_job(order):
    """Job a: every rank entered #11 and waits (stuck inside the collective: nobody to name).
    Job b: rank 2 never entered #11. Both stalled; b is named whichever job is judged first."""
    def frames(t):
        a = rank_rows(t, [11] * 4, [10] * 4, job="a")
        b = stuck(job="b")(t)
        return pl.concat([a, b] if order == "quiet job first" else [b, a])
    found = run(frames, [float(t) for t in range(0, 8)])
    assert [(f.job, f.culprit_ranks) for f in found[6]] == [("b", [2])]


def test_no_step_time_reported_is_zero_seconds():
    """A hook that reports no step time (null on every rank): the threshold is the 5 s floor and
    the evidence says 0 s, not a made-up step."""
    frames = lambda t: stuck()(t).with_columns(pl.lit(None, pl.Float64).alias("step_time_seconds"))  # noqa: E731
    [f] = run(frames, [float(t) for t in range(0, 8)])[6]
    assert (f.evidence["step_time_seconds"], f.evidence["threshold_seconds"], f.culprit_ranks) == (0.0, 5.0, [2])
