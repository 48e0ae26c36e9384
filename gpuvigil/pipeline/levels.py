"""Observation levels: what a job is observed with, and which detector of a capability runs for it.

- L0: NVML or DCGM, the scheduler's job map and logs (no change to the job).
- L1: L0 plus switches the scheduler sets in the job's environment: PyTorch Flight Recorder
  (dump on timeout, debug-info pipe) and the NCCL Inspector profiler plugin.
- L2: the in-process hook (`gpuvigil.hook.instrument`).

Each detector declares `level`, the `streams` it reads (any of them marks a job as observable by
it) and, for the headline capabilities, a `capability` (hang, oom, straggler). Per job the
pipeline keeps the findings of the best detector of each capability the job's streams allow; a
lower level's findings for that job are suppressed (handed to sinks as `suppressed_findings`, so
that e.g. an L0 hang suspicion still triggers L1 Flight Recorder dumps). If the selected L1
detector stays silent for `fallback_seconds` after a suppressed L0 finding, the L0 one goes out:
a broken pipe must not cost the page. A key `LEVEL.capability` (e.g. `L2.hang`) sets it for one
capability of a level: the hook's progress counters cannot see a hang whose culprit entered the
collective and is stuck inside a kernel (every rank has enqueued it, nobody is missing), while
the device telemetry sees the whole job stop; so an L2 job's hang falls back to the L0/L1
finding.

For a key in `side_by_side` (default `L2.hang`, `L2.oom`, `L2.straggler`) no finding waits for a
fallback: a job at that
level has the lower detectors its data allows run beside the selected one, and the first
finding of the capability pages. Later findings from the other detectors *join* it: they go out
as the same finding (one id per job and kind, so no second page), with their level, time and
culprits under `evidence.joined`; a page that named no culprit takes the first one a joining
detector names. A lower detector's finding is held back while a detector of the job's level
vouches for the job (`healthy_jobs`: the hook sees its collectives completing, or nobody in
one): the device view is the weaker evidence. The hook's OOM and straggler fits need its rows a
second or so apart; a hook that publishes more slowly, a growth over hours or a straggler that
comes and goes for minutes is seen by the device's detectors (which adapt to dcgm-exporter's 30 s)
first, and the hook's finding joins theirs.

A detector reads a per-job stream only where the rows carry what it needs: `DERIVED` streams
are seen for a job when its rows of the source stream have the column filled. The L2 straggler
detector reads `rank_wait` (hook rows with a collective wait); a hooked job whose hook sends
none is served by the L1/L0 straggler detectors, as an unhooked one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from gpuvigil.model import Finding

LEVELS = ("L0", "L1", "L2")
RANK = {lvl: i for i, lvl in enumerate(LEVELS)}
# Per-job streams and the level they mark (device streams carry no job: every placed job is L0).
STREAM_LEVEL = {"collective_progress": "L1", "fr_pipes": "L1", "fr_analysis": "L1", "rank_progress": "L2", "allocator_stats": "L2", "rank_wait": "L2"}
# Streams seen for a job when its rows of (stream) have (column) filled, not just any row.
DERIVED = {"rank_wait": ("rank_progress", "collective_wait_seconds")}


def level_of(detector: Any) -> str:
    return getattr(detector, "level", "L0")


class LevelsConfig(BaseModel):
    """The `levels` config section (validated at load with every other section; LevelSelector's
    keyword arguments)."""

    model_config = ConfigDict(extra="forbid")

    memory_seconds: float = Field(900.0, gt=0)
    # Per level ("L1") or per level and capability ("L2.hang"); the latter wins.
    fallback_seconds: dict[str, float] = Field(default_factory=lambda: {"L1": 60.0, "L2.hang": 30.0})
    # "LEVEL.capability" keys whose lower detectors run beside the selected one: first finding
    # pages, the others join it (a key here makes its fallback_seconds unused).
    side_by_side: list[str] = Field(default_factory=lambda: ["L2.hang", "L2.oom", "L2.straggler"])
    # A joined finding belongs to the same incident while some detector kept reporting it
    # within this many seconds.
    join_seconds: float = Field(60.0, gt=0)


class LevelSelector:
    """Tracks which per-job streams each job has shown, and filters findings by level."""

    def __init__(
        self,
        detectors: Sequence[Any],
        memory_seconds: float = 900.0,
        fallback_seconds: dict[str, float] | None = None,
        side_by_side: Iterable[str] | None = None,
        join_seconds: float = 60.0,
    ):
        self.detectors = list(detectors)
        self.memory_seconds = memory_seconds
        self.fallback_seconds = {"L1": 60.0, "L2.hang": 30.0} if fallback_seconds is None else dict(fallback_seconds)
        self.side_by_side = {"L2.hang", "L2.oom", "L2.straggler"} if side_by_side is None else set(side_by_side)
        self.join_seconds = join_seconds
        self._incidents: dict[tuple[str, str], dict[str, Any]] = {}  # (capability, job) → the paged finding and who joined
        self._seen: dict[tuple[str, str], float] = {}  # (job, stream) → last ts seen
        self._jobs: dict[str, float] = {}
        self._quiet_since: dict[tuple[str, str], float] = {}  # (capability, job) → first suppressed finding
        self._last_suppressed: dict[tuple[str, str], float] = {}  # (capability, job) → latest suppressed finding
        self._selected_reported: dict[tuple[str, str], float] = {}
        self.now = 0.0
        by_cap: dict[str, list[Any]] = {}
        for d in self.detectors:
            if getattr(d, "capability", None):
                by_cap.setdefault(d.capability, []).append(d)
        self.by_capability = by_cap

    def observe(self, window: Any) -> None:
        self.now = now = window.now
        for stream in STREAM_LEVEL:
            source, column = DERIVED.get(stream, (stream, None))
            df = window.fresh(source)
            if df.height and "job" in df.columns:
                if column is not None:
                    if column not in df.columns:
                        continue
                    df = df.filter(pl.col(column).is_not_null())
                for job in df.get_column("job").drop_nulls().unique().to_list():
                    self._seen[(job, stream)] = now
        alloc = window.get("allocations")
        if alloc.height:
            for job in alloc.get_column("job").drop_nulls().unique().to_list():
                self._jobs[job] = now
        cutoff = now - self.memory_seconds
        if len(self._seen) > 4 * max(1, len(self._jobs)) * len(STREAM_LEVEL):
            self._seen = {k: v for k, v in self._seen.items() if v >= cutoff}
        self._levels = self._compute_levels()
        self._needed: dict[tuple[str, str], bool] = {}

    def streams_of(self, job: str) -> set[str]:
        cutoff = self.now - self.memory_seconds
        return {s for s in STREAM_LEVEL if self._seen.get((job, s), -1e18) >= cutoff}

    def job_level(self, job: str) -> str:
        return max((STREAM_LEVEL[s] for s in self.streams_of(job)), key=RANK.__getitem__, default="L0")

    def job_levels(self) -> dict[str, str]:
        return dict(getattr(self, "_levels", {}))

    def _compute_levels(self) -> dict[str, str]:
        cutoff = self.now - self.memory_seconds
        jobs = {j for j, t in self._jobs.items() if t >= cutoff} | {j for (j, _s), t in self._seen.items() if t >= cutoff}
        streams = {j: frozenset(self.streams_of(j)) for j in sorted(jobs)}
        # The jobs' distinct stream sets: what `needed` decides on (a fleet of 1,000s of jobs has
        # a handful), so its cost does not grow with the jobs.
        self._stream_sets = set(streams.values())
        return {j: max((STREAM_LEVEL[s] for s in ss), key=RANK.__getitem__, default="L0") for j, ss in streams.items()}

    def best(self, capability: str, job: str) -> str:
        return self._best_for_streams(capability, frozenset(self.streams_of(job)))

    def _best_for_streams(self, capability: str, streams: frozenset[str]) -> str:
        """The highest level of the capability's detectors available to a job whose streams are
        `streams`: an L0 detector always is, a higher one when it reads one of them."""
        return max(
            (level_of(d) for d in self.by_capability.get(capability, []) if level_of(d) == "L0" or set(getattr(d, "streams", ())) & streams),
            key=RANK.__getitem__,
            default="L0",
        )

    def needed(self, detector: Any) -> bool:
        """Whether a capability detector is the selected one for some job now (else skip it)."""
        cap = getattr(detector, "capability", None)
        if not cap:
            return True
        key = (cap, level_of(detector))
        if key not in self._needed:
            # An L0 detector also serves L1 jobs: its findings trigger L1 dumps and are the fallback;
            # and the jobs of any higher level that falls back for this capability.
            if key[1] == "L0":
                wanted = ("L0", "L1", *(lvl for lvl in LEVELS[2:] if self.fallback(lvl, cap) is not None))
            else:
                wanted = (key[1], *(lvl for lvl in LEVELS if RANK[lvl] > RANK[key[1]] and self.fallback(lvl, cap) is not None))
            self._needed[key] = any(self._best_for_streams(cap, ss) in wanted for ss in getattr(self, "_stream_sets", ()))
        return self._needed[key]

    def jobs_selecting(self, detector: Any, jobs: Iterable[str], within: float) -> set[str]:
        """Of `jobs`, those whose findings from `detector` `select` may keep now or within the next
        `within` seconds (memory at 100,000 GPUs: the history its look-back reads is kept
        for these jobs' GPUs only). With no new rows a job's level only falls, as its streams age
        out of memory_seconds, so the best level it can have in that span is between its best
        level `within` seconds from now and its best now; a finding is kept where that level is
        the detector's own or lower, or one that falls back for the capability."""
        lvl = level_of(detector)
        cap = getattr(detector, "capability", None)
        if not cap:
            return set(jobs)
        later = self.now + within - self.memory_seconds
        cutoff = self.now - self.memory_seconds
        out = set()
        # Decided once per distinct (streams now, streams still seen then): a fleet's 1,000s of
        # jobs share a handful.
        decided: dict[tuple[frozenset[str], frozenset[str]], bool] = {}
        for job in jobs:
            last = {s: self._seen.get((job, s), -1e18) for s in STREAM_LEVEL}
            key = (frozenset(s for s, t in last.items() if t >= cutoff), frozenset(s for s, t in last.items() if t >= later))
            keep = decided.get(key)
            if keep is None:
                hi = RANK[self._best_for_streams(cap, key[0])]
                lo = RANK[self._best_for_streams(cap, key[1])]
                keep = decided[key] = any(RANK[lvl] >= r or self.fallback(LEVELS[r], cap) is not None for r in range(lo, hi + 1))
            if keep:
                out.add(job)
        return out

    def fallback(self, level: str, capability: str) -> float | None:
        """Seconds after which `level` falls back for `capability` (None: never); 0 where the
        lower detectors run side by side (their findings may go out at once)."""
        if f"{level}.{capability}" in self.side_by_side:
            return 0.0
        return self.fallback_seconds.get(f"{level}.{capability}", self.fallback_seconds.get(level))

    def _vouched(self, capability: str, level: str, job: str) -> bool:
        """Whether a detector of `level` for `capability` last saw `job` healthy."""
        return any(level_of(d) == level and job in getattr(d, "healthy_jobs", ()) for d in self.by_capability.get(capability, []))

    def _join(self, detector: Any, key: tuple[str, str], f: Finding) -> Finding:
        """The finding that goes out for `f` under side-by-side selection: `f` itself when it
        opens an incident, else the incident's finding with `f` joined as evidence."""
        now = self.now
        inc = self._incidents.get(key)
        if inc is None or now - inc["last"] > self.join_seconds:
            if len(self._incidents) > 1024:
                self._incidents = {k: v for k, v in self._incidents.items() if now - v["last"] <= self.join_seconds}
            self._incidents[key] = {"source": detector.name, "finding": f, "last": now, "joined": {}}
            return f
        inc["last"] = now
        if detector.name == inc["source"]:
            inc["finding"] = f
        else:
            prev = inc["joined"].get(detector.name, {})
            inc["joined"][detector.name] = {
                "level": level_of(detector),
                "first_ts": prev.get("first_ts", f.ts),
                "culprit_ranks": list(f.culprit_ranks),
                "summary": f.summary,
            }
        out = inc["finding"].model_copy(deep=True)
        if inc["joined"]:
            out.evidence["joined"] = {k: dict(v) for k, v in inc["joined"].items()}
        if not out.culprit_ranks:
            # The page named no culprit (L0: a rank stuck inside a kernel reads like its peers):
            # take the best-placed one a joining detector names.
            by = {d.name: d for d in self.by_capability.get(key[0], [])}
            namers = sorted((n for n, j in inc["joined"].items() if j["culprit_ranks"]), key=lambda n: -RANK[level_of(by[n])] if n in by else 0)
            if namers:
                j = inc["joined"][namers[0]]
                out.culprit_ranks = list(j["culprit_ranks"])
                out.ranks = sorted(set(out.ranks) | set(j["culprit_ranks"]))
                out.evidence["culprit_from"] = namers[0]
        return out

    def select(self, detector: Any, findings: Iterable[Finding]) -> tuple[list[Finding], list[Finding]]:
        """(kept, suppressed); every finding gets its detector's level in `evidence`."""
        lvl = level_of(detector)
        cap = getattr(detector, "capability", None)
        kept: list[Finding] = []
        dropped: list[Finding] = []
        for f in findings:
            f.evidence.setdefault("level", lvl)
            if not cap or f.job is None:
                kept.append(f)
                continue
            best = self.best(cap, f.job)
            key = (cap, f.job)
            if f"{best}.{cap}" in self.side_by_side and RANK[lvl] <= RANK[best]:
                if RANK[lvl] < RANK[best] and self._vouched(cap, best, f.job):
                    dropped.append(f)
                else:
                    kept.append(self._join(detector, key, f))
                continue
            if best == lvl:
                self._selected_reported[key] = self.now
                kept.append(f)
                continue
            if RANK[lvl] > RANK[best]:
                kept.append(f)  # a higher level than expected showed up: never hide better evidence
                continue
            fallback = self.fallback(best, cap)
            last = self._last_suppressed.get(key)
            if key not in self._quiet_since or (fallback is not None and last is not None and self.now - last > fallback):
                # A new suspicion (the last one went quiet for longer than the fallback): the
                # selected detector gets its full time again; a transient L0 suspicion long ago
                # must not send today's finding out at once.
                self._quiet_since[key] = self.now
            self._last_suppressed[key] = self.now
            since = self._quiet_since[key]
            selected_spoke = self._selected_reported.get(key, -1e18) >= since
            if fallback is not None and not selected_spoke and self.now - since >= fallback:
                f.evidence["fallback_from"] = best
                kept.append(f)
            else:
                dropped.append(f)
        return kept, dropped

    def frame(self) -> pl.DataFrame:
        levels = self.job_levels()
        return pl.DataFrame({"job": list(levels), "level": list(levels.values())}, schema={"job": pl.Utf8, "level": pl.Utf8})
