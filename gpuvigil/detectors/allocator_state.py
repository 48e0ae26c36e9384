"""What a PyTorch caching allocator's state saved to a file means: the registered detector
`allocator_state`, over `allocator_readings` (one row per `torch.cuda.memory_stats()` JSON or
memory snapshot pickle, written by `gpuvigil.collectors.allocator` when `analyze` reads one).

- `fragmentation_allocator` (ticket): PyTorch holds memory reserved but unallocated (at least
  `min_unallocated_bytes` and `min_unallocated_share` of what it reserved), and requests do not
  fit in the holes: the snapshot's largest free block is smaller than the failed request or the
  request the job keeps making; from memory_stats alone, the allocator had to retry or ran out;
- `oom_fragmentation` / `oom_capacity` (page): a snapshot that recorded an OOM, by whether the
  reserved but unallocated memory could have held the failed request.

It is placed `offline`: only an artefact read after the fact fills its stream. One reading has
no history, which is why this is not `fragmentation_allocator`'s rule: serve's trend detector
(detectors/fragmentation_allocator.py) needs a rising gap over minutes of `allocator_stats` rows
from the in-process hook, and memory_stats carries no largest free block.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from gpuvigil.detectors.base import FRESH, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

GIB = 1 << 30
STREAM = "allocator_readings"


class AllocatorConfig(BaseModel):
    min_unallocated_bytes: int = Field(2 * GIB, ge=0)
    min_unallocated_share: float = Field(0.10, ge=0, le=1)
    recurring_min_count: int = Field(2, ge=1)
    remedy_alloc_conf: str = "expandable_segments:True"


def load_config(cfg: dict[str, Any] | None = None) -> AllocatorConfig:
    """The detector's block of the `detectors` section (`detectors.allocator_state`)."""
    return settings("allocator_state", AllocatorConfig, cfg)


def _gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def _fragmented(unallocated: int, reserved: int, c: AllocatorConfig) -> bool:
    return reserved > 0 and unallocated >= c.min_unallocated_bytes and unallocated / reserved >= c.min_unallocated_share


class AllocatorStateDetector(Declared):
    spec = DetectorSpec(
        name="allocator_state",
        config=AllocatorConfig,
        emits=(FindingKind.FRAGMENTATION_ALLOCATOR, FindingKind.OOM_FRAGMENTATION, FindingKind.OOM_CAPACITY),
        reads={STREAM: FRESH},
        order=71,
        placement_override="offline",
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("allocator_state", AllocatorConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        out: list[Finding] = []
        for row in window.fresh(STREAM).to_dicts():
            # A reading whose totals are missing says nothing (an empty or garbled file).
            if row["reserved_bytes"] is None or row["allocated_bytes"] is None:
                continue
            where = {"ts": row["ts"], "job": row["job"], "node": row["node"], "gpu": row["gpu"], "source": row["source"] or self.name}
            if row["reading"] == "snapshot":
                out.extend(self._snapshot(row, where))
            elif row["reading"] == "memory_stats":
                out.extend(self._stats(row, where))
        return out

    def _stats(self, r: dict[str, Any], where: dict[str, Any]) -> list[Finding]:
        c = self.config
        allocated, reserved = r["allocated_bytes"], r["reserved_bytes"]
        unallocated = reserved - allocated
        retries, ooms = r["alloc_retries"] or 0, r["oom_count"] or 0
        if not (_fragmented(unallocated, reserved, c) and (retries > 0 or ooms > 0)):
            return []
        inactive = r["inactive_split_bytes"] or 0
        evidence = {
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "unallocated_bytes": unallocated,
            "inactive_split_bytes": inactive,
            "inactive_split_blocks": r["inactive_split_blocks"] or 0,
            "alloc_retries": retries,
            "num_ooms": ooms,
            "largest_free_block_bytes": None,
            "alloc_conf": c.remedy_alloc_conf,
        }
        summary = (
            f"PyTorch holds {_gib(unallocated)} reserved but unallocated ({_gib(inactive)} in split blocks) and "
            f"had to retry {retries} allocation(s), {ooms} OOM(s): fragmented cache; set "
            f"PYTORCH_CUDA_ALLOC_CONF={c.remedy_alloc_conf}"
        )
        return [Finding(kind=FindingKind.FRAGMENTATION_ALLOCATOR, severity=Severity.TICKET, cause="fragmentation", evidence=evidence, summary=summary, **where)]

    def _snapshot(self, r: dict[str, Any], where: dict[str, Any]) -> list[Finding]:
        c = self.config
        reserved, allocated = r["reserved_bytes"], r["allocated_bytes"]
        unallocated, largest = reserved - allocated, r["largest_free_block_bytes"] or 0
        common = {
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "unallocated_bytes": unallocated,
            "inactive_bytes": r["inactive_bytes"],
            "largest_free_block_bytes": largest,
            "segments": r["segments"],
            "expandable_segments": bool(r["expandable_segments"]),
        }
        failed = r["oom_request_bytes"]
        request = failed if failed is not None else r["recurring_request_bytes"]
        out: list[Finding] = []
        if request is not None and _fragmented(unallocated, reserved, c) and largest < request:
            out.append(
                Finding(
                    kind=FindingKind.FRAGMENTATION_ALLOCATOR,
                    severity=Severity.TICKET,
                    cause="fragmentation",
                    evidence={**common, "request_bytes": request, "request_failed": failed is not None, "alloc_conf": c.remedy_alloc_conf},
                    summary=(
                        f"{_gib(unallocated)} reserved but unallocated across {r['segments']} segments, yet the "
                        f"largest free block is {_gib(largest)}, below the {_gib(request)} "
                        f"{'request that failed' if failed is not None else 'request the job keeps making'}; set "
                        f"PYTORCH_CUDA_ALLOC_CONF={c.remedy_alloc_conf}"
                    ),
                    **where,
                )
            )
        if failed is not None:
            fragmentation = unallocated >= failed > largest
            out.append(
                Finding(
                    kind=FindingKind.OOM_FRAGMENTATION if fragmentation else FindingKind.OOM_CAPACITY,
                    severity=Severity.PAGE,
                    cause="fragmentation" if fragmentation else "capacity",
                    evidence={**common, "request_bytes": failed, "device_free_bytes": r["oom_device_free_bytes"], "oom_events": r["oom_events"] or 0},
                    summary=(
                        f"out of memory on a {_gib(failed)} request: "
                        + (
                            f"{_gib(unallocated)} was reserved but unallocated, in blocks of at most {_gib(largest)}"
                            if fragmentation
                            else f"only {_gib(unallocated)} reserved but unallocated; the job needs more memory than the GPU has"
                        )
                    ),
                    **where,
                )
            )
        return out


__all__ = ["AllocatorConfig", "AllocatorStateDetector", "load_config"]
