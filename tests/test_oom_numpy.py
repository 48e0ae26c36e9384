"""The `oom` detector's numpy per-key state (gpuvigil/detectors/oom.py) against the from-scratch
refit (tests/incremental_oracles.py: RefitOom) over the rows the detector was shown (`Shown`:
every row of every tick it saw in turn, even those the pipeline's window has dropped since; after
a rebuild, what the window holds): identical findings
(`to_json_dict`, evidence and summary included) on every tick, for each way the pipeline may call
a detector: detect() every tick; ingest() on ticks not due and detect() every 3rd; detect() only
every k-th tick with nothing between (which forces the rebuild path).

Streams are table-driven scenarios (requeues, jobs gone and new, keys that stop, late and
out-of-order rows, equal timestamps, missed ticks, time jumps, duplicates, nulls, ranks moving)
and a hypothesis-driven stream. Times lie on a 1/4 s grid and byte counts are whole MiB, so every
sum is exact in float64 whatever the order it is added in (the refit's group_by and the numpy
bincount add in different orders): the comparisons are equalities, no tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil import config, schemas
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.window import Window

sys.path.insert(0, str(Path(__file__).parent))
from hyp import examples  # noqa: E402
from incremental_oracles import refit_oom  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
CAP = 80 * GIB

BASE = {"fit_window_seconds": 30.0, "warmup_seconds": 4.0, "min_samples": 6, "min_span_seconds": 8.0, "min_r2": 0.3, "min_rise_bytes": 64 * MIB, "predict_horizon_seconds": 1e7}
CONFIGS = {
    "blocks": {**BASE, "lookback_blocks": 6, "block_slack_seconds": 3.0},
    "no_blocks": {**BASE, "lookback_blocks": 0},
    "default": {"predict_horizon_seconds": 1e7, "min_rise_bytes": 256 * MIB},
}


def _cfg(name: str):
    return config.load(overrides={"detectors": {"oom": CONFIGS[name]}})


def _window(det: OomPredictor, whole: bool) -> Window:
    """The pipeline's window (only the declared history of allocator_stats), or one keeping all."""
    ((stream, seconds),) = det.lookback_seconds().items()
    return Window(1e9) if whole else Window({stream: seconds, "default": 600.0})


def compare(cfg_name: str, ticks, whole: bool = False, sparse=((4, 0), (5, 2))) -> int:
    """Feed `ticks` ((now, rows, jobs) each) to pairs (numpy, refit) called the same way; every
    call must give the same findings. Returns the number of ticks with findings."""
    cfg = _cfg(cfg_name)
    pairs = [("every", None, OomPredictor(cfg), refit_oom(cfg)), ("ingested", None, OomPredictor(cfg), refit_oom(cfg))]
    pairs += [(f"every {p}", (p, q), OomPredictor(cfg), refit_oom(cfg)) for p, q in sparse]
    w = _window(pairs[0][2], whole)
    positives = 0
    for i, (now, rows, jobs) in enumerate(ticks):
        if rows.height:
            w.add("allocator_stats", rows)
        w.add("jobs", jobs)
        w.seal(now)
        for label, period, new, old in pairs:
            if period is not None and i % period[0] != period[1]:
                continue
            if label == "ingested" and i % 3:
                new.ingest(w)
                old.ingest(w)
                continue
            want = [f.to_json_dict() for f in old.detect(w)]
            got = [f.to_json_dict() for f in new.detect(w)]
            assert got == want, f"{cfg_name} tick {i} at {now} ({label})"
            if label == "every":
                positives += bool(want)
    return positives


def _row(now: float, job: str, rank: int, i: int, kind: str, **over) -> dict:
    """One allocator sample of a rank whose footprint grows by `kind` (leak: allocated peaks;
    frag: reserved - allocated, with retries; foreign: another process; flat)."""
    base = (20 + 2 * rank) * GIB
    grow = 64 * MIB * i
    peak = base + (grow if kind == "leak" else 0)
    gap = 256 * MIB + (grow if kind == "frag" else 0)
    row = {
        "ts": now, "job": job, "rank": rank, "node": f"n{rank // 2}", "gpu": rank % 2,
        "allocated_bytes": peak - GIB, "reserved_bytes": peak + gap, "inactive_split_bytes": gap // 2, "largest_free_block_bytes": 64 * MIB,
        "peak_allocated_bytes": peak, "alloc_retries": i // 5 if kind == "frag" else 0, "oom_count": 0, "device_capacity_bytes": CAP,
        "foreign_used_bytes": (grow if kind == "foreign" else None),
    }  # fmt: skip
    row.update(over)
    return row


KINDS = {("a", 0): "flat", ("a", 1): "leak", ("a", 2): "frag", ("a", 3): "flat", ("b", 0): "foreign", ("b", 1): "leak", ("c", 0): "leak"}


def _jobs(starts: dict[str, float | None]) -> pl.DataFrame:
    return pl.DataFrame([{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": s, "n_gpus": 8} for j, s in starts.items()], schema=schemas.JOBS)


def scenario(name: str, t0: float = 1_700_000_000.0, n: int = 90):
    """A named stream of ticks: the fleet of KINDS, one row per key per second, and one twist."""
    rng = np.random.default_rng(sum(map(ord, name)))
    ticks = []
    now = t0
    for i in range(n):
        dt = 1.0
        if name == "missed_tick" and i in (30, 31, 55):
            dt = 7.0 if i != 31 else 2.5
        if name == "time_jump" and i == 45:
            dt = 200.0
        now += dt
        starts: dict[str, float | None] = {"a": t0, "b": t0, "c": t0}
        if name == "requeue" and i >= 40:
            starts["a"] = t0 + 39.5
        if name == "job_gone" and 30 <= i < 60:
            del starts["b"]
        if name == "new_job":
            if i < 25:
                del starts["c"]  # rows arrive before the scheduler lists the job
            if i >= 35:
                starts["d"] = t0 + 35
        rows = []
        for (job, rank), kind in KINDS.items():
            if name == "new_job" and job == "d":
                continue
            if name == "rows_stop" and rank == 3 and 20 <= i < 70:
                continue
            if name == "rows_stop" and job == "c" and i >= 40:
                continue
            over = {}
            if name == "moves" and i >= 40 and rank == 1:
                over = {"node": "n9", "gpu": 7}
            if name == "nulls":
                pick = (i + rank) % 7
                over = [{"reserved_bytes": None}, {"peak_allocated_bytes": None}, {"alloc_retries": None}, {"device_capacity_bytes": None},
                        {"node": None}, {"gpu": None}, {"foreign_used_bytes": None}][pick] if i % 3 == 0 else {}  # fmt: skip
                if i == n - 1 and rank == 1:
                    over = {"device_capacity_bytes": None}
            if "reserved_bytes" in over or "peak_allocated_bytes" in over:
                # Null on a sample older than the tick's: the refit (and the numpy code) fails
                # on a finding whose newest sample lacks reserved - allocated (int(None)).
                rows.append(_row(now - 0.75, job, rank, i, kind, **over))
                over = {}
            if name == "equal_ts" and rank == 1 and i % 4 == 3:
                over["ts"] = now - 1.0  # the previous tick's newest ts again: the later arrival is the newest
            rows.append(_row(now, job, rank, i, kind, **over))
            if name == "late_rows" and i % 4 == 1:
                rows.append(_row(now - 3.25, job, rank, i - 3, kind))  # older than the previous tick
            if name == "equal_ts" and "ts" not in over:
                rows.append(_row(now, job, rank, i + (1 if i % 2 else -1), kind))
            if name == "duplicates" and i % 3 == 0:
                rows.append(dict(rows[-1]))
        if name == "new_job" and i >= 30:
            for rank in range(2):
                rows.append(_row(now, "d", rank, i - 30, "leak"))
        if name == "late_rows":
            rows = [rows[j] for j in rng.permutation(len(rows))]  # out of order within the tick
        ticks.append((now, pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS), _jobs(starts)))
    return ticks


SCENARIOS = ["plain", "requeue", "job_gone", "new_job", "rows_stop", "late_rows", "equal_ts", "missed_tick", "time_jump", "duplicates", "nulls", "moves"]


@pytest.mark.parametrize("cfg_name", ["blocks", "no_blocks"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_gives_the_refit_findings_on_every_tick(name, cfg_name):
    positives = compare(cfg_name, scenario(name))
    assert positives > 10, "leaking and fragmenting ranks must be found"


@pytest.mark.parametrize("name", ["plain", "requeue", "late_rows", "time_jump"])
def test_scenario_over_a_window_keeping_everything(name):
    assert compare("blocks", scenario(name), whole=True) > 10


def test_default_config_long_run_with_findings():
    """The shipped config (90 s fit, 18 blocks of 5 s), long enough for blocks to leave."""
    assert compare("default", scenario("late_rows", n=200), sparse=((7, 3),)) > 50


def test_keys_of_finished_jobs_are_dropped_and_the_rest_renumbered():
    """Job churn: each job lives 20 ticks; the key table is compacted when dead keys outnumber
    live ones (and 1024), and findings stay the refit's across compactions."""
    cfg = _cfg("blocks")
    new, old = OomPredictor(cfg), refit_oom(cfg)
    w = _window(new, False)
    now, positives, compactions, seen = 1000.0, 0, 0, 0
    for i in range(160):
        now += 1.0
        jobs = [f"j{(i // 20) * 2 + x}" for x in range(2)]
        rows = [_row(now, j, r, i % 20 + 10, "leak" if r % 7 == 1 else "flat") for j in jobs for r in range(700)]
        w.add("allocator_stats", pl.DataFrame(rows, schema=schemas.ALLOCATOR_STATS))
        w.add("jobs", _jobs({j: None for j in jobs}))
        w.seal(now)
        want = [f.to_json_dict() for f in old.detect(w)]
        assert [f.to_json_dict() for f in new.detect(w)] == want, f"tick {i}"
        positives += bool(want)
        compactions += new._keys.n < seen
        seen = new._keys.n
    assert positives > 0 and compactions > 0


@st.composite
def stream(draw):
    """Ticks with random steps (some past the slack or the look-back), rows late, tied, doubled,
    null, missing, ranks moving, jobs requeued, gone and new."""
    t0 = draw(st.sampled_from([0.0, 1_700_000_000.0]))
    keys = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)][: draw(st.integers(1, 5))]
    kinds = {k: draw(st.sampled_from(["leak", "leak", "frag", "foreign", "flat"])) for k in keys}
    starts: dict[str, float | None] = {j: draw(st.sampled_from([None, t0, t0 + 3.0])) for j in {k[0] for k in keys}}
    ticks, now, i = [], t0, 0
    for _ in range(draw(st.integers(5, 70))):
        now += draw(st.sampled_from([1.0, 1.0, 1.0, 0.25, 2.0, 4.5, 60.0]))
        i += 1
        if draw(st.integers(0, 15)) == 0:
            j = draw(st.sampled_from(sorted(starts)))
            starts[j] = draw(st.sampled_from([None, now - 2.0, t0]))  # requeued, unknown
        listed = {j: s for j, s in starts.items() if draw(st.integers(0, 20))}  # sometimes gone
        rows = []
        for k in keys:
            for _ in range(draw(st.sampled_from([0, 1, 1, 1, 1, 2, 3]))):
                ts = now - 0.25 * draw(st.sampled_from([0, 0, 0, 1, 4, 13]))
                over: dict = {}
                if draw(st.integers(0, 9)) == 0:
                    over[draw(st.sampled_from(["reserved_bytes", "peak_allocated_bytes", "foreign_used_bytes", "alloc_retries", "device_capacity_bytes", "node", "gpu"]))] = None
                if "reserved_bytes" in over or "peak_allocated_bytes" in over:
                    # Not on the key's newest sample (see scenario "nulls"): older, and a full one at now.
                    ts = now - 0.25 * draw(st.sampled_from([1, 4, 13]))
                    rows.append(_row(now, k[0], k[1], i, kinds[k]))
                if draw(st.integers(0, 30)) == 0:
                    over.update(node="nX", gpu=5)
                jitter = draw(st.integers(-2, 2)) * MIB
                r = _row(ts, k[0], k[1], i, kinds[k], **over)
                if r["peak_allocated_bytes"] is not None:
                    r["peak_allocated_bytes"] += jitter
                rows.append(r)
        order = draw(st.permutations(range(len(rows))))
        ticks.append((now, pl.DataFrame([rows[j] for j in order], schema=schemas.ALLOCATOR_STATS), _jobs(listed)))
    return ticks


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stream(), st.sampled_from(["blocks", "no_blocks"]), st.booleans())
def test_random_stream_gives_the_refit_findings_on_every_tick(ticks, cfg_name, whole):
    compare(cfg_name, ticks, whole=whole, sparse=((3, 1),))

