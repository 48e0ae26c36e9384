"""L1 collective mismatch: ranks of one process group called different collectives, or the same
one with different sizes or dtypes (the Flight Recorder cross-rank analysis,
`gpuvigil.collectors.flight_recorder`). Unlike a pending collective, a mismatch needs no
confirmation: the dumps show calls that were made, and the job cannot go on (NCCL hangs or
corrupts). It pages the job's owner, naming the minority ranks as culprits.

Reads the `fr_analysis` rows the dump-folder watcher writes live and those `analyze` and
`gpuvigil fr` write for dumps read after the fact: the same rule online and offline. Per job and
process group the newest analysis decides (a later one without the mismatch, e.g. after a
restart, clears it).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.detectors.hang_fr import OFFLINE, analysis_evidence, culprit_place, live_rows
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class FrMismatchConfig(BaseModel):
    max_age_seconds: float = 120.0  # analyses older than this no longer describe the job


class FlightRecorderMismatchDetector(Declared):
    spec = DetectorSpec(
        name="fr_mismatch",
        config=FrMismatchConfig,
        emits=(FindingKind.COLLECTIVE_MISMATCH,),
        reads={"fr_analysis": HISTORY, "jobs": HISTORY, "allocations": HISTORY},
        order=21,
        level="L1",
        streams=("fr_analysis",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("fr_mismatch", FrMismatchConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        if window.get("fr_analysis").height == 0:
            return []
        an = live_rows(window, self.config.max_age_seconds)
        # A `none` row (the newest dumps show no problem) has no group: it clears every group.
        newest = an.sort("ts").group_by("job", maintain_order=True).agg(pl.col("ts").max().alias("_newest"))
        an = an.join(newest, on="job", how="left", nulls_equal=True).filter(pl.col("ts") == pl.col("_newest"))
        mism = an.filter(pl.col("kind") == "collective_mismatch").unique(["job", "pg"], keep="last", maintain_order=True)
        return [self._finding(window, row) for row in mism.iter_rows(named=True)]

    def _finding(self, window: Window, row: dict[str, Any]) -> Finding:
        culprits = [int(r) for r in row["culprit_ranks"] or []]
        nodes, one = culprit_place(window, row, culprits)
        found = analysis_evidence(row)
        job = row["job"]
        return Finding(
            kind=FindingKind.COLLECTIVE_MISMATCH,
            severity=Severity.PAGE,
            ts=window.now,
            job=job,
            ranks=sorted({int(r) for r in row["ranks"] or []} | set(culprits)),
            culprit_ranks=culprits,
            node=nodes[0] if nodes else None,
            gpu=one["gpu"] if one else None,
            source=row["source"] if row["trigger"] == OFFLINE and row["source"] else self.name,
            evidence={
                **found,
                "level": "L1",
                "seq": row["seq"],
                "op": row["op"],
                "pg": row["pg"],
                "trigger": row["trigger"],
                "dumps": int(row["n_dumps"] or 0),
                "dump": row["source"],
                "culprit_nodes": nodes or found.get("culprit_nodes") or [],
            },
            summary=f"{job + ': ' if job else ''}{row['summary']}",
        )
