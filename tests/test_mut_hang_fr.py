"""Mutation testing: the L1 Flight Recorder hang detector (`gpuvigil/detectors/hang_fr.py`).

Data: the real Flight Recorder dump the NCCL watchdog wrote on an H200 when all_reduce #6 timed out
(`tests/data/h200/s6_fr_rank_0`), read by the real dump-folder watcher
(`collectors.fr_dumps.FrDumpWatcher`) into its `fr_analysis` row: trigger `timeout`, culprit rank 0,
pending #6 all_reduce on process group 0. The tests vary that row's fields (trigger, time, seq,
culprits, kind) to put it on each side of each guard; the NCCL Inspector progress rows, the jobs,
allocations and XID events beside it are constructed.
"""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.collectors.fr_dumps import FrDumpWatcher
from gpuvigil.detectors.hang_fr import FlightRecorderHangDetector
from gpuvigil.model import FindingKind, Severity
from levels_helpers import H200, allocations, cfg_with, play_per_tick

NOW = 1000.0


@pytest.fixture(scope="module")
def real_row(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fr")
    (root / "job-7").mkdir()
    shutil.copy(H200 / "s6_fr_rank_0", root / "job-7" / "fr_dump_0")
    w = FrDumpWatcher(root)
    out = w.collect(1.0) or w.collect(5.0) or w.collect(30.0)
    [row] = out["fr_analysis"].rows(named=True)
    assert row["trigger"] == "timeout" and row["culprit_ranks"] == [0] and row["seq"] == 6 and row["op"] == "all_reduce"
    return row


def _an(row: dict, ts: float, **changes) -> pl.DataFrame:
    return schemas.frame([{**row, "ts": ts, "dump_ts": ts, **changes}], schemas.FR_ANALYSIS)


def _xid(ts: float, node: str, xid: int = 79) -> pl.DataFrame:
    return schemas.frame([{"ts": ts, "node": node, "gpu": 0, "source": "kernel", "kind": "xid", "xid": xid, "message": "x"}], schemas.EVENTS)


def _progress(ts: float, sn: int, job: str = "job-7") -> pl.DataFrame:
    return schemas.frame([{"ts": ts, "job": job, "rank": r, "coll_sn": sn, "exec_time_us": 100.0} for r in range(2)], schemas.COLLECTIVE_PROGRESS)


def _run(ticks, cfg=None, det=None):
    """ticks: [(now, {stream: frame})]; returns the findings of each tick."""
    return play_per_tick(det or FlightRecorderHangDetector(cfg), ticks)


def test_the_real_timeout_dump_is_one_whole_page(real_row):
    alloc = allocations("job-7", [("h200", 3)])
    [[f]] = _run([(NOW, {"fr_analysis": _an(real_row, NOW, n_dumps=1), "allocations": alloc})])
    assert f.kind == FindingKind.COLLECTIVE_HANG and f.severity == Severity.PAGE and f.ts == NOW
    assert f.job == "job-7" and f.ranks == [0] and f.culprit_ranks == [0]
    assert f.node == "h200" and f.gpu == 3 and f.cause == "software" and f.source == "hang_fr"
    # the analysis's own evidence (what the dump shows), then how the detector confirmed it
    found = json.loads(real_row["evidence_json"])
    assert (found["collective_seq_id"], found["last_completed"], found["not_completed_ranks"]) == (6, [5], [0])
    assert f.evidence == {
        **found,
        "level": "L1", "pending_seq": 6, "op": "all_reduce", "pg": "0", "trigger": "timeout",
        "confirmed_by": "watchdog timeout dump", "dumps": 1, "dump": real_row["source"], "culprit_nodes": ["h200"], "xids": [],
    }
    assert real_row["source"].endswith("fr_dump_0")
    assert f.summary == f"job-7 is hung in collective #6 all_reduce (L1, Flight Recorder; watchdog timeout dump): {real_row['summary']}"


def test_an_on_demand_snapshot_needs_a_second_one_confirm_seconds_later(real_row):
    """Guard: one on-demand dump is normal skew (hard negative); the same pending collective
    exactly `confirm_seconds` (4 s) later pages, 3.5 s later does not."""
    od = dict(trigger="on_demand")
    quiet = _run([(NOW, {"fr_analysis": _an(real_row, NOW, **od)}), (NOW + 3.5, {"fr_analysis": _an(real_row, NOW + 3.5, **od)})])
    assert quiet == [[], []]
    res = _run([(NOW, {"fr_analysis": _an(real_row, NOW, **od)}), (NOW + 4.0, {"fr_analysis": _an(real_row, NOW + 4.0, **od)})])
    assert res[0] == [] and len(res[1]) == 1
    assert res[1][0].evidence["confirmed_by"] == "two dumps 4 s apart show the same pending collective"
    assert res[1][0].evidence["trigger"] == "on_demand"
    wider = _run([(NOW, {"fr_analysis": _an(real_row, NOW, **od)}), (NOW + 4.0, {"fr_analysis": _an(real_row, NOW + 4.0, **od)})],
                 cfg=cfg_with("hang_fr", confirm_seconds=6.0))
    assert wider == [[], []]


def test_a_second_dump_of_another_collective_does_not_confirm(real_row):
    """The job moved on between the dumps (#6, then #9 pending): not the same stuck collective."""
    od = dict(trigger="on_demand")
    res = _run([(NOW, {"fr_analysis": _an(real_row, NOW, **od)}), (NOW + 10, {"fr_analysis": _an(real_row, NOW + 10, seq=9, **od)})])
    assert res == [[], []]
    res = _run([(NOW, {"fr_analysis": _an(real_row, NOW, **od)}), (NOW + 10, {"fr_analysis": _an(real_row, NOW + 10, pg="1", **od)})])
    assert res == [[], []]


def test_nccl_inspector_confirms_when_no_collective_completed_for_the_stall_threshold(real_row):
    """Inspector path: progress moves at 990 s; an on-demand dump at 992 s; the default floor is
    5 s: 994.5 s quiet, 995 s pages (exactly the threshold), naming the seconds."""
    od = dict(trigger="on_demand")
    base = [(985.0, {"collective_progress": _progress(985.0, 10)}), (990.0, {"collective_progress": _progress(990.0, 20)})]
    res = _run(base + [(992.0, {"fr_analysis": _an(real_row, 992.0, **od)}), (994.5, {}), (995.0, {})])
    assert res[2] == [] and res[3] == [] and len(res[4]) == 1
    assert res[4][0].evidence["confirmed_by"] == "NCCL Inspector: no collective completed for 5 s"


def test_the_stall_threshold_scales_with_the_usual_collective_interval(real_row):
    """Collectives every 10 s (one sn per 10 s): threshold max(5, 1.5 × 10) = 15 s after the last move."""
    od = dict(trigger="on_demand")
    ticks = [(t, {"collective_progress": _progress(t, int(t // 10))}) for t in (950.0, 960.0, 970.0, 980.0, 990.0)]
    ticks += [(991.0, {"fr_analysis": _an(real_row, 991.0, **od)}), (1004.0, {}), (1005.0, {})]
    res = _run(ticks)
    assert res[-2] == [] and len(res[-1]) == 1
    assert res[-1][0].evidence["confirmed_by"] == "NCCL Inspector: no collective completed for 15 s"


def test_a_dump_taken_before_the_last_completion_is_not_confirmed_by_the_inspector(real_row):
    """Guard: the dump predates the job's last progress, so it may show a collective that then
    completed (hard negative), and with Inspector data the two-dump rule does not apply."""
    od = dict(trigger="on_demand")
    res = _run([(980.0, {"fr_analysis": _an(real_row, 980.0, **od)}), (985.0, {"collective_progress": _progress(985.0, 10)}),
                (990.0, {"fr_analysis": _an(real_row, 990.0, **od), "collective_progress": _progress(990.0, 20)}), (1000.0, {})])
    assert res == [[], [], [], []]


def test_analyses_older_than_max_age_no_longer_page(real_row):
    """Guard: max_age_seconds (120 s): exactly 120 s old still pages, 120.5 s does not."""
    assert len(_run([(NOW, {"fr_analysis": _an(real_row, NOW - 120.0)})])[0]) == 1
    assert _run([(NOW, {"fr_analysis": _an(real_row, NOW - 120.5)})])[0] == []
    assert len(_run([(NOW, {"fr_analysis": _an(real_row, NOW - 120.5)})], cfg=cfg_with("hang_fr", max_age_seconds=200.0))[0]) == 1


def _jobs(start: float, job: str = "job-7") -> pl.DataFrame:
    return schemas.frame([{"job": job, "state": "running", "start_ts": start, "n_gpus": 1}], schemas.JOBS)


def test_a_dump_from_before_the_jobs_restart_does_not_page(real_row):
    """Guard: the requeued job's previous run wrote the dump (dump and analysis before start_ts)."""
    assert _run([(NOW, {"fr_analysis": _an(real_row, NOW - 10), "jobs": _jobs(NOW - 5)})])[0] == []
    # the dump after the start, or analysed after it, or a job the scheduler does not list: pages
    assert len(_run([(NOW, {"fr_analysis": _an(real_row, NOW - 10, dump_ts=NOW - 5), "jobs": _jobs(NOW - 5)})])[0]) == 1
    assert len(_run([(NOW, {"fr_analysis": _an(real_row, NOW - 5, dump_ts=NOW - 10), "jobs": _jobs(NOW - 5)})])[0]) == 1
    assert len(_run([(NOW, {"fr_analysis": _an(real_row, NOW - 10), "jobs": _jobs(NOW - 5, job="other")})])[0]) == 1


def test_the_latest_analysis_decides(real_row):
    """Guard: a hang followed by a clean analysis (kind none) or one with no culprit does not page."""
    clean = _an(real_row, NOW, kind="none", culprit_ranks=[])
    assert _run([(NOW - 5, {"fr_analysis": _an(real_row, NOW - 5)}), (NOW, {"fr_analysis": clean})])[1] == []
    nobody = _an(real_row, NOW, culprit_ranks=[])
    assert _run([(NOW - 5, {"fr_analysis": _an(real_row, NOW - 5)}), (NOW, {"fr_analysis": nobody})])[1] == []
    mismatch = _an(real_row, NOW, kind="collective_mismatch")
    assert _run([(NOW, {"fr_analysis": mismatch})])[0] == []


def test_a_quiet_job_does_not_hide_the_next_one(real_row):
    both = pl.concat([_an(real_row, NOW - 1, job="a-clean", kind="none", culprit_ranks=[]), _an(real_row, NOW, job="b-hung"),
                      _an(real_row, NOW - 2, job="c-hung", culprit_ranks=[1])])
    fs = _run([(NOW, {"fr_analysis": both})])[0]
    assert [(f.job, f.culprit_ranks) for f in fs] == [("c-hung", [1]), ("b-hung", [0])]


def test_hardware_on_a_culprit_node_within_the_lookback(real_row):
    alloc = allocations("job-7", [("h200", 0), ("other", 0)])
    fr = _an(real_row, NOW)
    [[f]] = _run([(NOW, {"fr_analysis": fr, "allocations": alloc, "events": pl.concat([_xid(NOW - 120.0, "h200", 79), _xid(NOW - 1, "h200", 48), _xid(NOW - 1, "other", 13)])})])
    assert f.cause == "hardware" and f.evidence["xids"] == [48, 79]
    [[g]] = _run([(NOW, {"fr_analysis": fr, "allocations": alloc, "events": _xid(NOW - 120.5, "h200")})])
    assert g.cause == "software" and g.evidence["xids"] == []
    [[h]] = _run([(NOW, {"fr_analysis": fr, "allocations": alloc, "events": _xid(NOW - 1, "other")})])
    assert h.cause == "software"
    ecc = schemas.frame([{"ts": NOW - 1, "node": "h200", "kind": "ecc_dbe", "message": "dbe"}], schemas.EVENTS)
    [[e]] = _run([(NOW, {"fr_analysis": fr, "allocations": alloc, "events": ecc})])
    assert e.cause == "hardware" and e.evidence["xids"] == []
    warn = schemas.frame([{"ts": NOW - 1, "node": "h200", "kind": "nccl_warn", "message": "w"}], schemas.EVENTS)
    [[n]] = _run([(NOW, {"fr_analysis": fr, "allocations": alloc, "events": warn})])
    assert n.cause == "software"


def test_culprit_nodes_from_allocations_or_the_dump(real_row):
    two = _an(real_row, NOW, culprit_ranks=[2, 0])
    alloc = allocations("job-7", [("n-b", 0), ("n-x", 1), ("n-a", 5)])
    [[f]] = _run([(NOW, {"fr_analysis": two, "allocations": alloc})])
    assert f.culprit_ranks == [2, 0] and f.evidence["culprit_nodes"] == ["n-a", "n-b"] and f.node == "n-a" and f.gpu is None
    # no allocation of the job: the dump's own node, else none at all
    [[g]] = _run([(NOW, {"fr_analysis": _an(real_row, NOW, node="dump-host"), "allocations": allocations("other", [("n-z", 0)])})])
    assert g.node == "dump-host" and g.evidence["culprit_nodes"] == ["dump-host"] and g.gpu is None
    [[h]] = _run([(NOW, {"fr_analysis": _an(real_row, NOW, node=None)})])
    assert h.node is None and h.evidence["culprit_nodes"] == [] and h.cause == "software"


def test_a_dump_count_that_is_missing_reads_zero(real_row):
    [[f]] = _run([(NOW, {"fr_analysis": _an(real_row, NOW, n_dumps=None)})])
    assert f.evidence["dumps"] == 0


def test_an_unconfirmed_dump_does_not_hide_a_confirmed_one_after_it(real_row):
    """`a-snap` (an on-demand snapshot, first by time, not yet confirmed) is
    skipped and `b-hung` (the real timeout dump) behind it still pages."""
    both = pl.concat([_an(real_row, NOW - 1, job="a-snap", trigger="on_demand"), _an(real_row, NOW, job="b-hung")])
    assert [f.job for f in _run([(NOW, {"fr_analysis": both})])[0]] == ["b-hung"]


def test_a_culprit_rank_placed_on_no_node_leaves_the_known_node(real_row):
    """constructed: culprit ranks 2 and 0, rank 2 not placed yet (a pending pod: its allocation row
    has no node): the known node is named, instead of raising on sorting None with "n-a"."""
    two = _an(real_row, NOW, culprit_ranks=[2, 0])
    alloc = schemas.frame([{"job": "job-7", "rank": 0, "node": "n-a", "gpu": 5}, {"job": "job-7", "rank": 2, "node": None, "gpu": None}], schemas.ALLOCATIONS)
    [[f]] = _run([(NOW, {"fr_analysis": two, "allocations": alloc})])
    assert f.culprit_ranks == [2, 0] and f.evidence["culprit_nodes"] == ["n-a"] and f.node == "n-a" and f.severity == Severity.PAGE
