"""What the XID incidents of a whole kernel log mean, read after the fact (`analyze`): one `xid`
finding per incident (a burst of the same XID on the same GPU, the `xid_incidents` stream that
`gpuvigil.collectors.kernel_log.incident_rows` fills), paging, ticketing or informing by the XID
policy `serve`'s XID detector uses too (`gpuvigil.policies.xid_severity`, `xid_cause`), so an XID
is the same severity online and offline; and one node-level finding per cascade, where one root
XID hit several GPUs of a node.

A registered detector placed `offline` (only `analyze` runs it), not the live `xid` detector
over the log's `events` rows: what a whole log holds, no live stream does. Its incidents keep the
PCI bus id (most logs name no GPU index), the line numbers and processes, and the XIDs a line
says were caused by an earlier one; a burst is judged whole, however long ago, where `xid` judges
the last `report_seconds` of events as they arrive, leaves the ECC codes (48, 63, 64, 92, 94, 95)
to `ecc`, and blames by the jobs each GPU saw over days, which one log cannot tell. Judged by
`xid`, the public kernel logs would lose their ECC-code XIDs, their GPUs known only by bus id
and their cascades.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from gpuvigil import config, policies
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.gpu import xid
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class XidIncidentsConfig(BaseModel):
    # Other XIDs on the same GPU within this many seconds of an incident's burst are its
    # companions (`with_xids`): e.g. 48 with 63/64 changes NVIDIA's workflow (drain and reset).
    # null: the silence that ends a burst (`kernel_log.burst_gap_seconds`), one episode either way.
    companion_seconds: float | None = Field(None, ge=0)
    # A cascade: the same root XID on at least this many GPUs of a node, at least one of them only
    # through "caused by previous Xid N" lines; it pages once for the node, not once per GPU.
    cascade_min_gpus: int = Field(2, ge=2)


class _BurstGap(BaseModel):
    """The one setting of the `kernel_log` section this detector follows (the section's own
    model belongs to the reader, which detectors do not import)."""

    model_config = ConfigDict(extra="ignore")
    burst_gap_seconds: float = Field(180.0, gt=0)


class XidIncidentDetector(Declared):
    spec = DetectorSpec(
        name="xid_incidents",
        config=XidIncidentsConfig,
        emits=(FindingKind.XID,),
        reads={"xid_incidents": HISTORY},
        order=81,
        level="L0",
        placement_override="offline",
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("xid_incidents", XidIncidentsConfig, cfg)
        given = self.config.companion_seconds
        self.companion_seconds = given if given is not None else config.section("kernel_log", _BurstGap, cfg).burst_gap_seconds

    def detect(self, window: Window) -> list[Finding]:
        """`xid` findings, one per incident (one per cascade): page for fatal XIDs, ticket for
        the application's own."""
        inc = window.get("xid_incidents")
        if inc.height == 0:
            return []
        rows = (
            inc.filter(pl.col("xid").is_not_null() & pl.col("first_ts").is_not_null())
            .with_columns(pl.col("last_ts").fill_null(pl.col("first_ts")))
            .sort(["first_ts", "first_line"], nulls_last=True, maintain_order=True)
            .to_dicts()
        )
        window_s = self.companion_seconds
        out = [_incident_finding(row, _companions(row, rows, window_s)) for row in rows]
        return _group_cascades(out, self.config.cascade_min_gpus)


def _companions(row: dict[str, Any], rows: list[dict[str, Any]], window_seconds: float) -> list[int]:
    """Other XIDs on the same GPU while this one was bursting: e.g. 48 with 63/64 changes
    NVIDIA's workflow (drain and reset), 45/43 are usually its consequences."""
    code = int(row["xid"])
    return sorted(
        {
            int(o["xid"])
            for o in rows
            if o is not row
            and o["node"] == row["node"]
            and o["pci_bus_id"] == row["pci_bus_id"]
            and int(o["xid"]) != code
            and o["first_ts"] <= row["last_ts"] + window_seconds
            and o["last_ts"] >= row["first_ts"] - window_seconds
        }
    )


def _incident_finding(row: dict[str, Any], companions: list[int]) -> Finding:
    code = int(row["xid"])
    info = xid.xid_info(code)
    fatal = xid.is_fatal(code, row["message"] or "")
    name = info.name if info else "unknown XID (not in gpuvigil's table; see NVIDIA's XID catalog)"
    action = info.action if info else None
    where = row["node"] or "this node"
    gpu_txt = f"GPU {row['gpu']}" if row["gpu"] is not None else f"GPU at PCI {row['pci_bus_id']}"
    evidence: dict[str, Any] = {
        "fatal": fatal,
        "app_level": info.app_level if info else False,
        "action": action,
        "category": info.category if info else None,
        "name": name,
        "count": int(row["count"] or 1),
        "first_ts": row["first_ts"],
        "last_ts": row["last_ts"],
        "pci_bus_id": row["pci_bus_id"],
        "message": row["message"],
        "pids": list(row["pids"] or []),
        "processes": list(row["processes"] or []),
        "with_xids": companions,
        "ts_kind": row["ts_kind"],
    }
    reported = [int(r) for r in (row.get("reported_xids") or []) if r is not None and int(r) != code]
    if reported:
        # lines like "Xid 45 ... caused by previous Xid <code>": attributed to <code>
        evidence["caused_xids"] = reported
    if info is not None and not info.verified:
        evidence["table_row_verified"] = False
    times = f"{evidence['count']}×" if evidence["count"] > 1 else "once"
    summary = f"XID {code} ({name}) on {gpu_txt} of {where}, {times}"
    if reported:
        summary += f" (reported as Xid {', '.join(map(str, reported))} caused by previous Xid {code})"
    summary += f"; NVIDIA's immediate action: {action}" if action else ""
    return Finding(
        kind=FindingKind.XID,
        severity=policies.xid_severity(code, row["message"] or ""),
        ts=row["first_ts"],
        job=row["job"],
        node=row["node"],
        gpu=row["gpu"],
        xid=code,
        evidence=evidence,
        summary=summary,
        source=f"{row['file']}:{row['first_line']}" if row["file"] else "kernel_log",
        cause=policies.xid_cause(code, row["message"] or ""),
    )


_SEVERITY_RANK = {Severity.PAGE: 0, Severity.TICKET: 1, Severity.INFO: 2}


def _group_cascades(found: list[Finding], min_gpus: int) -> list[Finding]:
    """One node-level finding per cascade: the GPUs of a node hit by the same root XID (at least
    one of them only through "caused by previous Xid N" lines) page once, not once per GPU."""
    groups: dict[tuple[str | None, int], list[Finding]] = {}
    for f in found:
        groups.setdefault((f.node, int(f.xid)), []).append(f)  # type: ignore[arg-type]
    out: list[Finding] = []
    grouped: set[int] = set()
    for (node, code), members in groups.items():
        gpus = {m.evidence["pci_bus_id"] for m in members}
        if len(gpus) < min_gpus or not any(m.evidence.get("caused_xids") for m in members):
            continue
        first = min(members, key=lambda m: (m.ts, m.source or ""))
        worst = min(members, key=lambda m: _SEVERITY_RANK[m.severity])
        info = xid.xid_info(code)
        name = first.evidence["name"]
        per_gpu = [
            {
                "pci_bus_id": m.evidence["pci_bus_id"],
                "gpu": m.gpu,
                "count": m.evidence["count"],
                "first_ts": m.evidence["first_ts"],
                "caused_xids": m.evidence.get("caused_xids", []),
                "direct": not m.evidence.get("caused_xids"),
            }
            for m in sorted(members, key=lambda m: (m.ts, m.evidence["pci_bus_id"] or ""))
        ]
        evidence = {k: worst.evidence.get(k) for k in ("fatal", "app_level", "action", "category", "name")}
        evidence.update(
            {
                "cascade": True,
                "gpus": per_gpu,
                "gpu_count": len(per_gpu),
                "count": sum(g["count"] for g in per_gpu),
                "first_ts": min(g["first_ts"] for g in per_gpu),
                "last_ts": max(m.evidence["last_ts"] for m in members),
                "message": worst.evidence.get("message"),
                "ts_kind": first.evidence.get("ts_kind"),
                "pci_bus_id": None,
                "with_xids": sorted({x for m in members for x in m.evidence.get("with_xids", [])}),
            }
        )
        where = node or "this node"
        summary = f"XID {code} ({name}) cascade on {where}: {len(per_gpu)} GPUs hit"
        summary += f" ({', '.join(str(g['gpu']) if g['gpu'] is not None else g['pci_bus_id'] for g in per_gpu)})"
        summary += f"; NVIDIA's immediate action: {evidence['action']}" if evidence.get("action") else ""
        out.append(
            Finding(
                kind=FindingKind.XID,
                severity=worst.severity,
                ts=first.ts,
                job=first.job,
                node=node,
                gpu=None,
                xid=code,
                evidence=evidence,
                summary=summary,
                source=first.source,
                cause=worst.cause if info is not None else None,
            )
        )
        grouped.update(id(m) for m in members)
    out.extend(f for f in found if id(f) not in grouped)
    out.sort(key=lambda f: (f.ts, f.source or ""))
    return out
