"""NCCL watchdog timeouts read from the jobs' own logs (`events` of kind `nccl_timeout`, from the
torch/NCCL log source) → one `nccl_timeout` finding per job.

The ranks that print the watchdog's message are the ones that *waited*: they are named in
`ranks`, not as culprits. The culprit is named only when the logs can say it: an XID or ECC
event on one of the reporting ranks' nodes makes the cause hardware and that node the culprit
(so the requeue hint excludes it); otherwise the finding carries no node, and the requeue
excludes nothing. The in-process hook or Flight Recorder dumps name culprit ranks (`hang`,
`hang_fr`); this detector is what remains when neither is there (observation level L0).
"""

from __future__ import annotations

import re
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

_SEQ = re.compile(r"SeqNum=(\d+)")
_OP = re.compile(r"OpType=(\w+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)")


class WatchdogConfig(BaseModel):
    # A timeout is reported (kept active) for this long after its last log line.
    report_seconds: float = Field(600.0, gt=0)
    # XID/ECC events this recent on a reporting rank's node make the cause hardware.
    hardware_lookback_seconds: float = Field(300.0, ge=0)


def _first(pattern: re.Pattern[str], messages: list[str]) -> str | None:
    for m in messages:
        hit = pattern.search(m or "")
        if hit:
            return hit.group(1)
    return None


class WatchdogTimeoutDetector:
    name = "watchdog"
    level = "L0"
    capability = None
    streams = ("events",)

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("watchdog", WatchdogConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        now, c = window.now, self.config
        events = window.get("events")
        timeouts = events.filter((pl.col("kind") == "nccl_timeout") & pl.col("job").is_not_null() & (pl.col("ts") >= now - c.report_seconds))
        if timeouts.height == 0:
            return []
        hardware = events.filter(pl.col("kind").is_in(["xid", "ecc_dbe", "ecc"]) & (pl.col("ts") >= now - c.hardware_lookback_seconds))
        findings = []
        for rows in timeouts.sort("ts").partition_by("job", maintain_order=True):
            job = rows["job"][0]
            ranks = sorted({int(r) for r in rows["rank"].drop_nulls().to_list()})
            nodes = sorted({str(n) for n in rows["node"].drop_nulls().to_list()})
            messages = rows["message"].to_list()
            seq, op, timeout_ms = _first(_SEQ, messages), _first(_OP, messages), _first(_TIMEOUT, messages)
            hw = hardware.filter(pl.col("node").is_in(nodes)) if nodes else hardware.clear()
            hw_nodes = sorted({str(n) for n in hw["node"].drop_nulls().to_list()})
            xids = sorted({int(x) for x in hw["xid"].drop_nulls().to_list()})
            cause = "hardware" if hw_nodes else "software"
            where = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}" if ranks else "its ranks"
            what = f"collective #{seq}" if seq else "a collective"
            why = (f"; XID {', '.join(map(str, xids))} on {', '.join(hw_nodes)}" if xids else f"; hardware errors on {', '.join(hw_nodes)}") if hw_nodes else ""
            findings.append(
                Finding(
                    kind=FindingKind.NCCL_TIMEOUT,
                    severity=Severity.PAGE,
                    ts=float(rows["ts"].max()),
                    job=job,
                    ranks=ranks,
                    node=hw_nodes[0] if hw_nodes else None,
                    cause=cause,
                    source=self.name,
                    evidence={
                        "reporting_ranks": ranks,
                        "nodes": nodes,
                        "culprit_nodes": hw_nodes,
                        "seq": int(seq) if seq else None,
                        "op": op,
                        "timeout_ms": int(timeout_ms) if timeout_ms else None,
                        "lines": int(rows.height),
                        "first_ts": float(rows["ts"].min()),
                        "xids": xids,
                    },
                    summary=(
                        f"{job}: the NCCL watchdog timed out {what}" + (f" ({op})" if op else "")
                        + f" on {where}" + (f" ({', '.join(nodes)})" if nodes else "") + why
                        + ("" if hw_nodes else "; the ranks that did not join are not in the logs")
                        + "."
                    ),
                )
            )
        return findings
