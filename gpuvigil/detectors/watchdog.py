"""NCCL watchdog timeouts read from the jobs' own logs (`events` of kind `nccl_timeout`, from the
torch/NCCL log source) → one `nccl_timeout` finding per job.

The ranks that print the watchdog's message are the ones that *waited*: they are named in
`ranks`, not as culprits. The culprit is named only when the logs can say it: an XID or ECC
event on one of the reporting ranks' nodes makes the cause hardware and that node the culprit
(so the requeue hint excludes it); otherwise the finding carries no node, and the requeue
excludes nothing. NCCL's own network warnings (`nccl_warn` events: IB completion errors, socket
failures) in the same job's logs, or of no known job in the same file, make the cause `network`
and are counted in the evidence; they are evidence, never a page of their own. The in-process hook or Flight Recorder dumps name culprit ranks (`hang`,
`hang_fr`); this detector is what remains when neither is there (observation level L0).

A timeout read from a log of no known job (a `--log` pattern without `{job}`) still pages: one
finding per node and log file, naming both (`evidence.files`, the summary), with no job, so no
hint acts on a job; its node is the one that logged it (nothing else can be acted on).
"""

from __future__ import annotations

import re
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity, log_file, place
from gpuvigil.parsers.nccl import NET_WARN_PATTERN
from gpuvigil.window import Window

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


class WatchdogTimeoutDetector(Declared):
    spec = DetectorSpec(
        name="watchdog",
        config=WatchdogConfig,
        emits=(FindingKind.NCCL_TIMEOUT,),
        reads={"events": HISTORY},
        order=90,
        level="L0",
        streams=("events",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("watchdog", WatchdogConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        now, c = window.now, self.config
        events = window.get("events")
        timeouts = events.filter((pl.col("kind") == "nccl_timeout") & (pl.col("ts") >= now - c.report_seconds))
        if timeouts.height == 0:
            return []
        hardware = events.filter(pl.col("kind").is_in(["xid", "ecc_dbe", "ecc"]) & (pl.col("ts") >= now - c.hardware_lookback_seconds))
        timeouts = timeouts.with_columns(log_file(pl.col("source")).alias("_file"))
        # NCCL's own network warnings in the same job's (or, of no known job, the same file's) log
        # are the evidence of a network cause, as `analyze` reads them.
        network = events.filter(
            (pl.col("kind") == "nccl_warn") & (pl.col("ts") >= now - c.hardware_lookback_seconds)
            & pl.col("message").str.contains("(?i)" + NET_WARN_PATTERN)
        ).with_columns(log_file(pl.col("source")).alias("_file"))
        # A job's timeouts are one finding, wherever they were read. Lines of no known job (a log
        # whose path names none) are one finding per node and file: still a page, never dropped.
        groups = timeouts.filter(pl.col("job").is_not_null()).sort("ts").partition_by("job", maintain_order=True)
        groups += timeouts.filter(pl.col("job").is_null()).sort("ts").partition_by(["node", "_file"], maintain_order=True)
        findings = [self._finding(rows, hardware, network) for rows in groups if rows.height]
        return sorted(findings, key=lambda f: f.evidence["first_ts"])  # type: ignore[arg-type,return-value]

    def _finding(self, rows: pl.DataFrame, hardware: pl.DataFrame, network: pl.DataFrame) -> Finding:
        job = rows["job"][0]
        ranks = sorted({int(r) for r in rows["rank"].drop_nulls().to_list()})
        nodes = sorted({str(n) for n in rows["node"].drop_nulls().to_list()})
        files = sorted({str(f) for f in rows["_file"].drop_nulls().to_list()})
        messages = rows["message"].to_list()
        seq, op, timeout_ms = _first(_SEQ, messages), _first(_OP, messages), _first(_TIMEOUT, messages)
        hw = hardware.filter(pl.col("node").is_in(nodes)) if nodes else hardware.clear()
        hw_nodes = sorted({str(n) for n in hw["node"].drop_nulls().to_list()})
        xids = sorted({int(x) for x in hw["xid"].drop_nulls().to_list()})
        net = network.filter(pl.col("job") == job) if job else network.filter(pl.col("job").is_null() & pl.col("_file").is_in(files))
        cause = "hardware" if hw_nodes else ("network" if net.height else "software")
        where = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}" if ranks else "its ranks"
        what = f"collective #{seq}" if seq else "a collective"
        why = (f"; XID {', '.join(map(str, xids))} on {', '.join(hw_nodes)}" if xids else f"; hardware errors on {', '.join(hw_nodes)}") if hw_nodes else ""
        if job:
            who = str(job)
            # The culprit node only: a software timeout blames no node, so the requeue excludes none.
            node = hw_nodes[0] if hw_nodes else None
        else:
            # No job to act on: the finding is about the node (and file) that logged it.
            logs = ", ".join(f"{nodes[0]}:{f}" if len(nodes) == 1 else f for f in files) or (place(nodes[0]) if len(nodes) == 1 else "")
            who = "Job unknown" + (f" (log {logs})" if logs else "")
            node = hw_nodes[0] if hw_nodes else (nodes[0] if len(nodes) == 1 else None)
        evidence: dict[str, Any] = {
            "reporting_ranks": ranks,
            "nodes": nodes,
            "culprit_nodes": hw_nodes,
            "seq": int(seq) if seq else None,
            "op": op,
            "timeout_ms": int(timeout_ms) if timeout_ms else None,
            "lines": int(rows.height),
            "first_ts": float(rows["ts"].min()),
            "xids": xids,
        }
        if files:
            evidence["files"] = files
        if net.height:
            evidence["network_warnings"] = int(net.height)
            evidence["first_network_warning"] = str(net.sort("ts")["message"][0])[:300]
        return Finding(
            kind=FindingKind.NCCL_TIMEOUT,
            severity=Severity.PAGE,
            ts=float(rows["ts"].max()),
            job=job,
            ranks=ranks,
            node=node,
            cause=cause,
            source=self.name,
            evidence=evidence,
            summary=(
                f"{who}: the NCCL watchdog timed out {what}" + (f" ({op})" if op else "")
                + f" on {where}" + (f" ({', '.join(nodes)})" if nodes else "") + why
                + (f"; {net.height} NCCL network warning(s) in the log" if net.height and not hw_nodes else "")
                + ("" if hw_nodes else "; the ranks that did not join are not in the logs")
                + "."
            ),
        )
