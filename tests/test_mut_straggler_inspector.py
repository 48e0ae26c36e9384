"""Mutation testing: the L1 NCCL Inspector straggler (`gpuvigil/detectors/straggler_inspector.py`).

Data: constructed `collective_progress` rows. No capture of NCCL Inspector output with a straggler
exists here (no GPU cluster); the rows carry the plugin's fields as its README record shows them
(`coll_sn`, `coll_exec_time_us`, see `tests/test_nccl_inspector.py::README_RECORD`), and the
figures follow how a collective completes: the peers wait ~120 ms for the last rank, which waits
~3 ms. This detector is only ever fed constructed data (docs/testing.md says so).
"""

from __future__ import annotations

import polars as pl

from gpuvigil import schemas
from gpuvigil.detectors.straggler_inspector import InspectorStragglerDetector
from gpuvigil.model import FindingKind, Severity
from levels_helpers import cfg_with, play_per_tick


def _tick(t: float, execs: dict[int, float | None], *, job="j", sn_per_tick=4, sn=None, node="n1", gpu=True) -> pl.DataFrame:
    return schemas.frame(
        [{"ts": t, "job": job, "rank": r, "node": node, "gpu": r if gpu else None, "coll": "AllReduce",
          "coll_sn": sn if sn is not None else int(sn_per_tick * t), "exec_time_us": e} for r, e in execs.items()],
        schemas.COLLECTIVE_PROGRESS,
    )


STRAG = {0: 120000.0, 1: 120000.0, 2: 120000.0, 3: 3000.0}


def _play(ticks, cfg=None):
    """ticks: [(now, {stream: frame})] → the findings of each tick."""
    return play_per_tick(InspectorStragglerDetector(cfg), ticks)


def _series(n=30, execs=STRAG, **kw):
    return [(float(t), {"collective_progress": _tick(float(t), execs, **kw)}) for t in range(1, n + 1)]


def _first(res) -> int | None:
    """1-based tick of the first finding."""
    return next((i + 1 for i, fs in enumerate(res) if fs), None)


def test_the_whole_finding_of_the_rank_that_arrives_last():
    res = _play(_series(21))
    assert _first(res) == 21  # 20 samples each (min_samples) at tick 20, flagged twice in a row at 21
    [f] = res[20]
    assert f.kind == FindingKind.STRAGGLER and f.severity == Severity.TICKET and f.ts == 21.0
    assert f.job == "j" and f.ranks == [3] and f.culprit_ranks == [3] and f.node == "n1" and f.gpu == 3
    assert f.source == "straggler_inspector"
    # interval 20 s / 80 collectives = 0.25 s; (0.25 - 0.003) / (0.25 - 0.12) = 1.9
    assert f.evidence == {"level": "L1", "slowdown": 1.9, "rank_exec_seconds": 0.003, "peer_exec_seconds": 0.12,
                          "collective_interval_seconds": 0.25, "ranks_in_job": 4}
    assert f.summary == ("j rank 3 (n1 GPU 3) computes 90% slower than its 3 peers (L1, NCCL Inspector: its collectives "
                         "take 3.0 ms against the peers' 120.0 ms: it arrives last).")


def test_samples_and_persistence_from_the_configuration():
    assert _first(_play(_series(25), cfg_with("straggler_inspector", persist_evaluations=1))) == 20
    assert _first(_play(_series(25), cfg_with("straggler_inspector", min_samples=10))) == 11
    assert _first(_play(_series(25), cfg_with("straggler_inspector", persist_evaluations=3))) == 22


def test_a_one_evaluation_blip_does_not_ticket():
    """Guard (persistence): a 1 s look-back of 2 samples; rank 3 arrives last at 11-12 s only, so
    it is flagged at the 12 s evaluation alone: no finding (hard negative). Flagged at 12 and 13 s
    (last also at 13 s): a finding at 13 s; with `persist_evaluations: 1` at 12 s."""
    even = {r: 120000.0 for r in range(4)}
    cfg = {"window_seconds": 1.0, "min_samples": 2}

    def run(slow_ticks, **more):
        ticks = [(float(t), {"collective_progress": _tick(float(t), STRAG if t in slow_ticks else even)}) for t in range(1, 20)]
        return _first(_play(ticks, cfg_with("straggler_inspector", **cfg, **more)))

    assert run({11, 12}) is None
    assert run({11, 12, 13}) == 13
    assert run({11, 12}, persist_evaluations=1) == 12


def test_too_few_ranks_do_not_ticket():
    """Guard (min_ranks 4): the same straggler among 3 ranks is quiet; min_ranks 3 tickets."""
    three = {0: 120000.0, 1: 120000.0, 3: 3000.0}
    assert _first(_play(_series(25, three))) is None
    res = _play(_series(25, three), cfg_with("straggler_inspector", min_ranks=3))
    assert _first(res) == 21 and res[20][0].evidence["ranks_in_job"] == 3


def test_a_job_whose_sequence_numbers_do_not_move_is_not_judged():
    """Guard (finite interval): no collective completes (coll_sn stays), interval infinite: quiet."""
    assert _first(_play(_series(30, sn=7))) is None


def test_peers_slower_than_the_interval_are_not_judged():
    """Guard (interval > peers' exec): exec times as long as the time between collectives (0.25 s)
    leave no compute time to compare: the slowdown's denominator is 0 (an infinite slowdown without
    the guard). Quiet; longer peers' exec is quiet too."""
    assert _first(_play(_series(30, {0: 250000.0, 1: 250000.0, 2: 250000.0, 3: 3000.0}))) is None
    assert _first(_play(_series(30, {0: 300000.0, 1: 300000.0, 2: 300000.0, 3: 3000.0}))) is None
    assert _first(_play(_series(30, {0: 240000.0, 1: 240000.0, 2: 240000.0, 3: 3000.0}))) == 21


def test_the_exec_share_edge():
    """Guard (max_exec_share 0.5): exec exactly half the peers' tickets, a little more does not,
    though its slowdown (1.46) is above the floor."""
    at = {**STRAG, 3: 60000.0}
    res = _play(_series(21, at))
    assert _first(res) == 21 and res[20][0].evidence["slowdown"] == round(0.19 / 0.13, 3)
    assert _first(_play(_series(30, {**STRAG, 3: 60100.0}))) is None
    assert _first(_play(_series(30, {**STRAG, 3: 60100.0}), cfg_with("straggler_inspector", max_exec_share=0.6))) == 21


def test_the_slowdown_floor():
    """Guard (min_slowdown 1.15): collectives every 1 s: (1 - 0.003) / (1 - 0.12) = 1.133: quiet;
    with the floor at 1.13 it tickets."""
    assert _first(_play(_series(30, sn_per_tick=1))) is None
    res = _play(_series(30, sn_per_tick=1), cfg_with("straggler_inspector", min_slowdown=1.13))
    assert _first(res) == 21 and res[20][0].evidence["slowdown"] == round(0.997 / 0.88, 3)


def test_the_first_20_seconds_of_a_run_are_warm_up():
    """Samples before start_ts + 20 s are dropped: with a start at 0, the 20th usable sample
    (ts 20..39) is at tick 39, the finding at 40. A job the scheduler does not list is judged at once."""
    jobs = schemas.frame([{"job": "j", "state": "running", "start_ts": 0.0, "n_gpus": 4}], schemas.JOBS)
    ticks = _series(45)
    ticks[0][1]["jobs"] = jobs
    assert _first(_play(ticks)) == 40
    other = schemas.frame([{"job": "other", "state": "running", "start_ts": 0.0, "n_gpus": 4}], schemas.JOBS)
    ticks = _series(45)
    ticks[0][1]["jobs"] = other
    assert _first(_play(ticks)) == 21


def test_only_the_look_back_window_counts():
    """The interval is read over `window_seconds` (90 s): collectives every 0.25 s for 100 s,
    then every 0.5 s: at 200 s the window holds only the slower rate."""
    ticks = [(float(t), {"collective_progress": _tick(float(t), STRAG, sn=4 * t if t <= 100 else 400 + 2 * (t - 100))}) for t in range(1, 201)]
    res = _play(ticks)
    assert res[-1][0].evidence["collective_interval_seconds"] == 0.5
    res = _play(ticks, cfg_with("straggler_inspector", window_seconds=150.0))
    assert res[-1][0].evidence["collective_interval_seconds"] == round(150 / 400, 4)  # rows from 50 s


def test_rows_without_an_exec_time_are_not_samples():
    """A rank whose rows carry no exec time has no samples; the others are judged without it."""
    execs = {**STRAG, 4: None}
    res = _play(_series(21, execs))
    assert _first(res) == 21 and res[20][0].evidence["ranks_in_job"] == 4


def test_several_stragglers_one_finding_named_by_the_worst():
    execs = {0: 120000.0, 1: 120000.0, 2: 120000.0, 3: 3000.0, 4: 120000.0, 5: 1000.0, 6: 120000.0}
    [f] = _play(_series(21, execs))[20]
    assert f.ranks == [3, 5] and f.culprit_ranks == [3, 5] and f.gpu == 5
    assert f.evidence["slowdown"] == round(0.249 / 0.13, 3) and f.evidence["rank_exec_seconds"] == 0.001
    tie = {0: 120000.0, 1: 120000.0, 2: 120000.0, 3: 3000.0, 4: 120000.0, 5: 3000.0, 6: 120000.0}
    [g] = _play(_series(21, tie))[20]
    assert g.ranks == [3, 5] and g.gpu == 3  # equal slowdown: the lowest rank


def test_two_jobs_two_findings_and_no_gpu_reads_none():
    ticks = [(float(t), {"collective_progress": pl.concat([_tick(float(t), STRAG, job="b"), _tick(float(t), STRAG, job="a", gpu=False)])})
             for t in range(1, 22)]
    fs = _play(ticks)[20]
    assert [(f.job, f.ranks) for f in fs] == [("a", [3]), ("b", [3])]
    assert fs[0].gpu is None and fs[1].gpu == 3
    assert "a rank 3 (n1) computes" in fs[0].summary and "None" not in fs[0].summary  # no GPU: left out, never "GPU None"
