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

Slow growth: the steps above are the fast fit, built for 1 s NVML samples and leaks that fill
a GPU in minutes. Real sources sample every 30 s (dcgm-exporter) to 60 s (Prometheus history),
and real leaks take tens of minutes to hours, while an inference server's memory swings by tens
of GiB from one sample to the next. So each GPU also keeps the upper envelope of its used memory
(the maximum of each `trend_bucket_seconds` bucket, `_Buckets`, over the longest trend window),
and each of `trend_windows_seconds` is fitted from it: the window's `trend_blocks` block maxima
must rise from block to block (`trend_min_block_rises`, each by at least
`trend_min_rise_share` of the fitted rise per block: growth spread over the window, not one
burst), the Theil-Sen slope through them must add `trend_min_growth_bytes` over the window and
`trend_min_signal_to_noise` times the block maxima's own scatter around the line, the newest
block must still rise (`trend_min_recent_share`: a warm-up levelling off is not projected),
Kendall's tau of the window's bucket maxima (the finding's `confidence`) must reach
`trend_min_confidence`, and the fit must hold on every evaluation for `trend_persist_seconds`
(a burst that falls back within a bucket or two is the workload). Time to OOM = (capacity −
safety margin − the line at now) / slope; of the windows that warn, the one projecting the
soonest OOM is reported. Every threshold is relative to the series itself except the growth
floor, so the same rules hold at any sample interval from 1 s to a bucket's width.

Start-up: a GPU whose used memory was below `idle_bytes` or `idle_share` of its capacity (the
larger) less than `startup_seconds` ago (a process starting, a restart) is loading its job: neither fit warns on it until then, and a trend
window holding that moment is not fitted. A job the scheduler lists is also fitted only from its
start + `warmup_seconds` on.

Every finding's evidence carries the projection the report draws: `fit_start_ts`,
`fit_end_ts` (now), `slope_bytes_per_s`, `intercept_bytes` (the line at `fit_end_ts`),
`predicted_full_ts` (where it meets `capacity_bytes` − `safety_margin_bytes`),
`sample_interval_s` and `confidence` (0..1; the fast fit: its steps against 2 × min_rises).

The envelope costs O(new rows) a tick to fold in (one maximum per sample) and, per evaluation,
one pass over the longest window's buckets of every GPU (float32, bucket-major: a bucket of every
GPU is one contiguous row); the fits themselves run only for the GPUs whose block maxima rose.
A rebuild of the rings (below) starts the envelope over too.

Cause: another process on the GPU whose memory grows (per-process memory only) = foreign
process; else leak/capacity. The other processes' memory on a job's GPU is followed the same way
(its own envelope, steps, span and rate), so it warns next to a flat job too, while a single
one-off allocation by another process is no trend. Fragmentation cannot be seen at L0: a fragmenting pool also adds
segments, and only the allocator's own statistics (L2) tell reserved-but-unallocated apart.

Cost at scale (100,000 GPUs): O(new rows) per tick, not a refit of the window. Each allocated GPU
(a row of the allocation snapshot) keeps, in numpy rings (`incremental.SlotSamples`), its samples of the last
`fit_window_seconds`: ts, the job's own memory and the other processes' (NaN: no process list
at that sample), folded in from each tick's fresh rows (`ingest` on the ticks the detector is not
due, and `detect`), attributed as the refit attributes them (a process is the job's when its
`job`, else its `slurm_job`, is the GPU's allocated job; gpu_processes joined to gpu_samples on
the exact (ts, node, gpu)). `detect` evaluates every GPU at once over the rings (the same
filters, segments, envelopes, steps and sums as the refit, in float64, so every threshold is met
or missed exactly as before) and builds the findings from the GPUs with enough steps only.

A GPU whose allocation (job, rank) changes, that is newly allocated, or that leaves the snapshot
starts an empty ring; the rows it had in the window before are not copied, which changes nothing
while they are older than its job's start + `warmup_seconds` (they are filtered anyway). Where
they may count (a job with no known start, one allocated a GPU after its warm-up, a start that
moves back or disappears), that GPU is refilled from the window when next evaluated. A job whose
start moves is re-filtered from the stored ts. The rings are rebuilt from the window (what it
holds of the fit window) on the first call, a different window, a tick missed without `ingest`,
time going back, or a jump longer than the fit window. Rows the window's retention thins
(`window_retention`, pipeline/core.py: declared_retention) are dropped from the rings as the
window drops them, so the GPUs of jobs this detector is not selected for are fitted from the same
rows as before.

The window's gpu_samples history is then read only by a rebuild: `lookback_seconds` declares
`rebuild_history_seconds` (null: the whole fit window), so after a rebuild the fit starts again from that
much history. Where the result can differ from the refit over the same window (tests:
tests/test_oom_device_incremental.py, every other case against the refit, tick by tick):

- gpu_processes rows of a (ts, node, gpu) that arrive in a later tick than the gpu_samples row of
  that ts (or split over ticks): the refit joined them, the rings folded the sample in when it came
  (as DCGM-only, or with the processes seen then).
- Samples of one GPU with equal ts and different values: the refit's sort did not define their
  order; the rings keep arrival order.
- A job listed twice in `jobs`, or a GPU listed twice in `allocations`: the refit's joins
  duplicated rows; the rings take the first row.
- Rows that arrive later than the window's horizon but within the fit window: the window no
  longer holds them, the rings keep them.
- The window's retention judges each row once, at the first seal where it is older than the
  cut; the rings follow that. A row that arrives late, newer than the cut but older than rows
  sealed before it, can make the window judge those again when it merges small chunks
  (window.py: SMALL_CHUNK_ROWS), with the keys of then: the rings do not.

A refill of the GPUs whose earlier rows may count reads the window (a semi-join of its
gpu_samples): it costs O(window) on the ticks it happens, which needs a job without a start in
`jobs` or an allocation that changes after its job's warm-up.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field, model_validator

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import allocated_gpu_retention, rank_at, settings
from gpuvigil.detectors.incremental import BlockRing, SlotSamples, TickCursor, headroom, resized
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

BLOCK = 8192  # GPUs evaluated at once: bounds the temporaries (BLOCK x ring length float64 each)

GIB = float(1 << 30)
NOT_AT_L0 = "fragmentation cannot be seen at L0 (device memory shows the allocator's footprint, not what is free inside it)"
GPU_KEY = ["node", "gpu"]


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
    # Memory at scale (100,000 GPUs): gpu_samples rows older than this are kept only for the GPUs of
    # jobs whose findings this detector gives (pipeline/core.py: declared_retention); null: all.
    history_recent_seconds: float | None = Field(10.0, ge=0)
    # The gpu_samples history the window keeps for this detector (its look-back): the fit runs
    # from per-GPU rings, the window's history is read only to rebuild them. null: the whole fit
    # window (a rebuild then finds exactly what a refit would).
    rebuild_history_seconds: float | None = Field(20.0, gt=0)
    # Slow growth at real resolutions (dcgm-exporter every 30 s, Prometheus at 15-60 s, leaks
    # over tens of minutes to hours): the upper envelope of the GPU's used memory, kept as the
    # maximum of each bucket, is fitted over each of these windows (module doc, "Slow growth").
    trend_bucket_seconds: float = Field(60.0, gt=0)
    trend_windows_seconds: list[float] = Field(default_factory=lambda: [600.0, 1200.0, 2400.0, 4800.0])
    trend_blocks: int = Field(5, ge=2)  # each window's envelope: the maximum of each of its blocks
    trend_min_block_rises: int = Field(4, ge=1)  # block maxima that must rise on the one before
    trend_rise_bytes: int = Field(0, ge=0)  # a block maximum at most this much above the one before is no rise
    # ... nor one that rose less than this share of the fitted rise per block: the growth is
    # spread over the window, not one burst (the series' own scale, not a constant).
    trend_min_rise_share: float = Field(0.25, ge=0)
    # The fit must hold on every evaluation for this long before it is a finding: a burst that
    # falls back within a bucket or two is the workload, not a trend.
    trend_persist_seconds: float = Field(120.0, ge=0)
    trend_min_growth_bytes: int = Field(4 << 30, ge=0)  # fitted growth over the window
    # The fitted growth over the window against the envelope's own scatter around the fit (its
    # median absolute residual): growth below this many times the scatter is noise.
    trend_min_signal_to_noise: float = Field(4.0, ge=0)
    # The newest block's rise against the fitted rise per block: a growth that is levelling off
    # (a warm-up reaching its plateau) is not projected to the capacity.
    trend_min_recent_share: float = Field(0.25, ge=0)
    trend_min_confidence: float = Field(0.5, ge=0, le=1)  # Kendall's tau of the window's bucket maxima
    # A GPU whose used memory was below the larger of idle_bytes and idle_share of its capacity
    # (nothing but a CUDA context and libraries, or a restart) less than startup_seconds ago is
    # warming up: its growth is not a leak yet.
    idle_bytes: int = Field(2 << 30, ge=0)
    idle_share: float = Field(0.05, ge=0, le=1)
    startup_seconds: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _windows_fit_buckets(self) -> OomDeviceConfig:
        for w in self.trend_windows_seconds:
            per_block = w / self.trend_blocks / self.trend_bucket_seconds
            if w <= 0 or abs(per_block - round(per_block)) > 1e-9 or round(per_block) < 1:
                raise ValueError(f"trend window {w:g} s is not {self.trend_blocks} blocks of whole {self.trend_bucket_seconds:g} s buckets")
        if self.trend_min_block_rises > self.trend_blocks - 1:
            raise ValueError("trend_min_block_rises is more than trend_blocks - 1")
        if self.page_within_seconds > self.predict_horizon_seconds:
            raise ValueError("page_within_seconds must not exceed predict_horizon_seconds (a prediction beyond the horizon is never made, so it could never page)")
        return self


class DeviceOomPredictor(Declared):
    spec = DetectorSpec(
        name="oom_device",
        config=OomDeviceConfig,
        emits=(FindingKind.OOM_PREDICTED,),
        reads={"gpu_samples": HISTORY, "gpu_processes": HISTORY, "allocations": HISTORY, "jobs": HISTORY},
        order=50,
        level="L0",
        capability="oom",
        streams=("gpu_samples", "gpu_processes"),
        every_seconds=5.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom_device", OomDeviceConfig, cfg)
        self._cursor = TickCursor()
        self._reset()

    def lookback_seconds(self) -> dict[str, float]:
        """History read from the window (pipeline/core.py: declared_horizons, declared_columns):
        only a rebuild of the rings reads it (module doc)."""
        c = self.config
        return {"gpu_samples": c.fit_window_seconds if c.rebuild_history_seconds is None else min(c.rebuild_history_seconds, c.fit_window_seconds)}

    def window_retention(self) -> dict[str, tuple[float, str]]:
        return allocated_gpu_retention(self.config.history_recent_seconds)

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        return {"gpu_samples": ("ts", "node", "gpu", "memory_used_bytes", "memory_total_bytes", "memory_reserved_bytes")}

    # -- running state -------------------------------------------------------------------------
    def _reset(self) -> None:
        # Per allocated GPU, its samples of the fit window: the job's own memory, the other
        # processes' (NaN: no process list), and the newest sample's used memory and capacity.
        self._rings = SlotSamples(("own", "frn"), latest=("used", "capacity"), tracked=("frn",), chunk=BLOCK)
        c = self.config
        self._buckets = _Buckets(c.trend_bucket_seconds, math.ceil(max(c.trend_windows_seconds) / c.trend_bucket_seconds) + 1)
        self._keys = pl.DataFrame(schema={"node": pl.Utf8, "gpu": pl.Int32, "job": pl.Utf8, "rank": pl.Int32, "_k": pl.Int64})
        self._free = np.zeros(0, np.int64)  # slots of GPUs no longer allocated
        self._next = 0  # slots ever used
        self._alloc: pl.DataFrame | None = None  # the allocation snapshot the keys follow
        self._seen = -math.inf  # the newest gpu_samples ts seen (rows up to it are in the window)
        self._judged = -math.inf  # rows below this were judged by the window's retention rule
        self._rule_cache: tuple[pl.DataFrame, pl.DataFrame, np.ndarray] | None = None
        self._slot_cache: tuple[pl.DataFrame, pl.DataFrame, np.ndarray] | None = None

    def ingest(self, window: Window) -> None:
        """Fold this tick's rows in (called by the pipeline on ticks the detector is not due)."""
        self._sync(window)

    def _sync(self, window: Window) -> None:
        c = self.config
        now = window.now
        prev_window, prev_now = self._cursor.window, self._cursor.now
        mode = self._cursor.advance(window)
        if mode == "same":
            return
        # A gap longer than the fit window leaves nothing of the rings to keep: rebuild.
        stepping = mode == "step" and now - prev_now <= c.fit_window_seconds
        dt = now - prev_now if stepping else None
        if not stepping:
            judged = self._judged if window is prev_window else -math.inf
            self._reset()
            self._judged = judged
        self._sync_alloc(window)
        rule = self._rule(window)
        if stepping:
            fresh = window.fresh("gpu_samples")
            self._add(fresh, window.fresh("gpu_processes"), now, self._keys, rule, dt)
        else:
            # The window has applied its retention rule at this seal already: its rows are the rings'.
            self._add(window.get("gpu_samples"), window.get("gpu_processes"), now, self._keys, None, None)
            self._rings.floor[:] = -np.inf
        if rule is not None:
            cut, nonkept = rule
            if stepping:
                self._rings.thin(nonkept, self._judged, cut)
            self._judged = max(self._judged, cut)

    def _sync_alloc(self, window: Window) -> None:
        """Follow the allocation snapshot: a GPU whose (job, rank) changed, newly allocated or
        gone gets an empty ring (module doc); the others keep theirs."""
        alloc = window.get("allocations")
        if alloc is self._alloc:
            return
        same = self._alloc is not None and alloc.schema == self._alloc.schema and alloc.equals(self._alloc)
        self._alloc = alloc
        if same:  # a new snapshot, as the collectors send one each tick: the same GPUs' jobs
            return
        if alloc.height == 0 or not {"node", "gpu", "job", "rank"} <= set(alloc.columns):
            new = self._keys.clear().drop("_k")
        else:
            new = alloc.select("node", "gpu", "job", "rank").filter(pl.col("node").is_not_null() & pl.col("gpu").is_not_null()).unique(GPU_KEY, keep="first", maintain_order=True)
        old = self._keys
        m = new.join(old.select(*GPU_KEY, pl.col("job").alias("_pj"), pl.col("rank").alias("_pr"), "_k"), on=GPU_KEY, how="left", maintain_order="left")
        same = (m["_k"].is_not_null() & m["job"].eq_missing(m["_pj"]) & m["rank"].eq_missing(m["_pr"])).to_numpy()
        slots = m["_k"].fill_null(-1).to_numpy().astype(np.int64)
        kept = slots[same]
        freed = np.setdiff1d(old["_k"].to_numpy(), kept)
        if freed.size:
            self._rings.clear(freed)
            self._buckets.clear(freed)
            self._free = np.concatenate([self._free, freed])
        todo = int((~same).sum())
        if todo:
            if self._free.size < todo:
                extra = np.arange(self._next, self._next + todo - self._free.size, dtype=np.int64)
                self._next += extra.size
                self._free = np.concatenate([self._free, extra])
                self._rings.grow_rows(self._next)
                self._buckets.grow_rows(self._next)
            self._free = np.sort(self._free)
            given, self._free = self._free[:todo], self._free[todo:]
            slots[~same] = given
            self._rings.clear(given)
            self._buckets.clear(given)
            # Their rows that arrived before this tick are not in the rings: refilled from the
            # window if they can count (detect).
            self._rings.floor[given] = self._seen
        self._keys = new.with_columns(pl.Series("_k", slots, dtype=pl.Int64))
        self._rule_cache = None

    def _rule(self, window: Window) -> tuple[float, np.ndarray] | None:
        """The window's retention rule for gpu_samples (module doc): (cutoff, slots whose older
        rows it drops), or None."""
        fn = getattr(window, "retention", None)
        rule = fn("gpu_samples") if callable(fn) else None
        if rule is None:
            return None
        recent, keep = rule
        if sorted(keep.columns) != sorted(GPU_KEY):
            return None  # thinned by other keys: not followed (no reader declares such a rule)
        cached = self._rule_cache
        if cached is not None and cached[1] is self._keys and (cached[0] is keep or cached[0].equals(keep)):
            return window.now - recent, cached[2]
        keys = self._keys.select(*GPU_KEY, "_k")
        on = keep.select(GPU_KEY)
        if on.schema != keys.select(GPU_KEY).schema:
            on = on.cast(dict(keys.select(GPU_KEY).schema))  # type: ignore[arg-type]
        nonkept = keys.join(on, on=GPU_KEY, how="anti", nulls_equal=True)["_k"].to_numpy()
        self._rule_cache = (keep, self._keys, nonkept)
        return window.now - recent, nonkept

    def _add(self, gs: pl.DataFrame, procs: pl.DataFrame, now: float, keys: pl.DataFrame, rule: tuple[float, np.ndarray] | None, dt: float | None) -> None:
        """Fold rows of gpu_samples (and the gpu_processes of the same ts) into the rings of
        `keys`, attributed as the refit attributes them (module doc)."""
        c = self.config
        if gs.height == 0:
            return
        top = gs["ts"].max()
        if top is not None:
            self._seen = max(self._seen, float(top))  # type: ignore[arg-type]
        if keys.height == 0:
            return
        since = now - c.fit_window_seconds
        dev = (
            gs.filter(pl.col("ts") >= since)
            .select(
                "ts",
                "node",
                "gpu",
                pl.col("memory_used_bytes").cast(pl.Float64).alias("gpu_used"),
                (pl.col("memory_total_bytes") - pl.col("memory_reserved_bytes").fill_null(0)).cast(pl.Float64).alias("capacity"),
            )
            .filter(pl.col("gpu_used").is_not_null())
        )
        dev = dev.with_columns(pl.Series("_k", self._slots_of(dev.select(GPU_KEY), keys))).filter(pl.col("_k") >= 0)
        if dev.height == 0:
            return
        if procs.height:
            procs = procs.filter((pl.col("ts") >= since) & pl.col("used_memory_bytes").is_not_null())
        if procs.height:
            # A process is the job's when the scheduler's map or its own attribution says so.
            p = procs.join(keys.select(*GPU_KEY, "_k", pl.col("job").alias("_ajob")), on=GPU_KEY, how="inner").with_columns(
                (pl.col("job").is_not_null() & (pl.col("job") == pl.col("_ajob")) | pl.col("job").is_null() & (pl.col("slurm_job") == pl.col("_ajob"))).fill_null(False).alias("own")
            )
            per = p.group_by(["_k", "ts"]).agg(
                pl.col("used_memory_bytes").filter(pl.col("own")).sum().cast(pl.Float64).alias("own"),
                pl.col("used_memory_bytes").filter(~pl.col("own")).sum().cast(pl.Float64).alias("foreign"),
            )
            dev = dev.join(per, on=["_k", "ts"], how="left", maintain_order="left").with_columns(pl.col("own").fill_null(pl.col("gpu_used")))
        else:
            dev = dev.with_columns(pl.col("gpu_used").alias("own"), pl.lit(None, pl.Float64).alias("foreign"))
        k = dev["_k"].to_numpy()
        ts = dev["ts"].to_numpy()
        self._buckets.insert(k, ts, dev["gpu_used"].to_numpy(), dev["capacity"].to_numpy(), float(c.idle_bytes), c.idle_share)
        keep = None
        if rule is not None and rule[1].size:
            # Rows the window's retention dropped at this seal (module doc).
            cut, nonkept = rule
            mask = np.zeros(self._rings.rows, bool)
            mask[nonkept] = True
            keep = ~(mask[k] & (ts < cut))
        cols = [k, ts, dev["own"].to_numpy(), dev["foreign"].to_numpy(), dev["gpu_used"].to_numpy(), dev["capacity"].to_numpy()]
        if keep is not None and not keep.all():
            cols = [a[keep] for a in cols]
        per_tick = None if dt is None else c.fit_window_seconds / dt
        if dt is not None:
            self._rings.tidy(since)
        k, ts, own, frn, used, capacity = cols
        self._rings.insert(k, ts, {"own": own, "frn": frn}, {"used": used, "capacity": capacity}, keep_from=since, ticks=per_tick)

    def _slots_of(self, at: pl.DataFrame, keys: pl.DataFrame) -> np.ndarray:
        """The slot of each (node, gpu) row of `at` (-1: not allocated). A tick's samples come in
        the same GPU order as the tick before: then the previous answer is reused (no join)."""
        cached = self._slot_cache
        if keys is self._keys and cached is not None and cached[0] is keys and cached[1].equals(at):
            return cached[2]
        slots = at.join(keys.select(*GPU_KEY, "_k"), on=GPU_KEY, how="left", maintain_order="left")["_k"].fill_null(-1).to_numpy()
        if keys is self._keys:
            self._slot_cache = (keys, at, slots)
        return slots

    # -- evaluation ----------------------------------------------------------------------------
    def detect(self, window: Window) -> list[Finding]:
        self._sync(window)
        c = self.config
        now = window.now
        keys = self._keys
        if keys.height == 0:
            return []
        slots = keys["_k"].to_numpy()
        since = now - c.fit_window_seconds
        lo = np.full(slots.size, since)
        begun = np.full(slots.size, -np.inf)  # the job's start + warm-up, where the scheduler lists it
        jobs = window.get("jobs")
        if jobs.height:
            starts = jobs.select("job", pl.col("start_ts").cast(pl.Float64).alias("_start")).unique("job", keep="first", maintain_order=True)
            start = keys.select("job").join(starts, on="job", how="left", maintain_order="left")["_start"].to_numpy()
            after = start + c.warmup_seconds
            lo = np.where(np.isnan(after), since, np.maximum(since, after))
            begun = np.where(np.isnan(after), -np.inf, after)
        rings = self._rings
        stale = rings.floor[slots] >= lo
        if stale.any():
            self._refill(window, keys.filter(pl.Series(stale)))
        rings.sort_unsorted()
        pos, agg = _evaluate(rings, slots, lo, c)
        bk = self._buckets
        with np.errstate(invalid="ignore"):
            warming = now - bk.idle_ts[slots] < c.startup_seconds
        if pos.size and warming.any():
            # Growth out of an idle GPU is its job starting (module doc, "Slow growth").
            calm = ~warming[pos]
            pos, agg = pos[calm], {name: v[calm] for name, v in agg.items()}
        tpos, tfit = _trend_fits(bk, slots, begun, now, c)
        held = np.zeros(slots.size, bool)
        held[tpos] = True
        bk.since[slots] = np.where(held, np.minimum(bk.since[slots], now), np.inf)
        lasting = now - bk.since[slots[tpos]] >= c.trend_persist_seconds
        tpos, tfit = tpos[lasting], {name: v[lasting] for name, v in tfit.items()}
        found = self._findings(self._step_rows(keys, pos, agg, c), now) if pos.size else []
        return found + self._trend_findings(keys, tpos, tfit, now, {f.job for f in found})

    def _step_rows(self, keys: pl.DataFrame, pos: np.ndarray, agg: dict[str, np.ndarray], c: OomDeviceConfig) -> pl.DataFrame:
        nullable = lambda a: pl.Series(a, dtype=pl.Float64).fill_nan(None)  # noqa: E731
        per = keys.select("job", "rank", "node", "gpu")[pos].with_columns(
            *(pl.Series(f"{e}_rises", agg[f"{e}_rises"], dtype=pl.UInt32) for e in ("env", "fenv")),
            *(nullable(agg[f"{e}_{x}"]).alias(f"{e}_{x}") for e in ("env", "fenv") for x in ("t_first", "t_last", "first")),
            *(pl.Series(f"{e}_{x}", agg[f"{e}_{x}"], dtype=pl.Float64) for e in ("env", "fenv") for x in ("last", "start")),
            pl.Series("has_procs", agg["has_procs"], dtype=pl.Boolean),
            pl.Series("gpu_used", agg["gpu_used"], dtype=pl.Float64),
            nullable(agg["capacity"]).alias("capacity"),
            pl.Series("own_now", agg["own_now"], dtype=pl.Float64),
            nullable(agg["interval"]).alias("interval"),
        ).with_columns(
            (pl.col("env_last") - pl.col("env_start")).alias("growth"),
            (pl.col("fenv_last") - pl.col("fenv_start")).alias("f_growth"),
            (pl.col("capacity") - c.safety_margin_bytes - pl.col("gpu_used")).alias("headroom"),
        )
        return per

    def _refill(self, window: Window, keys: pl.DataFrame) -> None:
        """Refill the rings of `keys` from the window (rows that may count were not folded in)."""
        slots = keys["_k"].to_numpy()
        self._rings.clear(slots)
        on = keys.select(GPU_KEY)
        gs = window.get("gpu_samples").join(on, on=GPU_KEY, how="semi", maintain_order="left")
        procs = window.get("gpu_processes")
        if procs.height:
            procs = procs.join(on, on=GPU_KEY, how="semi", maintain_order="left")
        self._add(gs, procs, window.now, keys, None, None)
        self._rings.floor[slots] = -np.inf

    def _findings(self, per: pl.DataFrame, now: float) -> list[Finding]:
        c = self.config
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

    def _trend_findings(self, keys: pl.DataFrame, pos: np.ndarray, fit: dict[str, np.ndarray], now: float, done: set) -> list[Finding]:
        """One finding per job whose GPUs' envelope keeps growing over a trend window (jobs with
        a finding from the steps already are left to it): the GPU projected to fill soonest."""
        if pos.size == 0:
            return []
        c = self.config
        rows = keys.select("job", "rank", "node", "gpu")[pos].with_columns(*(pl.Series(name, v, dtype=pl.Float64) for name, v in fit.items()))
        rows = rows.filter(~pl.col("job").is_in(list(done))).sort(["tto", "job", "rank"])
        out = []
        for part in rows.partition_by("job", maintain_order=True):
            w = part.row(0, named=True)
            tto, rate, used, cap = float(w["tto"]), float(w["slope"]), float(w["used"]), float(w["capacity"])
            headroom = cap - c.safety_margin_bytes - used
            minutes = w["window"] / 60
            out.append(
                self._predicted(
                    now, w, "leak", tto,
                    evidence={
                        "level": "L0",
                        "time_to_oom_seconds": round(tto, 1),
                        "rank": None if w["rank"] is None else int(w["rank"]),
                        "growth_bytes_per_second": round(rate),
                        "gpu_used_bytes": int(used),
                        "headroom_bytes": int(headroom),
                        "fit_window_seconds": w["window"],
                        "per_process_memory": False,
                        "ranks_at_risk": part.height,
                        "fragmentation_visible": False,
                        "note": NOT_AT_L0,
                        **_projection(w["fit_start_ts"], now, rate, float(w["intercept"]), now + tto, cap, c.safety_margin_bytes, w["interval"], w["confidence"]),
                    },
                    what=f"the upper envelope of the GPU's used memory has kept growing for {minutes:.0f} min (a leak or a workload outgrowing the GPU)",
                    rate=rate,
                    headroom=headroom,
                )
            )
        return out

    def _finding(self, now: float, w: dict, n_at_risk: int, cause: str, rate: float, tto: float) -> Finding:
        c = self.config
        what = "another process on the GPU is taking more and more memory" if cause == "foreign_process" else "the job's footprint keeps adding segments (a leak, or a workload outgrowing the GPU)"
        if not w["has_procs"]:
            # DCGM's FB_USED alone: the GPU's memory grows, whose it is cannot be told.
            what = "the GPU's used memory keeps growing in segment steps (a leak or a workload outgrowing the GPU; without per-process memory another process's growth cannot be told apart)"
        return self._predicted(
            now, w, cause, tto,
            evidence={
                "level": "L0",
                "time_to_oom_seconds": round(tto, 1),
                "rank": None if w["rank"] is None else int(w["rank"]),
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
                # The projection the report draws: from the GPU's memory now, at the fitted rate,
                # to capacity − safety margin (steps: the envelope's first step to now).
                **_projection(float(w["fit_start"]), now, rate, float(w["gpu_used"]), now + tto, float(w["capacity"]), c.safety_margin_bytes, w.get("interval"), min(1.0, int(w.get("rises") or 0) / (2 * c.min_rises))),
            },
            what=what,
            rate=rate,
            headroom=w["headroom"],
        )

    def _predicted(self, now: float, w: dict, cause: str, tto: float, *, evidence: dict, what: str, rate: float, headroom: float) -> Finding:
        """An oom_predicted finding of either fit (segment steps or the slow-growth trend): a page
        when the OOM is due within page_within_seconds, a ticket before."""
        return Finding(
            kind=FindingKind.OOM_PREDICTED,
            severity=Severity.PAGE if tto <= self.config.page_within_seconds else Severity.TICKET,
            ts=now,
            job=w["job"],
            ranks=[] if w["rank"] is None else [int(w["rank"])],
            node=w["node"],
            gpu=w["gpu"],
            cause=cause,
            source=self.name,
            evidence=evidence,
            summary=(
                f"{w['job']} {_where(w)} will run out of GPU memory in about {tto / 60:.1f} min (L0, device memory): "
                f"{what}, +{rate / GIB * 60:.2f} GiB/min, {max(headroom, 0) / GIB:.1f} GiB left; {NOT_AT_L0}."
            ),
        )


def _where(w: dict) -> str:
    """'rank 3 (n0 GPU 2)', or 'on n0 GPU 2' for a GPU mapped to its job by the exporter's labels
    only (a pod: no rank)."""
    if w["rank"] is not None:
        return rank_at(w["rank"], w["node"], w["gpu"])
    return "on " + " ".join(p for p in (w["node"], None if w["gpu"] is None else f"GPU {w['gpu']}") if p)


def _projection(start: float, end: float, slope: float, at_end: float, full: float, capacity: float, margin: int, interval: Any, confidence: float) -> dict[str, Any]:
    return {
        "fit_start_ts": start,
        "fit_end_ts": end,
        "slope_bytes_per_s": slope,
        "intercept_bytes": at_end,
        "predicted_full_ts": full,
        "capacity_bytes": int(capacity),
        "safety_margin_bytes": int(margin),
        "sample_interval_s": None if interval is None or not math.isfinite(interval) else round(float(interval), 3),
        "confidence": round(float(confidence), 3),
    }


def _trend(per: pl.DataFrame, e: str, c: OomDeviceConfig) -> pl.DataFrame:
    """The GPUs of `per` where envelope `e` (the job's own, or the other processes') has risen in
    at least min_rises steps over at least min_span_seconds and by min_growth_bytes since the fit
    window began, within the horizon: rate = its rise from the first step to now / the first to
    last step's time apart; nearest to OOM first."""
    span = pl.col(f"{e}_t_last") - pl.col(f"{e}_t_first")
    return (
        per.with_columns(((pl.col(f"{e}_last") - pl.col(f"{e}_first")) / span).alias("rate"), pl.col(f"{e}_rises").alias("rises"), pl.col(f"{e}_t_first").alias("fit_start"))
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


def _evaluate(rings: SlotSamples, slots: np.ndarray, lo: np.ndarray, c: OomDeviceConfig) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The refit's per-GPU aggregates (detect) from the GPUs' samples (`rings`), for the GPUs (positions in `slots`) whose own
    or other processes' envelope rose in at least min_rises steps (the others cannot warn).

    Rows are sorted, so those a fit at lo reads (ts >= lo) are slots [a, n). A step of the
    envelope is a rise of more than rise_bytes from one sample to the next, so GPUs with
    fewer such rises in [a, n) are passed over first (the usual GPU: a plateau); the others
    are evaluated in full (`_aggregate`)."""
    rise_b = float(c.rise_bytes)
    order = np.argsort(slots, kind="stable")  # slot order: a block of consecutive slots is a view
    slots, lo = slots[order], lo[order]
    pos_all, parts = [], []
    for b in range(0, slots.size, BLOCK):
        q, low = slots[b : b + BLOCK], lo[b : b + BLOCK]
        n = rings.n[q]
        m = int(n.max())
        if m == 0:
            continue
        whole = int(q[-1]) - int(q[0]) + 1 == q.size
        take = (lambda a: a[int(q[0]) : int(q[-1]) + 1, :m]) if whole else (lambda a: a[q, :m])  # noqa: E731
        ts, own = take(rings.ts), take(rings.v["own"])
        a = (ts < low[:, None]).sum(axis=1)  # NaN (empty) slots are not below
        pair = np.arange(1, m)[None, :] > a[:, None]  # (j - 1, j) both read
        with np.errstate(invalid="ignore"):
            cand = (a < n) & ((((own[:, 1:] - own[:, :-1]) > rise_b) & pair).sum(axis=1) >= c.min_rises)
            procs = np.flatnonzero((a < n) & rings.seen["frn"][q])
            if procs.size:
                f0 = np.nan_to_num(take(rings.v["frn"])[procs], nan=0.0)
                cand[procs[((((f0[:, 1:] - f0[:, :-1]) > rise_b) & pair[procs]).sum(axis=1) >= c.min_rises)]] = True
        rows = np.flatnonzero(cand)
        if rows.size == 0:
            continue
        keep, agg = _aggregate(ts[rows], own[rows], take(rings.v["frn"])[rows], n[rows], a[rows], c)
        rows = rows[keep]
        if rows.size == 0:
            continue
        agg["gpu_used"] = rings.last["used"][q[rows]]
        agg["capacity"] = rings.last["capacity"][q[rows]]
        pos_all.append(order[b + rows])
        parts.append(agg)
    if not parts:
        return np.zeros(0, np.int64), {}
    return np.concatenate(pos_all), {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}



def _aggregate(ts: np.ndarray, own: np.ndarray, frn: np.ndarray, n: np.ndarray, a: np.ndarray, c: OomDeviceConfig) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per row (a GPU's sorted samples, those read in [a, n)), what the refit aggregates: the
    segment since the last drop starts at s (the last slot whose own memory fell by more than
    drop_bytes from the slot before, else a); the envelope is the running max over [s, n); a
    step is a rise of the envelope by more than rise_bytes from the slot before. Both ts and the
    envelope only grow along a row, so the first step has the least ts and envelope, the last
    the greatest. Returns the rows that can warn (at least min_rises steps of either envelope,
    the other processes' only with a process list) and their aggregates."""
    rows, m = ts.shape
    j = np.arange(m)
    inside = j[None, :] < n[:, None]
    fell = ((own[:, 1:] - own[:, :-1]) < -float(c.drop_bytes)) & (j[None, 1:] > a[:, None]) & inside[:, 1:]
    s = np.where(fell.any(axis=1), m - 1 - fell[:, ::-1].argmax(axis=1), a)  # fell[:, k] is slot k + 1
    seg = (j[None, :] >= s[:, None]) & inside
    step = (j[None, 1:] > s[:, None]) & inside[:, 1:]  # (j - 1, j) both in the segment
    r = np.arange(rows)
    last = n - 1
    has_procs = (seg & ~np.isnan(frn)).any(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        interval = np.where(last > s, (ts[r, last] - ts[r, s]) / np.maximum(last - s, 1), np.nan)
    out: dict[str, np.ndarray] = {"has_procs": has_procs, "own_now": own[r, last], "interval": interval}
    for e, v, which in (("env", own, r), ("fenv", frn, np.flatnonzero(has_procs))):
        # The other processes' envelope (NaN: 0) of a GPU without a process list is flat at 0.
        rises = np.zeros(rows, np.int64)
        t_first, t_last, e_first = np.full(rows, np.nan), np.full(rows, np.nan), np.full(rows, np.nan)
        e_last, e_start = np.zeros(rows), np.zeros(rows)
        if which.size:
            x = v[which] if e == "fenv" else v
            if e == "fenv":
                x = np.nan_to_num(x, nan=0.0)
            sg, st, w = (seg, step, r) if e == "env" else (seg[which], step[which], r[: which.size])
            env = np.maximum.accumulate(np.where(sg, x, -np.inf), axis=1)
            with np.errstate(invalid="ignore"):  # -inf - -inf before the segment: masked by step
                up = st & ((env[:, 1:] - env[:, :-1]) > float(c.rise_bytes))
            k = up.sum(axis=1)
            any_up = k > 0
            i1 = up.argmax(axis=1)  # the first step (slot i1 + 1)
            i2 = m - 2 - up[:, ::-1].argmax(axis=1)  # the last
            t1 = ts[which, 1:] if e == "fenv" else ts[:, 1:]
            rises[which] = k
            t_first[which] = np.where(any_up, t1[w, i1], np.nan)
            t_last[which] = np.where(any_up, t1[w, i2], np.nan)
            e_first[which] = np.where(any_up, env[w, i1 + 1], np.nan)
            e_last[which] = env[w, last[which]]
            e_start[which] = x[w, s[which]]
        out.update({f"{e}_rises": rises, f"{e}_t_first": t_first, f"{e}_t_last": t_last, f"{e}_first": e_first, f"{e}_last": e_last, f"{e}_start": e_start})
    keep = (out["env_rises"] >= c.min_rises) | (has_procs & (out["fenv_rises"] >= c.min_rises))
    return keep, {name: v[keep] for name, v in out.items()}


class _Buckets:
    """Per slot (an allocated GPU), the upper envelope of its used memory over the longest trend
    window: the maximum of each `width`-second bucket of a grid shared by every slot (bucket b:
    [b * width, (b + 1) * width)), in a ring of `length` buckets (incremental.BlockRing: a bucket
    of every slot is one contiguous row, so a new bucket clears one row and a block of buckets is
    a few rows). float32: a few kB of resolution at 150 GB, half the memory. Plus, per slot, how
    many samples each bucket got (the sample interval), the newest sample's used memory and
    capacity, and when the GPU was last idle (module doc, "Slow growth")."""

    def __init__(self, width: float, length: int) -> None:
        self.width = float(width)
        self.ring = BlockRing(length, {"vmax": (np.float32, np.nan), "cnt": (np.uint16, 0)})
        self._empty(0)

    def _empty(self, rows: int) -> None:
        self.last_ts = np.full(rows, -np.inf)
        self.idle_ts = np.full(rows, -np.inf)
        self.used = np.full(rows, np.nan)
        self.capacity = np.full(rows, np.nan)
        self.since = np.full(rows, np.inf)  # since when the trend fit has held on every evaluation

    @property
    def length(self) -> int:
        return self.ring.length

    @property
    def top(self) -> int:
        """The newest bucket id the ring holds."""
        return self.ring.top

    @property
    def vmax(self) -> np.ndarray:
        return self.ring["vmax"]

    @property
    def cnt(self) -> np.ndarray:
        return self.ring["cnt"]

    @property
    def rows(self) -> int:
        return int(self.last_ts.size)

    def grow_rows(self, rows: int) -> None:
        have = self.rows
        if rows <= have:
            return
        rows = headroom(rows, have)
        self.ring.widen(rows)
        self.last_ts, self.idle_ts = (resized(a, rows, -np.inf) for a in (self.last_ts, self.idle_ts))
        self.used, self.capacity = (resized(a, rows, np.nan) for a in (self.used, self.capacity))
        self.since = resized(self.since, rows, np.inf)

    def clear(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        self.ring.clear(slots)
        self.last_ts[slots] = self.idle_ts[slots] = -np.inf
        self.used[slots] = self.capacity[slots] = np.nan
        self.since[slots] = np.inf

    def advance(self, now: float) -> None:
        """Make the bucket holding `now` the newest (the ones it passes start empty)."""
        self.ring.advance(math.floor(now / self.width))

    def insert(self, k: np.ndarray, ts: np.ndarray, used: np.ndarray, capacity: np.ndarray, idle_bytes: float, idle_share: float = 0.0) -> None:
        """Fold samples in. A sample folded twice (a rebuild or refill reading the window again)
        changes no maximum and is counted once (only samples newer than the slot's newest count)."""
        ok = ~np.isnan(used)
        if not ok.all():
            k, ts, used, capacity = k[ok], ts[ok], used[ok], capacity[ok]
        if k.size == 0:
            return
        self.advance(float(ts.max()))
        b = np.floor(ts / self.width).astype(np.int64)
        keep = b > self.top - self.length
        if not keep.all():
            k, ts, used, capacity, b = k[keep], ts[keep], used[keep], capacity[keep], b[keep]
        if k.size == 0:
            return
        r = b % self.length
        v = used.astype(np.float32)
        newer = ts > self.last_ts[k]
        if np.bincount(k, minlength=1).max() <= 1:  # one sample a GPU (the usual tick): no duplicates
            self.vmax[r, k] = np.fmax(self.vmax[r, k], v)
            self.cnt[r[newer], k[newer]] += 1
            self.last_ts[k] = np.maximum(self.last_ts[k], ts)
            last = np.ones(k.size, bool)
        else:
            np.fmax.at(self.vmax, (r, k), v)
            np.add.at(self.cnt, (r[newer], k[newer]), 1)
            np.maximum.at(self.last_ts, k, ts)
            order = np.lexsort((ts, k))
            last = np.zeros(k.size, bool)
            last[order[np.r_[k[order][1:] != k[order][:-1], True]]] = True
        # The newest sample of each slot gives its used memory and capacity now.
        at = last & (ts >= self.last_ts[k])
        self.used[k[at]] = used[at]
        self.capacity[k[at]] = capacity[at]
        idle = used < np.fmax(idle_bytes, idle_share * capacity)
        if idle.any():
            np.maximum.at(self.idle_ts, k[idle], ts[idle])

    def units(self, unit: int, count: int) -> np.ndarray:
        """(count, rows) maxima of the newest `count` runs of `unit` buckets (row 0: the run ending
        with the newest bucket); NaN: no sample in the run."""
        out = np.empty((count, self.rows), np.float32)
        for j in range(count):
            hi = self.top - j * unit
            rows = np.arange(hi - unit + 1, hi + 1) % self.length
            out[j] = self.vmax[rows[0]]
            for r in rows[1:]:  # pairwise: numpy's reduce over the leading axis is many times slower here
                np.fmax(out[j], self.vmax[r], out=out[j])
        return out


TREND_FIELDS = ("fit_start_ts", "slope", "intercept", "tto", "confidence", "interval", "window", "used", "capacity")


def _trend_fits(bk: _Buckets, slots: np.ndarray, lo: np.ndarray, now: float, c: OomDeviceConfig) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The GPUs (positions in `slots`) whose used memory's upper envelope has kept growing over a
    trend window, projected to reach capacity − safety margin within predict_horizon_seconds, with
    the fit of the window that projects it soonest (module doc, "Slow growth")."""
    w, q = c.trend_bucket_seconds, c.trend_blocks
    per_block = [round(x / q / w) for x in c.trend_windows_seconds]
    unit = math.gcd(*per_block)
    count = max(per_block) * q // unit
    bk.advance(now)
    if slots.size == 0 or bk.top < 0:
        return np.zeros(0, np.int64), {}
    um = bk.units(unit, count)  # (count, slots), newest first
    if not (slots.size == bk.rows and (slots == np.arange(bk.rows)).all()):
        um = um[:, slots]
    with np.errstate(invalid="ignore"):
        settled = ~(now - bk.idle_ts[slots] < c.startup_seconds)
    best = np.full(slots.size, np.inf)  # the soonest projected OOM
    out = {name: np.full(slots.size, np.nan) for name in TREND_FIELDS}
    target = bk.capacity[slots] - c.safety_margin_bytes
    for bb in sorted(set(per_block)):
        idx = _trend_candidates(bk, _block_maxima(um, q, bb // unit), bb, slots, lo, settled & ~np.isnan(target), c)
        if idx.size == 0:
            continue
        fit = _theil_sen(bk, slots[idx], bb, now, target[idx], c)
        sooner = fit.pop("good") & (fit["tto"] < best[idx])
        if not sooner.any():
            continue
        at = idx[sooner]
        best[at] = fit["tto"][sooner]
        for name, val in fit.items():
            out[name][at] = val[sooner]
    pos = np.flatnonzero(np.isfinite(best))
    return pos, {name: v[pos] for name, v in out.items()}


def _block_maxima(um: np.ndarray, q: int, k: int) -> np.ndarray:
    """(q, slots) maxima of the window's q blocks of k units each, oldest first (`um`: the units'
    maxima, newest first)."""
    blocks = np.empty((q, um.shape[1]), np.float32)
    for b in range(q):
        blocks[q - 1 - b] = um[b * k]
        for u in range(b * k + 1, (b + 1) * k):
            np.fmax(blocks[q - 1 - b], um[u], out=blocks[q - 1 - b])
    return blocks


def _trend_candidates(bk: _Buckets, blocks: np.ndarray, bb: int, slots: np.ndarray, lo: np.ndarray, able: np.ndarray, c: OomDeviceConfig) -> np.ndarray:
    """Positions in `slots` whose window of `bb`-bucket blocks may hold a trend: every block has
    a sample, the window starts after the fit may (lo) and after the GPU was last idle, and its
    block maxima rose often and far enough. `able`: settled and of known capacity."""
    q = c.trend_blocks
    start = (bk.top - bb * q + 1) * c.trend_bucket_seconds
    with np.errstate(invalid="ignore"):
        rises = np.zeros(blocks.shape[1], np.int64)
        for b in range(1, q):
            rises += (blocks[b] - blocks[b - 1]) > c.trend_rise_bytes
        # every block has a sample (NaN propagates through the sum)
        total = blocks[0].copy()
        for b in range(1, q):
            total += blocks[b]
        cand = (
            able
            & ~np.isnan(total)
            & (start >= lo)
            & (start > bk.idle_ts[slots])
            & (rises >= c.trend_min_block_rises)
            & (blocks[-1] - blocks[0] >= c.trend_min_growth_bytes)
        )
    return np.flatnonzero(cand)


def _theil_sen(bk: _Buckets, gpus: np.ndarray, bb: int, now: float, target: np.ndarray, c: OomDeviceConfig) -> dict[str, np.ndarray]:
    """The trend of each slot of `gpus` over the window of `bb`-bucket blocks: a Theil-Sen line
    through its block maxima, and `good` where it holds (grows steadily, well above its scatter,
    still rising) and reaches `target` within the horizon; the other values as TREND_FIELDS."""
    q, w = c.trend_blocks, c.trend_bucket_seconds
    n = bb * q  # buckets in the window
    ids = np.arange(bk.top - n + 1, bk.top + 1)
    ring = ids % bk.length
    v = bk.vmax[ring][:, gpus].astype(np.float64)  # (n, m) bucket maxima, oldest first
    counts = bk.cnt[ring][:, gpus].sum(axis=0)
    centre = np.minimum((ids + 0.5) * w, now)
    # Each block's maximum and when it came (the centre of its bucket).
    vb = np.where(np.isnan(v), -np.inf, v).reshape(q, bb, -1)
    arg = vb.argmax(axis=1)  # (q, m)
    m_q = np.take_along_axis(vb, arg[:, None, :], axis=1)[:, 0, :]
    t_q = centre[(np.arange(q) * bb)[:, None] + arg]
    # Theil-Sen over the block maxima: the median of the pairwise slopes.
    i, j = np.triu_indices(q, 1)
    slope = np.median((m_q[j] - m_q[i]) / (t_q[j] - t_q[i]), axis=0)
    intercept = np.median(m_q + slope * (now - t_q), axis=0)  # the line at now
    scatter = np.median(np.abs(m_q - (intercept - slope * (now - t_q))), axis=0)
    growth = slope * n * w
    recent = m_q[-1] - m_q[-2]
    step_rise = np.maximum(slope * bb * w * c.trend_min_rise_share, float(c.trend_rise_bytes))
    rose = ((m_q[1:] - m_q[:-1]) > step_rise).sum(axis=0)
    # Kendall's tau of the bucket maxima against time: how steadily the envelope grows.
    ok = ~np.isnan(v)
    a, b = np.triu_indices(n, 1)
    sign = np.sign(v[b] - v[a])
    both = ok[a] & ok[b]
    pairs = both.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = np.where(pairs > 0, np.nansum(np.where(both, sign, 0.0), axis=0) / pairs, 0.0)
        tto = np.maximum(target - intercept, 0.0) / slope
        good = (
            (slope > 0)
            & (rose >= c.trend_min_block_rises)
            & (growth >= c.trend_min_growth_bytes)
            & (growth >= c.trend_min_signal_to_noise * scatter)
            & (recent >= c.trend_min_recent_share * slope * bb * w)
            & (tau >= c.trend_min_confidence)
            & (tto <= c.predict_horizon_seconds)
        )
        interval = np.where(counts > 0, n * w / np.maximum(counts, 1), np.nan)
    start = (bk.top - n + 1) * w
    return {
        "good": good,
        "fit_start_ts": np.full(gpus.size, start),
        "slope": slope,
        "intercept": intercept,
        "tto": tto,
        "confidence": np.clip(tau, 0.0, 1.0),
        "interval": interval,
        "window": np.full(gpus.size, n * w),
        "used": bk.used[gpus],
        "capacity": bk.capacity[gpus],
    }
