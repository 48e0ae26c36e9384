"""Collective-hang detector (gpuvigil/detectors/hang.py): behaviour that mutation testing (`make
mutate`, docs/testing.md) showed no other test pinned down: the whole finding (culprits, where,
why, the figures), several culprits, hardware evidence and its look-back, jobs that stop running,
a job that keeps completing, and ticks carrying several reports of one rank.

Source: constructed rank_progress frames (the in-process hook's Flight Recorder `pg_status`, one
report per rank per tick), built as in tests/test_detectors_guards.py so that each edge sits
exactly where the test needs it. The real gloo runs are in tests/test_detectors_real.py.
"""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.window import Window


def rank_rows(t, enq, comp, *, step_time=0.5, job="j", skip=(), per_node=4):
    return schemas.frame(
        [{"ts": t, "job": job, "rank": r, "node": f"n{r // per_node}", "gpu": r % per_node, "pg": "0", "last_enqueued_seq": e, "last_completed_seq": c,
          "current_op": "ALLREDUCE" if e > c else None, "step": 1, "step_time_seconds": step_time, "collective_wait_seconds": 0.0}
         for r, (e, c) in enumerate(zip(enq, comp)) if r not in skip],
        schemas.RANK_PROGRESS,
    )


def stuck(culprits=(2,), n=8, job="j"):
    return lambda t: rank_rows(t, [10 if r in culprits else 11 for r in range(n)], [10] * n, job=job)


def run(frames_at, times, events=None, jobs=None, **over) -> list[list]:
    det = HangDetector(config.load(overrides={"detectors": {"hang": over}}) if over else None)
    w = Window(1e9)
    out = []
    for t in times:
        w.add("rank_progress", frames_at(t))
        for stream, f in ((("events", events(t)) if events else ("events", None)), (("jobs", jobs(t)) if jobs else ("jobs", None))):
            if f is not None and f.height:
                w.add(stream, f)
        w.seal(t)
        out.append(det.detect(w))
    return out


T = [float(t) for t in range(0, 8)]


def test_hang_finding_says_who_where_why_and_how_long():
    """Rank 2 of 8 (node n0, GPU 2) never enters collective #11; the other 7 wait. At t=6 s the
    stall (6 s since the first report) passes the 5 s floor (0.5 s steps x 1.5 is below it)."""
    found = run(stuck(), T)
    assert [bool(f) for f in found] == [False] * 6 + [True] * 2
    [f] = found[6]
    assert (f.kind.value, f.severity.value, f.source, f.cause, f.job, f.ts) == ("collective_hang", "page", "hang", "software", "j", 6.0)
    assert (f.ranks, f.culprit_ranks, f.node, f.gpu) == ([2], [2], "n0", 2)
    assert f.evidence == {
        "pending_seq": 11, "op": "ALLREDUCE", "stalled_seconds": 6.0, "threshold_seconds": 5.0, "step_time_seconds": 0.5,
        "waiting_ranks": 7, "world_size": 8, "culprit_nodes": ["n0"], "silent_ranks": [], "not_started_ranks": [], "xids": [],
    }
    assert f.summary == "j is hung in collective #11: rank 2 (n0 GPU 2) did not join (it never entered the collective); 7 ranks have waited 6 s."


def test_culprits_on_two_nodes_name_both_and_no_single_gpu():
    """Ranks 1 (n0) and 5 (n1) never enter: both named, the first culprit node is the finding's
    node, and no single GPU is blamed."""
    [f] = run(stuck((1, 5)), T)[6]
    assert (f.culprit_ranks, f.node, f.gpu, f.evidence["culprit_nodes"], f.evidence["waiting_ranks"]) == ([1, 5], "n0", None, ["n0", "n1"], 6)
    assert "rank 1 (n0 GPU 1), rank 5 (n1 GPU 1) did not join" in f.summary


def test_two_culprits_on_one_node_name_the_node_but_no_gpu():
    [f] = run(stuck((2, 3)), T)[6]
    assert (f.culprit_ranks, f.node, f.gpu, f.evidence["culprit_nodes"]) == ([2, 3], "n0", None, ["n0"])


def test_many_culprits_are_summarised_after_four():
    """Six of eight ranks never enter: the summary lists four and says how many more."""
    [f] = run(stuck((0, 1, 2, 3, 4, 5)), T)[6]
    assert f.culprit_ranks == [0, 1, 2, 3, 4, 5] and f.evidence["waiting_ranks"] == 2
    assert "rank 0 (n0 GPU 0), rank 1 (n0 GPU 1), rank 2 (n0 GPU 2), rank 3 (n0 GPU 3) and 2 more did not join" in f.summary
    assert f.summary.endswith("; 2 ranks have waited 6 s.")


def _event(ts, node, kind="xid", xid=79):
    return schemas.frame([{"ts": ts, "node": node, "gpu": 2, "source": "kernel", "kind": kind, "xid": xid, "message": "m"}], schemas.EVENTS)


@pytest.mark.parametrize(
    "event_at, node, kind, xid, cause, xids, why",
    [
        (0.0, "n0", "xid", 79, "hardware", [79], "XID 79 on n0"),
        (0.0, "n0", "ecc_dbe", None, "hardware", [], "it never entered the collective"),
        (0.0, "n0", "ecc", None, "hardware", [], "it never entered the collective"),
        (0.0, "n1", "xid", 79, "software", [], "it never entered the collective"),  # another node: not the culprit's
        (0.0, "n0", "oom", None, "software", [], "it never entered the collective"),  # not a hardware event
        # the application's own XID (the table's app_level) is its bug: the node is not at fault
        (0.0, "n0", "xid", 13, "software", [], "it never entered the collective"),
        (0.0, "n0", "xid", 43, "software", [], "it never entered the collective"),
    ],
)
def test_hardware_evidence_on_the_culprit_node(event_at, node, kind, xid, cause, xids, why):
    """An event on the culprit's node within the 120 s look-back makes the cause hardware."""
    [f] = run(stuck(), T, events=lambda t: _event(event_at, node, kind, xid) if t == event_at else None)[6]
    assert (f.cause, f.evidence["xids"]) == (cause, xids)
    assert f"did not join ({why})" in f.summary


def test_hardware_lookback_is_120_seconds():
    """An XID on the culprit's node 113-119 s before the hang is found counts; 121-127 s before, not."""
    def frames(t):
        return stuck()(t)
    times = [float(t) for t in range(100, 108)]
    [f] = run(frames, times, events=lambda t: _event(-13.0, "n0") if t == 100.0 else None)[6]
    assert f.cause == "hardware"
    [f] = run(frames, times, events=lambda t: _event(-21.0, "n0") if t == 100.0 else None)[6]
    assert (f.cause, f.evidence["xids"]) == ("software", [])


def test_silent_rank_summary_says_its_process_stopped():
    """Rank 5 stops reporting after t=0 while everybody else waits in #11."""
    def frames(t):
        return rank_rows(t, [11] * 8, [10] * 8, skip=(5,) if t > 0 else ())
    found = run(frames, [float(t) for t in range(0, 12)])
    f = next(fs[0] for fs in found if fs)
    assert (f.culprit_ranks, f.evidence["silent_ranks"], f.evidence["waiting_ranks"]) == ([5], [5], 7)
    assert "rank 5 (n1 GPU 1) did not join (its process stopped reporting)" in f.summary


def test_a_job_that_keeps_completing_is_not_hung():
    """Every rank is always one collective ahead of its completions (pipelined) and rank 2 enters
    each one late, but a collective completes every second: the stall never grows."""
    def frames(t):
        c = int(t)
        return rank_rows(t, [c if r == 2 else c + 1 for r in range(8)], [c] * 8)
    assert not any(run(frames, [float(t) for t in range(0, 30)]))


def test_job_no_longer_running_is_forgotten():
    """The scheduler says the job completed at t=3: its stuck-looking last reports are not a hang."""
    def jobs(t):
        return schemas.frame([{"job": "j", "state": "running" if t < 3 else "completed", "n_gpus": 8, "submit_ts": 0.0, "start_ts": 0.0}], schemas.JOBS)
    assert not any(run(stuck(), T, jobs=jobs))
    # The same reports with the job still running are a hang (the guard is the job's state).
    running = lambda t: schemas.frame([{"job": "j", "state": "running", "n_gpus": 8, "submit_ts": 0.0, "start_ts": 0.0}], schemas.JOBS)  # noqa: E731
    assert run(stuck(), T, jobs=running)[6] != []


def test_requeued_job_reports_of_the_old_run_are_dropped():
    """Job requeued at t=4 (start_ts moves to 4): rank 2's report from the old run, which stopped
    before the requeue, must not make it a silent culprit of the new run."""
    def frames(t):
        if t < 4:
            return rank_rows(t, [11] * 8, [10] * 8)
        return rank_rows(t, [3] * 8, [3] * 8, skip=(2,))  # new run, all idle between collectives; rank 2 not up yet
    def jobs(t):
        return schemas.frame([{"job": "j", "state": "running", "n_gpus": 8, "submit_ts": 0.0, "start_ts": 0.0 if t < 4 else 4.0}], schemas.JOBS)
    assert not any(run(frames, [float(t) for t in range(0, 20)], jobs=jobs))


def test_rank_state_older_than_forget_after_is_dropped():
    """Rank 2 reported once at t=0 and then nothing; its peers wait. With forget_after 10 s its
    report is dropped after 10 s and the job has no silent culprit left to name: the 7 ranks
    left all entered #11 long ago, so the hang is paged with no culprit."""
    def frames(t):
        return rank_rows(t, [11] * 8, [10] * 8, skip=(2,) if t > 0 else ())
    times = [float(t) for t in range(0, 16)]
    found = run(frames, times, forget_after_seconds=10.0)
    # kept while it is exactly forget_after old (t = 10), dropped after
    assert all(f.culprit_ranks == [2] for t in range(6, 11) for f in found[t]) and all(found[t] for t in range(6, 11))
    assert all(len(fs) == 1 and fs[0].culprit_ranks == [] and fs[0].evidence["all_entered"] for fs in found[11:])
    assert [bool(f) for f in run(frames, times)[6:]] == [True] * 10  # default 900 s keeps it


def test_latest_of_several_reports_in_one_tick_counts():
    """One tick carries two reports of every rank (a fast sampler): at 0.5 s rank 2 had not
    entered #11, at 0.9 s it had. The later report counts: nobody is a culprit (every rank in
    #11; once that lasts past 8 s the job is paged with no culprit named)."""
    det = HangDetector()
    w = Window(1e9)
    for t in range(0, 10):
        early = rank_rows(t + 0.5, [10 if r == 2 else 11 for r in range(8)], [10] * 8)
        late = rank_rows(t + 0.9, [11] * 8, [10] * 8)
        w.add("rank_progress", pl.concat([late, early]))  # arrival order is not time order
        w.seal(float(t + 1))
        found = det.detect(w)
        if t < 8:
            assert found == [], t
        else:
            assert [(f.culprit_ranks, f.evidence["all_entered"]) for f in found] == [([], True)], t


def test_two_jobs_are_judged_apart():
    """Job a is hung (rank 2 missing from #11), job b completes a collective every second."""
    def frames(t):
        return pl.concat([stuck(job="a")(t), rank_rows(t, [int(t) + 1] * 4, [int(t)] * 4, job="b")])
    found = run(frames, T)
    assert [(f.job, f.culprit_ranks, f.evidence["world_size"]) for f in found[6]] == [("a", [2], 8)]


def test_a_rank_that_first_reports_after_its_peers_is_tracked():
    """Rank 2's first report arrives one tick after its peers' (its hook started later), and it
    never enters #11: it is the culprit, not forgotten as an unknown rank."""
    def frames(t):
        return stuck()(t) if t >= 1 else rank_rows(t, [11] * 8, [10] * 8, skip=(2,))
    found = run(frames, [float(t) for t in range(0, 10)])
    f = next(fs[0] for fs in found if fs)
    assert (f.culprit_ranks, f.evidence["silent_ranks"], f.evidence["world_size"]) == ([2], [], 8)


@pytest.mark.parametrize("n_culprits, more", [(4, ""), (5, " and 1 more")])
def test_four_culprits_are_listed_and_a_fifth_is_counted(n_culprits, more):
    [f] = run(stuck(tuple(range(n_culprits))), T)[6]
    listed = ", ".join(f"rank {r} (n0 GPU {r})" for r in range(4))
    assert f"#11: {listed}{more} did not join" in f.summary


def test_no_op_reported_is_none():
    """A hook that does not report the pending op (current_op null on every rank)."""
    frames = lambda t: stuck()(t).with_columns(pl.lit(None, pl.Utf8).alias("current_op"))  # noqa: E731
    [f] = run(frames, T)[6]
    assert f.evidence["op"] is None and f.culprit_ranks == [2]


def test_several_xids_on_several_culprit_nodes_are_all_named():
    """Ranks 1 (n0) and 5 (n1) never enter; XID 79 on n0 and XID 94 on n1 in the look-back."""
    ev = pl.concat([_event(0.0, "n0", xid=79), _event(0.0, "n1", xid=94)])
    [f] = run(stuck((1, 5)), T, events=lambda t: ev if t == 0.0 else None)[6]
    assert (f.cause, f.evidence["xids"]) == ("hardware", [79, 94])
    assert "did not join (XID 79, 94 on n0, n1)" in f.summary


def test_a_single_culprit_whose_rows_carry_no_gpu_is_paged_without_one():
    """constructed: rank 2's hook records carry no `gpu` (collectors/hook.py leaves it null): the
    hang is still paged, naming rank 2 and its node, with `gpu` None instead of raising on
    `int(None)` (mutation testing found this in straggler.py)."""
    no_gpu = lambda t: stuck()(t).with_columns(pl.when(pl.col("rank") == 2).then(None).otherwise(pl.col("gpu")).alias("gpu"))  # noqa: E731
    found = run(no_gpu, T)
    [f] = found[6]
    assert (f.culprit_ranks, f.node, f.gpu, f.severity.value) == ([2], "n0", None, "page")
    assert "rank 2 (n0) did not join" in f.summary


def test_culprits_on_two_nodes_whose_rank_order_is_not_their_name_order():
    """Ranks 0-3 on node n1 and 4-7 on n0 (a scheduler that numbers ranks from another node);
    ranks 1 (n1) and 5 (n0) never enter. The finding's node is the first culprit node as
    `evidence.culprit_nodes` lists them (name order), not the lowest culprit rank's node."""
    swap = pl.when(pl.col("node") == "n0").then(pl.lit("n1")).otherwise(pl.lit("n0")).alias("node")
    [f] = run(lambda t: stuck((1, 5))(t).with_columns(swap), T)[6]
    assert (f.culprit_ranks, f.node, f.gpu, f.evidence["culprit_nodes"]) == ([1, 5], "n0", None, ["n0", "n1"])


def test_culprits_one_of_which_names_no_node_are_paged_with_the_node_known():
    """constructed: ranks 1 (n0) and 5 (its hook rows carry no node) never enter: both are named,
    culprit_nodes lists the node that is known, instead of raising on sorting None with "n0"."""
    no_node = lambda t: stuck((1, 5))(t).with_columns(pl.when(pl.col("rank") == 5).then(None).otherwise(pl.col("node")).alias("node"))  # noqa: E731
    [f] = run(no_node, T)[6]
    assert (f.culprit_ranks, f.node, f.gpu, f.evidence["culprit_nodes"], f.severity.value) == ([1, 5], "n0", None, ["n0"], "page")


# -- a rank stuck inside a kernel: enqueued like its peers, never started (start records) --------


def in_kernel(culprits=(2,), n=8, started_known=True):
    def at(t):
        df = rank_rows(t, [11] * n, [10] * n)
        started = [(10 if r in culprits else 11) if started_known else -1 for r in range(n)]
        return df.with_columns(pl.Series("last_started_seq", started, dtype=pl.Int64))

    return at


def test_rank_that_enqueued_but_never_started_the_collective_is_the_culprit():
    """Every rank enqueued #11; rank 2's kernel never started (a compute kernel before it hangs),
    the 7 others started it and spin. Found at the same 5 s floor as a missing rank."""
    found = run(in_kernel(), T)
    assert [bool(f) for f in found] == [False] * 6 + [True] * 2
    [f] = found[6]
    assert (f.culprit_ranks, f.node, f.gpu, f.cause) == ([2], "n0", 2, "software")
    assert f.evidence["not_started_ranks"] == [2] and f.evidence["waiting_ranks"] == 7 and f.evidence["pending_seq"] == 11
    assert "stuck in a kernel before the collective" in f.summary


def test_without_start_records_every_rank_in_the_collective_is_paged_later_with_no_culprit():
    """gloo, or NCCL without TORCH_NCCL_ENABLE_TIMING: last_started is -1 everywhere, nobody is
    missing. Past the 5 s floor the hook names nobody; past max(8 s, 3 steps) with every rank in
    the collective and none completing it, the job is paged hung with no culprit."""
    found = run(in_kernel(started_known=False), [float(t) for t in range(0, 11)])
    assert [bool(f) for f in found] == [False] * 9 + [True] * 2
    [f] = found[9]
    assert (f.culprit_ranks, f.ranks, f.node, f.gpu, f.cause, f.severity.value) == ([], [], None, None, "software", "page")
    assert f.evidence["all_entered"] is True and f.evidence["pending_seq"] == 11 and f.evidence["waiting_ranks"] == 8
    assert f.evidence["threshold_seconds"] == 8.0 and f.evidence["stalled_seconds"] == 9.0
    assert "all 8 ranks entered it" in f.summary
    # Long steps stretch the wait: 4 s steps, 3 x 4 = 12 s.
    slow = lambda t: in_kernel(started_known=False)(t).with_columns(pl.lit(4.0).alias("step_time_seconds"))  # noqa: E731
    found = run(slow, [float(t) for t in range(0, 14)])
    assert [bool(f) for f in found] == [False] * 13 + [True]
    # Every rank started #11 too (start records, nobody lags): the same, no culprit.
    found = run(in_kernel(culprits=(), started_known=True), [float(t) for t in range(0, 10)])
    assert [bool(f) for f in found] == [False] * 9 + [True] and found[9][0].culprit_ranks == []


def test_healthy_jobs_are_those_whose_fresh_reports_show_no_stall():
    det = HangDetector()
    w = Window(1e9)
    seen = {}
    for t in T:
        # j: completing every second; k: all outside collectives; s: stuck since 0 s.
        w.add("rank_progress", pl.concat([rank_rows(t, [int(t) + 1] * 4, [int(t)] * 4, job="j"), rank_rows(t, [5] * 4, [5] * 4, job="k"),
                                          stuck(n=4, job="s")(t)]))
        w.seal(t)
        det.detect(w)
        seen[t] = set(det.healthy_jobs)
    assert seen[0.0] == {"j", "k", "s"}  # nobody has waited past the floor yet
    assert seen[5.0] == {"j", "k", "s"} and seen[6.0] == {"j", "k"}
    # A job whose reports stopped is vouched for by nobody.
    w.seal(20.0)
    det.detect(w)
    assert det.healthy_jobs == set()


def test_a_stall_rebuilt_from_many_reports_in_one_tick_keeps_its_start():
    """A replica that takes a job over reads the last minutes of reports in one tick: the job runs
    (ranks waiting in collectives) until t=20, sits outside any collective (a checkpoint) from 20
    to 29, then rank 2 never joins #11 while the others wait. The stall is timed from t=29 (the
    last report with nobody waiting), as a detector that saw every report as its own tick times
    it, not from the latest report (which would page a 140 s hang as a few seconds old)."""
    moving = [rank_rows(float(t), [t // 2 + 1] * 8, [t // 2] * 8) for t in range(0, 20)]
    idle = [rank_rows(float(t), [10] * 8, [10] * 8) for t in range(20, 30)]
    stalled = [stuck()(float(t)) for t in range(30, 170)]
    w = Window(1e9)
    w.add("rank_progress", pl.concat([*moving, *idle, *stalled]))
    w.seal(170.0)
    [f] = HangDetector().detect(w)
    assert f.evidence["stalled_seconds"] == 170.0 - 29.0 and f.culprit_ranks == [2]
    # Every report its own tick: the same finding.
    det, w = HangDetector(), Window(1e9)
    for frame in [*moving, *idle, *stalled]:
        w.add("rank_progress", frame)
        w.seal(float(frame["ts"][0]))
        det.detect(w)
    w.add("rank_progress", stuck()(170.0))
    w.seal(170.0)
    [g] = det.detect(w)
    assert g.evidence == f.evidence and g.summary == f.summary
    # Reports of one job that never line up in time (each rank its own clock) say nothing about
    # when nobody waited: no idle time is guessed from them.
    skewed = [rank_rows(20.0 + r / 10, [10] * 8, [10] * 8).filter(pl.col("rank") == r) for r in range(8)]
    w = Window(1e9)
    w.add("rank_progress", pl.concat([*moving, *skewed, *stalled]))
    w.seal(170.0)
    [h] = HangDetector().detect(w)
    assert h.evidence["stalled_seconds"] == 149.3  # from the last completion (rank 7 at 20.7 s)


def test_without_start_records_an_xid_on_one_rank_s_gpu_names_it():
    """Every rank in #11, no start records: an XID on the GPU of rank 5 (n1 GPU 1) names rank 5,
    cause hardware; an XID on a GPU the job does not use, or on two of its GPUs, names nobody."""
    def xid_on(node, gpus):
        return lambda t: schemas.frame([{"ts": 1.0, "node": node, "gpu": g, "source": "kernel", "kind": "xid", "xid": 79, "message": "xid"} for g in gpus], schemas.EVENTS)

    times = [float(t) for t in range(0, 11)]
    [f] = run(in_kernel(started_known=False), times, events=xid_on("n1", [1]))[9]
    assert (f.culprit_ranks, f.ranks, f.node, f.gpu, f.cause) == ([5], [5], "n1", 1, "hardware") and f.evidence["xids"] == [79]
    assert "rank 5 (n1 GPU 1) is stuck under a failed kernel (XID 79 on its GPU)" in f.summary
    [g] = run(in_kernel(started_known=False), times, events=xid_on("n1", [1, 2]))[9]
    assert g.culprit_ranks == [] and g.cause == "hardware"
    [h] = run(in_kernel(started_known=False), times, events=xid_on("n9", [1]))[9]
    assert h.culprit_ranks == [] and h.cause == "software"


def test_unknown_starts_never_name_a_rank_and_minus_one_is_a_start_record():
    """A start of -1 is a start record (nothing started yet); null is unknown (the hook's rows on
    gloo, with timing off, or from a hook started after the process group). Ranks 0-6 started
    #11, rank 7 did not: with -1 it is the culprit, with null it is not named (its peers' starts
    say nothing about it) and the job is paged later with no culprit, for the L0/L1 detectors."""
    def rank7(value):
        return lambda t: in_kernel(culprits=(7,))(t).with_columns(
            pl.when(pl.col("rank") == 7).then(pl.lit(value, dtype=pl.Int64)).otherwise(pl.col("last_started_seq")).alias("last_started_seq"))

    times = [float(t) for t in range(0, 11)]
    found = run(rank7(-1), times)
    assert found[6] and found[6][0].culprit_ranks == [7] and found[6][0].evidence["not_started_ranks"] == [7]
    found = run(rank7(None), times)
    assert [bool(f) for f in found] == [False] * 9 + [True] * 2
    assert found[9][0].culprit_ranks == [] and found[9][0].evidence["all_started"] is False
    assert "TORCH_NCCL_ENABLE_TIMING=1, set by gv.start() before init_process_group" in found[9][0].summary
    # Unknown everywhere: the same page as with -1 everywhere.
    none = lambda t: in_kernel(started_known=False)(t).with_columns(pl.lit(None, dtype=pl.Int64).alias("last_started_seq"))  # noqa: E731
    assert [bool(f) for f in run(none, times)] == [False] * 9 + [True] * 2


def test_first_collective_of_a_group_names_the_rank_that_never_started_it():
    """A process group's first collective: enqueued #0 everywhere, nothing completed (-1);
    ranks 1-7 started it (0), rank 0 is stuck in a kernel before it (-1: no start yet)."""
    def first(t):
        df = rank_rows(t, [0] * 8, [-1] * 8)
        return df.with_columns(pl.Series("last_started_seq", [-1] + [0] * 7, dtype=pl.Int64))

    found = run(first, T)
    [f] = found[6]
    assert f.culprit_ranks == [0] and f.evidence["pending_seq"] == 0 and f.evidence["not_started_ranks"] == [0]


def test_every_rank_started_the_stuck_collective_says_so():
    found = run(in_kernel(culprits=(), started_known=True), [float(t) for t in range(0, 10)])
    [f] = found[9]
    assert f.culprit_ranks == [] and f.evidence["all_started"] is True
    assert "every rank started it: the collective itself is stuck" in f.summary
