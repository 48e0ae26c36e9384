"""The Slurm adapter against a REAL cluster started by these tests: munged + slurmctld + two
slurmd (Debian slurm-wlm 22.05), 8 gres GPUs per node backed by placeholder device files.

The drill: a GPU batch job runs; an ECC finding on its node goes through the real pipeline, the
hint store and production's apply loop (`gpuvigil.app.acting.Acting`) → the node is drained with a
reason naming the finding, the job is requeued away from it and runs again elsewhere; when the
cause clears the hint expires, a quiet tick does not resume the node, and it is resumed (idle,
usable again) only after the hold-down. Plus: requeue-and-hold, OOM evidence (signal 9, exit 137),
failures that leave hints pending, unsupported hints nacked, and the non-JSON fallback reader.
"""

from __future__ import annotations

import os

import pytest

from gpuvigil.app.acting import Acting
from gpuvigil.api.store import HintState, HintStore
from gpuvigil.model import Finding, FindingKind, Hint, HintAction, Severity
from gpuvigil.scheduler.quarantine import ActingConfig, QuarantineStore, State
from gpuvigil.scheduler.slurm import Slurm, SlurmAdapter, SlurmError, SlurmState, SlurmStateCollector
from h_api_helpers import pipeline_into
from slurm_cluster import SlurmCluster, missing_binaries

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmd as root (SlurmdUser=root); run the tests as root")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def slurm(cluster):
    return Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})


@pytest.fixture(autouse=True)
def _nodes_idle_after_each_test(request):
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").reset()


def ecc_on(node: str, job: str) -> Finding:
    return Finding(
        kind=FindingKind.ECC,
        severity=Severity.PAGE,
        ts=0.0,
        node=node,
        gpu=1,
        job=job,
        evidence={"ecc_dbe_volatile_total": 2},
        summary=f"2 double-bit ECC errors on {node} GPU 1",
        source="ecc",
        cause="hardware",
    )


def running_on(cluster: SlurmCluster, job: str):
    def check():
        return cluster.job_field(job, "NodeList") if cluster.job_field(job, "JobState") == "RUNNING" else None

    return check


def test_drain_requeue_resume_drill_from_a_hint(cluster, slurm, tmp_path):
    job = cluster.sbatch("--requeue", "--gres=gpu:2", "--wrap", "sleep 300")
    node = cluster.wait_for(running_on(cluster, job), 60, f"job {job} running")
    other = next(n for n in cluster.nodes if n != node)

    # What gpuvigil sees of the cluster before anything happens.
    collector = SlurmStateCollector(SlurmState(slurm))
    frames = collector.collect(0.0)
    jobs = {r["job"]: r for r in frames["jobs"].to_dicts()}
    assert (jobs[job]["state"], jobs[job]["n_gpus"], jobs[job]["restarts"]) == ("running", 2, 0)
    assert frames["allocations"].filter(frames["allocations"]["job"] == job).select("rank", "node", "gpu").rows() == [(0, node, 0), (1, node, 1)]
    nodes = {r["node"]: r for r in frames["nodes"].to_dicts()}
    assert (nodes[node]["state"], nodes[node]["n_gpus"], nodes[node]["free_gpus"], nodes[node]["rack"]) == ("up", 8, 6, "rack-a")
    assert nodes[other]["free_gpus"] == 8

    with HintStore(tmp_path / "hints.db") as store:
        adapter = SlurmAdapter(slurm, store=store)
        finding = ecc_on(node, job)
        # Reported twice, quiet for two ticks, back once, then quiet for good.
        pipe = pipeline_into(store, [[finding], [finding], [], [], [finding]], clear_after=30.0)
        acting = Acting("slurm", "on", store=store, adapter=adapter, cfg=ActingConfig(hold_down_seconds=60), quarantine=QuarantineStore(tmp_path / "q.db"))
        pipe.sinks.append(acting)  # after the store: production's apply loop acts on what the store holds
        pipe.tick(1000.0)

        hints = {h.action: h for h in store.hints()}
        assert set(hints) == {HintAction.DRAIN_NODE, HintAction.REQUEUE_JOB}
        assert all(h.state == HintState.ACKED for h in hints.values()), [(h.action, h.state, h.last_error) for h in hints.values()]

        # Drained with a reason that names the finding; Slurm drains without killing.
        state, reason = cluster.node_state(node)
        assert state in ("draining", "drained")
        assert reason.startswith(f"gpuvigil drain ecc {finding.id}: ecc: 2 double-bit ECC errors on {node} GPU 1")
        assert hints[HintAction.DRAIN_NODE].state_reason.startswith(f"scontrol drained {node}")
        assert acting.machine.get(node).state == State.DRAINING

        # Requeued away from the bad node, and running again on the other one.
        assert cluster.job_field(job, "ExcNodeList") == node
        assert cluster.job_field(job, "Restarts") == "1"
        assert cluster.wait_for(running_on(cluster, job), 60, f"job {job} running again") == other
        assert hints[HintAction.REQUEUE_JOB].state_reason == f"job {job} requeued, excluding {node}"
        cluster.wait_for(lambda: cluster.node_state(node)[0] == "drained", 30, f"{node} drained")
        frames = collector.collect(1.0)
        nodes = {r["node"]: r for r in frames["nodes"].to_dicts()}
        assert (nodes[node]["state"], nodes[node]["free_gpus"]) == ("drained", 0)
        assert nodes[node]["reason"].startswith(f"gpuvigil drain ecc {finding.id}")
        row = frames["jobs"].filter(frames["jobs"]["job"] == job).to_dicts()[0]
        assert (row["state"], row["restarts"], row["excluded_nodes"]) == ("running", 1, node)

        # The cause clears: the hints expire, but a quiet tick does not resume the node.
        pipe.tick(1010.0)
        pipe.tick(1100.0)
        assert {h.state for h in store.hints()} == {HintState.EXPIRED}
        pipe.tick(1101.0)
        assert cluster.node_state(node)[0] == "drained"
        assert acting.machine.get(node).state == State.REMEDIATING
        # It comes back: the node stays out, back to draining.
        pipe.tick(1102.0)
        assert acting.machine.get(node).state == State.DRAINING
        for t in (1200.0, 1250.0):  # quiet again, for less than the hold-down
            pipe.tick(t)
        assert cluster.node_state(node)[0] == "drained"
        resumes = [c for c in slurm.calls if "State=RESUME" in c]
        assert resumes == []
        # Quiet for the hold-down: returned to service, once.
        for t in (1261.0, 1262.0, 1263.0):
            pipe.tick(t)
        cluster.wait_for(lambda: cluster.node_state(node)[0] == "idle", 30, f"{node} idle after resume")
        assert cluster.node_state(node)[1] in ("", "none")
        assert [c for c in slurm.calls if "State=RESUME" in c] == [["scontrol", "update", f"NodeName={node}", "State=RESUME"]]
        assert [t.to_state for t in acting.machine.history(node)] == ["suspect", "draining", "remediating", "draining", "remediating", "verifying", "healthy"]

    # The node takes work again.
    again = cluster.sbatch("--gres=gpu:8", "-w", node, "--wrap", "sleep 300")
    assert cluster.wait_for(running_on(cluster, again), 60, f"job {again} on resumed {node}") == node


def test_cordon_then_requeue_and_hold_then_resume_runs_the_job_again(cluster, slurm):
    job = cluster.sbatch("--requeue", "--gres=gpu:2", "--wrap", "sleep 300")
    node = cluster.wait_for(running_on(cluster, job), 60, f"job {job} running")
    adapter = SlurmAdapter(slurm)
    cordon = Hint(action=HintAction.CORDON_NODE, ts=0, reason="xid 79: GPU fell off the bus", finding_id="f" * 16, finding_kind=FindingKind.XID, node=node)
    requeue = Hint(action=HintAction.REQUEUE_JOB, ts=0, reason="xid 79", finding_id="f" * 16, finding_kind=FindingKind.XID, job=job, params={"hold": True})
    assert adapter.apply(cordon).detail.startswith(f"scontrol drained {node}: gpuvigil cordon xid ffffffffffffffff: xid 79")
    assert adapter.apply(requeue).detail == f"job {job} requeued and held"
    # Cordon = drain without killing: the requeue, not the cordon, stopped the job.
    assert cluster.wait_for(lambda: cluster.job_field(job, "JobState") in ("PENDING", "REQUEUE_HOLD") and cluster.job_field(job, "Reason"), 30, "job held")
    assert cluster.job_field(job, "Reason") in ("JobHeldAdmin", "job_requeued_in_held_state")
    assert SlurmStateCollector(SlurmState(slurm)).collect(0)["jobs"].filter(lambda_job(job))["state"].to_list() == ["requeued"]

    adapter.resume_node(node)
    adapter.release_job(job)
    cluster.wait_for(lambda: cluster.node_state(node)[0] in ("idle", "mixed", "allocated"), 30, f"{node} back")
    assert cluster.wait_for(running_on(cluster, job), 60, f"job {job} running again") in cluster.nodes
    assert cluster.job_field(job, "Restarts") == "1"


def lambda_job(job: str):
    import polars as pl

    return pl.col("job") == job


def test_oom_evidence_from_signal_9_and_exit_137(cluster, slurm):
    killed = cluster.sbatch("--gres=gpu:1", "--wrap", "kill -9 $$")
    exit137 = cluster.sbatch("--gres=gpu:1", "--wrap", "exit 137")
    plain_failure = cluster.sbatch("--wrap", "exit 1")
    for j in (killed, exit137, plain_failure):
        cluster.wait_for(lambda j=j: cluster.job_field(j, "JobState") in ("FAILED", "OUT_OF_MEMORY"), 60, f"job {j} finished")
    for use_json in (True, False):
        collector = SlurmStateCollector(SlurmState(slurm, use_json=use_json))
        events = collector.collect(5.0)["events"]
        by_job = {r["job"]: r for r in events.to_dicts()}
        assert set(by_job) >= {killed, exit137}
        assert plain_failure not in by_job
        assert by_job[killed]["kind"] == by_job[exit137]["kind"] == "oom"
        assert by_job[killed]["source"] == "scheduler"
        assert "signal 9" in by_job[killed]["message"]
        assert "exit code 137" in by_job[exit137]["message"]
        assert by_job[killed]["node"] in cluster.nodes
        assert by_job[killed]["ts"] > 1e9  # the job's end time, epoch seconds
        jobs = {r["job"]: r["state"] for r in collector.collect(6.0)["jobs"].to_dicts()}
        assert jobs[killed] == jobs[exit137] == jobs[plain_failure] == "failed"
        # Reported once per job run, not on every collect.
        assert collector.collect(7.0)["events"].height == 0


def test_failed_command_leaves_the_hint_pending_and_a_retry_applies_it(cluster, tmp_path):
    with HintStore(tmp_path / "h.db") as store:
        pipe = pipeline_into(store, [[ecc_on("gvnode1", None)]] * 3)
        # A controller that does not answer: a conf whose SlurmctldPort nobody listens on.
        dead_conf = tmp_path / "dead.conf"
        text = cluster.conf.read_text().replace(f"SlurmctldPort={cluster.ports['slurmctld']}", "SlurmctldPort=9")
        dead_conf.write_text(text)
        dead = Acting("slurm", "on", store=store, adapter=SlurmAdapter(Slurm(timeout=3, env={"SLURM_CONF": str(dead_conf)}), store=store))
        pipe.sinks.append(dead)
        pipe.tick(100.0)
        [hint] = store.hints()
        assert hint.last_error.startswith("`sinfo --json`")  # reading the node state first
        assert hint.state == HintState.PENDING
        assert hint.attempts == 1
        assert ("timed out after 3s" in hint.last_error) or ("Unable to contact slurm controller" in hint.last_error), hint.last_error
        assert cluster.node_state("gvnode1")[0] == "idle"
        assert dead.counts[("drain_node", "failed")] == 1

        # Backoff: a retry right away is not due yet (5 s after the first failure by default).
        pipe.tick(101.0)
        assert store.get_hint(hint.id).attempts == 1
        from gpuvigil import config

        no_backoff = config.load(overrides={"api": {"slurm": {"retry_base_seconds": 0}}})
        live = SlurmAdapter(Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)}), store=store, cfg=no_backoff)
        pipe.sinks[-1] = Acting("slurm", "on", store=store, adapter=live)
        pipe.tick(102.0)
        hint = store.get_hint(hint.id)
        assert (hint.state, hint.attempts, hint.last_error) == (HintState.ACKED, 2, None)
        assert cluster.node_state("gvnode1")[0] == "drained"


@pytest.mark.parametrize(
    "hint,error",
    [
        (Hint(action=HintAction.DRAIN_NODE, ts=0, reason="r", finding_id="a" * 16, finding_kind=FindingKind.ECC, node="gvnode9"), "Slurm node gvnode9 not found"),
        (Hint(action=HintAction.DRAIN_NODE, ts=0, reason="r", finding_id="a" * 16, finding_kind=FindingKind.ECC, node="gv node State=RESUME"), "not a valid Slurm node name"),
        (Hint(action=HintAction.REQUEUE_JOB, ts=0, reason="r", finding_id="a" * 16, finding_kind=FindingKind.ECC, job="987654"), "job 987654 not found"),
        (Hint(action=HintAction.REQUEUE_JOB, ts=0, reason="r", finding_id="a" * 16, finding_kind=FindingKind.ECC, job="train-llama"), "not a Slurm job id"),
    ],
)
def test_bad_hints_fail_with_a_clear_error(cluster, slurm, hint, error):
    with pytest.raises(SlurmError, match=error):
        SlurmAdapter(slurm).apply(hint)


def test_hints_slurm_cannot_express_are_nacked_with_the_reason(cluster, slurm, tmp_path):
    with HintStore(tmp_path / "h.db") as store:
        straggler = Finding(kind=FindingKind.STRAGGLER, severity=Severity.TICKET, ts=0, node="gvnode1", gpu=3, job="1", summary="slow GPU 3")
        pipe = pipeline_into(store, [[straggler]])
        pipe.sinks.append(Acting("slurm", "on", store=store, adapter=SlurmAdapter(slurm, store=store)))
        pipe.tick(10.0)
        [hint] = store.hints()
        assert (hint.action, hint.state) == (HintAction.AVOID_GPU, HintState.NACKED)
        assert hint.state_reason.startswith("Slurm cannot take a single GPU of a node out of service")


def test_operator_drain_is_neither_overwritten_nor_undone(cluster, slurm):
    adapter = SlurmAdapter(slurm)
    hint = Hint(action=HintAction.DRAIN_NODE, ts=0, reason="ecc", finding_id="b" * 16, finding_kind=FindingKind.ECC, node="gvnode2")
    cluster.cmd("scontrol", "update", "NodeName=gvnode2", "State=DRAIN", "Reason=bad DIMM, ticket 4711")
    assert adapter.apply(hint).detail == "gvnode2 already drained by someone else (bad DIMM, ticket 4711): left as is"
    assert adapter.undo(hint) is None
    assert cluster.node_state("gvnode2") == ("drained", "bad DIMM, ticket 4711")
    # Once the operator resumed it, the hint drains it with our reason, and its expiry resumes it.
    cluster.cmd("scontrol", "update", "NodeName=gvnode2", "State=RESUME")
    assert adapter.apply(hint).detail.startswith("scontrol drained gvnode2: gpuvigil drain ecc bbbbbbbbbbbbbbbb: ecc")
    assert adapter.undo(hint) == f"scontrol resumed gvnode2: cause {'b' * 16} cleared"
    cluster.wait_for(lambda: cluster.node_state("gvnode2")[0] == "idle", 30, "gvnode2 idle")


def test_json_and_scontrol_readers_agree(cluster, slurm):
    job = cluster.sbatch("--requeue", "--gres=gpu:3", "--wrap", "sleep 300")
    cluster.wait_for(running_on(cluster, job), 60, f"job {job} running")
    cluster.cmd("scontrol", "update", "NodeName=gvnode2", "State=DRAIN", "Reason=maintenance x=1 [planned]")
    a = SlurmStateCollector(SlurmState(slurm, use_json=True)).collect(0)
    b = SlurmStateCollector(SlurmState(slurm, use_json=False)).collect(0)
    for stream in ("jobs", "nodes", "allocations"):
        assert a[stream].sort(a[stream].columns[0]).to_dicts() == b[stream].sort(b[stream].columns[0]).to_dicts(), stream
    assert SlurmState(slurm).use_json is None
    state = SlurmState(slurm)
    state.nodes()
    assert state.use_json is True  # Slurm 22.05 has --json for squeue/sinfo
    nodes = {r["node"]: r for r in a["nodes"].to_dicts()}
    assert (nodes["gvnode2"]["state"], nodes["gvnode2"]["reason"]) == ("drained", "maintenance x=1 [planned]")
