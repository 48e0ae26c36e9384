"""`gpuvigil bench detectors --quick`: the reduced labelled suite completes and produces a
well-formed table and JSON object whose figures are those of its counts (no target figure is
asserted: a benchmark is not a unit test, beyond a hang being named before the 600 s watchdog)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks.detectors import (
    CASE_TYPES,
    DEFAULT_RESOLUTIONS,
    MUST,
    NEGATIVE,
    POSITIVE,
    RunResult,
    clopper_pearson,
    make_case,
    parse_cases,
    parse_resolutions,
    resolution_markdown,
    run_case,
    score_resolutions,
    runs_needed,
    score,
    target_rows,
    targets_markdown,
)
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


@pytest.mark.timeout(600)  # the suite's longest test: 19 simulated runs, each observed at L0, L1, L2 and at 30 s
def test_quick_suite_completes_with_a_well_formed_table(tmp_path):
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        # One extra device sample interval (dcgm-exporter's 30 s) besides the L0 view at the
        # tick: the table's per-interval rows are checked; every interval costs a pipeline a run.
        [sys.executable, "-m", "gpuvigil", "bench", "detectors", "--quick", "--resolutions", "30", "--json", "--output", str(doc)],
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
    assert result["anomaly:unknown"]["expected"] == 1 and result["pcie_replay"]["expected"] == 1
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
    # Every markdown table of the section (the detection targets, the per-kind rows, the OOM
    # warnings, the detector costs) has as many cells in each row as in its header.
    tables: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("|"):
            if not tables or not tables[-1]:
                tables.append([])
            tables[-1].append(line)
        elif tables and tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    assert len(tables) >= 3
    for t in tables:
        assert all(len(row.split("|")) == len(t[0].split("|")) for row in t), t[0]
    [kinds] = [t for t in tables if t[0].startswith("| kind | level |")]
    assert any(line.startswith("| collective_hang |") for line in kinds)
    assert any(line.startswith("| baseline_watchdog_600s |") for line in kinds)
    assert any(t[0].startswith("| target | level |") for t in tables)
    # The L0 view at each device sample interval (NVML 1 s, 10 s, dcgm-exporter's 30 s), with a
    # computed met / not met per target and the fault time scales stated.
    assert sorted(result["resolutions"], key=float) == ["30"]
    for k, sm in result["resolutions"].items():
        assert sm["hard_negatives"]["runs"] == len(NEGATIVE), k
        assert sm["collective_hang"]["expected"] == 2, k
    [res_targets] = [t for t in tables if t[0].startswith("| target (L0) | device sample interval |")]
    assert {line.split("|")[2].strip().split(" ")[0] for line in res_targets[2:]} == {"30"}
    assert all(line.split("|")[6].strip() in ("met", "not met") for line in res_targets[2:])
    assert "### L0 by device sample interval (simulated)" in text and "Fault time scales in these runs" in text


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


# -- what a sample proves (confidence bounds in the report) ---------------------------------------
def _binom_tail_ge(k: int, n: int, p: float) -> float:
    """P(X >= k), summed exactly with integer binomial coefficients (independent of the code)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


@pytest.mark.parametrize("k, n", [(0, 10), (5, 10), (9, 10), (10, 10), (18, 18), (94, 94), (147, 150), (100, 100)])
def test_clopper_pearson_bounds_solve_the_exact_binomial_tails(k, n):
    lower, upper = clopper_pearson(k, n)
    assert 0.0 <= lower <= k / n <= upper <= 1.0
    # The lower bound is the rate at which k or more successes become a 5% event; the upper one
    # the rate at which k or fewer do.
    if k > 0:
        assert _binom_tail_ge(k, n, lower) == pytest.approx(0.05, abs=1e-6)
    else:
        assert lower == 0.0
    if k < n:
        assert 1 - _binom_tail_ge(k + 1, n, upper) == pytest.approx(0.05, abs=1e-6)
    else:
        assert upper == 1.0


def test_clopper_pearson_matches_published_values_and_the_runs_needed():
    # Beta(0.05; 5, 6) = 0.2224 (tables of the exact interval); no failure: 0.05 ** (1 / n).
    assert clopper_pearson(5, 10)[0] == pytest.approx(0.22244, abs=1e-5)
    assert clopper_pearson(100, 100)[0] == pytest.approx(0.05 ** (1 / 100), abs=1e-9)  # 97.0%: the bound of the last round
    assert runs_needed(0.98) == 149 and clopper_pearson(149, 149)[0] >= 0.98 > clopper_pearson(148, 148)[0]
    assert runs_needed(0.995) == 598 and clopper_pearson(598, 598)[0] >= 0.995 > clopper_pearson(597, 597)[0]
    # More misses, lower bound; more runs at the same share, tighter bound.
    assert clopper_pearson(95, 100)[0] < clopper_pearson(99, 100)[0]
    assert clopper_pearson(990, 1000)[0] > clopper_pearson(99, 100)[0]
    with pytest.raises(ValueError):
        clopper_pearson(11, 10)


def _hang_run(index: int, found_at: float, culprit: list[int], case_type: str = "nccl_hang") -> RunResult:
    target = {"kind": case_type, "ts": 100.0, "job": "train", "ranks": [2]}
    f = {**_f("collective_hang", found_at, level="L1"), "culprit_ranks": culprit, "cause": "software"}
    return RunResult(
        index=index, case_type=case_type, gpus=8, step_time_seconds=0.5, tick_seconds=1.0, onset=100.0, injected=[target],
        findings=[f], oom_events=[], watchdog_fire_ts={}, static_rule_fires=[], wall_seconds=1.0, ticks=300,
        level_findings={"L0": [f], "L1": [f]}, mode="outside",
    )


def test_target_rows_count_misses_and_late_findings_against_the_target():
    runs = [_hang_run(i, 105.0, [2]) for i in range(8)] + [_hang_run(8, 150.0, [2]), _hang_run(9, 105.0, [5])]
    negatives = [
        RunResult(index=10 + i, case_type="checkpoint_pause", gpus=8, step_time_seconds=0.5, tick_seconds=1.0, onset=100.0, injected=[],
                  findings=[_f("collective_hang", 120.0)] if i == 0 else [], oom_events=[], watchdog_fire_ts={}, static_rule_fires=[],
                  wall_seconds=1.0, ticks=300, level_findings={"L0": [], "L1": []})
        for i in range(4)
    ]
    by_level = {lvl: score(runs + negatives, lvl) for lvl in ("L0", "L1", "L2")}
    rows = {(r["target"], r["level"]): r for r in target_rows(by_level)}
    exact = rows[("exact culprit ranks", "L1")]
    assert (exact["k"], exact["n"]) == (9, 10) and exact["lower"] == pytest.approx(clopper_pearson(9, 10)[0]) and not exact["shown"]
    # Found 50 s after onset: late for the 30 s target, in time for the 60 s one.
    assert (rows[("hang found ≤ 30 s (p90 ≤ 30 s)", "L1")]["k"], rows[("hang found ≤ 60 s (p90 ≤ 60 s)", "L0")]["k"]) == (9, 10)
    assert rows[("culprit GPU named, culprit outside the collective", "L0")]["k"] == 9
    # The page on a checkpoint counts at L2 only (the shadows saw nothing).
    assert (rows[("hard negatives page-free", "L2")]["k"], rows[("hard negatives page-free", "L2")]["n"]) == (3, 4)
    assert rows[("hard negatives page-free", "L0")]["k"] == 4
    md = "\n".join(targets_markdown(by_level))
    assert "| exact culprit ranks | L1 | 9 / 10 | 90.0% |" in md and "not shown" in md


def test_from_dumps_rescores_runs_without_simulating(tmp_path):
    from dataclasses import asdict

    dump = tmp_path / "runs.jsonl"
    dump.write_text("".join(json.dumps(asdict(_hang_run(i, 104.0, [2]))) + "\n" for i in range(149)))
    proc = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "bench", "detectors", "--quick", "--from-dumps", str(dump), "--no-write", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["meta"]["runs"] == 149 and result["levels"]["L1"]["collective_hang"]["culprit_right"] == 149
    proc = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "bench", "detectors", "--quick", "--from-dumps", str(dump), "--no-write"],
        capture_output=True, text=True, timeout=120,
    )
    assert "| exact culprit ranks | L1 | 149 / 149 | 100.0% | ≥ 98.0% | ≥ 98.0% | shown |" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "gpuvigil", "bench", "detectors", "--from-dumps", str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--from-dumps: cannot read" in bad.stderr and "Traceback" not in bad.stderr


def test_resolutions_option():
    assert parse_resolutions(None) == DEFAULT_RESOLUTIONS == (1.0, 10.0, 30.0)
    assert parse_resolutions("30, 1,30") == (1.0, 30.0) and parse_resolutions("none") == ()
    for bad, message in (("0", "outside"), ("x", "not a number"), ("4000", "outside")):
        with pytest.raises(UserError, match=message):
            parse_resolutions(bad)


def test_each_resolution_is_scored_with_met_or_not_met():
    """The same leak run seen at 1 s (warned before the OOM) and at 30 s (not warned): each
    interval gets its own figures and its own verdict per target."""
    warn = _f("oom_predicted", 180.0, cause="leak", level="L0")
    runs = [_leak_run("torch_2x", [warn])]
    runs[0].resolution_findings = {"1": [warn], "30": []}
    by_res = score_resolutions(runs)
    assert list(by_res) == ["1", "30"]
    assert by_res["1"]["oom_predicted"]["warned_before_oom"] == 1 and by_res["30"]["oom_predicted"]["warned_before_oom"] == 0
    md = resolution_markdown(by_res, runs, quick=False)
    assert "| OOM warned before the OOM (recall) | 1 s (NVML polled at 1 s) | 1 / 1 | 100.0% | ≥ 90.0% | met |" in md
    assert "| OOM warned before the OOM (recall) | 30 s (dcgm-exporter's default) | 0 / 1 | 0.0% | ≥ 90.0% | not met |" in md
    assert "120–360 s after onset" in md and "(simulated)" in md
    for table in [b for b in md.split("\n\n") if b.startswith("|")]:
        rows = table.splitlines()
        assert all(len(r.split("|")) == len(rows[0].split("|")) for r in rows), rows[0]


def test_a_run_is_observed_at_each_resolution_on_the_same_world():
    case = make_case(CASE_TYPES.index("ecc_dbe"), seed=0, max_gpus=16, quick=True)
    case.resolutions = (1.0, 30.0)
    res = run_case(case)
    assert res.error is None
    assert sorted(res.resolution_findings) == ["1", "30"]
    # An interval no longer than the tick is the L0 shadow itself.
    assert res.resolution_findings["1"] == res.level_findings["L0"]
    for k, found in res.resolution_findings.items():
        ecc = [f for f in found if f["kind"] == "ecc"]
        assert ecc and ecc[0]["node"] == res.injected[0]["node"], (k, [f["kind"] for f in found])
    # The counters of a 30 s refresh reach the pipeline no sooner than at 1 s.
    first = {k: min(f["ts"] for f in v if f["kind"] == "ecc") for k, v in res.resolution_findings.items()}
    assert first["30"] >= first["1"]


def test_resolutions_do_not_need_the_l0_shadow():
    """Where the level shadows run no L0 pipeline, every interval (the tick's included) gets a
    pipeline of its own: the resolution rows never depend on which levels were asked for."""
    from benchmarks.detectors import ResolutionShadows
    from benchmarks.levels import LevelShadows
    from gpuvigil import config
    from gpuvigil.app.runtime import build_simulated
    from gpuvigil.sim.scenario import Scenario

    case = make_case(CASE_TYPES.index("ecc_dbe"), seed=0, max_gpus=16, quick=True)
    cfg = config.load(overrides={"pipeline": {"tick_seconds": case.tick_seconds}, "hints": {"rules": []}})
    rt = build_simulated(Scenario.model_validate(case.scenario), seed=case.index, cfg=cfg)
    shadows = LevelShadows(rt, cfg)
    try:
        del shadows.pipelines["L0"]
        sampled = ResolutionShadows(shadows, cfg, (1.0, 30.0), case.tick_seconds, seed=case.index)
        assert sorted(sampled.pipelines) == [1.0, 30.0] and sampled.every_tick == []
        for _ in range(20):
            rt.step()
            shadows.tick(rt.now)
            sampled.tick(rt.now)
        assert sorted(sampled.findings()) == ["1", "30"]
        assert sampled.samplers[1.0].passthrough and not sampled.samplers[30.0].passthrough
    finally:
        shadows.close()


def test_cheaper_cases_keep_every_other_draw():
    """--max-step, --warmup, --after and --levels change only what they name: the job, its
    size, the fault's ranks and mode of case `index` stay those of the default suite (a step
    below the cap is drawn from the same uniform, so it shrinks by the ratio of the log spans)."""
    for i in range(12):
        full = make_case(i, seed=7, max_gpus=8, quick=True, types=["nccl_hang"])
        lean = make_case(i, seed=7, max_gpus=8, quick=True, types=["nccl_hang"], max_step=2.0, warmup=40.0, after_fault=60.0, levels=("L2",))
        assert (lean.gpus, lean.scenario["faults"][0]["ranks"], lean.scenario["faults"][0]["mode"]) == (full.gpus, full.scenario["faults"][0]["ranks"], full.scenario["faults"][0]["mode"])
        assert 0.1 <= lean.step_time_seconds <= 2.0 and 40.0 <= lean.onset <= 60.0 and lean.levels == ("L2",)
        assert lean.scenario["duration_seconds"] == pytest.approx(lean.onset + 60.0)
        assert full.levels == ("L0", "L1", "L2") and full.onset >= 100.0


def test_hang_inside_share_turns_hang_runs_into_kernel_hangs_and_keeps_the_rest():
    """--hang-inside-share 1: every nccl_hang run's culprit is stuck inside a kernel; the job, its
    ranks and the runs the default draws inside are those of the default suite."""
    default = [make_case(i, seed=7, max_gpus=8, quick=True, types=["nccl_hang"]) for i in range(30)]
    inside = [make_case(i, seed=7, max_gpus=8, quick=True, types=["nccl_hang"], hang_inside_share=1.0) for i in range(30)]
    assert {c.scenario["faults"][0]["mode"] for c in inside} == {"inside"}
    assert 0 < sum(c.scenario["faults"][0]["mode"] == "inside" for c in default) < 30
    for a, b in zip(default, inside):
        assert (a.gpus, a.step_time_seconds, a.onset, a.scenario["faults"][0]["ranks"]) == (b.gpus, b.step_time_seconds, b.onset, b.scenario["faults"][0]["ranks"])
    assert [c.scenario["faults"][0]["mode"] for c in default] == [
        c.scenario["faults"][0]["mode"] for c in (make_case(i, seed=7, max_gpus=8, quick=True, types=["nccl_hang"], hang_inside_share=0.2) for i in range(30))]
    assert {make_case(i, seed=7, types=["nccl_hang"], hang_inside_share=0.0).scenario["faults"][0]["mode"] for i in range(30)} == {"outside"}


def test_l2_hang_targets_count_short_steps_and_ranks_stuck_inside_a_kernel():
    runs = [_hang_run(i, 105.0, [2]) for i in range(8)] + [_hang_run(8, 112.0, [2]), _hang_run(9, 104.0, [])]
    runs[9].mode = "inside"
    runs[1].mode = "inside"
    by_level = {"L2": score(runs, "L2")}
    rows = {r["target"]: r for r in target_rows(by_level) if r["level"] == "L2"}
    assert (rows["hang found ≤ 10 s, steps ≤ 2 s (p90 ≤ 10 s)"]["k"], rows["hang found ≤ 10 s, steps ≤ 2 s (p90 ≤ 10 s)"]["n"]) == (9, 10)
    assert rows["exact culprit ranks, steps ≤ 2 s"]["k"] == 9
    assert (rows["exact culprit ranks, culprit stuck inside a kernel"]["k"], rows["exact culprit ranks, culprit stuck inside a kernel"]["n"]) == (1, 2)
    md = "\n".join(targets_markdown(by_level))
    assert "| hang found ≤ 10 s, steps ≤ 2 s (p90 ≤ 10 s) | L2 | 9 / 10 | 90.0% |" in md and md.count("| not met |") == 2


def test_recorder_can_send_the_hook_rows_as_the_real_hook_does():
    """--hook-without-wait / --hook-without-starts: the main runtime's rank_progress rows lose
    the collective wait (null) and the kernel starts (null: unknown), as the real hook on gloo sends them;
    the other streams pass as they are."""
    import polars as pl

    from benchmarks.levels import Recorder
    from gpuvigil import schemas

    rows = schemas.frame([{"ts": 1.0, "job": "j", "rank": 0, "collective_wait_seconds": 0.2, "last_started_seq": 7}], schemas.RANK_PROGRESS)
    gpu = schemas.frame([{"ts": 1.0, "node": "n", "gpu": 0}], schemas.GPU_SAMPLES)

    class Source:
        def collect(self, now):
            return {"rank_progress": rows, "gpu_samples": gpu}

    as_sim = Recorder([Source()]).collect(1.0)["rank_progress"]
    assert as_sim.select("collective_wait_seconds", "last_started_seq").row(0) == (0.2, 7)
    out = Recorder([Source()], hook_wait=False, hook_starts=False).collect(1.0)
    assert out["rank_progress"].select("collective_wait_seconds", "last_started_seq").row(0) == (None, None)
    assert out["rank_progress"].schema == rows.schema and out["gpu_samples"].equals(gpu)
    assert isinstance(out["rank_progress"], pl.DataFrame)
