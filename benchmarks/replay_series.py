"""Recorded dcgm-exporter history for replay tests and the replay benchmark: OpenMetrics text of
GPUs sampled every `step` seconds, with faults at known times (so a test knows what must fire and
when). The values are generated (simulated), not captured: say so wherever they are used."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass
class Fault:
    node: str
    gpu: int
    kind: str  # "xid79" | "thermal" | "dbe"
    start: float
    end: float | None = None


@dataclass
class Fleet:
    nodes: int
    gpus_per_node: int = 8
    start: float = 0.0
    seconds: float = 3600.0
    step: float = 30.0
    faults: list[Fault] = field(default_factory=list)

    def node_name(self, i: int) -> str:
        return f"gpu-node-{i:03d}"


FIELDS = [
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event reasons (bitmask)."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "gauge", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
]


def _value(fleet: Fleet, field_name: str, node: str, gpu: int, t: float) -> float:
    active = {f.kind for f in fleet.faults if f.node == node and f.gpu == gpu and f.start <= t and (f.end is None or t < f.end)}
    phase = ((t - fleet.start) / 600.0 + gpu) % 1.0
    if field_name == "DCGM_FI_DEV_FB_USED":
        return round(60_000 + 8_000 * phase)
    if field_name == "DCGM_FI_DEV_FB_FREE":
        return round(81_559 - 60_000 - 8_000 * phase)
    if field_name == "DCGM_FI_DEV_GPU_UTIL":
        return 97.0
    if field_name == "DCGM_FI_DEV_POWER_USAGE":
        return 640.0
    if field_name == "DCGM_FI_DEV_GPU_TEMP":
        return 89.0 if "thermal" in active else 62.0
    if field_name == "DCGM_FI_DEV_SM_CLOCK":
        return 1200.0 if "thermal" in active else 1980.0
    if field_name == "DCGM_FI_DEV_CLOCKS_EVENT_REASONS":
        return float(0x40 | 0x08) if "thermal" in active else 0.0
    if field_name == "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL":
        return 2.0 if "dbe" in active else 0.0
    if field_name == "DCGM_FI_DEV_XID_ERRORS":
        return 79.0 if "xid79" in active else 0.0
    raise KeyError(field_name)


def openmetrics_lines(fleet: Fleet) -> Iterator[str]:
    """OpenMetrics text (what `promtool tsdb create-blocks-from openmetrics` reads), family by family."""
    n = int(fleet.seconds // fleet.step) + 1
    for name, typ, help_text in FIELDS:
        yield f"# HELP {name} {help_text}"
        yield f"# TYPE {name} {typ}"
        for ni in range(fleet.nodes):
            node = fleet.node_name(ni)
            for g in range(fleet.gpus_per_node):
                labels = f'gpu="{g}",UUID="GPU-{ni:04d}{g:04d}-0000-0000-0000-000000000000",device="nvidia{g}",modelName="NVIDIA H200",Hostname="{node}"'
                for k in range(n):
                    t = fleet.start + k * fleet.step
                    yield f"{name}{{{labels}}} {_value(fleet, name, node, g, t):g} {t:.3f}"
    yield "# EOF"


def write_openmetrics(fleet: Fleet, path) -> None:
    with open(path, "w") as fh:
        for line in openmetrics_lines(fleet):
            fh.write(line + "\n")
