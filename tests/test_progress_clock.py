"""CollectiveClock, shared by the L1 dump trigger and the hang_fr detector (synthetic rows: the
arithmetic of the moving interval and the stall threshold)."""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil.util.progress import CollectiveClock


def rows(**sn_by_job: int) -> pl.DataFrame:
    return pl.DataFrame({"job": list(sn_by_job), "coll_sn": list(sn_by_job.values())})


def test_interval_is_a_moving_average_of_the_gaps_per_collective():
    clock = CollectiveClock(smoothing=0.5)
    clock.observe(rows(a=10), 100.0)
    assert clock.interval == {} and clock.last_move() == {"a": 100.0}
    clock.observe(rows(a=12), 104.0)  # 2 collectives in 4 s
    assert clock.interval["a"] == pytest.approx(2.0)
    clock.observe(rows(a=13), 108.0)  # 1 in 4 s: average of 2 and 4
    assert clock.interval["a"] == pytest.approx(3.0)
    clock.observe(rows(a=13), 120.0)  # no progress: neither the interval nor the last move change
    assert clock.interval["a"] == pytest.approx(3.0) and clock.last_move() == {"a": 108.0}


@pytest.mark.parametrize(
    "now, min_seconds, intervals, stalled",
    [
        (110.9, 3.0, 1.0, set()),  # 2.9 s without progress < 3 s floor
        (111.0, 3.0, 1.0, {"a"}),  # the floor reached (usual interval 2 s is below it)
        (111.0, 1.0, 2.0, set()),  # 3 s < 2 × 2 s: a slow job's normal gap is not a stall
        (112.0, 1.0, 2.0, {"a"}),
    ],
)
def test_stall_needs_both_the_floor_and_the_job_s_own_pace(now, min_seconds, intervals, stalled):
    clock = CollectiveClock()
    clock.observe(rows(a=1), 100.0)
    clock.observe(rows(a=5), 108.0)  # 2 s per collective
    assert clock.stalled(now, min_seconds, intervals) == stalled


def test_a_lower_sequence_number_restarts_the_clock_without_a_negative_interval():
    clock = CollectiveClock()
    clock.observe(rows(a=50), 10.0)
    clock.observe(rows(a=1), 20.0)  # the job restarted from a checkpoint
    assert clock.last_move() == {"a": 20.0} and "a" not in clock.interval
