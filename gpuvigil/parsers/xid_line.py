"""NVIDIA driver XID lines (`NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, ...`) -> typed
records. Pure text parsing, no I/O: the kernel-log collector and `analyze` build on it; timestamps
are `gpuvigil.parsers.logtime`'s business, XID meanings the table's (`gpuvigil.gpu.xid`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\):\s*(?P<code>\d{1,4})\b,?\s*(?P<rest>.*)$"
)
# "Ch 00000001 caused by previous Xid 149": a consequence of another XID, maybe not in the log.
_CAUSED_BY = re.compile(r"caused by previous Xid\s*(?P<code>\d{1,4})", re.IGNORECASE)
# Drivers that report a lost GPU without (or besides) an Xid 79 line:
#   NVRM: GPU 0000:06:00.0: GPU has fallen off the bus.
#   NVRM: The NVIDIA GPU 0000:b3:00.0 / NVRM: (PCI ID: 10de:26b5) installed in this system has /
#   NVRM: fallen off the bus and is not responding to commands.
_PCI = r"(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
_FELL_OFF_ONE_LINE = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?" + _PCI + r":?\s+GPU has fallen off the bus")
_THE_NVIDIA_GPU = re.compile(r"NVRM: The NVIDIA GPU (?:at )?(?:PCI:)?" + _PCI)
FALLEN_OFF_BUS_XID = 79
_PID = re.compile(r"\bpid=(?:'?(?P<pid>\d+)'?|'?<unknown>'?)\s*,?\s*")
_NAME = re.compile(r"\bname=(?P<name>[^,]*),?\s*")


@dataclass(frozen=True)
class XidLine:
    pci_bus_id: str  # normalised: domain:bus:device
    code: int
    message: str  # the driver's text after the code, without pid= / name=
    pid: int | None
    process: str | None
    # The XID this line says it was caused by ("caused by previous Xid N"), else None.
    caused_by: int | None = None
    # True for a driver message that reports an XID's condition without an Xid line.
    synthetic: bool = False

    @property
    def root(self) -> int:
        """The XID the line is attributed to: its cause when it names one, else its own code."""
        return self.caused_by if self.caused_by is not None else self.code


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


def parse_xid_line(line: str) -> XidLine | None:
    """The XID in one kernel-log line, or None."""
    m = XID_LINE.search(line)
    if not m:
        return None
    rest = m["rest"]
    pid_m = _PID.search(rest)
    name_m = _NAME.search(rest)
    message = _NAME.sub("", _PID.sub("", rest, count=1), count=1).strip().rstrip(",").strip()
    cause = _CAUSED_BY.search(rest)
    caused_by = int(cause["code"]) if cause else None
    return XidLine(
        pci_bus_id=normalise_pci(m["pci"]),
        code=int(m["code"]),
        message=message,
        pid=int(pid_m["pid"]) if pid_m and pid_m["pid"] else None,
        process=_process_name(name_m["name"]) if name_m else None,
        caused_by=caused_by if caused_by != int(m["code"]) else None,
    )


def iter_xid_records(lines: Iterable[str], lookahead: int = 3) -> Iterator[tuple[int, str, XidLine]]:
    """(offset, line, record) for every XID a kernel log reports, in order.

    Besides `NVRM: Xid` lines, a driver message saying a GPU "has fallen off the bus" is an
    Xid 79 even without an Xid line (the multi-line form names the GPU up to `lookahead` lines
    before the words). When the same GPU also has a real Xid 79 line, the two land in one
    incident downstream (same GPU, same code).
    """
    pending: tuple[int, str, str] | None = None  # (offset, line, pci) of "The NVIDIA GPU <pci>"
    last_79: dict[str, int] = {}  # pci -> offset of its last real Xid 79 line
    for offset, raw in enumerate(lines):
        line = raw.rstrip("\r\n")
        if "Xid" in line and (x := parse_xid_line(line)) is not None:
            if x.code == FALLEN_OFF_BUS_XID:
                last_79[x.pci_bus_id] = offset
            yield offset, line, x
            continue
        if "NVRM" not in line and "fallen off" not in line:
            continue
        if m := _FELL_OFF_ONE_LINE.search(line):
            pci = normalise_pci(m["pci"])
            if offset - last_79.get(pci, -(10**9)) <= lookahead + 2:
                continue  # the driver's own echo of the Xid 79 line just before
            yield offset, line, XidLine(pci, FALLEN_OFF_BUS_XID, "GPU has fallen off the bus (driver message without an Xid line)", None, None, synthetic=True)
            pending = None
            continue
        if m := _THE_NVIDIA_GPU.search(line):
            pending = (offset, line, normalise_pci(m["pci"]))
        if pending is not None and "fallen off the bus" in line:
            first_offset, first_line, pci = pending
            yield first_offset, first_line, XidLine(pci, FALLEN_OFF_BUS_XID, "GPU has fallen off the bus and is not responding to commands (driver message without an Xid line)", None, None, synthetic=True)
            pending = None
        elif pending is not None and offset - pending[0] >= lookahead:
            pending = None


def looks_like_kernel_log(sample: str) -> bool:
    """Whether a text sample holds an XID, in any wording (an Xid line or a lost-GPU message)."""
    return any(True for _ in iter_xid_records(sample.splitlines()))
