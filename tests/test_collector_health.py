"""Collector failures are loud: per-target health, a warning, up=0 on /metrics, a
`collector_down` finding routed like any alert, and recovery. And DCGM endpoints are scraped
concurrently: a dead one does not stall the others.

Real HTTP servers on loopback: one serves dcgm-exporter's text (tests/data/dcgm/
node07_constructed.prom: dcgm-exporter's field list and labels with the real H200's values; see
tests/data/public/README.md), one accepts connections and never answers."""

from __future__ import annotations

import http.server
import logging
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpuvigil import config
from gpuvigil.app import runtime
from gpuvigil.alerts.pusher import AlertPusher
from gpuvigil.alerts.settings import load_settings
from gpuvigil.collectors.dcgm import DcgmCollector
from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.exporter.prometheus import exposition
from gpuvigil.model import FindingKind, Severity
from gpuvigil.pipeline.core import Pipeline
from gpuvigil.scheduler.core import NodeSpec

SCRAPE = Path(__file__).parent / "data" / "dcgm" / "node07_constructed.prom"
ALERTS = Path(__file__).resolve().parents[1] / "alerts"


class SilentServer:
    """Accepts TCP connections, reads the requests and never answers (a hung exporter)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        self.conns: list[socket.socket] = []
        self.requests = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            conn.settimeout(5)
            try:
                if conn.recv(65536):
                    self.requests += 1
            except OSError:
                pass
            conn.setblocking(False)
            self.conns.append(conn)

    def holding_an_open_request(self, patience_seconds: float = 0.5) -> bool:
        """True while a client still waits on one of our connections (it has not given up).

        The accept loop runs on its own thread and may not have picked the connection up yet on
        a loaded machine, so look again for a short while before answering no."""
        deadline = time.monotonic() + patience_seconds
        while True:
            for conn in list(self.conns):
                try:
                    if conn.recv(1, socket.MSG_PEEK) == b"":
                        continue  # the client closed it
                except BlockingIOError:
                    return True
                except OSError:
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)
        for c in self.conns:
            c.close()
        self.sock.close()


class Exporter:
    """A real HTTP server serving the scrape; `on_request` runs inside each request."""

    def __init__(self, port: int = 0, on_request=None) -> None:
        body = SCRAPE.read_bytes()
        owner = self
        self.on_request = on_request
        self.seen: list[object] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if owner.on_request is not None:
                    owner.seen.append(owner.on_request())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_dead_endpoint_does_not_stall_the_others():
    dead = SilentServer()
    good = Exporter(on_request=dead.holding_an_open_request)
    col = DcgmCollector([dead.url, good.url], timeout_seconds=1.0)
    try:
        out = col.collect(100.0)
        # the live node's GPUs arrived, and it was asked while the dead one was still pending:
        # the scrapes run side by side, not one after the other
        assert out["gpu_samples"].height == 2
        assert good.seen == [True] and dead.requests == 1
        health = col.health()
        assert health[good.url] is None
        assert health[dead.url] == "no complete answer within 1 s"
        assert col.errors == 1 and col.name == "dcgm"
        # the next tick scrapes both again through the same client
        out = col.collect(101.0)
        assert out["gpu_samples"].height == 2 and dead.requests == 2 and col.errors == 2
    finally:
        col.close()
        good.stop()
        dead.stop()


def test_collector_down_is_loud_and_recovers(caplog):
    exporter = Exporter()
    port = exporter.port
    cfg = config.load(overrides={"pipeline": {"collector_down_after_failures": 2}})
    col = DcgmCollector(exporter.url, timeout_seconds=1.0)
    rt = runtime.build_real([col], [NodeSpec("node07", n_gpus=2)], cfg=cfg, now=0.0)
    snap = Snapshot(rt, TickStats())
    key = f'gpuvigil_collector_up{{collector="{col.name}",target="{exporter.url}"}}'
    try:
        with caplog.at_level(logging.WARNING, logger="gpuvigil"):
            rt.step()
            assert f"{key} 1.0" in exposition(snap).decode()
            exporter.stop()
            r1 = rt.step()  # one failure: not down yet
            assert not [f for f in r1.new_findings if f.kind == FindingKind.COLLECTOR_DOWN]
            assert not caplog.records
            r2 = rt.step()
        down = [f for f in r2.new_findings if f.kind == FindingKind.COLLECTOR_DOWN]
        assert len(down) == 1 and down[0].severity == Severity.TICKET
        assert down[0].evidence["target"] == exporter.url and "ConnectError" in down[0].evidence["reason"]
        warning = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warning) == 1 and exporter.url in warning[0].getMessage() and "ConnectError" in warning[0].getMessage()
        text = exposition(snap).decode()
        assert f"{key} 0.0" in text
        # still down: the same finding stays active, no second warning
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpuvigil"):
            r3 = rt.step()
            assert [f.id for f in r3.active_findings if f.kind == FindingKind.COLLECTOR_DOWN] == [down[0].id]
            assert not r3.new_findings and not [r for r in caplog.records if r.levelno >= logging.WARNING]
            # the exporter comes back on the same port: recovery is logged and the finding cleared
            back = Exporter(port=port)
            try:
                r4 = rt.step()
            finally:
                back.stop()
        assert [f.id for f in r4.cleared_findings] == [down[0].id]
        assert any("recovered" in r.getMessage() and exporter.url in r.getMessage() for r in caplog.records)
        assert f"{key} 1.0" in exposition(snap).decode()
    finally:
        col.close()


def test_collector_down_alert_is_routed_to_the_platform_ticket_receiver(tmp_path):
    import shutil

    settings = load_settings()
    from gpuvigil.pipeline.health import CollectorHealth, collector_down_finding

    h = CollectorHealth("dcgm", "http://n7:9400/metrics", up=False, consecutive_failures=3, reason="ConnectError: refused", down_since=5.0)
    f = collector_down_finding(h, 5.0, 3)
    other = collector_down_finding(CollectorHealth("dcgm", "http://n8:9400/metrics", up=False, reason="x"), 5.0, 3)
    assert f.id != other.id  # one finding (and alert) per target
    pusher = AlertPusher("http://127.0.0.1:9", tmp_path / "outbox.sqlite", settings)
    try:
        labels = pusher.alert_for(f, {}, starts_at=5.0, ends_at=300.0)["labels"]
    finally:
        pusher.close()
    assert labels["alertname"] == "GpuvigilCollectorDown" and labels["severity"] == "ticket"
    assert (labels["team"], labels["collector"], labels["target"]) == (settings.default_team, "dcgm", "http://n7:9400/metrics")
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool not installed (Debian package prometheus-alertmanager)")
    proc = subprocess.run(
        [amtool, "config", "routes", "test", "--config.file=alertmanager.yml", *(f"{k}={v}" for k, v in labels.items())],
        cwd=ALERTS, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{settings.default_team}-ticket"


class Broken:
    name = "broken"
    streams: dict = {}
    errors = 0

    def collect(self, now):
        raise RuntimeError("driver went away")


class Steady:
    name = "steady"
    errors = 0

    def __init__(self):
        import polars as pl

        from gpuvigil import schemas

        self.streams = {"events": schemas.EVENTS}
        self.frame = pl.DataFrame({"ts": [0.0], "source": ["sim"], "kind": ["x"]}).pipe(schemas.conform, schemas.EVENTS)

    def collect(self, now):
        return {"events": self.frame.with_columns(ts=now)}


def test_a_collector_that_raises_does_not_stop_the_tick(caplog):
    cfg = config.load(overrides={"pipeline": {"collector_down_after_failures": 3}})
    broken, steady = Broken(), Steady()
    pipe = Pipeline([broken, steady], [], cfg=cfg)
    with caplog.at_level(logging.WARNING, logger="gpuvigil"):
        results = [pipe.tick(float(t)) for t in range(1, 5)]
    assert all(r.samples_ingested == 1 for r in results)  # the other collector kept working
    assert broken.errors == 4 and results[-1].collector_errors == {"broken": 4, "steady": 0}
    down = [f for r in results for f in r.new_findings if f.kind == FindingKind.COLLECTOR_DOWN]
    assert len(down) == 1 and down[0].ts == 3.0
    assert down[0].evidence["reason"] == "collect raised RuntimeError: driver went away"
    assert [r.getMessage() for r in caplog.records] == [
        "collector broken is down after 3 failed collects in a row: collect raised RuntimeError: driver went away"
    ]
    rows = {(h.collector, h.target): h.up for h in pipe.health.rows()}
    assert rows == {("broken", "broken"): False, ("steady", "steady"): True}


def test_a_collector_keeping_its_own_up_flag_is_believed():
    class Flaky:
        name, errors, streams = "hook", 0, {}
        up, last_error = True, None

        def collect(self, now):
            return {}

    flaky = Flaky()
    pipe = Pipeline([flaky], [], cfg=config.load(overrides={"pipeline": {"collector_down_after_failures": 2}}))
    pipe.tick(1.0)
    flaky.up, flaky.last_error = False, "receiver port in use"
    assert not pipe.tick(2.0).new_findings
    down = pipe.tick(3.0).new_findings
    assert [f.evidence["reason"] for f in down] == ["receiver port in use"]
    flaky.up = True
    assert [f.id for f in pipe.tick(4.0).cleared_findings] == [down[0].id]
