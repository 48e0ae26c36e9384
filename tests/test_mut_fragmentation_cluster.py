"""Cluster fragmentation detector (gpuvigil/detectors/fragmentation_cluster.py): behaviour that
mutation testing (`make mutate`, docs/testing.md) showed no other test pinned down: the whole
finding (figures per node and per rack, the compaction moves, the summary).

Source: constructed scheduler frames (nodes, jobs, allocations), as in
tests/test_detectors_guards.py. The recorded real Slurm state (tests/data/slurm/) holds no
fragmented gang, so it is used as a hard negative only (tests/test_detectors_real.py).
"""

from __future__ import annotations

from gpuvigil import schemas
from gpuvigil.detectors.fragmentation_cluster import ClusterFragmentationDetector
from gpuvigil.pipeline.window import Window

NOW = 1000.0


def _window(nodes, jobs, allocs):
    w = Window(1e9)
    w.add("nodes", schemas.frame(nodes, schemas.NODES))
    w.add("jobs", schemas.frame(jobs, schemas.JOBS))
    w.add("allocations", schemas.frame(allocs, schemas.ALLOCATIONS))
    w.seal(NOW)
    return w


def _used(node, job, n, first=0):
    return [{"node": node, "gpu": g, "job": job, "rank": g - first} for g in range(first, first + n)]


def test_blocked_gang_finding_states_free_blocks_per_node_and_rack_and_the_moves():
    """Racks r0 (n0, n1: 4 GPUs free each) and r1 (n2: 3 free; n3 drained, 8 free but unusable).
    Gang `gang` (8 GPUs, 8 per node) has waited 60 s with 11 GPUs free. Moving the 4-GPU job s0
    off n0 onto n1 empties n0."""
    nodes = [{"node": "n0", "rack": "r0", "n_gpus": 8, "free_gpus": 4, "state": "up"},
             {"node": "n1", "rack": "r0", "n_gpus": 8, "free_gpus": 4, "state": "up"},
             {"node": "n2", "rack": "r1", "n_gpus": 8, "free_gpus": 3, "state": "up"},
             {"node": "n3", "rack": "r1", "n_gpus": 8, "free_gpus": 8, "state": "drain"}]
    jobs = [{"job": "gang", "state": "pending", "n_gpus": 8, "gpus_per_node": 8, "submit_ts": NOW - 60, "priority": "P1"}]
    allocs = _used("n0", "s0", 4) + _used("n1", "s1", 4) + _used("n2", "s2", 5)
    [f] = ClusterFragmentationDetector().detect(_window(nodes, jobs, allocs))
    assert (f.kind.value, f.severity.value, f.source, f.job, f.node, f.ts) == ("fragmentation_cluster", "ticket", "fragmentation_cluster", "gang", "n0", NOW)
    assert f.evidence == {
        "pending_gpus": 8, "gpus_per_node": 8, "free_gpus": 11, "unusable_free_share": 1.0,
        "largest_gang_per_node": 4, "largest_gang_per_rack": 8, "pending_seconds": 60.0,
        "moves": [{"job": "s0", "from_node": "n0", "to_node": "n1", "gpus": 4}],
    }
    assert f.summary == ("gang (8 GPUs, 8 per node) has waited 60 s although 11 GPUs are free: they are scattered "
                         "(largest free block 4 GPUs on one node); moving 1 small job(s) off n0 frees a slot.")


def _gang(submit_ago=60.0):
    return [{"job": "gang", "state": "pending", "n_gpus": 8, "gpus_per_node": 8, "submit_ts": NOW - submit_ago, "priority": "P1"}]


def test_the_node_with_most_free_gpus_is_emptied_first_onto_the_tightest_fit():
    """c has 6 free (job sc uses 2), b 4 free (sb: 4), a 3 free (sa: 5). Emptying c takes one
    move, sc onto a (the tightest node it fits on), though a sorts first by name. Waited 60.37 s:
    reported to a tenth."""
    nodes = [{"node": n, "rack": "r0", "n_gpus": 8, "free_gpus": f, "state": "up"} for n, f in (("a", 3), ("b", 4), ("c", 6))]
    allocs = _used("a", "sa", 5) + _used("b", "sb", 4) + _used("c", "sc", 2)
    [f] = ClusterFragmentationDetector().detect(_window(nodes, _gang(60.37), allocs))
    assert (f.node, f.evidence["moves"], f.evidence["pending_seconds"]) == ("c", [{"job": "sc", "from_node": "c", "to_node": "a", "gpus": 2}], 60.4)


def test_a_node_whose_busy_gpus_belong_to_no_known_job_is_passed_over():
    """n_res has the most free GPUs (5) but its other 3 are held outside any allocation the
    scheduler lists: nothing to move there, so n0 (4 free, job s0 of 4) is emptied onto n_res."""
    nodes = [{"node": "n_res", "rack": "r0", "n_gpus": 8, "free_gpus": 5, "state": "up"},
             {"node": "n0", "rack": "r0", "n_gpus": 8, "free_gpus": 4, "state": "up"}]
    [f] = ClusterFragmentationDetector().detect(_window(nodes, _gang(), _used("n0", "s0", 4)))
    assert (f.node, f.evidence["moves"]) == ("n0", [{"job": "s0", "from_node": "n0", "to_node": "n_res", "gpus": 4}])


def test_no_compaction_possible_is_still_reported_without_a_plan():
    """n0 and n1 have 4 free each; the only jobs on them span both nodes (a multi-node job is not
    moved): the gang is blocked by fragmentation, but no plan frees a node."""
    nodes = [{"node": n, "rack": "r0", "n_gpus": 8, "free_gpus": 4, "state": "up"} for n in ("n0", "n1")]
    allocs = _used("n0", "big", 4) + [{"node": "n1", "gpu": g, "job": "big", "rank": 4 + g} for g in range(4)]
    [f] = ClusterFragmentationDetector().detect(_window(nodes, _gang(), allocs))
    assert (f.job, f.node, f.evidence["moves"], f.evidence["free_gpus"]) == ("gang", None, [], 8)
    assert f.summary == "gang (8 GPUs, 8 per node) has waited 60 s although 8 GPUs are free: they are scattered (largest free block 4 GPUs on one node)."
