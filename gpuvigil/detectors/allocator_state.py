"""What a PyTorch caching allocator's state read after the fact means (`torch.cuda.memory_stats()`
JSON, memory snapshot pickles, read by `gpuvigil.collectors.allocator`):

- `fragmentation_allocator` (ticket): PyTorch holds memory reserved but unallocated (at least
  `min_unallocated_bytes` and `min_unallocated_share` of what it reserved), and requests do not
  fit in the holes: the snapshot's largest free block is smaller than the failed request or the
  request the job keeps making; from memory_stats alone, the allocator had to retry or ran out;
- `oom_fragmentation` / `oom_capacity` (page): a snapshot that recorded an OOM, by whether the
  reserved but unallocated memory could have held the failed request.

One reading has no history: the trend detector over `allocator_stats`
(detectors/fragmentation_allocator.py) is what `serve` runs on the same numbers.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, Field

from gpuvigil import config
from gpuvigil.model import Finding, FindingKind, Severity

GIB = 1 << 30


class AllocatorConfig(BaseModel):
    min_unallocated_bytes: int = Field(2 * GIB, ge=0)
    min_unallocated_share: float = Field(0.10, ge=0, le=1)
    recurring_min_count: int = Field(2, ge=1)
    remedy_alloc_conf: str = "expandable_segments:True"


def load_config(cfg: dict[str, Any] | None = None) -> AllocatorConfig:
    return config.section("allocator", AllocatorConfig, cfg)


def _gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


class Snapshot(Protocol):
    """A memory snapshot's summary, as the allocator reader returns it."""

    source: str
    segments: list[Any]
    reserved_bytes: int
    allocated_bytes: int
    inactive_bytes: int
    largest_free_block_bytes: int
    expandable_segments: bool
    oom_requests: list[dict[str, int | None]]
    recurring_request_bytes: int | None

    @property
    def unallocated_bytes(self) -> int: ...


def _fragmented(unallocated: int, reserved: int, c: AllocatorConfig) -> bool:
    return reserved > 0 and unallocated >= c.min_unallocated_bytes and unallocated / reserved >= c.min_unallocated_share


def findings_for_stats(stats: dict[str, int | float], source: str, *, ts: float = 0.0, job: str | None = None,
                       node: str | None = None, gpu: int | None = None, cfg: dict[str, Any] | None = None) -> list[Finding]:
    c = load_config(cfg)
    allocated = int(stats["allocated_bytes.all.current"])
    reserved = int(stats["reserved_bytes.all.current"])
    unallocated = reserved - allocated
    retries = int(stats.get("num_alloc_retries", 0))
    ooms = int(stats.get("num_ooms", 0))
    if not (_fragmented(unallocated, reserved, c) and (retries > 0 or ooms > 0)):
        return []
    inactive = int(stats.get("inactive_split_bytes.all.current", 0))
    return [
        Finding(
            kind=FindingKind.FRAGMENTATION_ALLOCATOR,
            severity=Severity.TICKET,
            ts=ts,
            job=job,
            node=node,
            gpu=gpu,
            cause="fragmentation",
            evidence={
                "reserved_bytes": reserved,
                "allocated_bytes": allocated,
                "unallocated_bytes": unallocated,
                "inactive_split_bytes": inactive,
                "inactive_split_blocks": int(stats.get("inactive_split.all.current", 0)),
                "alloc_retries": retries,
                "num_ooms": ooms,
                "largest_free_block_bytes": None,
                "alloc_conf": c.remedy_alloc_conf,
            },
            summary=(
                f"PyTorch holds {_gib(unallocated)} reserved but unallocated ({_gib(inactive)} in split blocks) and "
                f"had to retry {retries} allocation(s), {ooms} OOM(s): fragmented cache; set "
                f"PYTORCH_CUDA_ALLOC_CONF={c.remedy_alloc_conf}"
            ),
            source=source,
        )
    ]


def findings_for_snapshot(snap: Snapshot, *, ts: float = 0.0, job: str | None = None, node: str | None = None,
                          gpu: int | None = None, cfg: dict[str, Any] | None = None) -> list[Finding]:
    c = load_config(cfg)
    out: list[Finding] = []
    common = {
        "reserved_bytes": snap.reserved_bytes,
        "allocated_bytes": snap.allocated_bytes,
        "unallocated_bytes": snap.unallocated_bytes,
        "inactive_bytes": snap.inactive_bytes,
        "largest_free_block_bytes": snap.largest_free_block_bytes,
        "segments": len(snap.segments),
        "expandable_segments": snap.expandable_segments,
    }
    failed = snap.oom_requests[-1]["size"] if snap.oom_requests else None
    request = failed if failed is not None else snap.recurring_request_bytes
    if request is not None and _fragmented(snap.unallocated_bytes, snap.reserved_bytes, c) and snap.largest_free_block_bytes < request:
        out.append(
            Finding(
                kind=FindingKind.FRAGMENTATION_ALLOCATOR,
                severity=Severity.TICKET,
                ts=ts,
                job=job,
                node=node,
                gpu=gpu,
                cause="fragmentation",
                evidence={**common, "request_bytes": request, "request_failed": failed is not None, "alloc_conf": c.remedy_alloc_conf},
                summary=(
                    f"{_gib(snap.unallocated_bytes)} reserved but unallocated across {len(snap.segments)} segments, yet the "
                    f"largest free block is {_gib(snap.largest_free_block_bytes)}, below the {_gib(request)} "
                    f"{'request that failed' if failed is not None else 'request the job keeps making'}; set "
                    f"PYTORCH_CUDA_ALLOC_CONF={c.remedy_alloc_conf}"
                ),
                source=snap.source,
            )
        )
    if failed is not None:
        fragmentation = snap.unallocated_bytes >= failed > snap.largest_free_block_bytes
        kind = FindingKind.OOM_FRAGMENTATION if fragmentation else FindingKind.OOM_CAPACITY
        out.append(
            Finding(
                kind=kind,
                severity=Severity.PAGE,
                ts=ts,
                job=job,
                node=node,
                gpu=gpu,
                cause="fragmentation" if fragmentation else "capacity",
                evidence={**common, "request_bytes": failed, "device_free_bytes": snap.oom_requests[-1]["device_free"], "oom_events": len(snap.oom_requests)},
                summary=(
                    f"out of memory on a {_gib(failed)} request: "
                    + (
                        f"{_gib(snap.unallocated_bytes)} was reserved but unallocated, in blocks of at most {_gib(snap.largest_free_block_bytes)}"
                        if fragmentation
                        else f"only {_gib(snap.unallocated_bytes)} reserved but unallocated; the job needs more memory than the GPU has"
                    )
                ),
                source=snap.source,
            )
        )
    return out
