"""One incident per fault (gpuvigil/pipeline/incidents.py): the grouping rule, table-driven; its
window and ranks as config; what the alert pusher sends (evidence never, updates marked); the
incident in the API's finding reads. End to end (simulator, real Alertmanager): test_incidents_e2e.py."""

from __future__ import annotations

import json

import pytest

from gpuvigil import config
from gpuvigil.alerts.pusher import AlertPusher
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import PipelineConfig
from gpuvigil.pipeline.incidents import IncidentsConfig, IncidentTracker, Placement
from obs_helpers import alert_settings_for_tests, tiny_runtime

K = FindingKind


def F(kind: FindingKind, *, job: str | None = "train", node: str | None = "n1", gpu: int | None = 0, ranks=(0,), sev: str = "ticket", culprits=None) -> Finding:
    return Finding(kind=kind, severity=Severity(sev), ts=0.0, job=job, node=node, gpu=gpu, ranks=list(ranks),
                   culprit_ranks=list(ranks if culprits is None else culprits), summary=f"{kind.value} on {node}/{gpu}")


# (what happens, [(tick, finding)], expected [(incident number, role)] in the same order)
CASES = [
    ("straggler scenario: a known finding, then anomalies about its GPU",
     [(91, F(K.STRAGGLER)), (131, F(K.ANOMALY, culprits=[])), (201, F(K.ANOMALY, culprits=[], node="n1", gpu=0))],
     [(0, "opened"), (0, "evidence"), (0, "evidence")]),
    ("thermal scenario: anomaly first, the known cause re-titles, the symptom is evidence",
     [(91, F(K.ANOMALY, culprits=[])), (95, F(K.THERMAL_THROTTLE, culprits=[])), (116, F(K.STRAGGLER))],
     [(0, "opened"), (0, "update"), (0, "evidence")]),
    ("seen at once by two detectors: the known kind opens, the anomaly is explained",
     [(10, F(K.ANOMALY, culprits=[])), (10, F(K.THERMAL_THROTTLE, culprits=[]))],
     [(0, "evidence"), (0, "opened")]),
    ("an escalation is an update even when it explains no better",
     [(10, F(K.THERMAL_THROTTLE)), (20, F(K.STRAGGLER, sev="page"))],
     [(0, "opened"), (0, "update")]),
    ("same job, another GPU: one incident, and a message about the GPU no message named",
     [(10, F(K.XID, sev="page")), (20, F(K.XID, sev="page", node="n2", gpu=3, ranks=(5,)))],
     [(0, "opened"), (0, "update")]),
    ("an anomaly about another GPU of the job is not explained by the known finding",
     [(10, F(K.STRAGGLER)), (20, F(K.ANOMALY, node="n2", gpu=3, ranks=(5,), culprits=[]))],
     [(0, "opened"), (0, "update")]),
    ("shared GPU, different jobs (the GPU was given to another job): one incident",
     [(10, F(K.ECC, job="a")), (20, F(K.THERMAL_THROTTLE, job="b"))],
     [(0, "opened"), (0, "evidence")]),
    ("nothing shared: two incidents",
     [(10, F(K.XID, job="a", node="n1", gpu=0)), (20, F(K.XID, job="b", node="n2", gpu=0))],
     [(0, "opened"), (1, "opened")]),
    ("past the window: a new incident",
     [(10, F(K.STRAGGLER)), (10 + 600 + 1, F(K.THERMAL_THROTTLE))],
     [(0, "opened"), (1, "opened")]),
    ("job-level finding without GPU joins by job",
     [(10, F(K.OOM_PREDICTED, node=None, gpu=None, ranks=(0, 1))), (30, F(K.COLLECTIVE_HANG, node="n1", gpu=1, ranks=(0, 1, 2), culprits=[2]))],
     [(0, "opened"), (0, "update")]),
    ("a lost GPU hangs its job, the hang seen first: the XID that caused it re-titles the incident",
     [(40, F(K.COLLECTIVE_HANG, sev="page", gpu=6, ranks=(6,))), (45, F(K.XID, sev="page", gpu=6, ranks=(6,)))],
     [(0, "opened"), (0, "update")]),
    ("the XID seen first: the hang it caused is evidence",
     [(40, F(K.XID, sev="page", gpu=6, ranks=(6,))), (45, F(K.COLLECTIVE_HANG, sev="page", gpu=6, ranks=(6,)))],
     [(0, "opened"), (0, "evidence")]),
    ("no job, no GPU (a collector down): its own incident",
     [(10, F(K.COLLECTOR_DOWN, job=None, node=None, gpu=None, ranks=())), (11, F(K.XID, job=None, node="n1", gpu=0, ranks=()))],
     [(0, "opened"), (1, "opened")]),
]


def _run(tracker: IncidentTracker, stream: list[tuple[float, Finding]]) -> None:
    by_tick: dict[float, list[Finding]] = {}
    for t, f in stream:
        by_tick.setdefault(t, []).append(f)
    for t in sorted(by_tick):
        tracker.expire(t)
        tracker.observe(by_tick[t], t)


@pytest.mark.parametrize("what, stream, expected", CASES, ids=[c[0] for c in CASES])
def test_incident_rule(what, stream, expected):
    tracker = IncidentTracker(settings=IncidentsConfig())
    _run(tracker, stream)
    # incidents numbered in the order they were opened
    opened_order: dict[str | None, int] = {}
    for _t, f in sorted(stream, key=lambda x: x[0]):
        opened_order.setdefault(f.incident, len(opened_order))
    got = [(opened_order[f.incident], f.incident_role) for _t, f in stream]
    assert got == expected, what


def test_a_placed_finding_keeps_its_incident_and_role_while_reported():
    tracker = IncidentTracker(settings=IncidentsConfig())
    first = F(K.ANOMALY, culprits=[])
    tracker.observe([first], 1.0)
    tracker.observe([F(K.THERMAL_THROTTLE)], 2.0)
    again = F(K.ANOMALY, culprits=[])  # the detector's next report: a new object, same cause
    tracker.observe([again], 3.0)
    assert (again.incident, again.incident_role) == (first.incident, "opened")
    # reported every tick, the incident stays live past the window
    for t in range(4, 700):
        tracker.observe([F(K.ANOMALY, culprits=[])], float(t))
        tracker.expire(float(t))
    late = F(K.STRAGGLER)
    tracker.observe([late], 700.0)
    assert late.incident == first.incident and late.incident_role == "evidence"
    # quiet for longer than the window: forgotten (bounded memory), the next one opens anew
    assert tracker.expire(700.0 + 601.0) and not tracker.live
    later = F(K.STRAGGLER)
    tracker.observe([later], 1302.0)
    assert later.incident != first.incident and later.incident_role == "opened"


@pytest.mark.parametrize("what, stream, expected", CASES, ids=[c[0] for c in CASES])
def test_a_tracker_taking_over_names_every_incident_as_the_first_did(what, stream, expected):
    """A second tracker (a new act leader) sees the first one's live findings again, all in one
    tick and later: placed afresh it would name them otherwise (and, seen at once, order them
    otherwise); adopting the first one's placements, it gives each the incident and role it had."""
    first = IncidentTracker(settings=IncidentsConfig())
    _run(first, stream)
    live = {f.id: f for _t, f in stream if first.incident_of(f.id) is not None}
    placements = {fid: Placement(f.incident, f.incident_role, first.incident_of(fid).opened_at) for fid, f in live.items()}
    later = max(t for t, _f in stream) + 30.0

    def again() -> list[Finding]:
        return [f.model_copy(update={"incident": None, "incident_role": None}) for f in reversed(live.values())]

    fresh = again()
    IncidentTracker(settings=IncidentsConfig()).observe(fresh, later)
    assert {f.incident for f in fresh}.isdisjoint({f.incident for f in live.values()}), what  # the failure adopting prevents

    second = IncidentTracker(settings=IncidentsConfig())
    second.adopt(placements)
    taken = again()
    second.expire(later)
    second.observe(taken, later)
    assert {f.id: (f.incident, f.incident_role) for f in taken} == {fid: (f.incident, f.incident_role) for fid, f in live.items()}, what
    for inc in {f.incident for f in taken}:
        assert second.live[inc].opened_at == first.live[inc].opened_at
    assert not second.adopted  # each adopted placement is used once


def test_adopted_placements_yield_to_own_ones_and_expire():
    tracker = IncidentTracker(settings=IncidentsConfig(window_seconds=60))
    mine = F(K.XID, sev="page")
    tracker.observe([mine], 10.0)
    own = (mine.incident, mine.incident_role)
    tracker.adopt({mine.id: Placement("elsewhere", "update", 0.0), F(K.ECC, node="n9").id: Placement("gone", "opened", 0.0)})
    again = F(K.XID, sev="page")
    tracker.observe([again], 11.0)
    assert (again.incident, again.incident_role) == own  # placed here already: it keeps its place
    tracker.expire(20.0)  # the first tick after the adoption starts its clock
    tracker.expire(20.0 + 61.0)
    late = F(K.ECC, node="n9")
    tracker.observe([late], 82.0)
    assert not tracker.adopted and late.incident != "gone" and late.incident_role == "opened"


def test_window_and_ranks_are_config_data():
    cfg = config.load(overrides={"pipeline": {"incidents": {"window_seconds": 5, "explains": {"anomaly": 0, "straggler": 3, "default": 2}}}})
    tracker = IncidentTracker(config.section("pipeline", PipelineConfig, cfg).incidents)
    a, b, c = F(K.THERMAL_THROTTLE), F(K.STRAGGLER), F(K.ECC)
    tracker.observe([a], 0.0)
    tracker.observe([b], 1.0)  # ranks above thermal here: re-titles
    assert b.incident_role == "update" and tracker.incident_of(b.id).title is b
    tracker.expire(20.0)
    tracker.observe([c], 20.0)
    assert c.incident != a.incident
    with pytest.raises(config.ConfigError, match="window_seconds"):
        config.load(overrides={"pipeline": {"incidents": {"window_seconds": 0}}})


# -- alerts -------------------------------------------------------------------------------------------
def test_evidence_is_never_pushed_and_updates_say_so(tmp_path):
    settings = alert_settings_for_tests("http://127.0.0.1:9")
    straggler = F(K.STRAGGLER, node="node-a", gpu=0, ranks=(0,))
    anomaly = F(K.ANOMALY, node="node-a", gpu=0, ranks=(0,), culprits=[])
    hang = Finding(kind=K.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0.0, job="train", node="node-b", gpu=0, ranks=[0, 1, 2], culprit_ranks=[2],
                   summary="train hangs on rank 2")
    pusher = AlertPusher("http://127.0.0.1:9", tmp_path / "outbox.sqlite", settings)
    rt = tiny_runtime([straggler, anomaly, hang], sinks=[pusher])
    rt.step()
    with pusher._lock:
        rows = [json.loads(r[0]) for r in pusher.db.execute("SELECT alert_json FROM outbox ORDER BY id")]
    by_kind = {r["labels"]["kind"]: r["labels"] for r in rows}
    assert set(by_kind) == {"collective_hang", "straggler"}  # the explained anomaly is not pushed
    incident = by_kind["collective_hang"]["incident"]
    assert by_kind["straggler"]["incident"] == incident
    assert "update" not in by_kind["collective_hang"] and by_kind["straggler"]["update"] == "true"
    # one incident, one team: the hang's (the job's tenant, research), for the straggler too
    assert by_kind["straggler"]["team"] == by_kind["collective_hang"]["team"] == "ml-research"
    pusher.close()


def test_a_pusher_taking_over_routes_an_incident_to_the_team_it_was_opened_for(tmp_path):
    """The incident's opener has cleared; its update (a hardware finding) is still active. The
    pusher that sent the opener gave the update the opener's team; a new pusher (a new act
    leader) that never saw the opener does the same once it adopts the incident's team."""
    from types import SimpleNamespace

    import polars as pl

    settings = alert_settings_for_tests("http://127.0.0.1:9")
    hang = Finding(kind=K.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0.0, job="train", node="n1", gpu=6, ranks=[6], culprit_ranks=[6], summary="hang")
    lost = F(K.XID, sev="page", gpu=6, ranks=(6,))
    hang.incident, hang.incident_role, lost.incident, lost.incident_role = "inc", "opened", "inc", "update"
    window = {"jobs": pl.DataFrame({"job": ["train"], "tenant": ["research"]})}
    first = AlertPusher("http://127.0.0.1:9", tmp_path / "a.sqlite", settings)
    second = AlertPusher("http://127.0.0.1:9", tmp_path / "b.sqlite", settings)
    try:
        assert first.incident_teams(SimpleNamespace(active_findings=[hang, lost]), window) == {"inc": "ml-research"}
        assert first.incident_teams(SimpleNamespace(active_findings=[lost]), window) == {"inc": "ml-research"}
        only_update = SimpleNamespace(active_findings=[lost])
        assert second.incident_teams(only_update, window) == {"inc": settings.hardware_team}  # what adopting prevents
        second.adopt_incident_teams({"inc": "ml-research"})
        assert second.incident_teams(only_update, window) == {"inc": "ml-research"}
    finally:
        first.close()
        second.close()


def test_api_finding_reads_carry_the_incident(tmp_path):
    from gpuvigil.api import HintStore

    store = HintStore(tmp_path / "hints.db")
    rt = tiny_runtime(sinks=[store])
    rt.step()
    found = store.findings()
    assert found and all(f.incident and f.incident_role == "opened" for f in found)
    assert {f.incident for f in found} == {f.incident for f in rt.pipeline.all_findings}
    store.close()


def test_a_finding_no_pipeline_placed_is_an_incident_of_its_own(tmp_path):
    """Pushed without a pipeline (no incident): its own id, so Alertmanager's grouping by incident
    does not put every such alert in one group."""
    settings = alert_settings_for_tests("http://127.0.0.1:9")
    pusher = AlertPusher("http://127.0.0.1:9", tmp_path / "outbox.sqlite", settings)
    try:
        a, b = F(K.XID, node="n1"), F(K.XID, node="n2")
        labels = [pusher.alert_for(f, {}, starts_at=0.0, ends_at=1.0)["labels"] for f in (a, b)]
    finally:
        pusher.close()
    assert [lab["incident"] for lab in labels] == [a.id, b.id] and a.id != b.id
    assert not [lab for lab in labels if "update" in lab]


def test_replay_counts_only_the_pages_on_call_received():
    """A page that joined an incident as evidence was never sent: replay's summary (and the
    report's rate of pages per GPU-day) does not count it."""
    from gpuvigil.offline.replay import Fired, ReplayResult

    def page(kind: FindingKind, role: str | None, **over) -> Finding:
        f = Finding(kind=kind, severity=Severity.PAGE, ts=100.0, job="j", node="n1", gpu=2, summary="s", **over)
        f.incident, f.incident_role = ("inc-1", role) if role else (None, None)
        return f

    fired = [Fired(100.0, page(FindingKind.XID, "opened", xid=79)), Fired(101.0, page(FindingKind.ECC, "evidence")), Fired(102.0, page(FindingKind.COLLECTIVE_HANG, "update")),
             Fired(103.0, page(FindingKind.NCCL_TIMEOUT, None))]
    res = ReplayResult(findings=fired, hints=[], start=0.0, end=86400.0, step=30.0, ticks=2880, gpus=1, wall_seconds=1.0, samples={})
    s = res.summary()
    assert s["findings"] == 4 and s["pages"] == 3
    assert s["pages_by_kind"] == {"collective_hang": 1, "nccl_timeout": 1, "xid": 1}
