"""L0 hang detector (gpuvigil/detectors/hang_device.py): behaviour that mutation testing (`make
mutate`, docs/testing.md) showed no other test pinned down: the whole evidence of a finding, the
odd GPU's util exactly at `util_absent`, a silent GPU named as such.

Source: device telemetry built from the numbers of public incident reports, with the helpers of
tests/test_levels.py: huggingface/accelerate#3104 (8×H100, 7 GPUs at 100% util on ~116 W, one
at 0% util; healthy H100s draw ~600 W, NVIDIA-NeMo#9291) and rwth-i6/returnn#1484 (the lost GPU
answers nothing during the all_reduce hang).
"""

from __future__ import annotations

import polars as pl
import pytest
from levels_helpers import allocations, cfg_with, gpu_rows, play
from test_levels import _hang_ticks

from gpuvigil import schemas
from gpuvigil.detectors.hang_device import DeviceHangDetector

WAITING = {"util_ratio": 1.0, "power_w": 116.0}


def test_odd_gpu_exactly_at_the_absent_util_is_the_culprit_with_the_whole_evidence():
    """accelerate#3104 with the odd GPU at exactly util_absent (0.1, not 0): still the culprit."""
    [f, *_] = play(DeviceHangDetector(), _hang_ticks(600.0, WAITING, {3: {"util_ratio": 0.1, "power_w": 113.0}}))
    assert (f.culprit_ranks, f.gpu, f.cause, f.ts) == ([3], 3, "software", 86.0)
    assert f.evidence == {
        "level": "L0", "stalled_seconds": 25.0, "hold_seconds": 25.0, "waiting_gpus": 7, "gpus": 8, "culprit_gpus": ["n0:3"],
        "silent_ranks": [], "waiting_util_median": 1.0, "waiting_power_w_median": 116.0, "busy_power_w_median": 600.0,
        "waiting_sm_active_median": None, "xids": [],
    }
    assert f.summary == ("job looks hung from its GPUs (L0): 7 of 8 GPUs spin at 100% util on 116.0 W (busy: 600.0 W) for 25 s; "
                         "rank 3 (n0 GPU 3) differ(s) (util 0: its rank never entered the collective).")


def test_a_gpu_that_answers_nothing_is_a_silent_culprit():
    """returnn#1484: GPU 5 reads nothing (util and power null) while the others spin."""
    [f, *_] = play(DeviceHangDetector(), _hang_ticks(600.0, {"util_ratio": 1.0, "power_w": 150.0}, {5: {"util_ratio": None, "power_w": None}}))
    assert (f.culprit_ranks, f.evidence["silent_ranks"], f.evidence["culprit_gpus"], f.cause) == ([5], [5], ["n0:5"], "hardware")



# --- mutation testing: what the surviving mutants of hang_device.py showed untested ---------------
# Same sources: busy H100/H200 GPUs draw ~600 W at 100% util, a hung collective spins at 100% util
# on ~116 W (accelerate#3104); NVLink/PCIe bytes collapse with the work (docs/detectors.md). The
# values below are placed exactly on each threshold (binary-exact where a product is compared).

BUSY = {"util_ratio": 1.0, "power_w": 600.0}
SPIN = {"util_ratio": 1.0, "power_w": 116.0}
NVL = ("nvlink_tx_bytes_per_second", "nvlink_rx_bytes_per_second")
ALL4 = (*NVL, "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")


def _series(reading, *, gpus=8, seconds=120, events=None):
    """One tick a second from t=1 for `gpus` GPUs of node n0 (rank = GPU index); `reading(t, g)`
    gives GPU g's sample at t, or None for no row at all. `events` maps t to event rows."""
    nodes = [("n0", g) for g in range(gpus)]
    alloc = allocations("job", nodes)
    for t in range(1, seconds + 1):
        rows = [{"node": n, "gpu": g, **r} for n, g in nodes if (r := reading(t, g)) is not None]
        frames = {"gpu_samples": gpu_rows(float(t), rows), "allocations": alloc}
        if events and t in events:
            frames["events"] = schemas.frame(events[t], schemas.EVENTS)
        yield float(t), frames


def _phases(busy, hang, *, healthy=60, odd=None):
    """`healthy` s of `busy`, then every GPU reads `hang` (GPU i reads `odd[i]` where given)."""
    return lambda t, g: busy if t <= healthy else (odd or {}).get(g, hang)


def _first_page(reading, **kw):
    det = DeviceHangDetector(cfg_with("hang_device", **kw.pop("cfg", {})))
    found = play(det, _series(reading, **kw))
    return found[0] if found else None


def _links(cols, v):
    return {c: v for c in cols}


LINK_CASES = {
    # NVLink only (no PCIe counters): bytes fall to exactly 10% (quiet_link_ratio) of the busy baseline
    "nvlink at exactly 10% of busy is quiet": ({**BUSY, **_links(NVL, 16e9)}, {**SPIN, NVL[0]: 3.2e9, NVL[1]: 0.0}, True),
    # all four counters, the residual traffic on one of them only
    "four links at exactly 10% of busy are quiet": ({**BUSY, **_links(ALL4, 8e9)}, {**SPIN, **_links(ALL4, 0.0), ALL4[0]: 3.2e9}, True),
    "four links just above 10% are not quiet": ({**BUSY, **_links(ALL4, 8e9)}, {**SPIN, **_links(ALL4, 1.1e9), ALL4[0]: 0.0}, False),
    # counters present but no traffic while busy (one GPU's job, or no peer traffic): no link baseline
    "no link traffic while busy: links are not compared": ({**BUSY, **_links(ALL4, 0.0)}, {**SPIN, **_links(ALL4, 0.0), ALL4[0]: 1000.0}, True),
    "a link baseline of 1 B/s is compared": ({**BUSY, **_links(ALL4, 0.0), ALL4[2]: 1.0}, {**SPIN, **_links(ALL4, 0.0), ALL4[2]: 1000.0}, False),
}


@pytest.mark.parametrize("case", list(LINK_CASES))
def test_link_bytes_against_their_busy_baseline(case):
    busy, hang, pages = LINK_CASES[case]
    assert (_first_page(_phases(busy, hang)) is not None) is pages, case


EDGE_CASES = {
    "busy samples at exactly 50% util make the baseline": (dict(reading=_phases({**BUSY, "util_ratio": 0.5}, SPIN)), True),
    "power exactly 45% of the busy baseline is quiet (and does not feed the baseline)": (dict(reading=_phases(BUSY, {**SPIN, "power_w": 270.0})), True),
    "exactly min_baseline_samples busy samples are a baseline": (dict(reading=_phases(BUSY, SPIN, healthy=5)), True),
    "one busy sample fewer is none": (dict(reading=_phases(BUSY, SPIN, healthy=4)), False),
    "SM active exactly 0.35 and tensor active exactly 0.05 are quiet": (dict(reading=_phases(BUSY, {**SPIN, "sm_active_ratio": 0.35, "tensor_active_ratio": 0.05})), True),
    "util exactly util_pinned (0.9) is waiting": (dict(reading=_phases(BUSY, {**SPIN, "util_ratio": 0.9})), True),
    "a job of exactly min_gpus (2) is judged": (dict(reading=_phases(BUSY, SPIN), gpus=2), True),
    "exactly half the GPUs waiting, the rest absent": (dict(reading=_phases(BUSY, SPIN, odd={g: {"util_ratio": 0.0, "power_w": 90.0} for g in range(4)})), True),
    "fewer than half waiting": (dict(reading=_phases(BUSY, SPIN, odd={g: {"util_ratio": 0.0, "power_w": 90.0} for g in range(5)})), False),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_threshold_edges(case):
    kw, pages = EDGE_CASES[case]
    assert (_first_page(**kw) is not None) is pages, case


def test_a_gpu_that_sends_no_rows_at_all_is_the_silent_culprit():
    """A 2-GPU job: GPU 1 falls off the bus (its rows stop: no util, no power, nothing), GPU 0
    spins. The one fresh row of a tick is enough to judge the job."""
    f = _first_page(lambda t, g: BUSY if t <= 60 else (SPIN if g == 0 else None), gpus=2)
    assert (f.culprit_ranks, f.evidence["silent_ranks"], f.cause, f.gpu) == ([1], [1], "hardware", 1)


def test_a_rank_whose_gpu_was_never_busy_is_the_culprit():
    """GPU 3's rank never started (util 0 from the first second: no busy baseline of its own) while
    the others trained and then spin."""
    f = _first_page(lambda t, g: {"util_ratio": 0.0, "power_w": 90.0} if g == 3 else (BUSY if t <= 60 else SPIN))
    assert (f.culprit_ranks, f.gpu, f.cause, f.node, f.source) == ([3], 3, "software", "n0", "hang_device")


def _spin_phases(*phases):
    """Every GPU busy except during the given (start, end) seconds, when all spin alike."""
    return lambda t, g: SPIN if any(a <= t <= b for a, b in phases) else BUSY


def test_a_waiting_phase_that_ended_by_itself_raises_the_bar():
    """All GPUs spin t=61..80 (19 s: under the 25 s hold), then train again: a phase that ended by
    itself (a host-side straggler makes its peers spin like this). The hang from t=101 must then
    last 1.5 x 19 = 28.5 s before it pages: at t=130, not t=126."""
    det = DeviceHangDetector()
    found = play(det, _series(_spin_phases((61, 80), (101, 200)), seconds=140))
    f = found[0]
    assert (f.ts, f.evidence["hold_seconds"], f.evidence["stalled_seconds"]) == (130.0, 28.5, 29.0)


def test_the_longest_phase_that_ended_by_itself_sets_the_bar():
    """Two phases end by themselves, 19 s then 9 s: the longer one counts (hold 28.5 s)."""
    found = play(DeviceHangDetector(), _series(_spin_phases((61, 80), (91, 100), (121, 300)), seconds=160))
    assert (found[0].ts, found[0].evidence["hold_seconds"]) == (150.0, 28.5)


def test_a_break_of_exactly_the_gap_tolerance_does_not_end_the_phase():
    """Spinning from t=61, broken by 5 s of busy readings (t=71..75, `gap_tolerance_seconds`), then
    spinning again: one phase, paged 25 s after t=61."""
    found = play(DeviceHangDetector(), _series(_spin_phases((61, 70), (76, 200)), seconds=100))
    assert (found[0].ts, found[0].evidence["stalled_seconds"]) == (86.0, 25.0)


def _xid(ts, kind="xid", xid=79, node="n0"):
    return [{"ts": ts, "node": node, "gpu": 3, "source": "kernel", "kind": kind, "xid": xid, "job": None, "rank": None, "message": f"NVRM: Xid {xid}"}]


@pytest.mark.parametrize(
    ("case", "events", "cause", "xids"),
    [
        ("an XID on the culprit's node within the look-back", {70: _xid(70.0)}, "hardware", [79]),
        ("an XID exactly 120 s before the page", {6: _xid(6.0)}, "hardware", [79]),
        ("an XID 121 s before the page is too old", {5: _xid(5.0)}, "software", []),
        ("an event that is no XID or DBE", {70: _xid(70.0, kind="nccl_warn", xid=None)}, "software", []),
        ("an XID on another node", {70: _xid(70.0, node="n9")}, "software", []),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_hardware_evidence_on_the_culprit_node(case, events, cause, xids):
    """accelerate#3104's shape (GPU 3 at util 0 while 7 spin, paged at t=126 after 60 s of
    training at 600 W and the 25 s hold from t=101... here from t=101) with kernel events."""
    reading = lambda t, g: BUSY if t <= 100 else ({"util_ratio": 0.0, "power_w": 90.0} if g == 3 else {**SPIN, "power_w": 116.0625})  # noqa: E731
    f = _first_page(reading, events=events, seconds=130)
    assert (f.ts, f.cause, f.evidence["xids"]) == (126.0, cause, xids), case
    assert f.evidence["waiting_power_w_median"] == 116.062  # rounded to 3 places


def test_several_culprits_name_their_first_node_but_no_single_gpu_and_list_at_most_16():
    """A 40-GPU job: 20 spin, 20 ranks (0-19) sit at util 0. The finding names the node of the
    first culprit, no single GPU, lists 16 culprit GPUs in rank order and says there are more."""
    absent = {g: {"util_ratio": 0.0, "power_w": 90.0} for g in range(20)}
    f = _first_page(_phases(BUSY, SPIN, odd=absent), gpus=40)
    assert (f.culprit_ranks, f.node, f.gpu) == (list(range(20)), "n0", None)
    assert f.evidence["culprit_gpus"] == [f"n0:{g}" for g in range(16)]
    assert "rank 3 (n0 GPU 3) and more differ(s)" in f.summary


def test_figures_of_a_waiting_phase_read_from_its_gpus():
    """The GPUs spin at exactly util_pinned (90%) with DCGM's SM active at 0.35: the summary gives
    90% and the evidence the SM activity; stalled and held seconds are floats."""
    f = _first_page(_phases(BUSY, {**SPIN, "util_ratio": 0.9, "sm_active_ratio": 0.35}))
    assert f.summary.startswith("job looks hung from its GPUs (L0): 8 of 8 GPUs spin at 90% util on 116.0 W (busy: 600.0 W) for 25 s; every GPU waits alike")
    assert (f.evidence["waiting_util_median"], f.evidence["waiting_sm_active_median"], f.node, f.gpu, f.cause) == (0.9, 0.35, None, None, None)
    assert isinstance(f.evidence["stalled_seconds"], float) and isinstance(f.evidence["hold_seconds"], float)


# --- mutation testing, second pass: the rest of the survivors (summary wording, finding fields, DBE evidence) ---


def test_a_double_bit_ecc_error_on_the_culprits_node_is_hardware_evidence():
    """accelerate#3104's shape with a double-bit ECC event (no XID number) on n0 during the hang:
    the cause is hardware, and no XID is listed."""
    reading = lambda t, g: BUSY if t <= 100 else ({"util_ratio": 0.0, "power_w": 90.0} if g == 3 else SPIN)  # noqa: E731
    f = _first_page(reading, events={110: _xid(110.0, kind="ecc_dbe", xid=None)}, seconds=130)
    assert (f.ts, f.cause, f.evidence["xids"], f.culprit_ranks) == (126.0, "hardware", [], [3])


def test_every_field_of_a_single_culprit_finding():
    """The fields the alert and the scheduler read: job, ranks, culprit, node, GPU, source."""
    f = _first_page(_phases(BUSY, SPIN, odd={3: {"util_ratio": 0.0, "power_w": 90.0}}))
    assert (f.job, f.ranks, f.culprit_ranks, f.node, f.gpu, f.source, f.severity.value) == ("job", [3], [3], "n0", 3, "hang_device", "page")


def test_a_silent_gpu_is_named_gone_in_the_summary():
    """returnn#1484: the lost GPU answers nothing; the summary says why it is the culprit."""
    f = _first_page(_phases(BUSY, SPIN, odd={5: {"util_ratio": None, "power_w": None}}))
    assert f.summary.endswith("rank 5 (n0 GPU 5) differ(s) (no telemetry: the GPU is gone).")


@pytest.mark.parametrize(
    ("culprits", "listed"),
    [
        (2, "rank 0 (n0 GPU 0), rank 1 (n0 GPU 1) differ(s)"),
        (4, "rank 0 (n0 GPU 0), rank 1 (n0 GPU 1), rank 2 (n0 GPU 2), rank 3 (n0 GPU 3) differ(s)"),
        (5, "rank 0 (n0 GPU 0), rank 1 (n0 GPU 1), rank 2 (n0 GPU 2), rank 3 (n0 GPU 3) and more differ(s)"),
    ],
)
def test_the_summary_lists_four_culprits_then_says_there_are_more(culprits, listed):
    """A 12-GPU job whose first `culprits` ranks sit at util 0 while the rest spin."""
    absent = {g: {"util_ratio": 0.0, "power_w": 90.0} for g in range(culprits)}
    f = _first_page(_phases(BUSY, SPIN, odd=absent), gpus=12)
    assert f.summary.endswith(f"; {listed} (util 0: its rank never entered the collective).")


def test_a_one_gpu_job_is_judged_when_min_gpus_allows_it():
    """An operator who sets `min_gpus: 1` gets single-GPU jobs judged (a kernel spinning at full
    util on idle power): the detector must page for it, not fail on a job of one row."""
    f = _first_page(_phases(BUSY, SPIN), gpus=1, cfg={"min_gpus": 1})
    assert (f.job, f.culprit_ranks, f.evidence["gpus"]) == ("job", [], 1)


def _two_jobs(first_hangs_at, second_hangs_at, names):
    """Jobs `names[0]` on n0 and `names[1]` on n1 (4 GPUs each) train at 600 W, then spin from the
    given seconds on."""
    alloc = pl.concat([allocations(names[0], [("n0", g) for g in range(4)]), allocations(names[1], [("n1", g) for g in range(4)])])
    for t in range(1, 121):
        rows = [{"node": n, "gpu": g, **(SPIN if t >= start else BUSY)} for n, start in (("n0", first_hangs_at), ("n1", second_hangs_at)) for g in range(4)]
        yield float(t), {"gpu_samples": gpu_rows(float(t), rows), "allocations": alloc}


@pytest.mark.parametrize("names", [("a", "b"), ("b", "a")])
def test_a_job_still_under_its_hold_does_not_hide_another_that_is_past_it(names):
    """Two jobs spin at once: the one on n1 since t=61 pages at t=86 although the one on n0
    (since t=81) is not yet past its hold on that tick (the page repeats each tick while it lasts); n0's
    first page is at t=106. Both name orders."""
    first = {}
    for f in play(DeviceHangDetector(), _two_jobs(81, 61, names)):
        first.setdefault(f.job, f.ts)
    assert first == {names[1]: 86.0, names[0]: 106.0}
