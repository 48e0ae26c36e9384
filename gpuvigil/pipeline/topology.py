"""Which shared components each node hangs off: leaf switch, spine, rack, PDU, cooling loop.

Read from any of three sources, merged (a later source fills what an earlier one left unset):

- a topology file (YAML): per node, or per component with Slurm hostlists:

      nodes:
        gpu-001: {leaf_switch: leaf-01, spine: spine-a, rack: r01, pdu: pdu-r01, cooling_loop: loop-1}
      components:
        rack: {r02: "gpu-[005-008]"}
        cooling_loop: {loop-1: "gpu-[001-032]"}

- Slurm's `topology.conf` (topology/tree): `SwitchName=leaf01 Nodes=gpu-[001-016]` makes leaf01
  the leaf switch of those nodes; `SwitchName=spine1 Switches=leaf[01-04]` makes spine1 the spine
  of the leaves' nodes;
- a saved `ibnetdiscover` output: a switch with host channel adapters (`"H-..."` ports) on it is
  their nodes' leaf switch (the node is the first word of the HCA's NodeDescription, "gpu-001
  HCA-1"); the switches cabled to a leaf are its spines, named together (in a fat tree every
  leaf of a pod reaches the same spines, so the pod's leaves share one spine group).

Files are untrusted: a line that does not parse is skipped, never fatal.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from gpuvigil.errors import UserError

LEVELS = ("leaf_switch", "spine", "rack", "pdu", "cooling_loop")
_MAX_BYTES = 64 << 20


class TopologyError(UserError):
    """A topology file that cannot be read at all."""


def _expand(expr: str) -> list[str]:
    from gpuvigil.scheduler.slurm import expand_hostlist  # the Slurm hostlist grammar, one implementation

    return expand_hostlist(expr.strip())


class Topology:
    """node → {level: [components]}; and component (level, name) → its nodes. A node may hang off
    several components of one level: in a rail-optimised fabric each of its HCAs has its own leaf."""

    def __init__(self, placement: Mapping[str, Mapping[str, str | list[str]]] | None = None):
        self.placement: dict[str, dict[str, list[str]]] = {}
        for node, levels in (placement or {}).items():
            for level, comps in levels.items():
                for comp in [comps] if isinstance(comps, str) else comps:
                    self.place(node, level, comp)

    def place(self, node: str, level: str, component: str) -> None:
        if not node or not component:
            return
        comps = self.placement.setdefault(str(node), {}).setdefault(str(level), [])
        if str(component) not in comps:
            comps.append(str(component))

    def merge(self, other: Topology) -> Topology:
        """This topology, with the levels `other` knows of a node and this one does not."""
        for node, levels in other.placement.items():
            mine = self.placement.setdefault(node, {})
            for level, comps in levels.items():
                if not mine.get(level):
                    mine[level] = list(comps)
        return self

    @property
    def nodes(self) -> list[str]:
        return sorted(self.placement)

    def components(self, node: str, level: str) -> list[str]:
        return list(self.placement.get(node, {}).get(level, []))

    def members(self) -> dict[tuple[str, str], list[str]]:
        """(level, component) → its nodes, sorted."""
        out: dict[tuple[str, str], list[str]] = defaultdict(list)
        for node, levels in self.placement.items():
            for level, comps in levels.items():
                for comp in comps:
                    out[(level, comp)].append(node)
        return {k: sorted(v) for k, v in out.items()}

    def __len__(self) -> int:
        return len(self.placement)

    # -- readers ---------------------------------------------------------------------------------

    @classmethod
    def from_yaml_text(cls, text: str, where: str = "topology") -> Topology:
        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as exc:
            raise TopologyError(f"{where}: not valid YAML: {str(exc).splitlines()[0] if str(exc) else exc}") from None
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise TopologyError(f"{where}: top level must be a mapping with 'nodes' and/or 'components'")
        unknown = set(data) - {"nodes", "components"}
        if unknown:
            raise TopologyError(f"{where}: unknown key(s) {sorted(map(str, unknown))}; expected 'nodes' and/or 'components'")
        topo = cls()
        for node, levels in (data.get("nodes") or {}).items():
            if not isinstance(levels, dict):
                raise TopologyError(f"{where}: nodes.{node} must map levels to components")
            for level, comps in levels.items():
                for comp in comps if isinstance(comps, list) else [comps]:
                    topo.place(str(node), str(level), str(comp))
        for level, comps in (data.get("components") or {}).items():
            if not isinstance(comps, dict):
                raise TopologyError(f"{where}: components.{level} must map component names to hostlists")
            for comp, hosts in comps.items():
                exprs = hosts if isinstance(hosts, list) else [hosts]
                for expr in exprs:
                    for node in _expand(str(expr)):
                        topo.place(node, str(level), str(comp))
        return topo

    @classmethod
    def from_slurm_topology_text(cls, text: str) -> Topology:
        """Slurm topology.conf (topology/tree): leaf switches list Nodes, upper ones Switches."""
        nodes_of: dict[str, list[str]] = {}
        parent_of: dict[str, str] = {}
        for raw in text.splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields: dict[str, str] = {}
            for tok in line.split():
                key, sep, value = tok.partition("=")
                if sep:
                    fields[key.lower()] = value
            name = fields.get("switchname")
            if not name:
                continue
            if "nodes" in fields:
                nodes_of[name] = _expand(fields["nodes"])
            for child in _expand(fields.get("switches", "")):
                parent_of.setdefault(child, name)
        topo = cls()
        for leaf, nodes in nodes_of.items():
            for node in nodes:
                topo.place(node, "leaf_switch", leaf)
                if leaf in parent_of:
                    topo.place(node, "spine", parent_of[leaf])
        return topo

    @classmethod
    def from_ibnetdiscover_text(cls, text: str) -> Topology:
        """A saved `ibnetdiscover` output (see the module docstring)."""
        switch_desc: dict[str, str] = {}
        hosts_on: dict[str, set[str]] = defaultdict(set)
        links: dict[str, set[str]] = defaultdict(set)
        current: str | None = None
        for raw in text.splitlines():
            line = raw.strip()
            m = _IB_SWITCH.match(line)
            if m:
                current = m.group(1)
                switch_desc[current] = m.group(2) or ""
                continue
            if _IB_NODE.match(line):  # a CA or router block: its lines repeat the links seen from the switches
                current = None
                continue
            if current is None:
                continue
            m = _IB_LINK.match(line)
            if not m:
                continue
            peer, desc = m.group(1), m.group(2) or ""
            if peer.startswith("H-"):
                host = desc.split()[0] if desc.split() else ""
                if host:
                    hosts_on[current].add(host)
            elif peer.startswith("S-"):
                links[current].add(peer)
                links[peer].add(current)
        names = _switch_names(switch_desc)
        leaves = {s for s in hosts_on if hosts_on[s]}
        topo = cls()
        for leaf in sorted(leaves):
            spines = sorted(names.get(s, s) for s in links.get(leaf, ()) if s not in leaves)
            for host in sorted(hosts_on[leaf]):
                topo.place(host, "leaf_switch", names.get(leaf, leaf))
                if spines:
                    topo.place(host, "spine", "+".join(spines) if len(spines) <= 4 else f"{spines[0]}+{len(spines) - 1}-more")
        return topo

    @classmethod
    def load(cls, *, topology_file: str | Path | None = None, slurm_topology: str | Path | None = None, ibnetdiscover: str | Path | None = None) -> Topology:
        """Merge the given sources: the topology file first, then Slurm, then ibnetdiscover."""
        topo = cls()
        for path, reader in ((topology_file, "yaml"), (slurm_topology, "slurm"), (ibnetdiscover, "ib")):
            if path is None:
                continue
            text = _read_text(Path(path))
            part = cls.from_yaml_text(text, str(path)) if reader == "yaml" else cls.from_slurm_topology_text(text) if reader == "slurm" else cls.from_ibnetdiscover_text(text)
            topo.merge(part)
        return topo


_IB_SWITCH = re.compile(r'^Switch\s+\d+\s+"(S-[0-9A-Fa-f]+)"\s*(?:#\s*"([^"]*)")?')
_IB_NODE = re.compile(r'^(?:Ca|Rt)\s+\d+\s+"[HR]-[0-9A-Fa-f]+"')
_IB_LINK = re.compile(r'^\[\d+\](?:\([0-9A-Fa-f]+\))?\s+"([HSR]-[0-9A-Fa-f]+)"\[\d+\](?:\([0-9A-Fa-f]+\))?\s*(?:#\s*"([^"]*)")?')


def _switch_names(desc: Mapping[str, str]) -> dict[str, str]:
    """A switch's name from its NodeDescription: Mellanox/NVIDIA switches read
    "MF0;leaf-01:MQM9700/U1" (the name between ';' and ':'); a description that several switches
    share ("Quantum Mellanox Technologies") names none of them: the GUID does."""
    def short(d: str) -> str:
        m = re.match(r"^[^;]*;([^:]+):", d)
        return (m.group(1) if m else d).strip()

    shorts = {s: short(d) for s, d in desc.items()}
    counts: dict[str, int] = defaultdict(int)
    for v in shorts.values():
        counts[v] += 1
    return {s: v if v and counts[v] == 1 else s for s, v in shorts.items()}


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read topology: {exc.strerror or exc}") from exc
    if len(raw) > _MAX_BYTES:
        raise TopologyError(f"{path}: larger than {_MAX_BYTES >> 20} MiB; not a topology file")
    return raw.decode("utf-8", errors="replace")


def nodes_of(levels: Iterable[str], topo: Topology) -> dict[str, dict[str, list[str]]]:
    """level → component → nodes, for the given levels."""
    out: dict[str, dict[str, list[str]]] = {lv: {} for lv in levels}
    for (level, comp), nodes in topo.members().items():
        if level in out:
            out[level][comp] = nodes
    return out


def describe(topo: Topology) -> dict[str, Any]:
    counts: dict[str, int] = defaultdict(int)
    for level, _comp in topo.members():
        counts[level] += 1
    return {"nodes": len(topo), **{f"{lv}s": n for lv, n in sorted(counts.items())}}
