"""What a saved reading that no live stream carries says on its own: two registered detectors
placed `offline` (only `analyze` fills their streams).

- `smi_health`, over `smi_health` (one row per GPU block of saved `nvidia-smi -q` output,
  parsers/nvidia_smi.py): each memory repair by its own kind (`row_remap_failure`, else `ecc`
  for volatile DBEs; `row_remap_pending`, `retired_pages`), and `thermal_throttle` for a GPU
  that shows a heat reason active. serve's `ecc`, `memory_repair` and `thermal` detectors judge
  the same facts from NVML, but know a GPU by its node and index, which the output does not
  give (it names the PCI bus id), and `thermal` needs a series, not one reading.
- `active_findings`, over `active_findings` (the active-findings gauges of a saved gpuvigil
  `/metrics` page): the findings gpuvigil itself had active when the page was saved.

A saved dcgm-exporter scrape is judged by serve's own detectors (`offline.analyze.scrape_findings`:
XIDs, ECC, memory repairs, the NVLink fabric), as is a sysfs tree's InfiniBand ports, and an NVML
time series is replayed through serve's `thermal` detector (`offline.analyze.analyze_nvml_csv`).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from gpuvigil import policies
from gpuvigil.detectors.base import FRESH, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

# The gauges of a saved gpuvigil page that count its active findings.
ACTIVE_FINDINGS_METRICS = ("gpuvigil_node_findings_active", "gpuvigil_job_findings_active")


class SmiHealthConfig(BaseModel):
    # Uncorrectable errors in the volatile counters (since the driver loaded) that page as `ecc`.
    min_volatile_dbe: int = Field(1, ge=1)


class ActiveFindingsConfig(BaseModel):
    # An active-findings gauge at or above this many findings is one (gauges count findings).
    min_active_count: float = Field(1.0, gt=0)


# ---------------------------------------------------------------- nvidia-smi -q


class SmiHealthDetector(Declared):
    spec = DetectorSpec(
        name="smi_health",
        config=SmiHealthConfig,
        emits=(FindingKind.ROW_REMAP_FAILURE, FindingKind.ECC, FindingKind.ROW_REMAP_PENDING, FindingKind.RETIRED_PAGES, FindingKind.THERMAL_THROTTLE),
        reads={"smi_health": FRESH},
        order=180,
        placement_override="offline",
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("smi_health", SmiHealthConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        out: list[Finding] = []
        for h in window.fresh("smi_health").to_dicts():
            where = f"GPU {h['pci_bus_id']}" if h["pci_bus_id"] else "the GPU"
            src = f"{h['source']}:{h['line']}" if h["source"] else self.name
            common = {"ts": h["ts"], "node": h["node"], "gpu": h["gpu"], "source": src, "cause": "hardware"}
            out.extend(_memory_findings(h, where, common, self.config.min_volatile_dbe))
            if h["thermal_reasons"]:
                out.append(
                    Finding(
                        kind=FindingKind.THERMAL_THROTTLE,
                        severity=Severity.TICKET,
                        evidence={"pci_bus_id": h["pci_bus_id"], "active_reasons": list(h["thermal_reasons"]), "gpu_block": h["gpu_block"]},
                        summary=f"nvidia-smi -q on {where}: clocks slowed for heat or power ({', '.join(h['thermal_reasons'])} active)",
                        **common,
                    )
                )
        return out


def _memory_findings(h: dict[str, Any], where: str, common: dict[str, Any], min_dbe: int) -> list[Finding]:
    dbe = h["ecc_dbe_volatile_total"] or 0
    errors = f"{dbe} uncorrectable ECC error(s) since the driver loaded"
    out = []
    kind = policies.memory_fault(bool(h["remap_failure"]), dbe >= min_dbe)
    if kind == FindingKind.ROW_REMAP_FAILURE:
        out.append(Finding(kind=kind, severity=Severity.PAGE, **common,
                           evidence={"pci_bus_id": h["pci_bus_id"], "remap_failure": True, **({"ecc_dbe_volatile_total": dbe} if dbe else {})},
                           summary=f"nvidia-smi -q on {where}: a row remapping failed" + (f"; {errors}" if dbe else "") + f": {policies.MEMORY_REMEDY[kind]}"))
    elif kind == FindingKind.ECC:
        out.append(Finding(kind=kind, severity=Severity.PAGE, **common, evidence={"pci_bus_id": h["pci_bus_id"], "ecc_dbe_volatile_total": dbe},
                           summary=f"nvidia-smi -q on {where}: {errors}: {policies.MEMORY_REMEDY[kind]}"))
    if h["remap_pending"]:
        out.append(Finding(kind=FindingKind.ROW_REMAP_PENDING, severity=Severity.TICKET, **common, evidence={"pci_bus_id": h["pci_bus_id"], "remap_pending": True},
                           summary=f"nvidia-smi -q on {where}: a row remapping is pending: reset the GPU to apply it"))
    if h["retired_pages_pending"]:
        out.append(Finding(kind=FindingKind.RETIRED_PAGES, severity=Severity.TICKET, **common, evidence={"pci_bus_id": h["pci_bus_id"], "retired_pages_pending": True},
                           summary=f"nvidia-smi -q on {where}: retired pages are pending blacklist: reboot to retire them"))
    return out


# ---------------------------------------------------------------- a saved gpuvigil /metrics page


class ActiveFindingsDetector(Declared):
    spec = DetectorSpec(
        name="active_findings",
        config=ActiveFindingsConfig,
        emits=tuple(FindingKind),
        reads={"active_findings": FRESH},
        order=181,
        placement_override="offline",
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("active_findings", ActiveFindingsConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        """One finding per sample of an active-findings gauge of at least `min_active_count` whose
        kind and severity gpuvigil knows."""
        out = []
        for s in window.fresh("active_findings").to_dicts():
            if s["metric"] not in ACTIVE_FINDINGS_METRICS or not self.config.min_active_count <= (s["active_count"] or 0) < math.inf:
                continue
            try:
                kind, sev = FindingKind(s["kind"] or ""), Severity(s["severity"] or "")
            except ValueError:
                continue
            node, job, count = s["node"], s["job"], int(s["active_count"])
            out.append(
                Finding(
                    kind=kind,
                    severity=sev,
                    ts=s["ts"],
                    node=node,
                    job=job,
                    evidence={"active_count": count, "metric": s["metric"]},
                    summary=f"gpuvigil had {count} active {kind.value} finding(s) on {'node ' + node if node else 'job ' + str(job)} when this scrape was saved",
                    source=s["source"] or self.name,
                )
            )
        return out


__all__ = ["ACTIVE_FINDINGS_METRICS", "ActiveFindingsConfig", "ActiveFindingsDetector", "SmiHealthConfig", "SmiHealthDetector"]
