"""The pipeline loop: collect → window → detect → findings lifecycle → hints → sinks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil import config, kinds
from gpuvigil.collectors.base import Collector
from gpuvigil.detectors.base import Detector
from gpuvigil.pipeline.levels import LevelSelector, LevelsConfig
from gpuvigil.model import SEVERITY_RANK, Finding, Hint
from gpuvigil.pipeline.health import HealthTracker
from gpuvigil.pipeline.hints import HintPolicy
from gpuvigil.pipeline.components import ComponentCorrelator, ComponentsConfig
from gpuvigil.pipeline.incidents import IncidentsConfig, IncidentTracker
from gpuvigil.pipeline.jobjoin import JobJoin
from gpuvigil.window import Window
from gpuvigil.util.recentlog import RecentLog


class PipelineConfig(BaseModel):
    tick_seconds: float = Field(1.0, gt=0)
    horizon_seconds: dict[str, float] = Field(
        default_factory=lambda: {"default": 600.0, "gpu_samples": 120.0, "rank_progress": 180.0, "allocator_stats": 180.0, "gpu_processes": 180.0, "collective_progress": 180.0, "events": 3600.0}
    )
    # A finding that is not reported again for this long is cleared (its hints expire).
    clear_after_seconds: dict[str, float] = Field(default_factory=lambda: {"default": 30.0})
    # Trend detectors need not run every tick; 0 = every tick.
    detector_every_seconds: dict[str, float] = Field(default_factory=lambda: {"default": 0.0})
    # The same hint (same action for the same cause) is not issued again within this time: a
    # remedy that did not cure the cause escalates to people instead of looping.
    hint_cooldown_seconds: float = Field(3600.0, ge=0)
    # A collector target that fails this many collects in a row is down: a warning, up=0 on
    # /metrics and a `collector_down` finding until it recovers (pipeline/health.py).
    collector_down_after_failures: int = Field(3, ge=1)
    # The newest findings and hints kept in memory (`all_findings`/`all_hints`, for /metrics and
    # tests); the hint store keeps them all on disk. Bounded so a long-running serve stays flat.
    findings_kept: int = Field(10_000, ge=1)
    # Which findings are one incident, one message to on-call (pipeline/incidents.py).
    incidents: IncidentsConfig = Field(default_factory=IncidentsConfig)
    # Findings on many nodes under one leaf switch, rack or cooling loop: the component, named as one
    # incident, whose hint replaces the nodes' drains (pipeline/components.py).
    components: ComponentsConfig = Field(default_factory=ComponentsConfig)


@dataclass
class TickResult:
    now: float
    new_findings: list[Finding]
    active_findings: list[Finding]
    cleared_findings: list[Finding]
    new_hints: list[Hint]
    expired_hints: list[Hint]
    duration_seconds: float
    samples_ingested: int
    collector_errors: dict[str, int] = field(default_factory=dict)
    detector_seconds: dict[str, float] = field(default_factory=dict)
    # Findings of a lower observation level than the job's best for that capability (e.g. an
    # L0 hang suspicion on a job observed at L1): not raised, but sinks may act on them.
    suppressed_findings: list[Finding] = field(default_factory=list)
    job_levels: dict[str, str] = field(default_factory=dict)
    # Active findings whose severity rose this tick (a ticket that became a page as the OOM it
    # predicts drew near): the same cause, but news for whoever reads what gpuvigil said when.
    escalated_findings: list[Finding] = field(default_factory=list)



class Sink(Protocol):
    """Anything that consumes each tick's outcome: scheduler, alert pusher, exporter, timeline."""

    def on_tick(self, result: TickResult, window: Window) -> None: ...


def declared_horizons(configured: dict[str, float], detectors: Sequence[Any], tick_seconds: float = 1.0) -> dict[str, float]:
    """History kept per stream: the longest look-back of the detectors that read it, at most
    the configured horizon (pipeline.horizon_seconds, now a cap).

    A detector declares its look-back with `lookback_seconds()` → {stream: seconds of
    `window.get(stream)` it reads; 0 for a detector that only reads `window.fresh`}. A stream
    that some reader (its `streams`) does not declare keeps the configured horizon, as does
    every stream no detector reads (sinks read their latest rows). At least ten ticks are kept,
    so the latest row per key (exporter, API) is always there.
    """
    default = configured.get("default", 600.0)
    reads: dict[str, list[float | None]] = {}
    for d in detectors:
        fn = getattr(d, "lookback_seconds", None)
        declared: dict[str, float] = dict(fn()) if callable(fn) else {}
        for stream in {*(getattr(d, "streams", None) or ()), *declared}:
            reads.setdefault(stream, []).append(declared.get(stream))
    out = dict(configured)
    for stream, seconds in reads.items():
        if seconds and all(v is not None for v in seconds):
            cap = configured.get(stream, default)
            out[stream] = min(cap, max(max(v for v in seconds if v is not None), 10 * tick_seconds))
    return out


def declared_columns(detectors: Sequence[Any]) -> dict[str, list[str]]:
    """Columns of each stream's history that some detector reads (Window: `columns`).

    A detector declares them with `window_columns()` → {stream: columns of `window.get(stream)`
    it reads}. A reader that reads only fresh rows (look-back 0, see declared_horizons) needs no
    history; a stream with a reader of its history that declares no columns keeps them all.
    """
    cols: dict[str, set[str] | None] = {}
    for d in detectors:
        fn = getattr(d, "lookback_seconds", None)
        lookback: dict[str, float] = dict(fn()) if callable(fn) else {}
        fn = getattr(d, "window_columns", None)
        declared: dict[str, Sequence[str]] = dict(fn()) if callable(fn) else {}
        for stream in {*(getattr(d, "streams", None) or ()), *lookback, *declared}:
            if lookback.get(stream) == 0:
                cols.setdefault(stream, set())
                continue
            have = cols.setdefault(stream, set())
            if stream not in declared or have is None:
                cols[stream] = None
            else:
                have.update(declared[stream])
    return {stream: sorted(c) for stream, c in cols.items() if c is not None}


def declared_retention(detectors: Sequence[Any], needed: Any = None, resolve: Any = None) -> dict[str, tuple[float, Any] | None]:
    """How each stream's older history may be thinned (Window: `retain`).

    A detector that reads a stream's history may declare, with `window_retention()` →
    {stream: (recent_seconds, keys)}, that it reads the rows older than `recent_seconds` only for
    the keys in `keys`: a frame of key columns (e.g. the jobs straggler may have to refit over
    its long look-back), or a name that `resolve(detector, stream, name)` turns into one
    ("allocated": the GPUs of the jobs whose findings the level selection keeps from it). A
    stream is thinned only where every reader of its history declares it: the rows kept are
    those of any reader's keys, and the most recent seconds any reader keeps whole. A frame from
    a detector that is not `needed` now is stale (it stopped folding rows in): the stream keeps
    its whole history (None)."""
    readers: dict[str, list[Any]] = {}
    for d in detectors:
        fn = getattr(d, "lookback_seconds", None)
        declared: dict[str, float] = dict(fn()) if callable(fn) else {}
        for stream in {*(getattr(d, "streams", None) or ()), *declared}:
            if declared.get(stream) != 0:
                readers.setdefault(stream, []).append(d)
    out: dict[str, tuple[float, Any] | None] = {}
    for stream, ds in readers.items():
        rules: list[tuple[float, Any]] | None = []
        for d in ds:
            fn = getattr(d, "window_retention", None)
            rule = dict(fn()).get(stream) if callable(fn) else None
            if rule is not None and isinstance(rule[1], str):
                keys = resolve(d, stream, rule[1]) if resolve is not None else None
                rule = None if keys is None else (rule[0], keys)
            elif rule is not None and needed is not None and not needed(d):
                rule = None
            if rule is None or (rules and list(rule[1].columns) != list(rules[0][1].columns)):
                rules = None
                break
            rules.append((float(rule[0]), rule[1]))
        if not rules:
            out[stream] = None
            continue
        keys = rules[0][1] if len(rules) == 1 else pl.concat([k for _, k in rules], how="vertical_relaxed").unique()
        out[stream] = (max(r for r, _ in rules), keys)
    return out


class Pipeline:
    def __init__(
        self,
        collectors: Sequence[Collector],
        detectors: Sequence[Detector],
        *,
        sinks: Iterable[Sink] = (),
        cfg: dict[str, Any] | None = None,
    ):
        cfg = config.defaults() if cfg is None else cfg
        self.config = config.section("pipeline", PipelineConfig, cfg)
        self.collectors = list(collectors)
        self.detectors = list(detectors)
        self.sinks = list(sinks)
        self.hint_policy = HintPolicy(cfg)
        self.incidents = IncidentTracker(self.config.incidents)
        self.components: ComponentCorrelator | None = None
        if self.config.components.enabled:
            from gpuvigil.pipeline.topology import Topology

            c = self.config.components
            self.components = ComponentCorrelator(c, Topology.load(topology_file=c.topology_file, slurm_topology=c.slurm_topology, ibnetdiscover=c.ibnetdiscover))
        # Node-removing hints of a component symptom, waiting `components.hold_seconds` for the
        # component to be named: finding id → (release time, finding, hints).
        self._held: dict[str, tuple[float, Finding, list[Hint]]] = {}
        self.hints_replaced_by_component = 0  # held hints a named component's one action replaced
        self.window = Window(
            declared_horizons(self.config.horizon_seconds, self.detectors, self.config.tick_seconds),
            columns=declared_columns(self.detectors),
        )
        self._declared_window = self.window  # the window `declared_retention` thins (not one set from outside)
        self.active: dict[str, Finding] = {}
        self.first_seen: dict[str, float] = {}
        self.last_seen: dict[str, float] = {}
        self.active_hints: dict[str, list[Hint]] = {}  # finding id → its hints
        # Every finding and hint when first raised, in order: the newest `findings_kept` of each.
        self.all_findings: RecentLog[Finding] = RecentLog(self.config.findings_kept)
        self.all_hints: RecentLog[Hint] = RecentLog(self.config.findings_kept)
        self.ticks = 0
        self.samples_ingested_total = 0
        self._detector_last_run: dict[str, float] = {}
        self._hint_issued_at: dict[str, float] = {}
        self._previous_tick: float | None = None
        self.health = HealthTracker(self.config.collector_down_after_failures)
        self.jobjoin = JobJoin()
        self.levels = LevelSelector(self.detectors, **config.section("levels", LevelsConfig, cfg).model_dump())

    def carry_over(self) -> dict[str, Any]:
        """What a replay of recent rows cannot rebuild, for another process to `restore` (a fleet
        partition's next owner): the active findings with their first and last report, and each
        detector's own declared state (its `carry_over()`, frames). Bounded by what is active."""
        return {
            "now": self._previous_tick,
            "findings": [{"finding": f.to_json_dict(), "first_seen": self.first_seen[k], "last_seen": self.last_seen[k]} for k, f in self.active.items()],
            "detectors": {d.name: own for d in self.detectors if callable(getattr(d, "carry_over", None)) and (own := d.carry_over())},
        }

    def restore(self, state: dict[str, Any]) -> int:
        """Before the first tick: take `carry_over()`'s state. Restored findings are active as of
        the state's last tick: one the detectors report again on the next tick keeps its first
        report (its age) and incident and raises no new hint; one they no longer report clears
        after its clear time. Returns the findings restored."""
        now = state.get("now")
        if self.ticks or now is None:
            return 0
        restored: list[Finding] = []
        for item in state.get("findings", []):
            d = dict(item["finding"])
            d.pop("id", None)
            f = Finding.model_validate(d)
            self.active[f.id] = f
            self.first_seen[f.id] = float(item["first_seen"])
            self.last_seen[f.id] = float(item["last_seen"])
            restored.append(f)
        self._previous_tick = float(now)
        self.incidents.restore(restored, self.first_seen, float(now))
        for d in self.detectors:
            own = state.get("detectors", {}).get(d.name)
            if own and callable(getattr(d, "restore", None)):
                d.restore(own)
        return len(restored)

    def _retention_keys(self, detector: Any, stream: str, name: str) -> pl.DataFrame | None:
        """declared_retention's named keys: "allocated", the (node, gpu) in `allocations` of the
        jobs whose findings from `detector` the level selection keeps now or within its look-back."""
        if name != "allocated":
            return None
        alloc = self.window.get("allocations")
        if alloc.height == 0 or not {"node", "gpu", "job"} <= set(alloc.columns):
            return pl.DataFrame(schema={"node": pl.Utf8, "gpu": pl.Int32})
        fn = getattr(detector, "lookback_seconds", None)
        within = float(dict(fn()).get(stream, 0.0)) if callable(fn) else 0.0
        jobs = self.levels.jobs_selecting(detector, alloc["job"].drop_nulls().unique().to_list(), within)
        return alloc.filter(pl.col("job").is_in(sorted(jobs))).select("node", "gpu").unique()

    def _clear_after(self, finding: Finding) -> float:
        """The configured clear time of the finding's kind, else its policy's (gpuvigil/kinds.py),
        else the configured default."""
        c = self.config.clear_after_seconds
        kind = finding.kind.value
        if kind in c:
            return c[kind]
        own = kinds.policy(finding.kind).clear_after_seconds
        return float(own) if own is not None else c.get("default", 30.0)

    def _period(self, detector: Any) -> float:
        """Seconds between a detector's runs: configured, else its spec's, else the default."""
        every = self.config.detector_every_seconds
        if detector.name in every:
            return every[detector.name]
        spec = getattr(detector, "spec", None)
        return spec.every_seconds if spec is not None and spec.every_seconds else every.get("default", 0.0)

    def _hint_due(self, hint: Hint, now: float) -> bool:
        last = self._hint_issued_at.get(hint.id)
        if last is not None and now - last < self.config.hint_cooldown_seconds:
            return False
        # Re-inserted, so the dict stays in issue order and `_forget_hints` stops at the first
        # hint still cooling down.
        self._hint_issued_at.pop(hint.id, None)
        self._hint_issued_at[hint.id] = now
        return True

    def _forget_hints(self, now: float) -> None:
        """Drop the issue times of hints whose cooldown is over: they no longer hold anything
        back, and a serve that runs for months would otherwise keep every hint it ever issued."""
        issued = self._hint_issued_at
        cooldown = self.config.hint_cooldown_seconds
        while issued:
            key = next(iter(issued))
            if now - issued[key] < cooldown:
                break
            del issued[key]

    def _hold(self, finding: Finding, hints: list[Hint], now: float) -> list[Hint]:
        """The hints to issue now; a component symptom's node-removing hints wait to see whether
        its component is named (then the component's one action replaces them)."""
        comp = self.components
        if comp is None or not hints or not comp.symptom_nodes(finding):
            return hints
        held_actions = set(comp.config.held_actions)
        held = [h for h in hints if h.action in held_actions]
        if not held:
            return hints
        if comp.explaining(finding) is not None:
            self.hints_replaced_by_component += len(held)
        else:
            self._held[finding.id] = (now + comp.config.hold_seconds, finding, held)
        return [h for h in hints if h.action not in held_actions]

    def _release_held(self, now: float, reported_now: set[str]) -> list[Hint]:
        out: list[Hint] = []
        comp = self.components
        for fid, (release, finding, held) in list(self._held.items()):
            if comp is not None and comp.explaining(finding) is not None:
                self.hints_replaced_by_component += len(held)
                del self._held[fid]
            elif fid not in self.active and fid not in reported_now:
                del self._held[fid]  # cleared while waiting: nothing left to take out
            elif now >= release:
                due = [h for h in held if self._hint_due(h, now)]
                self.active_hints.setdefault(fid, []).extend(due)
                self.all_hints.extend(due)
                out.extend(due)
                del self._held[fid]
        return out

    def tick(self, now: float) -> TickResult:
        t0 = time.perf_counter()
        ingested, errors = self._collect(now)
        reported, suppressed, det_seconds = self._detect(now)
        self._retain()
        self._add_own_findings(reported, now)
        # Clear what went quiet first: a cause that comes back later is a new finding.
        reported_now = {f.id for f in reported}
        cleared, expired = self._clear_quiet(now, reported_now)
        self._forget_hints(now)
        self._group_incidents(reported, cleared, now)
        new, escalated, new_hints = self._admit(reported, reported_now, now)

        self._previous_tick = now
        self.ticks += 1
        self.samples_ingested_total += ingested
        result = TickResult(
            now=now,
            new_findings=new,
            escalated_findings=escalated,
            active_findings=list(self.active.values()),
            cleared_findings=cleared,
            new_hints=new_hints,
            expired_hints=expired,
            duration_seconds=time.perf_counter() - t0,
            samples_ingested=ingested,
            collector_errors=errors,
            detector_seconds=det_seconds,
            suppressed_findings=suppressed,
            job_levels=self.levels.job_levels(),
        )
        for sink in self.sinks:
            sink.on_tick(result, self.window)
        return result

    def _collect(self, now: float) -> tuple[int, dict[str, int]]:
        """Every collector's rows into the window, sealed at `now`: (rows ingested, errors per collector)."""
        ingested = 0
        # A collector that raises or whose targets fail is tracked, never fatal to the tick.
        # The node's own GPU → job map fills job/rank of per-GPU rows (pipeline/jobjoin.py).
        for stream, df in self.jobjoin.apply(self.health.collect_all(self.collectors, now)):
            self.window.add(stream, df)
            ingested += df.height
        errors = {collector.name: collector.errors for collector in self.collectors}
        self.window.seal(now)
        self.levels.observe(self.window)
        return ingested, errors

    def _detect(self, now: float) -> tuple[list[Finding], list[Finding], dict[str, float]]:
        """Run the detectors that are due: (findings reported, findings suppressed by level, seconds per detector)."""
        reported: list[Finding] = []
        suppressed: list[Finding] = []
        det_seconds: dict[str, float] = {}
        for detector in self.detectors:
            period = self._period(detector)
            last = self._detector_last_run.get(detector.name)
            if (last is not None and now - last < period - 1e-9) or not self.levels.needed(detector):
                # Not due: keep its active findings alive until it runs again.
                reported.extend(f for f in self.active.values() if f.source == detector.name)
                ingest = getattr(detector, "ingest", None)
                if ingest is not None and self.levels.needed(detector):
                    # A detector with running state folds every tick's rows in (O(new rows));
                    # without this it would rebuild from the whole window when next due.
                    d0 = time.perf_counter()
                    ingest(self.window)
                    det_seconds[detector.name] = time.perf_counter() - d0
                continue
            self._detector_last_run[detector.name] = now
            d0 = time.perf_counter()
            kept, dropped = self.levels.select(detector, detector.detect(self.window))
            reported.extend(kept)
            suppressed.extend(dropped)
            det_seconds[detector.name] = time.perf_counter() - d0
        return reported, suppressed, det_seconds

    def _retain(self) -> None:
        # The older history a detector keeps only for some keys (declared_retention), from the
        # next seal on.
        # A window set from outside (tests compare against a whole window) keeps every row.
        retain = getattr(self.window, "retain", None) if self.window is self._declared_window else None
        if retain is not None:
            for stream, rule in declared_retention(self.detectors, self.levels.needed, self._retention_keys).items():
                retain(stream, *(rule if rule is not None else (0.0, None)))

    def _add_own_findings(self, reported: list[Finding], now: float) -> None:
        """Collector health and named components join the detectors' findings; all are classified."""
        reported.extend(self.health.findings(now))
        if self.components is not None:
            # Named components are reported like any finding, before clearing: one that goes on
            # being named is one finding, not a new one (and a new drain) each tick.
            reported.extend(self.components.observe(reported, now))
        # Whose fault, before anything acts on it or tells anybody (pipeline/hints.py: classify).
        for finding in reported:
            self.hint_policy.classify(finding)

    def _clear_quiet(self, now: float, reported_now: set[str]) -> tuple[list[Finding], list[Hint]]:
        """Clear the active findings that went quiet: (findings cleared, their hints expired)."""
        cleared: list[Finding] = []
        expired: list[Hint] = []
        recovered = set(self.health.recovered)  # a collector back up clears at once
        # A finding reported on this tick and on the previous one never went quiet, however far
        # apart the ticks are (a replay of 60 s history ticks every 60 s): quiet means a tick passed
        # without it, for longer than its clear time.
        for key, finding in list(self.active.items()):
            continuous = key in reported_now and self.last_seen[key] == self._previous_tick
            if key in recovered or (not continuous and now - self.last_seen[key] > self._clear_after(finding)):
                cleared.append(self.active.pop(key))
                expired.extend(self.active_hints.pop(key, []))
                # A cause that comes back later is a new finding: nothing of this one is kept.
                self.first_seen.pop(key, None)
                self.last_seen.pop(key, None)
        return cleared, expired

    def _group_incidents(self, reported: list[Finding], cleared: list[Finding], now: float) -> None:
        self.incidents.forget(f.id for f in cleared)
        self.incidents.expire(now)
        # Every reported finding gets its incident and role before any sink sees it.
        self.incidents.observe(reported, now)
        if self.components is not None:
            for named in self.components.named.values():
                if named.finding is not None:
                    self.incidents.absorb(named.finding, self.components.member_findings(named))

    def _admit(self, reported: list[Finding], reported_now: set[str], now: float) -> tuple[list[Finding], list[Finding], list[Hint]]:
        """Make the reported findings active, with the hints of new ones: (new, escalated, new hints)."""
        new: list[Finding] = []
        escalated: list[Finding] = []
        new_hints: list[Hint] = []
        if self._held:
            new_hints.extend(self._release_held(now, reported_now))
        for finding in reported:
            key = finding.id
            before = self.active.get(key)
            rose = before is not None and SEVERITY_RANK[finding.severity] > SEVERITY_RANK[before.severity]
            if rose:
                escalated.append(finding)
            if key not in self.active:
                new.append(finding)
                self.first_seen[key] = now
                self.all_findings.append(finding)
            if key not in self.active or (rose and before is not None and before.evidence.get("fault") != finding.evidence.get("fault")):
                # New, or its fault changed with its severity (an application XID seen under a second
                # job is now the GPU's): its hints follow the new verdict.
                hints = [h for h in self._hold(finding, self.hint_policy.hints_for(finding), now) if self._hint_due(h, now)]
                self.active_hints[key] = self.active_hints.get(key, []) + hints
                new_hints.extend(hints)
                self.all_hints.extend(hints)
            self.active[key] = finding
            self.last_seen[key] = now
        return new, escalated, new_hints
