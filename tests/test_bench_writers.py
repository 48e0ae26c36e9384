"""The markdown writers of the benchmarks: each section says which command wrote it and where its
data came from, and computes met / not met for every target from the figures (p50 and p99 alike),
with "not measured" where the run did not measure what a target needs."""

from __future__ import annotations

import pytest

from benchmarks import api, hook, pipeline, soak
from benchmarks.report import command, targets_table, verdict, write_section


def verdicts(rows) -> dict[str, str]:
    return {what: verdict(ok) for what, _threshold, _measured, ok in rows}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "pipeline", "--gpus", "1000,10000", "--ticks", "5", "--json"], "gpuvigil bench pipeline --gpus 1000,10000 --ticks 5"),
        (["bench", "hook", "--no-write", "--quick"], "gpuvigil bench hook --quick"),
        (["bench", "soak", "--workdir", "/tmp/a b"], "gpuvigil bench soak --workdir '/tmp/a b'"),
        ([], "gpuvigil bench api"),  # called from Python, not the CLI
    ],
)
def test_command_is_the_cli_line_without_output_flags(argv, expected):
    kind = expected.split()[2]
    assert command(kind, argv) == expected


def test_targets_table_writes_each_verdict():
    rows = targets_table([("a", "< 1", "0.5", True), ("b", "< 1", "2", False), ("c", "< 1", "–", None)])
    assert rows[2:] == ["| a | < 1 | 0.5 | met |", "| b | < 1 | 2 | not met |", "| c | < 1 | – | not measured |"]


def hook_result(p99_pct: float, import_ms: float | None) -> dict:
    res = {"python": "3.11", "torch": None, "step_call_ns": 1759.0,
           "publish_no_torch": {"mean_us": 32.7, "p50_us": 5.7, "p99_us": 24.6},
           "end_to_end": {"steps": 60, "without_s": 6.0, "with_s": 6.01, "publishes": 6, "overhead_pct": 0.17},
           "modelled_overhead_pct_p50": 0.0045, "modelled_overhead_pct_p99": p99_pct}
    if import_ms is not None:
        res["import"] = {"runs": 11, "median_ms": import_ms, "min_ms": import_ms, "median_cpu_ms": import_ms, "load_average": 1.0,
                         "median_rss_added_mb": 2.6, "heavy_modules_loaded": []}
    return res


@pytest.mark.parametrize(
    "p99_pct, import_ms, p99_verdict, import_verdict",
    [
        (1.0015, 119.3, "not met", "not met"),  # a p99 publish of 10 ms and a slow import are flagged
        (0.09, 12.0, "met", "met"),
        (0.09, None, "met", "not measured"),
    ],
)
def test_hook_judges_the_p99_model_and_the_import(p99_pct, import_ms, p99_verdict, import_verdict):
    res = hook_result(p99_pct, import_ms)
    v = verdicts(hook.targets(res))
    assert v["modelled overhead per 100 ms step, p50 publish"] == "met"
    assert v["modelled overhead per 100 ms step, p99 publish"] == p99_verdict
    assert v["`import gpuvigil.hook.instrument`, wall (median)"] == import_verdict
    text = hook.markdown(res, "gpuvigil bench hook --quick")
    assert "Written by `gpuvigil bench hook --quick`." in text
    assert f"| modelled overhead per 100 ms step, p99 publish | < 1% | {p99_pct:.4f}% | {p99_verdict} |" in text


def pipeline_row(gpus: int, tick_cpu: float, all_due: float | None, samples: float, rss_gb: float, steady: bool = True) -> dict:
    return {"gpus": gpus, "tick_cpu_seconds_mean": tick_cpu, "all_due_tick_cpu_seconds_max": all_due, "gpu_metric_samples_per_cpu_second": samples,
            "peak_rss_bytes": int(rss_gb * 1e9), "covered_seconds": 200.0 if steady else 10.0,
            "window_horizon_seconds": {"gpu_samples": 20.0, "allocator_stats": 30.0, "rank_progress": 180.0}}


@pytest.mark.parametrize(
    "rows, expected",
    [
        # Without a 100,000-GPU run the tick targets are not measured, whatever the small sizes did.
        ([pipeline_row(1000, 0.02, 0.03, 1.4e6, 0.14), pipeline_row(10_000, 0.04, 0.06, 7e6, 0.3)],
         ["not measured", "not measured", "met", "met"]),
        # At 100,000 GPUs: mean met, worst (all due) not met; throughput judged at the largest size.
        ([pipeline_row(1000, 0.02, 0.03, 1.4e6, 0.14), pipeline_row(100_000, 0.4, 1.2, 2.9e6, 1.7)],
         ["met", "not met", "not met", "met"]),
        # Memory before the steady state is not the steady-state peak.
        ([pipeline_row(100_000, 0.4, 0.7, 7e6, 1.0, steady=False)], ["met", "met", "met", "not measured"]),
        ([pipeline_row(100_000, 0.4, None, 7e6, 2.1)], ["met", "not measured", "met", "not met"]),
    ],
)
def test_pipeline_targets(rows, expected):
    assert [verdict(ok) for *_, ok in pipeline.targets(rows)] == expected


def test_api_judges_p50_and_p99_of_every_endpoint_and_the_capacity():
    res = {"latency": {"verdict": {"n": 100, "p50_ms": 1.4, "p99_ms": 80.6, "max_ms": 90.0},
                       "hints_newest": {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}},
           "req_per_cpu_second": 512.0}
    assert verdicts(api.targets(res)) == {
        "`verdict` latency, p50": "met",
        "`verdict` latency, p99": "not met",
        "`hints_newest` latency, p50": "not measured",
        "`hints_newest` latency, p99": "not measured",
        "requests per CPU-second of the server (one core)": "met",
    }


def soak_result(**over) -> dict:
    r = {"rss_slope_medians_mb_per_hour": 12.0, "steady_window_s": 420.0, "tick_seconds": 5.0, "tick_p50_s": 0.7, "tick_p99_s": 3.3,
         "lost": [], "paged_twice": [], "outbox_left": 0, "dead_letters": 0, "api_p50_ms": 0.8, "api_p99_ms": 86.0, "tmpfs": True,
         "serve_alive_through_full_disk": True, "day_seconds": 10.0}
    return {**r, **over}


@pytest.mark.parametrize(
    "over, what, expected",
    [
        ({}, "API reads, p99", "not met"),
        ({}, "API reads, p50", "met"),
        ({"tick_p99_s": 6.2}, "tick duration p99 (period 5 s)", "not met"),
        ({"rss_slope_medians_mb_per_hour": 74.6}, "serve RSS slope once its windows were full (fit through the minute medians)", "not met"),
        ({"lost": ["abc"]}, "page findings lost (raised, never paged)", "not met"),
        ({"tmpfs": False}, "serve kept running while the disk was full", "not measured"),
        # A window of a minute or two cannot show a trend: not judged either way.
        ({"rss_slope_medians_mb_per_hour": 12.0, "steady_window_s": 90.0}, "serve RSS slope once its windows were full (fit through the minute medians)", "not measured"),
        ({"rss_slope_medians_mb_per_hour": float("nan")}, "serve RSS slope once its windows were full (fit through the minute medians)", "not measured"),
        ({}, "serve RSS slope once its windows were full (fit through the minute medians)", "met"),
    ],
)
def test_soak_targets(over, what, expected):
    assert verdicts(soak.targets(soak_result(**over)))[what] == expected


def test_write_section_replaces_its_own_section_only(tmp_path):
    doc = tmp_path / "benchmarks.md"
    write_section("a", "first a", doc)
    write_section("b", "first b", doc)
    write_section("a", "second a", doc)
    text = doc.read_text()
    assert "second a" in text and "first a" not in text and "first b" in text
    assert text.index("<!-- bench:a:start -->") < text.index("<!-- bench:b:start -->")
