"""The composition root: what each run mode runs, decided in one place.

`serve`, the fleet's `agent`, `detect` and `act`, `replay` and `analyze` build their pipelines
here from the config, their role and their sources. The role decides:

- which detectors run: those whose declaration (detectors/base.py `DetectorSpec.placement`)
  places them in a stage the role covers (`PLACEMENTS`). The single-process modes run every
  stage; in the fleet a detector runs in exactly one of agent, detect and act. `analyze` also
  runs the detectors placed `offline`, which judge what only an artefact read after the fact
  holds;
  `fleet.agent_detectors` moves detectors to the agent; it is applied here, for every role;
- the sinks and their order (`SINK_ORDER`): the built-in scheduler first (it mirrors the hints
  the outputs then see), tick statistics, alerts, the hint store, the sources' own sinks (the
  Flight Recorder trigger), the scheduler adapter that acts last, on what the store holds;
- how a suspected hang asks the job's ranks for Flight Recorder dumps (`DUMP_TRIGGER`): in
  `serve` the trigger is a sink that writes the pipes itself; in the fleet the hang detectors
  run in `detect`, whose trigger sends each request to the agents of the nodes holding the job's
  ranks (`gv.fr.request.<node>`), and the agent's Flight Recorder source writes the pipes.

`detect_once` runs analyze's detectors once over the stream frames a file read after the fact
became (`analyze`, `gpuvigil fr`).

`start_sources` starts a real node's `sources:` section (app/sources.py registry) and the
built-in scheduler the same way for `serve` and the agent.

What differs between the modes is a parameter here (the detectors put first, such as act's
relay; the collectors, such as replay's recorded rows), never a copy of the assembly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import polars as pl

from gpuvigil.detectors.base import Detector, Placement
from gpuvigil.detectors.registry import placement, registered
from gpuvigil.errors import UserError
from gpuvigil.model import Finding
from gpuvigil.pipeline.core import Pipeline, Sink

Role = Literal["serve", "agent", "detect", "act", "replay", "analyze"]

# The fleet stages whose detectors each role runs; `offline` detectors judge artefacts only
# analyze reads (detectors/base.py Placement).
PLACEMENTS: dict[str, tuple[Placement, ...]] = {
    "serve": ("agent", "detect", "act"),
    "replay": ("agent", "detect", "act"),
    "analyze": ("agent", "detect", "act", "offline"),
    "agent": ("agent",),
    "detect": ("detect",),
    "act": ("act",),
}
ROLES: tuple[str, ...] = tuple(PLACEMENTS)

# The order in which sinks see each tick's result.
SINK_ORDER = ("scheduler", "stats", "alerts", "store", "extra", "sources", "acting")

# sink: the Flight Recorder source's trigger is a pipeline sink that decides and writes the pipes;
# ask_agents: a trigger sink that decides and sends each request to the agents of the job's nodes;
# on_request: the Flight Recorder source's trigger writes the pipes detect asks for.
DUMP_TRIGGER: dict[str, str] = {"serve": "sink", "detect": "ask_agents", "agent": "on_request"}


def _check(role: str) -> None:
    if role not in PLACEMENTS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def stage_of(agent_detectors: Sequence[str] | None = None) -> dict[str, Placement]:
    """Detector name -> the fleet stage that runs it, `fleet.agent_detectors` applied."""
    placed = placement()
    if agent_detectors is None:
        return dict(placed)
    unknown = sorted(set(agent_detectors) - set(placed))
    if unknown:
        raise UserError(f"fleet.agent_detectors: unknown detector(s) {', '.join(unknown)}; known: {', '.join(sorted(placed))}")
    offline = sorted(set(agent_detectors) & {n for n, where in placed.items() if where == "offline"})
    if offline:
        raise UserError(f"fleet.agent_detectors: {', '.join(offline)} judge(s) artefacts read after the fact (analyze); no live stream feeds them")
    chosen = set(agent_detectors)
    return {name: "agent" if name in chosen else (where if where in ("act", "offline") else "detect") for name, where in placed.items()}


def detector_names(role: str, fleet: Any = None) -> list[str]:
    """The detectors `role` runs, in the declared order."""
    _check(role)
    stages = stage_of(getattr(fleet, "agent_detectors", None))
    return [cls.spec.name for cls in registered() if stages[cls.spec.name] in PLACEMENTS[role]]


def detectors(cfg: dict[str, Any] | None, role: str, *, fleet: Any = None, only: Iterable[str] | None = None) -> list[Detector]:
    """One instance of each detector `role` runs (of those named in `only`), built from `cfg`."""
    names = set(detector_names(role, fleet))
    if only is not None:
        names &= set(only)
    return [cls(cfg) for cls in registered() if cls.spec.name in names]  # type: ignore[call-arg]


def detect_once(names: Iterable[str], streams: Mapping[str, pl.DataFrame], ts: float, cfg: dict[str, Any] | None, *, horizon: float = 600.0) -> list[Finding]:
    """The findings of `analyze`'s detectors `names` over one snapshot of stream frames (one tick
    at `ts`, seeing the last `horizon` seconds): what a file read after the fact says, judged by
    the registered detectors."""
    from gpuvigil.window import Window

    window = Window(horizon)
    for stream, df in streams.items():
        window.add(stream, df)
    window.seal(ts)
    return [f for detector in detectors(cfg, "analyze", only=names) for f in detector.detect(window)]


@dataclass
class Outputs:
    """What a process does with each tick's result; each None where the mode has none."""

    stats: Sink | None = None  # tick statistics for /metrics
    alerts: Sink | None = None  # the Alertmanager pusher (its durable outbox)
    store: Sink | None = None  # the hint store of the feedback API and of acting
    acting: Sink | None = None  # the scheduler adapter (drain, requeue)
    extra: Sequence[Sink] = ()  # what a caller adds (benchmarks' probes, tests' recorders)


def source_sinks(role: str, sources: Iterable[Any]) -> list[Sink]:
    """The sinks the sources bring (the Flight Recorder trigger) where `role` attaches them."""
    if DUMP_TRIGGER.get(role) != "sink":
        return []
    return [s.sink for s in sources if getattr(s, "sink", None) is not None]


def sinks(role: str, outputs: Outputs | None = None, *, scheduler: Sink | None = None, sources: Iterable[Any] = (), dump_ask: Callable[[str], bool] | None = None) -> list[Sink]:
    """The pipeline's sinks in `SINK_ORDER`."""
    _check(role)
    out = outputs or Outputs()
    found: dict[str, list[Sink]] = {
        "scheduler": [scheduler] if scheduler is not None else [],
        "stats": [out.stats] if out.stats is not None else [],
        "alerts": [out.alerts] if out.alerts is not None else [],
        "store": [out.store] if out.store is not None else [],
        "extra": list(out.extra),
        "sources": source_sinks(role, sources) + ([fleet_dump_trigger(dump_ask)] if dump_ask is not None and DUMP_TRIGGER.get(role) == "ask_agents" else []),
        "acting": [out.acting] if out.acting is not None else [],
    }
    return [s for part in SINK_ORDER for s in found[part]]


def build(
    cfg: dict[str, Any] | None,
    role: str,
    collectors: Sequence[Any],
    *,
    fleet: Any = None,
    outputs: Outputs | None = None,
    scheduler: Sink | None = None,
    sources: Iterable[Any] = (),
    lead: Sequence[Detector] = (),
    dump_ask: Callable[[str], bool] | None = None,
) -> Pipeline:
    """The Pipeline of `role` over `collectors`. `sources` (app/sources.py) bring their sinks,
    and their `up` is their collector's health in this pipeline. `lead`: detectors of the mode
    itself that run before the declared ones (act's relay of the fleet's findings).
    `dump_ask(job)`: detect's request to the agents of the job's nodes to write its ranks'
    debug-info pipes."""
    sources = list(sources)
    pipeline = Pipeline(
        collectors,
        [*lead, *detectors(cfg, role, fleet=fleet)],
        sinks=sinks(role, outputs, scheduler=scheduler, sources=sources, dump_ask=dump_ask),
        cfg=cfg,
    )
    for s in sources:
        s.health = pipeline.health
        if s.collector is not None:  # its state changes are logged under the source's name
            pipeline.health.labels[s.collector.name] = s.label
    return pipeline


@dataclass
class Started:
    """What a real node's `sources:` section started: its sources, their collectors (plus the
    built-in scheduler's view where no real scheduler maps jobs) and the built-in scheduler."""

    sources: list[Any]
    collectors: list[Any]
    scheduler: Any


def start_sources(sources_cfg: Any, cfg: dict[str, Any]) -> Started:
    """Start every configured source (app/sources.py registry, in its declared order) and the
    built-in scheduler over the nodes and GPUs the GPU sources show at their first read: the same
    for `serve` and the fleet's agent. A source that cannot start is a UserError naming it."""
    from gpuvigil.app import sources as deploysources
    from gpuvigil.scheduler.core import Scheduler, SchedulerStateCollector

    started = deploysources.build(sources_cfg, cfg)
    try:
        nodes = nodes_from_probe([s.collector for s in started if s.kind in ("nvml", "dcgm")], sources_cfg.node_name())
    except BaseException:
        for s in started:
            s.close()
        raise
    scheduler = Scheduler(nodes, cfg)
    collectors = [s.collector for s in started if s.collector is not None]
    if sources_cfg.scheduler == "none":
        # No real scheduler: the built-in one's view is the only job/node map there is.
        collectors.append(SchedulerStateCollector(scheduler))
    return Started(started, collectors, scheduler)


def nodes_from_probe(collectors: list[Any], node: str) -> list[Any]:
    """GPU sources: learn nodes and GPU counts from one first collect."""
    import time

    import polars as pl

    from gpuvigil.scheduler.core import NodeSpec

    frames = [c.collect(time.time()).get("gpu_samples") for c in collectors]
    frames = [f for f in frames if f is not None and f.height]
    if not frames:
        return [NodeSpec(node, n_gpus=0)]
    per_node = (
        pl.concat(frames, how="vertical_relaxed")
        .group_by("node")
        .agg(pl.col("gpu").n_unique().alias("n"), pl.col("memory_total_bytes").max().alias("mem"))
        .sort("node")
    )
    return [NodeSpec(str(n), n_gpus=int(k), gpu_memory_bytes=int(mem or 0)) for n, k, mem in per_node.iter_rows()]


def fleet_dump_trigger(ask: Callable[[str], bool]) -> Sink:
    """serve's trigger (the same decision: an L0 hang suspicion, raised or suppressed, or an
    Inspector stall), whose writer is a request to the job's agents instead of the pipes."""
    from gpuvigil.collectors.fr_dumps import FrDumpTrigger, FrRequests

    return FrDumpTrigger(ask, FrRequests())


def dump_trigger_of(pipeline: Pipeline) -> Any:
    """The Flight Recorder trigger among a pipeline's sinks, or None."""
    from gpuvigil.collectors.fr_dumps import FrDumpTrigger

    return next((s for s in pipeline.sinks if isinstance(s, FrDumpTrigger)), None)


def dump_asker(role: str, sources: Iterable[Any]) -> Any:
    """The Flight Recorder source's trigger where `role` writes the pipes on request (the agent):
    its `ask(job, now, how)` writes the job's pipes and notes the request for the dump watcher."""
    if DUMP_TRIGGER.get(role) != "on_request":
        return None
    return next((s.sink for s in sources if s.kind == "flight_recorder" and getattr(s, "sink", None) is not None), None)
