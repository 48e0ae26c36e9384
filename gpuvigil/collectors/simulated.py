"""The collector over a simulated cluster: it reads what the world's instruments report.

The world (`gpuvigil.sim.cluster.SimulatedCluster`: hardware, training processes, faults and the
scheduler that places them) is built by the wiring and handed in. This module does not import it:
anything with `observe(now)` returning the declared streams will do, so collectors stay readers
of a world rather than owners of one.

What a tick brings is what the world's sources send then (the scenario's `sources`,
gpuvigil.sim.sources): device readings refreshed every 30 s by a simulated dcgm-exporter, hook
records only at step ends, lost and late samples, log lines without a job. A stream may have no
rows on a tick, as with a real collector."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import polars as pl

from gpuvigil import schemas


class SimulatedWorld(Protocol):
    """A world that, asked at `now`, reports its instruments' frames keyed by stream name."""

    def observe(self, now: float) -> Mapping[str, pl.DataFrame]: ...


class SimulatedCollector:
    """Collector over a simulated world (see `gpuvigil.sim`)."""

    name = "simulated"
    streams: Mapping[str, pl.Schema] = {
        "gpu_samples": schemas.GPU_SAMPLES,
        "rank_progress": schemas.RANK_PROGRESS,
        "allocator_stats": schemas.ALLOCATOR_STATS,
        "events": schemas.EVENTS,
    }

    def __init__(self, world: SimulatedWorld):
        self.world = world
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        return dict(self.world.observe(now))
