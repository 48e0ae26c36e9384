"""Production's apply loop (`gpuvigil.app.acting.Acting`) with its guards, against a REAL Slurm
cluster (munged + slurmctld + four slurmd, tests/slurm_cluster.py; 8 gres GPUs per node):

- a storm of fatal XIDs on more nodes than the circuit breaker's cap drains exactly the cap,
  pages once, and drains nothing more until a person closes the breaker (`gpuvigil breaker`);
- a restart in the middle of a drain (a job still running on the draining node) resumes from the
  stored quarantine state: no scontrol command is repeated, and a hint stored before the restart
  whose cause is gone is never acted on;
- an operator's drain is never resumed, neither one found in place nor one laid over ours.
- a named component's drain (a leaf switch over 3 nodes) is one action for the breaker.

Findings enter through the real Pipeline and HintStore (a scripted detector stands in for the
XID detector, which has its own tests on real kernel lines).
"""

from __future__ import annotations

import os

import pytest

from gpuvigil.app.acting import Acting
from gpuvigil.api.store import HintState, HintStore
from gpuvigil.cli.main import main
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.scheduler.quarantine import ActingConfig, BreakerConfig, QuarantineStore, State, store_beside
from gpuvigil.scheduler.slurm import Slurm, SlurmAdapter
from h_api_helpers import pipeline_into
from slurm_cluster import SlurmCluster, missing_binaries

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]
NODES = ("gvnode1", "gvnode2", "gvnode3", "gvnode4")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmd as root (SlurmdUser=root); run the tests as root")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=NODES).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def _nodes_idle_after_each_test(request):
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").reset()


def xid(node: str, gpu: int = 0) -> Finding:
    return Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0.0, node=node, gpu=gpu, xid=79, evidence={"fatal": True},
                   summary=f"XID 79 (GPU has fallen off the bus) on {node} GPU {gpu}", source="xid", cause="hardware")


def updates(slurm: Slurm) -> list[list[str]]:
    return [c for c in slurm.calls if c[:2] == ["scontrol", "update"]]


def drained_by_us(cluster: SlurmCluster) -> list[str]:
    return [n for n in NODES if cluster.node_state(n)[0] in ("drained", "draining") and cluster.node_state(n)[1].startswith("gpuvigil ")]


CFG = ActingConfig(hold_down_seconds=60, breaker=BreakerConfig(window_seconds=900, max_node_fraction=0.5, max_gpu_fraction=0.5, max_nodes=20))


def test_a_storm_drains_exactly_the_cap_pages_once_and_waits_for_a_person(cluster, tmp_path, capsys):
    slurm = Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    pages: list[tuple[str, bool]] = []
    storm = [xid(n) for n in NODES[:3]]  # 3 of 4 nodes; the cap is 50% of 4 = 2
    with HintStore(tmp_path / "hints.db") as store:
        pipe = pipeline_into(store, [storm] * 6)
        acting = Acting("slurm", "on", store=store, adapter=SlurmAdapter(slurm, store=store), cfg=CFG,
                        quarantine=store_beside(tmp_path / "hints.db"), pager=lambda text, firing: pages.append((text, firing)))
        pipe.sinks.append(acting)
        pipe.tick(1000.0)
        assert drained_by_us(cluster) == ["gvnode1", "gvnode2"]
        assert [c[2] for c in updates(slurm)] == ["NodeName=gvnode1", "NodeName=gvnode2"]
        assert len(pages) == 1 and pages[0][1] is True
        assert pages[0][0].startswith("breaker open: 1 node(s) would have been drained (8 GPU(s)), top causes xid (1)")
        held = next(h for h in store.hints() if h.node == "gvnode3")
        assert held.state == HintState.PENDING and held.state_reason.startswith("breaker open: would run: scontrol update NodeName=gvnode3 State=DRAIN")
        assert acting.machine.get("gvnode3").state == State.SUSPECT

        # The storm goes on: detection goes on, nothing more is drained, no second page.
        for t in (1010.0, 1020.0, 1030.0):
            pipe.tick(t)
        assert drained_by_us(cluster) == ["gvnode1", "gvnode2"]
        assert len(updates(slurm)) == 2 and len(pages) == 1
        assert acting.counts[("cordon_node", "breaker_open")] == 1  # said once per hint, not per tick
        fams = {f.name: f for f in acting.families()}
        assert "gpuvigil_breaker_open" in fams

        # Status for the person on call (exit 1 while open), then a close.
        assert main(["breaker", "status", "--hint-db", str(tmp_path / "hints.db")]) == 1
        out = capsys.readouterr().out
        assert "breaker slurm: OPEN since" in out and "1 node(s) would have been drained; causes xid (1)" in out
        assert main(["breaker", "close", "--hint-db", str(tmp_path / "hints.db"), "--who", "ann", "--note", "driver rolled back"]) == 0
        assert "breaker slurm: closed by operator:ann" in capsys.readouterr().out

        # Closed: the cause still live on gvnode3 is acted on now, and the close resolves the page.
        pipe.tick(1040.0)
        assert drained_by_us(cluster) == ["gvnode1", "gvnode2", "gvnode3"]
        assert [c[2] for c in updates(slurm)] == ["NodeName=gvnode1", "NodeName=gvnode2", "NodeName=gvnode3"]
        assert pages[1:] == [("breaker closed: acting resumes", False)]
        hist = acting.machine.history("gvnode3")
        assert [(t.from_state, t.to_state) for t in hist] == [("healthy", "suspect"), ("suspect", "cordoned")]
        assert hist[1].detail.startswith("scontrol drained gvnode3: gpuvigil cordon xid")
        # `gpuvigil why NODE`: the node's state and every move, with who and why.
        assert main(["why", "gvnode3", "--hint-db", str(tmp_path / "hints.db")]) == 0
        out = capsys.readouterr().out
        fid = storm[2].id
        assert "  node: cordoned since 1970-01-01T00:17:20Z (scontrol drained gvnode3: gpuvigil cordon xid" in out
        assert f"    cause xid {fid} (active): xid: XID 79 (GPU has fallen off the bus) on gvnode3 GPU 0" in out
        assert "healthy -> suspect by rule (finding): xid: xid: XID 79 (GPU has fallen off the bus) on gvnode3 GPU 0" in out
        assert "suspect -> cordoned by rule (applied):" in out and f"[{fid}]" in out


def test_a_restart_mid_drain_repeats_no_action_and_acts_on_nothing_stale(cluster, tmp_path):
    job = cluster.sbatch("-w", "gvnode1", "--gres=gpu:2", "--wrap", "sleep 300")
    cluster.wait_for(lambda: cluster.job_field(job, "JobState") == "RUNNING", 60, f"job {job} running")
    hints_db = tmp_path / "hints.db"
    first = Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    with HintStore(hints_db) as store, store_beside(hints_db) as q:
        pipe = pipeline_into(store, [[xid("gvnode1")]] * 3)
        pipe.sinks.append(Acting("slurm", "on", store=store, adapter=SlurmAdapter(first, store=store), cfg=CFG, quarantine=q))
        pipe.tick(1000.0)
        assert cluster.node_state("gvnode1")[0] == "draining"  # the job still runs there
        # A second cause was stored, then the process died before acting on it.
        stale = pipeline_into(store, [[xid("gvnode2")]])
        stale.tick(1001.0)
        assert any(h.node == "gvnode2" and h.state == HintState.PENDING for h in store.hints())
    assert [c[2] for c in updates(first)] == ["NodeName=gvnode1"]

    # The restart: new pipeline, store and loop over the same files. gvnode1's XID is still
    # reported; gvnode2's is not (its cause is gone).
    again = Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    with HintStore(hints_db) as store, store_beside(hints_db) as q:
        acting = Acting("slurm", "on", store=store, adapter=SlurmAdapter(again, store=store), cfg=CFG, quarantine=q)
        assert acting.machine.get("gvnode1").state == State.CORDONED
        pipe = pipeline_into(store, [[xid("gvnode1")]] * 2)
        pipe.sinks.append(acting)
        for t in (1100.0, 1110.0):
            pipe.tick(t)
        assert updates(again) == []  # nothing repeated, nothing stale acted on
        assert cluster.node_state("gvnode1")[0] == "draining" and cluster.job_field(job, "JobState") == "RUNNING"
        assert cluster.node_state("gvnode2")[0] == "idle"
        # Quiet from 1711 on (an XID clears 600 s after its last report), past the hold-down:
        # resumed once.
        for t in (1711.0, 1712.0, 1772.0, 1773.0, 1774.0):
            pipe.tick(t)
        assert [c for c in updates(again)] == [["scontrol", "update", "NodeName=gvnode1", "State=RESUME"]], [t.line() for t in acting.machine.history("gvnode1")]
        assert acting.machine.get("gvnode1").state == State.HEALTHY
        assert cluster.node_state("gvnode1")[0].rstrip("*") in ("mixed", "allocated")  # back in service, the job still on it


def test_an_operators_drain_is_never_resumed(cluster, tmp_path):
    slurm = Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    cluster.cmd("scontrol", "update", "NodeName=gvnode2", "State=DRAIN", "Reason=bad DIMM, ticket 4711")
    with HintStore(tmp_path / "hints.db") as store:
        pipe = pipeline_into(store, [[xid("gvnode2"), xid("gvnode3")]] * 2)
        acting = Acting("slurm", "on", store=store, adapter=SlurmAdapter(slurm, store=store), cfg=CFG, quarantine=QuarantineStore(tmp_path / "q.db"))
        pipe.sinks.append(acting)
        pipe.tick(1000.0)
        assert acting.machine.get("gvnode2").state == State.OPERATOR_HELD
        assert acting.machine.get("gvnode3").state == State.CORDONED
        # An operator takes over our drain of gvnode3 with a reason of their own.
        cluster.cmd("scontrol", "update", "NodeName=gvnode3", "State=DRAIN", "Reason=reseat GPU 0, ticket 4712")
        for t in (1010.0, 1611.0, 1612.0, 1672.0, 1673.0, 1674.0):  # cleared at 1611, hold-down 60 s
            pipe.tick(t)
        assert [c for c in updates(slurm) if "State=RESUME" in c] == []
        assert cluster.node_state("gvnode2") == ("drained", "bad DIMM, ticket 4711")
        assert cluster.node_state("gvnode3") == ("drained", "reseat GPU 0, ticket 4712")
        assert acting.machine.get("gvnode3").state == State.OPERATOR_HELD
        assert acting.machine.history("gvnode3")[-1].rule == "operator_owns_node"
        # A new cause on a held node is left to the operator: nacked, not applied.
        pipe2 = pipeline_into(store, [[xid("gvnode2", gpu=5)]])
        pipe2.sinks.append(acting)
        pipe2.tick(1700.0)
        [h] = [h for h in store.hints() if h.node == "gvnode2" and h.state == HintState.NACKED]
        assert h.state_reason == "gvnode2 is operator_held: gpuvigil leaves it to the operator"


def test_a_restart_between_the_drain_and_its_record_does_not_drain_again(cluster, tmp_path):
    """The loop writes its intent before it runs the command; a process that stopped after the
    command and before the outcome finds the node drained by gpuvigil and records it."""
    slurm = Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    finding = xid("gvnode4")
    with HintStore(tmp_path / "hints.db") as store, QuarantineStore(tmp_path / "q.db") as q:
        pipe = pipeline_into(store, [[finding]] * 2)
        pipe.tick(1000.0)  # the hint is stored; no loop ran yet
        [hint] = [h.to_hint() for h in store.hints()]
        adapter = SlurmAdapter(slurm, store=store)
        acting = Acting("slurm", "on", store=store, adapter=adapter, cfg=CFG, quarantine=q)
        # What the stopped process left: the intent on the record, the drain done in Slurm.
        rec = acting.machine.get("gvnode4")
        acting.machine.add_cause(rec, finding_id=finding.id, kind="xid", summary=hint.reason, hint_id=hint.id)
        acting.machine.transition(rec, State.SUSPECT, now=1000.0, rule="finding", cause="xid", finding_ids=[finding.id])
        rec.action, rec.hint = hint.action.value, hint.to_json_dict()
        acting.machine.save(rec)
        adapter.drain_node("gvnode4", adapter.node_reason(hint))
        before = len(updates(slurm))
        pipe.sinks.append(acting)
        pipe.tick(1001.0)
        assert len(updates(slurm)) == before  # not drained again
        assert acting.machine.get("gvnode4").state == State.CORDONED
        assert acting.machine.history("gvnode4")[-1].rule == "found_applied"
        assert store.get_hint(hint.id).state == HintState.ACKED


def test_a_named_components_drain_is_one_action_for_the_breaker(cluster, tmp_path):
    """A leaf switch over 3 of the 4 nodes fails: the component's drain takes its 3 nodes as one
    action, although 3 node removals would be over the cap (2): no trip, no page."""
    import yaml

    from gpuvigil import config
    from gpuvigil.pipeline.core import Pipeline
    from h_api_helpers import ScriptedDetector

    topo = tmp_path / "topology.yaml"
    topo.write_text(yaml.safe_dump({"components": {"leaf_switch": {"leaf-a": "gvnode[1-3]", "leaf-b": "gvnode4"}}}))
    down = [Finding(kind=FindingKind.IB_LINK_DOWN, severity=Severity.PAGE, ts=0.0, node=n, evidence={"device": "mlx5_0", "port": 1, "port_id": f"{n}/mlx5_0/1"},
                    summary=f"{n} mlx5_0 port 1 down", source="infiniband") for n in NODES[:3]]
    cfg = config.load(overrides={"pipeline": {"components": {"topology_file": str(topo), "min_nodes": 3, "max_p_value": 0.5, "max_fleet_share": 0.9}}})
    slurm = Slurm(timeout=20, env={"SLURM_CONF": str(cluster.conf)})
    pages: list[tuple[str, bool]] = []
    with HintStore(tmp_path / "hints.db") as store:
        pipe = Pipeline([], [ScriptedDetector([down] * 30)], sinks=[store], cfg=cfg)
        acting = Acting("slurm", "on", store=store, adapter=SlurmAdapter(slurm, store=store), cfg=CFG,
                        quarantine=store_beside(tmp_path / "hints.db"), pager=lambda text, firing: pages.append((text, firing)))
        pipe.sinks.append(acting)
        for t in range(0, 300, 10):
            pipe.tick(1000.0 + t)
        hints = store.hints()
        assert {h.params.get("component") for h in hints if h.node in NODES[:3]} == {"leaf_switch:leaf-a"}
        assert drained_by_us(cluster) == list(NODES[:3])
        assert pages == [] and not acting.breaker.state().open
