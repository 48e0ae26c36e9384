"""Polars schemas of every frame that crosses a stage boundary.

Collectors emit these frames, the pipeline windows them, detectors read them and the scheduler
publishes its state in them. Units are in the column names. Timestamps (`ts`) are seconds since
the Unix epoch (float64) for real sources and seconds of simulated time for the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

F64 = pl.Float64
I64 = pl.Int64
I32 = pl.Int32
STR = pl.Utf8
BOOL = pl.Boolean

GPU_SAMPLES = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,  # index on the node
        "gpu_uuid": STR,
        "memory_used_bytes": I64,
        "memory_total_bytes": I64,
        "util_ratio": F64,  # 0..1 SM busy
        "mem_util_ratio": F64,  # 0..1 memory controller busy
        "power_w": F64,
        "temperature_c": F64,
        "sm_clock_mhz": F64,
        "mem_clock_mhz": F64,
        "throttle_reasons": I64,  # NVML clock-event reasons bitmask
        "ecc_sbe_volatile_total": I64,
        "ecc_dbe_volatile_total": I64,
        "retired_pages_total": I64,  # remapped rows (Hopper) or retired pages (older)
        "remap_failure": BOOL,
        "pcie_replay_total": I64,
        "xid_total": I64,  # XIDs seen on this GPU so far
        "last_xid": I32,  # most recent XID code (DCGM semantics), null if none
        # Lifetime ECC counts (NVML aggregate counters, survive driver reloads); null if unknown.
        "ecc_sbe_aggregate_total": I64,
        "ecc_dbe_aggregate_total": I64,
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

EVENTS = pl.Schema(
    {
        "ts": F64,
        "node": STR,
        "gpu": I32,
        "source": STR,  # nvml | dcgm | kernel | nccl | torch | scheduler | sim
        "kind": STR,  # xid | ecc_dbe | ecc_sbe | oom | nccl_warn | nccl_timeout | ...
        "xid": I32,
        "job": STR,
        "rank": I32,
        "message": STR,
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

STREAMS: Mapping[str, pl.Schema] = {
    "gpu_samples": GPU_SAMPLES,
    "rank_progress": RANK_PROGRESS,
    "allocator_stats": ALLOCATOR_STATS,
    "events": EVENTS,
    "jobs": JOBS,
    "nodes": NODES,
    "allocations": ALLOCATIONS,
    "findings": FINDINGS,
    "hints": HINTS,
}


class SchemaError(ValueError):
    """A frame does not match the schema declared for its stream."""


def empty(schema: pl.Schema | str) -> pl.DataFrame:
    """An empty frame of a stream's schema."""
    if isinstance(schema, str):
        schema = STREAMS[schema]
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
