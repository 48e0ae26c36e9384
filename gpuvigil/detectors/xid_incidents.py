"""What XID incidents read from a kernel log mean: one `xid` finding per incident (a burst of
the same XID on the same GPU, `gpuvigil.collectors.kernel_log.incidents`), paging, ticketing or
informing by the XID policy `serve`'s XID detector uses too (`gpuvigil.policies.xid_severity`,
`xid_cause`), so an XID is the same severity online and offline; and one node-level finding per
cascade, where one root XID hit several GPUs of a node.

The incidents keep what the `events` stream does not: the PCI bus id, the line numbers, the
processes named and the XIDs a line says were caused by an earlier one.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from gpuvigil import policies
from gpuvigil.gpu import xid
from gpuvigil.model import Finding, FindingKind, Severity


def findings(
    incident_frame: pl.DataFrame,
    *,
    source_file: str | None = None,
    job: str | None = None,
    companion_window_seconds: float = 180.0,
) -> list[Finding]:
    """`xid` findings, one per incident: page for fatal XIDs, ticket for the application's own."""
    rows = incident_frame.to_dicts()
    out = [_incident_finding(row, _companions(row, rows, companion_window_seconds), source_file=source_file, job=job) for row in rows]
    return _group_cascades(out)


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


def _incident_finding(row: dict[str, Any], companions: list[int], *, source_file: str | None, job: str | None) -> Finding:
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
        "count": int(row["count"]),
        "first_ts": row["first_ts"],
        "last_ts": row["last_ts"],
        "pci_bus_id": row["pci_bus_id"],
        "message": row["message"],
        "pids": list(row["pids"]),
        "processes": list(row["processes"]),
        "with_xids": companions,
        "ts_kind": row["ts_kind"],
    }
    reported = [int(r) for r in (row.get("reported_xids") or []) if r is not None and int(r) != code]
    if reported:
        # lines like "Xid 45 ... caused by previous Xid <code>": attributed to <code>
        evidence["caused_xids"] = reported
    if info is not None and not info.verified:
        evidence["table_row_verified"] = False
    times = f"{row['count']}×" if row["count"] > 1 else "once"
    summary = f"XID {code} ({name}) on {gpu_txt} of {where}, {times}"
    if reported:
        summary += f" (reported as Xid {', '.join(map(str, reported))} caused by previous Xid {code})"
    summary += f"; NVIDIA's immediate action: {action}" if action else ""
    return Finding(
        kind=FindingKind.XID,
        severity=policies.xid_severity(code, row["message"] or ""),
        ts=row["first_ts"],
        job=job,
        node=row["node"],
        gpu=row["gpu"],
        xid=code,
        evidence=evidence,
        summary=summary,
        source=f"{source_file}:{row['first_line']}" if source_file else "kernel_log",
        cause=policies.xid_cause(code, row["message"] or ""),
    )


_SEVERITY_RANK = {Severity.PAGE: 0, Severity.TICKET: 1, Severity.INFO: 2}


def _group_cascades(found: list[Finding]) -> list[Finding]:
    """One node-level finding per cascade: the GPUs of a node hit by the same root XID (at least
    one of them only through "caused by previous Xid N" lines) page once, not once per GPU."""
    groups: dict[tuple[str | None, int], list[Finding]] = {}
    for f in found:
        groups.setdefault((f.node, int(f.xid)), []).append(f)  # type: ignore[arg-type]
    out: list[Finding] = []
    grouped: set[int] = set()
    for (node, code), members in groups.items():
        gpus = {m.evidence["pci_bus_id"] for m in members}
        if len(gpus) < 2 or not any(m.evidence.get("caused_xids") for m in members):
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
            for m in sorted(members, key=lambda m: (m.ts, m.evidence["pci_bus_id"]))
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
