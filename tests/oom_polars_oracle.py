"""The replaced polars implementation of the `oom` detector (gpuvigil/detectors/oom.py before its
per-key state became numpy arrays), copied verbatim but for the class name and OomConfig, which
is imported from the product: kept as the oracle the numpy one must equal on every tick
(tests/test_oom_numpy.py). Not to be called from the product.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from gpuvigil.detectors.common import rank_at, settings
from gpuvigil.detectors.incremental import SlidingRows, edges_from_rows
from gpuvigil.detectors.oom import OomConfig
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

from polars_incremental import BlockStore, merge_edges, refresh_first

GIB = float(1 << 30)


# Running sums per (job, rank), t = ts - now (seconds), y etc. in GiB (see _terms).
SUMS = ["n", "st", "stt", "sy", "sty", "syy", "ne", "ste", "stte", "sye", "stye", "sg", "stg", "sp", "stp", "sf", "stf"]
# Per block (block mode): the sums with t measured from the block's start, not from now.
BLOCK_SUMS = ["n", "st", "stt", "sy", "sty", "syy", "sg", "stg", "sp", "stp", "sf", "stf"]
# The newest sample's values (by ts, ties: the last to arrive) and the oldest's retries.
LAST = ["y", "gap", "foreign", "retries", "capacity", "node", "gpu"]


def _values(df: pl.DataFrame) -> pl.DataFrame:
    """Per row, what the fit reads (independent of `now`)."""
    return df.select(
        "job",
        "rank",
        "ts",
        "node",
        "gpu",
        pl.col("device_capacity_bytes").alias("capacity"),
        # What runs out is the device: our per-step peak footprint plus other processes.
        ((pl.max_horizontal("reserved_bytes", "peak_allocated_bytes") + pl.col("foreign_used_bytes").fill_null(0)) / GIB).alias("y"),
        ((pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")) / GIB).alias("gap"),
        (pl.col("peak_allocated_bytes") / GIB).alias("peak"),
        (pl.col("foreign_used_bytes").fill_null(0) / GIB).alias("foreign"),
        pl.col("alloc_retries").fill_null(0).cast(pl.Float64).alias("retries"),
    )


def _terms(v: pl.DataFrame, now: float, half: float, sign: float = 1.0, early_only: bool = False) -> pl.DataFrame:
    """Each row's contribution to SUMS (times `sign`); `early_only`: only the early half's."""
    t = pl.col("ts") - now
    y, g, p, f = pl.col("y"), pl.col("gap"), pl.col("peak"), pl.col("foreign")
    e = (t < half).cast(pl.Float64)
    one = pl.lit(1.0)
    zero = pl.lit(0.0)
    terms = {
        "n": one, "st": t, "stt": t * t, "sy": y, "sty": t * y, "syy": y * y,
        "ne": e, "ste": e * t, "stte": e * t * t, "sye": e * y, "stye": e * t * y,
        "sg": g, "stg": t * g, "sp": p, "stp": t * p, "sf": f, "stf": t * f,
    }  # fmt: skip
    early = {"ne", "ste", "stte", "sye", "stye"}
    return v.select(
        "job",
        "rank",
        *((zero if early_only and k not in early else (expr * sign if sign != 1.0 else expr)).alias(k) for k, expr in terms.items()),
    )


def _block_terms(v: pl.DataFrame, store: BlockStore) -> pl.DataFrame:
    """Each row's contribution to its block's BLOCK_SUMS, tau = ts - the block's start."""
    tau = pl.col("ts") - store.start(store.block_index())
    y, g, p, f = pl.col("y"), pl.col("gap"), pl.col("peak"), pl.col("foreign")
    terms = {
        "n": pl.lit(1.0), "st": tau, "stt": tau * tau, "sy": y, "sty": tau * y, "syy": y * y,
        "sg": g, "stg": tau * g, "sp": p, "stp": tau * p, "sf": f, "stf": tau * f,
    }  # fmt: skip
    return v.select("job", "rank", "ts", *(e.alias(k) for k, e in terms.items()), "retries")


def _leaving_terms(blocks: pl.DataFrame, store: BlockStore, now: float) -> pl.DataFrame:
    """Minus the SUMS of whole blocks leaving the look-back, t moved from each block's start to
    now (t = tau + d, d = start - now). Every row of such a block is older than now - W, so in
    the fit's early half (config check): the early sums lose the same amounts."""
    d = store.start(pl.col("_blk")) - now
    n, st, stt = pl.col("n"), pl.col("st"), pl.col("stt")
    t1 = st + n * d
    t2 = stt + 2 * d * st + n * d * d
    ty = pl.col("sty") + d * pl.col("sy")
    out = {
        "n": n, "st": t1, "stt": t2, "sy": pl.col("sy"), "sty": ty, "syy": pl.col("syy"),
        "ne": n, "ste": t1, "stte": t2, "sye": pl.col("sy"), "stye": ty,
        "sg": pl.col("sg"), "stg": pl.col("stg") + d * pl.col("sg"),
        "sp": pl.col("sp"), "stp": pl.col("stp") + d * pl.col("sp"),
        "sf": pl.col("sf"), "stf": pl.col("stf") + d * pl.col("sf"),
    }  # fmt: skip
    return blocks.select("job", "rank", *((-e).alias(k) for k, e in out.items()))


def _sum_terms(terms: pl.DataFrame) -> pl.DataFrame:
    return terms.group_by(["job", "rank"]).agg(pl.col(k).sum() for k in SUMS)


def _build(v: pl.DataFrame, now: float, half: float) -> pl.DataFrame:
    """The state of every key from its rows (a from-scratch fit, and the rebuild path)."""
    if v.height == 0:
        return _empty_state()
    sums = _sum_terms(_terms(v, now, half))
    edge = edges_from_rows(v, ["retries"], LAST)
    return sums.join(edge, on=["job", "rank"]).select(_empty_state().columns)


def _empty_state() -> pl.DataFrame:
    schema: dict[str, pl.DataType] = {"job": pl.Utf8(), "rank": pl.Int32()}
    schema.update({k: pl.Float64() for k in SUMS})
    schema.update({"ts_first": pl.Float64(), "retries_first": pl.Float64(), "ts_last": pl.Float64()})
    types = {"capacity": pl.Int64(), "node": pl.Utf8(), "gpu": pl.Int32()}
    schema.update({f"{c}_last": types.get(c, pl.Float64()) for c in LAST})
    return pl.DataFrame(schema=schema)


def _refresh_first_from_blocks(state: pl.DataFrame, gone: pl.DataFrame, store: BlockStore) -> pl.DataFrame:
    """Keys that lost their oldest block take the oldest row of their next one."""
    lost = gone.select("job", "rank").unique().join(state.select("job", "rank"), on=["job", "rank"], how="semi")
    if lost.height == 0:
        return state
    first = store.first_rows(lost).rename({"ts_first": "_f_ts", "retries": "_f_retries"})
    return state.join(first, on=["job", "rank"], how="left").with_columns(
        pl.when(pl.col("_f_ts").is_not_null()).then(pl.col(f"_f_{k}")).otherwise(pl.col(f"{k}_first")).alias(f"{k}_first") for k in ("ts", "retries")
    ).drop("_f_ts", "_f_retries")


class PolarsOomPredictor:
    name = "oom"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom", OomConfig, cfg)
        c = self.config
        # Block mode: the rows still read raw are those that cross into the early half (ingest).
        self._rows = SlidingRows("allocator_stats", c.fit_window_seconds, c.warmup_seconds, blocks=c.lookback_blocks, reach=c.min_span_seconds / 2)
        self._blocks = BlockStore(self._rows.B, BLOCK_SUMS, firsts=["retries"]) if c.lookback_blocks else None
        self._state = _empty_state()

    def lookback_seconds(self) -> dict[str, float]:
        """History of allocator_stats read from the window (pipeline/core.py: declared_horizons).

        Block mode: the fit's late half (min_span_seconds / 2: rows crossing into the early half
        are read from the window) plus block_slack_seconds, the longest gap between two ticks
        that still steps (else it rebuilds from what the window holds). Otherwise the fit's
        look-back plus 30 s in which rows leaving it can still be subtracted."""
        c = self.config
        if c.lookback_blocks:
            return {"allocator_stats": c.min_span_seconds / 2 + c.block_slack_seconds}
        return {"allocator_stats": c.fit_window_seconds + 30.0}

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        """Columns of allocator_stats' history it reads (`_values`; pipeline/core.py: declared_columns)."""
        return {"allocator_stats": ("ts", "job", "rank", "node", "gpu", "device_capacity_bytes", "reserved_bytes", "peak_allocated_bytes", "foreign_used_bytes", "alloc_retries")}

    def ingest(self, window: Window) -> None:
        """Fold this tick's rows into the running sums (called on ticks the fit is not due)."""
        c = self.config
        half = -c.min_span_seconds / 2
        step = self._rows.sync(window)
        if step.mode == "same":
            return
        if step.mode == "rebuild":
            rows = _values(self._rows.rows_for_rebuild(window))
            self._state = _build(rows, step.now, half)
            if self._blocks is not None:
                self._blocks.clear()
                self._blocks.add(_block_terms(rows, self._blocks))
            return
        assert step.fresh is not None and step.old is not None and step.leaving is not None
        now, d = step.now, step.now - step.prev_now
        st0 = self._state
        n, st, ne, ste = pl.col("n"), pl.col("st"), pl.col("ne"), pl.col("ste")
        # Move t's origin from the previous tick's now to this one's.
        shifted = st0.select(
            "job", "rank", "n",
            (st - n * d).alias("st"),
            (pl.col("stt") - 2 * d * st + n * d * d).alias("stt"),
            "sy", (pl.col("sty") - d * pl.col("sy")).alias("sty"), "syy",
            "ne", (ste - ne * d).alias("ste"),
            (pl.col("stte") - 2 * d * ste + ne * d * d).alias("stte"),
            "sye", (pl.col("stye") - d * pl.col("sye")).alias("stye"),
            "sg", (pl.col("stg") - d * pl.col("sg")).alias("stg"),
            "sp", (pl.col("stp") - d * pl.col("sp")).alias("stp"),
            "sf", (pl.col("stf") - d * pl.col("sf")).alias("stf"),
        )  # fmt: skip
        # Rows that crossed into the early half this tick (they were in the late one).
        movers = self._rows.current(
            step.old.filter(self._rows.in_look_back(step.prev_now) & ((pl.col("ts") - step.prev_now) >= half) & ((pl.col("ts") - now) < half)),
            self._rows.starts(window),
        )
        parts = [shifted.select("job", "rank", *SUMS)]
        if movers.height:
            parts.append(_terms(_values(movers), now, half, early_only=True))
        if step.leaving.height:
            parts.append(_terms(_values(step.leaving), now, half, sign=-1.0))
        gone = self._blocks.evict(step.lo_block) if self._blocks is not None else None
        if gone is not None and gone.height:
            parts.append(_leaving_terms(gone, self._blocks, now))  # type: ignore[arg-type]
        fresh = _values(step.fresh) if step.fresh.height else None
        if fresh is not None:
            parts.append(_terms(fresh, now, half))
            if self._blocks is not None:
                self._blocks.add(_block_terms(fresh, self._blocks))
        sums = _sum_terms(pl.concat(parts, how="vertical_relaxed")) if len(parts) > 1 else parts[0]
        sums = sums.filter(pl.col("n") > 0.5)
        edge = merge_edges(st0.select("job", "rank", "ts_first", "retries_first", "ts_last", *(f"{c}_last" for c in LAST)), fresh if fresh is not None else pl.DataFrame(), ["retries"], LAST)
        state = sums.join(edge, on=["job", "rank"], how="left")
        # The oldest sample of a key that lost rows is the next one up (a band lookup).
        state = refresh_first(self._rows, window, state, step.leaving, {"retries": pl.col("alloc_retries").fill_null(0).cast(pl.Float64)})
        if gone is not None and gone.height and self._blocks is not None:
            state = _refresh_first_from_blocks(state, gone, self._blocks)
        redo = step.rebuild_jobs(state)
        if redo:
            state = state.filter(~pl.col("job").is_in(redo))
            rows = _values(self._rows.rows_for_rebuild(window, redo))
            again = _build(rows, now, half)
            state = pl.concat([state, again.select(state.columns)], how="vertical_relaxed")
            if self._blocks is not None:
                self._blocks.drop_jobs(redo)
                self._blocks.add(_block_terms(rows, self._blocks))
        self._state = state.select(_empty_state().columns)

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        self.ingest(window)
        if self._state.height == 0:
            return []
        # Least squares from running sums (O(new rows) per tick, see ingest): y in GiB keeps the
        # sums of squares well conditioned. The window's two halves are fitted too: growth must
        # hold in both the last min_span/2 seconds and before them (a one-off step, warm-up or a
        # new phase of training, is not a trend).
        sums = self._state.select(
            "job",
            "rank",
            *SUMS,
            (pl.col("ts_first") - now).alias("t_min"),
            (pl.col("ts_last") - now).alias("t_max"),
            pl.col("y_last").alias("footprint_gib"),
            pl.col("gap_last").alias("gap_gib"),
            (pl.col("retries_last") - pl.col("retries_first")).alias("retries_delta"),
            pl.col("capacity_last").alias("capacity"),
            pl.col("node_last").alias("node"),
            pl.col("gpu_last").alias("gpu"),
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
                    gpu=worst["gpu"],
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
                        f"{worst['job']} {rank_at(worst['rank'], worst['node'], worst['gpu'])} will run out of GPU memory in about "
                        f"{tto / 60:.1f} min: {what}, +{worst['slope'] / GIB * 60:.2f} GiB/min, {worst['headroom'] / GIB:.1f} GiB left."
                    ),
                )
            )
        return findings
