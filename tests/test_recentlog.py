"""The bounded records a long-running serve keeps in memory (issue 13: nothing grows for the
process's life): `RecentLog`, the pipeline's findings and hints, the scheduler's actions, and the
readers that follow them with a cursor. Inputs: constructed entries, the real scheduler, and the
simulated cluster's `node_xid79` scenario (a real XID 79 line's meaning, simulated timing)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvigil import config
from gpuvigil.exporter.metrics import TickStats
from gpuvigil.recentlog import RecentLog
from gpuvigil.scheduler import JobSpec, NodeSpec, Scheduler


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
        assert log.recent(2) == everything[-min(keep, 2):] if everything else log.recent(2) == []


def test_unbounded_keeps_all_and_indexes_like_a_list():
    log = RecentLog(None, "abcde")
    assert len(log) == 5 and log[0] == "a" and log[-1] == "e" and log[1:3] == ["b", "c"]
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
    from gpuvigil.runtime import build_simulated

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
