"""Per-level detector runs for the benchmark: one simulated world, three observers.

The main runtime (the simulator, the scheduler and the full pipeline) is observed at L2, as a
job with the in-process hook is. Beside it, shadow pipelines see only what a job observed at
L0 (device telemetry, per-process memory, logs, the scheduler's job map) or at L1 (L0 plus NCCL
Inspector and Flight Recorder: the shadow's trigger writes to the simulated ranks' debug-info
pipes and its watcher analyses the dumps they write) would show. The world is the same, so the
rows compare levels on identical faults.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import polars as pl

from gpuvigil.pipeline.levels import RANK

L0_STREAMS = frozenset({"gpu_samples", "gpu_processes", "events", "jobs", "nodes", "allocations"})
L1_STREAMS = L0_STREAMS | {"collective_progress", "fr_pipes"}
LEVEL_STREAMS = {"L0": L0_STREAMS, "L1": L1_STREAMS}
L1_ONLY = L1_STREAMS - L0_STREAMS


class Recorder:
    """Wraps the main pipeline's collectors and keeps the frames of the latest tick."""

    name = "recorder"

    def __init__(self, collectors: list[Any], hook_wait: bool = True, hook_starts: bool = True):
        self.collectors = collectors
        # False: no kernel starts recorded (gloo, NCCL without TORCH_NCCL_ENABLE_TIMING): -1.
        self.hook_starts = hook_starts
        # False: the main runtime's hook rows carry no collective wait, as the real hook sends
        # them (the simulator fills the column); the shadows never read rank_progress.
        self.hook_wait = hook_wait
        self.frames: dict[str, list[pl.DataFrame]] = {}
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        out: dict[str, list[pl.DataFrame]] = {}
        for c in self.collectors:
            for stream, df in c.collect(now).items():
                out.setdefault(stream, []).append(df)
        if not self.hook_wait and "rank_progress" in out:
            out["rank_progress"] = [df.with_columns(pl.lit(None, dtype=pl.Float64).alias("collective_wait_seconds")) for df in out["rank_progress"]]
        if not self.hook_starts and "rank_progress" in out:
            out["rank_progress"] = [df.with_columns(pl.lit(None, dtype=pl.Int64).alias("last_started_seq")) for df in out["rank_progress"]]
        self.frames = out
        # The main runtime (L2) does not read the L1 streams: keep its cost and figures as they were.
        return {s: (dfs[0] if len(dfs) == 1 else pl.concat(dfs, how="vertical_relaxed")) for s, dfs in out.items() if s not in L1_ONLY}


class Replay:
    name = "replay"

    def __init__(self, recorder: Recorder, streams: frozenset[str]):
        self.recorder = recorder
        self.allowed = streams
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        return {s: (dfs[0] if len(dfs) == 1 else pl.concat(dfs, how="vertical_relaxed")) for s, dfs in self.recorder.frames.items() if s in self.allowed}


class LevelShadows:
    """L0 and L1 pipelines fed from the main runtime's world."""

    def __init__(self, rt: Any, cfg: dict[str, Any], levels: Any = ("L0", "L1"), hook_wait: bool = True, hook_starts: bool = True):
        from gpuvigil.collectors.fr_dumps import FrDumpTrigger, FrDumpWatcher, FrRequests
        from gpuvigil.detectors.registry import default_detectors
        from gpuvigil.pipeline.core import Pipeline

        self.rt = rt
        self.tmp = tempfile.mkdtemp(prefix="gpuvigil-fr-")
        rt.cluster.fr_folder = self.tmp
        rt.cluster.inspector = True
        self.recorder = Recorder(rt.pipeline.collectors, hook_wait=hook_wait, hook_starts=hook_starts)
        rt.pipeline.collectors = [self.recorder]
        requests = FrRequests()
        self.trigger = FrDumpTrigger(rt.cluster.request_fr_dump, requests)
        # Only the detectors whose choice depends on the level run in the shadows; the others
        # (XID, ECC, thermal, anomaly, OOM messages...) read L0 streams and say the same at every
        # level, so their findings are taken from the main runtime (`findings`).
        def dets(level: str) -> list[Any]:
            return [d for d in default_detectors(cfg) if d.capability and RANK[d.level] <= RANK[level]]

        self.levels = {d.name: (d.level, d.capability) for d in default_detectors(cfg)}
        make = {
            "L0": lambda: Pipeline([Replay(self.recorder, L0_STREAMS)], dets("L0"), cfg=cfg),
            "L1": lambda: Pipeline([Replay(self.recorder, L1_STREAMS), FrDumpWatcher(self.tmp, requests=requests)], dets("L1"), sinks=[self.trigger], cfg=cfg),
        }
        self.pipelines = {lvl: make[lvl]() for lvl in ("L0", "L1") if lvl in levels}

    def tick(self, now: float) -> None:
        for p in self.pipelines.values():
            p.tick(now)

    def findings(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for lvl, p in self.pipelines.items():
            shared = [
                f for f in self.rt.pipeline.all_findings.every()
                if f.source in self.levels and self.levels[f.source][1] is None and RANK[self.levels[f.source][0]] <= RANK[lvl]
            ]
            out[lvl] = sorted((f.to_json_dict() for f in [*p.all_findings.every(), *shared]), key=lambda d: d["ts"])
        return out

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
