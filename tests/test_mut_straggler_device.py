"""L0 straggler detector (gpuvigil/detectors/straggler_device.py): behaviour that mutation testing
(`make mutate`, docs/testing.md) showed no other test pinned down: the finding names the culprit's
node, and the look-back it declares is on the stream it reads (the pipeline trims each stream's
history to the declared look-back).

Source: device telemetry from published numbers, with the helpers of tests/test_levels.py: a
power-capped GPU whose SM clock lags 25% (1485 vs 1965 MHz) while healthy spread in real jobs is
±60 MHz (Megatron-LM straggler log).
"""

from __future__ import annotations

from levels_helpers import cfg_with, play, window
from test_levels import _straggler_ticks

from gpuvigil.detectors.straggler_device import DeviceStragglerDetector


def test_the_lagging_gpu_is_named_with_its_node():
    found = play(
        DeviceStragglerDetector(),
        _straggler_ticks({"util_ratio": 0.97, "power_w": 520.0, "sm_clock_mhz": 1485.0}, {"util_ratio": 0.97, "power_w": 450.0, "sm_clock_mhz": 1965.0}),
    )
    f = found[0]
    assert (f.culprit_ranks, f.node, f.gpu, f.job, f.source) == ([2], "n0", 2, "job", "straggler_device")


def test_the_declared_look_back_is_on_the_gpu_samples_stream():
    det = DeviceStragglerDetector()
    c = det.config
    assert det.lookback_seconds() == {"gpu_samples": max(c.window_seconds, c.recent_seconds)}


def _first(culprit, peers, **over):
    w = window()
    det = DeviceStragglerDetector(cfg_with("straggler_device", persist_evaluations=1, **over))
    for now, frames in _straggler_ticks(culprit, peers, seconds=40):
        for stream, df in frames.items():
            w.add(stream, df)
        w.seal(now)
        if det.detect(w):
            return now
    return None


def test_the_first_evaluation_with_exactly_min_samples_flags():
    """One sample a second from t=1: GPU 2's clock lags 25%; with no persistence the straggler is
    flagged on the tick its 20th sample (min_samples) arrives."""
    assert _first({"util_ratio": 0.97, "power_w": 520.0, "sm_clock_mhz": 1485.0}, {"util_ratio": 0.97, "power_w": 450.0, "sm_clock_mhz": 1965.0}) == 20.0


def test_a_util_lag_exactly_at_the_floor_flags():
    """Host-side lag only (same clocks): GPU 2 at 87.5% util, peers at 100%: a lag of exactly
    0.125, the configured floor (binary-exact values, so the edge is exact)."""
    same = {"power_w": 500.0, "sm_clock_mhz": 1900.0}
    assert _first({"util_ratio": 0.875, **same}, {"util_ratio": 1.0, **same}, min_util_lag=0.125) == 20.0
    assert _first({"util_ratio": 0.875, **same}, {"util_ratio": 1.0, **same}, min_util_lag=0.126) is None


def test_a_gpu_at_exactly_10_percent_util_is_slow_not_absent():
    """Idle means util below 0.1; GPU 2 at exactly 0.1 all along is a (very) slow GPU."""
    same = {"power_w": 500.0, "sm_clock_mhz": 1900.0}
    assert _first({"util_ratio": 0.1, **same}, {"util_ratio": 1.0, **same}) == 20.0
