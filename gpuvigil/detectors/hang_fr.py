"""L1 collective hang: exact culprit ranks, sequence number and op from Flight Recorder dumps.

Reads `fr_analysis` (cross-rank analyses of dumps, from the dump-folder watcher) and, where the
job runs the NCCL Inspector, `collective_progress`. One dump is a snapshot: a collective some
ranks have not joined *yet* is normal skew. A hang is confirmed when
- the dumps were written by the watchdog on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), or
- NCCL Inspector shows the job's collectives have not completed for max(min_stall_seconds,
  stall_intervals × the job's usual interval between completions), or
- two analyses at least `confirm_seconds` apart name the same pending collective.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.policies import implicates_hardware
from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import node_names, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.util.progress import CollectiveClock
from gpuvigil.window import Window


class HangFrConfig(BaseModel):
    min_stall_seconds: float = 5.0
    stall_intervals: float = 1.5
    confirm_seconds: float = 4.0
    max_age_seconds: float = 120.0  # analyses older than this no longer describe the job
    hardware_lookback_seconds: float = 120.0


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
        c = self.config
        now = window.now
        self._clock.observe(window.fresh("collective_progress"), now)
        last_move = self._clock.last_move()
        an = window.get("fr_analysis")
        if an.height == 0:
            return []
        an = an.filter(pl.col("ts") >= now - c.max_age_seconds)
        jobs = window.get("jobs")
        if jobs.height:
            an = an.join(jobs.select("job", pl.col("start_ts").alias("_s")), on="job", how="left").filter(pl.col("_s").is_null() | (pl.col("dump_ts") >= pl.col("_s")) | (pl.col("ts") >= pl.col("_s")))
        findings = []
        for rows in an.sort("ts").partition_by("job", maintain_order=True):
            latest = rows.row(rows.height - 1, named=True)
            job = latest["job"]
            if latest["kind"] != "collective_hang" or not latest["culprit_ranks"]:
                continue
            same = rows.filter((pl.col("kind") == "collective_hang") & (pl.col("pg") == latest["pg"]) & (pl.col("seq") == latest["seq"]))
            first_ts = float(same["ts"].min())
            moved = last_move.get(job)
            threshold = self._clock.stall_threshold(job, c.min_stall_seconds, c.stall_intervals)
            how = None
            if latest["trigger"] == "timeout":
                how = "watchdog timeout dump"
            elif moved is not None and now - moved >= threshold and float(latest["ts"]) > moved:
                # (the dump was taken after the last completion: it shows the stuck collective)
                how = f"NCCL Inspector: no collective completed for {now - moved:.0f} s"
            elif moved is None and float(latest["ts"]) - first_ts >= c.confirm_seconds:
                how = f"two dumps {float(latest['ts']) - first_ts:.0f} s apart show the same pending collective"
            if how is None:
                continue
            culprits = [int(r) for r in latest["culprit_ranks"]]
            alloc = window.get("allocations").filter((pl.col("job") == job) & pl.col("rank").is_in(culprits))
            nodes = node_names(alloc["node"]) or ([latest["node"]] if latest["node"] else [])
            hw = window.get("events").filter(implicates_hardware(now - c.hardware_lookback_seconds) & pl.col("node").is_in(nodes))
            one = alloc.row(0, named=True) if alloc.height == 1 else None
            findings.append(
                Finding(
                    kind=FindingKind.COLLECTIVE_HANG,
                    severity=Severity.PAGE,
                    ts=now,
                    job=job,
                    ranks=culprits,
                    culprit_ranks=culprits,
                    node=nodes[0] if nodes else None,
                    gpu=one["gpu"] if one else None,
                    cause="hardware" if hw.height else "software",
                    source=self.name,
                    evidence={
                        "level": "L1",
                        "pending_seq": latest["seq"],
                        "op": latest["op"],
                        "pg": latest["pg"],
                        "trigger": latest["trigger"],
                        "confirmed_by": how,
                        "dumps": int(latest["n_dumps"] or 0),
                        "culprit_nodes": nodes,
                        "xids": sorted({int(x) for x in hw["xid"].drop_nulls().to_list()}),
                    },
                    summary=f"{job} is hung in collective #{latest['seq']} {latest['op']} (L1, Flight Recorder; {how}): {latest['summary']}",
                )
            )
        return findings
