"""The alert pusher and its SQLite outbox, against a real Alertmanager 0.25 (started by the test
on a free loopback port): labels and annotations as Alertmanager stores them, resends, resolves,
an outage that loses nothing, replay after a gpuvigil restart, dead letters for rejected alerts."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime

import httpx
import pytest

from gpuvigil.alerts.alertmanager_config import alertmanager_document
from gpuvigil.alerts.pusher import AlertPusher, alert_name
from gpuvigil.errors import UserError
from obs_helpers import alert_settings_for_tests, tiny_runtime
from services import WebhookSink, alertmanager_server, free_port, start_alertmanager


class Clock:
    def __init__(self):
        import time

        self.offset = 0.0
        self._time = time.time

    def __call__(self) -> float:
        return self._time() + self.offset


@pytest.fixture(scope="module")
def webhook():
    with WebhookSink() as sink:
        yield sink


@pytest.fixture(scope="module")
def settings(webhook):
    return alert_settings_for_tests(webhook.url)


@pytest.fixture(scope="module")
def alertmanager(settings, tmp_path_factory):
    with alertmanager_server(alertmanager_document(settings), tmp_path_factory.mktemp("am")) as am:
        yield am


def am_alerts(am, **labels) -> list[dict]:
    resp = httpx.get(f"{am.url}/api/v2/alerts", params={"active": "true", "silenced": "true", "inhibited": "true"}, timeout=10)
    resp.raise_for_status()
    return [a for a in resp.json() if all(a["labels"].get(k) == v for k, v in labels.items())]


def outbox_rows(path) -> list[tuple[str, str, dict]]:
    with sqlite3.connect(path) as db:
        return [(fp, st, json.loads(js)) for fp, st, js in db.execute("SELECT fingerprint, status, alert_json FROM outbox ORDER BY id")]


def test_findings_arrive_in_alertmanager_with_labels_and_annotations(alertmanager, settings, tmp_path):
    pusher = AlertPusher(alertmanager.url, tmp_path / "outbox.sqlite", settings)
    rt = tiny_runtime(sinks=[pusher])
    rt.step()
    assert pusher.pending() == 2
    assert pusher.flush() == 2 and pusher.pending() == 0
    xid = am_alerts(alertmanager, alertname=alert_name("xid"), node="node-b")
    assert len(xid) == 1
    raised = {f.kind.value: f for f in rt.pipeline.all_findings}
    # Each finding opened its own incident (another GPU, another job): no `update` label.
    assert raised["xid"].incident and raised["xid"].incident != raised["oom_predicted"].incident
    assert xid[0]["labels"] == {
        "alertname": "GpuvigilXid", "severity": "page", "kind": "xid", "node": "node-b", "gpu": "1", "xid": "79",
        "team": "gpu-platform", "scope": "node", "origin": "finding", "hardware": "fatal", "incident": raised["xid"].incident,
    }
    ann = xid[0]["annotations"]
    assert ann["summary"].startswith("XID 79 on node-b")
    # every finding records the observation level it was made at; an XID is L0
    assert json.loads(ann["evidence"]) == {"fatal": True, "xid": 79, "level": "L0"}
    assert ann["runbook"].endswith("#finding-xid")
    oom = am_alerts(alertmanager, alertname="GpuvigilOomPredicted", job="train")
    assert len(oom) == 1
    labels = oom[0]["labels"]
    # The job's tenant (research) decides the team; a job alert is job-scoped, never "fatal".
    assert (labels["team"], labels["tenant"], labels["scope"], labels["severity"]) == ("ml-research", "research", "job", "ticket")
    assert "hardware" not in labels
    pusher.close()


def test_resend_only_after_the_interval_and_resolve_on_clear(alertmanager, settings, tmp_path):
    clock = Clock()
    pusher = AlertPusher(alertmanager.url, tmp_path / "outbox.sqlite", settings, clock=clock)
    rt = tiny_runtime(sinks=[pusher])
    rt.step()
    pusher.flush()
    for _ in range(5):  # same causes, within resend_seconds: nothing new to send
        rt.step()
    assert pusher.pending() == 0
    clock.offset += settings.resend_seconds + 1
    rt.step()
    assert {st for _, st, _ in outbox_rows(pusher.path)} == {"firing"} and pusher.pending() == 2
    pusher.flush()
    clock.offset = 0.0  # back to real time: Alertmanager compares endsAt with its own clock
    rt.detector.active = False
    for _ in range(int(rt.pipeline._clear_after(rt.detector.findings[1])) + 2):
        rt.step()
    rows = outbox_rows(pusher.path)
    assert [(st, a["labels"]["kind"]) for _, st, a in rows] == [("resolved", "xid"), ("resolved", "oom_predicted")]
    resolved = rows[1][2]
    assert resolved["startsAt"] < resolved["endsAt"] <= datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    pusher.flush()
    assert am_alerts(alertmanager, alertname="GpuvigilOomPredicted", job="train") == []
    pusher.close()


def test_outage_loses_nothing_and_a_restarted_gpuvigil_replays_the_outbox(settings, tmp_path):
    port = free_port()
    outbox = tmp_path / "outbox.sqlite"
    am = start_alertmanager(alertmanager_document(settings), tmp_path / "am", port=port)
    am.stop()  # Alertmanager is down from the start
    clock = Clock()
    pusher = AlertPusher(am.url, outbox, settings, clock=clock)
    rt = tiny_runtime(sinks=[pusher])
    rt.step()
    assert pusher.flush() == 0
    assert pusher.pending() == 2 and pusher.delivery_failures_total == 1
    assert pusher.backoff_seconds > 0
    assert pusher.flush() == 0 and pusher.delivery_failures_total == 1  # backing off: no attempt
    # Resends during the outage supersede the queued firing rows instead of piling up.
    for _ in range(3):
        clock.offset += settings.resend_seconds + 1
        rt.step()
    assert pusher.pending() == 2
    pusher.close()  # gpuvigil stops with alerts still queued

    am = start_alertmanager(alertmanager_document(settings), tmp_path / "am", port=port)
    try:
        restarted = AlertPusher(am.url, outbox, settings)
        assert restarted.pending() == 2
        assert restarted.flush() == 2 and restarted.pending() == 0
        assert len(am_alerts(am, origin="finding")) == 2
        restarted.close()
    finally:
        am.stop()


def test_a_resolve_queued_during_an_outage_is_not_dropped(settings, tmp_path):
    clock = Clock()
    pusher = AlertPusher(f"http://127.0.0.1:{free_port()}", tmp_path / "outbox.sqlite", settings, clock=clock)
    rt = tiny_runtime(sinks=[pusher])
    rt.step()
    rt.detector.active = False
    for _ in range(int(rt.pipeline._clear_after(rt.detector.findings[1])) + 2):
        rt.step()
    kinds = [(st, a["labels"]["kind"]) for _, st, a in outbox_rows(pusher.path)]
    # Alertmanager must still learn the OOM alert fired, then that it resolved, in that order.
    assert kinds == [("firing", "xid"), ("firing", "oom_predicted"), ("resolved", "xid"), ("resolved", "oom_predicted")]
    pusher.close()


def test_a_rejected_alert_goes_to_dead_letter_and_does_not_block_the_rest(alertmanager, settings, tmp_path):
    pusher = AlertPusher(alertmanager.url, tmp_path / "outbox.sqlite", settings)
    bad = {"labels": {"alertname": "Broken", "severity": "ticket"}, "annotations": {},
           "startsAt": "2030-01-01T00:10:00Z", "endsAt": "2030-01-01T00:00:00Z"}  # ends before it starts
    cur = pusher.db.cursor()
    pusher._enqueue(cur, "broken", "firing", bad, 0.0)
    rt = tiny_runtime(sinks=[pusher])
    rt.step()
    assert pusher.flush() == 2
    assert pusher.pending() == 0
    dead = pusher.dead_letters()
    assert len(dead) == 1 and json.loads(dead[0][0])["labels"]["alertname"] == "Broken" and "400" in dead[0][1]
    pusher.close()


def test_unusable_outbox_path_is_a_user_error(settings, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="alert outbox"):
        AlertPusher("http://127.0.0.1:9", blocker / "outbox.sqlite", settings)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database" * 100)
    with pytest.raises(UserError, match="alert outbox"):
        AlertPusher("http://127.0.0.1:9", garbage, settings)


def test_breaker_page_goes_through_the_outbox_and_resolves_when_closed(alertmanager, settings, tmp_path):
    """The acting circuit breaker pages through the same outbox as findings: one alert, firing
    until the breaker is closed."""
    pusher = AlertPusher(alertmanager.url, tmp_path / "outbox.sqlite", settings)
    text = "breaker open: 4 node(s) would have been drained (32 GPU(s)), top causes xid (4)"
    pusher.page(text, True)
    assert pusher.flush() == 1
    [got] = am_alerts(alertmanager, alertname="GpuvigilBreakerOpen")
    assert got["labels"] == {"alertname": "GpuvigilBreakerOpen", "severity": "page", "kind": "breaker_open", "team": settings.default_team,
                             "scope": "cluster", "origin": "acting", "incident": "gpuvigil:breaker_open"}
    assert got["annotations"]["summary"] == text and got["annotations"]["runbook"].endswith("#breaker-open")
    pusher.page("breaker closed: acting resumes", False)
    assert pusher.flush() == 1
    assert am_alerts(alertmanager, alertname="GpuvigilBreakerOpen") == []
    pusher.close()
