"""Unknown anomalies: GPUs unlike their peers, beyond what healthy history ever showed.

Each GPU that runs a job is described by how far its telemetry (SM busy, memory busy, power,
temperature, SM clock) sits from the median of the GPUs of the same job, in units of a
per-metric scale: ranks of one synchronous job do the same work, so a healthy GPU sits near the
origin whatever the job does. A `PeerEnvelope` is fitted on the first `fit_seconds` of such
vectors, taken as healthy: per metric, the range healthy GPUs covered (`envelope_quantile` of
them, so one glitch in the training data does not widen it). A GPU that stands out (some
coordinate beyond `min_abs_deviation`) and lies outside that envelope by at least
`envelope_margin` scale units, `consecutive` evaluations in a row, is an `anomaly`. It is a
ticket, never a page: a hunch wakes nobody up.

This replaced an IsolationForest (scikit-learn). Only GPUs ≥ `min_abs_deviation` from their
job's median are scored, and healthy peers never come near that (on the simulator the largest
healthy deviation was 2.7 units at 5% noise), so every GPU scored lies outside the healthy box
on some metric: there the forest, whose trees split only inside the training range, decided by
the same distance-outside-the-box term that this envelope uses. Agreement was 100% on 20k
synthetic cases and no benchmark case was found that only the forest caught (see
docs/dependencies.md); the envelope costs no dependency and no fitting time.

Tested on simulated data only: it needs four or more GPUs of one job, and the real captures have
one GPU (docs/testing.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

FEATURES = ("util_ratio", "mem_util_ratio", "power_w", "temperature_c", "sm_clock_mhz")


class PeerEnvelope:
    """Per-feature envelope of healthy peer deviations (numpy only).

    `fit(X)` keeps, per column, the [1 - q, q] quantile range of the healthy rows;
    `excess(X)` is how far each row lies outside it, in the units of X (0 inside), the largest
    over columns; `predict(X)` is -1 (outlier) where that exceeds `margin`, else 1.
    """

    def __init__(self, quantile: float = 0.999, margin: float = 0.5):
        if not 0.5 < quantile <= 1.0:
            raise ValueError("quantile must be in (0.5, 1]")
        self.quantile = quantile
        self.margin = margin
        self.low_: np.ndarray | None = None
        self.high_: np.ndarray | None = None

    def fit(self, X: Any) -> PeerEnvelope:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[0] == 0 or not np.isfinite(X).all():
            raise ValueError("fit needs a non-empty 2-D array of finite values")
        self.low_ = np.quantile(X, 1.0 - self.quantile, axis=0)
        self.high_ = np.quantile(X, self.quantile, axis=0)
        return self

    def excess_per_feature(self, X: Any) -> np.ndarray:
        if self.low_ is None or self.high_ is None:
            raise RuntimeError("PeerEnvelope is not fitted")
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.low_.shape[0]:
            raise ValueError(f"expected {self.low_.shape[0]} features, got shape {X.shape}")
        return np.maximum(X - self.high_, 0.0) + np.maximum(self.low_ - X, 0.0)

    def excess(self, X: Any) -> np.ndarray:
        return self.excess_per_feature(X).max(axis=1)

    def predict(self, X: Any) -> np.ndarray:
        return np.where(self.excess(X) >= self.margin, -1, 1)


class AnomalyConfig(BaseModel):
    fit_seconds: float = Field(60.0, gt=0)  # healthy history before the envelope is fitted
    every_seconds: float = Field(10.0, ge=0)  # evaluate this often (findings persist between)
    min_peers: int = Field(4, ge=2)
    max_train_rows: int = Field(20000, ge=100)
    min_abs_deviation: float = Field(3.0, gt=0)
    consecutive: int = Field(3, ge=1)
    # Deviation unit per metric: differences below these are noise between healthy peers.
    scale: dict[str, float] = Field(
        default_factory=lambda: {"util_ratio": 0.05, "mem_util_ratio": 0.05, "power_w": 25.0, "temperature_c": 4.0, "sm_clock_mhz": 60.0}
    )
    # Share of healthy rows inside the envelope, per metric and per side.
    envelope_quantile: float = Field(0.999, gt=0.5, le=1.0)
    # How far beyond the healthy envelope (scale units) a GPU must be to count.
    envelope_margin: float = Field(0.5, ge=0)


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


class AnomalyDetector(Declared):
    spec = DetectorSpec(
        name="anomaly",
        config=AnomalyConfig,
        emits=(FindingKind.ANOMALY,),
        reads={"gpu_samples": FRESH, "allocations": HISTORY},
        order=170,
        level="L0",
        streams=("gpu_samples",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("anomaly", AnomalyConfig, cfg)
        self.model: PeerEnvelope | None = None
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
        allocations = window.get("allocations")
        if allocations.height == 0:  # no GPU runs a job: no peers to compare (the join is empty)
            return self._report(now)
        dev = peer_deviations(fresh, allocations, c.scale, c.min_peers)
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
                self.model = PeerEnvelope(c.envelope_quantile, c.envelope_margin).fit(np.vstack(self._train))
                self._train = []
            return []
        # Only GPUs that stand out from their peers on some metric are worth scoring.
        far = dev.filter(pl.max_horizontal([pl.col(x).abs() for x in self._cols()]) >= c.min_abs_deviation)
        flagged: list[dict[str, Any]] = []
        streak: dict[tuple[str, int], int] = {}
        if far.height:
            excess = self.model.excess(far.select(self._cols()).to_numpy())
            for row, score in zip(far.iter_rows(named=True), excess):
                if score < c.envelope_margin:
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
                    gpu=row["gpu"],
                    cause="unknown",
                    source=self.name,
                    evidence={"beyond_healthy_envelope": round(row["score"], 3), **{f"deviation_{f}": v for f, v in devs.items()}, "most_unusual": top},
                    summary=(
                        f"{row['node']} GPU {row['gpu']} (job {row['job']} rank {row['rank']}) behaves unlike its peers: "
                        f"{top} is {devs[top]:+g} from the job's median; no known fault explains it yet."
                    ),
                )
            )
        return findings
