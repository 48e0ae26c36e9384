"""The remediation ladder (gpuvigil/scheduler/remediation.py) against a REAL Slurm cluster (munged +
slurmctld + two slurmd, tests/slurm_cluster.py), driven by production's apply loop
(`gpuvigil.app.acting.Acting`) behind the real pipeline and hint store.

- A node gpuvigil drained for a fatal XID whose NVIDIA action is RESET_GPU climbs the ladder once
  its cause is quiet: GPU reset (nobody holds the GPU), check; the check fails, so it stays
  drained in Slurm; reboot (it is drained: no job left), check; the check passes and only then is
  it resumed.
- Lemon rule: remediated twice within the window, the third time it goes to RMA instead, stays
  drained, and the evidence bundle holds the record, its transitions, the node's findings with
  the XID history, the kernel-log excerpt, the ECC/row-remap report and the bug report.
- Whose fault, on the same cluster (it starts once per module): an application XID under one
  Slurm job drains nothing; under a second job on the same GPU it drains the node.

The commands are small scripts written here that record their arguments (a test machine has no
GPU to reset); what the bundle quotes is real: the kernel log is
tests/data/public/kernel_dmesg_hung_task.log (leptonai/gpud#117: Xid 45 lines among a hung-task
report) and the ECC report is the H200 capture's `nvidia-smi -q` (tests/data/h200/nvidia-smi-q.txt,
copied unchanged from the capture, see docs/testing.md).
"""

from __future__ import annotations

import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from gpuvigil import config
from gpuvigil.app.acting import Acting
from gpuvigil.api.store import HintStore
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.scheduler.quarantine import ActingConfig, QuarantineMachine, QuarantineStore, Record, State
from gpuvigil.scheduler.remediation import Ladder, RemediationConfig, SlurmDrainer, remediation_config
from gpuvigil.scheduler.slurm import Slurm, SlurmAdapter
from h_api_helpers import pipeline_into
from slurm_cluster import SlurmCluster, missing_binaries

DATA = Path(__file__).parent / "data"
KERNEL_LOG = DATA / "public" / "kernel_dmesg_hung_task.log"
SLURM = pytest.mark.services  # these start the real cluster
SMI_Q = DATA / "h200" / "nvidia-smi-q.txt"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmd as root (SlurmdUser=root); run the tests as root")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=("gvnode1", "gvnode2")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def slurm(cluster):
    yield Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    cluster.reset()


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def xid_reset(node: str) -> Finding:
    """A fatal XID whose NVIDIA action is RESET_GPU (119, GSP RPC timeout) on GPU 1."""
    return Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0.0, node=node, gpu=1, xid=119, source="xid", cause="hardware",
                   evidence={"xid": 119, "fatal": True, "action": "RESET_GPU", "fault": "infrastructure", "count": 3},
                   summary=f"XID 119 (GSP RPC timeout) on {node} GPU 1: fatal, cordon the node; NVIDIA action RESET_GPU.")


def ladder_cfg(tmp: Path, **over) -> RemediationConfig:
    log = tmp / "commands.log"
    cfg = {
        "enabled": True,
        "gpu_reset": {"command": [script(tmp / "reset.sh", f'echo "reset $1 $2" >> {log}'), "{node}", "{gpu}"], "timeout_seconds": 10},
        "gpu_processes": {"command": [script(tmp / "procs.sh", "exit 0"), "{gpu}"], "timeout_seconds": 10},
        "reboot": {"command": [script(tmp / "reboot.sh", f'echo "reboot $1" >> {log}'), "{node}"], "timeout_seconds": 10},
        # The check passes only once the flag file exists.
        "verify": {"command": [script(tmp / "check.sh", f'echo "check $1" >> {log}; test -f {tmp}/healthy'), "{node}"], "timeout_seconds": 10, "pass_exit_codes": [0]},
        "bundle": {
            "dir": str(tmp / "rma"),
            "kernel_log": {"command": ["cat", str(KERNEL_LOG)]},
            "ecc": {"command": ["cat", str(SMI_Q)]},
            "bug_report": {"command": [script(tmp / "nvidia-bug-report.sh", 'echo "bug report of $(hostname)" | gzip > "$2.gz"'), "--output-file", "{out}"]},
        },
        **over,
    }
    return remediation_config(config.load(overrides={"remediation": cfg}))


def commands(tmp: Path) -> list[str]:
    f = tmp / "commands.log"
    return f.read_text().splitlines() if f.exists() else []


@SLURM
def test_the_ladder_returns_a_node_only_after_its_check_passes(cluster, slurm, tmp_path):
    node = cluster.nodes[0]
    finding = xid_reset(node)
    with HintStore(tmp_path / "hints.db") as store:
        adapter = SlurmAdapter(slurm, store=store)
        q = QuarantineStore(tmp_path / "q.db")
        machine = QuarantineMachine(q)
        steps = Ladder(ladder_cfg(tmp_path), machine, findings_of=lambda n: [json.loads(t) for t in store.findings_json(node=n)], scheduler=SlurmDrainer(adapter))
        pipe = pipeline_into(store, [[finding]], clear_after=30.0)
        acting = Acting("slurm", "on", store=store, adapter=adapter, cfg=ActingConfig(), quarantine=q, steps=steps)
        pipe.sinks.append(acting)

        pipe.tick(1000.0)
        assert acting.machine.get(node).state == State.CORDONED
        assert cluster.node_state(node)[0] == "drained"
        pipe.tick(1010.0)
        pipe.tick(1700.0)  # the finding cleared (xid: 600 s without it): its cause is quiet
        assert acting.machine.get(node).state == State.REMEDIATING
        assert commands(tmp_path) == []  # quiet alone does nothing but start the ladder
        pipe.tick(1701.0)
        assert commands(tmp_path) == [f"reset {node} 1"]  # the XID table says a reset suffices; nobody holds GPU 1
        assert acting.machine.get(node).state == State.VERIFYING
        pipe.tick(1702.0)
        assert commands(tmp_path)[-1] == f"check {node}"
        assert acting.machine.get(node).state == State.REMEDIATING  # the check failed
        assert cluster.node_state(node)[0] == "drained"
        pipe.tick(1703.0)
        assert commands(tmp_path)[-1] == f"reboot {node}"  # drained already (no job on it): the reboot runs
        assert acting.machine.get(node).state == State.VERIFYING and cluster.node_state(node)[0] == "drained"
        (tmp_path / "healthy").write_text("ok")  # after the reboot the check passes
        pipe.tick(1704.0)
        cluster.wait_for(lambda: cluster.node_state(node)[0] == "idle", 30, f"{node} idle after its check passed")
        assert acting.machine.get(node).state == State.HEALTHY
        assert [c for c in slurm.calls if "State=RESUME" in c] == [["scontrol", "update", f"NodeName={node}", "State=RESUME"]]
        hist = acting.machine.history(node)
        assert [t.to_state for t in hist] == ["suspect", "cordoned", "remediating", "verifying", "remediating", "verifying", "healthy"]
        assert [t.rule for t in hist][3:6] == ["remediated", "verify_failed", "remediated"]
        assert hist[3].cause.startswith("gpu_reset: exit 0") and hist[5].cause.startswith("reboot: exit 0")
        assert hist[4].cause.startswith(f"check failed ({tmp_path}/check.sh {node}): exit 1")
        assert hist[-1].cause.startswith("every cause quiet, check passed")


@SLURM
def test_a_lemon_goes_to_rma_with_its_evidence_bundle(cluster, slurm, tmp_path):
    node = cluster.nodes[1]
    finding = xid_reset(node)
    episode = [[finding], [], [], [], [], [], []]
    times = [0.0, 10.0, 700.0, 701.0, 702.0, 703.0, 704.0]  # xid clears after 600 s
    with HintStore(tmp_path / "hints.db") as store:
        adapter = SlurmAdapter(slurm, store=store)
        q = QuarantineStore(tmp_path / "q.db")
        (tmp_path / "healthy").write_text("ok")
        cfg = ladder_cfg(tmp_path, lemon={"remediations": 2, "window_seconds": 86400})
        steps = Ladder(cfg, QuarantineMachine(q), findings_of=lambda n: [json.loads(t) for t in store.findings_json(node=n)], scheduler=SlurmDrainer(adapter))
        pipe = pipeline_into(store, episode * 3, clear_after=30.0, hint_cooldown=0.0)
        acting = Acting("slurm", "on", store=store, adapter=adapter, cfg=ActingConfig(), quarantine=q, steps=steps)
        pipe.sinks.append(acting)
        for k in range(2):  # two remediations that pass: returned each time
            for t in times:
                pipe.tick(10_000.0 + 2000.0 * k + t)
            assert acting.machine.get(node).state == State.HEALTHY, acting.machine.history(node)[-1].line()
            cluster.wait_for(lambda: cluster.node_state(node)[0] == "idle", 30, f"{node} idle after remediation {k + 1}")
        for t in times:
            pipe.tick(14_000.0 + t)
        rec = acting.machine.get(node)
        assert rec.state == State.RMA
        assert commands(tmp_path).count(f"reset {node} 1") == 2  # no third reset: the lemon rule took it
        assert cluster.node_state(node)[0] == "drained"  # RMA: gpuvigil never returns it
        last = acting.machine.history(node)[-1]
        assert last.rule == "rma" and last.cause.startswith("lemon: 2 remediations within 1 days (limit 2)")
        bundle = Path(last.evidence["bundle"])
        assert bundle.parent == tmp_path / "rma" and bundle.name.startswith(f"rma-{node}-")

    with tarfile.open(bundle) as tar:
        names = sorted(tar.getnames())
        files = {n: tar.extractfile(n).read() for n in names}
    assert names == sorted(["manifest.json", "record.json", "transitions.json", "findings.json", "xid_ecc_history.json",
                            "kernel_log.txt", "ecc_row_remap.txt", "nvidia-bug-report.log.gz"])
    manifest = json.loads(files["manifest.json"])
    assert (manifest["node"], manifest["members"]) == (node, names)
    assert manifest["reason"].startswith("lemon:")
    record = json.loads(files["record.json"])
    assert record["rma_reason"].startswith("lemon:") and finding.id in record["causes"]
    transitions = json.loads(files["transitions.json"])
    assert [t["rule"] for t in transitions].count("remediated") == 2
    xids = json.loads(files["xid_ecc_history.json"])
    assert [(x["kind"], x["xid"], x["gpu"], x["evidence"]["action"]) for x in xids] == [("xid", 119, 1, "RESET_GPU")]
    assert [f["id"] for f in json.loads(files["findings.json"])] == [finding.id]
    kernel = files["kernel_log.txt"].decode().splitlines()
    assert len(kernel) == 6 and all("NVRM: Xid (PCI:0000:61:00): 45" in ln for ln in kernel)  # the hung-task lines left out
    assert files["ecc_row_remap.txt"] == SMI_Q.read_bytes()
    import gzip

    assert gzip.decompress(files["nvidia-bug-report.log.gz"]).startswith(b"bug report of ")


def test_the_bundle_says_what_it_could_not_have(tmp_path):
    """No nvidia-bug-report.sh on this host and no ECC command: the bundle says so in its manifest
    and holds the rest."""
    q = QuarantineStore(":memory:")
    machine = QuarantineMachine(q)
    cfg = remediation_config(config.load(overrides={"remediation": {"bundle": {
        "dir": str(tmp_path), "kernel_log": {"command": ["cat", str(KERNEL_LOG)]}, "ecc": {"command": None},
        "bug_report": {"command": [str(tmp_path / "absent" / "nvidia-bug-report.sh"), "--output-file", "{out}"]}}}}))
    rec = Record(key="n0/3", node="n0", gpu=3)
    path = Ladder(cfg, machine).bundle(rec, 1_800_000_000.0, "every rung tried")
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
        manifest = json.loads(tar.extractfile("manifest.json").read())
    assert names == ["findings.json", "kernel_log.txt", "manifest.json", "record.json", "transitions.json", "xid_ecc_history.json"]
    assert manifest["parts"]["ecc_row_remap.txt"] == "not configured"
    assert manifest["parts"]["nvidia-bug-report.log.gz"].endswith("nvidia-bug-report.sh not found on this host")
    assert path.name == "rma-n0-gpu3-20270115T080000Z.tar.gz"


@pytest.mark.parametrize(
    "xid, processes, expected",
    [
        (119, "", None),  # RESET_GPU, nobody holds it: reset
        (79, "", "does not say a GPU reset suffices"),  # fallen off the bus: RESTART_BM
        (119, "4242\n", "a process holds GPU 1: 4242"),
    ],
)
def test_a_gpu_is_reset_only_where_the_table_says_it_suffices_and_nobody_holds_it(tmp_path, xid, processes, expected):
    cfg = ladder_cfg(tmp_path, gpu_processes={"command": [script(tmp_path / "p.sh", f"printf '{processes}'")]})
    f = xid_reset("n0").model_copy(update={"xid": xid})
    machine = QuarantineMachine(QuarantineStore(":memory:"))
    lad = Ladder(cfg, machine, findings_of=lambda n: [f.to_json_dict()])
    rec = Record(key="n0", node="n0", state=State.REMEDIATING)
    machine.add_cause(rec, finding_id=f.id, kind="xid", summary=f.summary)
    skip = lad._skip(rec, "gpu_reset")
    assert (skip is None) if expected is None else (expected in skip)


def test_a_command_that_hangs_is_a_failed_rung_with_its_timeout_recorded(tmp_path):
    cfg = ladder_cfg(tmp_path, gpu_reset={"command": ["sleep", "5"], "timeout_seconds": 0.3}, reboot={"command": None})
    f = xid_reset("n0")
    machine = QuarantineMachine(QuarantineStore(":memory:"))
    lad = Ladder(cfg, machine, findings_of=lambda n: [f.to_json_dict()])
    rec = Record(key="n0", node="n0", state=State.REMEDIATING)
    machine.add_cause(rec, finding_id=f.id, kind="xid", summary=f.summary)
    r = lad.remediate(rec, 100.0)
    runs = rec.steps["ladder"]["runs"]
    assert [(x["rung"], x["outcome"]) for x in runs] == [("gpu_reset", "failed"), ("reboot", "skipped")]
    assert runs[0]["timed_out"] and runs[0]["detail"].startswith("timed out after")
    assert r.status == "rma" and "gpu_reset failed; reboot skipped" in r.detail and Path(r.evidence["bundle"]).is_file()


def test_serve_and_act_use_the_ladder_when_it_is_enabled(tmp_path):
    from gpuvigil.app.acting import make_acting
    from gpuvigil.scheduler.quarantine import HoldDown

    with HintStore(tmp_path / "hints.db") as store:
        on = make_acting("slurm", "on", store=store, cfg=config.load(overrides={"remediation": {"enabled": True}}))
        off = make_acting("slurm", "on", store=store, cfg=config.defaults())
        assert isinstance(on.steps, Ladder) and isinstance(on.steps.scheduler, SlurmDrainer)
        assert on.steps.cfg.verify.command == ["gpuvigil", "preflight"]
        assert isinstance(off.steps, HoldDown)


def test_a_rung_running_when_gpuvigil_stopped_is_not_run_again(tmp_path):
    """The record says a reboot was running (gpuvigil was killed during it): a new process's ladder
    does not reboot again; the check decides, and a failed check goes on to RMA, not a reboot."""
    cfg = ladder_cfg(tmp_path)
    q = QuarantineStore(tmp_path / "q.db")
    machine = QuarantineMachine(q)
    f = xid_reset("n0").model_copy(update={"xid": 79})
    rec = Record(key="n0", node="n0", state=State.REMEDIATING, action="drain_node")
    machine.add_cause(rec, finding_id=f.id, kind="xid", summary=f.summary)
    rec.steps["ladder"] = {"next": 2, "runs": [{"rung": "gpu_reset", "outcome": "skipped"}], "running": {"rung": "reboot", "ts": 50.0}}
    machine.save(rec)
    again = Ladder(cfg, QuarantineMachine(QuarantineStore(tmp_path / "q.db")), findings_of=lambda n: [f.to_json_dict()])
    rec = machine.get("n0")
    r = again.remediate(rec, 100.0)
    assert (r.status, commands(tmp_path)) == ("passed", [])
    assert r.detail.startswith("reboot: gpuvigil stopped while it ran (started 50)")
    assert "running" not in machine.get("n0").steps["ladder"]  # saved: a second restart does not see it running
    r = again.remediate(machine.get("n0"), 200.0)
    assert r.status == "rma" and commands(tmp_path) == []


def test_without_a_drain_through_the_scheduler_there_is_no_reboot(tmp_path):
    cfg = ladder_cfg(tmp_path)
    machine = QuarantineMachine(QuarantineStore(":memory:"))
    lad = Ladder(cfg, machine)
    cordoned = Record(key="n0", node="n0", state=State.REMEDIATING, action="cordon_node")
    drained = Record(key="n1", node="n1", state=State.REMEDIATING, action="drain_node")
    assert "cannot be drained first" in lad._skip(cordoned, "reboot")
    assert lad._skip(drained, "reboot") is None


@SLURM
def test_an_application_xid_under_a_second_slurm_job_drains_the_node(cluster, slurm, tmp_path):
    """Whose fault, end to end on the real cluster: the real XID 13 line (leptonai/gpud#46) on the
    GPU of Slurm job A (the GPU map read from slurmctld) is A's own bug: a ticket, nothing drained;
    the same XID on the same GPU under job B is the GPU: the node is drained and B requeued."""
    import polars as pl
    from gpuvigil.detectors.xid import XidDetector
    from gpuvigil.pipeline.core import Pipeline
    from gpuvigil.scheduler.slurm import SlurmState, SlurmStateCollector
    from test_detectors_real import _kernel_events

    node = cluster.nodes[0]
    line = _kernel_events("kernel_xids.log").filter(pl.col("xid") == 13).head(1)

    class KernelLines:
        name = "kernel_log"
        errors = 0
        at: dict[float, int] = {}

        def collect(self, now):
            gpu = self.at.get(now)
            return {} if gpu is None else {"events": line.with_columns(pl.lit(now).alias("ts"), pl.lit(node).alias("node"), pl.lit(gpu, pl.Int32).alias("gpu"))}

    def gpu_of(job):
        frames = SlurmStateCollector(SlurmState(slurm)).collect(0.0)
        return frames["allocations"].filter(pl.col("job") == job)["gpu"].to_list()

    a = cluster.sbatch("--requeue", "--gres=gpu:1", "-w", node, "--wrap", "sleep 300")
    cluster.wait_for(running_on(cluster, a), 60, f"job {a} running")
    [gpu] = gpu_of(a)
    kernel = KernelLines()
    kernel.at = {1000.0: gpu, 1100.0: gpu}
    with HintStore(tmp_path / "hints.db") as store:
        adapter = SlurmAdapter(slurm, store=store)
        pipe = Pipeline([SlurmStateCollector(SlurmState(slurm)), kernel], [XidDetector()], sinks=[store], cfg=config.defaults())
        acting = Acting("slurm", "on", store=store, adapter=adapter, cfg=ActingConfig(), quarantine=QuarantineStore(tmp_path / "q.db"))
        pipe.sinks.append(acting)
        r = pipe.tick(1000.0)
        [f] = r.new_findings
        assert (f.job, f.evidence["fault"], f.severity) == (a, "user", Severity.TICKET) and r.new_hints == []
        assert cluster.node_state(node)[0] in ("mixed", "allocated")  # not drained: A's owner fixes it
        cluster.cmd("scancel", a)
        b = cluster.sbatch("--requeue", "--gres=gpu:1", "-w", node, "--wrap", "sleep 300")
        cluster.wait_for(running_on(cluster, b), 60, f"job {b} running")
        assert gpu_of(b) == [gpu]
        r = pipe.tick(1100.0)
        [g] = r.escalated_findings
        assert (g.job, g.evidence["fault"], g.evidence["jobs_hit"], g.severity) == (b, "infrastructure", [a, b], Severity.PAGE)
        assert sorted(h.action.value for h in r.new_hints) == ["cordon_node", "requeue_job"]
        state, reason = cluster.node_state(node)
        assert "drain" in state and reason.startswith(f"gpuvigil cordon xid {g.id}")
        assert cluster.job_field(b, "Restarts") == "1" and cluster.job_field(b, "ExcNodeList") == node


def running_on(cluster, job):
    def check():
        return cluster.job_field(job, "NodeList") if cluster.job_field(job, "JobState") == "RUNNING" else None

    return check


def test_only_known_placeholders_are_filled_in():
    from gpuvigil.scheduler.remediation import Command, run_command

    run = run_command(Command(command=["awk", "BEGIN { print \"{node}/{gpu}\" }"]), node="n0", gpu=None)
    assert (run["argv"][1], run["rc"], run["stdout"]) == ('BEGIN { print "n0/" }', 0, "n0/\n")
    missing = run_command(Command(command=["/nonexistent/reset", "{gpu}"]), gpu=3)
    assert missing["rc"] is None and missing["stderr"].startswith("cannot run /nonexistent/reset")


def remap_failed(node: str) -> Finding:
    """A failed row remap on GPU 1 (NVML's failureOccurred): NVIDIA's RMA criterion."""
    return Finding(kind=FindingKind.ROW_REMAP_FAILURE, severity=Severity.PAGE, ts=0.0, node=node, gpu=1, source="ecc", cause="hardware",
                   evidence={"xids": [], "dbe_new": 0, "dbe_volatile_total": 0, "remapped_rows": 7, "remap_failure": True, "nvidia_action": "DRAIN_AND_RESET"},
                   summary=f"Row remapping failed on {node} GPU 1: the GPU can no longer repair its failing memory (NVIDIA's RMA criterion): drain the node and replace the GPU.")


@pytest.mark.parametrize(("rma_kinds", "rma"), [(None, True), ([], False)], ids=["default", "none"])
def test_a_failed_row_remap_goes_to_rma_before_any_rung(tmp_path, rma_kinds, rma):
    """A node held out by a failed row remap: by default no reset or reboot is tried (neither
    repairs it); it goes to RMA with the finding in the bundle's XID/ECC history. With no
    `rma_kinds` it climbs the ladder like any other hardware cause."""
    cfg = ladder_cfg(tmp_path, **({} if rma_kinds is None else {"rma_kinds": rma_kinds}))
    f = remap_failed("n0")
    machine = QuarantineMachine(QuarantineStore(":memory:"))
    lad = Ladder(cfg, machine, findings_of=lambda n: [f.to_json_dict()])
    rec = Record(key="n0", node="n0", state=State.REMEDIATING, action="drain_node")
    machine.add_cause(rec, finding_id=f.id, kind=f.kind.value, summary=f.summary)
    r = lad.remediate(rec, 1_800_000_000.0)
    if not rma:
        assert r.status == "passed" and commands(tmp_path) == ["reboot n0"]  # no XID says a reset suffices: the reboot rung
        return
    assert (r.status, commands(tmp_path)) == ("rma", [])
    assert r.detail.startswith("row_remap_failure: no reset or reboot repairs it")
    with tarfile.open(r.evidence["bundle"]) as tar:
        history = json.loads(tar.extractfile("xid_ecc_history.json").read())
    assert [(h["kind"], h["gpu"], h["evidence"]["remap_failure"]) for h in history] == [("row_remap_failure", 1, True)]


def test_rma_kinds_are_finding_kinds():
    with pytest.raises(config.ConfigError, match="rma_kinds"):
        remediation_config(config.load(overrides={"remediation": {"rma_kinds": ["row_remap_failed"]}}))
