"""PyTorch / NCCL training-log lines -> typed records (`ParsedLog`): watchdog timeouts, progress
of each process group, NCCL warnings and CUDA OOMs (see `gpuvigil.collectors.nccl_log` for the
wordings recognised). Pure text parsing, no I/O: shared by the log collector and `analyze`.
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuvigil.parsers.logtime import line_time
from gpuvigil.parsers.oom import OomReport, parse_oom

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
# An NCCL WARN about the network (the same pattern in Python's and polars' regex dialects).
NET_WARN_PATTERN = r"NET/|ibv_|\bIB\b|socket|Connection (?:closed|reset|refused)|Broken pipe|connect|remote peer|completion from peer|timed out|Network"
_NET_WARN = re.compile(NET_WARN_PATTERN, re.IGNORECASE)


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
    # "Timeout at NCCL work: N, last enqueued ..." lines (a timeout even without the WorkNCCL line)
    timeout_at: list[tuple[int, float, int | None]] = field(default_factory=list)  # line, ts, rank
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


def _complete(line: str) -> bool:
    """Whether a line that starts a known message carries all of it (not cut by a terminal)."""
    if "Watchdog caught" in line:
        return _WATCHDOG.search(line) is not None
    if "Timeout at NCCL work" in line or "detected by watchdog at work" in line:
        return _PROGRESS.search(line) is not None
    if "CUDA out of memory" in line or "HIP out of memory" in line:
        rep = parse_oom(line)
        return rep is None or rep.free_bytes is not None
    return True


def unwrap(lines: Iterable[str], max_joined: int = 2) -> Iterable[tuple[int, str]]:
    """(offset, line) with messages that a terminal or a copy-paste wrapped over several lines
    joined back (at most `max_joined` continuation lines; the break may fall inside a word, as in
    "ran f" / "or 1800010 milliseconds", or between words)."""
    it = iter(enumerate(lines))
    buffered: list[tuple[int, str]] = []

    def take() -> tuple[int, str] | None:
        if buffered:
            return buffered.pop(0)
        return next(it, None)

    while (item := take()) is not None:
        offset, raw = item
        line = raw.rstrip("\r\n")
        if len(line) > 20000 or _complete(line):
            yield offset, line
            continue
        following: list[tuple[int, str]] = []
        while len(following) < max_joined and (nxt := take()) is not None:
            following.append((nxt[0], nxt[1].rstrip("\r\n")))
        joined = None
        for n in range(1, len(following) + 1):
            for sep in ("", " "):
                candidate = line + sep + sep.join(f[1] if sep else f[1] for f in following[:n])
                if _complete(candidate):
                    joined, used = candidate, n
                    break
            if joined is not None:
                break
        if joined is None:
            yield offset, line
            buffered[:0] = following
        else:
            yield offset, joined
            buffered[:0] = following[used:]


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

    for offset, line in unwrap(lines):
        out.lines += 1
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
                if "Timeout at NCCL work" in line:
                    out.timeout_at.append((no, when(line), rank))
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


_SNIFF = re.compile(
    r"Watchdog caught collective operation timeout|(?:CUDA|HIP) out of memory|NCCL (?:WARN|INFO)|ProcessGroupNCCL|"
    r"last enqueued (?:NCCL )?work|Some NCCL operations have failed|PyTorch CUDA memory summary|Traceback \(most recent call last\)",
)


def looks_like_training_log(sample: str) -> bool:
    return _SNIFF.search(sample) is not None
