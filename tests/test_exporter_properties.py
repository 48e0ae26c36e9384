"""Property tests: job names, process groups and node names come from untrusted sources (logs,
scheduler state); whatever they contain, a scrape stays parseable and carries them unchanged."""

from __future__ import annotations

import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil import schemas
from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.exporter.prometheus import exposition
from gpuvigil.window import Window
from gpuvigil.util.recentlog import RecentLog

label_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)


class FakeJob:
    def __init__(self, name):
        from gpuvigil.scheduler.core import JobSpec

        self.spec = JobSpec(name, n_gpus=1, tenant=name[::-1], priority="P1")
        self.state = "running"
        self.restarts = 0
        self.lost_gpu_seconds = 0.0


class FrameRuntime:
    """Just enough runtime for a snapshot over hand-made frames (no scheduler nodes)."""

    def __init__(self, window: Window, jobs: list[str]):
        class P:
            pass

        self.pipeline = P()
        self.pipeline.window = window
        self.pipeline.active = {}
        self.pipeline.all_findings = RecentLog()
        self.pipeline.collectors = []
        self.pipeline.ticks = 1
        self.pipeline.samples_ingested_total = 0

        class S:
            pass

        self.scheduler = S()
        self.scheduler.jobs = {j: FakeJob(j) for j in jobs}
        self.scheduler.nodes = {}
        self.scheduler.actions = RecentLog()
        self.now = 1.0
        self.last_result = None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(label_text, min_size=1, max_size=4, unique=True), node=label_text, pg=label_text,
       step_time=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_untrusted_label_values_round_trip(jobs, node, pg, step_time):
    window = Window()
    rows = [dict(ts=1.0, job=j, rank=r, node=node, gpu=0, pg=pg, last_enqueued_seq=3, last_completed_seq=2, step=1, step_time_seconds=step_time)
            for j in jobs for r in range(2)]
    window.add("rank_progress", schemas.frame(rows, schemas.RANK_PROGRESS))
    window.add("gpu_samples", schemas.frame([dict(ts=1.0, node=node, gpu=0, gpu_uuid=pg, power_w=1.0, last_xid=None)], schemas.GPU_SAMPLES))
    window.seal(1.0)
    text = exposition(Snapshot(FrameRuntime(window, jobs), TickStats())).decode()
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            got.setdefault(s.name, []).append(s.labels)
    assert sorted({l["job"] for l in got["gpuvigil_rank_step_time_seconds"]}) == sorted(jobs)
    assert {l["pg"] for l in got["gpuvigil_rank_info"]} == {pg}
    assert {l["node"] for l in got["gpuvigil_gpu_power_watts"]} == {node}
    assert {l["tenant"] for l in got["gpuvigil_job_info"]} == {j[::-1] for j in jobs}


@settings(max_examples=30, deadline=None)
@given(n=st.integers(min_value=0, max_value=50))
def test_empty_and_partial_frames_never_break_a_scrape(n):
    window = Window()
    if n:
        window.add("gpu_samples", pl.DataFrame({"ts": [1.0] * n, "node": [f"n{i % 3}" for i in range(n)], "gpu": list(range(n))}).pipe(schemas.conform, "gpu_samples"))
    window.seal(1.0)
    text = exposition(Snapshot(FrameRuntime(window, []), TickStats())).decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "gpuvigil_build_info" in names
    assert ("gpuvigil_gpu_last_xid" in names) == (n > 0)
