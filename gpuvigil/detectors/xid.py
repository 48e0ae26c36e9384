"""XID events → findings, with meaning, fatality and NVIDIA's immediate action from the XID table."""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.gpu import xid as xid_table
from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window


class XidConfig(BaseModel):
    report_seconds: float = 600.0
    ecc_codes: list[int] = [48, 63, 64, 92, 94, 95]


class XidDetector(Declared):
    spec = DetectorSpec(
        name="xid",
        config=XidConfig,
        emits=(FindingKind.XID,),
        reads={"events": HISTORY, "allocations": HISTORY, "gpu_samples": FRESH},
        order=80,
        level="L0",
        streams=("events", "gpu_samples"),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("xid", XidConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        ev = window.get("events")
        # nothing recent: most ticks (a max over the column is far cheaper than the filter)
        if ev.height == 0 or (latest := ev.get_column("ts").max()) is None or latest < now - self.config.report_seconds:  # type: ignore[operator]
            return []
        ev = ev.filter(
            (pl.col("kind") == "xid")
            & pl.col("xid").is_not_null()
            & ~pl.col("xid").is_in(self.config.ecc_codes)
            & (pl.col("ts") >= now - self.config.report_seconds)
        )
        if ev.height == 0:
            return []
        groups = (
            ev.sort("ts")
            .group_by(["node", "gpu", "xid"], maintain_order=True)
            .agg(
                pl.len().alias("count"),
                pl.col("ts").min().alias("first_ts"),
                pl.col("ts").max().alias("last_ts"),
                pl.col("message").last(),
                pl.col("job").drop_nulls().last().alias("event_job"),
            )
            .join(gpu_jobs(window), on=["node", "gpu"], how="left")
        )
        findings = []
        for row in groups.iter_rows(named=True):
            code = int(row["xid"])
            info = xid_table.xid_info(code)
            fatal = xid_table.is_fatal(code, row["message"] or "")
            job = row["job"] or row["event_job"]
            meaning = info.name if info else "unknown XID (not in the table)"
            action = info.action if info else "CONTACT_SUPPORT"
            findings.append(
                Finding(
                    kind=FindingKind.XID,
                    severity=Severity.PAGE if fatal else Severity.TICKET,
                    ts=float(row["last_ts"]),
                    job=job,
                    ranks=[int(row["rank"])] if row.get("rank") is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    xid=code,
                    cause="hardware" if fatal else "software",
                    source=self.name,
                    evidence={
                        "xid": code,
                        "fatal": fatal,
                        "action": action,
                        "meaning": meaning,
                        "count": int(row["count"]),
                        "first_ts": float(row["first_ts"]),
                        "message": row["message"],
                    },
                    summary=(
                        f"XID {code} ({meaning}) on {place(row['node'], row['gpu'])}"
                        + (f" under job {job}" if job else "")
                        + (f": {'fatal, cordon the node' if fatal else 'application-level'}; NVIDIA action {action}.")
                    ),
                )
            )
        return findings
