"""One rule for a training log's NCCL timeouts, NCCL errors and OOMs: the same log, tailed live
through a `Pipeline` (the log collector -> `events` -> the registered `watchdog`, `nccl_error`
and `oom_events` detectors) and read whole by `gpuvigil analyze`, gets the same kind, ranks,
culprit ranks and cause.

Inputs: the real H200 watchdog timeout (tests/data/h200/, from /work/shared/fixtures/h200/),
real multi-rank watchdog logs from public issue threads (tests/data/public/, sources in its
README), and the H200 log with one more rank's progress line in torch's own wording (the line
torch prints on every rank when the dump signal arrives), saying that rank never enqueued the
collective the others timed out in.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from h_logs_helpers import H200, PUBLIC

from gpuvigil.app import compose
from gpuvigil.collectors.nccl_log import NcclLogCollector, events, parse_lines
from gpuvigil.model import FindingKind
from gpuvigil.offline.analyze import TRAINING_LOG_DETECTORS, Analyzer
from gpuvigil.pipeline.core import Pipeline

# Rank 1 of the H200 job, still at work 5 when rank 0 timed out in #6 (torch 2.x wording of the
# dump-signal line, as rank 0 printed it in the same capture).
LAGGING_RANK_1 = (
    "[rank1]:[E1129 23:07:38.036001000 ProcessGroupNCCL.cpp:1914] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump "
    "signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL "
    "work: 5, last completed NCCL work: 5."
)


def _h200_with_lagging_rank() -> str:
    return (H200 / "s6_nccl_watchdog_timeout.log").read_text() + LAGGING_RANK_1 + "\n"


CASES = [
    # name, log text, expected (kind, ranks, culprit_ranks, cause)
    ("h200_watchdog", lambda: (H200 / "s6_nccl_watchdog_timeout.log").read_text(), ("nccl_timeout", [0], [], "software")),
    ("h200_watchdog_lagging_rank", _h200_with_lagging_rank, ("nccl_timeout", [0], [1], "software")),
    ("public_pg1_three_ranks", lambda: (PUBLIC / "nccl_watchdog.log").read_text(), ("nccl_timeout", [0, 3, 4], [], "software")),
    ("public_pg_id", lambda: (PUBLIC / "nccl_watchdog_pg_id.log").read_text(), ("nccl_timeout", [0, 1, 2], [], "software")),
    ("public_openclip", lambda: (PUBLIC / "corpus" / "wd_openclip_1024.log").read_text(), ("nccl_timeout", [4, 5, 7], [], "software")),
    ("h200_two_ranks_nccl_error", lambda: (H200 / "s7_nccl_two_ranks.log").read_text(), ("nccl_error", [], [], "software")),
    ("h200_oom", lambda: (H200 / "s2_oom_ramp.log").read_text(), ("oom_capacity", [], [], "capacity")),
]


def _key(f) -> tuple:
    return (f.kind.value, f.ranks, f.culprit_ranks, f.cause)


def _online(log: Path) -> list:
    """The log tailed by the collector in a pipeline that runs the registered detectors, ticked
    once just after its last line (the collector reads yearless stamps against the clock)."""
    ev = events(parse_lines(log.read_text().splitlines(), reference_ts=time.time()))
    pipe = Pipeline([NcclLogCollector(log, job="j1")], compose.detectors(None, "serve", only=TRAINING_LOG_DETECTORS))
    return pipe.tick(float(ev["ts"].max()) + 1.0).new_findings


@pytest.mark.parametrize(("name", "text", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_same_log_is_judged_the_same_online_and_by_analyze(tmp_path, name, text, expected):
    log = tmp_path / f"{name}.log"
    log.write_text(text())
    online = _online(log)
    offline = Analyzer(job="j1").run([log]).findings
    assert [_key(f) for f in online] == [_key(f) for f in offline] == [expected], ([f.summary for f in online], [f.summary for f in offline])
    assert [f.job for f in online] == [f.job for f in offline] == ["j1"]


def test_online_watchdog_names_the_rank_that_never_enqueued_the_collective(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(_h200_with_lagging_rank())
    [f] = _online(log)
    assert f.kind == FindingKind.NCCL_TIMEOUT and f.ranks == [0] and f.culprit_ranks == [1]
    assert (f.evidence["seq"], f.evidence["op"], f.evidence["numel_in"], f.evidence["timeout_ms"], f.evidence["ran_for_ms"]) == (6, "ALLREDUCE", 1048576, 8000, 8031)
    assert (f.evidence["last_enqueued"], f.evidence["last_completed"], f.evidence["pg"]) == (6, 5, "0(default_pg)")
    assert "rank 1 never enqueued it" in f.summary and "did not join are not in the logs" not in f.summary


def test_a_job_that_timed_out_in_two_collectives_is_one_finding_naming_both(tmp_path):
    # A real log whose ranks timed out in a BROADCAST and an ALLREDUCE: the finding is about the
    # first collective to time out, lists both, and names every rank that waited.
    log = tmp_path / "train.log"
    log.write_text((PUBLIC / "corpus" / "wd_nccl_1409.log").read_text())
    [f] = _online(log)
    assert f.ranks == [3, 7] and (f.evidence["seq"], f.evidence["op"]) == (80078, "BROADCAST")
    assert [(c["seq"], c["op"], c["ranks"]) for c in f.evidence["collectives"]] == [(80078, "BROADCAST", [7]), (80078, "ALLREDUCE", [3, 7])]
    assert "also collective #80078 (ALLREDUCE)" in f.summary
    [g] = Analyzer(job="j1").run([log]).findings
    assert _key(g) == _key(f) and g.evidence["collectives"] == f.evidence["collectives"]


def test_a_job_with_two_distinct_nccl_errors_is_one_finding_listing_both(tmp_path):
    # Two real errors (a remote peer gone, then a system error) in one job's log, no timestamps:
    # one page about the first, the other listed, online and offline alike.
    corpus = PUBLIC / "corpus"
    log = tmp_path / "train.log"
    log.write_text((corpus / "ncclerr_nccl_2076_remote.log").read_text() + (corpus / "ncclerr_segmenter_60_system.log").read_text())
    pipe = Pipeline([NcclLogCollector(log, job="j1")], compose.detectors(None, "serve", only=TRAINING_LOG_DETECTORS))
    [f] = pipe.tick(time.time() + 1.0).new_findings
    assert f.kind == FindingKind.NCCL_ERROR and f.cause == "network" and f.evidence["code"] == "ncclRemoteError"
    assert [(e["code"], e["where"]) for e in f.evidence["errors"]] == [("ncclRemoteError", "NCCLUtils.hpp:268"), ("ncclSystemError", "ProcessGroupNCCL.cpp:825")]
    assert "; also ncclSystemError at ProcessGroupNCCL.cpp:825" in f.summary
    [g] = Analyzer(job="j1").run([log]).findings
    assert _key(g) == _key(f) and g.evidence["errors"] == f.evidence["errors"]


def _dump_signal(rank: int, pg: str, enq: int) -> str:
    return (f"[rank{rank}]:[E1129 23:07:38.0360{rank:02d}000 ProcessGroupNCCL.cpp:1914] [{pg} Rank {rank}] Received a dump signal due to a "
            f"collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL work: {enq}, last completed NCCL work: {enq}.")


DEFAULT_PG = "PG ID 0 PG GUID 0(default_pg)"


@pytest.mark.parametrize(
    ("extra", "culprits"),
    [
        ([_dump_signal(1, DEFAULT_PG, 5)], [1]),
        ([_dump_signal(1, DEFAULT_PG, 5), _dump_signal(2, DEFAULT_PG, 4)], [1, 2]),
        # a rank that reached the collective is waiting in it, not holding it up
        ([_dump_signal(1, DEFAULT_PG, 6)], []),
        # another process group counts its own sequence numbers
        ([_dump_signal(1, "PG ID 1 PG GUID 1", 2)], []),
        # the furthest a rank's lines got counts
        ([_dump_signal(1, DEFAULT_PG, 5), _dump_signal(1, DEFAULT_PG, 7)], []),
    ],
    ids=["one_lagging", "two_lagging", "reached_it", "other_pg", "later_line_reached_it"],
)
def test_culprits_are_the_ranks_whose_progress_never_reached_the_collective(tmp_path, extra, culprits):
    log = tmp_path / "train.log"
    log.write_text((H200 / "s6_nccl_watchdog_timeout.log").read_text() + "\n".join(extra) + "\n")
    [f] = _online(log)
    assert f.ranks == [0] and f.culprit_ranks == culprits
    [g] = Analyzer(job="j1").run([log]).findings
    assert _key(g) == _key(f)
