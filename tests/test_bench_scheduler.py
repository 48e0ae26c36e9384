"""`gpuvigil bench scheduler --quick` on the trace excerpts in tests/data/traces (see its README):
the JSON is well formed, the four placement policies are compared side by side, and the fault
replay reports both arms."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import benchmarks.report
import benchmarks.scheduler as bench
from gpuvigil.cli import main

DATA = Path(__file__).parent / "data" / "traces"


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    doc = tmp_path_factory.mktemp("doc") / "benchmarks.md"
    original = benchmarks.report.DEFAULT_DOC
    benchmarks.report.DEFAULT_DOC = doc
    try:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["bench", "scheduler", "--trace", str(DATA / "alibaba-gpu-v2023"), "--quick", "--json"])
    finally:
        benchmarks.report.DEFAULT_DOC = original
    return rc, json.loads(out.getvalue()), doc.read_text()


def test_quick_bench_json_is_well_formed(quick_result):
    rc, res, _ = quick_result
    assert rc == 0
    assert set(res["policies"]) == {"first_fit", "best_fit", "fgd", "ours"}
    for summary in res["policies"].values():
        assert 0.0 <= summary["unallocated_gpu_share_at_100"] <= 1.0
        assert summary["unallocated_gpus_at_max_load"] >= 0
    placement = res["placement"]
    assert placement["nodes"] == 61 and placement["gpus"] == 314
    for policy in bench.POLICIES:
        levels = placement["policies"][policy]["levels"]
        assert [lv["arrived_load"] for lv in levels] == [0.8, 0.9, 1.0, 1.1]
        # Before the cluster fills, everything that arrived is allocated (no departures).
        assert levels[0]["unallocated_gpu_share"] == pytest.approx(0.2, abs=0.02)
        shares = [lv["unallocated_gpu_share"] for lv in levels]
        assert shares == sorted(shares, reverse=True)  # tasks never leave
        assert all(0 <= lv["fragmented_gpu_share"] <= lv["unallocated_gpu_share"] + 1e-9 for lv in levels)


def test_quick_bench_fault_replay_has_both_arms(quick_result):
    _, res, _ = quick_result
    f = res["faults"]
    for arm in ("with_hints", "without_hints"):
        x = f[arm]
        assert x["faults_injected"] > 0 and x["jobs_submitted"] > 0
        assert 0 < x["goodput"] <= 1 and x["gpu_hours_lost"] >= 0
        assert x["queue_p95_hours"] >= x["queue_p50_hours"] >= 0
        assert not any(isinstance(v, float) and math.isnan(v) for v in x.values())
    # The same fault arrivals hit both arms.
    assert f["with_hints"]["faults_injected"] == f["without_hints"]["faults_injected"]
    assert f["with_hints"]["gpu_hours_lost"] < f["without_hints"]["gpu_hours_lost"]


def test_quick_bench_writes_its_doc_section(quick_result):
    _, res, doc = quick_result
    assert "<!-- bench:scheduler:start -->" in doc and "<!-- bench:scheduler:end -->" in doc
    for policy in bench.POLICIES:
        assert f"{policy} unalloc." in doc
    assert "GPU-hours lost" in doc and res["cycle"]["gpus"] == 1000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/nonexistent/trace"], "not found"),
        (["--trace", str(DATA / "alibaba-gpu-v2023"), "--faults", "/nonexistent"], "not found"),
        (["--trace", str(DATA / "alibaba-gpu-v2023"), "--seeds", "0"], "--seeds"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "scheduler", "--no-write", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_malformed_trace_files_are_user_errors(tmp_path):
    (tmp_path / "openb_node_list_gpu_node.csv").write_text("sn,gpu\nx,8\n")
    with pytest.raises(bench.UserError, match="missing column"):
        bench.load_nodes(tmp_path)
    (tmp_path / "fault_trace.json").write_text('[{"node_id": "a"}]')
    with pytest.raises(bench.UserError, match="malformed"):
        bench.load_faults(tmp_path)
    (tmp_path / "fault_trace.json").write_text("{not json")
    with pytest.raises(bench.UserError, match="not valid JSON"):
        bench.load_faults(tmp_path)


# -- parsers: random and truncated input never crash or hang ------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAULTS = (DATA / "infinitehbd-faults" / "fault_trace.json").read_bytes()
NODES = (DATA / "alibaba-gpu-v2023" / "openb_node_list_gpu_node.csv").read_bytes()
PODS = (DATA / "alibaba-gpu-v2023" / "openb_pod_list_default.csv").read_bytes()


def _load_or_user_error(fn, folder):
    try:
        fn(folder)
    except bench.UserError as exc:
        assert str(exc)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(FAULTS)), junk=st.binary(max_size=40))
def test_fault_trace_parser_survives_truncation(tmp_path, cut, junk):
    (tmp_path / "fault_trace.json").write_bytes(FAULTS[:cut] + junk)
    _load_or_user_error(bench.load_faults, tmp_path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fault_trace_parser_survives_random_bytes(tmp_path, data):
    (tmp_path / "fault_trace.json").write_bytes(data)
    _load_or_user_error(bench.load_faults, tmp_path)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut_nodes=st.integers(0, len(NODES)), cut_pods=st.integers(0, len(PODS)), junk=st.binary(max_size=30))
def test_trace_csv_parsers_survive_truncation(tmp_path, cut_nodes, cut_pods, junk):
    (tmp_path / "openb_node_list_gpu_node.csv").write_bytes(NODES[:cut_nodes] + junk)
    (tmp_path / "openb_pod_list_default.csv").write_bytes(PODS[:cut_pods] + junk)
    _load_or_user_error(bench.load_nodes, tmp_path)
    _load_or_user_error(bench.load_tasks, tmp_path)


def _fixed_result() -> dict:
    levels = (0.8, 1.0, 1.3)
    unalloc = {"first_fit": (0.2, 0.06, 0.055), "best_fit": (0.2, 0.075, 0.071), "fgd": (0.2, 0.057, 0.054), "ours": (0.2, 0.052, 0.045)}
    placement = {
        "nodes": 1213,
        "gpus": 6212,
        "trace_tasks": 8152,
        "seeds": 3,
        "policies": {
            p: {"levels": [{"arrived_load": lv, "unallocated_gpu_share": u, "unallocated_gpus": u * 6212, "fragmented_gpu_share": u * 0.8} for lv, u in zip(levels, us, strict=True)]}
            for p, us in unalloc.items()
        },
    }
    arm = {
        "faults_injected": 584,
        "gpu_hours_lost": 0.0,
        "goodput": 0.99,
        "queue_p50_hours": 0.0,
        "queue_p95_hours": 20.0,
        "wait_incl_hang_p95_hours": 21.0,
        "jct_p95_hours": 150.0,
        "jobs_completed": 100,
        "restarts": 10,
        "node_hours_out_of_service": 5000.0,
    }
    params = bench.FaultSimParams().__dict__
    return {
        "quick": False,
        "seconds": 300.0,
        "placement": placement,
        "faults": {"params": params, "with_hints": {**arm, "gpu_hours_lost": 600.0}, "without_hints": {**arm, "gpu_hours_lost": 1000.0, "queue_p95_hours": 21.0}},
        "cycle": {"gpus": 10000, "pending_jobs": 5000, "placed_in_first_cycle": 1085, "first_cycle_seconds": 0.9, "first_cycle_cpu_seconds": 0.5, "full_cluster_cycle_seconds": 0.05, "full_cluster_cycle_cpu_seconds": 0.02},
    }


def test_markdown_matches_golden_file():
    """The docs/benchmarks.md section for a fixed result (regenerate: GPUVIGIL_REGEN_GOLDEN=1)."""
    import os

    golden = DATA / "golden_bench_scheduler.md"
    text = bench.markdown(_fixed_result()) + "\n"
    if os.environ.get("GPUVIGIL_REGEN_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
