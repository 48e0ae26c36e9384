"""PyTorch / NCCL log parsing on the real H200 captures and on real lines from public threads."""

from __future__ import annotations

import pytest
from h_logs_helpers import H200, PUBLIC, REFERENCE_TS, check_golden, findings_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.collectors import nccl_log
from gpuvigil.offline.analyze import training_log_findings
from gpuvigil.config import ConfigError
from gpuvigil.model import FindingKind, Severity
from gpuvigil.parsers.nccl import parse_progress, parse_timeout

GIB = 1 << 30
MIB = 1 << 20


def analyze(path, **kw):
    return training_log_findings(path.read_text(), source_file=path.name, reference_ts=REFERENCE_TS, **kw)


# --- must-pass: the real H200 artefacts -------------------------------------------------------


def test_real_capacity_oom_is_oom_capacity():
    (f,) = analyze(H200 / "s2_oom_ramp.log")
    assert f.kind == FindingKind.OOM_CAPACITY and f.severity == Severity.PAGE and f.cause == "capacity"
    ev = f.evidence
    assert ev["requested_bytes"] == 4 * GIB
    assert ev["reserved_unallocated_bytes"] == 0
    assert ev["total_bytes"] == pytest.approx(139.80 * GIB, rel=1e-4)
    assert ev["free_bytes"] == pytest.approx(3.29 * GIB, rel=1e-3)
    assert ev["process_used_bytes"] == pytest.approx(136.51 * GIB, rel=1e-4)
    assert ev["allocated_bytes"] == 136 * GIB
    assert ev["foreign_bytes"] < GIB // 10
    assert f.gpu == 0 and f.source == "s2_oom_ramp.log:2"


def test_real_fragmentation_oom_is_oom_fragmentation():
    (f,) = analyze(H200 / "s3_fragmentation.log")
    assert f.kind == FindingKind.OOM_FRAGMENTATION and f.cause == "fragmentation"
    assert f.evidence["requested_bytes"] == 8 * GIB
    assert f.evidence["reserved_unallocated_bytes"] == 24 * GIB
    assert f.evidence["free_bytes"] == 2 * GIB


def test_expandable_segments_run_has_no_oom():
    assert analyze(H200 / "s4_fragmentation_expandable.log") == []


def test_real_watchdog_timeout():
    (f,) = analyze(H200 / "s6_nccl_watchdog_timeout.log")
    assert f.kind == FindingKind.NCCL_TIMEOUT and f.severity == Severity.PAGE
    ev = f.evidence
    assert (ev["seq"], ev["op"], ev["numel_in"], ev["numel_out"]) == (6, "ALLREDUCE", 1048576, 1048576)
    assert (ev["timeout_ms"], ev["ran_for_ms"]) == (8000, 8031)
    assert (ev["last_enqueued"], ev["last_completed"]) == (6, 5)
    assert ev["reporting_ranks"] == [0] and ev["pg"] == "0(default_pg)"
    assert f.ranks == [0] and f.culprit_ranks == []
    assert f.source == "s6_nccl_watchdog_timeout.log:15"
    # glog "[E1129 23:07:34.447300897 ...]": no year in the line, taken from the reference time
    assert f.ts == pytest.approx(1795993654.4473, abs=1e-3)


def test_real_nccl_warn_lines():
    parsed = nccl_log.parse_lines((H200 / "s7_nccl_two_ranks.log").read_text().splitlines(), reference_ts=REFERENCE_TS)
    assert [(w.host, w.pid, w.device, w.network) for w in parsed.warnings] == [("vm", 680, 0, False), ("vm", 679, 0, False)]
    assert parsed.warnings[0].message == "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60"
    ev = nccl_log.events(parsed)
    # the DistBackendError that followed them is an event of its own, after them
    assert ev.schema == schemas.EVENTS and ev["kind"].to_list() == ["nccl_warn", "nccl_warn", "nccl_error"] and ev["node"].to_list() == ["vm", "vm", None]


def test_nccl_info_log_has_no_findings():
    assert analyze(H200 / "s5_nccl_flight_recorder.log") == []


# --- other wordings, real lines from public issue threads -------------------------------------


@pytest.mark.parametrize(
    ("name", "seq", "op", "ranks", "enq", "done", "pg", "timeout_ms"),
    [
        ("nccl_watchdog.log", 1580, "ALLREDUCE", [0, 3, 4], 1582, 1579, "1", 600000),
        ("nccl_watchdog_reduce_scatter.log", 7753, "_REDUCE_SCATTER_BASE", [0, 4], 7755, 7752, "1", 600000),
        ("nccl_watchdog_pg_id.log", 808, "ALLREDUCE", [0, 1, 2], 811, 807, "0(default_pg)", 600000),
        ("nccl_watchdog_coalesced.log", 610, "COALESCED", [4], 616, 609, "2", 600000),
        ("nccl_watchdog_old.log", 469508, "ALLREDUCE", [1, 2, 3], None, None, None, 1800000),
    ],
)
def test_public_watchdog_wordings(name, seq, op, ranks, enq, done, pg, timeout_ms):
    (f,) = analyze(PUBLIC / name)
    ev = f.evidence
    assert (ev["seq"], ev["op"], f.ranks, ev.get("last_enqueued"), ev.get("last_completed"), ev.get("pg"), ev["timeout_ms"]) == (
        seq,
        op,
        ranks,
        enq,
        done,
        pg,
        timeout_ms,
    )
    check_golden(f"{PUBLIC.joinpath(name).stem}.json", findings_json([f]))


def test_some_operations_failed_without_workncl_details_still_pages():
    line = "[rank4]:[E318 07:39:53.792790830 ProcessGroupNCCL.cpp:630] [Rank 4] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data."
    (f,) = training_log_findings(line, reference_ts=REFERENCE_TS)
    assert f.kind == FindingKind.NCCL_TIMEOUT and f.ranks == [4]


def test_rank_that_did_not_enqueue_is_the_culprit():
    lines = [
        "[rank0]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600061 milliseconds before timing out.",
        "[rank0]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 12, last enqueued NCCL work: 12, last completed NCCL work: 11.",
        "[rank1]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600070 milliseconds before timing out.",
        "[rank1]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 1] Exception (either an error or timeout) detected by watchdog at work: 12, last enqueued NCCL work: 11, last completed NCCL work: 11.",
    ]
    (f,) = training_log_findings("\n".join(lines), reference_ts=REFERENCE_TS)
    assert f.ranks == [0, 1] and f.culprit_ranks == [1]
    assert [r["last_enqueued"] for r in f.evidence["per_rank"]] == [12, 11]


def test_repeated_timeout_messages_are_one_finding():
    line = "[rank0]:[E1129 23:07:34.447300897 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=8000) ran for 8031 milliseconds before timing out."
    what = "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=8000) ran for 8031 milliseconds before timing out."
    found = training_log_findings("\n".join([line, line, what]), reference_ts=REFERENCE_TS)
    assert len(found) == 1 and found[0].ranks == [0]


def test_network_warnings_are_attached_to_the_timeout():
    text = (PUBLIC / "nccl_warn_network.log").read_text() + (H200 / "s6_nccl_watchdog_timeout.log").read_text()
    parsed = nccl_log.parse_lines(text.splitlines(), reference_ts=REFERENCE_TS)
    assert [w.network for w in parsed.warnings] == [True, True, True, True, True]
    assert [w.host for w in parsed.warnings] == ["kp-ddp-worker-0", "ubuntu", "ubuntu", "a100-st-p4d24xlarge-22", "a100-st-p4d24xlarge-22"]
    (f,) = training_log_findings(parsed)
    assert f.cause == "network" and f.evidence["network_warnings"] == 5
    assert f.evidence["first_network_warning"].startswith("NET/IB : Got completion from peer 10.216.210.236<54862> with status=12")


@pytest.mark.parametrize(
    ("line_no", "kind", "wording", "requested", "unallocated"),
    [
        # free >= request + the driver's headroom: the figures do not explain the OOM (say so, do not guess)
        (1, FindingKind.OOM_UNEXPLAINED, "old", 50 * MIB, round(18.22 * MIB)),
        (2, FindingKind.OOM_UNEXPLAINED, "old", round(2.26 * GIB), round(1.24 * GIB) - round(781.59 * MIB)),
        # 41.56 MiB free for 32 MiB: within the driver's headroom, the 4 GiB device is full
        (3, FindingKind.OOM_CAPACITY, "capacty", 32 * MIB, round(1.90 * MIB)),
        # "Process 20398 has 14.52 GiB" covers PyTorch's 14.39 GiB: it is this process (container);
        # 235 MiB free and 330 MiB cached in pieces: neither could hold 496 MiB -> capacity
        (4, FindingKind.OOM_CAPACITY, "capacty", 496 * MIB, round(330.42 * MIB)),
        (5, FindingKind.OOM_FRAGMENTATION, "capacty", round(1.70 * GIB), round(2.30 * GIB)),
        (6, FindingKind.OOM_FRAGMENTATION, "new", 226 * MIB, round(336.73 * MIB)),
        (7, FindingKind.OOM_FRAGMENTATION, "capacty", 3 * GIB, round(4.84 * GIB)),
    ],
)
def test_public_oom_wordings(line_no, kind, wording, requested, unallocated):
    line = (PUBLIC / "oom_wordings.log").read_text().splitlines()[line_no - 1]
    (f,) = training_log_findings(line, reference_ts=REFERENCE_TS)
    assert (f.kind, f.evidence["wording"], f.evidence["requested_bytes"], f.evidence["reserved_unallocated_bytes"]) == (kind, wording, requested, unallocated)


def test_process_list_splits_ours_from_others():
    line = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.00 GiB is free. "
        "Process 4242 has 30.00 GiB memory in use. Process 777 has 48.10 GiB memory in use. Of the allocated memory 45.00 GiB is allocated by PyTorch, "
        "and 2.50 GiB is reserved by PyTorch but unallocated."
    )
    (f,) = training_log_findings(line, reference_ts=REFERENCE_TS)
    # 2.5 GiB cached >= 2 GiB asked: PyTorch's own cache had the room, whatever else is there
    assert f.kind == FindingKind.OOM_FRAGMENTATION
    assert f.evidence["process_used_bytes"] == round(48.10 * GIB)
    assert f.evidence["other_processes"] == [{"pid": 4242, "bytes": 30 * GIB}]
    assert f.evidence["foreign_bytes"] == 30 * GIB


def test_this_process_line_with_another_process():
    line = (
        "CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 3.29 GiB is free. "
        "Process 1234 has 40.00 GiB memory in use. Including non-PyTorch memory, this process has 96.51 GiB memory in use. "
        "Of the allocated memory 96.00 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
    )
    (f,) = training_log_findings(f"[rank3]:{line}", reference_ts=REFERENCE_TS)
    assert f.kind == FindingKind.OOM_FOREIGN_PROCESS and f.ranks == [3]
    assert f.evidence["foreign_bytes"] == 40 * GIB and f.evidence["process_used_bytes"] == round(96.51 * GIB)


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        ({}, FindingKind.OOM_FOREIGN_PROCESS),
        # 40 GiB held by another process counts only above foreign_min_bytes
        ({"foreign_min_bytes": 50 * GIB}, FindingKind.OOM_CAPACITY),
    ],
)
def test_oom_thresholds_are_config(overrides, kind):
    line = (
        "CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 3.29 GiB is free. "
        "Process 1234 has 40.00 GiB memory in use. Including non-PyTorch memory, this process has 96.51 GiB memory in use. "
        "Of the allocated memory 96.00 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
    )
    (f,) = training_log_findings(line, reference_ts=REFERENCE_TS, cfg={"oom_classify": overrides})
    assert f.kind == kind


def test_bad_oom_config_is_rejected():
    with pytest.raises(ConfigError):
        nccl_log.load_oom_config({"oom_classify": {"foreign_min_bytes": -1}})


def test_duplicate_oom_messages_are_counted_once():
    line = (H200 / "s2_oom_ramp.log").read_text().splitlines()[1]
    (f,) = training_log_findings("\n".join([line, "Traceback (most recent call last):", line]), reference_ts=REFERENCE_TS)
    assert f.evidence["occurrences"] == 2


def test_collector_tails_a_training_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("")
    col = nccl_log.NcclLogCollector(log, node="n1", job="j1")
    assert col.collect(0.0) == {}
    log.write_text((H200 / "s6_nccl_watchdog_timeout.log").read_text() + (H200 / "s2_oom_ramp.log").read_text())
    ev = col.collect(1.0)["events"]
    assert ev.schema == schemas.EVENTS
    assert sorted(ev["kind"].to_list()) == ["nccl_progress", "nccl_progress", "nccl_timeout", "oom"]
    assert set(ev["job"].to_list()) == {"j1"}


H200_LINES = [l for n in ("s2_oom_ramp.log", "s3_fragmentation.log", "s6_nccl_watchdog_timeout.log", "s7_nccl_two_ranks.log") for l in (H200 / n).read_text().splitlines()]
PUBLIC_LINES = [l for p in sorted(PUBLIC.glob("*.log")) if not p.name.startswith("kernel_") for l in p.read_text().splitlines()]
REAL_LINES = [l for l in H200_LINES + PUBLIC_LINES if l.strip()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=400), max_size=30))
def test_random_text_never_crashes(lines):
    parsed = nccl_log.parse_lines(lines, reference_ts=REFERENCE_TS)
    training_log_findings(parsed)
    nccl_log.events(parsed)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(REAL_LINES) - 1), st.integers(0, 600), st.text(max_size=60))
def test_truncated_and_mangled_real_lines_never_crash(i, cut, junk):
    parsed = nccl_log.parse_lines([REAL_LINES[i][:cut] + junk, REAL_LINES[i]], reference_ts=REFERENCE_TS)
    training_log_findings(parsed)
    nccl_log.events(parsed)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="CUDA out of memory. Tried to allocate 0123456789.GiBMbytes(;) GPU has a total capacty", max_size=600))
def test_oom_lookalike_noise_never_crashes(text):
    training_log_findings(nccl_log.parse_lines([text], reference_ts=REFERENCE_TS))


def test_pathological_line_is_fast_enough_to_finish():
    # A huge line of near-matches must not hang the regexes (no catastrophic backtracking).
    line = "Watchdog caught collective operation timeout: WorkNCCL(" + "a=(" * 5000 + " ran for x"
    nccl_log.parse_lines([line, "CUDA out of memory. Tried to allocate " + "1" * 100000], reference_ts=REFERENCE_TS)


def test_nccl_warn_with_an_embedded_newline_is_still_a_warning():
    """Found by hypothesis: a mangled WARN line once crashed the parser."""
    parsed = nccl_log.parse_lines(["ubuntu:39964:40075 [0] misc/socket.cc:483 NCCL WARN s\n0"], reference_ts=REFERENCE_TS)
    assert [w.message for w in parsed.warnings] == ["s\n0"]


_PG = st.one_of(st.none(), st.integers(0, 99).map(str), st.tuples(st.integers(0, 99), st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)).map(lambda t: f"{t[0]}({t[1]})"))
_N = st.one_of(st.none(), st.integers(0, 10**12))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 4095)), _PG, _N, st.from_regex(r"[A-Z_]{1,24}", fullmatch=True), _N, _N, _N, st.integers(0, 10**9))
def test_a_timeout_event_message_reads_back_whole(rank, pg, seq, op, numel_in, numel_out, timeout_ms, ran_for_ms):
    """The `events` stream carries a timeout as its message: the detector must read back every
    WorkNCCL field, the rank and the process group the log had."""
    fields = ", ".join(f"{k}={v}" for k, v in (("SeqNum", seq), ("OpType", op), ("NumelIn", numel_in), ("NumelOut", numel_out), ("Timeout(ms)", timeout_ms)) if v is not None)
    text = f"Watchdog caught collective operation timeout: WorkNCCL({fields}) ran for {ran_for_ms} milliseconds before timing out."
    t = nccl_log.WatchdogTimeout(1, 0.0, rank, pg if rank is not None else None, seq, op, numel_in, numel_out, timeout_ms, ran_for_ms, text)
    back = parse_timeout(t.message())
    assert back is not None and (back.rank, back.pg, back.seq, back.op_type, back.numel_in, back.numel_out, back.timeout_ms, back.ran_for_ms) == (
        t.rank, t.pg, seq, op, numel_in, numel_out, timeout_ms, ran_for_ms)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 4095)), _PG, st.one_of(st.none(), st.integers(-1, 10**9)), st.integers(-1, 10**9), st.integers(-1, 10**9))
def test_a_progress_event_message_reads_back_whole(rank, pg, at_seq, enq, done):
    p = nccl_log.Progress(1, rank, pg if rank is not None else None, at_seq, enq, done)
    back = parse_progress(p.message())
    assert back is not None and (back.rank, back.pg, back.at_seq, back.last_enqueued, back.last_completed) == (p.rank, p.pg, at_seq, enq, done)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_event_messages_of_any_text_never_crash_the_readers(text):
    for line in (text, "Watchdog caught collective operation timeout: WorkNCCL(" + text, "last enqueued work: " + text):
        parse_timeout(line)
        parse_progress(line)
