"""Unit tests of detector pieces on crafted inputs: the OOM event classifier on real PyTorch
wording, the peer-anomaly envelope, the FGD-style fragmentation measure
and compaction plan (properties), and the hang detector's adaptivity to a job's cadence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.detectors.anomaly import PeerEnvelope
from gpuvigil.detectors.fragmentation_cluster import plan_compaction, unusable_share
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.window import Window

GIB = 1 << 30
H200 = 139.8 * GIB
DATA = Path(__file__).parent / "data"


def _captured_oom(name: str) -> str:
    """The exact torch.OutOfMemoryError text a real H200 printed (between the capture script's
    OOM_MESSAGE_BEGIN/END markers), unedited."""
    text = (DATA / "h200" / name).read_text()
    return text.split("OOM_MESSAGE_BEGIN\n", 1)[1].split("\nOOM_MESSAGE_END", 1)[0]


# tests/data/h200/s2_oom_ramp.log: 4 GiB blocks until a real capacity OOM (PyTorch 2.11).
REAL_CAPACITY_OOM = _captured_oom("s2_oom_ramp.log")
# tests/data/h200/s3_fragmentation.log: an 8 GiB request fails with 24 GiB reserved but unallocated.
REAL_FRAGMENTATION_OOM = _captured_oom("s3_fragmentation.log")


def _wording_2x(request: float, capacity: float, in_use: float, allocated: float, unallocated: float, others: float) -> str:
    """PyTorch 2.x wording (as in the captures above) with numbers of our choosing, for the one
    cause no capture shows: another process holding memory ("Process N has ..." clause, as in
    tests/data/public/oom_wordings.log line 4)."""
    free = capacity - in_use - others
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {g(request)}. GPU 0 has a total capacity of {g(capacity)} of which {g(free)} is free. "
        f"Process 4242 has {g(others)} memory in use. Including non-PyTorch memory, this process has {g(in_use)} memory in use. Of the allocated memory "
        f"{g(allocated)} is allocated by PyTorch, and {g(unallocated)} is reserved by PyTorch but unallocated."
    )


def _events_window(messages: list[str], now: float = 10.0) -> Window:
    w = Window(600.0)
    rows = [{"ts": 5.0, "node": "node-000", "gpu": 3, "source": "torch", "kind": "oom", "job": "train", "rank": 3, "message": m} for m in messages]
    w.add("events", schemas.frame(rows, schemas.EVENTS))
    w.seal(now)
    return w


@pytest.mark.parametrize(
    "message, kind, requested",
    [
        (REAL_CAPACITY_OOM, "oom_capacity", 4 * GIB),
        (REAL_FRAGMENTATION_OOM, "oom_fragmentation", 8 * GIB),
        # Another process holds 40 GiB of the device (wording of the captures, numbers chosen).
        # 3.2 GiB free + 0.5 GiB cached < 4 GiB asked <= that + 40 GiB of the other process
        (_wording_2x(4 * GIB, H200, 96.6 * GIB, 96 * GIB, 0.5 * GIB, others=40 * GIB), "oom_foreign_process", 4 * GIB),
    ],
    ids=["real-h200-capacity", "real-h200-fragmentation", "crafted-foreign"],
)
def test_oom_events_are_classified_from_the_message(message, kind, requested):
    findings = OomEventClassifier().detect(_events_window([message]))
    assert [f.kind.value for f in findings] == [kind]
    f = findings[0]
    assert f.severity.value == "page" and f.job == "train" and f.ranks == [3] and f.culprit_ranks == [3] and f.node == "node-000" and f.gpu == 3
    assert f.evidence["requested_bytes"] == requested
    assert f.cause == kind.removeprefix("oom_") and f"{requested / GIB:.2f} GiB" in f.summary


def test_oom_events_reported_once_and_junk_ignored():
    det = OomEventClassifier()
    w = _events_window([REAL_CAPACITY_OOM, "CUDA error: something else entirely", ""])
    assert len(det.detect(w)) == 1
    w.seal(11.0)  # next tick, no new events
    assert det.detect(w) == []


def test_peer_envelope_checks_its_input():
    env = PeerEnvelope()
    with pytest.raises(RuntimeError):
        env.excess(np.zeros((1, 5)))
    for bad in (np.zeros((0, 5)), np.zeros(5), np.array([[0.0, np.nan]])):
        with pytest.raises(ValueError):
            PeerEnvelope().fit(bad)
    env.fit(np.zeros((10, 5)))
    with pytest.raises(ValueError, match="expected 5 features"):
        env.excess(np.zeros((1, 4)))
    with pytest.raises(ValueError):
        PeerEnvelope(quantile=0.4)


def test_peer_envelope_flags_only_what_healthy_history_never_showed():
    rng = np.random.default_rng(0)
    healthy = rng.normal(0, 0.3, size=(2000, 5))
    model = PeerEnvelope().fit(healthy)
    assert (model.predict(rng.normal(0, 0.3, size=(500, 5))) == 1).mean() > 0.99
    odd = np.array([[0, 0, -3, 6, -10], [8, 0, 0, 0, 0]], dtype=float)
    assert model.predict(odd).tolist() == [-1, -1]
    # The excess is in the deviation's own units: the second row is ~8 - 1 beyond the envelope.
    assert 6.5 < model.excess(odd)[1] < 7.5
    # One glitch in the "healthy" history does not widen the envelope to cover it.
    glitched = PeerEnvelope().fit(np.vstack([healthy, [[0, 0, 0, 0, 50.0]]]))
    assert glitched.predict(np.array([[0, 0, 0, 0, 40.0]])).tolist() == [-1]


@settings(max_examples=200, deadline=None)
@given(
    free=st.lists(st.integers(0, 8), min_size=1, max_size=40),
    needs=st.lists(st.integers(1, 8), min_size=1, max_size=10),
)
def test_unusable_share_is_a_share(free, needs):
    share = unusable_share(free, needs)
    assert 0.0 <= share <= 1.0
    if all(f >= max(needs) for f in free if f):
        assert share == 0.0


def _can_free(node_free: dict[str, int], node_jobs: dict[str, dict[str, int]], need: int) -> bool:
    """Brute force: can some node get `need` free GPUs by moving whole jobs to other nodes?"""
    import itertools

    for target, free0 in node_free.items():
        if free0 >= need:
            return True
        others = [n for n in node_free if n != target]
        jobs = list(node_jobs.get(target, {}).values())
        for k in range(1, len(jobs) + 1):
            for subset in itertools.combinations(jobs, k):
                if free0 + sum(subset) < need:
                    continue
                for dests in itertools.product(others, repeat=k):
                    room = {n: node_free[n] for n in others}
                    for size, dest in zip(subset, dests):
                        room[dest] -= size
                    if min(room.values(), default=0) >= 0:
                        return True
    return False


@settings(max_examples=200, deadline=None)
@given(
    used=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=2, max_size=6),
    need=st.integers(1, 8),
)
def test_compaction_plan_frees_a_slot_with_valid_moves(used, need):
    """Whenever a slot can be freed (checked by brute force), the plan frees it with valid moves;
    when the plan says it cannot, brute force agrees."""
    capacity = 8
    node_jobs: dict[str, dict[str, int]] = {}
    node_free: dict[str, int] = {}
    k = 0
    for i, sizes in enumerate(used):
        name = f"n{i:02d}"
        jobs, total = {}, 0
        for s in sizes:
            if total + s > capacity:
                break
            jobs[f"j{k}"] = s
            total += s
            k += 1
        node_jobs[name], node_free[name] = jobs, capacity - total
    plan = plan_compaction(node_free, node_jobs, need)
    assert (plan is not None) == _can_free(node_free, node_jobs, need)
    if plan is None:
        return
    target, moves = plan
    free = dict(node_free)
    for m in moves:
        assert m["from_node"] == target and m["to_node"] != target
        assert node_jobs[target][m["job"]] == m["gpus"]
        free[m["to_node"]] -= m["gpus"]
        free[target] += m["gpus"]
    assert min(free.values()) >= 0
    assert free[target] >= need
    assert len({m["job"] for m in moves}) == len(moves), "a job moved twice"


@pytest.mark.parametrize(
    "node_free, node_jobs, need, target, moves",
    [
        # n2 (most free) cannot be emptied (its 5-GPU job fits nowhere); n0 can, by moving its
        # 2-GPU job to the tightest node that takes it (n1, 2 free, before n2, 3 free).
        ({"n0": 2, "n1": 2, "n2": 3}, {"n0": {"a": 2, "b": 4}, "n1": {"c": 6}, "n2": {"d": 5}}, 4, "n0", [("a", "n1", 2)]),
        # The 3-GPU job fits nowhere; the 2-GPU one is enough.
        ({"n0": 3, "n1": 2}, {"n0": {"a": 3, "b": 2}, "n1": {"c": 6}}, 5, "n0", [("b", "n1", 2)]),
        # Largest job first: one 3-GPU move rather than three 1-GPU moves.
        ({"n0": 3, "n1": 2, "n2": 1}, {"n0": {"a": 5}, "n1": {"c": 3, "e": 1, "f": 1, "g": 1}, "n2": {"d": 7}}, 5, "n1", [("c", "n0", 3)]),
        # Already free: no move.
        ({"n0": 6, "n1": 2}, {"n0": {"a": 2}, "n1": {"b": 6}}, 6, "n0", []),
    ],
    ids=["tightest-destination", "skip-what-cannot-move", "largest-first", "no-move-needed"],
)
def test_compaction_plan_examples(node_free, node_jobs, need, target, moves):
    assert plan_compaction(node_free, node_jobs, need) == (target, [{"job": j, "from_node": target, "to_node": d, "gpus": g} for j, d, g in moves])


def test_compaction_plan_none_when_nothing_can_move():
    assert plan_compaction({"n0": 2, "n1": 2}, {"n0": {"a": 6}, "n1": {"b": 6}}, 4) is None


def _rank_rows(ts: float, step_time: float, enq: list[int], comp: list[int], step: int) -> pl.DataFrame:
    n = len(enq)
    return schemas.frame(
        [
            {"ts": ts, "job": "j", "rank": r, "node": f"node-{r // 8:03d}", "gpu": r % 8, "pg": "0", "last_enqueued_seq": enq[r], "last_completed_seq": comp[r],
             "current_op": "ALLREDUCE" if enq[r] > comp[r] else None, "step": step, "step_time_seconds": step_time, "collective_wait_seconds": 0.0}
            for r in range(n)
        ],
        schemas.RANK_PROGRESS,
    )


def _drive(step_time: float, hang_at: float | None, all_pause_at: float | None, until: float, tick: float) -> tuple[float | None, list[int]]:
    """Feed the hang detector a 16-rank job; return when it first fired and whom it named."""
    det = HangDetector()
    w = Window(900.0)
    per = 4  # collectives per step
    t = 0.0
    seq = 0
    while t < until:
        t += tick
        if hang_at is not None and t >= hang_at:
            enq = [seq + 1] * 16
            enq[7] = seq  # rank 7 never enters the next collective
            comp = [seq] * 16
        elif all_pause_at is not None and all_pause_at <= t < all_pause_at + 120:
            enq = comp = [seq] * 16  # everybody outside collectives: a checkpoint or input stall
        else:
            seq = int(t / step_time * per)
            enq, comp = [seq + 1] * 16, [seq] * 16
            enq[3] = seq  # ranks arrive at different times in a healthy job too
        w.add("rank_progress", _rank_rows(t, step_time, enq, comp, seq // per))
        w.seal(t)
        found = det.detect(w)
        if found:
            return t, found[0].culprit_ranks
    return None, []


@pytest.mark.parametrize(
    "step_time, tick, bound",
    [(0.2, 1.0, 10.0), (2.0, 1.0, 10.0), (40.0, 4.0, 3 * 40.0)],
    ids=["0.2s-steps", "2s-steps", "40s-steps"],
)
def test_hang_detector_adapts_to_the_job_cadence(step_time, tick, bound):
    onset = 200.0
    fired, culprits = _drive(step_time, hang_at=onset, all_pause_at=None, until=onset + 4 * bound, tick=tick)
    assert fired is not None and onset <= fired <= onset + bound
    assert culprits == [7]


@pytest.mark.parametrize("step_time", [0.2, 40.0])
def test_all_ranks_pausing_together_is_not_a_hang(step_time):
    fired, _ = _drive(step_time, hang_at=None, all_pause_at=100.0, until=400.0, tick=1.0 if step_time < 1 else 4.0)
    assert fired is None
