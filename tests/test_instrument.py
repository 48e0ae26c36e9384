"""The in-process hook (gpuvigil.hook.instrument) and its collector (gpuvigil.collectors.hook): real
files tailed, a real HTTP receiver on 127.0.0.1, and real gloo ranks whose hung collective shows
in the published pg_status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuvigil.hook.instrument as gv
from gpuvigil import schemas
from gpuvigil.collectors.base import Collector
from gpuvigil.collectors.hook import HookCollector, HookReceiver, rows_from_record

HERE = Path(__file__).parent


class FakeClock:
    """A settable clock, so that step times are exact (the hook takes `clock` for this)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(hook: gv.Hook, clock: FakeClock, n: int, seconds: float) -> None:
    for _ in range(n):
        clock.now += seconds
        hook.step()


def test_file_sink_publishes_once_per_interval_and_the_collector_tails_it(tmp_path):
    clock = FakeClock()
    hook = gv.Hook("job-1", gv.FileSink(tmp_path), rank=3, node="n7", gpu=2, interval=1.0, clock=clock)
    collector = HookCollector([tmp_path])
    assert isinstance(collector, Collector)
    run_steps(hook, clock, 20, 0.125)  # 2.5 s of 125 ms steps (exact in binary): 2 publishes
    assert hook.published == 2
    out = collector.collect(0.0)
    progress = out["rank_progress"]
    assert progress.schema == schemas.RANK_PROGRESS
    assert progress.select("job", "rank", "node", "gpu", "step").rows() == [("job-1", 3, "n7", 2, 8), ("job-1", 3, "n7", 2, 16)]
    assert progress["step_time_seconds"].to_list() == [0.125, 0.125]
    # Nothing new, nothing emitted; the next publish appears on the next collect.
    assert collector.collect(0.0) == {}
    run_steps(hook, clock, 10, 0.25)
    later = collector.collect(0.0)["rank_progress"]
    assert later["step"].to_list() == [22, 26, 30] and later["step_time_seconds"].to_list() == [0.25] * 3
    hook.stop()
    assert (tmp_path / "job-1.rank3.jsonl").exists()


def test_record_fields():
    clock = FakeClock()
    records = []

    class ListSink:
        def write(self, record):
            records.append(record)

        def close(self):
            pass

    hook = gv.Hook("j", ListSink(), rank=0, node="n", gpu=0, interval=1.0, clock=clock)
    run_steps(hook, clock, 8, 0.125)
    [record] = records
    assert record["v"] == 1 and record["job"] == "j" and record["step"] == 8
    assert record["steps_in_interval"] == 7 and record["mean_step_time_seconds"] == 0.125
    json.dumps(record)  # plain JSON


def test_a_failing_sink_never_raises_into_the_training_loop():
    class BrokenSink:
        def write(self, record):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    clock = FakeClock()
    hook = gv.Hook("j", BrokenSink(), rank=0, interval=1.0, clock=clock)
    run_steps(hook, clock, 20, 0.125)
    assert hook.errors == 2 and "No space left" in hook.last_error


def test_http_sink_to_a_real_receiver_on_loopback():
    collector = HookCollector()
    with HookReceiver(collector) as receiver:
        assert receiver.url.startswith("http://127.0.0.1:")
        sink = gv.HttpSink(receiver.url)
        clock = FakeClock()
        hook = gv.Hook("job-http", sink, rank=1, node="n1", gpu=1, interval=1.0, clock=clock)
        run_steps(hook, clock, 21, 0.125)
        assert sink.flush() and sink.sent == 2 and sink.failed == 0
        hook.stop()
        assert sink.sent == 3
    progress = collector.collect(0.0)["rank_progress"]
    assert progress["job"].to_list() == ["job-http"] * 3 and progress["step"].to_list() == [8, 16, 21]


def test_http_sink_with_the_collector_down_counts_failures_and_keeps_going():
    sink = gv.HttpSink("http://127.0.0.1:9/v1/hook", timeout=0.5)  # discard port: nothing listens
    clock = FakeClock()
    hook = gv.Hook("j", sink, rank=0, interval=1.0, clock=clock)
    run_steps(hook, clock, 21, 0.125)
    assert sink.flush(10)
    hook.stop()
    assert sink.sent == 0 and sink.failed == 3 and hook.errors == 0


def test_receiver_rejects_bad_bodies():
    import urllib.error
    import urllib.request

    collector = HookCollector()
    with HookReceiver(collector) as receiver:
        for body, code in ((b"not json", 400), (b"", 411)):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(urllib.request.Request(receiver.url, data=body, method="POST"), timeout=5)
            assert info.value.code == code
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(receiver.url.replace("/v1/hook", "/x"), data=b"{}", method="POST"), timeout=5)
        assert info.value.code == 404
    assert collector.errors == 1


def test_memory_record_becomes_allocator_stats():
    record = {
        "ts": 5.0, "job": "j", "rank": 0, "node": "n", "gpu": 0, "step": 7, "step_time_seconds": 0.1,
        "memory": {"allocated_bytes.all.current": 100, "allocated_bytes.all.peak": 150, "reserved_bytes.all.current": 300,
                   "inactive_split_bytes.all.current": 50, "num_alloc_retries": 2, "num_ooms": 1,
                   "device_free_bytes": 1000, "device_total_bytes": 2000},
        "pg_status": {"0": {"last_enqueued": 6, "last_completed": 5, "current_op": "all_reduce"}, "1": {"last_enqueued": 2, "last_completed": 2}},
    }
    progress, allocator = rows_from_record(record)
    assert [(r["pg"], r["last_enqueued_seq"], r["last_completed_seq"], r["current_op"]) for r in progress] == [("0", 6, 5, "all_reduce"), ("1", 2, 2, None)]
    [row] = allocator
    assert (row["allocated_bytes"], row["reserved_bytes"], row["peak_allocated_bytes"], row["alloc_retries"], row["oom_count"]) == (100, 300, 150, 2, 1)
    assert row["device_capacity_bytes"] == 2000 and row["foreign_used_bytes"] == 700  # 2000 − 1000 free − 300 reserved
    assert schemas.frame(allocator, schemas.ALLOCATOR_STATS).height == 1


def test_last_started_collective_reaches_rank_progress():
    """The hook publishes the Flight Recorder's last started collective per process group (-1:
    none started yet, as the dumps say it, e.g. the real H200 dumps in
    tests/test_instrument_stdlib.py, taken without timing; null where the hook knows starts are
    not recorded: tests/test_instrument_timing.py); the hang detector reads it to name a rank
    stuck in a kernel before the pending collective. Anything but an integer is dropped to null."""
    record = {
        "ts": 5.0, "job": "j", "rank": 3, "step": 7,
        "pg_status": {"0": {"last_enqueued": 12, "last_started": 11, "last_completed": 11}, "1": {"last_enqueued": 2, "last_started": -1, "last_completed": 2},
                      "2": {"last_enqueued": 2, "last_started": "x", "last_completed": 2}},
    }
    progress, _ = rows_from_record(record)
    assert [r["last_started_seq"] for r in progress] == [11, -1, None]
    frame = schemas.frame(progress, schemas.RANK_PROGRESS)
    assert frame["last_started_seq"].to_list() == [11, -1, None] and frame.schema["last_started_seq"] == pl.Int64


def test_tailing_handles_partial_lines_garbage_and_truncation(tmp_path):
    path = tmp_path / "j.rank0.jsonl"
    good = json.dumps({"ts": 1.0, "rank": 0, "job": "j", "step": 1})
    path.write_text(good + "\n" + "garbage\n" + '{"ts": "x", "rank": 0}\n' + good[:10])
    collector = HookCollector([tmp_path])
    assert collector.collect(0.0)["rank_progress"].height == 1
    assert collector.errors == 2
    with path.open("a") as fh:
        fh.write(good[10:] + "\n")
    assert collector.collect(0.0)["rank_progress"].height == 1  # the partial line, completed
    path.write_text(good + "\n")  # truncated and rewritten (log rotation)
    assert collector.collect(0.0)["rank_progress"].height == 1
    assert collector.errors == 2


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_random_bytes_in_the_tailed_files_never_raise(tmp_path, chunks):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"")
    collector = HookCollector([path])
    for chunk in chunks:
        with path.open("ab") as fh:
            fh.write(chunk)
        collector.collect(0.0)


def test_the_package_does_not_need_torch(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # make `import torch` fail, as where it is not installed
        "import gpuvigil.hook.instrument as gv\n"
        f"h = gv.start(job='j', sink={str(tmp_path)!r}, rank=0, interval=0.01)\n"
        "import time\n"
        "for _ in range(5): time.sleep(0.01); h.step()\n"
        "h.stop(); assert h.errors == 0, h.last_error; print(h.published)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 2
    lines = (tmp_path / "j.rank0.jsonl").read_text().splitlines()
    assert all("memory" not in json.loads(line) for line in lines)


@pytest.mark.torch
def test_real_gloo_ranks_publish_a_hung_collective(tmp_path):
    pytest.importorskip("torch", reason="torch (CPU build) is needed for real gloo ranks")
    done = subprocess.run([sys.executable, str(HERE / "hook_workers.py"), str(tmp_path)], capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    progress = HookCollector([tmp_path / "hook"]).collect(0.0)["rank_progress"]
    last = {r: progress.filter(progress["rank"] == r).row(-1, named=True) for r in (0, 1)}
    # Rank 0 enqueued collective #6 (5 training all_reduces before it) and it never completed:
    assert (last[0]["last_enqueued_seq"], last[0]["last_completed_seq"], last[0]["current_op"]) == (6, 5, "all_reduce")
    # ... because rank 1 never called it.
    assert (last[1]["last_enqueued_seq"], last[1]["last_completed_seq"], last[1]["current_op"]) == (5, 5, None)
    assert last[0]["step"] == last[1]["step"] == 5 and last[0]["node"] == "node0" and last[1]["gpu"] == 1


def test_benchmark_pieces_and_its_report(tmp_path):
    from benchmarks import hook as bench

    step_ns = bench.bench_step_calls(2000, batches=4) * 1e9
    publish = bench.bench_publish(10)
    e2e = bench.bench_end_to_end(3, step_body=lambda: bench._spin(0.001))
    assert step_ns > 0 and 0 < publish["p50_us"] <= publish["p99_us"] and e2e["steps"] == 3 and e2e["without_s"] >= 0.003
    res = {"python": "3", "torch": None, "step_call_ns": step_ns, "publish_no_torch": publish, "end_to_end": e2e,
           "modelled_overhead_pct_p50": 0.01, "modelled_overhead_pct_p99": 0.1}
    text = bench.markdown(res)
    assert "`step()`" in text and "publish()` without torch" in text and "0.0100%" in text
    from benchmarks.report import write_section

    doc = write_section("hook", text, doc=tmp_path / "benchmarks.md")
    assert "<!-- bench:hook:start -->" in doc.read_text()


def test_an_unwritable_folder_does_not_stop_training(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the sink's folder should be")
    clock = FakeClock()
    hook = gv.Hook("j", gv.FileSink(blocker / "hook"), rank=0, interval=1.0, clock=clock)
    run_steps(hook, clock, 16, 0.125)
    assert hook.published == 0 and hook.errors == 3 and "NotADirectoryError" in hook.last_error
