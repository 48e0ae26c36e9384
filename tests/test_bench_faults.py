"""`gpuvigil bench faults`, small: the InfiniteHBD excerpt in tests/data/traces (see its README),
16 simulated nodes, 10 days, 2 seeds (a few seconds). The study's figures are the benchmark's
(docs/benchmarks.md); here: both scenarios and their arms are reported with paired intervals, the
storm trips the breaker and the breaker holds the storm to its cap while no breaker lets it take
nearly every node it hit, and the section is written with its targets."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

import benchmarks.report
from benchmarks.faults import paired
from gpuvigil.cli.main import main

FAULTS = Path(__file__).parent / "data" / "traces" / "infinitehbd-faults"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    doc = tmp_path_factory.mktemp("doc") / "benchmarks.md"
    original = benchmarks.report.DEFAULT_DOC
    benchmarks.report.DEFAULT_DOC = doc
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["bench", "faults", "--faults", str(FAULTS), "--nodes", "16", "--days", "10", "--seeds", "2", "--json"])
    finally:
        benchmarks.report.DEFAULT_DOC = original
    return rc, json.loads(out.getvalue()), doc.read_text()


def test_both_scenarios_report_every_figure_per_arm_with_paired_intervals(small):
    rc, res, _ = small
    assert rc == 0
    assert set(res["scenarios"]) == {"trace", "storm"}
    for sc in res["scenarios"].values():
        assert len(sc["arms"]) == 2
        for arm in sc["arms"].values():
            assert len(arm["runs"]) == 2
            for key in ("gpu_hours_lost", "node_hours_out_of_service", "nodes_out_of_service_peak", "breaker_trips", "queue_p95_hours", "p0_queue_p95_hours"):
                assert math.isfinite(arm[key]) and arm[key] >= 0
        for d in sc["paired"].values():
            assert d["low"] <= d["mean"] <= d["high"] and d["n"] == 2


def test_the_storm_trips_the_breaker_and_stops_at_its_cap(small):
    _, res, _ = small
    cap = res["limits"][0]
    storm = res["scenarios"]["storm"]["arms"]
    hit = storm["gpuvigil + breaker"]["runs"][0]["storm_nodes"]
    assert hit == round(0.6 * 16)
    for run in storm["gpuvigil + breaker"]["runs"]:
        assert run["breaker_trips"] == 1 and run["storm_nodes_cordoned"] <= cap
        [opening] = run["breaker_openings"]
        assert opening["page"].startswith("breaker open:") and opening["would_have_nodes"] >= hit - cap - 1
    for run in storm["gpuvigil, no breaker"]["runs"]:
        assert run["breaker_trips"] == 0 and run["storm_nodes_cordoned"] > cap


def test_the_section_is_written_with_its_provenance_and_targets(small):
    _, _, doc = small
    assert "<!-- bench:faults:start -->" in doc and "<!-- bench:faults:end -->" in doc
    assert "gpuvigil bench faults --faults" in doc and "**From the simulator**" in doc
    assert "| storm: the breaker trips in every seed | >= 1 | 1-1 | met |" in doc


def test_paired_interval():
    d = paired([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])  # differences 1, 2, 3: mean 2, sd 1, t(2) 4.303
    assert d["mean"] == 2.0 and d["high"] - d["mean"] == pytest.approx(4.303 / math.sqrt(3))


@pytest.mark.parametrize("argv, message", [(["--seeds", "1"], "--seeds must be >= 2"), (["--storm-day", "99", "--days", "10"], "--storm-day")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "faults", "--faults", str(FAULTS), "--no-write", *argv]) == 2
    assert message in capsys.readouterr().err
