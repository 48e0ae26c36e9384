"""NCCL watchdog timeouts read from the jobs' own logs (`events` of kind `nccl_timeout`, from the
torch/NCCL log source) → one `nccl_timeout` finding per job. The same rule judges a live log
(`serve`, `detect`, `replay`) and a whole log after the fact (`analyze` runs this detector over
the log's events): there is no second copy of it.

The ranks that print the watchdog's message are the ones that *waited*: they are named in
`ranks`, not as culprits. Each timeout's WorkNCCL line (`parsers.nccl.parse_timeout`) says which
collective (sequence number, op, process group, sizes, timeout, how long it ran); the timeouts
are grouped per collective, and the ranks whose progress line (`nccl_progress` events,
`parsers.nccl.parse_progress`) says they stopped at that collective are among those that waited.
A rank whose progress line, in the same process group, says its last *enqueued* work is below
the timed-out sequence number never reached the collective the others are stuck in: it is
holding them up (elsewhere in the program, or dead), and is named in `culprit_ranks`.

The culprit node is named only when the logs can say it: an XID or ECC event on one of the
reporting ranks' nodes makes the cause hardware and that node the culprit (so the requeue hint
excludes it); otherwise the finding carries no node, and the requeue excludes nothing. NCCL's
own network warnings (`nccl_warn` events: IB completion errors, socket failures) in the same
job's logs, or of no known job in the same file, make the cause `network` and are counted in the
evidence; they are evidence, never a page of their own. The in-process hook or Flight Recorder
dumps name culprit ranks from the collectives' own state (`hang`, `hang_fr`); this detector is
what remains when neither is there (observation level L0).

A job is one finding (its identity, kinds.py): when its logs time out on several collectives
(two process groups, or a later collective after a restart), the finding is about the first one
to time out (its seq, op and progress are the evidence's top-level fields, its summary names it)
and `evidence.collectives` lists every one, each with its ranks and culprits; `ranks` and
`culprit_ranks` are those of all of them.

A timeout read from a log of no known job (a `--log` pattern without `{job}`) still pages: one
finding per node and log file, naming both (`evidence.files`, the summary), with no job, so no
hint acts on a job; its node is the one that logged it (nothing else can be acted on).

`NcclErrorDetector`: an NCCL call that failed (`events` of kind `nccl_error`: torch's
DistBackendError / RuntimeError `NCCL error in: ...`, the watchdog's `NCCL error: ...`) is a page
of its own, `nccl_error`, per job or, of no known job, per node and file, as above. It is about
the job's first error (its fullest copy, with NCCL's last error); where the logs have several
distinct errors (result and torch's source location), `evidence.errors` lists each with the
ranks that printed it and the summary names the others. Its cause is
what NCCL's result and last error say (`parsers.nccl.error_cause`), or `hardware` with an XID or
ECC event on the node that logged it. torch announces such an error with "Some NCCL operations
have failed or timed out" too: where the same job's (or file's) log has the error, that line is
not a timeout of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.policies import implicates_hardware
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity, log_file, place
from gpuvigil.parsers.nccl import NET_WARN_PATTERN, NcclError, Progress, WatchdogTimeout, describe_error, error_cause, parse_error_message, parse_progress, parse_timeout
from gpuvigil.window import Window

# The events of a timeout that the log tells only by this line (no WorkNCCL line).
SOME_FAILED = "Some NCCL operations have failed or timed out"


class WatchdogConfig(BaseModel):
    # A timeout is reported (kept active) for this long after its last log line.
    report_seconds: float = Field(600.0, gt=0)
    # XID/ECC events this recent on a reporting rank's node make the cause hardware.
    hardware_lookback_seconds: float = Field(300.0, ge=0)


def _pg_id(pg: str | None) -> str | None:
    return pg.split("(")[0] if pg else None


@dataclass
class Collective:
    """One collective that timed out: the ranks' timeouts of it, the ranks that waited in it and
    those that never enqueued it."""

    first: WatchdogTimeout
    timeouts: list[WatchdogTimeout]
    progress: Progress | None = None  # the first reporter's progress line
    ranks: list[int] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)
    per_rank: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"seq": self.first.seq, "op": self.first.op_type, "pg": self.first.pg, "ranks": self.ranks, "culprit_ranks": self.culprits}


def _progress_for(progress: list[Progress], t: WatchdogTimeout) -> Progress | None:
    """The progress line that belongs to a timeout: same rank (and PG when both say)."""
    best: Progress | None = None
    for p in progress:
        if p.rank != t.rank:
            continue
        if p.pg is not None and t.pg is not None and _pg_id(p.pg) != _pg_id(t.pg):
            continue
        if t.seq is not None and p.at_seq is not None and p.at_seq != t.seq:
            continue
        if best is None or (best.at_seq is None and p.at_seq is not None):
            best = p
    return best


def _group(timeouts: list[WatchdogTimeout], progress: list[Progress]) -> list[list[WatchdogTimeout]]:
    """The watchdog timeouts grouped by collective (sequence number, op, process group)."""
    # The same timeout is repeated in exception texts (`what(): [PG ID 0 ...] Watchdog caught
    # ...`) and summaries, sometimes with and sometimes without its process group.
    unique: dict[tuple, WatchdogTimeout] = {}
    for t in timeouts:
        dedupe = (t.rank, t.seq, t.op_type, t.ran_for_ms)
        if dedupe not in unique or (unique[dedupe].pg is None and t.pg is not None):
            unique[dedupe] = t
    groups: dict[tuple, list[WatchdogTimeout]] = {}
    for t in unique.values():
        if t.pg is None and (p := _progress_for(progress, t)) is not None:
            t.pg = p.pg
        groups.setdefault((t.seq, t.op_type, _pg_id(t.pg)), []).append(t)
    # A rank that did not say its process group joins the one group of the same collective.
    for key in [k for k in groups if k[2] is None]:
        named = [k for k in groups if k[:2] == key[:2] and k[2] is not None]
        if len(named) == 1:
            groups[named[0]].extend(groups.pop(key))
    return list(groups.values())


def collectives(timeouts: list[WatchdogTimeout], progress: list[Progress]) -> list[Collective]:
    """The collectives that timed out, first first, each with the ranks that waited in it (that
    printed its timeout, or a progress line stopped at it) and its culprits: the ranks whose
    progress in the same process group says their last enqueued work is below its sequence
    number (the furthest any of a rank's lines got counts)."""
    out: list[Collective] = []
    for group in _group(timeouts, progress):
        first = min(group, key=lambda t: (t.ts, t.line))
        c = Collective(first, group, _progress_for(progress, first))
        # Sequence numbers count per process group: a timeout that names none is compared with
        # the progress of other groups only when the log has one group at most.
        named = {_pg_id(p.pg) for p in progress if p.pg is not None}
        same_pg = [
            p for p in progress
            if p.rank is not None and (p.pg is None or (_pg_id(p.pg) == _pg_id(first.pg) if first.pg is not None else len(named) <= 1))
        ]
        stopped_here = {p.rank for p in same_pg if first.seq is not None and p.at_seq == first.seq}
        c.ranks = sorted({t.rank for t in group if t.rank is not None} | stopped_here)  # type: ignore[arg-type]
        reached: dict[int, int] = {}
        for p in same_pg:
            reached[p.rank] = max(reached.get(p.rank, p.last_enqueued), p.last_enqueued)  # type: ignore[index]
        c.culprits = sorted(r for r, enq in reached.items() if first.seq is not None and enq < first.seq)
        for t in sorted(group, key=lambda t: (t.rank if t.rank is not None else -1)):
            p = _progress_for(progress, t)
            c.per_rank.append({"rank": t.rank, "last_enqueued": p.last_enqueued if p else None, "last_completed": p.last_completed if p else None, "ran_for_ms": t.ran_for_ms})
        out.append(c)
    return sorted(out, key=lambda c: (c.first.ts, c.first.line))


def _records(rows: pl.DataFrame, parse: Any) -> list[Any]:
    """The rows' messages read back by `parse` (parsers.nccl), with the row's time, rank (where
    the message names none) and position (its order in the log)."""
    out = []
    for i, row in enumerate(rows.sort("ts", maintain_order=True).iter_rows(named=True)):
        rec = parse(row["message"] or "", line_no=i, ts=float(row["ts"]))
        if rec is not None:
            if rec.rank is None and row["rank"] is not None:
                rec.rank = int(row["rank"])
            out.append(rec)
    return out


def _network_warnings(events: pl.DataFrame, since: float) -> pl.DataFrame:
    """NCCL's own network warnings since `since`, with the log file they came from: in the same
    job's (or, of no known job, the same file's) log they are the evidence of a network cause."""
    return events.filter(
        (pl.col("kind") == "nccl_warn") & (pl.col("ts") >= since) & pl.col("message").str.contains("(?i)" + NET_WARN_PATTERN)
    ).with_columns(log_file(pl.col("source")).alias("_file"))


def _same_log(df: pl.DataFrame, job: str | None, files: list[str]) -> pl.DataFrame:
    """The rows of `df` from the same job's logs or, of no known job, from the same files."""
    if job:
        return df.filter(pl.col("job") == job)
    return df.filter(pl.col("job").is_null() & (pl.col("_file").is_in(files) if files else pl.col("_file").is_null()))


def _per_job_or_file(rows: pl.DataFrame) -> list[pl.DataFrame]:
    """A job's lines are one finding, wherever they were read; lines of no known job (a log whose
    path names none) are one finding per node and file: still a page, never dropped."""
    groups = rows.filter(pl.col("job").is_not_null()).sort("ts").partition_by("job", maintain_order=True)
    return groups + rows.filter(pl.col("job").is_null()).sort("ts").partition_by(["node", "_file"], maintain_order=True)


@dataclass
class LogContext:
    """What one group of log lines (a job's, or of no known job one node's file) is judged with,
    alike for a timeout and an NCCL error: where it was logged, the hardware errors on those
    nodes (which make the cause hardware and name the culprit node) and NCCL's network warnings
    in the same logs."""

    job: str | None
    nodes: list[str]
    files: list[str]
    hw_nodes: list[str]
    xids: list[int]
    network: pl.DataFrame

    @classmethod
    def of(cls, rows: pl.DataFrame, hardware: pl.DataFrame, network: pl.DataFrame) -> LogContext:
        job = rows["job"][0]
        nodes = sorted({str(n) for n in rows["node"].drop_nulls().to_list()})
        files = sorted({str(f) for f in rows["_file"].drop_nulls().to_list()})
        hw = hardware.filter(pl.col("node").is_in(nodes)) if nodes else hardware.clear()
        return cls(job, nodes, files, sorted({str(n) for n in hw["node"].drop_nulls().to_list()}),
                   sorted({int(x) for x in hw["xid"].drop_nulls().to_list()}), _same_log(network, job, files))

    @property
    def who(self) -> str:
        """The job, or of no known job the log (and its node) it was read from."""
        if self.job:
            return str(self.job)
        nodes, files = self.nodes, self.files
        logs = ", ".join(f"{nodes[0]}:{f}" if len(nodes) == 1 else f for f in files) or (place(nodes[0]) if len(nodes) == 1 else "")
        return "Job unknown" + (f" (log {logs})" if logs else "")

    @property
    def hardware_why(self) -> str:
        if not self.hw_nodes:
            return ""
        return f"; XID {', '.join(map(str, self.xids))} on {', '.join(self.hw_nodes)}" if self.xids else f"; hardware errors on {', '.join(self.hw_nodes)}"

    def timeout_node(self) -> str | None:
        """The node a timeout names: the one with the hardware error; of no known job, the one
        that logged it (nothing else can be acted on). The ranks that print a timeout only
        waited: a job's software timeout blames no node, so its requeue excludes none."""
        if self.hw_nodes:
            return self.hw_nodes[0]
        return self.nodes[0] if not self.job and len(self.nodes) == 1 else None

    def add_sources(self, evidence: dict[str, Any]) -> dict[str, Any]:
        """`evidence` with the log files read and the network warnings in them."""
        if self.files:
            evidence["files"] = self.files
        if self.network.height:
            evidence["network_warnings"] = int(self.network.height)
            evidence["first_network_warning"] = str(self.network.sort("ts")["message"][0])[:300]
        return evidence


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
        progress = events.filter((pl.col("kind") == "nccl_progress") & (pl.col("ts") >= now - c.report_seconds)).with_columns(log_file(pl.col("source")).alias("_file"))
        groups = _per_job_or_file(timeouts)
        errors = events.filter((pl.col("kind") == "nccl_error") & (pl.col("ts") >= now - c.report_seconds)).with_columns(log_file(pl.col("source")).alias("_file"))
        groups = [rows for rows in groups if rows.height and not _explained_by_error(rows, errors)]
        findings = [self._finding(rows, hardware, network, progress) for rows in groups]
        return sorted(findings, key=lambda f: f.evidence["first_ts"])  # type: ignore[arg-type,return-value]

    def _finding(self, rows: pl.DataFrame, hardware: pl.DataFrame, network: pl.DataFrame, progress: pl.DataFrame) -> Finding:
        ctx = LogContext.of(rows, hardware, network)
        same = _same_log(progress, ctx.job, ctx.files)
        colls = collectives(_records(rows, parse_timeout), _records(same.filter(pl.col("node").is_in(ctx.nodes)) if ctx.nodes and not ctx.job else same, parse_progress))
        reporting = sorted({int(r) for r in rows["rank"].drop_nulls().to_list()})
        ranks = sorted(set(reporting).union(*(c.ranks for c in colls)))
        return Finding(
            kind=FindingKind.NCCL_TIMEOUT,
            severity=Severity.PAGE,
            ts=float(rows["ts"].max()),
            job=ctx.job,
            ranks=ranks,
            culprit_ranks=sorted(set().union(*(c.culprits for c in colls))),
            node=ctx.timeout_node(),
            cause="hardware" if ctx.hw_nodes else ("network" if ctx.network.height else "software"),
            source=self.name,
            evidence=ctx.add_sources(_timeout_evidence(colls, reporting, ctx, rows)),
            summary=_timeout_summary(ctx, colls, ranks),
        )


def _timeout_evidence(colls: list[Collective], reporting: list[int], ctx: LogContext, rows: pl.DataFrame) -> dict[str, Any]:
    """The first collective's WorkNCCL fields and progress, per-rank evidence, every collective
    when there were several."""
    first = colls[0] if colls else None
    t, p = (first.first, first.progress) if first else (None, None)
    evidence: dict[str, Any] = {
        "reporting_ranks": reporting,
        "nodes": ctx.nodes,
        "culprit_nodes": ctx.hw_nodes,
        "seq": t.seq if t else None,
        "op": t.op_type if t else None,
        "timeout_ms": t.timeout_ms if t else None,
        "lines": int(rows.height),
        "first_ts": float(rows["ts"].min()),
        "xids": ctx.xids,
    }
    if t is not None:
        extra = {"pg": t.pg, "numel_in": t.numel_in, "numel_out": t.numel_out, "ran_for_ms": t.ran_for_ms,
                 "last_enqueued": p.last_enqueued if p else None, "last_completed": p.last_completed if p else None}
        evidence.update({k: v for k, v in extra.items() if v is not None})
    if first is not None and len(first.per_rank) > 1:
        evidence["per_rank"] = first.per_rank
    if len(colls) > 1:
        evidence["collectives"] = [c.describe() for c in colls]
    return evidence


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _timeout_summary(ctx: LogContext, colls: list[Collective], ranks: list[int]) -> str:
    first = colls[0].first if colls else None
    what = f"collective #{first.seq}" if first is not None and first.seq is not None else "a collective"
    op = first.op_type if first is not None else None
    culprits = colls[0].culprits if colls else []
    hw_nodes, network = ctx.hw_nodes, ctx.network.height
    text = (
        f"{ctx.who}: the NCCL watchdog timed out {what}" + (f" ({op})" if op else "")
        + f" on {_ranks_text(ranks) if ranks else 'its ranks'}" + (f" ({', '.join(ctx.nodes)})" if ctx.nodes else "")
    )
    if culprits:
        text += f"; {_ranks_text(culprits)} never enqueued it (the rank{'s' if len(culprits) != 1 else ''} holding the others up)"
    for c in colls[1:]:
        text += f"; also collective #{c.first.seq} ({c.first.op_type}" + (f", PG {c.first.pg}" if c.first.pg else "") + ")"
    text += ctx.hardware_why
    if network and not hw_nodes:
        text += f"; {network} NCCL network warning(s) in the log"
    if not hw_nodes and not culprits:
        text += "; the ranks that did not join are not in the logs"
    return text + "."


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
        parsed = _errors(rows)
        if not parsed:
            return None
        # The fullest copy of the first error: the one that carries NCCL's last error.
        first = parsed[0]
        best = next((e for e in parsed if e.last_error and (e.code, e.where) == (first.code, first.where)), first)
        ctx = LogContext.of(rows, hardware, network)
        ranks = sorted({int(r) for r in rows["rank"].drop_nulls().to_list()})
        distinct = _distinct_errors(parsed)
        where = _ranks_text(ranks) if ranks else "rank unknown"
        evidence: dict[str, Any] = {
            "code": best.code,
            "reason": best.reason,
            "where": best.where,
            "nccl_version": best.nccl_version,
            "last_error": best.last_error,
            "reporting_ranks": ranks,
            "nodes": ctx.nodes,
            "culprit_nodes": ctx.hw_nodes,
            "xids": ctx.xids,
            "lines": int(rows.height),
            "first_ts": float(rows["ts"].min()),
        }
        if len(distinct) > 1:
            evidence["errors"] = distinct
        also = "".join(f"; also {d['code'] or d['reason']}" + (f" at {d['where']}" if d["where"] else "") for d in distinct[1:])
        return Finding(
            kind=FindingKind.NCCL_ERROR,
            severity=Severity.PAGE,
            ts=float(rows["ts"].max()),
            job=ctx.job,
            ranks=ranks,
            # The node with the hardware error, else the one whose ranks printed it (an error is
            # the failure of the call that printed it; a timeout only says who waited).
            node=ctx.hw_nodes[0] if ctx.hw_nodes else (ctx.nodes[0] if len(ctx.nodes) == 1 else None),
            cause="hardware" if ctx.hw_nodes else error_cause(best, network_warnings=ctx.network.height > 0),
            source=self.name,
            evidence=ctx.add_sources(evidence),
            summary=f"{ctx.who}: NCCL error ({where}" + (f", {', '.join(ctx.nodes)}" if ctx.nodes else "") + f"): {describe_error(best).rstrip('.')}{also}{ctx.hardware_why}.",
        )


def _errors(rows: pl.DataFrame) -> list[NcclError]:
    """The rows' NCCL errors read back from their messages, with the row's rank where the
    message names none."""
    out = []
    for message, rank in zip(rows["message"].to_list(), rows["rank"].to_list(), strict=True):
        if (e := parse_error_message(message or "")) is not None:
            e.rank = e.rank if e.rank is not None else rank
            out.append(e)
    return out


def _distinct_errors(errors: list[NcclError]) -> list[dict[str, Any]]:
    """Each distinct NCCL error of a job's (or file's) log, first first (the same one printed by
    several ranks, or again in a launcher's summary, is one), with the ranks that printed it."""
    groups: dict[tuple, dict[str, Any]] = {}
    for e in errors:
        d = groups.setdefault((e.code or e.reason, e.where), {"code": e.code, "reason": e.reason, "where": e.where, "ranks": []})
        if e.rank is not None and e.rank not in d["ranks"]:
            d["ranks"] = sorted([*d["ranks"], e.rank])
    return list(groups.values())
