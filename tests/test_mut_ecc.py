"""ECC detector (gpuvigil/detectors/ecc.py): behaviour that mutation testing (`make mutate`,
docs/testing.md) showed no other test pinned down: the whole finding (time, job, XIDs, counters,
NVIDIA's action, the summary), a failed row remap (its own kind, `row_remap_failure`) seen in the
counters or an XID 64, an uncorrectable error without one (`ecc`), and counters that stay put
between ticks.

Sources:
- public: `kernel_dbe_syslog.log` (NVIDIA/gpu-operator#1146: XID 48, a double-bit ECC error,
  then XID 64, a failed page retirement, on worker4), read by the real KernelLogCollector as in
  tests/test_detectors_real.py. The kernel lines carry no GPU index; as a collector that maps
  the PCI address would, they are put on GPU 0;
- constructed: NVML counter samples (`ecc_dbe_volatile_total`, `retired_pages_total`,
  `remap_failure`), as in tests/test_detectors_guards.py.
"""

from __future__ import annotations

import polars as pl
import pytest
from test_detectors_real import _kernel_events, _window_of

from gpuvigil import config, schemas
from gpuvigil.detectors.ecc import EccDetector
from gpuvigil.window import Window

DRAIN = ": drain the node and reset the GPU before it runs anything again."
RMA = ": the GPU can no longer repair its failing memory (NVIDIA's RMA criterion): drain the node and replace the GPU."


def _samples(t, node="n0", gpu=0, dbe=0, retired=0, remap_failure=False):
    return schemas.frame([{"ts": t, "node": node, "gpu": gpu, "ecc_dbe_volatile_total": dbe, "retired_pages_total": retired, "remap_failure": remap_failure}], schemas.GPU_SAMPLES)


def test_real_dbe_finding_says_when_where_whose_job_and_what_to_do():
    """The DBE (XID 48) was followed by XID 64: the row remap that should have hidden it failed,
    NVIDIA's RMA criterion. One finding, of the failed remap's kind, with both XIDs."""
    ev = _kernel_events("kernel_dbe_syslog.log").with_columns(pl.lit(0, pl.Int32).alias("gpu"))
    t48 = float(ev.filter(pl.col("xid") == 48)["ts"][0])
    last = float(ev["ts"].max())
    alloc = schemas.frame([{"job": "train", "rank": 5, "node": "worker4", "gpu": 0}], schemas.ALLOCATIONS)
    [f] = EccDetector().detect(_window_of({"events": ev, "allocations": alloc}, last + 1))
    assert (f.kind.value, f.severity.value, f.cause, f.source) == ("row_remap_failure", "page", "hardware", "ecc")
    assert (f.ts, f.job, f.node, f.gpu, f.xid) == (last, "train", "worker4", 0, 48) and t48 <= last
    assert f.evidence == {"xids": [48, 64], "dbe_new": 0, "dbe_volatile_total": 0, "remapped_rows": 0, "remap_failure": False,
                          "nvidia_action": "RESET_GPU,WORKFLOW_XID_48"}
    assert f.summary == "Row remapping failed on worker4 GPU 0 after an uncorrectable ECC error (XID 48, 64), under job train" + RMA


def test_the_real_dbe_alone_is_an_ecc_error():
    """The same log without its XID 64 line: an uncorrectable error, no failed remap: `ecc`."""
    ev = _kernel_events("kernel_dbe_syslog.log").with_columns(pl.lit(0, pl.Int32).alias("gpu")).filter(pl.col("xid") != 64)
    [f] = EccDetector().detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    assert (f.kind.value, f.evidence["xids"]) == ("ecc", [48])
    assert f.summary == "Uncorrectable ECC error on worker4 GPU 0 (XID 48)" + DRAIN


def test_real_dbe_with_the_counters_of_the_same_gpu_is_one_finding():
    """The same two XIDs, and NVML's counters of that GPU on the same tick: one DBE counted, two
    pages retired, the remap failure flag up. One finding, the failed remap, carries both."""
    ev = _kernel_events("kernel_dbe_syslog.log").with_columns(pl.lit(0, pl.Int32).alias("gpu"))
    now = float(ev["ts"].max()) + 1
    samples = _samples(now, node="worker4", dbe=1, retired=2, remap_failure=True)
    [f] = EccDetector().detect(_window_of({"events": ev, "gpu_samples": samples}, now))
    assert f.evidence == {"xids": [48, 64], "dbe_new": 1, "dbe_volatile_total": 1, "remapped_rows": 2, "remap_failure": True,
                          "nvidia_action": "RESET_GPU,WORKFLOW_XID_48"}
    assert f.kind.value == "row_remap_failure"
    assert (f.job, f.summary) == (None, "Row remapping failed on worker4 GPU 0 after an uncorrectable ECC error (XID 48, 64)" + RMA)


def test_a_remap_failure_seen_only_in_the_counters_pages_as_such():
    """No kernel line, no DBE: NVML reports the row-remap failure flag on n0 GPU 0, under job j."""
    alloc = schemas.frame([{"job": "j", "rank": 1, "node": "n0", "gpu": 0}], schemas.ALLOCATIONS)
    [f] = EccDetector().detect(_window_of({"gpu_samples": _samples(100.0, retired=7, remap_failure=True), "allocations": alloc}, 100.0))
    assert (f.kind.value, f.ts, f.job, f.node, f.gpu, f.xid, f.severity.value) == ("row_remap_failure", 100.0, "j", "n0", 0, None, "page")
    assert f.evidence == {"xids": [], "dbe_new": 0, "dbe_volatile_total": 0, "remapped_rows": 7, "remap_failure": True, "nvidia_action": "DRAIN_AND_RESET"}
    assert f.summary == "Row remapping failed on n0 GPU 0, under job j" + RMA


def test_counters_that_stay_put_page_once_and_a_second_gpu_pages_on_its_own():
    """Ticks 0-4: n0 GPU 0 reads 2 DBEs from tick 1 on (one page, at tick 1). At tick 3 n1 GPU 2
    reads 1 DBE too: one page for it only; n0's unchanged counter stays quiet."""
    det = EccDetector()
    w = Window(1e9)
    got = []
    for t in range(5):
        rows = [_samples(float(t), dbe=2 if t >= 1 else 0)]
        if t >= 3:
            rows.append(_samples(float(t), node="n1", gpu=2, dbe=1))
        w.add("gpu_samples", pl.concat(rows))
        w.seal(float(t))
        got.append([(f.node, f.gpu, f.evidence["dbe_new"], f.evidence["dbe_volatile_total"]) for f in det.detect(w)])
    assert got == [[], [("n0", 0, 2, 2)], [], [("n1", 2, 1, 1)], []]


def test_report_seconds_from_the_configuration_bounds_the_first_tick():
    """public kernel_dbe_syslog.log, first tick 1 s after its last line: with the default hour
    it pages; configured to look back only half a second, the lines are too old to report."""
    ev = _kernel_events("kernel_dbe_syslog.log")
    now = float(ev["ts"].max()) + 1
    assert len(EccDetector().detect(_window_of({"events": ev}, now))) == 1
    short = config.load(overrides={"detectors": {"ecc": {"report_seconds": 0.5}}})
    assert EccDetector(short).detect(_window_of({"events": ev}, now)) == []


def test_a_real_non_memory_xid_is_not_an_ecc_error():
    """public kernel_fallen_off_bus.log (XID 79, 31, 32, 3): none is a memory error; the XID
    detector reports them, the ECC detector does not."""
    ev = _kernel_events("kernel_fallen_off_bus.log")
    assert EccDetector(config.load(overrides={"detectors": {"ecc": {"report_seconds": 1e10}}})).detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1)) == []


def test_an_event_is_reported_once_even_when_the_next_tick_brings_other_news():
    """Tick 10: an XID 94 on n0 GPU 1 stamped exactly 10.0: paged. Tick 11: n0 GPU 0's DBE counter
    rises (news, so the tick is fully evaluated): only that is paged; the XID stamped at the
    previous tick's instant is not reported again."""
    det = EccDetector()
    w = Window(1e9)
    w.add("events", schemas.frame([{"ts": 10.0, "node": "n0", "gpu": 1, "source": "kernel", "kind": "xid", "xid": 94, "message": "contained ECC"}], schemas.EVENTS))
    w.add("gpu_samples", _samples(10.0))
    w.seal(10.0)
    assert [(f.gpu, f.xid) for f in det.detect(w)] == [(1, 94)]
    w.add("gpu_samples", _samples(11.0, dbe=1))
    w.seal(11.0)
    assert [(f.gpu, f.xid, f.evidence["dbe_new"]) for f in det.detect(w)] == [(0, None, 1)]


# -- mutation testing, second pass -----------------------------------------------------------------


def _ticks(det, per_tick):
    """per_tick: [(t, [(node, gpu, dbe), ...])]; the findings of each tick as (node, gpu, new, total)."""
    w = Window(1e9)
    got = []
    for t, readings in per_tick:
        w.add("gpu_samples", pl.concat([_samples(float(t), node=n, gpu=g, dbe=d) for n, g, d in readings]))
        w.seal(float(t))
        got.append([(f.node, f.gpu, f.evidence["dbe_new"], f.evidence["dbe_volatile_total"]) for f in det.detect(w)])
    return got


def test_two_samples_of_one_gpu_in_a_tick_page_a_dbe_once():
    """NVML and DCGM both on: n0 GPU 0 is read twice a tick, the two readings a DBE apart at
    tick 1 (1 and 2). One page then, for both DBEs; nothing while the readings stay; one page for
    the third DBE at tick 5. (Found by mutation testing: compared row by row with the other
    sample's previous value, the same DBE paged again on every tick.)"""
    got = _ticks(EccDetector(), [(0, [("n0", 0, 0)] * 2), (1, [("n0", 0, 1), ("n0", 0, 2)]), (2, [("n0", 0, 1), ("n0", 0, 2)]),
                                 (3, [("n0", 0, 2)] * 2), (4, [("n0", 0, 2)]), (5, [("n0", 0, 2), ("n0", 0, 3)])])
    assert got == [[], [("n0", 0, 2, 2)], [], [], [], [("n0", 0, 1, 3)]]


def test_a_gpu_missing_from_a_tick_keeps_its_previous_counters():
    """n0 GPU 0 and n1 GPU 2 each read 1 DBE from tick 0 (paged then); n1's sample is missing at
    tick 1 and back, unchanged, at tick 2: no second page."""
    got = _ticks(EccDetector(), [(0, [("n0", 0, 1), ("n1", 2, 1)]), (1, [("n0", 0, 1)]), (2, [("n0", 0, 1), ("n1", 2, 1)])])
    assert got == [[("n0", 0, 1, 1), ("n1", 2, 1, 1)], [], []]


def test_ecc_events_from_a_non_xid_source_page():
    """An `ecc_dbe` or `ecc` event (DCGM's or NVML's own, no XID) pages for its GPU; a `thermal`
    event beside it does not."""
    for kind in ("ecc_dbe", "ecc"):
        w = Window(1e9)
        w.add("events", schemas.frame([{"ts": 5.0, "node": "n3", "gpu": 1, "source": "dcgm", "kind": kind, "xid": None, "message": "x"},
                                       {"ts": 5.0, "node": "n4", "gpu": 0, "source": "dcgm", "kind": "thermal", "xid": None, "message": "x"}], schemas.EVENTS))
        w.seal(5.0)
        [f] = EccDetector().detect(w)
        assert (f.node, f.gpu, f.xid, f.ts, f.evidence["xids"]) == ("n3", 1, None, 5.0, []), kind


def test_a_gpu_that_does_not_report_remap_status_is_not_called_a_remap_failure():
    """A DBE on a GPU whose NVML has no row-remapping status (null): an uncorrectable ECC error,
    `remap_failure` false."""
    w = Window(1e9)
    w.add("gpu_samples", _samples(1.0, dbe=1, remap_failure=None))
    w.seal(1.0)
    [f] = EccDetector().detect(w)
    assert f.evidence["remap_failure"] is False and f.summary.startswith("Uncorrectable ECC error on n0 GPU 0")
    assert f.kind.value == "ecc"


@pytest.mark.parametrize(
    ("flag", "xid", "dbe", "kind", "wording"),
    [
        # the remap failure flag up (NVML's failureOccurred, DCGM_FI_DEV_ROW_REMAP_FAILURE): the failed remap, whatever else
        (True, None, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0"),  # only the counters
        (True, 64, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 (XID 64)"),
        (True, 92, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 (XID 92)"),  # a high single-bit rate: not uncorrectable
        (True, 48, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 after an uncorrectable ECC error (XID 48)"),
        (True, 63, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 after an uncorrectable ECC error (XID 63)"),
        (True, 94, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 after an uncorrectable ECC error (XID 94)"),
        (True, 95, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 after an uncorrectable ECC error (XID 95)"),
        (True, None, 1, "row_remap_failure", "Row remapping failed on n0 GPU 0 after an uncorrectable ECC error"),  # a new DBE counted
        # the flag down: XID 64 alone says the remap failed; any other uncorrectable error is `ecc`
        (False, 64, 0, "row_remap_failure", "Row remapping failed on n0 GPU 0 (XID 64)"),
        (False, 48, 0, "ecc", "Uncorrectable ECC error on n0 GPU 0 (XID 48)"),
        (False, 63, 0, "ecc", "Uncorrectable ECC error on n0 GPU 0 (XID 63)"),
        (False, 92, 0, "ecc", "Uncorrectable ECC error on n0 GPU 0 (XID 92)"),
        (False, 94, 0, "ecc", "Uncorrectable ECC error on n0 GPU 0 (XID 94)"),
        (False, 95, 0, "ecc", "Uncorrectable ECC error on n0 GPU 0 (XID 95)"),
        (False, None, 1, "ecc", "Uncorrectable ECC error on n0 GPU 0"),
        (None, None, 1, "ecc", "Uncorrectable ECC error on n0 GPU 0"),  # a GPU that does not report remap status
    ],
)
def test_a_failed_remap_is_its_own_kind_and_an_uncorrectable_error_without_one_is_ecc(flag, xid, dbe, kind, wording):
    w = Window(1e9)
    w.add("gpu_samples", _samples(1.0, dbe=dbe, remap_failure=flag))
    if xid is not None:
        w.add("events", schemas.frame([{"ts": 1.0, "node": "n0", "gpu": 0, "source": "kernel", "kind": "xid", "xid": xid, "message": "x"}], schemas.EVENTS))
    w.seal(1.0)
    [f] = EccDetector().detect(w)
    assert f.kind.value == kind and f.summary == wording + (RMA if kind == "row_remap_failure" else DRAIN), f.summary
    assert (f.severity.value, f.cause, f.node, f.gpu) == ("page", "hardware", "n0", 0)
    assert f.evidence["remap_failure"] is bool(flag) and f.evidence["dbe_new"] == dbe


def test_a_failed_remap_pages_each_tick_it_is_read_as_one_finding():
    """The flag stays up (NVML: "a remapping has failed in the past"): each tick reads it and
    reports the same finding (one identity: the device), never one per job that holds the GPU."""
    det = EccDetector()
    w = Window(1e9)
    ids = []
    for t, job in ((1.0, "a"), (2.0, "a"), (3.0, "b")):
        w.add("allocations", schemas.frame([{"job": job, "rank": 0, "node": "n0", "gpu": 0}], schemas.ALLOCATIONS))
        w.add("gpu_samples", _samples(t, remap_failure=True))
        w.seal(t)
        [f] = det.detect(w)
        assert (f.kind.value, f.job) == ("row_remap_failure", job)
        ids.append(f.id)
    assert len(set(ids)) == 1


def test_the_codes_that_say_a_remap_failed_come_from_the_configuration():
    cfg = config.load(overrides={"detectors": {"ecc": {"remap_failure_codes": [], "uncorrectable_codes": [48, 63, 64, 94, 95]}}})
    w = Window(1e9)
    w.add("events", schemas.frame([{"ts": 1.0, "node": "n0", "gpu": 0, "source": "kernel", "kind": "xid", "xid": 64, "message": "x"}], schemas.EVENTS))
    w.seal(1.0)
    [f] = EccDetector(cfg).detect(w)
    assert f.kind.value == "ecc" and f.summary.startswith("Uncorrectable ECC error on n0 GPU 0 (XID 64)")
