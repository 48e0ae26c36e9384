"""Findings on many nodes → one shared component: "the switch, not 40 nodes".

When a leaf switch, a rack's PDU or a cooling loop fails, every node under it shows a symptom:
link errors, hangs whose culprits sit under one switch, throttling in one rack. Node by node,
each would be drained. Here the symptoms are counted per component of the topology
(gpuvigil/pipeline/topology.py), within `window_seconds`:

- a symptom class (config `symptoms`) says which finding kinds count and which levels of
  component can explain them (link faults: leaf switch, spine; throttling: rack, PDU, cooling
  loop). A finding counts for its node, or for its `culprit_nodes` (a hang names the ranks that
  stopped, and their nodes);
- a component is named when at least `min_nodes` of its nodes show the symptom, reported by at
  least `min_nodes` findings (one hung job naming all its ranks' nodes is one report), and the
  nodes outside it are quiet: under the outside rate (the share of the other nodes showing it), seeing
  that many of its nodes at once has a binomial probability below `max_p_value`. Of several
  candidates (a leaf and its spine) the least likely by chance is named first, and its nodes are
  no longer counted for the others. A component holding over `max_fleet_share` of the nodes is
  never named: there is no outside left to be quiet;
- the named component is one `component_fault` finding (one incident, one page) with the
  evidence per node; the nodes' own findings become evidence of its incident, and the pipeline
  holds their node-removing hints (`held_actions`) for `hold_seconds` so that a component named
  in that time replaces them: the hint is to take the component out, its nodes drained as one
  action (every hint carries `params.component_action`, the same for all of them, so a breaker
  counts it once).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuvigil.model import Finding, FindingKind, HintAction, Severity
from gpuvigil.pipeline.topology import Topology


class SymptomRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kinds: list[FindingKind]
    # Component levels that can explain the symptom, as named in the topology.
    levels: list[str]
    # How the summary names it ("link faults", "hangs", "throttling").
    label: str


def _default_symptoms() -> dict[str, SymptomRule]:
    return {
        "link": SymptomRule(kinds=[FindingKind.IB_LINK_DOWN, FindingKind.IB_LINK_ERRORS, FindingKind.IB_LINK_DEGRADED, FindingKind.IB_PORT_MISSING], levels=["leaf_switch", "spine"], label="link faults"),
        "hang": SymptomRule(kinds=[FindingKind.COLLECTIVE_HANG, FindingKind.NCCL_TIMEOUT], levels=["leaf_switch", "spine"], label="hang culprits"),
        "thermal": SymptomRule(kinds=[FindingKind.THERMAL_THROTTLE], levels=["rack", "pdu", "cooling_loop"], label="throttling"),
    }


class ComponentsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Where the topology comes from (any of them; merged). None of them: components are not named.
    topology_file: str | None = None
    slurm_topology: str | None = None
    ibnetdiscover: str | None = None
    window_seconds: float = Field(600.0, gt=0)
    min_nodes: int = Field(3, ge=2)
    max_p_value: float = Field(1e-4, gt=0, lt=1)
    max_fleet_share: float = Field(0.5, gt=0, le=1)
    hold_seconds: float = Field(120.0, ge=0)
    held_actions: list[HintAction] = Field(default_factory=lambda: [HintAction.CORDON_NODE, HintAction.DRAIN_NODE, HintAction.AVOID_GPU])
    # Which nodes the component's hint takes out: all of its nodes, or those showing the symptom.
    drain: dict[str, Literal["all", "affected"]] = Field(default_factory=lambda: {"default": "all", "spine": "affected", "cooling_loop": "affected"})
    severity: Severity = Severity.PAGE
    symptoms: dict[str, SymptomRule] = Field(default_factory=_default_symptoms)

    @property
    def enabled(self) -> bool:
        return any((self.topology_file, self.slurm_topology, self.ibnetdiscover))


def binomial_tail(k: int, n: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    q = min(max(q, 1e-12), 1 - 1e-12)
    lq, lp = math.log(q), math.log1p(-q)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lq + (n - i) * lp for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


@dataclass
class _Seen:
    first: float
    last: float
    findings: dict[str, Finding] = field(default_factory=dict)


@dataclass
class Named:
    level: str
    component: str
    symptom: str
    named_at: float
    first_symptom: float
    nodes: set[str]
    p_value: float
    outside: int
    finding: Finding | None = None
    # A wider component named later that holds this one (a PDU over the rack named first).
    superseded_by: str | None = None


class ComponentCorrelator:
    """Names shared components from the findings each tick (see the module docstring)."""

    def __init__(self, settings: ComponentsConfig, topology: Topology):
        self.config = settings
        self.topology = topology
        self.members = topology.members()
        self.fleet = len(topology)
        self._kind_symptoms: dict[FindingKind, list[str]] = {}
        for name, rule in settings.symptoms.items():
            for kind in rule.kinds:
                self._kind_symptoms.setdefault(kind, []).append(name)
        self.seen: dict[tuple[str, str], _Seen] = {}
        self.named: dict[tuple[str, str, str], Named] = {}
        self.history: list[Named] = []  # every component named, in order

    # -- what a finding is a symptom of -----------------------------------------------------------

    def symptom_nodes(self, f: Finding) -> list[tuple[str, str]]:
        """(symptom, node) pairs a finding counts for; nodes outside the topology do not count."""
        symptoms = self._kind_symptoms.get(f.kind)
        if not symptoms:
            return []
        culprits = f.evidence.get("culprit_nodes")
        nodes = [f.node] if f.node else [str(n) for n in culprits] if isinstance(culprits, list) else []
        return [(s, n) for s in symptoms for n in dict.fromkeys(nodes) if n in self.topology.placement]

    def explaining(self, f: Finding) -> Named | None:
        """The live named component this finding is a symptom under, if any."""
        for symptom, node in self.symptom_nodes(f):
            for named in self.named.values():
                if named.symptom == symptom and node in self.members.get((named.level, named.component), ()):
                    return named
        return None

    def member_findings(self, named: Named) -> list[Finding]:
        comp_nodes = set(self.members.get((named.level, named.component), ()))
        out: dict[str, Finding] = {}
        for (symptom, node), seen in self.seen.items():
            if symptom == named.symptom and node in comp_nodes:
                out.update(seen.findings)
        return list(out.values())

    # -- each tick -------------------------------------------------------------------------------

    def observe(self, reported: Iterable[Finding], now: float) -> list[Finding]:
        """Count this tick's findings; name what is now explained by a component. Returns the
        `component_fault` finding of every live named component (re-reported while it lasts)."""
        for f in reported:
            for key in self.symptom_nodes(f):
                s = self.seen.get(key)
                if s is None:
                    s = self.seen[key] = _Seen(first=now, last=now)
                s.last = now
                s.findings[f.id] = f
        horizon = now - self.config.window_seconds
        for key in [k for k, s in self.seen.items() if s.last < horizon]:
            del self.seen[key]
        for key, named in list(self.named.items()):
            comp_nodes = set(self.members.get((named.level, named.component), ()))
            still = {n for (sym, n) in self.seen if sym == named.symptom and n in comp_nodes}
            if len(still) < self.config.min_nodes:
                # Its fault is over (repaired, or gone quiet); one node's own fault that outlives
                # it must not keep it named, nor draw later unrelated symptoms into it.
                del self.named[key]
            else:
                named.nodes |= still
        # Widen first: new nodes in the rest of a wider component extend what was named, rather
        # than naming another part of it.
        self._widen(now)
        self._name_new(now)
        return [self._finding(n, now) for n in self.named.values()]

    def _widen(self, now: float) -> None:
        """A component named from its first few nodes (a rack) is replaced by the wider one that
        holds it (the rack's PDU, its cooling loop) once the wider one's other nodes show the
        symptom too, beyond what the background explains."""
        cfg = self.config
        for key, named in list(self.named.items()):
            if key not in self.named:
                continue
            rule = cfg.symptoms[named.symptom]
            part = set(self.members[(named.level, named.component)])
            affected = {n for (sym, n) in self.seen if sym == named.symptom}
            for level in rule.levels:
                if level == named.level:
                    continue
                for comp in sorted({c for n in part for c in self.topology.components(n, level)}):
                    whole = set(self.members[(level, comp)])
                    if not part < whole or len(whole) > cfg.max_fleet_share * self.fleet:
                        continue
                    inside = affected & whole
                    if self._reports(named.symptom, inside) < cfg.min_nodes:
                        continue
                    outside = len(affected - whole)
                    q = (outside + 0.5) / (self.fleet - len(whole) + 1)
                    rest = inside - part
                    if binomial_tail(len(rest), len(whole - part), q) > cfg.max_p_value or binomial_tail(len(inside), len(whole), q) > cfg.max_p_value:
                        continue
                    wider = Named(level=level, component=comp, symptom=named.symptom, named_at=now,
                                  first_symptom=min(self.seen[(named.symptom, n)].first for n in inside), nodes=inside,
                                  p_value=binomial_tail(len(inside), len(whole), q), outside=outside)
                    for k2, other in list(self.named.items()):
                        if other.symptom == named.symptom and set(self.members[(other.level, other.component)]) < whole:
                            other.superseded_by = f"{level}:{comp}"
                            del self.named[k2]
                    self.named[(level, comp, named.symptom)] = wider
                    self.history.append(wider)
                    break
                if key not in self.named:
                    break

    def _name_new(self, now: float) -> None:
        cfg = self.config
        for symptom, rule in cfg.symptoms.items():
            explained = {n for named in self.named.values() if named.symptom == symptom for n in self.members.get((named.level, named.component), ())}
            affected = {n for (sym, n) in self.seen if sym == symptom} - explained
            while len(affected) >= cfg.min_nodes:
                pool = self.fleet - len(explained)
                best: tuple[float, int, str, str, set[str], int] | None = None
                for level in rule.levels:
                    by_comp: dict[str, set[str]] = {}
                    for n in affected:
                        for comp in self.topology.components(n, level):
                            by_comp.setdefault(comp, set()).add(n)
                    for comp, inside in by_comp.items():
                        size = len(set(self.members[(level, comp)]) - explained)
                        if len(inside) < cfg.min_nodes or size > cfg.max_fleet_share * pool or size <= 0 or self._reports(symptom, inside) < cfg.min_nodes:
                            continue
                        outside = len(affected - inside)
                        q = (outside + 0.5) / (pool - size + 1)
                        p = binomial_tail(len(inside), size, q)
                        if p > cfg.max_p_value or self._a_part_explains(rule.levels, level, comp, inside, explained, q):
                            continue
                        if best is None or (p, size) < (best[0], best[1]):
                            best = (p, size, level, comp, inside, outside)
                if best is None:
                    break
                p, _size, level, comp, inside, outside = best
                first = min(self.seen[(symptom, n)].first for n in inside)
                named = Named(level=level, component=comp, symptom=symptom, named_at=now, first_symptom=first, nodes=set(inside), p_value=p, outside=outside)
                self.named[(level, comp, symptom)] = named
                self.history.append(named)
                members = set(self.members[(level, comp)])
                explained |= members
                affected -= members

    def _reports(self, symptom: str, nodes: Iterable[str]) -> int:
        """How many findings stand behind these nodes' symptoms: one hung job naming the eight
        nodes of its ranks is one report, not eight (a job packed under one switch is not the
        switch's fault until other reports join it)."""
        return len({fid for n in nodes for fid in self.seen[(symptom, n)].findings})

    def _a_part_explains(self, levels: list[str], level: str, comp: str, inside: set[str], explained: set[str], q: float) -> bool:
        """A wider component (a spine) is not named when one of its parts (a leaf under it) holds
        at least min_nodes of its affected nodes and the rest of it looks like the background:
        a leaf's failure plus one unrelated node elsewhere under the spine is the leaf."""
        whole = set(self.members[(level, comp)])
        for sub_level in levels:
            if sub_level == level:
                continue
            parts: dict[str, set[str]] = {}
            for n in inside:
                for part in self.topology.components(n, sub_level):
                    parts.setdefault(part, set()).add(n)
            for part, hit in parts.items():
                members = set(self.members[(sub_level, part)])
                if len(hit) < self.config.min_nodes or not members < whole:
                    continue
                rest = inside - members
                if binomial_tail(len(rest), len((whole - members) - explained), q) > self.config.max_p_value:
                    return True
        return False

    def _finding(self, named: Named, now: float) -> Finding:
        cfg = self.config
        rule = cfg.symptoms[named.symptom]
        members = self.members[(named.level, named.component)]
        how = cfg.drain.get(named.level, cfg.drain.get("default", "all"))
        drain = sorted(members) if how == "all" else sorted(named.nodes)
        per_node: list[str] = []
        for node in sorted(named.nodes)[:64]:
            seen = self.seen.get((named.symptom, node))
            if seen is None:
                continue
            kinds = sorted({f.kind.value for f in seen.findings.values()})
            first = min(seen.findings.values(), key=lambda f: f.ts)
            per_node.append(f"{node} (+{seen.first - named.first_symptom:.0f} s): {', '.join(kinds)}: {first.summary[:160]}")
        pool = self.fleet - len(members)
        level_name = named.level.replace("_", " ")
        summary = (
            f"{level_name} {named.component}: {rule.label} on {len(named.nodes)} of its {len(members)} nodes "
            f"within {max(0.0, now - named.first_symptom):.0f} s, {named.outside} of the other {pool}: the {level_name}, not the nodes"
        )
        evidence = {
            "component": named.component,
            "level": named.level,
            "symptom": named.symptom,
            "nodes": sorted(named.nodes),
            "component_nodes": len(members),
            "outside_nodes_affected": named.outside,
            "outside_nodes": pool,
            "p_value": named.p_value,
            "first_symptom_ts": named.first_symptom,
            "named_ts": named.named_at,
            "drain_nodes": drain,
            "per_node": per_node,
        }
        f = Finding(kind=FindingKind.COMPONENT_FAULT, severity=cfg.severity, ts=named.named_at, evidence=evidence, summary=summary, source="components", cause="hardware")
        named.finding = f
        return f


__all__ = ["ComponentCorrelator", "ComponentsConfig", "Named", "SymptomRule", "binomial_tail"]
