"""OOM classifier (gpuvigil/detectors/oom_events.py): behaviour that mutation testing (`make
mutate`, docs/testing.md) showed no other test pinned down: which events are read on the first
and later ticks, what a finding says when the job or rank is unknown, and the figures and advice
in its evidence and summary.

Sources:
- H200: the exact OOM messages of tests/data/h200/s2_oom_ramp.log (capacity) and
  s3_fragmentation.log (fragmentation), unedited;
- public: tests/data/public/oom_wordings.log line 4 (a real message with a "Process 20398 has
  14.52 GiB memory in use" clause);
- crafted: one message in the captures' wording naming another process (no capture has one).
Rows around the messages (node, GPU, job, rank, times) are constructed.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.window import Window

DATA = Path(__file__).parent / "data"
GIB = 1 << 30
MIB = 1 << 20


def _captured(name: str) -> str:
    text = (DATA / "h200" / name).read_text()
    return text.split("OOM_MESSAGE_BEGIN\n", 1)[1].split("\nOOM_MESSAGE_END", 1)[0]


CAPACITY = _captured("s2_oom_ramp.log")
FRAGMENTATION = _captured("s3_fragmentation.log")
OTHER_PROCESS = (DATA / "public" / "oom_wordings.log").read_text().splitlines()[3]

CAPACITY_ADVICE = "the job needs more memory than the GPU has: move it to a larger-memory GPU or shrink the micro-batch"
FRAGMENTATION_ADVICE = "the memory was free but in pieces: restart with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def event(ts: float, message: str | None, *, kind: str = "oom", job: str | None = "train", rank: int | None = 3, node: str = "node-7", gpu: int = 5) -> dict:
    return {"ts": ts, "node": node, "gpu": gpu, "source": "torch", "kind": kind, "job": job, "rank": rank, "message": message}


def tick(det: OomEventClassifier, w: Window, rows: list[dict], now: float) -> list:
    if rows:
        w.add("events", schemas.frame(rows, schemas.EVENTS))
    w.seal(now)
    return det.detect(w)


def test_first_tick_reports_recent_ooms_only_and_later_ticks_only_new_ones():
    """H200 messages at constructed times. On its first tick the classifier reports OOMs from the
    last `report_seconds` (600 s: a restarted collector), not older; afterwards only those that
    arrived since its previous tick, each once."""
    det = OomEventClassifier()
    w = Window(1e9)
    first = tick(det, w, [event(1000.0 - 700, CAPACITY), event(1000.0 - 599, FRAGMENTATION, rank=1)], 1000.0)
    assert [(f.kind.value, f.ts, f.ranks) for f in first] == [("oom_fragmentation", 401.0, [1])]
    # An event stamped exactly at the previous tick that arrives after it is new: reported once
    # (tests/test_oom_events_late.py has the late-arrival table).
    assert [(f.ts, f.ranks) for f in tick(det, w, [event(1000.0, CAPACITY, rank=2)], 1001.0)] == [(1000.0, [2])]
    later = tick(det, w, [event(1001.25, CAPACITY, rank=4), event(1001.5, CAPACITY, rank=5)], 1002.0)
    assert [(f.kind.value, f.ranks) for f in later] == [("oom_capacity", [4]), ("oom_capacity", [5])]
    assert tick(det, w, [], 1003.0) == []


def test_report_window_is_configuration():
    """H200 capacity message 700 s old on the first tick: reported when report_seconds is 800."""
    det = OomEventClassifier(config.load(overrides={"detectors": {"oom_events": {"report_seconds": 800.0}}}))
    [f] = tick(det, Window(1e9), [event(300.0, CAPACITY)], 1000.0)
    assert f.kind.value == "oom_capacity"


def test_only_oom_events_with_a_message_are_read():
    """An XID event carrying OOM text, and an OOM event without a message, are not classified
    (H200 capacity message)."""
    found = tick(OomEventClassifier(), Window(1e9), [event(990.0, CAPACITY, kind="xid"), event(991.0, None), event(992.0, FRAGMENTATION)], 1000.0)
    assert [(f.kind.value, f.ts) for f in found] == [("oom_fragmentation", 992.0)]


def test_capacity_finding_carries_the_message_figures_and_advice():
    """H200 s2: 4.00 GiB asked, 139.80 GiB total, 3.29 GiB free, 136.51 GiB in use by the process,
    136.00 GiB allocated, 0 bytes reserved-unallocated, no other process named."""
    [f] = tick(OomEventClassifier(), Window(1e9), [event(990.0, CAPACITY)], 1000.0)
    assert (f.kind.value, f.severity.value, f.cause, f.source, f.job, f.ranks, f.culprit_ranks, f.node, f.gpu) == (
        "oom_capacity", "page", "capacity", "oom_events", "train", [3], [3], "node-7", 5)
    ev = f.evidence
    assert ev["requested_bytes"] == 4 * GIB
    assert ev["total_bytes"] == pytest.approx(139.80 * GIB, abs=0.005 * GIB)
    assert ev["free_bytes"] == pytest.approx(3.29 * GIB, abs=0.005 * GIB)
    assert ev["process_used_bytes"] == pytest.approx(136.51 * GIB, abs=0.005 * GIB)
    assert ev["allocated_bytes"] == pytest.approx(136.00 * GIB, abs=0.005 * GIB)
    assert ev["reserved_unallocated_bytes"] == 0
    assert ev["foreign_bytes"] == 0
    assert f.summary == f"CUDA OOM in job train rank 3 on node-7 GPU 5, asking for 4.00 GiB: {CAPACITY_ADVICE}."


def test_fragmentation_finding_without_job_or_rank():
    """H200 s3 (8 GiB asked, 24 GiB reserved but unallocated) from a process no job is known for
    (a node-level log line): no ranks, and the summary says 'an unknown job'."""
    [f] = tick(OomEventClassifier(), Window(1e9), [event(990.0, FRAGMENTATION, job=None, rank=None)], 1000.0)
    assert (f.kind.value, f.cause, f.job, f.ranks, f.culprit_ranks) == ("oom_fragmentation", "fragmentation", None, [], [])
    assert f.evidence["reserved_unallocated_bytes"] == pytest.approx(24 * GIB, abs=0.005 * GIB)
    assert f.summary == f"CUDA OOM in an unknown job on node-7 GPU 5, asking for 8.00 GiB with 24.0 GiB reserved but unallocated: {FRAGMENTATION_ADVICE}."


def test_public_message_naming_its_own_process_is_not_foreign_memory():
    """public oom_wordings.log line 4: 496 MiB asked, 235.06 MiB free, 330.42 MiB cached; the
    'Process 20398 has 14.52 GiB memory in use' clause is the process itself (its 14.06 GiB
    allocated + 0.32 GiB cached): nothing held by others. Neither the free memory nor the cache
    (both smaller than the request) could have held it: capacity."""
    [f] = tick(OomEventClassifier(), Window(1e9), [event(990.0, OTHER_PROCESS, rank=0)], 1000.0)
    assert (f.kind.value, f.evidence["foreign_bytes"], f.evidence["requested_bytes"]) == ("oom_capacity", 0, 496 * MIB)
    assert f.summary == f"CUDA OOM in job train rank 0 on node-7 GPU 5, asking for 0.48 GiB with 0.3 GiB reserved but unallocated: {CAPACITY_ADVICE}."


def test_other_process_memory_is_in_the_evidence_and_summary():
    """crafted (no capture shows another process): the PyTorch 2.x wording of the H200 captures
    with a 'Process 4242 has 40.00 GiB memory in use' clause, as built in
    test_detectors_units._wording_2x: 3.20 GiB free + 0.50 GiB cached < 4 GiB asked."""
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 3.20 GiB is free. "
           "Process 4242 has 40.00 GiB memory in use. Including non-PyTorch memory, this process has 96.60 GiB memory in use. Of the allocated memory "
           "96.00 GiB is allocated by PyTorch, and 0.50 GiB is reserved by PyTorch but unallocated.")
    [f] = tick(OomEventClassifier(), Window(1e9), [event(990.0, msg)], 1000.0)
    assert (f.kind.value, f.cause) == ("oom_foreign_process", "foreign_process")
    assert f.evidence["foreign_bytes"] == 40 * GIB
    assert f.summary == (
        "CUDA OOM in job train rank 3 on node-7 GPU 5, asking for 4.00 GiB with 0.5 GiB reserved but unallocated and 40.0 GiB held by other "
        "processes: another process holds the memory: find and stop it, or requeue the job elsewhere."
    )


def test_same_tick_events_keep_their_own_rows():
    """Two ranks' H200 OOMs on one tick: each finding has its own rank, node, GPU and time."""
    rows = [event(995.0, CAPACITY, rank=0, node="a", gpu=0), event(996.0, FRAGMENTATION, rank=7, node="b", gpu=7, job="other")]
    found = tick(OomEventClassifier(), Window(1e9), rows, 1000.0)
    assert sorted((f.job, f.ranks, f.node, f.gpu, f.ts, f.kind.value) for f in found) == [
        ("other", [7], "b", 7, 996.0, "oom_fragmentation"), ("train", [0], "a", 0, 995.0, "oom_capacity")]
    assert pl.Series([f.ts for f in found]).is_unique().all()


def test_an_oom_event_without_figures_does_not_hide_the_next_one():
    """An "oom" event whose text PyTorch did not write (no figures) comes first on the tick; the
    H200 fragmentation OOM after it is still classified."""
    rows = [event(990.0, "CUDA error: something else entirely"), event(991.0, FRAGMENTATION, rank=6)]
    found = tick(OomEventClassifier(), Window(1e9), rows, 1000.0)
    assert [(f.kind.value, f.ranks) for f in found] == [("oom_fragmentation", [6])]


def test_classifier_thresholds_are_configuration():
    """The crafted 40 GiB-other-process message of the test above: with `oom_classify.
    foreign_min_bytes` raised to 50 GiB the other process is noise, and 4 GiB asked against 3.2
    free + 0.5 cached is capacity."""
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 3.20 GiB is free. "
           "Process 4242 has 40.00 GiB memory in use. Including non-PyTorch memory, this process has 96.60 GiB memory in use. Of the allocated memory "
           "96.00 GiB is allocated by PyTorch, and 0.50 GiB is reserved by PyTorch but unallocated.")
    det = OomEventClassifier(config.load(overrides={"oom_classify": {"foreign_min_bytes": 50 * GIB}}))
    [f] = tick(det, Window(1e9), [event(990.0, msg)], 1000.0)
    assert (f.kind.value, f.cause) == ("oom_capacity", "capacity")
