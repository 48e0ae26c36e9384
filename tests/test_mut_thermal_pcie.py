"""Thermal and PCIe-replay detectors (gpuvigil/detectors/thermal.py, pcie.py): behaviour that
mutation testing (`make mutate`, docs/testing.md) showed no other test pinned down: the whole
finding (figures, job, summary) and the exact edges (a replay rate exactly at the floor, an
evaluation exactly one window after the baseline).

Source: constructed NVML gpu_samples, as in tests/test_detectors_guards.py. Simulated/constructed
only on purpose: the real H200 series (tests/data/h200/nvml_timeseries.csv) never throttles for a
thermal reason and its PCIe replay counter stays 0, so it can only be a hard negative
(tests/test_detectors_real.py uses it as one).
"""

from __future__ import annotations

import math
import warnings

from gpuvigil import config, schemas
from gpuvigil.detectors.pcie import PcieReplayDetector
from gpuvigil.detectors.thermal import ThermalDetector
from gpuvigil.window import Window

ALLOC = schemas.frame([{"job": "j", "rank": 3, "node": "n0", "gpu": 0}], schemas.ALLOCATIONS)


def _row(t, **vals):
    return schemas.frame([{"ts": t, "node": "n0", "gpu": 0, **vals}], schemas.GPU_SAMPLES)


def _run(det, frames_at, times, alloc=True):
    w = Window(1e9)
    if alloc:
        w.add("allocations", ALLOC)
    out = []
    for t in times:
        w.add("gpu_samples", frames_at(t))
        w.seal(float(t))
        out.append(det.detect(w))
    return out


# -- thermal ---------------------------------------------------------------------------------------


def test_thermal_finding_states_its_figures_reasons_and_job():
    """30 samples, each throttled by software and hardware thermal slowdown (0x20 | 0x40) at
    91.4 °C, 1410 MHz, 612.36 W; the GPU runs rank 3 of job j."""
    out = _run(ThermalDetector(), lambda t: _row(float(t), throttle_reasons=0x60, temperature_c=91.4, sm_clock_mhz=1410.0, power_w=612.36), range(30))
    [f] = out[-1]
    assert (f.kind.value, f.severity.value, f.cause, f.source, f.ts) == ("thermal_throttle", "ticket", "hardware", "thermal", 29.0)
    assert (f.job, f.ranks, f.node, f.gpu) == ("j", [3], "n0", 0)
    assert f.evidence == {"throttled_share": 1.0, "max_temperature_c": 91.4, "sm_clock_mhz": 1410.0, "reasons": ["sw_thermal", "hw_thermal"],
                          "reasons_bitmask": 0x60, "power_w": 612.4}
    assert f.summary == "n0 GPU 0 is throttling (sw_thermal, hw_thermal) at 91 °C, SM clock 1410 MHz, slowing job j rank 3: check its cooling."


def test_thermal_finding_without_temperature_or_job_says_neither():
    """A replay with clock-event reasons (power brake, 0x80) but no temperature or power column,
    on a GPU no job runs on."""
    out = _run(ThermalDetector(), lambda t: _row(float(t), throttle_reasons=0x80, sm_clock_mhz=990.0), range(30), alloc=False)
    [f] = out[-1]
    assert (f.job, f.ranks, f.evidence["max_temperature_c"], f.evidence["power_w"], f.evidence["reasons_bitmask"]) == (None, [], 0.0, 0.0, 0x80)
    assert f.summary == f"n0 GPU 0 is throttling ({', '.join(f.evidence['reasons'])}), SM clock 990 MHz: check its cooling."


def test_thermal_share_is_an_exponential_average_over_the_window():
    """Throttled for 20 s, then clear for 1 s, then throttled again: the share after the clear
    sample is 1 - a, a = 1 - e^(-1 s / window_seconds) (one second's weight lost), still above
    0.8; the next sample is throttled again: reported, with share a + (1 - a)^2."""
    reasons = lambda t: 0 if t == 20 else 0x20  # noqa: E731
    det = ThermalDetector()
    out = _run(det, lambda t: _row(float(t), throttle_reasons=reasons(t), temperature_c=88.0, sm_clock_mhz=1500.0, power_w=500.0), range(22))
    assert out[20] == []  # not throttled right now
    [f] = out[21]
    a = 1 - math.exp(-1 / det.config.window_seconds)
    share = a + (1 - a) * (1 - a)  # after the clear sample (1 - a), then one throttled sample
    assert f.evidence["throttled_share"] == round(share, 2)


# -- PCIe replays ----------------------------------------------------------------------------------


def _pcie(count_at, times, **over):
    det = PcieReplayDetector(config.load(overrides={"detectors": {"pcie": over}}) if over else None)
    return _run(det, lambda t: _row(float(t), pcie_replay_total=count_at(t)), times)


def test_pcie_rate_exactly_at_the_floor_one_window_after_the_baseline_tickets():
    """Baseline at t=0 (0 replays); at t=60, exactly one 60 s window later, 100 replays: exactly
    the 100/min floor. The ticket comes on that tick, with its figures and the job."""
    out = _pcie(lambda t: 100 * t // 60, range(0, 62))
    assert not any(out[:60])
    [f] = out[60]
    assert (f.kind.value, f.severity.value, f.cause, f.source, f.ts) == ("pcie_replay", "ticket", "hardware", "pcie", 60.0)
    assert (f.job, f.ranks, f.node, f.gpu) == ("j", [3], "n0", 0)
    assert f.evidence == {"pcie_replays_per_minute": 100.0, "pcie_replay_total": 100, "window_seconds": 60.0}
    assert f.summary == ("n0 GPU 0 PCIe link replays 100 packets/min (100 so far): the link is degrading; "
                         "schedule the node for maintenance before the GPU falls off the bus.")
    [g] = out[61]  # the verdict holds until the next window
    assert g.evidence == f.evidence


def test_pcie_rate_just_under_the_floor_is_quiet_and_the_next_window_starts_from_the_last_reading():
    """99 replays in the first 60 s (quiet); then 150 more in the next 60 s: that window's rate
    is 150/min, counted from the t=60 reading, not from 0."""
    count = lambda t: 99 * t // 60 if t <= 60 else 99 + 150 * (t - 60) // 60  # noqa: E731
    out = _pcie(count, range(0, 121))
    assert not any(out[:120])
    [f] = out[120]
    assert f.evidence == {"pcie_replays_per_minute": 150.0, "pcie_replay_total": 249, "window_seconds": 60.0}


def test_pcie_samples_without_a_counter_or_a_gpu_are_skipped():
    """dcgm-exporter without the PCIe field (null counter), and a sample with no GPU index, in
    between real readings: they neither reset the baseline nor count."""
    def frames(t):
        rows = [{"ts": float(t), "node": "n0", "gpu": 0, "pcie_replay_total": 100 * t // 60 * 3},
                {"ts": float(t), "node": "n0", "gpu": 1, "pcie_replay_total": None},
                {"ts": float(t), "node": "n0", "gpu": None, "pcie_replay_total": 10**6}]
        return schemas.frame(rows, schemas.GPU_SAMPLES)
    det = PcieReplayDetector()
    out = _run(det, frames, range(0, 61))
    [f] = out[60]
    assert (f.gpu, f.evidence["pcie_replays_per_minute"]) == (0, 300.0)
    assert det._base.select("node", "gpu").rows() == [("n0", 0)]


def test_thermal_samples_without_clock_event_reasons_are_skipped():
    """DCGM without the clock-event field (null reasons) on GPU 1, next to GPU 0 throttled for a
    thermal reason: GPU 1 is not tracked at all, GPU 0 is reported."""
    def frames(t):
        return schemas.frame([{"ts": float(t), "node": "n0", "gpu": 0, "throttle_reasons": 0x20, "temperature_c": 90.0},
                              {"ts": float(t), "node": "n0", "gpu": 1, "throttle_reasons": None, "temperature_c": 95.0}], schemas.GPU_SAMPLES)
    det = ThermalDetector()
    out = _run(det, frames, range(30))
    assert [(f.node, f.gpu) for f in out[-1]] == [("n0", 0)]
    assert det._state.select("node", "gpu").rows() == [("n0", 0)]


def test_thermal_a_very_late_sample_is_absorbed_quietly():
    """A backlog replay delivers a sample 4 h older than the GPU's last one: the exponential
    weight overflows; that must not raise nor warn on every tick (as with polars before)."""
    det = ThermalDetector()
    w = Window(1e9)
    for t in (20000.0, 20001.0, 5600.0):
        w.add("gpu_samples", _row(t, throttle_reasons=0x20, temperature_c=90.0))
        w.seal(20002.0 if t < 20000 else t)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert det.detect(w) == []


def test_pcie_figures_keep_their_tenths():
    """Samples every 0.7 s from t=0, replays at 2 a second: the first reading a window after the
    baseline is at 60.2 s with 120 replays: 119.6/min over 60.2 s, as reported."""
    det = PcieReplayDetector()
    w = Window(1e9)
    found = []
    for k in range(0, 90):
        t = 0.7 * k
        w.add("gpu_samples", _row(t, pcie_replay_total=int(2 * t)))
        w.seal(t)
        found += det.detect(w)
    f = found[0]
    assert f.evidence == {"pcie_replays_per_minute": 119.6, "pcie_replay_total": 120, "window_seconds": 60.2}


def test_thermal_findings_come_least_recently_updated_first():
    """Two throttled GPUs; each tick's frame lists GPU 0 first, but GPU 1's sample is the older
    one (taken at t + 0.1 s, GPU 0's at t + 0.5 s). Findings come in the order the GPUs were
    updated, oldest first: GPU 1, then GPU 0 (the order the join-based version reported in)."""
    def frames(t):
        return schemas.frame([{"ts": t + 0.5, "node": "n0", "gpu": 0, "throttle_reasons": 0x20, "temperature_c": 90.0},
                              {"ts": t + 0.1, "node": "n0", "gpu": 1, "throttle_reasons": 0x20, "temperature_c": 90.0}], schemas.GPU_SAMPLES)
    out = _run(ThermalDetector(), frames, range(30))
    assert [f.gpu for f in out[-1]] == [1, 0]


# -- mutation testing: thermal ---------------------------------------------------------------------


def _gpus(t, rows):
    """rows: [(gpu, reasons, extra values)] on n0 at time t."""
    return schemas.frame([{"ts": float(t), "node": "n0", "gpu": g, "throttle_reasons": r, **v} for g, r, v in rows], schemas.GPU_SAMPLES)


def test_thermal_the_second_sample_is_averaged_with_the_first():
    """Throttled at t=0, clear one `window_seconds` later: share e^-1 = 0.368, not a fresh 0."""
    det = ThermalDetector()
    later = det.config.window_seconds
    _run(det, lambda t: _row(float(t), throttle_reasons=0x20 if t == 0 else 0), [0, later])
    assert math.isclose(det._state["share"][0], math.exp(-1.0), rel_tol=1e-12)


def test_thermal_several_samples_of_a_gpu_in_one_tick_count_by_their_mean():
    """Two samples of GPU 0 a tick (NVML and DCGM both on), one throttled, one not: the first
    tick's share is their mean, 0.5."""
    det = ThermalDetector()
    w = Window(1e9)
    w.add("gpu_samples", schemas.frame([{"ts": 0.2, "node": "n0", "gpu": 0, "throttle_reasons": 0x20},
                                        {"ts": 0.6, "node": "n0", "gpu": 0, "throttle_reasons": 0}], schemas.GPU_SAMPLES))
    w.seal(1.0)
    det.detect(w)
    assert det._state["share"].to_list() == [0.5]


def test_thermal_a_null_reading_of_another_gpu_does_not_blank_the_hot_ones():
    """GPU 1's temperature is missing in every tick; GPU 0 (throttled at 90 °C) keeps its own."""
    rows = lambda t: _gpus(t, [(0, 0x20, {"temperature_c": 90.0, "sm_clock_mhz": 1400.0}), (1, 0, {"temperature_c": None, "sm_clock_mhz": 1400.0})])  # noqa: E731
    [f] = _run(ThermalDetector(), rows, range(30))[-1]
    assert (f.gpu, f.evidence["max_temperature_c"], f.evidence["sm_clock_mhz"]) == (0, 90.0, 1400.0)


def test_thermal_order_follows_the_last_update_across_ticks():
    """GPU 1 is first seen before GPU 0; both throttle from t=0; from t=30 only GPU 1 reports.
    At t=31 GPU 0 is the less recently updated: it comes first."""
    def rows(t):
        if t < 30:
            return _gpus(t, [(1, 0x20, {}), (0, 0x20, {})])
        return _gpus(t, [(1, 0x20, {})])
    out = _run(ThermalDetector(), rows, range(32))
    assert [f.gpu for f in out[-1]] == [0, 1]


def test_thermal_without_a_clock_reading_says_zero_mhz():
    [f] = _run(ThermalDetector(), lambda t: _row(float(t), throttle_reasons=0x20, temperature_c=90.0), range(30))[-1]
    assert f.evidence["sm_clock_mhz"] == 0.0 and ", SM clock 0 MHz" in f.summary


def test_thermal_share_exactly_at_the_minimum_counts():
    """min_throttled_share 1.0 and every sample throttled: share exactly 1.0, reported."""
    det = ThermalDetector(config.load(overrides={"detectors": {"thermal": {"min_throttled_share": 1.0}}}))
    assert _run(det, lambda t: _row(float(t), throttle_reasons=0x20), range(10))[-1]


def test_thermal_names_only_the_reasons_in_its_mask_or_says_clock_events():
    """0x21 = sw_thermal (in the default mask 0xE8) and gpu_idle (not): only sw_thermal is named.
    A mask of an unnamed bit (0x1000) names nothing: 'clock events'."""
    [f] = _run(ThermalDetector(), lambda t: _row(float(t), throttle_reasons=0x21), range(10))[-1]
    assert "is throttling (sw_thermal), SM clock" in f.summary
    det = ThermalDetector(config.load(overrides={"detectors": {"thermal": {"reason_mask": 0x1000}}}))
    [f] = _run(det, lambda t: _row(float(t), throttle_reasons=0x1000), range(10))[-1]
    assert "is throttling (clock events), SM clock" in f.summary


def test_thermal_a_row_without_its_node_is_dropped():
    """A throttled row with no node (a broken exporter line) makes no state and no finding."""
    det = ThermalDetector()
    out = _run(det, lambda t: schemas.frame([{"ts": float(t), "node": None, "gpu": 0, "throttle_reasons": 0x20}], schemas.GPU_SAMPLES), range(12))
    assert out[-1] == [] and det._state.height == 0


# -- mutation testing: PCIe ------------------------------------------------------------------------


def _pcie_rows(t, counts):
    """counts: {(node, gpu): replay total or None}, all sampled at t."""
    return schemas.frame([{"ts": float(t), "node": n, "gpu": g, "pcie_replay_total": c} for (n, g), c in counts.items()], schemas.GPU_SAMPLES)


def test_pcie_two_hot_gpus_both_page_earliest_verdict_first():
    """GPU 1 (first seen) and GPU 0 both replay 200/min from t=0; GPU 0's baseline is taken at
    t=1 (it reports from then), so its verdict comes a tick later. At t=62 both are reported,
    GPU 1 first (earliest verdict), then GPU 0; re-judged at t=120 and t=121 in the same order."""
    def frames(t):
        counts = {("n0", 1): 200 * t // 60}
        if t >= 1:
            counts[("n0", 0)] = 200 * (t - 1) // 60
        return _pcie_rows(t, counts)
    out = _run(PcieReplayDetector(), frames, range(0, 123))
    assert [f.gpu for f in out[60]] == [1]
    assert [f.gpu for f in out[62]] == [1, 0]
    assert [f.gpu for f in out[122]] == [1, 0]


def test_pcie_figures_are_given_to_a_tenth():
    """Baseline at t=0.0; at t=61.37, 173 replays: 169.1 per minute over 61.4 s."""
    det = PcieReplayDetector()
    w = Window(1e9)
    for t, count in ((0.0, 0), (61.37, 173)):
        w.add("gpu_samples", _pcie_rows(t, {("n0", 0): count}))
        w.seal(t)
        out = det.detect(w)
    [f] = out
    assert f.evidence == {"pcie_replays_per_minute": 169.1, "pcie_replay_total": 173, "window_seconds": 61.4}


def test_pcie_rows_missing_a_node_or_a_counter_are_dropped():
    """Beside a healthy GPU: a row with no node (and a huge counter), and a row with a node but
    no counter: neither makes state nor pages."""
    def frames(t):
        rows = [{"ts": float(t), "node": "n0", "gpu": 0, "pcie_replay_total": 0},
                {"ts": float(t), "node": None, "gpu": 1, "pcie_replay_total": 10**6 * t},
                {"ts": float(t), "node": "n1", "gpu": 2, "pcie_replay_total": None}]
        return schemas.frame(rows, schemas.GPU_SAMPLES)
    det = PcieReplayDetector()
    assert not any(_run(det, frames, range(0, 121)))
    assert det._base.select("node", "gpu").rows() == [("n0", 0)]


def test_pcie_a_row_missing_only_its_node_or_only_its_counter_is_dropped_on_its_own():
    """Each defect alone in a tick (not beside another that would trigger the filter anyway)."""
    for bad in ({"ts": 0.0, "node": None, "gpu": 1, "pcie_replay_total": 10**6},
                {"ts": 0.0, "node": "n1", "gpu": 2, "pcie_replay_total": None}):
        def frames(t, bad=bad):
            return schemas.frame([{"ts": float(t), "node": "n0", "gpu": 0, "pcie_replay_total": 0}, {**bad, "ts": float(t),
                                  "pcie_replay_total": None if bad["pcie_replay_total"] is None else bad["pcie_replay_total"] * t}], schemas.GPU_SAMPLES)
        det = PcieReplayDetector()
        assert not any(_run(det, frames, range(0, 121)))
        assert det._base.select("node", "gpu").rows() == [("n0", 0)], bad
