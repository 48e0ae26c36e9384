"""The bounded records a long-running serve keeps in memory (nothing grows for the
process's life): `RecentLog`, the pipeline's findings and hints, the scheduler's actions, and the
readers that follow them with a cursor, and `gpuvigil serve --config` taking the bounds, as a
process. Inputs: constructed entries, the real scheduler, and the
simulated cluster's `node_xid79` scenario (a real XID 79 line's meaning, simulated timing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil import config
from gpuvigil.exporter.metrics import TickStats
from gpuvigil.util.recentlog import RecentLog
from gpuvigil.scheduler import JobSpec, NodeSpec, Scheduler
from services import wait_for

REPO = Path(__file__).resolve().parents[1]


@given(keep=st.integers(1, 6), batches=st.lists(st.integers(0, 5), max_size=12))
def test_a_reader_with_a_cursor_gets_exactly_what_was_appended_since_and_is_still_kept(keep, batches):
    log: RecentLog[int] = RecentLog(keep)
    everything: list[int] = []
    cursor = 0
    for size in batches:
        new = list(range(len(everything), len(everything) + size))
        log.extend(new)
        everything += new
        got = log.since(cursor)
        assert got == new[-keep:] if new else got == []
        cursor = log.total
        assert list(log) == everything[-keep:]
        assert log.total == len(everything) and log.dropped == len(everything) - len(log)


def test_unbounded_keeps_all_and_reads_both_ways():
    log = RecentLog(None, "abcde")
    assert len(log) == 5 and log[0] == "a" and log[-1] == "e"
    assert list(reversed(log)) == list("edcba") and log.since(3) == ["d", "e"] and log.dropped == 0


def test_a_reader_that_needs_every_entry_is_told_when_some_were_dropped():
    assert RecentLog(3, [1, 2, 3]).every() == [1, 2, 3]
    with pytest.raises(LookupError, match="1 of 4 entries were dropped"):
        RecentLog(3, [1, 2, 3, 4]).every()


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep must be >= 1"):
        RecentLog(0)


def test_the_scheduler_keeps_its_newest_actions_and_a_cycle_still_returns_its_own():
    s = Scheduler([NodeSpec("n0", n_gpus=8)], config.load(overrides={"scheduler": {"explain": {"actions_kept": 3}}}))
    for i in range(5):
        s.submit(JobSpec(f"j{i}", 1, submit_ts=0.0), 0.0)
    placed = s.cycle(0.0)
    assert [a.job for a in placed] == [f"j{i}" for i in range(5)], "a cycle returns every action it took"
    assert len(s.actions) == 3 and s.actions.total == 5
    assert [a.job for a in s.actions] == ["j2", "j3", "j4"]
    s.job_completed("j4", 1.0)
    assert s.why("j4")["recent_actions"][-1]["action"] == "completed"
    assert s.cycle(2.0) == []


def test_the_pipeline_keeps_its_newest_findings_and_the_exporter_counts_every_one():
    """Kept 1 finding: the exporter still counts the XID page, folded in from the cursor."""
    from gpuvigil.exporter.metrics import Snapshot
    from gpuvigil.exporter.prometheus import exposition
    from gpuvigil.app.runtime import build_simulated

    stats = TickStats()
    rt = build_simulated("node_xid79", sinks=[stats], cfg=config.load(overrides={"pipeline": {"findings_kept": 1}}))
    rt.run(130)
    raised = rt.pipeline.all_findings.total
    assert raised >= 1 and len(rt.pipeline.all_findings) == 1
    text = exposition(Snapshot(rt, stats)).decode()
    counted = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("gpuvigil_findings_total{")
    )
    assert counted == raised


def _serve(tmp_path, settings: str, *extra: str) -> subprocess.Popen:
    cfg = tmp_path / "gpuvigil.yaml"
    cfg.write_text(settings)
    return subprocess.Popen(
        [sys.executable, "-m", "gpuvigil", "serve", "--port", "0", "--scenario", "node_xid79", "--config", str(cfg), "--log-level", "warning", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _counter_total(text: str, name: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_serve_takes_the_bounds_from_its_config_and_its_metrics_count_past_them(tmp_path):
    """`gpuvigil serve --config` as a process: with 1 finding and 2 actions kept, /metrics still
    counts every finding and action taken (the scenario's XID 79 at t=100, every job placed)."""
    serve = _serve(tmp_path, "pipeline:\n  findings_kept: 1\nscheduler:\n  explain:\n    actions_kept: 2\n", "--speed", "100", "--duration", "60")
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        url = re.search(r"metrics (http://\S+/metrics)", line).group(1)

        def counted() -> str | None:
            text = httpx.get(url, timeout=10).text
            return text if _counter_total(text, "gpuvigil_findings_total") >= 1 else None

        text = wait_for(counted, timeout=120, what="the XID finding on /metrics")
        assert _counter_total(text, "gpuvigil_scheduler_actions_total") > 2
    finally:
        serve.terminate()
        serve.wait(60)


def test_serve_refuses_a_bound_below_one_in_one_line(tmp_path):
    serve = _serve(tmp_path, "pipeline:\n  findings_kept: 0\n", "--duration", "5")
    _, err = serve.communicate(timeout=120)
    assert serve.returncode != 0
    assert "findings_kept" in err and "Traceback" not in err
