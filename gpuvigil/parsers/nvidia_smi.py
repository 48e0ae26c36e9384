"""`nvidia-smi -q` text (whole or a pasted fragment) -> per-GPU health records.

Pure text parsing, no I/O. `nvidia-smi -q` prints nested `Key : Value` lines indented by
section, one block per GPU headed `GPU 00000000:3B:00.0`; people paste fragments such as::

    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 4
        Pending                           : Yes

What counts (NVIDIA's A100/H100 memory-error management and NVML clock-event reasons):

- memory: a row remapping pending (needs a GPU reset) or failed (RMA), retired pages pending
  blacklist, or uncorrectable (double-bit) ECC errors in the volatile counters -> `ecc`;
- heat: `HW Slowdown`, `HW Thermal Slowdown` or `SW Thermal Slowdown` active -> `thermal_throttle`.

Idle, application-clock, power-cap and sync-boost reasons are normal operation, not findings.
`health_rows` makes them `smi_health` rows; the registered detector `smi_health`
(`gpuvigil.detectors.saved_readings`) judges them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_GPU_HEADER = re.compile(r"^GPU (?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_KV = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z][^:]*?)\s*:\s*(?P<value>.*?)\s*$")
_SECTION = re.compile(r"^(?P<indent>\s*)(?P<name>[A-Za-z][A-Za-z0-9 /()\-]*?)\s*$")
_KV_ANY = re.compile(r"^\s+[A-Za-z][^:\n]*?\s:\s\S", re.MULTILINE)
_SNIFF = re.compile(
    r"^\s*(?:=+NVSMI LOG=+|Remapped Rows|Clocks (?:Throttle|Event) Reasons|ECC Errors|Retired Pages)\s*$", re.MULTILINE
)
_THERMAL_REASONS = ("hw slowdown", "hw thermal slowdown", "sw thermal slowdown")


@dataclass
class SmiGpu:
    pci_bus_id: str | None
    first_line: int
    values: dict[str, str] = field(default_factory=dict)  # "Section/Sub/Key" -> value

    def get(self, *suffixes: str) -> list[tuple[str, str]]:
        """(path, value) for every key whose lower-cased path ends with one of `suffixes`."""
        out = []
        for path, value in self.values.items():
            low = path.lower()
            if any(low.endswith(s) for s in suffixes):
                out.append((path, value))
        return out


def looks_like_nvidia_smi_q(sample: str) -> bool:
    return _SNIFF.search(sample) is not None and _KV_ANY.search(sample) is not None


def parse(text: str) -> list[SmiGpu]:
    """One record per GPU block (a fragment without a `GPU ...` header is one GPU of unknown bus)."""
    gpus: list[SmiGpu] = []
    current: SmiGpu | None = None
    stack: list[tuple[int, str]] = []  # (indent, section name)
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line.strip():
            continue
        if m := _GPU_HEADER.match(line.strip()):
            current = SmiGpu(m["pci"].lower(), no)
            gpus.append(current)
            stack = []
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        kv = _KV.match(line)
        if kv and kv["value"] != "":
            if current is None:
                current = SmiGpu(None, no)
                gpus.append(current)
            path = "/".join([s for _, s in stack] + [kv["key"].strip()])
            current.values[path] = kv["value"]
        elif sec := _SECTION.match(line):
            stack.append((indent, sec["name"].strip()))
    return gpus


def _int(value: str) -> int | None:
    try:
        return int(value.strip())
    except ValueError:
        return None


@dataclass(frozen=True)
class SmiHealth:
    """What one GPU block of `nvidia-smi -q` says of the device's memory and clocks."""

    index: int  # the block's place in the output
    pci_bus_id: str | None
    first_line: int
    remap_pending: bool
    remap_failure: bool
    retired_pages_pending: bool
    ecc_dbe_volatile_total: int  # uncorrectable errors in the volatile counters (the largest one)
    thermal_reasons_active: list[str]  # the HW/SW thermal or HW slowdown reasons shown Active


def _yes(g: SmiGpu, *suffixes: str) -> bool:
    return any(value.lower() == "yes" for _path, value in g.get(*suffixes))


def _volatile_dbe(g: SmiGpu) -> int:
    dbe = 0
    for path, value in g.values.items():
        low = path.lower()
        if "ecc errors/volatile" in low and ("double bit" in low or "uncorrectable" in low) and low.endswith("total") or (
            "ecc errors/volatile" in low and low.endswith(("dram uncorrectable", "uncorrectable/device memory", "double bit/device memory"))
        ):
            dbe = max(dbe, _int(value) or 0)
    return dbe


def _thermal_reasons(g: SmiGpu) -> list[str]:
    return sorted(
        {
            path.rsplit("/", 1)[-1]
            for path, value in g.values.items()
            if ("throttle reasons" in path.lower() or "event reasons" in path.lower())
            and path.rsplit("/", 1)[-1].strip().lower() in _THERMAL_REASONS
            and value.lower() == "active"
        }
    )


def health(gpus: list[SmiGpu]) -> list[SmiHealth]:
    """Each GPU block's memory and clock state."""
    return [
        SmiHealth(
            index=idx,
            pci_bus_id=g.pci_bus_id,
            first_line=g.first_line,
            remap_pending=_yes(g, "remapped rows/pending"),
            remap_failure=_yes(g, "remapping failure occurred", "remapped rows/remapping failure"),
            retired_pages_pending=_yes(g, "retired pages/pending page blacklist", "retired pages/pending"),
            ecc_dbe_volatile_total=_volatile_dbe(g),
            thermal_reasons_active=_thermal_reasons(g),
        )
        for idx, g in enumerate(gpus)
    ]


# dcgm-exporter's XID counters (DCGM_EXP_XID_ERRORS_COUNT and similar) label the code: xid="42".
_XID_SERIES = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*XID[A-Za-z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>[-+0-9.eE]+)", re.MULTILINE)
_LABEL = re.compile(r'(?P<k>[A-Za-z_][A-Za-z0-9_]*)="(?P<v>(?:[^"\\]|\\.)*)"')


def health_rows(states: list[SmiHealth], *, ts: float, node: str | None = None, source: str | None = None) -> list[dict[str, Any]]:
    """`smi_health` rows (gpuvigil/schemas.py), one per GPU block."""
    return [
        {
            "ts": ts,
            "node": node,
            "gpu": None,
            "source": source,
            "line": h.first_line,
            "gpu_block": h.index,
            "pci_bus_id": h.pci_bus_id,
            "ecc_dbe_volatile_total": min(h.ecc_dbe_volatile_total, (1 << 63) - 1),  # a forged count still fits the column
            "remap_failure": h.remap_failure,
            "remap_pending": h.remap_pending,
            "retired_pages_pending": h.retired_pages_pending,
            "thermal_reasons": list(h.thermal_reasons_active),
        }
        for h in states
    ]


def xid_counter_samples(text: str) -> list[dict[str, Any]]:
    """Series of an XID counter that name the code in a label (`xid`/`err_code`) and are > 0."""
    out = []
    for m in _XID_SERIES.finditer(text):
        labels = {lm["k"]: lm["v"] for lm in _LABEL.finditer(m["labels"])}
        code = labels.get("xid") or labels.get("err_code")
        try:
            value = float(m["value"])
        except ValueError:
            continue
        if code is None or not code.isdigit() or value <= 0:
            continue
        out.append({"metric": m["name"], "xid": int(code), "value": value, "labels": labels})
    return out


__all__ = ["SmiGpu", "SmiHealth", "health", "health_rows", "looks_like_nvidia_smi_q", "parse", "xid_counter_samples"]
