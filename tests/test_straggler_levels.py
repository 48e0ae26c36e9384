"""Stragglers of hooked (L2) jobs whose hook sends no collective wait.

The real in-process hook (`gpuvigil.hook.instrument`) publishes each rank's step and the Flight
Recorder's sequence numbers, not the time each rank blocked in collectives: its rank_progress
rows carry `collective_wait_seconds` null (tests/test_detectors_real.py checks it on real gloo
ranks). The L2 straggler detector needs that column; for such a job the level selection serves
stragglers with the L1/L0 detectors instead (pipeline/levels.py: DERIVED `rank_wait`).

Source: the simulator (one rank's GPU clock capped: it computes `slowdown` times longer each
step), observed through the full pipeline tick by tick at 1 s, once with the column as the
simulator writes it and once nulled, as the real hook sends it.
"""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil import config
from gpuvigil.app.runtime import build_simulated
from gpuvigil.sim.scenario import Scenario


class NullWait:
    """Passes the simulated streams on with rank_progress's collective wait nulled."""

    name = "nullwait"

    def __init__(self, inner: list):
        self.inner = inner
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        out: dict[str, pl.DataFrame] = {}
        for c in self.inner:
            for stream, df in c.collect(now).items():
                if stream == "rank_progress":
                    df = df.with_columns(pl.lit(None, dtype=pl.Float64).alias("collective_wait_seconds"))
                out[stream] = pl.concat([out[stream], df], how="vertical_relaxed") if stream in out else df
        return out


def _run(null_wait: bool, slowdown: float | None = 1.6, seconds: float = 200.0):
    faults = [] if slowdown is None else [{"type": "straggler", "ranks": [3], "slowdown": slowdown, "mode": "gpu", "at": 60.0, "job": "train"}]
    sc = Scenario.model_validate(
        {
            "name": "straggler-levels",
            "duration_seconds": seconds,
            "nodes": 2,
            "noise": 0.01,
            "telemetry": "nvml",
            "jobs": [{"name": "train", "gpus": 8, "gpus_per_node": 8, "step_time_seconds": 0.5, "collectives_per_step": 2,
                      "checkpoint_every_steps": 100000, "memory_base_gib": 30, "memory_peak_gib": 60, "startup_seconds": 10.0}],
            "background": {"jobs": 0},
            "faults": faults,
        }
    )
    cfg = config.load(overrides={"hints": {"rules": []}})
    rt = build_simulated(sc, seed=1, cfg=cfg)
    if null_wait:
        rt.pipeline.collectors = [NullWait(rt.pipeline.collectors)]
    levels = set()
    while rt.now + rt.tick_seconds <= seconds + 1e-9:
        result = rt.step()
        levels.add(result.job_levels.get("train"))
    return [f for f in rt.pipeline.all_findings.every() if f.kind.value == "straggler"], levels, rt


@pytest.mark.parametrize("null_wait, source, level", [(True, "straggler_device", "L0"), (False, "straggler", "L2")])
def test_hooked_job_straggler_is_found_with_or_without_collective_wait(null_wait, source, level):
    found, levels, _ = _run(null_wait)
    assert levels == {"L2"}, "the hook's rows make the job L2 either way"
    assert found, "no straggler finding"
    assert {f.source for f in found} == {source}, [(f.source, f.summary) for f in found]
    first = found[0]
    assert (first.job, first.culprit_ranks, first.evidence["level"], first.severity.value) == ("train", [3], level, "ticket")
    assert first.ts >= 60.0


def test_hooked_job_without_collective_wait_and_without_a_straggler_has_no_finding():
    """The device detector that now serves the job does not raise on a healthy one."""
    found, levels, _ = _run(True, slowdown=None, seconds=180.0)
    assert levels == {"L2"} and found == []
