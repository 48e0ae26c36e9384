"""OOM predicted before it happens, from the trend of per-step memory peaks.

The caching allocator's footprint is what runs out: `reserved` (segments held) must stay below
capacity minus the context and other processes. Its per-step *peak* is flat for a healthy job,
however close to 100% the sawtooth goes; it rises for a leak (allocated peaks rise) and for
fragmentation (reserved − allocated rises, alloc retries rise). A least-squares line over the
recent window gives the growth rate and the time left; the cause is whichever component grows:
another process's memory on the GPU (foreign process), reserved − allocated with cudaMalloc
retries (fragmentation), or allocated peaks (a leak, or activations that keep growing).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.common import current_run, settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

GIB = float(1 << 30)


class OomConfig(BaseModel):
    fit_window_seconds: float = 90.0
    warmup_seconds: float = 30.0
    min_samples: int = 20
    min_span_seconds: float = 20.0
    min_growth_bytes_per_second: float = 1 << 20
    min_r2: float = 0.6
    predict_horizon_seconds: float = 1800.0
    page_within_seconds: float = 900.0
    safety_margin_bytes: int = 1 << 30
    fragmentation_share: float = 0.5
    # The footprint must rise by at least this much across the fit: a few samples of jitter
    # around a flat peak can fit a line too.
    min_rise_bytes: int = 1 << 29


class OomPredictor:
    name = "oom"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom", OomConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        df = current_run(window, "allocator_stats", since=now - c.fit_window_seconds, warmup=c.warmup_seconds)
        if df.height == 0:
            return []
        # Least squares from sums (one pass, no per-group sort): y in GiB keeps the sums of
        # squares well conditioned. The window's two halves are fitted too: growth must hold
        # in both the last min_span/2 seconds and before them (a one-off step, warm-up or a new
        # phase of training, is not a trend).
        half = -c.min_span_seconds / 2
        df = df.select(
            "job",
            "rank",
            "node",
            "gpu",
            "device_capacity_bytes",
            (pl.col("ts") - now).alias("t"),
            # What runs out is the device: our per-step peak footprint plus other processes.
            ((pl.max_horizontal("reserved_bytes", "peak_allocated_bytes") + pl.col("foreign_used_bytes").fill_null(0)) / GIB).alias("y"),
            ((pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")) / GIB).alias("gap"),
            (pl.col("peak_allocated_bytes") / GIB).alias("peak"),
            (pl.col("foreign_used_bytes").fill_null(0) / GIB).alias("foreign"),
            pl.col("alloc_retries").fill_null(0).cast(pl.Float64).alias("retries"),
        ).with_columns((pl.col("t") < half).cast(pl.Float64).alias("e"))
        t, y, e = pl.col("t"), pl.col("y"), pl.col("e")
        sums = df.group_by(["job", "rank"]).agg(
            pl.len().cast(pl.Float64).alias("n"),
            t.min().alias("t_min"),
            t.max().alias("t_max"),
            t.sum().alias("st"),
            (t * t).sum().alias("stt"),
            y.sum().alias("sy"),
            (t * y).sum().alias("sty"),
            (y * y).sum().alias("syy"),
            e.sum().alias("ne"),
            (e * t).sum().alias("ste"),
            (e * t * t).sum().alias("stte"),
            (e * y).sum().alias("sye"),
            (e * t * y).sum().alias("stye"),
            pl.col("gap").sum().alias("sg"),
            (t * pl.col("gap")).sum().alias("stg"),
            pl.col("peak").sum().alias("sp"),
            (t * pl.col("peak")).sum().alias("stp"),
            pl.col("foreign").sum().alias("sf"),
            (t * pl.col("foreign")).sum().alias("stf"),
            y.last().alias("footprint_gib"),
            pl.col("gap").last().alias("gap_gib"),
            pl.col("foreign").last().alias("foreign_gib"),
            (pl.col("retries").last() - pl.col("retries").first()).alias("retries_delta"),
            pl.col("device_capacity_bytes").last().alias("capacity"),
            pl.col("node").last(),
            pl.col("gpu").last(),
        )

        def slope(n: pl.Expr, st: pl.Expr, stt: pl.Expr, sy: pl.Expr, sty: pl.Expr) -> pl.Expr:
            den = n * stt - st * st
            # Fewer than 3 samples (e.g. a half with no data) is no fit: null fails every filter.
            return pl.when((n >= 3) & (den > 0)).then((n * sty - st * sy) / den)

        n, st, stt = pl.col("n"), pl.col("st"), pl.col("stt")
        nl, stl, sttl = n - pl.col("ne"), st - pl.col("ste"), stt - pl.col("stte")
        sxy = n * pl.col("sty") - st * pl.col("sy")
        fits = (
            sums.with_columns(
                (pl.col("t_max") - pl.col("t_min")).alias("span"),
                (slope(n, st, stt, pl.col("sy"), pl.col("sty")) * GIB).alias("slope"),
                (slope(pl.col("ne"), pl.col("ste"), pl.col("stte"), pl.col("sye"), pl.col("stye")) * GIB).alias("slope_early"),
                (slope(nl, stl, sttl, pl.col("sy") - pl.col("sye"), pl.col("sty") - pl.col("stye")) * GIB).alias("slope_late"),
                (slope(n, st, stt, pl.col("sg"), pl.col("stg")) * GIB).alias("gap_slope"),
                (slope(n, st, stt, pl.col("sp"), pl.col("stp")) * GIB).alias("peak_slope"),
                (slope(n, st, stt, pl.col("sf"), pl.col("stf")) * GIB).alias("foreign_slope"),
                pl.when((n * pl.col("syy") - pl.col("sy") * pl.col("sy")) > 0)
                .then(sxy * sxy / ((n * stt - st * st) * (n * pl.col("syy") - pl.col("sy") * pl.col("sy"))))
                .alias("r2"),
                (pl.col("footprint_gib") * GIB).alias("footprint"),
                (pl.col("gap_gib") * GIB).alias("gap"),
                (pl.col("foreign_gib") * GIB).alias("foreign"),
            )
            .with_columns(
                (pl.col("capacity") - c.safety_margin_bytes - pl.col("footprint")).alias("headroom"),
            )
            .with_columns((pl.col("headroom") / pl.col("slope")).alias("tto"))
            .filter(
                (pl.col("n") >= c.min_samples)
                & (pl.col("span") >= c.min_span_seconds)
                & (pl.col("slope") >= c.min_growth_bytes_per_second)
                & (pl.col("slope_early") >= c.min_growth_bytes_per_second / 2)
                & (pl.col("slope_late") >= c.min_growth_bytes_per_second / 2)
                & (pl.col("r2") >= c.min_r2)
                & (pl.col("slope") * pl.col("span") >= c.min_rise_bytes)
                & (pl.col("tto") <= c.predict_horizon_seconds)
            )
            .sort(["tto", "job", "rank"])  # job, rank break ties: same input, same finding
        )
        findings = []
        for rows in fits.partition_by("job", maintain_order=True):
            worst = rows.row(0, named=True)
            if worst["foreign_slope"] >= c.fragmentation_share * worst["slope"]:
                cause, what = "foreign_process", "another process on the GPU is taking memory"
            elif worst["gap_slope"] >= c.fragmentation_share * worst["slope"] or worst["retries_delta"] > 0 and worst["gap_slope"] > worst["peak_slope"]:
                cause, what = "fragmentation", "the caching allocator is fragmenting (reserved but unallocated memory keeps growing)"
            else:
                cause, what = "leak", "allocated memory grows every step (a leak or growing activations)"
            tto = float(worst["tto"])
            findings.append(
                Finding(
                    kind=FindingKind.OOM_PREDICTED,
                    severity=Severity.PAGE if tto <= c.page_within_seconds else Severity.TICKET,
                    ts=now,
                    job=worst["job"],
                    ranks=sorted(rows["rank"].to_list()),
                    node=worst["node"],
                    gpu=int(worst["gpu"]),
                    cause=cause,
                    source=self.name,
                    evidence={
                        "time_to_oom_seconds": round(tto, 1),
                        "rank": int(worst["rank"]),
                        "growth_bytes_per_second": round(float(worst["slope"])),
                        "fragmentation_growth_bytes_per_second": round(float(worst["gap_slope"])),
                        "reserved_unallocated_bytes": int(worst["gap"]),
                        "footprint_bytes": int(worst["footprint"]),
                        "headroom_bytes": int(worst["headroom"]),
                        "capacity_bytes": int(worst["capacity"]),
                        "alloc_retries_delta": int(worst["retries_delta"]),
                        "fit_r2": round(float(worst["r2"]), 3),
                        "ranks_at_risk": rows.height,
                    },
                    summary=(
                        f"{worst['job']} rank {worst['rank']} ({worst['node']} GPU {worst['gpu']}) will run out of GPU memory in about "
                        f"{tto / 60:.1f} min: {what}, +{worst['slope'] / GIB * 60:.2f} GiB/min, {worst['headroom'] / GIB:.1f} GiB left."
                    ),
                )
            )
        return findings
