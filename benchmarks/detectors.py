"""`gpuvigil bench detectors`: the detector set on a labelled suite of randomised simulated runs.

Each run is one case type (a fault, or a hard negative) with randomised parameters: job size
8–1,024 GPUs, step time 0.1–60 s (log-uniform), collectives per step, checkpoint cadence and
length, memory footprint, telemetry noise, fault onset and magnitude, plus small background
jobs. Hints are switched off so every fault runs its course (an OOM really happens, a hang stays
hung): that gives the ground truth the warnings are measured against.

Per finding kind: precision, recall, F1, detection latency from fault onset (p50/p90), culprit
accuracy, cause accuracy; OOM warning lead time before the real OOM (p50/p10). Baselines
measured in the same runs: PyTorch's NCCL watchdog (a collective in flight for 600 s) for hangs,
and the static Prometheus rule "GPU memory used > 95% for 1 min" for OOMs. Also: the detector
set's cost per tick on 100,000 GPUs.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

# Fault magnitudes come from the simulator's fault models (published/captured behaviour, ranges
# that straddle the detectors' thresholds), not from the detectors.
from gpuvigil.sim.faults import FAULT_RANGES, OOM_WORDINGS_WITHOUT_FIGURES

GIB = 1 << 30
CAPACITY_GIB = 139.8
CONTEXT_GIB = 0.6
WATCHDOG_SECONDS = 600.0
STATIC_RULE_SHARE = 0.95
STATIC_RULE_FOR_SECONDS = 60.0

POSITIVE = [
    "nccl_hang",
    "gpu_lost",
    "memory_leak",
    "fragmentation",
    "foreign_process",
    "ecc_dbe",
    "remap_failure",
    "thermal",
    "straggler",
    "pcie_replay",
    "cluster_fragmentation",
    "power_excursion",
]
NEGATIVE = ["healthy", "checkpoint_pause", "dataloader_stall", "high_memory", "uniform_slowdown", "restart", "eval_phase"]
LEVELS = ("L0", "L1", "L2")
CASE_TYPES = POSITIVE + NEGATIVE
MEMORY_FAULTS = {"memory_leak": "leak", "fragmentation": "fragmentation", "foreign_process": "foreign_process"}
OOM_EVENT_KIND = {"leak": "oom_capacity", "capacity": "oom_capacity", "fragmentation": "oom_fragmentation", "foreign_process": "oom_foreign_process"}

# Finding kinds each case must raise about the injected target, and those it may raise too
# (a throttled GPU is also slower than its peers and unlike them). Kind `anomaly` is scored per
# cause (`anomaly:unknown` from the peer-envelope detector), so that each row measures one detector.
MUST = {
    "nccl_hang": ["collective_hang"],
    "gpu_lost": ["xid", "collective_hang"],
    "memory_leak": ["oom_predicted"],
    "fragmentation": ["oom_predicted", "fragmentation_allocator"],
    "foreign_process": ["oom_predicted"],
    "ecc_dbe": ["ecc"],
    "remap_failure": ["row_remap_failure"],
    "thermal": ["thermal_throttle"],
    "straggler": ["straggler"],
    "pcie_replay": ["pcie_replay"],
    "cluster_fragmentation": ["fragmentation_cluster"],
    # Only the anomaly detector can see it: no XID, no throttle, no slowdown, just power.
    "power_excursion": ["anomaly:unknown"],
}
MAY = {
    # The culprit that never entered the collective idles among spinning peers: unlike them.
    "nccl_hang": ["anomaly:unknown"],
    "thermal": ["straggler", "anomaly:unknown"],
    "straggler": ["anomaly:unknown"],
    "gpu_lost": ["anomaly:unknown"],
    "ecc_dbe": ["anomaly:unknown"],
    "remap_failure": ["anomaly:unknown"],
}


def label(f: dict[str, Any]) -> str:
    """What a finding is scored as: its kind, and for `anomaly` also its cause."""
    return f"anomaly:{f.get('cause') or 'unknown'}" if f["kind"] == "anomaly" else f["kind"]


@dataclass
class Case:
    index: int
    case_type: str
    scenario: dict[str, Any]
    tick_seconds: float
    step_time_seconds: float
    gpus: int
    onset: float
    # Device sample intervals (s) the L0 view is also measured at (`--resolutions`).
    resolutions: tuple[float, ...] = ()
    # The observation levels measured: L2 is the main runtime (always run); L0/L1 shadows only
    # where listed (a shadow pipeline costs about as much CPU as the main one).
    levels: tuple[str, ...] = ("L0", "L1", "L2")
    hook_wait: bool = True  # False: the L2 hook rows carry no collective wait (as the real hook's)
    hook_starts: bool = True  # False: kernel starts unknown in the hook rows (gloo, NCCL without timing)


@dataclass
class RunResult:
    index: int
    case_type: str
    gpus: int
    step_time_seconds: float
    tick_seconds: float
    onset: float | None
    injected: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    oom_events: list[dict[str, Any]]
    watchdog_fire_ts: dict[str, float]  # job → when the 600 s watchdog fires
    static_rule_fires: list[dict[str, Any]]  # (node, gpu, ts) of the static memory rule
    wall_seconds: float
    ticks: int
    error: str | None = None
    level_findings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # L0, L1 shadows
    mode: str | None = None  # the fault's mode (hang: outside/inside; straggler: host/gpu)
    telemetry: str | None = None
    oom_wordings: list[str] = field(default_factory=list)  # wording of each OOM message (same order as oom_events)
    cpu_seconds: float | None = None  # process CPU time of the run (wall time on a loaded machine measures the others)
    # L0 findings with device telemetry sampled every N s (key: str(N)), the world unchanged.
    resolution_findings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def make_case(
    index: int,
    seed: int,
    max_gpus: int = 1024,
    quick: bool = False,
    types: list[str] | None = None,
    max_step: float | None = None,
    warmup: float | None = None,
    after_fault: float | None = None,
    levels: tuple[str, ...] = ("L0", "L1", "L2"),
    hook_wait: bool = True,
    hook_starts: bool = True,
    hang_inside_share: float = 0.2,
) -> Case:
    """Case `index` of the suite: the type cycles through all types (or through `types`, where a
    repeated type weighs more), parameters are random.

    `quick` (CI): steps of at most 4 s and faults that play out within a few minutes.
    `max_step` caps the step time range; `warmup` draws the fault onset in [warmup, warmup + 20 s]
    instead of 100-160 s; `after_fault` sets how long a run goes on after the fault. All three
    leave every random draw in place, so the other parameters of case `index` stay as they are."""
    rng = np.random.default_rng([seed, index])
    cycle = types or CASE_TYPES
    case_type = cycle[index % len(cycle)]
    gpus = 8 * max(1, int(round(_log_uniform(rng, 1, max_gpus / 8))))
    step = _log_uniform(rng, 0.1, max_step if max_step is not None else 4.0 if quick else 60.0)
    # Coarser ticks for slow jobs keep the suite affordable; targets are in step times there.
    tick = 1.0 if step <= 1 else 2.0 if step <= 8 else min(5.0, step / 4)
    peak = float(rng.uniform(40, 120))
    base = peak * float(rng.uniform(0.3, 0.6))
    if case_type == "high_memory":
        peak = 0.97 * CAPACITY_GIB  # the sawtooth peaks at 97% of the GPU, and stays there
        base = peak * float(rng.uniform(0.4, 0.7))
    ckpt_every = max(1, int(round(rng.uniform(60, 400) / step)))
    job = {
        "name": "train",
        "gpus": gpus,
        "gpus_per_node": 8,
        "step_time_seconds": round(step, 4),
        "collectives_per_step": int(rng.integers(1, 9)),
        "checkpoint_every_steps": ckpt_every,
        "checkpoint_seconds": round(float(rng.uniform(3, 30)), 1),
        "memory_base_gib": round(base, 2),
        "memory_peak_gib": round(peak, 2),
        "startup_seconds": 10.0,
    }
    nodes = gpus // 8 + 2
    u_onset = float(rng.uniform(0, 60))
    onset = round(10.0 + 30.0 + max(60.0, 4 * step) + u_onset, 1) if warmup is None else round(warmup + u_onset / 3, 1)
    headroom_gib = CAPACITY_GIB - CONTEXT_GIB - peak * 1.01
    after = 120.0
    fault: dict[str, Any] | None = None
    ranks = sorted(rng.choice(gpus, size=1, replace=False).tolist())
    # L0/L1 realism, drawn apart so the hook-level draws above stay as they were: which device
    # telemetry the cluster has, how a hang's culprit looks, where a straggler is slow.
    lrng = np.random.default_rng([seed, index, 0x4C])
    telemetry = "nvml" if lrng.random() < 0.5 else "dcgm"
    # The same draw for any share, so that a share of 1 turns exactly the hang runs into ones
    # whose culprit is stuck inside a kernel and leaves every other parameter as it was.
    hang_mode = "outside" if lrng.random() < 1.0 - hang_inside_share else "inside"
    straggler_mode = "host" if lrng.random() < 0.5 else "gpu"
    if case_type in ("nccl_hang", "gpu_lost"):
        fault = {"type": case_type, "ranks": ranks}
        if case_type == "nccl_hang":
            fault["mode"] = hang_mode
        # Twice the L0 target (60 s) or 6 steps: a finding later than the target is measured as
        # late, not cut off by the end of the run (and an L2 job's hang fallback has room).
        after = max(120.0, 6 * step)
    elif case_type in MEMORY_FAULTS:
        t_oom = max(float(rng.uniform(100, 140) if quick else rng.uniform(120, 360)), 12 * step)
        if case_type == "memory_leak":
            fault = {"type": "memory_leak", "ranks": ranks, "leak_gib_per_step": headroom_gib / (t_oom / step)}
        elif case_type == "fragmentation":
            fault = {"type": "fragmentation", "ranks": list(range(min(gpus, 8))), "fragmentation_gib_per_step": headroom_gib / (t_oom / step)}
        else:
            fault = {"type": "foreign_process", "ranks": ranks, "foreign_gib_per_second": headroom_gib / t_oom}
        after = 1.5 * t_oom + 20  # checkpoint pauses stretch a per-step leak
    elif case_type in ("ecc_dbe", "remap_failure"):
        fault = {"type": case_type, "ranks": ranks}
        after = 60.0
    elif case_type == "thermal":
        fault = {"type": "thermal", "ranks": ranks, "temperature_c": round(float(rng.uniform(*FAULT_RANGES["thermal_temperature_c"])), 1)}
        after = 120.0
    elif case_type in ("straggler", "uniform_slowdown"):
        slow = round(float(rng.uniform(*FAULT_RANGES["straggler_slowdown" if case_type == "straggler" else "uniform_slowdown"])), 2)
        fault = {"type": case_type, "ranks": ranks if case_type == "straggler" else [], "slowdown": slow}
        if case_type == "straggler":
            fault["mode"] = straggler_mode
        after = max(120.0, 12 * step)
    elif case_type == "pcie_replay":
        fault = {"type": "pcie_replay", "ranks": ranks, "pcie_replays_per_second": round(_log_uniform(rng, *FAULT_RANGES["pcie_replays_per_second"]), 2)}
        after = 150.0
    elif case_type == "power_excursion":
        # 100-300 W over its peers (4-12 scale units): from "odd" to "something is burning".
        fault = {"type": "power_excursion", "ranks": ranks, "power_excess_w": round(float(rng.uniform(100, 300)), 0)}
        after = 120.0
    elif case_type in ("checkpoint_pause", "dataloader_stall", "eval_phase"):
        pause = round(float(rng.uniform(30, 60 if quick else 240)), 0)
        fault = {"type": {"checkpoint_pause": "long_checkpoint"}.get(case_type, case_type), "duration_seconds": pause}
        after = pause + max(60.0, 4 * step)
    elif case_type == "restart":
        fault = {"type": "restart"}
        after = 60.0 + max(60.0, 6 * step)
    elif case_type == "high_memory" or case_type == "healthy":
        after = 90.0 if quick else max(150.0, 6 * step)
    if after_fault is not None:
        after = after_fault
    scenario: dict[str, Any] = {
        "name": f"bench-{index:04d}-{case_type}",
        "duration_seconds": round(onset + after, 1),
        "nodes": nodes,
        "noise": round(float(rng.uniform(0.005, 0.05)), 4),
        "telemetry": telemetry,
        "jobs": [job],
        "background": {"jobs": int(rng.integers(0, 4)), "sizes": [1, 2, 4]},
        "faults": [],
    }
    if fault is not None:
        scenario["faults"] = [{**fault, "at": onset, "job": "train"}]
    if case_type == "cluster_fragmentation":
        n = int(rng.integers(4, 40))
        scenario.update(
            nodes=n,
            jobs=[],
            background={"jobs": 0},
            duration_seconds=round(onset + 60.0, 1),
            fragmented_cluster={
                "small_job_gpus": [1, 2, 3],
                "free_per_node": [2, 4],
                "gang": {**job, "name": "gang", "gpus": 8, "submit_at": onset},
            },
        )
    return Case(index, case_type, scenario, tick, step, gpus, onset, levels=tuple(levels), hook_wait=hook_wait, hook_starts=hook_starts)


class BaselineSink:
    """The two baselines, evaluated on the same telemetry as gpuvigil, tick by tick."""

    def __init__(self) -> None:
        self.mem_high_since: pl.DataFrame | None = None
        self.static_fires: dict[tuple[str, int], float] = {}
        self.in_flight: pl.DataFrame | None = None  # (job, rank, seq, since)

    def on_tick(self, result, window) -> None:
        now = result.now
        gs = window.fresh("gpu_samples")
        if gs.height:
            high = gs.filter((pl.col("memory_used_bytes") / pl.col("memory_total_bytes")) > STATIC_RULE_SHARE).select("node", "gpu")
            prev = self.mem_high_since
            cur = high.with_columns(pl.lit(now).alias("since"))
            if prev is not None:
                cur = cur.join(prev.rename({"since": "_s"}), on=["node", "gpu"], how="left").with_columns(pl.coalesce("_s", "since").alias("since")).drop("_s")
            self.mem_high_since = cur
            for node, gpu, since in cur.filter(now - pl.col("since") >= STATIC_RULE_FOR_SECONDS).iter_rows():
                self.static_fires.setdefault((node, int(gpu)), now)
        rp = window.fresh("rank_progress")
        if rp.height:
            flying = rp.filter(pl.col("last_enqueued_seq") > pl.col("last_completed_seq")).select("job", "rank", pl.col("last_enqueued_seq").alias("seq"))
            cur = flying.with_columns(pl.lit(now).alias("since"))
            if self.in_flight is not None:
                cur = cur.join(self.in_flight.rename({"since": "_s"}), on=["job", "rank", "seq"], how="left").with_columns(pl.coalesce("_s", "since").alias("since")).drop("_s")
            self.in_flight = cur

    def watchdog_fire_ts(self) -> dict[str, float]:
        """When the watchdog fires per job: a collective still in flight 600 s after it began.
        Hints are off, so a hang at the end of the run lasts for ever: extrapolate."""
        if self.in_flight is None or self.in_flight.height == 0:
            return {}
        return {j: float(s) + WATCHDOG_SECONDS for j, s in self.in_flight.group_by("job").agg(pl.col("since").min()).iter_rows()}


class ResolutionShadows:
    """The L0 view again with its device telemetry sampled every N s (a per-node clock, as an
    exporter scraped at that interval sends it: gpuvigil.sim.sources), on the same world.

    An interval no longer than the tick is the L0 shadow itself (every tick). Every L0 detector
    runs on the sampled streams, the hardware ones (XID, thermal, anomaly) included, since they
    read the same device samples."""

    def __init__(self, shadows: Any, cfg: dict[str, Any], resolutions: tuple[float, ...], tick: float, seed: int = 0):
        from benchmarks.levels import L0_STREAMS, Replay
        from gpuvigil.pipeline.levels import RANK
        from gpuvigil.detectors.registry import default_detectors
        from gpuvigil.pipeline.core import Pipeline
        from gpuvigil.sim.sources import DeviceSampler

        self.shadows = shadows
        # Every tick is the L0 shadow's own view, where the shadows run one.
        has_l0 = "L0" in getattr(shadows, "pipelines", {})
        self.every_tick = [r for r in resolutions if r <= tick + 1e-9] if has_l0 else []
        self.pipelines: dict[float, Any] = {}
        self.samplers: dict[float, Any] = {}
        nodes = list(shadows.rt.cluster.node_names)
        for r in resolutions:
            if r in self.every_tick:
                continue
            sampler = DeviceSampler(nodes, r if r > tick + 1e-9 else None, seed=seed * 1000 + int(r), mode="scraped")
            replay = Replay(shadows.recorder, L0_STREAMS)
            self.samplers[r] = sampler
            dets = [d for d in default_detectors(cfg) if RANK[d.level] <= RANK["L0"]]
            self.pipelines[r] = Pipeline([_Sampled(replay, sampler)], dets, cfg=cfg)

    def tick(self, now: float) -> None:
        for p in self.pipelines.values():
            p.tick(now)

    def findings(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        if self.every_tick:
            l0 = self.shadows.findings()["L0"]
            out.update({f"{r:g}": l0 for r in self.every_tick})
        for r, p in self.pipelines.items():
            out[f"{r:g}"] = sorted((f.to_json_dict() for f in p.all_findings.every()), key=lambda d: d["ts"])
        return out


class _Sampled:
    """A collector's frames thinned by a device sample clock."""

    def __init__(self, inner: Any, sampler: Any):
        self.inner = inner
        self.sampler = sampler
        self.name = f"sampled-{sampler.interval or 0:g}s"
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        return self.sampler.deliver(now, self.inner.collect(now))


def run_case(case: Case) -> RunResult:
    from gpuvigil import config
    from gpuvigil.sim.scenario import Scenario
    from gpuvigil.app.runtime import build_simulated

    t0 = time.perf_counter()
    c0 = time.process_time()
    try:
        sc = Scenario.model_validate(case.scenario)
        cfg = config.load(overrides={"pipeline": {"tick_seconds": case.tick_seconds}, "hints": {"rules": []}})
        baseline = BaselineSink()
        rt = build_simulated(sc, seed=case.index, cfg=cfg, sinks=[baseline])
        assert rt.cluster is not None
        from benchmarks.levels import LevelShadows

        shadows = LevelShadows(rt, cfg, levels=[lvl for lvl in case.levels if lvl != "L2"], hook_wait=case.hook_wait, hook_starts=case.hook_starts)
        sampled = ResolutionShadows(shadows, cfg, case.resolutions, case.tick_seconds, seed=case.index)
        try:
            while rt.now + rt.tick_seconds <= sc.duration_seconds + 1e-9:
                rt.step()
                shadows.tick(rt.now)
                sampled.tick(rt.now)
        finally:
            shadows.close()
        onset = min((f.ts for f in rt.cluster.injected), default=None)
        wd = baseline.watchdog_fire_ts()
        # A collective in flight at the end of a run that is not hung would complete: only
        # count the watchdog where it would fire on a collective that never completes.
        return RunResult(
            index=case.index,
            case_type=case.case_type,
            gpus=case.gpus,
            step_time_seconds=case.step_time_seconds,
            tick_seconds=case.tick_seconds,
            onset=onset,
            injected=[f.to_json_dict() for f in rt.cluster.injected],
            findings=[f.to_json_dict() for f in rt.pipeline.all_findings.every()],
            oom_events=list(rt.cluster.oom_events),
            watchdog_fire_ts={j: t for j, t in wd.items() if t <= sc.duration_seconds or case.case_type in ("nccl_hang", "gpu_lost")},
            static_rule_fires=[{"node": n, "gpu": g, "ts": t} for (n, g), t in baseline.static_fires.items()],
            wall_seconds=time.perf_counter() - t0,
            ticks=rt.pipeline.ticks,
            level_findings=shadows.findings(),
            mode=next((f.get("mode") for f in case.scenario.get("faults", [])), None),
            telemetry=case.scenario.get("telemetry"),
            oom_wordings=list(getattr(rt.cluster, "oom_wordings", [])),
            cpu_seconds=time.process_time() - c0,
            resolution_findings=sampled.findings(),
        )
    except Exception as exc:  # a crashed run is reported, not hidden
        return RunResult(case.index, case.case_type, case.gpus, case.step_time_seconds, case.tick_seconds, None, [], [], [], {}, [], time.perf_counter() - t0, 0, error=f"{type(exc).__name__}: {exc}")


# -- scoring ------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


@dataclass
class KindScore:
    expected: int = 0
    detected: int = 0
    false_positives: int = 0
    latencies: list[float] = field(default_factory=list)
    latencies_short_steps: list[float] = field(default_factory=list)  # step ≤ 2 s
    latency_in_steps: list[float] = field(default_factory=list)  # step > 2 s, in step times
    culprit_right: int = 0
    culprit_checked: int = 0
    cause_right: int = 0
    cause_checked: int = 0
    leads: list[float] = field(default_factory=list)
    warned_before_oom: int = 0
    ooms: int = 0
    culprit_outside_right: int = 0
    culprit_outside_runs: int = 0  # hang runs whose culprit is outside the collective (found or not)
    # Runs with steps <= 2 s (the L2 hang targets): expected, found within 10 s, culprit right.
    expected_short: int = 0
    culprit_right_short: int = 0
    culprit_inside_right: int = 0
    culprit_inside_runs: int = 0  # hang runs whose culprit is stuck inside a kernel (found or not)

    def to_dict(self) -> dict[str, Any]:
        tp = self.detected
        precision = _ratio(tp, tp + self.false_positives)
        recall = _ratio(tp, self.expected)
        f1 = round(2 * precision * recall / (precision + recall), 4) if precision and recall else (0.0 if precision is not None and recall is not None else None)
        out = {
            "expected": self.expected,
            "detected": tp,
            "false_positives": self.false_positives,
            "precision": precision,
            "recall": recall,
            "f1": f1,
            "latency_p50_seconds": _pct(self.latencies, 50),
            "latency_p90_seconds": _pct(self.latencies, 90),
            "latency_p90_seconds_step_le_2s": _pct(self.latencies_short_steps, 90),
            "latency_p90_steps_step_gt_2s": _pct(self.latency_in_steps, 90),
            "culprit_accuracy": _ratio(self.culprit_right, self.culprit_checked),
            "culprit_right": self.culprit_right,
            "cause_accuracy": _ratio(self.cause_right, self.cause_checked),
        }
        # The counts a confidence bound needs (`target_rows`): a p90 latency target holds when
        # at least 90% of the expected runs are found within it (a missed run counts as late).
        out["found_within_seconds"] = {str(t): sum(x <= t + 1e-9 for x in self.latencies) for t in (30, 60)}
        out.update(
            expected_step_le_2s=self.expected_short,
            found_within_10s_step_le_2s=sum(x <= 10 + 1e-9 for x in self.latencies_short_steps),
            culprit_right_step_le_2s=self.culprit_right_short,
            culprit_inside_right=self.culprit_inside_right,
            culprit_inside_runs=self.culprit_inside_runs,
        )
        if self.ooms:
            out.update(
                leads_at_least_60s=sum(x >= 60 - 1e-9 for x in self.leads),
                oom_runs=self.ooms,
                warned_before_oom=self.warned_before_oom,
                oom_recall=_ratio(self.warned_before_oom, self.ooms),
                lead_p50_seconds=_pct(self.leads, 50),
                lead_p10_seconds=_pct(self.leads, 10),
            )
        return out


def _target(res: RunResult) -> dict[str, Any] | None:
    return res.injected[0] if res.injected else None


def _matches(f: dict[str, Any], target: dict[str, Any]) -> bool:
    if f["job"] != target["job"] and not (f["kind"] in ("xid", "ecc", "thermal_throttle", "anomaly") and target.get("node") and f["node"] == target["node"]):
        return False
    return f["ts"] >= target["ts"] - 1e-9


def _culprit_right(f: dict[str, Any], target: dict[str, Any]) -> bool:
    if f["kind"] in ("collective_hang", "straggler"):
        return sorted(f["culprit_ranks"]) == sorted(target["ranks"])
    if f["kind"] == "oom_predicted":
        # The rank it says runs out first is one of the faulted ranks.
        return f["evidence"].get("rank") in target["ranks"]
    if target.get("node") is not None and f["kind"] in ("xid", "ecc", "thermal_throttle", "anomaly"):
        return f["node"] == target["node"] and f["gpu"] == target["gpu"]
    return True


# Kinds only the in-process hook can raise: not expected below L2 (their L0/L1 rows would only
# say "cannot see it", which the level docs say once).
L2_ONLY = {"fragmentation_allocator"}


def score(results: list[RunResult], level: str = "L2") -> dict[str, Any]:
    """Figures of the detector set as observed at `level` (L2: the main runtime; L0/L1: shadows)."""
    kinds: dict[str, KindScore] = defaultdict(KindScore)
    watchdog = KindScore()
    static = KindScore()
    negatives = page_free = 0
    outside = {"right": 0, "checked": 0}  # hang culprit named where it is outside the collective
    no_figures = 0  # memory-fault runs whose OOM message carries no figures
    for res in results:
        if res.error:
            continue
        findings = res.findings if level == "L2" else res.level_findings.get(level, [])
        target = _target(res)
        must = set(MUST.get(res.case_type, []))
        if level != "L2":
            must -= L2_ONLY
        may = set(MAY.get(res.case_type, []))
        # What the OOM truly was (the first OOM of the faulted job).
        i_oom = next((i for i, o in enumerate(res.oom_events) if target and o["job"] == target["job"]), None)
        oom = res.oom_events[i_oom] if i_oom is not None else None
        if res.case_type in MEMORY_FAULTS and oom is not None:
            # A message without figures ("CUDA error: out of memory" from cuBLAS or NCCL) holds
            # no cause to read after the fact: its class is allowed, not expected (counted apart).
            wordings = getattr(res, "oom_wordings", [])
            wording = wordings[i_oom] if i_oom < len(wordings) else None
            if wording in OOM_WORDINGS_WITHOUT_FIGURES:
                may.add(OOM_EVENT_KIND[oom["cause"]])
                no_figures += 1
            else:
                must.add(OOM_EVENT_KIND[oom["cause"]])
        matched_first: dict[str, dict[str, Any]] = {}
        false_kinds: set[str] = set()
        for f in sorted(findings, key=lambda f: f["ts"]):
            k = label(f)
            if target is not None and k in must and _matches(f, target):
                matched_first.setdefault(k, f)
                continue
            if k in may and target is not None and _matches(f, target):
                continue
            if target is not None and target["kind"] == "ecc_dbe" and k == "collective_hang":
                continue
            false_kinds.add(k)
        # Counted per run: a run with any false finding of a kind is one false positive of it.
        for k in false_kinds:
            kinds[k].false_positives += 1
        for k in must:
            s = kinds[k]
            s.expected += 1
            short = res.step_time_seconds <= 2
            s.expected_short += short
            inside = k == "collective_hang" and res.case_type == "nccl_hang" and res.mode == "inside"
            s.culprit_inside_runs += inside
            if k == "collective_hang" and (res.case_type == "gpu_lost" or res.mode in (None, "outside")):
                s.culprit_outside_runs += 1
            f = matched_first.get(k)
            if f is None:
                continue
            s.detected += 1
            latency = f["ts"] - target["ts"]
            s.latencies.append(latency)
            if res.step_time_seconds <= 2:
                s.latencies_short_steps.append(latency)
            else:
                s.latency_in_steps.append(latency / res.step_time_seconds)
            s.culprit_checked += 1
            s.culprit_right += _culprit_right(f, target)
            s.culprit_right_short += short and _culprit_right(f, target)
            s.culprit_inside_right += inside and _culprit_right(f, target)
            if k == "collective_hang" and (res.case_type == "gpu_lost" or res.mode in (None, "outside")):
                outside["checked"] += 1
                outside["right"] += _culprit_right(f, target)
                s.culprit_outside_right += _culprit_right(f, target)
            want_cause = {"nccl_hang": "software", "gpu_lost": "hardware"}.get(res.case_type) if k == "collective_hang" else MEMORY_FAULTS.get(res.case_type) if k == "oom_predicted" else None
            if f["evidence"].get("level") == "L0" and want_cause == "fragmentation":
                want_cause = None  # an L0 finding says it cannot see fragmentation (docs/levels.md)
            if k == "oom_predicted" and f["evidence"].get("level") == "L0" and f["evidence"].get("per_process_memory") is False:
                # DCGM alone (FB_USED): the finding says it cannot tell a leak from another
                # process's growth; its cause is a default, not a reading, so it is not scored.
                want_cause = None
            if want_cause:
                s.cause_checked += 1
                s.cause_right += f.get("cause") == want_cause
        if res.case_type in MEMORY_FAULTS and oom is not None:
            s = kinds["oom_predicted"]
            s.ooms += 1
            f = matched_first.get("oom_predicted")
            if f is not None and f["ts"] < oom["ts"]:
                s.warned_before_oom += 1
                s.leads.append(oom["ts"] - f["ts"])
        # Baselines.
        if res.case_type in ("nccl_hang", "gpu_lost"):
            watchdog.expected += 1
            fire = res.watchdog_fire_ts.get(target["job"])
            if fire is not None:
                watchdog.detected += 1
                watchdog.latencies.append(fire - target["ts"])
                (watchdog.latencies_short_steps if res.step_time_seconds <= 2 else watchdog.latency_in_steps).append(
                    fire - target["ts"] if res.step_time_seconds <= 2 else (fire - target["ts"]) / res.step_time_seconds
                )
                watchdog.culprit_checked += 1  # the watchdog reports every waiting rank, not the culprit
        else:
            watchdog.false_positives += bool(res.watchdog_fire_ts)
        fires = sorted(res.static_rule_fires, key=lambda r: r["ts"])
        if res.case_type in MEMORY_FAULTS and oom is not None:
            static.expected += 1
            static.ooms += 1
            hit = next((r for r in fires if r["node"] == oom["node"] and r["gpu"] == oom["gpu"] and r["ts"] >= target["ts"]), None)
            static.false_positives += any(r is not hit for r in fires)
            if hit is not None:
                static.detected += 1
                static.latencies.append(hit["ts"] - target["ts"])
                if hit["ts"] < oom["ts"]:
                    static.warned_before_oom += 1
                    static.leads.append(oom["ts"] - hit["ts"])
        else:
            static.false_positives += bool(fires)
        if res.case_type in NEGATIVE:
            negatives += 1
            page_free += not any(f["severity"] == "page" for f in findings)
    out: dict[str, Any] = {k: kinds[k].to_dict() for k in sorted(kinds)}
    if "collective_hang" in out:
        out["collective_hang"]["culprit_accuracy_outside"] = _ratio(outside["right"], outside["checked"])
        out["collective_hang"]["culprit_outside_right"] = kinds["collective_hang"].culprit_outside_right
        out["collective_hang"]["culprit_outside_runs"] = kinds["collective_hang"].culprit_outside_runs
    out["baseline_watchdog_600s"] = watchdog.to_dict()
    out["baseline_static_memory_95pct_1m"] = static.to_dict()
    out["oom_messages_without_figures"] = no_figures
    out["hard_negatives"] = {"runs": negatives, "page_free_runs": page_free, "page_free_share": _ratio(page_free, negatives)}
    return out


# -- detector cost on a large cluster -------------------------------------------------------------
def measure_cost(n_gpus: int = 100_000, history_seconds: float = 60.0, repeats: int = 3) -> dict[str, Any]:
    """Wall time of each detector on a window of `n_gpus` GPUs with `history_seconds` of samples.

    The window is built from one simulated tick replicated back in time (so the cost is the
    detectors', not the simulator's); stateful detectors are warmed up first. Reports the worst
    tick (every detector due) and the amortised tick (detectors that run every N s count 1/N).
    """
    from gpuvigil import config
    from gpuvigil.sim.scenario import Scenario
    from gpuvigil.sim.cluster import SimulatedCluster, node_specs
    from gpuvigil.detectors.registry import default_detectors
    from gpuvigil.pipeline.core import PipelineConfig
    from gpuvigil.window import Window
    from gpuvigil.scheduler.core import Scheduler, SchedulerStateCollector

    nodes = n_gpus // 8
    jobs = []
    left = n_gpus
    i = 0
    rng = np.random.default_rng(7)
    while left >= 8:
        size = min(left, 8 * int(2 ** rng.integers(0, 8)))
        jobs.append({"name": f"j{i:05d}", "gpus": size, "gpus_per_node": 8, "step_time_seconds": float(rng.uniform(0.3, 5)), "memory_base_gib": 30, "memory_peak_gib": 90, "startup_seconds": 0})
        left -= size
        i += 1
    sc = Scenario.model_validate({"name": "cost", "nodes": nodes, "jobs": jobs, "duration_seconds": 1e6})
    sched = Scheduler(node_specs(sc))
    cluster = SimulatedCluster(sc, sched, seed=1)
    sched.cycle(0.0)
    state = SchedulerStateCollector(sched)
    frames = cluster.observe(1.0)
    frames.update(state.collect(1.0))
    cfg = config.defaults()
    window = Window(config.section("pipeline", PipelineConfig, cfg).horizon_seconds)
    n_ticks = int(history_seconds)
    for t in range(1, n_ticks + 1):
        for stream, df in frames.items():
            if stream in ("events",):
                continue
            if "ts" in df.columns:
                df = df.with_columns(pl.lit(float(t)).alias("ts"))
            window.add(stream, df)
        window.seal(float(t))
    from gpuvigil.detectors.anomaly import AnomalyDetector, PeerEnvelope, peer_deviations

    dets = default_detectors(cfg)
    configured = dict(config.section("pipeline", PipelineConfig, cfg).detector_every_seconds)
    every = {d.name: configured.get(d.name, d.spec.every_seconds or configured.get("default", 0.0)) for d in dets}
    per: dict[str, float] = {}
    for d in dets:
        d.detect(window)  # warm state (incremental detectors)
        if isinstance(d, AnomalyDetector):
            # Fitted on this window's peer deviations so that the timed runs score, not collect.
            dev = peer_deviations(window.fresh("gpu_samples"), window.get("allocations"), d.config.scale, d.config.min_peers)
            d.model = PeerEnvelope(d.config.envelope_quantile, d.config.envelope_margin).fit(dev.select(d._cols()).to_numpy())
        # Detectors that pace themselves: time a real evaluation, amortise it over their period.
        own_period = getattr(getattr(d, "config", None), "every_seconds", None)
        if own_period:
            every[d.name] = max(every.get(d.name, 0.0), own_period)
        times = []
        for _ in range(repeats):
            for attr in ("_last_eval", "_last_run"):
                if hasattr(d, attr):
                    setattr(d, attr, None)
            t0 = time.perf_counter()
            d.detect(window)
            times.append(time.perf_counter() - t0)
        per[d.name] = min(times)
    # Every job here runs the hook (L2): the pipeline skips the L0/L1 OOM and straggler detectors
    # for it (gpuvigil.pipeline.levels), but runs the L0/L1 hang ones beside the hook's
    # (`levels.side_by_side`, key `L2.hang`); the L0 figures are what a cluster observed at L0
    # pays instead.
    from gpuvigil.pipeline.levels import LevelSelector, LevelsConfig

    sel = LevelSelector(dets, **config.section("levels", LevelsConfig, cfg).model_dump())
    level_of = {d.name: (d.level, d.capability) for d in dets}
    at_l2 = {
        k: v for k, v in per.items() if not (level_of[k][1] and level_of[k][0] != "L2" and sel.fallback("L2", level_of[k][1]) is None)
    }
    at_l0 = {k: v for k, v in per.items() if not (level_of[k][1] and level_of[k][0] != "L0")}

    def amort(sel: dict[str, float]) -> float:
        return sum(v / max(1.0, every.get(k, every.get("default", 0.0)) or 1.0) for k, v in sel.items())

    return {
        "gpus": n_gpus,
        "ranks": int(sum(j["gpus"] for j in jobs)),
        "history_seconds": history_seconds,
        "per_detector_seconds": {k: round(v, 4) for k, v in per.items()},
        "detector_levels": {k: level_of[k][0] for k in per},
        "worst_tick_seconds": round(sum(at_l2.values()), 3),
        "amortised_tick_seconds": round(amort(at_l2), 3),
        "worst_tick_seconds_l0": round(sum(at_l0.values()), 3),
        "amortised_tick_seconds_l0": round(amort(at_l0), 3),
    }


# -- what a sample proves --------------------------------------------------------------------------
CONFIDENCE = 0.95


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (n up to many thousands)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma
    terms = [lg(n + 1) - lg(i + 1) - lg(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact one-sided Clopper–Pearson bounds of a proportion from k successes in n trials.

    Returns (lower, upper): the true rate is >= lower with probability `confidence` (and,
    separately, <= upper). lower solves P(X >= k | p) = 1 - confidence, upper solves
    P(X <= k | p) = 1 - confidence; both by bisection on the exact binomial tail (the CDF is
    monotone in p), so no statistics library is needed. With no failure the lower bound is
    (1 - confidence) ** (1 / n): 149 runs for 98%, 598 for 99.5% at 95%."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside 0..{n}")
    alpha = 1.0 - confidence

    def solve(f, want_increasing: bool) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if (f(mid) < alpha) == want_increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    # P(X >= k | p) grows with p: the lower bound is where it reaches alpha.
    lower = 0.0 if k == 0 else solve(lambda p: 1.0 - _binom_cdf(k - 1, n, p), True)
    # P(X <= k | p) falls with p: the upper bound is where it falls to alpha.
    upper = 1.0 if k == n else solve(lambda p: _binom_cdf(k, n, p), False)
    return lower, upper


def runs_needed(target: float, confidence: float = CONFIDENCE) -> int:
    """Runs, all successful, whose lower bound reaches `target`."""
    return math.ceil(math.log(1.0 - confidence) / math.log(target))


def target_rows(by_level: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The detection targets by level as proportions (k of n), with what the sample proves about each.

    A p90 latency target is the share of expected runs found within it (>= 90%); a median lead
    target is the share of OOMs warned at least that long before (>= 50%)."""
    rows: list[dict[str, Any]] = []

    def add(target: str, level: str, k: int | None, n: int | None, goal: float) -> None:
        if not n:
            return
        lo, hi = clopper_pearson(int(k or 0), int(n))
        rows.append({"target": target, "level": level, "k": int(k or 0), "n": int(n), "share": k / n, "lower": lo, "upper": hi, "goal": goal, "shown": lo >= goal, "refuted": hi < goal})

    for lvl in LEVELS:
        sm = by_level.get(lvl) or {}
        h = sm.get("collective_hang")
        if h:
            if lvl == "L0":
                add("hang found ≤ 60 s (p90 ≤ 60 s)", lvl, h["found_within_seconds"]["60"], h["expected"], 0.90)
                add("culprit GPU named, culprit outside the collective", lvl, h.get("culprit_outside_right"), h.get("culprit_outside_runs"), 0.80)
            if lvl == "L1":
                add("exact culprit ranks", lvl, h["culprit_right"], h["expected"], 0.98)
                add("hang found ≤ 30 s (p90 ≤ 30 s)", lvl, h["found_within_seconds"]["30"], h["expected"], 0.90)
            if lvl == "L2" and h.get("expected_step_le_2s"):
                add("hang found ≤ 10 s, steps ≤ 2 s (p90 ≤ 10 s)", lvl, h["found_within_10s_step_le_2s"], h["expected_step_le_2s"], 0.90)
                add("exact culprit ranks, steps ≤ 2 s", lvl, h["culprit_right_step_le_2s"], h["expected_step_le_2s"], 0.98)
                add("exact culprit ranks, culprit stuck inside a kernel", lvl, h.get("culprit_inside_right"), h.get("culprit_inside_runs"), 0.98)
        o = sm.get("oom_predicted")
        if lvl == "L0" and o and o.get("oom_runs"):
            add("OOM warned before the OOM (recall)", lvl, o["warned_before_oom"], o["oom_runs"], 0.90)
            add("OOM warning precision", lvl, o["detected"], o["detected"] + o["false_positives"], 0.95)
            add("OOM warned ≥ 60 s ahead (median lead ≥ 60 s)", lvl, o.get("leads_at_least_60s"), o["oom_runs"], 0.50)
        hn = sm.get("hard_negatives")
        if hn and hn["runs"]:
            add("hard negatives page-free", lvl, hn["page_free_runs"], hn["runs"], 0.995)
    return rows


def targets_markdown(by_level: dict[str, dict[str, Any]]) -> list[str]:
    rows = target_rows(by_level)
    if not rows:
        return []
    pc = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    lines = [
        f"| target | level | runs k / n | share | one-sided {int(100 * CONFIDENCE)}% bound (Clopper–Pearson) | goal | what the sample shows | met (share ≥ goal) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["shown"]:
            verdict = "shown"
        elif r["refuted"]:
            verdict = f"missed (true rate ≤ {pc(r['upper'])})"
        else:
            verdict = f"not shown: {runs_needed(r['goal'])} runs without a miss would show it" if r["k"] == r["n"] else "not shown"
        met = "met" if r["share"] >= r["goal"] else "not met"
        lines.append(f"| {r['target']} | {r['level']} | {r['k']} / {r['n']} | {pc(r['share'])} | ≥ {pc(r['lower'])} | ≥ {pc(r['goal'])} | {verdict} | {met} |")
    return lines


# -- report -------------------------------------------------------------------------------------
def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "–"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:g}" if isinstance(v, float) else str(v)


def markdown(summary: dict[str, Any], meta: dict[str, Any], cost: dict[str, Any] | None, levels: dict[str, dict[str, Any]] | None = None) -> str:
    by_level = {**(levels or {}), "L2": summary}
    lines = [
        "## Detectors" + (" by observation level, reduced suite" if meta.get("quick") else "") + " (`gpuvigil bench detectors`)",
        "",
        f"{meta['runs']} simulated runs (seed {meta['seed']}, {meta['errors']} crashed), "
        + (
            f"case types cycled as `--cases {meta['cases']}` (runs per type: {', '.join(f'{t} {n}' for t, n in meta.get('case_counts', {}).items())})"
            if meta.get("cases")
            else f"{len(CASE_TYPES)} case types in turn ({len(POSITIVE)} faults, {len(NEGATIVE)} hard negatives: {', '.join(NEGATIVE)})"
        )
        + f"; job sizes {meta['gpus_min']}–{meta['gpus_max']} GPUs, "
        f"step times {meta['step_min']:.2f}–{meta['step_max']:.1f} s, random onset, noise, checkpoints and background jobs; hints off so faults run their course. "
        f"{meta['sim_seconds']:.0f} simulated s in {meta['wall_seconds']:.0f} s wall on {meta['workers']} worker(s)"
        + (f", {meta['cpu_seconds']:.0f} s of CPU in the runs" if meta.get("cpu_seconds") is not None else "")
        + (
            f" (reduced `--quick` suite: jobs of at most {meta.get('max_gpus') or 32} GPUs, steps of at most {meta.get('max_step') or 4:g} s, faults that play out within minutes)"
            if meta.get("quick")
            else ""
        )
        + "; wall time on a shared, loaded machine is not a performance figure.",
        "",
        "**Every figure below comes from the simulator** (gpuvigil.sim, model in docs/detectors.md), not from real clusters. Each run is observed "
        + ("three ways" if meta.get("levels", LEVELS) == LEVELS else f"at {', '.join(meta['levels'])} only (`--levels`)")
        + " on the same simulated world: L2 (the in-process hook: the main runtime, with the L0 detectors beside the hook's for hangs; the Flight "
        "Recorder streams are not fed to it), L1 (device telemetry + NCCL Inspector + Flight Recorder dumps through the "
        "debug-info pipes) and L0 (device telemetry, per-process memory, logs and the scheduler's job map only). Sample rates: the simulator emits device "
        "samples, hook records and Inspector rows once per pipeline tick, every 1 s for steps ≤ 1 s, 2 s for steps up to 8 s and up to 5 s beyond (real "
        "dcgm-exporter refreshes every 30 s, NVML at 1 s); "
        + (
            "`--hook-without-starts`: the hook rows mark kernel starts unknown, as the hook sends them on gloo, with `collective_timing=False`, or when it "
            "started after an NCCL process group on a torch without the runtime switch, so the hook cannot name a rank stuck in a kernel (the gloo / late-start case)"
            if meta.get("hook_without_starts")
            else "the simulated hook reports each rank's last started collective, as gpuvigil.hook.instrument provides it on NCCL when `gv.start()` runs "
            "before the process group (it sets TORCH_NCCL_ENABLE_TIMING=1, which ProcessGroupNCCL reads when it is built) or through torch's runtime switch "
            "on a group that exists; gloo records no starts, and the hook then marks them unknown, leaving a rank stuck in a kernel to the L0/L1 "
            "detectors: `--hook-without-starts` measures that case"
        )
        + (
            "; `--hook-without-wait`: the L2 hook rows carry no collective wait, as the real hook sends them, so an L2 job's stragglers are left to the L0/L1 detectors."
            if meta.get("hook_without_wait")
            else "; the simulated hook rows carry each rank's collective wait (the real hook does not send it: `--hook-without-wait` measures that case)."
        )
        + (
            f" `--hang-inside-share {meta['hang_inside_share']:g}`: {meta['hang_inside_share']:.0%} of the nccl_hang runs have their culprit stuck inside a "
            "kernel (20% by default), drawn as the default draws it."
            if meta.get("hang_inside_share", 0.2) != 0.2
            else ""
        ),
        "",
    ]
    if meta.get("command"):
        lines[2:2] = [f"Command: `{meta['command']}`.", ""]
    tl = targets_markdown(by_level)
    if tl:
        lines += [
            "What the sample proves about each target: k of n runs, and the rate the true one is at least, with 95% confidence (exact one-sided "
            "Clopper–Pearson bound; a target is shown when that bound reaches it). The p90 latency targets are read as \"at least 90% of the runs found "
            "within the limit\", a miss counting as late; the median lead as \"at least half the OOMs warned 60 s ahead\".",
            "",
            *tl,
            "",
        ]
    lines += [
        "| kind | level | expected | detected | FP | precision | recall | F1 | latency p50 / p90 (s) | p90 step ≤ 2 s (s) | p90 step > 2 s (steps) | culprit | cause |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    kinds = sorted({k for sm in by_level.values() for k in sm if k not in ("hard_negatives", "oom_messages_without_figures") and not k.startswith("baseline_")})
    rows = [(k, lvl) for k in kinds for lvl in LEVELS if k in by_level.get(lvl, {})]
    rows += [("baseline_watchdog_600s", "L0"), ("baseline_static_memory_95pct_1m", "L0")]
    for k, lvl in rows:
        s = (by_level["L2"] if k.startswith("baseline_") else by_level[lvl])[k]
        culprit = _fmt(s["culprit_accuracy"], True)
        if s.get("culprit_accuracy_outside") is not None:
            culprit += f" ({_fmt(s['culprit_accuracy_outside'], True)} outside)"
        lines.append(
            f"| {k} | {lvl} | {s['expected']} | {s['detected']} | {s['false_positives']} | {_fmt(s['precision'], True)} | {_fmt(s['recall'], True)} | {_fmt(s['f1'])} | "
            f"{_fmt(s['latency_p50_seconds'])} / {_fmt(s['latency_p90_seconds'])} | {_fmt(s['latency_p90_seconds_step_le_2s'])} | {_fmt(s['latency_p90_steps_step_gt_2s'])} | "
            f"{culprit} | {_fmt(s['cause_accuracy'], True)} |"
        )
    st = summary["baseline_static_memory_95pct_1m"]
    lines += [
        "",
        "| OOM warning | level | OOM runs | warned before the OOM | precision | lead p50 (s) | lead p10 (s) |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| gpuvigil oom_predicted | {lvl} | {o.get('oom_runs', 0)} | {_fmt(o.get('oom_recall'), True)} | {_fmt(o.get('precision'), True)} | {_fmt(o.get('lead_p50_seconds'))} | {_fmt(o.get('lead_p10_seconds'))} |"
            for lvl in LEVELS
            for o in [by_level.get(lvl, {}).get("oom_predicted", {})]
            if lvl in by_level
        ],
        f"| static rule: memory > 95% for 1 min | L0 | {st.get('oom_runs', 0)} | {_fmt(st.get('oom_recall'), True)} | {_fmt(st.get('precision'), True)} | {_fmt(st.get('lead_p50_seconds'))} | {_fmt(st.get('lead_p10_seconds'))} |",
        "",
        "Hard negatives and healthy runs without any page: "
        + "; ".join(
            f"{lvl} {sm['hard_negatives']['page_free_runs']}/{sm['hard_negatives']['runs']} ({_fmt(sm['hard_negatives']['page_free_share'], True)})" for lvl in LEVELS for sm in [by_level.get(lvl)] if sm
        )
        + ".",
        "",
        "Culprit \"outside\": hang runs whose culprit is outside the collective (its rank never entered it, or its GPU is gone); the rest of the hang runs "
        "have the culprit stuck inside a device kernel, which reads like its waiting peers at L0. At L0 the cause of a fragmentation OOM is not scored: "
        "L0 says it cannot see fragmentation.",
        "",
        "Latency is from fault onset to the first finding of the kind naming the faulted job (hardware kinds: the faulted node); culprit = the exact culprit ranks "
        "(hang, straggler), the faulted rank among the ranks at risk (OOM), the faulted node and GPU (hardware). The watchdog baseline fires when a collective has "
        "been in flight for 600 s and names every waiting rank, not the culprit (culprit accuracy 0). FP = runs with a finding of the kind that is not about the "
        "injected fault (the static rule: runs where it fires on any other GPU). oom_capacity/oom_fragmentation/oom_foreign_process classify the OOM after it "
        "happened: their latency is the time from fault onset to the OOM itself.",
    ]
    if cost:
        lines += [
            "",
            f"Detector cost on {cost['gpus']:,} GPUs / {cost['ranks']:,} ranks ({cost['history_seconds']:.0f} s of history in the window, one core): "
            f"worst tick (every detector due) {cost['worst_tick_seconds']:.3f} s, amortised per tick {cost['amortised_tick_seconds']:.3f} s (target < 1 s), every job at L2; "
            f"the same cluster observed at L0 (L0 hang/OOM/straggler detectors instead of the L2 ones): worst {cost.get('worst_tick_seconds_l0', 0):.3f} s, amortised {cost.get('amortised_tick_seconds_l0', 0):.3f} s.",
            "",
            "| detector | level | seconds per run |",
            "|---|---|---|",
            *[f"| {k} | {cost.get('detector_levels', {}).get(k, '')} | {v:.4f} |" for k, v in cost["per_detector_seconds"].items()],
        ]
    return "\n".join(lines)


# -- L0 by device sample interval ---------------------------------------------------------------------
DEFAULT_RESOLUTIONS = (1.0, 10.0, 30.0)
RESOLUTION_NAMES = {1.0: "NVML polled at 1 s", 10.0: "a 10 s scrape", 15.0: "Prometheus at 15 s", 30.0: "dcgm-exporter's default", 60.0: "Prometheus at 60 s"}


def parse_resolutions(spec: str | None) -> tuple[float, ...]:
    """`--resolutions`: device sample intervals in seconds, comma-separated (`none`: skip)."""
    from gpuvigil.errors import UserError

    if spec is None:
        return DEFAULT_RESOLUTIONS
    if spec.strip().lower() in ("", "none"):
        return ()
    out: list[float] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            r = float(part)
        except ValueError:
            raise UserError(f"--resolutions: {part!r} is not a number of seconds") from None
        if not 0 < r <= 3600:
            raise UserError(f"--resolutions: {part} s is outside (0, 3600]")
        out.append(r)
    return tuple(sorted(set(out)))


def score_resolutions(results: list[RunResult]) -> dict[str, dict[str, Any]]:
    """The L0 figures per device sample interval (`RunResult.resolution_findings`)."""
    from dataclasses import replace

    keys = sorted({k for r in results for k in r.resolution_findings}, key=float)
    return {k: score([replace(r, level_findings={"L0": r.resolution_findings.get(k, [])}) for r in results if not r.error], "L0") for k in keys}


def fault_time_scales(quick: bool, results: list[RunResult] | None = None) -> str:
    """The time scales of the suite's faults, as drawn and (memory faults) as they played out."""
    lo, hi = (100.0, 140.0) if quick else FAULT_RANGES["time_to_oom_seconds"]
    pause = "30–60 s" if quick else "30–240 s"
    seen = sorted(
        o["ts"] - r.onset
        for r in results or []
        if r.case_type in MEMORY_FAULTS and r.onset is not None
        for o in r.oom_events[:1]
    )
    played = f" (in these runs {seen[0]:.0f}–{seen[-1]:.0f} s, {len(seen)} OOMs)" if seen else ""
    return (
        f"Fault time scales in these runs: leaks, fragmentation and foreign processes are drawn to reach their OOM {lo:.0f}–{hi:.0f} s after onset "
        f"or 12 steps, whichever is longer{played}; hangs and lost GPUs are held for at least 120 s or 6 steps; stragglers, hot GPUs, PCIe "
        f"replays and power excursions stay from onset to the end of the run (at least 120 s); checkpoint, data-loader and evaluation pauses "
        f"last {pause}. Real leaks grow over 10 min to 6 h and stragglers come and go: those time scales are in the realistic scenarios "
        "(`gpuvigil demo --scenario realistic`, gpuvigil/sim/scenarios/realistic/), not in this suite."
    )


def resolution_markdown(by_res: dict[str, dict[str, Any]], results: list[RunResult], quick: bool) -> str:
    """The L0 section per device sample interval: every target with its computed met / not met."""
    if not by_res:
        return ""
    ticks = sorted({r.tick_seconds for r in results if not r.error})
    tick_span = f"{ticks[0]:g}–{ticks[-1]:g} s" if ticks and ticks[0] != ticks[-1] else f"{ticks[0]:g} s" if ticks else "–"
    pc = lambda v: f"{100 * v:.1f}%"  # noqa: E731

    def interval(k: str) -> str:
        r = float(k)
        name = RESOLUTION_NAMES.get(r)
        return f"{k} s" + (f" ({name})" if name else "")

    lines = [
        "### L0 by device sample interval (simulated)",
        "",
        f"The L0 view (device telemetry, per-process memory, logs and the job map; no in-process hook) of the same {len(results)} simulated runs, "
        f"its device telemetry refreshed per node every {', '.join(f'{k} s' for k in by_res)} (`--resolutions`; gpuvigil.sim.sources, mode `scraped`: "
        f"each node's exporter refreshes on its own phase and the pipeline scrapes it every tick, reading the last refresh, as gpuvigil's DCGM "
        f"collector reads dcgm-exporter). The world is the same at every interval: only what the exporter sends differs. A reading cannot be "
        f"refreshed more often than the pipeline ticks ({tick_span} in these runs, longer for slower jobs), so the shortest interval is every tick. "
        "No sample is lost or late here.",
        "",
        fault_time_scales(quick, results),
        "",
        "| target (L0) | device sample interval | runs k / n | share | goal | met | one-sided 95% bound | what the sample shows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, sm in by_res.items():
        for row in target_rows({"L0": sm}):
            if row["shown"]:
                shows = "shown"
            elif row["refuted"]:
                shows = f"missed (true rate ≤ {pc(row['upper'])})"
            else:
                shows = "not shown"
            met = "met" if row["share"] >= row["goal"] else "not met"
            lines.append(f"| {row['target']} | {interval(k)} | {row['k']} / {row['n']} | {pc(row['share'])} | ≥ {pc(row['goal'])} | {met} | ≥ {pc(row['lower'])} | {shows} |")
    lines += [
        "",
        "| kind | device sample interval | expected | detected | FP | recall | latency p50 / p90 (s) | OOM warned before it | lead p50 (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    kinds = sorted({kk for sm in by_res.values() for kk in sm if kk not in ("hard_negatives", "oom_messages_without_figures") and not kk.startswith("baseline_")})
    for kk in kinds:
        for k, sm in by_res.items():
            s = sm.get(kk)
            if not s:
                continue
            lines.append(
                f"| {kk} | {k} s | {s['expected']} | {s['detected']} | {s['false_positives']} | {_fmt(s['recall'], True)} | "
                f"{_fmt(s['latency_p50_seconds'])} / {_fmt(s['latency_p90_seconds'])} | {_fmt(s.get('oom_recall'), True)} | {_fmt(s.get('lead_p50_seconds'))} |"
            )
    lines += [
        "",
        "Hard negatives and healthy runs without any page at L0: "
        + "; ".join(f"{k} s {sm['hard_negatives']['page_free_runs']}/{sm['hard_negatives']['runs']}" for k, sm in by_res.items() if sm.get("hard_negatives"))
        + ". \"met\" compares the share in these runs with the goal; \"what the sample shows\" says whether the runs are enough to prove it (exact Clopper–Pearson bound).",
    ]
    return "\n".join(lines)


def parse_cases(spec: str | None) -> list[str] | None:
    """`--cases`: comma-separated case types, `all` for every type; a repeated type weighs more."""
    if not spec:
        return None
    from gpuvigil.errors import UserError

    out: list[str] = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name == "all":
            out += CASE_TYPES
        elif name in CASE_TYPES:
            out.append(name)
        else:
            raise UserError(f"--cases: unknown case type {name!r} (known: all, {', '.join(CASE_TYPES)})")
    return out or None


def run_suite(
    runs: int, seed: int, workers: int, max_gpus: int = 1024, progress: bool = False, quick: bool = False, types: list[str] | None = None, on_result=None,
    resolutions: tuple[float, ...] = (),
    case_options: dict[str, Any] | None = None,
) -> tuple[list[RunResult], float]:
    from dataclasses import replace

    cases = [replace(make_case(i, seed, max_gpus, quick, types, **(case_options or {})), resolutions=tuple(resolutions)) for i in range(runs)]
    # Biggest first so that the pool's tail is short; on one worker, in index order instead, so
    # that a long suite cut short has a prefix of the case cycle (its mix as asked).
    order = sorted(cases, key=lambda c: -(c.gpus * c.scenario["duration_seconds"] / c.tick_seconds)) if workers > 1 else cases
    t0 = time.perf_counter()
    results: list[RunResult] = []
    if workers <= 1:
        for c in order:
            r = run_case(c)
            results.append(r)
            if on_result is not None:
                on_result(r)
    else:
        # spawn, not fork: a forked child of a process whose polars thread pool ran can deadlock.
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for i, r in enumerate(pool.map(run_case, order, chunksize=1)):
                results.append(r)
                if on_result is not None:
                    on_result(r)
                if progress:
                    sys.stderr.write(f"\r{i + 1}/{len(order)} runs")
        if progress:
            sys.stderr.write("\n")
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


def cmd(args) -> int:
    from gpuvigil.errors import UserError

    if args.runs < 1:
        raise UserError(f"--runs must be >= 1, got {args.runs}")
    if args.cost_gpus < 0:
        raise UserError(f"--cost-gpus must be >= 0, got {args.cost_gpus}")
    # --quick alone: one run per case type; with an explicit --runs, that many quick runs.
    runs = (args.runs if "--runs" in sys.argv else len(CASE_TYPES)) if args.quick else args.runs
    max_gpus = getattr(args, "max_gpus", None) or (32 if args.quick else 1024)
    levels = tuple(sorted({*(x.strip() for x in (getattr(args, "levels", None) or "L0,L1,L2").split(",") if x.strip()), "L2"}))
    if not set(levels) <= set(LEVELS):
        raise UserError(f"--levels: unknown level in {args.levels!r} (known: {', '.join(LEVELS)})")
    case_options = {"max_step": getattr(args, "max_step", None), "warmup": getattr(args, "warmup", None), "after_fault": getattr(args, "after", None), "levels": levels,
                    "hook_wait": not getattr(args, "hook_without_wait", False), "hook_starts": not getattr(args, "hook_without_starts", False),
                    "hang_inside_share": getattr(args, "hang_inside_share", 0.2)}
    if not 0.0 <= case_options["hang_inside_share"] <= 1.0:
        raise UserError(f"--hang-inside-share must be in [0, 1], got {case_options['hang_inside_share']}")
    workers = args.workers or max(1, os.cpu_count() or 1)
    types = parse_cases(getattr(args, "cases", None))
    resolutions = parse_resolutions(getattr(args, "resolutions", None))
    if getattr(args, "from_dumps", None):
        return _report(args, load_dumps(args.from_dumps.split(",")), sum_wall=True, workers=1, types=types)
    dump = open(args.dump_runs, "w") if getattr(args, "dump_runs", None) else None

    def on_result(r: RunResult) -> None:
        # Every run's ground truth and findings, one JSON object a line, written as each run
        # ends: the table can be audited and rescored (`--from-dumps`) without rerunning the
        # simulations, and a long suite stopped early keeps the runs it finished.
        if dump is not None:
            from dataclasses import asdict

            dump.write(json.dumps(asdict(r), default=str) + "\n")
            dump.flush()

    try:
        results, wall = run_suite(
            runs, args.seed, workers, max_gpus, progress=not args.json and sys.stderr.isatty(), quick=args.quick, types=types, on_result=on_result,
            resolutions=resolutions, case_options=case_options,
        )
    finally:
        if dump is not None:
            dump.close()
    return _report(args, results, wall=wall, workers=workers, types=types)


def load_dumps(paths: list[str]) -> list[RunResult]:
    """Runs written by `--dump-runs` (several files: several seeds), for `--from-dumps`."""
    from gpuvigil.errors import UserError

    out: list[RunResult] = []
    for path in paths:
        try:
            with open(path) as fh:
                out += [RunResult(**json.loads(line)) for line in fh if line.strip()]
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"--from-dumps: cannot read {path}: {exc}") from exc
    if not out:
        raise UserError("--from-dumps: no runs in " + ", ".join(paths))
    return out


def _report(args, results: list[RunResult], wall: float = 0.0, workers: int = 1, types: list[str] | None = None, sum_wall: bool = False) -> int:
    summary = score(results)
    # Only the levels whose shadows ran (`--levels`): an absent shadow is no evidence of a miss.
    levels = {lvl: score(results, lvl) for lvl in ("L0", "L1") if any(lvl in r.level_findings for r in results if not r.error)}
    errors = [r for r in results if r.error]
    cpu = [r.cpu_seconds for r in results if r.cpu_seconds is not None]
    meta = {
        "runs": len(results),
        "seed": args.seed if not getattr(args, "from_dumps", None) else f"as dumped; rescored from {args.from_dumps}",
        "errors": len(errors),
        "workers": workers,
        "wall_seconds": sum(r.wall_seconds for r in results) if sum_wall else wall,
        "cpu_seconds": sum(cpu) if len(cpu) == len(results) else None,
        "sim_seconds": sum(r.ticks * r.tick_seconds for r in results),
        "gpus_min": min(r.gpus for r in results),
        "gpus_max": max(r.gpus for r in results),
        "step_min": min(r.step_time_seconds for r in results),
        "step_max": max(r.step_time_seconds for r in results),
        "quick": bool(args.quick),
        "levels": tuple(sorted({"L2", *levels})),
        "hook_without_wait": bool(getattr(args, "hook_without_wait", False)),
        "hook_without_starts": bool(getattr(args, "hook_without_starts", False)),
        "hang_inside_share": getattr(args, "hang_inside_share", 0.2),
        "max_gpus": getattr(args, "max_gpus", None),
        "max_step": getattr(args, "max_step", None),
        "command": ("gpuvigil bench detectors " + " ".join(sys.argv[sys.argv.index("detectors") + 1 :])) if "detectors" in sys.argv else None,
        "cases": getattr(args, "cases", None) or ("as in the dumps" if getattr(args, "from_dumps", None) else None),
        "case_counts": {t: sum(r.case_type == t for r in results) for t in dict.fromkeys(types or (sorted({r.case_type for r in results}) if getattr(args, "from_dumps", None) else CASE_TYPES))},
    }
    cost = None if args.quick or args.cost_gpus == 0 else measure_cost(args.cost_gpus)
    md = markdown(summary, meta, cost, levels)
    by_res = score_resolutions(results)
    if by_res:
        md = md.rstrip() + "\n\n" + resolution_markdown(by_res, results, bool(args.quick))
    if not args.no_write:
        from benchmarks.report import write_section

        write_section(getattr(args, "section", None) or "detectors", md, Path(args.output) if args.output else None)
    if args.json:
        sys.stdout.write(json.dumps({**summary, "levels": levels, "resolutions": by_res, "meta": meta, "cost": cost, "errors": [f"run {r.index} ({r.case_type}): {r.error}" for r in errors]}, sort_keys=True) + "\n")
    else:
        sys.stdout.write(md + "\n")
        for r in errors:
            sys.stdout.write(f"run {r.index} ({r.case_type}) crashed: {r.error}\n")
    return 1 if errors else 0


def add_parser(sub) -> None:
    p = sub.add_parser("detectors", help="labelled detector benchmark on randomised simulated runs, with baselines")
    p.add_argument("--runs", type=int, default=20 * len(CASE_TYPES), help=f"number of simulated runs (default {20 * len(CASE_TYPES)}: 20 per case type)")
    p.add_argument("--seed", type=int, default=0, help="suite seed (runs are deterministic per seed)")
    p.add_argument("--quick", action="store_true", help="reduced suite for CI: one run per case type, at most 32 GPUs and 4 s steps, short faults, no cost measurement")
    p.add_argument("--workers", type=int, default=None, help="parallel worker processes (default: one per core)")
    p.add_argument("--cost-gpus", type=int, default=100_000, help="GPUs for the detector cost measurement (0: skip)")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--output", default=None, help="markdown file to write the section into (default docs/benchmarks.md)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--dump-runs", default=None, metavar="FILE.jsonl", help="also write every run (ground truth and findings per level) as JSON lines")
    p.add_argument("--cases", default=None, help="case types to cycle through, comma-separated (`all` = every type; a repeated type weighs more), e.g. all,nccl_hang,gpu_lost")
    p.add_argument("--from-dumps", default=None, metavar="FILE.jsonl[,FILE.jsonl]", help="score runs written by --dump-runs (comma-separated files, e.g. several seeds) instead of simulating")
    p.add_argument(
        "--resolutions",
        default=None,
        metavar="S[,S...]",
        help="device sample intervals in seconds the L0 view is also measured at (default 1,10,30: NVML, a 10 s scrape, dcgm-exporter's default; none: skip)",
    )
    p.add_argument("--max-gpus", type=int, default=None, help="largest job in GPUs (default 1,024; 32 with --quick): smaller clusters make each run cheaper")
    p.add_argument("--max-step", type=float, default=None, help="longest step time in seconds (default 60; 4 with --quick)")
    p.add_argument("--warmup", type=float, default=None, help="healthy seconds before the fault: onset drawn in [WARMUP, WARMUP + 20] (default 100-160 s)")
    p.add_argument("--after", type=float, default=None, help="seconds a run goes on after the fault (default per case type)")
    p.add_argument("--levels", default=None, help="levels to observe, comma-separated (default L0,L1,L2; L2, the main runtime, always runs): fewer shadows cost less CPU")
    p.add_argument("--hook-without-wait", action="store_true", help="the L2 hook rows carry no collective wait, as the real hook sends them (the simulator fills it)")
    p.add_argument("--hook-without-starts", action="store_true", help="the L2 hook rows mark kernel starts unknown, as the hook sends them on gloo or without TORCH_NCCL_ENABLE_TIMING")
    p.add_argument("--hang-inside-share", type=float, default=0.2, metavar="S",
                   help="share of nccl_hang runs whose culprit is stuck inside a kernel (default 0.2; 1: all of them, to measure that case alone)")
    p.add_argument("--section", default=None, help="docs/benchmarks.md section to write (default: detectors), e.g. detectors-levels for a reduced per-level run beside the full one")
    p.set_defaults(func=cmd)
