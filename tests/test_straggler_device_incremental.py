"""The L0 straggler keeps one ring of samples per allocated GPU (O(new rows) per tick); it must
report exactly the findings of the refit over the window it replaced (`RefitDeviceStraggler`
below: the detector's `detect` as it was, verbatim) on the same rows, every tick.

Both run over one real Window, each with its own Persistence, through table-driven scenarios: a
host-side lag, a device-side clock lag, a hang (util pinned, power collapsed), idle GPUs (and a
GPU at 0 W: 0 / 0), the warm-up boundary, a job's start moving, allocations changing (a job's GPUs
given to a new job, a GPU listed for two jobs, a GPU dropped, an empty snapshot), ticks not due
(ingest only), skipped ticks (rebuild from the window), time jumping forward and back, GPUs
appearing and going silent, null util/clock/power, 0-2 rows a tick (even and odd counts), late
rows and rows exactly at the look-back's, the recent past's and the warm-up's edges. The cases
where the two may differ (gpuvigil/detectors/straggler_device.py, module docstring) are left out:
a GPU listed for a running job whose earlier rows pass the job's warm-up filter.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.common import Persistence, rank_at, settings
from gpuvigil.detectors.straggler_device import DeviceStragglerDetector, StragglerDeviceConfig, _sorted_median, _sorted_quantile
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window


class RefitDeviceStraggler:
    """The refit over the window, as straggler_device.py computed it before its rings (verbatim)."""

    name = "straggler_device"

    def __init__(self, cfg=None):
        self.config = settings("straggler_device", StragglerDeviceConfig, cfg)
        self._persistence = Persistence()

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        gs = window.get("gpu_samples").filter(pl.col("ts") >= now - c.window_seconds)
        alloc = window.get("allocations").select("job", "rank", "node", "gpu")
        if gs.height == 0 or alloc.height == 0:
            return []
        jobs = window.get("jobs")
        df = gs.select("ts", "node", "gpu", "util_ratio", "sm_clock_mhz", "power_w").join(alloc, on=["node", "gpu"], how="inner")
        if jobs.height:
            df = df.join(jobs.select("job", pl.col("start_ts").alias("_s")), on="job", how="left").filter(pl.col("_s").is_null() | (pl.col("ts") >= pl.col("_s") + 30.0))
        per = df.group_by(["job", "rank", "node", "gpu"]).agg(
            pl.len().alias("n"),
            pl.col("util_ratio").mean().alias("util"),
            (pl.col("util_ratio") < 0.1).mean().alias("idle_share"),
            pl.col("sm_clock_mhz").filter(pl.col("util_ratio") >= 0.5).median().alias("clock"),
            (pl.col("power_w").filter(pl.col("ts") >= now - c.recent_seconds).median() / pl.col("power_w").quantile(0.9)).alias("recent_power_share"),
            pl.col("util_ratio").filter(pl.col("ts") >= now - c.recent_seconds).median().alias("recent_util"),
        )
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
            & (pl.col("min_n") >= c.min_samples)
            & (pl.col("pinned_share") < 0.5)  # most GPUs pinned for the whole recent past: a hang, not a straggler
            & (pl.col("idle_share") <= c.max_idle_share)
            & (
                ((pl.col("util_lag") >= c.min_util_lag) & (pl.col("peer_util") >= c.min_peer_util))
                | (pl.col("clock_lag") >= c.min_clock_lag).fill_null(False)
            )
        )
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
                        "window_seconds": c.window_seconds,
                    },
                    summary=f"{w['job']} {rank_at(w['rank'], w['node'], w['gpu'])} is a straggler (L0): {why}.",
                )
            )
        return findings


SMALL = {"window_seconds": 20.0, "min_samples": 8, "min_gpus": 3, "persist_evaluations": 2, "recent_seconds": 6.0, "history_recent_seconds": None}
HEALTHY = {"util_ratio": 0.97, "sm_clock_mhz": 1965.0, "power_w": 450.0}
SLOW_HOST = {"util_ratio": 0.55, "sm_clock_mhz": 1965.0, "power_w": 300.0}
SLOW_CLOCK = {"util_ratio": 0.97, "sm_clock_mhz": 1485.0, "power_w": 520.0}
IDLE = {"util_ratio": 0.05, "sm_clock_mhz": 600.0, "power_w": 0.0}
PINNED = {"util_ratio": 1.0, "sm_clock_mhz": 1965.0, "power_w": 80.0}


def _cfg(**over):
    return config.load(overrides={"detectors": {"straggler_device": {**SMALL, **over}}})


def _jobs_frame(starts: dict[str, float | None]) -> pl.DataFrame:
    rows = [{**dict.fromkeys(schemas.JOBS), "job": j, "state": "running", "start_ts": s, "n_gpus": 4} for j, s in starts.items()]
    return pl.DataFrame(rows, schema=schemas.JOBS)


def _alloc_frame(alloc: dict[tuple[str, int], list[tuple[str, int]]]) -> pl.DataFrame:
    rows = [{"job": j, "rank": r, "node": n, "gpu": g} for (n, g), owners in alloc.items() for j, r in owners]
    return pl.DataFrame(rows, schema=schemas.ALLOCATIONS)


# name → what happens (see _ticks); `found`: the scenario must produce findings (not vacuous).
SCENARIOS = {
    "host_lag": {"slow": {("n0", 2): SLOW_HOST}, "found": True},
    "clock_lag": {"slow": {("n1", 1): SLOW_CLOCK}, "found": True},
    "clock_lag_nulls_jitter": {"slow": {("n1", 1): SLOW_CLOCK}, "p_null": 0.15, "rows_per_tick": [0, 1, 1, 2, 2], "late": 0.1, "found": True},
    "hang": {"slow": {("n1", 1): SLOW_CLOCK}, "hang_from": 25, "found": True},
    "idle": {"slow": {("n0", 1): IDLE, ("n0", 2): {**HEALTHY, "util_ratio": [0.05, 0.97]}, ("n1", 3): SLOW_HOST}, "found": True},
    "warm_up_edge": {"slow": {("n0", 2): SLOW_CLOCK}, "start": {"a": 2.0, "b": -100.0}, "found": True},
    "start_moves": {"slow": {("n0", 2): SLOW_CLOCK, ("n1", 2): SLOW_HOST}, "start_at": {20: ("a", 12.0), 34: ("a", -50.0), 40: ("b", None), 50: ("b", 45.0)}, "found": True},
    "realloc": {"slow": {("n1", 2): SLOW_CLOCK, ("n2", 1): SLOW_CLOCK}, "realloc_at": 30, "shared": True, "found": True},
    "appear_disappear": {"slow": {("n0", 2): SLOW_HOST}, "appear_at": {18: ("n3", 0, 4), 42: ("n3", 1, 5)}, "silent_gpu_at": 25, "drop_gpu_at": 40, "empty_alloc": (30, 33), "found": True},
    "not_due_and_skipped": {"slow": {("n0", 2): SLOW_CLOCK, ("n1", 3): SLOW_HOST}, "every": 3, "skip": {22, 23, 47}, "p_null": 0.1, "found": True},
    "time_jumps": {"slow": {("n1", 1): SLOW_CLOCK}, "jump_at": {30: 27.0, 45: 9.5}, "back_at": 52, "silence": (58, 82), "found": True},
}


def _ticks(spec: dict, seed: int):
    """(now, frames, mode) per tick: mode 'detect', 'ingest' (not due) or 'skip' (no call).

    Jobs a (GPUs n0:0-3) and b (n1:0-3), started long ago unless `start` says; n2:0-3 sample
    unallocated until `realloc_at` gives them with b's GPUs to a new job c started then; one
    sample a second at the tick's integer time, some late (`late`), 0-2 a tick (`rows_per_tick`).
    """
    rng = np.random.default_rng(seed)
    gpus = [(n, g) for n in ("n0", "n1", "n2") for g in range(4)]
    alloc = {("n0", g): [("a", g)] for g in range(4)} | {("n1", g): [("b", g)] for g in range(4)}
    starts: dict[str, float | None] = {"a": -100.0, "b": -100.0, **spec.get("start", {})}
    silent: set[tuple[str, int]] = set()
    now = 0.0
    for t in range(1, 91):
        now += spec.get("jump_at", {}).get(t, 1.0)
        if t == spec.get("back_at"):
            now -= 3.0
        if t in spec.get("start_at", {}):
            job, s = spec["start_at"][t]
            starts[job] = s
        if t == spec.get("realloc_at"):
            for g in range(4):
                alloc[("n2", g)] = [("c", g)]
                alloc[("n1", g)] = [("c", 4 + g)]
            starts["c"] = now
            starts.pop("b")
            if spec.get("shared"):
                alloc[("n0", 3)] = [("a", 3), ("c", 8)]  # one GPU listed for two jobs (c's start masks its past)
        if t in spec.get("appear_at", {}):
            n, g, rank = spec["appear_at"][t]
            gpus.append((n, g))  # a new GPU for job a: its first sample and its listing come together
            alloc[(n, g)] = [("a", rank)]
        if t == spec.get("silent_gpu_at"):
            silent.add(("n1", 1))  # still listed, its rows age out
        if t == spec.get("drop_gpu_at"):
            alloc.pop(("n0", 3))
        rows = []
        silence = spec.get("silence")
        if not (silence and silence[0] <= t < silence[1]):
            for n, g in gpus:
                if (n, g) in silent:
                    continue
                for _ in range(int(rng.choice(spec.get("rows_per_tick", [1])))):
                    v = dict(spec.get("slow", {}).get((n, g), HEALTHY))
                    if isinstance(v["util_ratio"], list):
                        v["util_ratio"] = v["util_ratio"][t % 2]
                    if spec.get("hang_from") and t >= spec["hang_from"] and (n, g) in alloc and alloc[(n, g)][0][0] == "b":
                        v = dict(PINNED)
                    v["util_ratio"] = min(1.0, v["util_ratio"] + int(rng.integers(-2, 3)) * 0.01)
                    v["sm_clock_mhz"] += int(rng.integers(-3, 4)) * 10
                    v["power_w"] = max(0.0, v["power_w"] + int(rng.integers(-4, 5)) * 5) if v["power_w"] else 0.0
                    for k in ("util_ratio", "sm_clock_mhz", "power_w"):
                        if spec.get("p_null") and rng.random() < spec["p_null"]:
                            v[k] = None
                    ts = now
                    if spec.get("late") and rng.random() < spec["late"]:
                        ts = now - int(rng.integers(1, 26))  # some past the look-back already
                    rows.append({"ts": ts, "node": n, "gpu": g, **v})
        empty = spec.get("empty_alloc")
        frames = {
            "gpu_samples": schemas.frame([{"memory_total_bytes": 80 << 30, **r} for r in rows], schemas.GPU_SAMPLES),
            "allocations": _alloc_frame({} if empty and empty[0] <= t < empty[1] else alloc),
            "jobs": _jobs_frame(starts),
        }
        every = spec.get("every", 1)
        mode = "skip" if t in spec.get("skip", ()) else ("detect" if t % every == 0 else "ingest")
        yield now, frames, mode


def _dump(findings: list[Finding]) -> list[dict]:
    return [f.model_dump() for f in findings]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_rings_find_what_the_refit_finds_every_tick(name, seed):
    spec = SCENARIOS[name]
    cfg = _cfg()
    inc, ref = DeviceStragglerDetector(cfg), RefitDeviceStraggler(cfg)
    w = Window(60.0)
    found = 0
    for now, frames, mode in _ticks(spec, seed):
        for stream, df in frames.items():
            w.add(stream, df)
        w.seal(now)
        if mode == "ingest":
            inc.ingest(w)
        elif mode == "detect":
            got, want = _dump(inc.detect(w)), _dump(ref.detect(w))
            assert got == want, f"{name} seed {seed}, t={now}: rings {got} != refit {want}"
            found += len(want)
    assert found or not spec["found"], f"{name}: no finding, the comparison proves little"


def test_rings_match_the_refit_on_the_shipped_config():
    """The shipped thresholds (90 s look-back, 20 samples, 3 evaluations): a clock lag found."""
    cfg = config.load(overrides={"detectors": {"straggler_device": {"history_recent_seconds": None}}})
    inc, ref = DeviceStragglerDetector(cfg), RefitDeviceStraggler(cfg)
    w = Window(120.0)
    found = 0
    spec = {"slow": {("n1", 1): SLOW_CLOCK}, "p_null": 0.05, "rows_per_tick": [1, 1, 2], "start_at": {60: ("a", 40.0)}}
    for now, frames, mode in _ticks(spec, 3):
        for stream, df in frames.items():
            w.add(stream, df)
        w.seal(now)
        got, want = _dump(inc.detect(w)), _dump(ref.detect(w))
        assert got == want, f"t={now}: rings {got} != refit {want}"
        found += len(want)
    assert found


@pytest.mark.parametrize("n", range(0, 12))
def test_sorted_median_and_nearest_quantile_are_polars(n):
    rng = np.random.default_rng(n)
    values = rng.choice([1.0, 2.0, 2.5, 7.0, 300.0, np.nan], size=(40, 12))
    ok = rng.random((40, 12)) < (n / 11)
    ok &= ~np.isnan(values)  # the callers leave NaN (null) out
    med, cnt = _sorted_median(values, ok)
    q, _ = _sorted_quantile(values, ok, 0.9)
    for i in range(values.shape[0]):
        s = pl.Series([None if np.isnan(v) else float(v) for v in values[i][ok[i]]], dtype=pl.Float64)
        want_med, want_q = s.median(), s.quantile(0.9)
        assert cnt[i] == s.count()
        assert (np.isnan(med[i]) and want_med is None) or med[i] == want_med
        assert (np.isnan(q[i]) and want_q is None) or q[i] == want_q



@pytest.mark.parametrize("n", range(0, 12))
def test_float32_rows_give_polars_float64_median(n):
    """exact32 (every value a float32 value, as whole MHz clocks are): the sort runs on float32
    rows, and the midpoint of an even count is still polars' float64 one (0.1f and 0.3f: their
    float32 midpoint rounds differently)."""
    rng = np.random.default_rng(100 + n)
    values = rng.choice(np.array([0.1, 0.3, 1410.0, 1980.0, 7.25, 1e-3], np.float32).astype(np.float64), size=(40, 12))
    ok = rng.random((40, 12)) < max(n, 1) / 11
    med64, cnt64 = _sorted_median(values, ok)
    med32, cnt32 = _sorted_median(values, ok, exact32=True)
    assert (cnt32 == cnt64).all()
    assert np.array_equal(med32, med64, equal_nan=True)
    for i in range(values.shape[0]):
        want = pl.Series(values[i][ok[i]], dtype=pl.Float64).median()
        assert (np.isnan(med32[i]) and want is None) or med32[i] == want


@pytest.mark.parametrize("clock", [1410.0, 1410.1])
def test_clock_median_sorts_float32_only_while_every_clock_is_one(clock):
    """Whole-MHz clocks keep the float32 sort; one clock that is no float32 value (1410.1) turns it
    off until the next reset, and the findings stay the refit's either way."""
    det, ref = DeviceStragglerDetector(_cfg()), RefitDeviceStraggler(_cfg())
    w = Window(120.0)
    alloc = pl.DataFrame({"node": ["n1"] * 4, "gpu": [0, 1, 2, 3], "job": ["j"] * 4, "rank": [0, 1, 2, 3]}, schema_overrides={"gpu": pl.Int32, "rank": pl.Int32})
    found = 0
    for i in range(60):
        now = 1000.0 + i
        w.add("allocations", alloc)
        w.add("jobs", pl.DataFrame({"job": ["j"], "start_ts": [0.0]}))
        w.add(
            "gpu_samples",
            pl.DataFrame(
                {"ts": [now] * 4, "node": ["n1"] * 4, "gpu": [0, 1, 2, 3], "util_ratio": [0.97] * 4, "sm_clock_mhz": [1980.0, 1980.0, 1980.0, clock], "power_w": [690.0, 688.5, 691.25, 540.0]},
                schema_overrides={"gpu": pl.Int32},
            ),
        )
        w.seal(now)
        got, want = _dump(det.detect(w)), _dump(ref.detect(w))
        assert got == want, f"t={now}: rings {got} != refit {want}"
        found += len(want)
    assert det._clock_exact32 is (clock == 1410.0)
    assert found


def test_declared_history_is_the_whole_look_back_unless_set_shorter():
    assert DeviceStragglerDetector(_cfg()).lookback_seconds() == {"gpu_samples": 20.0}
    assert DeviceStragglerDetector(_cfg(rebuild_history_seconds=10.0)).lookback_seconds() == {"gpu_samples": 10.0}


def test_a_shorter_declared_history_still_finds_what_the_whole_window_finds():
    """Declared 10 s: the window keeps 10 s of gpu_samples, the rings still the whole look-back."""
    spec = {"slow": {("n1", 1): SLOW_CLOCK}, "every": 2}
    short, whole = DeviceStragglerDetector(_cfg(rebuild_history_seconds=10.0)), RefitDeviceStraggler(_cfg())
    ws, ww = Window(10.0), Window(60.0)
    found = 0
    for now, frames, mode in _ticks(spec, 0):
        for w in (ws, ww):
            for stream, df in frames.items():
                w.add(stream, df)
            w.seal(now)
        if mode == "ingest":
            short.ingest(ws)
        else:
            got, want = _dump(short.detect(ws)), _dump(whole.detect(ww))
            assert got == want, f"t={now}: {got} != {want}"
            found += len(want)
    assert found


def test_rings_stay_sized_to_the_look_back():
    """One sample a second over a 20 s look-back: 21 rows per GPU, a ring of at most ~1/16 more
    (plus the 8-slot step), not the doubling's 32."""
    det = DeviceStragglerDetector(_cfg())
    w = Window(60.0)
    for now, frames, _ in _ticks({}, 0):
        for stream, df in frames.items():
            w.add(stream, df)
        w.seal(now)
        det.ingest(w)
    assert 21 <= det._ring.cap <= 29
