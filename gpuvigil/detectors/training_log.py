"""What a parsed training / NCCL log means: `nccl_timeout` (one per collective, over the ranks
that reported it), `nccl_error` (one per distinct NCCL error) and `oom_*` (one per distinct CUDA
OOM, classified by `gpuvigil.parsers.oom`) findings.

`analyze` reads whole logs after the fact, so it judges the parsed records
(`gpuvigil.parsers.nccl.ParsedLog`), which keep what the `events` stream drops: each rank's
progress line, the WorkNCCL fields, the OOM message's byte counts. The online detectors judge the
same messages as `events` (`watchdog`, `nccl_error`, `oom_events`); both read NCCL's result and
last error through `parsers.nccl.error_cause` and classify OOMs with `parsers.oom`, so an NCCL
error or an OOM gets the same cause offline and live. The wordings recognised are listed in
`gpuvigil.collectors.nccl_log`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.parsers.nccl import NcclWarn, ParsedLog, Progress, WatchdogTimeout, describe_error, error_cause, parse_lines
from gpuvigil.parsers.oom import OomClassifyConfig, OomReport, load_oom_config

Source = Callable[[int], str]


def _progress_for(parsed: ParsedLog, t: WatchdogTimeout) -> Progress | None:
    """The progress line that belongs to a timeout: same rank (and PG when both say)."""
    best: Progress | None = None
    for p in parsed.progress:
        if p.rank != t.rank:
            continue
        if p.pg is not None and t.pg is not None and p.pg.split("(")[0] != t.pg.split("(")[0]:
            continue
        if t.seq is not None and p.at_seq is not None and p.at_seq != t.seq:
            continue
        if best is None or (best.at_seq is None and p.at_seq is not None):
            best = p
    return best


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB"


def findings(
    parsed: ParsedLog,
    *,
    source_file: str | None = None,
    job: str | None = None,
    node: str | None = None,
    cfg: dict[str, Any] | None = None,
) -> list[Finding]:
    """`nccl_timeout` (one per collective, over the ranks that reported it), `nccl_error` and
    `oom_*` findings of one parsed log."""
    oom_cfg = load_oom_config(cfg)
    node = node or (parsed.hosts.most_common(1)[0][0] if len(parsed.hosts) == 1 else None)
    src: Source = (lambda line: f"{source_file}:{line}") if source_file else (lambda line: "nccl_log")
    network_warnings = [w for w in parsed.warnings if w.network]
    out = [_timeout_finding(parsed, group, job=job, node=node, src=src, network_warnings=network_warnings) for group in _collectives_timed_out(parsed)]
    out.extend(_error_findings(parsed, job=job, node=node, src=src, network_warnings=bool(network_warnings)))
    out.extend(_unnamed_timeout_finding(parsed, job=job, node=node, src=src, network_warnings=network_warnings))
    out.extend(_oom_findings(parsed, oom_cfg, job=job, node=node, src=src))
    return out


def _collectives_timed_out(parsed: ParsedLog) -> list[list[WatchdogTimeout]]:
    """The watchdog timeouts grouped by collective (sequence number, op, process group)."""
    # The same timeout is repeated in exception texts (`what(): [PG ID 0 ...] Watchdog caught
    # ...`) and summaries, sometimes with and sometimes without its process group.
    unique: dict[tuple, WatchdogTimeout] = {}
    for t in parsed.timeouts:
        dedupe = (t.rank, t.seq, t.op_type, t.ran_for_ms)
        if dedupe not in unique or (unique[dedupe].pg is None and t.pg is not None):
            unique[dedupe] = t
    groups: dict[tuple, list[WatchdogTimeout]] = {}
    for t in sorted(unique.values(), key=lambda t: t.line):
        if t.pg is None and (p := _progress_for(parsed, t)) is not None:
            t.pg = p.pg
        groups.setdefault((t.seq, t.op_type, t.pg.split("(")[0] if t.pg else None), []).append(t)
    # A rank that did not say its process group joins the one group of the same collective.
    for key in [k for k in groups if k[2] is None]:
        named = [k for k in groups if k[:2] == key[:2] and k[2] is not None]
        if len(named) == 1:
            groups[named[0]].extend(groups.pop(key))
    return list(groups.values())


def _ranks_timed_out(parsed: ParsedLog, first: WatchdogTimeout, ts_list: list[WatchdogTimeout]) -> list[int]:
    """The ranks that printed the timeout, and those that only logged the progress line for this
    collective: they timed out on it too."""
    pg_id = first.pg.split("(")[0] if first.pg else None
    progress_ranks = {
        p.rank
        for p in parsed.progress
        if p.rank is not None and first.seq is not None and p.at_seq == first.seq and (pg_id is None or p.pg is None or p.pg.split("(")[0] == pg_id)
    }
    return sorted({t.rank for t in ts_list if t.rank is not None} | progress_ranks)


def _timeout_finding(parsed: ParsedLog, ts_list: list[WatchdogTimeout], *, job: str | None, node: str | None, src: Source, network_warnings: list[NcclWarn]) -> Finding:
    first = min(ts_list, key=lambda t: (t.ts, t.line))
    per_rank = []
    for t in sorted(ts_list, key=lambda t: (t.rank if t.rank is not None else -1)):
        p = _progress_for(parsed, t)
        per_rank.append({"rank": t.rank, "last_enqueued": p.last_enqueued if p else None, "last_completed": p.last_completed if p else None, "ran_for_ms": t.ran_for_ms})
    ranks = _ranks_timed_out(parsed, first, ts_list)
    p_first = _progress_for(parsed, first)
    # A rank that never enqueued the collective the others are stuck in is the one holding
    # them up (it is elsewhere in the program, or dead).
    enq = [r for r in per_rank if r["last_enqueued"] is not None and r["rank"] is not None]
    culprits = sorted(r["rank"] for r in enq if first.seq is not None and r["last_enqueued"] < first.seq)
    evidence: dict[str, Any] = {
        "seq": first.seq,
        "op_type": first.op_type,
        "numel_in": first.numel_in,
        "numel_out": first.numel_out,
        "timeout_ms": first.timeout_ms if first.timeout_ms is not None else parsed.configured_timeout_ms,
        "ran_for_ms": first.ran_for_ms,
        "last_enqueued": p_first.last_enqueued if p_first else None,
        "last_completed": p_first.last_completed if p_first else None,
        "rank": first.rank,
        "pg": first.pg or (p_first.pg if p_first else None),
        "ranks_reporting": len(ranks),
        "world_size": parsed.world_size,
        "network_warnings": len(network_warnings),
    }
    if len(per_rank) > 1:
        evidence["per_rank"] = per_rank
    if network_warnings:
        evidence["first_network_warning"] = network_warnings[0].message[:300]
    return Finding(
        kind=FindingKind.NCCL_TIMEOUT,
        severity=Severity.PAGE,
        ts=first.ts,
        job=job,
        ranks=ranks,
        culprit_ranks=culprits,
        node=node,
        evidence=evidence,
        summary=_timeout_summary(first, ranks, p_first, evidence["timeout_ms"], len(network_warnings)),
        source=src(first.line),
        cause="network" if network_warnings else None,
    )


def _timeout_summary(first: WatchdogTimeout, ranks: list[int], p_first: Progress | None, timeout_ms: int | None, network_warnings: int) -> str:
    op = first.op_type or "collective"
    seq_txt = f" #{first.seq}" if first.seq is not None else ""
    who = f"{len(ranks)} ranks" if len(ranks) > 1 else (f"rank {ranks[0]}" if ranks else "a rank the log does not name")
    summary = f"NCCL watchdog timeout: {op}{seq_txt} on {who} ran {first.ran_for_ms} ms"
    if timeout_ms:
        summary += f" (timeout {timeout_ms} ms)"
    if p_first:
        summary += f"; last enqueued {p_first.last_enqueued}, last completed {p_first.last_completed}"
    if network_warnings:
        summary += f"; {network_warnings} NCCL network warning(s) in the log"
    return summary


def _unnamed_timeout_finding(parsed: ParsedLog, *, job: str | None, node: str | None, src: Source, network_warnings: list[NcclWarn]) -> list[Finding]:
    """A timeout the log tells without a WorkNCCL line. "Some NCCL operations have failed or timed
    out" is how torch announces an NCCL error too: with the error in the log, the error finding
    says what failed."""
    some_failed = [] if parsed.errors else parsed.some_failed
    if parsed.timeouts or not (some_failed or parsed.timeout_at):
        return []
    line, ts, rank = min(some_failed + parsed.timeout_at)
    return [
        Finding(
            kind=FindingKind.NCCL_TIMEOUT,
            severity=Severity.PAGE,
            ts=ts,
            job=job,
            ranks=[rank] if rank is not None else [],
            node=node,
            evidence={"rank": rank, "timeout_ms": parsed.configured_timeout_ms, "network_warnings": len(network_warnings), "message": "Some NCCL operations have failed or timed out"},
            summary="NCCL operations failed or timed out (no WorkNCCL details in the log)",
            source=src(line),
            cause="network" if network_warnings else None,
        )
    ]


def _distinct_ooms(parsed: ParsedLog) -> list[tuple[OomReport, int]]:
    """Each distinct OOM (a traceback repeats the message) with how often the log printed it."""
    seen: dict[tuple, int] = {}
    reports: list[OomReport] = []
    for rep in parsed.ooms:
        k = rep.key()
        if k not in seen:
            reports.append(rep)
        seen[k] = seen.get(k, 0) + 1
    return [(rep, seen[rep.key()]) for rep in reports]


def _oom_findings(parsed: ParsedLog, oom_cfg: OomClassifyConfig, *, job: str | None, node: str | None, src: Source) -> list[Finding]:
    out: list[Finding] = []
    for rep, occurrences in _distinct_ooms(parsed):
        kind = rep.classify(oom_cfg)
        evidence = {
            "requested_bytes": rep.requested_bytes,
            "total_bytes": rep.total_bytes,
            "free_bytes": rep.free_bytes,
            "process_used_bytes": rep.process_used_bytes,
            "allocated_bytes": rep.allocated_bytes,
            "reserved_unallocated_bytes": rep.reserved_unallocated_bytes,
            "foreign_bytes": rep.foreign_bytes(),
            "other_processes": rep.other_processes,
            # neither free nor PyTorch's: CUDA context, libraries (and other processes, if any)
            "non_pytorch_bytes": rep.non_pytorch_bytes(),
            "process_used_credible": rep.process_used_credible,
            "wording": rep.wording,
            **({"allowed_bytes": rep.allowed_bytes} if rep.allowed_bytes is not None else {}),
            "occurrences": occurrences,
            "rank": rep.rank,
        }
        where = f"GPU {rep.gpu}" if rep.gpu is not None else "the GPU"
        out.append(
            Finding(
                kind=kind,
                severity=Severity.PAGE,
                ts=rep.ts,
                job=job,
                ranks=[rep.rank] if rep.rank is not None else [],
                node=node,
                gpu=rep.gpu,
                evidence=evidence,
                summary=f"CUDA OOM on {where}: tried to allocate {_gib(rep.requested_bytes)} with {_gib(rep.free_bytes)} free of {_gib(rep.total_bytes)}; {rep.reason(kind)}",
                source=src(rep.line),
                cause=kind.value.removeprefix("oom_"),
            )
        )
    return out


def _error_findings(parsed: ParsedLog, *, job: str | None, node: str | None, src: Source, network_warnings: bool) -> list[Finding]:
    """One `nccl_error` finding per distinct NCCL error (the same one printed by several ranks,
    or again in a launcher's summary, is one), naming the ranks and hosts that printed it."""
    groups: dict[tuple, list] = {}
    for e in parsed.errors:
        groups.setdefault((e.code or e.reason, e.where), []).append(e)
    out: list[Finding] = []
    for errs in groups.values():
        first = min(errs, key=lambda e: (e.ts, e.line))
        # The fullest copy: the one that carries NCCL's last error, else the first.
        best = next((e for e in errs if e.last_error), first)
        ranks = sorted({e.rank for e in errs if e.rank is not None})
        hosts = sorted({e.host for e in errs if e.host})
        where_node = hosts[0] if len(hosts) == 1 else node
        cause = error_cause(best, network_warnings=network_warnings)
        who = f"ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else (f"rank {ranks[0]}" if ranks else "rank unknown")
        at = f", {', '.join(hosts)}" if hosts else (f", {where_node}" if where_node else "")
        out.append(
            Finding(
                kind=FindingKind.NCCL_ERROR,
                severity=Severity.PAGE,
                ts=first.ts,
                job=job,
                ranks=ranks,
                node=where_node,
                cause=cause,
                evidence={
                    "code": best.code,
                    "reason": best.reason,
                    "where": best.where,
                    "nccl_version": best.nccl_version,
                    "last_error": best.last_error,
                    "ranks_reporting": len(ranks),
                    "hosts": hosts,
                    "lines": len(errs),
                    "network_warnings": len([w for w in parsed.warnings if w.network]),
                },
                summary=f"NCCL error ({who}{at}): {describe_error(best)}",
                source=src(first.line),
            )
        )
    return out


def analyze_text(
    text: str,
    *,
    source_file: str | None = None,
    job: str | None = None,
    node: str | None = None,
    reference_ts: float | None = None,
    cfg: dict[str, Any] | None = None,
) -> list[Finding]:
    """The findings of a whole log's text."""
    return findings(parse_lines(text.splitlines(), reference_ts=reference_ts), source_file=source_file, job=job, node=node, cfg=cfg)
