"""Flight Recorder analyses are judged by the registered detectors, online and offline alike:
`hang_fr` (a pending collective, confirmed) and `fr_mismatch` (ranks that called different
collectives). The dump watcher's rows and `analyze`'s rows come from one conversion
(`collectors.fr_dumps.analysis_rows`); only the trigger differs (`offline` for dumps read after
the fact).

Data: the real H200 dumps (tests/data/h200: `s5_fr_dump.pickle`, 44 completed collectives of a
world of one; `s6_fr_rank_0`, the watchdog's dump with all_reduce #6 stuck). Two-rank groups are
built from them by giving the one real rank a peer whose record differs in one field (the op of
one collective, or the state of the stuck one).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.app import compose
from gpuvigil.collectors import flight_recorder as fr
from gpuvigil.collectors.fr_dumps import analysis_rows
from gpuvigil.detectors import registry
from gpuvigil.model import FindingKind, Severity
from gpuvigil.offline import fr as offline_fr
from gpuvigil.offline.analyze import Analyzer
from levels_helpers import H200, allocations, play_per_tick

NOW = 5000.0


def _two_ranks(path: Path, **rank1_changes) -> list[fr.FRDump]:
    one = fr.load_dump(path)
    dump = dataclasses.replace(one, pg_config={"0": fr.PGConfig("0", "default_pg", (0, 1))})
    return [dataclasses.replace(dump, rank=0, source="fr_rank_0"), dataclasses.replace(dump, rank=1, source="fr_rank_1", **rank1_changes)]


def _wrong_op_at(seq: int) -> list[fr.FRDump]:
    """Rank 1 called all_gather where rank 0 called #seq's real op."""
    base = fr.load_dump(H200 / "s5_fr_dump.pickle")
    entries = [dataclasses.replace(e, op="all_gather") if e.collective_seq_id == seq and e.pg_name == "0" else e for e in base.entries]
    return _two_ranks(H200 / "s5_fr_dump.pickle", entries=entries)


def _rows(dumps: list[fr.FRDump], *, job: str | None, trigger: str, ts: float | None) -> pl.DataFrame:
    return schemas.frame(analysis_rows(fr.analyze_dumps(dumps), dumps, job=job, trigger=trigger, ts=ts, dump_ts=ts), schemas.FR_ANALYSIS)


def _serve(ticks):
    """Every detector serve runs over the ticks: the findings of each tick."""
    dets = compose.detectors(None, "serve")

    class All:
        def detect(self, w):
            return [f for d in dets for f in d.detect(w)]

    return play_per_tick(All(), ticks)


def test_both_rules_are_registered_live_detectors_that_analyze_also_runs():
    specs = registry.specs()
    assert FindingKind.COLLECTIVE_MISMATCH in specs["fr_mismatch"].emits and FindingKind.COLLECTIVE_HANG in specs["hang_fr"].emits
    for name in offline_fr.DETECTORS:
        assert specs[name].placement == "detect" and "fr_analysis" in specs[name].reads
        assert name in compose.detector_names("serve") and name in compose.detector_names("analyze")


def test_a_mismatch_the_live_watcher_reports_pages_online():
    """The dump watcher writes a mismatch as an `fr_analysis` row: serve pages it, naming the
    culprit rank and its GPU, and a later analysis of the job without it clears it."""
    rows = _rows(_wrong_op_at(44), job="job-9", trigger="on_demand", ts=NOW)
    assert rows["kind"].to_list() == ["collective_mismatch"] and rows["culprit_ranks"].to_list() == [[1]]
    clean = _rows(_two_ranks(H200 / "s5_fr_dump.pickle"), job="job-9", trigger="periodic", ts=NOW + 20)
    assert clean["kind"].to_list() == ["none"]
    alloc = allocations("job-9", [("h200-a", 0), ("h200-b", 5)])
    ticks = _serve([(NOW, {"fr_analysis": rows, "allocations": alloc}), (NOW + 10, {}), (NOW + 20, {"fr_analysis": clean})])
    [[f], [again], after] = ticks
    assert f.kind == FindingKind.COLLECTIVE_MISMATCH and f.severity == Severity.PAGE and f.source == "fr_mismatch"
    assert (f.job, f.ranks, f.culprit_ranks, f.node, f.gpu) == ("job-9", [0, 1], [1], "h200-b", 5)
    assert (f.evidence["mismatch_type"], f.evidence["culprit_ops"], f.evidence["expected"], f.evidence["collective_seq_id"]) == ("op", ["all_gather"], "broadcast", 44)
    assert again.cause_key == f.cause_key
    assert after == []


def test_a_mismatch_older_than_max_age_no_longer_pages():
    rows = _rows(_wrong_op_at(44), job="job-9", trigger="on_demand", ts=NOW)
    [[f], late] = _serve([(NOW, {"fr_analysis": rows}), (NOW + 121, {})])
    assert f.kind == FindingKind.COLLECTIVE_MISMATCH and late == []


def test_analyze_judges_the_dumps_with_the_registered_detectors(tmp_path):
    """`analyze` of the real watchdog dump: the hang comes from `hang_fr` (confirmed because the
    dumps were read after the fact), sourced to the dump, with the analysis's evidence."""
    report = Analyzer(job="job-6").run([H200 / "s6_fr_rank_0"])
    [f] = report.findings
    assert f.kind == FindingKind.COLLECTIVE_HANG and f.job == "job-6" and f.culprit_ranks == [0]
    assert f.evidence["trigger"] == "offline" and f.evidence["confirmed_by"] == "dumps read after the fact"
    assert f.evidence["collective_seq_id"] == 6 and f.evidence["last_completed"] == [5]
    assert f.source.endswith("s6_fr_rank_0") and f.cause is None
    assert f.summary.startswith("job-6 is hung in collective #6 all_reduce (L1, Flight Recorder; dumps read after the fact)")


def test_the_detectors_config_is_what_analyze_uses():
    """A knob of the registered detector changes analyze's answer: the mismatch read after the
    fact is judged by `fr_mismatch` as configured (max_age_seconds < 0: nothing is recent)."""
    dumps = _wrong_op_at(44)
    [f] = offline_fr.analyze_dumps(dumps, job="j")
    assert f.kind == FindingKind.COLLECTIVE_MISMATCH and f.culprit_ranks == [1] and f.source == "fr_rank_1"
    assert offline_fr.analyze_dumps(dumps, job="j", cfg={"detectors": {"fr_mismatch": {"max_age_seconds": -1.0}}}) == []


def test_a_hang_with_no_culprit_pages_after_the_fact_only():
    """Both ranks hold the stuck all_reduce #6 and neither kernel started: the dumps cannot say
    whose it is. Live the L0 detectors see the job stop, so hang_fr waits for them; read after
    the fact nothing else will say it, so analyze pages it without culprits."""
    dumps = _two_ranks(H200 / "s6_fr_rank_0")
    [row] = analysis_rows(fr.analyze_dumps(dumps), dumps, job="j", trigger="timeout", ts=NOW, dump_ts=NOW)
    assert row["kind"] == "collective_hang" and row["culprit_ranks"] == [] and json.loads(row["evidence_json"])["not_completed_ranks"] == [0, 1]
    [live] = _serve([(NOW, {"fr_analysis": schemas.frame([row], schemas.FR_ANALYSIS)})])
    assert [f for f in live if f.kind == FindingKind.COLLECTIVE_HANG] == []
    [f] = offline_fr.analyze_dumps(dumps, job="j")
    assert f.kind == FindingKind.COLLECTIVE_HANG and f.culprit_ranks == [] and f.ranks == [0, 1] and f.node is None


@pytest.mark.parametrize("evidence_json", [None, "", "not json", "[1, 2]", "{\"a\": 1"])
def test_a_row_whose_evidence_is_missing_or_garbage_still_pages(evidence_json):
    rows = _rows(_wrong_op_at(44), job="job-9", trigger="on_demand", ts=NOW).with_columns(pl.lit(evidence_json, pl.Utf8).alias("evidence_json"))
    [[f]] = _serve([(NOW, {"fr_analysis": rows})])
    assert f.kind == FindingKind.COLLECTIVE_MISMATCH and f.culprit_ranks == [1] and f.evidence["seq"] == 44


def test_the_dump_watcher_s_mismatch_row_pages_through_serve_s_detectors(tmp_path):
    """End to end from the dump folder: the real torch JSON dump written as two ranks, rank 1's
    #44 a broadcast turned all_gather; the live watcher (`FrDumpWatcher`) writes its row and the
    detectors serve runs page the mismatch."""
    from gpuvigil.collectors.fr_dumps import FrDumpWatcher

    raw = json.loads((H200 / "s5_fr_dump.json").read_text())
    raw["pg_config"]["0"]["ranks"] = "[0, 1]"
    job_dir = tmp_path / "job-3"
    job_dir.mkdir()
    (job_dir / "fr_dump_0.json").write_text(json.dumps(raw))
    for e in raw["entries"]:
        if e["collective_seq_id"] == 44:
            e["profiling_name"] = "nccl:all_gather"
    (job_dir / "fr_dump_1.json").write_text(json.dumps(raw))
    out = FrDumpWatcher(tmp_path).collect(NOW)
    [row] = out["fr_analysis"].rows(named=True)
    assert (row["job"], row["kind"], row["culprit_ranks"], row["seq"]) == ("job-3", "collective_mismatch", [1], 44)
    [[f]] = _serve([(NOW, {"fr_analysis": out["fr_analysis"]})])
    assert f.kind == FindingKind.COLLECTIVE_MISMATCH and f.job == "job-3" and f.culprit_ranks == [1] and f.source == "fr_mismatch"
    assert f.evidence["dump"].endswith("fr_dump_1.json") and f.evidence["culprit_ops"] == ["all_gather"]


def _mismatched_job_folder(root: Path, job: str) -> None:
    """The real torch JSON dump written as two ranks of one job, rank 1's #44 a broadcast turned
    all_gather."""
    raw = json.loads((H200 / "s5_fr_dump.json").read_text())
    raw["pg_config"]["0"]["ranks"] = "[0, 1]"
    folder = root / job
    folder.mkdir(parents=True)
    (folder / "fr_dump_0.json").write_text(json.dumps(raw))
    for e in raw["entries"]:
        if e["collective_seq_id"] == 44:
            e["profiling_name"] = "nccl:all_gather"
    (folder / "fr_dump_1.json").write_text(json.dumps(raw))


def test_gpuvigil_serve_pages_a_mismatch_in_its_dump_folder(tmp_path):
    """As an operator runs it: `gpuvigil serve --fr-dump-dir DIR`, a process, with a job's dumps
    in DIR: the mismatch is a page of serve's own, naming the rank that called another op."""
    import os
    import subprocess
    import sys

    _mismatched_job_folder(tmp_path / "fr", "job-3")
    done = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "serve", "--port", "0", "--duration", "3", "--log-level", "info", "--fr-dump-dir", str(tmp_path / "fr")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert done.returncode == 0, done.stderr
    pages = [line for line in done.stderr.splitlines() if "finding page collective_mismatch" in line]
    assert len(pages) == 1, done.stderr[-3000:]
    assert "job-3: collective #44 on process group 0 (default_pg): rank(s) 1 called all_gather where the other 1 rank(s) called broadcast" in pages[0]
