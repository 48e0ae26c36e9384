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

`NcclErrorDetector`: an NCCL call that failed (`events` of kind `nccl_error`: torch's
DistBackendError / RuntimeError `NCCL error in: ...`, the watchdog's `NCCL error: ...`) is a page
of its own, `nccl_error`, per job or, of no known job, per node and file, as above. Its cause is
what NCCL's result and last error say (`parsers.nccl.error_cause`), or `hardware` with an XID or
ECC event on the node that logged it. torch announces such an error with "Some NCCL operations
have failed or timed out" too: where the same job's (or file's) log has the error, that line is
not a timeout of its own.
"""

from __future__ import annotations

import re
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.policies import implicates_hardware
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity, log_file, place
from gpuvigil.parsers.nccl import NET_WARN_PATTERN, describe_error, error_cause, parse_error_message
from gpuvigil.window import Window

_SEQ = re.compile(r"SeqNum=(\d+)")
_OP = re.compile(r"OpType=(\w+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)")
# The events of a timeout that the log tells only by this line (no WorkNCCL line).
SOME_FAILED = "Some NCCL operations have failed or timed out"


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


def _network_warnings(events: pl.DataFrame, since: float) -> pl.DataFrame:
    """NCCL's own network warnings since `since`, with the log file they came from: in the same
    job's (or, of no known job, the same file's) log they are the evidence of a network cause."""
    return events.filter(
        (pl.col("kind") == "nccl_warn") & (pl.col("ts") >= since) & pl.col("message").str.contains("(?i)" + NET_WARN_PATTERN)
    ).with_columns(log_file(pl.col("source")).alias("_file"))


def _per_job_or_file(rows: pl.DataFrame) -> list[pl.DataFrame]:
    """A job's lines are one finding, wherever they were read; lines of no known job (a log whose
    path names none) are one finding per node and file: still a page, never dropped."""
    groups = rows.filter(pl.col("job").is_not_null()).sort("ts").partition_by("job", maintain_order=True)
    return groups + rows.filter(pl.col("job").is_null()).sort("ts").partition_by(["node", "_file"], maintain_order=True)


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
        hardware = events.filter(implicates_hardware(now - c.hardware_lookback_seconds))
        timeouts = timeouts.with_columns(log_file(pl.col("source")).alias("_file"))
        network = _network_warnings(events, now - c.hardware_lookback_seconds)
        groups = _per_job_or_file(timeouts)
        errors = events.filter((pl.col("kind") == "nccl_error") & (pl.col("ts") >= now - c.report_seconds)).with_columns(log_file(pl.col("source")).alias("_file"))
        groups = [rows for rows in groups if rows.height and not _explained_by_error(rows, errors)]
        findings = [self._finding(rows, hardware, network) for rows in groups]
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


def _explained_by_error(rows: pl.DataFrame, errors: pl.DataFrame) -> bool:
    """A group of timeout events that are all "Some NCCL operations have failed" lines, in a job
    (or, of no known job, a node's file) whose log has an NCCL error: the error says what failed."""
    if errors.height == 0 or not all(m == SOME_FAILED for m in rows["message"].to_list()):
        return False
    job = rows["job"][0]
    if job is not None:
        return errors.filter(pl.col("job") == job).height > 0
    files = rows["_file"].drop_nulls().unique().to_list()
    nodes = rows["node"].drop_nulls().unique().to_list()
    same = errors.filter(pl.col("job").is_null())
    same = same.filter(pl.col("_file").is_in(files)) if files else same.filter(pl.col("_file").is_null())
    return (same.filter(pl.col("node").is_in(nodes)) if nodes else same).height > 0


class NcclErrorConfig(WatchdogConfig):
    """As the watchdog's: an NCCL error is reported this long after its last log line, and XID/ECC
    events this recent on the node that logged it make the cause hardware."""


class NcclErrorDetector(Declared):
    spec = DetectorSpec(
        name="nccl_error",
        config=NcclErrorConfig,
        emits=(FindingKind.NCCL_ERROR,),
        reads={"events": HISTORY},
        order=91,
        level="L0",
        streams=("events",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("nccl_error", NcclErrorConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        now, c = window.now, self.config
        events = window.get("events")
        errors = events.filter((pl.col("kind") == "nccl_error") & (pl.col("ts") >= now - c.report_seconds))
        if errors.height == 0:
            return []
        hardware = events.filter(implicates_hardware(now - c.hardware_lookback_seconds))
        network = _network_warnings(events, now - c.hardware_lookback_seconds)
        errors = errors.with_columns(log_file(pl.col("source")).alias("_file"))
        groups = _per_job_or_file(errors)
        found = [f for rows in groups if rows.height and (f := self._finding(rows, hardware, network)) is not None]
        return sorted(found, key=lambda f: f.evidence["first_ts"])  # type: ignore[arg-type,return-value]

    def _finding(self, rows: pl.DataFrame, hardware: pl.DataFrame, network: pl.DataFrame) -> Finding | None:
        parsed = [e for m in rows["message"].to_list() if (e := parse_error_message(m or "")) is not None]
        if not parsed:
            return None
        # The fullest copy of the first error: the one that carries NCCL's last error.
        first = parsed[0]
        best = next((e for e in parsed if e.last_error and (e.code, e.where) == (first.code, first.where)), first)
        job = rows["job"][0]
        ranks = sorted({int(r) for r in rows["rank"].drop_nulls().to_list()})
        nodes = sorted({str(n) for n in rows["node"].drop_nulls().to_list()})
        files = sorted({str(f) for f in rows["_file"].drop_nulls().to_list()})
        hw = hardware.filter(pl.col("node").is_in(nodes)) if nodes else hardware.clear()
        hw_nodes = sorted({str(n) for n in hw["node"].drop_nulls().to_list()})
        xids = sorted({int(x) for x in hw["xid"].drop_nulls().to_list()})
        net = network.filter(pl.col("job") == job) if job else network.filter(pl.col("job").is_null() & pl.col("_file").is_in(files))
        cause = "hardware" if hw_nodes else error_cause(best, network_warnings=net.height > 0)
        if job:
            who = str(job)
        else:
            logs = ", ".join(f"{nodes[0]}:{f}" if len(nodes) == 1 else f for f in files) or (place(nodes[0]) if len(nodes) == 1 else "")
            who = "Job unknown" + (f" (log {logs})" if logs else "")
        # The node to act on: the one with the hardware error; of no known job, the one that logged it.
        node = hw_nodes[0] if hw_nodes else (nodes[0] if len(nodes) == 1 else None)
        where = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}" if ranks else "rank unknown"
        why = f"; XID {', '.join(map(str, xids))} on {', '.join(hw_nodes)}" if xids else (f"; hardware errors on {', '.join(hw_nodes)}" if hw_nodes else "")
        evidence: dict[str, Any] = {
            "code": best.code,
            "reason": best.reason,
            "where": best.where,
            "nccl_version": best.nccl_version,
            "last_error": best.last_error,
            "reporting_ranks": ranks,
            "nodes": nodes,
            "culprit_nodes": hw_nodes,
            "xids": xids,
            "lines": int(rows.height),
            "first_ts": float(rows["ts"].min()),
        }
        if files:
            evidence["files"] = files
        if net.height:
            evidence["network_warnings"] = int(net.height)
            evidence["first_network_warning"] = str(net.sort("ts")["message"][0])[:300]
        return Finding(
            kind=FindingKind.NCCL_ERROR,
            severity=Severity.PAGE,
            ts=float(rows["ts"].max()),
            job=job,
            ranks=ranks,
            node=node,
            cause=cause,
            source=self.name,
            evidence=evidence,
            summary=f"{who}: NCCL error ({where}" + (f", {', '.join(nodes)}" if nodes else "") + f"): {describe_error(best).rstrip('.')}{why}.",
        )
