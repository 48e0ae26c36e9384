"""The thermal, PCIe and ECC detectors after their per-tick cost was cut (numpy per-GPU slots,
ECC's quiet-tick shortcut) give exactly the findings, in the same order, of the frame-join code
they replaced (tests/fast_detector_oracles.py), on random streams: several samples of one GPU in
a tick, GPUs that come and go, nulls, counter resets, XID/ECC events, jobs on some GPUs."""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyp import examples

from fast_detector_oracles import JoinEcc, JoinPcie, JoinThermal
from gpuvigil import schemas
from gpuvigil.detectors.ecc import EccDetector
from gpuvigil.detectors.pcie import PcieReplayDetector
from gpuvigil.detectors.thermal import ThermalDetector
from gpuvigil.window import Window

GPUS = [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 3)]


@st.composite
def gpu_series(draw):
    """Ticks of (now, gpu_samples rows, events rows)."""
    n_ticks = draw(st.integers(3, 30))
    pcie = dict.fromkeys(GPUS, 0)
    dbe = dict.fromkeys(GPUS, 0)
    ticks = []
    for i in range(n_ticks):
        now = 1_764_000_000.0 + 5.0 * (i + 1)
        rows, events = [], []
        for g in GPUS:
            for k in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
                pcie[g] = draw(st.sampled_from([pcie[g], pcie[g] + 7, pcie[g] + 400, 0]))
                dbe[g] = draw(st.sampled_from([dbe[g], dbe[g], dbe[g] + 1, 0]))
                rows.append(
                    {
                        # same-time samples too: ties must resolve as before
                        "ts": now - draw(st.sampled_from([0.0, 0.0, 1.25, 2.5, 4.0])),
                        "node": g[0],
                        "gpu": g[1],
                        "throttle_reasons": draw(st.sampled_from([None, 0, 0x20, 0x40, 0x48, 0x4, 0x8])),
                        "temperature_c": draw(st.sampled_from([None, 60.0, 88.5, 91.0])),
                        "sm_clock_mhz": draw(st.sampled_from([None, 1200.0, 1980.0])),
                        "power_w": draw(st.sampled_from([None, 300.0, 612.34])),
                        "pcie_replay_total": draw(st.sampled_from([pcie[g], pcie[g], None])),
                        "ecc_dbe_volatile_total": draw(st.sampled_from([dbe[g], dbe[g], None])),
                        "retired_pages_total": draw(st.sampled_from([None, 0, 3])),
                        "remap_failure": draw(st.sampled_from([None, False, False, True])),
                    }
                )
        for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
            g = draw(st.sampled_from(GPUS))
            kind, xid = draw(st.sampled_from([("xid", 48), ("xid", 64), ("xid", 79), ("xid", 94), ("ecc_dbe", None), ("xid", 13)]))
            events.append({"ts": now - draw(st.sampled_from([0.0, 3.0])), "node": g[0], "gpu": g[1], "source": "dcgm", "kind": kind, "xid": xid, "message": f"XID {xid}"})
        ticks.append((now, schemas.frame(rows, "gpu_samples"), schemas.frame(events, "events")))
    alloc = schemas.frame([{"job": "train", "rank": r, "node": n, "gpu": g} for r, (n, g) in enumerate(GPUS[: draw(st.integers(0, 4))])], "allocations")
    return ticks, alloc


CFG = {
    "detectors": {
        "thermal": {"min_samples": 2, "window_seconds": 10.0, "min_throttled_share": 0.5},
        "pcie": {"window_seconds": 8.0, "min_replays_per_minute": 50.0},
        "ecc": {"report_seconds": 20.0},
    }
}


def _dicts(findings):
    out = [f.to_json_dict() for f in findings]
    # ECC's frame code groups without keeping order (its findings come in any order): compare
    # ECC's as a set; thermal's and PCIe's order is deterministic and must match.
    return sorted(out, key=lambda f: (f["node"], f["gpu"])) if out and out[0]["source"] == "ecc" else out


def _compare(ticks, alloc, pairs):
    w = Window(60.0)
    positives = 0
    for i, (now, rows, events) in enumerate(ticks):
        w.add("gpu_samples", rows)
        w.add("events", events)
        w.add("allocations", alloc)
        w.seal(now)
        for fast, old in pairs:
            want = _dicts(old.detect(w))
            positives += bool(want)
            assert _dicts(fast.detect(w)) == want, f"{fast.name}: tick {i}"
    return positives


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(gpu_series())
def test_fast_per_gpu_detectors_match_the_join_code(series):
    ticks, alloc = series
    pairs = [(ThermalDetector(CFG), JoinThermal(CFG)), (PcieReplayDetector(CFG), JoinPcie(CFG)), (EccDetector(CFG), JoinEcc(CFG))]
    _compare(ticks, alloc, pairs)


@pytest.mark.parametrize("cfg", [None, CFG], ids=["defaults", "sensitive"])
def test_fast_per_gpu_detectors_match_on_a_fleet_with_faults(cfg):
    """A deterministic fleet where each detector fires, so the comparison is not vacuous."""
    ticks = []
    for i in range(40):
        now = 1_764_000_000.0 + 5.0 * (i + 1)
        rows = [
            {
                "ts": now,
                "node": f"n{g // 4}",
                "gpu": g % 4,
                "throttle_reasons": 0x40 if g == 3 and i > 5 else 0,
                "temperature_c": 90.0 if g == 3 else 60.0,
                "sm_clock_mhz": 1500.0,
                "power_w": 500.0,
                "pcie_replay_total": 1000 * i if g == 5 else 4,
                "ecc_dbe_volatile_total": 2 if g == 6 and i > 20 else 0,
                "remap_failure": g == 7 and i > 30,
            }
            for g in range(8)
        ]
        events = [{"ts": now, "node": "n1", "gpu": 2, "source": "dcgm", "kind": "xid", "xid": 48, "message": "XID 48"}] if i == 22 else []
        ticks.append((now, schemas.frame(rows, "gpu_samples"), schemas.frame(events, "events")))
    alloc = schemas.frame([{"job": "train", "rank": g, "node": f"n{g // 4}", "gpu": g % 4} for g in range(8)], "allocations")
    kinds, raised = set(), set()
    pairs = [(ThermalDetector(cfg), JoinThermal(cfg)), (PcieReplayDetector(cfg), JoinPcie(cfg)), (EccDetector(cfg), JoinEcc(cfg))]
    w = Window(600.0)
    for now, rows, events in ticks:
        w.add("gpu_samples", rows)
        w.add("events", events)
        w.add("allocations", alloc)
        w.seal(now)
        for fast, old in pairs:
            want = _dicts(old.detect(w))
            kinds |= {(f["source"], f["gpu"]) for f in want}
            raised |= {f["kind"] for f in want}
            assert _dicts(fast.detect(w)) == want
    assert kinds >= {("thermal", 3), ("pcie", 1), ("ecc", 2), ("ecc", 3)}
    assert raised >= {"ecc", "row_remap_failure"}  # n1 GPU 2's DBE, n1 GPU 3's failed remap


def test_gpu_without_node_or_gpu_is_not_tracked():
    """A sample that names no GPU cannot be attributed: it is left out of the per-GPU state."""
    det = ThermalDetector(CFG)
    w = Window(60.0)
    for t in range(5):
        w.add("gpu_samples", schemas.frame([{"ts": float(t), "node": None, "gpu": 0, "throttle_reasons": 0x40}, {"ts": float(t), "node": "n0", "gpu": None, "throttle_reasons": 0x40}], "gpu_samples"))
        w.seal(float(t))
        assert det.detect(w) == []
    assert det._state.height == 0


def test_gpu_slots_and_last_sample_per_slot():
    import numpy as np

    from gpuvigil.detectors.per_gpu import GpuSlots, grow, last_per_slot

    slots = GpuSlots()
    nodes, gpus = pl.Series(["a", "a", "b"]), pl.Series([0, 1, 0], dtype=pl.Int32)
    assert slots.of(nodes, gpus).tolist() == [0, 1, 2]
    # the same listing again (a new Series, equal values): the same slots
    assert slots.of(nodes.clone(), gpus.clone()).tolist() == [0, 1, 2]
    # another order and a new GPU: looked up, the new one appended
    assert slots.of(pl.Series(["b", "c", "a"]), pl.Series([0, 7, 1], dtype=pl.Int32)).tolist() == [2, 3, 1]
    assert len(slots) == 4 and slots.keys[3] == ("c", 7)
    # latest row per slot (the later row on equal times), slots in order of first sample by time
    rows, order = last_per_slot(np.array([5, 2, 5, 2, 9]), np.array([3.0, 1.0, 1.0, 1.0, 2.0]))
    assert order.tolist() == [2, 5, 9] and rows.tolist() == [3, 0, 4]
    rows, order = last_per_slot(np.array([4, 1]), np.array([2.0, 1.0]))
    assert order.tolist() == [1, 4] and rows.tolist() == [1, 0]
    g = grow(np.array([1.0, 2.0]), 3, -1.0)
    assert g.shape[0] >= 3 and g[:3].tolist() == [1.0, 2.0, -1.0] and (g[2:] == -1.0).all()
    assert grow(g, 2, 0.0) is g


# --- hang_device: its busy baseline in numpy slots, the allocations read through slot indices --

HANG_CFG = {"detectors": {"hang_device": {"hold_seconds": 10.0, "min_baseline_samples": 2, "gap_tolerance_seconds": 5.0, "min_gpus": 2}}}
HANG_GPUS = [("n0", 0), ("n0", 1), ("n0", 2), ("n1", 0), ("n1", 1), ("n2", 5)]
BUSY_READ = {"util_ratio": 1.0, "power_w": 600.0, "nvlink_tx_bytes_per_second": 4e10, "nvlink_rx_bytes_per_second": 4e10}
SPIN_READ = {"util_ratio": 1.0, "power_w": 116.0, "nvlink_tx_bytes_per_second": 1e6, "nvlink_rx_bytes_per_second": 1e6}


@st.composite
def hang_series(draw):
    """Ticks of (now, gpu_samples rows, events rows, allocations): training, then phases where
    some or all GPUs spin, with odd GPUs, silent ones, nulls, same-time samples, GPUs that come
    and go, and allocations that change."""
    n_ticks = draw(st.integers(5, 45))
    readings = [
        BUSY_READ,
        SPIN_READ,
        {"util_ratio": 0.0, "power_w": 113.0},
        {"util_ratio": None, "power_w": None},
        {"util_ratio": 1.0, "power_w": None},
        {"util_ratio": 0.95, "power_w": 270.0, "sm_active_ratio": 0.3, "tensor_active_ratio": 0.04},
        {"util_ratio": 1.0, "power_w": 116.0, "sm_active_ratio": 0.8},
        {"util_ratio": 0.6, "power_w": 600.0, "pcie_tx_bytes_per_second": 0.0},
        {"util_ratio": 1.0, "power_w": float("nan")},
    ]
    allocs = [
        [{"job": "a", "rank": r, "node": n, "gpu": g} for r, (n, g) in enumerate(HANG_GPUS[:4])] + [{"job": "b", "rank": 0, "node": "n1", "gpu": 1}],
        [{"job": "a", "rank": r, "node": n, "gpu": g} for r, (n, g) in enumerate(HANG_GPUS)],
        [{"job": "c", "rank": r, "node": n, "gpu": g} for r, (n, g) in enumerate(reversed(HANG_GPUS))] + [{"job": "c", "rank": 9, "node": "n9", "gpu": 0}],
    ]
    ticks = []
    alloc = draw(st.sampled_from(allocs))
    hang_from = draw(st.integers(2, n_ticks))
    for i in range(n_ticks):
        now = 1_764_000_000.0 + (i + 1)
        if draw(st.integers(0, 9)) == 0:
            alloc = draw(st.sampled_from(allocs))
        rows = []
        for g in HANG_GPUS:
            for _ in range(draw(st.sampled_from([0, 1, 1, 1, 1, 2]))):
                r = draw(st.sampled_from(readings)) if i >= hang_from else draw(st.sampled_from([BUSY_READ, BUSY_READ, BUSY_READ, readings[2]]))
                if i >= hang_from and draw(st.integers(0, 2)):
                    r = SPIN_READ
                rows.append({"ts": now - draw(st.sampled_from([0.0, 0.0, 0.5])), "node": g[0], "gpu": g[1], **r})
        events = []
        if draw(st.integers(0, 15)) == 0:
            events.append({"ts": now, "node": "n1", "gpu": 0, "source": "dcgm", "kind": "xid", "xid": 79, "message": "XID 79"})
        ticks.append((now, schemas.frame(rows, "gpu_samples"), schemas.frame(events, "events"), schemas.frame(alloc, "allocations")))
    return ticks


def _compare_hang(ticks, cfg):
    from fast_detector_oracles import JoinHangDevice

    from gpuvigil.detectors.hang_device import DeviceHangDetector

    fast, old = DeviceHangDetector(cfg), JoinHangDevice(cfg)
    w = Window(60.0)
    found = 0
    for i, (now, rows, events, alloc) in enumerate(ticks):
        w.add("gpu_samples", rows)
        w.add("events", events)
        w.add("allocations", alloc)
        w.seal(now)
        want = _dicts(old.detect(w))
        found += len(want)
        assert _dicts(fast.detect(w)) == want, f"tick {i}"
        # The join code also kept a baseline for samples naming no node or GPU, which no allocation
        # can ever match (null keys do not join): only the baselines of GPUs are compared.
        named = pl.col("node").is_not_null() & pl.col("gpu").is_not_null()
        assert fast._base.filter(named).sort("node", "gpu").equals(old._base.filter(named).sort("node", "gpu")), f"baseline, tick {i}"
    return found


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hang_series())
def test_hang_device_matches_the_join_code(ticks):
    _compare_hang(ticks, HANG_CFG)


def test_hang_device_matches_the_join_code_on_a_hang_with_an_odd_gpu():
    """accelerate#3104's shape (7 GPUs spin at 116 W, one at util 0) on two jobs, one of them
    hanging, with the defaults: the comparison must see findings, or it proves nothing."""
    gpus = [(f"n{k // 8}", k % 8) for k in range(16)]
    alloc = schemas.frame([{"job": f"j{k // 8}", "rank": k % 8, "node": n, "gpu": g} for k, (n, g) in enumerate(gpus)], "allocations")
    ticks = []
    for i in range(120):
        now = 1_764_000_000.0 + i
        rows = []
        for k, (n, g) in enumerate(gpus):
            r = BUSY_READ if i < 60 or k >= 8 else ({"util_ratio": 0.0, "power_w": 113.0} if k == 3 else SPIN_READ)
            rows.append({"ts": now, "node": n, "gpu": g, **r})
        ticks.append((now, schemas.frame(rows, "gpu_samples"), schemas.frame([], "events"), alloc))
    assert _compare_hang(ticks, None) > 0


def test_hang_device_matches_the_join_code_with_unplaced_rows():
    """The same hang, with samples that name no node or no GPU and allocation rows not (yet)
    placed on a GPU (a pending rank: node and gpu null): the join matched none of them, and the
    hang must still page."""
    gpus = [(f"n{k // 8}", k % 8) for k in range(16)]
    placed = [{"job": f"j{k // 8}", "rank": k % 8, "node": n, "gpu": g} for k, (n, g) in enumerate(gpus)]
    pending = [{"job": "j0", "rank": 8, "node": None, "gpu": None}, {"job": "j1", "rank": 8, "node": "n1", "gpu": None}]
    alloc = schemas.frame(placed + pending, "allocations")
    ticks = []
    for i in range(120):
        now = 1_764_000_000.0 + i
        rows = [{"ts": now, "node": None, "gpu": 0, **SPIN_READ}, {"ts": now, "node": "n0", "gpu": None, **BUSY_READ}]
        for k, (n, g) in enumerate(gpus):
            r = BUSY_READ if i < 60 or k >= 8 else ({"util_ratio": 0.0, "power_w": 113.0} if k == 3 else SPIN_READ)
            rows.append({"ts": now, "node": n, "gpu": g, **r})
        ticks.append((now, schemas.frame(rows, "gpu_samples"), schemas.frame([], "events"), alloc))
    assert _compare_hang(ticks, None) > 0


def test_hang_waiting_for_a_rank_placed_on_no_gpu_names_it_and_blames_no_hardware():
    """A job whose ninth rank is pending (allocation row without node and GPU) while the eight
    placed ranks spin: that rank is the culprit, and it is no hardware fault (requeue, not cordon).
    The per-rank code sorted the culprits' nodes, None among them, and raised instead."""
    from gpuvigil.detectors.hang_device import DeviceHangDetector

    gpus = [(f"n{k // 8}", k % 8) for k in range(16)]
    placed = [{"job": f"j{k // 8}", "rank": k % 8, "node": n, "gpu": g} for k, (n, g) in enumerate(gpus)]
    alloc = schemas.frame([*placed, {"job": "j0", "rank": 8, "node": None, "gpu": None}], "allocations")
    det, w = DeviceHangDetector(None), Window(60.0)
    found = []
    for i in range(120):
        now = 1_764_000_000.0 + i
        rows = [{"ts": now, "node": n, "gpu": g, **(BUSY_READ if i < 60 or k >= 8 else SPIN_READ)} for k, (n, g) in enumerate(gpus)]
        w.add("gpu_samples", schemas.frame(rows, "gpu_samples"))
        w.add("allocations", alloc)
        w.seal(now)
        found = det.detect(w) or found
    assert [(f.job, f.culprit_ranks, f.cause, f.severity.value) for f in found] == [("j0", [8], "software", "page")]
    assert "not placed on a GPU" in found[0].summary and found[0].evidence["silent_ranks"] == []
