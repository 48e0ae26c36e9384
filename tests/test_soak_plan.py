"""The soak's scenario (benchmarks/soak.py): a steady state, so that serve's RSS
slope can be read. Jobs arrive and complete at the same rate, the number running stays level, a
restarted serve continues the jobs that were running with the steps they had left, and faults
hit jobs that run at the time. Also the simulator's `total_steps`: a job completes and frees its
GPUs."""

from __future__ import annotations

import statistics

from benchmarks.soak import JOB_STARTUP_SECONDS, _end, job_plan, scenario
from gpuvigil.app.runtime import build_simulated
from gpuvigil.sim.scenario import Scenario


def _running(jobs: list[dict], t: float) -> list[dict]:
    return [j for j in jobs if j["submit_at"] <= t < _end(j)]


def test_the_planned_job_count_is_level_while_jobs_come_and_go():
    jobs = job_plan(10_000, 3600, seed=0)
    counts = [len(_running(jobs, t)) for t in range(0, 3600, 60)]
    mean = statistics.fmean(counts)
    # Level: every minute within a quarter of the mean (a Poisson population of ~150 jobs whose
    # count wanders with a correlation time of the mean run time, 240 s), from the first minute on.
    assert all(abs(c - mean) < 0.25 * mean for c in counts), counts
    # No trend: over ten seeds, the first and the second half-hour hold as many jobs.
    plans = [job_plan(10_000, 3600, seed=s) for s in range(10)]
    halves = [statistics.fmean(len(_running(p, t)) for p in plans for t in range(a, a + 1800, 60)) for a in (0, 1800)]
    assert abs(halves[0] - halves[1]) < 0.05 * statistics.fmean(halves), halves
    arrived = sum(1 for j in jobs if 600 <= j["submit_at"] < 3000)
    completed = sum(1 for j in jobs if 600 <= _end(j) < 3000)
    assert arrived > 1000 and abs(arrived - completed) < 0.1 * arrived  # turnover, balanced


def test_a_restarted_serve_continues_the_running_jobs_and_drops_the_finished():
    full = scenario(10_000, 750, 10.0, seed=0)
    later = scenario(10_000, 750, 10.0, seed=0, offset=100.0)
    Scenario.model_validate(full)
    Scenario.model_validate(later)
    by_name = {j["name"]: j for j in full["jobs"]}
    kept = {j["name"]: j for j in later["jobs"]}
    assert not any(_end(j) <= 100.0 for j in (by_name[n] for n in kept))  # finished ones are gone
    assert {j["name"] for j in _running(full["jobs"], 100.0)} <= set(kept)  # running ones continue
    for name, j in kept.items():
        old = by_name[name]
        if old["submit_at"] < 100.0:
            assert j["submit_at"] == 0.0 and j["total_steps"] <= old["total_steps"]
            left = _end(old) - 100.0
            assert abs(j["total_steps"] * j["step_time_seconds"] + JOB_STARTUP_SECONDS - left) <= JOB_STARTUP_SECONDS + j["step_time_seconds"]
        else:
            assert j["submit_at"] == round(old["submit_at"] - 100.0, 1)
    # Every fault targets a job that runs when it fires.
    for f in full["faults"]:
        job = by_name[f["job"]]
        assert job["submit_at"] + JOB_STARTUP_SECONDS <= f["at"] < _end(job)


def test_a_job_with_total_steps_completes_and_frees_its_gpus():
    sc = Scenario.model_validate(
        {"name": "t", "nodes": 2, "duration_seconds": 120,
         "jobs": [{"name": "short", "gpus": 8, "gpus_per_node": 8, "step_time_seconds": 0.5, "total_steps": 20},
                  {"name": "long", "gpus": 8, "gpus_per_node": 8, "step_time_seconds": 0.5}]}
    )
    rt = build_simulated(sc)
    rt.run(60.0)
    jobs = rt.scheduler.jobs
    assert jobs["short"].state == "completed" and jobs["long"].state == "running"
    assert rt.scheduler.placements().get("short") is None
    assert sum(1 for ns in rt.scheduler.nodes.values() for owner in ns.used.values() if owner == "short") == 0


def test_the_busy_gpus_stay_level_so_the_rss_slope_measures_serve_not_the_workload():
    # A closed loop (each job's successor starts when it completes): an open Poisson stream let the
    # busy GPUs rise 36% inside the window where the slope is read (seed 0, 12.5 min), and serve's
    # memory follows the running ranks.
    for minutes in (12.5, 25.0):
        jobs = job_plan(10_000, minutes * 60, seed=0)
        busy = {sum(j["gpus"] for j in _running(jobs, t)) for t in range(0, int(minutes * 60), 10)}
        running = {len(_running(jobs, t)) for t in range(0, int(minutes * 60), 10)}
        assert len(busy) == 1 and len(running) == 1, (busy, running)
        assert 0.55 * 10_000 <= busy.pop() <= 0.65 * 10_000
    # Sizes keep their mix; run times are exponential with the planned mean.
    jobs = job_plan(10_000, 3600, seed=0)
    assert {j["gpus"] for j in jobs} == {8, 16, 32, 64, 128}
    runs = [j["total_steps"] * j["step_time_seconds"] for j in jobs]
    assert abs(statistics.fmean(runs) - 240.0) < 0.15 * 240.0


def test_the_minute_median_slope_ignores_render_peaks_and_keeps_real_growth():
    from benchmarks.soak import _minute_medians, _slope

    # 1 s samples over 7 minutes; a 5 s peak of +50 MB after each minute's /metrics render,
    # the last one right at the window's end, where it tilts a plain least-squares fit.
    flat = [(float(t), 300.0 + (50.0 if t % 60 >= 55 else 0.0)) for t in range(0, 420)]
    assert _slope(flat) * 3600 > 10  # the plain fit reads the peaks as growth
    assert abs(_slope(_minute_medians(flat, 0.0)) * 3600) < 1e-6
    growing = [(t, r + t * 100 / 3600) for t, r in flat]  # plus 100 MB/h of real growth
    assert abs(_slope(_minute_medians(growing, 0.0)) * 3600 - 100) < 1
