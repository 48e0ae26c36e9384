"""What one saved reading of a node says on its own, with no history: `nvidia-smi -q` output, an
NVML time series of clock-event reasons, and a saved gpuvigil `/metrics` page. `analyze` reads
them (parsers/nvidia_smi.py, offline/formats.py) and this module judges what it read.

A saved dcgm-exporter scrape is judged by serve's own detectors (`offline.analyze.scrape_findings`:
XIDs, ECC, memory repairs, the NVLink fabric), as is a sysfs tree's InfiniBand ports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import polars as pl

from gpuvigil.gpu import throttle
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.parsers.nvidia_smi import SmiHealth

# NVML clock-event reasons that mean the GPU slowed itself down for heat (NVML's
# nvmlClocksEventReasonSwThermalSlowdown 0x20, HwThermalSlowdown 0x40, HwSlowdown 0x08).
THERMAL_REASONS_MASK = throttle.THERMAL_MASK
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


# ---------------------------------------------------------------- NVML time series


def thermal_findings(samples: pl.DataFrame, display: str, undated_ts: float) -> list[Finding]:
    """Thermal slowdowns in an NVML time series: one ticket per GPU that slowed its clocks for
    heat in any sample. `samples`: one row per sample with `_ts`, `_gpu`, `_reasons` (the
    clock-event reasons bit mask), `_line` (its line in the file) and, when recorded, `temp_c`;
    `undated_ts` is where a GPU whose samples carry no time is placed."""
    df = samples.with_columns(((pl.col("_reasons") & THERMAL_REASONS_MASK) != 0).fill_null(False).alias("_hot"))
    hot = (
        df.filter(pl.col("_hot"))
        .group_by("_gpu", maintain_order=True)
        .agg(
            pl.len().alias("samples"),
            pl.col("_ts").min().alias("first_ts"),
            pl.col("_ts").max().alias("last_ts"),
            pl.col("_line").first().alias("line"),
            pl.col("_reasons").first().alias("reasons"),
            (pl.col("temp_c").max() if "temp_c" in df.columns else pl.lit(None)).alias("max_temp_c"),
        )
    )
    totals = df.group_by("_gpu").agg(pl.len().alias("all_samples"))
    return [
        Finding(
            kind=FindingKind.THERMAL_THROTTLE,
            severity=Severity.TICKET,
            ts=row["first_ts"] if row["first_ts"] is not None else undated_ts,
            gpu=row["_gpu"],
            evidence={
                "samples": row["samples"],
                "of_samples": row["all_samples"],
                "first_ts": row["first_ts"],
                "last_ts": row["last_ts"],
                "clock_event_reasons": row["reasons"],
                "max_temperature_c": row["max_temp_c"],
            },
            summary=f"GPU {row['_gpu']} slowed its clocks for heat in {row['samples']} of {row['all_samples']} samples",
            source=f"{display}:{row['line']}",
            cause="hardware",
        )
        for row in hot.join(totals, on="_gpu").to_dicts()
    ]


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
