"""Small helpers shared by detectors (polars expressions, no per-GPU Python loops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import polars as pl
from pydantic import BaseModel

from gpuvigil import config
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

M = TypeVar("M", bound=BaseModel)


def settings(name: str, model: type[M], cfg: dict[str, Any] | None) -> M:
    """One detector's block of the `detectors` config section."""
    cfg = config.defaults() if cfg is None else cfg
    block = (cfg.get("detectors") or {}).get(name, {})
    return config.section(name, model, {name: block})


def current_run(window: Window, stream: str, since: float | None = None, warmup: float = 0.0) -> pl.DataFrame:
    """Rows of a per-job stream from each job's current run only (after its latest (re)start).

    A requeued job restarts from a checkpoint with lower sequence numbers and fresh memory; its
    previous run's samples would otherwise look like a stall or a leak.
    """
    df = window.get(stream)
    if since is not None:
        df = df.filter(pl.col("ts") >= since)
    jobs = window.get("jobs")
    if df.height == 0 or jobs.height == 0:
        return df
    starts = jobs.select("job", pl.col("start_ts").alias("_start"), pl.col("state").alias("_state"))
    return (
        df.join(starts, on="job", how="left")
        .filter(pl.col("_start").is_null() | (pl.col("ts") >= pl.col("_start") + warmup))
        .drop("_start", "_state")
    )


def gpu_jobs(window: Window) -> pl.DataFrame:
    """(node, gpu) → job, rank from the scheduler's allocation snapshot."""
    return window.get("allocations").select("node", "gpu", "job", "rank")


class Persistence:
    """How many evaluations in a row each (job, rank) has been flagged; a rank not flagged in an
    evaluation starts again from zero. Keeps one blip from becoming a finding."""

    def __init__(self) -> None:
        self.streak: dict[tuple[str, int], int] = {}

    def persistent(self, flagged: pl.DataFrame, evaluations: int) -> pl.DataFrame:
        """Count this evaluation's flagged (job, rank) rows; keep those flagged `evaluations` times in a row."""
        keys = {(j, int(r)) for j, r in flagged.select("job", "rank").unique().iter_rows()}
        self.streak = {k: self.streak.get(k, 0) + 1 for k in keys}
        kept = [k for k, n in self.streak.items() if n >= evaluations]
        schema = {"job": flagged.schema["job"], "rank": flagged.schema["rank"]}
        return flagged.join(pl.DataFrame({"job": [j for j, _ in kept], "rank": [r for _, r in kept]}, schema=schema), on=["job", "rank"], how="semi")


def allocated_gpu_retention(recent_seconds: float | None) -> dict[str, tuple[float, str]]:
    """`window_retention()` of an L0 detector that reads gpu_samples' history only for allocated
    GPUs (an inner join on node, gpu) and whose findings the level selection keeps only for the
    jobs it is selected for: rows older than `recent_seconds` are kept only for the GPUs of the
    jobs it is or will be selected for within its look-back (pipeline/core.py:
    declared_retention, levels.py: LevelSelector.jobs_selecting). None: keep every row."""
    return {} if recent_seconds is None else {"gpu_samples": (recent_seconds, "allocated")}


def rank_at(rank: Any, node: str | None, gpu: int | None) -> str:
    """'rank 3 (n0 GPU 2)' for a summary; a node or GPU the rows do not carry (a hook record
    without `gpu`) is left out instead of being printed as 'None'."""
    place = " ".join(p for p in (node, None if gpu is None else f"GPU {gpu}") if p)
    return f"rank {rank} ({place})" if place else f"rank {rank}"


def node_names(nodes: pl.Series) -> list[str]:
    """The distinct node names of culprit rows, sorted; rows naming no node (a hook row without
    one, a rank not placed yet) add none, so a page never fails on ordering None with names."""
    return nodes.drop_nulls().unique().sort().to_list()


def covered_jobs(rows: pl.DataFrame, now: float, span: float, need: float, *, column: str | None = None) -> set[str]:
    """Jobs whose rows (one series per rank) came densely enough over the last `span` seconds
    for a detector's own fit: at least `need` rows per rank, on the median rank (with `column`:
    rows where it is filled). Side-by-side level selection holds a lower detector's findings back
    for these jobs (pipeline/levels.py: healthy_jobs); a job whose hook publishes too seldom for
    the fit is left to the device's detectors."""
    if rows.height == 0 or "job" not in rows.columns or "rank" not in rows.columns:
        return set()
    recent = rows.filter(pl.col("ts") > now - span)
    if column is not None and column in recent.columns:
        recent = recent.filter(pl.col(column).is_not_null())
    if recent.height == 0:
        return set()
    per = recent.group_by("job", "rank").agg(pl.len().alias("n")).group_by("job").agg(pl.col("n").median().alias("n"))
    return set(per.filter(pl.col("n") >= need)["job"].drop_nulls().to_list())


def counter_rate_findings(flagged: pl.DataFrame, window: Window, *, kind: FindingKind, source: str, rate_key: str, total_key: str,
                          say: Callable[[dict[str, Any]], str]) -> list[Finding]:
    """One hardware ticket per GPU whose error counter rose too fast (`per_gpu.CounterRate.flagged`
    rows), with its job and rank; `say(row)` words the summary."""
    out = []
    for row in flagged.join(gpu_jobs(window), on=["node", "gpu"], how="left").iter_rows(named=True):
        out.append(
            Finding(
                kind=kind,
                severity=Severity.TICKET,
                ts=window.now,
                job=row["job"],
                ranks=[int(row["rank"])] if row["rank"] is not None else [],
                node=row["node"],
                gpu=row["gpu"],
                cause="hardware",
                source=source,
                evidence={rate_key: round(float(row["per_minute"]), 1), total_key: int(row["count"]), "window_seconds": round(float(row["ts"] - row["ts0"]), 1)},
                summary=say(row),
            )
        )
    return out
