"""oom_device's rings (gpuvigil/detectors/oom_device.py: O(new rows) per tick) against
the polars refit they replaced, kept here verbatim as the oracle (`Refit`: its `_series`, `detect`,
`_steps` and `_trend`, plus the two columns the projection's evidence reads: the fitted
segment's sample interval and the envelope's first step): both read the same real Window, tick by tick, through scenarios that cover
what the rings must follow (leak steps, drops, foreign growth, DCGM-only and partial process
lists, warm-up edges, a requeue, allocation changes, ticks the detector is not due, a missed
tick, time jumps, GPUs appearing and disappearing, equal and out-of-order timestamps, rows
exactly fit_window_seconds old, the window's retention rule). Every finding must be identical
(kind, severity, job, ranks, node, gpu, cause, source, evidence, summary) on every tick the
incremental detector is evaluated. The cases where the two may differ are listed in the module
doc of oom_device.py and are left out here.

Source: NVML device and per-process memory shaped as tests/test_mut_oom_device.py builds them
(the H200 of tests/data/h200: memory.total 150754820096 B, driver-reserved 644939776 B; PyTorch
caching-allocator footprints that grow in whole segments), simulated in the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.oom_device import DeviceOomPredictor, OomDeviceConfig
from gpuvigil.window import Window

TOTAL = 150_754_820_096
RESERVED = 644_939_776
GIB = 1 << 30
MIB = 1 << 20
BASE = 40 * GIB + 480 * MIB


# --- the oracle: the refit as it was before the rings (verbatim) --------------------------------
class Refit(DeviceOomPredictor):
    def ingest(self, window: Window) -> None:
        pass

    def _series(self, window: Window, since: float) -> pl.DataFrame:
        """(ts, job, rank, node, gpu, own, gpu_used, capacity, foreign) per process sample."""
        gs = window.get("gpu_samples").filter(pl.col("ts") >= since)
        alloc = window.get("allocations").select("node", "gpu", "job", "rank")
        if gs.height == 0 or alloc.height == 0:
            return pl.DataFrame()
        dev = gs.select(
            "ts",
            "node",
            "gpu",
            pl.col("memory_used_bytes").cast(pl.Float64).alias("gpu_used"),
            (pl.col("memory_total_bytes") - pl.col("memory_reserved_bytes").fill_null(0)).cast(pl.Float64).alias("capacity"),
        ).filter(pl.col("gpu_used").is_not_null())
        procs = window.get("gpu_processes")
        if procs.height:
            procs = procs.filter((pl.col("ts") >= since) & pl.col("used_memory_bytes").is_not_null())
        if procs.height:
            # A process is the job's when the scheduler's map or its own attribution says so.
            p = procs.join(alloc.rename({"job": "_ajob", "rank": "_arank"}), on=["node", "gpu"], how="left").with_columns(
                (pl.col("job").is_not_null() & (pl.col("job") == pl.col("_ajob")) | pl.col("job").is_null() & (pl.col("slurm_job") == pl.col("_ajob"))).fill_null(False).alias("own")
            )
            per = p.group_by(["ts", "node", "gpu"]).agg(
                pl.col("used_memory_bytes").filter(pl.col("own")).sum().cast(pl.Float64).alias("own"),
                pl.col("used_memory_bytes").filter(~pl.col("own")).sum().cast(pl.Float64).alias("foreign"),
            )
            dev = dev.join(per, on=["ts", "node", "gpu"], how="left").with_columns(pl.col("own").fill_null(pl.col("gpu_used")))
        else:
            dev = dev.with_columns(pl.col("gpu_used").alias("own"), pl.lit(None, pl.Float64).alias("foreign"))
        return dev.join(alloc, on=["node", "gpu"], how="inner")

    def detect(self, window: Window) -> list:
        c = self.config
        now = window.now
        df = self._series(window, now - c.fit_window_seconds)
        if df.height == 0:
            return []
        jobs = window.get("jobs")
        if jobs.height:
            df = df.join(jobs.select("job", pl.col("start_ts").alias("_start")), on="job", how="left").filter(
                pl.col("_start").is_null() | (pl.col("ts") >= pl.col("_start") + c.warmup_seconds)
            )
        key = ["job", "rank", "node", "gpu"]
        df = df.sort([*key, "ts"])
        # Segments since the last large drop, the envelope within them, and where it stepped up.
        df = df.with_columns((pl.col("own").diff().over(key) < -c.drop_bytes).fill_null(False).cum_sum().over(key).alias("seg"))
        df = df.filter(pl.col("seg") == pl.col("seg").max().over(key))
        df = df.with_columns(pl.col("own").cum_max().over(key).alias("env"), pl.col("foreign").fill_null(0).cum_max().over(key).alias("fenv"))
        df = df.with_columns(*((pl.col(e).diff().over(key).fill_null(0) > c.rise_bytes).alias(f"{e}_rise") for e in ("env", "fenv")))
        per = df.group_by(key).agg(
            *_steps("env"),
            *_steps("fenv"),
            pl.col("env").first().alias("env_start"),
            pl.col("fenv").first().alias("fenv_start"),
            pl.col("foreign").is_not_null().any().alias("has_procs"),
            pl.col("gpu_used").last().alias("gpu_used"),
            pl.col("capacity").last().alias("capacity"),
            pl.col("own").last().alias("own_now"),
            # the projection's evidence (added with it): the fitted segment's mean sample interval
            ((pl.col("ts").max() - pl.col("ts").min()) / (pl.len() - 1)).alias("interval"),
        ).with_columns(
            (pl.col("env_last") - pl.col("env_start")).alias("growth"),
            (pl.col("fenv_last") - pl.col("fenv_start")).alias("f_growth"),
            (pl.col("capacity") - c.safety_margin_bytes - pl.col("gpu_used")).alias("headroom"),
        )

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


def _steps(e: str) -> list[pl.Expr]:
    """Envelope `e`'s upward steps (column `{e}_rise`): how many, when the first and the last
    came, the envelope right after the first, and the envelope now."""
    rise = pl.col(f"{e}_rise")
    return [
        rise.sum().alias(f"{e}_rises"),
        pl.col("ts").filter(rise).min().alias(f"{e}_t_first"),
        pl.col("ts").filter(rise).max().alias(f"{e}_t_last"),
        pl.col(e).filter(rise).min().alias(f"{e}_first"),
        pl.col(e).last().alias(f"{e}_last"),
    ]


def _trend(per: pl.DataFrame, e: str, c: OomDeviceConfig) -> pl.DataFrame:
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


# --- scenarios ----------------------------------------------------------------------------------
@dataclass
class Gpu:
    """One GPU: node, index, the allocated job's own footprint own(t) (bytes), another process's
    foreign(t) (None: none), and how processes are listed: "job" (attributed to the job), "slurm"
    (only its Slurm job id), None (DCGM only: no process list)."""

    node: str
    gpu: int
    own: Callable[[float], int]
    foreign: Callable[[float], int] | None = None
    procs: str | None = "job"
    foreign_job: str | None = None


def leak(step_s: float, base: int = BASE, seg: int = GIB, since: float = 0.0) -> Callable[[float], int]:
    return lambda t: base + int(max(t - since, 0) // step_s) * seg


def flat(base: int = BASE) -> Callable[[float], int]:
    return lambda t: base


@dataclass
class Scenario:
    gpus: list[Gpu]
    alloc: Callable[[float], list[tuple[str, int, str, int]]]  # t → (job, rank, node, gpu)
    seconds: int = 200
    jobs: Callable[[float], dict[str, float | None]] | None = None  # t → job → start_ts
    mode: Callable[[int], str] = lambda i: "detect" if i % 5 == 0 else "ingest"  # "detect" | "ingest" | "ingest+detect" | "skip"
    clock: Callable[[int], float] = float  # tick i → now
    sample_ts: Callable[[float], list[float]] = lambda now: [now]  # the sample times sealed at `now`
    edit: Callable[[float, dict[str, pl.DataFrame]], dict[str, pl.DataFrame]] | None = None
    retain: Callable[[float], tuple[float, list[tuple[str, int]]] | None] | None = None
    cfg: dict[str, Any] = field(default_factory=dict)
    findings: bool = True  # the scenario must produce some (else the comparison proves little)


def _alloc_of(pairs, job="A"):
    return lambda t: [(job, r, n, g) for r, (n, g) in enumerate(pairs)]


def _frames(s: Scenario, now: float) -> dict[str, pl.DataFrame]:
    alloc = s.alloc(now)
    by_gpu = {(n, g): (j, r) for j, r, n, g in alloc}
    gs, procs = [], []
    for ts in s.sample_ts(now):
        for d in s.gpus:
            own = d.own(ts)
            f = d.foreign(ts) if d.foreign else 0
            gs.append({"ts": ts, "node": d.node, "gpu": d.gpu, "memory_used_bytes": own + f, "memory_total_bytes": TOTAL, "memory_reserved_bytes": RESERVED})
            job = by_gpu.get((d.node, d.gpu), (None, None))[0]
            if d.procs:
                tag = {"slurm_job": job} if d.procs == "slurm" else {"job": job}
                procs.append({"ts": ts, "node": d.node, "gpu": d.gpu, "pid": 100 + d.gpu, "used_memory_bytes": own, **tag})
                if f:
                    procs.append({"ts": ts, "node": d.node, "gpu": d.gpu, "pid": 4242, "used_memory_bytes": f, "job": d.foreign_job})
    frames = {
        "gpu_samples": schemas.frame(gs, schemas.GPU_SAMPLES),
        "allocations": schemas.frame([{"job": j, "rank": r, "node": n, "gpu": g} for j, r, n, g in alloc], schemas.ALLOCATIONS),
    }
    if procs:
        frames["gpu_processes"] = schemas.frame(procs, schemas.GPU_PROCESSES)
    if s.jobs is not None:
        frames["jobs"] = schemas.frame([{"job": j, "state": "running", "n_gpus": 1, "submit_ts": 0.0, "start_ts": st} for j, st in s.jobs(now).items()], schemas.JOBS)
    return s.edit(now, frames) if s.edit else frames


def _row(f) -> tuple:
    return (f.kind, f.severity, f.ts, f.job, tuple(f.ranks), f.node, f.gpu, f.cause, f.source, repr(sorted(f.evidence.items())), f.summary)


def _play(s: Scenario) -> Iterator[tuple[float, list[tuple], list[tuple]]]:
    cfg = config.load(overrides={"detectors": {"oom_device": s.cfg}}) if s.cfg else config.defaults()
    inc, ref = DeviceOomPredictor(cfg), Refit(cfg)
    w = Window(900.0)
    for i in range(1, s.seconds + 1):
        now = s.clock(i)
        for stream, df in _frames(s, now).items():
            w.add(stream, df)
        w.seal(now)
        rule = s.retain(now) if s.retain else None
        mode = s.mode(i)
        if mode == "ingest+detect":  # both in one tick: the rows are folded in once
            inc.ingest(w)
            mode = "detect"
        if mode == "ingest":
            inc.ingest(w)
        elif mode == "detect":
            yield now, [_row(f) for f in inc.detect(w)], [_row(f) for f in ref.detect(w)]
        # The pipeline sets the retention rule after its detectors, for the next seal.
        if s.retain:
            w.retain("gpu_samples", rule[0], pl.DataFrame(rule[1], schema={"node": pl.Utf8, "gpu": pl.Int32}, orient="row")) if rule else w.retain("gpu_samples", 0.0, None)


FOUR = [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]


def _drops(t: float) -> int:
    """A leak with empty_cache() every 60 s (the footprint falls back by 6 GiB), and a 2 GiB dip
    of exactly drop_bytes + 1 GiB at t=130 that is a drop, and one of exactly 1 GiB at t=170 that is not."""
    v = BASE + int(t // 3) % 20 * GIB
    if 130 <= t < 132:
        v -= 2 * GIB
    if 170 <= t < 172:
        v -= GIB
    return v


SCENARIOS: dict[str, Scenario] = {
    "leak steps, several jobs and ranks at risk": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3)), Gpu("n2", 0, flat()), Gpu("n2", 1, leak(5, base=90 * GIB))],
        lambda t: [("A", 0, "n1", 0), ("A", 1, "n1", 1), ("B", 0, "n2", 0), ("B", 1, "n2", 1)],
    ),
    "drops (empty_cache) start the envelope over": Scenario(
        [Gpu("n1", 0, _drops), Gpu("n1", 1, leak(4)), Gpu("n2", 0, lambda t: BASE + int(t // 4) * GIB - (GIB if int(t) % 9 == 0 else 0))],
        _alloc_of(FOUR[:3]),
    ),
    "rises at exactly rise_bytes and one byte more": Scenario(
        [Gpu("n1", 0, leak(2, base=125 * GIB, seg=64 * MIB)), Gpu("n1", 1, leak(2, base=125 * GIB, seg=64 * MIB + 1))],
        _alloc_of(FOUR[:2]),
        cfg={"min_growth_bytes": 256 * MIB},
    ),
    "a foreign process growing, next to a flat and a leaking job": Scenario(
        [
            Gpu("n1", 0, flat(), foreign=lambda t: int(t // 4) * GIB),
            Gpu("n1", 1, leak(4), foreign=lambda t: int(t // 5) * GIB, foreign_job="other"),
            Gpu("n2", 0, leak(8), foreign=lambda t: int(t // 3) * GIB),
            Gpu("n2", 1, flat(), foreign=lambda t: 3 * GIB if t > 50 else 0),
        ],
        lambda t: [("A", 0, "n1", 0), ("A", 1, "n1", 1), ("B", 0, "n2", 0), ("C", 0, "n2", 1)],
    ),
    "DCGM only, Slurm-only attribution, and a process list missing at some ticks": Scenario(
        [Gpu("n1", 0, leak(4), procs=None), Gpu("n1", 1, leak(3), procs="slurm"), Gpu("n2", 0, leak(4), foreign=lambda t: int(t // 6) * GIB)],
        _alloc_of(FOUR[:3]),
        edit=lambda now, fr: {k: v for k, v in fr.items() if k != "gpu_processes" or int(now) % 7 != 0},
    ),
    "warm-up boundary on a sample, a job not listed": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(4)), Gpu("n2", 0, leak(3))],
        lambda t: [("A", 0, "n1", 0), ("B", 0, "n1", 1), ("C", 0, "n2", 0)],
        jobs=lambda t: {"A": 10.0, "B": 10.5, "X": 0.0},
    ),
    "a requeue moves the job's start, then the job leaves the scheduler's list": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3))],
        _alloc_of(FOUR[:2]),
        jobs=lambda t: {} if t >= 160 else {"A": 0.0 if t < 100 else 95.0},
        seconds=220,
    ),
    "allocation changes: another job with a known start, one with none, a rank swap": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3)), Gpu("n2", 0, leak(4)), Gpu("n2", 1, leak(5))],
        lambda t: [
            ("A", 0, "n1", 0),
            ("A", 1, "n1", 1) if t < 80 else ("B", 0, "n1", 1),
            ("A", 2, "n2", 0) if t < 120 else ("C", 0, "n2", 0),
            ("A", 3, "n2", 1) if t < 140 else ("A", 4, "n2", 1),
        ],
        jobs=lambda t: {"A": 0.0, **({"B": 79.0} if t >= 80 else {})},
    ),
    "GPUs appearing in and leaving the allocation, a GPU that stops reporting": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3)), Gpu("n2", 0, leak(4)), Gpu("n2", 1, lambda t: leak(3)(t))],
        lambda t: [("A", 0, "n1", 0)] + ([("A", 1, "n1", 1)] if 40 <= t < 150 else []) + ([("B", 0, "n2", 0)] if t >= 60 else []) + [("B", 1, "n2", 1)],
        edit=lambda now, fr: {**fr, "gpu_samples": fr["gpu_samples"].filter(~((pl.col("node") == "n2") & (pl.col("gpu") == 1) & (pl.lit(now) > 120)))},
        jobs=lambda t: {"A": 0.0, "B": None},
    ),
    "due every tick, with two samples a tick": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(2.5), foreign=lambda t: int(t // 7) * GIB)],
        _alloc_of(FOUR[:2]),
        mode=lambda i: "detect",
        sample_ts=lambda now: [now - 0.5, now],
        seconds=150,
    ),
    "a missed tick (no ingest) and a tick evaluated twice": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3))],
        _alloc_of(FOUR[:2]),
        mode=lambda i: "skip" if i in (50, 51, 97) else "ingest+detect" if i in (52, 120) else "detect" if i % 5 == 0 else "ingest",
    ),
    "time jumps: past the fit window, and back": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3))],
        _alloc_of(FOUR[:2]),
        clock=lambda i: float(i if i < 80 else i + 300 if i < 140 else i + 150),  # back to 290: before the rows of 380..439
        seconds=200,
    ),
    "equal timestamps: a sample sent twice, across ticks too": Scenario(
        # (a process list sent twice is summed twice: the DCGM-only GPU is the one that can warn)
        [Gpu("n1", 0, leak(4), procs=None), Gpu("n1", 1, leak(3), foreign=lambda t: int(t // 9) * GIB)],
        _alloc_of(FOUR[:2]),
        sample_ts=lambda now: [now, now] if int(now) % 3 == 0 else [now - 1, now] if int(now) % 4 == 0 else [now],
    ),
    "out-of-order samples (a late one each tick)": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, _drops)],
        _alloc_of(FOUR[:2]),
        sample_ts=lambda now: [now] if int(now) % 2 else ([now, now - 3.5] if now > 4 else [now]),
    ),
    "rows exactly fit_window_seconds old at every evaluation": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, lambda t: BASE + (5 * GIB if t % 30 == 0 else 0) + int(t // 6) * GIB)],
        _alloc_of(FOUR[:2]),
        cfg={"fit_window_seconds": 30.0, "min_span_seconds": 12.0},
        mode=lambda i: "detect" if i % 3 == 0 else "ingest",
    ),
    "the window's retention rule thins GPUs not kept, its keys changing": Scenario(
        [Gpu("n1", 0, leak(4)), Gpu("n1", 1, leak(3)), Gpu("n2", 0, leak(4))],
        _alloc_of(FOUR[:3]),
        retain=lambda t: None if 150 <= t < 160 else (10.0, [("n1", 0)] + ([("n1", 1)] if t < 60 or t >= 110 else []) + ([("n2", 0)] if t >= 90 else [])),
        sample_ts=lambda now: [now, now - 12.5] if int(now) % 10 == 0 else [now],  # late samples, already older than the cut
        mode=lambda i: "detect" if i % 2 == 0 else "ingest",
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_rings_find_exactly_what_the_refit_finds(name):
    s = SCENARIOS[name]
    evaluated = found = 0
    for now, got, want in _play(s):
        assert got == want, f"{name}, t={now}"
        evaluated += 1
        found += bool(want)
    assert evaluated > 10
    if s.findings:
        assert found, f"{name}: no finding at all, the comparison proves little"


def test_the_rings_hold_the_fit_window_and_little_more():
    """1 s ticks, 110 s fit window: at most 112 rows a GPU are needed; the rows grow to that and
    an eighth more, once."""
    s = SCENARIOS["leak steps, several jobs and ranks at risk"]
    inc = DeviceOomPredictor(config.defaults())
    w = Window(900.0)
    for i in range(1, 301):
        for stream, df in _frames(s, float(i)).items():
            w.add(stream, df)
        w.seal(float(i))
        inc.ingest(w)
    assert 112 <= inc._rings.cap <= 112 + 112 // 8
    assert inc._rings.ts.shape == (64, inc._rings.cap)  # 4 GPUs: the first 64 slots


@pytest.mark.parametrize("name", ["allocation changes: another job with a known start, one with none, a rank swap", "GPUs appearing in and leaving the allocation, a GPU that stops reporting", "the window's retention rule thins GPUs not kept, its keys changing"])
def test_the_same_in_blocks_of_a_few_gpus(name, monkeypatch):
    """The rings are evaluated and compacted BLOCK GPUs at a time (8192 at scale): blocks of 3
    here, with slots freed and reused out of order, give the same findings."""
    import gpuvigil.detectors.oom_device as oom_device

    monkeypatch.setattr(oom_device, "BLOCK", 3)
    for now, got, want in _play(SCENARIOS[name]):
        assert got == want, f"{name}, t={now}"
