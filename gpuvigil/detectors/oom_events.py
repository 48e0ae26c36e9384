"""CUDA OOMs that happened, classified after the fact from PyTorch's own message.

The message carries the numbers that tell the causes apart (requested size, free memory, what
this process holds, PyTorch's reserved-but-unallocated memory, other processes): the parser and
classifier in `gpuvigil.parsers.oom` turn them into `oom_capacity`,
`oom_fragmentation`, `oom_foreign_process` or `oom_unexplained`. Each OOM is reported once, on the first tick the
classifier sees it, however late its line arrives: events are told apart by their content (time,
node, GPU, job, rank, source, message), not by whether their time is after the previous tick, so a
line read late (a log file read after a delay) is still reported and the same line read twice is
not reported again. An OOM older than `report_seconds` when it arrives is not reported (a restarted
collector's backlog). A traceback repeats the message: the same OOM (same figures, rank and GPU)
read again in the same job's (or file's) lines in one tick is one finding, counted in
`evidence.occurrences`. `evidence.reason` says why, with the figures (`OomReport.reason`).

`analyze` judges a whole log's OOMs by this same detector (over the log's events).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity, subject
from gpuvigil.parsers.oom import OomReport, load_oom_config, parse_oom
from gpuvigil.window import Window

GIB = float(1 << 30)

_CAUSE = {
    FindingKind.OOM_CAPACITY: ("capacity", "the job needs more memory than the GPU has: move it to a larger-memory GPU or shrink the micro-batch"),
    FindingKind.OOM_FRAGMENTATION: ("fragmentation", "the memory was free but in pieces: restart with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
    FindingKind.OOM_FOREIGN_PROCESS: ("foreign_process", "another process holds the memory: find and stop it, or requeue the job elsewhere"),
    FindingKind.OOM_UNEXPLAINED: ("unexplained", "the message's own figures say the room was free: check memory-fraction limits, MIG/MPS and other allocators"),
}


class OomEventsConfig(BaseModel):
    # OOMs are reported while at most this old (on the first tick: a restarted collector's
    # backlog is not paged again; later: how late a log line may still arrive and be reported).
    report_seconds: float = 600.0


class OomEventClassifier(Declared):
    spec = DetectorSpec(
        name="oom_events",
        config=OomEventsConfig,
        emits=(FindingKind.OOM_CAPACITY, FindingKind.OOM_FRAGMENTATION, FindingKind.OOM_FOREIGN_PROCESS, FindingKind.OOM_UNEXPLAINED,),
        reads={"events": HISTORY},
        order=60,
        level="L0",
        streams=("events",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom_events", OomEventsConfig, cfg)
        self.classify_config = load_oom_config(cfg)
        # Events already handled (reported or not classifiable) → their ts; forgotten once older
        # than report_seconds, when they can no longer be reported anyway.
        self._seen: dict[tuple[Any, ...], float] = {}

    def detect(self, window: Window) -> list[Finding]:
        since = window.now - self.config.report_seconds
        self._seen = {k: ts for k, ts in self._seen.items() if ts > since}
        ev = window.get("events").filter((pl.col("kind") == "oom") & (pl.col("ts") > since) & pl.col("message").is_not_null())
        found: dict[tuple[Any, ...], Finding] = {}
        fresh: set[tuple[Any, ...]] = set()  # rows first seen this tick (a repeated line counts again)
        for row in ev.sort("ts", maintain_order=True).iter_rows(named=True):
            key = (row["ts"], row["node"], row["gpu"], row["job"], row["rank"], row["source"], row["message"])
            if key in self._seen and key not in fresh:
                continue
            self._seen[key] = float(row["ts"])
            fresh.add(key)
            report = parse_oom(row["message"], ts=float(row["ts"]), rank=row["rank"])
            if report is None:
                continue  # an "oom" event without PyTorch's numbers: nothing to classify
            same = (row["job"], row["node"], row["source"], report.key())
            if same in found:
                found[same].evidence["occurrences"] += 1
                continue
            found[same] = self._finding(row, report)
        return list(found.values())

    def _finding(self, row: dict[str, Any], report: OomReport) -> Finding:
        kind = report.classify(self.classify_config)
        cause, advice = _CAUSE[kind]
        foreign = report.foreign_bytes()
        where = subject(job=row["job"], ranks=[row["rank"]], node=row["node"], gpu=row["gpu"])
        return Finding(
            kind=kind,
            severity=Severity.PAGE,
            ts=float(row["ts"]),
            job=row["job"],
            ranks=[int(row["rank"])] if row["rank"] is not None else [],
            culprit_ranks=[int(row["rank"])] if row["rank"] is not None else [],
            node=row["node"],
            gpu=row["gpu"],
            cause=cause,
            source=self.name,
            evidence={
                "requested_bytes": report.requested_bytes,
                "total_bytes": report.total_bytes,
                "free_bytes": report.free_bytes,
                "process_used_bytes": report.process_used_bytes,
                "allocated_bytes": report.allocated_bytes,
                "reserved_unallocated_bytes": report.reserved_unallocated_bytes,
                "foreign_bytes": foreign,
                **({"allowed_bytes": report.allowed_bytes} if report.allowed_bytes is not None else {}),
                "other_processes": report.other_processes,
                # neither free nor PyTorch's: CUDA context, libraries (and other processes, if any)
                "non_pytorch_bytes": report.non_pytorch_bytes(),
                "process_used_credible": report.process_used_credible,
                "wording": report.wording,
                "reason": report.reason(kind),
                "occurrences": 1,
            },
            summary=(
                f"CUDA OOM in {where}, asking for {report.requested_bytes / GIB:.2f} GiB"
                + (f" with {report.reserved_unallocated_bytes / GIB:.1f} GiB reserved but unallocated" if report.reserved_unallocated_bytes else "")
                + (f" and {foreign / GIB:.1f} GiB held by other processes" if foreign else "")
                + f": {advice}."
            ),
        )
