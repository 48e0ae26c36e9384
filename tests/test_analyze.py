"""`gpuvigil analyze`: format detection by content, output formats, and untrusted input.

Runs on copies of the real H200 captures and public log lines in a temporary folder whose files
get a fixed modification time (it stands for the year of year-less timestamps), so that the
golden output does not depend on when the tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from h_logs_helpers import DATA, H200, PUBLIC, REFERENCE_TS, check_golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil.offline import analyze
from gpuvigil.errors import UserError

JSON_KEYS = ["kind", "severity", "ts", "job", "ranks", "culprit_ranks", "node", "gpu", "xid", "action", "cause", "evidence", "summary", "source", "id"]
MIXED = [
    H200 / "s2_oom_ramp.log",
    H200 / "s3_fragmentation.log",
    H200 / "s4_fragmentation_expandable.log",
    H200 / "s6_nccl_watchdog_timeout.log",
    H200 / "s7_nccl_two_ranks.log",
    H200 / "nvml_timeseries.csv",
    PUBLIC / "kernel_dbe_syslog.log",
    PUBLIC / "kernel_nvlink5.log",
    PUBLIC / "nccl_watchdog_pg_id.log",
    PUBLIC / "oom_wordings.log",
    DATA / "dcgm" / "node07_constructed.prom",
]


def run(argv: list[str]) -> int:
    """The analyze command through its own add_parser, as gpuvigil.cli.main wires it."""
    parser = argparse.ArgumentParser(prog="gpuvigil")
    sub = parser.add_subparsers()
    analyze.add_parser(sub)
    args = parser.parse_args(["analyze", *argv])
    try:
        return args.func(args)
    except UserError as exc:  # what gpuvigil.cli.main does
        import sys

        print(f"gpuvigil: error: {exc}", file=sys.stderr)
        return 2


def stage(tmp_path: Path, files: list[Path], folder: str = "case") -> Path:
    dest = tmp_path / folder
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(f, dest / f.name)
        os.utime(dest / f.name, (REFERENCE_TS, REFERENCE_TS))
    return dest


@pytest.fixture
def mixed(tmp_path, monkeypatch):
    stage(tmp_path, MIXED)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_text_output_is_golden(mixed, capsys):
    assert run(["case"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    # The verdicts a reader acts on, whatever the layout: each real input's kind and action.
    blocks = out.split("\n\n")
    assert any(b.startswith("[PAGE] xid") and "kernel_dbe_syslog.log:2" in b and "XID 48" in b for b in blocks)
    assert any(b.startswith("[PAGE] nccl_timeout") and "s6_nccl_watchdog_timeout.log:15" in b and "collective #6 (ALLREDUCE)" in b for b in blocks)
    assert any("s3_fragmentation.log:2" in b and "oom_fragmentation" in b for b in blocks)
    assert any("s2_oom_ramp.log:2" in b and "oom_capacity" in b for b in blocks)
    # the H200 capture's DistBackendError (two ranks on one GPU): NCCL's result and last error
    assert any(b.startswith("[PAGE] nccl_error") and "s7_nccl_two_ranks.log:35" in b and "ncclInvalidUsage" in b and "Duplicate GPU" in b for b in blocks)
    check_golden("analyze_mixed.txt", out)


def test_json_lines(mixed, capsys):
    assert run(["case", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    for row in rows:
        assert list(row) == JSON_KEYS
        assert row["source"].startswith("case/")
    assert [r["ts"] for r in rows] == sorted(r["ts"] for r in rows)
    by_source = {r["source"].split("/")[1]: r for r in rows}
    assert by_source["s2_oom_ramp.log:2"]["kind"] == "oom_capacity"
    assert by_source["s3_fragmentation.log:2"]["kind"] == "oom_fragmentation"
    assert by_source["s3_fragmentation.log:2"]["action"] == "set_alloc_conf, requeue_job"
    nccl = by_source["s6_nccl_watchdog_timeout.log:15"]
    assert nccl["kind"] == "nccl_timeout" and nccl["evidence"]["seq"] == 6 and nccl["evidence"]["op"] == "ALLREDUCE"
    assert (nccl["evidence"]["last_enqueued"], nccl["evidence"]["last_completed"]) == (6, 5)
    dbe = by_source["kernel_dbe_syslog.log:2"]
    assert (dbe["kind"], dbe["xid"], dbe["action"], dbe["node"], dbe["severity"]) == ("xid", 48, "WORKFLOW_XID_48", "worker4", "page")
    check_golden("analyze_mixed.jsonl", out)


def test_job_node_and_pci_map_options(tmp_path, monkeypatch, capsys):
    stage(tmp_path, [PUBLIC / "kernel_nvlink5.log", H200 / "s2_oom_ramp.log"])
    monkeypatch.chdir(tmp_path)
    assert run(["case", "--format", "json", "--job", "llama-7", "--node", "gpu-node-3", "--pci-map", "0019:01:00=5,0018:01:00=4"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert {r["job"] for r in rows} == {"llama-7"}
    assert {r["node"] for r in rows} == {"gpu-node-3"}
    # "45 caused by previous Xid 149/145" on a second GPU: one node-level finding per
    # cascade, the mapped GPU indices in its per-GPU evidence
    xids = {r["xid"]: r for r in rows if r["kind"] == "xid"}
    assert set(xids) == {149, 145} and {r["gpu"] for r in xids.values()} == {None}
    assert {g["pci_bus_id"]: g["gpu"] for g in xids[149]["evidence"]["gpus"]} == {"0019:01:00": 5, "0000:dc:00": None}
    assert {g["pci_bus_id"]: g["gpu"] for g in xids[145]["evidence"]["gpus"]} == {"0018:01:00": 4, "0000:ed:00": None}
    assert next(r for r in rows if r["xid"] == 149)["action"] == "WORKFLOW_NVLINK5_ERR"


@pytest.mark.parametrize("bad", ["0000:3b:00", "0000:3b:00=x", "=3"])
def test_bad_pci_map_is_a_user_error(tmp_path, capsys, bad):
    assert run([str(H200 / "s2_oom_ramp.log"), "--pci-map", bad]) == 2
    assert "--pci-map" in capsys.readouterr().err


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda d: pickle.dumps({"entries": [_Evil(d / "pwned")], "pg_status": {}}, protocol=4), "refused global"),
        (lambda d: pickle.dumps(_Evil(d / "pwned"), protocol=2), "refused global"),
        (lambda d: (H200 / "s6_fr_rank_0").read_bytes()[:300], "not a valid pickle"),
        (lambda d: b"", "empty file"),
        (lambda d: bytes(range(256)) * 10, "format not recognised"),
        (lambda d: b"just some notes\nnothing to see\n", "format not recognised"),
        (lambda d: b'DCGM_FI_DEV_FB_USED{gpu="0" 12\n', "not a Prometheus text exposition"),
    ],
)
def test_unreadable_input_is_one_line_naming_the_file_and_others_still_run(tmp_path, monkeypatch, capsys, make, expect):
    d = stage(tmp_path, [H200 / "s2_oom_ramp.log"])
    (d / "bad.bin").write_bytes(make(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert run(["case", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(l)["kind"] for l in out.splitlines()] == ["oom_capacity"]
    (line,) = err.splitlines()
    assert line.startswith("gpuvigil analyze: case/bad.bin: ") and expect in line
    assert not (tmp_path / "pwned").exists()


def test_nothing_readable_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps(_Evil(tmp_path / "pwned"), protocol=4))
    monkeypatch.chdir(tmp_path)
    assert run(["evil.pickle", "missing.log", "."]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("gpuvigil analyze: evil.pickle: refused global")
    assert lines[1] == "gpuvigil analyze: missing.log: no such file or folder"
    assert lines[-1].startswith("gpuvigil: error: nothing could be read")
    assert not (tmp_path / "pwned").exists()


def test_a_file_given_twice_is_read_once(tmp_path, monkeypatch, capsys):
    d = stage(tmp_path, [H200 / "s2_oom_ramp.log"])
    monkeypatch.chdir(tmp_path)
    assert run(["case", "case/s2_oom_ramp.log", "--format", "json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert d.exists()


def test_xid_beyond_the_sniffed_head_is_found(tmp_path, capsys):
    log = tmp_path / "kern.log"
    filler = "Nov 29 10:00:00 n1 kernel: usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"
    with open(log, "w") as fh:
        fh.write(filler * (analyze.SNIFF_BYTES // len(filler) + 10))
        fh.write("Nov 29 10:00:01 n1 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    assert run([str(log), "--format", "json"]) == 0
    (row,) = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert (row["xid"], row["action"], row["node"]) == (79, "RESTART_BM", "n1")


def _nvml_csv(path, hot_gpu1: range, seconds: int = 60) -> None:
    """An NVML series at 1 Hz (the sampler's rate) of two GPUs; GPU 1 throttled for heat
    (HW thermal slowdown, 0x40) during `hot_gpu1`, idle reasons (0x1) otherwise."""
    rows = ["t,gpu,temp_c,sm_clock,power_mw,clock_event_reasons"]
    for i in range(seconds):
        for gpu in (0, 1):
            hot = gpu == 1 and i in hot_gpu1
            rows.append(f"{1795993584 + i}.5,{gpu},{88 if hot else 60},{1200 if hot else 1980},650000,{0x40 if hot else 1}")
    path.write_text("\n".join(rows) + "\n")


def test_thermal_slowdown_in_nvml_csv_is_judged_by_the_thermal_detector(tmp_path, capsys):
    csv = tmp_path / "nvml.csv"
    _nvml_csv(csv, range(5, 50))
    assert run([str(csv), "--format", "json", "--node", "n7"]) == 0
    (row,) = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert (row["kind"], row["severity"], row["node"], row["gpu"], row["cause"]) == ("thermal_throttle", "ticket", "n7", 1, "hardware")
    assert row["evidence"]["detector"] == "thermal" and row["evidence"]["reasons"] == ["hw_thermal"] and row["evidence"]["max_temperature_c"] == 88
    # serve's rule: an exponentially weighted share of throttled samples (time constant 15 s) of
    # at least 0.8: the 25th throttled second, on the line of GPU 1's sample then
    assert row["ts"] == 1795993584 + 29 + 0.5 and row["source"] == f"{csv}:{2 + 2 * 29 + 1}"
    assert row["evidence"]["held_until_ts"] > row["ts"]


def test_a_few_throttled_samples_are_not_a_slowdown(tmp_path, capsys):
    csv = tmp_path / "nvml.csv"
    csv.write_text("t,phase,temp_c,clock_event_reasons\n1.0,a,60,0\n2.0,a,88,64\n3.0,a,90,96\n4.0,a,70,1\n")
    assert run([str(csv), "--format", "json"]) == 0
    assert capsys.readouterr().out == ""
    _nvml_csv(csv, range(5, 20))  # 15 s throttled: below serve's share of 0.8
    assert run([str(csv), "--format", "json"]) == 0
    assert capsys.readouterr().out == ""


def test_real_nvml_series_has_no_thermal_slowdown(capsys):
    assert run([str(H200 / "nvml_timeseries.csv"), "--format", "json"]) == 0
    assert capsys.readouterr().out == ""


def test_gpuvigil_own_scrape(tmp_path, capsys):
    scrape = tmp_path / "gv.prom"
    scrape.write_text(
        "# HELP gpuvigil_node_findings_active Findings active now on a node.\n# TYPE gpuvigil_node_findings_active gauge\n"
        'gpuvigil_node_findings_active{node="n1",kind="xid",severity="page"} 1\n'
        'gpuvigil_node_findings_active{node="n2",kind="ecc",severity="page"} 0\n'
    )
    assert run([str(scrape), "--format", "json"]) == 0
    (row,) = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert (row["kind"], row["node"], row["severity"]) == ("xid", "n1", "page")


def test_flight_recorder_folder_is_analysed_together(tmp_path, monkeypatch, capsys):
    if analyze._optional("gpuvigil.collectors.flight_recorder") is None:
        pytest.skip("gpuvigil.collectors.flight_recorder is not installed")
    stage(tmp_path, [H200 / "s6_fr_rank_0", H200 / "s6_nccl_watchdog_timeout.log"])
    monkeypatch.chdir(tmp_path)
    assert run(["case", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    kinds = {json.loads(l)["kind"]: json.loads(l) for l in out.splitlines()}
    assert "nccl_timeout" in kinds
    (fr,) = [r for r in map(json.loads, out.splitlines()) if r["source"].startswith("case/s6_fr_rank_0")]
    # The real dump: #6 all_reduce joined by its one rank but never completed (no mismatch).
    assert (fr["kind"], fr["severity"], fr["evidence"]["collective_seq_id"], fr["evidence"]["op"]) == ("collective_hang", "page", 6, "all_reduce")
    assert fr["evidence"]["not_completed_ranks"] == [0] and (fr["evidence"]["last_enqueued"], fr["evidence"]["last_completed"]) == ([6], [5])


def test_allocator_files(tmp_path, monkeypatch, capsys):
    if analyze._optional("gpuvigil.collectors.allocator") is None:
        pytest.skip("gpuvigil.collectors.allocator is not installed")
    stage(tmp_path, [H200 / "s3_memory_stats_after.json", H200 / "s3_snapshot.pickle"])
    monkeypatch.chdir(tmp_path)
    assert run(["case", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = [json.loads(line) for line in out.splitlines()]
    by_file = {}
    for r in rows:
        by_file.setdefault(r["source"].split("/")[1].split(":")[0], []).append(r)
    # Both real captures of the fragmentation OOM say fragmentation, and why.
    assert sorted(by_file) == ["s3_memory_stats_after.json", "s3_snapshot.pickle"]
    expected = {
        "s3_memory_stats_after.json": {("fragmentation_allocator", "fragmentation")},
        # The snapshot also carries the OOM itself (its trace's failed 8 GiB request).
        "s3_snapshot.pickle": {("fragmentation_allocator", "fragmentation"), ("oom_fragmentation", "fragmentation")},
    }
    for name, found in by_file.items():
        assert {(r["kind"], r["cause"]) for r in found} == expected[name], name
        assert any(abs(r["evidence"].get("unallocated_bytes", r["evidence"].get("reserved_unallocated_bytes", 0)) - (24 << 30)) < 1 << 20 for r in found), name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.binary(max_size=2000))
def test_random_bytes_never_crash(tmp_path, data):
    f = tmp_path / "random.bin"
    f.write_bytes(data)
    report = analyze.Analyzer().run([f])
    assert len(report.read) + len(report.errors) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.sampled_from(MIXED + [H200 / "s6_fr_rank_0"]), st.integers(0, 4000))
def test_truncated_real_files_never_crash(tmp_path, src, cut):
    data = src.read_bytes()
    f = tmp_path / src.name
    f.write_bytes(data[: max(0, len(data) - cut)])
    report = analyze.Analyzer().run([f])
    assert len(report.read) + len(report.errors) >= 1


def test_cli_wiring():
    import gpuvigil.cli.main as cli

    assert cli.main(["analyze", str(H200 / "s2_oom_ramp.log"), "--format", "json"]) == 0


GPUVIGIL_PAGE = (
    "# HELP gpuvigil_node_findings_active Findings active now on a node.\n# TYPE gpuvigil_node_findings_active gauge\n"
    'gpuvigil_node_findings_active{node="n1",kind="xid",severity="page"} 1\n'
)


@pytest.mark.parametrize(
    "name, make, built",
    [
        ("s3_snapshot.pickle", lambda p: p.write_bytes((H200 / "s3_snapshot.pickle").read_bytes()), {"allocator_state"}),
        ("s3_memory_stats_after.json", lambda p: p.write_bytes((H200 / "s3_memory_stats_after.json").read_bytes()), {"allocator_state"}),
        ("node07.prom", lambda p: p.write_bytes((DATA / "dcgm" / "node07_constructed.prom").read_bytes()), {"xid", "ecc", "nvlink_fabric", "memory_repair"}),
        ("smi.txt", lambda p: p.write_bytes((PUBLIC / "corpus" / "smi_gpud_80_remap_pending.txt").read_bytes()), {"smi_health"}),
        ("gpuvigil.prom", lambda p: p.write_text(GPUVIGIL_PAGE), {"active_findings"}),
        ("nvml.csv", lambda p: _nvml_csv(p, range(5, 50)), {"thermal"}),
    ],
)
def test_every_finding_of_a_saved_reading_comes_from_a_registered_detector(tmp_path, monkeypatch, name, make, built):
    """analyze builds its detectors through the composition root, and prints only what they return."""
    from gpuvigil.app import compose

    made: list[str] = []
    returned: set[int] = set()
    real = compose.detectors

    def recording(cfg, role, **kw):
        out = real(cfg, role, **kw)
        for d in out:
            made.append(d.name)
            detect = d.detect
            d.detect = lambda w, detect=detect: [returned.add(id(f)) or f for f in detect(w)]
        return out

    monkeypatch.setattr(compose, "detectors", recording)
    path = tmp_path / name
    make(path)
    report = analyze.Analyzer().run([path])
    assert set(made) == built and not report.errors
    assert report.findings and all(id(f) in returned for f in report.findings)
