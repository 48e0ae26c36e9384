"""XID detector (gpuvigil/detectors/xid.py): behaviour that mutation testing (`make mutate`,
docs/testing.md) showed no other test pinned down: a window holding a single XID, and the edge of
the report window (an XID exactly `report_seconds` old is still reported, both by the early
return and by the filter).

Source: public kernel logs, read by the real KernelLogCollector as in tests/test_detectors_real.py:
`kernel_xids.log` (leptonai/gpud#46: XID 13 x3 and XID 109) and `kernel_fallen_off_bus.log`
(XID 79, 31, 32, 3). Only `now` is chosen here.
"""

from __future__ import annotations

import polars as pl
import pytest
from test_detectors_real import _cfg, _kernel_events, _window_of

from gpuvigil import schemas
from gpuvigil.detectors.xid import XidDetector


def test_a_single_real_xid_in_the_window_is_reported():
    """public kernel_xids.log: only its XID 109 line (CTX SWITCH TIMEOUT under pt_main_thread)
    is in the window: one page, with its count and message."""
    ev = _kernel_events("kernel_xids.log").filter(pl.col("xid") == 109)
    assert ev.height == 1
    [f] = XidDetector().detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    assert (f.xid, f.severity.value, f.cause, f.evidence["count"], f.node) == (109, "page", "hardware", 1, "node-a")
    assert "CTX SWITCH TIMEOUT" in f.evidence["message"]
    # no GPU index in the kernel line and no job known: the summary says so, never "GPU None"
    assert (f.job, f.ranks, f.gpu) == (None, [], None)
    assert f.summary == "XID 109 (Context switch timeout error) on node-a (GPU unknown): fatal, cordon the node; NVIDIA action RESET_GPU."


def test_an_xid_exactly_report_seconds_old_is_still_reported():
    """public kernel_fallen_off_bus.log: at now = the last line + 600 s (the default
    report_seconds) that last line is exactly on the edge and still reported; the earlier lines
    are older and left out. Half a second later nothing is."""
    ev = _kernel_events("kernel_fallen_off_bus.log")
    last = float(ev["ts"].max())
    now = last + 600.0
    assert now - 600.0 == last  # whole-second kernel timestamps: the edge is exact
    newest = ev.filter(pl.col("ts") == last)["xid"].to_list()
    found = XidDetector().detect(_window_of({"events": ev}, now))
    assert sorted(f.xid for f in found) == sorted(newest) and found
    assert all(f.ts == last for f in found)
    assert XidDetector().detect(_window_of({"events": ev}, now + 0.5)) == []
    # the same edge with a wider window: every line is reported (the edge is the only guard here)
    assert {f.xid for f in XidDetector(_cfg(xid={"report_seconds": 1e10})).detect(_window_of({"events": ev}, now))} == {79, 31, 32, 3}


def test_each_real_xid_finding_says_what_it_is_what_to_do_and_whose_job():
    """public kernel_fallen_off_bus.log: XID 79, 32, 31 on node-a and XID 3 (a code the table
    does not know) on localhost. The kernel lines carry no GPU index; as a collector that maps the
    PCI address would, they are put on GPU 0. The scheduler runs job `train` (rank 3) on node-a
    GPU 0; the localhost line carries its own job from the job map. Each finding states the
    table's meaning and NVIDIA's action, fatality, and the job."""
    ev = _kernel_events("kernel_fallen_off_bus.log").with_columns(
        pl.lit(0, pl.Int32).alias("gpu"), pl.when(pl.col("node") == "localhost").then(pl.lit("other")).otherwise(pl.col("job")).alias("job"))
    alloc = schemas.frame([{"job": "train", "rank": 3, "node": "node-a", "gpu": 0}], schemas.ALLOCATIONS)
    found = XidDetector(_cfg(xid={"report_seconds": 1e10})).detect(_window_of({"events": ev, "allocations": alloc}, float(ev["ts"].max()) + 1))
    got = {f.xid: f for f in found}
    assert sorted(got) == [3, 31, 32, 79]
    f = got[79]
    assert (f.severity.value, f.cause, f.job, f.ranks, f.node, f.gpu) == ("page", "hardware", "train", [3], "node-a", 0)
    t79 = float(ev.filter(pl.col("xid") == 79)["ts"][0])
    assert (f.kind.value, f.source, f.ts) == ("xid", "xid", t79)
    assert f.evidence == {"xid": 79, "fatal": True, "action": "RESTART_BM", "meaning": "GPU has fallen off the bus", "count": 1, "first_ts": t79, "message": "GPU has fallen off the bus.",
                          "fault": "infrastructure"}
    assert f.summary == "XID 79 (GPU has fallen off the bus) on node-a GPU 0 under job train: fatal, cordon the node; NVIDIA action RESTART_BM."
    f = got[31]
    assert (f.severity.value, f.cause, f.job, f.evidence["meaning"], f.evidence["action"]) == ("ticket", "software", "train", "GPU memory page fault (MMU error)", "RESTART_APP")
    # an application-level XID under one job only: the application's, its owner is told
    assert (f.evidence["fault"], f.evidence["app_level"], f.evidence["jobs_hit"]) == ("user", True, ["train"])
    f = got[3]
    # a code the table does not know: its cause is not said (as the kernel-log reader says it)
    assert (f.severity.value, f.cause, f.job, f.ranks, f.node) == ("ticket", None, "other", [], "localhost")
    assert (f.evidence["meaning"], f.evidence["action"], f.evidence["fatal"]) == ("unknown XID (not in the table)", "CONTACT_SUPPORT", False)
    assert f.summary == "XID 3 (unknown XID (not in the table)) on localhost GPU 0 under job other: application-level; NVIDIA action CONTACT_SUPPORT."


@pytest.mark.parametrize(
    "name, xid, severity",
    [
        # public leptonai/gpud#1174: an NVLink5 RLW error whose own text says "Nonfatal": a ticket
        ("corpus/xid_gpud_1174_145.log", 145, "ticket"),
        # public leptonai/gpud#1160: NETIR errors that say "Fatal": a page
        ("corpus/xid_gpud_1160_149.log", 149, "page"),
    ],
)
def test_an_nvlink5_xid_is_as_fatal_as_its_own_message_says(name, xid, severity):
    ev = _kernel_events(name)
    [f] = XidDetector(_cfg(xid={"report_seconds": 1e10})).detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    assert (f.xid, f.severity.value, f.evidence["fatal"], f.evidence["action"]) == (xid, severity, severity == "page", "WORKFLOW_NVLINK5_ERR")
