"""Unknown anomalies: GPUs unlike their peers, by a model fitted on healthy history.

Each GPU that runs a job is described by how far its telemetry (SM busy, memory busy, power,
temperature, SM clock) sits from the median of the GPUs of the same job, in units of a
per-metric scale: ranks of one synchronous job do the same work, so a healthy GPU sits near the
origin whatever the job does. An IsolationForest (`PeerIsolationForest`, a scikit-learn
estimator) is fitted on the first `fit_seconds` of such vectors, taken as healthy, and then
scores the GPUs that stand out (any coordinate beyond `min_abs_deviation`): a GPU the forest
isolates faster than any healthy one, `consecutive` evaluations in a row, is an `anomaly`.
It is a ticket, never a page: a model's hunch wakes nobody up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field
from sklearn.base import BaseEstimator, OutlierMixin
from sklearn.ensemble import IsolationForest
from sklearn.utils.validation import check_is_fitted, validate_data

from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.window import Window

FEATURES = ("util_ratio", "mem_util_ratio", "power_w", "temperature_c", "sm_clock_mhz")


class PeerIsolationForest(OutlierMixin, BaseEstimator):
    """IsolationForest whose decision threshold is set by the healthy training data.

    sklearn's IsolationForest needs a contamination share; fitted on healthy history there is
    none. The threshold is instead the `threshold_quantile` of the training scores minus
    `margin`: a sample is an outlier (-1) only when it is more isolated than (nearly) every
    healthy sample.

    Trees fitted on healthy data split only inside the healthy range, so a sample far outside it
    follows the same path as the most extreme healthy one and scores no worse. The score
    therefore also subtracts how far the sample lies outside the training box, per feature in
    units of that feature's training range.
    """

    def __init__(self, n_estimators: int = 100, max_samples: int | str = "auto", threshold_quantile: float = 0.001, margin: float = 0.02, random_state: int | None = 0):
        self.n_estimators = n_estimators
        self.max_samples = max_samples
        self.threshold_quantile = threshold_quantile
        self.margin = margin
        self.random_state = random_state

    def fit(self, X, y=None):
        X = validate_data(self, X, reset=True, dtype=np.float64)
        self.forest_ = IsolationForest(n_estimators=self.n_estimators, max_samples=self.max_samples, random_state=self.random_state).fit(X)
        self.low_, self.high_ = X.min(axis=0), X.max(axis=0)
        self.range_ = np.maximum(self.high_ - self.low_, 1e-9)
        train = self.forest_.score_samples(X)
        self.offset_ = float(np.quantile(train, self.threshold_quantile)) - self.margin
        return self

    def score_samples(self, X):
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=np.float64)
        outside = (np.maximum(X - self.high_, 0) + np.maximum(self.low_ - X, 0)) / self.range_
        return self.forest_.score_samples(X) - outside.sum(axis=1)

    def decision_function(self, X):
        return self.score_samples(X) - self.offset_

    def predict(self, X):
        return np.where(self.decision_function(X) < 0, -1, 1)


class AnomalyConfig(BaseModel):
    fit_seconds: float = Field(60.0, gt=0)  # healthy history before the model is fitted
    every_seconds: float = Field(10.0, ge=0)  # evaluate this often (findings persist between)
    min_peers: int = Field(4, ge=2)
    max_train_rows: int = Field(20000, ge=100)
    min_abs_deviation: float = Field(3.0, gt=0)
    consecutive: int = Field(3, ge=1)
    # Deviation unit per metric: differences below these are noise between healthy peers.
    scale: dict[str, float] = Field(
        default_factory=lambda: {"util_ratio": 0.05, "mem_util_ratio": 0.05, "power_w": 25.0, "temperature_c": 4.0, "sm_clock_mhz": 60.0}
    )
    n_estimators: int = Field(100, ge=10)
    random_state: int = 0


def peer_deviations(samples: pl.DataFrame, allocations: pl.DataFrame, scale: dict[str, float], min_peers: int) -> pl.DataFrame:
    """(node, gpu, job, rank, dev_<metric>…): each GPU's distance from its job's median."""
    df = samples.select("node", "gpu", *FEATURES).drop_nulls().join(allocations.select("node", "gpu", "job", "rank").unique(["node", "gpu"]), on=["node", "gpu"], how="inner")
    if df.height == 0:
        return df
    return (
        df.with_columns(pl.len().over("job").alias("_peers"))
        .filter(pl.col("_peers") >= min_peers)
        .with_columns([((pl.col(f) - pl.col(f).median().over("job")) / scale[f]).alias(f"dev_{f}") for f in FEATURES])
        .drop("_peers")
    )


class AnomalyDetector:
    name = "anomaly"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("anomaly", AnomalyConfig, cfg)
        self.model: PeerIsolationForest | None = None
        self._train: list[np.ndarray] = []
        self._train_rows = 0
        self._started: float | None = None
        self._last_eval: float | None = None
        self._streak: dict[tuple[str, int], int] = {}
        self._flagged: list[dict[str, Any]] = []

    def _cols(self) -> list[str]:
        return [f"dev_{f}" for f in FEATURES]

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        if self._last_eval is not None and now - self._last_eval < c.every_seconds - 1e-9:
            return self._report(now)
        self._last_eval = now
        fresh = window.fresh("gpu_samples")
        if fresh.height == 0:
            return self._report(now)
        dev = peer_deviations(fresh, window.get("allocations"), c.scale, c.min_peers)
        if dev.height == 0:
            return self._report(now)
        if self._started is None:
            self._started = now
        if self.model is None:
            if self._train_rows < c.max_train_rows:
                X = dev.select(self._cols()).to_numpy()
                self._train.append(X[: c.max_train_rows - self._train_rows])
                self._train_rows += len(self._train[-1])
            if now - self._started >= c.fit_seconds and self._train_rows >= 50:
                self.model = PeerIsolationForest(n_estimators=c.n_estimators, random_state=c.random_state).fit(np.vstack(self._train))
                self._train = []
            return []
        # Only GPUs that stand out from their peers on some metric are worth scoring.
        far = dev.filter(pl.max_horizontal([pl.col(x).abs() for x in self._cols()]) >= c.min_abs_deviation)
        flagged: list[dict[str, Any]] = []
        streak: dict[tuple[str, int], int] = {}
        if far.height:
            scores = self.model.decision_function(far.select(self._cols()).to_numpy())
            for row, score in zip(far.iter_rows(named=True), scores):
                if score >= 0:
                    continue
                key = (row["node"], int(row["gpu"]))
                streak[key] = self._streak.get(key, 0) + 1
                if streak[key] >= c.consecutive:
                    flagged.append({**row, "score": float(score)})
        self._streak = streak
        self._flagged = flagged
        return self._report(now)

    def _report(self, now: float) -> list[Finding]:
        findings = []
        for row in self._flagged:
            devs = {f: round(float(row[f"dev_{f}"]) * self.config.scale[f], 2) for f in FEATURES}
            top = max(FEATURES, key=lambda f: abs(row[f"dev_{f}"]))
            findings.append(
                Finding(
                    kind=FindingKind.ANOMALY,
                    severity=Severity.TICKET,
                    ts=now,
                    job=row["job"],
                    ranks=[int(row["rank"])],
                    node=row["node"],
                    gpu=int(row["gpu"]),
                    cause="unknown",
                    source=self.name,
                    evidence={"anomaly_score": round(row["score"], 4), **{f"deviation_{f}": v for f, v in devs.items()}, "most_unusual": top},
                    summary=(
                        f"{row['node']} GPU {row['gpu']} (job {row['job']} rank {row['rank']}) behaves unlike its peers: "
                        f"{top} is {devs[top]:+g} from the job's median; no known fault explains it yet."
                    ),
                )
            )
        return findings
