"""Cluster fragmentation detector (gpuvigil/detectors/fragmentation_cluster.py): behaviour that
mutation testing (`make mutate`, docs/testing.md) showed no other test pinned down: the whole
finding (figures per node and per rack, the compaction moves, the summary).

Source: constructed scheduler frames (nodes, jobs, allocations), as in
tests/test_detectors_guards.py. The recorded real Slurm state (tests/data/slurm/) holds no
fragmented gang, so it is used as a hard negative only (tests/test_detectors_real.py).
"""

from __future__ import annotations

from gpuvigil import schemas
from gpuvigil.detectors.fragmentation_cluster import ClusterFragmentationDetector, plan_compaction
from gpuvigil.window import Window

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


# -- mutation testing: the plan's order, the blocking rule's edges, the share's figures --------


def _up(*free, n_gpus=8):
    return [{"node": name, "rack": "r0", "n_gpus": n_gpus, "free_gpus": f, "state": "up"} for name, f in free]


def test_a_job_goes_to_the_tightest_fit_though_another_node_sorts_first():
    """c (6 free) is emptied by moving sc (2 GPUs): a has 4 free, b 3; b is the tighter fit."""
    allocs = _used("a", "sa", 4) + _used("b", "sb", 5) + _used("c", "sc", 2)
    [f] = ClusterFragmentationDetector().detect(_window(_up(("a", 4), ("b", 3), ("c", 6)), _gang(), allocs))
    assert (f.node, f.evidence["moves"]) == ("c", [{"job": "sc", "from_node": "c", "to_node": "b", "gpus": 2}])


def test_the_larger_job_on_the_target_moves_first():
    """a and b (5 free each) hold GPUs no listed job owns, so c (2 free) is the node emptied:
    y (4 GPUs) moves first, onto a (a tie with b, broken by name); a then has 1 free, so x (2)
    goes to b."""
    allocs = _used("c", "x", 2) + _used("c", "y", 4, first=2)
    [f] = ClusterFragmentationDetector().detect(_window(_up(("a", 5), ("b", 5), ("c", 2)), _gang(), allocs))
    assert (f.node, f.evidence["moves"]) == ("c", [{"job": "y", "from_node": "c", "to_node": "a", "gpus": 4}, {"job": "x", "from_node": "c", "to_node": "b", "gpus": 2}])


def test_of_two_equal_jobs_the_first_by_name_moves():
    """c (6 free) needs 2 more: q and p (2 GPUs each) could go; p, first by name, does."""
    allocs = _used("a", "sa", 4) + _used("c", "q", 2) + [{"node": "c", "gpu": 2 + g, "job": "p", "rank": g} for g in range(2)]
    [f] = ClusterFragmentationDetector().detect(_window(_up(("a", 4), ("c", 6)), _gang(), allocs))
    assert f.evidence["moves"] == [{"job": "p", "from_node": "c", "to_node": "a", "gpus": 2}]


def test_a_gang_pending_exactly_the_minimum_time_is_reported():
    allocs = _used("n0", "s0", 4) + _used("n1", "s1", 4)
    w = _window(_up(("n0", 4), ("n1", 4)), _gang(submit_ago=10.0), allocs)
    assert ClusterFragmentationDetector().config.min_pending_seconds == 10.0
    assert [f.job for f in ClusterFragmentationDetector().detect(w)] == ["gang"]


def test_a_two_node_gang_with_one_whole_node_free_is_blocked_and_given_no_single_node_plan():
    """gang16: 16 GPUs, 8 per node; 16 free, but only a has all 8: one node fits, two are needed.
    A compaction plan frees one node, which is no plan for a two-node gang."""
    jobs = [{"job": "gang16", "state": "pending", "n_gpus": 16, "gpus_per_node": 8, "submit_ts": NOW - 60, "priority": "P1"}]
    allocs = _used("b", "sb", 4) + _used("c", "sc", 4)
    [f] = ClusterFragmentationDetector().detect(_window(_up(("a", 8), ("b", 4), ("c", 4)), jobs, allocs))
    assert (f.job, f.node, f.evidence["moves"], f.evidence["free_gpus"], f.evidence["largest_gang_per_node"]) == ("gang16", None, [], 16, 8)


def test_a_gang_that_fits_does_not_stop_the_next_one_from_being_judged():
    """small (4 per node, waiting longer) fits on n0; gang (8 per node) behind it is blocked."""
    jobs = [{"job": "small", "state": "pending", "n_gpus": 4, "gpus_per_node": 4, "submit_ts": NOW - 90, "priority": "P1"}, *_gang()]
    allocs = _used("n0", "s0", 4) + _used("n1", "s1", 4)
    assert [f.job for f in ClusterFragmentationDetector().detect(_window(_up(("n0", 4), ("n1", 4)), jobs, allocs))] == ["gang"]


def test_blocked_gangs_are_reported_longest_waiting_first():
    jobs = [{"job": "late", "state": "pending", "n_gpus": 8, "gpus_per_node": 8, "submit_ts": NOW - 20, "priority": "P1"},
            {"job": "early", "state": "pending", "n_gpus": 8, "gpus_per_node": 8, "submit_ts": NOW - 90, "priority": "P1"}]
    allocs = _used("n0", "s0", 4) + _used("n1", "s1", 4)
    assert [f.job for f in ClusterFragmentationDetector().detect(_window(_up(("n0", 4), ("n1", 4)), jobs, allocs))] == ["early", "late"]


def test_a_job_with_no_per_node_shape_counts_at_most_a_node_and_the_share_is_given_to_three_places():
    """Free 4, 4, 3 (11). Pending shapes: the gang needs 8 on one node (all 11 unusable); `loose`
    (4 GPUs, no per-node shape) needs min(4, 8 per node) = 4, so only the 3 are unusable to it.
    Expected unusable share (11 + 3) / 2 / 11 = 0.636."""
    jobs = [*_gang(), {"job": "loose", "state": "pending", "n_gpus": 4, "gpus_per_node": None, "submit_ts": NOW - 60, "priority": "P1"}]
    allocs = _used("n0", "s0", 4) + _used("n1", "s1", 4) + _used("n2", "s2", 5)
    [f] = ClusterFragmentationDetector().detect(_window(_up(("n0", 4), ("n1", 4), ("n2", 3)), jobs, allocs))
    assert (f.job, f.evidence["unusable_free_share"]) == ("gang", 0.636)


def test_a_plan_is_found_where_moving_the_largest_job_first_strands_the_node():
    """constructed (found by the brute-force property test in tests/test_detectors_units.py): n01
    holds jobs of 2, 2 and 3 GPUs with 1 free, n00 has 4 free; a 5-GPU gang needs one node.
    Moving the 3-GPU job first leaves room for neither 2-GPU job; moving the two 2-GPU jobs to n00
    frees 5 GPUs on n01."""
    target, moves = plan_compaction({"n00": 4, "n01": 1}, {"n00": {"j0": 4}, "n01": {"j1": 2, "j2": 2, "j3": 3}}, 5)
    assert (target, [(m["job"], m["to_node"], m["gpus"]) for m in moves]) == ("n01", [("j1", "n00", 2), ("j2", "n00", 2)])
