"""NVML collector: per-GPU health and load straight from the driver, through `pynvml`
(nvidia-ml-py), plus XID and ECC events from NVML's event API on a background thread.

The counters (ECC, remapped rows / retired pages, PCIe replays and bytes) are read in one
`nvmlDeviceGetFieldValues` batch per GPU, which returns a status per field; a field the GPU or
driver does not support (`NotSupported`) is read once through its own NVML call instead (the
pre-Ampere retired-pages fallback, or older drivers) and left out of later batches. The gauges
(memory, utilisation, power, temperature, clocks, clock-event reasons) have no field id and are
read one call each. Any reading may fail on its own: `NotSupported` becomes null, as does any
other per-field `NVMLError` (counted in `errors`). Without `nvmlDeviceGetFieldValues` (very old
drivers) every reading is its own call. A machine without the driver or without GPUs raises
`NvmlUnavailable` at construction, with a message saying so.

Running compute processes are attributed to their job and rank (collectors/jobmap.py: the
process environment and cgroup) and emitted as `gpu_processes`; `processes()` hands the same
list to the job map (`JobMapCollector(processes=nvml.processes)`).
"""

from __future__ import annotations

import ctypes
import queue
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.jobmap import GpuProcess, ProcessOwner, attribute_pid
from gpuvigil.errors import UserError

GPU_PROCESSES = schemas.GPU_PROCESSES

# Counters read through nvmlDeviceGetFieldValues: our name → (pynvml constant, nvml.h value).
FIELD_IDS: dict[str, tuple[str, int]] = {
    "ecc_sbe_volatile_total": ("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 3),
    "ecc_dbe_volatile_total": ("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 4),
    "ecc_sbe_aggregate_total": ("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", 5),
    "ecc_dbe_aggregate_total": ("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", 6),
    "retired_sbe": ("NVML_FI_DEV_RETIRED_SBE", 29),
    "retired_dbe": ("NVML_FI_DEV_RETIRED_DBE", 30),
    "pcie_replay": ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", 94),
    "remapped_cor": ("NVML_FI_DEV_REMAPPED_COR", 142),
    "remapped_unc": ("NVML_FI_DEV_REMAPPED_UNC", 143),
    "remapped_pending": ("NVML_FI_DEV_REMAPPED_PENDING", 144),
    "remapped_failure": ("NVML_FI_DEV_REMAPPED_FAILURE", 145),
    "retired_pending": ("NVML_FI_DEV_RETIRED_PENDING", 31),
    "pcie_tx_bytes": ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197),
    "pcie_rx_bytes": ("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198),
}
# nvmlValueType_t → the c_nvmlValue_t union member holding the value.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

STREAMS: Mapping[str, pl.Schema] = {"gpu_samples": schemas.GPU_SAMPLES, "events": schemas.EVENTS, "gpu_processes": GPU_PROCESSES}

# NVML event type bits (nvml.h); the module's own constants are used when present.
_EVENT_SBE = 0x1
_EVENT_DBE = 0x2
_EVENT_XID = 0x8
_EVENT_WAIT_MS = 500


class NvmlUnavailable(UserError):
    """No NVIDIA driver, no NVML library or no GPU on this machine."""


# ---------------------------------------------------------------- process attribution
# /proc attribution is shared with the job map (collectors/jobmap.py); re-exported here.

# ---------------------------------------------------------------- the collector


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("NVML unavailable: the nvidia-ml-py package (pynvml) is not installed; use the simulated cluster") from exc
    return pynvml


class NvmlCollector:
    """Samples every GPU on this node on each `collect(now)`; events arrive between samples."""

    name = "nvml"
    streams = STREAMS

    def __init__(self, *, node: str | None = None, nvml: Any = None, proc_root: str | Path = "/proc", events: bool = True,
                 attribute: Callable[[int], ProcessOwner] | None = None):
        self.nvml = nvml if nvml is not None else _load_pynvml()
        self.node = node or socket.gethostname()
        self.errors = 0
        self.not_supported: dict[str, int] = {}
        self.field_values = callable(getattr(self.nvml, "nvmlDeviceGetFieldValues", None))
        self._field_ids = {name: int(getattr(self.nvml, const, default)) for name, (const, default) in FIELD_IDS.items()}
        self._unsupported_fields: list[set[str]] = []  # per GPU: fields left out of the batch
        self._pcie_prev: list[tuple[float, int | None, int | None] | None] = []
        self._last_processes: list[GpuProcess] = []
        self._attribute = attribute or (lambda pid: attribute_pid(pid, proc_root))
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML unavailable: {exc} (no NVIDIA driver on this machine?); use the simulated cluster") from exc
        try:
            count = int(self.nvml.nvmlDeviceGetCount())
            self.handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except self.nvml.NVMLError as exc:
            self._shutdown()
            raise NvmlUnavailable(f"NVML unavailable: cannot list GPUs: {exc}; use the simulated cluster") from exc
        if not self.handles:
            self._shutdown()
            raise NvmlUnavailable("NVML found no GPU on this machine; use the simulated cluster")
        self.uuids = [self._field("uuid", self.nvml.nvmlDeviceGetUUID, h) for h in self.handles]
        self._unsupported_fields = [set() for _ in self.handles]
        self.pci_bus_ids = [self._pci_bus_id(h) for h in self.handles]
        self._pcie_prev = [None] * len(self.handles)
        self._nvlink_ids: list[list[int] | None] = [None] * len(self.handles)
        self._fabric_fixed: int | None = None
        self._index_of = {self._handle_key(h): i for i, h in enumerate(self.handles)}
        self.xid_total = [0] * len(self.handles)
        self.last_xid: list[int | None] = [None] * len(self.handles)
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set = None
        self.event_types_registered: list[int] = [0] * len(self.handles)
        if events:
            self.start_events()

    # -- fields -------------------------------------------------------------------------

    @staticmethod
    def _handle_key(handle: Any) -> Any:
        # Real handles are ctypes pointers: the event's handle is another object for the same GPU,
        # so compare addresses. Anything else (a test double) compares by identity.
        try:
            return ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            return id(handle)

    def _count(self, exc: Exception, name: str) -> None:
        if getattr(exc, "value", None) == getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
            self.not_supported[name] = self.not_supported.get(name, 0) + 1
        else:
            self.errors += 1

    def _field(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML reading; null when this GPU or driver cannot give it."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            self._count(exc, name)
            return None

    def _memory(self, handle: Any) -> tuple[int | None, int | None, int | None]:
        """(used, total, driver-reserved) bytes."""
        # v2 separates driver-reserved memory from `used`; older drivers only have v1.
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                info = self.nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                reserved = getattr(info, "reserved", None)
                return int(info.used), int(info.total), int(reserved) if reserved is not None else None
            except (self.nvml.NVMLError, TypeError, AttributeError):
                pass
        info = self._field("memory", self.nvml.nvmlDeviceGetMemoryInfo, handle)
        return (int(info.used), int(info.total), None) if info is not None else (None, None, None)

    def _field_batch(self, i: int, handle: Any) -> dict[str, Any]:
        """The counters in one nvmlDeviceGetFieldValues call: name → value (None: failed;
        absent: not supported, to be read the old way)."""
        wanted = [n for n in FIELD_IDS if n not in self._unsupported_fields[i]]
        if not wanted:
            return {}
        try:
            values = self.nvml.nvmlDeviceGetFieldValues(handle, [self._field_ids[n] for n in wanted])
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in (getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(self.nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)):
                self.field_values = False  # this driver has no batch API: one call per reading
            else:
                self.errors += 1
            return {}
        ok = getattr(self.nvml, "NVML_SUCCESS", 0)
        not_supported = getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
        out: dict[str, Any] = {}
        for name, v in zip(wanted, values, strict=False):
            ret = int(v.nvmlReturn)
            if ret == ok:
                member = _VALUE_MEMBER.get(int(v.valueType))
                out[name] = getattr(v.value, member) if member else None
            elif ret == not_supported:
                self._unsupported_fields[i].add(name)
                self.not_supported[name] = self.not_supported.get(name, 0) + 1
            else:
                self.errors += 1
                out[name] = None
        return out

    def _counters(self, i: int, handle: Any, now: float) -> dict[str, Any]:
        """ECC, remapped rows / retired pages, PCIe replays and byte rates, batched when possible."""
        nv = self.nvml
        f = self._field_batch(i, handle) if self.field_values else {}
        corrected, uncorrected = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        legacy_ecc = {
            "ecc_sbe_volatile_total": (corrected, nv.NVML_VOLATILE_ECC, "ecc_volatile"),
            "ecc_dbe_volatile_total": (uncorrected, nv.NVML_VOLATILE_ECC, "ecc_volatile"),
            "ecc_sbe_aggregate_total": (corrected, nv.NVML_AGGREGATE_ECC, "ecc_aggregate"),
            "ecc_dbe_aggregate_total": (uncorrected, nv.NVML_AGGREGATE_ECC, "ecc_aggregate"),
        }
        out: dict[str, Any] = {}
        for name, (etype, counter, label) in legacy_ecc.items():
            out[name] = int(f[name]) if f.get(name) is not None else (None if name in f else self._ecc(handle, etype, counter, label))
        if "remapped_cor" in f or "remapped_unc" in f:
            cor, unc = f.get("remapped_cor"), f.get("remapped_unc")
            out["retired_pages_total"] = int(cor) + int(unc) if cor is not None and unc is not None else None
            fail, pending = f.get("remapped_failure"), f.get("remapped_pending")
            out["remap_failure"] = bool(fail) if fail is not None else None
            out["row_remap_pending"] = bool(pending) if pending is not None else None
        elif f.get("retired_sbe") is not None and f.get("retired_dbe") is not None:
            out["retired_pages_total"], out["remap_failure"], out["row_remap_pending"] = int(f["retired_sbe"]) + int(f["retired_dbe"]), None, None
        else:
            out["retired_pages_total"], out["remap_failure"], out["row_remap_pending"] = self._remapped(handle)
        retired_pending = f.get("retired_pending")
        out["retired_pages_pending"] = bool(retired_pending) if retired_pending is not None else None
        if "pcie_replay" in f:
            out["pcie_replay_total"] = int(f["pcie_replay"]) if f["pcie_replay"] is not None else None
        else:
            replay = self._field("pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, handle)
            out["pcie_replay_total"] = int(replay) if replay is not None else None
        # PCIe byte counters (Hopper and later drivers) → rates between samples.
        tx, rx = f.get("pcie_tx_bytes"), f.get("pcie_rx_bytes")
        prev = self._pcie_prev[i]
        self._pcie_prev[i] = (now, tx, rx) if tx is not None or rx is not None else None
        for col, cur, k in (("pcie_tx_bytes_per_second", tx, 1), ("pcie_rx_bytes_per_second", rx, 2)):
            before = prev[k] if prev is not None else None
            dt = now - prev[0] if prev is not None else 0.0
            out[col] = (cur - before) / dt if cur is not None and before is not None and dt > 0 and cur >= before else None
        return out

    def _throttle(self, handle: Any) -> int | None:
        fn = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(self.nvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
        value = self._field("clock_event_reasons", fn, handle)
        return int(value) if value is not None else None

    def _ecc(self, handle: Any, error_type: int, counter: int, name: str) -> int | None:
        value = self._field(name, self.nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, counter)
        return int(value) if value is not None else None

    def _remapped(self, handle: Any) -> tuple[int | None, bool | None, bool | None]:
        """(remapped rows or retired pages, remap failed, remap pending)."""
        rows = self._field("remapped_rows", self.nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            corrected, uncorrected, pending, failure = rows
            return int(corrected) + int(uncorrected), bool(failure), bool(pending)
        # Pre-Ampere GPUs retire pages instead of remapping rows.
        total = 0
        for cause in (0, 1):
            pages = self._field("retired_pages", self.nvml.nvmlDeviceGetRetiredPages, handle, cause)
            if pages is None:
                return None, None, None
            total += len(pages)
        return total, None, None

    def _nvlinks(self, i: int, handle: Any) -> tuple[int | None, int | None]:
        """(links the GPU has, links up). The links are found once: a link index past the GPU's
        last answers NotSupported or InvalidArgument, and a PCIe GPU has none (0, 0), so that
        'no NVLink up' is never said of a GPU without NVLink."""
        fn = getattr(self.nvml, "nvmlDeviceGetNvLinkState", None)
        if fn is None:
            return None, None
        links = self._nvlink_ids[i]
        if links is None:
            links = []
            for link in range(int(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    fn(handle, link)
                except self.nvml.NVMLError as exc:
                    if getattr(exc, "value", None) not in (getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(self.nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)):
                        self._count(exc, "nvlink_state")
                        return None, None  # unsure which links exist: ask again next time
                    continue
                links.append(link)
            self._nvlink_ids[i] = links
        up = 0
        for link in links:
            state = self._field("nvlink_state", fn, handle, link)
            if state is None:
                return len(links), None
            up += int(state) == int(getattr(self.nvml, "NVML_FEATURE_ENABLED", 1))
        return len(links), up

    def _fabric(self, handle: Any) -> int | None:
        """The GPU's fabric state as DCGM's dcgmFabricManagerStatus_t, mapped as DCGM maps NVML's
        (state not supported / not started / in progress; completed: success, or failure when its
        status is an error)."""
        fn = getattr(self.nvml, "nvmlDeviceGetGpuFabricInfo", None)
        if fn is None:
            return None
        if self._fabric_fixed is not None:  # not supported, or a driver without the call: asked once
            return self._fabric_fixed
        try:
            info = fn(handle)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == getattr(self.nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
                self._fabric_fixed = 0  # no NVLink fabric (a PCIe GPU, or before Hopper)
                return 0
            if code == getattr(self.nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                self._fabric_fixed = 6  # the driver predates the call
                return 6
            self._count(exc, "fabric_info")
            return None
        state, status = int(getattr(info, "state", -1)), int(getattr(info, "status", 0))
        if state in (0, 1, 2):
            return state
        if state == 3:
            return 3 if status == int(getattr(self.nvml, "NVML_SUCCESS", 0)) else 4
        return 5

    def _sample(self, i: int, handle: Any, now: float) -> dict[str, Any]:
        nv = self.nvml
        used, total, reserved = self._memory(handle)
        util = self._field("utilization", nv.nvmlDeviceGetUtilizationRates, handle)
        power_mw = self._field("power", nv.nvmlDeviceGetPowerUsage, handle)
        temperature = self._field("temperature", nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        sm_clock = self._field("sm_clock", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
        mem_clock = self._field("mem_clock", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM)
        counters = self._counters(i, handle, now)
        links, links_up = self._nvlinks(i, handle)
        return {
            "ts": now,
            "node": self.node,
            "gpu": i,
            "gpu_uuid": self.uuids[i],
            "memory_used_bytes": used,
            "memory_total_bytes": total,
            "util_ratio": util.gpu / 100.0 if util is not None else None,
            "mem_util_ratio": util.memory / 100.0 if util is not None else None,
            "power_w": power_mw / 1000.0 if power_mw is not None else None,
            "temperature_c": float(temperature) if temperature is not None else None,
            "sm_clock_mhz": float(sm_clock) if sm_clock is not None else None,
            "mem_clock_mhz": float(mem_clock) if mem_clock is not None else None,
            "throttle_reasons": self._throttle(handle),
            **counters,
            "memory_reserved_bytes": reserved,
            "nvlink_links_total": links,
            "nvlink_links_up": links_up,
            "fabric_manager_status": self._fabric(handle),
            "xid_total": self.xid_total[i],
            "last_xid": self.last_xid[i],
        }

    def _processes(self, i: int, handle: Any, now: float) -> list[dict[str, Any]]:
        procs = self._field("processes", self.nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        rows = []
        for p in procs:
            owner = self._attribute(int(p.pid))
            used = getattr(p, "usedGpuMemory", None)
            self._last_processes.append(GpuProcess(i, self.uuids[i], int(p.pid)))
            rows.append(
                {
                    "ts": now,
                    "node": self.node,
                    "gpu": i,
                    "gpu_uuid": self.uuids[i],
                    "pid": int(p.pid),
                    "used_memory_bytes": int(used) if isinstance(used, int) else None,
                    "slurm_job": owner.slurm_job,
                    "pod_uid": owner.pod_uid,
                    "container_id": owner.container_id,
                    "job": owner.job,
                    "rank": owner.rank,
                }
            )
        return rows

    def _pci_bus_id(self, handle: Any) -> str | None:
        fn = getattr(self.nvml, "nvmlDeviceGetPciInfo", None)
        info = self._field("pci_info", fn, handle) if fn is not None else None
        bus = getattr(info, "busId", None) if info is not None else None
        return bus.decode(errors="replace") if isinstance(bus, bytes) else bus

    def pci_to_gpu(self) -> dict[str, int]:
        """PCI bus id → GPU index, for the kernel log (XIDs name the GPU by its PCI address)."""
        return {bus: i for i, bus in enumerate(self.pci_bus_ids) if bus}

    def uuid_to_gpu(self) -> dict[str, int]:
        """GPU UUID → index, for the job map (PodResources and job-mapping files name UUIDs)."""
        return {u: i for i, u in enumerate(self.uuids) if u}

    def processes(self) -> list[GpuProcess]:
        """The compute processes seen by the latest collect (for JobMapCollector)."""
        return list(self._last_processes)

    def describe(self) -> str:
        mode = "field-value batches" if self.field_values else "one call per reading"
        return f"NVML: {len(self.handles)} GPU(s) on {self.node} ({mode})"

    # -- events -------------------------------------------------------------------------

    def start_events(self) -> None:
        """Register XID and ECC events on every GPU that supports them and start the waiter."""
        nv = self.nvml
        wanted = getattr(nv, "nvmlEventTypeXidCriticalError", _EVENT_XID) | getattr(nv, "nvmlEventTypeDoubleBitEccError", _EVENT_DBE) | getattr(
            nv, "nvmlEventTypeSingleBitEccError", _EVENT_SBE
        )
        event_set = self._field("event_set", nv.nvmlEventSetCreate)
        if event_set is None:
            return
        for i, handle in enumerate(self.handles):
            supported = self._field("event_types", nv.nvmlDeviceGetSupportedEventTypes, handle)
            mask = wanted & int(supported) if supported is not None else 0
            if not mask:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(handle, mask, event_set)
                self.event_types_registered[i] = mask
            except nv.NVMLError as exc:
                self._count(exc, "register_events")
        if not any(self.event_types_registered):
            self._field("event_set_free", nv.nvmlEventSetFree, event_set)
            return
        self._event_set = event_set
        self._thread = threading.Thread(target=self._wait_events, name="gpuvigil-nvml-events", daemon=True)
        self._thread.start()

    def _wait_events(self) -> None:
        nv = self.nvml
        timeout_code = getattr(nv, "NVML_ERROR_TIMEOUT", 10)
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._event_set, _EVENT_WAIT_MS)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != timeout_code:
                    self.errors += 1
                    self._stop.wait(_EVENT_WAIT_MS / 1000)
                continue
            self._events.put(self._event_row(data))

    def _event_row(self, data: Any) -> dict[str, Any]:
        nv = self.nvml
        gpu = self._index_of.get(self._handle_key(data.device))
        event_type = int(data.eventType)
        if event_type & getattr(nv, "nvmlEventTypeXidCriticalError", _EVENT_XID):
            kind, xid = "xid", int(data.eventData)
            if gpu is not None:
                self.xid_total[gpu] += 1
                self.last_xid[gpu] = xid
        elif event_type & getattr(nv, "nvmlEventTypeDoubleBitEccError", _EVENT_DBE):
            kind, xid = "ecc_dbe", None
        else:
            kind, xid = "ecc_sbe", None
        return {
            "node": self.node,
            "gpu": gpu,
            "source": "nvml",
            "kind": kind,
            "xid": xid,
            "message": f"NVML event type 0x{event_type:x} data {int(data.eventData)}",
        }

    def stop(self) -> None:
        """Stop the event thread and release NVML (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _EVENT_WAIT_MS / 1000 + 1)
            self._thread = None
        if self._event_set is not None:
            self._field("event_set_free", self.nvml.nvmlEventSetFree, self._event_set)
            self._event_set = None
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def __enter__(self) -> NvmlCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Collector protocol -------------------------------------------------------------

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        events = []
        while True:
            try:
                row = self._events.get_nowait()
            except queue.Empty:
                break
            events.append({**row, "ts": now})
        samples, procs = [], []
        self._last_processes = []
        for i, handle in enumerate(self.handles):
            samples.append(self._sample(i, handle, now))
            procs.extend(self._processes(i, handle, now))
        out = {"gpu_samples": schemas.frame(samples, schemas.GPU_SAMPLES), "gpu_processes": schemas.frame(procs, GPU_PROCESSES)}
        if events:
            out["events"] = schemas.frame(events, schemas.EVENTS)
        return out


# ---------------------------------------------------------------- replay of captured CSV

# Columns of an NVML time series captured with nvidia-ml-py (see tests/data/h200/README):
# memory in bytes, power in mW, clocks in MHz, utilisation in percent.
_CSV_COLUMNS = ("t", "fb_used", "util_gpu", "util_mem", "power_mw", "temp_c", "sm_clock", "mem_clock", "clock_event_reasons")


def replay_csv(path: str | Path, *, node: str = "replay", gpu: int = 0, gpu_uuid: str | None = None) -> pl.DataFrame:
    """A captured NVML time series as GPU_SAMPLES rows."""
    p = Path(path)
    try:
        df = pl.read_csv(p, infer_schema_length=10000)
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise UserError(f"{p}: cannot read NVML CSV: {str(exc).splitlines()[0][:160]}") from None
    missing = [c for c in _CSV_COLUMNS if c not in df.columns]
    if missing:
        raise UserError(f"{p}: not an NVML time series: missing column(s) {', '.join(missing)}")
    total = pl.col("fb_used") + pl.col("fb_free") + pl.col("fb_reserved") if {"fb_free", "fb_reserved"} <= set(df.columns) else pl.lit(None)
    try:
        out = df.select(
            pl.col("t").alias("ts"),
            pl.lit(node).alias("node"),
            pl.lit(gpu).alias("gpu"),
            pl.lit(gpu_uuid).alias("gpu_uuid"),
            pl.col("fb_used").alias("memory_used_bytes"),
            total.alias("memory_total_bytes"),
            (pl.col("util_gpu") / 100.0).alias("util_ratio"),
            (pl.col("util_mem") / 100.0).alias("mem_util_ratio"),
            (pl.col("power_mw") / 1000.0).alias("power_w"),
            pl.col("temp_c").alias("temperature_c"),
            pl.col("sm_clock").alias("sm_clock_mhz"),
            pl.col("mem_clock").alias("mem_clock_mhz"),
            pl.col("clock_event_reasons").alias("throttle_reasons"),
            *[(pl.col(f"pcie_{d}_kbs") * 1024.0).alias(f"pcie_{d}_bytes_per_second") for d in ("tx", "rx") if f"pcie_{d}_kbs" in df.columns],
            *([pl.col("fb_reserved").alias("memory_reserved_bytes")] if "fb_reserved" in df.columns else []),
        )
        return schemas.conform(out, schemas.GPU_SAMPLES, stream="gpu_samples")
    except (schemas.SchemaError, pl.exceptions.PolarsError) as exc:
        raise UserError(f"{p}: bad value in NVML CSV: {str(exc).splitlines()[0][:160]}") from None


def available() -> bool:
    """True when NVML initialises and sees at least one GPU (for callers choosing a fallback)."""
    try:
        NvmlCollector(events=False).stop()
        return True
    except NvmlUnavailable:
        return False


__all__ = ["GPU_PROCESSES", "NvmlCollector", "NvmlUnavailable", "ProcessOwner", "attribute_pid", "available", "replay_csv"]
