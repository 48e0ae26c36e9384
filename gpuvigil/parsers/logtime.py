"""Timestamps of log lines in the shapes GPU nodes write them.

Shared by the kernel-log and PyTorch/NCCL log parsers. Recognised at the start of a line (after an
optional `[rankN]:` prefix):

- ISO 8601 (`2026-11-29T23:07:34.123456+00:00`, `2026-11-29 23:07:34,123`, journalctl
  `-o short-iso`, NCCL's `[2026-11-29 23:08:16]`)
- syslog / journalctl short (`Nov 29 23:07:34[.123456] host ...`): no year
- `dmesg -T` (`[Sun Nov 29 23:07:34 2026]`)
- `dmesg` monotonic seconds since boot (`[12345.678901]`)
- glog, as torch's c10 logging writes it (`[E1129 23:07:34.447300897 file.cpp:689]`, `[E626 ...]`,
  `W1129 23:08:16.619000 662 file.py:165]`): no year

A timestamp without a zone is taken as UTC. A timestamp without a year gets the year that puts it
at or before `reference_ts` (the file's modification time when analysing a file), since a log
cannot be written after it was last modified.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}

_RANK_PREFIX = re.compile(r"^\s*(?:\[rank\d+\]:)?\s*")
_ISO = re.compile(
    r"^\[?(?P<date>\d{4}-\d{2}-\d{2})[T ](?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,9}))?"
    r"\s?(?P<tz>Z|[+-]\d{2}:?\d{2})?\]?"
)
_SYSLOG = re.compile(r"^(?P<mon>[A-Z][a-z]{2})\s+(?P<day>\d{1,2})\s+(?P<time>\d{2}:\d{2}:\d{2})(?:\.(?P<frac>\d{1,9}))?\s")
_DMESG_T = re.compile(r"^\[\s*[A-Z][a-z]{2}\s+(?P<mon>[A-Z][a-z]{2})\s+(?P<day>\d{1,2})\s+(?P<time>\d{2}:\d{2}:\d{2})\s+(?P<year>\d{4})\s*\]")
_DMESG_MONO = re.compile(r"^\[\s*(?P<secs>\d+\.\d+)\s*\]")
# c10's glog-like prefix does not zero-pad the month: E626 is June 26, E1129 November 29.
_GLOG = re.compile(r"^\[?[IWEF](?P<mon>\d{1,2}?)(?P<day>\d{2})\s+(?P<time>\d{2}:\d{2}:\d{2})(?:\.(?P<frac>\d{1,9}))?\s")


@dataclass(frozen=True)
class LineTime:
    ts: float
    kind: str  # iso | syslog | dmesg_t | glog | since_boot


def _frac(s: str | None) -> float:
    return float("0." + s) if s else 0.0


def _tz(s: str | None) -> timezone:
    if not s or s == "Z":
        return UTC
    sign = -1 if s[0] == "-" else 1
    digits = s[1:].replace(":", "")
    return timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:4])))


def _without_year(month: int, day: int, hms: str, frac: str | None, reference_ts: float) -> float | None:
    ref = datetime.fromtimestamp(reference_ts, UTC)
    h, m, s = (int(x) for x in hms.split(":"))
    for year in (ref.year, ref.year - 1):
        try:
            dt = datetime(year, month, day, h, m, s, tzinfo=UTC)
        except ValueError:  # e.g. Feb 29 in a non-leap year, or a garbled date
            continue
        ts = dt.timestamp() + _frac(frac)
        # A day of slack: clocks and zones of the writer and of the file system differ.
        if ts <= reference_ts + 86400:
            return ts
    return None


def line_time(line: str, reference_ts: float) -> LineTime | None:
    """The wall-clock (or since-boot) time a log line carries at its start, if any."""
    head = _RANK_PREFIX.sub("", line[:96], count=1)
    if m := _ISO.match(head):
        try:
            dt = datetime.strptime(f"{m['date']} {m['time']}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=_tz(m["tz"]))
        except ValueError:
            return None
        return LineTime(dt.timestamp() + _frac(m["frac"]), "iso")
    if m := _DMESG_T.match(head):
        month = MONTHS.get(m["mon"].lower())
        if month is None:
            return None
        try:
            dt = datetime.strptime(f"{m['year']}-{month:02d}-{int(m['day']):02d} {m['time']}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            return None
        return LineTime(dt.replace(tzinfo=UTC).timestamp(), "dmesg_t")
    if m := _SYSLOG.match(head):
        month = MONTHS.get(m["mon"].lower())
        ts = _without_year(month, int(m["day"]), m["time"], m["frac"], reference_ts) if month else None
        return LineTime(ts, "syslog") if ts is not None else None
    if m := _GLOG.match(head):
        month = int(m["mon"])
        ts = _without_year(month, int(m["day"]), m["time"], m["frac"], reference_ts) if 1 <= month <= 12 else None
        return LineTime(ts, "glog") if ts is not None else None
    if m := _DMESG_MONO.match(head):
        return LineTime(float(m["secs"]), "since_boot")
    return None


def syslog_host(line: str) -> str | None:
    """The host name of a syslog/journalctl line (`Nov 29 23:07:34 HOST kernel: ...`)."""
    m = re.match(r"^(?:\S+T\S+|[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}(?:\.\d+)?)\s+(?P<host>[\w.\-]+)\s+kernel:", line)
    return m["host"] if m else None
