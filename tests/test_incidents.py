"""One incident per fault (gpuvigil/pipeline/incidents.py): the rule, table-driven; the demo's
`straggler` and `thermal_throttle` scenarios end to end (one message to on-call plus updates); the
alert labels; a real Alertmanager 0.25 with the generated routing, where an incident's update
lands in the notification group of its first message; and the incident in every read of a
finding (demo JSON, API)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from gpuvigil import config
from gpuvigil.alerts.alertmanager_config import alertmanager_document
from gpuvigil.alerts.pusher import AlertPusher
from gpuvigil.demo import oncall_messages, render_timelines, run_scenario
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import PipelineConfig
from gpuvigil.pipeline.incidents import IncidentsConfig, IncidentTracker
from obs_helpers import alert_settings_for_tests, tiny_runtime
from services import WebhookSink, alertmanager_server, binary, wait_for

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
    ("no job, no GPU (a collector down): its own incident",
     [(10, F(K.COLLECTOR_DOWN, job=None, node=None, gpu=None, ranks=())), (11, F(K.XID, job=None, node="n1", gpu=0, ranks=()))],
     [(0, "opened"), (1, "opened")]),
]


@pytest.mark.parametrize("what, stream, expected", CASES, ids=[c[0] for c in CASES])
def test_incident_rule(what, stream, expected):
    tracker = IncidentTracker(settings=IncidentsConfig())
    by_tick: dict[float, list[Finding]] = {}
    for t, f in stream:
        by_tick.setdefault(t, []).append(f)
    for t in sorted(by_tick):
        tracker.expire(t)
        tracker.observe(by_tick[t], t)
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


# -- the simulator's scenarios, end to end -----------------------------------------------------------
@pytest.fixture(scope="module")
def scenarios():
    return {name: run_scenario(name) for name in ("straggler", "thermal_throttle")}


@pytest.mark.parametrize(
    "name, title, roles",
    [
        # the slow rank: the straggler ticket, then anomalies about the same GPU, explained
        ("straggler", "straggler", {"straggler": "opened", "anomaly": "evidence"}),
        # throttling: the anomaly opens, thermal_throttle re-titles (an update), the straggler is its symptom
        ("thermal_throttle", "thermal_throttle", {"anomaly": "opened", "thermal_throttle": "update", "straggler": "evidence"}),
    ],
)
def test_one_incident_per_injected_fault(scenarios, name, title, roles):
    res = scenarios[name]
    assert res.ok, res.problems
    kinds = {f["kind"] for f in res.findings}
    assert kinds == set(roles), kinds  # every detector that saw the fault is in the incident
    assert len({f["incident"] for f in res.findings}) == 1
    assert {f["kind"]: f["incident_role"] for f in res.findings} == roles
    # on-call: one message per injected fault, plus updates; an explained anomaly is never one
    m = oncall_messages(res)
    assert m["first"] == len(res.injected) == 1
    assert m["messages"] == 1 + m["updates"] == 1 + sum(r == "update" for r in roles.values())
    alerted = {a["finding_id"] for a in res.alerts}
    assert not any(f["id"] in alerted for f in res.findings if f["incident_role"] == "evidence")
    assert all(a["incident"] == res.findings[0]["incident"] for a in res.alerts)
    # ... and all go to one receiver (the incident's team), so they can share a notification group
    assert len({a["receiver"] for a in res.alerts}) == 1
    (heading, rows), = render_timelines(res)
    assert heading.startswith(f"incident {res.findings[0]['incident']}: {title} ")
    assert [r[1] for r in rows].count("DETECTED") == len(res.findings) and rows[0][1] == "INJECTED"


def test_demo_json_names_the_incident_of_every_finding_and_alert():
    out = subprocess.run([sys.executable, "-m", "gpuvigil", "demo", "--scenario", "thermal_throttle", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    incidents = {f["incident"] for f in obj["findings"]}
    assert len(incidents) == 1 and None not in incidents
    assert [(a["incident"] in incidents, a["update"]) for a in obj["alerts"]] == [(True, False), (True, True)]


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


@pytest.mark.services
@pytest.mark.timeout(300)
def test_an_update_lands_in_the_notification_group_of_the_first_message(tmp_path):
    """Real Alertmanager, the generated routing: the thermal scenario's incident is opened by an
    anomaly ticket (notified), then re-titled by thermal_throttle: the update is notified in the
    same group (same groupKey, same receiver), and the evidence (straggler) never reaches it."""
    binary("prometheus-alertmanager", "alertmanager")
    from gpuvigil.runtime import build_simulated

    with WebhookSink() as webhook:
        settings = alert_settings_for_tests(webhook.url)
        with alertmanager_server(alertmanager_document(settings), tmp_path / "am") as am:
            pusher = AlertPusher(am.url, tmp_path / "outbox.sqlite", settings)
            rt = build_simulated("thermal_throttle", sinks=[pusher])
            opened = None
            while rt.now < rt.cluster.scenario.duration_seconds:
                result = rt.step()
                pusher.flush()
                if opened is None and any(f.incident_role == "opened" for f in result.new_findings):
                    opened = wait_for(lambda: webhook.notifications("/ticket/"), 30, what="the first message")
            assert opened is not None
            firing = lambda: [(p, n["groupKey"], a["labels"]) for p, n in webhook.notifications("/ticket/") for a in n["alerts"] if a["status"] == "firing"]  # noqa: E731
            wait_for(lambda: any(lab.get("update") == "true" for _p, _g, lab in firing()), 30, what="the update")
            got = firing()
            assert len({(p, g) for p, g, _ in got}) == 1, got  # one receiver, one group
            assert {lab["kind"] for _p, _g, lab in got} == {"anomaly", "thermal_throttle"}
            assert len({lab["incident"] for _p, _g, lab in got}) == 1
            stored = httpx.get(f"{am.url}/api/v2/alerts", timeout=10).json()
            assert "straggler" not in {a["labels"]["kind"] for a in stored}
            assert [n["groupKey"] for _p, n in webhook.notifications()] and len(webhook.notifications("/page/")) == 0
            pusher.close()


def test_api_finding_reads_carry_the_incident(tmp_path):
    from gpuvigil.api import HintStore

    store = HintStore(tmp_path / "hints.db")
    rt = tiny_runtime(sinks=[store])
    rt.step()
    found = store.findings()
    assert found and all(f.incident and f.incident_role == "opened" for f in found)
    assert {f.incident for f in found} == {f.incident for f in rt.pipeline.all_findings}
    store.close()
