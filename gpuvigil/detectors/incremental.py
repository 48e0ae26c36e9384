"""Sliding per-key state for trend detectors: each tick costs O(new rows), not O(window).

A trend detector (OOM prediction, allocator fragmentation) aggregates, per (job, rank), the rows
of its look-back `[now - W, now]` from the job's current run (`common.current_run`). Refitting
that every tick costs the whole window. `SlidingRows` instead tells the detector, per tick, which
rows *entered* (this tick's fresh rows) and which *left* (older rows that fell below `now - W`),
so running sums are updated from those alone, as `hang` keeps its state from fresh rows.

It falls back to a full rebuild (the same rows a refit reads) whenever it cannot prove it saw
every tick: a different window, a missed seal (a detector called less often than the pipeline
ticks, with no `ingest` call in between), time going back, or a jump longer than the stream's
horizon leaves beyond the look-back. A job whose start changes (requeued, or gone from the
scheduler's snapshot) is rebuilt alone, from its rows in the window.

"First" and "last" values (oldest and newest sample of a key) are taken by timestamp, ties by
arrival; for rows that arrive in time order this is the window's arrival order.

Block mode (`blocks` > 0, for memory at 100,000 GPUs): the look-back's far edge moves in
steps of B = W / blocks seconds. The rows read are those with ts >= lo = floor((now - W) / B) * B
(between W and W + B seconds back), and the detector keeps per-(job, rank) aggregates of each
block [kB, (k+1)B) of its look-back (oom: `BlockSums`; fragmentation_allocator: `BlockRing`)
instead of reading rows leaving it from the window: a whole block leaves at once, when lo passes
its end. So the window needs to keep only
the rows the detector still reads raw (its `reach`: e.g. the OOM fit's late half), not the whole
look-back. A rebuild reads the look-back's rows from the window, as many as it still holds.

The per-key state the detectors keep is built from the helpers here, each once: key numbers
(`KeyIndex`), the recent rows of each key in a ring (`KeyRing`), per-block sums (`BlockSums`),
per-block arrays in a ring (`BlockRing`),
each slot's samples in time order (`SlotSamples`) and arrays that gain keys (`grow`,
`resized`, `headroom`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from gpuvigil.window import Window

KEYS = ["job", "rank"]


@dataclass
class Step:
    """What changed since the previous sync (mode 'step'), or 'rebuild' / 'same'."""

    mode: str
    now: float
    prev_now: float = 0.0
    lo_block: int = 0  # block mode: the index of the look-back's oldest block
    fresh: pl.DataFrame | None = None  # included rows that arrived this tick
    old: pl.DataFrame | None = None  # every window row that was there before this tick
    leaving: pl.DataFrame | None = None  # included before, below now - W now
    changed_jobs: list[str] | None = None  # jobs whose known start moved or went away
    appeared_jobs: list[str] | None = None  # jobs newly given a start

    def rebuild_jobs(self, state: pl.DataFrame) -> list[str]:
        """Jobs to rebuild from the window alone: a start that moved (requeued) or vanished
        (its warm-up rows count again), or a new start for a job already holding rows."""
        jobs = list(self.changed_jobs or [])
        if self.appeared_jobs:
            jobs += state.filter(pl.col("job").is_in(self.appeared_jobs))["job"].unique().to_list()
        return jobs


class SlidingRows:
    def __init__(self, stream: str, window_seconds: float, warmup_seconds: float, blocks: int = 0, reach: float = 0.0):
        """`blocks` > 0: block mode (module doc), with blocks of W / blocks seconds; `reach`: how
        far back (seconds) the detector still reads raw rows from the window in block mode."""
        self.stream = stream
        self.W = window_seconds
        self.warmup = warmup_seconds
        self.blocks = int(blocks)
        self.B = window_seconds / blocks if blocks > 0 else 0.0
        self.reach = reach
        self._window: Window | None = None
        self._seq = -1
        self._now = 0.0
        self._starts: pl.DataFrame | None = None

    # -- the current-run filter, as common.current_run applies it ---------------------------
    @staticmethod
    def starts(window: Window) -> pl.DataFrame:
        jobs = window.get("jobs")
        if jobs.height == 0:
            return pl.DataFrame(schema={"job": pl.Utf8, "_start": pl.Float64})
        # A job listed twice: current_run's join would duplicate its rows; keep that behaviour
        # out of scope (the scheduler snapshot has one row per job) by taking the first.
        return jobs.select("job", pl.col("start_ts").cast(pl.Float64).alias("_start")).unique("job", keep="first", maintain_order=True)

    def lo_block(self, now: float) -> int:
        """Block mode: the index of the look-back's oldest block (the one holding now - W)."""
        return math.floor((now - self.W) / self.B) if self.B > 0 else 0

    def in_look_back(self, now: float) -> pl.Expr:
        """Rows a fit at `now` reads: ts >= now - W, or in block mode every row of the block
        holding now - W and after (by block index, as the detectors file rows into blocks)."""
        if self.B > 0:
            return block_of(self.B) >= self.lo_block(now)
        return pl.col("ts") >= now - self.W

    def included(self, df: pl.DataFrame, now: float, starts: pl.DataFrame) -> pl.DataFrame:
        """Rows a refit at `now` reads (in_look_back), after their job's (re)start + warm-up."""
        df = df.filter(self.in_look_back(now))
        return self.current(df, starts)

    def current(self, df: pl.DataFrame, starts: pl.DataFrame) -> pl.DataFrame:
        if df.height == 0 or starts.height == 0:
            return df
        return df.join(starts, on="job", how="left").filter(pl.col("_start").is_null() | (pl.col("ts") >= pl.col("_start") + self.warmup)).drop("_start")

    def rows_for_rebuild(self, window: Window, jobs: Sequence[str] | None = None) -> pl.DataFrame:
        df = window.get(self.stream)
        if jobs is not None:
            df = df.filter(pl.col("job").is_in(list(jobs)))
        return self.included(df, window.now, self.starts(window))

    # -- per tick ------------------------------------------------------------------------------
    def sync(self, window: Window) -> Step:
        now = window.now
        seq = getattr(window, "seq", None)
        starts = self.starts(window)
        horizon = window.horizon(self.stream)
        if window is self._window and seq == self._seq:
            return Step("same", now, lo_block=self.lo_block(now))
        stepping = (
            window is self._window
            and seq is not None
            and seq == self._seq + 1
            and now > self._now
            # Rows leaving the look-back must still be in the window to be subtracted (block
            # mode: whole blocks leave from the detector's own state; the rows it reads raw, up
            # to `reach` back, must still be there).
            and now - self._now <= horizon - (self.reach if self.B > 0 else self.W)
        )
        prev_now, prev_starts = self._now, self._starts
        self._window, self._seq, self._now, self._starts = window, seq if seq is not None else -1, now, starts
        if not stepping:
            return Step("rebuild", now, lo_block=self.lo_block(now))
        df = window.get(self.stream)
        fresh = window.fresh(self.stream)
        # The window is the previous rows followed by this tick's (those not past the horizon).
        kept_fresh = fresh.filter(pl.col("ts") >= now - horizon).height if fresh.height else 0
        old = df.head(df.height - kept_fresh) if kept_fresh else df
        if self.B > 0:
            leaving = old.clear()  # blocks leave from the detector's own per-block state
        else:
            leaving = self.current(old.filter((pl.col("ts") >= prev_now - self.W) & (pl.col("ts") < now - self.W)), starts)
        changed: list[str] = []
        appeared: list[str] = []
        if prev_starts is not None and (prev_starts.height or starts.height):
            both = prev_starts.join(starts, on="job", how="full", coalesce=True, suffix="_new")
            moved = both.filter(pl.col("_start").ne_missing(pl.col("_start_new")))
            changed = moved.filter(pl.col("_start").is_not_null())["job"].to_list()
            appeared = moved.filter(pl.col("_start").is_null())["job"].to_list()
        return Step("step", now, prev_now, self.lo_block(now), self.included(fresh, now, starts) if fresh.height else fresh, old, leaving, changed, appeared)

    def first_rows(self, window: Window, keys: pl.DataFrame, values: dict[str, pl.Expr]) -> pl.DataFrame:
        """Per key in `keys`, `ts` and `values` of its oldest included row (ties: the first to
        arrive), as columns `_f_ts` and `_f_<name>`.

        Looked up in a band just above `now - W`, widened until every key is found: in steady
        state one tick's worth of rows, not the window.
        """
        now = window.now
        lo = now - self.W
        starts = self._starts if self._starts is not None else self.starts(window)
        df = window.get(self.stream)
        found: list[pl.DataFrame] = []
        band = 2.0
        todo = keys
        while todo.height:
            last_pass = band >= self.W * 4
            part = df.filter(pl.col("ts") >= lo) if last_pass else df.filter((pl.col("ts") >= lo) & (pl.col("ts") < lo + band))
            part = self.current(part, starts).join(todo, on=KEYS, how="semi")
            if part.height:
                got = (
                    part.select(*KEYS, pl.col("ts").alias("_f_ts"), *(e.alias(f"_f_{k}") for k, e in values.items()))
                    .sort("_f_ts", maintain_order=True)
                    .group_by(KEYS, maintain_order=True)
                    .first()
                )
                found.append(got)
                todo = todo.join(got.select(KEYS), on=KEYS, how="anti")
            if last_pass:
                break
            band *= 4
        if not found:
            return pl.DataFrame(schema={"job": pl.Utf8, "rank": pl.Int32, "_f_ts": pl.Float64}).with_columns(pl.lit(None).alias(f"_f_{k}") for k in values)
        return pl.concat(found, how="vertical_relaxed")


class TickCursor:
    """The last tick (of which window) a detector's running state folded in: whether a call is
    that tick again ("same"), the very next one ("step": fold its fresh rows in) or anything else
    ("rebuild": another window, a tick missed, time going back, a window without `seq`)."""

    def __init__(self) -> None:
        self.window: Window | None = None
        self.seq = -1
        self.now = -math.inf

    def advance(self, window: Window) -> str:
        seq = getattr(window, "seq", None)
        if window is self.window and seq is not None and seq == self.seq:
            return "same"
        step = window is self.window and seq is not None and seq == self.seq + 1 and window.now > self.now
        self.window, self.seq, self.now = window, (seq if seq is not None else -1), window.now
        return "step" if step else "rebuild"

    def forget(self) -> None:
        """The next call rebuilds."""
        self.window = None


def block_of(block_seconds: float) -> pl.Expr:
    """The index of the block of `block_seconds` holding each row's ts (block k: [kB, (k+1)B))."""
    return (pl.col("ts") / block_seconds).floor().cast(pl.Int64)





def edges_from_rows(v: pl.DataFrame, first: list[str], last: list[str]) -> pl.DataFrame:
    """Per key oldest/newest values of `v` (the rebuild path of merge_edges)."""
    return v.group_by(KEYS).agg(
        pl.col("ts").min().alias("ts_first"),
        *(pl.col(c).sort_by("ts", maintain_order=True).first().alias(f"{c}_first") for c in first),
        pl.col("ts").max().alias("ts_last"),
        *(pl.col(c).sort_by("ts", maintain_order=True).last().alias(f"{c}_last") for c in last),
    )


class KeyRing:
    """The recent rows of each (job, rank), in numpy ring buffers: one row of a (keys, capacity)
    array per key, filled in arrival order, so a tick costs O(new rows) and an evaluation is a
    few vectorised passes over keys × capacity (no group_by over the window).

    Rows older than `keep_from` (given on each insert) may be overwritten; when a key would
    overwrite a row still needed, every buffer doubles (`slack` set: grows instead to the most
    rows a key then holds, plus that share and at least 8 slots). `ts` NaN marks an empty slot.

    A caller that numbers its own keys (rows of the arrays) skips `key_index` and uses `reserve`
    and `clear` (straggler_device: one ring per allocated GPU, emptied when its job changes).
    """

    def __init__(self, floats: Sequence[str], ints: Sequence[str], capacity: int = 8, slack: float | None = None):
        self.float_names, self.int_names = list(floats), list(ints)
        self._index = KeyIndex({"job": pl.Utf8(), "rank": pl.Int32()})
        self.slack = slack
        self._alloc(0, capacity)

    @property
    def keys(self) -> pl.DataFrame:
        """The (job, rank) of each key row, and its number `_k`."""
        return self._index.table

    @property
    def n(self) -> int:
        """Keys numbered so far."""
        return self._index.n

    @n.setter
    def n(self, rows: int) -> None:
        self._index.n = rows

    def _alloc(self, rows: int, cap: int) -> None:
        self.cap = cap
        self.ts = np.full((rows, cap), np.nan)
        self.f = {c: np.full((rows, cap), np.nan) for c in self.float_names}
        self.i = {c: np.zeros((rows, cap), np.int32) for c in self.int_names}
        self.head = np.zeros(rows, np.int64)  # next slot to write, per key
        self.last_ts = np.full(rows, -np.inf)  # newest ts written, per key

    def _arrays(self) -> list[np.ndarray]:
        return [self.ts, *self.f.values(), *self.i.values()]

    def _grow_keys(self, rows: int, exact: bool = False) -> None:
        have = self.ts.shape[0]
        if rows <= have:
            return
        if not exact:
            rows = max(rows, 2 * have, 64)
        # One buffer at a time (the old one is freed before the next grows).
        self.ts = resized(self.ts, rows, np.nan)
        for c in self.f:
            self.f[c] = resized(self.f[c], rows, np.nan)
        for c in self.i:
            self.i[c] = resized(self.i[c], rows, 0)
        self.head = resized(self.head, rows, 0)
        self.last_ts = resized(self.last_ts, rows, -np.inf)

    def _grow_capacity(self, cap: int) -> None:
        """Unroll every ring (oldest first) into a wider buffer."""
        rows = self.ts.shape[0]
        order = (self.head[:, None] + np.arange(self.cap)[None, :]) % self.cap

        def widen(a: np.ndarray, fill: float | int) -> np.ndarray:
            out = np.full((rows, cap), fill, dtype=a.dtype)
            out[:, : self.cap] = np.take_along_axis(a, order, axis=1)
            return out

        # One buffer at a time: the old one is freed before the next is widened.
        self.ts = widen(self.ts, np.nan)
        for c in self.f:
            self.f[c] = widen(self.f[c], np.nan)
        for c in self.i:
            self.i[c] = widen(self.i[c], 0)
        self.head = np.full(rows, self.cap, np.int64)
        self.cap = cap

    def reserve(self, rows: int) -> None:
        """Room for keys 0..rows-1 (for a caller numbering its own keys), with 1/8 headroom."""
        have = self.ts.shape[0]
        if rows > have:
            self._grow_keys(headroom(rows, have), exact=True)

    def clear(self, rows: np.ndarray) -> None:
        """Empty these keys' rings (their rows are forgotten; the keys stay numbered)."""
        if len(rows) == 0:
            return
        self.ts[rows] = np.nan
        for a in self.f.values():
            a[rows] = np.nan
        for a in self.i.values():
            a[rows] = 0
        self.head[rows] = 0
        self.last_ts[rows] = -np.inf

    def key_index(self, keys: pl.DataFrame) -> np.ndarray:
        """Index of each row's (job, rank); keys not seen before are added."""
        k = self._index.index(keys, shape=False)
        self._grow_keys(self.n)
        return k

    def insert(self, key: np.ndarray, ts: np.ndarray, floats: dict[str, np.ndarray], ints: dict[str, np.ndarray], keep_from: float) -> None:
        """Append rows (in arrival order) to their keys' rings; rows older than keep_from are
        not kept, slots holding rows older than keep_from are reused."""
        keep = ts >= keep_from
        if not keep.all():
            key, ts = key[keep], ts[keep]
            floats = {c: v[keep] for c, v in floats.items()}
            ints = {c: v[keep] for c, v in ints.items()}
        if key.size == 0:
            return
        order = np.argsort(key, kind="stable")  # stable: arrival order within a key
        ks = key[order]
        first = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        counts = np.diff(np.r_[first, ks.size])
        ordinal = np.arange(ks.size) - np.repeat(first, counts)
        while True:
            slot = (self.head[ks] + ordinal) % self.cap
            busy = self.ts[ks, slot] >= keep_from
            if counts.max() <= self.cap and not busy.any():
                break
            if self.slack is None:
                self._grow_capacity(self.cap * 2)
            else:
                uk = ks[first]
                need = int(((self.ts[uk] >= keep_from).sum(axis=1) + counts).max())
                self._grow_capacity(max(math.ceil(need * (1.0 + self.slack)), self.cap + 8, self.cap + int(counts.max())))
        self.ts[ks, slot] = ts[order]
        for c, v in floats.items():
            self.f[c][ks, slot] = v[order]
        for c, v in ints.items():
            self.i[c][ks, slot] = v[order]
        uk = ks[first]
        self.head[uk] = (self.head[uk] + counts) % self.cap
        self.last_ts[uk] = np.maximum(self.last_ts[uk], np.maximum.reduceat(ts[order], first))

    def valid(self, rows: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Slots of `rows` holding a row with ts >= lo (per row)."""
        return self.ts[rows] >= lo[:, None]

    def newest(self, rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Per row, the slot of its latest-arrived valid row (-1 if none)."""
        head = self.head[rows]
        j = (head - 1) % self.cap  # the latest write, valid for almost every key
        late = ~valid[np.arange(j.size), j]
        if late.any():
            age = (head[late][:, None] - 1 - np.arange(self.cap)[None, :]) % self.cap  # 0 = newest
            age = np.where(valid[late], age, self.cap)
            j[late] = np.where(valid[late].any(axis=1), age.argmin(axis=1), -1)
        return j


def masked_median(values: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the median of `values` where `valid` (and not NaN), exactly as polars computes
    it (odd n: the middle value; even n: a + (b - a) * 0.5 of the two middle ones), and the count.

    Invalid slots become +inf, so a row's middle values sit at columns (n-1)//2 and n//2: rows
    are partitioned in groups of equal count (a handful in steady state), one numpy call each.
    """
    ok = valid & ~np.isnan(values)
    n = ok.sum(axis=1)
    med = np.full(values.shape[0], np.nan)
    if values.size == 0:
        return med, n
    x = np.where(ok, values, np.inf)
    order = np.argsort(n, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(n[order])) + 1)
    for rows in groups if len(groups) > 1 else [slice(None)]:
        count = int(n[rows][0]) if len(groups) > 1 else int(n[0])
        if count == 0:
            continue
        k1, k2 = (count - 1) // 2, count // 2
        part = np.partition(x[rows], [k1, k2] if k1 != k2 else k1, axis=1)
        a, b = part[:, k1], part[:, k2]
        med[rows] = a if count % 2 else a + (b - a) * 0.5
    return med, n


# --- numpy per-key state (oom) ---


class KeyIndex:
    """Stable row numbers for keys (the values of one or more columns, nulls equal): row k of a
    detector's numpy arrays holds key k. A tick's keys arrive in the same order tick after tick,
    so the last frame and its numbers are cached: an equal frame costs one comparison, not a join.
    `keep` drops keys (renumbering the rest in order) so that keys of finished jobs do not pile up.
    """

    def __init__(self, schema: dict[str, pl.DataType]):
        self.cols = list(schema)
        self.table = pl.DataFrame(schema={**schema, "_k": pl.Int64})  # row k holds key k
        self.n = 0
        self.unique = True  # whether the last frame indexed had each key once
        self.run: slice | None = None  # the last frame's numbers, when they are lo, lo + 1, ... (a slice of the arrays)
        self._last: tuple[pl.DataFrame, np.ndarray, bool, slice | None] | None = None

    def index(self, keys: pl.DataFrame, shape: bool = True, cache: bool = True) -> np.ndarray:
        """Number of each row's key; keys not seen before are appended. `shape`: also tell
        whether each key came once (`unique`) and the slice the numbers form (`run`). `cache`
        False: a one-off frame (a rebuild's rows, rows leaving), neither compared with the last
        frame nor replacing it (appending keys leaves the numbers of known ones as they were)."""
        last = self._last
        if cache and last is not None and last[0].height == keys.height and all(last[0][c].equals(keys[c]) for c in self.cols):
            self.unique, self.run = last[2], last[3]
            return last[1]
        k = self._join(keys)
        if k.null_count():
            new = keys.filter(k.is_null()).unique(maintain_order=True)
            new = new.with_columns(pl.int_range(self.n, self.n + new.height, dtype=pl.Int64).alias("_k"))
            self.table = pl.concat([self.table, new], how="vertical_relaxed")
            self.n += new.height
            k = self._join(keys)
        idx = k.to_numpy()
        if not shape:
            if cache:
                self._last = None
            return idx
        self.unique = bool(keys.height < 2 or not keys.is_duplicated().any())
        step = np.diff(idx)
        self.run = slice(int(idx[0]), int(idx[-1]) + 1) if idx.size and bool((step == 1).all()) else None
        if cache:
            self._last = (keys, idx, self.unique, self.run)
        return idx

    def _join(self, keys: pl.DataFrame) -> pl.Series:
        return keys.join(self.table, on=self.cols, how="left", maintain_order="left", nulls_equal=True)["_k"]

    def keep(self, keep: np.ndarray) -> np.ndarray:
        """Keep the keys where `keep` (length n); returns old number -> new (-1: dropped)."""
        remap = np.full(self.n, -1, np.int64)
        remap[keep] = np.arange(int(keep.sum()))
        self.table = self.table.filter(pl.Series(keep[: self.n])).with_columns(pl.int_range(0, pl.len(), dtype=pl.Int64).alias("_k"))
        self.n = self.table.height
        self._last = None
        return remap


# --- growth: per-key arrays that gain keys ---


def headroom(rows: int, have: int) -> int:
    """How many key rows to allocate for `rows` keys when `have` are allocated: 1/8 more than
    held (at least 64), so keys arriving one tick at a time reallocate O(log n) times."""
    return max(rows, have + have // 8, 64)


def grow(arr: np.ndarray, n: int, fill: float | int | bool) -> np.ndarray:
    """`arr` extended to at least `n` slots with `fill` (amortised doubling)."""
    if arr.shape[0] >= n:
        return arr
    out = np.full(max(n, 2 * arr.shape[0], 64), fill, dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def resized(a: np.ndarray, n: int, fill: float | int | bool, axis: int = 0) -> np.ndarray:
    """A copy of `a` with exactly `n` entries along `axis`, the new ones `fill` (`grow` doubles;
    this is for callers that choose the size themselves)."""
    shape = list(a.shape)
    shape[axis] = n
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


# --- block sums: a look-back kept as per-block aggregates ---


class BlockSums:
    """Block mode's per-key aggregates (module doc): per block index k (rows with ts in
    [kB, (k+1)B)), a (sums + firsts, keys) array whose first `sums` rows are running sums (0:
    nothing yet) and whose last `firsts` rows describe each key's oldest row of the block (NaN:
    none). Only the look-back's blocks are held: a block leaves whole (`leaving`)."""

    def __init__(self, sums: int, firsts: int) -> None:
        self.sums, self.firsts = sums, firsts
        self.blocks: dict[int, np.ndarray] = {}

    def empty(self, width: int) -> np.ndarray:
        a = np.zeros((self.sums + self.firsts, width))
        a[self.sums :] = np.nan
        return a

    def at(self, k: int, width: int) -> np.ndarray:
        """Block k's array (a new one, `width` keys wide, when it holds nothing yet)."""
        a = self.blocks.get(k)
        if a is None:
            a = self.blocks[k] = self.empty(width)
        return a

    def pad(self, width: int) -> None:
        """Every block at least `width` keys wide (new keys empty)."""
        for k, a in self.blocks.items():
            if a.shape[1] < width:
                self.blocks[k] = np.concatenate([a, self.empty(width - a.shape[1])], axis=1)

    def keep(self, live: np.ndarray) -> None:
        """Keep the keys where `live` (renumbered in order, as KeyIndex.keep)."""
        n = live.size
        for k, a in self.blocks.items():
            self.blocks[k] = a[:, : min(n, a.shape[1])][:, live[: a.shape[1]]]

    def clear(self, keys: np.ndarray) -> None:
        """Empty the keys where `keys` (a mask over key numbers) in every block."""
        for a in self.blocks.values():
            w = min(a.shape[1], keys.size)
            m = keys[:w]
            a[: self.sums, :w][:, m] = 0.0
            a[self.sums :, :w][:, m] = np.nan

    def leaving(self, lo_block: int) -> list[tuple[int, np.ndarray]]:
        """The blocks below `lo_block` (they left the look-back), oldest first, no longer held."""
        return [(k, self.blocks.pop(k)) for k in sorted(b for b in self.blocks if b < lo_block)]

    def oldest_first(self) -> list[np.ndarray]:
        return [self.blocks[k] for k in sorted(self.blocks)]


# --- a ring of per-block arrays ---


class BlockRing:
    """A look-back kept per block and key in a ring: named (length, keys) arrays (`fields`: name
    -> (dtype, fill), the fill marking an empty entry) whose row b % length holds block b. A
    block of every key is one contiguous row, so a block starting or leaving is one row per
    array, and a key is a column. Which blocks the rows hold is the caller's rule: `advance`
    keeps the `length` blocks up to the newest (emptying the rows it moves onto), `clear_blocks`
    empties blocks that left; `relay` moves the held blocks into a ring of another length.

    fragmentation_allocator keeps each (job, rank)'s per-block count, oldest sample and largest
    request here; oom_device each GPU's per-bucket maximum of used memory and sample count.
    """

    def __init__(self, length: int, fields: dict[str, tuple[type | np.dtype, float | int | bool]], keys: int = 0) -> None:
        self.length = int(length)
        self.fields = {name: (np.dtype(dtype), fill) for name, (dtype, fill) in fields.items()}
        self.top = -1  # the newest block `advance` was given
        self.a = {name: np.full((self.length, keys), fill, dtype) for name, (dtype, fill) in self.fields.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.a[name]

    @property
    def keys(self) -> int:
        return next(iter(self.a.values())).shape[1] if self.a else 0

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """The ring rows of blocks lo..hi (inclusive), in block order."""
        return np.arange(lo, hi + 1) % self.length

    def widen(self, keys: int) -> None:
        """Exactly `keys` columns (new keys empty); the caller chooses the headroom."""
        for name, (_, fill) in self.fields.items():
            self.a[name] = resized(self.a[name], keys, fill, axis=1)

    def keep(self, live: np.ndarray) -> None:
        """Keep the keys `live` (ascending numbers, or a mask), renumbered in order."""
        for name in self.a:
            self.a[name] = self.a[name][:, live]

    def clear(self, keys: np.ndarray) -> None:
        """Empty the keys `keys` (numbers or a mask) in every block."""
        for name, (_, fill) in self.fields.items():
            self.a[name][:, keys] = fill

    def clear_blocks(self, blocks: np.ndarray | Sequence[int], names: Sequence[str] | None = None) -> None:
        """Empty blocks (all fields, or `names` alone: the one that tells an entry is empty)."""
        rows = np.asarray(blocks, np.int64) % self.length
        for name in self.a if names is None else names:
            self.a[name][rows] = self.fields[name][1]

    def advance(self, block: int) -> None:
        """Make `block` the newest: the blocks it passes start empty (the oldest ones go)."""
        if block <= self.top:
            return
        self.clear_blocks(np.arange(max(self.top + 1, block - self.length + 1), block + 1))
        self.top = block

    def relay(self, length: int, held: Sequence[int]) -> None:
        """A ring of `length` rows holding the blocks `held` (their entries moved; others empty)."""
        old = self.length
        for name, (dtype, fill) in self.fields.items():
            a = self.a[name]
            out = np.full((length, a.shape[1]), fill, dtype)
            for b in held:
                out[b % length] = a[b % old]
            self.a[name] = out
        self.length = int(length)


# --- per-slot samples in time order (oom_device) ---

class SlotSamples:
    """Per slot (a row of the arrays, numbered by the caller), its samples of a look-back: `ts`
    and one 2-D float64 array per value column (`v[name]`), in slots [0, n) of the row (NaN
    beyond), in ts order (ties: arrival order; a slot that received a row older than its newest
    is sorted by `sort_unsorted` before it is read). Per slot too: whether a `tracked` column ever
    had a value (`seen[name]`), the newest row's `latest` values (`last[name]`) and a `floor`
    (rows with ts <= floor may be missing: the caller refills the slot). The row length grows to
    what the look-back holds (its ticks + slack); rows below the look-back are dropped when a
    slot runs out of room (`compact`), or a block of slots at a time (`tidy`).

    oom_device keeps each allocated GPU's samples of its fit window here.
    """

    def __init__(self, values: Sequence[str], latest: Sequence[str] = (), tracked: Sequence[str] = (), chunk: int = 8192) -> None:
        self.value_names, self.latest_names, self.tracked_names = list(values), list(latest), list(tracked)
        self.chunk = chunk  # slots moved at once: bounds the temporaries (chunk x row length float64 each)
        self.cap = 0
        self.slack = 0  # the room beyond what the fit window held when the rows last grew
        self._tidy = 0  # the next slot `tidy` compacts
        self._empty(0)

    def _empty(self, rows: int) -> None:
        self.ts = np.full((rows, self.cap), np.nan)
        self.v = {name: np.full((rows, self.cap), np.nan) for name in self.value_names}
        self.n = np.zeros(rows, np.int64)
        self.last_in = np.full(rows, -np.inf)  # the newest ts folded in (a row older: unsorted)
        self.unsorted = np.zeros(rows, bool)
        self.seen = {name: np.zeros(rows, bool) for name in self.tracked_names}
        self.new_ts = np.full(rows, -np.inf)  # the newest row's ts, and its `latest` values
        self.last = {name: np.full(rows, np.nan) for name in self.latest_names}
        # Rows with ts <= floor may be missing (the slot started empty or lost its newest rows):
        # +inf or a floor at or above the start of what the caller reads refills it.
        self.floor = np.full(rows, -np.inf)

    @property
    def rows(self) -> int:
        return int(self.n.size)

    def chunks(self, rows: np.ndarray) -> list[np.ndarray]:
        return [rows[i : i + self.chunk] for i in range(0, rows.size, self.chunk)]

    def _grids(self) -> list[np.ndarray]:
        return [self.ts, *self.v.values()]

    def grow_rows(self, rows: int) -> None:
        have = self.rows
        if rows <= have:
            return
        rows = headroom(rows, have)
        self.ts = resized(self.ts, rows, np.nan)
        self.v = {name: resized(a, rows, np.nan) for name, a in self.v.items()}
        self.n = resized(self.n, rows, 0)
        self.last_in, self.new_ts, self.floor = (resized(a, rows, -np.inf) for a in (self.last_in, self.new_ts, self.floor))
        self.unsorted = resized(self.unsorted, rows, False)
        self.seen = {name: resized(a, rows, False) for name, a in self.seen.items()}
        self.last = {name: resized(a, rows, np.nan) for name, a in self.last.items()}

    def _widen(self, cap: int) -> None:
        self.ts = resized(self.ts, cap, np.nan, axis=1)
        self.v = {name: resized(a, cap, np.nan, axis=1) for name, a in self.v.items()}
        self.cap = cap

    def clear(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        for a in self._grids():
            a[slots] = np.nan
        self.n[slots] = 0
        self.last_in[slots] = -np.inf
        self.unsorted[slots] = False
        for a in self.seen.values():
            a[slots] = False
        self.new_ts[slots] = -np.inf
        for a in self.last.values():
            a[slots] = np.nan
        self.floor[slots] = -np.inf

    def remove(self, slots: np.ndarray, dead: np.ndarray, newest: bool = False) -> None:
        """Drop the rows marked `dead` (within [0, n)) from `slots`, keeping the others' order.
        `newest`: the newest row may be among them while older ones stay."""
        count = dead.sum(axis=1)
        hit = count > 0
        if not hit.any():
            return
        slots, dead, count = slots[hit], dead[hit], count[hit]
        j = np.arange(self.cap)
        prefix = (dead == (j[None, :] < count[:, None])).all(axis=1)
        for d in np.unique(count[prefix]):
            for q in self.chunks(slots[prefix & (count == d)]):
                lo, hi = int(q[0]), int(q[-1]) + 1
                rows = slice(lo, hi) if hi - lo == q.size and (q[1:] > q[:-1]).all() else q  # a run of slots: no copy
                for a in self._grids():
                    a[rows, : self.cap - d] = a[rows, d:]
                    a[rows, self.cap - d :] = np.nan
        rest, rdead = slots[~prefix], dead[~prefix]
        if rest.size:
            order = np.argsort(rdead, axis=1, kind="stable")
            left = self.n[rest] - count[~prefix]
            for a in self._grids():
                moved = np.take_along_axis(a[rest], order, axis=1)
                moved[j[None, :] >= left[:, None]] = np.nan
                a[rest] = moved
        self.n[slots] -= count
        # A slot that lost its newest row (thinned) is refilled from the window when evaluated.
        gone = slots[self.n[slots] == 0]
        self.new_ts[gone] = -np.inf
        for a in self.last.values():
            a[gone] = np.nan
        left_slots = slots[self.n[slots] > 0]
        if newest and left_slots.size:
            lost = np.nanmax(self.ts[left_slots], axis=1) < self.new_ts[left_slots]
            self.floor[left_slots[lost]] = np.inf

    def compact(self, slots: np.ndarray, keep_from: float) -> None:
        """Drop the rows of `slots` older than keep_from (they left the fit window for good)."""
        for q in self.chunks(np.sort(slots)):
            lo, hi = int(q[0]), int(q[-1]) + 1
            self.remove(q, self.ts[lo:hi] < keep_from if hi - lo == q.size else self.ts[q] < keep_from)

    def tidy(self, keep_from: float) -> None:
        """Compact the next block of slots (round robin), so that slots filled at the same pace
        do not all run out of room on the same tick (a tick's cost stays O(new rows))."""
        if self.rows == 0 or self.cap == 0:
            return
        start = self._tidy % self.rows
        size = -(-self.rows // max(1, self.slack - 2))  # every slot once before its room runs out
        self._tidy = start + size
        q = np.arange(start, min(start + size, self.rows))
        q = q[self.n[q] > self.cap - self.slack]
        if q.size:
            self.compact(q, keep_from)

    def thin(self, slots: np.ndarray, judged: float, cut: float) -> None:
        """The window's retention rule at this seal: rows of `slots` with judged <= ts < cut go."""
        for q in self.chunks(slots):
            t = self.ts[q]
            self.remove(q, (t >= judged) & (t < cut), newest=True)

    def insert(self, k: np.ndarray, ts: np.ndarray, values: dict[str, np.ndarray], latest: dict[str, np.ndarray], keep_from: float, ticks: float | None) -> None:
        """Append rows (in arrival order) to their slots; rows older than keep_from are not kept.
        `ticks`: how many ticks the look-back spans (sizes the rows when they must grow)."""
        ok = ts >= keep_from
        if not ok.all():
            k, ts = k[ok], ts[ok]
            values = {name: a[ok] for name, a in values.items()}
            latest = {name: a[ok] for name, a in latest.items()}
        if k.size == 0:
            return
        order = np.lexsort((ts, k))  # by slot, then ts; stable: ties keep arrival order
        k, ts = k[order], ts[order]
        values = {name: a[order] for name, a in values.items()}
        latest = {name: a[order] for name, a in latest.items()}
        first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        counts = np.diff(np.r_[first, k.size])
        uk = k[first]
        need = self.n[uk] + counts
        if need.max() > self.cap:
            self.compact(uk[need > self.cap], keep_from)
            need = self.n[uk] + counts
            if need.max() > self.cap:
                want = int(need.max())
                if ticks is not None:
                    want = max(want, int(counts.max()) * (math.floor(ticks) + 2))
                self.slack = max(8, want // 8)
                self._widen(want + self.slack)
        self.unsorted[uk] |= ts[first] < self.last_in[uk]
        pos = np.repeat(self.n[uk], counts) + (np.arange(k.size) - np.repeat(first, counts))
        self.ts[k, pos] = ts
        for name, a in values.items():
            self.v[name][k, pos] = a
        self.n[uk] += counts
        for name, flags in self.seen.items():
            has = ~np.isnan(values[name])
            if has.any():
                flags[k[has]] = True
        last = first + counts - 1  # each slot's newest row of the batch (ties: the later arrival)
        self.last_in[uk] = np.maximum(self.last_in[uk], ts[last])
        newer = ts[last] >= self.new_ts[uk]
        up, li = uk[newer], last[newer]
        self.new_ts[up] = ts[li]
        for name, a in latest.items():
            self.last[name][up] = a[li]

    def sort_unsorted(self) -> None:
        rows = np.flatnonzero(self.unsorted)
        for q in self.chunks(rows):
            order = np.argsort(self.ts[q], axis=1, kind="stable")  # NaN (empty) last
            for a in self._grids():
                a[q] = np.take_along_axis(a[q], order, axis=1)
        self.unsorted[rows] = False
