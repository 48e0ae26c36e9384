"""NVML clock-event (throttle) reasons: the one table of their bits.

NVML reports why the SM clock is below its maximum as a bitmask
(`nvmlDeviceGetCurrentClocksEventReasons`, formerly `...ClocksThrottleReasons`; the same bits
are dcgm-exporter's `DCGM_FI_DEV_CLOCKS_EVENT_REASONS` / `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`).
The bits are nvml.h's `nvmlClocksEventReason*` constants. The collectors pass the mask through;
the simulator, the thermal detector, `analyze` and the exporter name bits through this table.

`slows`: the reason means lost speed (idle, application clocks, sync boost and display clocks
are normal operation). `thermal`: the reason is heat.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClockEventReason:
    name: str  # the `reason` label of gpuvigil_gpu_clock_throttled
    short: str  # in finding evidence
    bit: int
    nvml: str  # nvml.h: nvmlClocksEventReason<nvml>
    slows: bool
    thermal: bool
    meaning: str


REASONS: tuple[ClockEventReason, ...] = (
    ClockEventReason("gpu_idle", "idle", 0x1, "GpuIdle", False, False, "nothing runs on the GPU"),
    ClockEventReason("applications_clocks_setting", "app_clocks", 0x2, "ApplicationsClocksSetting", False, False, "clocks limited by the applications clocks setting"),
    ClockEventReason("sw_power_cap", "power_cap", 0x4, "SwPowerCap", True, False, "the power draw reached the power limit"),
    ClockEventReason("hw_slowdown", "hw_slowdown", 0x8, "HwSlowdown", True, True, "hardware slowdown (temperature, power brake or power supply)"),
    ClockEventReason("sync_boost", "sync_boost", 0x10, "SyncBoost", False, False, "clocks synchronised with other GPUs of a sync-boost group"),
    ClockEventReason("sw_thermal_slowdown", "sw_thermal", 0x20, "SwThermalSlowdown", True, True, "the driver lowers clocks to cool the GPU or its memory"),
    ClockEventReason("hw_thermal_slowdown", "hw_thermal", 0x40, "HwThermalSlowdown", True, True, "the hardware halves clocks: the GPU is too hot"),
    ClockEventReason("hw_power_brake_slowdown", "power_brake", 0x80, "HwPowerBrakeSlowdown", True, False, "an external power brake (the node's power supply) lowered clocks"),
    ClockEventReason("display_clock_setting", "display_clocks", 0x100, "DisplayClockSetting", False, False, "clocks limited by the display clock setting"),
)

BY_NAME: dict[str, ClockEventReason] = {r.name: r for r in REASONS}


def bit(name: str) -> int:
    return BY_NAME[name].bit


def mask(*names: str) -> int:
    out = 0
    for n in names:
        out |= BY_NAME[n].bit
    return out


# The reasons that cost speed; the heat-related ones among them.
SLOWDOWN_MASK = sum(r.bit for r in REASONS if r.slows)
THERMAL_MASK = sum(r.bit for r in REASONS if r.thermal)


def active(reasons: int, within: int = -1, *, short: bool = False) -> list[str]:
    """Names of the reasons set in `reasons` (and in `within`), in bit order."""
    return [(r.short if short else r.name) for r in REASONS if reasons & within & r.bit]


__all__ = ["BY_NAME", "REASONS", "SLOWDOWN_MASK", "THERMAL_MASK", "ClockEventReason", "active", "bit", "mask"]
