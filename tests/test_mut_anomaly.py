"""Unknown-anomaly detector (gpuvigil/detectors/anomaly.py): behaviour that mutation testing
(`make mutate`, docs/testing.md) showed no other test pinned down: the evaluation cadence (the
first finding comes on the exact evaluation the streak completes), the finding's figures, and
findings kept between evaluations and on an evaluation that has no usable sample.

Source: constructed NVML gpu_samples of 4 GPUs of one job (simulated-only detector: it needs four
or more GPUs of one job and the real captures have one GPU; see docs/testing.md).
"""

from __future__ import annotations

from gpuvigil import config, schemas
from gpuvigil.detectors.anomaly import AnomalyDetector
from gpuvigil.window import Window

ALLOC = schemas.frame([{"job": "j", "rank": g, "node": "n0", "gpu": g} for g in range(4)], schemas.ALLOCATIONS)


def _samples(t, hot_from=None, null_temp=False):
    rows = []
    for g in range(4):
        wobble = ((int(t) * 7 + g * 3) % 5 - 2) / 10  # healthy peers differ by a fraction of a unit
        temp = 70.0 + 4.0 * wobble + (30.0 if hot_from is not None and t >= hot_from and g == 3 else 0.0)
        rows.append({"ts": float(t), "node": "n0", "gpu": g, "util_ratio": 0.9 + 0.05 * wobble, "mem_util_ratio": 0.5,
                     "power_w": 600.0 + 25.0 * wobble, "temperature_c": None if null_temp else temp, "sm_clock_mhz": 1800.0})
    return schemas.frame(rows, schemas.GPU_SAMPLES)


def _first_finding(det):
    w = Window(1e9)
    w.add("allocations", ALLOC)
    for t in range(0, 161):
        w.add("gpu_samples", _samples(t, hot_from=125))
        w.seal(float(t))
        if det.detect(w):
            return t
    return None


def test_consecutive_evaluations_come_from_the_configuration():
    """The same run with `consecutive: 1`: reported on the first evaluation after GPU 3 heats up."""
    assert _first_finding(AnomalyDetector(config.load(overrides={"detectors": {"anomaly": {"consecutive": 1}}}))) == 130
    assert _first_finding(AnomalyDetector()) == 150


def test_a_gpu_hotter_than_its_peers_is_flagged_on_the_third_evaluation_and_kept_between():
    """Ticks every second. The envelope is fitted on the first evaluation >= 60 s with >= 50
    healthy rows (4 rows an evaluation, every 10 s: t=120). GPU 3 runs 30 °C hotter than its
    peers from t=125: flagged on the evaluations at 130, 140, 150, reported from t=150 (three
    in a row), on every tick after it, and on the evaluation at t=160 whose samples lack the
    temperature (nothing to re-score: the last verdict stands)."""
    det = AnomalyDetector()
    w = Window(1e9)
    w.add("allocations", ALLOC)
    out = {}
    for t in range(0, 161):
        w.add("gpu_samples", _samples(t, hot_from=125, null_temp=t == 160))
        w.seal(float(t))
        out[t] = det.detect(w)
    assert det.model is not None
    assert next(t for t in sorted(out) if out[t]) == 150
    for t in (150, 155, 159, 160):
        [f] = out[t]
        assert (f.ts, f.node, f.gpu, f.ranks, f.job, f.cause, f.severity.value, f.kind.value, f.source) == (float(t), "n0", 3, [3], "j", "unknown", "ticket", "anomaly", "anomaly")
    f = out[150][0]
    assert f.evidence["most_unusual"] == "temperature_c"
    assert 29.0 <= f.evidence["deviation_temperature_c"] <= 31.0
    assert f.summary.startswith("n0 GPU 3 (job j rank 3) behaves unlike its peers: temperature_c is +")


# -- PeerEnvelope, the model itself (mutation testing: its arithmetic and its checks) ----------
# Source: constructed arrays. The envelope is plain numpy; its numbers are checked by hand.
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gpuvigil.detectors.anomaly import PeerEnvelope  # noqa: E402

# Healthy rows 0..100 in both columns: quantile 0.99 keeps [1, 99] per column (numpy's linear rule).
HEALTHY = np.column_stack([np.arange(101.0), np.arange(101.0) * 2])


@pytest.mark.parametrize(
    ("row", "per_feature", "worst"),
    [
        ([50.0, 100.0], [0.0, 0.0], 0.0),  # inside on both sides
        ([99.0, 2.0], [0.0, 0.0], 0.0),  # exactly on the edges: not outside
        ([101.5, 100.0], [2.5, 0.0], 2.5),  # above the high edge of column 0
        ([50.0, -3.0], [0.0, 5.0], 5.0),  # below the low edge of column 1 (low 2)
        ([-1.0, 203.0], [2.0, 5.0], 5.0),  # one below, one above: the worst counts
    ],
)
def test_peer_envelope_excess_is_the_distance_outside_each_columns_quantile_range(row, per_feature, worst):
    env = PeerEnvelope(quantile=0.99, margin=2.5).fit(HEALTHY)
    np.testing.assert_allclose(env.low_, [1.0, 2.0])
    np.testing.assert_allclose(env.high_, [99.0, 198.0])
    np.testing.assert_allclose(env.excess_per_feature(np.array([row])), [per_feature], atol=1e-9)
    np.testing.assert_allclose(env.excess(np.array([row])), [worst], atol=1e-9)
    assert env.predict(np.array([row])).tolist() == [-1 if worst >= 2.5 else 1]


def test_peer_envelope_defaults_and_margin_edge():
    env = PeerEnvelope()
    assert (env.quantile, env.margin, env.low_, env.high_) == (0.999, 0.5, None, None)
    env.fit([[0.0], [1.0]])  # lists are taken too, as float64
    assert env.low_.dtype == np.float64 and env.low_.shape == (1,) and env.high_.shape == (1,)
    edge = env.high_[0] + 0.5
    # Exactly `margin` outside counts as an outlier; just under does not.
    assert env.predict([[edge], [edge - 1e-9], [env.low_[0] - 0.5]]).tolist() == [-1, 1, -1]


@pytest.mark.parametrize("quantile", [0.5, 0.4, 1.01, 2.0])
def test_peer_envelope_rejects_a_quantile_outside_half_to_one(quantile):
    with pytest.raises(ValueError) as e:
        PeerEnvelope(quantile=quantile)
    assert str(e.value) == "quantile must be in (0.5, 1]"


@pytest.mark.parametrize("quantile", [0.5000001, 1.0])
def test_peer_envelope_accepts_the_ends_of_its_range(quantile):
    env = PeerEnvelope(quantile=quantile).fit(HEALTHY)
    if quantile == 1.0:  # the whole healthy range
        np.testing.assert_allclose(env.low_, [0.0, 0.0])
        np.testing.assert_allclose(env.high_, [100.0, 200.0])


def test_peer_envelope_messages_name_what_is_wrong():
    with pytest.raises(RuntimeError) as e:
        PeerEnvelope().excess(np.zeros((1, 2)))
    assert str(e.value) == "PeerEnvelope is not fitted"
    half = PeerEnvelope()
    half.low_ = np.zeros(2)  # one edge without the other is not a fitted model either
    with pytest.raises(RuntimeError):
        half.excess(np.zeros((1, 2)))
    for bad in (np.zeros((0, 2)), np.zeros(2), [[0.0, np.inf]]):
        with pytest.raises(ValueError) as e:
            PeerEnvelope().fit(bad)
        assert str(e.value) == "fit needs a non-empty 2-D array of finite values"
    with pytest.raises(ValueError) as e:
        PeerEnvelope().fit(HEALTHY).excess(np.zeros((3, 1)))
    assert str(e.value) == "expected 2 features, got shape (3, 1)"


# -- AnomalyDetector: when the envelope is fitted, what is scored, what the finding says --------
# Source: constructed NVML gpu_samples of one job (simulated-only detector, see the module docstring).


def _job_samples(t, temps):
    """One row per GPU of job j on n0: identical but for the temperatures given."""
    rows = [{"ts": float(t), "node": "n0", "gpu": g, "util_ratio": 0.9, "mem_util_ratio": 0.5, "power_w": 600.0, "temperature_c": temp, "sm_clock_mhz": 1800.0}
            for g, temp in enumerate(temps)]
    return schemas.frame(rows, schemas.GPU_SAMPLES)


def _alloc(n):
    return schemas.frame([{"job": "j", "rank": g, "node": "n0", "gpu": g} for g in range(n)], schemas.ALLOCATIONS)


def _anomaly(**over):
    return AnomalyDetector(config.load(overrides={"detectors": {"anomaly": {"every_seconds": 0.0, **over}}}))


def _feed(det, ticks, temps, start=0):
    w = Window(1e9)
    w.add("allocations", _alloc(len(temps)))
    out = []
    for t in range(start, start + ticks):
        w.add("gpu_samples", _job_samples(t, temps))
        w.seal(float(t))
        out.append(det.detect(w))
    return out


def test_the_envelope_is_fitted_once_fit_seconds_have_passed_from_the_first_usable_tick():
    """10 GPUs a tick (10 healthy rows); first usable tick at 100 s; fit_seconds 20: fitted on
    the tick at 120 s, not at 119 s, though 50 rows were there long before."""
    det = _anomaly(fit_seconds=20.0)
    _feed(det, 20, [70.0] * 10, start=100)
    assert det.model is None and det._train_rows == 200
    _feed(det, 1, [70.0] * 10, start=120)
    assert det.model is not None


def test_the_envelope_needs_50_healthy_rows():
    """fit_seconds passed at once (0.5 s); 10 rows a tick: 50 rows on the 5th tick, fitted then."""
    det = _anomaly(fit_seconds=0.5)
    _feed(det, 4, [70.0] * 10)
    assert det.model is None and det._train_rows == 40
    _feed(det, 1, [70.0] * 10, start=4)
    assert det.model is not None


def test_training_rows_stop_at_max_train_rows():
    """10 rows a tick, at most 105 kept: the 11th tick adds only 5 of its rows."""
    det = _anomaly(fit_seconds=1000.0, max_train_rows=105)
    _feed(det, 15, [70.0] * 10)
    assert det.model is None and det._train_rows == 105 and sum(len(x) for x in det._train) == 105


def _fitted(**over):
    """An envelope fitted on 60 ticks of 6 identical GPUs (every deviation 0)."""
    det = _anomaly(fit_seconds=1.0, **over)
    _feed(det, 60, [70.0] * 6)
    assert det.model is not None
    return det


def test_a_gpu_exactly_min_abs_deviation_and_envelope_margin_away_is_scored():
    """Temperature scale 4 °C: GPU 5 at +12 °C is exactly 3.0 units from the job's median, the
    default min_abs_deviation, and envelope_margin is 3.0 here: both edges count. Reported on the
    third evaluation, with its figures."""
    det = _fitted(envelope_margin=3.0)
    out = _feed(det, 3, [70.0] * 5 + [82.0], start=100)
    assert out[0] == [] and out[1] == []
    [f] = out[2]
    assert (f.node, f.gpu, f.ranks, f.ts) == ("n0", 5, [5], 102.0)
    assert f.evidence == {
        "beyond_healthy_envelope": 3.0, "deviation_util_ratio": 0.0, "deviation_mem_util_ratio": 0.0, "deviation_power_w": 0.0,
        "deviation_temperature_c": 12.0, "deviation_sm_clock_mhz": 0.0, "most_unusual": "temperature_c",
    }
    assert f.summary == "n0 GPU 5 (job j rank 5) behaves unlike its peers: temperature_c is +12 from the job's median; no known fault explains it yet."


def test_figures_are_given_to_two_and_three_places():
    """GPU 5 at +12.3456 °C: 3.0864 units; reported as 12.35 °C and 3.086."""
    det = _fitted()
    [f] = _feed(det, 3, [70.0] * 5 + [82.3456], start=100)[2]
    assert f.evidence["deviation_temperature_c"] == 12.35 and f.evidence["beyond_healthy_envelope"] == 3.086


def test_a_far_gpu_inside_the_margin_does_not_stop_the_next_from_being_scored():
    """min_abs_deviation 3, envelope_margin 5: GPU 4 is 4 units away (far, but inside the
    margin), GPU 5 6 units: only GPU 5 is reported."""
    det = _fitted(envelope_margin=5.0)
    out = _feed(det, 3, [70.0] * 4 + [86.0, 94.0], start=100)
    assert [(f.gpu, f.evidence["beyond_healthy_envelope"]) for f in out[2]] == [(5, 6.0)]


def test_each_gpu_keeps_its_own_streak():
    """GPU 4 deviates from t=100, GPU 5 from t=101: each needs three evaluations of its own, so
    at t=102 only GPU 4 is reported, at t=103 both."""
    det = _fitted()
    out = _feed(det, 1, [70.0] * 4 + [86.0, 70.0], start=100) + _feed(det, 3, [70.0] * 4 + [86.0, 94.0], start=101)
    assert out[0] == [] and out[1] == []
    assert [f.gpu for f in out[2]] == [4]
    assert sorted(f.gpu for f in out[3]) == [4, 5]


def test_a_reported_gpu_stays_reported_on_ticks_without_samples_or_allocations():
    """After GPU 5 is reported (t=102), a tick with no gpu_samples at all (t=103) and one whose
    window has no allocations (t=104) keep the finding, stamped with their own time."""
    det = _fitted()
    w = Window(1e9)
    w.add("allocations", _alloc(6))
    for t in (100, 101, 102):
        w.add("gpu_samples", _job_samples(t, [70.0] * 5 + [94.0]))
        w.seal(float(t))
        out = det.detect(w)
    assert [f.gpu for f in out] == [5]
    w.seal(103.0)
    assert [(f.gpu, f.ts) for f in det.detect(w)] == [(5, 103.0)]
    empty = Window(1e9)
    empty.add("gpu_samples", _job_samples(104, [70.0] * 5 + [94.0]))
    empty.seal(104.0)
    assert [(f.gpu, f.ts) for f in det.detect(empty)] == [(5, 104.0)]
