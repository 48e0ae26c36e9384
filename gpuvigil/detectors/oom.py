"""OOM predicted before it happens, from the trend of per-step memory peaks.

The caching allocator's footprint is what runs out: `reserved` (segments held) must stay below
capacity minus the context and other processes. Its per-step *peak* is flat for a healthy job,
however close to 100% the sawtooth goes; it rises for a leak (allocated peaks rise) and for
fragmentation (reserved − allocated rises, alloc retries rise). A least-squares line over the
recent window gives the growth rate and the time left; the cause is whichever component grows:
another process's memory on the GPU (foreign process), reserved − allocated with cudaMalloc
retries (fragmentation), or allocated peaks (a leak, or activations that keep growing).

The fit's sums are running sums per (job, rank), updated from each tick's new rows and the rows
leaving the look-back, with t measured from the current tick so they stay well conditioned at
epoch timestamps: a tick costs O(new rows + keys), not O(window). The state is numpy arrays
with one column per key (incremental.KeyIndex numbers the keys; a tick whose keys arrive in the
previous tick's order reuses its numbers): the sums, the oldest and newest sample's values, and
(block mode) a ring of per-block sums. The fit is evaluated over every key with array masks;
only the keys that pass become a small frame and Findings. A rebuild (first call, a missed
tick, another window) reloads the arrays from the window's rows.

The fit's halves: a row enters the early-half sums when it crosses now - min_span_seconds / 2.
The rows still in the late half are held per tick of arrival (index, ts, y) and folded into the
early sums as they cross, so the window is not re-read for them.

With `lookback_blocks` (the default) the look-back is kept as per-block sums (t from each
block's start) and leaves a block at a time: the fit reads the rows from the start of the block
holding now - fit_window_seconds (90 to 95 s back); the window keeps only the late half + slack
for rebuilds. With lookback_blocks 0 rows leave one at a time, read back from the window, which
then keeps the whole look-back (+ 30 s).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field, model_validator

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import covered_jobs, rank_at, settings
from gpuvigil.detectors.incremental import BlockSums, KeyIndex, SlidingRows, resized
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

GIB = float(1 << 30)


class OomConfig(BaseModel):
    fit_window_seconds: float = 90.0
    warmup_seconds: float = 30.0
    min_samples: int = 8
    min_span_seconds: float = 40.0
    min_growth_bytes_per_second: float = 1 << 20
    min_r2: float = 0.8
    predict_horizon_seconds: float = 1800.0
    page_within_seconds: float = 900.0
    safety_margin_bytes: int = 1 << 30
    fragmentation_share: float = 0.5
    # The footprint must rise by at least this much across the fit: a few samples of jitter
    # around a flat peak can fit a line too.
    min_rise_bytes: int = 1 << 29
    # The look-back is kept as this many blocks of fit_window_seconds / lookback_blocks seconds
    # per (job, rank) (incremental.py: block mode): the fit reads the rows from the start of the
    # block holding now - fit_window_seconds, and the window keeps only the rows of the fit's
    # late half (+ block_slack_seconds), not the whole look-back. 0: rows leave one at a time
    # and the window keeps the whole look-back (+ 30 s).
    lookback_blocks: int = Field(18, ge=0)
    block_slack_seconds: float = Field(10.0, ge=1.0)

    @model_validator(mode="after")
    def _halves_inside_look_back(self) -> OomConfig:
        if self.lookback_blocks and self.min_span_seconds / 2 > self.fit_window_seconds:
            raise ValueError("oom: with lookback_blocks, min_span_seconds / 2 must not exceed fit_window_seconds (a block leaving the look-back must lie in the fit's early half)")
        if self.page_within_seconds > self.predict_horizon_seconds:
            raise ValueError("page_within_seconds must not exceed predict_horizon_seconds (a prediction beyond the horizon is never made, so it could never page)")
        return self


# Running sums per (job, rank) (rows of OomPredictor._S), t = ts - now (seconds), y etc. in GiB;
# the e-suffixed ones over the fit's early half only.
SUMS = ["n", "st", "stt", "sy", "sty", "syy", "ne", "ste", "stte", "sye", "stye", "sg", "stg", "sp", "stp", "sf", "stf"]
N, ST, STT, SY, STY, SYY, NE, STE, STTE, SYE, STYE, SG, STG, SP, STP, SF, STF = range(len(SUMS))
EARLY = [NE, STE, STTE, SYE, STYE]
# Per block (block mode): the sums with t measured from the block's start, not from now, then
# the block's oldest row's ts and retries (NaN: the key has no row in the block).
BLOCK_SUMS = ["n", "st", "stt", "sy", "sty", "syy", "sg", "stg", "sp", "stp", "sf", "stf"]
B_TS, B_RETRIES = len(BLOCK_SUMS), len(BLOCK_SUMS) + 1
# The oldest sample's ts and retries, the newest's ts and values (oldest/newest by ts; ties: the
# first/last to arrive); NaN: no sample (or a null value).
EDGES = ["ts_first", "retries_first", "ts_last", "y_last", "gap_last", "foreign_last", "retries_last"]
TS_FIRST, R_FIRST, TS_LAST, Y_LAST, GAP_LAST, F_LAST, R_LAST = range(len(EDGES))
NO_INT = np.iinfo(np.int64).min  # a null capacity or gpu


def _nullable(s: pl.Series) -> np.ndarray:
    """A numeric column as float64, null -> NaN (bytes stay exact below 2**53)."""
    return s.to_numpy().astype(np.float64, copy=False)


def _int_or_null(s: pl.Series) -> np.ndarray:
    return s.fill_null(NO_INT).cast(pl.Int64).to_numpy() if s.null_count() else s.cast(pl.Int64).to_numpy()


class _Rows:
    """What the fit reads of some rows of allocator_stats (independent of `now`), as arrays."""

    def __init__(self, df: pl.DataFrame):
        self.ts = _nullable(df["ts"])
        reserved, peak = _nullable(df["reserved_bytes"]), _nullable(df["peak_allocated_bytes"])
        foreign = np.nan_to_num(_nullable(df["foreign_used_bytes"]), nan=0.0)
        # What runs out is the device: our per-step peak footprint plus other processes (fmax:
        # one of reserved / peak null reads the other, as max_horizontal).
        self.y = (np.fmax(reserved, peak) + foreign) / GIB
        self.gap = (reserved - peak) / GIB
        self.peak = peak / GIB
        self.foreign = foreign / GIB
        self.retries = np.nan_to_num(_nullable(df["alloc_retries"]), nan=0.0)
        self.capacity = _int_or_null(df["device_capacity_bytes"])
        self.gpu = _int_or_null(df["gpu"])
        # What the sums add: a null value adds nothing (polars' sum skips nulls).
        if df["reserved_bytes"].null_count() or df["peak_allocated_bytes"].null_count():
            self.y0, self.gap0, self.peak0 = (np.nan_to_num(v, nan=0.0) for v in (self.y, self.gap, self.peak))
        else:
            self.y0, self.gap0, self.peak0 = self.y, self.gap, self.peak

    def take(self, m: np.ndarray) -> None:
        for k, v in vars(self).items():
            setattr(self, k, v[m])


def _add(a: np.ndarray, idx: np.ndarray, terms: list[np.ndarray], run: slice | None, sign: float = 1.0) -> None:
    """a[j, k] += sign * the sum of terms[j] over the rows whose idx is k. `run`: idx is that
    slice (each key once, in order: a plain add, the common case of a tick's rows)."""
    for j, v in enumerate(terms):
        if run is not None:
            if sign == 1.0:
                a[j, run] += v
            else:
                a[j, run] -= v
            continue
        s = np.bincount(idx, v, minlength=a.shape[1])
        if sign == 1.0:
            a[j] += s
        else:
            a[j] -= s


def _sum_terms(t: np.ndarray, early: np.ndarray, r: _Rows) -> list[np.ndarray]:
    """Each row's contribution to SUMS (t = ts - now; `early`: in the fit's early half)."""
    y, g, p, f = r.y0, r.gap0, r.peak0, r.foreign
    e = early.astype(np.float64)
    et = e * t
    return [np.ones_like(t), t, t * t, y, t * y, y * y, e, et, et * t, e * y, et * y, g, t * g, p, t * p, f, t * f]


def _expand(chunk: tuple[np.ndarray | slice, np.ndarray | np.float64, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk of late rows with its key numbers and ts as one array each."""
    idx, ts, y = chunk
    if isinstance(idx, slice):
        idx = np.arange(idx.start, idx.stop)
    if np.ndim(ts) == 0:
        ts = np.full(y.size, ts)
    return idx, ts, y


def _ends(idx: np.ndarray, ts: np.ndarray, unique: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key of `idx`: the key, its oldest row (ties: the first to arrive) and newest
    (ties: the last to arrive)."""
    if unique:
        return idx, np.arange(idx.size), np.arange(idx.size)
    order = np.lexsort((ts, idx))  # stable: equal (key, ts) keep arrival order
    ks = idx[order]
    start = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
    end = np.r_[start[1:], ks.size] - 1
    return ks[start], order[start], order[end]


def _slope(n: np.ndarray, st: np.ndarray, stt: np.ndarray, sy: np.ndarray, sty: np.ndarray) -> np.ndarray:
    """The least-squares slope from running sums (NaN: no fit)."""
    den = n * stt - st * st
    # Fewer than 3 samples (e.g. a half with no data) is no fit: NaN fails every test.
    ok = (n >= 3) & (den > 0)
    return np.where(ok, (n * sty - st * sy) / np.where(ok, den, 1.0), np.nan)


class OomPredictor(Declared):
    spec = DetectorSpec(
        name="oom",
        config=OomConfig,
        emits=(FindingKind.OOM_PREDICTED,),
        reads={"allocator_stats": HISTORY, "jobs": HISTORY},
        order=40,
        level="L2",
        capability="oom",
        streams=("allocator_stats",),
        every_seconds=5.0,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("oom", OomConfig, cfg)
        c = self.config
        # Used for its current-run filter, rebuild rows and first-row band lookup (lookback_blocks
        # 0); the stepping itself is this class's (_sync), which does not need the window's old rows.
        self._rows = SlidingRows("allocator_stats", c.fit_window_seconds, c.warmup_seconds, blocks=c.lookback_blocks, reach=c.min_span_seconds / 2)
        self._half = -c.min_span_seconds / 2
        self._window: Window | None = None
        self._seq = -1
        self._now = 0.0
        self._starts: pl.DataFrame | None = None
        self._jobs_seen: tuple[pl.DataFrame, pl.DataFrame] | None = None  # the jobs snapshot last read, its starts
        self._reset()

    # -- state --------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._keys = KeyIndex({"job": pl.Utf8(), "rank": pl.Int32()})
        self._jobs = KeyIndex({"job": pl.Utf8()})
        self._nodes = KeyIndex({"node": pl.Utf8()})
        self._cap = 0
        self._job_numbered = 0  # keys whose job number is filled in
        self._indexed: tuple[pl.DataFrame, tuple[np.ndarray, bool, slice | None]] | None = None  # the last frame indexed
        self._S = np.zeros((len(SUMS), 0))
        self._E = np.zeros((len(EDGES), 0))
        self._capacity = np.zeros(0, np.int64)
        self._node = np.zeros(0, np.int64)
        self._gpu = np.zeros(0, np.int64)
        self._job = np.zeros(0, np.int64)  # the job number (self._jobs) of each key
        self._live = np.zeros(0, bool)
        self._start_of_job = np.zeros(0)  # NaN: no start known (every row counts)
        # Block mode: per block, its sums (tau from the block's start), oldest ts and oldest retries.
        self._blocks = BlockSums(len(BLOCK_SUMS), 2) if self._rows.B > 0 else None
        # Rows still in the fit's late half, per tick of arrival: key numbers (or their slice),
        # ts (or the one ts they share), y (null: NaN).
        self._late: list[tuple[np.ndarray | slice, np.ndarray | np.float64, np.ndarray]] = []

    def _grow(self) -> None:
        """Room for every numbered key (1/8 headroom), new keys empty."""
        n = self._keys.n
        if n > self._cap:
            cap = max(n + n // 8, 64)
            self._S, self._E = resized(self._S, cap, 0.0, axis=-1), resized(self._E, cap, np.nan, axis=-1)
            self._capacity, self._node, self._gpu, self._job = resized(self._capacity, cap, NO_INT), resized(self._node, cap, 0), resized(self._gpu, cap, NO_INT), resized(self._job, cap, 0)
            self._live = resized(self._live, cap, False)
            self._cap = cap
        if self._blocks is not None:
            self._blocks.pad(n)
        if self._job_numbered < n:
            new = self._keys.table.slice(self._job_numbered)
            self._job[self._job_numbered : n] = self._jobs.index(new.select("job"))
            self._job_numbered = n
        if self._start_of_job.size < self._jobs.n:
            self._start_of_job = np.concatenate([self._start_of_job, np.full(self._jobs.n - self._start_of_job.size, np.nan)])

    def _index(self, df: pl.DataFrame) -> tuple[np.ndarray, bool, slice | None]:
        """Key numbers of df's rows, whether each key appears once, and the slice they form if any."""
        if self._indexed is not None and self._indexed[0] is df:
            return self._indexed[1]
        idx = self._keys.index(df.select("job", "rank"))
        out = (idx, self._keys.unique, self._keys.run)
        self._grow()
        self._indexed = (df, out)
        return out

    def _set_starts(self, starts: pl.DataFrame) -> None:
        codes = self._jobs.index(starts.select("job"))
        self._grow()
        self._start_of_job = np.full(self._jobs.n, np.nan)
        self._start_of_job[codes] = starts["_start"].to_numpy()

    def _forget(self, keys: np.ndarray) -> None:
        """Keys (numbers) with no row left, or about to be reloaded: empty their state."""
        self._S[:, keys] = 0.0
        self._E[:, keys] = np.nan
        self._live[keys] = False

    def _compact(self) -> None:
        """Drop the numbers of keys with no rows (finished jobs) once they outnumber the live ones."""
        n = self._keys.n
        live = self._live[:n]
        alive = int(live.sum())
        if n - alive <= max(1024, alive):
            return
        remap = self._keys.keep(live)
        self._indexed = None
        self._S, self._E = self._S[:, :n][:, live], self._E[:, :n][:, live]
        self._capacity, self._node, self._gpu, self._job = self._capacity[:n][live], self._node[:n][live], self._gpu[:n][live], self._job[:n][live]
        self._live = self._live[:n][live]
        self._cap = alive
        self._job_numbered = alive
        if self._blocks is not None:
            self._blocks.keep(live)
        self._late = [(remap[i], t, y) for i, t, y in self._late]  # a slice's numbers become an array
        self._grow()

    # -- folding rows in ----------------------------------------------------------------------
    def _fold(self, df: pl.DataFrame, now: float, mask: np.ndarray | None = None) -> None:
        """Add rows (of the look-back, current run) to every sum, edge, block and the late rows."""
        if df.height == 0:
            return
        idx, unique, run = self._index(df)
        r = _Rows(df)
        node = self._nodes.index(df.select("node"))
        if mask is not None and not mask.all():
            idx, node, run = idx[mask], node[mask], None
            r.take(mask)
        if idx.size == 0:
            return
        ts, y, g, f = r.ts, r.y, r.gap, r.foreign
        t = ts - now
        early = t < self._half
        _add(self._S, idx, _sum_terms(t, early, r), run)
        self._live[idx if run is None else run] = True
        # Oldest / newest sample.
        keys, first, last = _ends(idx, ts, unique)
        E = self._E
        later = np.isnan(E[TS_LAST, keys]) | (ts[last] >= E[TS_LAST, keys])
        k, j = keys[later], last[later]
        E[TS_LAST, k], E[Y_LAST, k], E[GAP_LAST, k], E[F_LAST, k], E[R_LAST, k] = ts[j], y[j], g[j], f[j], r.retries[j]
        self._capacity[k], self._node[k], self._gpu[k] = r.capacity[j], node[j], r.gpu[j]
        earlier = np.isnan(E[TS_FIRST, keys]) | (ts[first] < E[TS_FIRST, keys])
        k, j = keys[earlier], first[earlier]
        E[TS_FIRST, k], E[R_FIRST, k] = ts[j], r.retries[j]
        if self._rows.B > 0:
            self._fold_blocks(idx, ts, r, unique, run)
        late = ~early
        if late.any():
            every = bool(late.all())
            i = run if every and run is not None else idx[late]
            t_late = ts[late]
            # A tick's rows usually share one ts and their keys' run of numbers: then the chunk
            # holds only y (the fleet's 1 Hz rows of the late half are most of this state).
            t_one = t_late[0] if t_late.min() == t_late.max() else None
            self._late.append((i, t_late if t_one is None else np.float64(t_one), y[late]))

    def _fold_blocks(self, idx: np.ndarray, ts: np.ndarray, r: _Rows, unique: bool, run: slice | None) -> None:
        B = self._rows.B
        blk = np.floor(ts / B).astype(np.int64)
        lo, hi = int(blk.min()), int(blk.max())
        for k in range(lo, hi + 1) if hi - lo < 64 else np.unique(blk).tolist():
            m = None if lo == hi else blk == k
            if m is not None and not m.any():
                continue
            i, t0 = (idx, ts) if m is None else (idx[m], ts[m])
            y, g, p, f, rt = (r.y0, r.gap0, r.peak0, r.foreign, r.retries) if m is None else (r.y0[m], r.gap0[m], r.peak0[m], r.foreign[m], r.retries[m])
            tau = t0 - float(k) * B
            a = self._blocks.at(k, self._keys.n)
            one = np.ones_like(tau)
            _add(a, i, [one, tau, tau * tau, y, tau * y, y * y, g, tau * g, p, tau * p, f, tau * f], run if m is None else None)
            keys, first, _ = _ends(i, t0, unique)
            older = np.isnan(a[B_TS, keys]) | (t0[first] < a[B_TS, keys])
            kk, j = keys[older], first[older]
            a[B_TS, kk], a[B_RETRIES, kk] = t0[j], rt[j]

    # -- per tick -----------------------------------------------------------------------------
    def _sync(self, window: Window) -> tuple[str, float, list[str]]:
        """'same' (this tick again), 'step' (the next tick of the same window, close enough that
        what left the look-back can be subtracted) or 'rebuild'; for a step, the jobs whose
        start changed (SlidingRows.sync's rule)."""
        now = window.now
        seq = getattr(window, "seq", None)
        if window is self._window and seq == self._seq:
            return "same", now, []
        jobs = window.get("jobs")
        if self._jobs_seen is not None and self._jobs_seen[0] is jobs:
            starts = self._jobs_seen[1]
        else:
            starts = SlidingRows.starts(window)
            self._jobs_seen = (jobs, starts)
        horizon = window.horizon(self._rows.stream)
        stepping = (
            window is self._window
            and seq is not None
            and seq == self._seq + 1
            and now > self._now
            and now - self._now <= horizon - (self._rows.reach if self._rows.B > 0 else self._rows.W)
        )
        prev_starts = self._starts
        self._window, self._seq, self._now, self._starts = window, seq if seq is not None else -1, now, starts
        if not stepping:
            return "rebuild", now, []
        changed: list[str] = []
        appeared: list[str] = []
        if prev_starts is not None and prev_starts is not starts and (prev_starts.height or starts.height) and not prev_starts.equals(starts):
            both = prev_starts.join(starts, on="job", how="full", coalesce=True, suffix="_new")
            moved = both.filter(pl.col("_start").ne_missing(pl.col("_start_new")))
            changed = moved.filter(pl.col("_start").is_not_null())["job"].to_list()
            appeared = moved.filter(pl.col("_start").is_null())["job"].to_list()
            self._set_starts(starts)
        if appeared:
            # A new start for a job already holding rows: its warm-up rows must go (rebuild).
            codes = self._jobs.index(pl.DataFrame({"job": appeared}, schema={"job": pl.Utf8}))
            self._grow()
            held = np.isin(codes, self._job[: self._keys.n][self._live[: self._keys.n]])
            changed += [j for j, h in zip(appeared, held, strict=True) if h]
        return "step", now, changed

    def ingest(self, window: Window) -> None:
        """Fold this tick's rows into the running sums (called on ticks the fit is not due)."""
        prev_now = self._now
        mode, now, redo = self._sync(window)
        if mode == "same":
            return
        if mode == "rebuild":
            self._reset()
            assert self._starts is not None
            self._set_starts(self._starts)
            self._fold(self._rows.rows_for_rebuild(window), now)
            self._compact()
            return
        self._step(window, now, prev_now)
        if redo:
            self._rebuild_jobs(window, now, redo)
        self._compact()

    def _step(self, window: Window, now: float, prev_now: float) -> None:
        rows = self._rows
        d = now - prev_now
        S = self._S
        n, st, ne, ste = S[N], S[ST], S[NE], S[STE]
        # Move t's origin from the previous tick's now to this one's.
        S[STT] = S[STT] - 2 * d * st + n * d * d
        S[ST] = st - n * d
        S[STY] -= d * S[SY]
        S[STTE] = S[STTE] - 2 * d * ste + ne * d * d
        S[STE] = ste - ne * d
        S[STYE] -= d * S[SYE]
        S[STG] -= d * S[SG]
        S[STP] -= d * S[SP]
        S[STF] -= d * S[SF]
        lo_block = rows.lo_block(now)
        self._cross(now, lo_block)
        fresh = window.fresh(rows.stream)
        if fresh.height:
            self._fold(fresh, now, self._included(fresh, now))
        lost = np.zeros(self._keys.n, bool)
        if rows.B > 0:
            self._evict(now, lo_block, lost)
        else:
            self._leave(window, now, prev_now, lost)
        n_keys = self._keys.n
        dead = self._live[:n_keys] & (self._S[N, :n_keys] <= 0.5)
        if dead.any():
            self._forget(np.flatnonzero(dead))
        lost &= self._live[:n_keys]
        if lost.any():
            self._refresh_first(window, np.flatnonzero(lost))

    def _included(self, df: pl.DataFrame, now: float) -> np.ndarray:
        """Rows a fit at `now` reads (SlidingRows.included, over arrays)."""
        ts = _nullable(df["ts"])
        rows = self._rows
        with np.errstate(invalid="ignore"):
            if rows.B > 0:
                ok = ~np.isnan(ts)
                ok[ok] = np.floor(ts[ok] / rows.B).astype(np.int64) >= rows.lo_block(now)
            else:
                ok = ts >= now - rows.W
        if self._starts is not None and self._starts.height:
            idx, _, run = self._index(df)
            start = self._start_of_job[self._job[idx if run is None else run]]
            ok &= np.isnan(start) | (ts >= start + rows.warmup)
        return ok

    def _cross(self, now: float, lo_block: int) -> None:
        """Late rows that crossed into the early half join the early sums; rows gone from the
        look-back (a block evicted, or below now - W) stop being tracked."""
        half, rows = self._half, self._rows
        kept: list[tuple[np.ndarray | slice, np.ndarray | np.float64, np.ndarray]] = []
        for chunk in self._late:
            if chunk[2].size == 0:
                continue
            t_min = chunk[1].min()
            if (t_min - now) >= half and (np.floor(t_min / rows.B) >= lo_block if rows.B > 0 else t_min >= now - rows.W):
                kept.append(chunk)  # nothing crosses or leaves
                continue
            if np.ndim(chunk[1]) == 0 and (t_min - now) < half:  # one ts: the whole chunk crosses
                t = np.full(chunk[2].size, t_min - now)
                yy = np.nan_to_num(chunk[2], nan=0.0)
                self._add_early(chunk[0], [np.ones_like(t), t, t * t, yy, t * yy])
                continue
            idx, ts, y = _expand(chunk)
            moving = (ts - now) < half
            if moving.any():
                i, t = (idx, ts - now) if moving.all() else (idx[moving], ts[moving] - now)
                yy = y if moving.all() else y[moving]
                yy = np.nan_to_num(yy, nan=0.0)
                self._add_early(i, [np.ones_like(t), t, t * t, yy, t * yy])
                idx, ts, y = idx[~moving], ts[~moving], y[~moving]
            if idx.size:
                gone = (np.floor(ts / rows.B).astype(np.int64) < lo_block) if rows.B > 0 else (ts < now - rows.W)
                if gone.any():
                    idx, ts, y = idx[~gone], ts[~gone], y[~gone]
            if idx.size:
                kept.append((idx, ts, y))
        self._late = kept

    def _add_early(self, idx: np.ndarray | slice, terms: list[np.ndarray]) -> None:
        if isinstance(idx, slice):
            for j, row in enumerate(EARLY):
                self._S[row, idx] += terms[j]
            return
        for j, row in enumerate(EARLY):
            self._S[row] += np.bincount(idx, terms[j], minlength=self._S.shape[1])

    def _evict(self, now: float, lo_block: int, lost: np.ndarray) -> None:
        """Subtract whole blocks leaving the look-back, t moved from each block's start to now
        (t = tau + d, d = start - now). Every row of such a block is older than now - W, so in
        the fit's early half (config check): the early sums lose the same amounts."""
        S = self._S
        for k, a in self._blocks.leaving(lo_block):
            w = a.shape[1]
            d = float(k) * self._rows.B - now
            n, st, stt, sy, sty, syy, sg, stg, sp, stp, sf, stf = a[: len(BLOCK_SUMS)]
            t1 = st + n * d
            t2 = stt + 2 * d * st + n * d * d
            ty = sty + d * sy
            for row, v in ((N, n), (ST, t1), (STT, t2), (SY, sy), (STY, ty), (SYY, syy), (NE, n), (STE, t1), (STTE, t2), (SYE, sy), (STYE, ty),
                           (SG, sg), (STG, stg + d * sg), (SP, sp), (STP, stp + d * sp), (SF, sf), (STF, stf + d * sf)):  # fmt: skip
                S[row, :w] -= v
            lost[:w] |= ~np.isnan(a[B_TS])

    def _leave(self, window: Window, now: float, prev_now: float, lost: np.ndarray) -> None:
        """lookback_blocks 0: rows that fell below now - W, read back from the window."""
        rows = self._rows
        df = window.get(rows.stream)
        fresh = window.fresh(rows.stream)
        # The window is the previous rows followed by this tick's (those not past the horizon).
        kept_fresh = fresh.filter(pl.col("ts") >= now - window.horizon(rows.stream)).height if fresh.height else 0
        old = df.head(df.height - kept_fresh) if kept_fresh else df
        starts = self._starts if self._starts is not None else rows.starts(window)
        leaving = rows.current(old.filter((pl.col("ts") >= prev_now - rows.W) & (pl.col("ts") < now - rows.W)), starts)
        if leaving.height == 0:
            return
        idx, _, run = self._index(leaving)
        r = _Rows(leaving)
        t = r.ts - now
        _add(self._S, idx, _sum_terms(t, t < self._half, r), run, sign=-1.0)
        lost[idx] = True

    def _refresh_first(self, window: Window, keys: np.ndarray) -> None:
        """Keys that lost their oldest rows take the next oldest: from their oldest block left,
        or (lookback_blocks 0) from a band of the window just above now - W."""
        E = self._E
        if self._rows.B > 0:
            todo = keys
            for a in self._blocks.oldest_first():
                if todo.size == 0:
                    break
                inside = todo[todo < a.shape[1]]
                has = ~np.isnan(a[B_TS, inside])
                got = inside[has]
                E[TS_FIRST, got], E[R_FIRST, got] = a[B_TS, got], a[B_RETRIES, got]
                todo = np.setdiff1d(todo, got, assume_unique=True)
            return
        lost = self._keys.table[keys].select("job", "rank")
        first = self._rows.first_rows(window, lost, {"retries": pl.col("alloc_retries").fill_null(0).cast(pl.Float64)})
        if first.height:
            idx = self._keys.index(first.select("job", "rank"))
            E[TS_FIRST, idx] = first["_f_ts"].to_numpy()
            E[R_FIRST, idx] = first["_f_retries"].to_numpy()

    def _rebuild_jobs(self, window: Window, now: float, jobs: list[str]) -> None:
        """Jobs whose start moved (requeued), vanished, or appeared while holding rows: reload
        their keys from the window alone."""
        codes = self._jobs.index(pl.DataFrame({"job": jobs}, schema={"job": pl.Utf8}))
        self._grow()
        n = self._keys.n
        keys = np.isin(self._job[:n], codes)
        self._forget(np.flatnonzero(keys))
        if self._blocks is not None:
            self._blocks.clear(keys)
        self._late = [(i[~keys[i]], t[~keys[i]], y[~keys[i]]) for i, t, y in map(_expand, self._late)]
        self._fold(self._rows.rows_for_rebuild(window, jobs), now)

    # -- the fit ------------------------------------------------------------------------------
    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        # Jobs whose hook rows come often enough for this fit (min_samples over the fit window):
        # the device's OOM detector, running beside this one, is held back for them.
        self.healthy_jobs = covered_jobs(window.get("allocator_stats"), now, c.fit_window_seconds / 2, (c.min_samples + 1) / 2)
        self.ingest(window)
        keys = np.flatnonzero(self._live[: self._keys.n])
        if keys.size == 0:
            return []
        fit = self._fit(keys, now)
        if not fit["ok"].any():
            return []
        fits = self._hits(keys, fit)
        return [self._finding(rows, now) for rows in fits.partition_by("job", maintain_order=True)]

    def _fit(self, keys: np.ndarray, now: float) -> dict[str, np.ndarray]:
        """Least squares from running sums (O(new rows) per tick, see ingest): y in GiB keeps the
        sums of squares well conditioned. The window's two halves are fitted too: growth must
        hold in both the last min_span/2 seconds and before them (a one-off step, warm-up or a
        new phase of training, is not a trend). NaN stands for the polars fit's null (no fit).
        Returns the keys' sums and edges (S, E), the fit's terms and `ok`: the keys that warn."""
        c = self.config
        n_keys = self._keys.n
        every = keys.size == n_keys  # then views, not copies
        S = self._S[:, :n_keys] if every else self._S[:, keys]
        E = self._E[:, :n_keys] if every else self._E[:, keys]
        n, st, stt, sy, sty, syy = S[N], S[ST], S[STT], S[SY], S[STY], S[SYY]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            span = (E[TS_LAST] - now) - (E[TS_FIRST] - now)
            growth = _slope(n, st, stt, sy, sty) * GIB
            early = _slope(S[NE], S[STE], S[STTE], S[SYE], S[STYE]) * GIB
            late = _slope(n - S[NE], st - S[STE], stt - S[STTE], sy - S[SYE], sty - S[STYE]) * GIB
            sxy = n * sty - st * sy
            syd = n * syy - sy * sy
            r2 = np.where(syd > 0, sxy * sxy / ((n * stt - st * st) * syd), np.nan)
            footprint = E[Y_LAST] * GIB
            capacity = self._capacity[:n_keys] if every else self._capacity[keys]
            headroom = np.where(capacity == NO_INT, np.nan, (capacity - c.safety_margin_bytes).astype(np.float64) - footprint)
            tto = headroom / growth
            g = c.min_growth_bytes_per_second
            ok = (
                (n >= c.min_samples)
                & (span >= c.min_span_seconds)
                & (growth >= g)
                & (early >= g / 2)
                & (late >= g / 2)
                & (r2 >= c.min_r2)
                & (growth * span >= c.min_rise_bytes)
                & (tto <= c.predict_horizon_seconds)
            )
        return {"S": S, "E": E, "growth": growth, "r2": r2, "footprint": footprint, "capacity": capacity, "headroom": headroom, "tto": tto, "ok": ok}

    def _hits(self, keys: np.ndarray, fit: dict[str, np.ndarray]) -> pl.DataFrame:
        """The keys that warn, one row each with what the finding says, soonest OOM first."""
        hit = np.flatnonzero(fit["ok"])
        k = keys[hit]
        Sk, E = fit["S"][:, hit], fit["E"]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            gap_slope = _slope(Sk[N], Sk[ST], Sk[STT], Sk[SG], Sk[STG]) * GIB
            peak_slope = _slope(Sk[N], Sk[ST], Sk[STT], Sk[SP], Sk[STP]) * GIB
            foreign_slope = _slope(Sk[N], Sk[ST], Sk[STT], Sk[SF], Sk[STF]) * GIB
        gpu = self._gpu[k]
        return (
            self._keys.table[k]
            .select("job", "rank")
            .with_columns(
                pl.Series("tto", fit["tto"][hit]),
                pl.Series("slope", fit["growth"][hit]),
                pl.Series("gap_slope", gap_slope),
                pl.Series("peak_slope", peak_slope),
                pl.Series("foreign_slope", foreign_slope),
                pl.Series("r2", fit["r2"][hit]),
                pl.Series("gap", E[GAP_LAST, hit] * GIB),
                pl.Series("footprint", fit["footprint"][hit]),
                pl.Series("headroom", fit["headroom"][hit]),
                pl.Series("capacity", fit["capacity"][hit]),
                pl.Series("retries_delta", E[R_LAST, hit] - E[R_FIRST, hit]),
                self._nodes.table["node"].gather(self._node[k]).alias("node"),
                pl.Series("gpu", [None if v == NO_INT else int(v) for v in gpu], dtype=pl.Int32),
            )
            .sort(["tto", "job", "rank"])  # job, rank break ties: same input, same finding
        )

    def _finding(self, rows: pl.DataFrame, now: float) -> Finding:
        """One job's finding, from its ranks that warn (soonest first)."""
        c = self.config
        worst = rows.row(0, named=True)
        if worst["foreign_slope"] >= c.fragmentation_share * worst["slope"]:
            cause, what = "foreign_process", "another process on the GPU is taking memory"
        elif worst["gap_slope"] >= c.fragmentation_share * worst["slope"] or worst["retries_delta"] > 0 and worst["gap_slope"] > worst["peak_slope"]:
            cause, what = "fragmentation", "the caching allocator is fragmenting (reserved but unallocated memory keeps growing)"
        else:
            cause, what = "leak", "allocated memory grows every step (a leak or growing activations)"
        tto = float(worst["tto"])
        return Finding(
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
                # (null when the newest sample had no reserved reading: the footprint then is the peak)
                "reserved_unallocated_bytes": None if worst["gap"] is None or math.isnan(worst["gap"]) else int(worst["gap"]),
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

    def lookback_seconds(self) -> dict[str, float]:
        """History of allocator_stats read from the window (pipeline/core.py: declared_horizons).

        Block mode: the fit's late half (min_span_seconds / 2: a rebuild reloads the late rows
        from the window) plus block_slack_seconds, the longest gap between two ticks that still
        steps (else it rebuilds from what the window holds). Otherwise the fit's look-back plus
        30 s in which rows leaving it can still be subtracted."""
        c = self.config
        if c.lookback_blocks:
            return {"allocator_stats": c.min_span_seconds / 2 + c.block_slack_seconds}
        return {"allocator_stats": c.fit_window_seconds + 30.0}

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        """Columns of allocator_stats' history it reads (`_Rows`; pipeline/core.py: declared_columns)."""
        return {"allocator_stats": ("ts", "job", "rank", "node", "gpu", "device_capacity_bytes", "reserved_bytes", "peak_allocated_bytes", "foreign_used_bytes", "alloc_retries")}
