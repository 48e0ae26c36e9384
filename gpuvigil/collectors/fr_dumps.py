"""L1 Flight Recorder without touching the training code: watch the dump folder, and ask ranks
to dump on demand through their debug-info pipes.

The scheduler sets, per job (deploy/slurm-taskprolog-l1.sh, deploy/k8s-pod-env-l1.yaml):

    TORCH_NCCL_TRACE_BUFFER_SIZE=2000           # record the last 2000 collectives per rank
    TORCH_NCCL_DUMP_ON_TIMEOUT=1                # the watchdog dumps every rank when it fires
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<root>/<job>/fr_dump_   # dump file prefix (+ rank)
    TORCH_FR_DUMP_TEMP_FILE=<root>/<job>/fr_dump_           # the same, newer torch name
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<root>/<job>/fr_pipe_   # each rank creates fr_pipe_<rank>.pipe

`FrDumpWatcher` (a collector) scans `<root>/<job>/`: every FIFO there is a rank's debug-info pipe
(stream `fr_pipes`: the job is observable at L1); every complete set of dump files is loaded
with the restricted unpickler / JSON reader and run through the cross-rank analysis of
`gpuvigil.collectors.flight_recorder` (stream `fr_analysis`: culprit ranks, sequence number, op).
A set is complete when it holds a dump per member of the process group, or when it has not
changed for `settle_seconds` (a dead rank writes nothing). Dumps written by the watchdog on a timeout are analysed the same way
(trigger `timeout`). `analysis_rows` is the one conversion of analyses into rows; `analyze` and
`gpuvigil fr` use it too (trigger `offline`).

`FrDumpTrigger` (a pipeline sink) writes to every pipe of a job when an L0 hang is suspected
(a finding, raised or suppressed by the level selection), when NCCL Inspector shows the job's
collectives stopped completing, or every `every_seconds` (0: never). It does not decide anything:
the `hang_fr` and `fr_mismatch` detectors do, from the analyses.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors import flight_recorder as fr
from gpuvigil.errors import UserError
from gpuvigil.util.progress import CollectiveClock

STREAMS: Mapping[str, pl.Schema] = {"fr_pipes": schemas.FR_PIPES, "fr_analysis": schemas.FR_ANALYSIS}
_RANK = fr._RANK_IN_NAME


@dataclass
class FrRequests:
    """Shared between trigger and watcher: when each job was last asked to dump."""

    asked: dict[str, float] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)


def _pipe_rank(name: str) -> int | None:
    stem = name[: -len(".pipe")] if name.endswith(".pipe") else name
    m = _RANK.search(stem)
    return int(m.group(1)) if m else None


def refine_culprits(analysis: fr.GroupAnalysis, dumps: list[fr.FRDump]) -> list[int]:
    """Culprits the generic analysis leaves open: ranks that wrote no dump (a dead process), or,
    when every rank holds the pending collective, those whose kernel never started (stuck in a
    compute kernel before it) while the others' did."""
    culprits = list(analysis.culprit_ranks)
    ranks = list(analysis.ranks)
    if culprits and len(culprits) < max(len(ranks), 1):
        return culprits
    missing = list(analysis.evidence.get("ranks_without_dump") or [])
    if missing:
        return sorted(missing)
    seq = analysis.evidence.get("collective_seq_id")
    pg = analysis.evidence.get("pg")
    states = {}
    for d in dumps:
        e = d.collectives(str(pg)).get(seq) if pg is not None and seq is not None else None
        if e is not None and d.rank is not None:
            states[d.rank] = e.state
    started = {r for r, s in states.items() if s in ("started", "completed")}
    scheduled = sorted(r for r, s in states.items() if s == "scheduled")
    if started and scheduled:
        return scheduled
    return culprits


class FrDumpWatcher:
    """Collector over `<root>/<job>/` folders of Flight Recorder pipes and dumps."""

    name = "fr_dumps"
    streams = STREAMS

    def __init__(self, root: str | Path, *, node: str | None = None, requests: FrRequests | None = None, pipes_every_seconds: float = 60.0, settle_seconds: float = 2.0):
        self.root = Path(root)
        self.settle_seconds = settle_seconds
        self.node = node
        self.requests = requests or FrRequests()
        self.pipes_every_seconds = pipes_every_seconds
        self.errors = 0
        self.last_error: str | None = None
        self._pending: dict[str, tuple] = {}  # job → signature seen on the previous scan
        self._done: dict[str, tuple] = {}  # job → signature already analysed
        self._pipes_at: dict[str, float] = {}

    def _scan(self, folder: Path) -> tuple[list[Path], list[tuple[int, str]]]:
        dumps, pipes = [], []
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return [], []
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISFIFO(st.st_mode):
                r = _pipe_rank(e.name)
                if r is not None:
                    pipes.append((r, e.path))
            elif stat.S_ISREG(st.st_mode) and not e.name.startswith(".") and not e.name.endswith((".tmp", ".pipe")):
                dumps.append(Path(e.path))
        return sorted(dumps), sorted(pipes)

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        pipe_rows: list[dict] = []
        rows: list[dict] = []
        if not self.root.is_dir():
            return {}
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            job = folder.name
            dumps, pipes = self._scan(folder)
            if pipes and now - self._pipes_at.get(job, -1e18) >= self.pipes_every_seconds:
                self._pipes_at[job] = now
                pipe_rows += [{"ts": now, "job": job, "rank": r, "node": self.node, "path": p} for r, p in pipes]
            if not dumps:
                continue
            try:
                sig = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in dumps)
            except OSError:
                continue
            if sig == self._done.get(job):
                continue
            try:
                loaded = [fr.load_dump(p) for p in dumps if fr.is_flight_recorder_dump(p)]
            except UserError as exc:
                self.errors += 1
                self.last_error = str(exc)
                self._done[job] = sig
                continue
            if not loaded:
                continue
            size = max((len(c.ranks) for d in loaded for c in d.pg_config.values() if c.ranks), default=0)
            prev = self._pending.get(job)
            if prev is None or prev[0] != sig:
                self._pending[job] = (sig, now)
                prev = (sig, now)
            settled = now - prev[1] >= self.settle_seconds
            if not (size and len(loaded) >= size) and not settled:
                continue  # ranks are still writing (or a dead rank never will): look again
            self._done[job] = sig
            rows += self._analyse(job, loaded, now, max(s[1] for s in sig) / 1e9)
        out: dict[str, pl.DataFrame] = {}
        if pipe_rows:
            out["fr_pipes"] = schemas.frame(pipe_rows, schemas.FR_PIPES)
        if rows:
            out["fr_analysis"] = schemas.frame(rows, schemas.FR_ANALYSIS)
        return out

    def _analyse(self, job: str, dumps: list[fr.FRDump], now: float, dump_mtime: float) -> list[dict]:
        try:
            analyses = fr.analyze_dumps(dumps)
        except UserError as exc:
            self.errors += 1
            self.last_error = str(exc)
            return []
        trigger = self.requests.how.get(job, "on_demand") if job in self.requests.asked else "timeout"
        self.requests.asked.pop(job, None)
        return analysis_rows(analyses, dumps, job=job, trigger=trigger, ts=now, dump_ts=dump_mtime)


def analysis_rows(analyses: list[fr.GroupAnalysis], dumps: list[fr.FRDump], *, job: str | None, trigger: str, ts: float | None, dump_ts: float | None) -> list[dict]:
    """One job's analyses as `fr_analysis` rows (a `none` row when the dumps show no problem), the
    one conversion the watcher and `analyze` / `gpuvigil fr` use. `ts`: when they were analysed;
    None (dumps read after the fact): each analysis's own time."""
    base = {"job": job, "trigger": trigger, "dump_ts": dump_ts, "n_dumps": len(dumps)}
    if not analyses:
        when = ts if ts is not None else dump_ts
        return [{**base, "ts": when, "kind": "none", "culprit_ranks": [], "ranks": sorted(d.rank for d in dumps if d.rank is not None)}]
    return [
        {
            **base,
            "ts": a.ts if ts is None else ts,
            "kind": a.kind,
            "culprit_ranks": refine_culprits(a, dumps),
            "ranks": list(a.ranks),
            "pg": a.evidence.get("pg"),
            "seq": a.evidence.get("collective_seq_id"),
            "op": a.evidence.get("op"),
            "node": a.node,
            "summary": a.summary,
            "source": a.source,
            "evidence_json": json.dumps(a.evidence, sort_keys=True, default=str),
        }
        for a in analyses
    ]


def pipe_writer(root: str | Path) -> Callable[[str], bool]:
    """Write one byte to every debug-info pipe of a job (`<root>/<job>/*.pipe`): each rank's
    watchdog thread reads it and dumps. Non-blocking: a pipe nobody reads is skipped."""
    base = Path(root)

    def write(job: str) -> bool:
        wrote = False
        folder = base / job
        try:
            names = os.listdir(folder)
        except OSError:
            return False
        for name in names:
            path = folder / name
            try:
                if not stat.S_ISFIFO(os.stat(path).st_mode):
                    continue
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno in (errno.ENXIO, errno.ENOENT):
                    continue  # no reader (the rank exited) or gone
                raise
            try:
                os.write(fd, b"1\n")
                wrote = True
            finally:
                os.close(fd)
        return wrote

    return write


class FrDumpTrigger:
    """Pipeline sink: asks a job's ranks for Flight Recorder dumps when its hang is suspected."""

    def __init__(self, writer: Callable[[str], bool], requests: FrRequests, *, every_seconds: float = 0.0, min_interval_seconds: float = 5.0,
                 stall_seconds: float = 3.0, stall_intervals: float = 1.0, max_asks_per_suspicion: int = 2):
        self.writer = writer
        self.requests = requests
        self.every_seconds = every_seconds
        self.min_interval_seconds = min_interval_seconds
        self.stall_seconds = stall_seconds
        self.stall_intervals = stall_intervals
        self._clock = CollectiveClock()
        self._periodic_at: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._asks: dict[str, int] = {}
        self.max_asks_per_suspicion = max_asks_per_suspicion
        self.requested = 0
        self._l0_suspects: set[str] = set()  # jobs whose current suspicion includes an L0 hang finding

    def _inspector_stalls(self, window, now: float) -> set[str]:
        self._clock.observe(window.fresh("collective_progress"), now)
        return self._clock.stalled(now, self.stall_seconds, self.stall_intervals)

    def on_tick(self, result, window) -> None:
        now = result.now
        why: dict[str, str] = {}
        l0: set[str] = set()
        for f in [*result.new_findings, *getattr(result, "suppressed_findings", [])]:
            if f.kind.value == "collective_hang" and f.job and f.evidence.get("level") == "L0":
                why.setdefault(f.job, "on_demand")
                l0.add(f.job)
        for job in l0 - self._l0_suspects:
            # The GPUs now say hung: a new suspicion, even where the Inspector's stall (a
            # checkpoint that ran straight into the hang) already spent this one's asks on dumps
            # that showed no pending collective.
            self._asks.pop(job, None)
        self._l0_suspects = l0 | {j for j in self._l0_suspects if j in why}
        for job in self._inspector_stalls(window, now):
            why.setdefault(job, "on_demand")
        if self.every_seconds > 0:
            pipes = window.get("fr_pipes")
            for job in pipes["job"].unique().to_list() if pipes.height else []:
                if now - self._periodic_at.get(job, -1e18) >= self.every_seconds:
                    self._periodic_at[job] = now
                    why.setdefault(job, "periodic")
        for job in list(self._asks):
            if job not in why:
                del self._asks[job]  # the suspicion is gone: a new one may ask again
        for job, how in why.items():
            last = self._last.get(job)
            if last is not None and now - last < self.min_interval_seconds:
                continue
            if how != "periodic":
                # One dump and one to confirm it per suspicion: a checkpoint that stops the
                # collectives for minutes must not cost a dump every few seconds.
                if self._asks.get(job, 0) >= self.max_asks_per_suspicion:
                    continue
                self._asks[job] = self._asks.get(job, 0) + 1
            self._last[job] = now
            self.ask(job, now, how)

    def ask(self, job: str, now: float, how: str = "on_demand") -> bool:
        """Write the job's pipes now and note the request, so the watcher labels the dumps that
        answer it (`how`). Called by `on_tick`, and by the fleet's agent for the requests detect
        sends."""
        if not self.writer(job):
            return False
        self.requests.asked[job] = now
        self.requests.how[job] = how
        self.requested += 1
        return True
