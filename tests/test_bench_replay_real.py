"""benchmarks/replay_real.py's scoring, leak seeding and alert-rule `for` semantics (the bench
itself runs a real Prometheus over the whole trace: `gpuvigil bench replay-real`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.replay_real import Leak, add_leak, placement, rule_fires, score

GIB = float(1 << 30)


def test_a_leak_reaches_capacity_at_its_end_and_the_series_stops_there():
    ts = 1e9 + np.arange(0.0, 6000.0, 60.0)
    used = np.where(np.arange(ts.size) % 2 == 0, 24 * GIB, 12 * GIB)  # real-like swings: peak 24 GiB
    lts, lused, oom, rate = add_leak(ts, used, start=1e9 + 3600, duration=1200, capacity=80 * GIB)
    assert rate == pytest.approx(56 * GIB / 1200)
    assert oom == lts[-1] and lused[-1] == 80 * GIB and (lused[:-1] < 80 * GIB).all()
    assert 1e9 + 3600 + 1140 <= oom <= 1e9 + 3600 + 1200  # the peak sample reaches capacity on the hour's grid
    assert (lused[lts < 1e9 + 3600] == used[: (lts < 1e9 + 3600).sum()]).all()


def test_a_leak_that_never_reaches_capacity_has_no_oom():
    ts = np.arange(0.0, 600.0, 60.0)
    _, _, oom, _ = add_leak(ts, np.full(ts.size, GIB), start=0.0, duration=1e6, capacity=80 * GIB)
    assert oom == math.inf


def test_score_counts_warnings_leads_and_false_pages():
    leaks = [Leak("a", "fast", 1000.0, 3000.0, 1.0), Leak("b", "slow", 1000.0, 9000.0, 1.0), Leak("c", "fast", 1000.0, 2000.0, 1.0)]
    pages = {
        "a": [2000.0, 2500.0],  # lead 1000 s
        "b": [500.0, 8000.0],  # paged before its leak began (a false page), then 1000 s ahead
        "c": [1990.0],  # 10 s ahead: not warned
        "h1": [123.0],  # a healthy pod paged
    }
    s = score(pages, leaks, ["a", "b", "c", "h1", "h2"])
    assert (s["warned"], s["leaks"], s["median_lead_s"], s["false_pages"], s["healthy"]) == (2, 3, 1000.0, 2, 2)
    assert [x["lead_s"] for x in s["per_leak"]] == [1000.0, 1000.0, 10.0]


class _Answers:
    """query_range's answer for one series: true at the given evaluation times."""

    def __init__(self, times):
        self.times = times

    def query_range(self, expr, start, end, step):
        return [{"metric": {"pod": "p"}, "values": [[t, "1"] for t in self.times if start <= t <= end]}]


@pytest.mark.parametrize(
    "times, fired",
    [
        ([0, 60, 120, 180, 240, 300], [300.0]),  # true for 5 min: fires at the 6th evaluation
        ([0, 60, 120, 180, 240], []),  # 4 min: pending only
        ([0, 60, 120, 240, 300, 360, 420, 480, 540], [540.0]),  # a missed evaluation resets pending
        ([0, 60, 120, 180, 240, 300, 360, 600, 660, 720, 780, 840, 900], [300.0, 900.0]),  # fires again after resolving
    ],
)
def test_an_alert_fires_after_being_true_for_its_for_duration(times, fired):
    assert rule_fires(_Answers([float(t) for t in times]), "x", 300.0, 0.0, 1000.0).get("p", []) == fired


def test_pods_are_placed_eight_gpus_a_host_and_grouped_on_request():
    pods = [f"{i:032x}" for i in range(10)]
    one = placement(pods)
    assert [(one[p]["Hostname"], one[p]["gpu"]) for p in pods[7:9]] == [("genai-node-00", "7"), ("genai-node-01", "0")]
    assert len({v["pod"] for v in one.values()}) == 10 and len({v["UUID"] for v in one.values()}) == 10
    assert len({v["pod"] for v in placement(pods, 4).values()}) == 3
