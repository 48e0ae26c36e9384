"""Stragglers: a rank consistently slower than its peers in the same job.

In synchronous training every rank ends a step together, so step times cannot tell who is slow.
Time blocked in collectives can: the slowest rank arrives last and waits least, while its peers
wait for it. A rank whose wait is far below its peers' (who wait a real share of each step) is
computing slower; its slowdown is (step − its wait) / (step − peers' wait).

Cost: O(new rows) per tick, not O(window). Each tick's rows go into per-(job, rank) ring buffers
holding the last `window_seconds` (detectors/incremental.py: KeyRing), and into per-(job, second)
counts. A job is judged over max(window_seconds, min_steps × its median step time); the counts
prove, for almost every job, that its median step is short enough for that to be window_seconds,
and then its ranks' medians come from the rings (one numpy partition for all ranks). A job the
counts cannot settle (long steps, or a median near the bound) is judged from the window as before.
Findings are those of the refit over the window (tests/incremental_oracles.py: RefitStraggler).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import covered_jobs, current_run, rank_at, settings
from gpuvigil.detectors.incremental import KeyIndex, KeyRing, SlidingRows, TickCursor, masked_median
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

STREAM = "rank_progress"
NO_GPU = np.iinfo(np.int32).min  # a null gpu in the rings


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
    # Memory at scale (100,000 GPUs): the window keeps rank rows older than window_seconds +
    # history_slack_seconds only for jobs with a long step (step x min_steps > window_seconds) in
    # the look-back, the only jobs judged over more than window_seconds. None: keep every row.
    history_slack_seconds: float | None = Field(5.0, ge=0)


class StragglerDetector(Declared):
    spec = DetectorSpec(
        name="straggler",
        config=StragglerConfig,
        emits=(FindingKind.STRAGGLER,),
        reads={"rank_progress": HISTORY, "jobs": HISTORY},
        order=130,
        level="L2",
        capability="straggler",
        streams=("rank_wait",),
        every_seconds=5.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("straggler", StragglerConfig, cfg)
        self._cursor = TickCursor()
        self._reset()

    def lookback_seconds(self) -> dict[str, float]:
        """History of rank_progress read from the window (pipeline/core.py: declared_horizons):
        a job's window stretches up to max_window_seconds; rings are rebuilt from it."""
        c = self.config
        return {STREAM: max(c.window_seconds, c.max_window_seconds)}

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        """The columns of that history it reads (pipeline/core.py: declared_columns)."""
        return {STREAM: ("ts", "job", "rank", "node", "gpu", "step_time_seconds", "collective_wait_seconds")}

    def window_retention(self) -> dict[str, tuple[float, pl.DataFrame]]:
        """The rank rows older than window_seconds + history_slack_seconds are read only for the
        jobs `_per_rank_refit` may judge (pipeline/core.py: declared_retention): those with a long
        step in the look-back (every job the step counts cannot settle has one). The fast path and
        a rebuild of the rings read window_seconds. A job whose first long step comes later has
        its older rows from then on (the refit then reads fewer than `max_window_seconds`' worth
        until its look-back refills)."""
        c = self.config
        if c.history_slack_seconds is None:
            return {}
        return {STREAM: (min(c.window_seconds, c.max_window_seconds) + c.history_slack_seconds, self._long_jobs)}

    # -- running state ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self._long_jobs = pl.DataFrame(schema={"job": pl.Utf8})
        self._ring = KeyRing(["wait", "step"], ["node", "gpu"])
        self._nodes = KeyIndex({"node": pl.Utf8()})  # node names as the ring's int column
        self._seconds: list[pl.DataFrame] = []  # per (job, second of ts): counts of step times

    def _spans(self, window: Window) -> tuple[float, float, float]:
        c = self.config
        # A job whose median step is short is judged over `fast`; `look` bounds every job's window.
        return min(c.window_seconds, c.max_window_seconds), max(c.window_seconds, c.max_window_seconds), window.horizon(STREAM)

    def ingest(self, window: Window) -> None:
        """Fold this tick's rows in (called by the pipeline on ticks the detector is not due)."""
        now = window.now
        mode = self._cursor.advance(window)
        if mode == "same":
            return
        stepping = mode == "step"
        fast, look, horizon = self._spans(window)
        keep_from = now - min(fast, horizon)
        if stepping:
            self._add(window.fresh(STREAM), keep_from)
            ring = self._ring
            stale = int((ring.last_ts[: ring.n] < keep_from).sum())
            if stale > max(4096, ring.n - stale):  # jobs gone long ago: start over, smaller
                stepping = False
        if not stepping:
            # The same rows a refit reads, in the window's (arrival) order.
            self._reset()
            self._add(window.get(STREAM), keep_from)
        lo = now - min(look, horizon)
        if self._seconds:
            counts = pl.concat(self._seconds, how="vertical_relaxed") if len(self._seconds) > 1 else self._seconds[0]
            self._seconds = [counts.filter(pl.col("_hi") >= lo)]
            # Jobs with a long step in the look-back (window_retention).
            self._long_jobs = self._seconds[0].filter(pl.col("_steps") > pl.col("_short")).select(pl.col("job").cast(pl.Utf8)).unique()

    def _add(self, df: pl.DataFrame, keep_from: float) -> None:
        df = df.filter(pl.col("collective_wait_seconds").is_not_null())
        if df.height == 0:
            return
        c = self.config
        self._seconds.append(
            df.group_by("job", pl.col("ts").floor().alias("_sec")).agg(
                pl.col("ts").min().alias("_lo"),
                pl.col("ts").max().alias("_hi"),
                pl.col("step_time_seconds").count().alias("_steps"),
                # Steps short enough that, were the median one of them, the job's window is window_seconds.
                (pl.col("step_time_seconds") * c.min_steps <= c.window_seconds).sum().alias("_short"),
            )
        )
        df = df.filter(pl.col("ts") >= keep_from)
        if df.height == 0:
            return
        codes = self._nodes.index(df.select("node"), shape=False)
        key = self._ring.key_index(df.select(pl.col("job").cast(pl.Utf8), pl.col("rank").cast(pl.Int32)))
        self._ring.insert(
            key,
            df["ts"].to_numpy(),
            {"wait": df["collective_wait_seconds"].to_numpy(), "step": df["step_time_seconds"].cast(pl.Float64).fill_null(np.nan).to_numpy()},
            {"node": codes.astype(np.int32), "gpu": df["gpu"].fill_null(NO_GPU).to_numpy().astype(np.int32)},
            keep_from,
        )

    # -- evaluation ------------------------------------------------------------------------------
    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        # Jobs whose hook rows carry a wait often enough for this detector (min_samples over its
        # window): the device's straggler detector, running beside this one, is held back for them.
        self.healthy_jobs = covered_jobs(window.get(STREAM), now, c.window_seconds / 2, (c.min_samples + 1) / 2, column="collective_wait_seconds")
        self.ingest(window)
        fast, look, horizon = self._spans(window)
        if not self._seconds:
            return []
        starts = SlidingRows.starts(window)
        # Which jobs' median step is provably short (window = `fast`): a count of short steps
        # above half of an upper bound on the job's step count.
        lo_look = max(now - look, now - horizon)
        counts = self._seconds[0] if len(self._seconds) == 1 else pl.concat(self._seconds, how="vertical_relaxed")
        counts = counts.join(starts, on="job", how="left").with_columns(pl.max_horizontal(pl.lit(lo_look), pl.col("_start")).alias("_from"))
        jobs = counts.group_by("job").agg(
            pl.col("_short").filter(pl.col("_lo") >= pl.col("_from")).sum().alias("short"),
            pl.col("_steps").filter(pl.col("_hi") >= pl.col("_from")).sum().alias("steps"),
        )
        settled = (pl.col("steps") == 0) | (pl.col("short") >= pl.col("steps") // 2 + 1)
        unsettled = jobs.filter(~settled)["job"]
        parts = [self._per_rank_fast(window, starts, unsettled, fast, horizon)]
        if unsettled.len():
            parts.append(self._per_rank_refit(window, unsettled))
        per_rank = pl.concat(parts, how="vertical_relaxed") if len(parts) > 1 else parts[0]
        return self._judge(per_rank, now)

    def _per_rank_fast(self, window: Window, starts: pl.DataFrame, unsettled: pl.Series, fast: float, horizon: float) -> pl.DataFrame:
        """Per-rank rows for the jobs judged over `fast` seconds, from the rings.

        Every rank's median wait (its peers' median needs them all); the median step and the
        newest node/GPU only for ranks whose wait is low enough to be flagged (the others fail
        `wait <= max_wait_share x peer_wait` whatever their step, so it is left null).
        """
        c = self.config
        ring = self._ring
        keys = ring.keys
        if unsettled.len():
            keys = keys.filter(~pl.col("job").is_in(unsettled.implode(), nulls_equal=True))
        keys = keys.join(starts, on="job", how="left", maintain_order="left")
        every = keys.height == ring.n  # keys are numbered in order: plain slices, no copies
        rows = slice(0, ring.n) if every else keys["_k"].to_numpy()
        now = window.now
        lo = np.maximum(max(now - fast, now - horizon), keys["_start"].fill_null(-np.inf).to_numpy())
        valid = ring.ts[rows] >= lo[:, None]
        wait, n = masked_median(ring.f["wait"][rows], valid)
        per = pl.DataFrame({"job": keys["job"], "rank": keys["rank"], "n": pl.Series(n, dtype=pl.UInt32), "wait": wait, "_i": np.arange(keys.height)}).filter(
            pl.col("n") > 0
        )
        peers = per.group_by("job").agg(pl.col("wait").median().alias("_peer"))
        cand = per.join(peers, on="job").filter(pl.col("wait") <= c.max_wait_share * pl.col("_peer"))["_i"].to_numpy()
        step = np.full(keys.height, np.nan)
        gpu = np.full(keys.height, NO_GPU, np.int32)
        node: list[str | None] = [None] * keys.height
        if cand.size:
            krows = np.arange(ring.n)[rows][cand]
            cvalid = valid[cand]
            step[cand] = masked_median(ring.f["step"][krows], cvalid)[0]
            slot = ring.newest(krows, cvalid)
            gpu[cand] = ring.i["gpu"][krows, slot]
            names = self._nodes.table["node"].gather(ring.i["node"][krows, slot]).to_list()
            for i, name in zip(cand.tolist(), names, strict=True):
                node[i] = name
        idx = per["_i"]
        return per.drop("_i").with_columns(
            pl.Series("step", step).gather(idx).fill_nan(None),
            pl.Series("node", node, dtype=pl.Utf8).gather(idx),
            pl.Series("gpu", gpu, dtype=pl.Int32).gather(idx).replace(NO_GPU, None),
        )

    def _per_rank_refit(self, window: Window, jobs: pl.Series) -> pl.DataFrame:
        """The refit, for jobs whose window the counts could not settle."""
        c = self.config
        now = window.now
        rp = current_run(window, STREAM, since=now - max(c.window_seconds, c.max_window_seconds)).filter(
            pl.col("collective_wait_seconds").is_not_null() & pl.col("job").is_in(jobs.implode(), nulls_equal=True)
        )
        # Each job is judged over max(window_seconds, min_steps × its step time).
        rp = rp.filter(
            pl.col("ts") >= now - pl.max_horizontal(pl.lit(c.window_seconds), pl.col("step_time_seconds").median().over("job") * c.min_steps).clip(upper_bound=c.max_window_seconds)
        )
        return rp.group_by(["job", "rank"]).agg(
            pl.len().alias("n"),
            pl.col("collective_wait_seconds").median().alias("wait"),
            pl.col("step_time_seconds").median().alias("step"),
            pl.col("node").last(),
            pl.col("gpu").last(),
        )

    def _judge(self, per_rank: pl.DataFrame, now: float) -> list[Finding]:
        c = self.config
        if per_rank.height == 0:
            return []
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
                    gpu=w["gpu"],
                    source=self.name,
                    evidence={
                        "slowdown": round(float(w["slowdown"]), 3),
                        "rank_wait_seconds": round(float(w["wait"]), 4),
                        "peer_wait_seconds": round(float(w["peer_wait"]), 4),
                        "step_time_seconds": round(float(w["step"]), 4),
                        "ranks_in_job": int(w["ranks"]),
                    },
                    summary=(
                        f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])} computes {100 * (w['slowdown'] - 1):.0f}% slower than its "
                        f"{w['ranks'] - 1} peers, who wait {w['peer_wait']:.2f} s per {w['step']:.2f} s step for it."
                    ),
                )
            )
        return findings
