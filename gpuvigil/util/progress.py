"""Per-job collective clock: how a job's newest collective sequence number moves over time.

Shared by the L1 dump trigger (a collector-side sink) and the `hang_fr` detector, which may not
import each other: both read the `collective_progress` stream (NCCL Inspector) and ask when a job
last completed a collective and how long its collectives usually take.
"""

from __future__ import annotations

import polars as pl


class CollectiveClock:
    """Per job: the newest `coll_sn` seen, when it last moved, and the usual time between
    collectives (an exponential moving average of the gaps, weight `smoothing` for the newest)."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self._newest: dict[str, tuple[int, float]] = {}  # job -> (max coll_sn, when it last moved)
        self.interval: dict[str, float] = {}

    def observe(self, progress: pl.DataFrame, now: float) -> None:
        """Fold in the fresh `collective_progress` rows of one tick."""
        if progress.height == 0:
            return
        for job, sn in progress.group_by("job").agg(pl.col("coll_sn").max()).iter_rows():
            prev = self._newest.get(job)
            if prev is not None and sn == prev[0]:
                continue
            if prev is not None and sn > prev[0]:
                gap = (now - prev[1]) / (sn - prev[0])
                old = self.interval.get(job)
                self.interval[job] = gap if old is None else (1 - self.smoothing) * old + self.smoothing * gap
            self._newest[job] = (sn, now)

    def last_move(self) -> dict[str, float]:
        """When each job's newest collective sequence number last changed."""
        return {job: t for job, (_sn, t) in self._newest.items()}

    def stall_threshold(self, job: str, min_seconds: float, intervals: float) -> float:
        """Seconds without progress that count as a stall for `job`: at least `min_seconds`, and
        `intervals` times its usual gap between collectives."""
        return max(min_seconds, intervals * self.interval.get(job, 0.0))

    def stalled(self, now: float, min_seconds: float, intervals: float) -> set[str]:
        return {job for job, t in self.last_move().items() if now - t >= self.stall_threshold(job, min_seconds, intervals)}
