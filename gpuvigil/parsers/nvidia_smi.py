"""`nvidia-smi -q` text (whole or a pasted fragment) -> per-GPU health records and findings.

Pure text parsing, no I/O. `nvidia-smi -q` prints nested `Key : Value` lines indented by
section, one block per GPU headed `GPU 00000000:3B:00.0`; people paste fragments such as::

    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 4
        Pending                           : Yes

What counts (NVIDIA's A100/H100 memory-error management and NVML clock-event reasons):

- memory, each with its own kind: a row remapping failed (NVIDIA's RMA criterion) ->
  `row_remap_failure` (the GPU's uncorrectable errors, if any, its evidence); else uncorrectable
  (double-bit) ECC errors in the volatile counters -> `ecc`; a row remapping pending (needs a GPU
  reset) -> `row_remap_pending`; retired pages pending blacklist (a reboot retires them) ->
  `retired_pages`;
- heat: `HW Slowdown`, `HW Thermal Slowdown` or `SW Thermal Slowdown` active -> `thermal_throttle`.

Idle, application-clock, power-cap and sync-boost reasons are normal operation, not findings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gpuvigil.model import Finding, FindingKind, Severity

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


def _memory(g: SmiGpu) -> dict[str, Any]:
    """What the GPU's memory blocks say: remap pending/failed, pages pending, volatile DBEs."""
    out: dict[str, Any] = {}
    if any(value.lower() == "yes" for _, value in g.get("remapped rows/pending")):
        out["remap_pending"] = True
    if any(value.lower() == "yes" for _, value in g.get("remapping failure occurred", "remapped rows/remapping failure")):
        out["remap_failure"] = True
    if any(value.lower() == "yes" for _, value in g.get("retired pages/pending page blacklist", "retired pages/pending")):
        out["retired_pages_pending"] = True
    dbe = 0
    for path, value in g.values.items():
        low = path.lower()
        if "ecc errors/volatile" in low and ("double bit" in low or "uncorrectable" in low) and low.endswith("total") or (
            "ecc errors/volatile" in low and low.endswith(("dram uncorrectable", "uncorrectable/device memory", "double bit/device memory"))
        ):
            dbe = max(dbe, _int(value) or 0)
    if dbe > 0:
        out["ecc_dbe_volatile_total"] = dbe
    return out


def _memory_findings(g: SmiGpu, mem: dict[str, Any], *, where: str, **common: Any) -> list[Finding]:
    dbe = mem.get("ecc_dbe_volatile_total", 0)
    errors = f"{dbe} uncorrectable ECC error(s) since the driver loaded"
    out = []
    if mem.get("remap_failure"):
        out.append(Finding(kind=FindingKind.ROW_REMAP_FAILURE, severity=Severity.PAGE, **common,
                           evidence={"pci_bus_id": g.pci_bus_id, "remap_failure": True, **({"ecc_dbe_volatile_total": dbe} if dbe else {})},
                           summary=f"nvidia-smi -q on {where}: a row remapping failed (NVIDIA's RMA criterion)" + (f"; {errors}" if dbe else "")
                           + ": drain the node and replace the GPU"))
    elif dbe:
        out.append(Finding(kind=FindingKind.ECC, severity=Severity.PAGE, **common, evidence={"pci_bus_id": g.pci_bus_id, "ecc_dbe_volatile_total": dbe},
                           summary=f"nvidia-smi -q on {where}: {errors}: drain the node and reset the GPU"))
    if mem.get("remap_pending"):
        out.append(Finding(kind=FindingKind.ROW_REMAP_PENDING, severity=Severity.TICKET, **common, evidence={"pci_bus_id": g.pci_bus_id, "remap_pending": True},
                           summary=f"nvidia-smi -q on {where}: a row remapping is pending: reset the GPU to apply it"))
    if mem.get("retired_pages_pending"):
        out.append(Finding(kind=FindingKind.RETIRED_PAGES, severity=Severity.TICKET, **common, evidence={"pci_bus_id": g.pci_bus_id, "retired_pages_pending": True},
                           summary=f"nvidia-smi -q on {where}: retired pages are pending blacklist: reboot to retire them"))
    return out


def findings(gpus: list[SmiGpu], *, source_file: str | None = None, ts: float, node: str | None = None) -> list[Finding]:
    out: list[Finding] = []
    for idx, g in enumerate(gpus):
        where = f"GPU {g.pci_bus_id}" if g.pci_bus_id else "the GPU"
        src = f"{source_file}:{g.first_line}" if source_file else "nvidia-smi"
        out.extend(_memory_findings(g, _memory(g), where=where, ts=ts, node=node, gpu=None, source=src, cause="hardware"))
        hot = sorted(
            {
                path.rsplit("/", 1)[-1]
                for path, value in g.values.items()
                if ("throttle reasons" in path.lower() or "event reasons" in path.lower())
                and path.rsplit("/", 1)[-1].strip().lower() in _THERMAL_REASONS
                and value.lower() == "active"
            }
        )
        if hot:
            out.append(
                Finding(
                    kind=FindingKind.THERMAL_THROTTLE,
                    severity=Severity.TICKET,
                    ts=ts,
                    node=node,
                    gpu=None,
                    evidence={"pci_bus_id": g.pci_bus_id, "active_reasons": hot, "gpu_block": idx},
                    summary=f"nvidia-smi -q on {where}: clocks slowed for heat or power ({', '.join(hot)} active)",
                    source=src,
                    cause="hardware",
                )
            )
    return out


# dcgm-exporter's XID counters (DCGM_EXP_XID_ERRORS_COUNT and similar) label the code: xid="42".
_XID_SERIES = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*XID[A-Za-z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>[-+0-9.eE]+)", re.MULTILINE)
_LABEL = re.compile(r'(?P<k>[A-Za-z_][A-Za-z0-9_]*)="(?P<v>(?:[^"\\]|\\.)*)"')


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


__all__ = ["SmiGpu", "looks_like_nvidia_smi_q", "parse", "findings", "xid_counter_samples"]
