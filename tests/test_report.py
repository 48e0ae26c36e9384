"""`--report FILE.html` rendered in a real headless Chromium (Debian `chromium`).

The report must open with no network (name resolution is mapped to nothing), draw every plot it
announces (plotly's SVG roots present in the DOM after the scripts ran), log no console errors,
and screenshot to a non-blank image. Above all it must draw nothing gpuvigil did not say: every
mark of a finding in the rendered DOM (the data attributes the page's script stamps on plotly's
SVG elements) is a finding of the same run's `--format json` output, every page and warning has
its mark, and nothing red or orange is drawn that is not a finding's mark.

Inputs: the real H200 captures (NVML series at ~0.1 s + the real OOM log, which has no
timestamps; Flight Recorder dump + watchdog log), a real public XID cascade, the real per-pod GPU
memory series of Alibaba's GenAI trace (57 s), generated dcgm-exporter series at 30 s (a leak to
OOM, a healthy warm-up to 78 of 80 GiB; benchmarks/replay_series.py), and every built-in demo
scenario's simulated streams (1 Hz) replayed through `run_replay`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("plotly", reason="the report needs the optional plotly dependency (gpuvigil[report])")

from benchmarks.replay_series import Fault, Fleet, write_openmetrics  # noqa: E402
import gpuvigil.cli.main as cli  # noqa: E402
from gpuvigil.offline import report  # noqa: E402
from gpuvigil.model import Finding, FindingKind, Severity  # noqa: E402
from gpuvigil.offline.replay import parse_time  # noqa: E402

DATA = Path(__file__).parent / "data"
H200 = DATA / "h200"
OOM_AT = "2026-11-29T23:06:52.7Z"  # the end of the oom_ramp phase of the H200's NVML series
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # any network fetch would fail: the file is self-contained
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=15000",
    "--window-size=1400,3200",
]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.skip("chromium not installed (Debian package chromium; `make system-deps` installs it)")


def _open(html: Path, tmp_path: Path, *extra: str) -> tuple[str, str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    proc = subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, html.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def _console_errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln and re.search(r"error|uncaught|failed", ln, re.IGNORECASE)]


# -- the rendered DOM --------------------------------------------------------------------------------
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
_RGB = re.compile(r"rgba?\((\d+),\s*(\d+),\s*(\d+)")


def _firing_colour(style: str) -> bool:
    """Red or orange: the colours a reader takes for "this fired"."""
    return any(int(r) >= 170 and int(g) <= 175 and int(b) <= 100 and int(r) - int(b) >= 120 for r, g, b in _RGB.findall(style))


class _Dom(HTMLParser):
    """Marks (elements with data-mark), red/orange SVG elements outside any finding's mark, the
    visible text, and each plot's stamped-marks count."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # (tag, inside a finding's mark)
        self.marks: list[dict[str, str]] = []
        self.unmarked_firing: list[str] = []
        self.text: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        inside = (self.stack[-1][1] if self.stack else False) or "data-finding-id" in a
        if "data-mark" in a:
            self.marks.append(a)
        colour = " ".join(a.get(k, "") for k in ("style", "fill", "stroke"))
        if not inside and _firing_colour(colour) and not a.get("class", "").startswith("modebar"):
            self.unmarked_firing.append(f"<{tag} {a}>")
        if tag in ("script", "style"):
            self.skip += 1
        if tag not in _VOID:
            self.stack.append((tag, inside))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in _VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self.skip = max(0, self.skip - 1)
        if tag in _VOID:
            return
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.text.append(data)


def _rendered(html: Path, tmp_path: Path, expected_plots: set[str] | None = None) -> _Dom:
    text = html.read_text()
    # plotly.js is inlined: the page's own tags load nothing from elsewhere
    assert not re.search(r"^<(?:script|link)[^>]*\b(?:src|href)=", text, re.M)
    dom, stderr = _open(html, tmp_path, "--dump-dom")
    assert not _console_errors(stderr), _console_errors(stderr)
    meta = json.loads(re.search(r"id=\"report-meta\">(.*?)</script>", dom, re.S).group(1).replace("&quot;", '"'))  # type: ignore[union-attr]
    for plot in meta["plots"] if expected_plots is None else expected_plots:
        # each announced plot's div got plotly's SVG root once the scripts ran, and its marks stamped
        m = re.search(rf"id=\"plot-{re.escape(plot)}\".*?(?=<div class=\"plot\"|<h2|<h4|<table|$)", dom, re.S)
        assert m, f"plot {plot} missing from the DOM"
        assert 'class="main-svg"' in m.group(0), f"plot {plot} did not render"
        assert "data-marks-stamped" in m.group(0), f"plot {plot}: marks not stamped"
    parsed = _Dom()
    parsed.feed(dom)
    parsed.meta = meta  # type: ignore[attr-defined]
    return parsed


def _screenshot(html: Path, tmp_path: Path) -> Path:
    shot = tmp_path / f"{html.stem}.png"
    _open(html, tmp_path, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000  # not a blank page
    return shot


def _finding_key(rec: dict) -> tuple[str, str, float]:
    return (rec["id"], rec["kind"], round(float(rec["fired_at"] if "fired_at" in rec else rec["ts"]), 3))


def _assert_marks_are_findings(dom: _Dom, records: list[dict]) -> None:
    """Every finding mark is a finding of the run; every page and warning has a mark; nothing red
    or orange is drawn outside a finding's mark."""
    findings = {_finding_key(r) for r in records if r.get("record", "finding") == "finding"}
    drawn: set[tuple[str, str, float]] = set()
    for m in dom.marks:
        if m["data-mark"] == "bin":
            ids, ats = m["data-finding-ids"].split(), m["data-fired-ats"].split()
            assert len(ids) == len(ats) == int(m["data-count"])
            keys = {(i, m["data-kind"], round(float(a), 3)) for i, a in zip(ids, ats, strict=True)}
        elif "data-finding-id" in m:
            keys = {(m["data-finding-id"], m["data-kind"], round(float(m["data-fired-at"]), 3))}
        else:
            assert m["data-mark"] == "capacity", m  # the only mark that is no finding: a recorded sample
            continue
        assert keys <= findings, f"drawn but never raised: {keys - findings}"
        drawn |= keys
    firing = {_finding_key(r) for r in records if r.get("record", "finding") == "finding" and r["severity"] in ("page", "ticket")}
    assert firing <= drawn, f"raised but not drawn: {firing - drawn}"
    assert not dom.unmarked_firing, dom.unmarked_firing[:3]


def _json_lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


# -- generated dcgm-exporter series (30 s, pod labels) ------------------------------------------------
def _dcgm_series(path: Path, used_mib: list[float], t0: float, step: float = 30.0, total_mib: float = 81920.0) -> None:
    labels = 'gpu="0",UUID="GPU-5e1c4d0a-0000-0000-0000-000000000001",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="node-1",container="trainer",namespace="ml",pod="train-0"'
    lines = ["# TYPE DCGM_FI_DEV_FB_USED gauge", "# TYPE DCGM_FI_DEV_FB_FREE gauge", "# TYPE DCGM_FI_DEV_FB_RESERVED gauge"]
    for i, used in enumerate(used_mib):
        t = t0 + i * step
        lines.append(f"DCGM_FI_DEV_FB_USED{{{labels}}} {round(used)} {t:.3f}")
        lines.append(f"DCGM_FI_DEV_FB_FREE{{{labels}}} {round(total_mib - 512 - used)} {t:.3f}")
        lines.append(f"DCGM_FI_DEV_FB_RESERVED{{{labels}}} 512 {t:.3f}")
    path.write_text("\n".join(lines) + "\n# EOF\n")


def _replay(args: list[str], capsys) -> list[dict]:
    assert cli.main(["replay", *args, "--format", "json"]) == 0
    return _json_lines(capsys.readouterr().out)


# -- real inputs ---------------------------------------------------------------------------------------
def test_h200_oom_placed_with_at_is_the_only_mark(tmp_path, capsys):
    """The real H200: NVML series at ~0.1 s and the real capacity OOM's log (no timestamps),
    placed with --at at the end of the series' OOM ramp. The only finding is oom_capacity: the
    chart draws it and nothing else (no warning of the report's own)."""
    out = tmp_path / "h200.html"
    recs = _replay([str(H200 / "nvml_timeseries.csv"), str(H200 / "s2_oom_ramp.log"), "--step", "1s", "--at", OOM_AT, "--report", str(out)], capsys)
    findings = [r for r in recs if r["record"] == "finding"]
    assert [f["kind"] for f in findings] == ["oom_capacity"]
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    assert any(p.startswith("incident-1-memory-") for p in dom.meta["plots"]), dom.meta["plots"]  # type: ignore[attr-defined]
    text = " ".join(dom.text)
    assert "s2_oom_ramp.log has no timestamps of its own" in text and "the time given with --at, 2026-11-29 23:06:52 UTC" in text
    # the memory chart's only finding lines are the OOM's: one line and its label
    memory = [m for m in dom.marks if m.get("data-finding-id") and m["data-mark"] in ("finding", "label", "fit")]
    assert {m["data-kind"] for m in memory} == {"oom_capacity"} and not [m for m in dom.marks if m["data-mark"] == "fit"]
    _screenshot(out, tmp_path)


def test_h200_undated_log_at_file_time_is_said_and_not_drawn_on_the_series(tmp_path, capsys):
    """Without --at the log is placed at its file's time (here an hour after the series ended):
    the report says so, the overview spans it, and no memory chart pretends the OOM was on it."""
    log = tmp_path / "s2_oom_ramp.log"
    log.write_bytes((H200 / "s2_oom_ramp.log").read_bytes())
    series_end = 1795993698.968
    os.utime(log, (series_end + 3600, series_end + 3600))
    out = tmp_path / "h200.html"
    recs = _replay([str(H200 / "nvml_timeseries.csv"), str(log), "--report", str(out)], capsys)
    assert [r["fired_at"] for r in recs if r["record"] == "finding"] == [series_end + 3600]
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    text = " ".join(dom.text)
    assert "has no timestamps of its own: its findings are placed at its file's modification time" in text
    assert "60 min after the last recorded sample" in text and "Give --at TIME" in text
    assert not any("memory" in p for p in dom.meta["plots"])  # type: ignore[attr-defined]
    assert "no recorded memory samples in this incident's window" in text


def test_analyze_report_of_real_captures(tmp_path, capsys):
    """analyze over the real H200 files (OOM ramp placed with --at, NVML series, FR dump and
    watchdog log of one rank) and a real public XID cascade: marks are analyze's findings; one
    rank's FR dump draws its table, not a one-rank heat map."""
    out = tmp_path / "incident.html"
    inputs = [H200 / "s2_oom_ramp.log", H200 / "nvml_timeseries.csv", H200 / "s6_fr_rank_0", H200 / "s6_nccl_watchdog_timeout.log", DATA / "public" / "corpus" / "xid_ogkm_1150_cascade.log"]
    assert cli.main(["analyze", *map(str, inputs), "--report", str(out), "--node", "gpu-node-1", "--at", OOM_AT, "--format", "json"]) == 0
    recs = _json_lines(capsys.readouterr().out)
    assert any(r["kind"] == "oom_capacity" for r in recs) and any(r["kind"] == "xid" for r in recs)
    # the OOM message has no time: --at placed it; the dated watchdog log kept its own time
    assert {r["ts"] for r in recs if r["kind"] == "oom_capacity"} == {parse_time(OOM_AT)}
    assert all(r["ts"] != parse_time(OOM_AT) for r in recs if r["kind"] == "nccl_timeout")
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    plots = dom.meta["plots"]  # type: ignore[attr-defined]
    assert any("memory-gpu-node-1-0" in p for p in plots), plots
    assert not any(p.endswith("-progress") for p in plots)  # one rank: no heat map
    html = out.read_text()
    assert "Flight Recorder across ranks" in html or any(r["kind"] == "nccl_timeout" for r in recs)


def test_alibaba_genai_real_series_with_no_finding_draws_nothing_firing(tmp_path, capsys):
    """Real per-pod GPU memory (Alibaba GenAI 2026, 57 s, 22.8 h, 4 pods that vary the most) as
    dcgm-exporter FB_USED: every mark is a finding of the replay; where nothing fired, nothing
    red or orange and no "OOM" anywhere."""
    df = pl.read_csv(DATA / "public" / "alibaba-genai-2026" / "pod_gpu_memory_used_bytes_4pods.csv")
    lines = ["# TYPE DCGM_FI_DEV_FB_USED gauge"]
    for t, v, pod in df.iter_rows():
        lines.append(f'DCGM_FI_DEV_FB_USED{{gpu="0",Hostname="pod-{pod[:8]}",pod="{pod[:12]}"}} {round(v / (1 << 20))} {t:.3f}')
    om = tmp_path / "alibaba.om"
    om.write_text("\n".join(lines) + "\n# EOF\n")
    out = tmp_path / "alibaba.html"
    recs = _replay([str(om), "--step", "57s", "--report", str(out)], capsys)
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    if not [r for r in recs if r["record"] == "finding"]:
        assert not dom.marks and not dom.meta["plots"]  # type: ignore[attr-defined]
        assert "OOM" not in " ".join(dom.text) and "Nothing fired" in " ".join(dom.text)


def test_healthy_warm_up_plateau_at_78_of_80_gib_draws_nothing_that_fired(tmp_path, capsys):
    """A job warming up to 78 of 80 GiB in 5 min and staying there for an hour (dcgm-exporter at
    30 s): no finding, so no chart, no mark, no OOM, no warning colour."""
    used = [2048 + (78 * 1024 - 2048) * min(i / 10, 1.0) + (37 if i % 3 == 0 else 0) for i in range(130)]
    om = tmp_path / "plateau.om"
    _dcgm_series(om, used, 1_764_000_000.0)
    out = tmp_path / "plateau.html"
    recs = _replay([str(om), "--report", str(out)], capsys)
    assert not [r for r in recs if r["record"] == "finding"]
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    text = " ".join(dom.text)
    assert not dom.marks and not dom.meta["plots"] and "OOM" not in text and "Nothing fired" in text  # type: ignore[attr-defined]


def test_dcgm_leak_to_oom_at_30s_marks_only_what_fired(tmp_path, capsys):
    """A 40-minute leak to OOM in dcgm-exporter series with pod labels at 30 s (then the process
    dies and its memory is freed): whatever the detectors raise is drawn, and only that."""
    used = [40 * 1024 + 1024 * (i / 2) for i in range(81)] + [1024.0] * 20
    om = tmp_path / "leak.om"
    _dcgm_series(om, used, 1_764_000_000.0)
    out = tmp_path / "leak.html"
    recs = _replay([str(om), "--report", str(out)], capsys)
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    kinds = {r["kind"] for r in recs if r["record"] == "finding"}
    if not any(k.startswith("oom") for k in kinds):
        assert "OOM" not in " ".join(dom.text)
    # a prediction that carries its fit has it drawn (segment and extrapolation), with its id and
    # the time it was said (a ticket that became a page is said twice, each with its own fit)
    for r in recs:
        if r["record"] == "finding" and all(k in r["evidence"] for k in report.FIT_KEYS):
            fits = [m for m in dom.marks if m["data-mark"] == "fit" and m["data-finding-id"] == r["id"] and round(float(m["data-fired-at"]), 3) == round(float(r["fired_at"]), 3)]
            assert len(fits) == 2, (r["severity"], r["fired_at"], len(fits))


def test_replay_report_of_a_fleet_renders_in_chromium(tmp_path, capsys):
    t0 = 1_764_000_000.0
    om = tmp_path / "dcgm.om"
    write_openmetrics(Fleet(nodes=2, start=t0, seconds=7200, faults=[Fault("gpu-node-001", 3, "xid79", t0 + 1800), Fault("gpu-node-000", 1, "dbe", t0 + 5400)]), om)
    out = tmp_path / "replay.html"
    recs = _replay([str(om), "--report", str(out)], capsys)
    assert "pages per GPU-day" in out.read_text()
    dom = _rendered(out, tmp_path, {"overview"})
    _assert_marks_are_findings(dom, recs)
    # two incidents: different nodes, an hour apart
    assert len(dom.meta["incidents"]) == 2  # type: ignore[attr-defined]
    _screenshot(out, tmp_path)


def test_replay_of_a_hang_draws_rank_progress_with_the_culprit(tmp_path, capsys):
    """Hook records (the in-process hook's JSONL) of 4 ranks: from t=60 s ranks 0, 1, 3 wait in
    collective #61 that rank 2 never enqueued. Generated records, real pipeline and detectors."""
    t0 = 1_764_000_000.0
    lines = []
    for k in range(121):
        t = t0 + k
        for rank in range(4):
            done = min(k, 60)
            enq = done + 1 if (k > 60 and rank != 2) else done
            lines.append(json.dumps({"ts": t, "job": "train", "rank": rank, "node": f"gpu-node-{rank // 2}", "gpu": rank % 2, "step": done, "step_time_seconds": 1.0,
                                     "pg_status": {"0": {"last_enqueued": enq, "last_completed": done}}}))
    hook = tmp_path / "hook.jsonl"
    hook.write_text("\n".join(lines) + "\n")
    out = tmp_path / "hang.html"
    recs = _replay([str(hook), "--step", "1s", "--report", str(out)], capsys)
    hangs = [r for r in recs if r.get("kind") == "collective_hang"]
    assert hangs and hangs[0]["culprit_ranks"] == [2] and t0 + 60 <= hangs[0]["fired_at"] <= t0 + 75
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    assert "incident-1-progress" in dom.meta["plots"]  # type: ignore[attr-defined]
    culprits = [m for m in dom.marks if m["data-mark"] == "culprit"]
    assert culprits and all(m["data-kind"] == "collective_hang" for m in culprits)
    assert "culprit rank 2" in " ".join(dom.text)


# -- every demo scenario, its simulated streams replayed ------------------------------------------
def _record_scenario(name: str, t0: float):
    """The streams the simulated collectors handed the pipeline during `gpuvigil demo`'s run of
    `name` (1 Hz, simulated), moved to wall-clock time t0 + sim time, as replay's input."""
    from gpuvigil.offline.replay import Recorded
    from gpuvigil.app.runtime import build_simulated

    rt = build_simulated(name, seed=0)
    rec = Recorded()
    for c in rt.pipeline.collectors:
        orig = c.collect

        def wrap(now: float, orig=orig):
            out = orig(now)
            rec.add({k: v.with_columns(pl.col("ts") + t0) for k, v in out.items() if v.height and "ts" in v.columns})
            return out

        c.collect = wrap  # type: ignore[method-assign]
    rt.run(rt.cluster.scenario.duration_seconds)  # type: ignore[union-attr]
    rec.read.append(f"simulated scenario {name}")
    return rec


def _scenarios() -> list[str]:
    from gpuvigil.sim import scenario

    return scenario.builtin_names()


@pytest.mark.parametrize("name", _scenarios())
def test_every_demo_scenario_replayed_draws_only_its_findings(name, tmp_path):
    from gpuvigil import config
    from gpuvigil.pipeline.hints import HintPolicy
    from gpuvigil.offline.replay import json_records, run_replay

    t0 = 1_764_000_000.0
    result = run_replay(_record_scenario(name, t0), step=1.0)
    recs = [json.loads(json.dumps(r, default=str)) for r in json_records(result, HintPolicy(config.defaults()))]
    out = tmp_path / f"{name}.html"
    report.write_replay_report(result, out)
    dom = _rendered(out, tmp_path)
    _assert_marks_are_findings(dom, recs)
    findings = [r for r in recs if r["record"] == "finding"]
    if not findings:
        assert not dom.marks and "OOM" not in " ".join(dom.text)
    if any(r["kind"] == "collective_hang" for r in findings):
        assert any(p.endswith("-progress") for p in dom.meta["plots"])  # type: ignore[attr-defined]


# -- the drawing of a finding's own reasoning, and scale ------------------------------------------
def _series(node: str, gpu: int, ts: list[float], used_gib: list[float], total_gib: float = 80.0) -> pl.DataFrame:
    return pl.DataFrame(
        {"ts": ts, "node": [node] * len(ts), "gpu": [gpu] * len(ts), "memory_used_bytes": [int(u * (1 << 30)) for u in used_gib], "memory_total_bytes": [int(total_gib * (1 << 30))] * len(ts)},
        schema={"ts": pl.Float64, "node": pl.Utf8, "gpu": pl.Int32, "memory_used_bytes": pl.Int64, "memory_total_bytes": pl.Int64},
    )


def test_a_predictors_fit_in_its_evidence_is_drawn_from_its_keys(tmp_path):
    """An oom_predicted finding carrying its fit (fit_start_ts .. predicted_full_ts) gets the fit
    segment and its extrapolation to capacity, both marked with its id; without the keys, only
    the line of when it fired."""
    t0 = 1_764_000_000.0
    ts = [t0 + 30 * i for i in range(60)]
    gs = _series("node-1", 0, ts, [40 + 0.5 * i for i in range(60)])
    ev = {"fit_start_ts": ts[30], "fit_end_ts": ts[50], "slope_bytes_per_s": (1 << 30) / 60, "intercept_bytes": 65 * (1 << 30), "predicted_full_ts": ts[50] + 900, "capacity_bytes": 80 * (1 << 30), "sample_interval_s": 30.0, "confidence": 0.9}
    with_fit = Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.TICKET, ts=ts[50], job="train", node="node-1", gpu=0, evidence=ev, summary="will run out")
    without = Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.TICKET, ts=ts[50], job="eval", node="node-2", gpu=1, evidence={"time_to_oom_seconds": 900.0}, summary="will run out")
    gs2 = _series("node-2", 1, ts, [40 + 0.5 * i for i in range(60)])
    data = report.ReportData(title="t", findings=[(ts[50], with_fit), (ts[50] + 7200 * 3, without)], gpu_samples=pl.concat([gs, gs2]), span=(ts[0], ts[-1] + 7200 * 3))
    out = tmp_path / "fit.html"
    report.write(data, out)
    dom = _rendered(out, tmp_path)
    recs = [{"id": f.id, "kind": f.kind.value, "fired_at": at, "severity": f.severity.value} for at, f in data.findings]
    _assert_marks_are_findings(dom, recs)
    fits = [m for m in dom.marks if m["data-mark"] == "fit"]
    assert len(fits) == 2 and {m["data-finding-id"] for m in fits} == {with_fit.id}


def test_two_thousand_pages_are_counted_per_round_bin_and_hundreds_of_gpus_summarised(tmp_path):
    """2,000 XID pages over a week on 250 GPUs: the overview counts them per round bin (every
    page in exactly one bar), and an incident of 200 GPUs draws at most the configured few."""
    t0 = 1_764_000_000.0
    findings = []
    for i in range(2000):
        at = t0 + i * 302.4
        node, gpu = f"n{(i % 250) // 8:03d}", (i % 250) % 8
        findings.append((at, Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=at, node=node, gpu=gpu, xid=79, summary="XID 79")))
    ooms = []
    for g in range(200):
        at = t0 + 3600 + g
        ooms.append((at, Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.TICKET, ts=at, job="big", node=f"m{g // 8:03d}", gpu=g % 8, summary="will run out")))
    gs = pl.concat([_series(f"m{g // 8:03d}", g % 8, [t0 + 3000 + 30 * i for i in range(40)], [40 + i for i in range(40)]) for g in range(200)])
    data = report.ReportData(title="t", findings=findings + ooms, gpu_samples=gs, span=(t0, t0 + 7 * 86400))
    assert report.bin_seconds(7 * 86400, 48) == 21600.0 and report.bin_seconds(60, 48) == 2.0
    out = tmp_path / "many.html"
    plots = report.write(data, out)
    assert sum(p.startswith("incident-") and "-memory-" in p for p in plots) <= report.ReportConfig().gpus_per_incident
    assert "more GPU(s) of this incident not drawn" in out.read_text()
    dom = _rendered(out, tmp_path, {"overview"})
    recs = [{"id": f.id, "kind": f.kind.value, "fired_at": at, "severity": f.severity.value} for at, f in data.findings]
    _assert_marks_are_findings(dom, recs)
    bins = [m for m in dom.marks if m["data-mark"] == "bin"]
    assert sum(int(m["data-count"]) for m in bins) == 2200


def test_incidents_group_by_job_node_gpu_within_the_gap_and_honour_an_own_id():
    t0 = 1_764_000_000.0

    def f(kind, at, **kw):
        return (at, Finding(kind=kind, severity=Severity.PAGE, ts=at, summary="s", **kw))

    items = [
        f(FindingKind.OOM_PREDICTED, t0, job="a", node="n1", gpu=0),
        f(FindingKind.OOM_CAPACITY, t0 + 600, job="a", node="n1", gpu=0),
        f(FindingKind.XID, t0 + 700, node="n1", gpu=3),  # same node within the gap: same incident
        f(FindingKind.XID, t0 + 100_000, node="n1", gpu=3),  # a day later: its own
        f(FindingKind.ECC, t0 + 650, node="n9", gpu=1),  # other node: its own
        f(FindingKind.ECC, t0 + 660, node="n8", gpu=1, evidence={"incident": "fault-7"}),
        f(FindingKind.ECC, t0 + 90_000, node="n7", gpu=1, evidence={"incident": "fault-7"}),
    ]
    groups = [[x[1].kind.value for x in inc.findings] for inc in report.incidents(items, 1800)]
    assert groups == [["oom_predicted", "oom_capacity", "xid"], ["ecc"], ["ecc", "ecc"], ["xid"]]
