"""`--report FILE.html` for `analyze` and `replay`: one self-contained HTML incident report.

Everything is in the one file (plotly.js inlined once), so it opens without network access and
can be attached to a ticket. The report decides nothing: every mark it draws is a finding the
engine raised (with its id), a hint, or a recorded sample. Where a finding carries its reasoning
in its evidence (the OOM predictor's fit: `fit_start_ts`, `fit_end_ts`, `slope_bytes_per_s`,
`intercept_bytes`, `predicted_full_ts`, `capacity_bytes`), that reasoning is drawn; otherwise only
the moment it fired. A series on which nothing fired is not drawn.

- Overview: findings, pages and warnings per kind over the whole replay (one marker per finding
  when they are few, counts per round time bin when they are many), and which inputs had no
  timestamps of their own and where they were placed (`--at`).
- One section per incident (findings of one job, node or GPU close in time, `incidents()`), its
  time window fitted to the incident with a lead-up and an aftermath: its findings and hints,
  the memory of the GPUs its memory findings name, collective progress across ranks for a hang
  (two ranks or more), the cross-rank Flight Recorder table, and where its findings fired when
  they span several GPUs.

Marks are machine-checkable: once plotly has drawn, each SVG element of a finding's mark carries
`data-mark`, `data-finding-id` (the finding's id, as in `--format json`), `data-kind`,
`data-severity` and `data-fired-at` (replay's `fired_at`; analyze's `ts`).

plotly is an optional dependency (`pip install 'gpuvigil[report]'`).
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from gpuvigil import config
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, FindingKind, Hint, Severity

GIB = float(1 << 30)
HANG_KINDS = {FindingKind.NCCL_TIMEOUT, FindingKind.COLLECTIVE_HANG, FindingKind.COLLECTIVE_MISMATCH}
MEMORY_KINDS = {
    FindingKind.OOM_PREDICTED,
    FindingKind.OOM_CAPACITY,
    FindingKind.OOM_FRAGMENTATION,
    FindingKind.OOM_FOREIGN_PROCESS,
    FindingKind.OOM_UNEXPLAINED,
    FindingKind.FRAGMENTATION_ALLOCATOR,
}
FIT_KEYS = ("fit_start_ts", "fit_end_ts", "slope_bytes_per_s", "intercept_bytes", "predicted_full_ts", "capacity_bytes")
SINCE_BOOT_LIMIT = 10 * 365 * 86400.0  # below this a stamp is seconds since boot, not a date

# Colours: red and orange are reserved for findings (page, warning); recorded series and context
# are blue and grey, so that nothing that did not fire looks like firing.
SEVERITY_COLOUR = {Severity.PAGE: "#c62828", Severity.TICKET: "#ef8a00", Severity.INFO: "#8a8a8a"}
SEVERITY_WORD = {Severity.PAGE: "page", Severity.TICKET: "warning", Severity.INFO: "info"}
SERIES_COLOUR = "#1f5fa8"
CONTEXT_COLOUR = "#666666"
KIND_PALETTE = ["#1f5fa8", "#2a9d8f", "#6a4c93", "#4d908e", "#577590", "#8d99ae", "#264653", "#7b2cbf", "#3a86ff", "#52796f"]
NICE_SECONDS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 2 * 86400, 7 * 86400, 14 * 86400, 30 * 86400]


class ReportConfig(BaseModel):
    """The `report` config section (gpuvigil/config/report.yaml)."""

    model_config = ConfigDict(extra="forbid")

    incident_gap_seconds: float = Field(1800.0, gt=0)
    lead_fraction: float = Field(0.5, ge=0)
    lead_samples: int = Field(20, ge=0)
    lead_min_seconds: float = Field(120.0, ge=0)
    gpus_per_incident: int = Field(4, ge=1)
    timeline_rows: int = Field(12, ge=1)
    timeline_min_findings: int = Field(6, ge=2)
    overview_markers_max: int = Field(60, ge=1)
    overview_bins: int = Field(48, ge=4)
    incidents_max: int = Field(30, ge=1)


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go  # noqa: F401
        import plotly.offline  # noqa: F401
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise UserError("--report needs plotly: pip install 'gpuvigil[report]'") from exc
    import plotly

    return plotly


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _when(ts: float, with_date: bool = True) -> str:
    if ts < SINCE_BOOT_LIMIT:
        return f"{ts:.1f} s"
    return _dt(ts).strftime("%Y-%m-%d %H:%M:%S UTC" if with_date else "%H:%M:%S")


def _duration(seconds: float) -> str:
    s = abs(seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _where(f: Finding) -> str:
    return " ".join(
        x
        for x in (
            f.job or "",
            f.node or "",
            f"GPU {f.gpu}" if f.gpu is not None else "",
            f"ranks {','.join(map(str, f.ranks))}" if f.ranks else "",
        )
        if x
    )


@dataclass
class ReportData:
    title: str
    findings: list[tuple[float, Finding]]  # (time it fired, finding)
    hints: list[tuple[float, Hint]] = field(default_factory=list)
    gpu_samples: pl.DataFrame | None = None
    rank_progress: pl.DataFrame | None = None
    subtitle: str = ""
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    span: tuple[float, float] | None = None  # the replay's [start, end]
    placed: dict[str, tuple[float, str]] = field(default_factory=dict)  # undated input -> (where, how)


@dataclass
class Incident:
    number: int
    findings: list[tuple[float, Finding]]
    start: float  # first evidence (a fit's start, a throttle's first sample) or first firing
    end: float  # last firing or last evidence

    @property
    def worst(self) -> Finding:
        order = {Severity.PAGE: 0, Severity.TICKET: 1, Severity.INFO: 2}
        return min((f for _, f in self.findings), key=lambda f: order[f.severity])


def _incident_id(f: Finding) -> str | None:
    """An incident id the engine gave the finding itself, if any (an attribute or its evidence)."""
    v = getattr(f, "incident", None) or f.evidence.get("incident") or f.evidence.get("incident_id")
    return str(v) if v not in (None, "") else None


def _keys(f: Finding) -> list[tuple]:
    """What a finding is about: its job, its node, its GPU (when no node names it)."""
    keys: list[tuple] = []
    if f.job:
        keys.append(("job", f.job))
    if f.node:
        keys.append(("node", f.node))
    elif f.gpu is not None:
        keys.append(("gpu", f.gpu))
    return keys or [("kind", f.kind.value)]


def _evidence_span(at: float, f: Finding) -> tuple[float, float]:
    ev = f.evidence
    lo, hi = at, at
    for k in ("fit_start_ts", "first_ts"):
        v = ev.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and at - 30 * 86400 < v <= at:
            lo = min(lo, float(v))
    v = ev.get("last_ts")
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and at <= v < at + 30 * 86400:
        hi = max(hi, float(v))
    return lo, hi


def incidents(findings: Sequence[tuple[float, Finding]], gap_seconds: float) -> list[Incident]:
    """Findings that belong together. A finding with an incident id of its own is grouped by it;
    the others join when they share a job, a node, or (no node named) a GPU index, and fired
    within `gap_seconds` of the previous finding about the same thing. Ordered by first firing."""
    parent = list(range(len(findings)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(i: int, j: int) -> None:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)

    order = sorted(range(len(findings)), key=lambda i: findings[i][0])
    by_id: dict[str, int] = {}
    last: dict[tuple, tuple[int, float]] = {}
    for i in order:
        at, f = findings[i]
        own = _incident_id(f)
        if own is not None:
            if own in by_id:
                union(by_id[own], i)
            else:
                by_id[own] = i
            continue
        for k in _keys(f):
            if k in last and at - last[k][1] <= gap_seconds:
                union(last[k][0], i)
            last[k] = (i, at)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in order:
        groups[find(i)].append(i)
    out = []
    for members in sorted(groups.values(), key=lambda m: findings[m[0]][0]):
        spans = [_evidence_span(*findings[i]) for i in members]
        out.append(Incident(0, [findings[i] for i in members], min(s[0] for s in spans), max(s[1] for s in spans)))
    for n, inc in enumerate(out, 1):
        inc.number = n
    return out


def bin_seconds(span: float, bins: int) -> float:
    """A round bin width (1 s .. 30 days) giving about `bins` bins over `span` seconds."""
    want = max(span, 1.0) / bins
    return float(next((s for s in NICE_SECONDS if s >= want), NICE_SECONDS[-1]))


# -- marks -------------------------------------------------------------------------------------------
class Marks:
    """Marks of one figure: each shape/annotation/point named with a key into `layout.meta`, which
    the page's script turns into data attributes on the drawn SVG elements."""

    def __init__(self) -> None:
        self.meta: dict[str, dict[str, Any]] = {}

    def key(self, mark: str, at: float | None = None, f: Finding | None = None, **extra: Any) -> str:
        k = f"m{len(self.meta)}"
        d: dict[str, Any] = {"mark": mark, **extra}
        if f is not None:
            d.update({"finding-id": f.id, "kind": f.kind.value, "severity": f.severity.value, "fired-at": repr(float(at if at is not None else f.ts))})
        self.meta[k] = d
        return k

    def apply(self, fig: Any) -> None:
        fig.update_layout(meta={"marks": self.meta})


def _numbered_labels(fig: Any, marks: Marks, items: list[tuple[float, int, Finding]], lo: float, hi: float, width_px: float = 1100.0) -> int:
    """A label per finding line above the plot (its number in the incident's table and its kind),
    on staggered rows so that none overlaps another; returns the rows used."""
    rows_end: list[float] = []
    span = max(hi - lo, 1e-9)
    for at, number, f in sorted(items, key=lambda x: x[0]):
        text = f"{number} {f.kind.value}"
        px = 7.0 * len(text) + 14
        half = px / width_px * span / 2
        row = next((r for r, end in enumerate(rows_end) if at - half > end), None)
        if row is None:
            row = len(rows_end)
            rows_end.append(-math.inf)
        if row >= 4:  # rows beyond four: the number alone
            text = str(number)
            half = (7.0 * len(text) + 8) / width_px * span / 2
            row = next((r for r, end in enumerate(rows_end) if at - half > end), 3)
        rows_end[row] = at + half
        fig.add_annotation(
            x=_dt(at),
            y=1.0,
            yref="paper",
            yanchor="bottom",
            yshift=4 + 18 * row,
            text=html.escape(text),
            showarrow=False,
            font={"color": SEVERITY_COLOUR[f.severity], "size": 12},
            name=marks.key("label", at, f),
        )
    return min(len(rows_end), 4)


def _vline(fig: Any, marks: Marks, at: float, f: Finding, yref: str = "paper", y0: float = 0.0, y1: float = 1.0) -> None:
    fig.add_shape(
        type="line", x0=_dt(at), x1=_dt(at), xref="x", yref=yref, y0=y0, y1=y1,
        line={"color": SEVERITY_COLOUR[f.severity], "width": 2},
        name=marks.key("finding", at, f),
    )


# -- incident charts ------------------------------------------------------------------------------
def _window(inc: Incident, rc: ReportConfig, dt: float, extend_to: float | None = None) -> tuple[float, float]:
    core = inc.end - inc.start
    lead = max(rc.lead_fraction * core, rc.lead_samples * dt, rc.lead_min_seconds)
    hi = max(inc.end + lead / 2, (extend_to + lead / 4) if extend_to is not None else -math.inf)
    return inc.start - lead, hi


def _sample_interval(ts: Sequence[float]) -> float:
    if len(ts) < 2:
        return 0.0
    diffs = sorted(b - a for a, b in zip(ts, ts[1:], strict=False) if b > a)
    return diffs[len(diffs) // 2] if diffs else 0.0


def _gpu_series(gs: pl.DataFrame, f: Finding) -> list[tuple[Any, Any]]:
    """The recorded GPUs a finding is about: its (node, GPU); a finding with no node matches
    that GPU index on any node; one with no GPU matches only when a single GPU was recorded."""
    keys = gs.select("node", "gpu").unique().rows()
    if f.gpu is None:
        return [k for k in keys if f.node in (None, k[0])] if len({k for k in keys if f.node in (None, k[0])}) == 1 else []
    return [k for k in keys if k[1] == f.gpu and f.node in (None, k[0])]


def _memory_charts(inc: Incident, data: ReportData, rc: ReportConfig, numbers: dict[int, int]) -> tuple[list[tuple[str, Any]], list[str]]:
    import plotly.graph_objects as go

    gs = data.gpu_samples
    mem = [(at, f) for at, f in inc.findings if f.kind in MEMORY_KINDS]
    if not mem:
        return [], []
    if gs is None or gs.height == 0 or gs["memory_used_bytes"].null_count() == gs.height:
        return [], ["No memory series was recorded for the GPUs of this incident: only the findings above."]
    per_gpu: dict[tuple, list[tuple[float, Finding]]] = defaultdict(list)
    for at, f in mem:
        for k in _gpu_series(gs, f):
            per_gpu[k].append((at, f))
    if not per_gpu:
        return [], ["None of the recorded memory series is of a GPU this incident's findings name."]
    rank = {Severity.PAGE: 0, Severity.TICKET: 1, Severity.INFO: 2}
    chosen = sorted(per_gpu, key=lambda k: (min(rank[f.severity] for _, f in per_gpu[k]), -len(per_gpu[k]), min(a for a, _ in per_gpu[k]), str(k)))
    notes = []
    if len(chosen) > rc.gpus_per_incident:
        rest = chosen[rc.gpus_per_incident :]
        notes.append(
            f"{len(rest)} more GPU(s) of this incident not drawn (fewer or less severe findings): "
            + ", ".join(f"{n} GPU {g} ({len(per_gpu[(n, g)])})" for n, g in rest[:40])
            + (" ..." if len(rest) > 40 else "")
        )
        chosen = chosen[: rc.gpus_per_incident]
    out = []
    for node, gpu in chosen:
        g = gs.filter((pl.col("node") == node) & (pl.col("gpu") == gpu) if node is not None else pl.col("node").is_null() & (pl.col("gpu") == gpu))
        g = g.drop_nulls("memory_used_bytes").sort("ts")
        fits = [(at, f) for at, f in per_gpu[(node, gpu)] if all(isinstance(f.evidence.get(k), int | float) for k in FIT_KEYS)]
        full_at = max((float(f.evidence["predicted_full_ts"]) for _, f in fits), default=None)
        lo, hi = _window(inc, rc, _sample_interval(g["ts"].to_list()), full_at)
        g = g.filter(pl.col("ts").is_between(lo, hi))
        where = f"{node or 'node'} GPU {gpu}"
        if g.height < 2:
            notes.append(f"{where}: no recorded memory samples in this incident's window ({_when(lo)} .. {_when(hi)}).")
            continue
        t = g["ts"].to_list()
        # the x range ends where the recorded samples and the findings do (no empty lead-up)
        lo = max(lo, min(t[0], inc.start))
        hi = min(hi, max(t[-1], inc.end, full_at if full_at is not None else -math.inf))
        pad = (hi - lo) * 0.02
        lo, hi = lo - pad, hi + pad
        marks = Marks()
        fig = go.Figure()
        fig.add_trace(go.Scatter(x=[_dt(x) for x in t], y=[v / GIB for v in g["memory_used_bytes"].to_list()], mode="lines", name="memory used (recorded)", line={"color": SERIES_COLOUR, "width": 2}))
        total = g["memory_total_bytes"].drop_nulls()
        cap = float(total.max()) / GIB if total.len() else None  # type: ignore[arg-type]
        if cap:
            fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=cap, y1=cap, line={"color": CONTEXT_COLOUR, "dash": "dot", "width": 1}, name=marks.key("capacity"))
            fig.add_annotation(xref="paper", x=0.0, xanchor="left", y=cap, yanchor="top", text=f"capacity {cap:.1f} GiB (recorded)", showarrow=False, font={"color": CONTEXT_COLOUR, "size": 11}, name=marks.key("capacity"))
        for at, f in fits:
            ev = f.evidence
            slope, end_v, t0, t1 = float(ev["slope_bytes_per_s"]), float(ev["intercept_bytes"]), float(ev["fit_start_ts"]), float(ev["fit_end_ts"])
            start_v = end_v - slope * (t1 - t0)
            colour = SEVERITY_COLOUR[f.severity]
            fig.add_shape(type="line", x0=_dt(t0), x1=_dt(t1), y0=start_v / GIB, y1=end_v / GIB, line={"color": colour, "width": 3}, name=marks.key("fit", at, f))
            full = float(ev["predicted_full_ts"])
            # the finding's own line carried on to the moment it predicted (capacity less any margin)
            fig.add_shape(
                type="line", x0=_dt(t1), x1=_dt(full), y0=end_v / GIB, y1=(end_v + slope * (full - t1)) / GIB,
                line={"color": colour, "width": 2, "dash": "dash"}, name=marks.key("fit", at, f),
            )
        items = []
        for at, f in per_gpu[(node, gpu)]:
            _vline(fig, marks, at, f)
            items.append((at, numbers[id(f)], f))
        rows = _numbered_labels(fig, marks, items, lo, hi)
        marks.apply(fig)
        kinds = ", ".join(sorted({f.kind.value for _, f in per_gpu[(node, gpu)]}))
        fig.update_layout(
            title={"text": f"GPU memory of {html.escape(where)} around {html.escape(kinds)}", "y": 0.98, "yanchor": "top"},
            xaxis={"title": "time (UTC)", "range": [_dt(lo), _dt(hi)]},
            yaxis={"title": "memory used (GiB)", "rangemode": "tozero"},
            height=380 + 18 * rows, margin={"t": 70 + 18 * rows}, showlegend=False,
        )
        out.append((f"incident-{inc.number}-memory-{node}-{gpu}", fig))
    return out, notes


def _progress_chart(inc: Incident, data: ReportData, rc: ReportConfig, numbers: dict[int, int]) -> tuple[list[tuple[str, Any]], list[str]]:
    import plotly.graph_objects as go

    hangs = [(at, f) for at, f in inc.findings if f.kind in HANG_KINDS]
    rp = data.rank_progress
    if not hangs or rp is None or rp.height == 0 or rp["last_completed_seq"].null_count() == rp.height:
        return [], []
    jobs = {f.job for _, f in hangs if f.job}
    rp = rp.drop_nulls(["rank", "last_completed_seq"])
    if jobs and "job" in rp.columns:
        rp = rp.filter(pl.col("job").is_in(list(jobs)))
    lo, hi = _window(inc, rc, _sample_interval(rp["ts"].unique().sort().to_list()))
    rp = rp.filter(pl.col("ts").is_between(lo, hi))
    ranks = sorted(rp["rank"].unique().to_list())
    if len(ranks) < 2:
        # one rank's progress is its own line: a heat map says nothing the table does not
        return [], []
    step = max((hi - lo) / 120.0, _sample_interval(rp["ts"].unique().sort().to_list()), 1e-3)
    # a hang shows in what each rank enqueued (nobody completes the stuck collective): the
    # enqueued sequence number where it was recorded, the completed one otherwise
    col = "last_enqueued_seq" if "last_enqueued_seq" in rp.columns and rp["last_enqueued_seq"].null_count() < rp.height else "last_completed_seq"
    binned = rp.with_columns((pl.col("ts") // step * step).alias("t")).group_by(["rank", "t"]).agg(pl.col(col).max()).sort(["rank", "t"])
    times = sorted(binned["t"].unique().to_list())
    z = {(r, t): v for r, t, v in binned.iter_rows()}
    seqs, last = [], {}
    for r in ranks:
        row = []
        for t in times:
            v = z.get((r, t), last.get(r))
            last[r] = v
            row.append(v)
        seqs.append(row)
    # how far each rank is behind the furthest one at that time: a rank that stops shows as a
    # band, where the raw sequence numbers (all climbing together) would hide it
    lead = [max((row[j] for row in seqs if row[j] is not None), default=None) for j in range(len(times))]
    matrix = [[None if v is None or lead[j] is None else lead[j] - v for j, v in enumerate(row)] for row in seqs]
    worst = max((v for row in matrix for v in row if v is not None), default=0)
    if worst <= 0:
        return [], ["Collective progress: every rank kept up with the others in this window (no rank behind), so no chart."]
    what = "enqueued" if col == "last_enqueued_seq" else "completed"
    marks = Marks()
    fig = go.Figure(
        go.Heatmap(
            z=matrix, x=[_dt(t) for t in times], y=ranks, customdata=seqs, colorscale="Blues", zmin=0, zmax=worst,
            colorbar={"title": {"text": f"collectives {what}<br>behind the<br>furthest rank"}},
            hovertemplate="rank %{y}<br>%{x}<br>%{z} behind (last " + what + " #%{customdata})<extra></extra>",
        )
    )
    items = []
    for at, f in hangs:
        if lo <= at <= hi:
            _vline(fig, marks, at, f)
            items.append((at, numbers[id(f)], f))
        for r in f.culprit_ranks:
            if r in ranks:
                # the culprit's row outlined (its name is in the title: no label to collide)
                fig.add_shape(
                    type="rect", xref="paper", x0=0, x1=1, y0=r - 0.5, y1=r + 0.5, line={"color": SEVERITY_COLOUR[f.severity], "width": 2},
                    name=marks.key("culprit", at, f),
                )
    rows = _numbered_labels(fig, marks, items, lo, hi)
    marks.apply(fig)
    culprits = sorted({r for _, f in hangs for r in f.culprit_ranks})
    fig.update_layout(
        title={"text": f"Collectives {what} per rank, behind the furthest rank" + (f" (culprit rank {', '.join(map(str, culprits))}, outlined)" if culprits else ""), "y": 0.98, "yanchor": "top"},
        xaxis={"title": "time (UTC)"},
        yaxis={"title": "rank", "autorange": "reversed", "dtick": 1 if len(ranks) <= 32 else None},
        height=min(700, 220 + 18 * len(ranks)) + 18 * rows, margin={"t": 70 + 18 * rows},
    )
    return [(f"incident-{inc.number}-progress", fig)], []


def _fr_tables(inc: Incident) -> list[str]:
    out = []
    for _at, f in inc.findings:
        if f.kind not in (FindingKind.COLLECTIVE_HANG, FindingKind.COLLECTIVE_MISMATCH):
            continue
        ev = f.evidence
        if "collective_seq_id" not in ev:
            continue  # not read from Flight Recorder dumps: the finding's table row says it all
        ranks = f.ranks or sorted(set(ev.get("not_completed_ranks") or []) | set(f.culprit_ranks))
        if not ranks:
            continue
        enq = ev.get("last_enqueued") if isinstance(ev.get("last_enqueued"), list) else [ev.get("last_enqueued")] * len(ranks)
        done = ev.get("last_completed") if isinstance(ev.get("last_completed"), list) else [ev.get("last_completed")] * len(ranks)
        enq, done = (list(enq) + [None] * len(ranks))[: len(ranks)], (list(done) + [None] * len(ranks))[: len(ranks)]
        not_done = set(ev.get("not_completed_ranks") or [])
        rows = "".join(
            f"<tr><td>{r}</td><td>{html.escape(str(ev.get('op') or ev.get('op_type') or ''))}</td><td>{html.escape(str(ev.get('collective_seq_id', '')))}</td>"
            f"<td>{'' if e is None else html.escape(str(e))}</td><td>{'' if d is None else html.escape(str(d))}</td><td>{'no' if r in not_done else 'yes'}</td>"
            f"<td class='page'>{'culprit' if r in f.culprit_ranks else ''}</td></tr>"
            for r, e, d in zip(ranks, enq, done, strict=True)
        )
        out.append(
            f"<h4>Flight Recorder across ranks: {html.escape(f.kind.value)} in {html.escape(str(ev.get('pg_desc') or ev.get('pg') or 'process group'))}</h4>"
            f"<table class='f' data-finding-id='{html.escape(f.id)}'><tr><th>rank</th><th>op</th><th>seq</th><th>last enqueued</th><th>last completed</th><th>completed</th><th></th></tr>{rows}</table>"
        )
    return out


def _timeline(inc: Incident, data: ReportData, rc: ReportConfig, numbers: dict[int, int]) -> tuple[list[tuple[str, Any]], list[str]]:
    """Where the incident's findings fired, one row per GPU (or node), when they span several:
    the order and spread across GPUs that the table's rows do not show."""
    import plotly.graph_objects as go

    def row_of(f: Finding) -> str:
        return f"{f.node or ''} GPU {f.gpu}".strip() if f.gpu is not None else (f.node or f.job or f.kind.value)

    rows = Counter(row_of(f) for _, f in inc.findings)
    if sum(1 for r in rows if " GPU " in f" {r}") < 2 or len(inc.findings) < rc.timeline_min_findings:
        return [], []  # a few findings, or one GPU: the table's times say as much
    kept = [r for r, _ in rows.most_common(rc.timeline_rows)]
    notes = []
    if len(rows) > len(kept):
        notes.append(f"{len(rows) - len(kept)} more place(s) with findings in this incident not drawn: " + ", ".join(r for r, _ in rows.most_common()[len(kept) : len(kept) + 40]))
    marks = Marks()
    fig = go.Figure()
    for sev in (Severity.INFO, Severity.TICKET, Severity.PAGE):
        sel = [(at, f) for at, f in inc.findings if f.severity == sev and row_of(f) in kept]
        if not sel:
            continue
        fig.add_trace(
            go.Scatter(
                x=[_dt(at) for at, _ in sel], y=[row_of(f) for _, f in sel], mode="markers",
                marker={"size": 12, "color": SEVERITY_COLOUR[sev], "symbol": "diamond"},
                customdata=[marks.key("finding", at, f) for at, f in sel],
                hovertext=[f"{numbers[id(f)]}: {f.kind.value}: {f.summary[:200]}" for _, f in sel], hoverinfo="text+x",
                name=SEVERITY_WORD[sev],
            )
        )
    marks.apply(fig)
    fig.update_layout(
        title="Where this incident's findings fired", xaxis_title="time (UTC)",
        yaxis={"title": "GPU / node", "categoryorder": "array", "categoryarray": list(reversed(kept))},
        height=200 + 26 * len(kept), showlegend=False,
    )
    return [(f"incident-{inc.number}-timeline", fig)], notes


# -- overview ------------------------------------------------------------------------------------------
def _overview_chart(data: ReportData, rc: ReportConfig, lo: float, hi: float) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    firing = [(at, f) for at, f in data.findings if f.severity in (Severity.PAGE, Severity.TICKET)]
    if not firing:
        return []
    kinds = sorted({f.kind.value for _, f in firing})
    marks = Marks()
    if len(firing) <= rc.overview_markers_max:
        fig = go.Figure()
        for sev in (Severity.TICKET, Severity.PAGE):
            sel = [(at, f) for at, f in firing if f.severity == sev]
            if sel:
                fig.add_trace(
                    go.Scatter(
                        x=[_dt(at) for at, _ in sel], y=[f.kind.value for _, f in sel], mode="markers",
                        marker={"size": 13, "color": SEVERITY_COLOUR[sev], "symbol": "line-ns-open" if sev == Severity.TICKET else "diamond", "line": {"width": 3, "color": SEVERITY_COLOUR[sev]}},
                        customdata=[marks.key("finding", at, f) for at, f in sel],
                        hovertext=[f"{SEVERITY_WORD[sev]}: {_where(f)}: {f.summary[:200]}" for _, f in sel], hoverinfo="text+x",
                        name=SEVERITY_WORD[sev],
                    )
                )
        fig.update_layout(
            yaxis={"title": "finding kind", "categoryorder": "array", "categoryarray": list(reversed(kinds)), "range": [-0.7, len(kinds) - 0.3]},
            height=190 + 34 * len(kinds), showlegend=False,
        )
        title = "Pages (diamonds) and warnings (ticks) per kind, one marker each"
    else:
        from plotly.subplots import make_subplots

        width = bin_seconds(hi - lo, rc.overview_bins)
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=("pages", "warnings"))
        for row, sev in ((1, Severity.PAGE), (2, Severity.TICKET)):
            for i, kind in enumerate(kinds):
                bins: dict[float, list[tuple[float, Finding]]] = defaultdict(list)
                for at, f in firing:
                    if f.severity == sev and f.kind.value == kind:
                        bins[math.floor((at - lo) / width) * width + lo].append((at, f))
                if not bins:
                    continue
                xs = sorted(bins)
                fig.add_trace(
                    go.Bar(
                        x=[_dt(x + width / 2) for x in xs], y=[len(bins[x]) for x in xs], width=width * 1000 * 0.9, name=kind,
                        marker={"color": KIND_PALETTE[i % len(KIND_PALETTE)]}, legendgroup=kind, showlegend=row == 1 or not any(f.severity == Severity.PAGE and f.kind.value == kind for _, f in firing),
                        customdata=[marks.key("bin", count=len(bins[x]), **{"finding-ids": " ".join(f.id for _, f in bins[x]), "fired-ats": " ".join(repr(float(a)) for a, _ in bins[x]), "severity": sev.value, "kind": kind}) for x in xs],
                        hovertemplate="%{y} " + SEVERITY_WORD[sev] + "(s) of " + kind + "<extra></extra>",
                    ),
                    row=row, col=1,
                )
        fig.update_layout(barmode="stack", height=460, bargap=0)
        fig.update_yaxes(title_text="findings per bin", rangemode="tozero")
        title = f"Pages and warnings per kind, counted per {_duration(width)} bin"
    marks.apply(fig)
    pad = max((hi - lo) * 0.02, 1.0)
    fig.update_layout(title=title, xaxis={"range": [_dt(lo - pad), _dt(hi + pad)]}, margin={"t": 60})
    fig.update_xaxes(title_text="time (UTC)", row=2 if len(firing) > rc.overview_markers_max else None, col=1 if len(firing) > rc.overview_markers_max else None)
    return [("overview", fig)]


# -- page ----------------------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-top:1px solid #ccc;padding-top:14px}
h4{font-size:14px;margin:14px 0 4px}table.f{border-collapse:collapse;font-size:13px;width:100%}table.f td,table.f th{border:1px solid #ddd;padding:4px 6px;vertical-align:top}
.page{color:#c62828;font-weight:600}.ticket{color:#b35f00;font-weight:600}.info{color:#666}.muted{color:#555;font-size:13px}.placed{background:#fff7e0;padding:6px 10px;border-left:3px solid #999}"""

# Once plotly has drawn a figure, each drawn element of a mark gets the mark's data attributes
# (layout.meta.marks, keyed by the shape's or annotation's name, or a point's customdata).
_STAMP_JS = """
(function(){
function attrs(el, m){ if(!m) return; for (const k in m) el.setAttribute('data-' + k, String(m[k])); }
function stamp(gd){
  const marks = (gd.layout && gd.layout.meta && gd.layout.meta.marks) || {};
  const shapes = gd.layout.shapes || [], notes = gd.layout.annotations || [];
  gd.querySelectorAll('.shapelayer path[data-index]').forEach(function(p){ const s = shapes[+p.getAttribute('data-index')]; if (s) attrs(p, marks[s.name]); });
  gd.querySelectorAll('g.annotation[data-index]').forEach(function(a){ const s = notes[+a.getAttribute('data-index')]; if (s) attrs(a, marks[s.name]); });
  gd.querySelectorAll('g.trace').forEach(function(tr){
    const cd = tr.__data__; const trace = cd && cd[0] && cd[0].trace; if (!trace || !trace.customdata) return;
    tr.querySelectorAll('.point').forEach(function(pt){ const d = pt.__data__; if (d && d.i !== undefined) attrs(pt, marks[trace.customdata[d.i]]); });
  });
  gd.setAttribute('data-marks-stamped', Object.keys(marks).length);
}
document.querySelectorAll('.js-plotly-plot').forEach(function(gd){ stamp(gd); gd.on('plotly_afterplot', function(){ stamp(gd); }); });
})();
"""


def _finding_rows(items: list[tuple[int, float, Finding]], hints_by: dict[str, list[tuple[float, Hint]]]) -> str:
    out = ["<table class='f'><tr><th>#</th><th>fired</th><th>severity</th><th>kind</th><th>where</th><th>summary</th><th>hint</th><th>source</th></tr>"]
    for n, at, f in items:
        hs = "; ".join(f"{h.action.value} ({_when(hat, False)})" for hat, h in hints_by.get(f.id, []))
        out.append(
            f"<tr data-finding-id='{html.escape(f.id)}' data-kind='{f.kind.value}' data-fired-at='{float(at)!r}'><td>{n}</td><td>{_when(at)}</td>"
            f"<td class='{f.severity.value}'>{SEVERITY_WORD[f.severity]}</td><td>{html.escape(f.kind.value)}</td><td>{html.escape(_where(f))}</td>"
            f"<td>{html.escape(f.summary)}</td><td>{html.escape(hs)}</td><td>{html.escape(f.source or '')}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _placement_notes(data: ReportData, lo: float, hi: float, series_span: tuple[float, float] | None) -> list[str]:
    notes = []
    for name, (at, how) in sorted(data.placed.items()):
        rel = ""
        if series_span is not None:
            if at > series_span[1]:
                rel = f", {_duration(at - series_span[1])} after the last recorded sample"
            elif at < series_span[0]:
                rel = f", {_duration(series_span[0] - at)} before the first recorded sample"
            else:
                rel = ", within the recorded series"
        why = "its file's modification time" if how == "file time" else "the time given with --at"
        notes.append(f"{name} has no timestamps of its own: its findings are placed at {why}, {_when(at)}{rel}." + (" Give --at TIME to place it." if how == "file time" else ""))
    boot = sorted({(f.source or "?").rsplit(":", 1)[0] for at, f in data.findings if f.ts < SINCE_BOOT_LIMIT})
    if boot and data.span is not None:
        notes.append(f"{', '.join(boot)}: stamped in seconds since boot, not dates: placed at the start of the replay, {_when(data.span[0])}.")
    return notes


def render(data: ReportData, cfg: dict[str, Any] | None = None) -> str:
    plotly = _plotly()
    rc = config.section("report", ReportConfig, cfg)
    series_span, lo, hi = _spans(data)
    incs = incidents(data.findings, rc.incident_gap_seconds)
    hints_by: dict[str, list[tuple[float, Hint]]] = defaultdict(list)
    for at, h in data.hints:
        hints_by[h.finding_id].append((at, h))

    figures: list[tuple[str, Any]] = []
    parts_body = _overview_text(data, incs, lo, hi, series_span)
    ov = _overview_chart(data, rc, lo, hi)
    figures += ov
    parts_body.extend(_plot_div(d, f) for d, f in ov)
    if incs:
        parts_body.append(
            "<p class='muted'>Incidents: findings about the same job, node or GPU within "
            f"{_duration(rc.incident_gap_seconds)} of one another (or sharing an incident id). Each section's charts cover that incident only.</p>"
        )
    detailed = _detailed_incidents(incs, rc.incidents_max)
    if len(incs) > len(detailed):
        parts_body.append(_listed_incidents(incs, detailed))
    for inc in incs:
        if inc.number in detailed:
            figs, section = _incident_section(inc, data, rc, hints_by)
            figures += figs
            parts_body.extend(section)
    return _page(data, plotly, parts_body, figures, incs)


def _spans(data: ReportData) -> tuple[tuple[float, float] | None, float, float]:
    """The span of the recorded series (None without any), and the report's span: the replayed
    one, else the findings'."""
    gs = data.gpu_samples
    series_span = None
    if gs is not None and gs.height:
        series_span = (float(gs["ts"].min()), float(gs["ts"].max()))  # type: ignore[arg-type]
    if data.rank_progress is not None and data.rank_progress.height:
        rp_span = (float(data.rank_progress["ts"].min()), float(data.rank_progress["ts"].max()))  # type: ignore[arg-type]
        series_span = rp_span if series_span is None else (min(series_span[0], rp_span[0]), max(series_span[1], rp_span[1]))
    ats = [at for at, _ in data.findings]
    if data.span is not None:
        lo, hi = data.span
    elif ats:
        lo, hi = min(ats), max(ats)
    else:
        lo = hi = 0.0
    return series_span, lo, hi


def _overview_text(data: ReportData, incs: list[Incident], lo: float, hi: float, series_span: tuple[float, float] | None) -> list[str]:
    n_by = Counter(f.severity for _, f in data.findings)
    parts = ["<h2>Overview</h2>"]
    parts.append(
        "<p>"
        + html.escape(
            f"{len(data.findings)} finding(s): {n_by[Severity.PAGE]} page(s), {n_by[Severity.TICKET]} warning(s), {n_by[Severity.INFO]} info; "
            f"{len(incs)} incident(s); {len(data.hints)} hint(s)."
            + (f" Replayed {_when(lo)} .. {_when(hi)} ({_duration(hi - lo)})." if data.span is not None else "")
        )
        + "</p>"
    )
    if data.summary:
        s = data.summary
        parts.append(
            "<p class='muted'>"
            + html.escape(
                f"{s['gpus']} GPU(s) and {s['gpu_days']:.3g} GPU-days"
                + (f" = {s['pages_per_gpu_day']:.4g} pages per GPU-day" if s["gpu_days"] >= 1 else " (too short for a rate of pages per GPU-day)")
                + ". Pages by kind: "
                + (", ".join(f"{k} {v}" for k, v in s["pages_by_kind"].items()) or "none")
            )
            + "</p>"
        )
    for note in _placement_notes(data, lo, hi, series_span):
        parts.append(f"<p class='placed' data-placed>{html.escape(note)}</p>")
    for note in data.notes:
        parts.append(f"<p class='muted'>{html.escape(note)}</p>")
    if not data.findings:
        parts.append("<p><b>Nothing fired.</b> No finding, so no chart: the recorded series are not drawn on their own.</p>")
    return parts


def _detailed_incidents(incs: list[Incident], most: int) -> set[int]:
    """The numbers of the heaviest incidents, which get a section each."""
    # a page weighs three warnings: a 200-GPU warning outranks one GPU's few pages
    weight = {Severity.PAGE: 3.0, Severity.TICKET: 1.0, Severity.INFO: 0.1}
    ranked = sorted(incs, key=lambda i: (-sum(weight[f.severity] for _, f in i.findings), i.start))
    return {i.number for i in ranked[:most]}


def _listed_incidents(incs: list[Incident], detailed: set[int]) -> str:
    """The incidents without a section, one table row each, in order of time."""
    return (
        f"<h2 id='other-incidents'>{len(incs) - len(detailed)} more incident(s), listed only</h2><p class='muted'>The {len(detailed)} heaviest incidents (a page counts three warnings) "
        "have a section below; these are listed in order of time.</p>"
        "<table class='f'><tr><th>incident</th><th>from</th><th>to</th><th>worst</th><th>kind</th><th>where</th><th>findings</th></tr>"
        + "".join(
            f"<tr data-incident='{i.number}'><td>{i.number}</td><td>{_when(i.start)}</td><td>{_when(i.end)}</td><td class='{i.worst.severity.value}'>{SEVERITY_WORD[i.worst.severity]}</td>"
            f"<td>{html.escape(i.worst.kind.value)}</td><td>{html.escape(_where(i.worst))}</td><td>{len(i.findings)}</td></tr>"
            for i in incs
            if i.number not in detailed
        )
        + "</table>"
    )


def _incident_section(
    inc: Incident, data: ReportData, rc: ReportConfig, hints_by: dict[str, list[tuple[float, Hint]]]
) -> tuple[list[tuple[str, Any]], list[str]]:
    """One incident's heading, findings table, charts and Flight Recorder tables."""
    numbers = {id(f): i for i, (_, f) in enumerate(inc.findings, 1)}
    w = inc.worst
    figures: list[tuple[str, Any]] = []
    parts = [
        f"<h2 id='incident-{inc.number}' data-incident='{inc.number}'>Incident {inc.number}: {html.escape(w.kind.value)} ({SEVERITY_WORD[w.severity]}) "
        f"{html.escape(_where(w))}: {html.escape(_when(inc.start))} .. {html.escape(_when(inc.end, inc.end - inc.start > 86400))}</h2>",
        _finding_rows([(numbers[id(f)], at, f) for at, f in inc.findings], hints_by),
    ]
    for build in (_memory_charts, _progress_chart, _timeline):
        figs, notes = build(inc, data, rc, numbers)
        figures += figs
        parts.extend(_plot_div(d, f) for d, f in figs)
        parts.extend(f"<p class='muted'>{html.escape(n)}</p>" for n in notes)
    parts.extend(_fr_tables(inc))
    return figures, parts


def _page(data: ReportData, plotly: Any, parts_body: list[str], figures: list[tuple[str, Any]], incs: list[Incident]) -> str:
    """The self-contained HTML document, with the metadata the tests and tools read."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(data.title)}</title><style>{_CSS}</style>",
        # plotly.js inlined once: the report opens with no network
        f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>{html.escape(data.title)}</h1><p class='muted'>{html.escape(data.subtitle)}</p>",
        *parts_body,
        f"<script type='text/javascript'>{_STAMP_JS}</script>",
    ]
    meta = {
        "plots": [d for d, _ in figures],
        "findings": len(data.findings),
        "incidents": [{"number": i.number, "finding_ids": [f.id for _, f in i.findings], "start": i.start, "end": i.end} for i in incs],
        "placed": {k: list(v) for k, v in data.placed.items()},
    }
    parts.append(f"<script type='application/json' id='report-meta'>{html.escape(json.dumps(meta))}</script>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _plot_div(div_id: str, fig: Any) -> str:
    fig.update_layout(template="plotly_white", font={"size": 12})
    body = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{div_id}", config={"displaylogo": False, "responsive": True})
    return f"<div class='plot' data-plot='{html.escape(div_id)}'>{body}</div>"


def write(data: ReportData, path: Path, cfg: dict[str, Any] | None = None) -> list[str]:
    text = render(data, cfg)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot write the report: {exc.strerror or exc}") from exc
    meta = text.rsplit("id='report-meta'>", 1)[1].split("</script>", 1)[0]
    return json.loads(html.unescape(meta))["plots"]


def _series_from_inputs(paths: Sequence[Path]) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
    """Memory and progress series among `analyze`'s inputs (NVML CSV, hook JSONL, timestamped
    Prometheus/OpenMetrics text), recognised and read as `gpuvigil replay` reads them."""
    from gpuvigil.offline.formats import Recorded, read_series_file

    rec = Recorded()
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()))]
    for f in files:
        try:
            with open(f, "rb") as fh:
                head = fh.read(65536).decode("utf-8", errors="replace")
            rec.add(read_series_file(f, head, node="node") or {})
        except (OSError, UserError):
            continue  # analyze already said what it could not read
    gs = rec.stream("gpu_samples") if "gpu_samples" in rec.frames else None
    rp = rec.stream("rank_progress") if "rank_progress" in rec.frames else None
    return gs, rp


def write_analyze_report(report: Any, paths: Sequence[Path], path: Path, cfg: dict[str, Any] | None = None, node: str | None = None) -> list[str]:
    gs, rp = _series_from_inputs(paths)
    if gs is not None and node and gs["node"].unique().to_list() == ["node"]:
        gs = gs.with_columns(pl.lit(node).alias("node"))  # a file that names no host is --node's, as its findings are
    data = ReportData(
        title="gpuvigil analyze: incident report",
        subtitle=f"{len(report.read)} file(s) analysed; {len(report.findings)} finding(s). Generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}.",
        findings=[(f.ts, f) for f in report.findings],
        gpu_samples=gs,
        rank_progress=rp,
        notes=[f"skipped: {e}" for e in report.errors],
        placed=dict(getattr(report, "placed", {}) or {}),
    )
    return write(data, path, cfg)


def write_replay_report(result: Any, path: Path, cfg: dict[str, Any] | None = None) -> list[str]:
    data = ReportData(
        title="gpuvigil replay: what would have fired",
        subtitle=f"{_when(result.start)} .. {_when(result.end)}, one tick every {result.step:g} s; inputs: {', '.join(result.read[:8])}{' ...' if len(result.read) > 8 else ''}",
        findings=[(x.at, x.finding) for x in result.findings],
        hints=[(h.at, h.hint) for h in result.hints],
        gpu_samples=result.gpu_samples,
        rank_progress=getattr(result, "rank_progress", None),
        summary=result.summary(),
        span=(result.start, result.end),
        placed=dict(getattr(result, "placed", {}) or {}),
        notes=[f"not read: {e}" for e in result.errors],
    )
    return write(data, path, cfg)


__all__ = ["Incident", "ReportConfig", "ReportData", "bin_seconds", "incidents", "render", "write", "write_analyze_report", "write_replay_report"]
