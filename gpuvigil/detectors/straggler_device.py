"""L0 straggler: a GPU that persistently lags its job's peers in device telemetry.

Two signatures (docs/detectors.md):
- *host-side* straggler (slow input, CPU contention on one rank): its GPU idles while its peers spin
  in the collective waiting for it, so its utilisation lags the peers' (whose spinning reads 100%);
- *device-side* straggler (power-capped, throttled or degraded GPU): its SM clock lags the peers'
  while it stays busy; the peers, waiting for it, are the ones whose SM activity and power drop
  (traceml#252: DDP equalises step times, so the slow rank is not the one that looks idle).
Healthy spread in real jobs is wide (Megatron/savanna logs: ±13 °C, ±60 MHz, one rank at 45%
util in a snapshot): the thresholds are relative to the job's median and must hold over a
window and on consecutive evaluations. A job whose GPUs wait together (a hang) is skipped.
The window is `window_seconds` at NVML's 1 s; GPUs sampled more slowly (dcgm-exporter's 30 s)
get a look-back of `min_samples` intervals, up to `max_window_seconds` (240 s: eight samples), so
that a straggler that comes and goes for minutes is found within its episode.

Cost at scale (100,000 GPUs): O(new rows) per tick, not O(window). Each allocated GPU (each row of
`allocations`) has a ring of its samples' ts, util, SM clock and power over the last
`window_seconds` (detectors/incremental.py: KeyRing), fed from each tick's fresh rows (`ingest` on
the ticks the detector is not due, and `detect`). An evaluation is a few vectorised numpy passes
over the rings (masks for the look-back, the job's warm-up and the recent past; sorted rows for
the medians and the 0.9 quantile, as polars computes them); the per-job peer stage is the small
polars frame of one row per GPU, as before. A rebuild (the first call, another window, time going
back, a tick missed with no `ingest`, no allocation listed) refills the rings from the rows the
window holds, joined to the current allocations as the refit was; a long gap between two ticks
needs none (every tick's rows were folded in; those older than the look-back are masked).
Findings are those of the refit over the window it replaced (tests/test_straggler_device_incremental.py:
the refit, verbatim, as the oracle) except:

- A GPU's ring starts empty when its allocation row (job, rank, node, gpu) first appears after a
  rebuild, and is dropped when the row goes: the refit joined every row of the GPU in the window
  to its *current* allocation, so it also counted the rows the GPU sent before it was listed for
  this job (for another job, idle, or while missing from a non-empty allocations snapshot) that
  pass the job's warm-up filter. They are the same whenever those rows are older than the job's start_ts + 30 s
  (a GPU listed within 30 s of its job's start, the usual case), so the difference needs a job
  without a start_ts in `jobs`, a start_ts moved earlier than the listing by more than 30 s, or a
  GPU dropped from `allocations` and listed again for the same job.
- The window's history is emulated, not read: a `pipeline.horizon_seconds` cap for gpu_samples
  below `window_seconds` (or a shorter declared look-back, `rebuild_history_seconds`) shortened
  the refit's look-back; the rings keep `window_seconds` of fresh rows whatever the window keeps,
  and a rebuild reads what the window holds. Likewise, rows `Window.retain` thinned from the window
  (GPUs of jobs the level selection does not give this detector) are still in the rings; the
  early return (no sample at all in the look-back) looks at the newest sample seen, thinned or not.
- util is a mean, which polars sums Kahan-compensated in row order. The rings give that sum, in
  arrival order, for every job whose findings could tell (a flagged GPU, whose util is printed,
  or a comparison within 1e-9 of its threshold: see detect); were the refit's join to reorder a
  GPU's rows (it kept arrival order in every test), its own util could differ in the last bit.
- Out of scope (inconsistent input): a NaN (not null) util, clock, power or ts, counted as null
  (ts NaN: the row is dropped; polars orders NaN above every number); an allocation or a job listed
  twice (the refit's joins duplicated the GPU's rows: the rings keep each row once, per distinct
  allocation row, and a job's first start_ts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import Persistence, allocated_gpu_retention, rank_at, settings
from gpuvigil.detectors.incremental import KeyRing, TickCursor
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class StragglerDeviceConfig(BaseModel):
    window_seconds: float = 90.0
    min_samples: int = 20
    # Slowly sampled GPUs (dcgm-exporter's 30 s default): the look-back grows to hold min_samples
    # intervals, up to max_window_seconds, and a GPU is judged on as many samples as that holds
    # (three quarters of them, at least min_window_samples). At 1 s nothing changes.
    max_window_seconds: float = Field(240.0, gt=0)
    min_window_samples: int = Field(6, ge=2)
    min_gpus: int = 4
    min_util_lag: float = 0.15  # host-side: util below the peers' median by this much ...
    min_peer_util: float = 0.8  # ... while the peers are busy or spinning
    min_clock_lag: float = 0.08  # device-side: busy SM clock this share below the peers' median
    max_idle_share: float = 0.5  # a GPU idle (util < 0.1) most of the window is absent, not slow
    persist_evaluations: int = 3
    recent_seconds: float = 20.0  # skip a job whose GPUs wait together (util pinned, power collapsed): a hang
    # Memory at scale (100,000 GPUs): gpu_samples rows older than this are kept only for the GPUs of
    # jobs whose findings this detector gives (pipeline/core.py: declared_retention); null: all.
    history_recent_seconds: float | None = Field(10.0, ge=0)
    # gpu_samples history declared to the pipeline (lookback_seconds): what a rebuild of the rings
    # can read. None: the whole look-back (max(window_seconds, recent_seconds)), so a rebuild is
    # exact; shorter, the window may keep less (memory) and a rebuild starts from what it holds.
    rebuild_history_seconds: float | None = Field(20.0, gt=0)

ALLOC = ["job", "rank", "node", "gpu"]
ALLOC_SCHEMA = {"job": pl.Utf8, "rank": pl.Int32, "node": pl.Utf8, "gpu": pl.Int32}
WARMUP_SECONDS = 30.0


class DeviceStragglerDetector(Declared):
    spec = DetectorSpec(
        name="straggler_device",
        config=StragglerDeviceConfig,
        emits=(FindingKind.STRAGGLER,),
        reads={"gpu_samples": HISTORY, "allocations": HISTORY, "jobs": HISTORY},
        order=150,
        level="L0",
        capability="straggler",
        streams=("gpu_samples", "allocations"),
        every_seconds=5.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("straggler_device", StragglerDeviceConfig, cfg)
        self._persistence = Persistence()
        self._cursor = TickCursor()
        self._interval = 0.0  # the GPUs' median sample interval (s), from the rings
        self._reset()

    def _window(self) -> float:
        """The look-back: window_seconds, or min_samples sample intervals up to max_window_seconds."""
        c = self.config
        return max(c.window_seconds, min(c.min_samples * self._interval, c.max_window_seconds))

    def _recent_seconds(self) -> float:
        """The recent past the hang check reads: at least one and a half sample intervals."""
        return max(self.config.recent_seconds, 1.5 * self._interval)

    def _needed_samples(self) -> int:
        c = self.config
        if self._interval <= 0 or self._window() >= c.min_samples * self._interval:
            return c.min_samples
        return min(c.min_samples, max(c.min_window_samples, int(0.75 * self._window() / self._interval)))

    def _measure_interval(self) -> None:
        """The median, over GPUs with two samples or more in their ring, of their mean interval."""
        ring = self._ring
        n = ring.n
        if n == 0:
            return
        ts = ring.ts[:n]
        ok = ~np.isnan(ts)
        cnt = np.count_nonzero(ok, axis=1)
        have = cnt >= 2
        if not have.any():
            return
        with np.errstate(invalid="ignore"):
            span = np.nanmax(np.where(ok, ts, np.nan)[have], axis=1) - np.nanmin(np.where(ok, ts, np.nan)[have], axis=1)
        self._interval = float(np.median(span / (cnt[have] - 1)))

    def lookback_seconds(self) -> dict[str, float]:
        """History read from the window (pipeline/core.py: declared_horizons, declared_columns):
        only a rebuild of the rings reads it (see rebuild_history_seconds)."""
        c = self.config
        return {"gpu_samples": c.rebuild_history_seconds if c.rebuild_history_seconds is not None else max(c.window_seconds, c.recent_seconds)}

    def window_retention(self) -> dict[str, tuple[float, str]]:
        return allocated_gpu_retention(self.config.history_recent_seconds)

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        return {"gpu_samples": ("ts", "node", "gpu", "util_ratio", "sm_clock_mhz", "power_w")}

    # -- running state ---------------------------------------------------------------------------
    def _reset(self) -> None:
        # "clock": the SM clock of a busy sample only (util >= 0.5; else NaN), the one the median reads.
        self._ring = KeyRing(["util", "clock", "power"], [], slack=1 / 16)
        # The same rows over the recent past only (same ring rows): its medians sort a narrow array.
        self._recent = KeyRing(["util", "power"], [], slack=1 / 16)
        self._keys = pl.DataFrame(schema={**ALLOC_SCHEMA, "_k": pl.Int64})  # allocation row -> ring row
        self._free: list[int] = []  # ring rows of allocations gone, reused first
        self._alloc: pl.DataFrame | None = None  # the allocations frame the keys were synced with
        self._route: tuple[pl.DataFrame, np.ndarray, np.ndarray] | None = None  # fresh (node, gpu) -> (row, ring row)
        self._max_ts = -np.inf  # newest sample seen (any GPU)
        # Every busy clock folded in since the last reset is a float32 value (NVML reports whole
        # MHz): its median then sorts float32 rows, half the bytes, with the same order and values.
        self._clock_exact32 = True

    def ingest(self, window: Window) -> None:
        """Fold this tick's rows in (called by the pipeline on ticks the detector is not due)."""
        now = window.now
        mode = self._cursor.advance(window)
        if mode == "same":
            return
        stepping = mode == "step"
        if not stepping:
            self._reset()
        self._sync_allocations(window.get("allocations"))
        self._add(window.fresh("gpu_samples") if stepping else window.get("gpu_samples"), now - self._window(), now - self._recent_seconds())
        self._measure_interval()
        if self._keys.height == 0:
            # No allocation to keep rows for (none yet, or an empty snapshot): the next call
            # rebuilds from the window, as the refit joined its rows to the allocations then.
            self._cursor.forget()

    def _sync_allocations(self, alloc: pl.DataFrame) -> None:
        """One ring per distinct allocation row; a row gone frees its ring, a new one starts empty."""
        if self._alloc is not None and (alloc is self._alloc or (alloc.schema == self._alloc.schema and alloc.equals(self._alloc))):
            return
        self._alloc, self._route = alloc, None
        if alloc.height == 0 or not set(ALLOC) <= set(alloc.columns):
            now_keys = pl.DataFrame(schema=ALLOC_SCHEMA)
        else:
            # The refit's inner join on (node, gpu) matched no null node or GPU.
            now_keys = alloc.select(pl.col(c).cast(t) for c, t in ALLOC_SCHEMA.items()).filter(pl.col("node").is_not_null() & pl.col("gpu").is_not_null()).unique(maintain_order=True)
        keys = now_keys.join(self._keys, on=ALLOC, how="left", nulls_equal=True, maintain_order="left")
        gone = self._keys.join(now_keys, on=ALLOC, how="anti", nulls_equal=True)["_k"].to_numpy()
        if gone.size:
            self._ring.clear(gone)
            self._recent.clear(gone)
            self._free.extend(gone.tolist())
        new = keys["_k"].is_null()
        fresh_keys = int(new.sum())
        if fresh_keys:
            reuse = self._free[:fresh_keys]
            self._free = self._free[fresh_keys:]
            first = self._ring.n
            more = fresh_keys - len(reuse)
            self._ring.n += more
            self._ring.reserve(self._ring.n)
            self._recent.n = self._ring.n
            self._recent.reserve(self._recent.n)
            ids = np.concatenate([np.asarray(reuse, np.int64), np.arange(first, first + more, dtype=np.int64)])
            k = keys["_k"].fill_null(-1).to_numpy().astype(np.int64)
            k[new.to_numpy()] = ids
            keys = keys.with_columns(pl.Series("_k", k, dtype=pl.Int64))
        self._keys = keys

    def _add(self, rows: pl.DataFrame, keep_from: float, recent_from: float) -> None:
        """Fold samples into the rings of their GPU's allocation rows (every row of that GPU)."""
        if rows.height == 0:
            return
        hi = rows["ts"].filter(rows["ts"].is_not_nan()).max()
        if hi is not None:
            self._max_ts = max(self._max_ts, float(hi))  # type: ignore[arg-type]
        if self._keys.height == 0:
            return
        where = rows.select("node", "gpu")
        route = self._route
        if route is not None and route[0].height == where.height and route[0].equals(where):
            at, k = route[1], route[2]  # the usual tick: the same GPUs in the same order
        else:
            if where.schema != {"node": pl.Utf8, "gpu": pl.Int32}:
                where = where.cast({"node": pl.Utf8, "gpu": pl.Int32})  # type: ignore[arg-type]
            m = where.with_row_index("_r").join(self._keys.select("node", "gpu", "_k"), on=["node", "gpu"], how="inner", maintain_order="left")
            at, k = m["_r"].to_numpy().astype(np.int64), m["_k"].to_numpy()
            self._route = (rows.select("node", "gpu"), at, k)
        ts = rows["ts"].to_numpy().astype(np.float64)[at]
        keep = ts >= keep_from  # null (NaN here) and NaN ts: dropped
        if not keep.all():
            at, k, ts = at[keep], k[keep], ts[keep]
        if k.size == 0:
            return
        vals = {name: rows[col].cast(pl.Float64).to_numpy().astype(np.float64)[at] for name, col in (("util", "util_ratio"), ("clock", "sm_clock_mhz"), ("power", "power_w"))}
        vals["clock"][~(vals["util"] >= 0.5)] = np.nan  # util null (NaN) or below 0.5: not busy
        if self._clock_exact32:
            clock = vals["clock"][~np.isnan(vals["clock"])]
            self._clock_exact32 = bool(np.array_equal(clock.astype(np.float32), clock))
        self._ring.insert(k, ts, vals, {}, keep_from)
        recent_from = max(recent_from, keep_from)
        r = ts >= recent_from
        self._recent.insert(k[r], ts[r], {"util": vals["util"][r], "power": vals["power"][r]}, {}, recent_from)

    # -- evaluation ------------------------------------------------------------------------------
    def _per_gpu(self, window: Window) -> tuple[pl.DataFrame, np.ndarray]:
        """One row per allocation row with samples in its look-back: the refit's `per` frame (and
        `_k`, its ring row); and per ring row the oldest ts read."""
        now = window.now
        keys = self._keys
        ring = self._ring
        rows_n = ring.n  # ring rows ever numbered (the arrays have headroom past them)
        # Per ring row, the oldest ts read: the look-back, and the job's warm-up where it has a start.
        lo = np.full(rows_n, np.inf)
        jobs = window.get("jobs")
        look = now - self._window()
        if keys.height:
            kk = keys["_k"].to_numpy()
            if jobs.height:
                starts = jobs.select(pl.col("job").cast(pl.Utf8), pl.col("start_ts").cast(pl.Float64).alias("_s")).unique("job", keep="first", maintain_order=True)
                s = keys.select("job").join(starts, on="job", how="left", maintain_order="left")["_s"].fill_null(-np.inf).to_numpy()
                warm = s + WARMUP_SECONDS
                # ts >= NaN is false in polars: a NaN start_ts kept none of its job's rows.
                lo[kk] = np.where(np.isnan(warm), np.inf, np.where(warm > look, warm, look))
            else:
                lo[kk] = look
        ts = ring.ts[:rows_n]
        util, clock, power = ring.f["util"][:rows_n], ring.f["clock"][:rows_n], ring.f["power"][:rows_n]
        inw = ts >= lo[:, None]
        n = np.count_nonzero(inw, axis=1)
        u_ok = ~np.isnan(util)
        u_ok &= inw
        cu = np.count_nonzero(u_ok, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_u = np.sum(util, axis=1, where=u_ok) / cu  # polars' own sum: see detect
            idle = np.count_nonzero((util < 0.1) & u_ok, axis=1) / cu
        scratch = np.empty(ts.shape)  # one buffer for the full-width sorts
        busy = ~np.isnan(clock)  # busy samples only (see _reset)
        busy &= inw
        clock_med, _ = _sorted_median(clock, busy, None if self._clock_exact32 else scratch, exact32=self._clock_exact32)
        del u_ok, busy
        p_ok = ~np.isnan(power)
        p_ok &= inw
        q90, nq = _sorted_quantile(power, p_ok, 0.9, scratch)
        del inw, p_ok, scratch
        rr = self._recent
        r_ts, r_power, r_util = rr.ts[:rows_n], rr.f["power"][:rows_n], rr.f["util"][:rows_n]
        recent = r_ts >= lo[:, None]
        recent &= r_ts >= now - self._recent_seconds()
        p_recent, npr = _sorted_median(r_power, recent & ~np.isnan(r_power))
        u_recent, _ = _sorted_median(r_util, recent & ~np.isnan(r_util))
        with np.errstate(invalid="ignore", divide="ignore"):
            share = p_recent / q90
        share_ok = (npr > 0) & (nq > 0)
        kk = keys["_k"].to_numpy()
        per = keys.select(*ALLOC, "_k").with_columns(
            pl.Series("n", n[kk], dtype=pl.UInt32),
            pl.Series("util", mean_u[kk]).fill_nan(None),  # no value: null, as polars' mean
            pl.Series("idle_share", idle[kk]).fill_nan(None),
            pl.Series("clock", clock_med[kk]).fill_nan(None),
            pl.Series("_share", share[kk]),
            pl.Series("_share_ok", share_ok[kk]),
            pl.Series("recent_util", u_recent[kk]).fill_nan(None),
        )
        # The share keeps a NaN of 0 / 0 (as polars divides); null where either side had no value.
        return per.filter(pl.col("n") > 0).with_columns(pl.when(pl.col("_share_ok")).then(pl.col("_share")).alias("recent_power_share")).select(
            *ALLOC, "n", "util", "idle_share", "clock", "recent_power_share", "recent_util", "_k"
        ), lo

    def _judge(self, per: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
        """The refit's per-job peer stage over the per-GPU frame (one row per GPU): scored, flagged."""
        c = self.config
        peers = per.group_by("job").agg(
            pl.len().alias("gpus"),
            pl.col("n").min().alias("min_n"),
            pl.col("util").median().alias("peer_util"),
            pl.col("clock").median().alias("peer_clock"),
            ((pl.col("recent_util") >= 0.9) & (pl.col("recent_power_share") <= 0.45)).mean().alias("pinned_share"),
        )
        scored = per.join(peers, on="job").with_columns(
            (pl.col("peer_util") - pl.col("util")).alias("util_lag"),
            (1.0 - pl.col("clock") / pl.col("peer_clock")).alias("clock_lag"),
        )
        flagged = scored.filter(
            (pl.col("gpus") >= c.min_gpus)
            & (pl.col("min_n") >= self._needed_samples())
            & (pl.col("pinned_share") < 0.5)  # most GPUs pinned for the whole recent past: a hang, not a straggler
            & (pl.col("idle_share") <= c.max_idle_share)
            & (
                ((pl.col("util_lag") >= c.min_util_lag) & (pl.col("peer_util") >= c.min_peer_util))
                | (pl.col("clock_lag") >= c.min_clock_lag).fill_null(False)
            )
        )
        return scored, flagged

    def detect(self, window: Window) -> list[Finding]:
        self.ingest(window)
        c = self.config
        now = window.now
        # The refit's early return (no sample of any GPU in the look-back, or no allocation) leaves
        # the persistence streaks as they were.
        if not self._max_ts >= now - self._window() or window.get("allocations").height == 0:
            return []
        per, lo = self._per_gpu(window)
        scored, flagged = self._judge(per)
        # util is a mean: polars sums a group Kahan-compensated in arrival order, which over the
        # rings costs ~10x the rest (strided). The plain sum differs from it by ~1e-14 at most, so
        # only a job with a flagged GPU (its util is printed) or a comparison within 1e-9 of its
        # threshold can tell them apart: those jobs' GPUs get polars' sum, and are judged again.
        tol = 1e-9
        close = (
            ((pl.col("util_lag") - c.min_util_lag).abs() <= tol)
            | ((pl.col("peer_util") - c.min_peer_util).abs() <= tol)
        ).fill_null(False)
        jobs = pl.concat([flagged.select("job"), scored.filter(close).select("job")]).unique()
        if jobs.height:
            # Judged again alone (a job's peers are its own GPUs); the other jobs flag nothing.
            sel = per.join(jobs, on="job", how="semi", nulls_equal=True)
            k = sel["_k"].to_numpy()
            ring = self._ring
            ok = (ring.ts[k] >= lo[k][:, None]) & ~np.isnan(ring.f["util"][k])
            with np.errstate(invalid="ignore", divide="ignore"):
                exact = _kahan_sum(ring.f["util"][k], ok, ring.head[k]) / np.count_nonzero(ok, axis=1)
            _, flagged = self._judge(sel.with_columns(pl.Series("util", exact).fill_nan(None)))
        out = self._persistence.persistent(flagged, c.persist_evaluations)
        findings = []
        for rows in out.sort(["job", "rank"]).partition_by("job", maintain_order=True) if out.height else []:
            w = rows.row(0, named=True)
            device_side = (w["clock_lag"] or 0) >= c.min_clock_lag
            why = (
                f"its SM clock runs {100 * w['clock_lag']:.0f}% below its peers' ({w['clock']:.0f} vs {w['peer_clock']:.0f} MHz): a slow device"
                if device_side
                else f"its utilisation lags its peers' ({100 * w['util']:.0f}% vs {100 * w['peer_util']:.0f}%): it waits on its host while they wait on it"
            )
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
                    cause="device" if device_side else "host",
                    source=self.name,
                    evidence={
                        "level": "L0",
                        "util": round(float(w["util"]), 3),
                        "peer_util": round(float(w["peer_util"]), 3),
                        "clock_mhz": None if w["clock"] is None else round(float(w["clock"])),
                        "peer_clock_mhz": None if w["peer_clock"] is None else round(float(w["peer_clock"])),
                        "gpus_in_job": int(w["gpus"]),
                        "window_seconds": self._window(),
                    },
                    summary=f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])} is a straggler (L0): {why}.",
                )
            )
        return findings


def _kahan_sum(values: np.ndarray, ok: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Per ring row, the sum of the values where `ok`, as polars sums a group for its mean:
    Kahan-compensated, in arrival order (the ring's oldest slot, at `head`, first)."""
    rows, cap = values.shape
    s = np.zeros(rows)
    c = np.zeros(rows)
    if rows == 0:
        return s
    same = bool((head == head[0]).all())  # every ring turned alike (steady state): column slices
    r = np.arange(rows)
    with np.errstate(invalid="ignore"):
        for j in range(cap):
            if same:
                col = int((head[0] + j) % cap)
                x, m = values[:, col], ok[:, col]
            else:
                col_idx = (head + j) % cap
                x, m = values[r, col_idx], ok[r, col_idx]
            if not m.any():
                continue
            y = x - c
            t = s + y
            c = np.where(m, (t - s) - y, c)
            s = np.where(m, t, s)
    return s


def _sorted_rows(values: np.ndarray, ok: np.ndarray, out: np.ndarray | None = None, exact32: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each row's values where `ok` (never where NaN), sorted ascending first, +inf after (in
    `out` if given, a scratch buffer of values' shape); the counts. `exact32`: the caller knows
    every value where `ok` is a float32 value, so float32 rows sort to the same order and values."""
    x = np.empty(values.shape, np.float32 if exact32 else np.float64) if out is None else out
    x.fill(np.inf)
    np.copyto(x, values, where=ok, casting="same_kind")
    x.sort(axis=1)  # numpy's vectorised sort: faster here than two partitions
    return x, np.count_nonzero(ok, axis=1)


def _sorted_median(values: np.ndarray, ok: np.ndarray, out: np.ndarray | None = None, exact32: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per row, polars' median of the values where `ok` (the caller leaves NaN = null out; even counts: a +
    (b - a) * 0.5 of the middle two; none: NaN), and the count."""
    x, n = _sorted_rows(values, ok, out, exact32)
    out = np.full(values.shape[0], np.nan)
    has = n > 0
    if x.shape[1] == 0 or not has.any():
        return out, n
    r = np.flatnonzero(has)
    # float64 before the arithmetic: the midpoint of two float32 values is polars' float64 one.
    a = x[r, (n[r] - 1) // 2].astype(np.float64)
    b = x[r, n[r] // 2].astype(np.float64)
    out[r] = np.where(n[r] % 2 == 1, a, a + (b - a) * 0.5)
    return out, n


def _sorted_quantile(values: np.ndarray, ok: np.ndarray, q: float, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row, polars' quantile(q) (interpolation 'nearest': the value at index (n - 1) * q
    rounded half away from zero, of the sorted values where `ok`, NaN left out; none: NaN), and the count."""
    x, n = _sorted_rows(values, ok, out)
    out = np.full(values.shape[0], np.nan)
    has = n > 0
    if x.shape[1] == 0 or not has.any():
        return out, n
    r = np.flatnonzero(has)
    f = (n[r] - 1).astype(np.float64) * q
    base = np.floor(f)
    idx = (base + (f - base >= 0.5)).astype(np.int64)
    out[r] = x[r, np.minimum(idx, n[r] - 1)]
    return out, n
