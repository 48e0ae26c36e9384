"""NVML collector.

This machine has no NVIDIA GPU or driver, so the collector is driven by `FakeNvml`, an in-memory
stand-in for the `pynvml` module: same function names and constants, and it raises pynvml's own
`NVMLError` subclasses (NotSupported, GPU is lost, library not found...). It is a mock only
because no real NVML can run here; the same collector ran on a real H200 (scripts/device_check.py).
The captured H200 time series (tests/data/h200/nvml_timeseries.csv) is replayed through the
collector's schema."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pynvml
import pytest

from gpuvigil import schemas
from gpuvigil.collectors.base import Collector
from gpuvigil.collectors.nvml import GPU_PROCESSES, NvmlCollector, NvmlUnavailable, ProcessOwner, attribute_pid, replay_csv
from gpuvigil.errors import UserError

DATA = Path(__file__).parent / "data" / "h200"
GIB = 1 << 30


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeHandle:
    def __init__(self, index: int):
        self.index = index


class FakeNvml:
    """In-memory pynvml: each GPU is a dict of readings; a reading that is an int error code in
    `errors[(gpu, function)]` raises that NVMLError instead."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_AGGREGATE_ECC = pynvml.NVML_AGGREGATE_ECC
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError
    nvmlEventTypeSingleBitEccError = pynvml.nvmlEventTypeSingleBitEccError

    def __init__(self, gpus: list[dict], *, init_error: int | None = None, errors: dict | None = None, memory_v2: bool = True):
        self.gpus = gpus
        self.handles = [FakeHandle(i) for i in range(len(gpus))]
        self.init_error = init_error
        self.errors = errors or {}
        self.memory_v2 = memory_v2
        self.pending_events: list[SimpleNamespace] = []
        self.lock = threading.Lock()
        self.registered: dict[int, int] = {}
        self.shutdown_calls = 0
        self.freed_sets = 0
        self.waits = 0

    def _read(self, handle: FakeHandle, function: str, value):
        code = self.errors.get((handle.index, function))
        if code is not None:
            raise nvml_error(code)
        return value

    def nvmlInit(self):
        if self.init_error is not None:
            raise nvml_error(self.init_error)

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.handles[i]

    def nvmlDeviceGetUUID(self, h):
        return self._read(h, "uuid", self.gpus[h.index]["uuid"])

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        g = self.gpus[h.index]
        if version is not None:
            if not self.memory_v2:
                raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return SimpleNamespace(total=g["total"], reserved=g["reserved"], used=g["used"], free=g["total"] - g["used"] - g["reserved"])
        # v1 counts driver-reserved memory as used.
        return self._read(h, "memory", SimpleNamespace(total=g["total"], used=g["used"] + g["reserved"], free=g["total"] - g["used"] - g["reserved"]))

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self.gpus[h.index]
        return self._read(h, "utilization", SimpleNamespace(gpu=g["util"], memory=g["mem_util"]))

    def nvmlDeviceGetPowerUsage(self, h):
        return self._read(h, "power", self.gpus[h.index]["power_mw"])

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._read(h, "temperature", self.gpus[h.index]["temp"])

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._read(h, f"clock{kind}", self.gpus[h.index]["sm_mhz" if kind == pynvml.NVML_CLOCK_SM else "mem_mhz"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._read(h, "reasons", self.gpus[h.index]["reasons"])

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter):
        return self._read(h, "ecc", self.gpus[h.index]["ecc"][(error_type, counter)])

    def nvmlDeviceGetRemappedRows(self, h):
        return self._read(h, "remapped", self.gpus[h.index]["remapped"])

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return self._read(h, "retired", self.gpus[h.index]["retired"][cause])

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._read(h, "replay", self.gpus[h.index]["replay"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._read(h, "processes", [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self.gpus[h.index]["procs"]])

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return self._read(h, "event_types", self.gpus[h.index].get("event_types", 0xFF))

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h, mask, event_set):
        self._read(h, "register", None)
        self.registered[h.index] = mask

    def nvmlEventSetWait(self, event_set, timeout_ms):
        self.waits += 1
        with self.lock:
            if self.pending_events:
                return self.pending_events.pop(0)
        time.sleep(0.01)
        raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set):
        self.freed_sets += 1

    def inject(self, gpu: int, event_type: int, data: int) -> None:
        with self.lock:
            self.pending_events.append(SimpleNamespace(device=self.handles[gpu], eventType=event_type, eventData=data, gpuInstanceId=0, computeInstanceId=0))


def h200(uuid: str, **over) -> dict:
    c, u, v, a = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    gpu = {
        "uuid": uuid, "total": 150754820096, "reserved": 644939776, "used": 40 * GIB, "util": 97, "mem_util": 60,
        "power_mw": 693575, "temp": 61, "sm_mhz": 1980, "mem_mhz": 3201, "reasons": 4,
        "ecc": {(c, v): 3, (u, v): 0, (c, a): 12, (u, a): 1}, "remapped": (2, 1, 0, 0), "retired": {0: [], 1: []},
        "replay": 5, "procs": [(4242, 38 * GIB)],
    }
    gpu.update(over)
    return gpu


@pytest.fixture
def proc_root(tmp_path):
    def make(pid, environ=None, cgroup=None):
        d = tmp_path / "proc" / str(pid)
        d.mkdir(parents=True)
        if environ is not None:
            (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
        if cgroup is not None:
            (d / "cgroup").write_text(cgroup)

    make(4242, environ={"PATH": "/usr/bin", "SLURM_JOB_ID": "777"})
    make(5151, cgroup="0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-" + "ab" * 32 + ".scope\n")
    return tmp_path / "proc"


def test_all_fields_on_a_healthy_h200(proc_root):
    fake = FakeNvml([h200("GPU-a"), h200("GPU-b", procs=[(5151, None)])])
    with NvmlCollector(node="n1", nvml=fake, proc_root=proc_root) as collector:
        assert isinstance(collector, Collector)
        out = collector.collect(100.0)
        assert collector.errors == 0 and collector.not_supported == {}
    samples = out["gpu_samples"]
    assert samples.schema == schemas.GPU_SAMPLES and samples.height == 2
    row = samples.row(0, named=True)
    assert row["gpu_uuid"] == "GPU-a" and row["node"] == "n1" and row["gpu"] == 0 and row["ts"] == 100.0
    assert row["memory_used_bytes"] == 40 * GIB  # v2: driver-reserved memory is not "used"
    assert row["memory_total_bytes"] == 150754820096
    assert row["util_ratio"] == pytest.approx(0.97) and row["mem_util_ratio"] == pytest.approx(0.60)
    assert row["power_w"] == pytest.approx(693.575)
    assert (row["temperature_c"], row["sm_clock_mhz"], row["mem_clock_mhz"], row["throttle_reasons"]) == (61.0, 1980.0, 3201.0, 4)
    assert (row["ecc_sbe_volatile_total"], row["ecc_dbe_volatile_total"]) == (3, 0)
    assert (row["ecc_sbe_aggregate_total"], row["ecc_dbe_aggregate_total"]) == (12, 1)
    assert row["retired_pages_total"] == 3 and row["remap_failure"] is False
    assert row["pcie_replay_total"] == 5 and row["xid_total"] == 0 and row["last_xid"] is None
    procs = out["gpu_processes"]
    assert procs.schema == GPU_PROCESSES
    assert procs.select("gpu", "pid", "used_memory_bytes", "slurm_job", "pod_uid", "container_id").rows() == [
        (0, 4242, 38 * GIB, "777", None, None),
        (1, 5151, None, None, "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "ab" * 32),
    ]
    assert fake.shutdown_calls == 1


def test_not_supported_fields_become_null_never_errors():
    ns = pynvml.NVML_ERROR_NOT_SUPPORTED
    unsupported = {(0, f): ns for f in ("power", "temperature", "ecc", "remapped", "replay", "reasons", "processes", "utilization", "event_types")}
    fake = FakeNvml([h200("GPU-vm", retired={0: [0x1000], 1: [0x2000, 0x3000]})], errors=unsupported, memory_v2=False)
    with NvmlCollector(node="vm", nvml=fake) as collector:
        row = collector.collect(1.0)["gpu_samples"].row(0, named=True)
        assert collector.errors == 0
        assert set(collector.not_supported) >= {"power", "temperature", "ecc_volatile", "ecc_aggregate", "remapped_rows", "pcie_replay"}
    for column in ("power_w", "temperature_c", "util_ratio", "throttle_reasons", "ecc_sbe_volatile_total", "ecc_dbe_aggregate_total", "pcie_replay_total", "remap_failure"):
        assert row[column] is None, column
    assert row["retired_pages_total"] == 3  # pre-Ampere fallback: retired pages
    assert row["memory_used_bytes"] == 40 * GIB + 644939776  # v1 fallback counts reserved as used
    assert row["sm_clock_mhz"] == 1980.0


def test_other_nvml_errors_become_null_and_are_counted():
    lost = pynvml.NVML_ERROR_GPU_IS_LOST
    fake = FakeNvml([h200("GPU-a"), h200("GPU-b")], errors={(1, "power"): lost, (1, "temperature"): lost, (1, "uuid"): lost})
    with NvmlCollector(node="n", nvml=fake, events=False) as collector:
        samples = collector.collect(1.0)["gpu_samples"]
        assert collector.errors == 3
    assert samples["power_w"].to_list() == [pytest.approx(693.575), None]
    assert samples["gpu_uuid"].to_list() == ["GPU-a", None]
    assert samples["sm_clock_mhz"].to_list() == [1980.0, 1980.0]


@pytest.mark.parametrize(
    "fake, message",
    [
        (FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), "NVML Shared Library Not Found"),
        (FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), "Driver Not Loaded"),
        (FakeNvml([]), "found no GPU"),
    ],
)
def test_no_driver_or_no_gpu_is_a_clear_unavailable(fake, message):
    with pytest.raises(NvmlUnavailable, match=message) as info:
        NvmlCollector(nvml=fake)
    assert isinstance(info.value, UserError) and "simulated cluster" in str(info.value)


def test_real_pynvml_on_this_gpu_less_machine_is_unavailable():
    with pytest.raises(NvmlUnavailable, match="NVML"):
        NvmlCollector()


def test_xid_and_ecc_events_arrive_through_the_event_thread():
    fake = FakeNvml([h200("GPU-a"), h200("GPU-b", event_types=pynvml.nvmlEventTypeXidCriticalError)])
    collector = NvmlCollector(node="n1", nvml=fake)
    try:
        xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
        assert fake.registered == {0: xid | dbe | pynvml.nvmlEventTypeSingleBitEccError, 1: xid}
        fake.inject(1, xid, 79)
        fake.inject(0, dbe, 0)
        events = []
        deadline = time.monotonic() + 30
        while len(events) < 2 and time.monotonic() < deadline:
            out = collector.collect(5.0)
            if "events" in out:
                events.extend(out["events"].rows(named=True))
            time.sleep(0.01)
        assert [(e["gpu"], e["kind"], e["xid"], e["source"]) for e in events] == [(1, "xid", 79, "nvml"), (0, "ecc_dbe", None, "nvml")]
        samples = collector.collect(6.0)["gpu_samples"]
        assert samples.select("xid_total", "last_xid").rows() == [(0, None), (1, 79)]
    finally:
        collector.stop()
    assert collector._thread is None and fake.freed_sets == 1 and fake.shutdown_calls == 1
    waits = fake.waits
    time.sleep(0.05)
    assert fake.waits == waits  # the thread really stopped


def test_event_wait_failures_do_not_kill_the_thread():
    fake = FakeNvml([h200("GPU-a")])
    calls = {"n": 0}
    real_wait = fake.nvmlEventSetWait

    def flaky(event_set, timeout_ms):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)
        return real_wait(event_set, timeout_ms)

    fake.nvmlEventSetWait = flaky
    collector = NvmlCollector(node="n1", nvml=fake)
    try:
        fake.inject(0, pynvml.nvmlEventTypeXidCriticalError, 48)
        deadline = time.monotonic() + 30
        while collector.xid_total[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.last_xid[0] == 48 and collector.errors == 2
    finally:
        collector.stop()


@pytest.mark.parametrize(
    "environ, cgroup, owner",
    [
        ({"SLURM_JOB_ID": "123"}, None, ProcessOwner("123")),
        (None, "12:memory:/slurm/uid_1000/job_4567/step_0/task_0\n", ProcessOwner("4567")),
        (None, "0::/system.slice/slurmstepd.scope/job_89/step_batch/user/task_0\n", ProcessOwner("89")),
        (None, "11:cpu:/kubepods/burstable/pod0e3f1c2a-1111-2222-3333-444455556666/" + "cd" * 32 + "\n",
         ProcessOwner(None, "0e3f1c2a-1111-2222-3333-444455556666", "cd" * 32)),
        (None, "0::/user.slice/user-1000.slice/session-3.scope\n", ProcessOwner()),
        (None, None, ProcessOwner()),
    ],
)
def test_process_attribution(tmp_path, environ, cgroup, owner):
    d = tmp_path / "31337"
    d.mkdir()
    if environ is not None:
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()))
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    assert attribute_pid(31337, tmp_path) == owner


def test_replay_of_the_real_h200_time_series():
    samples = replay_csv(DATA / "nvml_timeseries.csv", node="h200-0", gpu_uuid="GPU-34d3dfff-b746-63b5-0224-9f470d7475f1")
    assert samples.schema == schemas.GPU_SAMPLES and samples.height == 802
    raw = pl.read_csv(DATA / "nvml_timeseries.csv")
    first = samples.row(0, named=True)
    assert first["memory_total_bytes"] == 150754820096 and first["power_w"] == pytest.approx(125.147)
    assert first["sm_clock_mhz"] == 405.0 and first["throttle_reasons"] == 1  # idle clocks: GPU idle reason
    matmul = samples.filter(raw["phase"] == "matmul")
    assert matmul["power_w"].max() == pytest.approx(693.575)  # at the 700 W cap ...
    assert 4 in matmul["throttle_reasons"].to_list()  # ... with the SW power-cap clock event
    ramp = samples.filter(raw["phase"] == "oom_ramp")
    assert ramp["memory_used_bytes"].max() == 146581291008


@pytest.mark.parametrize("content, message", [("a,b\n1,2\n", "missing column"), ("", "cannot read")])
def test_bad_csv_is_a_user_error(tmp_path, content, message):
    path = tmp_path / "nvml.csv"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        replay_csv(path)


def test_event_handles_match_by_address_like_real_ctypes_handles():
    import ctypes

    first = ctypes.cast(ctypes.c_void_p(0x1000), pynvml.c_nvmlDevice_t)
    same_gpu = ctypes.cast(ctypes.c_void_p(0x1000), pynvml.c_nvmlDevice_t)
    other = ctypes.cast(ctypes.c_void_p(0x2000), pynvml.c_nvmlDevice_t)
    assert NvmlCollector._handle_key(first) == NvmlCollector._handle_key(same_gpu) != NvmlCollector._handle_key(other)


def test_golden_replay_rows():
    from h_fr_helpers import check_golden

    samples = replay_csv(DATA / "nvml_timeseries.csv", node="h200-0")
    # Units converted, not copied: mW → W, bytes kept; the idle start reads 125 W, 35 °C.
    first = samples.row(0, named=True)
    assert (first["power_w"], first["temperature_c"], first["memory_total_bytes"]) == (125.147, 35.0, 150754820096)
    assert samples.height == 802 and samples["ts"].is_sorted()
    check_golden("nvml_replay_rows.json", samples.head(3).rows(named=True) + samples.tail(2).rows(named=True))


def test_fake_seeded_from_the_real_h200_inventory():
    """The real H200's static NVML readings (tests/data/h200/nvml_inventory.json): remapped rows
    supported and zero, retired pages NotSupported (Hopper remaps rows instead), and the
    supported event mask 65439 covering XID, SBE and DBE events."""
    import ast
    import json

    inv = json.loads((DATA / "nvml_inventory.json").read_text())
    c, u, v, a = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    gpu = h200(
        inv["uuid"],
        total=int(inv["memory"]["total"]), reserved=0, used=int(inv["memory"]["used"]),
        remapped=ast.literal_eval(inv["remapped_rows"]), replay=int(inv["pcie_replay"]), procs=[],
        ecc={(c, v): 0, (u, v): int(inv["ecc_volatile_uncorrected"]), (c, a): int(inv["ecc_aggregate_corrected"]), (u, a): 0},
        event_types=int(inv["supported_event_types"]),
    )
    assert inv["retired_pages_dbe"].startswith("ERR:NVMLError_NotSupported")
    fake = FakeNvml([gpu], errors={(0, "retired"): pynvml.NVML_ERROR_NOT_SUPPORTED}, memory_v2=False)
    with NvmlCollector(node="h200", nvml=fake) as collector:
        row = collector.collect(1.0)["gpu_samples"].row(0, named=True)
        xid, sbe, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeSingleBitEccError, pynvml.nvmlEventTypeDoubleBitEccError
        assert collector.event_types_registered == [xid | sbe | dbe]
        assert collector.errors == 0 and collector.not_supported == {}  # remapped rows answered: retired pages never asked
    assert row["gpu_uuid"] == "GPU-34d3dfff-b746-63b5-0224-9f470d7475f1"
    assert (row["memory_used_bytes"], row["memory_total_bytes"]) == (644939776, 150754820096)
    assert (row["retired_pages_total"], row["remap_failure"], row["pcie_replay_total"], row["ecc_dbe_volatile_total"]) == (0, False, 0, 0)
