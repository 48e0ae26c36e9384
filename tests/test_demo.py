"""Every built-in scenario end to end on the simulated cluster: the injected fault, a finding of
the right kind naming the right job/rank/node/GPU with its cause and severity within its latency
bound, and the scheduler's action; hard negatives raise nothing. This is what `make demo` shows.

Each simulated fault type is tested end to end once: here where the demo has it, in
test_detectors_faults.py (hints off, so an OOM runs its course) where it has not."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

from gpuvigil.sim.scenario import builtin_names
from gpuvigil.app.demo import ScenarioResult, run_scenario

# scenario → (expected finding kind or None, extra finding fields, scheduler action taken on its hint, job resumes)
EXPECTED = {
    "healthy": (None, {}, None, False),
    "checkpoint_pause": (None, {}, None, False),
    "leak_to_oom": ("oom_predicted", {"cause": "leak"}, "resized", True),
    "fragmentation_oom": ("oom_predicted", {"cause": "fragmentation"}, "set_alloc_conf", True),
    "nccl_hang": ("collective_hang", {"cause": "software", "severity": "page"}, "requeued", True),
    "node_xid79": ("xid", {"xid": 79, "severity": "page", "cause": "hardware"}, "cordoned", True),
    "mass_xid": ("xid", {"xid": 79, "severity": "page", "cause": "hardware"}, "cordoned", True),
    "ecc_dbe": ("ecc", {"severity": "page", "cause": "hardware"}, "drained", True),
    "thermal_throttle": ("thermal_throttle", {}, "avoid_gpu", False),
    "straggler": ("straggler", {}, "avoid_gpu", False),
    "cluster_fragmentation": ("fragmentation_cluster", {}, "moved", True),
}

# Seconds from the fault's onset within which its first finding must come.
LATENCY_BOUND = {"nccl_hang": 10, "node_xid79": 5, "mass_xid": 5, "ecc_dbe": 5, "thermal_throttle": 60, "straggler": 60}
# Kinds whose finding must name the faulty GPU itself.
NAMES_GPU = ("xid", "ecc", "thermal_throttle", "straggler", "collective_hang")


@pytest.fixture(scope="module")
def results() -> dict[str, ScenarioResult]:
    names = builtin_names()
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(names, pool.map(run_scenario, names)))


def test_every_builtin_scenario_is_covered():
    assert sorted(EXPECTED) == builtin_names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_end_to_end(results, name):
    kind, fields, action, resumes = EXPECTED[name]
    res = results[name]
    assert res.problems == [], res.problems
    if kind is None:
        assert res.findings == []
        assert not [a for a in res.actions if a["hint_id"]], "a hard negative must not make the scheduler act"
        return
    fault = res.injected[0]
    matching = [f for f in res.findings if f["kind"] == kind and f["job"] == fault["job"]]
    assert matching, f"no {kind} finding for {fault['job']}: {[f['kind'] for f in res.findings]}"
    first = matching[0]
    for key, value in fields.items():
        assert first[key] == value, (key, first[key])
    if fault["node"] is not None and kind not in ("oom_predicted",):
        assert first["node"] == fault["node"]
    if kind in ("collective_hang", "straggler"):
        assert first["culprit_ranks"] == fault["ranks"]
    if kind in NAMES_GPU and fault["gpu"] is not None:
        assert first["gpu"] == fault["gpu"], (first["gpu"], fault["gpu"])
    if name in LATENCY_BOUND:
        assert first["ts"] <= fault["ts"] + LATENCY_BOUND[name], (first["ts"] - fault["ts"], LATENCY_BOUND[name])
    if kind == "oom_predicted":
        assert set(fault["ranks"]) <= set(first["ranks"])
        assert first["evidence"]["time_to_oom_seconds"] > 0
    assert first["ts"] >= fault["ts"], "detected before the fault was injected"
    assert first["summary"] and first["evidence"]
    hint_ids = {h["id"] for h in res.hints if h["finding_id"] == first["id"]}
    acted = [a for a in res.actions if a["hint_id"] in hint_ids]
    assert action in [a["action"] for a in acted], f"scheduler did not {action}: {[(a['action'], a['hint_id']) for a in res.actions]}"
    if resumes:
        resumed = [a for a in res.actions if a["action"] == "placed" and a["job"] == fault["job"] and a["ts"] >= first["ts"]]
        assert resumed, f"{fault['job']} was not placed again after the action"


def test_mass_xid_storm_stops_at_the_breaker_cap_with_one_page(results):
    """A bad driver rollout: fatal XIDs on 6 of 10 nodes in two minutes. The breaker's cap is 25%
    of the fleet (2 nodes): exactly those are cordoned, it opens once (the page), and the later
    nodes' hints are held, none applied."""
    res = results["mass_xid"]
    faulty = [f["node"] for f in res.injected]
    assert len(set(faulty)) == 6 and res.nodes == 10
    assert all(f["kind"] == "xid" for f in res.findings if f["node"] in faulty and f["incident_role"] == "opened")
    cordoned = [a["node"] for a in res.actions if a["action"] in ("cordoned", "drained")]
    assert cordoned == faulty[:2]
    [opened] = [a for a in res.actions if a["action"] == "breaker_open"]
    assert opened["detail"].startswith("breaker open: 1 node(s) would have been drained (8 GPU(s)), top causes xid (1)")
    assert opened["ts"] == res.injected[2]["ts"]
    held = {a["node"] for a in res.actions if a["action"] == "breaker_held" and a["node"]}
    assert held == set(faulty[2:])
    assert not [a for a in res.actions if a["ts"] >= opened["ts"] and a["action"] in ("cordoned", "drained", "requeued", "avoid_gpu")]


def test_hang_detected_long_before_the_watchdog(results):
    res = results["nccl_hang"]
    onset = res.injected[0]["ts"]
    hang = next(f for f in res.findings if f["kind"] == "collective_hang")
    # Job steps every 1.2 s; PyTorch's default watchdog would fire after 600 s.
    assert hang["ts"] - onset <= 10


def test_leak_predicted_before_the_oom(results):
    res = results["leak_to_oom"]
    pred = next(f for f in res.findings if f["kind"] == "oom_predicted")
    assert pred["evidence"]["time_to_oom_seconds"] >= 60


def test_runs_are_deterministic_per_seed():
    a = run_scenario("straggler", seed=3).to_json_dict()
    b = run_scenario("straggler", seed=3).to_json_dict()
    assert a == b


def test_demo_json_cli_prints_one_object_per_scenario():
    out = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "demo", "--scenario", "nccl_hang", "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["scenario"] == "nccl_hang" and obj["ok"] is True
    assert {"injected", "findings", "actions"} <= set(obj)
    assert obj["injected"][0]["kind"] == "nccl_hang"
    assert {"kind", "ts", "job", "ranks", "node"} <= set(obj["injected"][0])
    assert obj["findings"][0]["kind"] == "collective_hang"
