"""Straggler detector (gpuvigil/detectors/straggler.py): behaviour that mutation testing
(`make mutate`, docs/testing.md) showed no other selected test pinned down.

- Its findings are those of the refit over the window (tests/incremental_oracles.py:
  RefitStraggler) however it is fed (detect every tick; ingest every tick and detect now and
  then; detect now and then with nothing between, rebuilt from the window), on series built to sit
  on the edges the fast path decides on: one row a tick, rows exactly `window_seconds` old,
  a rank moving to a new node, rows without node, job or GPU, a row exactly at the look-back's
  edge, a requeue, a history shorter than the look-back, history older than the look-back, half
  the steps short.
- O(new rows) per tick: a steady tick folds its rows in without rebuilding, and a job
  whose median step is provably short is judged from the rings, not by the refit.
- Rings of jobs gone long ago are dropped (start over, smaller) exactly past the bound.

Source: every input is a constructed frame (the rank_progress schema the hook and the Flight
Recorder reader emit); ranks' step times and waits follow the straggler mechanism (a slow rank
waits least: 5% of its step against its peers' 40%). The detector's behaviour on real gloo ranks is
in tests/test_detectors_real.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.window import Window

sys.path.insert(0, str(Path(__file__).parent))
from incremental_oracles import RefitStraggler, check_against_refit  # noqa: E402

# Short windows so the series stay small: a job is judged over max(10 s, 2 x its median step),
# at most 40 s; a step is "short" (window stays 10 s) when it is <= 5 s.
BASE = {"window_seconds": 10.0, "min_samples": 5, "min_ranks": 3, "min_steps": 2.0, "max_window_seconds": 40.0}


def _cfg(**over):
    return config.load(overrides={"detectors": {"straggler": {**BASE, **over}}})


def _row(ts, job, rank, step, *, slow=False, node="auto", gpu="auto"):
    wait = None if step is None else (0.05 if slow else 0.4) * step + (rank % 3) * 0.01
    return {"ts": ts, "job": job, "rank": rank, "node": f"n{rank}" if node == "auto" else node, "gpu": rank if gpu == "auto" else gpu, "pg": "0",
            "last_enqueued_seq": 1, "last_completed_seq": 1, "current_op": None, "step": 1, "step_time_seconds": step,
            "collective_wait_seconds": wait}  # fmt: skip


def _frame(rows):
    return pl.DataFrame(rows, schema=schemas.RANK_PROGRESS)


def _jobs(starts: dict):
    rows = [{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": s, "n_gpus": 8} for j, s in starts.items()]
    return pl.DataFrame(rows, schema=schemas.JOBS)


def _tick_rows(now, job, step, ranks=4, slow_rank=3, **kw):
    return [_row(now, job, r, step, slow=r == slow_rank, **kw) for r in range(ranks)]


# -- series (each: list of (now, rows, jobs snapshot)) ---------------------------------------------
def one_row_a_tick():
    """Four ranks report in turn, one row a tick (0.25 s ticks): every fresh frame has one row."""
    out = []
    for i in range(1, 81):
        now = 100.0 + 0.25 * i
        r = i % 4
        out.append((now, [_row(now, "j", r, 1.0, slow=r == 3)], {}))
    return out


def whole_seconds():
    """Rows at whole seconds, one a rank a second: exactly 11 rows in [now - 10, now], and
    min_samples 11 (set by the case), so a row exactly window_seconds old decides the finding."""
    return [(float(t), _tick_rows(float(t), "j", 1.0), {}) for t in range(100, 130)]


def node_moves():
    """Whole seconds; at t=112 the slow rank moves to a node not seen before (a new batch of node
    names), and at t=118 rank 0 moves too: the finding names the culprit's newest node."""
    out = []
    for t in range(100, 130):
        rows = _tick_rows(float(t), "j", 1.0)
        if t >= 112:
            rows[3]["node"] = "spare-a"
        if t >= 118:
            rows[0]["node"] = "spare-b"
        out.append((float(t), rows, {}))
    return out


def nulls():
    """Rows without a node (the culprit of job j), without a GPU (a peer of j), and a job without
    a name (hook records from code that named neither, 1 s steps until t=115, 6 s after; rows
    without a job never reach a finding: they have no peers), beside job m (1 s steps, its rows
    after j's in each frame: a node code misplaced by j's null node would show in m's finding)
    and a long-step job k (6 s steps: judged by the refit)."""
    out = []
    for t in range(100, 130):
        now = float(t)
        rows = _tick_rows(now, "j", 1.0)
        rows[3]["node"] = None
        rows[1]["gpu"] = None
        rows += [_row(now, "m", r, 1.0, slow=r == 2, node=f"m{r}") for r in range(4)]
        rows += _tick_rows(now, None, 1.0 if t < 115 else 6.0)
        rows += _tick_rows(now, "k", 6.0)
        out.append((now, rows, {}))
    return out


def look_back_edge():
    """Whole seconds, steps alternating 1 s / 30 s a second, a second without rows every 7 s: on
    some ticks exactly half the steps in the 40 s look-back are short and the oldest second, exactly
    40 s old, is a long one: the median is long (a 31 s window, from the refit), by that one
    second."""
    out = []
    for t in range(100, 190):
        if t % 7 == 3:
            out.append((float(t), [], {}))
            continue
        out.append((float(t), _tick_rows(float(t), "j", 30.0 if t % 2 == 0 else 1.0), {}))
    return out


def requeue():
    """Short steps (1 s) until the job is requeued at t=140, 6 s steps after: the short steps
    before the restart must not count (the job's window is 12 s, from the refit)."""
    out = []
    for t in range(100, 165):
        start = 140.0 if t >= 140 else 50.0
        out.append((float(t), _tick_rows(float(t), "j", 1.0 if t < 140 else 6.0), {"j": start}))
    return out


def switch():
    """Short steps (1 s) until t=140, 6 s steps after, no requeue (the window's history is set
    shorter than the look-back by the case)."""
    return [(float(t), _tick_rows(float(t), "j", 1.0 if t < 140 else 6.0), {}) for t in range(100, 165)]


def old_history():
    """A first batch with 100 s of 30 s steps (all older than the 40 s look-back, late rows), then
    6 s steps: the job's median is over the look-back only (a 12 s window: 13 rows a rank, fewer
    than min_samples 20, no finding); over the whole history it would be 30 s (a 40 s window, a
    finding)."""
    first = [_row(float(t), "j", r, 30.0, slow=r == 3) for t in range(0, 100) for r in range(4)]
    out = [(140.0, first + _tick_rows(140.0, "j", 6.0), {})]
    out += [(float(t), _tick_rows(float(t), "j", 6.0), {}) for t in range(141, 175)]
    return out


def half_short():
    """Steps alternating 0.5 s / 6 s a second (median 3.25 s: the window stays 10 s even when the
    counts cannot prove it), beside a steady 1 s job judged from the rings."""
    out = []
    for t in range(100, 160):
        rows = _tick_rows(float(t), "j", 6.0 if t % 2 == 0 else 0.5) + _tick_rows(float(t), "s", 1.0, slow_rank=1)
        out.append((float(t), rows, {}))
    return out


def _four_ranks_waiting(seconds, *, slow_wait, peer_wait, job="j"):
    """A 4-rank job of 4 s steps, one tick a second: rank 3 waits `slow_wait` per step, its peers `peer_wait`."""
    out = []
    for t in seconds:
        rows = [_row(float(t), job, r, 4.0) for r in range(4)]
        for r in rows:
            r["collective_wait_seconds"] = slow_wait if r["rank"] == 3 else peer_wait
        out.append((float(t), rows, {}))
    return out


def wait_at_the_share():
    """4 s steps; peers wait exactly 2.0 s, the slow rank exactly 0.7 s = max_wait_share (0.35) x
    2.0 (binary-exact products): a wait exactly at the share is flagged."""
    return _four_ranks_waiting(range(100, 120), slow_wait=0.7, peer_wait=2.0)


def ranks_leave_and_join():
    """A 5-rank job (1 s steps, rank 3 slow): rank 4 stops reporting after t=104 (its ring stays,
    with no row in the window), rank 5 first reports at t=120 (one row on that tick: the job waits
    until every rank has min_samples)."""
    out = []
    for t in range(100, 130):
        rows = [_row(float(t), "j", r, 1.0, slow=r == 3) for r in range(5) if r != 4 or t <= 104]
        if t >= 120:
            rows.append(_row(float(t), "j", 5, 1.0))
        out.append((float(t), rows, {}))
    return out


def peers_at_the_floor():
    """4 s steps, min_slowdown 1.05 (set by the case). Job "at": peers wait exactly 0.4 s =
    min_peer_wait_share (0.1) x 4.0 (binary-exact), the slow rank 0.1 s (slowdown 1.083): flagged.
    Job "under": peers wait 0.3 s, below the floor, the slow rank 0.05 s: not flagged."""
    out = []
    for t in range(100, 115):
        rows = []
        for job, peer, slow in (("at", 0.4, 0.1), ("under", 0.3, 0.05)):
            for r in range(4):
                row = _row(float(t), job, r, 4.0)
                row["collective_wait_seconds"] = slow if r == 3 else peer
                rows.append(row)
        out.append((float(t), rows, {}))
    return out


def slowdown_at_the_floor():
    """4 s steps, peers wait 1.0 s, the slow rank 0.25 s: slowdown (4 - 0.25) / (4 - 1) = 1.25
    exactly, and min_slowdown is 1.25 (set by the case): flagged."""
    return _four_ranks_waiting(range(100, 112), slow_wait=0.25, peer_wait=1.0)


# name: (series, config, window horizon, whether the refit raises findings on it)
CASES = {
    "one row a tick": (one_row_a_tick, {}, 1e9, True),
    "row exactly window_seconds old": (whole_seconds, {"min_samples": 11}, 1e9, True),
    "a rank moves to a new node": (node_moves, {"min_samples": 11}, 1e9, True),
    "rows without node, GPU or job": (nulls, {"min_samples": 11}, 1e9, True),
    "a row exactly at the look-back's edge": (look_back_edge, {"min_samples": 15}, 1e9, True),
    "a requeue": (requeue, {"min_samples": 12}, 1e9, True),
    "history shorter than the look-back": (switch, {"min_samples": 12}, {"default": 1e9, "rank_progress": 25.0}, True),
    "history older than the look-back": (old_history, {"min_samples": 20}, 1e9, False),
    "half the steps short": (half_short, {"min_samples": 11}, 1e9, True),
    "a wait exactly max_wait_share of the peers'": (wait_at_the_share, {}, 1e9, True),
    "ranks leave and join": (ranks_leave_and_join, {}, 1e9, True),
    "peers waiting exactly min_peer_wait_share of the step": (peers_at_the_floor, {"min_slowdown": 1.05}, 1e9, True),
    "a slowdown exactly min_slowdown": (slowdown_at_the_floor, {"min_slowdown": 1.25}, 1e9, True),
}


def _dicts(findings):
    return [f.to_json_dict() for f in findings]


@pytest.mark.parametrize("name", list(CASES))
def test_findings_are_the_refits_however_the_detector_is_fed(name):
    series, over, horizon, raises = CASES[name]
    cfg = _cfg(**over)
    ticks = [(now, _frame(rows), _jobs(starts)) for now, rows, starts in series()]
    positives = check_against_refit(lambda: StragglerDetector(cfg), lambda: RefitStraggler(cfg), "rank_progress", ticks, horizon, rebuilt_every=((2, 0), (3, 1)), label=f"{name}: ")
    assert (positives > 0) == raises  # where it raises findings the comparison is not of two empty lists


# -- O(new rows) per tick ----------------------------------------------------------------------------
def _counting(det, monkeypatch):
    calls = {"reset": 0, "refit": 0}
    reset, refit = det._reset, det._per_rank_refit

    def count_reset():
        calls["reset"] += 1
        reset()

    def count_refit(*a):
        calls["refit"] += 1
        return refit(*a)

    monkeypatch.setattr(det, "_reset", count_reset)
    monkeypatch.setattr(det, "_per_rank_refit", count_refit)
    return calls


def test_a_steady_tick_folds_in_its_rows_without_rebuilding(monkeypatch):
    """Constructed: one 4-rank job with 1 s steps, a tick a second. After the first tick (which
    builds the rings from the window) every tick takes the incremental path, a second ingest of the
    same tick does nothing, and the job (median step provably short) is never refitted."""
    cfg = _cfg()
    det, w = StragglerDetector(cfg), Window(1e9)
    calls = _counting(det, monkeypatch)
    for t in range(100, 140):
        w.add("rank_progress", _frame(_tick_rows(float(t), "j", 1.0)))
        w.add("jobs", _jobs({}))
        w.seal(float(t))
        det.ingest(w)
        det.ingest(w)
        if t % 5 == 0:
            found = det.detect(w)
            assert _dicts(found) == _dicts(RefitStraggler(cfg).detect(w))
    assert calls == {"reset": 1, "refit": 0}
    assert [f.culprit_ranks for f in found] == [[3]]


def _rows_short_long(now, short, long_, step=1.0):
    """A 4-rank job whose rows in one tick have `short` steps of `step` and `long_` of 30 s."""
    rows = []
    for i in range(short + long_):
        rows.append(_row(now - 0.01 * i, "j", i % 4, step if i < short else 30.0, slow=i % 4 == 3))
    return rows


def _ticks_single(rows, starts=None):
    return [(200.0, rows, starts or {})]


def _ticks_after_a_minute():
    """60 s of 1 s steps, a tick a second (the detector is called once, at the end: rebuilt)."""
    return [(float(t), _tick_rows(float(t), "j", 1.0), {}) for t in range(100, 160)]


PATH_CASES = {
    # min_steps x 5.0 s == window_seconds: the job's window is window_seconds.
    "every step exactly at the bound": ([(float(t), _tick_rows(float(t), "j", 5.0), {}) for t in range(100, 130)], "every"),
    # Median short by one row: 2 short of 3, 10 short of 19.
    "two short steps of three": (_ticks_single(_rows_short_long(200.0, 2, 1)), "last"),
    "ten short steps of nineteen": (_ticks_single(_rows_short_long(200.0, 10, 9)), "last"),
    # Requeued after its last row: nothing of its current run to judge.
    "a requeued job with no rows since its restart": (_ticks_single(_rows_short_long(200.0, 3, 5), {"j": 250.0}), "last"),
    "a minute of short steps, rebuilt from the window": (_ticks_after_a_minute(), "last"),
}


@pytest.mark.parametrize("name", list(PATH_CASES))
def test_a_job_with_a_provably_short_median_step_is_judged_from_the_rings(name, monkeypatch):
    """Constructed: jobs whose median step is short (their window is window_seconds) never take
    the refit, whether fed every tick or rebuilt from the window once; findings are the refit's."""
    ticks, when = PATH_CASES[name]
    cfg = _cfg()
    det, w = StragglerDetector(cfg), Window(1e9)
    calls = _counting(det, monkeypatch)
    for i, (now, rows, starts) in enumerate(ticks):
        w.add("rank_progress", _frame(rows))
        w.add("jobs", _jobs(starts))
        w.seal(now)
        if when == "every" or i == len(ticks) - 1:
            assert _dicts(det.detect(w)) == _dicts(RefitStraggler(cfg).detect(w))
    assert calls["refit"] == 0


# -- rings of jobs gone long ago --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gone", "edge", "live", "kept"),
    [
        (4096, 0, 1, 4097),  # 4,096 stale keys: not more than the bound, kept
        (4096, 1, 1, 4098),  # plus one whose newest row is exactly keep_from: not stale
        (4097, 0, 1, 1),  # 4,097 stale, more than the live: start over with the live key only
        (4097, 0, 4098, 8195),  # 4,097 stale but fewer than the live: kept
    ],
)
def test_rings_of_jobs_gone_long_ago_are_dropped_past_the_bound(gone, edge, live, kept):
    """Constructed: at t=100 `gone` ranks of a job report once and stop, `edge` ranks report at
    t=101; `live` ranks report at 100 and 111. At t=111 (keep_from = 111 - 10 = 101) the rings are
    rebuilt from the window (only keys with rows since keep_from) exactly when the stale keys are
    more than 4,096 and more than the others."""
    cfg = _cfg()
    det, w = StragglerDetector(cfg), Window(1e9)
    first = [_row(100.0, "gone", r, 1.0) for r in range(gone)] + [_row(100.0, "live", r, 1.0) for r in range(live)]
    for now, rows in ((100.0, first), (101.0, [_row(101.0, "edge", r, 1.0) for r in range(edge)]), (111.0, [_row(111.0, "live", r, 1.0) for r in range(live)])):
        if rows:
            w.add("rank_progress", _frame(rows))
        w.add("jobs", _jobs({}))
        w.seal(now)
        det.ingest(w)
    assert det._ring.n == kept


# -- the finding ----------------------------------------------------------------------------------
def test_the_finding_names_every_culprit_slowest_first_with_its_figures():
    """Constructed: two 9-rank jobs, 2.00004 s steps, peers waiting 1.00004 s. Job a: ranks 1 and 4
    wait 0.123456 s (slowdown (2.00004 - 0.123456) / (2.00004 - 1.00004) = 1.876584), rank 7
    waits 0.25 s (1.75004); job b: rank 2 waits 0.3 s (1.70004). Job b's rows come first in
    every frame. One finding a job, jobs in name order; culprits slowest first, ties by rank; the
    node and GPU of the slowest; figures rounded (slowdown to 3 places, seconds to 4)."""
    det, w = StragglerDetector(_cfg()), Window(1e9)
    waits = {"a": {1: 0.123456, 4: 0.123456, 7: 0.25}, "b": {2: 0.3}}
    for t in range(100, 112):
        rows = []
        for job in ("b", "a"):
            for r in range(9):
                row = _row(float(t), job, r, 2.00004)
                row["collective_wait_seconds"] = waits[job].get(r, 1.00004)
                rows.append(row)
        w.add("rank_progress", _frame(rows))
        w.add("jobs", _jobs({}))
        w.seal(float(t))
        found = det.detect(w)
    got = [{k: v for k, v in f.to_json_dict().items() if k != "id"} for f in found]
    common = {"kind": "straggler", "severity": "ticket", "ts": 111.0, "xid": None, "source": "straggler", "cause": None}
    assert got == [
        {**common, "job": "a", "ranks": [1, 4, 7], "culprit_ranks": [1, 4, 7], "node": "n1", "gpu": 1,
         "evidence": {"slowdown": 1.877, "rank_wait_seconds": 0.1235, "peer_wait_seconds": 1.0, "step_time_seconds": 2.0, "ranks_in_job": 9},
         "summary": "a rank 1 (n1 GPU 1) computes 88% slower than its 8 peers, who wait 1.00 s per 2.00 s step for it."},
        {**common, "job": "b", "ranks": [2], "culprit_ranks": [2], "node": "n2", "gpu": 2,
         "evidence": {"slowdown": 1.7, "rank_wait_seconds": 0.3, "peer_wait_seconds": 1.0, "step_time_seconds": 2.0, "ranks_in_job": 9},
         "summary": "b rank 2 (n2 GPU 2) computes 70% slower than its 8 peers, who wait 1.00 s per 2.00 s step for it."},
    ]  # fmt: skip
    assert _dicts(found) == _dicts(RefitStraggler(_cfg()).detect(w))


# -- a bug found by this round (fixed in straggler.py, oom.py, fragmentation_allocator.py and hang.py) --
def test_a_culprit_whose_rows_carry_no_gpu_is_reported_without_one():
    """Constructed: the hook emits `gpu` null for a record without one (collectors/hook.py:
    rows_from_record), and jobjoin can fill a job and rank but not a GPU. The slow rank's rows
    have no GPU: the finding should name the rank and its node with `gpu` None (Finding.gpu is
    optional; a null node is reported as None already). Before the fix detect() raised TypeError at
    `gpu=int(w["gpu"])` on the tick the rank was first flagged, so the detector reported nothing."""
    det, w = StragglerDetector(_cfg()), Window(1e9)
    found = []
    for t in range(100, 115):
        rows = _tick_rows(float(t), "j", 1.0)
        rows[3]["gpu"] = None
        w.add("rank_progress", _frame(rows))
        w.add("jobs", _jobs({}))
        w.seal(float(t))
        found = det.detect(w) or found
    assert [(f.culprit_ranks, f.node, f.gpu) for f in found] == [([3], "n3", None)]
    assert found[0].summary.startswith("j rank 3 (n3) computes")
