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
- `Some NCCL operations have failed or timed out.` (a timeout without the WorkNCCL line);
- `host:pid:tid [dev] file.cc:NN NCCL WARN ...` network and other warnings;
- CUDA OOM, three generations: `CUDA out of memory. Tried to allocate X (GPU 0; Y total capacity;
  Z already allocated; W free; V reserved in total by PyTorch)`; `... GPU 0 has a total capacty
  of ...` (sic, torch 2.1-2.2) and `... total capacity of ... of which ... is free. [Process N has
  X memory in use.] [Including non-PyTorch memory, this process has X memory in use.] Of the
  allocated memory A is allocated by PyTorch, and U is reserved by PyTorch but unallocated.`

Each OOM is classified (`gpuvigil/config/oom_classify.yaml`): `oom_foreign_process` when other
processes hold a large share of the device, `oom_fragmentation` when PyTorch's reserved but
unallocated memory could have held the request had it been contiguous, else `oom_capacity`.
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil import config, schemas
from gpuvigil.collectors.logtime import line_time
from gpuvigil.collectors.kernel_log import FileTail, TailingLogCollector  # one tail implementation for all logs
from gpuvigil.model import Finding, FindingKind, Severity

_UNITS = {"b": 1, "bytes": 1, "byte": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes?|[KMGT]iB|[KMGT]B|B)"

_RANK_PREFIX = re.compile(r"\[rank(?P<rank>\d+)\]:")
_RANK_TAG = re.compile(r"\[(?:PG (?:ID )?(?P<pg>[^\]]*?)\s+)?Rank (?P<rank>\d+)\]")
_PG_NAME = re.compile(r"PG GUID \S+?\((?P<name>[^)]*)\)|PG \d+ \((?P<name2>[^)]*)\)")
_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\((?P<body>[^)]*(?:\([^)]*\)[^)]*)*)\) ran for (?P<ran>\d+) milliseconds")
_WORK_FIELD = re.compile(r"(\w+(?:\(ms\))?)=([^,]+)")
_PROGRESS = re.compile(
    r"(?:(?:at work(?: sequence id)?|Timeout at NCCL work):\s*(?P<at>-?\d+).{0,40}?)?"
    r"last enqueued (?:NCCL )?work:\s*(?P<enq>-?\d+),\s*last completed (?:NCCL )?work:\s*(?P<done>-?\d+)",
    re.IGNORECASE,
)
_SOME_FAILED = re.compile(r"Some NCCL operations have failed or timed out")
_INIT = re.compile(r"ProcessGroupNCCL initialization options:.*?size:\s*(?P<size>\d+),\s*global rank:\s*(?P<rank>\d+),\s*TIMEOUT\(ms\):\s*(?P<timeout>\d+)")
_NCCL_WARN = re.compile(r"(?:^|\s|\])(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\](?:\s+\S+:\d+)?\s+NCCL WARN\s*(?P<msg>.*)$")
# Always matches a line containing "NCCL WARN", whatever follows (even embedded newlines).
_NCCL_WARN_BARE = re.compile(r"NCCL WARN\s*(?P<msg>.*)", re.S)
_NET_WARN = re.compile(
    r"NET/|ibv_|\bIB\b|socket|Connection (?:closed|reset|refused)|Broken pipe|connect|remote peer|completion from peer|timed out|Network",
    re.IGNORECASE,
)

_OOM_HEAD = re.compile(r"CUDA out of memory\. Tried to allocate " + _SIZE, re.IGNORECASE)
_OOM_OLD = re.compile(
    r"\(GPU (?P<gpu>\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE + r" free;"
    # torch ≤1.3 said "cached" for what later releases call "reserved in total by PyTorch"
    r"(?: " + _SIZE + r" (?P<what>reserved in total by PyTorch|cached))?"
)
_OOM_NEW = re.compile(r"GPU (?P<gpu>\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE + r" is free\.")
_OOM_THIS_PROC = re.compile(r"this process has " + _SIZE + r" memory in use")
_OOM_PROC = re.compile(r"Process (?P<pid>\d+) has " + _SIZE + r" memory in use")
_OOM_SPLIT = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, and " + _SIZE + r" is reserved by PyTorch but unallocated")


def _bytes(value: str, unit: str) -> int:
    return int(round(float(value) * _UNITS[unit.lower()]))


class OomClassifyConfig(BaseModel):
    # Other processes hold at least this share of the device: the OOM is theirs, not ours.
    foreign_min_share: float = Field(0.10, ge=0, le=1)
    # ... and at least this many times the failed request (else freeing them would not help).
    foreign_min_request_ratio: float = Field(1.0, ge=0)
    # PyTorch's reserved-but-unallocated memory is at least this many times the request: the
    # memory was there but in pieces too small (fragmentation).
    fragmentation_min_request_ratio: float = Field(1.0, ge=0)
    # ... or at least this share of the device, whatever the request.
    fragmentation_min_share: float = Field(0.10, ge=0, le=1)


def load_oom_config(cfg: dict[str, Any] | None = None) -> OomClassifyConfig:
    if cfg is None:
        return _default_oom_config()
    return config.section("oom_classify", OomClassifyConfig, cfg)


@lru_cache(maxsize=1)
def _default_oom_config() -> OomClassifyConfig:
    # Reading every default section costs ~0.1 s: do it once, not per analysed file.
    return config.section("oom_classify", OomClassifyConfig, None)


@dataclass
class OomReport:
    line: int
    ts: float
    rank: int | None
    gpu: int | None
    requested_bytes: int
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_used_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    other_processes: list[dict[str, int]] = field(default_factory=list)
    wording: str = "new"  # old | capacty | new
    text: str = ""

    def foreign_bytes(self) -> int | None:
        """Device memory held by processes other than this one."""
        if self.other_processes:
            return sum(p["bytes"] for p in self.other_processes)
        if self.total_bytes is None or self.free_bytes is None:
            return None
        if self.process_used_bytes is not None:
            return max(0, self.total_bytes - self.free_bytes - self.process_used_bytes)
        if self.allocated_bytes is not None and self.reserved_unallocated_bytes is not None:
            # No per-process figure (old wording): what is neither free nor PyTorch's own. This
            # includes our CUDA context (a few hundred MiB), hence the share threshold.
            return max(0, self.total_bytes - self.free_bytes - self.allocated_bytes - self.reserved_unallocated_bytes)
        return None

    def classify(self, cfg: OomClassifyConfig) -> FindingKind:
        foreign = self.foreign_bytes()
        if (
            foreign is not None
            and self.total_bytes
            and foreign >= cfg.foreign_min_share * self.total_bytes
            and foreign >= cfg.foreign_min_request_ratio * self.requested_bytes
        ):
            return FindingKind.OOM_FOREIGN_PROCESS
        unalloc = self.reserved_unallocated_bytes
        if unalloc is not None and unalloc > 0 and (
            unalloc >= cfg.fragmentation_min_request_ratio * self.requested_bytes
            or (self.total_bytes and unalloc >= cfg.fragmentation_min_share * self.total_bytes)
        ):
            return FindingKind.OOM_FRAGMENTATION
        return FindingKind.OOM_CAPACITY

    def key(self) -> tuple:
        return (self.rank, self.gpu, self.requested_bytes, self.total_bytes, self.free_bytes, self.allocated_bytes, self.reserved_unallocated_bytes)


def parse_oom(text: str, *, line: int = 0, ts: float = 0.0, rank: int | None = None) -> OomReport | None:
    """The numbers of one CUDA OOM message (any of the three wordings), or None."""
    head = _OOM_HEAD.search(text)
    if not head:
        return None
    rep = OomReport(line=line, ts=ts, rank=rank, gpu=None, requested_bytes=_bytes(head[1], head[2]), text=text[head.start():][:800])
    if m := _OOM_OLD.search(text):
        g = m.groups()
        rep.wording = "old"
        rep.gpu = int(g[0])
        rep.total_bytes = _bytes(g[1], g[2])
        rep.allocated_bytes = _bytes(g[3], g[4])
        rep.free_bytes = _bytes(g[5], g[6])
        if g[7] is not None:
            amount = _bytes(g[7], g[8])
            # torch ≤1.3's "cached" is what the cache holds beyond live tensors; later releases
            # give the whole reservation.
            rep.reserved_unallocated_bytes = amount if m["what"] == "cached" else max(0, amount - rep.allocated_bytes)
        return rep
    if m := _OOM_NEW.search(text):
        g = m.groups()
        rep.wording = "capacty" if "capacty" in m.group(0) else "new"
        rep.gpu = int(g[0])
        rep.total_bytes = _bytes(g[1], g[2])
        rep.free_bytes = _bytes(g[3], g[4])
    if m := _OOM_THIS_PROC.search(text):
        rep.process_used_bytes = _bytes(m[1], m[2])
    procs = [{"pid": int(p["pid"]), "bytes": _bytes(p[2], p[3])} for p in _OOM_PROC.finditer(text)]
    if m := _OOM_SPLIT.search(text):
        rep.allocated_bytes = _bytes(m[1], m[2])
        rep.reserved_unallocated_bytes = _bytes(m[3], m[4])
    if procs and rep.process_used_bytes is None:
        # In a container NVML's pids are not ours, so our own process is listed as "Process N"
        # too: take the one that holds at least what PyTorch reserved (closest to it) as us.
        ours = (rep.allocated_bytes or 0) + (rep.reserved_unallocated_bytes or 0)
        candidates = [p for p in procs if p["bytes"] >= ours]
        if candidates:
            me = min(candidates, key=lambda p: p["bytes"] - ours)
            rep.process_used_bytes = me["bytes"]
            procs = [p for p in procs if p is not me]
    rep.other_processes = procs
    return rep


@dataclass
class WatchdogTimeout:
    line: int
    ts: float
    rank: int | None
    pg: str | None
    seq: int | None
    op_type: str | None
    numel_in: int | None
    numel_out: int | None
    timeout_ms: int | None
    ran_for_ms: int
    text: str


@dataclass
class Progress:
    line: int
    rank: int | None
    pg: str | None
    at_seq: int | None
    last_enqueued: int
    last_completed: int


@dataclass
class NcclWarn:
    line: int
    ts: float
    rank: int | None
    host: str | None
    pid: int | None
    device: int | None
    message: str
    network: bool


@dataclass
class ParsedLog:
    timeouts: list[WatchdogTimeout] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    warnings: list[NcclWarn] = field(default_factory=list)
    ooms: list[OomReport] = field(default_factory=list)
    some_failed: list[tuple[int, float, int | None]] = field(default_factory=list)  # line, ts, rank
    world_size: int | None = None
    configured_timeout_ms: int | None = None
    hosts: Counter = field(default_factory=Counter)
    lines: int = 0


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _rank_and_pg(line: str) -> tuple[int | None, str | None]:
    rank: int | None = None
    pg: str | None = None
    if m := _RANK_PREFIX.search(line):
        rank = int(m["rank"])
    if m := _RANK_TAG.search(line):
        rank = int(m["rank"]) if rank is None else rank
        if m["pg"]:
            name = _PG_NAME.search(m.group(0))
            pg_id = m["pg"].split()[0]
            pg = f"{pg_id}({(name['name'] or name['name2'])})" if name else pg_id
    return rank, pg


def parse_lines(lines: Iterable[str], *, reference_ts: float | None = None, first_line_no: int = 1) -> ParsedLog:
    reference_ts = time.time() if reference_ts is None else reference_ts
    out = ParsedLog()
    # Timestamps are only parsed for lines that matter; a line without one (a traceback line,
    # an OOM message) takes the nearest stamped line before it, looked up in this window.
    recent: deque[str] = deque(maxlen=64)

    def when(line: str) -> float:
        for candidate in (line, *reversed(recent)):
            t = line_time(candidate, reference_ts)
            if t is not None and t.kind != "since_boot":
                return t.ts
        return reference_ts

    for offset, raw in enumerate(lines):
        out.lines += 1
        line = raw.rstrip("\r\n")
        if len(line) > 20000:  # a runaway line (binary junk) cannot be a log message we know
            line = line[:20000]
        no = first_line_no + offset
        try:
            if "Watchdog caught" in line and (m := _WATCHDOG.search(line)):
                fields = dict(_WORK_FIELD.findall(m["body"]))
                rank, pg = _rank_and_pg(line[: m.start()])
                out.timeouts.append(
                    WatchdogTimeout(
                        line=no,
                        ts=when(line),
                        rank=rank,
                        pg=pg,
                        seq=_int(fields.get("SeqNum")),
                        op_type=fields.get("OpType"),
                        numel_in=_int(fields.get("NumelIn")),
                        numel_out=_int(fields.get("NumelOut")),
                        timeout_ms=_int(fields.get("Timeout(ms)")),
                        ran_for_ms=int(m["ran"]),
                        text=line[m.start():][:500],
                    )
                )
            elif "ast enqueued" in line and (m := _PROGRESS.search(line)):
                rank, pg = _rank_and_pg(line[: m.start()])
                out.progress.append(Progress(no, rank, pg, _int(m["at"]), int(m["enq"]), int(m["done"])))
            elif "Some NCCL operations have failed" in line:
                out.some_failed.append((no, when(line), _rank_and_pg(line)[0]))
            elif "initialization options" in line and (m := _INIT.search(line)):
                out.world_size = int(m["size"])
                out.configured_timeout_ms = int(m["timeout"])
            elif "NCCL WARN" in line:
                m = _NCCL_WARN.search(line)
                rank = _rank_and_pg(line)[0]
                if m:
                    msg = m["msg"].strip()
                    out.hosts[m["host"]] += 1
                    warn = NcclWarn(no, when(line), rank, m["host"], int(m["pid"]), int(m["dev"]), msg, bool(_NET_WARN.search(msg)))
                else:
                    msg = _NCCL_WARN_BARE.search(line)["msg"].strip()  # type: ignore[index]
                    warn = NcclWarn(no, when(line), rank, None, None, None, msg, bool(_NET_WARN.search(msg)))
                out.warnings.append(warn)
            elif "out of memory" in line and (rep := parse_oom(line, line=no, rank=_rank_and_pg(line)[0])) is not None:
                rep.ts = when(line)
                out.ooms.append(rep)
        finally:
            recent.append(line)
    return out


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
        who = f"rank {first.rank}" if len(ranks) <= 1 else f"{len(ranks)} ranks"
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
    if not parsed.timeouts and parsed.some_failed:
        line, ts, rank = parsed.some_failed[0]
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
            "wording": rep.wording,
            "occurrences": seen_oom[rep.key()],
            "rank": rep.rank,
        }
        where = f"GPU {rep.gpu}" if rep.gpu is not None else "the GPU"
        reason = {
            FindingKind.OOM_CAPACITY: "the job needs more memory than the GPU has",
            FindingKind.OOM_FRAGMENTATION: f"{_gib(rep.reserved_unallocated_bytes)} reserved by PyTorch but unallocated (fragmented)",
            FindingKind.OOM_FOREIGN_PROCESS: f"{_gib(foreign)} held by other processes",
        }[kind]
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
                cause={FindingKind.OOM_CAPACITY: "capacity", FindingKind.OOM_FRAGMENTATION: "fragmentation", FindingKind.OOM_FOREIGN_PROCESS: "foreign_process"}[kind],
            )
        )
    return out


def events(parsed: ParsedLog, *, node: str | None = None, job: str | None = None) -> pl.DataFrame:
    """The `events` stream: one row per timeout, OOM, progress failure and NCCL warning."""
    rows: list[dict[str, Any]] = []
    for t in parsed.timeouts:
        rows.append({"ts": t.ts, "node": node, "source": "torch", "kind": "nccl_timeout", "job": job, "rank": t.rank, "message": t.text})
    for o in parsed.ooms:
        rows.append({"ts": o.ts, "node": node, "gpu": o.gpu, "source": "torch", "kind": "oom", "job": job, "rank": o.rank, "message": o.text})
    for w in parsed.warnings:
        rows.append({"ts": w.ts, "node": w.host or node, "gpu": w.device, "source": "nccl", "kind": "nccl_warn", "job": job, "rank": w.rank, "message": w.message})
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


_SNIFF = re.compile(
    r"Watchdog caught collective operation timeout|CUDA out of memory|NCCL (?:WARN|INFO)|ProcessGroupNCCL|"
    r"last enqueued (?:NCCL )?work|Some NCCL operations have failed|PyTorch CUDA memory summary|Traceback \(most recent call last\)",
)


def looks_like_training_log(sample: str) -> bool:
    return _SNIFF.search(sample) is not None


class NcclLogCollector(TailingLogCollector):
    """Tails a training log (one rank's, or torchrun's merged output) and emits `events`."""

    def __init__(self, path: str | Path, *, node: str | None = None, job: str | None = None, from_start: bool = True):
        self.name = f"nccl_log:{path}"
        self.errors = 0
        self.node = node
        self.job = job
        self.tail = FileTail(Path(path), from_start=from_start)

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        parsed = parse_lines(lines, reference_ts=time.time(), first_line_no=first_line_no)
        return events(parsed, node=self.node, job=self.job)
