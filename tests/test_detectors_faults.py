"""The default detector set on each injected fault (tests/data/detectors/scenarios/*.yaml) that
the demo's scenarios do not already test end to end (tests/test_demo.py has the fast-step hang,
XID 79, ECC DBE, thermal throttling and the straggler), run on the simulated cluster with hints
off so each fault runs its course: an OOM warned of really happens and its message is classified.

Each case asserts the behaviour (the right kind names the right job, culprit ranks, node, GPU
and cause, within the latency target) and then compares every finding with its golden file
(tests/data/golden/findings/<scenario>.json; `pytest --update-goldens` rewrites them for review)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.detectors_helpers import check_golden, run

# scenario → (tick seconds, kind that must be raised, fields it must carry, latency bound from onset in s)
CASES = {
    # 40 s steps: the stall threshold is 1.5 steps, so the bound is 3 step times.
    "hang_slow_steps": (4.0, "collective_hang", {"culprit_ranks": [12], "node": "node-001", "gpu": 4, "cause": "software"}, 120),
    "remap_failure": (1.0, "row_remap_failure", {"node": "node-001", "gpu": 2, "severity": "page", "cause": "hardware"}, 5),
    "pcie_replay": (1.0, "pcie_replay", {"cause": "hardware", "node": "node-000", "gpu": 6, "severity": "ticket"}, 130),
    "memory_leak": (1.0, "oom_predicted", {"cause": "leak"}, 60),
    "fragmentation": (1.0, "oom_predicted", {"cause": "fragmentation"}, 60),
    "foreign_process": (1.0, "oom_predicted", {"cause": "foreign_process"}, 60),
}
# After the warning, the OOM really happens (hints are off): its message is classified.
OOM_KIND = {"memory_leak": "oom_capacity", "fragmentation": "oom_fragmentation", "foreign_process": "oom_foreign_process"}


@pytest.fixture(scope="module")
def results():
    names = sorted(CASES)
    # spawn, not fork: forking a process whose polars thread pool is running can deadlock.
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(names, pool.map(run, names, [CASES[n][0] for n in names])))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fault_is_found_and_named(results, name):
    _tick, kind, fields, bound = CASES[name]
    res = results[name]
    fault = res["injected"][0]
    matching = [f for f in res["findings"] if f["kind"] == kind and f["job"] == fault["job"]]
    assert matching, f"no {kind} for {fault['job']}: {[(f['kind'], f['job']) for f in res['findings']]}"
    first = matching[0]
    for key, value in fields.items():
        assert first[key] == value, (key, first[key], value)
    assert fault["ts"] <= first["ts"] <= fault["ts"] + bound, (first["ts"], fault["ts"])
    if kind == "oom_predicted":
        assert set(fault["ranks"]) & set(first["ranks"]), "the leaking rank is not among the ranks at risk"
        oom = [o for o in res["oom_events"] if o["job"] == fault["job"]]
        assert oom, "the simulated fault should end in a real OOM with hints off"
        assert first["ts"] <= oom[0]["ts"] - 60, "warned less than 60 s before the OOM"
        classified = [f for f in res["findings"] if f["kind"].startswith("oom_") and f["kind"] != "oom_predicted"]
        assert classified and classified[0]["kind"] == OOM_KIND[name], [f["kind"] for f in classified]
    if name == "fragmentation":
        assert any(f["kind"] == "fragmentation_allocator" for f in res["findings"])
    if name == "gpu_lost":
        hang = [f for f in res["findings"] if f["kind"] == "collective_hang"]
        assert hang and hang[0]["cause"] == "hardware" and hang[0]["culprit_ranks"] == [9]


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_page_from_the_model_and_golden(results, name):
    res = results[name]
    assert not [f for f in res["findings"] if f["kind"] == "anomaly" and f["severity"] == "page"]
    check_golden(name, res)
