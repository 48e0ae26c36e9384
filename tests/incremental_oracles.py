"""From-scratch refits: the trend detectors as they were before they kept running state.

Each reads its whole look-back from the window on every call. The incremental detectors must
give the same findings on the same rows (tests/test_detectors_incremental.py). With the
detectors' block mode (config `lookback_blocks`) the look-back starts at the start of
the block holding now - W (`look_back`): the refits read exactly those rows, so the comparison
stays an equality.
"""

from __future__ import annotations

from typing import Any

import math

import polars as pl

# `settings` reads the shipped configuration and `rank_at` words a summary: shared so that the
# comparison is about what is found, not about config loading or wording. Which rows a fit reads
# (`current_run`) is decided here independently of the product.
from gpuvigil.detectors.common import rank_at, settings
from gpuvigil.detectors.fragmentation_allocator import FragmentationAllocatorConfig
from gpuvigil.detectors.oom import OomConfig
from gpuvigil.detectors.straggler import StragglerConfig
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

GIB = float(1 << 30)


def current_run(window: Window, stream: str, since: float | None = None, warmup: float = 0.0) -> pl.DataFrame:
    """Rows of a per-job stream from each job's latest (re)start on (+ warm-up), from `since` on;
    rows of a job the scheduler does not list, or lists without a start, are all kept."""
    df = window.get(stream)
    if since is not None:
        df = df.filter(pl.col("ts") >= since)
    jobs = window.get("jobs")
    if df.height == 0 or jobs.height == 0:
        return df
    start = dict(zip(jobs["job"].to_list(), jobs["start_ts"].to_list()))
    keep = [start.get(j) is None or ts >= start[j] + warmup for j, ts in zip(df["job"].to_list(), df["ts"].to_list())]
    return df.filter(pl.Series(keep, dtype=pl.Boolean))


def look_back(window: Window, stream: str, seconds: float, blocks: int, warmup: float) -> pl.DataFrame:
    """The rows a fit at window.now reads: the job's current run after warm-up, from now - seconds;
    with `blocks` (the detectors' block mode), from the start of the block of
    seconds / blocks seconds holding now - seconds (blocks start at multiples of their length),
    i.e. every row whose block index is at least that block's."""
    now = window.now
    if not blocks:
        return current_run(window, stream, since=now - seconds, warmup=warmup)
    b = seconds / blocks
    first = math.floor((now - seconds) / b)
    return current_run(window, stream, warmup=warmup).filter((pl.col("ts") / b).floor().cast(pl.Int64) >= first)


def in_time_order(df: pl.DataFrame) -> pl.DataFrame:
    """Rows by timestamp, ties in arrival order: a key's oldest and newest sample are by time,
    whatever order the rows arrived in."""
    return df.sort("ts", maintain_order=True)


class RefitOom:
    name = "oom"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom", OomConfig, cfg)

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        df = in_time_order(look_back(window, "allocator_stats", c.fit_window_seconds, c.lookback_blocks, c.warmup_seconds))
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

class RefitStraggler:
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

class RefitFragmentationAllocator:
    name = "fragmentation_allocator"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("fragmentation_allocator", FragmentationAllocatorConfig, cfg)
        self._last_run: float | None = None
        self._last: list[Finding] = []

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        if self._last_run is not None and now - self._last_run < self.config.every_seconds - 1e-9:
            return self._last
        self._last_run = now
        self._last = self._evaluate(window)
        return self._last

    def _evaluate(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        df = in_time_order(look_back(window, "allocator_stats", c.window_seconds, c.lookback_blocks, c.warmup_seconds))
        if df.height == 0:
            return []
        # In time order (ties by arrival), so first/last below are oldest/newest.
        per_rank = (
            df.group_by(["job", "rank"])
            .agg(
                pl.len().alias("n"),
                (pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")).last().alias("gap"),
                (pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")).first().alias("gap0"),
                pl.col("inactive_split_bytes").last().alias("split"),
                (pl.col("alloc_retries").last() - pl.col("alloc_retries").first()).alias("retries"),
                pl.col("largest_free_block_bytes").last().alias("largest_free"),
                # The step's recurring large request: what a step allocates above its live floor.
                (pl.col("peak_allocated_bytes") - pl.col("allocated_bytes")).max().alias("step_request"),
                pl.col("device_capacity_bytes").last().alias("capacity"),
                pl.col("node").last(),
                pl.col("gpu").last(),
            )
            .filter(
                (pl.col("n") >= c.min_samples)
                & (pl.col("gap") >= c.min_gap_bytes)
                & (pl.col("gap") >= c.min_gap_share * pl.col("capacity"))
                & (pl.col("gap") > pl.col("gap0"))
                & (pl.col("split") >= c.min_inactive_split_share * pl.col("gap"))
                & (pl.col("retries") >= c.min_retries)
            )
            .sort(["job", "gap", "rank"], descending=[False, True, False])  # rank breaks ties: same input, same finding
        )
        findings = []
        for rows in per_rank.partition_by("job", maintain_order=True):
            w = rows.row(0, named=True)
            starved = w["largest_free"] is not None and w["step_request"] is not None and w["largest_free"] < w["step_request"]
            findings.append(
                Finding(
                    kind=FindingKind.FRAGMENTATION_ALLOCATOR,
                    severity=Severity.TICKET,
                    ts=now,
                    job=w["job"],
                    ranks=sorted(rows["rank"].to_list()),
                    node=w["node"],
                    gpu=w["gpu"],
                    cause="fragmentation",
                    source=self.name,
                    evidence={
                        "rank": int(w["rank"]),
                        "reserved_unused_bytes": int(w["gap"]),
                        "reserved_unused_growth_bytes": int(w["gap"] - w["gap0"]),
                        "inactive_split_bytes": int(w["split"]),
                        "alloc_retries_delta": int(w["retries"]),
                        "largest_free_block_bytes": int(w["largest_free"] or 0),
                        "step_request_bytes": int(w["step_request"] or 0),
                        "largest_block_below_request": bool(starved),
                        "ranks_fragmented": rows.height,
                    },
                    summary=(
                        f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])}: the caching allocator holds {w['gap'] / GIB:.1f} GiB it cannot use "
                        f"(+{(w['gap'] - w['gap0']) / GIB:.1f} GiB in {c.window_seconds:.0f} s, {int(w['retries'])} cudaMalloc retries"
                        + (f", largest free block {w['largest_free'] / GIB:.2f} GiB < the step's {w['step_request'] / GIB:.2f} GiB request" if starved else "")
                        + "): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
                    ),
                )
            )
        return findings



def check_against_refit(make_new, make_refit, stream, ticks, horizon, rebuilt_every=((4, 0),), label=""):
    """Feed `ticks` ((now, rows of `stream`, jobs snapshot) each) to a refit and to detectors fed
    the ways the pipeline may feed them: detect() every tick (state stepped); ingest() every tick
    and detect() every 3rd (the pipeline's way); and, for each (period, phase) of `rebuilt_every`,
    detect() only on ticks i % period == phase with nothing between (state rebuilt from the window).
    Each must report exactly the refit's findings on every tick it reports. Returns how many ticks
    the refit raised findings on, so that a caller can check the comparison was not of empty lists."""

    def dicts(findings):
        return [f.to_json_dict() for f in findings]

    every_tick, ingested, refit = make_new(), make_new(), make_refit()
    sparse = [(period, phase, make_new()) for period, phase in rebuilt_every]
    w = Window(horizon)
    positives = 0
    for i, (now, rows, jobs) in enumerate(ticks):
        if rows.height:
            w.add(stream, rows)
        w.add("jobs", jobs)
        w.seal(now)
        want = dicts(refit.detect(w))
        positives += bool(want)
        assert dicts(every_tick.detect(w)) == want, f"{label}tick {i} at {now} (every tick)"
        if i % 3 == 0:
            assert dicts(ingested.detect(w)) == want, f"{label}tick {i} at {now} (ingested)"
        else:
            ingested.ingest(w)
        for period, phase, det in sparse:
            if i % period == phase:
                assert dicts(det.detect(w)) == want, f"{label}tick {i} at {now} (rebuilt, every {period})"
    return positives


class _Shown:
    """What a refit reads in place of the pipeline's window: the rows a detector was shown,
    with the window's own time and snapshot streams."""

    def __init__(self, window: Window, stream: str, rows: pl.DataFrame):
        self.now, self._window, self._stream, self._rows = window.now, window, stream, rows

    def get(self, stream: str) -> pl.DataFrame:
        return self._rows if stream == self._stream else self._window.get(stream)


class Shown:
    """The rows of `stream` a detector with running state has been shown by a pipeline window
    that drops rows after its horizon: the specification the refits are compared under when the
    window keeps less history than the look-back (block mode) or calls are sparse.

    A detector that saw every tick of one window (seq + 1 each call, time going forward, gaps
    short enough that the rows it still reads raw, `reach` seconds back, or with no blocks the
    whole look-back `W`, are still in the window) has seen every row that arrived, even those the
    window has dropped since. Otherwise it knows only what the window holds now. A job whose
    start moved or vanished, or that got a start while rows of it are held, is known only from
    the window's rows of it (its warm-up rows count again)."""

    def __init__(self, stream: str, look_back_seconds: float, blocks: int, reach: float):
        self.stream, self.W, self.blocks, self.reach = stream, look_back_seconds, blocks, reach
        self._window: Window | None = None
        self._seq = -1
        self._now = -math.inf
        self._starts: dict[str, float | None] | None = None
        self.rows: pl.DataFrame | None = None

    @staticmethod
    def _starts_of(window: Window) -> dict[str, float | None]:
        jobs = window.get("jobs")
        out: dict[str, float | None] = {}
        for job, start in zip(jobs["job"].to_list(), jobs["start_ts"].to_list()) if jobs.height else ():
            out.setdefault(job, start)
        return out

    def show(self, window: Window) -> _Shown:
        seq, now = window.seq, window.now
        if window is self._window and seq == self._seq and self.rows is not None:
            return _Shown(window, self.stream, self.rows)
        keep_raw = self.reach if self.blocks else self.W
        stepped = (
            window is self._window
            and seq == self._seq + 1
            and now > self._now
            and now - self._now <= window.horizon(self.stream) - keep_raw
            and self.rows is not None
        )
        starts = self._starts_of(window)
        if not stepped:
            self.rows = window.get(self.stream)
        else:
            rows = pl.concat([self.rows, window.fresh(self.stream)], how="vertical_relaxed")
            prev = self._starts or {}
            held = set(rows["job"].to_list())
            moved = [j for j in set(prev) | set(starts) if prev.get(j) != starts.get(j) and (prev.get(j) is not None or j in held)]
            if moved:
                rows = pl.concat([rows.filter(~pl.col("job").is_in(moved)), window.get(self.stream).filter(pl.col("job").is_in(moved))], how="vertical_relaxed")
            self.rows = rows
        self._window, self._seq, self._now, self._starts = window, seq, now, starts
        return _Shown(window, self.stream, self.rows)


class RefitOnShown:
    """A refit called the way the pipeline calls a detector (`ingest` on ticks not due, `detect`
    on the others), reading the rows `Shown` says the detector was shown."""

    def __init__(self, refit: Any, shown: Shown):
        self.refit, self.shown = refit, shown

    def ingest(self, window: Window) -> None:
        self.shown.show(window)

    def detect(self, window: Window) -> list[Finding]:
        return self.refit.detect(self.shown.show(window))


def refit_oom(cfg: dict[str, Any] | None = None) -> RefitOnShown:
    refit = RefitOom(cfg)
    c = refit.config
    return RefitOnShown(refit, Shown("allocator_stats", c.fit_window_seconds, c.lookback_blocks, reach=c.min_span_seconds / 2))


def refit_fragmentation_allocator(cfg: dict[str, Any] | None = None) -> RefitOnShown:
    refit = RefitFragmentationAllocator(cfg)
    c = refit.config
    return RefitOnShown(refit, Shown("allocator_stats", c.window_seconds, c.lookback_blocks, reach=0.0))
