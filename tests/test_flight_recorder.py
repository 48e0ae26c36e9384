"""Flight Recorder: the real H200 dumps, and real multi-rank hangs and mismatches produced by
CPU ranks on gloo (tests/fr_workers.py), analysed to the exact culprit ranks."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil.cli.main import main as cli_main
from gpuvigil.collectors import flight_recorder as fr
from gpuvigil.offline import fr as offline_fr
from gpuvigil.errors import UserError
from gpuvigil.model import FindingKind, Severity

DATA = Path(__file__).parent / "data" / "h200"
sys.path.insert(0, str(Path(__file__).parent))


# ---------------------------------------------------------------- real H200 dumps


def test_s6_watchdog_dump_shows_enqueued_6_completed_5_and_a_stuck_allreduce():
    dump = fr.load_dump(DATA / "s6_fr_rank_0")
    assert dump.rank == 0
    assert dump.pg_status["0"] == fr.PGStatus(last_enqueued=6, last_started=-1, last_completed=5)
    assert [e.collective_seq_id for e in dump.entries] == [1, 2, 3, 4, 5, 6]
    assert dump.entries[-1].state == "scheduled" and dump.entries[-1].op == "all_reduce"
    assert dump.entries[-1].input_sizes == ((1048576,),) and dump.entries[-1].timeout_ms == 8000
    [finding] = offline_fr.analyze_dumps([dump])
    assert finding.kind == FindingKind.COLLECTIVE_HANG and finding.severity == Severity.PAGE
    assert finding.evidence["collective_seq_id"] == 6
    assert finding.evidence["op"] == "all_reduce"
    assert finding.evidence["last_completed"] == [5]
    assert finding.ranks == [0] and finding.culprit_ranks == [0]
    assert finding.source.endswith("s6_fr_rank_0")


def test_s5_dump_has_44_completed_collectives_and_no_problem():
    dump = fr.load_dump(DATA / "s5_fr_dump.pickle")
    assert len(dump.entries) == 44 and dump.completed_count() == 44
    assert dump.comm_lib_version == "2.28.9"
    assert {e.op for e in dump.entries} >= {"all_reduce", "broadcast"}
    assert offline_fr.analyze_dumps([dump]) == []


def test_s5_pickle_and_json_forms_agree():
    from_pickle = fr.load_dump(DATA / "s5_fr_dump.pickle")
    from_json = fr.load_dump(DATA / "s5_fr_dump.json")
    fields = ("pg_name", "pg_desc", "collective_seq_id", "op", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "state", "time_created_ns", "timeout_ms")
    assert [tuple(getattr(e, f) for f in fields) for e in from_pickle.entries] == [tuple(getattr(e, f) for f in fields) for e in from_json.entries]
    assert from_pickle.pg_config == from_json.pg_config
    # JSON writes pg_status numbers as strings: normalised to ints.
    assert from_json.pg_status["0"] == fr.PGStatus(44, -1, 44)
    # Side by side they are one dump (pickle kept), not two ranks.
    [kept] = fr.load_paths([DATA / "s5_fr_dump.pickle", DATA / "s5_fr_dump.json"])
    assert kept.source.endswith("s5_fr_dump.pickle")


@pytest.mark.parametrize("name, expected", [("s5_fr_dump.pickle", True), ("s5_fr_dump.json", True), ("s6_fr_rank_0", True), ("s3_snapshot.pickle", False), ("s2_memory_stats.json", False), ("nvml_timeseries.csv", False)])
def test_format_sniffing(name, expected):
    assert fr.is_flight_recorder_dump(DATA / name) is expected


# ---------------------------------------------------------------- bad input


def test_malicious_dump_is_refused_naming_the_file(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "fr_rank_1"
    bad.write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()], "pg_status": {}}))
    with pytest.raises(UserError, match=r"fr_rank_1: refused global builtins\.print"):
        fr.load_dump(bad)
    assert fr.is_flight_recorder_dump(bad) is False


@pytest.mark.parametrize(
    "content, message",
    [
        (pickle.dumps({"device_traces": [], "segments": []}), "not a Flight Recorder dump"),
        (pickle.dumps([1, 2, 3]), "not a Flight Recorder dump"),
        (b'{"entries": [1], "pg_status": {}}', "entry 0 is int"),
        (b'{"entries": [{"collective_seq_id": "x"}], "pg_status": {}}', "collective_seq_id is 'x'"),
        (b'{"entries": [{"input_sizes": 5}], "version": "2"}', "input_sizes is int"),
        (b'{"entries": [', "not valid JSON"),
        (b"hello", "neither a pickle nor JSON"),
    ],
)
def test_bad_dumps_are_user_errors_naming_the_file(tmp_path, content, message):
    path = tmp_path / "fr_rank_3"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as info:
        fr.load_dump(path)
    assert str(path) in str(info.value)


def test_two_different_dumps_for_one_rank_of_one_job_are_refused(tmp_path):
    shutil.copy(DATA / "s6_fr_rank_0", tmp_path / "fr_rank_0")
    shutil.copy(DATA / "s5_fr_dump.pickle", tmp_path / "fr_rank_0.pickle")
    with pytest.raises(UserError, match="second, different dump for rank 0"):
        offline_fr.analyze_paths([tmp_path])


def test_dumps_of_different_jobs_in_one_folder_are_analysed_apart():
    # s5 and s6 are two single-rank jobs side by side: each is its own job (file-name prefix).
    groups = fr.load_groups([DATA])
    assert [[Path(d.source).name for d in g] for g in groups] == [["s5_fr_dump.pickle"], ["s6_fr_rank_0"]]
    [finding] = offline_fr.analyze_paths([DATA])
    assert finding.source.endswith("s6_fr_rank_0") and finding.evidence["collective_seq_id"] == 6


def test_folder_without_dumps_and_missing_path(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    with pytest.raises(UserError, match="no Flight Recorder dumps in this folder"):
        offline_fr.analyze_paths([tmp_path])
    with pytest.raises(UserError, match="no such file"):
        offline_fr.analyze_paths([tmp_path / "gone"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_truncated_and_random_dumps_only_raise_user_error(tmp_path, data):
    raw = (DATA / data.draw(st.sampled_from(["s6_fr_rank_0", "s5_fr_dump.json"]))).read_bytes()
    cut = raw[: data.draw(st.integers(0, len(raw)))]
    candidate = data.draw(st.sampled_from([cut, data.draw(st.binary(max_size=200)), b"\x80\x02" + data.draw(st.binary(max_size=200))]))
    path = tmp_path / "fr_rank_0"
    path.write_bytes(candidate)
    fr.is_flight_recorder_dump(path)
    try:
        offline_fr.analyze_dumps([fr.load_dump(path)])
    except UserError:
        pass


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_entry_keys = ["collective_seq_id", "process_group", "profiling_name", "input_sizes", "output_sizes", "input_dtypes", "state", "time_created_ns", "is_p2p"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(_entry_keys), _json_values, max_size=9), max_size=4), st.dictionaries(st.text(max_size=3), _json_values, max_size=3))
def test_random_structures_only_raise_user_error(entries, pg_status):
    try:
        dump = fr.parse_dump({"version": "2.10", "entries": entries, "pg_status": pg_status, "pg_config": {}}, "<random>")
        offline_fr.analyze_dumps([dump])
    except UserError:
        pass


# ---------------------------------------------------------------- ring buffer, no false culprit


def test_evicted_entries_are_not_taken_for_a_missing_rank():
    one_rank = fr.load_dump(DATA / "s5_fr_dump.pickle")
    dump = dataclasses.replace(one_rank, pg_config={"0": fr.PGConfig("0", "default_pg", (0, 1))})
    rank0 = dataclasses.replace(dump, rank=0, source="r0")
    # Rank 1 kept only its newest 10 entries (a smaller ring buffer): nothing is missing.
    rank1 = dataclasses.replace(dump, rank=1, source="r1", entries=dump.entries[-10:])
    assert offline_fr.analyze_dumps([rank0, rank1]) == []
    # Rank 1 stopped at #40: ranks 0 and 1 disagree from #41 on, and rank 1 is the culprit.
    rank1 = dataclasses.replace(dump, rank=1, source="r1", entries=dump.entries[:40], pg_status={"0": fr.PGStatus(40, -1, 40)})
    [finding] = offline_fr.analyze_dumps([rank0, rank1])
    assert finding.kind == FindingKind.COLLECTIVE_HANG and finding.culprit_ranks == [1]
    assert finding.evidence["collective_seq_id"] == 41 and finding.evidence["culprit_last_seq"] == [40]


# ---------------------------------------------------------------- real gloo ranks

# (id, world, scenario, culprits, op)
GLOO_CASES = [
    ("4_one_missing", 4, "missing", [1], "all_gather"),
    ("8_one_missing", 8, "missing", [6], "all_gather"),
    ("8_node_missing", 8, "missing", [4, 5, 6, 7], "all_gather"),
    ("4_all_gather_vs_all_reduce", 4, "wrong_op", [2], "all_gather"),
    ("8_broadcast_vs_all_reduce", 8, "wrong_op", [5], "broadcast"),
    ("4_size", 4, "size", [1], "all_gather"),
    ("4_dtype", 4, "dtype", [3], "all_gather"),
]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    pytest.importorskip("torch", reason="torch (CPU build) is needed for real gloo ranks")
    import fr_workers

    runs = {case_id: tmp_path_factory.mktemp(case_id) for case_id, *_ in GLOO_CASES}
    fr_workers.run_worlds(
        [fr_workers.World(runs[case_id], world, scenario, culprits, op=op, json_form=case_id == "4_one_missing") for case_id, world, scenario, culprits, op in GLOO_CASES]
    )
    return runs


@pytest.mark.torch
@pytest.mark.parametrize("case_id, world, scenario, culprits, op", GLOO_CASES, ids=[c[0] for c in GLOO_CASES])
def test_gloo_hangs_and_mismatches_name_the_culprit_ranks(gloo_runs, case_id, world, scenario, culprits, op):
    findings = offline_fr.analyze_paths([gloo_runs[case_id]], job="job-42")
    assert len(findings) == 1
    [finding] = findings
    assert finding.culprit_ranks == culprits
    assert finding.ranks == list(range(world))
    assert finding.severity == Severity.PAGE and finding.job == "job-42"
    # 3 all_reduces and a broadcast succeed first; the faulty collective is #5.
    assert finding.evidence["collective_seq_id"] == 5
    assert finding.evidence["pg_size"] == world
    if scenario == "missing":
        assert finding.kind == FindingKind.COLLECTIVE_HANG
        assert finding.evidence["op"] == "all_reduce"
        assert finding.evidence["joined_ranks"] == world - len(culprits)
        assert finding.evidence["culprit_last_seq"] == [4] * len(culprits)
    else:
        assert finding.kind == FindingKind.COLLECTIVE_MISMATCH
        expected_type = {"wrong_op": "op", "size": "size", "dtype": "dtype"}[scenario]
        assert finding.evidence["mismatch_type"] == expected_type
        if scenario == "wrong_op":
            assert finding.evidence["culprit_ops"] == [op] and finding.evidence["expected"] == "all_reduce"
        # A mismatch is shown in the culprit's own record.
        assert finding.source.endswith(f"fr_rank_{culprits[0]}")


@pytest.mark.torch
def test_gloo_json_form_gives_the_same_answer(gloo_runs, tmp_path):
    for path in gloo_runs["4_one_missing"].glob("fr_rank_*.json"):
        shutil.copy(path, tmp_path / path.name)
    assert len(list(tmp_path.iterdir())) == 4
    [from_json] = offline_fr.analyze_paths([tmp_path])
    [from_pickle] = offline_fr.analyze_paths(sorted(gloo_runs["4_one_missing"].glob("fr_rank_?")))
    assert from_json.culprit_ranks == from_pickle.culprit_ranks == [1]
    assert from_json.evidence["collective_seq_id"] == from_pickle.evidence["collective_seq_id"]


@pytest.mark.torch
def test_fr_cli_text_and_json(gloo_runs, capsys):
    assert cli_main(["fr", str(gloo_runs["8_node_missing"])]) == 0
    text = capsys.readouterr().out
    assert "8 Flight Recorder dump(s)" in text and "culprits=4-7" in text
    assert cli_main(["fr", str(gloo_runs["4_size"]), "--format", "json"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["kind"] == "collective_mismatch" and record["culprit_ranks"] == [1]
    assert record["evidence"]["mismatch_type"] == "size"


def test_fr_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "fr_rank_0"
    bad.write_bytes(b"\x80\x04garbage")
    assert cli_main(["fr", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err


def test_golden_normalised_s6_dump_and_findings():
    from h_fr_helpers import check_golden

    from gpuvigil.collectors.safe_pickle import safe_load

    raw = safe_load(DATA / "s6_fr_rank_0")
    dump = fr.parse_dump(raw, "s6_fr_rank_0", Path("s6_fr_rank_0"))
    # The real dump on timeout: collective #6 enqueued, #5 the last completed.
    assert (dump.pg_status["0"].last_enqueued, dump.pg_status["0"].last_completed) == (6, 5)
    found = offline_fr.analyze_dumps([dump])
    [f] = found
    assert (f.kind.value, f.severity.value, f.culprit_ranks, f.evidence["collective_seq_id"], f.evidence["op"]) == ("collective_hang", "page", [0], 6, "all_reduce")
    check_golden("fr_s6_dump.json", dataclasses.asdict(dump))
    check_golden("fr_s6_findings.json", [f.to_json_dict() for f in found])


def test_entries_evicted_by_another_group_are_not_a_missing_rank():
    """The ring buffer is shared by all groups: a rank whose busy second group pushed out every
    entry of the first still says, in pg_status, how far it got there."""
    one_rank = fr.load_dump(DATA / "s5_fr_dump.pickle")
    dump = dataclasses.replace(one_rank, pg_config={"0": fr.PGConfig("0", "default_pg", (0, 1))})
    rank0 = dataclasses.replace(dump, rank=0, source="r0")
    rank1 = dataclasses.replace(dump, rank=1, source="r1", entries=[], pg_status={"0": fr.PGStatus(44, -1, 44)})
    assert offline_fr.analyze_dumps([rank0, rank1]) == []
    rank1 = dataclasses.replace(rank1, pg_status={"0": fr.PGStatus(30, -1, 30)})
    [finding] = offline_fr.analyze_dumps([rank0, rank1])
    assert finding.culprit_ranks == [1] and finding.evidence["collective_seq_id"] == 31 and finding.evidence["culprit_last_seq"] == [30]
