"""Stragglers: a rank consistently slower than its peers in the same job.

In synchronous training every rank ends a step together, so step times cannot tell who is slow.
Time blocked in collectives can: the slowest rank arrives last and waits least, while its peers
wait for it. A rank whose wait is far below its peers' (who wait a real share of each step) is
computing slower; its slowdown is (step − its wait) / (step − peers' wait).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.common import current_run, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window


class StragglerConfig(BaseModel):
    window_seconds: float = 60.0
    min_samples: int = 20
    min_ranks: int = 4
    max_wait_share: float = 0.35
    min_peer_wait_share: float = 0.1
    min_slowdown: float = 1.15
    # A job with long steps needs a longer window: at least this many of its steps.
    min_steps: float = 8.0
    max_window_seconds: float = 900.0


class StragglerDetector:
    name = "straggler"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("straggler", StragglerConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        rp = current_run(window, "rank_progress", since=now - max(c.window_seconds, c.max_window_seconds)).filter(pl.col("collective_wait_seconds").is_not_null())
        if rp.height == 0:
            return []
        # Each job is judged over max(window_seconds, min_steps × its step time).
        rp = rp.filter(
            pl.col("ts") >= now - pl.max_horizontal(pl.lit(c.window_seconds), pl.col("step_time_seconds").median().over("job") * c.min_steps).clip(upper_bound=c.max_window_seconds)
        )
        per_rank = rp.group_by(["job", "rank"]).agg(
            pl.len().alias("n"),
            pl.col("collective_wait_seconds").median().alias("wait"),
            pl.col("step_time_seconds").median().alias("step"),
            pl.col("node").last(),
            pl.col("gpu").last(),
        )
        peers = per_rank.group_by("job").agg(
            pl.col("wait").median().alias("peer_wait"), pl.len().alias("ranks"), pl.col("n").min().alias("min_n")
        )
        slow = (
            per_rank.join(peers, on="job")
            .with_columns(((pl.col("step") - pl.col("wait")) / (pl.col("step") - pl.col("peer_wait"))).alias("slowdown"))
            .filter(
                (pl.col("ranks") >= c.min_ranks)
                & (pl.col("min_n") >= c.min_samples)
                & (pl.col("peer_wait") >= c.min_peer_wait_share * pl.col("step"))
                & (pl.col("wait") <= c.max_wait_share * pl.col("peer_wait"))
                & (pl.col("slowdown") >= c.min_slowdown)
            )
            .sort(["job", "slowdown", "rank"], descending=[False, True, False])
        )
        findings = []
        for rows in slow.partition_by("job", maintain_order=True):
            w = rows.row(0, named=True)
            findings.append(
                Finding(
                    kind=FindingKind.STRAGGLER,
                    severity=Severity.TICKET,
                    ts=now,
                    job=w["job"],
                    ranks=rows["rank"].to_list(),
                    culprit_ranks=rows["rank"].to_list(),
                    node=w["node"],
                    gpu=int(w["gpu"]),
                    source=self.name,
                    evidence={
                        "slowdown": round(float(w["slowdown"]), 3),
                        "rank_wait_seconds": round(float(w["wait"]), 4),
                        "peer_wait_seconds": round(float(w["peer_wait"]), 4),
                        "step_time_seconds": round(float(w["step"]), 4),
                        "ranks_in_job": int(w["ranks"]),
                    },
                    summary=(
                        f"{w['job']} rank {w['rank']} ({w['node']} GPU {w['gpu']}) computes {100 * (w['slowdown'] - 1):.0f}% slower than its "
                        f"{w['ranks'] - 1} peers, who wait {w['peer_wait']:.2f} s per {w['step']:.2f} s step for it."
                    ),
                )
            )
        return findings
