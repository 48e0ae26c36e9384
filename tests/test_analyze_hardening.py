"""`gpuvigil analyze` on hostile and odd input: every file isolated (one bad file, one
line; the others still analysed), Flight Recorder dumps of shapes torch never writes, every
input bounded by size and work before it is loaded, nothing printed raw to a terminal, real
kernel logs whose XIDs are followed by other lines, and documents that quote error messages.

Subprocess runs measure the child's peak RSS (a bound the code must respect, not a timing).
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil.offline import analyze
from gpuvigil.collectors.safe_pickle import PickleReadError, check_items, safe_load, scan
from gpuvigil.util.textsafe import printable

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
PUBLIC = DATA / "public"
H200 = DATA / "h200"
GOOD_DUMP = H200 / "s6_fr_rank_0"


def _run(paths: list[Path], *extra: str) -> tuple[int, str, str]:
    import argparse
    import contextlib
    import io

    parser = argparse.ArgumentParser(prog="gpuvigil")
    analyze.add_parser(parser.add_subparsers())
    args = parser.parse_args(["analyze", *map(str, paths), *extra])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = args.func(args)
        except Exception as exc:  # what gpuvigil.cli.main does with a UserError
            print(f"gpuvigil: error: {exc}", file=sys.stderr)
            rc = 2
    return rc, out.getvalue(), err.getvalue()


# A small interpreter starts `gpuvigil analyze` and reports that grandchild's peak RSS. Forked
# straight from pytest, the child's peak would include pytest's own pages at the fork (ru_maxrss
# keeps the pre-exec high-water mark), which grows with the suite, not with gpuvigil.
_LAUNCHER = """
import os, sys
pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "gpuvigil", "analyze", *sys.argv[2:]], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def _child(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run `gpuvigil analyze` in a grandchild; return it and its own peak RSS in MB."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rusage"
        launcher = subprocess.run([sys.executable, "-c", _LAUNCHER, str(report), *args], cwd=cwd, stdout=out, stderr=err)
        assert launcher.returncode == 0, "the launcher failed"
        code, maxrss_kb = (int(x) for x in report.read_text().split())
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(args, code, out.read().decode(errors="replace"), err.read().decode(errors="replace"))
    return proc, maxrss_kb // 1024


# -- isolation ------------------------------------------------------------------------------
def _fr_json(**override) -> str:
    raw = json.loads((H200 / "s5_fr_dump.json").read_text())
    raw.update(override)
    return json.dumps(raw)


BAD_FILES = {
    "fr_list_status_rank_1.json": lambda: _fr_json(pg_status=[1, 2, 3]),
    "fr_list_config_rank_2.json": lambda: _fr_json(pg_config=["default_pg"]),
    "fr_bigint_rank_3.json": lambda: _fr_json().replace('"entries"', '"huge": ' + "9" * 5000 + ', "entries"', 1),
    "fr_inf_rank_4.json": lambda: _fr_json().replace('"entries"', '"rank": 4, "entries"', 1).replace('"collective_seq_id": 1', '"collective_seq_id": Infinity', 1),
    "fr_entries_not_dicts_rank_5.json": lambda: _fr_json(entries=[1, "x", None]),
}


def test_bad_flight_recorder_dumps_get_one_line_each_and_the_rest_is_analysed(tmp_path):
    case = tmp_path / "case"
    case.mkdir()
    shutil.copy(PUBLIC / "kernel_dbe_syslog.log", case / "kernel.log")
    shutil.copy(PUBLIC / "nccl_watchdog_pg_id.log", case / "train.log")
    fr = case / "fr"
    fr.mkdir()
    shutil.copy(GOOD_DUMP, fr / "fr_rank_0")  # the real H200 dump (rank 0)
    for name, make in BAD_FILES.items():
        (fr / name).write_text(make())
    rc, out, err = _run([case], "--format", "json")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["kind"] for r in rows} >= {"xid", "nccl_timeout", "collective_hang"}, "good files still analysed"
    err_lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    for name in BAD_FILES:
        assert sum(name in ln for ln in err_lines) == 1, (name, err)
    assert any("pg_status is a list" in ln for ln in err_lines)
    assert any("pg_config is a list" in ln for ln in err_lines)


def test_five_thousand_digit_integer_is_one_line(tmp_path):
    f = tmp_path / "fr_rank_0.json"
    f.write_text(BAD_FILES["fr_bigint_rank_3.json"]())
    shutil.copy(PUBLIC / "kernel_xids.log", tmp_path / "k.log")
    rc, out, err = _run([tmp_path])
    assert rc == 0 and "Traceback" not in err
    assert "fr_rank_0.json" in err and err.count("\n") == 1
    assert "xid" in out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=3000))
def test_any_bytes_never_abort_the_run(tmp_path, blob):
    """Whatever one file holds, the run ends normally and the good file next to it is analysed."""
    case = tmp_path / "fuzz"
    case.mkdir(exist_ok=True)
    (case / "blob.bin").write_bytes(blob)
    shutil.copy(PUBLIC / "kernel_xids.log", case / "k.log")
    report = analyze.Analyzer().run([case])
    assert any(f.kind.value == "xid" for f in report.findings)


@pytest.mark.parametrize(
    "prefix",
    [b"\x80\x04", b"\x80\x02}q\x00(X\x07\x00\x00\x00entries", b'{"entries": [', b'{"pg_status": {"0": {"last_enqueued_collective": 1e999}}, "entries": []}'],
)
def test_truncated_and_odd_dumps_are_one_line(tmp_path, prefix):
    (tmp_path / "fr_rank_0").write_bytes(prefix)
    shutil.copy(PUBLIC / "kernel_xids.log", tmp_path / "k.log")
    report = analyze.Analyzer().run([tmp_path])
    assert len(report.errors) <= 1 and any(f.kind.value == "xid" for f in report.findings)


# -- bounded before loading -----------------------------------------------------------------
def test_shared_entries_pickle_is_refused_by_its_work_not_walked(tmp_path, monkeypatch):
    """References to one entry: a small pickle, many entries to walk. (The issue's case was 2
    million references in 4 MB; the budget is scaled down with the pickle to keep the test short.)"""
    from gpuvigil.collectors import flight_recorder

    monkeypatch.setattr(flight_recorder, "MAX_DUMP_ITEMS", 1_000_000)
    entry = {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "p2p_seq_id": 0,
             "op_id": 1, "profiling_name": "nccl:all_reduce", "time_created_ns": 1, "input_sizes": [[4]], "output_sizes": [[4]],
             "state": "scheduled", "timeout_ms": 600000, "is_p2p": False}
    blob = pickle.dumps({"version": "2.4", "pg_config": {}, "pg_status": {}, "entries": [entry] * 100_000}, protocol=4)
    assert len(blob) < 300_000
    path = tmp_path / "fr_rank_0"
    path.write_bytes(blob)
    # The Flight Recorder reader refuses it by its item budget (shared entries counted each time)...
    with pytest.raises(PickleReadError, match="items once shared parts are counted"):
        safe_load(path, max_items=flight_recorder.MAX_DUMP_ITEMS)
    assert not flight_recorder.is_flight_recorder_dump(path)
    # ... so analyze gives the file one line and no finding. (The error text is checked without the
    # path: this test's tmp_path contains the word "entries".)
    report = analyze.Analyzer().run([path])
    assert report.findings == [] and len(report.errors) == 1
    assert report.errors[0].startswith(f"{path}: ") and report.errors[0].endswith("; not loaded")


def test_item_budget_counts_shared_parts_each_time():
    d = {"a": [1, 2, 3]}
    assert check_items([d, d, d], 100) == 3 + 3 * (1 + 3)
    with pytest.raises(PickleReadError, match="more than 10 items"):
        safe_load(pickle.dumps([d] * 10, protocol=4), max_items=10)


def _nested_tuple_key_bomb(depth: int) -> bytes:
    """{t_depth: 1} where t_{i+1} = (t_i, t_i) through the memo: hashing it visits 2^depth tuples."""
    out = bytearray(b"\x80\x04K\x01\x85\x94")  # (1,), memo 0
    for i in range(depth):
        out += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
    out += b"}h" + bytes([depth]) + b"K\x01s."
    return bytes(out)


def test_hash_bomb_is_refused_before_the_loader_hashes_it():
    bomb = _nested_tuple_key_bomb(60)
    assert len(bomb) < 400
    with pytest.raises(PickleReadError, match="units of work"):
        safe_load(bomb)
    assert scan(_nested_tuple_key_bomb(4), 10**6) > 2**4  # the scanner charges the hashing


@pytest.mark.parametrize("path", [H200 / "s3_snapshot.pickle", H200 / "s4_snapshot.pickle", H200 / "s5_fr_dump.pickle"])
def test_real_pickles_are_within_every_budget(path):
    assert safe_load(path) == pickle.loads(path.read_bytes())
    assert scan(path.read_bytes(), 10**9) < 100_000


def test_gigabyte_pickle_is_refused_without_being_read(tmp_path):
    big = tmp_path / "snapshot.pickle"
    with open(big, "wb") as fh:
        fh.write(b"\x80\x04\x95")
        fh.truncate(1 << 30)  # sparse: 1 GiB that costs no disk
    proc, peak_mb = _child([str(big), str(PUBLIC / "kernel_xids.log")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "larger than" in proc.stderr and proc.stderr.count("\n") == 1
    assert peak_mb < 600, f"peak RSS {peak_mb} MB: the file was read"


def test_runaway_single_line_message_is_bounded_and_not_echoed(tmp_path):
    log = tmp_path / "kern.log"
    with open(log, "w") as fh:
        fh.write("[  100.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus. ")
        chunk = "A" * (1 << 20)
        for _ in range(64):  # a 64 MB line (the was 200 MB; the bound is the same)
            fh.write(chunk)
        fh.write("\n[  101.000000] usb 1-1: new device\n")
    proc, peak_mb = _child([str(log)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "xid" in proc.stdout and "GPU has fallen off the bus" in proc.stdout
    assert len(proc.stdout) < 20_000, "the message is cut, not echoed whole"
    assert "more characters not shown" in proc.stdout
    assert peak_mb < 400, f"peak RSS {peak_mb} MB for a 64 MB line"


def test_oversized_csv_and_scrape_are_refused_from_their_size(tmp_path, monkeypatch):
    monkeypatch.setattr(analyze, "MAX_TABLE_BYTES", 100)
    monkeypatch.setattr(analyze, "MAX_SCRAPE_BYTES", 100)
    shutil.copy(H200 / "nvml_timeseries.csv", tmp_path / "nvml.csv")
    shutil.copy(DATA / "dcgm" / "node07_constructed.prom", tmp_path / "m.prom")
    report = analyze.Analyzer().run([tmp_path])
    assert sorted(e.split(":")[0].rsplit("/", 1)[-1] for e in report.errors) == ["m.prom", "nvml.csv"]
    assert all("byte limit" in e for e in report.errors)


# -- terminal output ------------------------------------------------------------------------
def test_escape_sequences_in_messages_are_not_printed_raw(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(
        "[  100.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=\x1b]0;owned\x07x, GPU has fallen off the bus "
        "\x1b[2J\x1b[31mRED\x1b[0m \x9b6n bell\x07 bidi\u202etxt.exe\n[  101.000000] usb 1-1: new device\n"
    )
    rc, out, err = _run([log])
    assert rc == 0, err
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in out
    assert "RED" in out and "\\u202e" in out


@pytest.mark.parametrize(
    "text,expected",
    [
        ("plain", "plain"),
        ("a\x1b[31mred\x1b[0m", "ared"),
        ("title\x1b]0;x\x07end", "titleend"),
        ("bell\x07", "bell\\x07"),
        ("nl\nnext", "nl\\x0anext"),
        ("rtl\u202eabc", "rtl\\u202eabc"),
        ("c1\x9b2J", "c1"),
    ],
)
def test_printable(text, expected):
    assert printable(text) == expected


@given(st.text())
def test_printable_never_lets_a_control_character_through(text):
    out = printable(text, 500)
    assert not any((ord(c) < 0x20 and c != "\t") or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029\u202a\u202b\u202c\u202d\u202e" for c in out)


def test_error_lines_are_sanitised_too(tmp_path):
    evil = tmp_path / "evil\x1b[2Jname.log"
    evil.write_bytes(b"\x80\x04junk")
    shutil.copy(PUBLIC / "kernel_xids.log", tmp_path / "k.log")
    rc, out, err = _run([tmp_path])
    assert rc == 0 and "\x1b" not in err and "evil" in err


# -- kernel logs where XIDs are not the last line ------------------------------------------
@pytest.mark.parametrize(
    "name,xids",
    [
        ("kernel_dmesg_hung_task.log", {45}),
        ("kernel_journalctl_gsp.log", {69, 62}),
        ("kernel_journalctl_localized.log", {38, 109}),
    ],
)
def test_real_kernel_logs_with_lines_after_the_last_xid(tmp_path, name, xids):
    lines = (PUBLIC / name).read_text().splitlines()
    if name != "kernel_journalctl_localized.log":
        assert "Xid" not in lines[-1], "the capture exercises XIDs followed by other lines"
    report = analyze.Analyzer().run([PUBLIC / name])
    assert report.formats == {str(PUBLIC / name): "kernel_log"}
    assert {f.xid for f in report.findings} == xids


def test_xid_followed_by_thousands_of_lines_beyond_the_sniffed_head(tmp_path):
    log = tmp_path / "dmesg.log"
    body = (PUBLIC / "kernel_dmesg_hung_task.log").read_text()
    filler = "".join(f"[{200 + i}.000000] eth0: link up {i}\n" for i in range(20000))
    log.write_text(body + filler)
    report = analyze.Analyzer().run([log])
    assert {f.xid for f in report.findings} == {45}


# -- documents that quote messages ---------------------------------------------------------
README = """# Troubleshooting NCCL hangs

When a job stops making progress and the log then shows
`Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600060 milliseconds before timing out`,
one rank never entered the collective. If you see NCCL WARN NET/IB : Got completion from peer 10.0.0.1<1234> with status=12
the InfiniBand link is the likely cause, and when dmesg says NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus the GPU is gone.

```
[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.
[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 79, pid=1797828, name=pt_main_thread, GPU has fallen off the bus.
```

Read the runbook before you cordon the node, and page the owner of the job only when the hang repeats.
"""


def test_readme_quoting_error_messages_does_not_page(tmp_path):
    (tmp_path / "README.md").write_text(README)
    rc, out, err = _run([tmp_path / "README.md"])
    assert (rc, out) == (2, "")
    assert "README.md: format not recognised" in err


def test_readme_beside_a_real_log_is_skipped_and_the_log_analysed(tmp_path):
    (tmp_path / "README.md").write_text(README)
    shutil.copy(PUBLIC / "nccl_watchdog_pg_id.log", tmp_path / "train.log")
    rc, out, err = _run([tmp_path, "--format", "json"])
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and rows and all(r["source"].split(":")[0].endswith("train.log") for r in rows)


def test_prose_paragraphs_without_a_heading_do_not_page(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text(
        "When a job hangs the log shows Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, "
        "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600060 milliseconds before timing out, and one rank is stuck.\n"
        "If dmesg says NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus then the GPU is gone.\n"
    )
    rc, out, err = _run([notes])
    assert "[PAGE]" not in out


def test_prose_quotes_are_blanked_but_real_prefixes_are_kept():
    import re

    phrase = re.compile(r"Watchdog caught|NVRM: Xid")
    kept = [
        "[rank0]:[E321 02:07:08.408 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught x\n",
        "Jan 18 11:38:05 localhost kernel: [ 269.517039] NVRM: Xid (0000:01:00): 3, x\n",
        "kwi 15 07:56:59 testowy kernel: NVRM: Xid (PCI:0000:07:00): 38, x\n",
        "    [rank7]:[E816 01:45:40.18 ProcessGroupNCCL.cpp:607] [Rank 7] Watchdog caught x\n",
        "Watchdog caught x\n",
    ]
    quoted = ["If you see `Watchdog caught x`, wait\n", "and when dmesg says NVRM: Xid (PCI:0000:3b:00): 79, x\n"]
    assert list(analyze.log_lines(kept + quoted, phrase)) == kept + ["\n"] * len(quoted)
    assert list(analyze.log_lines(["```\n", "Watchdog caught x\n", "```\n", "Watchdog caught y\n"], phrase)) == ["\n", "\n", "\n", "Watchdog caught y\n"]

