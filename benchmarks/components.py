"""`gpuvigil bench components`: is the failed switch, rack PDU or cooling loop named, instead of
its nodes drained one by one?

A fat tree of HGX nodes (default 256: leaves of 16 nodes, 4 leaves per spine group, racks of 4
nodes, a PDU per 2 racks, a cooling loop per row of 8 racks, rows offset from the switches) runs
for the InfiniteHBD fault trace's span (349 days). Two kinds of faults arrive:

- **background** node faults: the trace's own fault arrivals and repair times, in order and at
  their real spacing (its 231 servers mapped onto 231 of the nodes), each turned into the finding
  gpuvigil would raise (Link Down, NIC → ib_link_down; Temperature, Fan, Power Supply →
  thermal_throttle; Suspect Machine Offline → a hang naming the node; ECC → ecc; other GPU faults
  → a fatal xid);
- **component** faults injected at random times: a leaf switch (link down on 40-100% of its nodes
  within 2 min), a spine group (hangs whose culprits spread over its leaves within 10 min), a
  cooling loop (throttling on 50-100% of its nodes as the water warms over 2-15 min), a PDU (power
  brake throttling on 50-100% of its 8 nodes within a minute).

This is a findings-level simulation: no telemetry is generated. Each node's symptom becomes its
finding after the latency of the source that sees it (InfiniBand sysfs read at the tick; DCGM
scraped every 30 s and throttling held 60 s; a hang after 5-10 min of stall), at pipeline ticks
of `--tick` seconds (30 s, dcgm-exporter's refresh). The findings run through the real
`Pipeline` twice: with the topology file (pipeline.components) and without it (every node on its
own), so that what is avoided is counted, not assumed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "tests" / "data" / "traces" / "infinitehbd-faults-full" / "fault_trace.json"
DAY = 86400.0
NODE_REMOVING = ("cordon_node", "drain_node", "avoid_gpu")

# The trace's fault descriptions → the finding gpuvigil raises for them (first match wins).
TRACE_MAP: list[tuple[str, str]] = [
    (r"Link Down|NIC|Rnic|Optical|Y-cable", "link"),
    (r"Temperature|Fan|Power Supply", "thermal"),
    (r"Suspect Machine Offline", "hang"),
    (r"ECC", "ecc"),
    (r"GPU|nvidia-smi", "xid"),
]


@dataclass
class Fleet:
    nodes: list[str]
    placement: dict[str, dict[str, str]]

    def members(self, level: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for n in self.nodes:
            out[self.placement[n][level]].append(n)
        return dict(out)


def fat_tree(nodes: int = 256, leaf: int = 16, leaves_per_spine: int = 4, rack: int = 4, pdu_racks: int = 2, loop_racks: int = 8) -> Fleet:
    names = [f"gpu-{i:04d}" for i in range(nodes)]
    placement = {}
    loop_nodes = rack * loop_racks
    for i, n in enumerate(names):
        placement[n] = {
            "leaf_switch": f"leaf-{i // leaf:02d}",
            "spine": f"spine-{i // (leaf * leaves_per_spine)}",
            "rack": f"rack-{i // rack:03d}",
            "pdu": f"pdu-{i // (rack * pdu_racks):03d}",
            # rows of racks are cooled together; the first row starts half a row in, so loops straddle switches
            "cooling_loop": f"loop-{((i + loop_nodes // 2) // loop_nodes) % max(1, nodes // loop_nodes)}",
        }
    return Fleet(names, placement)


@dataclass
class Episode:
    """One finding's life: reported from `appear` until `end`."""

    appear: float
    end: float
    finding: Any
    origin: str  # "bg:<n>" or "comp:<n>"


@dataclass
class Injected:
    id: str
    level: str
    component: str
    symptom: str
    onset: float
    nodes: list[str] = field(default_factory=list)
    first_finding: float = math.inf  # when its first node's finding appears
    end: float = 0.0  # when it is repaired


def _finding(symptom: str, node: str, at: float, tag: str) -> Any:
    from gpuvigil.model import Finding, FindingKind, Severity

    if symptom == "link":
        return Finding(kind=FindingKind.IB_LINK_DOWN, severity=Severity.PAGE, ts=at, node=node, evidence={"device": "mlx5_0", "port": 1, "port_id": f"{node}/mlx5_0/1"}, summary=f"{node} mlx5_0 port 1 down", source="infiniband")
    if symptom == "thermal":
        return Finding(kind=FindingKind.THERMAL_THROTTLE, severity=Severity.TICKET, ts=at, node=node, gpu=0, summary=f"{node} GPU 0 throttled", source="thermal")
    if symptom == "hang":
        # as the hang detector reports it: the culprit's node, no hardware event seen on it
        return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=at, job=f"job-{tag}", culprit_ranks=[0], node=node, evidence={"culprit_nodes": [node]}, summary=f"job-{tag} hung on {node}", source="hang")
    if symptom == "ecc":
        return Finding(kind=FindingKind.ECC, severity=Severity.PAGE, ts=at, node=node, gpu=0, summary=f"{node} GPU 0 DBE", source="ecc")
    return Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=at, node=node, gpu=0, xid=79, evidence={"fatal": True}, summary=f"{node} XID 79", source="xid")


# Detection latency of each symptom's source, seconds: (fixed, uniform extra).
LATENCY = {"link": (0.0, 0.0), "thermal": (60.0, 30.0), "hang": (300.0, 300.0), "ecc": (0.0, 0.0), "xid": (0.0, 0.0)}


def background(fleet: Fleet, rng: np.random.Generator, trace: Path, days: float, scale: float) -> list[Episode]:
    events = json.loads(trace.read_text())
    starts = sorted((e for e in events if e["event_type"] == "fault_start"), key=lambda e: e["event_time"])
    ends: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e["event_type"] == "fault_end":
            ends[e["node_id"]].append(float(e["event_time"]))
    trace_nodes = sorted({e["node_id"] for e in starts})
    slots = rng.permutation(len(fleet.nodes))[: len(trace_nodes)]
    where = {tn: fleet.nodes[int(s) % len(fleet.nodes)] for tn, s in zip(trace_nodes, slots, strict=False)}
    t0 = float(starts[0]["event_time"])
    out: list[Episode] = []
    for k, e in enumerate(starts):
        day = (float(e["event_time"]) - t0) / scale
        if day >= days:
            break
        desc = e["fault_type"]["Desc"]
        symptom = next((s for pattern, s in TRACE_MAP if re.search(pattern, desc, re.I)), None)
        if symptom is None:
            continue
        onset = day * DAY
        later = [x for x in ends[e["node_id"]] if x >= float(e["event_time"])]
        repair = ((min(later) - float(e["event_time"])) * DAY / scale) if later else 4 * 3600.0
        fixed, extra = LATENCY[symptom]
        appear = onset + fixed + rng.uniform(0, extra)
        node = where[e["node_id"]]
        out.append(Episode(appear, max(appear + 60.0, onset + repair), _finding(symptom, node, appear, f"bg{k}"), f"bg:{k}"))
    return out


# Component fault types: (level, symptom, share of its nodes affected (lo, hi), onset spread s (lo, hi), repair h (lo, hi)).
COMPONENT_FAULTS = {
    "leaf_switch": ("link", (0.4, 1.0), (0.0, 120.0), (1.0, 8.0)),
    "spine": ("hang", (0.06, 0.2), (0.0, 600.0), (1.0, 4.0)),
    "cooling_loop": ("thermal", (0.5, 1.0), (120.0, 900.0), (1.0, 6.0)),
    "pdu": ("thermal", (0.5, 1.0), (0.0, 60.0), (0.5, 4.0)),
}


def inject(fleet: Fleet, rng: np.random.Generator, days: float, per_type: int) -> tuple[list[Injected], list[Episode]]:
    injected: list[Injected] = []
    episodes: list[Episode] = []
    k = 0
    for level, (symptom, share, spread, repair) in COMPONENT_FAULTS.items():
        comps = fleet.members(level)
        names = sorted(comps)
        for _ in range(per_type):
            comp = names[int(rng.integers(len(names)))]
            members = comps[comp]
            onset = float(rng.uniform(0.02, 0.98)) * days * DAY
            count = max(3, math.ceil(float(rng.uniform(*share)) * len(members)))
            hit = sorted(rng.choice(members, size=min(count, len(members)), replace=False).tolist())
            fix = float(rng.uniform(*repair)) * 3600.0
            inj = Injected(f"comp:{k}", level, comp, symptom, onset, hit)
            injected.append(inj)
            fixed, extra = LATENCY[symptom]
            inj.end = onset + fix
            for j, node in enumerate(hit):
                appear = onset + float(rng.uniform(*spread)) + fixed + float(rng.uniform(0, extra))
                inj.first_finding = min(inj.first_finding, appear)
                episodes.append(Episode(appear, onset + fix, _finding(symptom, node, appear, f"c{k}-{j}"), inj.id))
            k += 1
    return injected, episodes


class _Scripted:
    """Reports the episodes live at each tick."""

    name = "scripted"

    def __init__(self, episodes: list[Episode]):
        self.episodes = sorted(episodes, key=lambda e: e.appear)
        self._next = 0
        self._live: list[Episode] = []

    def detect(self, window: Any) -> list[Any]:
        now = window.now
        while self._next < len(self.episodes) and self.episodes[self._next].appear <= now:
            self._live.append(self.episodes[self._next])
            self._next += 1
        self._live = [e for e in self._live if e.end > now]
        return [e.finding.model_copy() for e in self._live]


def tick_times(episodes: list[Episode], tick: float, follow: float) -> list[float]:
    """Ticks around every finding's appearance (and its end), skipping the quiet days between:
    a finding reported on consecutive ticks stays one finding however far apart they are."""
    ticks: set[float] = set()
    for e in episodes:
        for base in (e.appear, e.end):
            t0 = math.ceil(base / tick) * tick
            ticks.update(t0 + i * tick for i in range(int(follow // tick) + 1))
    return sorted(ticks)


def run_pipeline(episodes: list[Episode], fleet: Fleet | None, tick: float, follow: float, workdir: Path) -> dict[str, Any]:
    from gpuvigil import config
    from gpuvigil.pipeline.core import Pipeline

    over: dict[str, Any] = {"pipeline": {"detector_every_seconds": {"default": 0}}}
    if fleet is not None:
        topo = workdir / "topology.yaml"
        topo.write_text(yaml.safe_dump({"nodes": fleet.placement}, sort_keys=True))
        over["pipeline"]["components"] = {"topology_file": str(topo)}
    p = Pipeline([], [_Scripted(episodes)], cfg=config.load(overrides=over))
    origin = {e.finding.id: e.origin for e in episodes}
    first_reported: dict[str, float] = {}
    hints: list[tuple[float, Any]] = []
    component_findings: list[tuple[float, Any]] = []
    for t in tick_times(episodes, tick, follow):
        r = p.tick(t)
        for f in r.new_findings:
            o = origin.get(f.id)
            if o is not None:
                first_reported.setdefault(o, t)
            if f.source == "components":
                component_findings.append((t, f))
        hints.extend((t, h) for h in r.new_hints)
    history = list(p.components.history) if p.components is not None else []
    return {"hints": hints, "origin": origin, "first_reported": first_reported, "history": history, "component_findings": component_findings,
            "replaced": p.hints_replaced_by_component}


def evaluate(injected: list[Injected], with_c: dict[str, Any], without: dict[str, Any], tick: float, window: float) -> dict[str, Any]:
    truth: dict[tuple[str, str], list[Injected]] = defaultdict(list)
    for i in injected:
        truth[(i.level, i.component)].append(i)
    correct: list[tuple[Any, Injected]] = []
    wrong = []
    final = [n for n in with_c["history"] if n.superseded_by is None]
    parts_first = [n for n in with_c["history"] if n.superseded_by is not None]
    for n in final:
        # the same component may fail twice: the naming must fall within that fault's life
        inj = next((i for i in truth.get((n.level, n.component), []) if n.symptom == i.symptom and i.onset <= n.named_at <= i.end + window), None)
        if inj is not None:
            correct.append((n, inj))
        else:
            wrong.append(n)
    found: dict[str, float] = {}
    for n, inj in correct:
        found[inj.id] = min(found.get(inj.id, math.inf), n.named_at)
    # the first tick that reports the fault's first finding
    to_name = [found[i.id] - math.ceil(i.first_finding / tick) * tick for i in injected if i.id in found]
    from_onset = [found[i.id] - i.onset for i in injected if i.id in found]
    named = final

    def node_actions(run: dict[str, Any], comp: bool) -> tuple[int, int]:
        """(node-removing hints on the findings of component faults, of background faults)."""
        c = b = 0
        for _t, h in run["hints"]:
            if h.action.value not in NODE_REMOVING or h.finding_kind.value == "component_fault":
                continue
            o = run["origin"].get(h.finding_id, "")
            c += o.startswith("comp:")
            b += o.startswith("bg:")
        return c, b

    base_comp, base_bg = node_actions(without, False)
    base_by_action: dict[str, int] = defaultdict(int)
    for _t, h in without["hints"]:
        if h.action.value in NODE_REMOVING and without["origin"].get(h.finding_id, "").startswith("comp:"):
            base_by_action[h.action.value] += 1
    with_comp, with_bg = node_actions(with_c, True)
    comp_hints = [(t, h) for t, h in with_c["hints"] if h.finding_kind.value == "component_fault"]
    # one action per component and time it was taken (the same switch failing again months later is another)
    actions = {(h.params["component_action"], t) for t, h in comp_hints}
    by_level: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i in injected:
        by_level[i.level][0] += 1
        by_level[i.level][1] += i.id in found
    return {
        "injected": len(injected),
        "named": len(named),
        "named_correct": len(correct),
        "named_wrong": [f"{n.level}:{n.component} ({n.symptom})" for n in wrong],
        "parts_named_first": len(parts_first),
        "found": len(found),
        "recall": len(found) / len(injected) if injected else None,
        "precision": len(correct) / len(named) if named else None,
        "by_level": {k: {"injected": v[0], "named": v[1]} for k, v in by_level.items()},
        "time_to_name_s": sorted(to_name),
        "time_from_onset_s": sorted(from_onset),
        "node_actions_baseline": base_comp,
        "node_actions_baseline_by_action": dict(sorted(base_by_action.items())),
        "node_actions_with": with_comp,
        "component_actions": len(actions),
        "component_nodes_drained": len({(h.node, t) for t, h in comp_hints}),
        "background_actions_baseline": base_bg,
        "background_actions_with": with_bg,
        "affected_nodes": sum(len(i.nodes) for i in injected),
    }


def run(*, days: float, per_type: int, seed: int, tick: float, nodes: int, scale: float, trace: Path = TRACE) -> dict[str, Any]:
    from gpuvigil import config
    from gpuvigil.pipeline.core import PipelineConfig

    comp_cfg = config.section("pipeline", PipelineConfig).components
    follow = comp_cfg.hold_seconds + comp_cfg.window_seconds + 2 * tick
    rng = np.random.default_rng(seed)
    fleet = fat_tree(nodes)
    bg = background(fleet, rng, trace, days, scale)
    injected, comp = inject(fleet, rng, days, per_type)
    episodes = bg + comp
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuvigil-bench-components-") as tmp:
        with_c = run_pipeline(episodes, fleet, tick, follow, Path(tmp))
        without = run_pipeline(episodes, None, tick, follow, Path(tmp))
    res = evaluate(injected, with_c, without, tick, comp_cfg.window_seconds)
    res["outcomes"] = [{"id": i.id, "level": i.level, "component": i.component, "nodes": len(i.nodes), "onset": i.onset} for i in injected]
    res.update({"days": days, "per_type": per_type, "seed": seed, "tick": tick, "nodes": nodes, "scale": scale, "background_findings": len(bg),
                "component_findings": len(comp), "seconds": time.monotonic() - t0, "hold_seconds": comp_cfg.hold_seconds,
                "window_seconds": comp_cfg.window_seconds, "min_nodes": comp_cfg.min_nodes, "max_p_value": comp_cfg.max_p_value})
    return res


def _q(values: list[float], q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f} s"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


TARGETS = {"precision": 0.9, "recall": 0.8, "avoided": 0.8, "p50_s": 180.0, "p90_s": 900.0}


def targets(r: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    avoided = 1 - r["node_actions_with"] / r["node_actions_baseline"] if r["node_actions_baseline"] else None
    p50, p90 = _q(r["time_to_name_s"], 0.5), _q(r["time_to_name_s"], 0.9)
    return [
        ("precision of the component named", f"≥ {_pct(TARGETS['precision'])}", _pct(r["precision"]), None if r["precision"] is None else r["precision"] >= TARGETS["precision"]),
        ("recall: component faults named", f"≥ {_pct(TARGETS['recall'])}", _pct(r["recall"]), None if r["recall"] is None else r["recall"] >= TARGETS["recall"]),
        ("per-node drains avoided under component faults", f"≥ {_pct(TARGETS['avoided'])}", _pct(avoided), None if avoided is None else avoided >= TARGETS["avoided"]),
        ("time to name, median (from the first node's finding)", f"≤ {TARGETS['p50_s']:.0f} s", _s(p50), None if p50 is None else p50 <= TARGETS["p50_s"]),
        ("time to name, p90", f"≤ {TARGETS['p90_s']:.0f} s", _s(p90), None if p90 is None else p90 <= TARGETS["p90_s"]),
        ("background node faults still drained (none held back for good)", "100%",
         _pct(r["background_actions_with"] / r["background_actions_baseline"]) if r["background_actions_baseline"] else "—",
         None if not r["background_actions_baseline"] else r["background_actions_with"] == r["background_actions_baseline"]),
    ]


def markdown(r: dict[str, Any], cmd: str) -> str:
    from benchmarks.report import provenance, targets_table

    data = (
        f"**findings-level simulation** (no telemetry): a fat tree of {r['nodes']} nodes; background node faults are the InfiniteHBD "
        f"trace's real arrivals and repair times (tests/data/traces/infinitehbd-faults-full, {r['days']:g} days"
        + (f", time compressed ×{r['scale']:g}" if r["scale"] != 1 else ", real spacing")
        + f"; {r['background_findings']} findings); {r['injected']} component faults injected by the simulator (seed {r['seed']}), "
        f"{r['component_findings']} node findings. Findings appear after their source's latency (InfiniBand sysfs at the tick, "
        f"DCGM 30 s + 60 s held for throttling, 5-10 min of stall for a hang) at pipeline ticks of {r['tick']:g} s."
    )
    lines = [
        "## Shared components: the switch, not its nodes" + (f" (stress: background faults ×{r['scale']:g} denser)" if r["scale"] != 1 else ""),
        "",
        provenance(cmd, data),
        "",
        f"The real `Pipeline` ran twice over the same findings: with the topology file (`pipeline.components`: window "
        f"{r['window_seconds']:g} s, min_nodes {r['min_nodes']}, max_p_value {r['max_p_value']:g}, hold {r['hold_seconds']:g} s) and "
        f"without it. {r['seconds']:.0f} s wall.",
        "",
        "| component faults | injected | named |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {lv} | {v['injected']} | {v['named']} |" for lv, v in sorted(r["by_level"].items())]
    lines += [
        "",
        "| figure | without components | with components |",
        "| --- | --- | --- |",
        f"| components named (correct / all) | — | {r['named_correct']} / {r['named']} |",
        f"| a part named first, then the wider component holding it (a rack, then its PDU) | — | {r['parts_named_first']} |",
        f"| node-removing actions on the component faults' nodes (each counted by a breaker) | {r['node_actions_baseline']} | "
        f"{r['node_actions_with']} + {r['component_actions']} component action(s) ({r['component_nodes_drained']} nodes) |",
        f"| of which, by action | {', '.join(f'{a} {n}' for a, n in r['node_actions_baseline_by_action'].items()) or '—'} | "
        f"the component's action is `drain_node`: it takes whole nodes out, where node by node a throttling GPU was only avoided |",
        f"| node-removing actions on background node faults | {r['background_actions_baseline']} | {r['background_actions_with']} (link and throttling ones {r['hold_seconds']:g} s later) |",
        f"| time to name: median / p90 from the first node's finding | — | {_s(_q(r['time_to_name_s'], 0.5))} / {_s(_q(r['time_to_name_s'], 0.9))} |",
        f"| time to name: median / p90 from the fault's onset | — | {_s(_q(r['time_from_onset_s'], 0.5))} / {_s(_q(r['time_from_onset_s'], 0.9))} |",
        "",
    ]
    if r["named_wrong"]:
        lines += [f"Named but not injected (or the wrong level): {', '.join(r['named_wrong'])}.", ""]
    lines += targets_table(targets(r))
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("components", help="shared-component root cause on a fat tree under the InfiniteHBD fault trace (simulated findings)")
    p.add_argument("--days", type=float, default=349.0, help="days of the trace to replay (default: all 349)")
    p.add_argument("--per-type", type=int, default=10, help="component faults injected per kind (leaf, spine, cooling loop, PDU)")
    p.add_argument("--nodes", type=int, default=256)
    p.add_argument("--tick", type=float, default=30.0, help="pipeline tick, seconds (default 30: dcgm-exporter's refresh)")
    p.add_argument("--scale", type=float, default=1.0, help="compress the trace's background faults in time by this factor (stress: more coincidences)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from benchmarks.report import command, write_section

    r = run(days=args.days, per_type=args.per_type, seed=args.seed, tick=args.tick, nodes=args.nodes, scale=args.scale, trace=args.trace)
    cmd = command("components")
    text = markdown(r, cmd)
    if not args.no_write:
        name = "components" if args.scale == 1 else "components-stress"
        write_section(name, text)
    print(json.dumps(r, default=str) if args.json else text)
    return 0
