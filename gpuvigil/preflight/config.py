"""The preflight's checks and thresholds (config section `preflight`, defaults in
gpuvigil/config/preflight.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CHECK_NAMES = ("nvml", "infiniband", "dcgm", "torch_load", "nccl")
CheckName = Literal["nvml", "infiniband", "dcgm", "torch_load", "nccl"]
# What a condition does to the verdict when it is found.
Outcome = Literal["fail", "warn", "ignore"]

# nvml.h clock-event (throttle) reason bits, by their names without the nvmlClocksEventReason prefix.
CLOCK_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NvmlCheckConfig(_Strict):
    expect_gpus: int | None = Field(None, ge=1)
    ecc_enabled: bool = True
    max_volatile_uncorrected: int | None = Field(0, ge=0)
    max_volatile_corrected: int | None = Field(1000, ge=0)
    pending_remap: Outcome = "fail"
    remap_failure: Outcome = "fail"
    fail_clock_reasons: list[str] = Field(default_factory=lambda: ["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"])
    warn_clock_reasons: list[str] = Field(default_factory=lambda: ["sw_thermal_slowdown"])
    pcie_width_degraded: Outcome = "warn"
    persistence_off: Outcome = "warn"
    processes_present: Outcome = "fail"

    @field_validator("fail_clock_reasons", "warn_clock_reasons")
    @classmethod
    def _known_reasons(cls, v: list[str]) -> list[str]:
        unknown = [r for r in v if r not in CLOCK_REASONS]
        if unknown:
            raise ValueError(f"unknown clock reason(s) {unknown}; known: {sorted(CLOCK_REASONS)}")
        return v


class DcgmCheckConfig(_Strict):
    command: str = "dcgmi"
    level: Literal[1, 2] = 1
    timeout_seconds: float = Field(300.0, gt=0)


class TorchLoadCheckConfig(_Strict):
    seconds: float = Field(3.0, gt=0, le=600)
    memory_share: float = Field(0.5, gt=0, le=0.95)
    matrix_size: int = Field(4096, ge=64, le=32768)
    min_tflops: float | None = Field(None, gt=0)
    no_cuda: Outcome = "fail"


class NcclCheckConfig(_Strict):
    backend: Literal["nccl", "gloo"] = "nccl"
    size_mib: float = Field(64.0, gt=0, le=8192)
    iterations: int = Field(20, ge=1, le=10000)
    timeout_seconds: float = Field(120.0, gt=0)
    min_bus_gbps: float | None = Field(None, gt=0)


class InfinibandCheckConfig(_Strict):
    expect_ports: int | None = Field(None, ge=0)
    min_rate_gbps: float | None = Field(None, gt=0)
    ignore_devices: list[str] = Field(default_factory=list)


class PreflightConfig(_Strict):
    checks: list[CheckName] = Field(default_factory=lambda: list(CHECK_NAMES))
    require: list[CheckName] = Field(default_factory=lambda: ["nvml"])
    nvml: NvmlCheckConfig = Field(default_factory=NvmlCheckConfig)
    dcgm: DcgmCheckConfig = Field(default_factory=DcgmCheckConfig)
    torch_load: TorchLoadCheckConfig = Field(default_factory=TorchLoadCheckConfig)
    nccl: NcclCheckConfig = Field(default_factory=NcclCheckConfig)
    infiniband: InfinibandCheckConfig = Field(default_factory=InfinibandCheckConfig)

    @field_validator("require")
    @classmethod
    def _nvml_required(cls, v: list[str]) -> list[str]:
        # Without NVML nothing says a GPU is there: a preflight that could pass without it would
        # pass a node with no GPU.
        if "nvml" not in v:
            raise ValueError("nvml must stay required: without it a node with no GPU would pass")
        return v

    @model_validator(mode="after")
    def _required_are_run(self) -> PreflightConfig:
        missing = [c for c in self.require if c not in self.checks]
        if missing:
            raise ValueError(f"required check(s) {missing} are not in checks {self.checks}")
        return self
