"""One incident per fault, end to end: the demo's `straggler` and `thermal_throttle` scenarios
(simulated cluster, 1 Hz samples) give one incident each, one message to on-call plus updates, an
explained anomaly never alerted; `demo --json` names every finding's and alert's incident; and a
real Alertmanager 0.25 with the generated routing puts an incident's update in the notification
group of its first message."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from gpuvigil.alerts.alertmanager_config import alertmanager_document
from gpuvigil.alerts.pusher import AlertPusher
from gpuvigil.app.demo import oncall_messages, render_timelines, run_scenario
from obs_helpers import alert_settings_for_tests
from services import WebhookSink, alertmanager_server, binary, wait_for


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


@pytest.mark.services
@pytest.mark.timeout(300)
def test_an_update_lands_in_the_notification_group_of_the_first_message(tmp_path):
    """Real Alertmanager, the generated routing: the thermal scenario's incident is opened by an
    anomaly ticket (notified), then re-titled by thermal_throttle: the update is notified in the
    same group (same groupKey, same receiver), and the evidence (straggler) never reaches it."""
    binary("prometheus-alertmanager", "alertmanager")
    from gpuvigil.app.runtime import build_simulated

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


