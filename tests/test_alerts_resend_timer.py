"""Late pipeline ticks must not page a finding twice (seen in the soak: 1 finding paged twice).

A firing alert carries endsAt = now + end_after_seconds. When resends came only from pipeline
ticks, a tick that ran later than end_after_seconds (a starved CPU, a slow scrape holding the
tick lock) let endsAt pass: Alertmanager resolved the alert, and the next tick fired it again, a
second page for one finding. The delivery thread now re-sends firing alerts on its own timer.
Checked against a real Alertmanager (started here) and its webhook notifications."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime

import httpx

from gpuvigil.alerts.alertmanager_config import alertmanager_document
from gpuvigil.alerts.pusher import KEEP_FIRING_TICKS_LATE, AlertPusher, DeliveryLoop
from obs_helpers import alert_settings_for_tests, tiny_runtime
from services import WebhookSink, alertmanager_server, wait_for

# endsAt lapses only if no resend is delivered for END_AFTER - RESEND seconds: margin for a loaded machine.
RESEND, END_AFTER = 1.0, 6.0


def _xid_in_am(am) -> dict | None:
    resp = httpx.get(f"{am.url}/api/v2/alerts", params={"filter": 'alertname="GpuvigilXid"'}, timeout=10)
    resp.raise_for_status()
    alerts = resp.json()
    return alerts[0] if alerts else None


def _xid_notifications(sink: WebhookSink) -> list[tuple[str, str]]:
    """(status, startsAt) of the XID alert in every webhook notification, in arrival order."""
    out = []
    for _, payload in sink.notifications():
        for alert in payload.get("alerts", []):
            if alert.get("labels", {}).get("alertname") == "GpuvigilXid":
                out.append((alert["status"], alert["startsAt"]))
    return out


def test_ticks_later_than_end_after_do_not_resolve_and_re_page(tmp_path):
    with WebhookSink() as sink:
        settings = alert_settings_for_tests(sink.url, resend_seconds=RESEND, end_after_seconds=END_AFTER)
        with alertmanager_server(alertmanager_document(settings), tmp_path / "am") as am:
            pusher = AlertPusher(am.url, tmp_path / "outbox.sqlite", settings)
            rt = tiny_runtime(sinks=[pusher])
            loop = DeliveryLoop(pusher, interval=0.2).start()
            try:
                rt.step()  # the XID finding fires
                wait_for(lambda: _xid_notifications(sink), timeout=60, what="the first page")
                # No tick for more than twice end_after_seconds: only the timer keeps it firing.
                time.sleep(2 * END_AFTER)
                alert = _xid_in_am(am)
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                assert alert is not None and alert["status"]["state"] == "active"
                assert alert["endsAt"] > now, "the alert's endsAt lapsed while ticks were late"
                assert pusher.timer_resends_total >= 2
                rt.step()  # the late tick: same finding, still active
                # Long enough for Alertmanager's group_interval (2 s) to notify any change.
                time.sleep(3 * 2.0)
            finally:
                loop.stop()
            notes = _xid_notifications(sink)
            assert [status for status, _ in notes] == ["firing"], f"paged again or resolved in between: {notes}"
            pusher.close()


def test_the_timer_stops_when_ticks_stop(tmp_path):
    """A pipeline that stopped ticking must let its alerts resolve: the timer only re-sends what a
    tick confirmed within KEEP_FIRING_TICKS_LATE × end_after_seconds."""

    class Clock:
        offset = 0.0

        def __call__(self) -> float:
            return time.time() + self.offset

    clock = Clock()
    settings = alert_settings_for_tests("http://127.0.0.1:9", resend_seconds=RESEND, end_after_seconds=END_AFTER)
    pusher = AlertPusher("http://127.0.0.1:9", tmp_path / "outbox.sqlite", settings, clock=clock)
    rt = tiny_runtime(sinks=[pusher])
    rt.step()
    assert pusher.resend_due() == 0  # just sent
    clock.offset += RESEND + 0.1
    assert pusher.resend_due() == 2  # both active findings, without a tick
    clock.offset += KEEP_FIRING_TICKS_LATE * END_AFTER + 1
    assert pusher.resend_due() == 0  # no tick confirmed them for too long: let them end
    rt.step()  # a tick sees them again
    clock.offset += RESEND + 0.1
    assert pusher.resend_due() == 2
    pusher.close()


def test_a_firing_alert_that_waited_in_the_outbox_is_delivered_with_a_future_end(tmp_path):
    with WebhookSink() as sink:
        settings = alert_settings_for_tests(sink.url, resend_seconds=RESEND, end_after_seconds=END_AFTER)
        with alertmanager_server(alertmanager_document(settings), tmp_path / "am") as am:
            pusher = AlertPusher(am.url, tmp_path / "outbox.sqlite", settings)
            rt = tiny_runtime(sinks=[pusher])
            rt.step()
            time.sleep(END_AFTER + 0.5)  # Alertmanager "down": the queued alerts' endsAt passes
            assert pusher.flush() == 2
            alert = _xid_in_am(am)
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            assert alert is not None and alert["endsAt"] > now
            pusher.close()


def test_one_incident_keeps_its_labels_in_alertmanager(tmp_path):
    """A job-level finding follows its job (its id ignores node and GPU), so its node label can
    change between reports; a hardware finding's job label changes when its GPU gets another job.
    Alertmanager knows alerts by labels: a changed label set would be a second alert, a second
    page. The pusher keeps the labels of the incident's first send, resolves with them, and only
    a severity change (escalation) starts a new alert."""
    from gpuvigil.model import Finding, FindingKind, Severity

    with WebhookSink() as sink:
        settings = alert_settings_for_tests(sink.url, resend_seconds=RESEND, end_after_seconds=END_AFTER)
        with alertmanager_server(alertmanager_document(settings), tmp_path / "am") as am:
            hang = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0.0, job="train", node="node-a", gpu=0, summary="hang")
            pusher = AlertPusher(am.url, tmp_path / "outbox.sqlite", settings)
            rt = tiny_runtime(findings=[hang], sinks=[pusher])
            rt.step()
            assert pusher.flush() == 1
            moved = hang.model_copy(update={"node": "node-b", "gpu": 1})
            assert moved.id == hang.id  # the same cause
            rt.detector.findings = [moved]
            time.sleep(RESEND + 0.2)
            rt.step()  # due for a resend, now reported on node-b
            assert pusher.flush() == 1
            alerts = [a for a in httpx.get(f"{am.url}/api/v2/alerts", timeout=10).json() if a["labels"].get("kind") == "collective_hang"]
            assert [(a["labels"]["node"], a["labels"]["gpu"]) for a in alerts] == [("node-a", "0")]
            # Escalation is a new incident: the ticket is resolved and the page fires.
            rt.detector.findings = [moved.model_copy(update={"severity": Severity.TICKET})]
            rt.step()
            with sqlite3.connect(pusher.path) as db:
                rows = [(st, json.loads(js)["labels"]["severity"]) for st, js in db.execute("SELECT status, alert_json FROM outbox ORDER BY id")]
            assert rows == [("resolved", "page"), ("firing", "ticket")]
            pusher.close()
