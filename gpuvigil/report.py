"""`--report FILE.html` for `analyze` and `replay`: one self-contained HTML incident report.

Everything is in the one file (plotly.js inlined once), so it opens without network access and
can be attached to a ticket. Plots, each drawn only when the inputs hold what it needs:

- memory over time up to the OOM, with the growth trend the OOM predictor extrapolates
  (least squares over its fit window, `detectors.oom.fit_window_seconds`) and when the warning
  fired (replay: the `oom_predicted` finding's time; analyze: when the same trend first put the
  OOM within `predict_horizon_seconds`);
- a rank x time heat map of collective progress (last completed sequence number per rank), the
  culprit ranks of hang/timeout findings marked;
- the cross-rank Flight Recorder table of each collective hang or mismatch;
- an XID/ECC timeline per GPU;
- for replay, pages over time per kind.

plotly is an optional dependency (`pip install 'gpuvigil[report]'`).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import config
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, FindingKind

GIB = float(1 << 30)
HANG_KINDS = {FindingKind.NCCL_TIMEOUT, FindingKind.COLLECTIVE_HANG, FindingKind.COLLECTIVE_MISMATCH}
HEALTH_KINDS = {FindingKind.XID, FindingKind.ECC}


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


@dataclass
class ReportData:
    title: str
    findings: list[tuple[float, Finding]]  # (time it fired, finding)
    gpu_samples: pl.DataFrame | None = None
    rank_progress: pl.DataFrame | None = None
    subtitle: str = ""
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


# -- figures -----------------------------------------------------------------------------------------
def _memory_figures(data: ReportData, cfg: dict[str, Any] | None) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    gs = data.gpu_samples
    if gs is None or gs.height == 0 or gs["memory_used_bytes"].null_count() == gs.height:
        return []
    oom_cfg = (cfg or config.defaults()).get("detectors", {}).get("oom", {})
    fit_window = float(oom_cfg.get("fit_window_seconds", 90.0))
    horizon = float(oom_cfg.get("predict_horizon_seconds", 1800.0))
    ooms = [(at, f) for at, f in data.findings if f.kind.value.startswith("oom_") and f.kind != FindingKind.OOM_PREDICTED]
    predicted = [(at, f) for at, f in data.findings if f.kind == FindingKind.OOM_PREDICTED]
    # the GPUs worth a plot: those an OOM names, else the one whose memory grew the most
    keys = gs.select("node", "gpu").unique().rows()
    named = {(f.node, f.gpu) for _, f in ooms + predicted}
    chosen = [k for k in keys if k in named] or sorted(
        keys, key=lambda k: -float(gs.filter((pl.col("node") == k[0]) & (pl.col("gpu") == k[1]))["memory_used_bytes"].max() or 0)
    )[:1]
    out = []
    for node, gpu in chosen[:4]:
        g = gs.filter((pl.col("node") == node) & (pl.col("gpu") == gpu)).sort("ts").drop_nulls("memory_used_bytes")
        if g.height < 2:
            continue
        t = g["ts"].to_list()
        used = [v / GIB for v in g["memory_used_bytes"].to_list()]
        total = g["memory_total_bytes"].drop_nulls()
        cap = float(total.max()) / GIB if total.len() else None  # type: ignore[arg-type]
        # an OOM only marks this series when it happened within it (a log without dates is
        # stamped with the file's time, which may be anywhere)
        ooms = [(at, f) for at, f in ooms if t[0] <= at <= t[-1] + fit_window]
        # no dated OOM on this series: it is at the top of the most sustained climb (a rising run
        # of at least a fifth of the peak, with the most rising samples)
        runs, i0 = [], 0
        for i in range(1, len(used) + 1):
            if i == len(used) or used[i] < used[i - 1] - 0.02 * max(used):  # small dips: the same climb
                top = max(range(i0, i), key=lambda j: (used[j], -j))  # first sample at the run's top
                climbs = sum(1 for j in range(i0 + 1, top + 1) if used[j] > used[j - 1])
                runs.append((used[top] - used[i0] >= 0.2 * max(used), climbs, used[top] - used[i0], top))
                i0 = i
        peak_t = t[max(runs)[3]]
        end_t = next((at for at, f in ooms if f.gpu in (gpu, None)), peak_t)
        fig = go.Figure()
        fig.add_trace(go.Scatter(x=[_dt(x) for x in t], y=used, mode="lines", name="memory used (GiB)"))
        if cap:
            fig.add_hline(y=cap, line_dash="dot", line_color="red", annotation_text=f"capacity {cap:.1f} GiB")
        # the predictor's trend: least squares over the fit window before the OOM (or the end)
        # the growth that led to it: the rising run of samples before the OOM, within the fit window
        end_i = max(i for i, x in enumerate(t) if x <= end_t) if t[0] <= end_t else 0
        start_i = end_i
        while start_i > 0 and used[start_i - 1] <= used[start_i] + 0.02 * max(used) and used[start_i - 1] > min(used) and t[start_i - 1] >= end_t - fit_window:
            start_i -= 1
        fit = list(zip(t[start_i : end_i + 1], used[start_i : end_i + 1], strict=True))
        warn_at = next((at for at, f in predicted if f.gpu in (gpu, None)), None)
        if len(fit) >= 3 and cap:
            n = len(fit)
            mx = sum(x for x, _ in fit) / n
            my = sum(y for _, y in fit) / n
            sxx = sum((x - mx) ** 2 for x, _ in fit)
            slope = sum((x - mx) * (y - my) for x, y in fit) / sxx if sxx else 0.0
            if slope > 0:
                t_full = mx + (cap - my) / slope
                x0 = fit[0][0]
                fig.add_trace(
                    go.Scatter(x=[_dt(x0), _dt(t_full)], y=[my + slope * (x0 - mx), cap], mode="lines", line={"dash": "dash", "color": "orange"}, name=f"trend {slope * 60:.2f} GiB/min")
                )
                if warn_at is None:
                    # when the same trend first put the OOM within the predictor's horizon
                    warn_at = next((x for x, _ in fit if t_full - x <= horizon), None)
        if warn_at is not None:
            fig.add_vline(x=_dt(warn_at).timestamp() * 1000, line_color="orange", annotation_text=f"warning (trend: full within {horizon / 60:.0f} min)")
        for at, f in ooms:
            if f.gpu in (gpu, None):
                fig.add_vline(x=_dt(at).timestamp() * 1000, line_color="red", annotation_text=f.kind.value)
        fig.update_layout(title=f"Memory of {node or 'node'} GPU {gpu} up to the OOM", xaxis_title="time (UTC)", yaxis_title="GiB", height=380)
        out.append((f"memory-{node}-{gpu}", fig))
    return out


def _progress_figure(data: ReportData) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    hangs = [(at, f) for at, f in data.findings if f.kind in HANG_KINDS]
    culprits = sorted({r for _, f in hangs for r in f.culprit_ranks})
    rp = data.rank_progress
    if rp is not None and rp.height and rp["last_completed_seq"].null_count() < rp.height:
        rp = rp.drop_nulls(["rank", "last_completed_seq"]).sort("ts")
        step = max((rp["ts"].max() - rp["ts"].min()) / 120.0, 1.0)  # type: ignore[operator]
        binned = rp.with_columns((pl.col("ts") // step * step).alias("t")).group_by(["rank", "t"]).agg(pl.col("last_completed_seq").max()).sort(["rank", "t"])
        ranks = sorted(binned["rank"].unique().to_list())
        times = sorted(binned["t"].unique().to_list())
        z = {(r, t): v for r, t, v in binned.iter_rows()}
        matrix = []
        last: dict[int, float | None] = {}
        for r in ranks:
            row = []
            for t in times:
                v = z.get((r, t), last.get(r))
                last[r] = v
                row.append(v)
            matrix.append(row)
        fig = go.Figure(go.Heatmap(z=matrix, x=[_dt(t) for t in times], y=[f"rank {r}" for r in ranks], colorscale="Viridis", colorbar={"title": "last completed seq"}))
        title = "Collective progress per rank"
    elif hangs:
        # no progress series: each timeout's per-rank view (last enqueued / completed at the timeout)
        rows = []
        for at, f in hangs:
            for pr in f.evidence.get("per_rank") or [{"rank": f.evidence.get("rank"), "last_completed": f.evidence.get("last_completed")}]:
                if pr.get("rank") is not None:
                    rows.append((pr["rank"], at, pr.get("last_completed")))
        if not rows:
            return []
        ranks = sorted({r for r, _, _ in rows})
        times = sorted({t for _, t, _ in rows})
        z = {(r, t): v for r, t, v in rows}
        fig = go.Figure(go.Heatmap(z=[[z.get((r, t)) for t in times] for r in ranks], x=[_dt(t) for t in times], y=[f"rank {r}" for r in ranks], colorscale="Viridis", colorbar={"title": "last completed seq"}))
        title = "Collective progress per rank at each timeout"
    else:
        return []
    for r in culprits:
        fig.add_annotation(x=1.0, xref="paper", y=f"rank {r}", text=f"culprit: rank {r}", showarrow=True, arrowhead=2, ax=-60, ay=0, font={"color": "red"})
    fig.update_layout(title=title + (f" (culprit rank {', '.join(map(str, culprits))})" if culprits else ""), height=max(260, 40 * len(fig.data[0].y) + 140))
    return [("progress", fig)]


def _fr_tables(data: ReportData) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    out = []
    for i, (_at, f) in enumerate(x for x in data.findings if x[1].kind in (FindingKind.COLLECTIVE_HANG, FindingKind.COLLECTIVE_MISMATCH)):
        ev = f.evidence
        ranks = f.ranks or sorted(set(ev.get("not_completed_ranks") or []) | set(f.culprit_ranks))
        if not ranks:
            continue
        enq = ev.get("last_enqueued") if isinstance(ev.get("last_enqueued"), list) else [ev.get("last_enqueued")] * len(ranks)
        done = ev.get("last_completed") if isinstance(ev.get("last_completed"), list) else [ev.get("last_completed")] * len(ranks)
        not_done = set(ev.get("not_completed_ranks") or [])
        cols = [
            ranks,
            [ev.get("op") or ev.get("op_type")] * len(ranks),
            [ev.get("collective_seq_id")] * len(ranks),
            (list(enq) + [None] * len(ranks))[: len(ranks)],
            (list(done) + [None] * len(ranks))[: len(ranks)],
            ["no" if r in not_done else "yes" for r in ranks],
            ["culprit" if r in f.culprit_ranks else "" for r in ranks],
        ]
        fig = go.Figure(go.Table(header={"values": ["rank", "op", "seq", "last enqueued", "last completed", "completed", ""]}, cells={"values": cols}))
        fig.update_layout(title=f"Flight Recorder, across ranks: {f.kind.value} in {ev.get('pg_desc') or ev.get('pg') or 'process group'}", height=260 + 30 * len(ranks))
        out.append((f"fr-{i}", fig))
    return out


def _health_timeline(data: ReportData) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    items = [(at, f) for at, f in data.findings if f.kind in HEALTH_KINDS]
    if not items:
        return []
    fig = go.Figure()
    for kind in sorted({f.kind.value for _, f in items}):
        sel = [(at, f) for at, f in items if f.kind.value == kind]
        fig.add_trace(
            go.Scatter(
                x=[_dt(at) for at, _ in sel],
                y=[f"{f.node or 'node'} GPU {f.gpu if f.gpu is not None else (f.evidence.get('pci_bus_id') or 'all')}" for _, f in sel],
                mode="markers+text",
                marker={"size": 14, "symbol": "x" if kind == "ecc" else "diamond"},
                text=[f"XID {f.xid}" if f.xid is not None else kind for _, f in sel],
                textposition="top center",
                hovertext=[f.summary for _, f in sel],
                name=kind,
            )
        )
    fig.update_layout(title="XID / ECC timeline per GPU", xaxis_title="time (UTC)", height=max(300, 30 * len({f.gpu for _, f in items}) + 220))
    return [("health", fig)]


def _pages_over_time(data: ReportData) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    pages = [(at, f) for at, f in data.findings if f.severity.value == "page"]
    if not pages:
        return []
    fig = go.Figure()
    for kind in sorted({f.kind.value for _, f in pages}):
        fig.add_trace(go.Histogram(x=[_dt(at) for at, f in pages if f.kind.value == kind], name=kind))
    fig.update_layout(barmode="stack", title="Pages over time per kind", xaxis_title="time (UTC)", yaxis_title="pages", height=340)
    return [("pages", fig)]


# -- page ----------------------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}h1{font-size:22px}h2{font-size:17px;margin-top:28px}
table.f{border-collapse:collapse;font-size:13px;width:100%}table.f td,table.f th{border:1px solid #ddd;padding:4px 6px;vertical-align:top}
.page{color:#b00;font-weight:600}.ticket{color:#a60}.info{color:#666}.muted{color:#666;font-size:13px}"""


def render(data: ReportData, cfg: dict[str, Any] | None = None) -> str:
    plotly = _plotly()
    figures = [*_memory_figures(data, cfg), *_progress_figure(data), *_fr_tables(data), *_health_timeline(data)]
    if data.summary is not None:
        figures += _pages_over_time(data)
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(data.title)}</title><style>{_CSS}</style>",
        # plotly.js inlined once: the report opens with no network
        f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>{html.escape(data.title)}</h1><p class='muted'>{html.escape(data.subtitle)}</p>",
    ]
    if data.summary:
        s = data.summary
        parts.append(
            "<p>"
            + html.escape(
                f"{s['findings']} finding(s), {s['pages']} page(s) over {s['gpus']} GPU(s) and {s['gpu_days']:.3g} GPU-days "
                f"= {s['pages_per_gpu_day']:.4g} pages per GPU-day; {s['hints']} hint(s). Pages by kind: "
                + (", ".join(f"{k} {v}" for k, v in s["pages_by_kind"].items()) or "none")
            )
            + "</p>"
        )
    for note in data.notes:
        parts.append(f"<p class='muted'>{html.escape(note)}</p>")
    for div_id, fig in figures:
        parts.append(f"<div class='plot' data-plot='{html.escape(div_id)}'>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{div_id}", config={"displaylogo": False}))
        parts.append("</div>")
    parts.append("<h2>Findings</h2><table class='f'><tr><th>fired</th><th>severity</th><th>kind</th><th>where</th><th>summary</th><th>source</th></tr>")
    for at, f in data.findings:
        where = " ".join(x for x in (f.job or "", f.node or "", f"GPU {f.gpu}" if f.gpu is not None else "", f"ranks {','.join(map(str, f.ranks))}" if f.ranks else "") if x)
        parts.append(
            f"<tr><td>{_dt(at).strftime('%Y-%m-%d %H:%M:%S') if at > 3.2e8 else f'{at:.1f} s'}</td><td class='{f.severity.value}'>{f.severity.value}</td>"
            f"<td>{html.escape(f.kind.value)}</td><td>{html.escape(where)}</td><td>{html.escape(f.summary)}</td><td>{html.escape(f.source or '')}</td></tr>"
        )
    parts.append("</table>")
    parts.append(f"<script type='application/json' id='report-meta'>{html.escape(json.dumps({'plots': [d for d, _ in figures], 'findings': len(data.findings)}))}</script>")
    parts.append("</body></html>")
    return "\n".join(parts)


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
    from gpuvigil.replay import Recorded, read_series_file

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


def write_analyze_report(report: Any, paths: Sequence[Path], path: Path, cfg: dict[str, Any] | None = None) -> list[str]:
    gs, rp = _series_from_inputs(paths)
    data = ReportData(
        title="gpuvigil analyze: incident report",
        subtitle=f"{len(report.read)} file(s) analysed; {len(report.findings)} finding(s). Generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}.",
        findings=[(f.ts, f) for f in report.findings],
        gpu_samples=gs,
        rank_progress=rp,
        notes=[f"skipped: {e}" for e in report.errors],
    )
    return write(data, path, cfg)


def write_replay_report(result: Any, path: Path, cfg: dict[str, Any] | None = None) -> list[str]:
    data = ReportData(
        title="gpuvigil replay: what would have fired",
        subtitle=f"{datetime.fromtimestamp(result.start, UTC):%Y-%m-%d %H:%M} .. {datetime.fromtimestamp(result.end, UTC):%Y-%m-%d %H:%M} UTC at {result.step:g} s",
        findings=[(x.at, x.finding) for x in result.findings],
        gpu_samples=result.gpu_samples,
        rank_progress=getattr(result, "rank_progress", None),
        summary=result.summary(),
    )
    return write(data, path, cfg)


__all__ = ["ReportData", "render", "write", "write_analyze_report", "write_replay_report"]
