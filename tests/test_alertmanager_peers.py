"""Several Alertmanagers, as Prometheus uses them: the pusher sends every alert to every peer, each
peer with its own outbox state and backoff, and the Alertmanager cluster (gossip) deduplicates the
notifications.

The service tests start two real Alertmanager 0.25 processes clustered with gossip on loopback and
a webhook receiver, and assert that
- a page pushed to both peers reaches both, and the pager gets exactly one notification;
- with one peer killed, a new page is still delivered (to the other) and pages exactly once; its
  alert stays queued for the dead peer only;
- when that peer comes back, the outbox replays the backlog to it, and the cluster's shared
  notification log keeps it from paging a second time;
- and, as the control, that two Alertmanagers without gossip do page twice.
The other tests need no server: config validation, a peer that is down does not hold back another,
and an outbox written before peers existed (schema version 1) is read and delivered.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gpuvigil import config
from gpuvigil.alerts.alertmanager_config import alertmanager_document
from gpuvigil.alerts.pusher import SCHEMA, AlertPusher, DeliveryLoop, peer_urls
from gpuvigil.alerts.settings import load_settings
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import TickResult
from obs_helpers import alert_settings_for_tests
from services import ALERTMANAGER_CANDIDATES, Service, WebhookSink, binary, free_port, wait_for, wait_ready

# Test-only cluster timings: a peer at position i of the cluster waits i × peer_timeout before it
# notifies (and then only if the gossiped notification log says nobody has), so a duplicate, if
# the cluster failed to deduplicate, arrives within group_wait + peer_timeout of the first.
PEER_TIMEOUT_S = 4  # well above gossip delays on a loaded test machine (Alertmanager default: 15 s)
GROUP_WAIT_S = 1
DUPLICATE_WINDOW_S = 2 * (PEER_TIMEOUT_S + GROUP_WAIT_S)


def xid(node: str) -> Finding:
    return Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0, node=node, gpu=0, xid=79,
                   evidence={"fatal": True}, summary=f"XID 79 on {node} GPU 0")


def tick(findings: list[Finding]) -> TickResult:
    return TickResult(now=0.0, new_findings=list(findings), active_findings=list(findings), cleared_findings=[],
                      new_hints=[], expired_hints=[], duration_seconds=0.0, samples_ingested=0)


class ClusterMember:
    """One Alertmanager of a gossip cluster on loopback; restartable with the same ports and storage."""

    def __init__(self, name: str, config_doc: dict, workdir: Path):
        self.name = name
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "alertmanager.yml").write_text(yaml.safe_dump(config_doc, sort_keys=False))
        self.web_port = free_port()
        self.cluster_port = free_port()
        self.url = f"http://127.0.0.1:{self.web_port}"
        self.peers: list[ClusterMember] = []
        self.service: Service | None = None

    def start(self) -> None:
        exe = binary(ALERTMANAGER_CANDIDATES[0], *ALERTMANAGER_CANDIDATES[1:])
        cluster = f"127.0.0.1:{self.cluster_port}"
        cmd = [
            exe, f"--config.file={self.workdir / 'alertmanager.yml'}", f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.web_port}", "--log.level=warn",
            f"--cluster.listen-address={cluster}", f"--cluster.advertise-address={cluster}",
            *[f"--cluster.peer=127.0.0.1:{p.cluster_port}" for p in self.peers],
            f"--cluster.peer-timeout={PEER_TIMEOUT_S}s", "--cluster.settle-timeout=3s", "--cluster.gossip-interval=100ms",
            "--cluster.pushpull-interval=2s", "--cluster.probe-interval=200ms", "--cluster.probe-timeout=100ms",
            "--cluster.reconnect-interval=1s",
        ]
        log = self.workdir / "alertmanager.log"
        proc = subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, cwd=self.workdir)
        self.service = Service(proc, self.url, self.web_port, log)
        try:
            wait_ready(f"{self.url}/-/ready", proc, log=log)
        except BaseException:
            self.service.stop()
            raise

    def kill(self) -> None:
        """SIGKILL: no goodbye to the cluster, no state written on the way out."""
        assert self.service is not None
        self.service.proc.kill()
        self.service.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    def status(self) -> dict:
        resp = httpx.get(f"{self.url}/api/v2/status", timeout=5)
        resp.raise_for_status()
        return resp.json()["cluster"]

    def alerts(self, **labels: str) -> list[dict]:
        resp = httpx.get(f"{self.url}/api/v2/alerts", params={"active": "true", "silenced": "true", "inhibited": "true"}, timeout=5)
        resp.raise_for_status()
        return [a for a in resp.json() if all(a["labels"].get(k) == v for k, v in labels.items())]


def pages_for(webhook: WebhookSink, node: str) -> list[dict]:
    """Firing notifications (one per webhook call) whose alerts include this node's XID."""
    return [
        payload for _, payload in webhook.notifications("/page/gpu-platform")
        if any(a.get("status") == "firing" and a["labels"].get("node") == node for a in payload.get("alerts", []))
    ]


@pytest.fixture
def cluster(tmp_path):
    with WebhookSink() as webhook:
        settings = alert_settings_for_tests(webhook.url, group_wait=f"{GROUP_WAIT_S}s")
        doc = alertmanager_document(settings)
        a, b = ClusterMember("am-a", doc, tmp_path), ClusterMember("am-b", doc, tmp_path)
        a.peers, b.peers = [b], [a]
        try:
            a.start()
            b.start()
            wait_for(lambda: all(len(m.status()["peers"]) == 2 and m.status()["status"] == "ready" for m in (a, b)),
                     60, what="the two Alertmanagers to see each other and settle")
            yield settings, webhook, a, b
        finally:
            a.stop()
            b.stop()


@pytest.mark.services
@pytest.mark.timeout(240)
def test_two_clustered_alertmanagers_page_once_also_with_one_down_and_after_it_returns(cluster, tmp_path):
    settings, webhook, a, b = cluster
    pusher = AlertPusher([a.url, b.url], tmp_path / "outbox.sqlite", settings)
    try:
        # -- both up: every peer gets the alert, the cluster pages once -------------------------
        pusher.on_tick(tick([xid("node-1")]), None)
        assert pusher.flush() == 2 and pusher.pending() == 0  # one alert, accepted by each of two peers
        # Alertmanager does not gossip alerts (only silences and the notification log): each peer
        # holding it proves the pusher sent it to each.
        assert len(a.alerts(node="node-1")) == 1 and len(b.alerts(node="node-1")) == 1
        wait_for(lambda: pages_for(webhook, "node-1"), 30, what="the page for node-1")
        time.sleep(DUPLICATE_WINDOW_S)  # time enough for the second peer's notification, were it not deduplicated
        assert len(pages_for(webhook, "node-1")) == 1

        # -- peer A killed: the page goes through B, once; A's copy waits in the outbox --------
        a.kill()
        pusher.on_tick(tick([xid("node-1"), xid("node-2")]), None)  # node-1 is within resend_seconds: not re-sent
        assert pusher.flush() == 1  # B accepted node-2; A refused the connection
        peer_a, peer_b = pusher.peers
        assert (pusher.pending_for(peer_a), pusher.pending_for(peer_b), pusher.pending()) == (1, 0, 1)
        assert peer_a.failures_in_a_row == 1 and peer_b.failures_in_a_row == 0 and pusher.backoff_seconds > 0
        wait_for(lambda: pages_for(webhook, "node-2"), 60, what="the page for node-2 with one Alertmanager down")
        time.sleep(DUPLICATE_WINDOW_S)
        assert len(pages_for(webhook, "node-2")) == 1
        assert pusher.flush() == 0  # A is backing off; B has nothing left to take

        # -- A back (same storage, rejoins the cluster): the backlog reaches it, no second page --
        a.start()
        wait_for(lambda: len(a.status()["peers"]) == 2 and a.status()["status"] == "ready", 60, what="A to rejoin and settle")
        assert pusher.flush(force=True) == 1 and pusher.pending() == 0
        assert len(a.alerts(node="node-2")) == 1
        time.sleep(DUPLICATE_WINDOW_S)
        assert len(pages_for(webhook, "node-2")) == 1
        assert len(pages_for(webhook, "node-1")) == 1
    finally:
        pusher.close()


@pytest.mark.services
@pytest.mark.timeout(120)
def test_control_two_alertmanagers_not_clustered_page_twice(tmp_path):
    """The control for the test above: the same pusher and peers without gossip between them page
    twice, so the single page there is the cluster's deduplication, not a quirk of the setup."""
    with WebhookSink() as webhook:
        settings = alert_settings_for_tests(webhook.url, group_wait=f"{GROUP_WAIT_S}s")
        doc = alertmanager_document(settings)
        a, b = ClusterMember("solo-a", doc, tmp_path), ClusterMember("solo-b", doc, tmp_path)  # no --cluster.peer
        pusher = None
        try:
            a.start()
            b.start()
            pusher = AlertPusher([a.url, b.url], tmp_path / "outbox.sqlite", settings)
            pusher.on_tick(tick([xid("node-1")]), None)
            assert pusher.flush() == 2
            wait_for(lambda: len(pages_for(webhook, "node-1")) >= 2, 30, what="a page from each lone Alertmanager")
        finally:
            if pusher is not None:
                pusher.close()
            a.stop()
            b.stop()


def test_alertmanagers_config_is_validated_whole():
    ok = load_settings(config.load(overrides={"alerts": {"alertmanagers": ["http://am-0:9093", "https://am-1.example:9093/"]}}))
    assert ok.alertmanagers == ["http://am-0:9093", "https://am-1.example:9093/"]
    assert load_settings().alertmanagers == []
    for bad, why in ((["am-0:9093"], "not an http"), (["http://"], "not an http"), (["http://a:1", "http://a:1/"], "listed twice")):
        with pytest.raises(config.ConfigError, match=why):
            load_settings(config.load(overrides={"alerts": {"alertmanagers": bad}}))
    with pytest.raises(config.ConfigError):
        load_settings(config.load(overrides={"alerts": {"alertmanager": "http://a:1"}}))  # unknown key: an error, not ignored
    assert peer_urls("http://a:9093/") == ["http://a:9093"]  # the single-URL form
    with pytest.raises(UserError):
        peer_urls([])


def test_a_peer_that_is_down_does_not_hold_back_the_other(tmp_path):
    """Delivery to a live peer (a local HTTP server standing in for Alertmanager's API) proceeds
    while the other peer refuses connections; the delivery loop runs one thread per peer."""
    with WebhookSink() as live:
        settings = alert_settings_for_tests(live.url)
        dead = f"http://127.0.0.1:{free_port()}"
        pusher = AlertPusher([dead, live.url], tmp_path / "outbox.sqlite", settings)
        loop = DeliveryLoop(pusher, interval=0.05).start()
        try:
            pusher.on_tick(tick([xid("node-1"), xid("node-2")]), None)
            wait_for(lambda: pusher.pending_for(pusher.peers[1]) == 0, 30, what="delivery to the live peer")
            posted = [a["labels"]["node"] for path, body in live.notifications("/api/v2/alerts") for a in body]
            assert sorted(posted) == ["node-1", "node-2"]
            assert pusher.pending_for(pusher.peers[0]) == 2 and pusher.pending() == 2  # kept for the dead peer
            assert pusher.peers[0].failures_total >= 1 and pusher.peers[1].failures_total == 0
        finally:
            loop.stop(final_flush=False)
            pusher.close()
        # Restarted with the dead peer dropped from the config: nothing is left to deliver.
        again = AlertPusher([live.url], tmp_path / "outbox.sqlite", settings)
        assert again.pending() == 0
        again.close()


def test_a_peer_that_hangs_does_not_delay_the_other(tmp_path):
    """A peer that accepts connections and never answers holds its own delivery thread until the
    HTTP timeout (120 s here); the other peer's thread delivers meanwhile. Were the peers served
    one after the other, the live peer would wait out that timeout and the wait below would fail."""
    import socket

    hanging = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hanging.bind(("127.0.0.1", 0))
    hanging.listen(8)  # connections complete in the backlog; nothing ever reads them
    with WebhookSink() as live:
        settings = alert_settings_for_tests(live.url)
        pusher = AlertPusher([f"http://127.0.0.1:{hanging.getsockname()[1]}", live.url], tmp_path / "outbox.sqlite", settings,
                             timeout_seconds=120)
        loop = DeliveryLoop(pusher, interval=0.05).start()
        try:
            pusher.on_tick(tick([xid("node-1")]), None)
            wait_for(lambda: pusher.pending_for(pusher.peers[1]) == 0, 60, what="delivery to the live peer while the other hangs")
            assert [a["labels"]["node"] for _, body in live.notifications("/api/v2/alerts") for a in body] == ["node-1"]
            assert pusher.pending_for(pusher.peers[0]) == 1
        finally:
            hanging.close()  # resets the queued connection: the hung request fails and its thread ends
            loop.stop(final_flush=False)
            pusher.close()


def test_an_outbox_written_before_peers_is_delivered_to_every_peer(tmp_path):
    """Schema version 1 (one Alertmanager, no `delivered` table): its queued rows survive the
    migration and are due for every configured peer."""
    path = tmp_path / "outbox.sqlite"
    alert = {"labels": {"alertname": "GpuvigilXid", "node": "node-7"}, "annotations": {}}
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA)
        db.execute("INSERT INTO outbox (fingerprint, status, alert_json, enqueued_at) VALUES ('fp', 'firing', ?, 0)", (json.dumps(alert),))
        db.execute("PRAGMA user_version = 1")
    with WebhookSink() as one, WebhookSink() as two:
        pusher = AlertPusher([one.url, two.url], path, alert_settings_for_tests(one.url))
        assert pusher.pending() == 1
        assert pusher.flush() == 2 and pusher.pending() == 0
        for sink in (one, two):
            assert [a["labels"]["node"] for _, body in sink.notifications("/api/v2/alerts") for a in body] == ["node-7"]
        pusher.close()


def _serve(*argv: str):
    from gpuvigil.cli.main import build_parser
    from gpuvigil.app.serve import Server

    full = ["serve", "--port", "0", *argv]
    server = Server(build_parser(full).parse_args(full))
    server.start()
    return server


def test_serve_pushes_to_every_peer_of_the_config_and_the_flag_overrides_it(tmp_path):
    """`gpuvigil serve` takes its Alertmanager peers from `alerts.alertmanagers`; repeated
    `--alertmanager` flags replace them. Peers here are local HTTP servers standing in for
    Alertmanager's API (they accept every POST and record it)."""
    import threading

    with WebhookSink() as one, WebhookSink() as two, WebhookSink() as three:
        cfg = tmp_path / "gpuvigil.yaml"
        cfg.write_text(yaml.safe_dump({"alerts": {"alertmanagers": [one.url, two.url]}}))
        server = _serve("--config", str(cfg), "--scenario", "node_xid79", "--speed", "1000", "--outbox", str(tmp_path / "o.sqlite"))
        try:
            assert [p.base for p in server.pusher.peers] == [one.url, two.url]
            server.args.duration = 60
            thread = threading.Thread(target=server.loop, daemon=True)
            thread.start()

            def xid_posted(sink: WebhookSink) -> bool:
                return any(a["labels"].get("kind") == "xid" for _, body in sink.notifications("/api/v2/alerts") for a in body)

            wait_for(lambda: xid_posted(one) and xid_posted(two), 60, what="the XID alert posted to both peers")
        finally:
            server.stop()
            server.close()
        overridden = _serve("--config", str(cfg), "--alertmanager", three.url, "--alertmanager", f"{one.url}/",
                            "--outbox", str(tmp_path / "o2.sqlite"))
        try:
            assert [p.base for p in overridden.pusher.peers] == [three.url, one.url]
        finally:
            overridden.close()
