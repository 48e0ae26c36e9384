"""`gpuvigil replay`: what would gpuvigil have said about last month, on the data you already have?

Runs the streaming pipeline (every detector, the findings lifecycle and the hint rules) over
recorded history in recorded time: the clock is the recording's, one tick per `--step`, and each
tick sees exactly the samples recorded up to that moment. Reports every finding, page and hint
with the moment it would have fired, plus pages per GPU-day and per kind.

Sources (any mix):
- a Prometheus server: `--prometheus URL --start T --end T [--step S]` (T in RFC 3339 or unix
  seconds, as promtool takes them). dcgm-exporter series (`DCGM_FI_*`, labels `Hostname`/`gpu`/
  `UUID`/`pod`/`namespace`/`job`) and gpuvigil's own series (`gpuvigil_gpu_*`, `gpuvigil_rank_*`)
  are read through the HTTP API (`/api/v1/query_range`), in chunks under its 11,000-point limit;
- files: OpenMetrics / Prometheus text with sample timestamps, NVML CSV, hook JSONL (what the
  in-process hook publishes), and every log and dump `gpuvigil analyze` reads. Logs and dumps are
  diagnosed by the offline readers and fire at their own timestamps, through the same hint rules.

Untrusted input is read as `analyze` reads it (restricted unpickler for dumps).
"""

from __future__ import annotations

import argparse
import io
import collections
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from gpuvigil import config, schemas
from gpuvigil.collectors import dcgm
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, Hint, Severity
from gpuvigil.offline.formats import (  # noqa: F401 (the readers stay importable here)
    ALL_FIELDS,
    DCGM_FIELDS,
    GPUVIGIL_ALLOC_FIELDS,
    GPUVIGIL_GPU_FIELDS,
    GPUVIGIL_IB_FIELDS,
    GPUVIGIL_RANK_FIELDS,
    LONG,
    READ_CHUNK_BYTES,
    Recorded,
    _IB_LABELS,
    _LABEL_COLUMNS,
    _labels_row,
    _long_from_labelled,
    _series_columns,
    iter_files,
    parse_duration,
    parse_time,
    read_exposition_file,
    read_hook_jsonl,
    read_series_file,
    series_kind,
    streams_from_long,
)
from gpuvigil.pipeline.incidents import MESSAGE_ROLES

MIB = 1 << 20
MAX_POINTS_PER_QUERY = 10_000  # Prometheus refuses query_range answers above 11,000 points a series


# -- sources ---------------------------------------------------------------------------------------
def query_prometheus(url: str, start: float, end: float, step: float, *, client: Any = None, metrics: Iterable[str] = ALL_FIELDS) -> pl.DataFrame:
    """Every series of `metrics` in [start, end] at `step`, as LONG rows, through query_range."""
    import httpx

    names = sorted({m.removesuffix("_total") for m in metrics} | set(metrics))
    selector = '{__name__=~"' + "|".join(re.escape(n) for n in names) + '"}'
    own = client is None
    client = client or httpx.Client(timeout=120.0)
    frames: list[pl.DataFrame] = []
    chunk = step * MAX_POINTS_PER_QUERY
    try:
        t = start
        while t <= end:
            t_end = min(end, t + chunk - step)
            try:
                resp = client.get(f"{url.rstrip('/')}/api/v1/query_range", params={"query": selector, "start": f"{t:.3f}", "end": f"{t_end:.3f}", "step": f"{step:g}"})
                resp.raise_for_status()
                fast = long_from_query_body(resp.content)
                if fast is not None:
                    frames.append(fast)
                    t = t_end + step
                    continue
                body = resp.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise UserError(f"{url}: query_range failed: {exc}") from exc
            if body.get("status") != "success":
                raise UserError(f"{url}: query_range: {body.get('error', body)}")
            try:
                frames.append(long_from_query_result(body["data"]["result"]))
            except (KeyError, TypeError, ValueError, pl.exceptions.PolarsError) as exc:
                raise UserError(f"{url}: query_range: unexpected answer: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
            t = t_end + step
    finally:
        if own:
            client.close()
    return pl.concat(frames, how="vertical_relaxed") if frames else pl.DataFrame(schema=LONG)


# the labels `_labels_row` reads, and a query_range answer's shape with only those
_QUERY_LABELS = tuple(dict.fromkeys(("__name__", *(n for names in dcgm.LABELS.values() for n in names), "exported_job", "job", "rank", *_IB_LABELS)))
_QUERY_SCHEMA = pl.Schema(
    {
        "status": pl.Utf8,
        "data": pl.Struct(
            {
                "resultType": pl.Utf8,
                "result": pl.List(pl.Struct({"metric": pl.Struct(dict.fromkeys(_QUERY_LABELS, pl.Utf8)), "values": pl.List(pl.List(pl.Utf8))})),
            }
        ),
    }
)


def long_from_query_body(body: bytes) -> pl.DataFrame | None:
    """A successful query_range answer (the JSON bytes) -> LONG rows, parsed by polars' JSON
    reader (about half the CPU of json.loads and Python lists). None when the answer is not a
    plain successful matrix (an error, an odd shape): the caller then reads it with json, as
    before. Labels are still mapped per series by `_labels_row`."""
    try:
        # The schema is given, not inferred (inference scans the whole answer: ~40% of the CPU).
        # It names only the labels `_labels_row` reads: the reader skips the others, which
        # replay never looks at, so nothing it uses is lost.
        df = pl.read_json(io.BytesIO(body), schema=_QUERY_SCHEMA)
        if df.height != 1 or df["status"][0] != "success" or df.select(pl.col("data").struct.field("resultType")).item() != "matrix":
            return None
        res = df.select(pl.col("data").struct.field("result")).explode("result")
        if res["result"].null_count() == res.height:
            return pl.DataFrame(schema=LONG)
        res = res.unnest("result")
        bases = []
        for labels in res["metric"].to_list():
            labels = {k: v for k, v in (labels or {}).items() if v is not None}
            bases.append(_labels_row(labels.get("__name__", ""), labels, 0.0, 0.0))
        per_series = pl.DataFrame(bases, schema={c: pl.Utf8 for c in ("metric", *_LABEL_COLUMNS)}, strict=False)
        points = per_series.with_columns(res["values"]).explode("values").filter(pl.col("values").list.len() == 2)
        out = points.with_columns(
            pl.col("values").list.get(0).cast(pl.Float64, strict=False).alias("ts"),
            pl.col("values").list.get(1).cast(pl.Float64, strict=False).alias("value"),
        )
    except (pl.exceptions.PolarsError, ValueError, TypeError, KeyError):
        return None
    ok = pl.col("ts").is_not_null() & pl.col("value").is_not_null() & ~pl.col("value").is_nan()
    return out.filter(ok).select([pl.col(c).cast(t) for c, t in LONG.items()])


def long_from_query_result(result: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """A query_range answer's `data.result` (matrix) -> LONG rows, as one frame: the points of
    every series flattened in one pass and the labels mapped once per series (a month of a fleet
    is millions of series-chunks: a frame per series cost more than the samples)."""
    bases: list[dict[str, Any]] = []
    counts: list[int] = []
    ts: list[Any] = []
    vs: list[Any] = []
    for series in result:
        values = series.get("values") or []
        if not values:
            continue
        labels = series["metric"]
        bases.append(_labels_row(labels.get("__name__", ""), labels, 0.0, 0.0))
        counts.append(len(values))
        t, v = zip(*values, strict=True)
        ts.extend(t)
        vs.extend(v)
    if not bases:
        return pl.DataFrame(schema=LONG)
    per_series = pl.DataFrame(bases, schema={c: pl.Utf8 for c in ("metric", *_LABEL_COLUMNS)}, strict=False)
    idx = np.repeat(np.arange(len(bases)), counts)
    out = per_series[idx].with_columns(
        pl.Series("ts", ts, dtype=pl.Float64, strict=False),
        pl.Series("value", vs, dtype=pl.Utf8, strict=False).cast(pl.Float64, strict=False),
    )
    ok = pl.col("ts").is_not_null() & pl.col("value").is_not_null() & ~pl.col("value").is_nan()
    return out.filter(ok).select([pl.col(c).cast(t) for c, t in LONG.items()])


CHUNK_SECONDS = 6 * 3600.0  # a Prometheus replay fetches and holds this much history at a time


def prometheus_chunks(url: str, start: float, end: float, step: float, chunk_seconds: float = CHUNK_SECONDS) -> Iterable[tuple[float, dict[str, pl.DataFrame]]]:
    """(until, streams) for consecutive windows of a Prometheus server's history."""
    last_xid: dict[tuple, int | None] = {}
    named: dict[tuple, bool] = {}
    t = start
    while t <= end:
        until = min(end, t + chunk_seconds - step)
        yield until, streams_from_long(query_prometheus(url, t, until, step), last_xid, named)
        t = until + step


def load_files(
    paths: Sequence[Path], recorded: Recorded, *, node: str | None = None, job: str | None = None, cfg: dict[str, Any] | None = None, at: float | None = None
) -> None:
    """Series files into streams; everything else through `analyze`'s offline readers (`at`:
    where inputs with no timestamps of their own are placed; default their file's time)."""
    from gpuvigil.offline.analyze import Analyzer

    rest: list[Path] = []
    for item in iter_files(paths):
        if isinstance(item, str):
            recorded.errors.append(item)
            continue
        try:
            with open(item, "rb") as fh:
                head = fh.read(64 * 1024).decode("utf-8", errors="replace")
        except OSError as exc:
            recorded.errors.append(f"{item}: unreadable: {exc.strerror or exc}")
            continue
        try:
            streams = read_series_file(item, head, node=node or "replay")
            if streams is None:
                rest.append(item)
                continue
            recorded.add(streams)
        except UserError as exc:
            recorded.errors.append(str(exc).splitlines()[0])
            continue
        recorded.read.append(str(item))
    if rest:
        report = Analyzer(cfg=cfg, job=job, node=node, at=at).run(rest)
        recorded.offline.extend(report.findings)
        recorded.placed.update(report.placed)
        recorded.read.extend(report.read)
        recorded.errors.extend(report.errors)


# -- the replay ------------------------------------------------------------------------------------
class ReplayCollector:
    """Hands the pipeline, at each tick, exactly the recorded rows stamped since the last tick."""

    name = "replay"

    def __init__(self, streams: Mapping[str, pl.DataFrame]):
        self.errors = 0
        self._frames = {k: v.sort("ts") for k, v in streams.items() if v.height}
        self._ts = {k: v["ts"].to_numpy() for k, v in self._frames.items()}
        self._pos = dict.fromkeys(self._frames, 0)
        self.streams = {k: schemas.STREAMS[k] for k in self._frames if k in schemas.STREAMS}

    def extend(self, streams: Mapping[str, pl.DataFrame]) -> None:
        """Append later recorded rows (the next chunk of a long replay); rows already handed out
        are dropped, so memory stays one chunk."""
        for k, new in streams.items():
            if new.height == 0:
                continue
            old = self._frames.get(k)
            rest = old.slice(self._pos[k]) if old is not None else None
            df = pl.concat([rest, new], how="vertical_relaxed") if rest is not None and rest.height else new
            self._frames[k] = df.sort("ts")
            self._ts[k] = self._frames[k]["ts"].to_numpy()
            self._pos[k] = 0
            if k in schemas.STREAMS:
                self.streams[k] = schemas.STREAMS[k]

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        out = {}
        for k, df in self._frames.items():
            end = int(np.searchsorted(self._ts[k], now, side="right"))
            start = self._pos[k]
            if end > start:
                out[k] = df.slice(start, end - start)
                self._pos[k] = end
        return out


@dataclass
class Fired:
    at: float  # recorded time the pipeline first raised it
    finding: Finding


@dataclass
class FiredHint:
    at: float
    hint: Hint


@dataclass
class ReplayResult:
    findings: list[Fired]
    hints: list[FiredHint]
    start: float
    end: float
    step: float
    ticks: int
    gpus: int
    wall_seconds: float
    samples: dict[str, int]
    errors: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    placed: dict[str, tuple[float, str]] = field(default_factory=dict)  # undated input -> (where, how)
    gpu_samples: pl.DataFrame | None = None  # kept for the report's memory plot
    rank_progress: pl.DataFrame | None = None  # ... and its progress heat map

    @property
    def pages(self) -> list[Fired]:
        """The pages on-call would have received: a page that joined an incident as evidence
        (the incident had already paged about that place) was never sent."""
        return [f for f in self.findings if f.finding.severity == Severity.PAGE and f.finding.incident_role in (None, *MESSAGE_ROLES)]

    def summary(self) -> dict[str, Any]:
        days = max((self.end - self.start) / 86400.0, 1e-9)
        gpu_days = max(self.gpus, 1) * days
        by_kind = Counter(f.finding.kind.value for f in self.pages)
        return {
            "record": "summary",
            "start": self.start,
            "end": self.end,
            "step_seconds": self.step,
            "ticks": self.ticks,
            "gpus": self.gpus,
            "gpu_days": round(gpu_days, 4),
            "findings": len(self.findings),
            "pages": len(self.pages),
            "hints": len(self.hints),
            "pages_per_gpu_day": round(len(self.pages) / gpu_days, 6),
            "pages_by_kind": dict(sorted(by_kind.items())),
            "pages_per_gpu_day_by_kind": {k: round(v / gpu_days, 6) for k, v in sorted(by_kind.items())},
            "samples": self.samples,
            "wall_seconds": round(self.wall_seconds, 3),
        }


def prefetch(items: Iterable[Any], depth: int = 1) -> Iterable[Any]:
    """`items` produced `depth` ahead in a background thread: the next chunk's fetch, JSON read and
    conversion (polars, which releases the GIL) overlap the pipeline's ticks over this one. Same
    items, same order; memory is `depth` + 1 chunks; an error in the producer is raised here."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((True, item), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((True, done))
        except BaseException as exc:  # handed to the consumer, raised there
            q.put((False, exc))

    thread = threading.Thread(target=produce, name="replay-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()


REPORT_SAMPLES_MAX = 2_000_000  # gpu_samples kept for the report's memory plot only below this


def run_replay(
    recorded: Recorded,
    *,
    cfg: dict[str, Any] | None = None,
    step: float = 30.0,
    start: float | None = None,
    end: float | None = None,
    chunks: Any = None,
) -> ReplayResult:
    """Tick the pipeline over [start, end]. `chunks`, if given, yields (until, streams): the
    recorded rows up to `until`, fetched lazily (a Prometheus replay of a month holds one chunk)."""
    from gpuvigil.app import compose

    cfg = config.defaults() if cfg is None else cfg
    streams = {k: recorded.stream(k) for k in recorded.frames}
    t0, t1 = _replay_span(recorded, start, end)
    collector = ReplayCollector(streams)
    pipeline = compose.build(cfg, "replay", [collector])
    fired: list[Fired] = []
    hints: list[FiredHint] = []
    w0 = time.perf_counter()
    # No recorded series (logs and dumps only): nothing for the streaming detectors to tick over.
    n_ticks = int(math.floor((t1 - t0) / step)) + 1 if (streams or chunks is not None) else 0
    rows = _RowsSeen.of(streams)
    it = prefetch(chunks) if chunks is not None else None
    # Logs and dumps: diagnosed offline, fired at their own time (clamped to the replayed span).
    offline = sorted(((min(max(f.ts if f.ts > 10 * 365 * 86400 else t0, t0), t1), f) for f in recorded.offline), key=lambda x: x[0])
    pending = collections.deque(offline)
    fetched_until = -math.inf if it is not None else math.inf
    for i in range(n_ticks):
        now = t0 + i * step
        while now > fetched_until and it is not None:
            nxt = next(it, None)
            if nxt is None:
                it, fetched_until = None, math.inf
                break
            fetched_until, part = nxt
            collector.extend(part)
            rows.add(part)
        while pending and pending[0][0] <= now:  # dated log/dump findings join incidents in time order
            at, f = pending.popleft()
            pipeline.incidents.observe([f], at)
        res = pipeline.tick(now)
        fired.extend(Fired(now, f) for f in (*res.new_findings, *res.escalated_findings))
        hints.extend(FiredHint(now, h) for h in res.new_hints)
    if it is not None:
        it.close()  # type: ignore[attr-defined]  # stops the prefetch thread
    for at, f in pending:  # after the last tick
        pipeline.incidents.observe([f], at)
    _fire_offline(offline, cfg, fired, hints)
    fired.sort(key=lambda x: (x.at, x.finding.ts))
    hints.sort(key=lambda x: x.at)
    return ReplayResult(
        findings=fired,
        hints=hints,
        start=t0,
        end=t1,
        step=step,
        ticks=n_ticks,
        gpus=len(rows.gpu_keys),
        wall_seconds=time.perf_counter() - w0,
        samples=rows.seen,
        errors=list(recorded.errors),
        read=list(recorded.read),
        placed=dict(recorded.placed),
        gpu_samples=rows.gpu_samples(),
        rank_progress=streams.get("rank_progress"),
    )


def _replay_span(recorded: Recorded, start: float | None, end: float | None) -> tuple[float, float]:
    """[start, end], each defaulting to the recording's own span."""
    span = recorded.span()
    if span is None and (start is None or end is None):
        raise UserError("nothing recorded to replay (no series and no dated findings)")
    t0 = start if start is not None else span[0]  # type: ignore[index]
    t1 = end if end is not None else span[1]  # type: ignore[index]
    if t1 < t0:
        raise UserError("--end is before --start")
    return t0, t1


@dataclass
class _RowsSeen:
    """What a replay counts of the rows it is handed: rows per stream, the GPUs, and the GPU
    samples the report draws (as long as they stay under REPORT_SAMPLES_MAX)."""

    seen: dict[str, int]
    gpu_keys: set[tuple]
    kept: list[pl.DataFrame]

    @classmethod
    def of(cls, streams: Mapping[str, pl.DataFrame]) -> _RowsSeen:
        gs = streams.get("gpu_samples")
        return cls({k: v.height for k, v in streams.items()}, set(gs.select("node", "gpu").unique().rows()) if gs is not None else set(), [gs] if gs is not None else [])

    def add(self, part: Mapping[str, pl.DataFrame]) -> None:
        for k, v in part.items():
            self.seen[k] = self.seen.get(k, 0) + v.height
        if "gpu_samples" in part and part["gpu_samples"].height:
            self.gpu_keys |= set(part["gpu_samples"].select("node", "gpu").unique().rows())
            if sum(x.height for x in self.kept) + part["gpu_samples"].height <= REPORT_SAMPLES_MAX:
                self.kept.append(part["gpu_samples"].select("ts", "node", "gpu", "memory_used_bytes", "memory_total_bytes"))

    def gpu_samples(self) -> pl.DataFrame | None:
        kept = self.kept
        return pl.concat(kept, how="diagonal_relaxed") if kept and sum(x.height for x in kept) <= REPORT_SAMPLES_MAX else None


def _fire_offline(offline: list[tuple[float, Finding]], cfg: dict[str, Any], fired: list[Fired], hints: list[FiredHint]) -> None:
    """The findings of logs and dumps fire at their own time, through the same hint rules."""
    from gpuvigil.pipeline.hints import HintPolicy

    policy = HintPolicy(cfg)
    for at, f in offline:
        fired.append(Fired(at, f))
        hints.extend(FiredHint(at, h) for h in policy.hints_for(f))


# -- output ----------------------------------------------------------------------------------------
def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def json_records(result: ReplayResult, policy: Any) -> Iterable[dict[str, Any]]:
    from gpuvigil.offline.analyze import to_json_line

    for f in result.findings:
        yield {"record": "finding", "fired_at": f.at, **to_json_line(f.finding, policy), "incident": f.finding.incident, "incident_role": f.finding.incident_role}
    for h in result.hints:
        d = h.hint.model_dump(mode="json")
        yield {"record": "hint", "fired_at": h.at, **d}
    yield result.summary()


def format_text(result: ReplayResult, policy: Any) -> str:
    from gpuvigil.offline.analyze import format_text as finding_text

    blocks = []
    for f in result.findings:
        blocks.append(f"fired at {_iso(f.at)}\n" + finding_text(f.finding, policy))
    for h in result.hints:
        hint = h.hint
        where = ", ".join(x for x in (f"job {hint.job}" if hint.job else "", f"node {hint.node}" if hint.node else "", f"gpu {hint.gpu}" if hint.gpu is not None else "") if x)
        blocks.append(f"hint {hint.action.value} at {_iso(h.at)}" + (f" ({where})" if where else "") + f"\n  {hint.reason}")
    s = result.summary()
    by_kind = ", ".join(f"{k} {v} ({s['pages_per_gpu_day_by_kind'][k]:.4g}/GPU-day)" for k, v in s["pages_by_kind"].items()) or "none"
    tail = (
        f"replayed {_iso(result.start)} .. {_iso(result.end)} at {result.step:g} s ({result.ticks} ticks, {result.gpus} GPU(s), {s['gpu_days']:.3g} GPU-days) in {result.wall_seconds:.1f} s\n"
        f"{s['findings']} finding(s), {s['pages']} page(s) = {s['pages_per_gpu_day']:.4g} per GPU-day; {s['hints']} hint(s)\n"
        f"pages by kind: {by_kind}"
    )
    return ("\n\n".join(blocks) + "\n\n" if blocks else "") + tail + "\n"


def handler(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.config) if args.config else config.defaults()
    except config.ConfigError as exc:
        raise UserError(str(exc)) from exc
    if not args.prometheus and not args.paths:
        raise UserError("nothing to replay: give --prometheus URL --start T --end T and/or files")
    step = parse_duration(args.step)
    if step <= 0:
        raise UserError("--step must be positive")
    start = parse_time(args.start) if args.start else None
    end = parse_time(args.end) if args.end else None
    recorded = Recorded()
    chunks = None
    if args.prometheus:
        if start is None or end is None:
            raise UserError("--prometheus needs --start and --end")
        chunks = prometheus_chunks(args.prometheus, start, end, step)
        recorded.read.append(args.prometheus)
    if args.paths:
        load_files([Path(p) for p in args.paths], recorded, node=args.node, job=args.job, cfg=cfg, at=parse_time(args.at) if args.at else None)
    for err in recorded.errors:
        print(f"gpuvigil replay: {err}", file=sys.stderr)
    if not recorded.read:
        raise UserError("nothing could be read" + (f" ({len(recorded.errors)} error(s) above)" if recorded.errors else ""))
    result = run_replay(recorded, cfg=cfg, step=step, start=start, end=end, chunks=chunks)
    from gpuvigil.pipeline.hints import HintPolicy

    policy = HintPolicy(cfg)
    if args.format == "json":
        for rec in json_records(result, policy):
            sys.stdout.write(json.dumps(rec, default=str) + "\n")
    else:
        sys.stdout.write(format_text(result, policy))
    if args.report:
        from gpuvigil.offline import report

        report.write_replay_report(result, Path(args.report), cfg)
        print(f"gpuvigil replay: report written to {args.report}", file=sys.stderr)
    sys.stdout.flush()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="what gpuvigil would have said: replay recorded history (Prometheus, files) through every detector", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", metavar="PATH", help="OpenMetrics/Prometheus text with timestamps, NVML CSV, hook JSONL, logs and dumps")
    p.add_argument("--prometheus", metavar="URL", help="Prometheus server to read dcgm-exporter and gpuvigil series from (HTTP API)")
    p.add_argument("--start", metavar="T", help="start of the replay (RFC 3339 or unix seconds); default: first recorded sample")
    p.add_argument("--end", metavar="T", help="end of the replay (RFC 3339 or unix seconds); default: last recorded sample")
    p.add_argument("--step", default="30s", help="tick and query resolution (seconds or 30s/1m; default 30s)")
    p.add_argument("--format", choices=["text", "json"], default="text", help="text (default) or JSON lines: findings, hints and a summary")
    p.add_argument("--report", metavar="FILE.html", help="also write a self-contained HTML report with plots")
    p.add_argument("--at", metavar="TIME", help="place logs and dumps with no timestamps of their own at TIME (RFC 3339 or unix seconds); default: each file's modification time")
    p.add_argument("--job", help="job name for logs that do not name one")
    p.add_argument("--node", help="node name for files that do not name their host")
    p.add_argument("--config", help="YAML/JSON config overriding thresholds and hint rules")
    p.set_defaults(func=handler)


__all__ = ["Recorded", "ReplayCollector", "ReplayResult", "run_replay", "query_prometheus", "streams_from_long", "load_files", "read_series_file", "series_kind", "parse_time", "parse_duration", "add_parser"]
