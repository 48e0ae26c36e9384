"""Mutation testing: shared detector helpers (`gpuvigil/detectors/common.py`):
`current_run` (a requeued job's previous run is not read) and `Persistence`.

Data: constructed `rank_progress` and `jobs` frames (the helper's contract; the detectors that use
it are tested on captures in their own files). In the mutation run only the straggler's refit
reached `current_run`, through the hypothesis test that the fast selection leaves out.
"""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.detectors.common import Persistence, current_run, rank_at
from gpuvigil.window import Window


def _rows(job: str, times: list[float]) -> list[dict]:
    return [{"ts": t, "job": job, "rank": 0, "step": int(t)} for t in times]


def _window(rows: list[dict], jobs: list[dict] | None, now: float = 100.0) -> Window:
    w = Window(600.0)
    w.add("rank_progress", schemas.frame(rows, schemas.RANK_PROGRESS))
    if jobs is not None:
        w.add("jobs", schemas.frame(jobs, schemas.JOBS))
    w.seal(now)
    return w


def _steps(df: pl.DataFrame) -> list[tuple[str, int]]:
    return sorted(df.select("job", "step").rows())


def test_rows_before_the_jobs_latest_start_are_dropped_and_unlisted_jobs_kept():
    rows = _rows("a", [10.0, 49.0, 50.0, 60.0]) + _rows("b", [5.0, 70.0])
    jobs = [{"job": "a", "state": "running", "start_ts": 50.0}, {"job": "c", "state": "running", "start_ts": 0.0}]
    out = current_run(_window(rows, jobs), "rank_progress")
    assert _steps(out) == [("a", 50), ("a", 60), ("b", 5), ("b", 70)]  # the start itself is in the run
    assert out.columns == list(schemas.RANK_PROGRESS.names()) and out.schema == schemas.RANK_PROGRESS


def test_a_listed_job_without_a_start_keeps_all_its_rows():
    rows = _rows("a", [10.0, 60.0])
    out = current_run(_window(rows, [{"job": "a", "state": "pending", "start_ts": None}]), "rank_progress")
    assert _steps(out) == [("a", 10), ("a", 60)]


def test_warmup_after_the_start():
    rows = _rows("a", [50.0, 59.0, 60.0, 70.0])
    w = _window(rows, [{"job": "a", "state": "running", "start_ts": 50.0}])
    assert _steps(current_run(w, "rank_progress", warmup=10.0)) == [("a", 60), ("a", 70)]
    assert _steps(current_run(w, "rank_progress")) == [("a", 50), ("a", 59), ("a", 60), ("a", 70)]


def test_since_bounds_the_rows_inclusively_with_or_without_jobs():
    rows = _rows("a", [10.0, 20.0, 30.0])
    assert _steps(current_run(_window(rows, None), "rank_progress", since=20.0)) == [("a", 20), ("a", 30)]
    jobs = [{"job": "a", "state": "running", "start_ts": 0.0}]
    assert _steps(current_run(_window(rows, jobs), "rank_progress", since=20.0)) == [("a", 20), ("a", 30)]
    assert _steps(current_run(_window(rows, jobs), "rank_progress")) == [("a", 10), ("a", 20), ("a", 30)]


def test_no_jobs_or_no_rows_return_the_stream_as_it_is():
    rows = _rows("a", [10.0, 20.0])
    out = current_run(_window(rows, None), "rank_progress")
    assert _steps(out) == [("a", 10), ("a", 20)] and out.schema == schemas.RANK_PROGRESS
    out = current_run(_window([], [{"job": "a", "state": "running", "start_ts": 50.0}]), "rank_progress")
    assert out.height == 0 and out.schema == schemas.RANK_PROGRESS
    one = current_run(_window(_rows("a", [10.0]), [{"job": "a", "state": "running", "start_ts": 50.0}]), "rank_progress")
    assert one.height == 0  # a single row of the previous run is dropped too


def test_persistence_counts_consecutive_evaluations_per_rank():
    p = Persistence()
    f = lambda ranks: pl.DataFrame({"job": ["j"] * len(ranks), "rank": ranks, "x": list(range(len(ranks)))}, schema={"job": pl.String, "rank": pl.Int32, "x": pl.Int64})
    assert p.persistent(f([1, 2]), 2).height == 0
    kept = p.persistent(f([1, 3]), 2)
    assert kept["rank"].to_list() == [1] and kept.columns == ["job", "rank", "x"]
    assert p.persistent(f([3]), 2)["rank"].to_list() == [3]
    assert p.persistent(f([1, 3]), 2)["rank"].to_list() == [3]  # rank 1 missed one evaluation: starts again


@pytest.mark.parametrize(
    ("rank", "node", "gpu", "text"),
    [(3, "n0", 2, "rank 3 (n0 GPU 2)"), (3, "n0", 0, "rank 3 (n0 GPU 0)"), (3, "n0", None, "rank 3 (n0)"), (3, None, 1, "rank 3 (GPU 1)"), (3, None, None, "rank 3")],
)
def test_a_rank_is_placed_by_what_its_rows_carry(rank, node, gpu, text):
    """A hook record without `gpu` (or without a node) leaves it out of the summary, never 'None'."""
    assert rank_at(rank, node, gpu) == text
