"""What one saved reading of a node says on its own, with no history: `nvidia-smi -q` output and a
saved gpuvigil `/metrics` page. `analyze` reads them (parsers/nvidia_smi.py) and this module
judges what it read.

A saved dcgm-exporter scrape is judged by serve's own detectors (`offline.analyze.scrape_findings`:
XIDs, ECC, memory repairs, the NVLink fabric), as is a sysfs tree's InfiniBand ports, and an NVML
time series is replayed through serve's `thermal` detector (`offline.analyze.analyze_nvml_csv`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.parsers.nvidia_smi import SmiHealth

# The gauges of a saved gpuvigil page that count its active findings.
ACTIVE_FINDINGS_METRICS = ("gpuvigil_node_findings_active", "gpuvigil_job_findings_active")


# ---------------------------------------------------------------- nvidia-smi -q


def smi_findings(states: Iterable[SmiHealth], *, source_file: str | None = None, ts: float, node: str | None = None) -> list[Finding]:
    """Each memory repair by its own kind (`row_remap_failure`, else `ecc` for volatile DBEs;
    `row_remap_pending`, `retired_pages`), and `thermal_throttle` for a GPU that slowed its
    clocks for heat."""
    out: list[Finding] = []
    for h in states:
        where = f"GPU {h.pci_bus_id}" if h.pci_bus_id else "the GPU"
        src = f"{source_file}:{h.first_line}" if source_file else "nvidia-smi"
        out.extend(_memory_findings(h, where=where, ts=ts, node=node, gpu=None, source=src, cause="hardware"))
        if h.thermal_reasons_active:
            out.append(
                Finding(
                    kind=FindingKind.THERMAL_THROTTLE,
                    severity=Severity.TICKET,
                    ts=ts,
                    node=node,
                    gpu=None,
                    evidence={"pci_bus_id": h.pci_bus_id, "active_reasons": list(h.thermal_reasons_active), "gpu_block": h.index},
                    summary=f"nvidia-smi -q on {where}: clocks slowed for heat or power ({', '.join(h.thermal_reasons_active)} active)",
                    source=src,
                    cause="hardware",
                )
            )
    return out


def _memory_findings(h: SmiHealth, *, where: str, **common: Any) -> list[Finding]:
    dbe = h.ecc_dbe_volatile_total
    errors = f"{dbe} uncorrectable ECC error(s) since the driver loaded"
    out = []
    if h.remap_failure:
        out.append(Finding(kind=FindingKind.ROW_REMAP_FAILURE, severity=Severity.PAGE, **common,
                           evidence={"pci_bus_id": h.pci_bus_id, "remap_failure": True, **({"ecc_dbe_volatile_total": dbe} if dbe else {})},
                           summary=f"nvidia-smi -q on {where}: a row remapping failed (NVIDIA's RMA criterion)" + (f"; {errors}" if dbe else "")
                           + ": drain the node and replace the GPU"))
    elif dbe:
        out.append(Finding(kind=FindingKind.ECC, severity=Severity.PAGE, **common, evidence={"pci_bus_id": h.pci_bus_id, "ecc_dbe_volatile_total": dbe},
                           summary=f"nvidia-smi -q on {where}: {errors}: drain the node and reset the GPU"))
    if h.remap_pending:
        out.append(Finding(kind=FindingKind.ROW_REMAP_PENDING, severity=Severity.TICKET, **common, evidence={"pci_bus_id": h.pci_bus_id, "remap_pending": True},
                           summary=f"nvidia-smi -q on {where}: a row remapping is pending: reset the GPU to apply it"))
    if h.retired_pages_pending:
        out.append(Finding(kind=FindingKind.RETIRED_PAGES, severity=Severity.TICKET, **common, evidence={"pci_bus_id": h.pci_bus_id, "retired_pages_pending": True},
                           summary=f"nvidia-smi -q on {where}: retired pages are pending blacklist: reboot to retire them"))
    return out


# ---------------------------------------------------------------- a saved gpuvigil /metrics page


def active_findings(samples: Iterable[Mapping[str, Any]], display: str, ts: float) -> list[Finding]:
    """The findings gpuvigil itself had active when its `/metrics` was saved: one per sample of
    an active-findings gauge above zero (`metric`, `labels`, `value`) whose kind and severity
    gpuvigil knows."""
    out = []
    for s in samples:
        if s["metric"] not in ACTIVE_FINDINGS_METRICS or s["value"] <= 0:
            continue
        labels = s["labels"]
        try:
            kind, sev = FindingKind(labels.get("kind", "")), Severity(labels.get("severity", ""))
        except ValueError:
            continue
        node, job = labels.get("node"), labels.get("job")
        out.append(
            Finding(
                kind=kind,
                severity=sev,
                ts=ts,
                node=node,
                job=job,
                evidence={"active_count": int(s["value"]), "metric": s["metric"]},
                summary=f"gpuvigil had {int(s['value'])} active {kind.value} finding(s) on {'node ' + node if node else 'job ' + str(job)} when this scrape was saved",
                source=display,
            )
        )
    return out
