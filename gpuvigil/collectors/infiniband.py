"""InfiniBand / RoCE ports from sysfs: state, rate, width and error counters, one row per port.

The kernel publishes every RDMA port under `/sys/class/infiniband/<device>/ports/<port>/`
(Documentation/ABI/stable/sysfs-class-infiniband): `state` ("4: ACTIVE"), `phys_state`
("5: LinkUp"), `rate` ("400 Gb/sec (4X NDR)": speed times active width), `link_layer`
("InfiniBand" or "Ethernet" for RoCE), the PortCounters of the InfiniBand specification in
`counters/` (`link_downed`, `symbol_error`, `port_rcv_errors`, ...) and the driver's own in
`hw_counters/` (mlx5: `out_of_buffer`, `local_ack_timeout_err`, ...). The collector reads them
under a root (`--sysfs-root`, default `/sys`), so a copy of a machine's tree reads as the machine.

Files are untrusted text (a copy, a driver that prints something new): a value that does not
parse is null and counted in `errors`; a file over 4 KiB is not read; nothing raises.

Ports are attributed to GPUs by the PCIe topology where sysfs shows it: an HCA under the same
PCIe switch as a GPU (they share a bridge below the root port, nvidia-smi topo's PIX/PXB) is
that GPU's, else the GPUs on its NUMA node, else the node as a whole (`affinity` says which).
GPUs are named by their PCI address, as NVML gives it (`pci_to_gpu`).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas

PORT_COUNTERS, HW_COUNTERS, COUNTERS, column = schemas.IB_PORT_COUNTERS, schemas.IB_HW_COUNTERS, schemas.IB_COUNTERS, schemas.ib_column
IB_PORTS = schemas.IB_PORTS

STREAMS: Mapping[str, pl.Schema] = {"ib_ports": IB_PORTS}

MAX_FILE_BYTES = 4096
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec(?:\s*\(\s*([0-9]+)X\s*([A-Za-z0-9]*)\s*\))?\s*$")
# The kernel's names are words joined by single spaces ("7: Phy Test", drivers/infiniband/core/sysfs.c).
_STATE = re.compile(r"^\s*(?:[0-9]+\s*:\s*)?([A-Za-z][A-Za-z_]*(?: [A-Za-z][A-Za-z_]*)*)\s*$")
_BDF = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MAX_I64 = (1 << 63) - 1


def normalize_bdf(bus_id: str | None) -> str | None:
    """'00000000:18:00.0' (NVML) or '0000:18:00.0' (sysfs) -> '0000:18:00.0'; None if not one."""
    if not bus_id:
        return None
    m = _BDF.match(bus_id.strip())
    if not m:
        return None
    domain = int(m.group(1) or "0", 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def parse_state(text: str | None) -> str | None:
    """'4: ACTIVE' -> 'ACTIVE', '7: Phy Test' -> 'Phy Test' (and the name alone); None for anything else."""
    if text is None:
        return None
    m = _STATE.match(text)
    return m.group(1) if m else None


def parse_rate(text: str | None) -> tuple[float | None, int | None, str | None]:
    """'400 Gb/sec (4X NDR)' -> (400.0, 4, 'NDR'); RoCE ports may print no width ('25 Gb/sec')."""
    if text is None:
        return None, None, None
    m = _RATE.match(text)
    if not m:
        return None, None, None
    rate = float(m.group(1))
    width = int(m.group(2)) if m.group(2) and len(m.group(2)) <= 3 else None
    return rate, width, (m.group(3) or None) if m.group(2) else None


def parse_counter(text: str | None) -> int | None:
    """A counter file's decimal value; None for anything else (negative, not a number, > int64)."""
    if text is None:
        return None
    s = text.strip()
    if not s.isascii() or not s.isdigit() or len(s) > 19:
        return None
    value = int(s)
    return value if value <= _MAX_I64 else None


def _read(path: Path) -> str | None:
    """A small sysfs text file, or None (absent, unreadable, too large, not text)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_FILE_BYTES:
        return None
    return data.decode("utf-8", errors="replace")


def _pci_chain(path: str) -> list[str]:
    """The PCI functions from the root port down to the device, from a resolved sysfs path
    (/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0 -> the last three)."""
    parts = Path(path).parts
    return [p for p in parts if normalize_bdf(p) is not None and not p.startswith("pci")]


def _int_file(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


class InfinibandCollector:
    """Reads every port of every RDMA device under `<sysfs_root>/class/infiniband` on each collect."""

    name = "infiniband"
    streams = STREAMS

    def __init__(self, sysfs_root: str | Path = "/sys", *, node: str | None = None,
                 pci_to_gpu: Callable[[], Mapping[str, int]] | Mapping[str, int] | None = None):
        self.root = Path(sysfs_root)
        self.node = node or socket.gethostname()
        self.errors = 0
        self._pci_to_gpu = pci_to_gpu
        self._last_error: str | None = None
        self._gpu_places: dict[int, tuple[list[str], int | None]] | None = None

    @property
    def base(self) -> Path:
        return self.root / "class" / "infiniband"

    def describe(self) -> str:
        return f"InfiniBand/RoCE ports under {self.base}"

    def health(self) -> dict[str, str | None]:
        return {str(self.base): self._last_error}

    # -- GPU affinity ------------------------------------------------------------------------

    def _gpus(self) -> dict[int, tuple[list[str], int | None]]:
        """GPU index -> (its PCI chain, its NUMA node), from the PCI addresses NVML gave."""
        if self._gpu_places is not None:
            return self._gpu_places
        source = self._pci_to_gpu() if callable(self._pci_to_gpu) else (self._pci_to_gpu or {})
        places: dict[int, tuple[list[str], int | None]] = {}
        for bus, gpu in source.items():
            bdf = normalize_bdf(bus)
            if bdf is None:
                continue
            dev = self.root / "bus" / "pci" / "devices" / bdf
            if not dev.exists():
                continue
            places[int(gpu)] = (_pci_chain(os.path.realpath(dev)), _int_file(dev / "numa_node"))
        if source:  # NVML may list no GPU yet: ask again next time
            self._gpu_places = places
        return places

    def _affinity(self, chain: list[str], numa: int | None) -> tuple[list[int], str]:
        gpus = self._gpus()
        # Sharing the root port and a switch below it: the same PCIe switch (PIX/PXB).
        near = sorted(g for g, (c, _) in gpus.items() if len(os.path.commonprefix([c, chain])) >= 2)
        if near:
            return near, "pcie"
        if numa is not None and numa >= 0:
            same = sorted(g for g, (_, n) in gpus.items() if n == numa)
            if same:
                return same, "numa"
        return [], "node"

    # -- reading ------------------------------------------------------------------------------

    def _port_row(self, now: float, device: str, dev_dir: Path, port_dir: Path, place: tuple[str | None, int | None, list[int], str]) -> dict[str, Any]:
        try:
            port = int(port_dir.name)
        except ValueError:
            port = None
        state = parse_state(_read(port_dir / "state"))
        phys = parse_state(_read(port_dir / "phys_state"))
        rate, width, speed = parse_rate(_read(port_dir / "rate"))
        layer_text = _read(port_dir / "link_layer")
        layer = layer_text.strip() if layer_text is not None and layer_text.strip().isalpha() else None
        row: dict[str, Any] = {
            "ts": now, "node": self.node, "device": device, "port": port, "link_layer": layer, "state": state, "phys_state": phys,
            "rate_gbps": rate, "width": width, "speed": speed,
            "pci_bus_id": place[0], "numa_node": place[1], "gpus": place[2], "affinity": place[3],
        }
        bad = sum(1 for name, v in (("state", state), ("phys_state", phys)) if v is None and (port_dir / name).exists())
        for counter in COUNTERS:
            value = None
            for sub in ("counters", "hw_counters"):
                path = port_dir / sub / counter
                text = _read(path)
                if text is not None:
                    value = parse_counter(text)
                    bad += value is None
                    break
            row[column(counter)] = value
        self.errors += bad
        return row

    def _device_place(self, dev_dir: Path) -> tuple[str | None, int | None, list[int], str]:
        link = dev_dir / "device"
        resolved = os.path.realpath(link) if link.exists() else None
        chain = _pci_chain(resolved) if resolved else []
        numa = _int_file(link / "numa_node") if resolved else None
        gpus, affinity = self._affinity(chain, numa)
        return (normalize_bdf(chain[-1]) if chain else None), numa, gpus, affinity

    def read(self, now: float) -> pl.DataFrame:
        rows: list[dict[str, Any]] = []
        try:
            devices = sorted(self.base.iterdir()) if self.base.is_dir() else []
        except OSError as exc:
            self._last_error = f"cannot list {self.base}: {exc.strerror or exc}"
            self.errors += 1
            return pl.DataFrame(schema=IB_PORTS)
        # No class/infiniband at all is a node without RDMA (or its driver unloaded), not a failing
        # read: the heartbeat row below says "no port", which ib_port_missing judges.
        self._last_error = None
        for dev_dir in devices:
            try:
                ports = sorted((dev_dir / "ports").iterdir(), key=lambda p: (len(p.name), p.name))
            except OSError:
                continue  # not a device directory (or it vanished mid-read)
            place = self._device_place(dev_dir)
            for port_dir in ports:
                if port_dir.is_dir():
                    rows.append(self._port_row(now, dev_dir.name, dev_dir, port_dir, place))
        if not rows:
            # The tree was read and holds no port (or no class/infiniband at all: the RDMA core
            # is not loaded): one row without a device says so, so that a node whose HCAs all
            # fell off the bus is not mistaken for one that was not read.
            rows.append({"ts": now, "node": self.node, "gpus": [], "affinity": "node"})
        return pl.DataFrame([{k: r.get(k) for k in IB_PORTS} for r in rows], schema=IB_PORTS, orient="row") if rows else pl.DataFrame(schema=IB_PORTS)

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        df = self.read(now)
        return {"ib_ports": df} if df.height else {}


__all__ = ["COUNTERS", "HW_COUNTERS", "IB_PORTS", "PORT_COUNTERS", "InfinibandCollector", "STREAMS", "column", "normalize_bdf", "parse_counter", "parse_rate", "parse_state"]
