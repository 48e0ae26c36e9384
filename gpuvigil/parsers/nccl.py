"""PyTorch / NCCL training-log lines -> typed records (`ParsedLog`): watchdog timeouts, progress
of each process group, NCCL errors raised through torch, NCCL warnings and CUDA OOMs (see
`gpuvigil.collectors.nccl_log` for the wordings recognised). Pure text parsing, no I/O: shared by
the log collector and `analyze`.
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

# An NCCL result torch raised: `NCCL error in: <file>:<line>, <reason>, NCCL version V` (a
# collective or communicator call, torch 1.x RuntimeError and 2.x DistBackendError), `NCCL error:
# <reason>, NCCL version V` (the watchdog's asynchronous check), `NCCL Error N: <reason>`
# (torch.cuda.nccl and other direct callers). The reason is ncclGetErrorString's text.
_NCCL_ERROR = re.compile(
    r"NCCL (?:error in: (?P<path>[^\s,]{1,400}?):(?P<lineno>\d{1,7}),|[Ee]rror (?P<num>\d{1,3}):|error:)\s*"
    r"(?P<reason>(?:(?!\s(?:nccl[A-Z]|Last error:))[^,()\n]){1,200})(?:\(run with NCCL_DEBUG=\w+ for details\)\s*)?"
    r"(?:,\s*NCCL version (?P<version>[\w.+\-]{1,40}))?"
)
# The result's name, on the line after the message or inline when a log joined them.
_NCCL_CODE = re.compile(r"(?<![\w.])(?P<code>nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidArgument|InvalidUsage|RemoteError|InProgress)):\s*(?P<text>.*?)\s*(?=Last error:|$)")
_LAST_ERROR = re.compile(r"Last error:\s*(?P<text>.*)$")
# ncclGetErrorString's texts (NCCL 2.x) -> the result's name; older NCCL reports number them.
NCCL_RESULTS = {
    "unhandled cuda error": "ncclUnhandledCudaError",
    "unhandled system error": "ncclSystemError",
    "internal error": "ncclInternalError",
    "invalid argument": "ncclInvalidArgument",
    "invalid usage": "ncclInvalidUsage",
    "remote process exited or there was a network error": "ncclRemoteError",
    "operation in progress": "ncclInProgress",
}
_RESULT_NUMBERS = {"1": "ncclUnhandledCudaError", "2": "ncclSystemError", "3": "ncclInternalError", "4": "ncclInvalidArgument", "5": "ncclInvalidUsage", "6": "ncclRemoteError", "7": "ncclInProgress"}
# A launcher's host prefix (pdsh, DeepSpeed's runner): `node-7: RuntimeError: NCCL error in: ...`.
_HOST_PREFIX = re.compile(r"^\s*(?P<host>[A-Za-z][\w\-]{0,62}(?:\.[\w\-]{1,62}){0,6}):\s")
_ABORTED_ON = re.compile(r"communicator was aborted on rank (?P<rank>\d+)")
# Continuation lines of an NCCL error are read this many lines after it at most.
_ERROR_FOLLOW_LINES = 4


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

    def message(self) -> str:
        """One line that `parse_timeout` reads back whole, rank and process group included (the
        `events` stream's message)."""
        return _tag(self.rank, self.pg) + self.text


@dataclass
class Progress:
    line: int
    rank: int | None
    pg: str | None
    at_seq: int | None
    last_enqueued: int
    last_completed: int
    ts: float = 0.0

    def message(self) -> str:
        """One line that `parse_progress` reads back whole (the `events` stream's message)."""
        at = f"detected by watchdog at work: {self.at_seq}, " if self.at_seq is not None else ""
        return f"{_tag(self.rank, self.pg)}{at}last enqueued NCCL work: {self.last_enqueued}, last completed NCCL work: {self.last_completed}."


def _tag(rank: int | None, pg: str | None) -> str:
    """torch's `[PG ID 0 PG GUID 0(default_pg) Rank 3] ` prefix, as `_rank_and_pg` reads it back."""
    if rank is None:
        return ""
    if pg is None:
        return f"[Rank {rank}] "
    pg_id, _, name = pg.partition("(")
    return f"[PG ID {pg_id} PG GUID {pg_id}({name.rstrip(')')}) Rank {rank}] " if name else f"[PG {pg_id} Rank {rank}] "


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
class NcclError:
    """An NCCL call that failed, as torch raised it. `code`: the result's name (ncclRemoteError,
    ...), from the message's name line or its reason text; `last_error`: NCCL's own last message
    (the socket, IB or CUDA failure behind it) where the log carries it; `where`: torch's source
    file and line that checked the result."""

    line: int
    ts: float
    rank: int | None
    host: str | None
    where: str | None
    reason: str
    code: str | None
    nccl_version: str | None
    last_error: str | None
    text: str

    def message(self) -> str:
        """One line that `parse_error_message` reads back whole (the `events` stream's message)."""
        head = f"NCCL error in: {self.where}, {self.reason}" if self.where else f"NCCL error: {self.reason}"
        if self.nccl_version:
            head += f", NCCL version {self.nccl_version}"
        if self.code:
            head += f" {self.code}: "
        if self.last_error:
            head += f" Last error: {self.last_error}"
        return head


@dataclass
class ParsedLog:
    timeouts: list[WatchdogTimeout] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    warnings: list[NcclWarn] = field(default_factory=list)
    errors: list[NcclError] = field(default_factory=list)
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


def error_cause(err: NcclError, *, network_warnings: bool = False) -> str:
    """What an NCCL error points at: `network` (a remote rank gone or the network failing: NCCL
    says so, or its last error or a network warning in the same log does; NCCL 2.18 reported
    network failures as internal errors), `cuda` (a CUDA call inside NCCL failed), `software`
    (the program used NCCL wrongly), else `system` or `internal`."""
    if err.code == "ncclRemoteError" or (err.last_error and _NET_WARN.search(err.last_error)):
        return "network"
    if err.code in ("ncclInvalidUsage", "ncclInvalidArgument"):
        return "software"
    if err.code == "ncclUnhandledCudaError":
        return "cuda"
    if network_warnings and err.code in ("ncclSystemError", "ncclInternalError"):
        return "network"
    return "system" if err.code == "ncclSystemError" else "internal"


def describe_error(err: NcclError) -> str:
    """`ncclRemoteError (remote process exited ...) at NCCLUtils.hpp:268, NCCL 2.21.5; last error:
    ...`: what a person reads first, with only the parts the log gave."""
    text = f"{err.code} ({err.reason})" if err.code else err.reason
    if err.where:
        text += f" at {err.where}"
    if err.nccl_version:
        text += f", NCCL {err.nccl_version}"
    if err.last_error:
        text += f"; last error: {err.last_error}"
    return text


def _host(line: str) -> str | None:
    m = _HOST_PREFIX.match(line)
    if m is None:
        return None
    host = m["host"]
    # `RuntimeError: ...`, `torch.distributed.DistBackendError: ...`, `what(): ...` are not hosts.
    if host.endswith(("Error", "Exception", "Warning")) or host.split(".")[-1][:1].isupper() or host in ("what", "Traceback", "Last error"):
        return None
    return host


def parse_error_message(line: str, *, line_no: int = 0, ts: float = 0.0) -> NcclError | None:
    """The NCCL error a line reports (None when it reports none): its reason, result, torch's
    source location, NCCL version and, where the line carries them, the result's name and NCCL's
    last error. The rank comes from torchrun's `[rankN]:` prefix or a `[Rank N]` tag, the host
    from a launcher's `host:` prefix."""
    m = _NCCL_ERROR.search(line)
    if m is None:
        return None
    reason = m["reason"].strip().rstrip(".")
    base = reason.split(" - ")[0].strip().lower()
    code = NCCL_RESULTS.get(base) or (_RESULT_NUMBERS.get(m["num"]) if m["num"] else None)
    # Prose that happens to say "NCCL error: ..." is not a result torch raised: the reason must be
    # an NCCL result text, or the message must carry torch's source location or NCCL's version.
    if code is None and m["path"] is None and m["version"] is None:
        return None
    rest = line[m.end():]
    if (c := _NCCL_CODE.search(rest)) is not None:
        code = c["code"]
    last = _LAST_ERROR.search(rest)
    rank, _pg = _rank_and_pg(line)
    if rank is None and (a := _ABORTED_ON.search(line)):
        rank = int(a["rank"])
    where = f"{m['path'].rsplit('/', 1)[-1]}:{m['lineno']}" if m["path"] else None
    return NcclError(
        line=line_no, ts=ts, rank=rank, host=_host(line), where=where, reason=reason[:200], code=code,
        nccl_version=m["version"], last_error=(last["text"].strip()[:300] or None) if last else None, text=line[m.start():][:500],
    )


def parse_timeout(line: str, *, line_no: int = 0, ts: float = 0.0) -> WatchdogTimeout | None:
    """The watchdog timeout a line reports (None when it reports none): the WorkNCCL fields, how
    long it ran, and the rank and process group of the tag before it."""
    m = _WATCHDOG.search(line)
    if m is None:
        return None
    fields = dict(_WORK_FIELD.findall(m["body"]))
    rank, pg = _rank_and_pg(line[: m.start()])
    return WatchdogTimeout(
        line=line_no, ts=ts, rank=rank, pg=pg, seq=_int(fields.get("SeqNum")), op_type=fields.get("OpType"),
        numel_in=_int(fields.get("NumelIn")), numel_out=_int(fields.get("NumelOut")), timeout_ms=_int(fields.get("Timeout(ms)")),
        ran_for_ms=int(m["ran"]), text=line[m.start():][:500],
    )


def parse_progress(line: str, *, line_no: int = 0, ts: float = 0.0) -> Progress | None:
    """A process group's progress as the watchdog printed it (None when the line has none): the
    work it stopped at, the last work enqueued and the last completed."""
    m = _PROGRESS.search(line)
    if m is None:
        return None
    rank, pg = _rank_and_pg(line[: m.start()])
    return Progress(line_no, rank, pg, _int(m["at"]), int(m["enq"]), int(m["done"]), ts)


def _continue_error(err: NcclError, line: str, state: dict) -> bool:
    """Reads a continuation line of `err` (its result's name, `Last error:` and the line after
    it) into it; False when the line is none of those."""
    if (r := _RANK_PREFIX.search(line)) is not None and err.rank is not None and int(r["rank"]) != err.rank:
        return False  # another rank's lines
    body = _RANK_PREFIX.sub("", line, count=1)
    if (h := _host(body)) is not None and h == err.host:
        body = body[_HOST_PREFIX.match(body).end():]  # type: ignore[union-attr]
    body = body.strip()
    if state.get("want_last"):
        if not body:
            return True  # a blank line between `Last error:` and its text
        state["want_last"] = False
        if err.last_error is None and not body.startswith(("Traceback", "File ", "Exception raised from", "frame #")):
            err.last_error = body[:300]
            return True
    if (c := _NCCL_CODE.match(body)) is not None:
        err.code = c["code"]
        if (last := _LAST_ERROR.search(body)) is not None and err.last_error is None:
            err.last_error = last["text"].strip()[:300] or None
            state["want_last"] = err.last_error is None
        return True
    if (last := _LAST_ERROR.match(body)) is not None:
        if last["text"].strip() and err.last_error is None:
            err.last_error = last["text"].strip()[:300]
        else:
            state["want_last"] = True
        return True
    return False


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

    # The NCCL error whose continuation lines (its result's name, NCCL's last error) may follow.
    following: NcclError | None = None
    follow_state: dict = {}
    for offset, line in unwrap(lines):
        out.lines += 1
        if len(line) > 20000:  # a runaway line (binary junk) cannot be a log message we know
            line = line[:20000]
        no = first_line_no + offset
        try:
            if following is not None:
                if no - following.line <= _ERROR_FOLLOW_LINES and "NCCL error" not in line and _continue_error(following, line, follow_state):
                    continue
                if not follow_state.get("want_last"):
                    following = None
            if "Watchdog caught" in line and (t := parse_timeout(line, line_no=no)) is not None:
                t.ts = when(line)
                out.timeouts.append(t)
            elif "ast enqueued" in line and (p := parse_progress(line, line_no=no)) is not None:
                p.ts = when(line)
                out.progress.append(p)
                if "Timeout at NCCL work" in line:
                    out.timeout_at.append((no, p.ts, p.rank))
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
            # An NCCL error may share its line with a timeout's or a failure's wording (a log that
            # joined torch's lines): read it whichever branch took the line.
            if ("NCCL error" in line or "NCCL Error" in line) and "NCCL WARN" not in line and (err := parse_error_message(line, line_no=no, ts=when(line))) is not None:
                out.errors.append(err)
                following, follow_state = err, {}
        finally:
            recent.append(line)
    return out


_SNIFF = re.compile(
    r"Watchdog caught collective operation timeout|(?:CUDA|HIP) out of memory|NCCL (?:WARN|INFO)|ProcessGroupNCCL|"
    r"last enqueued (?:NCCL )?work|Some NCCL operations have failed|PyTorch CUDA memory summary|Traceback \(most recent call last\)|"
    r"NCCL error(?: in)?:|NCCL Error \d",
)


def looks_like_training_log(sample: str) -> bool:
    return _SNIFF.search(sample) is not None
