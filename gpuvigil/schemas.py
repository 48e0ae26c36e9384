"""Polars schemas of every frame that crosses a stage boundary.

Collectors emit these frames, the pipeline windows them, detectors read them and the scheduler
publishes its state in them. Units are in the column names. Timestamps (`ts`) are seconds since
the Unix epoch (float64) for real sources and seconds of simulated time for the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from gpuvigil import signals

F64 = pl.Float64
I64 = pl.Int64
I32 = pl.Int32
STR = pl.Utf8
BOOL = pl.Boolean

# One row per GPU per sample: the key columns and the telemetry of gpuvigil/signals.py, whose
# table gives each column's type, unit and the field of every real source that fills it.
GPU_SAMPLES = signals.gpu_samples_schema()

# Which pod / Slurm job uses a GPU, as dcgm-exporter's labels say (`pod`, `namespace`,
# `container`, `hpc_job`; null where it names none): the live collector and replay read them with
# the same function (collectors/dcgm.py), and the pipeline turns them into `gpu_jobs` rows.
GPU_WORKLOADS = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,
        "gpu_uuid": STR,
        "model_name": STR,
        "pci_bus_id": STR,
        "pod": STR,
        "namespace": STR,
        "container": STR,
        "hpc_job": STR,
    }
)

# One row per compute process on a GPU per sample (NVML running processes; per-process used
# memory), attributed to a job and rank where the scheduler's map or the process says so.
GPU_PROCESSES = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,
        "gpu_uuid": STR,
        "pid": I64,
        "used_memory_bytes": I64,  # null when the driver does not say (e.g. in a container)
        "slurm_job": STR,
        "pod_uid": STR,
        "container_id": STR,
        "job": STR,  # attributed job (null: not a job's process, i.e. foreign)
        "rank": I32,
    }
)

# NCCL Inspector (L1, profiler plugin, no code change): one row per completed collective per
# rank and communicator, as the plugin dumps it (JSON lines or Prometheus textfile).
COLLECTIVE_PROGRESS = pl.Schema(
    {
        "ts": F64,  # dump time
        "job": STR,
        "rank": I32,
        "node": STR,
        "gpu": I32,
        "comm_id": STR,
        "n_ranks": I32,
        "coll": STR,  # AllReduce, AllGather, ...
        "coll_sn": I64,  # the communicator's collective sequence number
        "msg_size_bytes": I64,
        "exec_time_us": F64,  # start → completion on this rank: the last rank to arrive waits least
        "busbw_gbs": F64,
    }
)

# Flight Recorder (L1): debug-info pipes found per rank, and cross-rank analyses of dumps.
FR_PIPES = pl.Schema({"ts": F64, "job": STR, "rank": I32, "node": STR, "path": STR})
FR_ANALYSIS = pl.Schema(
    {
        "ts": F64,  # when the dumps were analysed (read after the fact: the time the analysis describes)
        "job": STR,
        # on_demand | periodic | timeout (dumps written by the watchdog) | offline (dumps read
        # after the fact by `analyze` or `gpuvigil fr`: what they show is over, nothing is pending)
        "trigger": STR,
        "kind": STR,  # collective_hang | collective_mismatch | none
        "culprit_ranks": pl.List(I32),
        "ranks": pl.List(I32),
        "pg": STR,
        "seq": I64,
        "op": STR,
        "node": STR,
        "summary": STR,
        "dump_ts": F64,  # newest dump file's modification time
        "n_dumps": I32,
        "source": STR,  # the dump that shows it (the culprit's own, for a mismatch)
        "evidence_json": STR,  # the analysis's evidence (joined ranks, mismatch type, ...), JSON
    }
)

RANK_PROGRESS = pl.Schema(
    {
        "ts": F64,
        "job": STR,
        "rank": I32,
        "node": STR,
        "gpu": I32,
        "pg": STR,  # process group name/id
        "last_enqueued_seq": I64,
        "last_completed_seq": I64,
        "current_op": STR,  # e.g. ALLREDUCE, null when idle
        "step": I64,
        "step_time_seconds": F64,  # duration of the last completed step
        # Time this rank spent blocked in collectives during the last step (Flight Recorder
        # start→complete): the slowest rank waits least, so this names stragglers.
        "collective_wait_seconds": F64,
        # The last collective whose kernel started on this rank (the Flight Recorder's
        # `last_started_collective`; NCCL records it with TORCH_NCCL_ENABLE_TIMING=1, gloo never:
        # -1 or null there). A rank stuck in a kernel before the pending collective has enqueued
        # it like its peers but not started it.
        "last_started_seq": I64,
    }
)

ALLOCATOR_STATS = pl.Schema(
    {
        "ts": F64,
        "job": STR,
        "rank": I32,
        "node": STR,
        "gpu": I32,
        "allocated_bytes": I64,
        "reserved_bytes": I64,
        "inactive_split_bytes": I64,
        "largest_free_block_bytes": I64,
        "peak_allocated_bytes": I64,  # peak since the previous sample (per-step peak)
        "alloc_retries": I64,
        "oom_count": I64,
        "device_capacity_bytes": I64,
        "foreign_used_bytes": I64,  # device memory held by other processes
    }
)

# One reading of a PyTorch caching allocator's state saved to a file and read after the fact
# (collectors/allocator.py): a `torch.cuda.memory_stats()` JSON or a memory snapshot pickle, one
# row each. Only `analyze` fills it; the snapshot-only columns are null for memory_stats.
ALLOCATOR_READINGS = pl.Schema(
    {
        "ts": F64,
        "job": STR,
        "node": STR,
        "gpu": I32,
        "source": STR,  # the file it was read from
        "reading": STR,  # memory_stats | snapshot
        "reserved_bytes": I64,
        "allocated_bytes": I64,
        "inactive_split_bytes": I64,  # memory_stats: reserved bytes in inactive split blocks
        "inactive_split_blocks": I64,
        "alloc_retries": I64,  # memory_stats: cudaMalloc retried after freeing the cache
        "oom_count": I64,  # memory_stats: num_ooms
        "inactive_bytes": I64,  # snapshot: free blocks inside reserved segments
        "largest_free_block_bytes": I64,  # snapshot: the largest free block of any segment
        "segments": I64,
        "expandable_segments": BOOL,
        "oom_request_bytes": I64,  # snapshot: the size of the last request that failed
        "oom_device_free_bytes": I64,  # ... and the device's free memory then
        "oom_events": I64,  # snapshot: OOMs its trace recorded
        "recurring_request_bytes": I64,  # snapshot: the largest request the trace shows recurring
    }
)

# One GPU block of saved `nvidia-smi -q` output (parsers/nvidia_smi.py `health_rows`): its memory
# repairs and clock-event reasons as the block says them. Only `analyze` fills it.
SMI_HEALTH = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,  # null: the output gives the PCI bus id, not the index a scheduler uses
        "source": STR,  # the file it was read from
        "line": I64,  # the block's first line
        "gpu_block": I32,  # the block's place in the output
        "pci_bus_id": STR,
        "ecc_dbe_volatile_total": I64,
        "remap_failure": BOOL,
        "remap_pending": BOOL,
        "retired_pages_pending": BOOL,
        "thermal_reasons": pl.List(STR),  # HW/SW thermal or HW slowdown reasons shown Active
    }
)

# The active-findings gauges of a saved gpuvigil `/metrics` page, one row per sample
# (gpuvigil_node_findings_active, gpuvigil_job_findings_active). Only `analyze` fills it.
ACTIVE_FINDINGS = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "job": STR,
        "source": STR,  # the file it was read from
        "metric": STR,
        "kind": STR,
        "severity": STR,
        "active_count": F64,
    }
)

EVENTS = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,
        "source": STR,  # nvml | dcgm | kernel | nccl | torch | scheduler | sim; read from a log file: torch:<path>, nccl:<path>
        "kind": STR,  # xid | ecc_dbe | ecc_sbe | oom | nccl_warn | nccl_timeout | nccl_progress | nccl_error | ...
        "xid": I32,
        "job": STR,
        "rank": I32,
        "message": STR,
    }
)

# XID incidents of a whole kernel log read after the fact (`analyze`): one row per burst of the
# same XID on the same GPU (collectors/kernel_log.py `incidents`), with what the live `events`
# rows of the same lines do not keep: the PCI bus id, the first line, the processes named, the
# codes the lines carried. Only analyze fills it; serve's `xid` detector judges the lines as events.
XID_INCIDENT_COLUMNS = pl.Schema(
    {
        "node": STR,
        "pci_bus_id": STR,
        "gpu": I32,
        "xid": I32,
        "first_ts": F64,
        "last_ts": F64,
        "count": pl.UInt32,
        "first_line": I64,
        "message": STR,
        "pids": pl.List(I64),
        "processes": pl.List(STR),
        "ts_kind": STR,  # how first_ts was read: wall-clock stamp, since boot, none (the file's time)
        # the codes the lines carried (e.g. [45] for lines "caused by previous Xid <xid>")
        "reported_xids": pl.List(I32),
    }
)
XID_INCIDENTS = pl.Schema(
    {
        "ts": F64,  # when the log was read (the incident's own times are first_ts and last_ts)
        "file": STR,  # the log, as the user named it (null: text handed over without a name)
        "job": STR,  # the job the user says the log is about (--job), if any
        **XID_INCIDENT_COLUMNS,
    }
)

JOBS = pl.Schema(
    {
        "job": STR,
        "tenant": STR,
        "priority": STR,  # P0 | P1 | P2
        "n_gpus": I32,
        "gpus_per_node": I32,  # null = any spread; else full-node gang shape
        "state": STR,  # pending | running | preempted | requeued | completed | failed
        "submit_ts": F64,
        "start_ts": F64,
        "last_checkpoint_step": I64,
        "restarts": I32,
        "alloc_conf": STR,
        "excluded_nodes": STR,  # comma separated
    }
)

NODES = pl.Schema(
    {
        "node": STR,
        "rack": STR,
        "n_gpus": I32,
        "gpu_memory_bytes": I64,
        "state": STR,  # up | cordoned | draining | drained | down
        "reason": STR,
        "free_gpus": I32,
    }
)

ALLOCATIONS = pl.Schema(
    {
        "job": STR,
        "rank": I32,
        "node": STR,
        "gpu": I32,
    }
)

FINDINGS = pl.Schema(
    {
        "id": STR,
        "kind": STR,
        "severity": STR,
        "ts": F64,
        "job": STR,
        "ranks": pl.List(I32),
        "node": STR,
        "gpu": I32,
        "xid": I32,
        "summary": STR,
        "evidence_json": STR,
        "source": STR,
    }
)

HINTS = pl.Schema(
    {
        "id": STR,
        "action": STR,
        "ts": F64,
        "job": STR,
        "node": STR,
        "gpu": I32,
        "reason": STR,
        "finding_id": STR,
        "finding_kind": STR,
        "params_json": STR,
    }
)

# Which job (and rank) uses which GPU on a node, from the node itself (collectors/jobmap.py):
# dcgm-exporter's HPC job-mapping files, the kubelet PodResources API, `scontrol pidinfo`, and the
# environment / cgroup of the processes NVML lists on the GPU. One row per GPU and job. The
# pipeline keeps the latest as a snapshot, fills job/rank of per-GPU rows from it and adds it to
# `allocations` where the scheduler placed nothing (pipeline/jobjoin.py).
GPU_JOBS = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,
        "gpu_uuid": STR,
        "job": STR,
        "rank": I32,  # global rank of the job's process on this GPU (RANK / SLURM_PROCID)
        "local_rank": I32,
        "pod": STR,
        "namespace": STR,
        "pid": I64,
        "source": STR,  # hpc_job_mapping | slurm_pidinfo | proc_environ | proc_cgroup | podresources | dcgm_hpc_job | dcgm_pod
    }
)

# InfiniBand/RoCE ports read from sysfs (collectors/infiniband.py), one row per port per read;
# a row without a device says the node was read and has no port. Counters kept as columns: the
# PortCounters (counters/) and the mlx5 driver's own (hw_counters/); a file absent on this driver
# is null, and a name present in both directories is read from counters/.
IB_PORT_COUNTERS = (
    "link_downed",
    "link_error_recovery",
    "symbol_error",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "port_xmit_wait",
    "VL15_dropped",
    "port_xmit_data",
    "port_rcv_data",
)
IB_HW_COUNTERS = ("out_of_buffer", "out_of_sequence", "local_ack_timeout_err", "packet_seq_err", "rnr_nak_retry_err", "implied_nak_seq_err")
IB_COUNTERS = IB_PORT_COUNTERS + IB_HW_COUNTERS


def ib_column(counter: str) -> str:
    """A counter file's column name (VL15_dropped -> vl15_dropped)."""
    return counter.lower()


IB_PORTS = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "device": STR,  # mlx5_0
        "port": I32,
        "link_layer": STR,  # InfiniBand | Ethernet
        "state": STR,  # DOWN | INIT | ARMED | ACTIVE | ACTIVE_DEFER
        "phys_state": STR,  # Sleep | Polling | Disabled | LinkUp | LinkErrorRecovery | ...
        "rate_gbps": F64,
        "width": I32,  # active lanes: 1, 2, 4, 8, 12
        "speed": STR,  # SDR ... HDR, NDR, XDR
        "pci_bus_id": STR,  # the HCA's PCI function, as sysfs names it
        "numa_node": I32,
        "gpus": pl.List(I32),  # GPUs the port serves (empty: the node as a whole)
        "affinity": STR,  # pcie | numa | node
        **{ib_column(c): I64 for c in IB_COUNTERS},
    }
)

STREAMS: Mapping[str, pl.Schema] = {
    "ib_ports": IB_PORTS,
    "gpu_jobs": GPU_JOBS,
    "gpu_samples": GPU_SAMPLES,
    "gpu_workloads": GPU_WORKLOADS,
    "rank_progress": RANK_PROGRESS,
    "allocator_stats": ALLOCATOR_STATS,
    "allocator_readings": ALLOCATOR_READINGS,
    "smi_health": SMI_HEALTH,
    "active_findings": ACTIVE_FINDINGS,
    "events": EVENTS,
    "jobs": JOBS,
    "nodes": NODES,
    "allocations": ALLOCATIONS,
    "gpu_processes": GPU_PROCESSES,
    "collective_progress": COLLECTIVE_PROGRESS,
    "fr_pipes": FR_PIPES,
    "fr_analysis": FR_ANALYSIS,
    "xid_incidents": XID_INCIDENTS,
    "findings": FINDINGS,
    "hints": HINTS,
}


class SchemaError(ValueError):
    """A frame does not match the schema declared for its stream."""


_EMPTY: dict[str, pl.DataFrame] = {}


def empty(schema: pl.Schema | str) -> pl.DataFrame:
    """An empty frame of a stream's schema."""
    if isinstance(schema, str):
        # Built once per stream: constructing a frame from a schema costs ~0.5 ms, and windows
        # hand out empty streams to every detector on every tick. A clone is ~1 µs and keeps
        # the cached one safe from in-place edits.
        df = _EMPTY.get(schema)
        if df is None:
            df = _EMPTY[schema] = pl.DataFrame(schema=STREAMS[schema])
        return df.clone()
    return pl.DataFrame(schema=schema)


def conform(df: pl.DataFrame, schema: pl.Schema | str, *, stream: str = "") -> pl.DataFrame:
    """Return `df` with exactly the schema's columns, in order and type.

    Missing nullable columns are added as nulls; extra columns are dropped; types are cast
    strictly, so a value that cannot be represented raises `SchemaError` instead of silently
    turning into null.
    """
    if isinstance(schema, str):
        stream = stream or schema
        schema = STREAMS[schema]
    if "ts" in schema and "ts" not in df.columns:
        raise SchemaError(f"{stream or 'frame'}: missing required column 'ts'")
    try:
        return df.select(
            [
                (pl.col(name) if name in df.columns else pl.lit(None)).cast(dtype, strict=True).alias(name)
                for name, dtype in schema.items()
            ]
        )
    except (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError) as exc:
        raise SchemaError(f"{stream or 'frame'}: {exc}".splitlines()[0]) from exc


def frame(rows: list[dict], schema: pl.Schema | str) -> pl.DataFrame:
    """Build a frame of `schema` from row dicts (missing keys become nulls)."""
    if isinstance(schema, str):
        schema = STREAMS[schema]
    if not rows:
        return empty(schema)
    return pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema, orient="row")
