"""Parsing what Slurm 22.05 prints, on real captured output (tests/data/slurm/, recorded from the
test cluster in tests/slurm_cluster.py: a running 3-GPU job, a job killed by signal 9, a job that
exited 137, a plain failure, a requeued-and-held job, a held job, a node drained with a reason).

Golden files hold the frames gpuvigil makes of it; `pytest --update-goldens` rewrites them after a
deliberate change (review the diff). Hypothesis feeds random and truncated output:
the parsers never crash or hang, they drop malformed records and count them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from golden import check_json
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil.scheduler.slurm import (
    SlurmError,
    SlurmState,
    SlurmStateCollector,
    expand_hostlist,
    gpu_count,
    gpu_indices,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    parse_scontrol_record,
    parse_sinfo_json,
    parse_squeue_json,
)

DATA = Path(__file__).parent / "data" / "slurm"


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    # scontrol prints local times; the capture was made in UTC.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


class Recorded:
    """Answers Slurm commands with the output recorded from the real cluster."""

    def __init__(self):
        self.calls = []

    def run(self, *argv):
        self.calls.append(list(argv))
        name = {"squeue": "squeue.json", "sinfo": "sinfo.json"}.get(argv[0]) if "--json" in argv else {"job": "scontrol_show_job.txt", "node": "scontrol_show_node.txt"}[argv[-1]]
        return (DATA / name).read_text()

    def run_json(self, *argv):
        return json.loads(self.run(*argv))


def frames_as_json(frames) -> dict:
    return {name: df.to_dicts() for name, df in sorted(frames.items())}


@pytest.mark.parametrize("use_json", [True, False], ids=["json", "scontrol"])
def test_frames_from_recorded_output_match_golden(use_json):
    collector = SlurmStateCollector(SlurmState(Recorded(), use_json=use_json))
    got = frames_as_json(collector.collect(1800000000.0))
    if use_json:
        check_json(DATA / "expected_frames.json", got)
    else:  # the scontrol text path must make the same frames as the JSON path
        assert got == json.loads((DATA / "expected_frames.json").read_text())
    assert collector.errors == 0


def test_recorded_state_reads_as_expected():
    jobs = {j.job: j for j in parse_squeue_json((DATA / "squeue.json").read_text())[0]}
    assert (jobs["1"].state, jobs["1"].n_gpus, jobs["1"].gpus_by_node) == ("RUNNING", 3, [("gvnode1", [0, 1, 2])])
    assert (jobs["2"].exit_signal, jobs["2"].oom_evidence) == (9, "killed by signal 9 (SIGKILL, what the OOM killer sends)")
    assert (jobs["4"].exit_code, jobs["4"].exit_signal) == (137, None)
    assert (jobs["5"].exit_code, jobs["5"].oom_evidence) == (1, None)
    assert (jobs["3"].restarts, jobs["3"].state) == (1, "PENDING")
    nodes = {n.node: n for n in parse_sinfo_json((DATA / "sinfo.json").read_text())[0]}
    assert nodes["gvnode2"].gpuvigil_state == "drained"
    assert nodes["gvnode2"].reason == "gpuvigil drain ecc 0123456789abcdef: ecc: 2 DBE x=y"
    assert (nodes["gvnode1"].n_gpus, nodes["gvnode1"].gpus_used, nodes["gvnode1"].rack) == (8, 3, "rack-a")
    # The fallback reader sees the same.
    sjobs = {j.job: j for j in parse_scontrol_jobs((DATA / "scontrol_show_job.txt").read_text())[0]}
    assert sjobs.keys() == jobs.keys()
    for jid in jobs:
        a, b = jobs[jid], sjobs[jid]
        assert (a.state, a.n_gpus, a.restarts, a.exit_code, a.exit_signal, a.submit_ts) == (b.state, b.n_gpus, b.restarts, b.exit_code, b.exit_signal, b.submit_ts), jid
    snodes = {n.node: n for n in parse_scontrol_nodes((DATA / "scontrol_show_node.txt").read_text())[0]}
    assert {k: (v.gpuvigil_state, v.reason, v.n_gpus, v.gpus_used) for k, v in snodes.items()} == {
        k: (v.gpuvigil_state, v.reason, v.n_gpus, v.gpus_used) for k, v in nodes.items()
    }


@pytest.mark.parametrize(
    "line,expected",
    [
        ("JobId=7 JobName=a b Restarts=1", [("JobId", "7"), ("JobName", "a b"), ("Restarts", "1")]),
        ("NodeName=n1 OS=Linux 6.1 #1 SMP State=IDLE+DRAIN Reason=bad x=y [root@2026-01-01T00:00:00]",
         [("NodeName", "n1"), ("OS", "Linux 6.1 #1 SMP"), ("State", "IDLE+DRAIN"), ("Reason", "bad x=y [root@2026-01-01T00:00:00]")]),
        ("", []),
        ("no equals here", []),
    ],
)
def test_parse_scontrol_record(line, expected):
    assert parse_scontrol_record(line) == expected


@pytest.mark.parametrize(
    "expr,hosts",
    [
        ("gvnode1", ["gvnode1"]),
        ("gv[1-3]", ["gv1", "gv2", "gv3"]),
        ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
        ("r[1,3-4]n", ["r1n", "r3n", "r4n"]),
        ("(null)", []),
        ("", []),
    ],
)
def test_expand_hostlist(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    "gres,count,indices",
    [
        ("gpu:8", 8, []),
        ("gres:gpu:2", 2, []),
        ("gpu:h200:8(S:0-1)", 8, []),
        ("gpu:2(IDX:0-1)", 2, [0, 1]),
        ("gpu:h200:3(IDX:0,2-3)", 3, [0, 2, 3]),
        ("gpu:a100:2,gpu:h200:4", 6, []),
        ("(null)", 0, []),
        ("", 0, []),
    ],
)
def test_gres_parsing(gres, count, indices):
    assert gpu_count(gres) == count
    assert gpu_indices(gres) == indices


RECORDED = {name: (DATA / name).read_text() for name in ("squeue.json", "sinfo.json", "scontrol_show_job.txt", "scontrol_show_node.txt")}
PARSERS = {"squeue.json": parse_squeue_json, "sinfo.json": parse_sinfo_json, "scontrol_show_job.txt": parse_scontrol_jobs, "scontrol_show_node.txt": parse_scontrol_nodes}


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(RECORDED)), cut=st.floats(0, 1))
def test_truncated_output_never_crashes(name, cut):
    text = RECORDED[name][: int(len(RECORDED[name]) * cut)]
    try:
        records, dropped = PARSERS[name](text)
    except SlurmError:
        assert name.endswith(".json")  # a cut JSON document is a clear error, not a crash
        return
    assert dropped >= 0 and isinstance(records, list)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=400))
def test_random_text_never_crashes_the_scontrol_parsers(text):
    for parse in (parse_scontrol_jobs, parse_scontrol_nodes):
        parse(text)
        parse("JobId=" + text)
        parse("NodeName=" + text)
    parse_scontrol_record(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=60, deadline=None)
@given(records=st.lists(st.dictionaries(st.sampled_from(["job_id", "job_state", "exit_code", "nodes", "gres_detail", "tres_per_node", "name", "state", "gres", "state_flags", "job_resources", "submit_time"]), json_values, max_size=8), max_size=4))
def test_malformed_json_records_are_dropped_not_fatal(records):
    collector = SlurmStateCollector(SlurmState(Recorded()))
    jobs, dropped_jobs = parse_squeue_json(json.dumps({"jobs": records, "errors": []}))
    nodes, dropped_nodes = parse_sinfo_json(json.dumps({"nodes": records, "errors": []}))
    assert len(jobs) + dropped_jobs == len(records)
    assert len(nodes) + dropped_nodes <= len(records)
    # Whatever survives parsing makes valid frames.
    collector.frames(jobs, nodes, 0.0)


def test_collector_fits_the_collector_protocol():
    from gpuvigil.collectors.base import Collector

    collector = SlurmStateCollector(SlurmState(Recorded()))
    assert isinstance(collector, Collector)
    assert set(collector.streams) == {"jobs", "nodes", "allocations", "events"}


@pytest.mark.parametrize(
    "overrides,where",
    [
        ({"api": {"port": 70000}}, "config section 'api': port"),
        ({"api": {"stream_poll_seconds": 0}}, "config section 'api': stream_poll_seconds"),
        ({"api": {"node_health": {"unhealthy_severities": ["fatal"]}}}, "config section 'api': node_health.unhealthy_severities.0"),
        ({"api": {"slurm": {"command_timeout_seconds": 0}}}, "config section 'api.slurm': command_timeout_seconds"),
        ({"api": {"kubernetes": {"taint_effect": {"ecc": "Evict"}}}}, "config section 'api.kubernetes': taint_effect.ecc"),
    ],
)
def test_invalid_adapter_and_api_config_is_rejected_with_the_reason(overrides, where):
    from gpuvigil import config
    from gpuvigil.api.app import api_config
    from gpuvigil.scheduler.kubernetes import kubernetes_config
    from gpuvigil.scheduler.slurm import slurm_config

    # The whole config is validated at load ...
    with pytest.raises(config.ConfigError, match=where.replace(".", r"\.")):
        config.load(overrides=overrides)
    # ... and each owner's loader rejects it too.
    cfg = config.load(overrides=overrides, validate=False)
    with pytest.raises(config.ConfigError, match=where.replace(".", r"\.")):
        api_config(cfg)
        slurm_config(cfg)
        kubernetes_config(cfg)


def test_default_config_loads():
    from gpuvigil.api.app import api_config
    from gpuvigil.scheduler.kubernetes import kubernetes_config
    from gpuvigil.scheduler.slurm import slurm_config

    assert api_config().port == 8787
    assert slurm_config().command_timeout_seconds == 20
    assert kubernetes_config().taint_effect["ecc"] == "NoExecute"


@pytest.mark.parametrize(
    "state,exit_code,evidence",
    [
        ("OUT_OF_MEMORY", 0, "job state OUT_OF_MEMORY"),  # cgroup OOM (needs memory enforcement, not on the test cluster)
        ("FAILED", 9, "killed by signal 9 (SIGKILL, what the OOM killer sends)"),
        ("FAILED", 137 << 8, "exit code 137 (128 + SIGKILL: a child was OOM-killed)"),
        ("FAILED", 1 << 8, None),
        ("CANCELLED", 15, None),  # SIGTERM from scancel is not OOM evidence
        ("COMPLETED", 0, None),
    ],
)
def test_oom_evidence_from_job_state_and_wait_status(state, exit_code, evidence):
    data = json.loads(RECORDED["squeue.json"])
    record = next(j for j in data["jobs"] if j["job_id"] == 5)
    record.update(job_state=state, exit_code=exit_code)
    [job], dropped = parse_squeue_json(json.dumps({"jobs": [record]}))
    assert (job.oom_evidence, dropped) == (evidence, 0)
    events = SlurmStateCollector(SlurmState(Recorded())).frames([job], [], 0.0)["events"]
    assert events.height == (1 if evidence else 0)
    if evidence:
        assert events.row(0, named=True)["message"] == f"slurm job 5 ended {state}: {evidence}"
