"""`gpuvigil bench detectors --quick`: the reduced labelled suite completes and produces a
well-formed table and JSON object whose figures are those of its counts (no target figure is
asserted: a benchmark is not a unit test, beyond a hang being named before the 600 s watchdog)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.detectors import CASE_TYPES, MUST, NEGATIVE, POSITIVE, RunResult, make_case, parse_cases, score
from gpuvigil.errors import UserError


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
        timeout=600,  # each run is observed at L0, L1 and L2 (benchmarks/levels.py); generous for a loaded CI machine
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["meta"]["runs"] == len(CASE_TYPES) and result["meta"]["errors"] == 0
    # Each kind is expected once per run whose case must raise it (one run per case type here).
    must_count = {k: sum(k in MUST[c] for c in POSITIVE) for k in ("collective_hang", "oom_predicted")}
    assert result["collective_hang"]["expected"] == must_count["collective_hang"] == 2  # nccl_hang, gpu_lost
    assert result["oom_predicted"]["expected"] == must_count["oom_predicted"] == 3  # leak, fragmentation, foreign
    assert result["baseline_watchdog_600s"]["expected"] == 2
    # The anomaly detector has its own case (power_excursion) and row; the PCIe rule has its own.
    assert result["anomaly:unknown"]["expected"] == 1 and result["anomaly:pcie_replay"]["expected"] == 1
    for key in ("collective_hang", "oom_predicted", "baseline_watchdog_600s", "baseline_static_memory_95pct_1m"):
        row = result[key]
        # The figures are not fixed, but they must be the figures of these counts.
        tp, fp, n = row["detected"], row["false_positives"], row["expected"]
        assert 0 <= tp <= n and fp >= 0, (key, row)
        assert row["recall"] == (round(tp / n, 4) if n else None), (key, row)
        assert row["precision"] == (round(tp / (tp + fp), 4) if tp + fp else None), (key, row)
        if row["precision"] and row["recall"]:
            assert row["f1"] == pytest.approx(2 * row["precision"] * row["recall"] / (row["precision"] + row["recall"]), abs=1e-4)
        if tp:
            assert 0 <= row["latency_p50_seconds"] <= row["latency_p90_seconds"], (key, row)
        else:
            assert row["latency_p50_seconds"] is None and row["latency_p90_seconds"] is None
    # The watchdog fires 600 s after the stuck collective began and names every waiting rank.
    wd = result["baseline_watchdog_600s"]
    assert wd["detected"] == wd["expected"] and wd["latency_p50_seconds"] >= 540 and wd["culprit_accuracy"] == 0.0, wd
    # What gpuvigil is for: a hang named well before the watchdog would fire.
    hang = result["collective_hang"]
    assert hang["detected"] >= 1 and hang["latency_p90_seconds"] < 300, hang
    assert result["hard_negatives"]["runs"] == len(NEGATIVE)
    text = doc.read_text()
    assert "<!-- bench:detectors:start -->" in text and "<!-- bench:detectors:end -->" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    header = table[0].split("|")
    assert all(len(line.split("|")) == len(header) for line in table[: 2 + len(result) - 4] if "OOM warning" not in line)
    assert any(line.startswith("| collective_hang |") for line in table)
    assert any(line.startswith("| baseline_watchdog_600s |") for line in table)


def test_cases_option_weights_and_restricts_the_cycle():
    types = parse_cases("all,nccl_hang,nccl_hang")
    assert types[: len(CASE_TYPES)] == CASE_TYPES and types[len(CASE_TYPES) :] == ["nccl_hang", "nccl_hang"]
    cases = [make_case(i, seed=0, quick=True, types=parse_cases("gpu_lost,memory_leak")) for i in range(6)]
    assert [c.case_type for c in cases] == ["gpu_lost", "memory_leak"] * 3
    with pytest.raises(UserError, match="unknown case type 'nope'"):
        parse_cases("nccl_hang,nope")


def _leak_run(wording: str, findings: list[dict]) -> RunResult:
    target = {"kind": "memory_leak", "ts": 100.0, "job": "train", "ranks": [2], "node": "n0", "gpu": 2}
    oom = {"ts": 250.0, "job": "train", "rank": 2, "node": "n0", "gpu": 2, "cause": "capacity"}
    return RunResult(
        index=2, case_type="memory_leak", gpus=8, step_time_seconds=0.5, tick_seconds=1.0, onset=100.0, injected=[target],
        findings=findings, oom_events=[oom], watchdog_fire_ts={}, static_rule_fires=[], wall_seconds=1.0, ticks=300, oom_wordings=[wording],
    )


def _f(kind: str, ts: float, **kw) -> dict:
    return {"kind": kind, "ts": ts, "job": "train", "node": "n0", "gpu": 2, "severity": "page", "culprit_ranks": [2], "cause": kw.pop("cause", None), "evidence": {"rank": 2, **kw}}


def test_an_oom_message_without_figures_is_not_expected_to_be_classified():
    """"CUDA error: out of memory" (cuBLAS, NCCL) carries no figures: its class cannot be read
    after the fact, so it is neither a miss nor, when some other source classifies it, a false
    positive; a message with figures must be classified."""
    warn = _f("oom_predicted", 180.0, cause="leak")
    s = score([_leak_run("cublas", [warn])])
    assert "oom_capacity" not in s and s["oom_messages_without_figures"] == 1
    assert s["oom_predicted"]["detected"] == 1 and s["oom_predicted"]["oom_recall"] == 1.0
    s = score([_leak_run("cublas", [warn, _f("oom_capacity", 250.0)])])
    assert "oom_capacity" not in s  # allowed: neither expected nor a false positive
    s = score([_leak_run("torch_2x", [warn])])
    assert s["oom_capacity"]["expected"] == 1 and s["oom_capacity"]["detected"] == 0 and s["oom_messages_without_figures"] == 0


def test_l0_oom_cause_is_scored_only_where_l0_can_tell_it():
    """DCGM alone (no per-process memory): the L0 finding's cause is a default, not a reading."""
    dcgm = _f("oom_predicted", 180.0, cause="leak", level="L0", per_process_memory=False)
    nvml = _f("oom_predicted", 180.0, cause="leak", level="L0", per_process_memory=True)
    assert score([_leak_run("torch_2x", [dcgm])])["oom_predicted"]["cause_accuracy"] is None
    assert score([_leak_run("torch_2x", [nvml])])["oom_predicted"]["cause_accuracy"] == 1.0
