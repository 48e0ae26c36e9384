"""NCCL Inspector ingest (JSON and Prometheus textfile modes) and the L1 straggler it feeds.

The record layouts are the plugin's own: the JSON object of NVIDIA/nccl
ext-profiler/inspector/README.md ("Output Example"), and the Prometheus lines exactly as
inspector_prom.cc formats them (labels comm_id, hostname, rank, slurm_job, slurm_job_id, nranks,
n_nodes, gpu_device_id, collective, coll_sn, timestamp, message_size)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.collectors.nccl_inspector import NcclInspectorCollector, iter_json_objects, json_record, prom_records
from gpuvigil.detectors.straggler_inspector import InspectorStragglerDetector
from levels_helpers import play

README_RECORD = {
    "header": {"id": "0x7f8c496ae9f661", "rank": 2, "n_ranks": 8, "nnodes": 1},
    "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "", "rec_mechanism": "profiler_plugin", "dump_timestamp_us": 1748030377748202, "hostname": "example-hostname", "pid": 1639453},
    "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184, "coll_exec_time_us": 61974, "coll_algobw_gbs": 277.210914, "coll_busbw_gbs": 485.119099},
}


def _prom(rank: int, sn: int, exec_us: float, job="4242") -> str:
    labels = (
        f'comm_id="0xd152c00f111816",hostname="pool0-0002",rank="{rank}",slurm_job="train",slurm_job_id="{job}",nranks="8",'
        f'n_nodes="1",gpu_device_id="GPU{rank}",collective="AllReduce",coll_sn="{sn}",timestamp="2025-10-17T03:31:47Z",message_size="2.00GB"'
    )
    return f"nccl_algorithm_bandwidth_gbs{{{labels}}} 180.5\nnccl_bus_bandwidth_gbs{{{labels}}} 315.9\nnccl_collective_exec_time_microseconds{{{labels}}} {exec_us:g}\n"


def test_readme_json_record():
    row = json_record(README_RECORD, "job-1", 0.0)
    assert row["rank"] == 2 and row["n_ranks"] == 8 and row["coll_sn"] == 1407 and row["coll"] == "AllReduce"
    assert row["exec_time_us"] == 61974 and row["msg_size_bytes"] == 17179869184 and row["node"] == "example-hostname"
    assert row["ts"] == 1748030377.748202 and row["comm_id"] == "0x7f8c496ae9f661"


def test_prometheus_textfile_snapshot():
    rows, bad = prom_records(_prom(4, 228924, 11873.0), None, 99.0)
    assert bad == 0 and len(rows) == 1
    r = rows[0]
    assert r["job"] == "4242" and r["rank"] == 4 and r["gpu"] == 4 and r["coll_sn"] == 228924
    assert r["exec_time_us"] == 11873.0 and r["busbw_gbs"] == 315.9 and r["msg_size_bytes"] == 2 * (1 << 30) and r["n_ranks"] == 8


def test_collector_reads_json_incrementally_and_prom_on_rewrite(tmp_path):
    job = tmp_path / "job-5"
    job.mkdir()
    log = job / "nccl-inspector-0.log"
    rec = dict(README_RECORD)
    log.write_text(json.dumps(rec) + "\n" + json.dumps(rec, indent=2)[:40])  # the second is still being written
    c = NcclInspectorCollector(tmp_path)
    out = c.collect(1.0)["collective_progress"]
    assert out.height == 1 and out["job"].to_list() == ["job-5"] and out.schema == schemas.COLLECTIVE_PROGRESS
    with log.open("w") as fh:  # the plugin appends; rewrite the same prefix plus the rest
        fh.write(json.dumps(rec) + "\n" + json.dumps({**rec, "coll_perf": {**rec["coll_perf"], "coll_sn": 1408}}, indent=2) + "\n")
    out = c.collect(2.0)["collective_progress"]
    assert out["coll_sn"].to_list() == [1408]
    assert c.collect(3.0) == {}
    (job / "nccl_inspector_metrics_GPU-abc.prom").write_text(_prom(1, 77, 900.0))
    out = c.collect(4.0)["collective_progress"]
    assert out["coll_sn"].to_list() == [77] and out["job"].to_list() == ["job-5"]
    assert c.errors == 0


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_garbage_never_raises(text):
    for obj, _end in iter_json_objects(text):
        json_record(obj, "j", 0.0)
    prom_records(text, "j", 0.0)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["header", "metadata", "coll_perf", "rank", "coll_sn", "coll_exec_time_us", "dump_timestamp_us", "hostname"]), c, max_size=4), max_leaves=12))
def test_odd_structures_give_a_row_or_none(obj):
    row = json_record(obj, "j", 0.0)
    assert row is None or isinstance(row["rank"], int)


def test_rank_arriving_last_is_the_l1_straggler():
    """Peers wait ~120 ms per collective for rank 5, which arrives last and waits ~3 ms; the job
    completes a collective every ~250 ms: rank 5 computes (0.25-0.003)/(0.25-0.12) ≈ 1.9× longer."""
    ticks = []
    for t in range(1, 121):
        rows = [
            {"ts": float(t), "job": "j", "rank": r, "node": "n0", "gpu": r, "comm_id": "c", "coll": "AllReduce", "coll_sn": 4 * t, "exec_time_us": 3000.0 if r == 5 else 120000.0 + 1000 * (r % 3)}
            for r in range(8)
        ]
        ticks.append((float(t), {"collective_progress": schemas.frame(rows, schemas.COLLECTIVE_PROGRESS)}))
    found = play(InspectorStragglerDetector(), ticks)
    assert found and found[0].culprit_ranks == [5] and found[0].evidence["level"] == "L1"
    assert 1.7 < found[0].evidence["slowdown"] < 2.1


def test_equal_ranks_are_not_stragglers():
    ticks = [
        (float(t), {"collective_progress": schemas.frame([{"ts": float(t), "job": "j", "rank": r, "coll_sn": 4 * t, "exec_time_us": 20000.0 + 500 * r} for r in range(8)], schemas.COLLECTIVE_PROGRESS)})
        for t in range(1, 121)
    ]
    assert play(InspectorStragglerDetector(), ticks) == []
