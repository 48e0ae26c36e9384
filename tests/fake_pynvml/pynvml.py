"""A stand-in for the `pynvml` module (nvidia-ml-py) for the preflight tests: this machine has no
GPU or driver. Same function names, constants and error type (an `NVMLError` with the NVML return
code in `.value`). The GPUs it shows are `STATE["gpus"]`, or the JSON file named by
$GPUVIGIL_FAKE_NVML, read at `nvmlInit` (so a `gpuvigil preflight` subprocess with this directory
first on PYTHONPATH sees them). A GPU's reading given as {"error": code} raises that error."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1

_MESSAGES = {1: "Uninitialized", 3: "Not Supported", 12: "NVML Shared Library Not Found", 15: "GPU is lost"}


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(_MESSAGES.get(value, f"NVML error {value}"))
        self.value = value


# An H100 SXM at idle, healthy: the baseline each test changes one reading of.
HEALTHY = {
    "ecc_mode": [1, 1],
    "ecc": {"0": 0, "1": 0},  # corrected, uncorrected (volatile)
    "remapped": [0, 0, 0, 0],  # corrected rows, uncorrected rows, pending, failure
    "reasons": 0x1,  # idle
    "pcie_width": 16,
    "pcie_max_width": 16,
    "persistence": 1,
    "processes": [],
}

STATE: dict = {"gpus": [], "init_error": None, "shutdowns": 0}


def gpu(**over) -> dict:
    return {**json.loads(json.dumps(HEALTHY)), **over}


def _value(i: int, key: str):
    v = STATE["gpus"][i][key]
    if isinstance(v, dict) and "error" in v:
        raise NVMLError(int(v["error"]))
    return v


def nvmlInit():
    path = os.environ.get("GPUVIGIL_FAKE_NVML")
    if path:
        with open(path, encoding="utf-8") as f:
            STATE.update(json.load(f))
    if STATE.get("init_error") is not None:
        raise NVMLError(int(STATE["init_error"]))


def nvmlShutdown():
    STATE["shutdowns"] = STATE.get("shutdowns", 0) + 1


def nvmlDeviceGetCount():
    return len(STATE["gpus"])


def nvmlDeviceGetHandleByIndex(i):
    return SimpleNamespace(index=i)


def nvmlDeviceGetEccMode(h):
    return _value(h.index, "ecc_mode")


def nvmlDeviceGetTotalEccErrors(h, error_type, counter):
    assert counter == NVML_VOLATILE_ECC
    ecc = _value(h.index, "ecc")
    return ecc[str(error_type)]


def nvmlDeviceGetRemappedRows(h):
    return tuple(_value(h.index, "remapped"))


def nvmlDeviceGetCurrentClocksEventReasons(h):
    return _value(h.index, "reasons")


def nvmlDeviceGetCurrPcieLinkWidth(h):
    return _value(h.index, "pcie_width")


def nvmlDeviceGetMaxPcieLinkWidth(h):
    return _value(h.index, "pcie_max_width")


def nvmlDeviceGetPersistenceMode(h):
    return _value(h.index, "persistence")


def nvmlDeviceGetComputeRunningProcesses(h):
    return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in _value(h.index, "processes")]
