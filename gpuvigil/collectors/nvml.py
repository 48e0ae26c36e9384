"""NVML collector: per-GPU health and load straight from the driver, through `pynvml`
(nvidia-ml-py), plus XID and ECC events from NVML's event API on a background thread.

Every reading is its own NVML call and may fail on its own: `NotSupported` (NVLink on a VM,
remapped rows on pre-Ampere, ECC with ECC off) becomes null, as does any other per-field
`NVMLError` (counted in `errors`). A machine without the driver or without GPUs raises
`NvmlUnavailable` at construction, with a message saying so; the caller then runs the simulated
cluster instead.

Running compute processes are attributed to their Slurm job (SLURM_JOB_ID in
/proc/PID/environ, or `job_N` in the cgroup path) or Kubernetes pod (pod UID in the cgroup path)
and emitted as the `gpu_processes` stream declared here.
"""

from __future__ import annotations

import ctypes
import queue
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.errors import UserError

GPU_PROCESSES = pl.Schema(
    {
        "ts": pl.Float64,
        "node": pl.Utf8,
        "gpu": pl.Int32,
        "gpu_uuid": pl.Utf8,
        "pid": pl.Int64,
        "used_memory_bytes": pl.Int64,  # null when the driver does not say (e.g. in a container)
        "slurm_job": pl.Utf8,
        "pod_uid": pl.Utf8,
        "container_id": pl.Utf8,
    }
)

STREAMS: Mapping[str, pl.Schema] = {"gpu_samples": schemas.GPU_SAMPLES, "events": schemas.EVENTS, "gpu_processes": GPU_PROCESSES}

# NVML event type bits (nvml.h); the module's own constants are used when present.
_EVENT_SBE = 0x1
_EVENT_DBE = 0x2
_EVENT_XID = 0x8
_EVENT_WAIT_MS = 500


class NvmlUnavailable(UserError):
    """No NVIDIA driver, no NVML library or no GPU on this machine."""


# ---------------------------------------------------------------- process attribution

_SLURM_JOB_IN_CGROUP = re.compile(r"/job_(\d+)(?:/|$)")
# cgroupfs: /kubepods/burstable/pod<uid>/<container>; systemd: kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope
_POD_IN_CGROUP = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER_IN_CGROUP = re.compile(r"(?:cri-containerd-|docker-|crio-|/)([0-9a-f]{64})(?:\.scope)?(?:/|$)")


@dataclass(frozen=True)
class ProcessOwner:
    slurm_job: str | None = None
    pod_uid: str | None = None
    container_id: str | None = None


def attribute_pid(pid: int, proc_root: str | Path = "/proc") -> ProcessOwner:
    """Which Slurm job or Kubernetes pod a PID belongs to, from /proc (best effort, never raises)."""
    base = Path(proc_root) / str(pid)
    slurm_job = None
    try:
        for item in (base / "environ").read_bytes().split(b"\0"):
            if item.startswith(b"SLURM_JOB_ID="):
                slurm_job = item.split(b"=", 1)[1].decode(errors="replace") or None
                break
    except OSError:
        pass  # another user's process, or gone: fall back to the cgroup path
    pod_uid = container_id = None
    try:
        cgroup = (base / "cgroup").read_text(errors="replace")
    except OSError:
        cgroup = ""
    if slurm_job is None and (m := _SLURM_JOB_IN_CGROUP.search(cgroup)):
        slurm_job = m.group(1)
    if m := _POD_IN_CGROUP.search(cgroup):
        pod_uid = m.group(1).replace("_", "-")
        if c := _CONTAINER_IN_CGROUP.search(cgroup[m.end():]):
            container_id = c.group(1)
    return ProcessOwner(slurm_job, pod_uid, container_id)


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

    def _memory(self, handle: Any) -> tuple[int | None, int | None]:
        # v2 separates driver-reserved memory from `used`; older drivers only have v1.
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                info = self.nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                return int(info.used), int(info.total)
            except (self.nvml.NVMLError, TypeError, AttributeError):
                pass
        info = self._field("memory", self.nvml.nvmlDeviceGetMemoryInfo, handle)
        return (int(info.used), int(info.total)) if info is not None else (None, None)

    def _throttle(self, handle: Any) -> int | None:
        fn = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(self.nvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
        value = self._field("clock_event_reasons", fn, handle)
        return int(value) if value is not None else None

    def _ecc(self, handle: Any, error_type: int, counter: int, name: str) -> int | None:
        value = self._field(name, self.nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, counter)
        return int(value) if value is not None else None

    def _remapped(self, handle: Any) -> tuple[int | None, bool | None]:
        rows = self._field("remapped_rows", self.nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            corrected, uncorrected, _pending, failure = rows
            return int(corrected) + int(uncorrected), bool(failure)
        # Pre-Ampere GPUs retire pages instead of remapping rows.
        total = 0
        for cause in (0, 1):
            pages = self._field("retired_pages", self.nvml.nvmlDeviceGetRetiredPages, handle, cause)
            if pages is None:
                return None, None
            total += len(pages)
        return total, None

    def _sample(self, i: int, handle: Any, now: float) -> dict[str, Any]:
        nv = self.nvml
        used, total = self._memory(handle)
        util = self._field("utilization", nv.nvmlDeviceGetUtilizationRates, handle)
        power_mw = self._field("power", nv.nvmlDeviceGetPowerUsage, handle)
        temperature = self._field("temperature", nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        sm_clock = self._field("sm_clock", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
        mem_clock = self._field("mem_clock", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM)
        corrected, uncorrected = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        remapped, remap_failure = self._remapped(handle)
        replay = self._field("pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, handle)
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
            "ecc_sbe_volatile_total": self._ecc(handle, corrected, nv.NVML_VOLATILE_ECC, "ecc_volatile"),
            "ecc_dbe_volatile_total": self._ecc(handle, uncorrected, nv.NVML_VOLATILE_ECC, "ecc_volatile"),
            "ecc_sbe_aggregate_total": self._ecc(handle, corrected, nv.NVML_AGGREGATE_ECC, "ecc_aggregate"),
            "ecc_dbe_aggregate_total": self._ecc(handle, uncorrected, nv.NVML_AGGREGATE_ECC, "ecc_aggregate"),
            "retired_pages_total": remapped,
            "remap_failure": remap_failure,
            "pcie_replay_total": int(replay) if replay is not None else None,
            "xid_total": self.xid_total[i],
            "last_xid": self.last_xid[i],
        }

    def _processes(self, i: int, handle: Any, now: float) -> list[dict[str, Any]]:
        procs = self._field("processes", self.nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        rows = []
        for p in procs:
            owner = self._attribute(int(p.pid))
            used = getattr(p, "usedGpuMemory", None)
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
                }
            )
        return rows

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
