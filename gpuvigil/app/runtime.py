"""The runtime of the single-process modes (the demo, `serve`, benchmarks): collectors, pipeline,
detectors and the built-in scheduler, assembled by the composition root (app/compose.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuvigil import config
from gpuvigil.app import compose
from gpuvigil.collectors.base import Collector
from gpuvigil.collectors.simulated import SimulatedCollector
from gpuvigil.pipeline.core import Pipeline, Sink, TickResult
from gpuvigil.scheduler.core import NodeSpec, Scheduler, SchedulerStateCollector
from gpuvigil.sim import scenario as scenario_mod
from gpuvigil.sim.cluster import SimulatedCluster, node_specs


@dataclass
class Runtime:
    pipeline: Pipeline
    scheduler: Scheduler
    cluster: SimulatedCluster | None
    now: float = 0.0
    last_result: TickResult | None = None
    results: list[TickResult] = field(default_factory=list)
    keep_results: bool = False

    @property
    def tick_seconds(self) -> float:
        return self.pipeline.config.tick_seconds

    def step(self) -> TickResult:
        """One tick: collect, detect, hint; the scheduler acts before the next tick."""
        self.now += self.tick_seconds
        result = self.pipeline.tick(self.now)
        self.last_result = result
        if self.keep_results:
            self.results.append(result)
        return result

    def run(self, until: float) -> None:
        while self.now + self.tick_seconds <= until + 1e-9:
            self.step()


def build_simulated(
    scenario: str | scenario_mod.Scenario = "healthy",
    nodes: int | None = None,
    seed: int = 0,
    cfg: dict[str, Any] | None = None,
    sinks: Iterable[Sink] = (),
    outputs: compose.Outputs | None = None,
) -> Runtime:
    """The simulated cluster under serve's pipeline. `sinks`: extra sinks after the outputs."""
    sc = scenario if isinstance(scenario, scenario_mod.Scenario) else scenario_mod.load(scenario)
    if nodes is not None:
        sc = scenario_mod.with_nodes(sc, nodes)
    cfg = config.defaults() if cfg is None else cfg
    if sc.tick_seconds is not None:
        # A scenario on real time scales says the tick it runs at (hours sampled every 30 s
        # need no 1 s tick).
        cfg = {**cfg, "pipeline": {**cfg.get("pipeline", {}), "tick_seconds": sc.tick_seconds}}
    # The world: the scheduler is built from the cluster's node list; the cluster reads its
    # placements. The simulated collector only reads the world.
    scheduler = Scheduler(node_specs(sc), cfg)
    cluster = SimulatedCluster(sc, scheduler, seed=seed)
    collectors: list[Collector] = [SimulatedCollector(cluster), SchedulerStateCollector(scheduler)]
    pipeline = compose.build(cfg, "serve", collectors, scheduler=scheduler, outputs=_with_extra(outputs, sinks))
    scheduler.cycle(0.0)
    return Runtime(pipeline, scheduler, cluster)


def build_real(
    collectors: Sequence[Collector],
    nodes: Sequence[NodeSpec],
    cfg: dict[str, Any] | None = None,
    sinks: Iterable[Sink] = (),
    now: float = 0.0,
    outputs: compose.Outputs | None = None,
) -> Runtime:
    """A runtime over real collectors (NVML, DCGM, logs); the built-in scheduler mirrors hints."""
    cfg = config.defaults() if cfg is None else cfg
    scheduler = Scheduler(list(nodes), cfg)
    pipeline = compose.build(cfg, "serve", [*collectors, SchedulerStateCollector(scheduler)], scheduler=scheduler, outputs=_with_extra(outputs, sinks))
    return Runtime(pipeline, scheduler, None, now=now)


def _with_extra(outputs: compose.Outputs | None, sinks: Iterable[Sink]) -> compose.Outputs:
    out = outputs or compose.Outputs()
    extra = list(sinks)
    return compose.Outputs(out.stats, out.alerts, out.store, out.acting, [*out.extra, *extra]) if extra else out
