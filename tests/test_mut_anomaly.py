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
from gpuvigil.pipeline.window import Window

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
