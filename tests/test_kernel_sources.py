"""Live kernel-log sources: /dev/kmsg, journald and files, with resume points across restarts.

- kmsg: parsing is tested on real records read from this machine's /dev/kmsg
  (tests/data/kernel/kmsg_records.json); the reader itself runs on the real /dev/kmsg when the
  test can read it (skipped otherwise), and writes a harmless marker line to it when it can.
- journald: systemd-journald does not run in CI containers, so `journalctl` is
  tests/fake_journalctl.py put on PATH; it prints real journald JSON entries
  (tests/data/kernel/journald_kernel.jsonl, captured with `journalctl -k -o json`) and follows
  the entries a test appends. The XID entries are those real entries with MESSAGE replaced by
  real XID messages (tests/data/public/kernel_xids.log).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.collectors import kernel_log
from gpuvigil.collectors.kernel_log import (
    KernelLogCollector,
    KernelLogUnavailable,
    KmsgSource,
    journal_line,
    kmsg_line,
    parse_kmsg_record,
)

DATA = Path(__file__).parent / "data"
KMSG_RECORDS = [r.encode() for r in json.loads((DATA / "kernel" / "kmsg_records.json").read_text())]
JOURNAL = [json.loads(l) for l in (DATA / "kernel" / "journald_kernel.jsonl").read_text().splitlines() if l.strip()]
XID_MESSAGES = [l.split("] ", 1)[1] for l in (DATA / "public" / "kernel_xids.log").read_text().splitlines() if "NVRM: Xid" in l]


def kmsg_write(text: str) -> None:
    """Log a line through /dev/kmsg, or skip where this machine (a container) refuses it."""
    try:
        with open("/dev/kmsg", "w") as fh:
            fh.write(text)
    except OSError as exc:
        pytest.skip(f"cannot write /dev/kmsg here: {exc}")


def wait_for(fn, timeout: float = 15.0):
    """Poll `fn` until it returns something truthy (a child process needs a moment to print)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


# ---------------------------------------------------------------- kmsg records


def test_real_kmsg_records_parse():
    recs = [parse_kmsg_record(r) for r in KMSG_RECORDS]
    assert all(r is not None for r in recs)
    first = recs[0]
    assert (first.priority, first.facility, first.seq, first.usec) == (5, 0, 0, 0)
    assert first.message.startswith("Linux version ")
    # continuation lines (" SUBSYSTEM=acpi") are not part of the message
    with_dict = next(r for raw, r in zip(KMSG_RECORDS, recs, strict=True) if b"\n SUBSYSTEM=" in raw)
    assert "SUBSYSTEM" not in with_dict.message and with_dict.message.startswith("acpi ")
    # the kernel's \xNN escapes are decoded
    escaped = next(r for raw, r in zip(KMSG_RECORDS, recs, strict=True) if b"\\x09" in raw)
    assert "\t" in escaped.message and "\\x09" not in escaped.message
    assert kmsg_line(with_dict).startswith(f"[{with_dict.usec / 1e6:12.6f}] acpi")


def test_xid_in_a_kmsg_record_becomes_an_event_on_the_wall_clock():
    raw = f"3,4711,5123456789,-;{XID_MESSAGES[-1]}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:cb:00.0\n".encode()
    rec = parse_kmsg_record(raw)
    assert rec is not None and rec.seq == 4711 and rec.priority == 3
    df = kernel_log.parse_lines([kmsg_line(rec)], node="n1", boot_ts=1_700_000_000.0, pci_to_gpu={"0000:cb:00.0": 6})
    row = df.row(0, named=True)
    assert (row["xid"], row["gpu"], row["pid"], row["ts_kind"]) == (109, 6, 1797828, "boot_offset")
    assert row["ts"] == pytest.approx(1_700_000_000.0 + 5123.456789)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_never_a_crash(raw):
    rec = parse_kmsg_record(raw)
    if rec is not None:
        kmsg_line(rec)


def _can_read_kmsg() -> bool:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.read(fd, 1 << 16)
        return True
    except BlockingIOError:
        return True
    except OSError:  # EPERM where a container may not read the kernel log
        return False
    finally:
        os.close(fd)


kmsg_readable = pytest.mark.skipif(not _can_read_kmsg(), reason="/dev/kmsg not readable here")


@kmsg_readable
def test_real_dev_kmsg_from_start_capped_reads_and_resume(tmp_path):
    src = KmsgSource(from_start=True, max_read_bytes=2048)
    first = src.read()
    assert first and sum(len(l) for l in first) < 2048 + 1024  # the cap stops after ~2 KiB of records
    more = src.read()
    assert more  # the rest comes on later reads
    state = src.state()
    assert state is not None and state["kind"] == "kmsg" and state["boot_id"] == kernel_log.current_boot_id()
    src.close()
    # a restart on the same boot resumes after the saved sequence number
    again = KmsgSource(resume=state)
    assert again.resumed
    resumed = again.read()
    seqs = again.state()["seq"]
    assert seqs >= state["seq"]
    assert first[0] not in resumed  # what was read before the restart is not read twice
    again.close()
    # another boot's state: the buffer is new, read from its start
    other = KmsgSource(resume={"kind": "kmsg", "boot_id": "another-boot", "seq": 10**9})
    assert other.read()[0] == first[0]
    other.close()


@kmsg_readable
@pytest.mark.skipif(not os.access("/dev/kmsg", os.W_OK), reason="/dev/kmsg not writable here")
def test_a_line_written_to_dev_kmsg_is_read_once_across_a_restart(tmp_path):
    state = tmp_path / "kernel_log.state"
    col = KernelLogCollector("kmsg", node="n1", state_file=state)
    assert col.collect(0.0) == {}  # starts at the end
    marker = f"gpuvigil test marker {uuid.uuid4()}"
    kmsg_write(f"<6>{marker}\n")
    seen = [l for l in col.source.read() if marker in l]
    assert len(seen) == 1
    col._save_state()
    col.close()
    saved = json.loads(state.read_text())
    assert saved["kind"] == "kmsg"
    col2 = KernelLogCollector("kmsg", node="n1", state_file=state)
    assert "resuming" in col2.describe()
    assert not [l for l in col2.source.read() if marker in l]  # not read again after the restart
    col2.close()


def test_missing_kmsg_is_a_clear_error(tmp_path):
    with pytest.raises(KernelLogUnavailable, match="cannot open .*nokmsg"):
        KernelLogCollector("kmsg", kmsg_path=tmp_path / "nokmsg")


# ---------------------------------------------------------------- journald


def xid_entries(start_i: int, n: int, host: str = "gpu-node-07") -> list[dict]:
    """Real journald kernel entries carrying real XID messages (see the module docstring)."""
    out = []
    base = JOURNAL[5]
    for k in range(n):
        i = start_i + k
        e = dict(base)
        e["MESSAGE"] = XID_MESSAGES[k % len(XID_MESSAGES)]
        e["_HOSTNAME"] = host
        e["__REALTIME_TIMESTAMP"] = str(1_725_016_989_000_000 + i * 1_000_000)
        e["__CURSOR"] = base["__CURSOR"].replace(";i=", f";i={i}0").replace(";x=", f";x={i:x}")
        e["PRIORITY"] = "3"
        out.append(e)
    return out


@pytest.fixture
def fake_journal(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "journalctl"
    exe.write_text(f"#!{sys.executable}\n" + (Path(__file__).parent / "fake_journalctl.py").read_text())
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(e) + "\n" for e in JOURNAL))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    return journal


def started(journal: Path) -> None:
    ready = Path(str(journal) + ".ready")
    assert wait_for(ready.exists)
    ready.unlink()


def append(journal: Path, entries: list[dict]) -> None:
    with journal.open("a") as fh:
        fh.write("".join(json.dumps(e) + "\n" for e in entries))


def test_journal_entries_render_like_short_iso_precise():
    line, cursor = journal_line(JOURNAL[0])
    assert line.startswith("2026-") and " vm kernel: Linux version " in line and cursor == JOURNAL[0]["__CURSOR"]
    # MESSAGE as an array of bytes (not UTF-8) and a null MESSAGE
    e = dict(JOURNAL[0], MESSAGE=list(b"NVRM: Xid (PCI:0000:3b:00): 79, \xff"))
    assert "NVRM: Xid (PCI:0000:3b:00): 79, \ufffd" in journal_line(e)[0]
    assert journal_line(dict(JOURNAL[0], MESSAGE=None)) is None


def test_journald_follows_from_the_end_then_resumes_from_the_cursor(fake_journal, tmp_path):
    state = tmp_path / "state" / "kernel_log.state"
    col = KernelLogCollector("journald", state_file=state, boot_ts=0.0)
    assert col.source.kind == "journald" and "--lines=0" in col.source._argv()
    started(fake_journal)
    assert col.collect(0.0) == {}  # nothing old is read
    append(fake_journal, JOURNAL[:2] + xid_entries(1, 3))
    got = wait_for(lambda: col.collect(1.0))
    ev = got["events"]
    assert ev.schema == schemas.EVENTS
    assert ev["xid"].to_list() == [13, 13, 13] and ev["node"].unique().to_list() == ["gpu-node-07"]
    assert ev["ts"].to_list() == pytest.approx([1_725_016_990.0, 1_725_016_991.0, 1_725_016_992.0])
    saved = json.loads(state.read_text())
    assert saved == {"kind": "journald", "cursor": xid_entries(1, 3)[-1]["__CURSOR"]}
    col.close()
    # while gpuvigil is down, two more XIDs are logged; the restart reads exactly those
    append(fake_journal, xid_entries(4, 5)[3:])
    col2 = KernelLogCollector("journald", state_file=state, boot_ts=0.0)
    started(fake_journal)
    assert any(a.startswith("--after-cursor=") for a in col2.source._argv())
    ev2 = wait_for(lambda: col2.collect(2.0))["events"]
    assert ev2["xid"].to_list() == [109, 13]
    assert ev2["ts"].to_list() == pytest.approx([1_725_016_997.0, 1_725_016_998.0])
    col2.close()


def test_journald_node_given_wins_over_the_journal_hostname(fake_journal):
    col = KernelLogCollector("journald", node="n1", from_start=True)
    started(fake_journal)
    append(fake_journal, xid_entries(1, 1))
    ev = wait_for(lambda: col.collect(0.0))["events"]
    assert ev["node"].to_list() == ["n1"]
    col.close()


def test_journalctl_failing_is_reported_with_its_reason(fake_journal, monkeypatch):
    monkeypatch.setenv("FAKE_JOURNALCTL_EXIT", "1")
    col = KernelLogCollector("journald")
    assert wait_for(lambda: col.collect(0.0) == {} and col.last_error)
    assert "exited with status 1" in col.last_error and "Failed to open journal" in col.last_error
    assert col.health() == {col.source.where: col.last_error} and col.errors >= 1
    monkeypatch.delenv("FAKE_JOURNALCTL_EXIT")
    # restarted on the next read; from the end (no cursor yet), so it sees what comes next
    assert col.collect(1.0) == {} and col.last_error is None and col.source.restarts == 1
    started(fake_journal)
    append(fake_journal, xid_entries(1, 1))
    assert wait_for(lambda: col.collect(2.0))["events"]["xid"].to_list() == [13]
    col.close()


def test_journalctl_missing_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(KernelLogUnavailable, match="journalctl"):
        KernelLogCollector("journald")


# ---------------------------------------------------------------- files


LINE = XID_MESSAGES[-1]


def test_file_source_resumes_at_the_saved_offset(tmp_path):
    log, state = tmp_path / "kern.log", tmp_path / "kernel_log.state"
    log.write_text(f"[1.0] {LINE}\n")
    col = KernelLogCollector(log, state_file=state, boot_ts=0.0)
    assert col.collect(0.0) == {}  # started at the end
    with log.open("a") as fh:
        fh.write(f"[2.0] {LINE}\n")
    assert col.collect(1.0)["events"]["ts"].to_list() == [2.0]
    col.close()
    with log.open("a") as fh:
        fh.write(f"[3.0] {LINE}\n[4.0] {LINE}\n")  # written while gpuvigil was down
    col2 = KernelLogCollector(log, state_file=state, boot_ts=0.0)
    assert col2.collect(2.0)["events"]["ts"].to_list() == [3.0, 4.0]
    col2.close()
    # the file was replaced while down: the new file is read whole
    log.unlink()
    log.write_text(f"[5.0] {LINE}\n")
    col3 = KernelLogCollector(log, state_file=state, boot_ts=0.0)
    assert col3.collect(3.0)["events"]["ts"].to_list() == [5.0]


def test_per_read_byte_cap(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("".join(f"[{i}.0] {LINE}\n" for i in range(100)))
    col = KernelLogCollector(log, from_start=True, boot_ts=0.0, max_read_bytes=1000)
    sizes = []
    while out := col.collect(0.0):
        sizes.append(out["events"].height)
    assert sum(sizes) == 100 and max(sizes) <= 1000 // len(LINE) + 1 and len(sizes) > 5


def test_auto_picks_a_readable_source_or_says_why_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kernel_log, "FILE_CANDIDATES", (str(tmp_path / "none.log"),))
    with pytest.raises(KernelLogUnavailable) as err:
        KernelLogCollector("auto", kmsg_path=tmp_path / "nokmsg")
    assert "nokmsg" in str(err.value) and "journalctl" in str(err.value) and "none.log" in str(err.value)
    (tmp_path / "none.log").write_text("")
    col = KernelLogCollector("auto", kmsg_path=tmp_path / "nokmsg")
    assert col.source.kind == "file" and "none.log" in col.describe()


def test_kernel_log_source_fits_the_pipeline_and_reports_health(tmp_path):
    from gpuvigil.collectors.base import Collector

    col = KernelLogCollector(tmp_path / "kern.log", from_start=True)
    assert isinstance(col, Collector)
    assert col.collect(0.0) == {} and col.health() == {str(tmp_path / "kern.log"): None}


def test_journald_ident_split_is_undone():
    """journald files `NVRM: ...` written through /dev/kmsg under SYSLOG_IDENTIFIER=NVRM (a real
    entry): the line must read as dmesg printed it, or the XID is missed."""
    entry = json.loads((DATA / "kernel" / "journald_userspace_kmsg.json").read_text())
    assert entry["SYSLOG_IDENTIFIER"] == "NVRM" and not entry["MESSAGE"].startswith("NVRM")
    line, _ = journal_line(entry)
    df = kernel_log.parse_lines([line])
    assert df["xid"].to_list() == [79] and df["node"].to_list() == ["vm"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["MESSAGE", "__CURSOR", "__REALTIME_TIMESTAMP", "_HOSTNAME", "SYSLOG_IDENTIFIER"]),
                       st.one_of(st.none(), st.text(max_size=40), st.integers(), st.lists(st.integers(-5, 300), max_size=10))))
def test_any_journal_entry_is_never_a_crash(entry):
    journal_line(entry)


# ---------------------------------------------------------------- a real systemd-journald


@pytest.fixture
def real_journald():
    """The running journald, or one started here (root, systemd-journald installed, none running)."""
    import shutil
    import signal
    import subprocess

    if shutil.which("journalctl") is None:
        pytest.skip("journalctl not installed (Debian package systemd)")
    running = subprocess.run(["pgrep", "-x", "systemd-journal"], capture_output=True).returncode == 0
    proc = None
    if not running:
        exe = next((p for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald") if os.access(p, os.X_OK)), None)
        if exe is None or os.geteuid() != 0 or not os.access("/dev/kmsg", os.W_OK):
            pytest.skip("no systemd-journald running and none can be started here")
        proc = subprocess.Popen([exe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if not wait_for(lambda: Path("/run/systemd/journal/socket").exists() and proc.poll() is None, 10):
            proc.kill()
            pytest.skip("systemd-journald did not start here")
    yield
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.mark.services
@pytest.mark.skipif(not os.access("/dev/kmsg", os.W_OK), reason="cannot write /dev/kmsg here")
def test_real_journald_follows_and_resumes_from_its_cursor(real_journald, tmp_path):
    state = tmp_path / "kernel_log.state"
    col = KernelLogCollector("journald", node="n1", state_file=state)
    read_before: list[str] = []

    def write_and_see():
        # each try its own marker: the child journalctl (started at the end) may still be starting
        marker = f"gpuvigil test marker {uuid.uuid4()}"
        kmsg_write(f"<6>{marker}\n")
        return wait_for(lambda: read_before.extend(l for l in col.source.read() if "gpuvigil test marker" in l) or any(marker in l for l in read_before), 5)

    assert wait_for(write_and_see, 30)
    assert all(" kernel: " in l for l in read_before)
    col._save_state()
    col.close()
    assert json.loads(state.read_text())["cursor"].startswith("s=")
    marker2 = f"gpuvigil test marker {uuid.uuid4()}"
    kmsg_write(f"<6>{marker2}\n")  # logged while gpuvigil is down
    col2 = KernelLogCollector("journald", node="n1", state_file=state)
    assert "resuming" in col2.describe()
    after: list[str] = []
    assert wait_for(lambda: after.extend(l for l in col2.source.read() if "gpuvigil test marker" in l) or any(marker2 in l for l in after), 20)
    col2.close()
    assert not set(after) & set(read_before)  # nothing read before the restart is read again
