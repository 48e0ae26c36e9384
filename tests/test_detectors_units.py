"""Unit tests of detector pieces on crafted inputs: the OOM event classifier on real PyTorch
wording, the peer-anomaly estimator's scikit-learn contract, the FGD-style fragmentation measure
and compaction plan (properties), and the hang detector's adaptivity to a job's cadence."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.collectors.simulated import GIB, _oom_message
from gpuvigil.detectors.anomaly import PeerIsolationForest
from gpuvigil.detectors.fragmentation_cluster import plan_compaction, unusable_share
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.pipeline.window import Window

H200 = 139.8 * GIB
# A real capture (tests/data/h200/s2_oom_ramp.log wording, PyTorch 2.x).
REAL_CAPACITY_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.12 GiB is free. "
    "Including non-PyTorch memory, this process has 138.68 GiB memory in use. Of the allocated memory 137.56 GiB is allocated by PyTorch, and "
    "458.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def _events_window(messages: list[str], now: float = 10.0) -> Window:
    w = Window(600.0)
    rows = [{"ts": 5.0, "node": "node-000", "gpu": 3, "source": "torch", "kind": "oom", "job": "train", "rank": 3, "message": m} for m in messages]
    w.add("events", schemas.frame(rows, schemas.EVENTS))
    w.seal(now)
    return w


@pytest.mark.parametrize(
    "message, kind",
    [
        (REAL_CAPACITY_OOM, "oom_capacity"),
        # Leak: the pool holds only its usual slack when the request fails.
        (_oom_message(4 * GIB, H200, 136 * GIB, 135 * GIB, 3), "oom_capacity"),
        # Fragmentation: 30 GiB reserved but unallocated, a 4 GiB request fails.
        (_oom_message(4 * GIB, H200, 136 * GIB, 106 * GIB, 3), "oom_fragmentation"),
        # Another process holds 40 GiB of the device.
        (_oom_message(4 * GIB, H200, 96 * GIB, 95 * GIB, 3, foreign_bytes=40 * GIB), "oom_foreign_process"),
    ],
    ids=["real-capacity", "sim-leak", "sim-fragmentation", "sim-foreign"],
)
def test_oom_events_are_classified_from_the_message(message, kind):
    findings = OomEventClassifier().detect(_events_window([message]))
    assert [f.kind.value for f in findings] == [kind]
    f = findings[0]
    assert f.severity.value == "page" and f.job == "train" and f.ranks == [3] and f.node == "node-000" and f.gpu == 3
    assert f.evidence["requested_bytes"] > 0 and f.summary


def test_oom_events_reported_once_and_junk_ignored():
    det = OomEventClassifier()
    w = _events_window([REAL_CAPACITY_OOM, "CUDA error: something else entirely", ""])
    assert len(det.detect(w)) == 1
    w.seal(11.0)  # next tick, no new events
    assert det.detect(w) == []


def test_peer_isolation_forest_follows_the_sklearn_contract():
    from sklearn.base import clone
    from sklearn.utils.estimator_checks import check_estimator

    est = PeerIsolationForest(n_estimators=20, random_state=0)
    assert clone(est).get_params() == est.get_params()
    # The full battery of scikit-learn's estimator checks (fit/predict/score_samples, params,
    # input validation, pickling, n_features_in_ ...).
    # One check is about contamination: it expects fit_predict to call some training samples
    # outliers. This model is fitted on healthy history by design, so by design it calls none.
    check_estimator(
        est,
        expected_failed_checks={
            "check_outliers_fit_predict": "fitted on healthy history: no training sample is an outlier by design",
            "check_outliers_train": "same: predict on the training data returns no outlier by design",
        },
    )


def test_peer_isolation_forest_flags_only_what_healthy_history_never_showed():
    rng = np.random.default_rng(0)
    healthy = rng.normal(0, 0.3, size=(2000, 5))
    model = PeerIsolationForest(random_state=0).fit(healthy)
    assert (model.predict(rng.normal(0, 0.3, size=(500, 5))) == 1).mean() > 0.99
    odd = np.array([[0, 0, -3, 6, -10], [8, 0, 0, 0, 0]], dtype=float)
    assert model.predict(odd).tolist() == [-1, -1]
    assert (model.decision_function(odd) < 0).all()


@settings(max_examples=200, deadline=None)
@given(
    free=st.lists(st.integers(0, 8), min_size=1, max_size=40),
    needs=st.lists(st.integers(1, 8), min_size=1, max_size=10),
)
def test_unusable_share_is_a_share(free, needs):
    share = unusable_share(free, needs)
    assert 0.0 <= share <= 1.0
    if all(f >= max(needs) for f in free if f):
        assert share == 0.0


@settings(max_examples=200, deadline=None)
@given(
    used=st.lists(st.lists(st.integers(1, 4), max_size=4), min_size=2, max_size=12),
    need=st.integers(1, 8),
)
def test_compaction_plan_frees_a_slot_with_valid_moves(used, need):
    capacity = 8
    node_jobs: dict[str, dict[str, int]] = {}
    node_free: dict[str, int] = {}
    k = 0
    for i, sizes in enumerate(used):
        name = f"n{i:02d}"
        jobs, total = {}, 0
        for s in sizes:
            if total + s > capacity:
                break
            jobs[f"j{k}"] = s
            total += s
            k += 1
        node_jobs[name], node_free[name] = jobs, capacity - total
    plan = plan_compaction(node_free, node_jobs, need, capacity)
    if plan is None:
        return
    target, moves = plan
    free = dict(node_free)
    for m in moves:
        assert m["from_node"] == target and m["to_node"] != target
        assert node_jobs[target][m["job"]] == m["gpus"]
        free[m["to_node"]] -= m["gpus"]
        free[target] += m["gpus"]
    assert min(free.values()) >= 0
    assert free[target] >= need


def _rank_rows(ts: float, step_time: float, enq: list[int], comp: list[int], step: int) -> pl.DataFrame:
    n = len(enq)
    return schemas.frame(
        [
            {"ts": ts, "job": "j", "rank": r, "node": f"node-{r // 8:03d}", "gpu": r % 8, "pg": "0", "last_enqueued_seq": enq[r], "last_completed_seq": comp[r],
             "current_op": "ALLREDUCE" if enq[r] > comp[r] else None, "step": step, "step_time_seconds": step_time, "collective_wait_seconds": 0.0}
            for r in range(n)
        ],
        schemas.RANK_PROGRESS,
    )


def _drive(step_time: float, hang_at: float | None, all_pause_at: float | None, until: float, tick: float) -> tuple[float | None, list[int]]:
    """Feed the hang detector a 16-rank job; return when it first fired and whom it named."""
    det = HangDetector()
    w = Window(900.0)
    per = 4  # collectives per step
    t = 0.0
    seq = 0
    while t < until:
        t += tick
        if hang_at is not None and t >= hang_at:
            enq = [seq + 1] * 16
            enq[7] = seq  # rank 7 never enters the next collective
            comp = [seq] * 16
        elif all_pause_at is not None and all_pause_at <= t < all_pause_at + 120:
            enq = comp = [seq] * 16  # everybody outside collectives: a checkpoint or input stall
        else:
            seq = int(t / step_time * per)
            enq, comp = [seq + 1] * 16, [seq] * 16
            enq[3] = seq  # ranks arrive at different times in a healthy job too
        w.add("rank_progress", _rank_rows(t, step_time, enq, comp, seq // per))
        w.seal(t)
        found = det.detect(w)
        if found:
            return t, found[0].culprit_ranks
    return None, []


@pytest.mark.parametrize(
    "step_time, tick, bound",
    [(0.2, 1.0, 10.0), (2.0, 1.0, 10.0), (40.0, 4.0, 3 * 40.0)],
    ids=["0.2s-steps", "2s-steps", "40s-steps"],
)
def test_hang_detector_adapts_to_the_job_cadence(step_time, tick, bound):
    onset = 200.0
    fired, culprits = _drive(step_time, hang_at=onset, all_pause_at=None, until=onset + 4 * bound, tick=tick)
    assert fired is not None and onset <= fired <= onset + bound
    assert culprits == [7]


@pytest.mark.parametrize("step_time", [0.2, 40.0])
def test_all_ranks_pausing_together_is_not_a_hang(step_time):
    fired, _ = _drive(step_time, hang_at=None, all_pause_at=100.0, until=400.0, tick=1.0 if step_time < 1 else 4.0)
    assert fired is None
