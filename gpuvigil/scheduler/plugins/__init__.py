"""Policy plugins of the built-in scheduler, one module each, and the registry that wires the
configured ones into the framework's hook lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuvigil.scheduler.framework import FilterPlugin, GangPlanner, OrderPlugin, PermitPlugin, PreemptPlugin, SchedulerLike, ScorePlugin


@dataclass
class Registry:
    by_name: dict[str, Any] = field(default_factory=dict)
    orders: list[OrderPlugin] = field(default_factory=list)
    filters: list[FilterPlugin] = field(default_factory=list)
    scores: list[tuple[ScorePlugin, float]] = field(default_factory=list)
    permits: list[PermitPlugin] = field(default_factory=list)
    preempts: list[PreemptPlugin] = field(default_factory=list)
    gang_planner: GangPlanner | None = None
    submit_listeners: list[Any] = field(default_factory=list)
    bind_listeners: list[Any] = field(default_factory=list)
    change_listeners: list[Any] = field(default_factory=list)


def build_plugins(scheduler: SchedulerLike) -> Registry:
    from gpuvigil.scheduler.plugins.fragmentation import FragmentationPlugin
    from gpuvigil.scheduler.plugins.gang import GangPlugin
    from gpuvigil.scheduler.plugins.health import HealthPlugin
    from gpuvigil.scheduler.plugins.fragmentation import PaperFgdScore
    from gpuvigil.scheduler.plugins.packing import BestFitScore, FirstFitScore, PaperBestFitScore
    from gpuvigil.scheduler.plugins.priority import PriorityPlugin
    from gpuvigil.scheduler.plugins.quota import QuotaPlugin
    from gpuvigil.scheduler.plugins.topology import TopologyPlugin

    cfg = scheduler.config
    reg = Registry()
    makers = {
        "priority": PriorityPlugin,
        "quota": QuotaPlugin,
        "gang": GangPlugin,
        "topology": TopologyPlugin,
        "fragmentation": FragmentationPlugin,
        "health": HealthPlugin,
    }
    for name in cfg.plugins:
        plugin = makers[name](scheduler)
        reg.by_name[name] = plugin
        if hasattr(plugin, "job_key"):
            reg.orders.append(plugin)
        if hasattr(plugin, "filter"):
            reg.filters.append(plugin)
        if hasattr(plugin, "permit"):
            reg.permits.append(plugin)
        if hasattr(plugin, "victims"):
            reg.preempts.append(plugin)
        if hasattr(plugin, "plan_multi_node"):
            reg.gang_planner = plugin
        if hasattr(plugin, "on_submit"):
            reg.submit_listeners.append(plugin)
        if hasattr(plugin, "on_bind"):
            reg.bind_listeners.append(plugin)
        if hasattr(plugin, "on_change"):
            reg.change_listeners.append(plugin)
    # Score plugins follow the placement policy, so the benchmark compares policies through
    # the same framework: baselines score with their one rule (plus health preferences).
    w = cfg.score_weights
    frag = reg.by_name.get("fragmentation")
    health = reg.by_name.get("health")
    topo = reg.by_name.get("topology")
    if cfg.placement == "first_fit":
        reg.scores.append((FirstFitScore(scheduler), 1.0))
    elif cfg.placement == "best_fit":
        # The FGD paper's best-fit baseline, scored as its simulator does.
        reg.scores.append((PaperBestFitScore(scheduler), 1.0))
    elif cfg.placement == "fgd":
        if frag is None:
            raise ValueError("placement 'fgd' needs the 'fragmentation' plugin enabled")
        # FGD as published (the authors' simulator's integer score), not our unquantised variant.
        reg.scores.append((PaperFgdScore(frag), 1.0))
    else:  # ours
        if frag is not None:
            reg.scores.append((frag, w.get("fragmentation", 1.0)))
        reg.scores.append((BestFitScore(scheduler), w.get("binpack", 0.2)))
        if topo is not None:
            reg.scores.append((topo, w.get("topology", 0.01)))
    if health is not None:
        reg.scores.append((health, w.get("health", 10.0)))
    return reg
