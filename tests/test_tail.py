"""The one file tail (collectors/tail.py) every file source uses: kernel log files, torch/NCCL
logs and the hook's JSON-lines files. Real files, real renames and truncations."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil.collectors.hook import HookCollector
from gpuvigil.collectors.tail import FileTail, TailPosition, TailSet


def rec(step: int) -> str:
    return json.dumps({"ts": float(step), "rank": 0, "job": "j", "step": step}) + "\n"


def steps(out) -> list[int]:
    return out["rank_progress"]["step"].to_list() if "rank_progress" in out else []


def test_hook_file_replaced_mid_stream_loses_no_records(tmp_path):
    """Regression: the hook's old tailer kept a byte offset per path, so a file replaced by a new
    one (a restarted rank, a rotation) was read from the old offset and its first records lost."""
    path = tmp_path / "j.rank0.jsonl"
    path.write_text("".join(rec(i) for i in range(5)))
    col = HookCollector([tmp_path])
    assert steps(col.collect(0.0)) == [0, 1, 2, 3, 4]
    writer = path.open("a")
    writer.write(rec(5))  # the last record of the old file, flushed just before the replace
    writer.flush()
    new = tmp_path / "j.rank0.jsonl.tmp"
    new.write_text("".join(rec(i) for i in range(6, 12)))  # longer than the old file's offset
    os.replace(new, path)
    writer.write(rec(99))  # a late write to the replaced file (still open) is also ours
    writer.close()
    assert steps(col.collect(1.0)) == [5, 99, 6, 7, 8, 9, 10, 11]
    # deleted and re-created under the same name
    path.unlink()
    path.write_text(rec(12))
    assert steps(col.collect(2.0)) == [12]
    assert col.errors == 0


def test_rotation_truncation_and_partial_lines(tmp_path):
    p = tmp_path / "a.log"
    p.write_text("one\ntw")
    t = FileTail(p)
    assert t.read_lines() == ["one"]
    with p.open("a") as fh:
        fh.write("o\nthree")  # 'three' has no newline yet when the file is rotated
    os.rename(p, tmp_path / "a.log.1")
    p.write_text("four\n")
    assert t.read_lines() == ["two", "three", "four"] and t.rotations == 1
    p.write_text("")  # copytruncate
    assert t.read_lines() == []
    p.write_text("five\n")
    assert t.read_lines() == ["five"]


def test_reads_are_capped_and_overlong_lines_dropped(tmp_path):
    p = tmp_path / "big.log"
    p.write_bytes(b"x" * 5000 + b"\n" + b"".join(b"line %d\n" % i for i in range(200)))
    t = FileTail(p, max_read_bytes=512, max_line_bytes=1000)
    got: list[str] = []
    per_read = []
    for _ in range(100):  # 6.4 KB in reads of at most 512 bytes
        lines = t.read_lines()
        per_read.append(sum(len(l) + 1 for l in lines))
        got.extend(lines)
    assert max(per_read) <= 512 + len("line 199\n")  # a line may have started in the previous read
    assert got == [f"line {i}" for i in range(200)]
    assert t.dropped_lines == 1


def test_rotation_with_more_left_in_the_old_file_than_one_read(tmp_path):
    p = tmp_path / "a.log"
    p.write_text("")
    t = FileTail(p, max_read_bytes=100)
    assert t.read_lines() == []
    with p.open("a") as fh:
        fh.write("".join(f"old {i:03d}\n" for i in range(50)))
    os.rename(p, tmp_path / "a.log.1")
    p.write_text("new 1\n")
    got = []
    for _ in range(20):
        got.extend(t.read_lines())
    assert got == [f"old {i:03d}" for i in range(50)] + ["new 1"]


def test_start_at_end_and_resume_position(tmp_path):
    p = tmp_path / "a.log"
    p.write_text("old\n")
    t = FileTail(p, from_start=False)
    assert t.read_lines() == []
    with p.open("a") as fh:
        fh.write("new\npart")
    assert t.read_lines() == ["new"]
    pos = t.position
    assert isinstance(pos, TailPosition) and pos.offset == len("old\nnew\n")  # the partial line is re-read
    t.close()
    with p.open("a") as fh:
        fh.write("ial\n")
    again = FileTail(p, position=TailPosition.from_json(pos.to_json()))
    assert again.read_lines() == ["partial"]


def test_tailset_picks_up_new_files_and_releases_deleted_ones(tmp_path):
    (tmp_path / "a.jsonl").write_text("a1\n")
    ts = TailSet([tmp_path], from_start=False)
    assert ts.read() == []
    (tmp_path / "b.jsonl").write_text("b1\n")  # a new file: read from its start
    (tmp_path / "ignored.txt").write_text("x\n")
    assert ts.read() == [(tmp_path / "b.jsonl", [b"b1"])]
    (tmp_path / "b.jsonl").unlink()
    ts.read()
    assert list(ts.tails) == [tmp_path / "a.jsonl"]
    glob_set = TailSet([str(tmp_path / "*.log")])
    (tmp_path / "r0.log").write_text("x\n")
    assert glob_set.read() == [(tmp_path / "r0.log", [b"x"])]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "rotate", "truncate"]), st.binary(max_size=80)), max_size=12))
def test_no_line_is_lost_or_repeated_whatever_the_file_does(ops):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.log"
        p.write_bytes(b"")
        t = FileTail(p, max_read_bytes=64)
        expected: list[bytes] = []
        got: list[bytes] = []
        for i, (op, data) in enumerate(ops):
            data = data.replace(b"\n", b"") + b"\n"
            if op == "rotate":
                os.rename(p, Path(d) / f"f.log.{i}")
                p.write_bytes(b"")
            elif op == "truncate":
                for _ in range(50):
                    got.extend(t.read_raw_lines())
                p.write_bytes(b"")
                # seen truncated before it grows again (a truncation followed by as many bytes
                # as were read before it cannot be told from no change, as for `tail -F`)
                got.extend(t.read_raw_lines())
            with p.open("ab") as fh:
                fh.write(data)
            expected.append(data[:-1])
            got.extend(t.read_raw_lines())
        for _ in range(50):
            got.extend(t.read_raw_lines())
        assert got == expected


def test_an_unreadable_path_is_an_error_a_missing_one_is_not(tmp_path):
    import pytest

    from gpuvigil.collectors.kernel_log import KernelLogCollector, KernelLogUnavailable
    from gpuvigil.collectors.nccl_log import NcclLogCollector

    assert FileTail(tmp_path / "later.log", from_start=False).read_lines() == []
    with pytest.raises(OSError, match="not a regular file"):
        FileTail(tmp_path, from_start=False)
    with pytest.raises(KernelLogUnavailable, match="cannot read"):
        KernelLogCollector(tmp_path)
    # a log that turns into something unreadable later is reported through health()
    p = tmp_path / "train.log"
    col = NcclLogCollector(p, node="n1", from_start=True)
    assert col.collect(0.0) == {} and col.health() == {str(p): None}
    p.mkdir()
    assert col.collect(1.0) == {}
    assert "not a regular file" in col.health()[str(p)] and col.errors == 1


def test_one_unreadable_hook_file_does_not_hide_the_others(tmp_path):
    a, fifo, c = tmp_path / "a.rank0.jsonl", tmp_path / "b.rank1.jsonl", tmp_path / "c.rank2.jsonl"
    a.write_text(rec(1))
    os.mkfifo(fifo)  # not a regular file: must neither hang nor hide the others
    c.write_text(rec(2))
    col = HookCollector([a, fifo, c])
    assert steps(col.collect(0.0)) == [1, 2]
    assert "not a regular file" in col.health()["hook"] and col.errors == 1


def test_nccl_inspector_dump_replaced_by_a_longer_one_loses_nothing(tmp_path):
    """Regression: the Inspector collector kept a byte offset per path too."""
    from gpuvigil.collectors.nccl_inspector import NcclInspectorCollector
    from test_nccl_inspector import README_RECORD

    def record(sn):
        return json.dumps({**README_RECORD, "coll_perf": {**README_RECORD["coll_perf"], "coll_sn": sn}}) + "\n"

    job = tmp_path / "job-5"
    job.mkdir()
    dump = job / "nccl-inspector-0.log"
    dump.write_text(record(1) + record(2))
    col = NcclInspectorCollector(tmp_path)
    assert col.collect(1.0)["collective_progress"]["coll_sn"].to_list() == [1, 2]
    new = job / "tmp"
    new.write_text("".join(record(sn) for sn in range(10, 15)))
    os.replace(new, dump)
    assert col.collect(2.0)["collective_progress"]["coll_sn"].to_list() == [10, 11, 12, 13, 14]
    assert col.errors == 0
