"""Hard negatives: things that look like faults to a naive rule and must raise no finding at all
(checkpoint pauses and data-loader stalls where all ranks pause together, a sawtooth peaking at
97% of the GPU without growth, a job slow on every rank alike, a preemption and restart). The
healthy run and the checkpoint pause are the demo's hard negatives (tests/test_demo.py). Golden
files hold the (empty) findings and the injected ground truth."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.detectors_helpers import check_golden, run

NEGATIVES = ["dataloader_stall", "high_memory", "uniform_slowdown", "restart"]


@pytest.fixture(scope="module")
def results():
    # spawn, not fork: forking a process whose polars thread pool is running can deadlock.
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(NEGATIVES, pool.map(run, NEGATIVES)))


@pytest.mark.parametrize("name", NEGATIVES)
def test_hard_negative_raises_nothing(results, name):
    res = results[name]
    assert res["findings"] == [], [(f["kind"], f["ts"]) for f in res["findings"]]
    assert res["oom_events"] == []
    check_golden(name, res)


def test_high_memory_really_sits_above_the_static_rule():
    """The 97% sawtooth is a real hard negative: NVML memory stays above 95% of the GPU."""
    from gpuvigil import config
    from gpuvigil.sim import scenario as scenario_mod
    from gpuvigil.app.runtime import build_simulated
    from tests.detectors_helpers import DATA

    sc = scenario_mod.load(DATA / "high_memory.yaml")
    rt = build_simulated(sc, cfg=config.load(overrides={"hints": {"rules": []}}))
    rt.run(60)
    gs = rt.pipeline.window.get("gpu_samples")
    busy = gs.filter(gs["memory_used_bytes"] > 0.95 * gs["memory_total_bytes"])
    assert busy.height > 0 and busy["ts"].max() == 60
