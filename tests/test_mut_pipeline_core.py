"""The pipeline loop's bookkeeping (gpuvigil/pipeline/core.py) on what the fast tests did not
check (mutation testing, docs/testing.md): the window a Pipeline builds keeps each
stream's declared history (not the 600 s default), `declared_horizons`' cap and undeclared readers,
the tick and sample counters, each collector's error count in the tick's result, the `levels`
section reaching the level selector, and each finding's level.

Data: constructed: a collector that emits one event row per collect and counts a bad sample on its
second, a detector that reads without declaring, an L1 detector, and the shipped configuration
(`fragmentation_allocator` declares a 150 s look-back of allocator_stats).
"""

from __future__ import annotations

import copy

import polars as pl

from gpuvigil import config, schemas
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import Pipeline, declared_horizons


class Counting:
    """Emits one events row per collect; counts one dropped sample on its second collect."""

    name = "counting"
    streams: dict = {}

    def __init__(self) -> None:
        self.errors = 0
        self.calls = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        self.calls += 1
        if self.calls == 2:
            self.errors += 1
        return {"events": schemas.conform(pl.DataFrame({"ts": [now], "node": ["n1"], "kind": ["xid"]}), schemas.EVENTS, stream="events")}


# fragmentation_allocator with the exact sliding look-back (lookback_blocks 0): it reads 120 s + 30 s.
EXACT = {"detectors": {"fragmentation_allocator": {"lookback_blocks": 0}}}


def test_the_pipeline_window_keeps_each_streams_declared_history():
    """fragmentation_allocator reads 120 s + 30 s of allocator_stats: the pipeline's window keeps
    150 s of it (not the configured cap); streams no detector reads keep their configured cap.
    In block mode (the default) it reads only fresh rows while it steps: 10 s (block_slack_seconds)."""
    cfg = config.defaults()
    cap = cfg["pipeline"]["horizon_seconds"]
    p = Pipeline([], [AllocatorFragmentationDetector(EXACT)], cfg=cfg)
    assert cap.get("allocator_stats", cap["default"]) > 150.0
    assert p.window.horizon("allocator_stats") == 150.0
    assert p.window.horizon("events") == cap.get("events", cap["default"])
    assert Pipeline([], [AllocatorFragmentationDetector()], cfg=cfg).window.horizon("allocator_stats") == 10.0


def test_ticks_are_counted_and_each_result_carries_the_collectors_error_counts():
    c = Counting()
    p = Pipeline([c], [], cfg=config.defaults())
    results = [p.tick(float(t)) for t in (1, 2, 3)]
    assert p.ticks == 3
    assert [r.samples_ingested for r in results] == [1, 1, 1] and p.samples_ingested_total == 3
    assert [r.collector_errors for r in results] == [{"counting": 0}, {"counting": 1}, {"counting": 1}]


class Reader:
    """A detector that reads allocator_stats' history without declaring a look-back."""

    name = "reader"
    streams = ("allocator_stats",)


def test_declared_horizons_cap_and_undeclared_readers():
    """The configured default caps a declared look-back (100 s < 150 s); a stream that some
    reader does not declare keeps the configured horizon."""
    frag = AllocatorFragmentationDetector(EXACT)
    assert declared_horizons({"default": 100.0}, [frag])["allocator_stats"] == 100.0
    assert declared_horizons({"default": 600.0}, [frag])["allocator_stats"] == 150.0
    assert declared_horizons({"default": 600.0}, [frag, Reader()]).get("allocator_stats", 600.0) == 600.0


def test_the_levels_section_of_the_configuration_reaches_the_level_selector():
    cfg = {**copy.deepcopy(config.defaults()), "levels": {"memory_seconds": 123.0, "fallback_seconds": {"L1": 7.0}}}
    p = Pipeline([], [], cfg=cfg)
    assert (p.levels.memory_seconds, p.levels.fallback_seconds) == (123.0, {"L1": 7.0})


class Level1:
    """A constructed L1 detector (no capability) that reports one finding per tick."""

    name = "level1"
    level = "L1"

    def detect(self, window):
        return [Finding(kind=FindingKind.STRAGGLER, severity=Severity.TICKET, ts=window.now, job="j", summary="s", source=self.name)]


def test_each_finding_carries_the_level_of_the_detector_that_raised_it():
    """The tick passes each detector to the level selector: an L1 detector's finding says L1."""
    p = Pipeline([], [Level1()], cfg=config.defaults())
    (f,) = p.tick(1.0).new_findings
    assert f.evidence["level"] == "L1"
