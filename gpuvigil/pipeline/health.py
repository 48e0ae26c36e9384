"""Collector failures are loud: per-target health, `collector_down` findings, log lines.

A collector reports how each of its targets fared on the latest `collect` through an optional
`health()` → `{target: None | "reason"}` (a DCGM endpoint, /dev/kmsg, a log file...), or, for
one target, `up = False` with `last_error`. A `collect` that raises is a failure of all its
targets (the tick goes on without it). After
`down_after` failures in a row (config `pipeline.collector_down_after_failures`) a target is
down: a WARNING names it and the reason, its `gpuvigil_collector_up` goes to 0, and a
`collector_down` finding (ticket) is raised every tick while it stays down. The first success
after that logs the recovery and clears the finding at once.

A target is up only once a read of it worked: its first successful read is logged ("... is up"),
once, and until then `last_read_ok` is False. The log has one line per change of state (up, down,
up again), never one per read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import polars as pl

from gpuvigil.collectors.base import Collector
from gpuvigil.model import Finding, FindingKind, Severity

log = logging.getLogger("gpuvigil.pipeline")


@dataclass
class CollectorHealth:
    collector: str
    target: str
    up: bool = True
    consecutive_failures: int = 0
    reason: str | None = None  # the latest failure's reason
    failing_since: float | None = None
    down_since: float | None = None
    failures_total: int = 0
    node: str | None = None  # the node the collector watches, when it is one node's
    ever_ok: bool = False  # a read of it has worked (it was reported up)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _who(collector: str, target: str, label: tuple[str, str] | None = None) -> str:
    if label is not None:  # how its owner names it, e.g. serve's ("source dcgm", where it reads)
        name, where = label
        return f"{name}: {where if target == collector else target}"
    return f"collector {collector}" if target == collector or target in collector else f"collector {collector}: {target}"


def finding_id(collector: str, target: str) -> str:
    return collector_down_finding(CollectorHealth(collector, target), 0.0, 1).id


def collector_down_finding(h: CollectorHealth, now: float, down_after: int) -> Finding:
    return Finding(
        kind=FindingKind.COLLECTOR_DOWN,
        severity=Severity.TICKET,
        ts=h.down_since if h.down_since is not None else now,
        node=h.node,
        evidence={
            "collector": h.collector,
            "target": h.target,
            "reason": h.reason,
            "consecutive_failures": h.consecutive_failures,
            "failing_since": h.failing_since,
            "down_after_failures": down_after,
        },
        summary=f"Collector {h.collector} cannot read {h.target}: {h.reason or 'unknown error'} "
        f"({h.consecutive_failures} failed collects in a row); detectors are blind to what it watches",
        source="pipeline",
    )


class HealthTracker:
    """Runs every collector's `collect` for a tick and keeps the health of each target."""

    def __init__(self, down_after: int = 3):
        self.down_after = down_after
        self.table: dict[tuple[str, str], CollectorHealth] = {}
        self.recovered: list[str] = []  # ids of findings to clear this tick
        # collector name → how the log names it: (name, where it reads), e.g. serve's ("source
        # dcgm", URL); a target of its own is named instead of `where`. Default "collector NAME".
        self.labels: dict[str, tuple[str, str]] = {}

    def _targets_of(self, collector: Collector) -> list[str]:
        known = [t for (c, t) in self.table if c == collector.name]
        return known or [collector.name]

    def collect_all(self, collectors: Sequence[Collector], now: float) -> list[tuple[str, pl.DataFrame]]:
        frames: list[tuple[str, pl.DataFrame]] = []
        self.recovered = []
        for collector in collectors:
            errors_before = int(getattr(collector, "errors", 0))
            try:
                out = collector.collect(now)
            except Exception as exc:  # noqa: BLE001 - one broken collector must not stop the others
                collector.errors = errors_before + 1
                reason = _one_line(f"collect raised {type(exc).__name__}: {exc}")
                self._update(collector, {t: reason for t in self._targets_of(collector)}, now)
                continue
            frames.extend(out.items())
            status = getattr(collector, "health", None)
            try:
                if callable(status):
                    targets = dict(status())
                elif getattr(collector, "up", None) is False:  # a collector that keeps its own `up`
                    targets = {collector.name: getattr(collector, "last_error", None) or "reported down"}
                elif int(getattr(collector, "errors", 0)) > errors_before and not out:
                    # it counted a failure and produced nothing: its read failed this tick
                    targets = {collector.name: getattr(collector, "last_error", None) or "read failed"}
                else:
                    targets = {collector.name: None}
            except Exception as exc:  # noqa: BLE001
                targets = {t: _one_line(f"health() raised {type(exc).__name__}: {exc}") for t in self._targets_of(collector)}
            self._update(collector, targets or {collector.name: None}, now)
        return frames

    def _update(self, source: Collector, targets: dict[str, str | None], now: float) -> None:
        collector = source.name
        node = getattr(source, "node", None)
        for target, reason in targets.items():
            h = self.table.setdefault((collector, str(target)), CollectorHealth(collector, str(target), node=node if isinstance(node, str) else None))
            who = _who(collector, str(target), self.labels.get(collector))
            if reason is None:
                if not h.up:
                    self.recovered.append(finding_id(collector, str(target)))
                if not h.up and h.ever_ok:
                    log.info("%s is up again: recovered after %.0f s down (%d failed collects)", who, now - (h.down_since or now), h.consecutive_failures)
                elif not h.ever_ok:
                    # A named source's first read is news to whoever watches the log; a built-in
                    # collector's (the scheduler's own state) is not.
                    log.log(logging.INFO if collector in self.labels else logging.DEBUG,
                            "%s is up" + (" after %d failed collects" % h.consecutive_failures if h.consecutive_failures else ""), who)
                h.up, h.ever_ok, h.consecutive_failures, h.failing_since, h.down_since = True, True, 0, None, None
                continue
            h.reason = _one_line(reason)
            h.failures_total += 1
            h.consecutive_failures += 1
            if h.failing_since is None:
                h.failing_since = now
            if h.up and h.consecutive_failures >= self.down_after:
                h.up, h.down_since = False, now
                log.warning("%s is down after %d failed collects in a row: %s", who, h.consecutive_failures, h.reason)

    def last_read_ok(self, collector: str) -> bool:
        """Whether every target of `collector` worked on its last collect: False before its first
        successful read (a source is not up until it has been read)."""
        targets = [h for (c, _t), h in self.table.items() if c == collector]
        return bool(targets) and all(h.ever_ok and h.consecutive_failures == 0 for h in targets)

    def read_yet(self, collector: str) -> bool:
        """Whether `collector` has been collected at all (a read tried, whatever its outcome)."""
        return any(c == collector for (c, _t) in self.table)

    def reason(self, collector: str) -> str | None:
        return next((h.reason for (c, _t), h in self.table.items() if c == collector and h.consecutive_failures), None)

    def findings(self, now: float) -> list[Finding]:
        return [collector_down_finding(h, now, self.down_after) for h in self.table.values() if not h.up]

    def rows(self) -> Iterable[CollectorHealth]:
        return sorted(self.table.values(), key=lambda h: (h.collector, h.target))


__all__ = ["CollectorHealth", "HealthTracker", "collector_down_finding"]
