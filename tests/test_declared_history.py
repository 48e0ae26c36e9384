"""Each detector that reads a stream's history declares how far back (`lookback_seconds`) and
which columns (`window_columns`); the pipeline keeps only that (pipeline/core.py:
declared_horizons, declared_columns). A declaration that leaves out a column the detector reads,
or a look-back shorter than the rows it fits, changes what it finds, but only where that
detector is the stream's sole reader: in the default set, another reader's declaration can cover
the gap (oom and fragmentation_allocator both read allocator_stats). So each history reader runs
here alone, on a fault it pages on, once over the window its own declaration yields and once
over a window that keeps every column for the configured horizon (`pipeline.horizon_seconds`,
the cap); every tick's findings must be identical, and there must be some.

Data: gpuvigil's simulated cluster (the fault scenarios of tests/data/detectors/scenarios, seed 0,
hints off so each fault runs its course, as in test_detectors_faults.py). What is checked is the
declaration against the detector's own reads, which the simulator exercises on the path that
pages; the detectors' judgement on real captures is tested elsewhere (test_detectors_real.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuvigil import config
from gpuvigil.detectors.registry import default_detectors
from gpuvigil.pipeline.core import Pipeline
from gpuvigil.window import Window
from gpuvigil.app.runtime import build_simulated
from gpuvigil.sim import scenario as scenario_mod

SCENARIOS = Path(__file__).parent / "data" / "detectors" / "scenarios"

# (detector, scenario, seconds): long enough that the stream's oldest rows leave the declared
# horizon while the fault is still paged.
CASES = [
    ("oom", "memory_leak", 240),
    ("fragmentation_allocator", "fragmentation", 240),
    ("oom_device", "memory_leak", 240),
    ("straggler", "straggler", 230),
    ("straggler_device", "straggler", 230),
]


def _findings_by_tick(detector: str, scenario: str, seconds: int, *, whole_window: bool) -> tuple[list[list[tuple]], Pipeline]:
    cfg = config.load(overrides={"hints": {"rules": []}})
    rt = build_simulated(scenario_mod.load(SCENARIOS / f"{scenario}.yaml"), seed=0, cfg=cfg)
    (alone,) = [d for d in default_detectors(cfg) if d.name == detector]
    pipe = Pipeline(rt.pipeline.collectors, [alone], sinks=rt.pipeline.sinks, cfg=cfg)
    if whole_window:
        pipe.window = Window(dict(pipe.config.horizon_seconds))
    rt.pipeline = pipe
    ticks = []
    for _ in range(seconds):
        result = rt.step()
        ticks.append(sorted((f.id, f.kind.value, f.severity.value, tuple(f.culprit_ranks or ()), f.node, f.gpu, repr(sorted(f.evidence.items()))) for f in result.active_findings))
    return ticks, pipe


@pytest.mark.parametrize(("detector", "scenario", "seconds"), CASES, ids=[c[0] for c in CASES])
def test_a_detector_alone_finds_the_same_over_its_declared_history_as_over_the_whole_window(detector, scenario, seconds):
    pruned, pipe = _findings_by_tick(detector, scenario, seconds, whole_window=False)
    whole, _ = _findings_by_tick(detector, scenario, seconds, whole_window=True)
    ((stream, lookback),) = pipe.detectors[0].lookback_seconds().items()
    # The declaration is what kept the history short and narrow here: its look-back (at most the
    # configured cap) and its columns.
    assert pipe.window.horizon(stream) == min(lookback, pipe.config.horizon_seconds[stream])
    assert pipe.window.columns(stream) is not None and set(pipe.window.columns(stream)) >= set(pipe.detectors[0].window_columns()[stream])
    assert any(pruned), f"{detector} found nothing on {scenario}: the comparison would prove nothing"
    for t, (a, b) in enumerate(zip(pruned, whole, strict=True)):
        assert a == b, f"{detector} on {scenario}, tick {t + 1}: declared history {a} != whole window {b}"
