"""`gpuvigil bench detectors --quick`: the reduced labelled suite completes and produces a
well-formed table and JSON object (figures are not asserted: a benchmark is not a unit test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.detectors import CASE_TYPES, MUST, NEGATIVE, POSITIVE, make_case


def test_suite_cycles_through_every_case_with_random_parameters():
    cases = [make_case(i, seed=3) for i in range(3 * len(CASE_TYPES))]
    assert sorted({c.case_type for c in cases}) == sorted(CASE_TYPES)
    assert set(POSITIVE) == set(MUST) and not set(NEGATIVE) & set(MUST)
    assert all(8 <= c.gpus <= 1024 and c.gpus % 8 == 0 for c in cases)
    assert all(0.1 <= c.step_time_seconds <= 60 for c in cases)
    assert len({round(c.step_time_seconds, 3) for c in cases}) > len(cases) // 2, "step times must vary"
    assert make_case(5, seed=3) == make_case(5, seed=3), "cases are deterministic per seed"


@pytest.mark.parametrize("bad, message", [(["--runs", "0"], "--runs must be >= 1"), (["--cost-gpus", "-1"], "--cost-gpus must be >= 0")])
def test_bad_arguments_are_one_line_errors(bad, message):
    proc = subprocess.run([sys.executable, "-m", "gpuvigil", "bench", "detectors", *bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_quick_suite_completes_with_a_well_formed_table(tmp_path):
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "bench", "detectors", "--quick", "--json", "--output", str(doc)],
        capture_output=True,
        text=True,
        timeout=300,  # about 40 s on two idle cores; generous for a loaded CI machine
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["meta"]["runs"] == len(CASE_TYPES) and result["meta"]["errors"] == 0
    for key in ("collective_hang", "oom_predicted", "baseline_watchdog_600s", "baseline_static_memory_95pct_1m"):
        row = result[key]
        for field in ("precision", "recall", "f1", "latency_p50_seconds", "latency_p90_seconds", "culprit_accuracy"):
            assert field in row
    assert result["hard_negatives"]["runs"] == len(NEGATIVE)
    text = doc.read_text()
    assert "<!-- bench:detectors:start -->" in text and "<!-- bench:detectors:end -->" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    header = table[0].split("|")
    assert all(len(line.split("|")) == len(header) for line in table[: 2 + len(result) - 4] if "OOM warning" not in line)
    assert any(line.startswith("| collective_hang |") for line in table)
    assert any(line.startswith("| baseline_watchdog_600s |") for line in table)
