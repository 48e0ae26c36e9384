"""Shared components: the topology readers (YAML, Slurm topology.conf, a saved ibnetdiscover
output) and "the switch, not 40 nodes": findings on many nodes under one component, with the nodes
outside it quiet, are one component_fault incident whose one action replaces the nodes' drains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hyp import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import config
from gpuvigil.model import Finding, FindingKind, HintAction, Severity
from gpuvigil.pipeline.components import ComponentCorrelator, ComponentsConfig, binomial_tail
from gpuvigil.pipeline.core import Pipeline
from gpuvigil.pipeline.topology import Topology, TopologyError

DATA = Path(__file__).parent / "data" / "topology"


# -- topology readers ---------------------------------------------------------------------------


def test_yaml_topology_per_node_and_per_component_hostlists():
    text = """
nodes:
  gpu-001: {leaf_switch: leaf-01, spine: spine-a, rack: r01, pdu: pdu-01, cooling_loop: loop-1}
components:
  rack: {r01: "gpu-[001-004]", r02: "gpu-[005-008]"}
  leaf_switch: {leaf-01: "gpu-[001-008]"}
  rail: {rail-0: ["gpu-[001-002]", "gpu-003"]}
"""
    t = Topology.from_yaml_text(text)
    assert t.placement["gpu-001"] == {"leaf_switch": ["leaf-01"], "spine": ["spine-a"], "rack": ["r01"], "pdu": ["pdu-01"], "cooling_loop": ["loop-1"], "rail": ["rail-0"]}
    assert t.components("gpu-007", "rack") == ["r02"] and t.members()[("leaf_switch", "leaf-01")] == [f"gpu-{i:03d}" for i in range(1, 9)]
    assert t.members()[("rail", "rail-0")] == ["gpu-001", "gpu-002", "gpu-003"]


@pytest.mark.parametrize("text", ["- a\n", "nodes: {n1: leaf}\n", "nodez: {}\n", "nodes: [unclosed\n", "components: {rack: [1, 2]}\n"])
def test_bad_yaml_topology_is_one_error(text):
    with pytest.raises(TopologyError):
        Topology.from_yaml_text(text)


def test_slurm_topology_conf_leaf_and_spine():
    t = Topology.from_slurm_topology_text((DATA / "topology.conf").read_text())
    assert len(t) == 12
    assert t.placement["gpu-006"] == {"leaf_switch": ["leaf02"], "spine": ["spine1"]}
    assert t.placement["gpu-010"] == {"leaf_switch": ["leaf03"], "spine": ["spine2"]}


def test_ibnetdiscover_leaves_spines_and_node_names():
    t = Topology.from_ibnetdiscover_text((DATA / "ibnetdiscover.txt").read_text())
    spines = "S-fc6a1c0300e8a100+S-fc6a1c0300e8a200"  # both spines describe themselves alike: GUIDs name them
    assert t.placement == {
        "gpu-001": {"leaf_switch": ["leaf-01"], "spine": [spines]},
        "gpu-002": {"leaf_switch": ["leaf-01"], "spine": [spines]},
        "gpu-003": {"leaf_switch": ["leaf-02"], "spine": [spines]},
        "gpu-004": {"leaf_switch": ["leaf-02"], "spine": [spines]},
    }


def test_ibnetdiscover_garbage_reads_as_nothing():
    assert len(Topology.from_ibnetdiscover_text("Switch 64 \"S-zz\"\n[1] \"H-\x00\"\n\x1b[31m\n" * 50)) == 0


def test_sources_merge_yaml_first(tmp_path):
    (tmp_path / "t.yaml").write_text("components:\n  rack: {r1: 'gpu-[001-004]'}\n  leaf_switch: {override: gpu-001}\n")
    t = Topology.load(topology_file=tmp_path / "t.yaml", slurm_topology=DATA / "topology.conf")
    assert t.placement["gpu-001"] == {"rack": ["r1"], "leaf_switch": ["override"], "spine": ["spine1"]}
    assert t.placement["gpu-002"]["leaf_switch"] == ["leaf01"]
    with pytest.raises(TopologyError, match="cannot read"):
        Topology.load(topology_file=tmp_path / "absent.yaml")


# -- the correlator -----------------------------------------------------------------------------

# 256 nodes: 16 leaves of 16, 4 spines of 4 leaves, racks of 4 nodes, cooling loops of 32 nodes
# (two leaves each: cooling follows rows, not switches).
def fat_tree() -> Topology:
    t = Topology()
    for i in range(256):
        n = f"gpu-{i:03d}"
        t.place(n, "leaf_switch", f"leaf-{i // 16}")
        t.place(n, "spine", f"spine-{i // 64}")
        t.place(n, "rack", f"rack-{i // 4}")
        t.place(n, "pdu", f"pdu-{i // 8}")
        t.place(n, "cooling_loop", f"loop-{i // 32}")
    return t


def link_down(node: str, ts: float) -> Finding:
    return Finding(kind=FindingKind.IB_LINK_DOWN, severity=Severity.PAGE, ts=ts, node=node, evidence={"device": "mlx5_0", "port": 1, "port_id": f"{node}/mlx5_0/1"}, summary=f"{node} mlx5_0 port 1 down", source="infiniband")


def throttle(node: str, ts: float, gpu: int = 0) -> Finding:
    return Finding(kind=FindingKind.THERMAL_THROTTLE, severity=Severity.TICKET, ts=ts, node=node, gpu=gpu, summary=f"{node} GPU {gpu} throttled", source="thermal")


def hang(job: str, culprit_nodes: list[str], ts: float) -> Finding:
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=ts, job=job, culprit_ranks=[0], evidence={"culprit_nodes": culprit_nodes}, cause="hardware", summary=f"{job} hung", source="hang")


def _run(findings_at: dict[float, list[Finding]], **over) -> ComponentCorrelator:
    c = ComponentCorrelator(ComponentsConfig(topology_file="x", **over), fat_tree())
    active: dict[str, Finding] = {}
    for t in sorted(findings_at):
        for f in findings_at[t]:
            active[f.id] = f
        c.observe(list(active.values()), t)
    return c


CASES = {
    # name: (findings per tick, what is named: [(level, component, symptom)])
    "a leaf's nodes lose their links": ({10.0 * k: [link_down(f"gpu-{16 * 3 + k:03d}", 10.0 * k)] for k in range(6)}, [("leaf_switch", "leaf-3", "link")]),
    "the same count spread over leaves of different spines": ({10.0 * k: [link_down(f"gpu-{16 * leaf:03d}", 10.0 * k)] for k, leaf in enumerate((0, 4, 8, 12, 1, 5))}, []),
    "two nodes are not a component": ({0.0: [link_down("gpu-001", 0.0), link_down("gpu-002", 0.0)]}, []),
    "a noisy fleet outside the leaf": (
        {0.0: [link_down(f"gpu-{i:03d}", 0.0) for i in list(range(16, 256, 3))] + [link_down(f"gpu-{i:03d}", 0.0) for i in (0, 1, 2)]},
        [],
    ),
    "hang culprits across one spine's leaves": (
        {30.0 * k: [hang(f"job{k}", [f"gpu-{64 + 16 * (k % 4) + k:03d}"], 30.0 * k)] for k in range(8)},
        [("spine", "spine-1", "hang")],
    ),
    "one hung job naming every node of its ranks under one leaf is one report": ({0.0: [hang("job1", [f"gpu-{48 + k:03d}" for k in range(8)], 0.0)]}, []),
    "three hung jobs with culprits under one leaf": ({30.0 * k: [hang(f"job{k}", [f"gpu-{48 + 2 * k:03d}", f"gpu-{49 + 2 * k:03d}"], 30.0 * k)] for k in range(3)}, [("leaf_switch", "leaf-3", "hang")]),
    "throttling on one cooling loop's racks": ({20.0 * k: [throttle(f"gpu-{32 + 4 * k:03d}", 20.0 * k)] for k in range(6)}, [("cooling_loop", "loop-1", "thermal")]),
    "a leaf plus one unrelated node under its spine is the leaf": (
        {0.0: [link_down("gpu-010", 0.0)], **{30.0 + k: [link_down(f"gpu-{16 + k:03d}", 30.0 + k)] for k in range(5)}},
        [("leaf_switch", "leaf-1", "link")],
    ),
    "a rack named first, then its PDU as the other rack's nodes throttle": (
        {0.0: [throttle(f"gpu-{40 + k:03d}", 0.0) for k in range(4)], 60.0: [throttle(f"gpu-{44 + k:03d}", 60.0) for k in range(3)]},
        [("rack", "rack-10", "thermal"), ("pdu", "pdu-5", "thermal")],
    ),
    "throttling in one rack": ({0.0: [throttle(f"gpu-{40 + k:03d}", 0.0, gpu=g) for k in range(4) for g in (0, 5)]}, [("rack", "rack-10", "thermal")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_components_named(case):
    findings_at, expected = CASES[case]
    c = _run(findings_at)
    assert [(n.level, n.component, n.symptom) for n in c.history] == expected


def test_a_component_finding_carries_the_evidence_per_node():
    c = _run({10.0 * k: [link_down(f"gpu-{48 + k:03d}", 10.0 * k)] for k in range(5)})
    [f] = c.observe([], 40.0)
    assert f.kind == FindingKind.COMPONENT_FAULT and f.node is None and f.severity == Severity.PAGE
    ev = f.evidence
    assert ev["component"] == "leaf-3" and ev["level"] == "leaf_switch" and ev["nodes"] == [f"gpu-{i:03d}" for i in range(48, 53)]
    assert ev["drain_nodes"] == [f"gpu-{i:03d}" for i in range(48, 64)] and ev["component_nodes"] == 16 and ev["outside_nodes_affected"] == 0
    assert ev["per_node"][0] == "gpu-048 (+0 s): ib_link_down: gpu-048 mlx5_0 port 1 down"
    assert f.summary == "leaf switch leaf-3: link faults on 5 of its 16 nodes within 40 s, 0 of the other 240: the leaf switch, not the nodes"
    # named at the third node (t=20); the fourth and fifth joined it
    assert ev["named_ts"] == 20.0 and ev["first_symptom_ts"] == 0.0


def test_a_wider_component_supersedes_the_part_named_first():
    c = _run({0.0: [throttle(f"gpu-{40 + k:03d}", 0.0) for k in range(4)], 60.0: [throttle(f"gpu-{44 + k:03d}", 60.0) for k in range(3)]})
    assert [(n.component, n.superseded_by) for n in c.history] == [("rack-10", "pdu:pdu-5"), ("pdu-5", None)]
    [f] = c.observe([], 90.0)
    assert f.evidence["component"] == "pdu-5" and f.evidence["nodes"] == [f"gpu-{i:03d}" for i in range(40, 47)] and f.evidence["first_symptom_ts"] == 0.0


def test_a_component_expires_when_its_nodes_go_quiet():
    c = _run({0.0: [link_down(f"gpu-{48 + k:03d}", 0.0) for k in range(4)]}, window_seconds=60)
    assert c.observe([], 30.0) and c.observe([], 61.0) == []


def test_binomial_tail():
    assert binomial_tail(0, 5, 0.3) == 1.0 and binomial_tail(6, 5, 0.3) == 0.0
    assert binomial_tail(1, 1, 0.25) == pytest.approx(0.25)
    assert binomial_tail(2, 3, 0.5) == pytest.approx(0.5)  # P(2) + P(3) = 3/8 + 1/8
    assert binomial_tail(3, 16, 0.002) == pytest.approx(560 * 0.002**3, rel=0.02)


# -- in the pipeline: one incident, one action, the nodes' drains held back --------------------


class Scripted:
    name = "scripted"

    def __init__(self, script: dict[float, list[Finding]]):
        self.script = script

    def detect(self, window):
        return [f.model_copy() for t, fs in self.script.items() if t <= window.now for f in fs]


def _pipeline(tmp_path: Path, script, topology: bool = True) -> Pipeline:
    topo = tmp_path / "topology.yaml"
    topo.write_text(yaml.safe_dump({"components": {"leaf_switch": {f"leaf-{k}": f"gpu-[{16 * k:03d}-{16 * k + 15:03d}]" for k in range(8)}}}))
    over = {"pipeline": {"detector_every_seconds": {"default": 0}, "components": {"topology_file": str(topo) if topology else None}}}
    return Pipeline([], [Scripted(script)], cfg=config.load(overrides=over))


def _drive(p: Pipeline, until: float, step: float = 10.0):
    out = []
    t = 0.0
    while t <= until:
        out.append(p.tick(t))
        t += step
    return out


def test_switch_failure_is_one_incident_and_one_action(tmp_path):
    script = {10.0 * k: [link_down(f"gpu-{48 + k:03d}", 10.0 * k)] for k in range(6)}
    results = _drive(_pipeline(tmp_path, script), 300.0)
    hints = [h for r in results for h in r.new_hints]
    assert {h.action for h in hints} == {HintAction.DRAIN_NODE}
    assert sorted(h.node for h in hints) == [f"gpu-{i:03d}" for i in range(48, 64)]
    assert len({h.params["component_action"] for h in hints}) == 1 and all(h.params["component"] == "leaf_switch:leaf-3" for h in hints)
    assert all(h.finding_kind == FindingKind.COMPONENT_FAULT and len(h.params["component_nodes"]) == 16 for h in hints)
    # no node was cordoned on its own: the held cordons were replaced by the component's action
    assert results[-1].active_findings and all(h.action != HintAction.CORDON_NODE for h in hints)
    comp = [f for r in results for f in r.new_findings if f.kind == FindingKind.COMPONENT_FAULT]
    assert len(comp) == 1 and comp[0].incident_role == "opened"
    later = [f for f in results[-1].active_findings if f.kind == FindingKind.IB_LINK_DOWN]
    assert len(later) == 6 and all(f.incident == comp[0].incident and f.incident_role == "evidence" for f in later)


def test_without_a_topology_each_node_is_cordoned(tmp_path):
    script = {10.0 * k: [link_down(f"gpu-{48 + k:03d}", 10.0 * k)] for k in range(6)}
    results = _drive(_pipeline(tmp_path, script, topology=False), 300.0)
    hints = [h for r in results for h in r.new_hints]
    assert sorted(h.node for h in hints) == [f"gpu-{48 + k:03d}" for k in range(6)] and {h.action for h in hints} == {HintAction.CORDON_NODE}
    assert not any(f.kind == FindingKind.COMPONENT_FAULT for r in results for f in r.new_findings)


def test_a_lone_node_fault_is_cordoned_after_the_hold(tmp_path):
    script = {0.0: [link_down("gpu-017", 0.0)]}
    p = _pipeline(tmp_path, script)
    results = _drive(p, 200.0)
    when = [(r.now, h.node, h.action) for r in results for h in r.new_hints]
    assert when == [(120.0, "gpu-017", HintAction.CORDON_NODE)]  # held hold_seconds (120), then issued
    assert p.hints_replaced_by_component == 0


def test_a_lasting_component_is_one_finding_and_one_action_at_any_tick_spacing(tmp_path):
    # a leaf down for hours, ticks 10 s apart then 30 min apart (a replay of sparse history)
    script = {10.0 * k: [link_down(f"gpu-{48 + k:03d}", 10.0 * k)] for k in range(6)}
    p = _pipeline(tmp_path, script)
    ticks = [10.0 * k for k in range(20)] + [200.0 + 1800.0 * k for k in range(1, 8)]
    results = [p.tick(t) for t in ticks]
    comp = [f for r in results for f in r.new_findings if f.kind == FindingKind.COMPONENT_FAULT]
    hints = [h for r in results for h in r.new_hints]
    assert len(comp) == 1 and len(hints) == 16 and not any(f.kind == FindingKind.COMPONENT_FAULT for r in results for f in r.cleared_findings)


# -- untrusted files: the readers survive anything ----------------------------------------------



_IB_LINES = st.sampled_from([
    'Switch\t64 "S-fc6a1c0300e8b200"\t\t# "MF0;leaf-01:MQM9700/U1" enhanced port 0 lid 3 lmc 0',
    '[1]\t"H-0c42a10300a1b2c0"[1](c42a10300a1b2c0) \t\t# "gpu-001 HCA-1" lid 11 4xNDR',
    '[33]\t"S-fc6a1c0300e8a100"[1]\t\t# "Quantum Mellanox Technologies" lid 1 4xNDR',
    'Ca\t1 "H-0c42a10300a1b2c0"\t\t# "gpu-001 HCA-1"', "", "vendid=0x2c9", '[2]\t"H-"[', '# "', "SwitchName=x Nodes=gpu-[1-",
])


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.one_of(_IB_LINES, st.text(max_size=80)), max_size=40))
def test_ibnetdiscover_and_slurm_readers_never_raise(lines):
    text = "\n".join(lines)
    for topo in (Topology.from_ibnetdiscover_text(text), Topology.from_slurm_topology_text(text)):
        for node, levels in topo.placement.items():
            assert isinstance(node, str) and all(isinstance(c, str) for comps in levels.values() for c in comps)


@settings(max_examples=examples(200), deadline=None)
@given(st.text(max_size=300))
def test_yaml_topology_reader_fails_only_with_a_topology_error(text):
    try:
        Topology.from_yaml_text(text)
    except TopologyError:
        pass
