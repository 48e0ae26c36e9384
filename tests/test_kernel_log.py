"""Kernel-log XID parsing: line formats, burst grouping, findings, file tailing, robustness.

Inputs are real kernel log lines from public GitHub threads (tests/data/public/README.md says
which) plus lines in each timestamp format the kernel/journal writes.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

import polars as pl
import pytest
from h_logs_helpers import H200, PUBLIC, REFERENCE_TS, check_golden, findings_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.collectors import kernel_log
from gpuvigil.app import compose
from gpuvigil.offline.analyze import kernel_log_findings
from gpuvigil.config import ConfigError
from gpuvigil.model import FindingKind, Severity


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "ts", "ts_kind", "node"),
    [
        (f"[12345.678901] {LINE}", 12345.678901, "since_boot", None),
        (f"[Sun Nov 29 23:07:34 2026] {LINE}", utc(2026, 11, 29, 23, 7, 34), "dmesg_t", None),
        (f"2026-11-29T23:07:34,500000+00:00 {LINE}", utc(2026, 11, 29, 23, 7, 34) + 0.5, "iso", None),
        (f"2026-11-30T00:07:34+0100 gpu-7 kernel: {LINE}", utc(2026, 11, 29, 23, 7, 34), "iso", "gpu-7"),
        (f"Nov 29 23:07:34 gpu-7 kernel: {LINE}", utc(2026, 11, 29, 23, 7, 34), "syslog", "gpu-7"),
        (f"Nov 29 23:07:34 gpu-7 kernel: [12345.678901] {LINE}", utc(2026, 11, 29, 23, 7, 34), "syslog", "gpu-7"),
        (f"Nov 29 23:07:34.250000 gpu-7.cluster.local kernel: {LINE}", utc(2026, 11, 29, 23, 7, 34) + 0.25, "syslog", "gpu-7.cluster.local"),
        # a syslog date after the reference belongs to the year before
        (f"Dec 31 23:59:59 gpu-7 kernel: {LINE}", utc(2025, 12, 31, 23, 59, 59), "syslog", "gpu-7"),
        (f"kernel: {LINE}", REFERENCE_TS, "none", None),
        (LINE, REFERENCE_TS, "none", None),
    ],
)
def test_timestamp_and_host_formats(line, ts, ts_kind, node):
    df = kernel_log.parse_lines([line], reference_ts=REFERENCE_TS)
    assert df.height == 1
    row = df.row(0, named=True)
    assert row["ts"] == pytest.approx(ts)
    assert row["ts_kind"] == ts_kind
    assert row["node"] == node
    assert (row["xid"], row["pci_bus_id"], row["pid"], row["process"]) == (79, "0000:3b:00", 1234, "python")
    assert row["message"] == "GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "code", "pci", "pid", "process", "message"),
    [
        ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
         13, "0000:cb:00", None, None, "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"),
        ("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.", 79, "0000:2b:00", None, None, "GPU has fallen off the bus."),
        ("NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007 M 00001ffc Data ffffffff", 3, "0000:01:00", None, None, "C 00000005 SC 00000007 M 00001ffc Data ffffffff"),
        ("NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000)", 149, "0019:01:00", None, None, "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000)"),
        # attributed to the XID it names as its cause; the line's own code is reported_xid
        ("NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149", 149, "0000:dc:00", 1818990, "python3", "Ch 00000001 caused by previous Xid 149"),
    ],
)
def test_xid_line_fields(line, code, pci, pid, process, message):
    row = kernel_log.parse_lines([line], reference_ts=REFERENCE_TS).row(0, named=True)
    assert (row["xid"], row["pci_bus_id"], row["pid"], row["process"], row["message"]) == (code, pci, pid, process, message)
    assert row["reported_xid"] == int(line.split("): ", 1)[1].split(",", 1)[0])


def test_lost_gpu_message_without_xid_line_is_xid_79():
    # NVIDIA/NVSentinel#155: drivers report a lost GPU this way without an Xid line
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
    ]
    (row,) = kernel_log.parse_lines(lines, reference_ts=REFERENCE_TS).to_dicts()
    assert (row["xid"], row["pci_bus_id"], row["line"]) == (79, "0000:b3:00", 1)
    # and its one-line echo right after a real Xid 79 line is the same event, not a second one
    echo = ["NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.", "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus."]
    assert kernel_log.parse_lines(echo, reference_ts=REFERENCE_TS).height == 1
    assert kernel_log.parse_lines(echo[1:], reference_ts=REFERENCE_TS)["xid"].to_list() == [79]


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae",
        "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context",
        "Xid",
        "",
    ],
)
def test_non_xid_lines_are_ignored(line):
    assert kernel_log.parse_lines([line], reference_ts=REFERENCE_TS).is_empty()


@pytest.mark.parametrize(("spelling"), ["0000:3b:00", "00000000:3B:00.0", "0000:3B:00.0", "3b:00"])
def test_pci_bus_id_maps_to_gpu_index(spelling):
    mapping = {spelling: 3} if spelling != "3b:00" else {"0000:3b:00": 3}
    row = kernel_log.parse_lines([LINE], pci_to_gpu=mapping, reference_ts=REFERENCE_TS).row(0, named=True)
    assert row["gpu"] == 3


def test_since_boot_stamps_become_wall_clock_with_boot_time():
    row = kernel_log.parse_lines([f"[100.5] {LINE}"], boot_ts=1_700_000_000.0, reference_ts=REFERENCE_TS).row(0, named=True)
    assert row["ts"] == pytest.approx(1_700_000_100.5)
    assert row["ts_kind"] == "boot_offset"


def _burst(offsets: list[float], code: int = 79) -> list[str]:
    base = utc(2026, 11, 29, 12, 0, 0)
    return [
        f"{datetime.fromtimestamp(base + o, UTC).strftime('%Y-%m-%dT%H:%M:%S')}+00:00 n1 kernel: NVRM: Xid (PCI:0000:3b:00): {code}, pid=1, name=x, m"
        for o in offsets
    ]


@pytest.mark.parametrize(
    ("offsets", "gap", "expected_counts"),
    [
        ([0, 10, 20, 30], 180, [4]),
        ([0, 170, 340, 510], 180, [4]),  # never 3 minutes of silence: one incident
        ([0, 10, 200, 210], 180, [2, 2]),
        ([0, 181], 180, [1, 1]),
        ([0, 180], 180, [2]),
        ([0, 10, 200, 210], 600, [4]),  # configurable
        ([0, 400, 800], 60, [1, 1, 1]),
    ],
)
def test_bursts_are_one_incident_until_silence(offsets, gap, expected_counts):
    inc = kernel_log.incidents(kernel_log.parse_lines(_burst(offsets), reference_ts=REFERENCE_TS), gap)
    assert inc["count"].to_list() == expected_counts
    assert inc["first_ts"].is_sorted()


def test_bursts_of_different_codes_and_gpus_are_separate():
    lines = _burst([0, 5]) + _burst([1, 6], code=48) + [l.replace("3b:00", "5d:00") for l in _burst([2])]
    inc = kernel_log.incidents(kernel_log.parse_lines(lines, reference_ts=REFERENCE_TS), 180)
    assert sorted(zip(inc["pci_bus_id"], inc["xid"], inc["count"])) == [("0000:3b:00", 48, 2), ("0000:3b:00", 79, 2), ("0000:5d:00", 79, 1)]


def test_burst_gap_comes_from_config():
    assert kernel_log.load_config().burst_gap_seconds == 180
    assert kernel_log.load_config({"kernel_log": {"burst_gap_seconds": 30}}).burst_gap_seconds == 30
    with pytest.raises(ConfigError):
        kernel_log.load_config({"kernel_log": {"burst_gap_seconds": -1}})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # (xid, severity, count, with_xids)
        ("kernel_xids.log", [(13, Severity.TICKET, 3, [109]), (109, Severity.PAGE, 1, [13])]),
        ("kernel_dbe_syslog.log", [(48, Severity.PAGE, 1, [64]), (64, Severity.PAGE, 1, [48])]),
        # "45 caused by previous Xid 149/145" on other GPUs: one node-level finding per cascade
        ("kernel_nvlink5.log", [(149, Severity.PAGE, 2, []), (145, Severity.PAGE, 2, [])]),
        ("kernel_fallen_off_bus.log", [(32, Severity.TICKET, 1, [31]), (31, Severity.TICKET, 1, [32]), (3, Severity.TICKET, 1, []), (79, Severity.PAGE, 1, [])]),
    ],
)
def test_public_kernel_logs(name, expected):
    path = PUBLIC / name
    found = kernel_log_findings(path.read_text(), source_file=name, reference_ts=REFERENCE_TS)
    assert [(f.xid, f.severity, f.evidence["count"], f.evidence["with_xids"]) for f in found] == expected
    for f in found:
        assert f.kind == FindingKind.XID
        assert f.source.startswith(f"{name}:")
        assert f.evidence["fatal"] == (f.severity == Severity.PAGE)
        assert f.cause == ("hardware" if f.evidence["fatal"] else f.cause)
    check_golden(f"{path.stem}.json", findings_json(found))


def test_fatal_finding_matches_the_cordon_hint_rule():
    from gpuvigil.pipeline.hints import HintPolicy

    found = kernel_log_findings((PUBLIC / "kernel_dbe_syslog.log").read_text(), reference_ts=REFERENCE_TS)
    dbe = next(f for f in found if f.xid == 48)
    assert dbe.node == "worker4"
    assert [h.action.value for h in HintPolicy().hints_for(dbe)] == ["cordon_node"]  # no job known: no requeue


def test_events_frame_has_the_events_schema():
    df = kernel_log.parse_lines((PUBLIC / "kernel_xids.log").read_text().splitlines(), reference_ts=REFERENCE_TS)
    ev = kernel_log.events(df)
    assert ev.schema == schemas.EVENTS
    assert ev["kind"].unique().to_list() == ["xid"] and ev["source"].unique().to_list() == ["kernel"]
    assert ev.height == 4


def test_tail_follows_appends_partial_lines_rotation_and_truncation(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(f"Nov 29 10:00:00 n1 kernel: {LINE}\nNov 29 10:00:01 n1 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pi")
    col = kernel_log.KernelLogCollector(log, node="n1", boot_ts=0.0, from_start=True)
    out = col.collect(0.0)["events"]
    assert out.height == 1 and out.schema == schemas.EVENTS
    assert col.collect(1.0) == {}  # nothing new, partial line still pending
    with open(log, "a") as fh:
        fh.write("d=7, name=x, GPU has fallen off the bus.\n")
    out = col.collect(2.0)["events"]
    assert out.height == 1 and out["xid"].to_list() == [79]
    # rotation: a last line lands in the old file, it is renamed away, a new one takes its name
    with open(log, "a") as fh:
        fh.write(f"Nov 29 10:04:00 n1 kernel: {LINE.replace(': 79,', ': 64,')}\n")
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text(f"Nov 29 10:05:00 n1 kernel: {LINE.replace(': 79,', ': 48,')}\n")
    assert col.collect(3.0)["events"]["xid"].to_list() == [64, 48]  # nothing lost
    # truncation in place (copytruncate)
    log.write_text("")
    assert col.collect(4.0) == {}
    log.write_text(f"Nov 29 10:06:00 n1 kernel: {LINE.replace(': 79,', ': 13,')}\n")
    assert col.collect(5.0)["events"]["xid"].to_list() == [13]
    assert col.errors == 0


def test_tail_of_missing_file_is_quiet_until_it_appears(tmp_path):
    log = tmp_path / "later.log"
    col = kernel_log.KernelLogCollector(log, boot_ts=0.0)
    assert col.collect(0.0) == {}
    log.write_text(f"[5.0] {LINE}\n")
    assert col.collect(1.0)["events"]["xid"].to_list() == [79]
    assert col.errors == 0


def test_tail_can_start_at_the_end(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(f"[1.0] {LINE}\n")
    col = kernel_log.KernelLogCollector(log, boot_ts=0.0, from_start=False)
    assert col.collect(0.0) == {}
    with open(log, "a") as fh:
        fh.write(f"[2.0] {LINE.replace(': 79,', ': 31,')}\n")
    assert col.collect(1.0)["events"]["xid"].to_list() == [31]


def test_tail_survives_invalid_utf8(tmp_path):
    log = tmp_path / "kern.log"
    log.write_bytes(b"\xff\xfe garbage \x00\n" + f"[1.0] {LINE}\n".encode())
    col = kernel_log.KernelLogCollector(log, boot_ts=0.0, from_start=True)
    assert col.collect(0.0)["events"]["xid"].to_list() == [79]


def _judged(xid_lines: pl.DataFrame) -> list:
    """The lines' incidents judged by the registered `xid_incidents` detector, as analyze does."""
    rows = kernel_log.incident_rows(xid_lines, 180.0, ts=REFERENCE_TS, file="kern.log")
    found = compose.detect_once(["xid_incidents"], {"xid_incidents": rows}, REFERENCE_TS, None)
    assert all(f.kind == FindingKind.XID and f.source.startswith("kern.log:") for f in found)
    return found


REAL_LINES = [l for p in sorted(PUBLIC.glob("kernel_*.log")) for l in p.read_text().splitlines()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=300), max_size=30))
def test_random_text_never_crashes(lines):
    df = kernel_log.parse_lines(lines, reference_ts=REFERENCE_TS)
    _judged(df)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(REAL_LINES) - 1), st.integers(0, 400), st.text(max_size=40))
def test_truncated_and_mangled_real_lines_never_crash(i, cut, junk):
    line = REAL_LINES[i][:cut] + junk
    df = kernel_log.parse_lines([line, REAL_LINES[i]], reference_ts=REFERENCE_TS)
    assert df.height >= (1 if "NVRM: Xid" in REAL_LINES[i] else 0)
    found = _judged(df)
    assert len(found) >= (1 if "NVRM: Xid" in REAL_LINES[i] else 0)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="NVRM: Xid(PCI0123456789abcdef,.)[] \n", max_size=400))
def test_xid_lookalike_noise_never_crashes(text):
    df = kernel_log.parse_lines(text.splitlines(), reference_ts=REFERENCE_TS)
    assert df.schema == kernel_log.XID_LINES
    assert isinstance(kernel_log.incidents(df), pl.DataFrame)


def test_collectors_fit_the_pipeline(tmp_path):
    from gpuvigil.collectors.base import Collector
    from gpuvigil.collectors.nccl_log import NcclLogCollector
    from gpuvigil.pipeline.core import Pipeline

    kern = tmp_path / "kern.log"
    kern.write_text(f"2026-11-29T23:07:34+00:00 n1 kernel: {LINE}\n")
    train = tmp_path / "train.log"
    train.write_text((H200 / "s6_nccl_watchdog_timeout.log").read_text())
    collectors = [kernel_log.KernelLogCollector(kern, boot_ts=0.0, from_start=True), NcclLogCollector(train, node="n1", job="j")]
    assert all(isinstance(c, Collector) for c in collectors)
    pipe = Pipeline(collectors, [])
    result = pipe.tick(utc(2026, 11, 29, 23, 8, 0))
    assert result.samples_ingested == 4 and result.collector_errors == {c.name: 0 for c in collectors}
    assert sorted(pipe.window.get("events")["kind"].to_list()) == ["nccl_progress", "nccl_progress", "nccl_timeout", "xid"]
