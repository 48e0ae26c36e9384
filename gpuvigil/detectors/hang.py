"""Collective hang: some ranks wait in a collective that others never entered.

Signals, all from `rank_progress` (the in-process hook's Flight Recorder `pg_status`):
- a job is *stalled* when its highest enqueued sequence number is ahead of its lowest completed
  one (someone is waiting) and no collective has completed for longer than the job's own cadence
  allows: max(min_stall_seconds, step_time_factor × median step time);
- the *culprits* are the ranks that never enqueued the pending collective, ranks whose
  reports stopped while their peers kept reporting (a dead process or a GPU off the bus), and,
  where the Flight Recorder records kernel starts (NCCL with TORCH_NCCL_ENABLE_TIMING=1, which
  the hook turns on when it starts before the process group), ranks that enqueued it but never
  started it while their peers did: stuck in a kernel before it. A start of -1 is a start
  record ("nothing started yet"); a missing one (null: gloo, timing off, a hook started too
  late) is unknown and never makes a rank a culprit.
  Without start records such a rank looks like its peers: when every rank has entered the
  pending collective and none completes it for longer (`all_entered_*`), the job is paged hung;
  an XID or ECC event on the GPU of exactly one of its ranks names that rank (a GPU that failed
  under its kernel), else no culprit is named and the L0/L1 detectors, which run beside this one
  for hooked jobs (pipeline/levels.py), join it with theirs.
A checkpoint save or a data-loader stall pauses all ranks *outside* collectives (enqueued ==
completed everywhere), so it is never a hang. XID/ECC events on a culprit's node say hardware.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.policies import implicates_hardware
from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import node_names, rank_at, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class HangConfig(BaseModel):
    min_stall_seconds: float = 5.0
    step_time_factor: float = 1.5
    stale_report_seconds: float = 5.0
    hardware_lookback_seconds: float = 120.0
    forget_after_seconds: float = 900.0
    # Every rank entered the pending collective and none completes it (nobody missing, nobody
    # silent): a rank stuck inside a kernel or the network, which start records would name. Paged
    # without a culprit after max(all_entered_min_seconds, all_entered_step_factor x step time).
    all_entered_min_seconds: float = 8.0
    all_entered_step_factor: float = 3.0


class HangDetector(Declared):
    spec = DetectorSpec(
        name="hang",
        config=HangConfig,
        emits=(FindingKind.COLLECTIVE_HANG,),
        reads={"rank_progress": FRESH, "events": HISTORY, "jobs": HISTORY},
        order=10,
        level="L2",
        capability="hang",
        streams=("rank_progress",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("hang", HangConfig, cfg)
        self._state: pl.DataFrame | None = None
        # Per job: the last tick on which nobody waited in a collective. A stall is timed from
        # the later of this and the last completion, so a checkpoint or data-loader pause (all
        # ranks outside collectives) does not count towards the next collective's wait.
        self._idle: pl.DataFrame = pl.DataFrame(schema={"job": pl.Utf8, "idle_ts": pl.Float64})
        # Jobs whose fresh reports show them healthy for hangs on the last detect (collectives
        # completing, or nobody inside one): the level selection keeps the L0/L1 hang detectors'
        # findings for these jobs back (their device view is the weaker evidence).
        self.healthy_jobs: set[str] = set()

    def carry_over(self) -> dict[str, pl.DataFrame]:
        """The state a replay of the last minutes cannot rebuild, for the next owner of a fleet
        partition (`restore`): the latest report of every rank of the jobs someone waits in, with
        when its completed counter last moved, and when those jobs last had nobody waiting. A
        replay alone would time a stall older than itself from its own first row, and lose a
        rank silent since before it. Jobs nobody waits in rebuild exactly from the replay."""
        state = self._state
        if state is None or state.height == 0:
            return {}
        waiting = state.group_by("job").agg(pl.col("last_enqueued_seq").max().alias("_enq"), pl.col("last_completed_seq").min().alias("_comp"))
        waiting = waiting.filter(pl.col("_enq") > pl.col("_comp")).select("job")
        if waiting.height == 0:
            return {}
        return {"state": state.join(waiting, on="job", how="semi"), "idle": self._idle.join(waiting, on="job", how="semi")}

    def restore(self, frames: dict[str, pl.DataFrame]) -> None:
        """Take `carry_over()`'s frames before the first detect: the replay's reports then continue
        them (a rank whose completed counter has not moved keeps the time it last moved)."""
        state, idle = frames.get("state"), frames.get("idle")
        if state is not None and state.height and {"job", "rank", "ts", "last_completed_seq", "since"} <= set(state.columns):
            self._state = state
        if idle is not None and idle.height and set(idle.columns) == {"job", "idle_ts"}:
            self._idle = idle.cast({"job": pl.Utf8, "idle_ts": pl.Float64})

    def _update_state(self, window: Window) -> pl.DataFrame:
        """Per (job, rank): the latest report and when its completed counter last moved.

        Kept incrementally from each tick's fresh rows, so the cost is O(ranks) per tick
        however long a stall lasts.
        """
        fresh = window.fresh("rank_progress")
        if fresh.height:
            # A tick may carry many reports of a rank (a slow tick over a fast sampler, or a
            # replica rebuilding a partition from the stream in one go): its counter last moved
            # at the first of them that shows the latest completed collective, not at the latest
            # report, so the stall is timed exactly as if every report had been its own tick.
            fresh = fresh.sort("ts")
            last = fresh.group_by(["job", "rank"], maintain_order=True).last()
            moved = (
                fresh.join(last.select("job", "rank", pl.col("last_completed_seq").alias("_final")), on=["job", "rank"])
                .filter(pl.col("last_completed_seq").eq_missing(pl.col("_final")))
                .group_by(["job", "rank"])
                .agg(pl.col("ts").min().alias("_moved"))
            )
            # in the stream's column order, as a state begun from an empty tick has it
            fresh = last.join(moved, on=["job", "rank"], how="left").select(*fresh.columns, "_moved")
        else:
            fresh = fresh.with_columns(pl.col("ts").alias("_moved"))
        if self._state is None:
            state = fresh.rename({"_moved": "since"})
        elif fresh.height == 0:
            state = self._state
        else:
            prev = self._state.select("job", "rank", pl.col("last_completed_seq").alias("_prev_comp"), pl.col("since").alias("_prev_since"))
            updated = fresh.join(prev, on=["job", "rank"], how="left").with_columns(
                pl.when(pl.col("_prev_comp") == pl.col("last_completed_seq")).then(pl.col("_prev_since")).otherwise(pl.col("_moved")).alias("since")
            ).drop("_prev_comp", "_prev_since", "_moved")
            kept = self._state.join(fresh.select("job", "rank"), on=["job", "rank"], how="anti")
            state = pl.concat([kept, updated], how="vertical_relaxed")
        jobs = window.get("jobs")
        if jobs.height and state.height:
            # Forget ranks of a job's previous run (requeued) and of jobs no longer running.
            running = jobs.filter(pl.col("state") == "running").select("job", pl.col("start_ts").alias("_start"))
            state = state.join(running, on="job", how="inner").filter(pl.col("ts") >= pl.col("_start")).drop("_start")
        self._state = state.filter(pl.col("ts") >= window.now - self.config.forget_after_seconds)
        return self._state

    def _idle_in_batch(self, window: Window) -> pl.DataFrame:
        """(job, idle_ts): the latest report time, among this tick's several reports of a job,
        at which every rank of it reported and nobody waited in a collective. What a detector
        ticking on every report would have kept in `_idle`; counted only for report times at
        which all the job's ranks in the batch reported together (else unknown: not guessed)."""
        fresh = window.fresh("rank_progress")
        if fresh.height == 0 or fresh["ts"].n_unique() < 2:
            return pl.DataFrame(schema={"job": pl.Utf8, "idle_ts": pl.Float64})
        ranks = fresh.group_by("job").agg(pl.col("rank").n_unique().alias("_n"))
        return (
            fresh.group_by(["job", "ts"])
            .agg(pl.col("last_enqueued_seq").max().alias("_enq"), pl.col("last_completed_seq").min().alias("_comp"), pl.col("rank").n_unique().alias("_k"))
            .join(ranks, on="job")
            .filter((pl.col("_k") == pl.col("_n")) & (pl.col("_enq") <= pl.col("_comp")))
            .group_by("job")
            .agg(pl.col("ts").max().alias("idle_ts"))
        )

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        latest = self._update_state(window)
        self.healthy_jobs = set()
        if latest.height == 0:
            return []
        if "last_started_seq" not in latest.columns:
            latest = latest.with_columns(pl.lit(None, dtype=pl.Int64).alias("last_started_seq"))
        per_job = self._stalled_jobs(self._per_job(latest), window, now)
        if per_job.height == 0:
            return []
        ranks = self._rank_roles(latest, per_job)
        events = window.get("events").filter(implicates_hardware(now - c.hardware_lookback_seconds))
        findings = []
        for job_rows in ranks.partition_by("job"):
            culprits = job_rows.filter(pl.col("culprit")).sort("rank")
            if culprits.height == job_rows.height:
                continue  # nobody waiting on anybody: not a collective hang
            first = job_rows.row(0, named=True)
            if culprits.height == 0:
                # Everybody entered it: hung only if it stays incomplete well past the cadence.
                if first["stalled_seconds"] > max(c.all_entered_min_seconds, c.all_entered_step_factor * (first["step_time"] or 0.0)):
                    findings.append(self._all_entered(job_rows, first, events, now))
                continue
            findings.append(self._culprit_finding(job_rows, culprits, first, events, now))
        return findings

    @staticmethod
    def _per_job(latest: pl.DataFrame) -> pl.DataFrame:
        """Each job's collective progress over its ranks' latest reports."""
        return (
            latest.group_by("job")
            .agg(
                pl.col("last_enqueued_seq").max().alias("max_enq"),
                pl.col("last_completed_seq").min().alias("min_comp"),
                pl.col("ts").max().alias("fresh_ts"),
                pl.col("since").max().alias("progress_ts"),
                pl.len().alias("n_ranks"),
                pl.col("step_time_seconds").median().alias("step_time"),
                pl.col("last_started_seq").max().alias("max_started"),
            )
        )

    def _stalled_jobs(self, per_job: pl.DataFrame, window: Window, now: float) -> pl.DataFrame:
        """The jobs with a collective pending past their threshold; the others that report are healthy."""
        c = self.config
        idle_before = self._idle_in_batch(window)
        if idle_before.height:
            self._idle = pl.concat([self._idle, idle_before]).group_by("job", maintain_order=True).agg(pl.col("idle_ts").max())
        idle_now = per_job.filter(pl.col("max_enq") <= pl.col("min_comp")).select("job", pl.lit(now).alias("idle_ts"))
        self._idle = pl.concat([self._idle.join(per_job.select("job"), on="job", how="semi").join(idle_now, on="job", how="anti"), idle_now])
        per_job = per_job.join(self._idle, on="job", how="left").with_columns(
            pl.max_horizontal(pl.lit(c.min_stall_seconds), pl.col("step_time") * c.step_time_factor).alias("threshold"),
            (pl.lit(now) - pl.max_horizontal("progress_ts", "idle_ts")).alias("stalled_seconds"),
        )
        healthy = per_job.filter(
            (pl.lit(now) - pl.col("fresh_ts") <= c.stale_report_seconds)
            & pl.col("max_enq").is_not_null()
            & pl.col("min_comp").is_not_null()
            & ((pl.col("max_enq") <= pl.col("min_comp")) | (pl.col("stalled_seconds") <= pl.col("threshold")))
        )
        self.healthy_jobs = set(healthy["job"].drop_nulls().to_list())
        per_job = (
            per_job.filter(
                (pl.col("max_enq") > pl.col("min_comp"))
                & (pl.col("stalled_seconds") > pl.col("threshold"))
                & (pl.lit(now) - pl.col("fresh_ts") <= c.stale_report_seconds)  # the job still reports
            )
        )
        return per_job

    def _rank_roles(self, latest: pl.DataFrame, per_job: pl.DataFrame) -> pl.DataFrame:
        """The stalled jobs' ranks, each marked culprit (did not join), silent or not started."""
        c = self.config
        return latest.join(per_job.select("job", "min_comp", "fresh_ts", "stalled_seconds", "threshold", "step_time", "n_ranks", "max_started"), on="job").with_columns(
            # Enqueued but never started while a peer started it (start records exist).
            ((pl.col("max_started") > pl.col("min_comp")) & (pl.col("last_started_seq") <= pl.col("min_comp"))).fill_null(False).alias("not_started"),
        ).with_columns(
            (
                (pl.col("last_enqueued_seq") <= pl.col("min_comp"))
                | (pl.col("fresh_ts") - pl.col("ts") > c.stale_report_seconds)
                | pl.col("not_started")
            ).fill_null(False).alias("culprit"),
            (pl.col("fresh_ts") - pl.col("ts") > c.stale_report_seconds).alias("silent"),
        )

    def _culprit_finding(self, job_rows: pl.DataFrame, culprits: pl.DataFrame, first: dict[str, Any], events: pl.DataFrame, now: float) -> Finding:
        """The hang of a job some of whose ranks did not join the pending collective."""
        job = first["job"]
        culprit_nodes = node_names(culprits["node"])
        hw = events.filter(pl.col("node").is_in(culprit_nodes))
        xids = sorted({int(x) for x in hw["xid"].drop_nulls().to_list()})
        silent = culprits.filter(pl.col("silent"))["rank"].to_list()
        in_kernel = culprits.filter(pl.col("not_started") & ~pl.col("silent") & (pl.col("last_enqueued_seq") > pl.col("min_comp")))["rank"].to_list()
        cause = "hardware" if hw.height else "software"
        c0 = culprits.row(0, named=True)
        seq = int(first["min_comp"]) + 1
        where = ", ".join(rank_at(r["rank"], r["node"], r["gpu"]) for r in culprits.head(4).iter_rows(named=True))
        more = f" and {culprits.height - 4} more" if culprits.height > 4 else ""
        why = f"XID {', '.join(map(str, xids))} on {', '.join(sorted(set(hw['node'].to_list())))}" if xids else ("its process stopped reporting" if silent else "stuck in a kernel before the collective: enqueued, never started" if in_kernel else "it never entered the collective")
        return Finding(
            kind=FindingKind.COLLECTIVE_HANG,
            severity=Severity.PAGE,
            ts=now,
            job=job,
            ranks=culprits["rank"].to_list(),
            culprit_ranks=culprits["rank"].to_list(),
            node=c0["node"] if len(culprit_nodes) == 1 else culprit_nodes[0],
            gpu=c0["gpu"] if culprits.height == 1 else None,
            cause=cause,
            source=self.name,
            evidence={
                "pending_seq": seq,
                "op": next((o for o in job_rows["current_op"].to_list() if o), None),
                "stalled_seconds": round(float(first["stalled_seconds"]), 1),
                "threshold_seconds": round(float(first["threshold"]), 2),
                "step_time_seconds": round(float(first["step_time"] or 0.0), 3),
                "waiting_ranks": int(job_rows.height - culprits.height),
                "world_size": int(first["n_ranks"]),
                "culprit_nodes": culprit_nodes,
                "silent_ranks": silent,
                "not_started_ranks": in_kernel,
                "xids": xids,
            },
            summary=(
                f"{job} is hung in collective #{seq}: {where}{more} did not join ({why}); "
                f"{job_rows.height - culprits.height} ranks have waited {first['stalled_seconds']:.0f} s."
            ),
        )

    def _all_entered(self, job_rows: pl.DataFrame, first: dict[str, Any], events: pl.DataFrame, now: float) -> Finding:
        job = first["job"]
        nodes = node_names(job_rows["node"])
        hw = events.filter(pl.col("node").is_in(nodes))
        xids = sorted({int(x) for x in hw["xid"].drop_nulls().to_list()})
        seq = int(first["min_comp"]) + 1
        # A hardware error on one GPU of the job: the rank on it is stuck under a failed kernel.
        bad = hw.select(pl.col("node").cast(pl.Utf8), pl.col("gpu").cast(pl.Int64)).drop_nulls().unique()
        on_bad = job_rows.with_columns(pl.col("node").cast(pl.Utf8), pl.col("gpu").cast(pl.Int64)).join(bad, on=["node", "gpu"], how="semi")
        culprits = [int(on_bad["rank"][0])] if bad.height == 1 and on_bad.height == 1 else []
        # Every rank's start known and every rank started: the kernel that hangs is the
        # collective's own (a network or peer-to-peer stall), not one before it.
        all_started = bool((job_rows["last_started_seq"] > job_rows["min_comp"]).fill_null(False).all())
        where = rank_at(culprits[0], on_bad["node"][0], on_bad["gpu"][0]) if culprits else None
        return Finding(
            kind=FindingKind.COLLECTIVE_HANG,
            severity=Severity.PAGE,
            ts=now,
            job=job,
            ranks=culprits,
            culprit_ranks=culprits,
            gpu=int(on_bad["gpu"][0]) if culprits else None,
            node=str(on_bad["node"][0]) if culprits else (nodes[0] if len(nodes) == 1 else None),
            cause="hardware" if hw.height else "software",
            source=self.name,
            evidence={
                "pending_seq": seq,
                "op": next((o for o in job_rows["current_op"].to_list() if o), None),
                "stalled_seconds": round(float(first["stalled_seconds"]), 1),
                "threshold_seconds": round(max(self.config.all_entered_min_seconds, self.config.all_entered_step_factor * (first["step_time"] or 0.0)), 2),
                "step_time_seconds": round(float(first["step_time"] or 0.0), 3),
                "waiting_ranks": int(job_rows.height),
                "world_size": int(first["n_ranks"]),
                "all_entered": True,
                "all_started": all_started,
                "xids": xids,
            },
            summary=(
                f"{job} is hung in collective #{seq}: all {job_rows.height} ranks entered it and none has completed it for "
                f"{first['stalled_seconds']:.0f} s; "
                + (
                    f"{where} is stuck under a failed kernel (XID {', '.join(map(str, xids))} on its GPU)."
                    if culprits and xids
                    else f"{where} is stuck under a failed kernel (a hardware error on its GPU)."
                    if culprits
                    else "every rank started it: the collective itself is stuck (network or a peer's link)."
                    if all_started
                    else "a rank is stuck inside a kernel or the network (the hook names it only where "
                    "the Flight Recorder records kernel starts: TORCH_NCCL_ENABLE_TIMING=1, set by gv.start() "
                    "before init_process_group)."
                )
            ),
        )
