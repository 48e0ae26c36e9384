"""NVIDIA XIDs from kernel logs (dmesg, journalctl, /var/log/syslog or kern.log).

The driver writes one line per XID::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

(older drivers omit `PCI:` and the pid/name fields). Lines may carry a dmesg timestamp
(`[12345.678]`, since boot), `dmesg -T` or ISO wall-clock timestamps, or a syslog prefix
(`Nov 29 23:07:34 host kernel: `). A failing GPU usually logs the same XID many times in a
burst; a burst is one incident until `burst_gap_seconds` of silence (3 minutes by default,
`gpuvigil/config/kernel_log.yaml`).

`parse_lines` turns text into an `events` frame (plus the PCI bus id and line numbers for
reports), `incidents` groups bursts with polars, and `findings` turns incidents into `xid`
findings using the XID table (`gpuvigil/data/xid.yaml`). `KernelLogCollector` tails a file.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil import config, schemas, xid
from gpuvigil.collectors.logtime import line_time, syslog_host
from gpuvigil.model import Finding, FindingKind, Severity

XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\):\s*(?P<code>\d{1,4})\b,?\s*(?P<rest>.*)$"
)
_PID = re.compile(r"\bpid=(?:'?(?P<pid>\d+)'?|'?<unknown>'?)\s*,?\s*")
_NAME = re.compile(r"\bname=(?P<name>[^,]*),?\s*")

# The richer per-line frame: EVENTS plus what offline reports need.
XID_LINES = pl.Schema(
    {
        **schemas.EVENTS,
        "pci_bus_id": pl.Utf8,
        "line": pl.Int64,
        "pid": pl.Int64,
        "process": pl.Utf8,
        "ts_kind": pl.Utf8,
    }
)


class KernelLogConfig(BaseModel):
    burst_gap_seconds: float = Field(180.0, gt=0)


def load_config(cfg: dict[str, Any] | None = None) -> KernelLogConfig:
    if cfg is None:
        return _default_config()
    return config.section("kernel_log", KernelLogConfig, cfg)


@lru_cache(maxsize=1)
def _default_config() -> KernelLogConfig:
    return config.section("kernel_log", KernelLogConfig, None)


def _process_name(raw: str) -> str | None:
    name = raw.strip().strip("'")
    return None if not name or name == "<unknown>" else name


def normalise_pci(bus_id: str) -> str:
    """`0000:3B:00` / `00000000:3b:00.0` → `0000:3b:00` (domain:bus:device), the form XIDs use."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) < 3:
        return bus_id.strip().lower()
    domain, bus, dev = parts[-3], parts[-2], parts[-1].split(".")[0]
    return f"{int(domain, 16):04x}:{bus}:{dev}"


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
    for offset, raw in enumerate(lines):
        if "Xid" not in raw:  # cheap filter: kernel logs are mostly other things
            continue
        line = raw.rstrip("\r\n")
        m = XID_LINE.search(line)
        if not m:
            continue
        when = line_time(line, reference_ts)
        ts, ts_kind = (reference_ts, "none") if when is None else (when.ts, when.kind)
        if when is not None and when.kind == "since_boot" and boot_ts is not None:
            ts, ts_kind = boot_ts + when.ts, "boot_offset"
        rest = m["rest"]
        pid_m = _PID.search(rest)
        name_m = _NAME.search(rest)
        message = _NAME.sub("", _PID.sub("", rest, count=1), count=1).strip().rstrip(",").strip()
        pci = normalise_pci(m["pci"])
        code = int(m["code"])
        rows.append(
            {
                "ts": ts,
                "node": syslog_host(line) or node,
                "gpu": gpu_of.get(pci),
                "source": "kernel",
                "kind": "xid",
                "xid": code if code < 2**31 else None,
                "message": message,
                "pci_bus_id": pci,
                "line": first_line_no + offset,
                "pid": int(pid_m["pid"]) if pid_m and pid_m["pid"] else None,
                "process": _process_name(name_m["name"]) if name_m else None,
                "ts_kind": ts_kind,
            }
        )
    return schemas.frame(rows, XID_LINES)


def events(xid_lines: pl.DataFrame) -> pl.DataFrame:
    """The `events` stream view of `parse_lines` output."""
    return schemas.conform(xid_lines, schemas.EVENTS, stream="events")


INCIDENTS = pl.Schema(
    {
        "node": pl.Utf8,
        "pci_bus_id": pl.Utf8,
        "gpu": pl.Int32,
        "xid": pl.Int32,
        "first_ts": pl.Float64,
        "last_ts": pl.Float64,
        "count": pl.UInt32,
        "first_line": pl.Int64,
        "message": pl.Utf8,
        "pids": pl.List(pl.Int64),
        "processes": pl.List(pl.Utf8),
        "ts_kind": pl.Utf8,
    }
)


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
        )
        .with_columns(pl.when(pl.col("node") == "").then(None).otherwise(pl.col("node")).alias("node"))
        .sort(["first_ts", "first_line"])
    )
    return out.select([pl.col(c).cast(t) for c, t in INCIDENTS.items()])


def _severity(code: int, fatal: bool) -> Severity:
    info = xid.xid_info(code)
    if fatal:
        return Severity.PAGE
    if info is not None and info.action == "IGNORE":
        return Severity.INFO
    return Severity.TICKET


def findings(
    incident_frame: pl.DataFrame,
    *,
    source_file: str | None = None,
    job: str | None = None,
    companion_window_seconds: float = 180.0,
) -> list[Finding]:
    """`xid` findings, one per incident: page for fatal XIDs, ticket for the application's own."""
    out: list[Finding] = []
    rows = incident_frame.to_dicts()
    for row in rows:
        code = int(row["xid"])
        info = xid.xid_info(code)
        fatal = xid.is_fatal(code, row["message"] or "")
        # Other XIDs on the same GPU while this one was bursting: e.g. 48 with 63/64 changes
        # NVIDIA's workflow (drain and reset), 45/43 are usually its consequences.
        companions = sorted(
            {
                int(o["xid"])
                for o in rows
                if o is not row
                and o["node"] == row["node"]
                and o["pci_bus_id"] == row["pci_bus_id"]
                and int(o["xid"]) != code
                and o["first_ts"] <= row["last_ts"] + companion_window_seconds
                and o["last_ts"] >= row["first_ts"] - companion_window_seconds
            }
        )
        name = info.name if info else "unknown XID (not in gpuvigil's table; see NVIDIA's XID catalog)"
        action = info.action if info else None
        where = row["node"] or "this node"
        gpu_txt = f"GPU {row['gpu']}" if row["gpu"] is not None else f"GPU at PCI {row['pci_bus_id']}"
        evidence: dict[str, Any] = {
            "fatal": fatal,
            "app_level": info.app_level if info else False,
            "action": action,
            "category": info.category if info else None,
            "name": name,
            "count": int(row["count"]),
            "first_ts": row["first_ts"],
            "last_ts": row["last_ts"],
            "pci_bus_id": row["pci_bus_id"],
            "message": row["message"],
            "pids": list(row["pids"]),
            "processes": list(row["processes"]),
            "with_xids": companions,
            "ts_kind": row["ts_kind"],
        }
        if info is not None and not info.verified:
            evidence["table_row_verified"] = False
        times = f"{row['count']}×" if row["count"] > 1 else "once"
        summary = f"XID {code} ({name}) on {gpu_txt} of {where}, {times}"
        summary += f"; NVIDIA's immediate action: {action}" if action else ""
        out.append(
            Finding(
                kind=FindingKind.XID,
                severity=_severity(code, fatal),
                ts=row["first_ts"],
                job=job,
                node=row["node"],
                gpu=row["gpu"],
                xid=code,
                evidence=evidence,
                summary=summary,
                source=f"{source_file}:{row['first_line']}" if source_file else "kernel_log",
                cause="hardware" if fatal else ("software" if info is not None and info.app_level else None),
            )
        )
    return out


def analyze_text(
    text: str,
    *,
    source_file: str | None = None,
    node: str | None = None,
    pci_to_gpu: Mapping[str, int] | None = None,
    reference_ts: float | None = None,
    cfg: dict[str, Any] | None = None,
) -> list[Finding]:
    gap = load_config(cfg).burst_gap_seconds
    lines = parse_lines(text.splitlines(), node=node, pci_to_gpu=pci_to_gpu, reference_ts=reference_ts)
    return findings(incidents(lines, gap), source_file=source_file, companion_window_seconds=gap)


def looks_like_kernel_log(sample: str) -> bool:
    return XID_LINE.search(sample) is not None


def boot_time() -> float | None:
    """This machine's boot time (`btime` in /proc/stat), to place dmesg's since-boot stamps."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        return None
    return None


class FileTail:
    """Follows a growing text file like `tail -F`: survives rotation (new inode) and truncation.

    The file stays open between reads, so lines appended to it just before it is rotated away are
    still read from the old file before switching to the new one. Only whole lines are returned;
    a partial last line waits for its newline. Invalid UTF-8 is replaced, never fatal.
    """

    def __init__(self, path: Path, from_start: bool = True):
        self.path = Path(path)
        self.from_start = from_start
        self.lines_read = 0
        self._fh: Any = None
        self._partial = b""

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self, *, at_end: bool) -> bool:
        try:
            self._fh = open(self.path, "rb")  # noqa: SIM115 (kept open on purpose)
        except OSError:
            self._fh = None
            return False
        if at_end:
            self._fh.seek(0, os.SEEK_END)
        return True

    def _drain(self) -> bytes:
        return self._fh.read() if self._fh is not None else b""

    def read_lines(self) -> list[str]:
        chunks: list[bytes] = []
        if self._fh is None:
            if not self._open(at_end=not self.from_start and self.lines_read == 0 and not self._partial):
                return []
        else:
            try:
                st = os.stat(self.path)
            except OSError:
                st = None
            fst = os.fstat(self._fh.fileno())
            if st is None or st.st_ino != fst.st_ino or st.st_dev != fst.st_dev:
                # Rotated: what was appended to the old file before the rename is still ours.
                chunks.append(self._drain())
                self.close()
                if st is not None and self._open(at_end=False):
                    # the new file starts a new line whatever the old one ended with
                    old_tail = self._partial + chunks[-1]
                    if old_tail and not old_tail.endswith(b"\n"):
                        chunks.append(b"\n")
            elif fst.st_size < self._fh.tell():
                # Truncated in place (copytruncate): start again from the top.
                self._fh.seek(0)
                self._partial = b""
        chunks.append(self._drain())
        data = self._partial + b"".join(chunks)
        if not data:
            return []
        *complete, self._partial = data.split(b"\n")
        out = [raw.decode("utf-8", errors="replace") for raw in complete]
        self.lines_read += len(out)
        return out


class TailingLogCollector:
    """Base of the collectors that tail a log file: new lines each tick → `events`.

    Subclasses say how lines become events (`events_from`); reading, rotation and error counting
    are here once. A line that cannot be parsed is counted in `errors`, never raised.
    """

    streams: Mapping[str, pl.Schema] = {"events": schemas.EVENTS}
    name: str
    errors: int
    tail: FileTail

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        raise NotImplementedError

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        first = self.tail.lines_read + 1
        try:
            lines = self.tail.read_lines()
        except OSError:
            self.errors += 1
            return {}
        if not lines:
            return {}
        try:
            ev = self.events_from(lines, first)
        except (ValueError, OverflowError, schemas.SchemaError):
            self.errors += 1
            return {}
        return {"events": ev} if ev.height else {}


class KernelLogCollector(TailingLogCollector):
    """Tails a kernel log file and emits `events` for each XID line appended to it."""

    def __init__(
        self,
        path: str | Path,
        *,
        node: str | None = None,
        pci_to_gpu: Mapping[str, int] | None = None,
        from_start: bool = True,
        boot_ts: float | None = None,
    ):
        self.name = f"kernel_log:{path}"
        self.errors = 0
        self.node = node
        self.pci_to_gpu = dict(pci_to_gpu or {})
        self.boot_ts = boot_time() if boot_ts is None else boot_ts
        self.tail = FileTail(Path(path), from_start=from_start)

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        parsed = parse_lines(
            lines, node=self.node, pci_to_gpu=self.pci_to_gpu, reference_ts=time.time(), boot_ts=self.boot_ts, first_line_no=first_line_no
        )
        return events(parsed) if parsed.height else schemas.empty("events")
