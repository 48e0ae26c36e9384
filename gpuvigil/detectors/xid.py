"""XID events → findings, with meaning, fatality and NVIDIA's immediate action from the XID table.

Whose fault: an application-level XID (13, 31, 43, ... : `app_level` in the XID table) is
usually the program's own bug, but the same code hitting one GPU under several different jobs is
the GPU. Each GPU remembers the jobs its application-level XIDs came under (bounded: the newest
`blame.max_jobs_per_gpu` jobs of at most `blame.max_gpus` GPUs, for `blame.history_seconds`), and
each XID finding says `fault`: `user` (one job only: its owner is told, nothing is cordoned) or
`infrastructure` (fatal codes, and application-level ones under `blame.min_jobs` jobs or more:
the hardware team, and the node is cordoned by the hint rules).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil import policies
from gpuvigil.gpu import xid as xid_table
from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window


class XidBlameConfig(BaseModel):
    # Distinct jobs an application-level XID must come under on one GPU to be the GPU's fault.
    min_jobs: int = Field(2, ge=2)
    # How long a GPU remembers the jobs its application-level XIDs came under.
    history_seconds: float = Field(7 * 86400.0, gt=0)
    # Bounds of that memory: GPUs (least recently hit forgotten first) and jobs per GPU (oldest first).
    max_gpus: int = Field(100_000, ge=1)
    max_jobs_per_gpu: int = Field(16, ge=2)
    # Where the history is kept across restarts (JSON, rewritten when it changes); null: in memory.
    state_file: str | None = None


class XidConfig(BaseModel):
    report_seconds: float = 600.0
    ecc_codes: list[int] = [48, 63, 64, 92, 94, 95]
    blame: XidBlameConfig = XidBlameConfig()


Fault = Literal["user", "infrastructure"]


class GpuJobHistory:
    """Per GPU, the jobs its application-level XIDs came under and when last: bounded in GPUs,
    jobs per GPU and age, so a fleet's years of XIDs stay a few MB."""

    def __init__(self, cfg: XidBlameConfig):
        self.cfg = cfg
        self._gpus: OrderedDict[tuple[str | None, int | None], dict[str, float]] = OrderedDict()

    def record(self, node: str | None, gpu: int | None, job: str, ts: float) -> bool:
        """Remember `job` on the GPU at `ts`; whether anything changed."""
        key = (node, gpu)
        jobs = self._gpus.get(key, {})
        if jobs.get(job, float("-inf")) >= ts and next(reversed(self._gpus), None) == key:
            return False
        jobs = self._gpus.pop(key, {})
        jobs[job] = max(ts, jobs.get(job, ts))
        if len(jobs) > self.cfg.max_jobs_per_gpu:
            for old in sorted(jobs, key=jobs.__getitem__)[: len(jobs) - self.cfg.max_jobs_per_gpu]:
                del jobs[old]
        self._gpus[key] = jobs  # most recently hit last
        while len(self._gpus) > self.cfg.max_gpus:
            self._gpus.popitem(last=False)
        return True

    def to_json(self) -> list[Any]:
        return [[node, gpu, jobs] for (node, gpu), jobs in self._gpus.items()]

    def load(self, rows: Any) -> None:
        """Rows of `to_json` read back (a file is untrusted: rows that are not well formed are
        skipped, and the bounds apply as if they were recorded again)."""
        if not isinstance(rows, list):
            return
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[2], dict)):
                continue
            node, gpu, jobs = row
            if not (node is None or isinstance(node, str)) or not (gpu is None or (isinstance(gpu, int) and not isinstance(gpu, bool))):
                continue
            for job, ts in jobs.items():
                if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts):
                    self.record(node, gpu, str(job), float(ts))

    def jobs(self, node: str | None, gpu: int | None, now: float) -> list[str]:
        """The jobs hit on this GPU within the history, oldest first."""
        jobs = self._gpus.get((node, gpu), {})
        for old in [j for j, t in jobs.items() if t < now - self.cfg.history_seconds]:
            del jobs[old]
        return sorted(jobs, key=lambda j: (jobs[j], j))

    def __len__(self) -> int:
        return len(self._gpus)


class XidDetector(Declared):
    spec = DetectorSpec(
        name="xid",
        config=XidConfig,
        emits=(FindingKind.XID,),
        reads={"events": HISTORY, "allocations": HISTORY, "gpu_samples": FRESH},
        order=80,
        level="L0",
        streams=("events", "gpu_samples"),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("xid", XidConfig, cfg)
        self.history = GpuJobHistory(self.config.blame)
        state = self.config.blame.state_file
        if state:
            try:
                self.history.load(json.loads(Path(state).read_text()))
            except (OSError, ValueError, UnicodeDecodeError, RecursionError):
                pass  # no file yet, or not ours to trust: start empty

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        ev = window.get("events")
        # nothing recent: most ticks (a max over the column is far cheaper than the filter)
        if ev.height == 0 or (latest := ev.get_column("ts").max()) is None or latest < now - self.config.report_seconds:  # type: ignore[operator]
            return []
        ev = ev.filter(
            (pl.col("kind") == "xid")
            & pl.col("xid").is_not_null()
            & ~pl.col("xid").is_in(self.config.ecc_codes)
            & (pl.col("ts") >= now - self.config.report_seconds)
        )
        if ev.height == 0:
            return []
        groups = (
            ev.sort("ts")
            .group_by(["node", "gpu", "xid"], maintain_order=True)
            .agg(
                pl.len().alias("count"),
                pl.col("ts").min().alias("first_ts"),
                pl.col("ts").max().alias("last_ts"),
                pl.col("message").last(),
                pl.col("job").drop_nulls().last().alias("event_job"),
            )
            .join(gpu_jobs(window), on=["node", "gpu"], how="left")
        )
        self._remember_jobs(ev, window)
        findings = []
        for row in groups.iter_rows(named=True):
            code = int(row["xid"])
            info = xid_table.xid_info(code)
            fatal = xid_table.is_fatal(code, row["message"] or "")
            job = row["job"] or row["event_job"]
            meaning = info.name if info else "unknown XID (not in the table)"
            action = info.action if info else "CONTACT_SUPPORT"
            app_level = bool(info and info.app_level and not fatal)
            fault, jobs_hit, verdict = self._blame(row["node"], row["gpu"], fatal, app_level, now)
            # The shared XID policy, unless the job history decides: an application XID on a GPU
            # under several jobs is the GPU's (page), under one job its owner's (a ticket to them).
            severity = {"infrastructure": Severity.PAGE, "user": Severity.TICKET}.get(fault or "") or policies.xid_severity(code, row["message"] or "")
            findings.append(
                Finding(
                    kind=FindingKind.XID,
                    severity=severity,
                    ts=float(row["last_ts"]),
                    job=job,
                    ranks=[int(row["rank"])] if row.get("rank") is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    xid=code,
                    cause="hardware" if fault == "infrastructure" else policies.xid_cause(code, row["message"] or ""),
                    source=self.name,
                    evidence={
                        "xid": code,
                        "fatal": fatal,
                        "action": action,
                        "meaning": meaning,
                        "count": int(row["count"]),
                        "first_ts": float(row["first_ts"]),
                        "message": row["message"],
                        **({"app_level": True, "jobs_hit": jobs_hit} if app_level else {}),
                        **({"fault": fault} if fault else {}),
                    },
                    summary=(
                        f"XID {code} ({meaning}) on {place(row['node'], row['gpu'])}"
                        + (f" under job {job}" if job else "")
                        + f": {verdict}; NVIDIA action {action}."
                    ),
                )
            )
        return findings

    def _remember_jobs(self, ev: pl.DataFrame, window: Window) -> None:
        """Record the job each application-level XID event came under: its own job, else the
        job the scheduler placed on that GPU."""
        codes = [c for c, info in xid_table.table().items() if info.app_level]
        app = ev.filter(pl.col("xid").is_in(codes))
        if app.height == 0:
            return
        alloc = gpu_jobs(window).select("node", "gpu", pl.col("job").alias("placed_job")).unique(["node", "gpu"], keep="last")
        rows = (
            app.join(alloc, on=["node", "gpu"], how="left")
            .select("node", "gpu", "message", "xid", pl.coalesce("job", "placed_job").alias("job"), "ts")
            .filter(pl.col("job").is_not_null())
            .group_by("node", "gpu", "xid", "message", "job")
            .agg(pl.col("ts").max())
        )
        changed = False
        for node, gpu, xid, message, job, ts in rows.sort("ts").iter_rows():
            if not xid_table.is_fatal(xid, message or ""):
                changed = self.history.record(node, gpu, job, float(ts)) or changed
        state = self.config.blame.state_file
        if changed and state:
            try:
                tmp = Path(state).with_suffix(".tmp")
                tmp.write_text(json.dumps(self.history.to_json()))
                tmp.replace(state)
            except OSError:
                pass  # the history stays in memory; the next change tries again

    def _blame(self, node: str | None, gpu: int | None, fatal: bool, app_level: bool, now: float) -> tuple[Fault | None, list[str], str]:
        """Whose fault, the jobs hit on the GPU, and the summary's verdict."""
        if fatal:
            return "infrastructure", [], "fatal, cordon the node"
        if not app_level:
            return None, [], "application-level"
        jobs = self.history.jobs(node, gpu, now)
        days = self.config.blame.history_seconds / 86400.0
        within = f"{days:g} day{'s' if days != 1 else ''}" if days >= 1 else f"{self.config.blame.history_seconds / 3600.0:g} h"
        if len(jobs) >= self.config.blame.min_jobs:
            shown = ", ".join(jobs[-5:]) + (f" and {len(jobs) - 5} more" if len(jobs) > 5 else "")
            return "infrastructure", jobs, (
                f"infrastructure fault: {len(jobs)} different jobs ({shown}) hit it on this GPU within {within}, "
                "so the GPU, not the application: cordon the node"
            )
        if jobs:
            return "user", jobs, f"user fault: only job {jobs[0]} hit it on this GPU within {within}, so the application: its owner is told, no cordon"
        return None, [], "application-level, job unknown (whose fault is not known)"
