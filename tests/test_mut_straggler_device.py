"""L0 straggler detector (gpuvigil/detectors/straggler_device.py): behaviour that mutation testing
(`make mutate`, docs/testing.md) showed no other test pinned down: the finding names the culprit's
node, and the look-back it declares is on the stream it reads (the pipeline trims each stream's
history to the declared look-back).

Source: device telemetry from published numbers, with the helpers of tests/test_levels.py: a
power-capped GPU whose SM clock lags 25% (1485 vs 1965 MHz) while healthy spread in real jobs is
±60 MHz (Megatron-LM straggler log).
"""

from __future__ import annotations

import pytest
from levels_helpers import allocations, cfg_with, gpu_rows, play, play_per_tick
from test_levels import _straggler_ticks

from gpuvigil import schemas
from gpuvigil.detectors.straggler_device import DeviceStragglerDetector


def test_the_lagging_gpu_is_named_with_its_node():
    found = play(
        DeviceStragglerDetector(),
        _straggler_ticks({"util_ratio": 0.97, "power_w": 520.0, "sm_clock_mhz": 1485.0}, {"util_ratio": 0.97, "power_w": 450.0, "sm_clock_mhz": 1965.0}),
    )
    f = found[0]
    assert (f.culprit_ranks, f.node, f.gpu, f.job, f.source) == ([2], "n0", 2, "job", "straggler_device")


def test_the_declared_look_back_is_on_the_gpu_samples_stream():
    """What a rebuild of its rings reads: rebuild_history_seconds (20 s by default), or
    with null the whole look-back (the longer of the window and the recent past)."""
    det = DeviceStragglerDetector()
    assert det.lookback_seconds() == {"gpu_samples": det.config.rebuild_history_seconds} == {"gpu_samples": 20.0}
    whole = DeviceStragglerDetector({"detectors": {"straggler_device": {"rebuild_history_seconds": None, "recent_seconds": 95.0}}})
    assert whole.lookback_seconds() == {"gpu_samples": 95.0}
    whole = DeviceStragglerDetector({"detectors": {"straggler_device": {"rebuild_history_seconds": None}}})
    assert whole.lookback_seconds() == {"gpu_samples": 90.0}


def _first(culprit, peers, **over):
    """The first tick on which GPU 2 (`culprit`) is flagged, with no persistence; None if never."""
    return next(iter(_flag_ticks(list(_straggler_ticks(culprit, peers, seconds=40)), **over)), None)


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


# --- mutation testing: every mutant of straggler_device.py run; what its survivors showed untested ---
# Same sources: values within the published healthy spread (±60 MHz, 97-100% util) for peers and a
# culprit well outside it; the hang signature (util pinned near 100%, power collapsed) is the one
# of docs/detectors.md and ../shared/research/device-signatures.md (NCCL spin: util 100%, power low).

PEER = {"util_ratio": 0.97, "power_w": 450.0, "sm_clock_mhz": 1965.0}
SLOW = {"util_ratio": 0.97, "power_w": 520.0, "sm_clock_mhz": 1485.0}  # power-capped: clock 25% low


def _ticks(sample, *, gpus=8, seconds=40, jobs=None, job="job"):
    """One sample a second from t=1 for `gpus` GPUs of node n0 (rank = GPU index);
    `sample(t, gpu)` gives that GPU's util/power/clock at second t."""
    alloc = allocations(job, [("n0", g) for g in range(gpus)])
    for t in range(1, seconds + 1):
        frames = {"gpu_samples": gpu_rows(float(t), [{"node": "n0", "gpu": g, **sample(t, g)} for g in range(gpus)]), "allocations": alloc}
        if jobs is not None:
            frames["jobs"] = jobs
        yield float(t), frames


def _flag_ticks(ticks, **over):
    """The ticks on which a detector with no persistence (and `over`) flags anything."""
    return [now for now, found in zip((t for t, _ in ticks), play_per_tick(_unpersisted(**over), ticks)) if found]


def _unpersisted(**over):
    return DeviceStragglerDetector(cfg_with("straggler_device", persist_evaluations=1, **over))


def _found(ticks, **over):
    """Every finding of a detector with no persistence (and `over`) over `ticks`."""
    return play(_unpersisted(**over), ticks)


def _culprit_2(culprit=SLOW, peer=PEER):
    return lambda t, g: culprit if g == 2 else peer


def _jobs(rows):
    return schemas.frame([{"job": j, "state": "running", "start_ts": s} for j, s in rows], schemas.JOBS)


def test_the_first_30_seconds_after_the_job_started_are_left_out():
    """The job started at t=0: samples before t=30 are warm-up; from t=30 on, 20 samples
    (min_samples) are there first at t=49."""
    ticks = list(_ticks(_culprit_2(), seconds=60, jobs=_jobs([("job", 0.0)])))
    assert _flag_ticks(ticks)[0] == 49.0


def test_a_job_the_scheduler_does_not_list_is_judged_from_its_first_sample():
    """The jobs snapshot lists another job only: no start known, so no warm-up is cut."""
    ticks = list(_ticks(_culprit_2(), seconds=30, jobs=_jobs([("other", 0.0)])))
    assert _flag_ticks(ticks)[0] == 20.0


def test_the_look_back_includes_its_oldest_second():
    """A 19 s look-back at t=20 holds t=1..20: exactly min_samples (20) samples."""
    ticks = list(_ticks(_culprit_2(), seconds=25))
    assert _flag_ticks(ticks, window_seconds=19.0)[0] == 20.0


def test_a_clock_read_at_exactly_half_utilisation_counts():
    """The busy clock is the median over samples with util >= 0.5; every GPU at exactly 0.5 with
    GPU 2's clock 25% low (no util lag, peers not busy enough for the host-side test)."""
    ticks = list(_ticks(_culprit_2({**SLOW, "util_ratio": 0.5}, {**PEER, "util_ratio": 0.5}), seconds=25))
    assert _flag_ticks(ticks)[0] == 20.0


def test_a_job_with_no_busy_clock_reading_is_not_flagged():
    """At 30% util no sample is busy (util >= 0.5), so no GPU has a clock to compare: no clock lag."""
    ticks = list(_ticks(_culprit_2({**SLOW, "util_ratio": 0.3}, {**PEER, "util_ratio": 0.3}), seconds=25))
    assert _flag_ticks(ticks) == []


def test_a_job_of_exactly_min_gpus_is_judged():
    ticks = list(_ticks(_culprit_2(), gpus=4, seconds=25))
    assert _flag_ticks(ticks)[0] == 20.0
    assert _flag_ticks(ticks, min_gpus=5) == []


def test_a_gpu_idle_exactly_the_maximum_share_of_its_samples_is_slow_not_absent():
    """GPU 2 alternates 5% and 95% util: idle (< 0.1) in exactly half its samples at t=20."""
    slow = lambda t, g: ({**PEER, "util_ratio": 0.05 if t % 2 else 0.95} if g == 2 else PEER)  # noqa: E731
    assert _flag_ticks(list(_ticks(slow, seconds=20)))[-1:] == [20.0]


def test_peers_exactly_at_the_busy_floor_make_a_util_lag_count():
    """Host-side only: peers at 75% util (binary-exact), the floor set to 0.75; GPU 2 at 50%."""
    same = {"power_w": 500.0, "sm_clock_mhz": 1900.0}
    ticks = list(_ticks(_culprit_2({**same, "util_ratio": 0.5}, {**same, "util_ratio": 0.75}), seconds=25))
    assert _flag_ticks(ticks, min_peer_util=0.75)[0] == 20.0
    assert _flag_ticks(ticks, min_peer_util=0.76) == []


def test_a_clock_lag_exactly_at_the_floor_is_a_slow_device():
    """1500 vs 2000 MHz: a lag of exactly 0.25 (binary-exact), the floor set to 0.25."""
    ticks = list(_ticks(_culprit_2({**SLOW, "sm_clock_mhz": 1500.0}, {**PEER, "sm_clock_mhz": 2000.0}), seconds=25))
    found = _found(ticks, min_clock_lag=0.25)
    assert found and found[0].cause == "device"
    assert _flag_ticks(ticks, min_clock_lag=0.2501) == []


SAME_CLOCKS = {"power_w": 500.0, "sm_clock_mhz": 1900.0}


@pytest.mark.parametrize(
    ("culprit", "peer", "cause", "figures", "why"),
    [
        # GPU 2 power-capped: its clock lags 25% at the same util
        (SLOW, PEER, "device", (0.97, 0.97, 1485, 1965), "its SM clock runs 24% below its peers' (1485 vs 1965 MHz): a slow device"),
        # same clocks, GPU 2 at 68.75% util against peers at 93.75% (binary-exact): it waits on its host
        ({**SAME_CLOCKS, "util_ratio": 0.6875}, {**SAME_CLOCKS, "util_ratio": 0.9375}, "host", (0.688, 0.938, 1900, 1900),
         "its utilisation lags its peers' (69% vs 94%): it waits on its host while they wait on it"),
    ],
    ids=["device-side", "host-side"],
)
def test_a_finding_reads_out_its_figures(culprit, peer, cause, figures, why):
    [f, *_] = _found(list(_ticks(_culprit_2(culprit, peer), seconds=20)))
    util, peer_util, clock, peer_clock = figures
    assert f.cause == cause
    assert f.evidence == {"level": "L0", "util": util, "peer_util": peer_util, "clock_mhz": clock, "peer_clock_mhz": peer_clock, "gpus_in_job": 8, "window_seconds": 90.0}
    assert f.summary == f"job rank 2 (n0 GPU 2) is a straggler (L0): {why}."


def test_a_host_side_straggler_with_no_busy_clock_reading_has_no_clock_figures():
    """GPU 2 at 30% util never has a busy (>= 50%) sample: no clock of its own to report."""
    [f, *_] = _found(list(_ticks(_culprit_2({**SAME_CLOCKS, "util_ratio": 0.3}, {**SAME_CLOCKS, "util_ratio": 1.0}), seconds=20)))
    assert (f.cause, f.evidence["clock_mhz"], f.evidence["peer_clock_mhz"]) == ("host", None, 1900)


def test_two_stragglers_of_a_job_are_one_finding_named_by_the_lower_rank():
    """GPUs 5 and 2 both power-capped (GPU 5's clock lower still): one finding for the job,
    ranks in order, node and GPU of rank 2."""
    cap = lambda t, g: {**SLOW, "sm_clock_mhz": 1400.0} if g == 5 else (SLOW if g == 2 else PEER)  # noqa: E731
    found = _found(list(_ticks(cap, seconds=20)))
    assert len(found) == 1
    assert (found[0].culprit_ranks, found[0].ranks, found[0].gpu, found[0].evidence["clock_mhz"]) == ([2, 5], [2, 5], 2, 1485)


def _hang(recent, *, pinned=8):
    """60 s of training (every GPU 97% util, 1000 W; GPU 2's clock 25% low throughout), then
    `recent(t)` gives the util and power of the first `pinned` GPUs for t > 60 (the others keep
    training). Returns whether the detector flags GPU 2 on the last tick (t=100)."""

    def sample(t, g):
        base = {**(SLOW if g == 2 else PEER), "power_w": 1000.0}
        if t > 60 and g < pinned:
            base.update(recent(t))
        return base

    ticks = list(_ticks(sample, seconds=100))
    return 100.0 in _flag_ticks(ticks)


SPIN = {"util_ratio": 1.0, "power_w": 200.0}  # NCCL spin: util pinned, power 20% of its p90


@pytest.mark.parametrize(
    ("case", "recent", "pinned", "flagged"),
    [
        ("every GPU spins in a collective: a hang, not a straggler", lambda t: SPIN, 8, False),
        ("util exactly 90% counts as pinned", lambda t: {**SPIN, "util_ratio": 0.9}, 8, False),
        ("power exactly 45% of its p90 counts as collapsed", lambda t: {**SPIN, "power_w": 450.0}, 8, False),
        ("power at 46% of its p90 is not a collapse", lambda t: {**SPIN, "power_w": 460.0}, 8, True),
        ("exactly half the GPUs pinned is a hang", lambda t: SPIN, 4, False),
        ("three of eight pinned is not", lambda t: SPIN, 3, True),
        ("power collapsed at half util (a slow phase, not a spin) is not a hang", lambda t: {"util_ratio": 0.5, "power_w": 200.0}, 8, True),
        (
            "util pinned in only 10 of the 21 samples of the recent 20 s (85% before) is not a hang",
            lambda t: {"util_ratio": 1.0 if t > 90 else 0.85, "power_w": 200.0},
            8,
            True,
        ),
        (
            "power at 0 for the last 10 s, 500 W the 10 s before: the recent median is 500 W (half), not a collapse",
            lambda t: {"util_ratio": 1.0, "power_w": 0.0 if t > 90 else (500.0 if t > 80 else 1000.0)},
            8,
            True,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_job_whose_gpus_wait_together_is_skipped(case, recent, pinned, flagged):
    assert _hang(recent, pinned=pinned) is flagged, case


def _dcgm_ticks(culprit: dict, peers: dict, *, seconds: int = 900, every: int = 30, tick: int = 5, onset: int = 0):
    """A pipeline ticking every `tick` s over GPUs sampled every `every` s (dcgm-exporter's 30 s
    default): GPU 2 behaves as `culprit` from `onset`, as its peers before."""
    from test_levels import NODE8

    alloc = allocations("job", NODE8)
    for t in range(tick, seconds + 1, tick):
        frames = {"allocations": alloc}
        if t % every == 0:
            rows = [{"node": n, "gpu": g, **(culprit if g == 2 and t >= onset else peers)} for n, g in NODE8]
            frames["gpu_samples"] = gpu_rows(float(t), rows)
        yield float(t), frames


HOST_SLOW = {"util_ratio": 0.74, "power_w": 430.0, "sm_clock_mhz": 1950.0}  # waits on its host a quarter of each step
SPINNING = {"util_ratio": 0.95, "power_w": 460.0, "sm_clock_mhz": 1950.0}  # its peers, spinning while they wait on it


def test_at_dcgm_s_30_s_the_look_back_grows_and_a_straggler_is_found_within_minutes():
    """Three samples in 90 s never reached min_samples: the look-back grows to min_samples
    intervals (up to max_window_seconds, 240 s) and a GPU is judged on what that holds."""
    per_tick = list(play_per_tick(DeviceStragglerDetector(), _dcgm_ticks(HOST_SLOW, SPINNING, onset=300)))
    first = next(i for i, found in enumerate(per_tick) if found)
    f = per_tick[first][0]
    assert (f.culprit_ranks, f.cause, f.evidence["window_seconds"]) == ([2], "host", 240.0)
    found_at = 5.0 * (first + 1)
    assert 300.0 < found_at <= 300.0 + 240.0
    # the same data with the look-back held at 90 s: never enough samples
    assert play(DeviceStragglerDetector(cfg_with("straggler_device", max_window_seconds=90.0)), _dcgm_ticks(HOST_SLOW, SPINNING, onset=300)) == []


def test_at_dcgm_s_30_s_healthy_spread_and_a_job_slow_alike_are_no_straggler():
    healthy = play(DeviceStragglerDetector(), _dcgm_ticks({"util_ratio": 0.93, "power_w": 610.0, "sm_clock_mhz": 1950.0}, {"util_ratio": 1.0, "power_w": 680.0, "sm_clock_mhz": 1980.0}))
    assert healthy == []
    assert play(DeviceStragglerDetector(), _dcgm_ticks(HOST_SLOW, HOST_SLOW)) == []


def test_at_1_s_the_look_back_and_the_samples_needed_are_unchanged():
    det = DeviceStragglerDetector()
    play(det, _straggler_ticks(SPINNING, SPINNING, seconds=60))
    assert det._interval == pytest.approx(1.0) and det._window() == 90.0 and det._needed_samples() == 20
