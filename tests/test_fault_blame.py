"""User fault or infrastructure fault, decided before anything acts.

An application-level XID (13, 31, 43: `app_level` in gpuvigil/data/xid.yaml) on one GPU under
several different jobs is the GPU's (page, cordon); under one job only it is the application's
(ticket to the job's tenant, no cordon). OOMs and hangs whose culprit is the application are the
user's too (the `faults` table of the hint rules).

Sources: the XID lines are real, read by the real KernelLogCollector (tests/data/public, see its
README): `kernel_xids.log` (leptonai/gpud#46: an XID 13 burst), `kernel_fallen_off_bus.log`
(open-gpu-kernel-modules#1151 and Bumblebee#677: XID 79 and 31). No public log here carries an
XID 43 line: its rows are the table's code with the catalog's wording. The OOM is the real H200
capacity OOM (tests/data/h200/s2_oom_ramp.log). What the test chooses: the times, the GPU and the
job the scheduler placed on it.
"""

from __future__ import annotations

import polars as pl
import pytest
from test_detectors_real import H200, _cfg, _kernel_events, _oom_events, _window_of

from gpuvigil import config, schemas
from gpuvigil.alerts.pusher import team_of
from gpuvigil.alerts.settings import load_settings
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.detectors.xid import GpuJobHistory, XidBlameConfig, XidDetector
from gpuvigil.model import Finding, FindingKind, HintAction, Severity
from gpuvigil.pipeline.core import Pipeline
from gpuvigil.pipeline.hints import HintPolicy

T0 = 1_800_000_000.0
HOUR = 3600.0


def _real_xid_row(code: int) -> pl.DataFrame:
    """One real kernel-log event of XID `code` (43: the table's wording, no public line)."""
    if code == 43:
        return schemas.frame([{"ts": 0.0, "node": "node-a", "source": "kernel", "kind": "xid", "xid": 43,
                               "message": "GPU stopped processing (reset channel verification error)"}], schemas.EVENTS)
    name = {13: "kernel_xids.log", 31: "kernel_fallen_off_bus.log", 79: "kernel_fallen_off_bus.log"}[code]
    ev = _kernel_events(name).filter(pl.col("xid") == code)
    assert ev.height >= 1, (name, code)
    return ev.head(1)


def _hit(detector: XidDetector, code: int, node: str, gpu: int, job: str | None, ts: float) -> list[Finding]:
    """The XID happens at `ts` on (node, gpu) while the scheduler runs `job` there (None: no job known)."""
    ev = _real_xid_row(code).with_columns(pl.lit(ts).alias("ts"), pl.lit(node).alias("node"), pl.lit(gpu, pl.Int32).alias("gpu"),
                                          pl.lit(None, pl.Utf8).alias("job"))
    alloc = schemas.frame([{"job": job, "rank": 0, "node": node, "gpu": gpu}] if job else [], schemas.ALLOCATIONS)
    return detector.detect(_window_of({"events": ev, "allocations": alloc}, ts + 1.0))


# name → (XID code, [(job, hours after the first)], expected fault, severity, hints)
CASES = {
    "13 under two jobs: the GPU": (13, [("train-a", 0), ("train-b", 5)], "infrastructure", "page", ["cordon_node", "requeue_job"]),
    "13 under one job, twice: the application": (13, [("train-a", 0), ("train-a", 5)], "user", "ticket", []),
    "31 under three jobs: the GPU": (31, [("a", 0), ("b", 1), ("c", 2)], "infrastructure", "page", ["cordon_node", "requeue_job"]),
    "31 under one job: the application": (31, [("a", 0)], "user", "ticket", []),
    "43 under two jobs: the GPU": (43, [("a", 0), ("b", 30)], "infrastructure", "page", ["cordon_node", "requeue_job"]),
    "43 under one job: the application": (43, [("a", 0), ("a", 30)], "user", "ticket", []),
    # the first job's XID is older than the history (7 days): only one job within it
    "13 under two jobs a fortnight apart: the application": (13, [("a", 0), ("b", 14 * 24)], "user", "ticket", []),
    # a fatal XID is the GPU's whoever ran on it
    "79 under one job: the GPU": (79, [("a", 0)], "infrastructure", "page", ["cordon_node", "requeue_job"]),
    # nobody known: neither is said, nothing cordoned
    "13 with no job known": (13, [(None, 0), (None, 1)], None, "ticket", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_whose_fault_an_xid_is(case):
    code, hits, fault, severity, actions = CASES[case]
    det = XidDetector()
    found: list[Finding] = []
    for job, hours in hits:
        found = _hit(det, code, "node-a", 2, job, T0 + hours * HOUR)
    [f] = found
    assert (f.xid, f.evidence.get("fault"), f.severity.value) == (code, fault, severity)
    assert f.cause == ("hardware" if fault == "infrastructure" else "software")
    assert [h.action.value for h in HintPolicy(config.defaults()).hints_for(f)] == actions
    if fault == "infrastructure" and code != 79:
        jobs = sorted({j for j, _ in hits})
        assert f.evidence["jobs_hit"] == jobs and "infrastructure fault" in f.summary and f"{len(jobs)} different jobs" in f.summary
    if fault == "user":
        assert f.evidence["jobs_hit"] == [hits[-1][0]]
        assert f"user fault: only job {hits[-1][0]}" in f.summary and "no cordon" in f.summary


def test_other_gpus_and_other_codes_do_not_count():
    """Two jobs with XID 13, but on two different GPUs: each GPU saw one job, both are the user's.
    An XID 109 (not application-level) under another job adds nothing to a GPU's history."""
    det = XidDetector()
    [a] = _hit(det, 13, "node-a", 0, "a", T0)
    [b] = _hit(det, 13, "node-a", 1, "b", T0 + 60)
    assert (a.evidence["fault"], b.evidence["fault"]) == ("user", "user")
    det.detect(_window_of({"events": _kernel_events("kernel_xids.log").filter(pl.col("xid") == 109).with_columns(
        pl.lit(T0 + 120).alias("ts"), pl.lit(0, pl.Int32).alias("gpu")),
        "allocations": schemas.frame([{"job": "c", "rank": 0, "node": "node-a", "gpu": 0}], schemas.ALLOCATIONS)}, T0 + 121))
    assert det.history.jobs("node-a", 0, T0 + 121) == ["a"]


def test_the_per_gpu_history_is_bounded():
    cfg = XidBlameConfig(max_gpus=3, max_jobs_per_gpu=4, history_seconds=HOUR)
    h = GpuJobHistory(cfg)
    for gpu in range(10):
        for j in range(10):
            h.record("n", gpu, f"job{j}", T0 + j)
    assert len(h) == 3  # the least recently hit GPUs forgotten
    assert h.jobs("n", 0, T0 + 10) == []
    assert h.jobs("n", 9, T0 + 10) == ["job6", "job7", "job8", "job9"]  # the newest jobs kept
    assert h.jobs("n", 9, T0 + 8 + HOUR) == ["job8", "job9"]  # and only within the history
    h.record("n", 7, "job0", T0 + 20)  # hit again: most recent, survives the next new GPU
    h.record("n", 99, "x", T0 + 21)
    assert h.jobs("n", 7, T0 + 21)[-1] == "job0" and h.jobs("n", 8, T0 + 21) == []


def test_a_second_job_on_an_active_user_xid_escalates_and_cordons():
    """In the pipeline: XID 13 under job a is a ticket with no hint; the same GPU's XID 13 under job
    b while that finding is still active escalates it to a page, and only then is the node
    cordoned and the job requeued, once."""

    class Script:
        name = "kernel_log"
        errors = 0

        def __init__(self) -> None:
            self.frames: dict[float, dict[str, pl.DataFrame]] = {}

        def collect(self, now: float) -> dict[str, pl.DataFrame]:
            return self.frames.get(now, {})

    def frames(job: str, ts: float) -> dict[str, pl.DataFrame]:
        return {"events": _real_xid_row(13).with_columns(pl.lit(ts).alias("ts"), pl.lit(3, pl.Int32).alias("gpu")),
                "allocations": schemas.frame([{"job": job, "rank": 0, "node": "node-a", "gpu": 3}], schemas.ALLOCATIONS)}

    col = Script()
    col.frames = {T0: frames("a", T0), T0 + 120: frames("b", T0 + 120)}
    p = Pipeline([col], [XidDetector()], cfg=config.defaults())
    first = p.tick(T0)
    [f] = first.new_findings
    assert (f.severity, f.evidence["fault"], first.new_hints) == (Severity.TICKET, "user", [])
    assert p.tick(T0 + 60).new_hints == []
    second = p.tick(T0 + 120)
    [g] = second.escalated_findings
    assert (g.severity, g.evidence["fault"], g.evidence["jobs_hit"]) == (Severity.PAGE, "infrastructure", ["a", "b"])
    assert sorted(h.action.value for h in second.new_hints) == ["cordon_node", "requeue_job"]
    assert {h.node for h in second.new_hints} == {"node-a"}
    assert p.tick(T0 + 180).new_hints == []


def test_a_user_xid_is_told_to_the_jobs_tenant_an_infrastructure_one_to_the_hardware_team():
    s = load_settings(config.defaults())
    det = XidDetector()
    [user] = _hit(det, 13, "node-a", 0, "a", T0)
    [infra] = _hit(det, 13, "node-a", 0, "b", T0 + 60)
    assert team_of(user, "research", s) == s.team_of_tenant("research") != s.hardware_team
    assert team_of(infra, "research", s) == s.hardware_team


# (kind, cause) → fault from the `faults` table (None: neither is said)
FAULTS = [
    (FindingKind.OOM_CAPACITY, "capacity", "user"),
    (FindingKind.OOM_FRAGMENTATION, "fragmentation", "user"),
    (FindingKind.OOM_PREDICTED, "leak", "user"),
    (FindingKind.OOM_PREDICTED, "foreign_process", "infrastructure"),
    (FindingKind.OOM_FOREIGN_PROCESS, None, "infrastructure"),
    (FindingKind.COLLECTIVE_HANG, "software", "user"),
    (FindingKind.COLLECTIVE_HANG, "hardware", "infrastructure"),
    (FindingKind.COLLECTIVE_HANG, None, None),
    (FindingKind.NCCL_TIMEOUT, "network", "infrastructure"),
    (FindingKind.NCCL_TIMEOUT, None, None),
    (FindingKind.COLLECTIVE_MISMATCH, None, "user"),
    (FindingKind.ECC, "hardware", "infrastructure"),
    (FindingKind.STRAGGLER, None, None),
    (FindingKind.XID, "hardware", "infrastructure"),  # fatal, e.g. DCGM's last XID (evidence fatal: true below)
    (FindingKind.XID, None, None),  # an application-level XID no detector could attribute
]


@pytest.mark.parametrize("kind, cause, fault", FAULTS)
def test_whose_fault_by_the_table(kind, cause, fault):
    policy = HintPolicy(config.defaults())
    f = Finding(kind=kind, severity=Severity.PAGE, ts=T0, job="j", node="n0", gpu=1, cause=cause, summary="s.",
                evidence={"fatal": cause == "hardware"} if kind == FindingKind.XID else {})
    assert policy.classify(f) == fault
    assert f.evidence.get("fault") == fault
    assert (f.summary != "s.") == (fault is not None)
    assert policy.classify(f) == fault and f.summary.lower().count("fault:") == (1 if fault else 0)  # said once
    cordons = any(h.action in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE) for h in policy.hints_for(f))
    if fault == "user":
        assert not cordons


def test_the_real_h200_capacity_oom_is_the_users_and_cordons_nothing():
    ev = _oom_events(H200 / "s2_oom_ramp.log")
    [f] = OomEventClassifier().detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    policy = HintPolicy(_cfg())
    assert policy.classify(f) == "user" and f.summary.endswith("User fault: the application's own, its owner is told.")
    assert [h.action for h in policy.hints_for(f)] == [HintAction.RESIZE_OR_MOVE_JOB]
    assert team_of(f, "vision", load_settings(config.defaults())) == "ml-vision"


def test_the_history_survives_a_restart_and_a_garbage_file(tmp_path):
    """With blame.state_file, a detector started after a restart still knows job a hit the GPU:
    job b's XID 13 there is the GPU's. A file that is not the history (garbage, wrong shapes) is
    not trusted: the detector starts empty."""
    state = tmp_path / "xid_blame.json"
    cfg = _cfg(xid={"blame": {"state_file": str(state)}})
    [a] = _hit(XidDetector(cfg), 13, "node-a", 0, "a", T0)
    assert a.evidence["fault"] == "user" and state.is_file()
    [b] = _hit(XidDetector(cfg), 13, "node-a", 0, "b", T0 + HOUR)  # a new process
    assert (b.evidence["fault"], b.evidence["jobs_hit"]) == ("infrastructure", ["a", "b"])
    for garbage in (b"\x00\xff" * 50, b'{"node-a": 1}', b'[["node-a", true, {"a": 1}], ["n", 0, {"x": "NaN"}], [1, 2]]', b"[" * 100_000):
        state.write_bytes(garbage)
        d = XidDetector(cfg)
        assert len(d.history) == 0
        [c] = _hit(d, 13, "node-a", 0, "b", T0 + 2 * HOUR)
        assert c.evidence["fault"] == "user"


def test_a_verdict_on_a_copy_stays_on_the_copy():
    """A detector that reports copies of one finding (model_copy is shallow: the evidence mapping
    is shared): each copy is told whose fault it is, evidence and summary alike."""
    policy = HintPolicy(config.defaults())
    original = Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0.0, node="n1", gpu=0, xid=79, evidence={"fatal": True}, summary="XID 79 on n1 GPU 0")
    first, second = original.model_copy(), original.model_copy()
    assert policy.classify(first) == policy.classify(second) == "infrastructure"
    assert "fault" not in original.evidence and original.summary == "XID 79 on n1 GPU 0"
    assert all(f.summary.endswith("Infrastructure fault: the GPU, node or network, not the application.") for f in (first, second))
