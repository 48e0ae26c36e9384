"""L1 Flight Recorder without code change: the dump-folder watcher, the debug-info pipe writer and
the `hang_fr` detector.

Real components: the dumps are torch's own (gloo ranks, `_dump_fr_trace()`), a real FIFO stands
for a rank's debug-info pipe. What torch 2.13's CPU build does NOT do, checked here in
`test_cpu_torch_has_no_nccl_dump_switches`: `TORCH_NCCL_DUMP_ON_TIMEOUT` and
`TORCH_NCCL_DEBUG_INFO_PIPE_FILE` live in ProcessGroupNCCL only, so with gloo nothing dumps on a
timeout and nobody reads the pipe. The gloo test therefore has each rank write its dump the way
the NCCL watchdog does on a timeout (`<prefix><rank>`, after its collective timed out); the
watcher and the analysis are the real ones. On NCCL (no GPU in this session) the same files come
from torch itself: untested here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.collectors.fr_dumps import FrDumpTrigger, FrDumpWatcher, FrRequests, pipe_writer
from gpuvigil.detectors.hang_fr import FlightRecorderHangDetector
from gpuvigil.sim.device import write_fr_dumps
from levels_helpers import allocations, window


def _analyse(tmp_path: Path, n: int, completed: int, entered, started, drop=()):
    write_fr_dumps(tmp_path, "job-1", n, completed, np.array(entered), np.array(started), now=100.0)
    for r in drop:
        (tmp_path / "job-1" / f"fr_dump_{r}").unlink()
    w = FrDumpWatcher(tmp_path)
    out = w.collect(1.0) or w.collect(5.0)  # an incomplete set is analysed once it stops changing
    return out["fr_analysis"].row(0, named=True)


def test_rank_that_never_entered_is_the_culprit(tmp_path):
    row = _analyse(tmp_path, 4, 41, [1, 1, 0, 1], [1, 1, 0, 1])
    assert row["kind"] == "collective_hang" and row["culprit_ranks"] == [2]
    assert row["seq"] == 42 and row["op"] == "all_reduce" and row["trigger"] == "timeout"


def test_rank_stuck_in_a_compute_kernel_has_its_collective_only_scheduled(tmp_path):
    row = _analyse(tmp_path, 4, 41, [1, 1, 1, 1], [1, 0, 1, 1])
    assert row["culprit_ranks"] == [1]


def test_dead_rank_writes_no_dump_and_is_the_culprit(tmp_path):
    row = _analyse(tmp_path, 4, 41, [1, 1, 1, 1], [1, 1, 1, 1], drop=[3])
    assert row["culprit_ranks"] == [3]


def test_incomplete_set_waits_for_the_missing_ranks(tmp_path):
    write_fr_dumps(tmp_path, "job-1", 4, 41, np.array([1, 1, 0, 1]), np.array([1, 1, 0, 1]), now=100.0)
    (tmp_path / "job-1" / "fr_dump_3").rename(tmp_path / "later")
    w = FrDumpWatcher(tmp_path)
    assert "fr_analysis" not in w.collect(1.0)  # 3 of 4 dumps: a rank is still writing
    (tmp_path / "later").rename(tmp_path / "job-1" / "fr_dump_3")
    out = w.collect(2.0)
    assert out["fr_analysis"]["culprit_ranks"].to_list() == [[2]]
    assert "fr_analysis" not in w.collect(3.0)  # analysed once


def test_pipe_writer_reaches_a_reader_and_skips_a_pipe_nobody_reads(tmp_path):
    folder = tmp_path / "job-9"
    folder.mkdir()
    read_pipe, dead_pipe = folder / "fr_pipe_0.pipe", folder / "fr_pipe_1.pipe"
    os.mkfifo(read_pipe)
    os.mkfifo(dead_pipe)
    got: list[bytes] = []

    def reader() -> None:  # what torch's watchdog thread does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE
        fd = os.open(read_pipe, os.O_RDONLY | os.O_NONBLOCK)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            try:
                data = os.read(fd, 16)
            except BlockingIOError:
                data = b""
            if data:
                got.append(data)
            time.sleep(0.01)
        os.close(fd)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)  # the reader has the FIFO open
    assert pipe_writer(tmp_path)("job-9") is True
    t.join()
    assert got and got[0].startswith(b"1")
    # The watcher lists both pipes: the job can be asked for dumps (L1).
    pipes = FrDumpWatcher(tmp_path).collect(5.0)["fr_pipes"]
    assert sorted(pipes["rank"].to_list()) == [0, 1] and set(pipes["job"]) == {"job-9"}


def test_trigger_asks_for_dumps_when_inspector_progress_stops_and_rate_limits():
    asked: list[tuple[float, str]] = []
    now_box = [0.0]
    trig = FrDumpTrigger(lambda job: asked.append((now_box[0], job)) or True, FrRequests(), min_interval_seconds=5.0, stall_seconds=3.0)

    class R:
        new_findings: list = []
        suppressed_findings: list = []

    w = window()
    for t in range(1, 21):
        now_box[0] = float(t)
        sn = min(t, 8) * 10  # completes 10 collectives a second, then stops at t=8
        w.add("collective_progress", schemas.frame([{"ts": float(t), "job": "j", "rank": r, "coll_sn": sn} for r in range(4)], schemas.COLLECTIVE_PROGRESS))
        w.seal(float(t))
        R.now = float(t)
        trig.on_tick(R, w)
    assert [t for t, _ in asked] == [11.0, 16.0]


def _analysis_row(ts, trigger="on_demand", culprits=(2,), seq=42):
    return schemas.frame(
        [{"ts": ts, "job": "j", "trigger": trigger, "kind": "collective_hang", "culprit_ranks": list(culprits), "ranks": [0, 1, 2, 3], "pg": "0", "seq": seq, "op": "all_reduce", "summary": "s", "dump_ts": ts, "n_dumps": 4}],
        schemas.FR_ANALYSIS,
    )


def test_one_snapshot_is_not_a_hang_two_are():
    det = FlightRecorderHangDetector()
    w = window()
    w.add("allocations", allocations("j", [("n0", g) for g in range(4)]))
    w.add("fr_analysis", _analysis_row(10.0))
    w.seal(10.0)
    assert det.detect(w) == []  # in-flight skew looks like this too
    w.add("fr_analysis", _analysis_row(16.0))
    w.seal(16.0)
    [f] = det.detect(w)
    assert f.culprit_ranks == [2] and f.evidence["pending_seq"] == 42 and f.evidence["level"] == "L1" and f.gpu == 2


def test_a_watchdog_dump_is_a_hang_at_once():
    det = FlightRecorderHangDetector()
    w = window()
    w.add("fr_analysis", _analysis_row(10.0, trigger="timeout"))
    w.seal(10.0)
    [f] = det.detect(w)
    assert f.evidence["confirmed_by"] == "watchdog timeout dump"


def test_cpu_torch_has_no_nccl_dump_switches():
    """Why the gloo test writes the timeout dumps itself: the CPU build carries the Flight
    Recorder (and TORCH_FR_DUMP_TEMP_FILE) but not ProcessGroupNCCL's dump-on-timeout or pipe."""
    torch = pytest.importorskip("torch")
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not lib.exists() or torch.cuda.is_available():
        pytest.skip("not the CPU build")
    data = lib.read_bytes()
    assert b"TORCH_FR_DUMP_TEMP_FILE" in data
    assert b"TORCH_NCCL_DUMP_ON_TIMEOUT" not in data and b"TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in data


@pytest.mark.torch
def test_gloo_hang_dumps_are_analysed_the_moment_the_set_is_complete(tmp_path):
    """4 real gloo ranks; rank 1 skips collective #5; the others time out in it and dump (as the
    NCCL watchdog does), then rank 1 dumps. The watcher runs meanwhile, as in `serve`."""
    pytest.importorskip("torch", reason="torch (CPU build) is needed for real gloo ranks")
    import fr_workers

    job_dir = tmp_path / "job-7"
    job_dir.mkdir()
    err: list[BaseException] = []

    def world() -> None:
        try:
            fr_workers.run_world(job_dir, 4, "missing", [1], hang_seconds=1.0)
        except BaseException as exc:  # reported below
            err.append(exc)

    t = threading.Thread(target=world)
    t.start()
    watcher = FrDumpWatcher(tmp_path)
    rows: list[dict] = []
    seen_dumps_when_analysed = None
    deadline = time.monotonic() + 240
    while not rows and time.monotonic() < deadline:
        out = watcher.collect(time.time())
        if "fr_analysis" in out:
            rows = out["fr_analysis"].rows(named=True)
            seen_dumps_when_analysed = len(list(job_dir.glob("fr_rank_*")))
        time.sleep(0.1)
    t.join(timeout=240)
    assert not err, err
    assert rows, "the dumps were never analysed"
    [row] = rows
    assert seen_dumps_when_analysed == 4
    assert row["job"] == "job-7" and row["trigger"] == "timeout" and row["n_dumps"] == 4
    assert row["kind"] == "collective_hang" and row["culprit_ranks"] == [1] and row["seq"] == 5 and row["op"] == "all_reduce"
    # ... and the L1 detector pages with the exact culprit.
    w = window()
    w.add("fr_analysis", pl.DataFrame([row], schema=schemas.FR_ANALYSIS))
    w.seal(row["ts"])
    [f] = FlightRecorderHangDetector().detect(w)
    assert f.culprit_ranks == [1] and f.evidence["pending_seq"] == 5 and f.evidence["level"] == "L1"
