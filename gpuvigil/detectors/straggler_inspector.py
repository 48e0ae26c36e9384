"""L1 straggler from NCCL Inspector: per-rank collective execution times (no code change).

A collective completes on every rank together, when the last rank arrives: each rank's execution
time is its wait for the last arrival plus the transfer. The straggler waits least. With I the
job's interval between collectives (from the rate its sequence numbers advance), a rank computes
I − exec per collective, so the straggler's slowdown against its peers is
(I − exec_rank) / (I − exec_peers): the same reading as the L2 detector's, from the plugin's output.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import Persistence, rank_at, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class StragglerInspectorConfig(BaseModel):
    window_seconds: float = 90.0
    min_samples: int = 20
    min_ranks: int = 4
    max_exec_share: float = 0.5  # the rank's exec time at most this share of its peers' median
    min_slowdown: float = 1.15
    persist_evaluations: int = 2


class InspectorStragglerDetector(Declared):
    spec = DetectorSpec(
        name="straggler_inspector",
        config=StragglerInspectorConfig,
        emits=(FindingKind.STRAGGLER,),
        reads={"collective_progress": HISTORY, "jobs": HISTORY},
        order=140,
        level="L1",
        capability="straggler",
        streams=("collective_progress",),
        every_seconds=5.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("straggler_inspector", StragglerInspectorConfig, cfg)
        self._persistence = Persistence()

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        cp = window.get("collective_progress").filter(pl.col("ts") >= now - c.window_seconds)
        if cp.height == 0:
            return []
        jobs = window.get("jobs")
        if jobs.height:
            cp = cp.join(jobs.select("job", pl.col("start_ts").alias("_s")), on="job", how="left").filter(pl.col("_s").is_null() | (pl.col("ts") >= pl.col("_s") + 20.0))
        per_job = cp.group_by("job").agg(
            ((pl.col("ts").max() - pl.col("ts").min()) / (pl.col("coll_sn").max() - pl.col("coll_sn").min()).cast(pl.Float64)).alias("interval_s"),
        )
        per = cp.filter(pl.col("exec_time_us").is_not_null()).group_by(["job", "rank"]).agg(
            pl.len().alias("n"), (pl.col("exec_time_us").median() / 1e6).alias("exec_s"), pl.col("node").last(), pl.col("gpu").last()
        )
        peers = per.group_by("job").agg(pl.col("exec_s").median().alias("peer_exec_s"), pl.len().alias("ranks"), pl.col("n").min().alias("min_n"))
        scored = (
            per.join(peers, on="job")
            .join(per_job, on="job")
            .with_columns(((pl.col("interval_s") - pl.col("exec_s")) / (pl.col("interval_s") - pl.col("peer_exec_s"))).alias("slowdown"))
            .filter(
                (pl.col("ranks") >= c.min_ranks)
                & (pl.col("min_n") >= c.min_samples)
                & pl.col("interval_s").is_finite()
                & (pl.col("interval_s") > pl.col("peer_exec_s"))
                & (pl.col("exec_s") <= c.max_exec_share * pl.col("peer_exec_s"))
                & (pl.col("slowdown") >= c.min_slowdown)
            )
        )
        kept = self._persistence.persistent(scored, c.persist_evaluations)
        findings = []
        for rows in kept.sort(["job", "slowdown", "rank"], descending=[False, True, False]).partition_by("job", maintain_order=True) if kept.height else []:
            w = rows.row(0, named=True)
            findings.append(
                Finding(
                    kind=FindingKind.STRAGGLER,
                    severity=Severity.TICKET,
                    ts=now,
                    job=w["job"],
                    ranks=sorted(rows["rank"].to_list()),
                    culprit_ranks=sorted(rows["rank"].to_list()),
                    node=w["node"],
                    gpu=w["gpu"],
                    source=self.name,
                    evidence={
                        "level": "L1",
                        "slowdown": round(float(w["slowdown"]), 3),
                        "rank_exec_seconds": round(float(w["exec_s"]), 5),
                        "peer_exec_seconds": round(float(w["peer_exec_s"]), 5),
                        "collective_interval_seconds": round(float(w["interval_s"]), 4),
                        "ranks_in_job": int(w["ranks"]),
                    },
                    summary=(
                        f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])} computes {100 * (w['slowdown'] - 1):.0f}% slower than its {w['ranks'] - 1} peers "
                        f"(L1, NCCL Inspector: its collectives take {1e3 * w['exec_s']:.1f} ms against the peers' {1e3 * w['peer_exec_s']:.1f} ms: it arrives last)."
                    ),
                )
            )
        return findings
