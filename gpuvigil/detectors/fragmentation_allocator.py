"""Allocator-level fragmentation: a rank's caching allocator holds memory it cannot use.

Signature of fragmentation in PyTorch's caching allocator, per rank, all from `allocator_stats`:
- reserved − per-step peak allocated (memory held but never used at the peak) is large and
  rising,
- most of it sits in inactive split blocks (slivers left by splitting large segments),
- the allocator had to free its cache and retry cudaMalloc (alloc retries rising), and
- the largest free block is smaller than the step's recurring request (peak − live memory), so
  the next large allocation cannot be served from the cache.
It is a ticket (it costs memory and time, and is cured by `expandable_segments:True`); the OOM
predictor pages when it is heading for an OOM.

State, per (job, rank), in numpy arrays indexed by a key number (`_Keys`: incremental.KeyIndex
numbers of (job, rank), node and job, one polars join each, skipped when the tick's key columns
equal the previous tick's): the sample count of its look-back, its oldest sample (ts, gap,
retries) and its newest (ts, gap, split, retries, largest free block, capacity, node, gpu),
oldest and newest by ts (ties: the earlier / the later arrival). Byte values are int64 with a
validity mask each (exact, and a null fails every threshold as polars' null does). A tick folds
in its fresh rows only (O(new rows) plus a few vectorised passes over the keys); an evaluation
is a mask over all keys, and Finding objects are built for the keys that pass alone.

With `lookback_blocks` (the default) the look-back starts at the start of the block of
B = window_seconds / lookback_blocks seconds holding now - window_seconds, and each key's rows are
also kept per block: count, oldest sample and the max of the step's request, in a ring of
(blocks, keys) arrays indexed by block number modulo the ring's length (incremental.BlockRing). A whole block leaves at
once (its counts are subtracted; a key that lost its oldest block takes the oldest sample of its
next one), so the window keeps only `block_slack_seconds` of rows. With lookback_blocks = 0 rows
leave one at a time: they are read from the window (which keeps the look-back + 30 s), as is
the step's request of the ranks found.

Whatever the detector cannot prove it saw tick by tick (another window, a missed tick, time
going back, a jump past the window's horizon) is rebuilt from the window's rows (`_build`, in
polars) and loaded into the arrays; a job whose start changed (requeued, gone from the
scheduler's snapshot, or newly given one while holding rows) is rebuilt alone. The rules are
those of incremental.SlidingRows; the tests compare it with a from-scratch refit over the rows
those rules say it was shown (tests/incremental_oracles.py: Shown).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import rank_at, settings
from gpuvigil.detectors.incremental import KEYS, BlockRing, KeyIndex, SlidingRows, edges_from_rows, resized
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

GIB = float(1 << 30)
STREAM = "allocator_stats"
_MIN = np.iinfo(np.int64).min


class FragmentationAllocatorConfig(BaseModel):
    window_seconds: float = 120.0
    warmup_seconds: float = 30.0
    min_samples: int = 8
    min_gap_bytes: int = 4 << 30  # held-but-unused memory worth a ticket
    min_gap_share: float = 0.05  # ... and at least this share of the device
    min_inactive_split_share: float = 0.5
    min_retries: int = 1
    every_seconds: float = 5.0  # a trend over minutes: evaluating it every tick buys nothing
    # The look-back is kept as this many blocks of window_seconds / lookback_blocks seconds per
    # (job, rank): count, oldest sample, the step's largest request (block mode); the window
    # keeps only block_slack_seconds of rows. 0: rows leave one at a time and the window keeps
    # the whole look-back (+ 30 s).
    lookback_blocks: int = Field(24, ge=0)
    block_slack_seconds: float = Field(10.0, ge=1.0)


# Per (job, rank): the oldest sample's gap and retries, the newest sample's values (by ts).
FIRST = ["gap", "retries"]
# Per (job, rank) and block (block mode): count, oldest sample (ts, gap, retries), the max of the
# step's request, each int64 with its validity.
RING_FIELDS: dict[str, tuple[type, float | int | bool]] = {
    "n": (np.int32, 0),
    "ts": (np.float64, 0.0),
    **{name: (np.int64, 0) for name in ("gap", "retries", "req")},
    **{f"{name}_ok": (np.bool_, False) for name in ("gap", "retries", "req")},
}
LAST = ["gap", "split", "retries", "largest_free", "capacity", "node", "gpu"]


def _values(df: pl.DataFrame) -> pl.DataFrame:
    return df.select(
        "job",
        "rank",
        "ts",
        (pl.col("reserved_bytes") - pl.col("peak_allocated_bytes")).alias("gap"),
        pl.col("inactive_split_bytes").alias("split"),
        pl.col("alloc_retries").alias("retries"),
        pl.col("largest_free_block_bytes").alias("largest_free"),
        pl.col("device_capacity_bytes").alias("capacity"),
        "node",
        "gpu",
    )


def _build(v: pl.DataFrame) -> pl.DataFrame:
    """Per key: count and oldest/newest values of `v` (= _values(rows)): the rebuild, loaded
    into the arrays by `_load`."""
    counts = v.group_by(KEYS).agg(pl.len().cast(pl.Int64).alias("n"))
    return counts.join(edges_from_rows(v, FIRST, LAST), on=KEYS)


def _ints(s: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """int64 values (0 where null) and validity."""
    if s.dtype != pl.Int64:
        s = s.cast(pl.Int64)
    if s.null_count():
        return s.fill_null(0).to_numpy(), s.is_not_null().to_numpy()
    return s.to_numpy(), np.ones(s.len(), bool)


class _Keys:
    """(job, rank) -> key number, each row's node -> a node number, and each key's job number,
    all incremental.KeyIndex numbers. A tick's fresh rows usually carry the same keys in the same
    order as the previous tick's: then the previous answer is reused (no join)."""

    def __init__(self) -> None:
        self.pairs = KeyIndex({"job": pl.Utf8(), "rank": pl.Int64()})
        self.node_index = KeyIndex({"node": pl.Utf8()})
        self.job_index = KeyIndex({"job": pl.Utf8()})
        self.job_of = np.zeros(0, np.int64)  # key number -> job number

    @property
    def n(self) -> int:
        return self.pairs.n

    @property
    def jobs(self) -> pl.Series:
        """Job number -> name."""
        return self.job_index.table["job"]

    def names(self, ks: np.ndarray) -> tuple[list[Any], list[Any]]:
        """The jobs and ranks of key numbers `ks`."""
        t = self.pairs.table[ks]
        return t["job"].to_list(), t["rank"].to_list()

    def nodes(self, ns: np.ndarray) -> list[Any]:
        """The names of node numbers `ns`."""
        return self.node_index.table["node"].gather(ns).to_list()

    def job_numbers(self, jobs: list[Any]) -> np.ndarray:
        """The number of each job (-1: none of its rows were seen)."""
        got = pl.DataFrame({"job": jobs}, schema={"job": pl.Utf8}).join(self.job_index.table, on="job", how="left", maintain_order="left", nulls_equal=True)
        return got["_k"].fill_null(-1).to_numpy()

    def index(self, job: pl.Series, rank: pl.Series, node: pl.Series, cache: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Key number and node number of each row; `cache`: a tick's fresh rows (compared with
        the previous fresh rows next time)."""
        have = self.pairs.n
        k = self.pairs.index(pl.DataFrame([job.cast(pl.Utf8).alias("job"), rank.cast(pl.Int64).alias("rank")]), shape=cache, cache=cache)
        ni = self.node_index.index(pl.DataFrame([node.cast(pl.Utf8).alias("node")]), shape=cache, cache=cache)
        if self.pairs.n > have:
            jn = self.job_index.index(self.pairs.table.slice(have).select("job"), shape=False, cache=False)
            if self.job_of.size < self.pairs.n:
                self.job_of = resized(self.job_of, max(self.pairs.n, 2 * self.job_of.size, 64), 0)
            self.job_of[have : self.pairs.n] = jn
        return k, ni

    def keep(self, live: np.ndarray) -> np.ndarray:
        """Renumber: only keys `live` (ascending) stay, as 0..len-1; returns old -> new (-1 gone)."""
        mask = np.zeros(self.n, bool)
        mask[live] = True
        self.job_of = self.job_of[live].copy()
        return self.pairs.keep(mask)


class _Rows:
    """A frame's rows as numpy columns (what the state keeps of them)."""

    def __init__(self, df: pl.DataFrame, keys: _Keys, with_request: bool, cache: bool = False):
        self.k, self.node = keys.index(df["job"], df["rank"], df["node"], cache)
        self.ts = df["ts"].cast(pl.Float64).to_numpy()
        res, resv = _ints(df["reserved_bytes"])
        peak, peakv = _ints(df["peak_allocated_bytes"])
        self.gap, self.gapv = res - peak, resv & peakv
        self.split, self.splitv = _ints(df["inactive_split_bytes"])
        self.retries, self.retriesv = _ints(df["alloc_retries"])
        self.lf, self.lfv = _ints(df["largest_free_block_bytes"])
        self.cap, self.capv = _ints(df["device_capacity_bytes"])
        self.gpu, self.gpuv = _ints(df["gpu"])
        if with_request:
            alloc, allocv = _ints(df["allocated_bytes"])
            self.req, self.reqv = peak - alloc, peakv & allocv

    def take(self, m: np.ndarray) -> None:
        for name, a in list(vars(self).items()):
            setattr(self, name, a[m])


def _groups(k: np.ndarray, ts: np.ndarray, blk: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Rows ordered by (key, ts, arrival): the order, the start of each key's run, and the start
    of each (key, block) run (blocks follow ts: a key's run is ordered by block too). All None:
    each key came once (the usual tick), every row is its own group."""
    m = k.size
    if m < 2 or int(np.bincount(k).max()) == 1:
        return None, None, None
    if not bool(np.all(ts[1:] >= ts[:-1])):
        order = np.lexsort((ts, k))  # stable: equal (key, ts) keep their arrival order
    elif not bool(np.all(k[1:] > k[:-1])):
        order = np.argsort(k, kind="stable")
    else:
        order = np.arange(m)
    ks = k[order]
    new_key = np.r_[True, ks[1:] != ks[:-1]]
    kstart = np.flatnonzero(new_key)
    if blk is None:
        return order, kstart, kstart
    bs = blk[order]
    bstart = np.flatnonzero(new_key | np.r_[True, bs[1:] != bs[:-1]])
    return order, kstart, bstart


def _pick(a: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    return a if rows is None else a[rows]


def _where(mask: np.ndarray, keys: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The keys and rows (None: every row, in order) where mask holds."""
    if mask.all():
        return keys, rows
    sel = np.flatnonzero(mask)
    return keys[sel], (sel if rows is None else rows[sel])


class AllocatorFragmentationDetector(Declared):
    spec = DetectorSpec(
        name="fragmentation_allocator",
        config=FragmentationAllocatorConfig,
        emits=(FindingKind.FRAGMENTATION_ALLOCATOR,),
        reads={"allocator_stats": HISTORY, "jobs": HISTORY},
        order=70,
        level="L2",
        streams=("allocator_stats",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("fragmentation_allocator", FragmentationAllocatorConfig, cfg)
        self._last_run: float | None = None
        self._last: list[Finding] = []
        c = self.config
        # Not synced: used for its current-run rules and window reads (rebuild, lost firsts).
        self._rows = SlidingRows(STREAM, c.window_seconds, c.warmup_seconds, blocks=c.lookback_blocks, reach=0.0)
        self.B = self._rows.B
        self._built = False
        # The tick cursor (SlidingRows.sync's rule) and the jobs' starts as of its last tick.
        self._window: Window | None = None
        self._seq = -1
        self._now = 0.0
        self._jobs_frame: pl.DataFrame | None = None
        self._starts: dict[Any, float | None] | None = None
        self._reset()

    # -- state ---------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.keys = _Keys()
        cap = 0
        self.n = np.zeros(cap, np.int64)
        self.i: dict[str, np.ndarray] = {}  # int64 values
        self.v: dict[str, np.ndarray] = {}  # their validity
        for name in ("gap0", "retries0", "gap", "split", "retries", "lf", "cap", "gpu"):
            self.i[name] = np.zeros(cap, np.int64)
            self.v[name] = np.zeros(cap, bool)
        self.ts0 = np.zeros(cap)
        self.ts1 = np.zeros(cap)
        self.node = np.zeros(cap, np.int64)
        self.job_start = np.zeros(0)  # per job number: start + warm-up, NaN: no start
        self._jobs_set = 0  # job numbers below this have their start in job_start
        # Block ring: it holds blocks [lo, hi]; a count ("n") of 0 is an empty entry (the other
        # fields of an entry are read only where its count is not). "<field>_ok": validity.
        self.ring = BlockRing(self.config.lookback_blocks + 1 if self.B > 0 else 0, RING_FIELDS, cap)
        self.lo, self.hi = 0, -1

    @property
    def R(self) -> int:
        """The ring's length (0: no blocks, rows leave one at a time)."""
        return self.ring.length

    @property
    def bn(self) -> np.ndarray:
        """(blocks, keys): the rows each block holds of each key (the ring's counts)."""
        return self.ring["n"]

    @property
    def bi(self) -> dict[str, np.ndarray]:
        """(blocks, keys) int64: each block's oldest gap and retries and its largest request."""
        return {name: self.ring[name] for name in ("gap", "retries", "req")}

    def _fit_keys(self) -> None:
        """Arrays sized for every key number (1/4 headroom: keys come in bursts)."""
        need, have = self.keys.n, self.n.shape[0]
        if need <= have:
            return
        cap = max(need, have + have // 4, 64)
        self.n = resized(self.n, cap, 0)
        for d in (self.i, self.v):
            for name in d:
                d[name] = resized(d[name], cap, 0)
        self.ts0, self.ts1, self.node = resized(self.ts0, cap, 0.0), resized(self.ts1, cap, 0.0), resized(self.node, cap, 0)
        if self.R:
            self.ring.widen(cap)

    def _fit_jobs(self) -> None:
        """Per job number: start + warm-up from the snapshot (NaN: none, its rows all count)."""
        have, need = self._jobs_set, self.keys.job_index.n
        if have < need:
            if self.job_start.shape[0] < need:
                self.job_start = resized(self.job_start, max(need, 2 * self.job_start.shape[0], 16), np.nan)
            starts = self._starts or {}
            for jn, job in enumerate(self.keys.jobs.slice(have, need - have).to_list(), start=have):
                s = starts.get(job)
                self.job_start[jn] = np.nan if s is None else s + self.config.warmup_seconds
            self._jobs_set = need

    def _set_starts(self, starts: dict[Any, float | None]) -> None:
        self._starts = starts
        w = self.config.warmup_seconds
        self.job_start = np.array([np.nan if (s := starts.get(j)) is None else s + w for j in self.keys.jobs.to_list()], dtype=np.float64)
        self._jobs_set = self.keys.job_index.n

    @property
    def _state(self) -> pl.DataFrame:
        """The per-key state as a polars frame (for tests and debugging; the detector never reads it)."""
        live = np.flatnonzero(self.n[: self.keys.n] > 0)
        jobs, ranks = self.keys.names(live)
        return pl.DataFrame(
            {
                "job": jobs,
                "rank": ranks,
                "n": self.n[live],
                "ts_first": self.ts0[live],
                "gap_first": self._col("gap0", live),
                "retries_first": self._col("retries0", live),
                "ts_last": self.ts1[live],
                **{f"{c}_last": self._col(c, live) for c in ("gap", "split", "retries")},
                "largest_free_last": self._col("lf", live),
                "capacity_last": self._col("cap", live),
                "node_last": self.keys.nodes(self.node[live]),
                "gpu_last": self._col("gpu", live),
            },
            schema_overrides={"job": pl.Utf8, "rank": pl.Int64},
        )

    def _col(self, name: str, rows: np.ndarray) -> pl.Series:
        return pl.Series(self.i[name][rows]).set(pl.Series(~self.v[name][rows]), None) if rows.size else pl.Series([], dtype=pl.Int64)

    # -- the config's contract with the pipeline -----------------------------------------------
    def lookback_seconds(self) -> dict[str, float]:
        """History of allocator_stats read from the window (pipeline/core.py: declared_horizons):
        block mode, block_slack_seconds (it reads only fresh rows while it steps; a rebuild reads
        what the window holds); else the look-back plus 30 s in which rows leaving it can still
        be subtracted."""
        c = self.config
        if c.lookback_blocks:
            return {STREAM: c.block_slack_seconds}
        return {STREAM: c.window_seconds + 30.0}

    def window_columns(self) -> dict[str, tuple[str, ...]]:
        """Columns of allocator_stats' history it reads (`_values`, `_Rows`; pipeline/core.py:
        declared_columns)."""
        cols = ("ts", "job", "rank", "node", "gpu", "reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes", "alloc_retries", "largest_free_block_bytes", "device_capacity_bytes")
        # ... and the step's request (blocks, or for the ranks it finds with lookback_blocks = 0).
        cols += ("allocated_bytes",)
        return {STREAM: cols}

    # -- per tick ------------------------------------------------------------------------------
    def _read_starts(self, window: Window) -> dict[Any, float | None] | None:
        """The jobs' starts (SlidingRows.starts: the first row of a job listed twice), or None
        when the snapshot is the frame of the previous tick."""
        jobs = window.get("jobs")
        if jobs is self._jobs_frame and self._starts is not None:
            return None
        self._jobs_frame = jobs
        if jobs.height == 0:
            return {}
        u = jobs.select("job", pl.col("start_ts").cast(pl.Float64)).unique("job", keep="first", maintain_order=True)
        return dict(zip(u["job"].to_list(), u["start_ts"].to_list(), strict=True))

    def _sync(self, window: Window) -> tuple[str, tuple[list[Any], list[Any]]]:
        """'same' (this tick again), 'step' (the next tick: fold its fresh rows in) or 'rebuild'
        (SlidingRows.sync's rule), and the jobs whose start moved or vanished, or that were newly
        given one (step only)."""
        now = window.now
        seq = getattr(window, "seq", None)
        if window is self._window and seq == self._seq:
            return "same", []
        horizon = window.horizon(STREAM)
        stepping = (
            window is self._window
            and seq is not None
            and seq == self._seq + 1
            and now > self._now
            and now - self._now <= horizon - (0.0 if self.B > 0 else self.config.window_seconds)
        )
        self._prev_now = self._now
        self._window, self._seq, self._now = window, seq if seq is not None else -1, now
        prev = self._starts
        starts = self._read_starts(window)
        changed: list[Any] = []
        appeared: list[Any] = []
        if starts is not None and starts != prev:
            if prev is not None:
                changed = [j for j, s in prev.items() if s is not None and starts.get(j) != s]
                appeared = [j for j, s in starts.items() if s is not None and prev.get(j) is None]
            self._set_starts(starts)
        return ("step" if stepping else "rebuild"), (changed, appeared)

    def ingest(self, window: Window) -> None:
        """Fold this tick's rows into the per-key arrays (O(new rows))."""
        if not self._built and window.get(STREAM).height == 0:
            # No allocator data yet (a replay of device series never has any): nothing to keep.
            # The first tick with rows rebuilds from the window, as after any gap.
            return
        mode, moved = self._sync(window)
        if mode == "same" and self._built:
            return
        if mode != "step" or not self._built:
            self._rebuild(window)
            return
        self._step(window, moved)

    def _lo_block(self, now: float) -> int:
        return self._rows.lo_block(now)

    def _rebuild(self, window: Window, jobs: list[Any] | None = None) -> None:
        """From the window's rows (every key, or the keys of `jobs`), as a refit reads them."""
        if jobs is None:
            starts = self._starts
            self._reset()
            self._starts = starts
            self._set_starts(starts or {})
            self._built = True
            self.lo = self._lo_block(window.now) if self.R else 0
            self.hi = self.lo - 1
        rows = self._rows.rows_for_rebuild(window, jobs)
        # Keys numbered in arrival order (the order of the next ticks' rows).
        r = _Rows(rows, self.keys, with_request=self.R > 0) if rows.height else None
        self._fit_keys()
        self._fit_jobs()
        if jobs is not None:
            # The state reported until now for these jobs goes; their rows are read again.
            numbers = self.keys.job_numbers(jobs)
            drop = np.isin(self.keys.job_of[: self.keys.n], numbers[numbers >= 0])
            self.n[: self.keys.n][drop] = 0
            if self.R:
                self.ring["n"][:, : self.keys.n][:, drop] = 0
        if rows.height == 0:
            return
        self._load(_build(_values(rows)))
        if self.R and r is not None:
            self._add_blocks(r)

    def _load(self, st: pl.DataFrame) -> None:
        k, node = self.keys.index(st["job"], st["rank"], st["node_last"])
        self._fit_keys()
        self._fit_jobs()
        self.n[k] = st["n"].to_numpy()
        self.ts0[k] = st["ts_first"].cast(pl.Float64).to_numpy()
        self.ts1[k] = st["ts_last"].cast(pl.Float64).to_numpy()
        self.node[k] = node
        for name, col in (("gap0", "gap_first"), ("retries0", "retries_first"), ("gap", "gap_last"), ("split", "split_last"), ("retries", "retries_last"),
                          ("lf", "largest_free_last"), ("cap", "capacity_last"), ("gpu", "gpu_last")):  # fmt: skip
            self.i[name][k], self.v[name][k] = _ints(st[col])

    def _step(self, window: Window, moved: tuple[list[Any], list[Any]]) -> None:
        now = window.now
        lo = self._lo_block(now)
        gone = self._evict(lo) if self.R else None
        fresh = window.fresh(STREAM)
        r = None
        if fresh.height:
            r = _Rows(fresh, self.keys, with_request=self.R > 0, cache=True)
            self._fit_keys()
            self._fit_jobs()
            if self.R:
                blk = np.floor(r.ts / self.B).astype(np.int64)
                inc = blk >= lo
            else:
                inc = r.ts >= now - self.config.window_seconds
            start = self.job_start[self.keys.job_of[r.k]]
            inc &= np.isnan(start) | (r.ts >= start)
            if not inc.all():
                r.take(inc)
                if self.R:
                    blk = blk[inc]
            if r.k.size:
                self._merge(r)
        lost = None
        if gone is not None:
            self.n[: gone.size] -= gone
            lost = np.flatnonzero(gone > 0)
        elif not self.R:
            lost = self._leaving(window)
        np.maximum(self.n, 0, out=self.n)
        if r is not None and r.k.size and self.R:
            self._add_blocks(r, blk)
        if lost is not None and lost.size:
            lost = lost[self.n[lost] > 0]
            if lost.size:
                self._refresh_first(window, lost)
        changed, appeared = moved
        if appeared:
            # A new start for a job already holding rows: its warm-up rows leave (SlidingRows).
            live = self.keys.job_of[: self.keys.n][self.n[: self.keys.n] > 0]
            holding = set(np.unique(live).tolist())
            changed = changed + [j for j, jn in zip(appeared, self.keys.job_numbers(appeared).tolist(), strict=True) if jn in holding]
        if changed:
            self._rebuild(window, changed)
        self._compact()

    def _compact(self) -> None:
        """Forget keys without rows once they outnumber the others (jobs come and go: the arrays
        would grow with every rank ever seen)."""
        K = self.keys.n
        live = np.flatnonzero(self.n[:K] > 0)
        if K - live.size <= max(1024, live.size):
            return
        if self.R:
            # A key may hold block entries and no count only if they were never counted.
            live = np.union1d(live, np.flatnonzero(self.ring["n"][:, :K].any(axis=0)))
        self.keys.keep(live)
        self.n = self.n[live].copy()
        for d in (self.i, self.v):
            for name in d:
                d[name] = d[name][live].copy()
        self.ts0, self.ts1, self.node = self.ts0[live].copy(), self.ts1[live].copy(), self.node[live].copy()
        if self.R:
            self.ring.keep(live)

    def _merge(self, r: _Rows) -> None:
        """Fold rows (included ones) into the keys' counts and oldest / newest samples
        (incremental.merge_edges: oldest by ts, ties the earlier arrival; newest by ts, ties the
        later; a fresh newest replaces one of equal ts)."""
        order, kstart, _ = _groups(r.k, r.ts, None)
        if order is None or kstart is None:
            uk, first, last, cnt = r.k, None, None, np.int64(1)
        else:
            first, last = order[kstart], order[np.r_[kstart[1:], order.size] - 1]
            uk, cnt = r.k[first], np.diff(np.r_[kstart, order.size])
        had = self.n[uk] > 0
        earlier = ~had | (_pick(r.ts, first) < self.ts0[uk])
        if earlier.any():
            ke, fe = _where(earlier, uk, first)
            self.ts0[ke] = _pick(r.ts, fe)
            self.i["gap0"][ke], self.v["gap0"][ke] = _pick(r.gap, fe), _pick(r.gapv, fe)
            self.i["retries0"][ke], self.v["retries0"][ke] = _pick(r.retries, fe), _pick(r.retriesv, fe)
        later = ~had | (_pick(r.ts, last) >= self.ts1[uk])
        if later.any():
            kl, fl = _where(later, uk, last)
            self.ts1[kl] = _pick(r.ts, fl)
            self.node[kl] = _pick(r.node, fl)
            for name, vals, valid in (("gap", r.gap, r.gapv), ("split", r.split, r.splitv), ("retries", r.retries, r.retriesv), ("lf", r.lf, r.lfv), ("cap", r.cap, r.capv), ("gpu", r.gpu, r.gpuv)):
                self.i[name][kl], self.v[name][kl] = _pick(vals, fl), _pick(valid, fl)
        self.n[uk] += cnt

    # -- block mode ----------------------------------------------------------------------------
    def _add_blocks(self, r: _Rows, blk: np.ndarray | None = None) -> None:
        """Fold rows into their (block, key) entries: count, oldest sample, max request."""
        if blk is None:
            blk = np.floor(r.ts / self.B).astype(np.int64)
        if blk.size == 0:
            return
        top = int(blk.max())
        if top - self.lo >= self.R:
            self._grow_ring(top - self.lo + 1 + self.config.lookback_blocks // 2)
        self.hi = max(self.hi, top)
        order, _, bstart = _groups(r.k, r.ts, blk)
        if order is None or bstart is None:
            first, k, b, cnt = None, r.k, blk, np.ones(r.k.size, np.int32)
            req, anyv = np.where(r.reqv, r.req, _MIN), r.reqv
        else:
            first = order[bstart]
            k, b, cnt = r.k[first], blk[first], np.diff(np.r_[bstart, order.size]).astype(np.int32)
            reqv = r.reqv[order]
            req, anyv = np.maximum.reduceat(np.where(reqv, r.req[order], _MIN), bstart), np.logical_or.reduceat(reqv, bstart)
        lo_b = int(b.min())
        # One block per tick but at a block's start: a row view of the ring per block touched.
        for bb in [lo_b] if lo_b == top else np.unique(b).tolist():
            sel = None if lo_b == top else np.flatnonzero(b == bb)
            s = bb % self.R
            kk, rows = _pick(k, sel), _pick(first, sel) if first is not None else sel
            e = {name: a[s] for name, a in self.ring.a.items()}  # block bb's entries (views)
            had = e["n"][kk] > 0
            earlier = ~had | (_pick(r.ts, rows) < e["ts"][kk])
            if earlier.any():
                ke, fe = _where(earlier, kk, rows)
                e["ts"][ke] = _pick(r.ts, fe)
                e["gap"][ke], e["gap_ok"][ke] = _pick(r.gap, fe), _pick(r.gapv, fe)
                e["retries"][ke], e["retries_ok"][ke] = _pick(r.retries, fe), _pick(r.retriesv, fe)
            q, qv = _pick(req, sel), _pick(anyv, sel)
            old, oldv = e["req"][kk], e["req_ok"][kk] & had
            e["req"][kk] = np.where(oldv & qv, np.maximum(old, q), np.where(oldv, old, q))
            e["req_ok"][kk] = oldv | qv
            e["n"][kk] += _pick(cnt, sel)

    def _grow_ring(self, slots: int) -> None:
        """Rows from further ahead than the ring reaches (a clock ahead): a longer ring."""
        self.ring.relay(slots, range(self.lo, self.hi + 1))

    def _evict(self, lo: int) -> np.ndarray | None:
        """Drop the blocks below `lo`; per key, the rows they held (None: none left)."""
        if lo <= self.lo:
            return None
        gone = None
        bn = self.ring["n"]
        for b in range(self.lo, min(lo, self.hi + 1)):
            s = b % self.R
            cnt = bn[s, : self.keys.n]
            gone = cnt.astype(np.int64) if gone is None else gone + cnt
            self.ring.clear_blocks([b], names=["n"])
        self.lo = lo
        self.hi = max(self.hi, lo - 1)
        return gone

    def _refresh_first(self, window: Window, lost: np.ndarray) -> None:
        """Keys that lost their oldest rows take their oldest remaining one."""
        if not self.R:
            jobs, ranks = self.keys.names(lost)
            keys = pl.DataFrame({"job": jobs, "rank": ranks}, schema={"job": pl.Utf8, "rank": pl.Int64})
            df = window.get(STREAM)
            keys = keys.cast({"rank": df.schema["rank"]}) if "rank" in df.schema else keys
            got = self._rows.first_rows(window, keys, {"gap": pl.col("reserved_bytes") - pl.col("peak_allocated_bytes"), "retries": pl.col("alloc_retries")})
            got = got.filter(pl.col("_f_ts").is_not_null())
            if got.height == 0:
                return
            k = self.keys.pairs.index(got.select(pl.col("job").cast(pl.Utf8), pl.col("rank").cast(pl.Int64)), shape=False, cache=False)
            self.ts0[k] = got["_f_ts"].to_numpy()
            self.i["gap0"][k], self.v["gap0"][k] = _ints(got["_f_gap"])
            self.i["retries0"][k], self.v["retries0"][k] = _ints(got["_f_retries"])
            return
        todo = lost
        for b in range(self.lo, self.hi + 1):
            s = b % self.R
            here = self.ring["n"][s, todo] > 0
            k = todo[here]
            if k.size:
                self.ts0[k] = self.ring["ts"][s, k]
                for name, state in (("gap", "gap0"), ("retries", "retries0")):
                    self.i[state][k], self.v[state][k] = self.ring[name][s, k], self.ring[f"{name}_ok"][s, k]
                todo = todo[~here]
            if todo.size == 0:
                break

    def _leaving(self, window: Window) -> np.ndarray | None:
        """lookback_blocks = 0: the window's rows that left the look-back this tick (SlidingRows.sync)
        are subtracted; the keys that lost some."""
        now, W = window.now, self.config.window_seconds
        df = window.get(STREAM)
        fresh = window.fresh(STREAM)
        kept_fresh = fresh.filter(pl.col("ts") >= now - window.horizon(STREAM)).height if fresh.height else 0
        old = df.head(df.height - kept_fresh) if kept_fresh else df
        leaving = self._rows.current(old.filter((pl.col("ts") >= self._prev_now - W) & (pl.col("ts") < now - W)), SlidingRows.starts(window))
        if leaving.height == 0:
            return None
        k, _ = self.keys.index(leaving["job"], leaving["rank"], leaving["node"])
        self._fit_keys()
        self._fit_jobs()
        cnt = np.bincount(k, minlength=self.keys.n)
        self.n[: cnt.size] -= cnt
        return np.flatnonzero(cnt)

    # -- evaluation ----------------------------------------------------------------------------
    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        self.ingest(window)
        if self._last_run is not None and now - self._last_run < self.config.every_seconds - 1e-9:
            return self._last
        self._last_run = now
        self._last = self._evaluate(window)
        return self._last

    def _fragmented(self) -> np.ndarray:
        """Key numbers passing every threshold (a null value fails, as polars' filter drops it)."""
        c = self.config
        K = self.keys.n
        i, v = {k: a[:K] for k, a in self.i.items()}, {k: a[:K] for k, a in self.v.items()}
        n, gap, gap0, split, cap = self.n[:K], i["gap"], i["gap0"], i["split"], i["cap"]
        ok = (n > 0) & (n >= c.min_samples) & v["gap"] & v["gap0"] & v["split"] & v["cap"] & v["retries"] & v["retries0"]
        ok &= gap >= c.min_gap_bytes
        ok &= gap >= c.min_gap_share * cap  # float64, as polars compares Int64 with Float64
        ok &= gap > gap0
        ok &= split >= c.min_inactive_split_share * gap
        ok &= (i["retries"] - i["retries0"]) >= c.min_retries
        return np.flatnonzero(ok)

    def _evaluate(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        if not self._built:
            return []
        ks = self._fragmented()
        if ks.size == 0:
            return []
        jobs, ranks = self.keys.names(ks)
        i = {k: a[ks] for k, a in self.i.items()}
        v = {k: a[ks] for k, a in self.v.items()}

        def ints(x: np.ndarray, valid: np.ndarray) -> list[int | None]:
            return [a if ok else None for a, ok in zip(x.tolist(), valid.tolist(), strict=True)]

        per_rank = pl.DataFrame(
            {
                "job": jobs,
                "rank": ranks,
                "n": self.n[ks],
                "gap": i["gap"],
                "gap0": i["gap0"],
                "split": i["split"],
                "retries": i["retries"] - i["retries0"],
                "largest_free": ints(i["lf"], v["lf"]),
                "capacity": i["cap"],
                "node": self.keys.nodes(self.node[ks]),
                "gpu": ints(i["gpu"], v["gpu"]),
            },
            schema_overrides={"job": pl.Utf8, "rank": pl.Int64, "largest_free": pl.Int64, "node": pl.Utf8, "gpu": pl.Int64},
        )
        if self.R:
            # The step's recurring large request (what a step allocates above its live floor)
            # over the look-back: the max of each block's max.
            held = (self.ring["n"][:, ks] > 0) & self.ring["req_ok"][:, ks]
            req = np.where(held, self.ring["req"][:, ks], _MIN).max(axis=0)
            per_rank = per_rank.with_columns(pl.Series("step_request", ints(req, held.any(axis=0)), pl.Int64))
        per_rank = per_rank.sort(["job", "gap", "rank"], descending=[False, True, False])  # rank breaks ties: same input, same finding
        if not self.R:
            # Read from the window for the ranks found only: a max does not slide.
            rows = self._rows.rows_for_rebuild(window, per_rank["job"].unique().to_list())
            keys = per_rank.select(KEYS).cast({"rank": rows.schema["rank"]})
            rows = rows.join(keys, on=KEYS, how="semi")
            request = rows.group_by(KEYS).agg((pl.col("peak_allocated_bytes") - pl.col("allocated_bytes")).max().alias("step_request"))
            per_rank = per_rank.join(request.cast({"rank": pl.Int64}), on=KEYS, how="left", maintain_order="left")
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
