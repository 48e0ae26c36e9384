"""The built-in scheduler framework and its policy plugins, on small hand-built clusters."""

from __future__ import annotations

import numpy as np
import pytest

from gpuvigil import config
from gpuvigil.model import FindingKind, Hint, HintAction
from gpuvigil.scheduler import JobSpec, NodeSpec, Scheduler
from gpuvigil.scheduler.actions import find_plan
from gpuvigil.scheduler.config import SchedulerConfig, load_scheduler_config
from gpuvigil.scheduler.framework import Plan, Session
from gpuvigil.scheduler.plugins.fragmentation import Workload, node_fragmentation

GIB = 1 << 30


def cluster(n: int = 2, gpus: int = 8, racks: int = 1, **kw) -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", rack=f"r{i * racks // n}", n_gpus=gpus, **kw) for i in range(n)]


def sched(nodes=None, **overrides) -> Scheduler:
    cfg = config.load(overrides={"scheduler": overrides}) if overrides else None
    return Scheduler(nodes or cluster(), cfg)


def hint(action: HintAction, **kw) -> Hint:
    return Hint(action=action, ts=0.0, reason=kw.pop("reason", "test"), finding_id="f1", finding_kind=FindingKind.XID, **kw)


def nodes_of(s: Scheduler, job: str) -> list[str]:
    return sorted({n for n, _ in s.jobs[job].placement})


# -- config -------------------------------------------------------------------------------------


def test_default_config_loads_from_yaml():
    cfg = load_scheduler_config(config.defaults())
    assert cfg.actions == ["enqueue", "allocate", "preempt", "backfill"]
    assert cfg.priority.preempt_grace_seconds == {"P0": 0, "P1": 300}
    assert cfg.placement == "ours"


@pytest.mark.parametrize(
    "override, reason",
    [
        ({"actions": ["enqueue", "allocate", "shuffle"]}, "unknown action"),
        ({"actions": ["enqueue", "preempt"]}, "'allocate' must be enabled"),
        ({"actions": ["allocate", "enqueue"]}, "in the order"),
        ({"plugins": ["priority", "gang", "magic"]}, "unknown plugin"),
        ({"plugins": ["priority", "health"]}, "'gang' cannot be disabled"),
        ({"placement": "random"}, "placement"),
        ({"priority": {"preempt_grace_seconds": {"P1": -5}}}, "must be >= 0"),
        ({"priority": {"preempt_grace_seconds": {"P9": 10}}}, "unknown class"),
        ({"priority": {"classes": ["P0", "P0"]}}, "distinct"),
        ({"quota": {"tenants": {"a": {"gpus": -1}}}}, "quota.tenants.a.gpus"),
        ({"score_weights": {"luck": 1.0}}, "unknown score weight"),
        ({"score_weights": {"binpack": -1.0}}, "must be >= 0"),
        ({"backfil": {}}, "backfil"),
    ],
)
def test_invalid_config_is_rejected_with_the_reason(override, reason):
    with pytest.raises(config.ConfigError, match="scheduler") as err:
        Scheduler(cluster(), config.load(overrides={"scheduler": override}))
    assert reason in str(err.value)


# -- gang ---------------------------------------------------------------------------------------


def test_gang_is_all_or_nothing_and_starts_when_whole():
    s = sched(cluster(2))
    for i, n in enumerate(["n0", "n1"]):
        s.submit(JobSpec(f"small{i}", 4), 0)
    s.cycle(0)
    # Bin-packing (the default score) puts both 4-GPU jobs on one node, leaving n1 whole.
    assert nodes_of(s, "small0") == nodes_of(s, "small1") == ["n0"]
    assert len(s.placements()) == 2
    s.submit(JobSpec("gang", 12), 1)
    s.cycle(1)
    free = sum(len(ns.free_gpus()) for ns in s.nodes.values())
    assert s.jobs["gang"].state == "pending" and s.jobs["gang"].placement == []
    assert free == 8  # nothing of the gang was bound
    s.job_completed("small0", 2)
    s.cycle(2)
    assert s.jobs["gang"].state == "running" and len(s.jobs["gang"].placement) == 12
    assert len(set(s.jobs["gang"].placement)) == 12


@pytest.mark.parametrize(
    "slots, per_node, ok",
    [
        ([(0, 0), (0, 1), (1, 0), (1, 1)], None, True),
        ([(0, 0), (0, 1), (1, 0)], None, False),  # incomplete
        ([(0, 0), (0, 0), (1, 0), (1, 1)], None, False),  # a GPU twice
        ([(0, 0), (0, 1), (0, 2), (1, 0)], 2, False),  # wrong per-node shape
        ([(0, 0), (0, 1), (1, 0), (1, 1)], 2, True),
    ],
)
def test_gang_permit(slots, per_node, ok):
    s = sched(cluster(2))
    s.submit(JobSpec("g", 4, gpus_per_node=per_node), 0)
    js = s.jobs["g"]
    ssn = Session(now=0, scheduler=s, view=s.view, pending=[js])
    reason = s.plugin("gang").permit(js, Plan(js, slots), ssn)
    assert (reason is None) == ok


def test_full_node_gang_shape():
    s = sched(cluster(3))
    s.submit(JobSpec("filler", 2), 0)
    s.cycle(0)
    s.submit(JobSpec("g", 16, gpus_per_node=8), 1)
    s.cycle(1)
    placed = s.jobs["g"].placement
    assert len(placed) == 16 and nodes_of(s, "filler")[0] not in nodes_of(s, "g")


# -- topology -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "specs, busy, want",
    [
        # Two NVLink domains of two nodes; domain d1 is whole: the 16-GPU gang goes there.
        (
            [NodeSpec("a0", rack="r0", nvlink_domain="d0"), NodeSpec("a1", rack="r1", nvlink_domain="d1"), NodeSpec("a2", rack="r0", nvlink_domain="d0"), NodeSpec("a3", rack="r1", nvlink_domain="d1")],
            {"a0": 2},
            ["a1", "a3"],
        ),
        # No domain fits, one rack does: stay in rack r1 rather than spread over both.
        (
            [NodeSpec("b0", rack="r0"), NodeSpec("b1", rack="r1"), NodeSpec("b2", rack="r1"), NodeSpec("b3", rack="r0")],
            {"b0": 4, "b3": 4},
            ["b1", "b2"],
        ),
        # Nothing fits in one rack: fewest nodes, fullest rack first.
        (
            [NodeSpec("c0", rack="r0"), NodeSpec("c1", rack="r1"), NodeSpec("c2", rack="r2")],
            {"c0": 5, "c1": 4, "c2": 0},
            ["c1", "c2"],
        ),
    ],
)
def test_topology_keeps_gangs_together(specs, busy, want):
    s = sched(specs)
    for node, k in busy.items():
        if k:
            name = f"busy-{node}"
            s.submit(JobSpec(name, k), 0)
            s.jobs[name].preferred_nodes = [node]
    s.cycle(0)
    for node, k in busy.items():
        if k:
            assert nodes_of(s, f"busy-{node}") == [node]
    s.submit(JobSpec("gang", 12 if want == ["c1", "c2"] else 16), 1)
    s.cycle(1)
    assert nodes_of(s, "gang") == want


# -- priority and preemption --------------------------------------------------------------------


@pytest.mark.parametrize(
    "preemptor, victim, outcome",
    [
        ("P0", "P2", "notice"),
        ("P0", "P1", "notice"),
        ("P0", "P0", "never"),
        ("P1", "P2", "grace"),
        ("P1", "P1", "never"),
        ("P1", "P0", "never"),
        ("P2", "P2", "never"),
    ],
)
def test_priority_preemption(preemptor, victim, outcome):
    s = sched(cluster(1))
    s.submit(JobSpec("victim", 8, priority=victim), 0)
    s.cycle(0)
    s.checkpoint("victim", 50, 40)
    s.submit(JobSpec("boss", 8, priority=preemptor, submit_ts=100), 100)
    s.cycle(100)
    if outcome == "notice":
        # P0's grace is 0 s, but the victim has 60 s of work since its checkpoint: it is told
        # to save it (preemption.checkpoint_notice_seconds, 120 s) and evicted once it reports it.
        assert s.jobs["boss"].state == "pending" and s.jobs["victim"].state == "running"
        assert s.jobs["victim"].preempt_deadline == pytest.approx(220)
        assert any(a.action == "preempt_notice" and a.job == "victim" for a in s.actions)
        s.checkpoint("victim", 60, 130)
        s.cycle(130)
        assert s.jobs["boss"].state == "running"
        assert s.jobs["victim"].state == "pending" and s.jobs["victim"].preemptions == 1
        assert s.jobs["victim"].lost_gpu_seconds == pytest.approx(0.0)
        assert any(a.action == "preempted" and a.job == "victim" and "before the grace period ended" in a.detail for a in s.actions)
    elif outcome == "never":
        s.cycle(1000)
        assert s.jobs["boss"].state == "pending" and s.jobs["victim"].state == "running"
    else:
        assert s.jobs["victim"].state == "running" and s.jobs["boss"].state == "pending"
        assert s.jobs["victim"].preempt_deadline == pytest.approx(400)
        assert any(a.action == "preempt_notice" and a.job == "victim" for a in s.actions)
        s.cycle(399)  # no checkpoint since the notice: it keeps its whole grace
        assert s.jobs["victim"].state == "running"
        s.cycle(400)
        assert s.jobs["boss"].state == "running" and s.jobs["victim"].state == "pending"
        assert s.jobs["victim"].lost_gpu_seconds == pytest.approx((400 - 40) * 8)


@pytest.mark.parametrize(
    "notice_s, end_early, victim_ckpt, evicted_at, lost",
    [
        (0, True, 40, 100, (100 - 40) * 8),  # notice off: P0 evicts at once, losing the work since t=40
        (120, True, 40, 220, (220 - 40) * 8),  # told, never saves: evicted at the deadline
        (120, True, 130, 130, 0),  # saves at t=130: evicted then, nothing lost
        (120, False, 130, 220, (220 - 130) * 8),  # saves, but the grace is not ended early
        (120, True, 100, 100, 0),  # nothing unsaved at the preemption: no notice needed
        (0, False, None, 100, 100 * 8),  # never checkpointed, notice off: loses everything
    ],
)
def test_zero_grace_preemption_gives_a_checkpoint_notice(notice_s, end_early, victim_ckpt, evicted_at, lost):
    s = sched(cluster(1), preemption={"checkpoint_notice_seconds": notice_s, "end_grace_on_checkpoint": end_early})
    s.submit(JobSpec("victim", 8, priority="P2"), 0)
    s.cycle(0)
    if victim_ckpt is not None and victim_ckpt <= 100:
        s.checkpoint("victim", 50, victim_ckpt)
    s.submit(JobSpec("boss", 8, priority="P0", submit_ts=100), 100)
    for t in sorted({100, victim_ckpt or 100, evicted_at - 1, evicted_at}):
        if t < 100:
            continue
        if victim_ckpt is not None and t == victim_ckpt and t > 100:
            s.checkpoint("victim", 60, t)
        s.cycle(t)
        want = "running" if t >= evicted_at else "pending"
        assert s.jobs["boss"].state == want, t
    assert s.jobs["victim"].state == "pending" and s.jobs["victim"].preemptions == 1
    assert s.jobs["victim"].lost_gpu_seconds == pytest.approx(lost)


def test_quota_reclaim_ends_its_grace_at_the_victims_checkpoint():
    s = quota_sched(reclaim_grace_seconds=300)
    s.submit(JobSpec("a1", 8, tenant="a"), 0)
    s.submit(JobSpec("a2", 8, tenant="a"), 0)
    s.cycle(0)
    s.submit(JobSpec("b1", 8, tenant="b", submit_ts=100), 100)
    s.cycle(100)
    borrower = next(j for j in ("a1", "a2") if s.jobs[j].preempt_deadline is not None)
    assert s.jobs[borrower].preempt_deadline == pytest.approx(400)
    s.checkpoint(borrower, 10, 150)
    s.cycle(150)
    assert s.jobs["b1"].state == "running" and s.jobs[borrower].state == "pending"
    assert s.jobs[borrower].lost_gpu_seconds == pytest.approx(0.0)


def test_nodes_of_a_preemptor_under_notice_are_held_for_it():
    # boss needs two whole nodes: the free n1 and n0 once its victim leaves. A job arriving
    # during the grace must not take n1, or the eviction frees room boss cannot use.
    s = sched(cluster(2))
    s.submit(JobSpec("victim", 8, priority="P2"), 0)
    s.cycle(0)
    s.submit(JobSpec("boss", 16, priority="P1", gpus_per_node=8, submit_ts=10), 10)
    s.cycle(10)
    assert s.jobs["victim"].preempt_deadline == pytest.approx(310)
    s.submit(JobSpec("late", 8, priority="P2", submit_ts=20), 20)
    s.cycle(20)
    assert s.jobs["late"].state == "pending"
    assert "waiting for its preemption victims" in s.why("late")["decisions"][-1]["reason"]
    s.cycle(310)
    assert s.jobs["boss"].state == "running" and nodes_of(s, "boss") == ["n0", "n1"]


def test_jobs_evicted_in_a_cycle_are_rescheduled_in_that_cycle():
    # Two victims leave at t=310 for a 2-node gang; a node returned to service meanwhile takes
    # one of them in the same cycle, not at whatever the next cycle is.
    s = sched(cluster(4))
    s.nodes["n3"].state = "cordoned"
    for j in ("v", "w", "x"):
        s.submit(JobSpec(j, 8, priority="P2"), 0)
    s.cycle(0)
    s.submit(JobSpec("boss", 16, priority="P1", gpus_per_node=8, submit_ts=10), 10)
    s.cycle(10)
    victims = [j for j in ("v", "w", "x") if s.jobs[j].preempt_deadline is not None]
    assert len(victims) == 2
    s.uncordon("n3", 300)
    s.cycle(310)
    assert s.jobs["boss"].state == "running"
    states = sorted(s.jobs[j].state for j in victims)
    assert states == ["pending", "running"], states
    back = next(j for j in victims if s.jobs[j].state == "running")
    assert s.jobs[back].restarts == 1 and s.jobs[back].start_ts == 310


def test_within_quota_jobs_go_before_borrowers_of_any_class():
    # b1 (P2) is within b's guarantee; a2 (P0) would borrow. Placing a2 first would only have
    # b1 reclaim it at once.
    s = quota_sched()
    s.submit(JobSpec("a1", 8, tenant="a", priority="P0"), 0)
    s.cycle(0)
    s.submit(JobSpec("a2", 8, tenant="a", priority="P0", submit_ts=1), 1)
    s.submit(JobSpec("b1", 8, tenant="b", priority="P2", submit_ts=2), 2)
    s.cycle(2)
    assert s.jobs["b1"].state == "running" and s.jobs["a2"].state == "pending"
    assert s.jobs["a1"].preemptions == 0 and not any(a.action in ("preempted", "preempt_notice") for a in s.actions)


def test_grace_period_is_configurable():
    s = sched(cluster(1), priority={"preempt_grace_seconds": {"P0": 0, "P1": 30}})
    s.submit(JobSpec("victim", 8, priority="P2"), 0)
    s.cycle(0)
    s.submit(JobSpec("boss", 8, priority="P1", submit_ts=10), 10)
    s.cycle(10)
    s.cycle(39)
    assert s.jobs["boss"].state == "pending"
    s.cycle(40)
    assert s.jobs["boss"].state == "running"


def test_preemption_takes_fewest_victims_on_one_node():
    s = sched(cluster(2))
    for i in range(4):
        s.submit(JobSpec(f"v{i}", 4, priority="P2"), 0)
    s.cycle(0)
    s.submit(JobSpec("boss", 8, priority="P0", submit_ts=5), 5)
    s.cycle(5)
    s.cycle(125)  # after the checkpoint notice
    preempted = [j for j in ("v0", "v1", "v2", "v3") if s.jobs[j].state == "pending"]
    assert s.jobs["boss"].state == "running" and len(preempted) == 2
    assert len({nodes_of(s, "boss")[0]}) == 1


def test_higher_priority_is_placed_first():
    s = sched(cluster(1))
    s.submit(JobSpec("low", 8, priority="P2", submit_ts=0), 0)
    s.submit(JobSpec("high", 8, priority="P1", submit_ts=5), 5)
    s.cycle(10)
    assert s.jobs["high"].state == "running" and s.jobs["low"].state == "pending"


# -- quota --------------------------------------------------------------------------------------


def quota_sched(**quota):
    return sched(cluster(2), quota={"tenants": {"a": {"gpus": 8}, "b": {"gpus": 8}}, **quota})


def test_quota_borrow_then_reclaim():
    s = quota_sched()
    s.submit(JobSpec("a1", 8, tenant="a"), 0)
    s.submit(JobSpec("a2", 8, tenant="a", submit_ts=1), 1)
    s.cycle(1)
    assert s.jobs["a1"].state == s.jobs["a2"].state == "running"
    assert not s.jobs["a1"].borrowed and s.jobs["a2"].borrowed
    s.checkpoint("a2", 10, 50)
    s.submit(JobSpec("b1", 8, tenant="b", submit_ts=100), 100)
    s.cycle(100)
    # Reclaim grace 0 s, but a2 has work since t=50: a checkpoint notice (120 s) first.
    assert s.jobs["a2"].preempt_deadline == pytest.approx(220) and s.jobs["b1"].state == "pending"
    s.cycle(220)
    assert s.jobs["b1"].state == "running"
    assert s.jobs["a2"].state == "pending" and s.jobs["a1"].state == "running"
    assert s.jobs["a2"].lost_gpu_seconds == pytest.approx((220 - 50) * 8)


def test_quota_without_borrowing_holds_the_job():
    s = quota_sched(borrow=False)
    s.submit(JobSpec("a1", 8, tenant="a"), 0)
    s.submit(JobSpec("a2", 8, tenant="a"), 0)
    s.cycle(0)
    assert sorted(js.state for js in s.jobs.values()) == ["pending", "running"]


def test_tenant_over_its_quota_cannot_reclaim():
    s = quota_sched()
    s.submit(JobSpec("b1", 8, tenant="b"), 0)
    s.submit(JobSpec("b2", 8, tenant="b", submit_ts=1), 1)
    s.cycle(1)
    s.submit(JobSpec("b3", 8, tenant="b", submit_ts=2), 2)
    s.cycle(2)
    assert s.jobs["b3"].state == "pending" and s.jobs["b2"].state == "running"


# -- fragmentation (FGD) ------------------------------------------------------------------------


def wl(*classes):
    """classes: (cpu, n_gpus, milli, weight)."""
    return Workload.from_counts({(c, n, m): w for c, n, m, w in classes})


@pytest.mark.parametrize(
    "free, cpu_free, classes, want",
    [
        # One class needing 0.6 GPU: the 0.5-free GPU is a fragment, the idle one is not.
        ([1000, 500], 8000, [(0, 1, 600, 1)], 500),
        # A 2-GPU task cannot run here at all: every idle milli-GPU is a fragment.
        ([1000, 500], 8000, [(0, 2, 1000, 1)], 1500),
        # A CPU-only task cannot use GPUs: all idle GPU counts.
        ([1000, 500], 8000, [(1000, 0, 0, 1)], 1500),
        # Not enough CPU for the task: all idle GPU counts.
        ([1000, 500], 1000, [(2000, 1, 300, 1)], 1500),
        # Popularity-weighted sum over the target workload.
        ([1000, 500], 8000, [(0, 1, 600, 1), (0, 2, 1000, 1)], 0.5 * 500 + 0.5 * 1500),
        # A fully used GPU (0 free) adds nothing.
        ([0, 1000], 8000, [(0, 1, 1000, 1)], 0),
    ],
)
def test_node_fragmentation_matches_the_paper_definition(free, cpu_free, classes, want):
    f = node_fragmentation(np.array([free]), np.array([cpu_free]), wl(*classes))
    assert f[0] == pytest.approx(want)


@pytest.mark.parametrize(
    "placement, want",
    [
        # Worked by hand from the definitions: nA=[1000,1000] free, nB=[1000,300]; target
        # workload half 0.5-GPU tasks, half 1-GPU tasks. A 0.3-GPU task on nB's GPU 1 fills the
        # hole (growth -300 milli-GPU); on nA or nB's GPU 0 it grows F by +350.
        ("fgd", ("nB", 1)),
        ("ours", ("nB", 1)),
        ("best_fit", ("nB", 1)),
        ("first_fit", ("nA", 0)),
    ],
)
def test_fgd_choice_hand_checked(placement, want):
    s = sched([NodeSpec("nA", n_gpus=2), NodeSpec("nB", n_gpus=2)], placement=placement)
    s.nodes["nB"].shared[1] = {"other": 700}
    if s.plugin("fragmentation") is not None:
        s.plugin("fragmentation").set_workload({(0, 1, 500): 1, (0, 1, 1000): 1})
    s.submit(JobSpec("t", 1, gpu_milli=300), 0)
    s.cycle(0)
    assert tuple(s.jobs["t"].placement[0]) == want


def test_fgd_delta_values_hand_checked():
    s = sched([NodeSpec("nA", n_gpus=2), NodeSpec("nB", n_gpus=2)], placement="fgd")
    s.nodes["nB"].shared[1] = {"x": 700}
    s.sync_view()
    frag = s.plugin("fragmentation")
    frag.set_workload({(0, 1, 500): 1, (0, 1, 1000): 1})
    s.submit(JobSpec("t", 1, gpu_milli=300), 0)
    js = s.jobs["t"]
    ssn = Session(now=0, scheduler=s, view=s.view, pending=[js])
    feasible = np.ones((2, 2), dtype=bool)
    score = frag.score(js, ssn, feasible) * 1000  # minus the growth, in milli-GPU
    np.testing.assert_allclose(score, [[-350, -350], [-350, 300]])



def test_node_fragmentation_counts_memory_only_when_asked():
    """A node without the class's typical memory cannot host it: all its idle GPU is a fragment,
    but only in the memory-aware measure; the published one (no `mem_free`) ignores memory."""
    w = wl((0, 1, 1000, 1)).with_memory({(0, 1, 1000): 32768})
    free, cpu_free = np.array([[1000, 500]]), np.array([8000])
    assert node_fragmentation(free, cpu_free, w)[0] == pytest.approx(500)
    assert node_fragmentation(free, cpu_free, w, np.array([10240]))[0] == pytest.approx(1500)
    assert node_fragmentation(free, cpu_free, w, np.array([65536]))[0] == pytest.approx(500)


@pytest.mark.parametrize(
    "placement, want",
    [
        # Worked by hand: nB has memory to spare, nA only 10 GiB, and the target workload is
        # whole-GPU tasks of 32 GiB. A 0.5-GPU task of 1 GiB grows the published FGD measure by
        # 500 milli-GPU on either node (tie: the first node, nB). Counting memory, nA's GPUs are
        # stranded already (F = 2000), so using one of them shrinks F by 500; on nB F grows by 500.
        ("fgd", ("nB", 0)),
        ("ours", ("nA", 0)),
    ],
)
def test_ours_uses_gpus_stranded_by_memory(placement, want):
    s = sched([NodeSpec("nB", n_gpus=2, memory_mib=102400), NodeSpec("nA", n_gpus=2, memory_mib=10240)], placement=placement)
    s.plugin("fragmentation").set_workload({(0, 1, 1000): 1}, memory={(0, 1, 1000): 32768})
    s.submit(JobSpec("t", 1, gpu_milli=500, memory_mib=1024), 0)
    s.cycle(0)
    assert tuple(s.jobs["t"].placement[0]) == want


@pytest.mark.parametrize(
    "task, want",
    [
        # Worked by hand. Both nodes have 2 GPUs, GPU 0 half used; nA's GPU 1 is idle and it has
        # 4 CPUs free, nB's GPU 1 is in use and it has 64 CPUs free. Target workload: 0.5-GPU
        # shares without CPU, so no option grows the fragmentation and the packing term decides.
        # A 0.5 share packs by GPU only: nB (0 idle GPU after it) over nA (1 GPU idle after it),
        # although nA has less CPU left; with the CPU half (0.5 x CPU left / 64 CPUs) nA's
        # 0.25 + 0.5 x 2/64 = 0.27 would beat nB's 0 + 0.5 x 62/64 = 0.48.
        (JobSpec("t", 1, gpu_milli=500, cpu_milli=2000), ("nB", 0)),
        # A whole-GPU task still counts CPU; only nA has a whole GPU free.
        (JobSpec("t", 1, cpu_milli=2000), ("nA", 1)),
    ],
)
def test_ours_packs_a_gpu_share_by_gpu_not_cpu(task, want):
    s = sched([NodeSpec("nA", n_gpus=2, cpu_milli=64000), NodeSpec("nB", n_gpus=2, cpu_milli=64000)], placement="ours")
    s.nodes["nA"].shared[0] = {"x": 500}
    s.nodes["nA"].cpu_used = 60000
    s.nodes["nB"].shared[0] = {"y": 500}
    s.nodes["nB"].used[1] = "z"
    s.plugin("fragmentation").set_workload({(0, 1, 500): 1})
    s.submit(task, 0)
    s.cycle(0)
    assert tuple(s.jobs["t"].placement[0]) == want


def test_best_fit_term_ignores_cpu_for_a_share_only():
    s = sched([NodeSpec("nA", n_gpus=2, cpu_milli=64000), NodeSpec("nB", n_gpus=2, cpu_milli=64000)], placement="ours")
    s.nodes["nA"].cpu_used = 60000
    s.sync_view()
    bf = next(p for p, _ in s.plugins.scores if p.name == "best_fit")

    def node_scores(spec):
        s.submit(spec, 0)
        js = s.jobs[spec.name]
        ssn = Session(now=0, scheduler=s, view=s.view, pending=[js])
        shape = (2, 2) if spec.n_gpus == 1 and spec.gpu_milli < 1000 else (2,)
        out = bf.score(js, ssn, np.ones(shape, dtype=bool))
        return out.max(axis=1) if out.ndim == 2 else out

    share = node_scores(JobSpec("share", 1, gpu_milli=500, cpu_milli=2000))
    assert share[0] == pytest.approx(share[1], abs=1e-5)  # same GPUs idle: CPU makes no difference
    whole = node_scores(JobSpec("whole", 1, cpu_milli=2000))
    assert whole[0] - whole[1] == pytest.approx(0.5 * 60000 / 64000)  # nA has 60 CPUs less left


def test_gpu_sharing_packs_shares_onto_one_gpu():
    s = sched(cluster(1, gpus=2))
    s.submit(JobSpec("a", 1, gpu_milli=500), 0)
    s.submit(JobSpec("b", 1, gpu_milli=500), 0)
    s.cycle(0)
    assert s.jobs["a"].placement == s.jobs["b"].placement
    assert s.nodes["n0"].free_gpus() == [1]
    s.submit(JobSpec("whole", 1), 1)
    s.cycle(1)
    assert s.jobs["whole"].placement == [("n0", 1)]


# -- health hints -------------------------------------------------------------------------------


def test_cordon_and_requeue_excluding_node_accounts_lost_work():
    s = sched(cluster(2))
    s.submit(JobSpec("j", 8), 0)
    s.cycle(0)
    bad = nodes_of(s, "j")[0]
    s.checkpoint("j", 100, 60)
    s.apply_hint(hint(HintAction.CORDON_NODE, node=bad), 90)
    out = s.apply_hint(hint(HintAction.REQUEUE_JOB, job="j", node=bad, exclude_nodes=[bad]), 90)
    assert [a.action for a in out] == ["requeued"] and "resumes from checkpoint step 100" in out[0].detail
    assert s.nodes[bad].state == "cordoned"
    assert s.jobs["j"].lost_gpu_seconds == pytest.approx((90 - 60) * 8)
    s.cycle(91)
    assert nodes_of(s, "j") != [bad] and s.jobs["j"].restarts == 1
    # Uncordoned without a repair, the job still stays off it.
    s.uncordon(bad, 200, "operator override", trust_again=False)
    s.job_failed("j", 300, "test")
    s.jobs["j"].preferred_nodes = [bad]
    s.cycle(301)
    assert s.jobs["j"].state == "running" and nodes_of(s, "j") != [bad]
    # Repaired: the exclusion was about the fault, so the node may be used again.
    s.uncordon(bad, 400, "repaired")
    assert bad not in s.jobs["j"].excluded_nodes


def test_lost_work_counts_from_restart_not_from_an_older_checkpoint():
    s = sched(cluster(1))
    s.submit(JobSpec("j", 4), 0)
    s.cycle(0)
    s.checkpoint("j", 10, 100)
    s.job_failed("j", 130, "oom")
    s.cycle(200)
    s.job_failed("j", 260, "oom")
    assert s.jobs["j"].lost_gpu_seconds == pytest.approx(30 * 4 + 60 * 4)


@pytest.mark.parametrize(
    "action, kw, check",
    [
        (HintAction.AVOID_GPU, {"node": "n0", "gpu": 0}, lambda s: 0 not in {g for n, g in s.jobs["j2"].placement if n == "n0"} and 0 in s.nodes["n0"].avoid_gpus),
        (HintAction.SET_ALLOC_CONF, {"job": "j", "params": {"alloc_conf": "expandable_segments:True"}}, lambda s: s.jobs["j"].alloc_conf == "expandable_segments:True" and s.jobs["j"].restarts == 1),
        (HintAction.DRAIN_NODE, {"node": "n0"}, lambda s: s.nodes["n0"].state in ("draining", "drained") and "n0" not in nodes_of(s, "j2")),
        (HintAction.RESIZE_OR_MOVE_JOB, {"job": "j"}, lambda s: nodes_of(s, "j") == ["big"] and s.jobs["j"].restarts == 1),
    ],
)
def test_health_hints(action, kw, check):
    specs = [NodeSpec("n0", gpu_memory_bytes=80 * GIB), NodeSpec("n1", gpu_memory_bytes=80 * GIB), NodeSpec("big", gpu_memory_bytes=141 * GIB)]
    s = sched(specs)
    s.submit(JobSpec("j", 4), 0)
    s.jobs["j"].preferred_nodes = ["n0"]
    s.cycle(0)
    assert nodes_of(s, "j") == ["n0"]
    s.apply_hint(hint(action, **kw), 10)
    s.submit(JobSpec("j2", 4, submit_ts=11), 11)
    s.jobs["j2"].preferred_nodes = ["n0"]
    s.cycle(11)
    assert check(s)


def test_resize_without_larger_gpus_shrinks_micro_batch():
    s = sched(cluster(2))
    s.submit(JobSpec("j", 8), 0)
    s.cycle(0)
    out = s.apply_hint(hint(HintAction.RESIZE_OR_MOVE_JOB, job="j"), 5)
    assert s.jobs["j"].memory_scale == pytest.approx(0.75)
    assert [a.action for a in out] == ["resized", "requeued"]


def test_compact_moves_small_job_to_free_a_node():
    s = sched(cluster(2))
    s.submit(JobSpec("a", 4), 0)
    s.jobs["a"].preferred_nodes = ["n0"]
    s.submit(JobSpec("b", 4), 0)
    s.jobs["b"].preferred_nodes = ["n1"]
    s.cycle(0)
    assert nodes_of(s, "a") == ["n0"] and nodes_of(s, "b") == ["n1"]
    out = s.apply_hint(hint(HintAction.COMPACT, params={"moves": [{"job": "b", "from_node": "n1", "to_node": "n0"}]}), 10)
    assert [a.action for a in out][:2] == ["moved", "requeued"]
    assert nodes_of(s, "b") == ["n0"] and len(s.nodes["n1"].free_gpus()) == 8


def test_node_down_requeues_its_jobs():
    s = sched(cluster(2))
    s.submit(JobSpec("j", 16), 0)
    s.cycle(0)
    out = s.node_down("n1", 50, "GPU fell off the bus")
    assert [a.action for a in out] == ["node_down", "requeued"]
    s.cycle(51)
    assert s.jobs["j"].state == "pending"  # 16 GPUs no longer exist
    s.uncordon("n1", 60)
    s.cycle(61)
    assert s.jobs["j"].state == "running"


# -- actions ------------------------------------------------------------------------------------


def test_enqueue_fails_a_job_that_can_never_fit():
    s = sched(cluster(1))
    s.submit(JobSpec("huge", 64), 0)
    out = s.cycle(0)
    assert s.jobs["huge"].state == "failed" and "needs 64 GPUs" in out[0].detail


def test_future_jobs_wait_for_their_submit_time():
    s = sched(cluster(1))
    s.submit(JobSpec("later", 1, submit_ts=100), 0)
    s.cycle(50)
    assert s.jobs["later"].state == "pending"
    s.cycle(100)
    assert s.jobs["later"].state == "running" and s.jobs["later"].queued_seconds == 0


def test_reserved_p0_holds_the_queue_but_short_jobs_backfill():
    s = sched(cluster(1))
    s.submit(JobSpec("run", 4, priority="P0"), 0)
    s.cycle(0)
    s.submit(JobSpec("p0", 8, priority="P0", submit_ts=1), 1)
    s.submit(JobSpec("long", 2, priority="P2", submit_ts=1), 1)
    s.submit(JobSpec("short", 2, priority="P2", submit_ts=1, duration_seconds=600), 1)
    s.cycle(2)
    assert s.jobs["p0"].state == "pending"
    assert s.jobs["long"].state == "pending"
    assert s.jobs["short"].state == "running"


def test_direct_edits_of_node_state_are_seen():
    """The simulator pins jobs by editing NodeState.used: the next cycle must see it."""
    s = sched(cluster(1))
    s.submit(JobSpec("pinned", 6), 0)
    ns = s.nodes["n0"]
    for g in range(6):
        ns.used[g] = "pinned"
    js = s.jobs["pinned"]
    js.placement, js.state, js.start_ts = [("n0", g) for g in range(6)], "running", 0.0
    s.submit(JobSpec("next", 4), 0)
    s.cycle(1)
    assert s.jobs["next"].state == "pending"
    s.submit(JobSpec("fits", 2), 1)
    s.cycle(2)
    assert s.jobs["fits"].placement == [("n0", 6), ("n0", 7)]


def test_state_frames_conform_to_schemas():
    s = sched(cluster(2))
    s.submit(JobSpec("j", 12), 0)
    s.cycle(0)
    frames = s.state_frames()
    assert frames["allocations"].height == 12
    assert frames["nodes"]["free_gpus"].sum() == 4
    assert frames["jobs"]["state"].to_list() == ["running"]


def test_find_plan_changes_nothing():
    s = sched(cluster(1))
    s.submit(JobSpec("j", 4), 0)
    js = s.jobs["j"]
    before = s.view.free_milli.copy()
    plan = find_plan(js, Session(now=0, scheduler=s, view=s.view, pending=[js]))
    assert plan is not None and len(plan.slots) == 4
    assert (s.view.free_milli == before).all() and js.state == "pending"


def test_submit_validation():
    s = sched(cluster(1))
    with pytest.raises(ValueError, match="share"):
        s.submit(JobSpec("x", 2, gpu_milli=500))
    with pytest.raises(ValueError, match="multiple"):
        s.submit(JobSpec("y", 12, gpus_per_node=8))
    s.submit(JobSpec("z", 1))
    with pytest.raises(ValueError, match="already"):
        s.submit(JobSpec("z", 1))


def test_scheduler_accepts_config_object():
    s = Scheduler(cluster(1), SchedulerConfig(placement="first_fit"))
    assert s.config.placement == "first_fit"


def test_notice_is_cancelled_when_room_appears_elsewhere():
    s = sched(cluster(2))
    s.submit(JobSpec("v0", 8, priority="P2"), 0)
    s.submit(JobSpec("v1", 8, priority="P2"), 0)
    s.cycle(0)
    s.submit(JobSpec("boss", 8, priority="P1", submit_ts=10), 10)
    s.cycle(10)
    noticed = [j for j in ("v0", "v1") if s.jobs[j].preempt_deadline is not None]
    assert len(noticed) == 1
    other = ({"v0", "v1"} - set(noticed)).pop()
    s.job_completed(other, 50)
    s.cycle(50)
    assert s.jobs["boss"].state == "running"
    assert s.jobs[noticed[0]].preempt_deadline is None and s.jobs[noticed[0]].state == "running"
    s.cycle(400)
    assert s.jobs[noticed[0]].state == "running" and s.jobs[noticed[0]].preemptions == 0


def test_cpu_and_memory_are_respected_for_sharing_tasks():
    s = sched([NodeSpec("small", n_gpus=2, cpu_milli=4000, memory_mib=8192), NodeSpec("big", n_gpus=2, cpu_milli=64000, memory_mib=65536)])
    s.submit(JobSpec("t", 1, gpu_milli=200, cpu_milli=8000, memory_mib=4096), 0)
    s.cycle(0)
    assert nodes_of(s, "t") == ["big"]
    s.submit(JobSpec("cpu-only", 0, cpu_milli=60000, memory_mib=1024), 1)
    s.cycle(1)
    assert s.jobs["cpu-only"].state == "pending"  # 56000 milli-CPU left on big, 4000 on small
    s.job_completed("t", 2)
    s.cycle(2)
    assert s.jobs["cpu-only"].state == "running" and s.jobs["cpu-only"].placement == [("big", -1)]
