"""PyTorch / NCCL training logs: watchdog timeouts, progress of each process group, NCCL warnings
and CUDA out-of-memory errors, in the wordings of several PyTorch and NCCL releases.

Recognised (with or without torchrun's `[rankN]:` prefix and glog `[E1129 23:07:34.44 f.cpp:1]`):

- `[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6, OpType=ALLREDUCE,
  NumelIn=1048576, NumelOut=1048576, Timeout(ms)=8000) ran for 8031 milliseconds before timing
  out.` — also without NumelIn/NumelOut (torch 1.1x) and without SeqNum (older), and with
  `[PG ID 0 PG GUID 0(default_pg) Rank 0]` or `[PG 1 Rank 0]` prefixes;
- progress: `failure detected by watchdog at work sequence id: 6 PG status: last enqueued work:
  6, last completed work: 5`, `Exception (either an error or timeout) detected by watchdog at
  work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.`, `Timeout at NCCL
  work: ...`, `Last enqueued NCCL work: 6, last completed NCCL work: 5.`;
- `Some NCCL operations have failed or timed out.` (a timeout without the WorkNCCL line, unless
  an NCCL error in the same log says what failed);
- NCCL errors torch raised: `torch.distributed.DistBackendError: NCCL error in:
  ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with
  NCCL_DEBUG=INFO for details), NCCL version 2.21.5` (torch 2.x; 1.x raised `RuntimeError`, with
  `torch/lib/c10d/` paths), the watchdog's `Process group watchdog thread terminated with
  exception: NCCL error: remote process exited or there was a network error, NCCL version ...`,
  `NCCL Error 2: unhandled system error`; with the lines after them, `ncclRemoteError: ...`,
  `Last error:` and NCCL's own message, with torchrun's `[rankN]:` or a launcher's `host:`
  prefix;
- `host:pid:tid [dev] file.cc:NN NCCL WARN ...` network and other warnings;
- CUDA OOM, three generations: `CUDA out of memory. Tried to allocate X (GPU 0; Y total capacity;
  Z already allocated; W free; V reserved in total by PyTorch)`; `... GPU 0 has a total capacty
  of ...` (sic, torch 2.1-2.2) and `... total capacity of ... of which ... is free. [Process N has
  X memory in use.] [Including non-PyTorch memory, this process has X memory in use.] Of the
  allocated memory A is allocated by PyTorch, and U is reserved by PyTorch but unallocated.`

ROCm builds say `HIP out of memory` in the same wordings. Each OOM is classified
(`gpuvigil.parsers.oom`, thresholds in `gpuvigil/config/oom_classify.yaml`): `oom_fragmentation`
when PyTorch's reserved but unallocated memory could have held the request had it been contiguous,
`oom_unexplained` when the free memory could have, `oom_foreign_process` when it could have without
the other processes the message lists, else `oom_capacity`.

The line parsing itself (text -> typed records, no I/O) is in `gpuvigil.parsers.nccl` and
`gpuvigil.parsers.oom`; this module turns parsed logs into findings and `events`, and tails files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.tail import FileTail, TailingLogCollector  # one tail implementation for all logs
from gpuvigil.model import Finding, FindingKind, Severity, log_source

# The text parsing is shared with `analyze` and the OOM detector; these names stay importable here.
from gpuvigil.parsers.nccl import ParsedLog, Progress, WatchdogTimeout, describe_error, error_cause, looks_like_training_log, parse_lines  # noqa: F401
from gpuvigil.parsers.oom import OomReport, load_oom_config, parse_oom  # noqa: F401


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
    """`nccl_timeout` (one per collective, over the ranks that reported it) and `oom_*` findings."""
    oom_cfg = load_oom_config(cfg)
    node = node or (parsed.hosts.most_common(1)[0][0] if len(parsed.hosts) == 1 else None)
    src = (lambda line: f"{source_file}:{line}") if source_file else (lambda line: "nccl_log")
    out: list[Finding] = []

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
    network_warnings = [w for w in parsed.warnings if w.network]
    for (_seq, _op, _pg), ts_list in groups.items():
        first = min(ts_list, key=lambda t: (t.ts, t.line))
        per_rank = []
        for t in sorted(ts_list, key=lambda t: (t.rank if t.rank is not None else -1)):
            p = _progress_for(parsed, t)
            per_rank.append({"rank": t.rank, "last_enqueued": p.last_enqueued if p else None, "last_completed": p.last_completed if p else None, "ran_for_ms": t.ran_for_ms})
        # Ranks that only logged the progress line for this collective timed out on it too.
        pg_id = first.pg.split("(")[0] if first.pg else None
        progress_ranks = {
            p.rank
            for p in parsed.progress
            if p.rank is not None and first.seq is not None and p.at_seq == first.seq and (pg_id is None or p.pg is None or p.pg.split("(")[0] == pg_id)
        }
        ranks = sorted({t.rank for t in ts_list if t.rank is not None} | progress_ranks)
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
        op = first.op_type or "collective"
        seq_txt = f" #{first.seq}" if first.seq is not None else ""
        who = f"{len(ranks)} ranks" if len(ranks) > 1 else (f"rank {ranks[0]}" if ranks else "a rank the log does not name")
        summary = f"NCCL watchdog timeout: {op}{seq_txt} on {who} ran {first.ran_for_ms} ms"
        if evidence["timeout_ms"]:
            summary += f" (timeout {evidence['timeout_ms']} ms)"
        if p_first:
            summary += f"; last enqueued {p_first.last_enqueued}, last completed {p_first.last_completed}"
        if network_warnings:
            summary += f"; {len(network_warnings)} NCCL network warning(s) in the log"
        out.append(
            Finding(
                kind=FindingKind.NCCL_TIMEOUT,
                severity=Severity.PAGE,
                ts=first.ts,
                job=job,
                ranks=ranks,
                culprit_ranks=culprits,
                node=node,
                evidence=evidence,
                summary=summary,
                source=src(first.line),
                cause="network" if network_warnings else None,
            )
        )
    out.extend(_error_findings(parsed, job=job, node=node, src=src, network_warnings=bool(network_warnings)))
    # "Some NCCL operations have failed or timed out" is how torch announces an NCCL error too:
    # with the error in the log, the error finding says what failed.
    some_failed = [] if parsed.errors else parsed.some_failed
    if not parsed.timeouts and (some_failed or parsed.timeout_at):
        line, ts, rank = min(some_failed + parsed.timeout_at)
        out.append(
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
        )

    seen_oom: dict[tuple, int] = {}
    reports: list[OomReport] = []
    for rep in parsed.ooms:
        k = rep.key()
        if k in seen_oom:
            seen_oom[k] += 1
            continue
        seen_oom[k] = 1
        reports.append(rep)
    for rep in reports:
        kind = rep.classify(oom_cfg)
        foreign = rep.foreign_bytes()
        evidence = {
            "requested_bytes": rep.requested_bytes,
            "total_bytes": rep.total_bytes,
            "free_bytes": rep.free_bytes,
            "process_used_bytes": rep.process_used_bytes,
            "allocated_bytes": rep.allocated_bytes,
            "reserved_unallocated_bytes": rep.reserved_unallocated_bytes,
            "foreign_bytes": foreign,
            "other_processes": rep.other_processes,
            # neither free nor PyTorch's: CUDA context, libraries (and other processes, if any)
            "non_pytorch_bytes": rep.non_pytorch_bytes(),
            "process_used_credible": rep.process_used_credible,
            "wording": rep.wording,
            **({"allowed_bytes": rep.allowed_bytes} if rep.allowed_bytes is not None else {}),
            "occurrences": seen_oom[rep.key()],
            "rank": rep.rank,
        }
        where = f"GPU {rep.gpu}" if rep.gpu is not None else "the GPU"
        reason = rep.reason(kind)
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
                summary=f"CUDA OOM on {where}: tried to allocate {_gib(rep.requested_bytes)} with {_gib(rep.free_bytes)} free of {_gib(rep.total_bytes)}; {reason}",
                source=src(rep.line),
                cause=kind.value.removeprefix("oom_"),
            )
        )
    return out


def _error_findings(parsed: ParsedLog, *, job: str | None, node: str | None, src: Any, network_warnings: bool) -> list[Finding]:
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


def events(parsed: ParsedLog, *, node: str | None = None, job: str | None = None, file: str | None = None) -> pl.DataFrame:
    """The `events` stream: one row per timeout, OOM, progress failure and NCCL warning. Rows read
    from a log file carry it in `source` (`torch:<file>`, model.log_source): a line of no known
    job is still told apart by its file."""
    torch, nccl = log_source("torch", file), log_source("nccl", file)
    rows: list[dict[str, Any]] = []
    for t in parsed.timeouts:
        rows.append({"ts": t.ts, "node": node, "source": torch, "kind": "nccl_timeout", "job": job, "rank": t.rank, "message": t.text})
    # A timeout that the log tells only by these lines (no WorkNCCL line) is a timeout all the same.
    for _line, ts, rank in parsed.some_failed:
        rows.append({"ts": ts, "node": node, "source": torch, "kind": "nccl_timeout", "job": job, "rank": rank, "message": "Some NCCL operations have failed or timed out"})
    for _line, ts, rank in parsed.timeout_at:
        rows.append({"ts": ts, "node": node, "source": torch, "kind": "nccl_timeout", "job": job, "rank": rank, "message": "Timeout at NCCL work"})
    for o in parsed.ooms:
        rows.append({"ts": o.ts, "node": node, "gpu": o.gpu, "source": torch, "kind": "oom", "job": job, "rank": o.rank, "message": o.text})
    for e in parsed.errors:
        rows.append({"ts": e.ts, "node": e.host or node, "source": torch, "kind": "nccl_error", "job": job, "rank": e.rank, "message": e.message()})
    for w in parsed.warnings:
        rows.append({"ts": w.ts, "node": w.host or node, "gpu": w.device, "source": nccl, "kind": "nccl_warn", "job": job, "rank": w.rank, "message": w.message})
    return schemas.frame(sorted(rows, key=lambda r: r["ts"]), schemas.EVENTS)


def analyze_text(
    text: str,
    *,
    source_file: str | None = None,
    job: str | None = None,
    node: str | None = None,
    reference_ts: float | None = None,
    cfg: dict[str, Any] | None = None,
) -> list[Finding]:
    return findings(parse_lines(text.splitlines(), reference_ts=reference_ts), source_file=source_file, job=job, node=node, cfg=cfg)


class NcclLogCollector(TailingLogCollector):
    """Tails a training log (one rank's, or torchrun's merged output) and emits `events`."""

    def __init__(self, path: str | Path, *, node: str | None = None, job: str | None = None, from_start: bool = True):
        self.name = f"nccl_log:{path}"
        self.errors = 0
        self.node = node
        self.job = job
        self.path = str(path)
        self.tail = FileTail(Path(path), from_start=from_start)

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        parsed = parse_lines(lines, reference_ts=time.time(), first_line_no=first_line_no)
        return events(parsed, node=self.node, job=self.job, file=self.path)
