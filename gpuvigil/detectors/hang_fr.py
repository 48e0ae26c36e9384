"""L1 collective hang: exact culprit ranks, sequence number and op from Flight Recorder dumps.

Reads `fr_analysis` (cross-rank analyses of dumps: the dump-folder watcher's live, `analyze`'s
and `gpuvigil fr`'s of dumps read after the fact) and, where the job runs the NCCL Inspector,
`collective_progress`. One dump is a snapshot: a collective some ranks have not joined *yet* is
normal skew. A hang is confirmed when
- the dumps were written by the watchdog on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), or read after
  the fact (trigger `offline`: whatever they show pending stayed pending), or
- NCCL Inspector shows the job's collectives have not completed for max(min_stall_seconds,
  stall_intervals × the job's usual interval between completions), or
- two analyses at least `confirm_seconds` apart name the same pending collective.

A hang whose dumps name no culprit (every rank joined and none completed) is left to the L0
detectors live, which see the job stop; read after the fact nothing else will say it, so it pages
without culprits. The finding of a live analysis is sourced to this detector, one read after
the fact to the dump that shows it; its evidence is the analysis's, plus how it was confirmed.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.policies import implicates_hardware
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import node_names, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.util.progress import CollectiveClock
from gpuvigil.window import Window

# The trigger of analyses of dumps read after the fact (`analyze`, `gpuvigil fr`).
OFFLINE = "offline"


class HangFrConfig(BaseModel):
    min_stall_seconds: float = 5.0
    stall_intervals: float = 1.5
    confirm_seconds: float = 4.0
    max_age_seconds: float = 120.0  # analyses older than this no longer describe the job
    hardware_lookback_seconds: float = 120.0


def analysis_evidence(row: dict[str, Any]) -> dict[str, Any]:
    """What the analysis itself found (its `evidence_json`); {} where the row carries none or
    carries something that is not a JSON object."""
    try:
        ev = json.loads(row.get("evidence_json") or "{}")
    except ValueError:
        return {}
    return ev if isinstance(ev, dict) else {}


def culprit_place(window: Window, row: dict[str, Any], culprits: list[int]) -> tuple[list[str], dict[str, Any] | None]:
    """The nodes of the culprit ranks (the scheduler's placement, else the node the dumps name)
    and the allocation row of the one culprit GPU, if there is exactly one."""
    alloc = window.get("allocations")
    alloc = alloc.filter((pl.col("job") == row["job"]) & pl.col("rank").is_in(culprits)) if row["job"] is not None else alloc.clear()
    nodes = node_names(alloc["node"]) or ([row["node"]] if row["node"] else [])
    return nodes, (alloc.row(0, named=True) if alloc.height == 1 else None)


def live_rows(window: Window, max_age_seconds: float) -> pl.DataFrame:
    """Analyses that still describe their job: younger than `max_age_seconds` and not about an
    earlier run of a job that has since restarted."""
    an = window.get("fr_analysis").filter(pl.col("ts") >= window.now - max_age_seconds)
    jobs = window.get("jobs")
    if jobs.height:
        an = an.join(jobs.select("job", pl.col("start_ts").alias("_s")), on="job", how="left").filter(pl.col("_s").is_null() | (pl.col("dump_ts") >= pl.col("_s")) | (pl.col("ts") >= pl.col("_s")))
    return an


class FlightRecorderHangDetector(Declared):
    spec = DetectorSpec(
        name="hang_fr",
        config=HangFrConfig,
        emits=(FindingKind.COLLECTIVE_HANG,),
        reads={"collective_progress": HISTORY, "fr_analysis": HISTORY, "events": HISTORY, "jobs": HISTORY, "allocations": HISTORY},
        order=20,
        level="L1",
        capability="hang",
        streams=("fr_pipes", "fr_analysis", "collective_progress"),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("hang_fr", HangFrConfig, cfg)
        self._clock = CollectiveClock()

    def detect(self, window: Window) -> list[Finding]:
        self._clock.observe(window.fresh("collective_progress"), window.now)
        if window.get("fr_analysis").height == 0:
            return []
        findings = []
        for rows in live_rows(window, self.config.max_age_seconds).sort("ts").partition_by("job", maintain_order=True):
            latest = rows.row(rows.height - 1, named=True)
            offline = latest["trigger"] == OFFLINE
            if latest["kind"] != "collective_hang" or not (latest["culprit_ranks"] or offline):
                continue
            how = self._confirmed(rows, latest, window.now)
            if how is not None:
                findings.append(self._finding(window, latest, how))
        return findings

    def _confirmed(self, rows: pl.DataFrame, latest: dict[str, Any], now: float) -> str | None:
        """How the pending collective is known to be stuck; None while it may still complete."""
        c = self.config
        job = latest["job"]
        same = rows.filter((pl.col("kind") == "collective_hang") & (pl.col("pg") == latest["pg"]) & (pl.col("seq") == latest["seq"]))
        first_ts = float(same["ts"].min())
        moved = self._clock.last_move().get(job)
        threshold = self._clock.stall_threshold(job, c.min_stall_seconds, c.stall_intervals)
        if latest["trigger"] == "timeout":
            return "watchdog timeout dump"
        if latest["trigger"] == OFFLINE:
            return "dumps read after the fact"
        if moved is not None and now - moved >= threshold and float(latest["ts"]) > moved:
            # (the dump was taken after the last completion: it shows the stuck collective)
            return f"NCCL Inspector: no collective completed for {now - moved:.0f} s"
        if moved is None and float(latest["ts"]) - first_ts >= c.confirm_seconds:
            return f"two dumps {float(latest['ts']) - first_ts:.0f} s apart show the same pending collective"
        return None

    def _finding(self, window: Window, latest: dict[str, Any], how: str) -> Finding:
        c = self.config
        now = window.now
        job = latest["job"]
        offline = latest["trigger"] == OFFLINE
        culprits = [int(r) for r in latest["culprit_ranks"] or []]
        nodes, one = culprit_place(window, latest, culprits)
        hw = window.get("events").filter(implicates_hardware(now - c.hardware_lookback_seconds) & pl.col("node").is_in(nodes))
        found = analysis_evidence(latest)
        # Read after the fact, no XID of the node was read beside the dumps: the cause stays open.
        cause = "hardware" if hw.height else (None if offline else "software")
        return Finding(
            kind=FindingKind.COLLECTIVE_HANG,
            severity=Severity.PAGE,
            ts=now,
            job=job,
            ranks=sorted({int(r) for r in latest["ranks"] or []} | set(culprits)),
            culprit_ranks=culprits,
            node=nodes[0] if nodes else None,
            gpu=one["gpu"] if one else None,
            cause=cause,
            source=latest["source"] if offline and latest["source"] else self.name,
            evidence={
                **found,
                "level": "L1",
                "pending_seq": latest["seq"],
                "op": latest["op"],
                "pg": latest["pg"],
                "trigger": latest["trigger"],
                "confirmed_by": how,
                "dumps": int(latest["n_dumps"] or 0),
                "dump": latest["source"],
                "culprit_nodes": nodes or found.get("culprit_nodes") or [],
                "xids": sorted({int(x) for x in hw["xid"].drop_nulls().to_list()}),
            },
            summary=f"{job or 'the job'} is hung in collective #{latest['seq']} {latest['op']} (L1, Flight Recorder; {how}): {latest['summary']}",
        )
