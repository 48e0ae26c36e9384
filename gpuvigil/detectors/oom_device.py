"""L0 OOM prediction from device memory (NVML per-process used memory, else DCGM FB_USED).

What the device sees of PyTorch is the caching allocator's footprint (reserved segments) plus the
CUDA context and NCCL buffers: it grows in segment-sized steps and shrinks only on
`empty_cache()` (or a restart); the sawtooth of allocated memory within a step stays inside it
(pytorch#37250). A healthy job's footprint is therefore a step function that plateaus after
warm-up, however close to capacity the plateau is; a leak (or growing activations) keeps adding
segments. The detector follows the upper envelope of each process's footprint since its last
drop, and warns when it has risen in at least `min_rises` separate steps spread over
`min_span_seconds`: rate = growth between the first and the last step / their time apart; time
to OOM = headroom / rate, where headroom = capacity (total − driver-reserved) − safety margin −
what the GPU holds now.

Cause: another process on the GPU whose memory grows (per-process memory only) = foreign
process; else leak/capacity. The other processes' memory on a job's GPU is followed the same way
(its own envelope, steps, span and rate), so it warns next to a flat job too, while a single
one-off allocation by another process is no trend. Fragmentation cannot be seen at L0: a fragmenting pool also adds
segments, and only the allocator's own statistics (L2) tell reserved-but-unallocated apart.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.common import allocated_gpu_retention, rank_at, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

GIB = float(1 << 30)
NOT_AT_L0 = "fragmentation cannot be seen at L0 (device memory shows the allocator's footprint, not what is free inside it)"


class OomDeviceConfig(BaseModel):
    fit_window_seconds: float = 110.0
    warmup_seconds: float = 30.0
    min_rises: int = 3  # separate upward steps of the envelope
    rise_bytes: int = 64 << 20  # a step smaller than this is noise
    drop_bytes: int = 1 << 30  # a fall this large is empty_cache or a restart: start over
    min_span_seconds: float = 20.0  # first to last step at least this far apart
    min_growth_bytes: int = 1 << 30
    predict_horizon_seconds: float = 1800.0
    page_within_seconds: float = 900.0
    safety_margin_bytes: int = 1 << 30
    foreign_share: float = 0.5  # cause = foreign process when its growth is this share of the GPU's
    # Memory at scale (issue 11): gpu_samples rows older than this are kept only for the GPUs of
    # jobs whose findings this detector gives (pipeline/core.py: declared_retention); null: all.
    history_recent_seconds: float | None = Field(10.0, ge=0)


class DeviceOomPredictor:
    name = "oom_device"
    level = "L0"
    capability = "oom"
    streams = ("gpu_samples", "gpu_processes")

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom_device", OomDeviceConfig, cfg)

    def lookback_seconds(self) -> dict[str, float]:
        """History read from the window (pipeline/core.py: declared_horizons, declared_columns)."""
        return {"gpu_samples": self.config.fit_window_seconds}

    def window_retention(self) -> dict[str, tuple[float, str]]:
        return allocated_gpu_retention(self.config.history_recent_seconds)

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        return {"gpu_samples": ("ts", "node", "gpu", "memory_used_bytes", "memory_total_bytes", "memory_reserved_bytes")}

    def _series(self, window: Window, since: float) -> pl.DataFrame:
        """(ts, job, rank, node, gpu, own, gpu_used, capacity, foreign) per process sample."""
        gs = window.get("gpu_samples").filter(pl.col("ts") >= since)
        alloc = window.get("allocations").select("node", "gpu", "job", "rank")
        if gs.height == 0 or alloc.height == 0:
            return pl.DataFrame()
        dev = gs.select(
            "ts",
            "node",
            "gpu",
            pl.col("memory_used_bytes").cast(pl.Float64).alias("gpu_used"),
            (pl.col("memory_total_bytes") - pl.col("memory_reserved_bytes").fill_null(0)).cast(pl.Float64).alias("capacity"),
        ).filter(pl.col("gpu_used").is_not_null())
        procs = window.get("gpu_processes")
        if procs.height:
            procs = procs.filter((pl.col("ts") >= since) & pl.col("used_memory_bytes").is_not_null())
        if procs.height:
            # A process is the job's when the scheduler's map or its own attribution says so.
            p = procs.join(alloc.rename({"job": "_ajob", "rank": "_arank"}), on=["node", "gpu"], how="left").with_columns(
                (pl.col("job").is_not_null() & (pl.col("job") == pl.col("_ajob")) | pl.col("job").is_null() & (pl.col("slurm_job") == pl.col("_ajob"))).fill_null(False).alias("own")
            )
            per = p.group_by(["ts", "node", "gpu"]).agg(
                pl.col("used_memory_bytes").filter(pl.col("own")).sum().cast(pl.Float64).alias("own"),
                pl.col("used_memory_bytes").filter(~pl.col("own")).sum().cast(pl.Float64).alias("foreign"),
            )
            dev = dev.join(per, on=["ts", "node", "gpu"], how="left").with_columns(pl.col("own").fill_null(pl.col("gpu_used")))
        else:
            dev = dev.with_columns(pl.col("gpu_used").alias("own"), pl.lit(None, pl.Float64).alias("foreign"))
        return dev.join(alloc, on=["node", "gpu"], how="inner")

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        df = self._series(window, now - c.fit_window_seconds)
        if df.height == 0:
            return []
        jobs = window.get("jobs")
        if jobs.height:
            df = df.join(jobs.select("job", pl.col("start_ts").alias("_start")), on="job", how="left").filter(
                pl.col("_start").is_null() | (pl.col("ts") >= pl.col("_start") + c.warmup_seconds)
            )
        key = ["job", "rank", "node", "gpu"]
        df = df.sort([*key, "ts"])
        # Segments since the last large drop, the envelope within them, and where it stepped up.
        df = df.with_columns((pl.col("own").diff().over(key) < -c.drop_bytes).fill_null(False).cum_sum().over(key).alias("seg"))
        df = df.filter(pl.col("seg") == pl.col("seg").max().over(key))
        df = df.with_columns(pl.col("own").cum_max().over(key).alias("env"), pl.col("foreign").fill_null(0).cum_max().over(key).alias("fenv"))
        df = df.with_columns(*((pl.col(e).diff().over(key).fill_null(0) > c.rise_bytes).alias(f"{e}_rise") for e in ("env", "fenv")))
        per = df.group_by(key).agg(
            *_steps("env"),
            *_steps("fenv"),
            pl.col("env").first().alias("env_start"),
            pl.col("fenv").first().alias("fenv_start"),
            pl.col("foreign").is_not_null().any().alias("has_procs"),
            pl.col("gpu_used").last().alias("gpu_used"),
            pl.col("capacity").last().alias("capacity"),
            pl.col("own").last().alias("own_now"),
        ).with_columns(
            (pl.col("env_last") - pl.col("env_start")).alias("growth"),
            (pl.col("fenv_last") - pl.col("fenv_start")).alias("f_growth"),
            (pl.col("capacity") - c.safety_margin_bytes - pl.col("gpu_used")).alias("headroom"),
        )

        fits = _trend(per, "env", c)
        # Another process's growth on a job's GPU also counts when the job's own footprint is
        # flat, fitted the same way from its own steps (a one-off allocation is no trend); every
        # GPU of the job is judged and the nearest to OOM named.
        foreign = _trend(per.filter(pl.col("has_procs")), "fenv", c)
        findings = []
        seen = set()
        for rows in fits.partition_by("job", maintain_order=True):
            w = rows.row(0, named=True)
            seen.add(w["job"])
            is_foreign = bool(w["has_procs"]) and w["f_growth"] >= c.foreign_share * max(w["growth"] + w["f_growth"], 1.0)
            findings.append(self._finding(now, w, rows.height, "foreign_process" if is_foreign else "leak", float(w["rate"]), float(w["tto"])))
        for rows in foreign.filter(~pl.col("job").is_in(list(seen))).partition_by("job", maintain_order=True) if foreign.height else []:
            w = rows.row(0, named=True)
            findings.append(self._finding(now, w, rows.height, "foreign_process", float(w["rate"]), float(w["tto"])))
        return findings

    def _finding(self, now: float, w: dict, n_at_risk: int, cause: str, rate: float, tto: float) -> Finding:
        c = self.config
        what = "another process on the GPU is taking more and more memory" if cause == "foreign_process" else "the job's footprint keeps adding segments (a leak, or a workload outgrowing the GPU)"
        if not w["has_procs"]:
            # DCGM's FB_USED alone: the GPU's memory grows, whose it is cannot be told.
            what = "the GPU's used memory keeps growing in segment steps (a leak or a workload outgrowing the GPU; without per-process memory another process's growth cannot be told apart)"
        return Finding(
            kind=FindingKind.OOM_PREDICTED,
            severity=Severity.PAGE if tto <= c.page_within_seconds else Severity.TICKET,
            ts=now,
            job=w["job"],
            ranks=[int(w["rank"])],
            node=w["node"],
            gpu=w["gpu"],
            cause=cause,
            source=self.name,
            evidence={
                "level": "L0",
                "time_to_oom_seconds": round(tto, 1),
                "rank": int(w["rank"]),
                "growth_bytes_per_second": round(rate),
                "footprint_bytes": int(w["own_now"]),
                "gpu_used_bytes": int(w["gpu_used"]),
                "capacity_bytes": int(w["capacity"]),
                "headroom_bytes": int(w["headroom"]),
                "segment_steps": int(w.get("rises") or 0),
                "per_process_memory": bool(w["has_procs"]),
                "ranks_at_risk": n_at_risk,
                "fragmentation_visible": False,
                "note": NOT_AT_L0,
            },
            summary=(
                f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])} will run out of GPU memory in about {tto / 60:.1f} min (L0, device memory): "
                f"{what}, +{rate / GIB * 60:.2f} GiB/min, {max(w['headroom'], 0) / GIB:.1f} GiB left; {NOT_AT_L0}."
            ),
        )


def _steps(e: str) -> list[pl.Expr]:
    """Envelope `e`'s upward steps (column `{e}_rise`): how many, when the first and the last
    came, the envelope right after the first, and the envelope now."""
    rise = pl.col(f"{e}_rise")
    return [
        rise.sum().alias(f"{e}_rises"),
        pl.col("ts").filter(rise).min().alias(f"{e}_t_first"),
        pl.col("ts").filter(rise).max().alias(f"{e}_t_last"),
        pl.col(e).filter(rise).min().alias(f"{e}_first"),
        pl.col(e).last().alias(f"{e}_last"),
    ]


def _trend(per: pl.DataFrame, e: str, c: OomDeviceConfig) -> pl.DataFrame:
    """The GPUs of `per` where envelope `e` (the job's own, or the other processes') has risen in
    at least min_rises steps over at least min_span_seconds and by min_growth_bytes since the fit
    window began, within the horizon: rate = its rise from the first step to now / the first to
    last step's time apart; nearest to OOM first."""
    span = pl.col(f"{e}_t_last") - pl.col(f"{e}_t_first")
    return (
        per.with_columns(((pl.col(f"{e}_last") - pl.col(f"{e}_first")) / span).alias("rate"), pl.col(f"{e}_rises").alias("rises"))
        .with_columns((pl.col("headroom").clip(lower_bound=0) / pl.col("rate")).alias("tto"))
        .filter(
            (pl.col("rises") >= c.min_rises)
            & (span >= c.min_span_seconds)
            & (pl.col(f"{e}_last") - pl.col(f"{e}_start") >= c.min_growth_bytes)
            & (pl.col("rate") > 0)
            & (pl.col("tto") <= c.predict_horizon_seconds)
        )
        .sort(["tto", "job", "rank"])
    )
