"""Mutation testing: the L0 NCCL watchdog detector (`gpuvigil/detectors/watchdog.py`).

Data: the real watchdog log captured on an H200 (`tests/data/h200/s6_nccl_watchdog_timeout.log`:
rank 0's all_reduce #6 timed out after 8000 ms) and the public watchdog logs of the corpus
(`tests/data/public/nccl_watchdog.log`: ranks 0 and 4 report #1580 at one instant;
`nccl_watchdog_pg_id.log`: ranks 0, 2, 1 report #808 over 0.75 s). They go through the real log
parser (`collectors.nccl_log.parse_lines` + `events`). The hardware events beside them (an XID, an
ECC DBE) are constructed rows: no capture has a watchdog timeout and an XID together.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.collectors.nccl_log import events, parse_lines
from gpuvigil.detectors.watchdog import WatchdogTimeoutDetector
from gpuvigil.model import FindingKind, Severity
from gpuvigil.window import Window
from levels_helpers import cfg_with

DATA = Path(__file__).parent / "data"
NOW = 10_000.0


def _timeouts(name: str, *, job: str | None = "j1", node: str | None = "gvx", last_at: float = NOW) -> pl.DataFrame:
    """The log's `nccl_timeout` events, shifted so that its last one is at `last_at` (the
    captures' own clocks are old); the gaps between lines are the log's own."""
    ev = events(parse_lines((DATA / name).read_text().splitlines(), reference_ts=0.0), node=node, job=job)
    ev = ev.filter(pl.col("kind") == "nccl_timeout")
    return ev.with_columns(ts=pl.col("ts") - pl.col("ts").max() + last_at)


def _hw(ts: float, node: str, kind: str = "xid", xid: int | None = 79) -> pl.DataFrame:
    return schemas.frame([{"ts": ts, "node": node, "gpu": 0, "source": "kernel", "kind": kind, "xid": xid, "message": f"{kind} on {node}"}], schemas.EVENTS)


def _detect(*frames: pl.DataFrame, now: float = NOW, cfg: dict | None = None):
    w = Window(3600.0)
    w.add("events", pl.concat(list(frames), how="diagonal_relaxed") if len(frames) > 1 else frames[0])
    w.seal(now)
    return WatchdogTimeoutDetector(cfg).detect(w)


def test_the_h200_timeout_is_one_whole_software_finding():
    [f] = _detect(_timeouts("h200/s6_nccl_watchdog_timeout.log"))
    assert f.kind == FindingKind.NCCL_TIMEOUT and f.severity == Severity.PAGE
    assert f.ts == NOW and f.job == "j1" and f.ranks == [0] and f.culprit_ranks == []
    assert f.node is None and f.cause == "software" and f.source == "watchdog"
    assert f.evidence == {
        "reporting_ranks": [0], "nodes": ["gvx"], "culprit_nodes": [], "seq": 6, "op": "ALLREDUCE",
        "timeout_ms": 8000, "lines": 1, "first_ts": NOW, "xids": [],
        "numel_in": 1048576, "numel_out": 1048576, "ran_for_ms": 8031,
    }
    assert f.summary == ("j1: the NCCL watchdog timed out collective #6 (ALLREDUCE) on rank 0 (gvx); "
                         "the ranks that did not join are not in the logs.")


def test_several_reporting_ranks_over_time_are_one_finding_at_the_last_line():
    ev = _timeouts("public/nccl_watchdog_pg_id.log")
    assert ev.height == 3 and ev["ts"].min() < NOW - 0.7  # the capture's own spread
    [f] = _detect(ev)
    assert f.ranks == [0, 1, 2] and f.ts == NOW and f.evidence["lines"] == 3
    assert abs(f.evidence["first_ts"] - float(ev["ts"].min())) < 1e-9
    assert f.evidence["seq"] == 808 and f.evidence["timeout_ms"] == 600000
    assert "on ranks 0, 1, 2 (gvx);" in f.summary


def test_an_xid_on_a_reporting_node_makes_it_hardware_and_names_the_node():
    ev = _timeouts("public/nccl_watchdog.log")
    [f] = _detect(ev, _hw(NOW - 5, "gvx", xid=79), _hw(NOW - 4, "gvx", xid=48), _hw(NOW - 3, "other", xid=13))
    assert f.cause == "hardware" and f.node == "gvx"
    assert f.evidence["culprit_nodes"] == ["gvx"] and f.evidence["xids"] == [48, 79]
    assert f.summary == ("j1: the NCCL watchdog timed out collective #1580 (ALLREDUCE) on ranks 0, 4 (gvx); "
                         "XID 48, 79 on gvx.")


def test_an_ecc_error_without_an_xid_is_hardware_too():
    [f] = _detect(_timeouts("h200/s6_nccl_watchdog_timeout.log"), _hw(NOW - 1, "gvx", kind="ecc_dbe", xid=None))
    assert f.cause == "hardware" and f.node == "gvx" and f.evidence["xids"] == []
    assert f.summary.endswith("on rank 0 (gvx); hardware errors on gvx.")
    [g] = _detect(_timeouts("h200/s6_nccl_watchdog_timeout.log"), _hw(NOW - 1, "gvx", kind="ecc", xid=None))
    assert g.cause == "hardware"


def test_hardware_elsewhere_or_of_another_kind_is_not_the_cause():
    """Hard negatives of the hardware cause: an XID on another node, a non-hardware event on the node."""
    ev = _timeouts("h200/s6_nccl_watchdog_timeout.log")
    [f] = _detect(ev, _hw(NOW - 1, "other"), _hw(NOW - 1, "gvx", kind="nccl_warn", xid=None))
    assert f.cause == "software" and f.node is None and f.evidence["culprit_nodes"] == []


def test_timeouts_without_a_node_blame_no_node_even_with_hardware_errors_around():
    ev = _timeouts("h200/s6_nccl_watchdog_timeout.log", node=None)
    [f] = _detect(ev, _hw(NOW - 1, "gvx"))
    assert f.cause == "software" and f.evidence["nodes"] == [] and f.node is None
    assert f.summary.endswith("on rank 0; the ranks that did not join are not in the logs.")


def test_hardware_lookback_edge_from_the_configuration():
    ev = _timeouts("h200/s6_nccl_watchdog_timeout.log")
    [f] = _detect(ev, _hw(NOW - 300.0, "gvx"))  # exactly the default 300 s: still hardware
    assert f.cause == "hardware"
    [g] = _detect(ev, _hw(NOW - 300.5, "gvx"))
    assert g.cause == "software"
    [h] = _detect(ev, _hw(NOW - 300.5, "gvx"), cfg=cfg_with("watchdog", hardware_lookback_seconds=400.0))
    assert h.cause == "hardware"


def test_report_seconds_edge_from_the_configuration():
    """Guard: a timeout older than `report_seconds` no longer pages (hard negative), exactly that old still does."""
    ev = _timeouts("h200/s6_nccl_watchdog_timeout.log", last_at=NOW - 600.0)
    assert len(_detect(ev)) == 1
    late = _timeouts("h200/s6_nccl_watchdog_timeout.log", last_at=NOW - 600.5)
    assert _detect(late) == []
    assert len(_detect(late, cfg=cfg_with("watchdog", report_seconds=700.0))) == 1
    assert _detect(ev, cfg=cfg_with("watchdog", report_seconds=100.0)) == []


def _from_file(name: str, path: str | None, *, node: str | None = "gvx", job: str | None = None) -> pl.DataFrame:
    """The log's timeouts as NcclLogCollector reads them from `path` (its file in `source`)."""
    ev = events(parse_lines((DATA / name).read_text().splitlines(), reference_ts=0.0), node=node, job=job, file=path)
    ev = ev.filter(pl.col("kind") == "nccl_timeout")
    return ev.with_columns(ts=pl.col("ts") - pl.col("ts").max() + NOW)


@pytest.mark.parametrize(
    "node, path, names",
    [
        ("gvx", "/var/log/train/a.log", "Job unknown (log gvx:/var/log/train/a.log): "),
        ("gvx", None, "Job unknown (log gvx (GPU unknown)): "),
        (None, "/var/log/train/a.log", "Job unknown (log /var/log/train/a.log): "),
        (None, None, "Job unknown: "),
    ],
)
def test_a_timeout_of_no_known_job_pages_naming_the_node_and_file(node, path, names):
    """No silent drop: the H200 timeout read from a log whose path names no job is a page that
    names what is known (node, file), with no job, so that no hint acts on a job."""
    from gpuvigil.pipeline.hints import HintPolicy

    [f] = _detect(_from_file("h200/s6_nccl_watchdog_timeout.log", path, node=node))
    assert (f.kind, f.severity, f.job, f.ranks, f.cause, f.node) == (FindingKind.NCCL_TIMEOUT, Severity.PAGE, None, [0], "software", node)
    assert f.evidence["seq"] == 6 and f.evidence["op"] == "ALLREDUCE" and f.evidence.get("files", []) == ([path] if path else [])
    assert f.summary == names + "the NCCL watchdog timed out collective #6 (ALLREDUCE) on rank 0" + (f" ({node})" if node else "") + (
        "; the ranks that did not join are not in the logs.")
    assert HintPolicy().hints_for(f) == []  # requeue needs a job; a software cause cordons nothing


def test_timeouts_of_no_known_job_in_two_files_are_two_findings_and_hardware_still_counts():
    a = _from_file("h200/s6_nccl_watchdog_timeout.log", "/logs/a.log")
    b = _from_file("public/nccl_watchdog.log", "/logs/b.log")
    fs = _detect(a, b, _hw(NOW - 1, "gvx", xid=79))
    assert sorted(f.evidence["files"][0] for f in fs) == ["/logs/a.log", "/logs/b.log"]
    assert len({f.id for f in fs}) == 2  # two causes, not one merged by node
    assert all(f.cause == "hardware" and f.node == "gvx" and f.job is None for f in fs)
    from gpuvigil.pipeline.hints import HintPolicy

    # the node is known and to blame: cordon it; the job is not known: nothing requeued
    assert {h.action.value for f in fs for h in HintPolicy().hints_for(f)} == {"cordon_node"}
    # the same lines with their job are one finding per job, as before
    [g] = _detect(_from_file("h200/s6_nccl_watchdog_timeout.log", "/logs/a.log", job="j1"))
    assert g.job == "j1" and g.node is None and g.summary.startswith("j1: ")


def test_only_nccl_timeout_events_page():
    """Guard: the other events of the same log (none here is a timeout) page nothing."""
    ev = events(parse_lines((DATA / "h200/s2_oom_ramp.log").read_text().splitlines(), reference_ts=0.0), node="gvx", job="j1")
    assert ev.height > 0
    assert _detect(ev.with_columns(ts=pl.lit(NOW))) == []


def test_two_jobs_are_two_findings_in_order_of_their_lines():
    a = _timeouts("public/nccl_watchdog.log", job="b-late", node="n1")
    b = _timeouts("h200/s6_nccl_watchdog_timeout.log", job="a-early", node="n2", last_at=NOW - 10)
    fs = _detect(a, b)
    assert [f.job for f in fs] == ["a-early", "b-late"]
    assert fs[0].ranks == [0] and fs[0].evidence["nodes"] == ["n2"] and fs[1].ranks == [0, 4]


def test_a_line_without_seq_op_timeout_or_rank_still_pages_in_plain_words():
    ev = _timeouts("h200/s6_nccl_watchdog_timeout.log").with_columns(
        message=pl.lit("Watchdog caught collective operation timeout"), rank=pl.lit(None, pl.Int32))
    [f] = _detect(ev)
    assert f.evidence["seq"] is None and f.evidence["op"] is None and f.evidence["timeout_ms"] is None
    assert f.ranks == [] and f.evidence["reporting_ranks"] == []
    assert f.summary == "j1: the NCCL watchdog timed out a collective on its ranks (gvx); the ranks that did not join are not in the logs."


def test_seq_and_op_come_from_the_first_line_that_has_them():
    ev = _timeouts("public/nccl_watchdog.log")
    first = ev.sort("ts").head(1).with_columns(message=pl.lit("no details here"), ts=pl.lit(NOW - 1))
    [f] = _detect(pl.concat([first, ev]))
    assert f.evidence["seq"] == 1580 and f.evidence["op"] == "ALLREDUCE" and f.evidence["timeout_ms"] == 600000
    assert f.evidence["lines"] == 3 and f.evidence["first_ts"] == NOW - 1


def test_xids_on_two_reporting_nodes_are_both_named():
    a = _timeouts("public/nccl_watchdog.log", node="n1")
    b = _timeouts("h200/s6_nccl_watchdog_timeout.log", node="n2")
    [f] = _detect(a, b, _hw(NOW - 2, "n2", xid=79), _hw(NOW - 1, "n1", xid=94))
    assert f.node == "n1" and f.evidence["culprit_nodes"] == ["n1", "n2"] and f.evidence["nodes"] == ["n1", "n2"]
    assert f.summary.endswith("; XID 79, 94 on n1, n2.")


def test_ecc_errors_on_two_reporting_nodes_are_both_named_and_so_are_the_nodes():
    """The plain 'hardware errors on' list and the reporting nodes in the
    summary, with two nodes each (same real logs, ECC events constructed)."""
    a = _timeouts("public/nccl_watchdog.log", node="n1")
    b = _timeouts("h200/s6_nccl_watchdog_timeout.log", node="n2")
    [f] = _detect(a, b, _hw(NOW - 2, "n2", kind="ecc", xid=None), _hw(NOW - 1, "n1", kind="ecc", xid=None))
    assert f.evidence["nodes"] == ["n1", "n2"]
    assert "(n1, n2)" in f.summary
    assert f.summary.endswith("; hardware errors on n1, n2.")


def _warnings(path: str | None, *, job: str | None = "j1", node: str | None = "gvx") -> pl.DataFrame:
    """The public NCCL network warnings (nccl/issues/1405, nccl-tests/issues/166, nccl/issues/795:
    IB completion status 12, socket connect/close, broken pipe) as read from `path`, just before NOW."""
    ev = events(parse_lines((DATA / "public/nccl_warn_network.log").read_text().splitlines(), reference_ts=0.0), node=node, job=job, file=path)
    ev = ev.filter(pl.col("kind") == "nccl_warn")
    return ev.with_columns(ts=pl.lit(NOW - 5.0))


@pytest.mark.parametrize(
    "timeout_job, timeout_file, warn_job, warn_file, cause",
    [
        ("j1", "/logs/a.log", "j1", "/logs/a.log", "network"),   # the job's own log says the network failed
        ("j1", "/logs/a.log", "j1", "/logs/b.log", "network"),   # another rank's log of the same job
        ("j1", "/logs/a.log", "j2", "/logs/b.log", "software"),  # another job's network trouble is not this one's
        (None, "/logs/a.log", None, "/logs/a.log", "network"),   # no job known: the same file
        (None, "/logs/a.log", None, "/logs/b.log", "software"),  # no job known: another file says nothing of this one
    ],
)
def test_nccl_network_warnings_of_the_same_job_or_file_make_the_cause_network(timeout_job, timeout_file, warn_job, warn_file, cause):
    """Parsed NCCL warnings reach the finding that they explain (as `analyze` reads them), never
    another job's or file's; hardware errors still come first."""
    from gpuvigil.pipeline.hints import HintPolicy

    warns = _warnings(warn_file, job=warn_job)
    assert warns.height == 5  # the 5 NCCL WARN lines of the 8 (the INFO lines are not warnings), all about the network
    [f] = _detect(_from_file("h200/s6_nccl_watchdog_timeout.log", timeout_file, job=timeout_job), warns)
    assert f.cause == cause
    if cause == "network":
        assert f.evidence["network_warnings"] == 5 and "NET/IB : Got completion from peer" in f.evidence["first_network_warning"]
        assert "; 5 NCCL network warning(s) in the log; the ranks that did not join are not in the logs." in f.summary
    else:
        assert "network_warnings" not in f.evidence and "network warning" not in f.summary
    # a network cause is requeued like a software one (when the job is known), cordons nothing
    assert [h.action.value for h in HintPolicy().hints_for(f)] == (["requeue_job"] if timeout_job else [])
    [g] = _detect(_from_file("h200/s6_nccl_watchdog_timeout.log", timeout_file, job=timeout_job), warns, _hw(NOW - 1, "gvx"))
    assert g.cause == "hardware" and "network warning" not in g.summary
