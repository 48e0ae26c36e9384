"""`--report FILE.html` rendered in a real headless Chromium (Debian `chromium`).

The report must open with no network (name resolution is mapped to nothing), draw every plot it
announces (plotly's SVG roots present in the DOM after the scripts ran), log no console errors,
and screenshot to a non-blank image. Inputs are the real H200 captures (OOM ramp + NVML series,
Flight Recorder dump + watchdog log), a real public XID cascade, and a replay of generated
dcgm-exporter series (benchmarks/replay_series.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("plotly", reason="the report needs the optional plotly dependency (gpuvigil[report])")

from benchmarks.replay_series import Fault, Fleet, write_openmetrics  # noqa: E402
from gpuvigil import cli  # noqa: E402

DATA = Path(__file__).parent / "data"
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


def _check_rendered(html: Path, tmp_path: Path, expected_plots: set[str]) -> None:
    text = html.read_text()
    # plotly.js is inlined: the page's own tags load nothing from elsewhere
    assert not re.search(r"^<(?:script|link)[^>]*\b(?:src|href)=", text, re.M)
    dom, stderr = _open(html, tmp_path, "--dump-dom")
    assert not _console_errors(stderr), _console_errors(stderr)
    for plot in expected_plots:
        # each announced plot's div got plotly's SVG root once the scripts ran
        m = re.search(rf"id=\"plot-{re.escape(plot)}\".*?(?=<div class=\"plot\"|<h2>Findings)", dom, re.S)
        assert m, f"plot {plot} missing from the DOM"
        assert 'class="main-svg"' in m.group(0), f"plot {plot} did not render"
    shot = tmp_path / f"{html.stem}.png"
    _open(html, tmp_path, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 30_000  # not a blank page


def test_analyze_report_renders_in_chromium(tmp_path, capsys):
    h200 = DATA / "h200"
    out = tmp_path / "incident.html"
    inputs = [h200 / "s2_oom_ramp.log", h200 / "nvml_timeseries.csv", h200 / "s6_fr_rank_0", h200 / "s6_nccl_watchdog_timeout.log", DATA / "public" / "corpus" / "xid_ogkm_1150_cascade.log"]
    assert cli.main(["analyze", *map(str, inputs), "--report", str(out), "--node", "gpu-node-1"]) == 0
    capsys.readouterr()
    meta = re.search(r"id='report-meta'>(.*?)</script>", out.read_text(), re.S).group(1)  # type: ignore[union-attr]
    plots = set(re.findall(r"&quot;([\w.-]+)&quot;", meta)) - {"plots", "findings"}
    # memory up to the OOM, rank x time progress with the culprit, the FR table, XID timeline
    assert {"progress", "fr-0", "health"} <= plots and any(p.startswith("memory-") for p in plots), plots
    html = out.read_text()
    assert "culprit: rank 0" in html and "trend" in html and "XID 145" in html
    _check_rendered(out, tmp_path, plots)


def test_replay_report_renders_in_chromium(tmp_path, capsys):
    t0 = 1_764_000_000.0
    om = tmp_path / "dcgm.om"
    write_openmetrics(Fleet(nodes=2, start=t0, seconds=7200, faults=[Fault("gpu-node-001", 3, "xid79", t0 + 1800), Fault("gpu-node-000", 1, "dbe", t0 + 5400)]), om)
    out = tmp_path / "replay.html"
    assert cli.main(["replay", str(om), "--report", str(out)]) == 0
    capsys.readouterr()
    html = out.read_text()
    assert "pages per GPU-day" in html
    _check_rendered(out, tmp_path, {"pages", "health"})


def test_replay_of_a_hang_draws_rank_progress_with_the_culprit(tmp_path, capsys):
    """Hook records (the in-process hook's JSONL) of 4 ranks: from t=60 s ranks 0, 1, 3 wait in
    collective #61 that rank 2 never enqueued. Generated records, real pipeline and detectors."""
    import json

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
    assert cli.main(["replay", str(hook), "--step", "1s", "--report", str(out), "--format", "json"]) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    hangs = [r for r in records if r.get("kind") == "collective_hang"]
    assert hangs and hangs[0]["culprit_ranks"] == [2] and t0 + 60 <= hangs[0]["fired_at"] <= t0 + 75
    html = out.read_text()
    assert "Collective progress per rank" in html and "culprit: rank 2" in html
    _check_rendered(out, tmp_path, {"progress"})
