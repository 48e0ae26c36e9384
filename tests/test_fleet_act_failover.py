"""An act leader killed with an incident open, on a real nats-server, a real Alertmanager and a
webhook receiver: the standby takes the lease over and pages nothing again.

Two `gpuvigil act` processes share one nats-server; the test plays detect (it publishes a
partition's findings messages, as a detect owner does). The incident opens with a straggler, then
an XID on one of the job's GPUs explains it better: an update of the same incident, routed to the
incident's team (the tenant's, not the hardware team). The leader pages both and is killed
(SIGKILL). The standby, taking over, reads both findings again in one message: placed afresh it
would name the incident otherwise (its id is a digest of the first finding and the time this
replica first saw it), open it with the XID and send the straggler as the update. Alertmanager
knows an alert by its labels, so any of that is a second page. It adopts the incidents the old
leader recorded in the ledger instead, and re-sends the same labels, with the start each alert
first had: Alertmanager merges them into the alerts it already notified.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import ExitStack

import httpx
import pytest
import yaml

from fleet_helpers import GvProc as Proc, NatsCluster, Probe, nats_binary
from services import WebhookSink, binary, start_alertmanager, wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet import transport
from gpuvigil.model import Finding, FindingKind, Severity

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]
LEASE_TTL = 4.0
RESEND = 2.0
GROUP_WAIT = 1.0
SUBJECT = "gv.findings.part.1"


def straggler(now: float) -> Finding:
    return Finding(kind=FindingKind.STRAGGLER, severity=Severity.PAGE, ts=now, job="train-a", ranks=list(range(8)), culprit_ranks=[3],
                   summary="train-a: rank 3 is 40% slower than its peers", source="straggler")


def xid(now: float) -> Finding:
    return Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=now, job="train-a", ranks=[3], node="n1", gpu=3, xid=79,
                   summary="n1 GPU 3 fell off the bus (XID 79) under train-a rank 3", source="xid")


class Detect:
    """Publishes the partition's findings every half second, as its detect owner does (the full
    state each time, stamped with the owner's lease epoch)."""

    def __init__(self, probe: Probe):
        self.probe = probe
        self.kinds: list = [straggler]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            body = transport.findings_payload("detect", now, [k(now) for k in self.kinds], partition=1, owner="detect-1", epoch=1,
                                              tenants={"train-a": "research"})
            try:
                self.probe.publish(SUBJECT, body)
            except Exception:  # noqa: BLE001 - the probe reconnecting: the next message carries the same state
                pass
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def firing(webhook: WebhookSink) -> list[dict]:
    return [a for _p, payload in webhook.notifications("/page") for a in payload.get("alerts", []) if a.get("status") == "firing"]


def sent_labels(outbox) -> dict[str, dict]:
    """finding id → the labels of the firing alert an act replica last sent for it ({} before its
    outbox exists: a standby opens none)."""
    if not outbox.exists():
        return {}
    con = sqlite3.connect(f"file:{outbox}?mode=ro", uri=True)
    try:
        return {fp: json.loads(body)["labels"] for fp, body in con.execute("SELECT fingerprint, alert_json FROM sent WHERE alert_json IS NOT NULL")}
    except sqlite3.OperationalError:  # created, not migrated yet
        return {}
    finally:
        con.close()


def delivered(proc: Proc) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    url = proc.metrics_url()
    if url is None:
        return 0.0
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "gpuvigil_act_alerts_delivered_total")


def sent_starts(outbox) -> dict[str, float]:
    """finding id → the startsAt (epoch seconds) of the alert an act replica sent for it."""
    con = sqlite3.connect(outbox)
    try:
        return dict(con.execute("SELECT fingerprint, starts_at FROM sent"))
    finally:
        con.close()


def test_act_failover_re_sends_the_same_alerts_and_pages_nothing_twice(tmp_path):
    nats_binary()
    binary("prometheus-alertmanager", "alertmanager")
    with ExitStack() as stack:
        cluster = NatsCluster(tmp_path, 1)
        stack.callback(cluster.stop)
        webhook = stack.enter_context(WebhookSink())
        cluster.wait_ready()
        am = start_alertmanager({
            "route": {"receiver": "page", "group_by": ["..."], "group_wait": f"{GROUP_WAIT:g}s", "group_interval": "1h", "repeat_interval": "4h"},
            "receivers": [{"name": "page", "webhook_configs": [{"url": f"{webhook.url}/page", "send_resolved": False}]}],
        }, tmp_path / "alertmanager")
        stack.callback(am.stop)
        fleet = Fleet(servers=cluster.urls, partitions=4, lease_ttl_seconds=LEASE_TTL)
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": fleet.model_dump(), "alerts": {"resend_seconds": RESEND, "end_after_seconds": 60}}))
        probe = Probe(cluster.urls)
        stack.callback(probe.close)

        def act(name: str) -> Proc:
            proc = Proc(name, ["act", "--config", "fleet.yaml", "--log-level", "info", "--id", name, "--metrics-port", "0",
                               "--alertmanager", am.url, "--outbox", f"{name}-outbox.sqlite"], tmp_path)
            stack.callback(proc.stop)
            return proc

        procs = [act("act-1")]
        wait_for(lambda: probe.holders().get("act.leader") == "act-1", 60, 0.2, "act-1 leading")
        procs.append(act("act-2"))  # the standby
        detect = Detect(probe)
        stack.callback(detect.close)
        try:
            wait_for(lambda: len(firing(webhook)) == 1, 60, 0.2, "the straggler paged")
            detect.kinds = [straggler, xid]
            wait_for(lambda: len(firing(webhook)) == 2, 60, 0.2, "the XID paged as the incident's update")
        except AssertionError:
            raise AssertionError("\n".join(p.tail() for p in procs) + f"\npages: {firing(webhook)}") from None
        first = {a["annotations"]["finding_id"]: a["labels"] for a in firing(webhook)}
        by_kind = {labels["kind"]: labels for labels in first.values()}
        assert by_kind["xid"]["incident"] == by_kind["straggler"]["incident"]
        assert by_kind["xid"].get("update") == "true" and "update" not in by_kind["straggler"]
        assert by_kind["xid"]["team"] == by_kind["straggler"]["team"] == "ml-research"  # the incident's team, not the hardware team's
        assert sent_labels(tmp_path / "act-1-outbox.sqlite") == first

        procs[0].kill()
        wait_for(lambda: probe.holders().get("act.leader") == "act-2", 30, 0.2, "act-2 taking the leader lease over")
        # Its first sends, then resends (every RESEND s): a label that differs from the first
        # page is a new alert, notified after group_wait.
        try:
            wait_for(lambda: delivered(procs[1]) >= 4, 60, 0.2, "act-2 sending its alerts and re-sending them")
        except AssertionError:
            raise AssertionError(procs[1].tail()) from None
        time.sleep(GROUP_WAIT + 2.0)

        pages = firing(webhook)
        assert sorted(a["annotations"]["finding_id"] for a in pages) == sorted(first), [a["labels"] for a in pages]
        assert sent_labels(tmp_path / "act-2-outbox.sqlite") == first
        # The same alerts, not new ones: each keeps the start its first page had.
        assert sent_starts(tmp_path / "act-2-outbox.sqlite") == sent_starts(tmp_path / "act-1-outbox.sqlite")
        assert "adopted" in procs[1].text()
