"""The telemetry columns of `gpu_samples`, and where each comes from: one table.

Every column of `gpu_samples` is a row of `GPU_SIGNALS`: its polars type and unit, the field
that each real source has for it (the `DCGM_FI_*` series dcgm-exporter exports and how it maps
onto the column, the NVML call, the in-process hook's record field, gpuvigil's own Prometheus
series) and which real collectors fill it under their default configuration. The `gpu_samples`
schema (`schemas.GPU_SAMPLES`), dcgm-exporter's mapping (live: `collectors/dcgm.py`; replayed
from Prometheus or files: `replay.py`, through the same function) and the replay of gpuvigil's
own series are derived from it, so a column added here reaches every reader at once.

Sources, as gpuvigil runs them by default:
- `nvml`: the NVML collector, one sample a second;
- `dcgm`: dcgm-exporter scraped (or replayed) at its 30 s default with its default counters
  (`etc/default-counters.csv`, the field list tests/data/dcgm/node07_constructed.prom follows);
  fields it exports only once added to its counters file (ECC, the profiling fields) are
  `dcgm_opt_in`;
- `hook`: the in-process hook (torch), one record a step;
- `logs`: kernel and NCCL logs.
A column that no real source fills (`producers` empty) is filled only by the simulator.

Only polars is imported: `schemas` builds on this table and sits below everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import polars as pl

MIB = 1 << 20

# Real sources. `dcgm_opt_in`: dcgm-exporter exports the field once it is in its counters file.
# Beyond the GPU telemetry: NCCL Inspector's dumps, Flight Recorder dumps and pipes, the node's
# GPU -> job map (collectors/jobmap.py), the scheduler's state (built-in or Slurm) and the node's
# InfiniBand/RoCE ports read from sysfs (collectors/infiniband.py).
SOURCES = ("nvml", "dcgm", "dcgm_opt_in", "hook", "logs", "nccl_inspector", "flight_recorder", "jobmap", "scheduler", "infiniband")
DEFAULT_SOURCES = ("nvml", "dcgm", "hook", "logs", "nccl_inspector", "flight_recorder", "jobmap", "scheduler", "infiniband")


@dataclass(frozen=True)
class Dcgm:
    """How dcgm-exporter series become one column.

    `fields`: the DCGM field names, as dcgm-exporter names its series. `how`: how they combine
    (a key of `DCGM_COMBINE`). `scale`: the factor from DCGM's unit to the column's. `default`:
    the fields dcgm-exporter exports with its default counters (the others need adding to its
    counters file)."""

    fields: tuple[str, ...]
    how: str = "value"
    scale: float = 1.0
    default: tuple[str, ...] = ()


@dataclass(frozen=True)
class Signal:
    name: str
    dtype: pl.DataType
    unit: str
    description: str
    dcgm: Dcgm | None = None
    nvml: str | None = None  # the NVML call that reads it
    hook: str | None = None  # the field of the in-process hook's record
    prometheus: str | None = None  # gpuvigil's exporter series (sample name as scraped)
    prometheus_scale: float = 1.0  # series value = column value x this
    prometheus_help: str = ""  # the exporter series' HELP text
    # Real collectors that fill it under their default configuration (see the module's doc).
    producers: frozenset[str] = field(default_factory=frozenset)


def _p(*names: str) -> frozenset[str]:
    return frozenset(names)


F64, I64, I32, STR, BOOL = pl.Float64(), pl.Int64(), pl.Int32(), pl.String(), pl.Boolean()

# The key columns of a GPU sample: every source fills them.
GPU_KEY: tuple[Signal, ...] = (
    Signal("ts", F64, "s", "sample time, seconds since the Unix epoch (simulated seconds in the simulator)", producers=_p("nvml", "dcgm")),
    Signal("node", STR, "", "host name (dcgm-exporter: the Hostname label)", producers=_p("nvml", "dcgm")),
    Signal("gpu", I32, "", "GPU index on the node (dcgm-exporter: the gpu label)", nvml="nvmlDeviceGetHandleByIndex", producers=_p("nvml", "dcgm")),
    Signal("gpu_uuid", STR, "", "GPU UUID (dcgm-exporter: the UUID label)", nvml="nvmlDeviceGetUUID", producers=_p("nvml", "dcgm")),
)

# The telemetry columns, in schema order.
GPU_SIGNALS: tuple[Signal, ...] = (
    Signal(
        "memory_used_bytes", I64, "B", "device memory in use",
        dcgm=Dcgm(("DCGM_FI_DEV_FB_USED",), scale=MIB, default=("DCGM_FI_DEV_FB_USED",)),
        nvml="nvmlDeviceGetMemoryInfo", prometheus="gpuvigil_gpu_memory_used_bytes", prometheus_help="Device memory in use.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "memory_total_bytes", I64, "B", "device memory capacity (DCGM without FB_TOTAL: used + free + reserved)",
        dcgm=Dcgm(
            ("DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"), how="total_or_parts", scale=MIB,
            default=("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"),
        ),
        nvml="nvmlDeviceGetMemoryInfo", prometheus="gpuvigil_gpu_memory_total_bytes", prometheus_help="Device memory capacity.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "util_ratio", F64, "ratio", "0..1 of the time a kernel ran (SM busy)",
        dcgm=Dcgm(("DCGM_FI_DEV_GPU_UTIL",), scale=0.01, default=("DCGM_FI_DEV_GPU_UTIL",)),
        nvml="nvmlDeviceGetUtilizationRates", prometheus="gpuvigil_gpu_utilization_ratio", prometheus_help="Fraction of time the SMs were busy (0..1).", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "mem_util_ratio", F64, "ratio", "0..1 of the time the memory controller was busy",
        dcgm=Dcgm(("DCGM_FI_DEV_MEM_COPY_UTIL",), scale=0.01, default=("DCGM_FI_DEV_MEM_COPY_UTIL",)),
        nvml="nvmlDeviceGetUtilizationRates", prometheus="gpuvigil_gpu_memory_utilization_ratio", prometheus_help="Fraction of time the memory controller was busy (0..1).", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "power_w", F64, "W", "board power draw",
        dcgm=Dcgm(("DCGM_FI_DEV_POWER_USAGE",), default=("DCGM_FI_DEV_POWER_USAGE",)),
        nvml="nvmlDeviceGetPowerUsage", prometheus="gpuvigil_gpu_power_watts", prometheus_help="Board power draw.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "temperature_c", F64, "degC", "GPU core temperature",
        dcgm=Dcgm(("DCGM_FI_DEV_GPU_TEMP",), default=("DCGM_FI_DEV_GPU_TEMP",)),
        nvml="nvmlDeviceGetTemperature", prometheus="gpuvigil_gpu_temperature_celsius", prometheus_help="GPU core temperature.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "sm_clock_mhz", F64, "MHz", "SM clock",
        dcgm=Dcgm(("DCGM_FI_DEV_SM_CLOCK",), default=("DCGM_FI_DEV_SM_CLOCK",)),
        nvml="nvmlDeviceGetClockInfo", prometheus="gpuvigil_gpu_sm_clock_hertz", prometheus_help="SM clock.", prometheus_scale=1e6, producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "mem_clock_mhz", F64, "MHz", "memory clock",
        dcgm=Dcgm(("DCGM_FI_DEV_MEM_CLOCK",), default=("DCGM_FI_DEV_MEM_CLOCK",)),
        nvml="nvmlDeviceGetClockInfo", prometheus="gpuvigil_gpu_memory_clock_hertz", prometheus_help="Memory clock.", prometheus_scale=1e6, producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "throttle_reasons", I64, "bitmask", "NVML clock-event reasons (DCGM's older field name first renamed, either taken)",
        dcgm=Dcgm(("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"), how="coalesce"),
        nvml="nvmlDeviceGetCurrentClocksEventReasons", prometheus="gpuvigil_gpu_throttle_reasons", prometheus_help="NVML clock-event reasons bitmask (see gpuvigil_gpu_clock_throttled).", producers=_p("nvml"),
    ),
    Signal(
        "ecc_sbe_volatile_total", I64, "count", "corrected ECC errors since the driver loaded",
        dcgm=Dcgm(("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",)),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_ECC_SBE_VOL_TOTAL)", prometheus="gpuvigil_gpu_ecc_sbe_errors_total", prometheus_help="Corrected (single-bit) ECC errors since the driver loaded.", producers=_p("nvml"),
    ),
    Signal(
        "ecc_dbe_volatile_total", I64, "count", "uncorrected ECC errors since the driver loaded",
        dcgm=Dcgm(("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",)),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_ECC_DBE_VOL_TOTAL)", prometheus="gpuvigil_gpu_ecc_dbe_errors_total", prometheus_help="Uncorrected (double-bit) ECC errors since the driver loaded.", producers=_p("nvml"),
    ),
    Signal(
        "retired_pages_total", I64, "count", "remapped rows (Ampere and later) or retired pages (older GPUs)",
        dcgm=Dcgm(
            ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"), how="sum",
            default=("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
        ),
        nvml="nvmlDeviceGetRemappedRows", prometheus="gpuvigil_gpu_retired_pages_total", prometheus_help="Remapped rows (Hopper) or retired pages.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "remap_failure", BOOL, "flag", "row remapping failed (the GPU needs service)",
        dcgm=Dcgm(("DCGM_FI_DEV_ROW_REMAP_FAILURE",), how="positive", default=("DCGM_FI_DEV_ROW_REMAP_FAILURE",)),
        nvml="nvmlDeviceGetRemappedRows", prometheus="gpuvigil_gpu_row_remap_failure",
        prometheus_help="1 when row remapping failed (the GPU needs service).", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "pcie_replay_total", I64, "count", "PCIe replays",
        dcgm=Dcgm(("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), default=("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",)),
        nvml="nvmlDeviceGetPcieReplayCounter", prometheus="gpuvigil_gpu_pcie_replays_total", prometheus_help="PCIe replay events.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "xid_total", I64, "count", "XIDs seen on this GPU so far (DCGM: changes of its last XID, counted by whoever watches successive samples)",
        nvml="nvmlEventSetWait (nvmlEventTypeXidCriticalError)", prometheus="gpuvigil_gpu_xid_errors_total", prometheus_help="XID errors reported for this GPU.", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "last_xid", I32, "code", "most recent XID (DCGM semantics), null if none",
        dcgm=Dcgm(("DCGM_FI_DEV_XID_ERRORS",), how="nonzero", default=("DCGM_FI_DEV_XID_ERRORS",)),
        nvml="nvmlEventSetWait (nvmlEventTypeXidCriticalError)", prometheus="gpuvigil_gpu_last_xid", prometheus_help="Most recent XID code on this GPU (0 when none).", producers=_p("nvml", "dcgm"),
    ),
    Signal(
        "ecc_sbe_aggregate_total", I64, "count", "lifetime corrected ECC errors (survive driver reloads)",
        dcgm=Dcgm(("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",)),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_ECC_SBE_AGG_TOTAL)", producers=_p("nvml"),
    ),
    Signal(
        "ecc_dbe_aggregate_total", I64, "count", "lifetime uncorrected ECC errors (survive driver reloads)",
        dcgm=Dcgm(("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",)),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_ECC_DBE_AGG_TOTAL)", producers=_p("nvml"),
    ),
    Signal(
        "pcie_tx_bytes_per_second", F64, "B/s", "PCIe transmit throughput",
        dcgm=Dcgm(("DCGM_FI_PROF_PCIE_TX_BYTES",)),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_PCIE_COUNT_TX_BYTES), differenced", producers=_p("nvml"),
    ),
    Signal(
        "pcie_rx_bytes_per_second", F64, "B/s", "PCIe receive throughput",
        dcgm=Dcgm(("DCGM_FI_PROF_PCIE_RX_BYTES",)),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_PCIE_COUNT_RX_BYTES), differenced", producers=_p("nvml"),
    ),
    Signal(
        "nvlink_crc_errors_total", I64, "count", "NVLink flits and data packets that failed their CRC check, summed over the GPU's links",
        dcgm=Dcgm(("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"), how="sum"),
        nvml="nvmlDeviceGetNvLinkErrorCounter (NVML_NVLINK_ERROR_DL_CRC_FLIT + NVML_NVLINK_ERROR_DL_CRC_DATA), summed over links",
        prometheus="gpuvigil_gpu_nvlink_crc_errors_total", prometheus_help="NVLink CRC errors (flit and data) summed over the GPU's links.",
    ),
    Signal("nvlink_tx_bytes_per_second", F64, "B/s", "NVLink transmit throughput", dcgm=Dcgm(("DCGM_FI_PROF_NVLINK_TX_BYTES",))),
    Signal("nvlink_rx_bytes_per_second", F64, "B/s", "NVLink receive throughput", dcgm=Dcgm(("DCGM_FI_PROF_NVLINK_RX_BYTES",))),
    Signal(
        "sm_active_ratio", F64, "ratio", "0..1 of the cycles an SM had a warp (falls when a spinning NCCL kernel is all that runs)",
        dcgm=Dcgm(("DCGM_FI_PROF_SM_ACTIVE",)),
    ),
    Signal("tensor_active_ratio", F64, "ratio", "0..1 of the cycles the tensor pipes were busy", dcgm=Dcgm(("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",))),
    Signal("dram_active_ratio", F64, "ratio", "0..1 of the cycles the memory interface was busy", dcgm=Dcgm(("DCGM_FI_PROF_DRAM_ACTIVE",))),
    Signal(
        "memory_reserved_bytes", I64, "B", "driver-reserved device memory: capacity usable by processes = total - this",
        dcgm=Dcgm(("DCGM_FI_DEV_FB_RESERVED",), scale=MIB),
        nvml="nvmlDeviceGetMemoryInfo (v2 reserved)", producers=_p("nvml"),
    ),
    Signal(
        "nvlink_links_total", I32, "count", "NVLinks the GPU has (0: a PCIe GPU without NVLink; null: not read)",
        nvml="nvmlDeviceGetNvLinkState (the links that answer)", prometheus="gpuvigil_gpu_nvlink_links", prometheus_help="NVLinks the GPU has (0 on a PCIe GPU without NVLink).", producers=_p("nvml"),
    ),
    Signal(
        "nvlink_links_up", I32, "count", "NVLinks in the enabled (up) state",
        nvml="nvmlDeviceGetNvLinkState", prometheus="gpuvigil_gpu_nvlink_links_up", prometheus_help="NVLinks in the enabled (up) state.", producers=_p("nvml"),
    ),
    Signal(
        "fabric_manager_status", I32, "code",
        "the GPU's NVLink fabric (Fabric Manager / IMEX) as DCGM's dcgmFabricManagerStatus_t: 0 not supported, 1 not started, "
        "2 in progress, 3 success, 4 failure, 5 unrecognized, 6 NVML too old (NVML: state, and status once completed)",
        dcgm=Dcgm(("DCGM_FI_DEV_FABRIC_MANAGER_STATUS",)),
        nvml="nvmlDeviceGetGpuFabricInfo", prometheus="gpuvigil_gpu_fabric_manager_status",
        prometheus_help="The GPU's NVLink fabric state as DCGM's dcgmFabricManagerStatus_t (0 not supported, 1 not started, 2 in progress, 3 success, 4 failure).", producers=_p("nvml"),
    ),
    Signal(
        "row_remap_pending", BOOL, "flag", "a row remap waits for a GPU reset to take effect",
        dcgm=Dcgm(("DCGM_FI_DEV_ROW_REMAP_PENDING",), how="positive"),
        nvml="nvmlDeviceGetRemappedRows (isPending)", prometheus="gpuvigil_gpu_row_remap_pending", prometheus_help="1 when a row remap waits for a GPU reset.", producers=_p("nvml"),
    ),
    Signal(
        "retired_pages_pending", BOOL, "flag", "pages wait for a reboot to be retired (GPUs before Ampere)",
        dcgm=Dcgm(("DCGM_FI_DEV_RETIRED_PENDING",), how="positive"),
        nvml="nvmlDeviceGetFieldValues(NVML_FI_DEV_RETIRED_PENDING)", prometheus="gpuvigil_gpu_retired_pages_pending", prometheus_help="1 when pages wait for a reboot to be retired (GPUs before Ampere).", producers=_p("nvml"),
    ),
)

GPU_COLUMNS: tuple[Signal, ...] = GPU_KEY + GPU_SIGNALS


@dataclass(frozen=True)
class StreamSources:
    """The real sources of a stream's columns: `sources` fill every column except those named in
    `columns` (column -> its own sources; empty: only the simulator fills it, with why)."""

    sources: tuple[str, ...]
    columns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    why: Mapping[str, str] = field(default_factory=dict)


# The other streams detectors read, by column. A stream's schema is in schemas.py; this says who
# fills it on a real cluster.
STREAM_SOURCES: Mapping[str, StreamSources] = {
    "rank_progress": StreamSources(
        ("hook",),
        {"collective_wait_seconds": ()},
        {"collective_wait_seconds": "the hook reports step times and collective sequence numbers, not the time a rank waited in collectives"},
    ),
    "allocator_stats": StreamSources(
        ("hook",),
        {"largest_free_block_bytes": ()},
        {"largest_free_block_bytes": "memory_stats has no largest free block; only a memory snapshot read offline (analyze) has it"},
    ),
    # memory_stats JSON and snapshot pickles a job saved, read by analyze (collectors/allocator.py)
    "allocator_readings": StreamSources(("allocator",)),
    # saved `nvidia-smi -q` output and a saved gpuvigil /metrics page, read by analyze
    "smi_health": StreamSources(("nvidia_smi",)),
    "active_findings": StreamSources(("gpuvigil",)),
    # XIDs from NVML events, dcgm-exporter's last XID and the kernel log; NCCL timeouts, progress,
    # errors and warnings and OOM lines from logs; Slurm's node and job events. job/rank: where a log line names them, else the job map.
    "events": StreamSources(("nvml", "dcgm", "logs", "scheduler"), {"job": ("logs", "scheduler", "jobmap"), "rank": ("logs", "jobmap")}),
    "gpu_processes": StreamSources(("nvml",)),
    "collective_progress": StreamSources(("nccl_inspector",)),
    "fr_pipes": StreamSources(("flight_recorder",)),
    "fr_analysis": StreamSources(("flight_recorder",)),
    # a whole kernel log read after the fact (analyze); live, the same lines are `events` rows
    "xid_incidents": StreamSources(("logs",)),
    "gpu_jobs": StreamSources(("jobmap",)),
    "gpu_workloads": StreamSources(("dcgm",)),
    "jobs": StreamSources(("scheduler",)),
    "nodes": StreamSources(("scheduler",)),
    # the scheduler's placements, and the node's own job map where it placed nothing (pipeline/jobjoin.py)
    "allocations": StreamSources(("scheduler", "jobmap", "dcgm")),
    # every column from sysfs; the GPUs a port serves from sysfs' PCI tree and NVML's bus ids
    "ib_ports": StreamSources(("infiniband",), {"gpus": ("infiniband", "nvml"), "affinity": ("infiniband", "nvml")}),
}


def column_sources(stream: str, column: str) -> frozenset[str]:
    """The real sources of a stream's column (empty: only the simulator fills it)."""
    if stream == "gpu_samples":
        return producers(BY_NAME[column])
    spec = STREAM_SOURCES[stream]
    return frozenset(spec.columns.get(column, spec.sources))
BY_NAME: Mapping[str, Signal] = {s.name: s for s in GPU_COLUMNS}


def producers(signal: Signal) -> frozenset[str]:
    """Every real source of the column: its default producers, and dcgm-exporter where one of its
    fields must first be added to dcgm-exporter's counters file (`dcgm_opt_in`)."""
    out = set(signal.producers)
    if signal.dcgm is not None and "dcgm" not in out:
        out.add("dcgm_opt_in")
    return frozenset(out)


# -- derived: the schema ------------------------------------------------------------------------
def gpu_samples_schema() -> pl.Schema:
    return pl.Schema({s.name: s.dtype for s in GPU_COLUMNS})


# -- derived: dcgm-exporter's series -> columns ---------------------------------------------------
def _sum_present(cols: Sequence[pl.Expr]) -> pl.Expr:
    """Sum of the fields present (null only where all are null)."""
    return pl.when(pl.any_horizontal([c.is_not_null() for c in cols])).then(pl.sum_horizontal(cols))


def _total_or_parts(cols: Sequence[pl.Expr]) -> pl.Expr:
    total, used, free, reserved = cols
    # without FB_TOTAL the capacity is used + free (+ reserved, newer exporters); used alone is not it
    return pl.coalesce(total, pl.when(used.is_not_null() & free.is_not_null()).then(used + free + reserved.fill_null(0)))


# How a Dcgm's fields (already scaled) combine into the column's value.
DCGM_COMBINE: Mapping[str, Callable[[Sequence[pl.Expr]], pl.Expr]] = {
    "value": lambda cols: cols[0],
    "coalesce": lambda cols: pl.coalesce(cols),
    "sum": _sum_present,
    "total_or_parts": _total_or_parts,
    "positive": lambda cols: cols[0] > 0,  # a 0/1 gauge
    "nonzero": lambda cols: pl.when(cols[0] > 0).then(cols[0]),  # DCGM's 0 means "none"
}

DCGM_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(f for s in GPU_SIGNALS if s.dcgm for f in s.dcgm.fields))


def _cast(expr: pl.Expr, dtype: pl.DataType) -> pl.Expr:
    if dtype.is_integer():
        return expr.round(0).cast(dtype)
    return expr.cast(dtype)


def dcgm_expressions(present: Sequence[str]) -> list[pl.Expr]:
    """One expression per DCGM-fed column over a frame with one Float64 column per DCGM field in
    `present` (values in DCGM's units); a field not present reads as null."""
    have = set(present)

    def field_col(name: str, scale: float) -> pl.Expr:
        col = pl.col(name) if name in have else pl.lit(None, pl.Float64)
        return col * scale if scale != 1.0 else col

    return [
        _cast(DCGM_COMBINE[s.dcgm.how]([field_col(f, s.dcgm.scale) for f in s.dcgm.fields]), s.dtype).alias(s.name)
        for s in GPU_SIGNALS
        if s.dcgm is not None
    ]


# -- derived: gpuvigil's own series -> columns ---------------------------------------------------
def prometheus_fields() -> dict[str, tuple[str, float]]:
    """gpuvigil's exporter series -> (column, factor from the series' unit to the column's)."""
    return {s.prometheus: (s.name, 1.0 / s.prometheus_scale) for s in GPU_SIGNALS if s.prometheus}


def nvml_calls() -> dict[str, str]:
    """Column -> the NVML call that reads it (columns NVML has)."""
    return {s.name: s.nvml for s in GPU_COLUMNS if s.nvml}


__all__ = [
    "BY_NAME",
    "STREAM_SOURCES",
    "StreamSources",
    "column_sources",
    "DCGM_COMBINE",
    "DCGM_FIELDS",
    "DEFAULT_SOURCES",
    "GPU_COLUMNS",
    "GPU_SIGNALS",
    "SOURCES",
    "Dcgm",
    "Signal",
    "dcgm_expressions",
    "gpu_samples_schema",
    "nvml_calls",
    "producers",
    "prometheus_fields",
]
