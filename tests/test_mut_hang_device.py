"""L0 hang detector (gpuvigil/detectors/hang_device.py): behaviour that mutation testing (`make
mutate`, docs/testing.md) showed no other test pinned down: the whole evidence of a finding, the
odd GPU's util exactly at `util_absent`, a silent GPU named as such.

Source: device telemetry built from the numbers of public incident reports, with the helpers of
tests/test_levels.py: huggingface/accelerate#3104 (8×H100, 7 GPUs at 100% util on ~116 W, one
at 0% util; healthy H100s draw ~600 W, NVIDIA-NeMo#9291) and rwth-i6/returnn#1484 (the lost GPU
answers nothing during the all_reduce hang).
"""

from __future__ import annotations

from levels_helpers import play
from test_levels import _hang_ticks

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

