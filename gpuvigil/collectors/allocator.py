"""PyTorch caching-allocator state: `torch.cuda.memory_stats()` JSON and memory snapshots.

The allocator keeps freed blocks cached inside the segments it reserved from CUDA. When a segment
is split by a long-lived tensor, the rest of it is an "inactive split" block that only a request
of at most that size can reuse: memory is reserved but unallocated, yet a larger request fails.
That is fragmentation, and it shows as

- memory_stats: `reserved_bytes.all.current − allocated_bytes.all.current` large,
  `inactive_split_bytes.all.current` large, and `num_alloc_retries` / `num_ooms` above zero;
- a snapshot (`torch.cuda.memory._snapshot()`, a pickle read with the restricted unpickler):
  the largest free block of every segment is smaller than the requests the job makes.

`expandable_segments:True` grows one segment in place instead, which is why the same program
(s4 in the H200 captures) does not fragment.

This module reads and summarises, and turns a saved reading into an `allocator_readings` row
(`stats_reading`, `snapshot_reading`); whether the state it reads is fragmentation or an OOM's
cause is decided by the registered detector `allocator_state` (thresholds: its block of
`gpuvigil/config/detectors.yaml`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.safe_pickle import looks_like_pickle, safe_load
from gpuvigil.errors import UserError

MAX_STATS_BYTES = 16 * 1024 * 1024
MAX_SNAPSHOT_BYTES = 256 * 1024 * 1024  # real snapshots of a full 141 GB device are tens of MB; bounded before reading (safe_pickle)
_SNIFF_BYTES = 64 * 1024


# ---------------------------------------------------------------- memory_stats


def parse_memory_stats(raw: Any, source: str) -> dict[str, int | float]:
    """Validate a decoded `memory_stats()` dict (flat, or wrapped as {"memory_stats": {...}})."""
    if isinstance(raw, dict) and isinstance(raw.get("memory_stats"), dict):
        raw = raw["memory_stats"]
    if not isinstance(raw, dict) or "allocated_bytes.all.current" not in raw or "reserved_bytes.all.current" not in raw:
        raise UserError(f"{source}: not torch.cuda.memory_stats() output (no allocated_bytes.all.current / reserved_bytes.all.current)")
    out: dict[str, int | float] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise UserError(f"{source}: memory_stats key {key!r} is not text")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            raise UserError(f"{source}: memory_stats value of {key!r} is {value!r}, expected a number")
        out[key] = value
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current"):
        if out[key] < 0:
            raise UserError(f"{source}: memory_stats {key} is negative ({out[key]})")
    return out


def read_memory_stats(path: str | Path) -> dict[str, int | float]:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_STATS_BYTES:
            raise UserError(f"{p}: larger than the {MAX_STATS_BYTES}-byte limit for memory_stats JSON")
        raw = json.loads(p.read_bytes())
    except OSError as exc:
        raise UserError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"{p}: not valid JSON: {str(exc).splitlines()[0][:120]}") from None
    return parse_memory_stats(raw, str(p))


def is_memory_stats(path: str | Path) -> bool:
    try:
        with Path(path).open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return False
    return head.lstrip()[:1] == b"{" and b'"allocated_bytes.all.current"' in head and b'"reserved_bytes.all.current"' in head


# ---------------------------------------------------------------- snapshots


@dataclass
class SegmentSummary:
    address: int | None
    total_bytes: int
    allocated_bytes: int
    largest_free_block_bytes: int
    free_bytes: int
    is_expandable: bool


@dataclass
class SnapshotSummary:
    source: str
    segments: list[SegmentSummary] = field(default_factory=list)
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    inactive_bytes: int = 0  # free blocks inside reserved segments
    largest_free_block_bytes: int = 0
    expandable_segments: bool = False
    alloc_conf: str | None = None
    oom_requests: list[dict[str, int | None]] = field(default_factory=list)  # {size, device_free}
    recurring_request_bytes: int | None = None  # largest request size that recurs in the trace
    trace_events: int = 0

    @property
    def unallocated_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes


def _int(value: Any, what: str, source: str, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"{source}: memory snapshot field {what} is {value!r}, expected a non-negative integer")
    return value


def summarize_snapshot(raw: Any, source: str, recurring_min_count: int = 2) -> SnapshotSummary:
    """Summarise a decoded `torch.cuda.memory._snapshot()` dict."""
    if not isinstance(raw, dict) or not isinstance(raw.get("segments"), list):
        raise UserError(f"{source}: not a torch.cuda.memory._snapshot() (no 'segments' list)")
    out = SnapshotSummary(source=source)
    settings = raw.get("allocator_settings")
    if isinstance(settings, dict):
        out.expandable_segments = bool(settings.get("expandable_segments", False))
        conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
        out.alloc_conf = conf if isinstance(conf, str) else None
    for i, seg in enumerate(raw["segments"]):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            raise UserError(f"{source}: memory snapshot segment {i} is not a mapping with a 'blocks' list")
        total = _int(seg.get("total_size"), f"segments[{i}].total_size", source)
        allocated = _int(seg.get("allocated_size"), f"segments[{i}].allocated_size", source, default=0)
        free_sizes = []
        for j, block in enumerate(seg.get("blocks", [])):
            if not isinstance(block, dict):
                raise UserError(f"{source}: memory snapshot segments[{i}].blocks[{j}] is not a mapping")
            if block.get("state") == "inactive":
                free_sizes.append(_int(block.get("size"), f"segments[{i}].blocks[{j}].size", source))
        address = seg.get("address")
        out.segments.append(
            SegmentSummary(
                address=address if isinstance(address, int) and not isinstance(address, bool) else None,
                total_bytes=total,
                allocated_bytes=allocated,
                largest_free_block_bytes=max(free_sizes, default=0),
                free_bytes=sum(free_sizes),
                is_expandable=bool(seg.get("is_expandable", False)),
            )
        )
        out.expandable_segments = out.expandable_segments or bool(seg.get("is_expandable", False))
    out.reserved_bytes = sum(s.total_bytes for s in out.segments)
    out.allocated_bytes = sum(s.allocated_bytes for s in out.segments)
    out.inactive_bytes = sum(s.free_bytes for s in out.segments)
    out.largest_free_block_bytes = max((s.largest_free_block_bytes for s in out.segments), default=0)

    traces = raw.get("device_traces") or []
    if not isinstance(traces, list):
        raise UserError(f"{source}: memory snapshot device_traces is not a list")
    alloc_sizes: Counter[int] = Counter()
    for device_trace in traces:
        if not isinstance(device_trace, list):
            continue
        for event in device_trace:
            if not isinstance(event, dict):
                continue
            out.trace_events += 1
            size = event.get("size")
            if not isinstance(size, int) or isinstance(size, bool):
                continue
            if event.get("action") == "oom":
                free = event.get("device_free")
                out.oom_requests.append({"size": size, "device_free": free if isinstance(free, int) else None})
            elif event.get("action") == "alloc":
                alloc_sizes[size] += 1
    recurring = [size for size, n in alloc_sizes.items() if n >= recurring_min_count]
    out.recurring_request_bytes = max(recurring, default=None)
    return out


def read_snapshot(path: str | Path, recurring_min_count: int = 2) -> SnapshotSummary:
    """A snapshot pickle's summary; a request size seen at least `recurring_min_count` times in
    the allocation trace is one the job keeps making."""
    p = Path(path)
    return summarize_snapshot(safe_load(p, max_bytes=MAX_SNAPSHOT_BYTES), str(p), recurring_min_count)


def is_snapshot(path: str | Path) -> bool:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            head = fh.read(16)
    except OSError:
        return False
    if not looks_like_pickle(head):
        return False
    try:
        raw = safe_load(p, max_bytes=MAX_SNAPSHOT_BYTES)
    except UserError:
        return False
    return isinstance(raw, dict) and isinstance(raw.get("segments"), list) and ("device_traces" in raw or "allocator_settings" in raw)


# ---------------------------------------------------------------- rows


def stats_row(
    stats: dict[str, int | float],
    *,
    ts: float,
    job: str | None = None,
    rank: int | None = None,
    node: str | None = None,
    gpu: int | None = None,
    largest_free_block_bytes: int | None = None,
    device_capacity_bytes: int | None = None,
    foreign_used_bytes: int | None = None,
) -> dict[str, Any]:
    """One ALLOCATOR_STATS row from a memory_stats dict."""
    return {
        "ts": ts,
        "job": job,
        "rank": rank,
        "node": node,
        "gpu": gpu,
        "allocated_bytes": int(stats["allocated_bytes.all.current"]),
        "reserved_bytes": int(stats["reserved_bytes.all.current"]),
        "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
        "largest_free_block_bytes": largest_free_block_bytes,
        "peak_allocated_bytes": int(stats["allocated_bytes.all.peak"]) if "allocated_bytes.all.peak" in stats else None,
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "oom_count": int(stats.get("num_ooms", 0)),
        "device_capacity_bytes": device_capacity_bytes,
        "foreign_used_bytes": foreign_used_bytes,
    }


def stats_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    return schemas.frame(rows, schemas.ALLOCATOR_STATS)


def stats_reading(stats: dict[str, int | float], source: str, *, ts: float, job: str | None = None, node: str | None = None, gpu: int | None = None) -> dict[str, Any]:
    """One `allocator_readings` row from a saved memory_stats dict."""
    return {
        "ts": ts,
        "job": job,
        "node": node,
        "gpu": gpu,
        "source": source,
        "reading": "memory_stats",
        "reserved_bytes": int(stats["reserved_bytes.all.current"]),
        "allocated_bytes": int(stats["allocated_bytes.all.current"]),
        "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
        "inactive_split_blocks": int(stats.get("inactive_split.all.current", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "oom_count": int(stats.get("num_ooms", 0)),
    }


def snapshot_reading(snap: SnapshotSummary, *, ts: float, job: str | None = None, node: str | None = None, gpu: int | None = None) -> dict[str, Any]:
    """One `allocator_readings` row from a snapshot's summary (its last OOM, if it recorded any)."""
    last_oom = snap.oom_requests[-1] if snap.oom_requests else {}
    return {
        "ts": ts,
        "job": job,
        "node": node,
        "gpu": gpu,
        "source": snap.source,
        "reading": "snapshot",
        "reserved_bytes": snap.reserved_bytes,
        "allocated_bytes": snap.allocated_bytes,
        "inactive_bytes": snap.inactive_bytes,
        "largest_free_block_bytes": snap.largest_free_block_bytes,
        "segments": len(snap.segments),
        "expandable_segments": snap.expandable_segments,
        "oom_request_bytes": last_oom.get("size"),
        "oom_device_free_bytes": last_oom.get("device_free"),
        "oom_events": len(snap.oom_requests),
        "recurring_request_bytes": snap.recurring_request_bytes,
    }


def readings_frame(rows: list[dict[str, Any]], source: str) -> pl.DataFrame:
    """`allocator_readings` rows; a number past int64 (a forged file) is refused naming `source`."""
    try:
        return schemas.frame(rows, schemas.ALLOCATOR_READINGS)
    except (OverflowError, TypeError, ValueError, pl.exceptions.PolarsError) as exc:
        raise UserError(f"{source}: memory reading holds a value out of range: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
