"""NVIDIA XIDs from kernel logs (dmesg, journalctl, /var/log/syslog or kern.log).

The driver writes one line per XID::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

(older drivers omit `PCI:` and the pid/name fields). Lines may carry a dmesg timestamp
(`[12345.678]`, since boot), `dmesg -T` or ISO wall-clock timestamps, or a syslog prefix
(`Nov 29 23:07:34 host kernel: `). A failing GPU usually logs the same XID many times in a
burst; a burst is one incident until `burst_gap_seconds` of silence (3 minutes by default,
`gpuvigil/config/kernel_log.yaml`).

One line's XID is parsed by `gpuvigil.parsers.xid_line` (pure, shared with `analyze`);
`parse_lines` turns text into an `events` frame (plus the PCI bus id and line numbers for
reports) and `incidents` groups bursts with polars (`incident_rows`: the `xid_incidents` stream
`analyze` fills); what an incident means (an `xid` finding, by the XID table
`gpuvigil/data/xid.yaml` and the shared XID policy) is decided by the registered offline
detector `xid_incidents` (gpuvigil/detectors/xid_incidents.py). `KernelLogCollector` reads the live kernel
log from `/dev/kmsg`, journald or a file, resuming where it stopped (see below and docs/sources.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil import config, schemas
from gpuvigil.parsers.logtime import line_time, syslog_host
from gpuvigil.parsers.xid_line import XID_LINE, iter_xid_records, looks_like_kernel_log, normalise_pci, parse_xid_line  # noqa: F401
from gpuvigil.collectors.tail import FileTail, TailingLogCollector, TailPosition  # noqa: F401 (re-exported)
from gpuvigil.errors import UserError


# The richer per-line frame: EVENTS plus what offline reports need.
XID_LINES = pl.Schema(
    {
        **schemas.EVENTS,
        "pci_bus_id": pl.Utf8,
        "line": pl.Int64,
        "pid": pl.Int64,
        "process": pl.Utf8,
        "ts_kind": pl.Utf8,
        # the code the line itself carries when `xid` is the one it was caused by ("45 caused
        # by previous Xid 149": xid 149, reported_xid 45); equal to `xid` otherwise
        "reported_xid": pl.Int32,
    }
)


class KernelLogConfig(BaseModel):
    burst_gap_seconds: float = Field(180.0, gt=0)
    # Live sources (KernelLogCollector): where the resume point is kept across restarts (null:
    # not kept, start at the end), and the most bytes read from the source per tick.
    state_file: str | None = None
    max_read_bytes: int = Field(1 << 20, gt=0)


def load_config(cfg: dict[str, Any] | None = None) -> KernelLogConfig:
    return config.section("kernel_log", KernelLogConfig, cfg)


def parse_lines(
    lines: Iterable[str],
    *,
    node: str | None = None,
    pci_to_gpu: Mapping[str, int] | None = None,
    reference_ts: float | None = None,
    boot_ts: float | None = None,
    first_line_no: int = 1,
) -> pl.DataFrame:
    """XID lines as a frame of `XID_LINES` (a superset of the `events` schema).

    `pci_to_gpu` maps PCI bus ids (any common spelling) to GPU indices on the node. Lines with
    only a since-boot timestamp get `boot_ts + seconds` when `boot_ts` is known, else the
    seconds since boot (`ts_kind` says which); lines with no timestamp get `reference_ts`.
    """
    reference_ts = time.time() if reference_ts is None else reference_ts
    gpu_of = {normalise_pci(k): v for k, v in (pci_to_gpu or {}).items()}
    rows: list[dict[str, Any]] = []
    for offset, line, x in iter_xid_records(lines):
        when = line_time(line, reference_ts)
        ts, ts_kind = (reference_ts, "none") if when is None else (when.ts, when.kind)
        if when is not None and when.kind == "since_boot" and boot_ts is not None:
            ts, ts_kind = boot_ts + when.ts, "boot_offset"
        pci = x.pci_bus_id
        # "45 ... caused by previous Xid 149" is attributed to 149, even when 149's own line is
        # not in the log: the finding names 149's meaning and severity.
        code = x.root
        rows.append(
            {
                "ts": ts,
                "node": syslog_host(line) or node,
                "gpu": gpu_of.get(pci),
                "source": "kernel",
                "kind": "xid",
                "xid": code if code < 2**31 else None,
                "message": x.message,
                "pci_bus_id": pci,
                "line": first_line_no + offset,
                "pid": x.pid,
                "process": x.process,
                "ts_kind": ts_kind,
                "reported_xid": x.code if x.code < 2**31 else None,
            }
        )
    return schemas.frame(rows, XID_LINES)


def events(xid_lines: pl.DataFrame) -> pl.DataFrame:
    """The `events` stream view of `parse_lines` output."""
    return schemas.conform(xid_lines, schemas.EVENTS, stream="events")


# One row per burst (the `xid_incidents` stream's columns, less when and from which file it was read).
INCIDENTS = schemas.XID_INCIDENT_COLUMNS


def incidents(xid_lines: pl.DataFrame, burst_gap_seconds: float = 180.0) -> pl.DataFrame:
    """One row per burst of the same XID on the same GPU: a new incident after a silent gap."""
    if xid_lines.is_empty():
        return pl.DataFrame(schema=INCIDENTS)
    key = ["node", "pci_bus_id", "xid"]
    df = (
        xid_lines.with_columns(pl.col("node").fill_null(""))
        .sort([*key, "ts", "line"])
        .with_columns(
            (pl.col("ts").diff().over(key).fill_null(0.0) > burst_gap_seconds).cum_sum().over(key).alias("burst")
        )
    )
    out = (
        df.group_by([*key, "burst"], maintain_order=True)
        .agg(
            pl.col("gpu").first(),
            pl.col("ts").min().alias("first_ts"),
            pl.col("ts").max().alias("last_ts"),
            pl.len().alias("count"),
            pl.col("line").first().alias("first_line"),
            pl.col("message").first(),
            pl.col("pid").drop_nulls().unique(maintain_order=True).alias("pids"),
            pl.col("process").drop_nulls().unique(maintain_order=True).alias("processes"),
            pl.col("ts_kind").first(),
            (pl.col("reported_xid") if "reported_xid" in df.columns else pl.col("xid")).cast(pl.Int32).unique(maintain_order=True).alias("reported_xids"),
        )
        .with_columns(pl.when(pl.col("node") == "").then(None).otherwise(pl.col("node")).alias("node"))
        .sort(["first_ts", "first_line"])
    )
    return out.select([pl.col(c).cast(t) for c, t in INCIDENTS.items()])


def incident_rows(xid_lines: pl.DataFrame, burst_gap_seconds: float, *, ts: float, file: str | None = None, job: str | None = None) -> pl.DataFrame:
    """The `xid_incidents` stream of a whole log read at `ts`: its bursts (`incidents`), each
    naming the file it came from and the job the user said the log is about."""
    inc = incidents(xid_lines, burst_gap_seconds)
    return schemas.conform(inc.with_columns(pl.lit(ts, pl.Float64).alias("ts"), pl.lit(file, pl.Utf8).alias("file"), pl.lit(job, pl.Utf8).alias("job")), "xid_incidents")


def boot_time() -> float | None:
    """This machine's boot time (`btime` in /proc/stat), to place dmesg's since-boot stamps."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        return None
    return None


# ---------------------------------------------------------------- live kernel-log sources
#
# Three ways to read the kernel log on a node, as node-problem-detector does: `/dev/kmsg` (the
# kernel's record interface, one record per read), journald (`journalctl -k -o json`, followed
# from a cursor) and a log file (kern.log / messages / syslog, tailed). Each turns what it reads
# into text lines in a shape `parse_lines` knows (dmesg's `[secs] msg` for kmsg, journalctl's
# `-o short-iso-precise` for journald), so the XID parsing is the same whatever the source. Each
# keeps a resume point (kmsg: boot id + sequence number; journald: cursor; file: device, inode
# and offset) in a small JSON state file, so a restart neither misses nor repeats messages.


class KernelLogUnavailable(UserError):
    """An explicitly configured kernel-log source cannot be read on this machine."""


_KMSG_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    priority: int  # syslog level (0 emerg .. 7 debug)
    facility: int
    seq: int
    usec: int  # since boot
    continuation: bool
    message: str


def parse_kmsg_record(raw: bytes) -> KmsgRecord | None:
    """One `/dev/kmsg` record: `prio,seq,usec,flags[,...];message\\n[ KEY=value\\n...]`.

    The kernel escapes non-printable bytes in the message as `\\xNN`; they are decoded back.
    Returns None for anything that is not a record (never raises).
    """
    head, sep, rest = raw.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4:
        return None
    try:
        prio, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    if prio < 0 or seq < 0 or usec < 0:
        return None
    text = rest.split(b"\n", 1)[0]  # continuation lines (" SUBSYSTEM=pci") follow the message
    text = _KMSG_ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), text)
    return KmsgRecord(prio & 7, prio >> 3, seq, usec, fields[3].startswith(b"c"), text.decode("utf-8", errors="replace"))


def kmsg_line(rec: KmsgRecord) -> str:
    """The record as `dmesg` prints it (`[secs since boot] message`)."""
    return f"[{rec.usec / 1e6:12.6f}] {rec.message}"


def current_boot_id(path: str | Path = "/proc/sys/kernel/random/boot_id") -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


class KmsgSource:
    """Reads `/dev/kmsg` without blocking: one record per `read()`, EAGAIN at the end.

    The resume point is (boot id, last sequence number): after a restart on the same boot the
    records up to that number are skipped; after a reboot the buffer is new and read whole.
    EPIPE means the ring buffer overwrote records before we read them: counted in `lost`.
    """

    kind = "kmsg"
    READ_SIZE = 1 << 16  # larger than any record (the kernel's limit is 8 KiB per record)

    def __init__(self, path: str | Path = "/dev/kmsg", *, from_start: bool = False, resume: Mapping[str, Any] | None = None,
                 max_read_bytes: int = 1 << 20, boot_id: str | None = None):
        self.path = Path(path)
        self.where = str(self.path)
        self.max_read_bytes = max_read_bytes
        self.boot_id = boot_id if boot_id is not None else current_boot_id()
        self.lost = 0
        self.last_seq: int | None = None
        self._skip_through: int | None = None
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise KernelLogUnavailable(f"kernel log: cannot open {self.path}: {exc.strerror or exc}") from exc
        same_boot = resume is not None and resume.get("boot_id") == self.boot_id and isinstance(resume.get("seq"), int)
        if same_boot:
            self._skip_through = int(resume["seq"])  # type: ignore[index]
            self.last_seq = self._skip_through
            os.lseek(self._fd, 0, os.SEEK_SET)
        elif resume is not None or from_start:
            os.lseek(self._fd, 0, os.SEEK_SET)  # a new boot (or asked for): the whole buffer
        else:
            os.lseek(self._fd, 0, os.SEEK_END)
        self.resumed = same_boot

    def read(self) -> list[str]:
        lines: list[str] = []
        budget = self.max_read_bytes
        while budget > 0:
            try:
                raw = os.read(self._fd, self.READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self.lost += 1  # overwritten before we read it; the next read continues
                continue
            if not raw:
                break
            budget -= len(raw)
            rec = parse_kmsg_record(raw)
            if rec is None:
                continue
            if self._skip_through is not None:
                if rec.seq <= self._skip_through:
                    continue
                self._skip_through = None
            self.last_seq = rec.seq
            lines.append(kmsg_line(rec))
        return lines

    def state(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "boot_id": self.boot_id, "seq": self.last_seq} if self.last_seq is not None else None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def journal_line(entry: Mapping[str, Any], *, with_host: bool = True) -> tuple[str, str | None] | None:
    """A `journalctl -o json` entry as a `short-iso-precise` line, and its cursor.

    MESSAGE is a string, or an array of byte values when it is not valid UTF-8, or null.
    """
    msg = entry.get("MESSAGE")
    if isinstance(msg, list):
        try:
            msg = bytes(int(b) & 0xFF for b in msg).decode("utf-8", errors="replace")
        except (TypeError, ValueError):
            return None
    if not isinstance(msg, str):
        return None
    cursor = entry.get("__CURSOR") if isinstance(entry.get("__CURSOR"), str) else None
    try:
        usec = int(entry.get("__REALTIME_TIMESTAMP"))  # type: ignore[arg-type]
        stamp = datetime.fromtimestamp(usec / 1e6, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")
    except (TypeError, ValueError, OverflowError, OSError):
        stamp = None
    host = entry.get("_HOSTNAME") if with_host and isinstance(entry.get("_HOSTNAME"), str) else None
    # journald splits "IDENT: text" off records that userspace wrote to /dev/kmsg (facility
    # other than kern); put it back so the line reads as dmesg printed it.
    ident = entry.get("SYSLOG_IDENTIFIER")
    if isinstance(ident, str) and ident not in ("", "kernel") and not msg.startswith(ident):
        msg = f"{ident}: {msg}"
    prefix = " ".join(p for p in (stamp, host) if p)
    return (f"{prefix} kernel: {msg}" if prefix else msg), cursor


class JournaldSource:
    """Follows the kernel messages in the journal: `journalctl -k -o json --follow`.

    A child `journalctl` follows the journal from the saved cursor (`--after-cursor`), from the
    end (`--lines=0`) or from the start of the journal (`--lines=all`); its output is read without
    blocking, capped per read. If it exits, it is restarted from the last cursor on the next read.
    """

    kind = "journald"
    MAX_LINE_BYTES = 1 << 20

    def __init__(self, *, journalctl: str = "journalctl", from_start: bool = False, resume: Mapping[str, Any] | None = None,
                 max_read_bytes: int = 1 << 20, with_host: bool = True, extra_args: tuple[str, ...] = ()):
        exe = shutil.which(journalctl)
        if exe is None:
            raise KernelLogUnavailable(f"kernel log: journald selected but {journalctl!r} is not on PATH")
        self.exe = exe
        self.where = f"journald ({exe} -k)"
        self.from_start = from_start
        self.max_read_bytes = max_read_bytes
        self.with_host = with_host
        self.extra_args = tuple(extra_args)
        self.cursor: str | None = resume.get("cursor") if resume and isinstance(resume.get("cursor"), str) else None
        self.resumed = self.cursor is not None
        self.restarts = 0
        self.bad_entries = 0
        self._partial = b""
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _argv(self) -> list[str]:
        # Only the fields we read (the cursor and timestamps always come): a third of the bytes.
        fields = "--output-fields=MESSAGE,_HOSTNAME,SYSLOG_IDENTIFIER"
        argv = [self.exe, "-k", "-o", "json", fields, "--no-pager", "--follow", *self.extra_args]
        if self.cursor is not None:
            argv.append(f"--after-cursor={self.cursor}")
        else:
            argv.append("--lines=all" if self.from_start else "--lines=0")
        return argv

    def _start(self) -> None:
        try:
            self._proc = subprocess.Popen(self._argv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise KernelLogUnavailable(f"kernel log: cannot run {self.exe}: {exc.strerror or exc}") from exc
        os.set_blocking(self._proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self._partial = b""

    def _reap(self) -> str:
        """The exited child's reason, and get ready to restart it from the last cursor."""
        proc, self._proc = self._proc, None
        assert proc is not None
        err = b""
        try:
            err = proc.stderr.read() or b"" if proc.stderr else b""  # type: ignore[operator]
        except OSError:
            pass
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        lines = [l for l in err.decode(errors="replace").splitlines() if l.strip()]
        return f"journalctl exited with status {proc.returncode}" + (f": {lines[-1].strip()[:200]}" if lines else "")

    def read(self) -> list[str]:
        if self._proc is None:
            self.restarts += 1
            self._start()
        assert self._proc is not None and self._proc.stdout is not None
        chunks: list[bytes] = []
        budget = self.max_read_bytes
        fd = self._proc.stdout.fileno()
        eof = False
        while budget > 0:
            try:
                data = os.read(fd, min(budget, 1 << 16))
            except BlockingIOError:
                break
            if not data:
                eof = True
                break
            chunks.append(data)
            budget -= len(data)
        data = self._partial + b"".join(chunks)
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > self.MAX_LINE_BYTES:
            self.bad_entries += 1
            self._partial = b""
        lines: list[str] = []
        for raw in complete:
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                self.bad_entries += 1
                continue
            got = journal_line(entry, with_host=self.with_host) if isinstance(entry, dict) else None
            if got is None:
                self.bad_entries += 1
                continue
            line, cursor = got
            lines.append(line)
            if cursor is not None:
                self.cursor = cursor
        if eof:
            self._proc.wait()
            reason = self._reap()
            if not lines:
                raise OSError(reason)  # the read failed: the collector reports it
        return lines

    def state(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "cursor": self.cursor} if self.cursor is not None else None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._reap()


class FileSource:
    """A kernel log file (kern.log, messages, syslog, or `dmesg -w` output), tailed."""

    kind = "file"

    def __init__(self, path: str | Path, *, from_start: bool = False, resume: Mapping[str, Any] | None = None, max_read_bytes: int = 1 << 20):
        self.path = Path(path)
        self.where = str(self.path)
        position = TailPosition.from_json(resume) if resume and resume.get("path") == str(self.path) else None
        self.resumed = position is not None
        self.tail = FileTail(self.path, from_start=from_start, max_read_bytes=max_read_bytes, position=position)

    def read(self) -> list[str]:
        return self.tail.read_lines()

    def state(self) -> dict[str, Any] | None:
        pos = self.tail.position
        return {"kind": self.kind, "path": str(self.path), **pos.to_json()} if pos is not None else None

    def close(self) -> None:
        self.tail.close()


FILE_CANDIDATES = ("/var/log/kern.log", "/var/log/messages", "/var/log/syslog")


class StateFile:
    """A small JSON file holding a source's resume point; written atomically (rename)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # none yet, or unreadable: start afresh rather than fail
        return data if isinstance(data, dict) else None

    def save(self, state: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, self.path)


def open_source(spec: str | Path, *, from_start: bool = False, resume: Mapping[str, Any] | None = None, max_read_bytes: int = 1 << 20,
                journalctl: str = "journalctl", kmsg_path: str | Path = "/dev/kmsg", with_host: bool = True):
    """`kmsg`, `journald`, a file path, or `auto` (kmsg, else journald, else the first kernel
    log file that exists). Raises KernelLogUnavailable when the chosen source cannot be read."""
    spec = str(spec)

    def resume_for(kind: str) -> Mapping[str, Any] | None:
        return resume if resume is not None and resume.get("kind") == kind else None

    if spec == "kmsg":
        return KmsgSource(kmsg_path, from_start=from_start, resume=resume_for("kmsg"), max_read_bytes=max_read_bytes)
    if spec == "journald":
        return JournaldSource(journalctl=journalctl, from_start=from_start, resume=resume_for("journald"), max_read_bytes=max_read_bytes, with_host=with_host)
    if spec == "auto":
        reasons = []
        for kind in ("kmsg", "journald"):
            try:
                return open_source(kind, from_start=from_start, resume=resume, max_read_bytes=max_read_bytes, journalctl=journalctl, kmsg_path=kmsg_path, with_host=with_host)
            except KernelLogUnavailable as exc:
                reasons.append(str(exc))
        for candidate in FILE_CANDIDATES:
            if os.access(candidate, os.R_OK):
                return FileSource(candidate, from_start=from_start, resume=resume_for("file"), max_read_bytes=max_read_bytes)
        raise KernelLogUnavailable("kernel log: no source readable (" + "; ".join(reasons) + f"; none of {', '.join(FILE_CANDIDATES)})")
    try:
        return FileSource(spec, from_start=from_start, resume=resume_for("file"), max_read_bytes=max_read_bytes)
    except OSError as exc:
        raise KernelLogUnavailable(f"kernel log: cannot read {spec}: {exc.strerror or exc}") from exc


class KernelLogCollector:
    """XIDs from the kernel log, from `/dev/kmsg`, journald or a file (see `open_source`).

    Starts at the end of the log (new messages only) unless `from_start`, or at the resume point
    saved in `state_file` by a previous run. Emits `events` for each XID line.
    """

    streams: Mapping[str, pl.Schema] = {"events": schemas.EVENTS}

    def __init__(
        self,
        source: str | Path = "auto",
        *,
        node: str | None = None,
        pci_to_gpu: Mapping[str, int] | None = None,
        from_start: bool = False,
        state_file: str | Path | None = None,
        max_read_bytes: int | None = None,
        boot_ts: float | None = None,
        journalctl: str = "journalctl",
        kmsg_path: str | Path = "/dev/kmsg",
        cfg: dict[str, Any] | None = None,
    ):
        c = load_config(cfg)
        self.errors = 0
        self.node = node
        self.pci_to_gpu = dict(pci_to_gpu or {})
        self.boot_ts = boot_time() if boot_ts is None else boot_ts
        state_file = state_file if state_file is not None else c.state_file
        self.state_file = StateFile(state_file) if state_file else None
        resume = self.state_file.load() if self.state_file else None
        self.source = open_source(
            source, from_start=from_start, resume=resume, max_read_bytes=max_read_bytes or c.max_read_bytes,
            journalctl=journalctl, kmsg_path=kmsg_path, with_host=node is None,
        )
        self.name = f"kernel_log:{self.source.kind}" if self.source.kind != "file" else f"kernel_log:{self.source.where}"
        self.last_error: str | None = None
        self._saved: dict[str, Any] | None = resume
        self.lines_read = 0

    @property
    def tail(self) -> FileTail | None:
        return getattr(self.source, "tail", None)

    def describe(self) -> str:
        start = "resuming from the saved point" if getattr(self.source, "resumed", False) else "new messages only"
        state = f", state {self.state_file.path}" if self.state_file else ""
        return f"kernel log: {self.source.kind} {self.source.where} ({start}{state})"

    def health(self) -> dict[str, str | None]:
        return {self.source.where: self.last_error}

    def close(self) -> None:
        self.source.close()

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        state = self.source.state()
        if state is None or state == self._saved:
            return
        try:
            self.state_file.save(state)
            self._saved = state
        except OSError as exc:
            self.errors += 1
            self.last_error = f"cannot save state to {self.state_file.path}: {exc.strerror or exc}"

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        try:
            lines = self.source.read()
            self.last_error = None
        except OSError as exc:
            self.errors += 1
            self.last_error = str(exc) if not getattr(exc, "strerror", None) else f"cannot read {self.source.where}: {exc.strerror}"
            return {}
        first = self.lines_read + 1
        self.lines_read += len(lines)
        out: dict[str, pl.DataFrame] = {}
        if lines:
            try:
                ev = self.events_from(lines, first)
            except (ValueError, OverflowError, schemas.SchemaError):
                self.errors += 1
                ev = schemas.empty("events")
            if ev.height:
                out["events"] = ev
        self._save_state()
        return out

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        parsed = parse_lines(
            lines, node=self.node, pci_to_gpu=self.pci_to_gpu, reference_ts=time.time(), boot_ts=self.boot_ts, first_line_no=first_line_no
        )
        return events(parsed) if parsed.height else schemas.empty("events")


__all__ = [
    "FileSource", "FileTail", "JournaldSource", "KernelLogCollector", "KernelLogUnavailable", "KmsgRecord", "KmsgSource", "StateFile",
    "TailingLogCollector", "events", "incidents", "kmsg_line", "journal_line", "open_source", "parse_kmsg_record",
    "parse_lines",
]
