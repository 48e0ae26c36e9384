"""`gpuvigil serve`: argument errors, the in-process server (metrics, feedback API, DCGM source),
and the real process: SIGTERM stops it cleanly with its alerts kept in the outbox."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.cli.main import build_parser, main
from gpuvigil.app.serve import Server
from services import StaticPage, free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
DCGM_PAGE = Path(__file__).parent / "data" / "obs" / "dcgm_node07.prom"


def metric_values(text: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "--port 70000"),
        (["--speed", "0"], "--speed 0"),
        (["--duration", "-1"], "--duration"),
        (["--source", "dcgm"], "--dcgm-url"),
        (["--api-port", "0"], "--api-token-file"),
        (["--alertmanager", "ftp://am"], "http(s)://"),
        (["--scenario", "no-such-scenario", "--port", "0"], "no-such-scenario"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def _server(*argv: str) -> Server:
    full = ["serve", "--port", "0", *argv]
    args = build_parser(full).parse_args(full)
    server = Server(args)
    server.start()
    return server


def _run_for(server: Server, seconds: float) -> None:
    server.args.duration = seconds
    server.loop()


def test_in_process_server_serves_metrics_and_the_feedback_api(tmp_path):
    server = _server("--scenario", "node_xid79", "--speed", "1000", "--api-port", "0", "--insecure-local",
                     "--hint-db", str(tmp_path / "hints.sqlite"))
    try:
        thread = threading.Thread(target=_run_for, args=(server, 60), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        # XID 79 at simulated t=100 (ticks run as fast as they can at this speed)
        text = wait_for(lambda: (t := httpx.get(url, timeout=10).text) and any(v >= 1 for _, v in metric_values(t, "gpuvigil_gpu_last_xid_fatal")) and t,
                        timeout=60, what="the XID 79 to show in /metrics")
        fatal = [labels for labels, v in metric_values(text, "gpuvigil_gpu_last_xid_fatal") if v == 1]
        assert fatal and all(labels["node"].startswith("node-") for labels in fatal)
        hints = wait_for(lambda: httpx.get(f"{server.api_server.url}/v1/hints", timeout=10).json()["hints"], timeout=30, what="hints in the API")
        assert any(h["action"] == "cordon_node" and h["node"] == fatal[0]["node"] for h in hints)
    finally:
        server.stop()
        thread.join(timeout=30)
        server.close()


def test_dcgm_source_exports_the_exporter_s_gpus():
    exporter = StaticPage(DCGM_PAGE.read_bytes())
    server = _server("--source", "dcgm", "--dcgm-url", exporter.url)
    try:
        _run_for(server, 1.5)
        text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
        power = {labels["gpu"]: v for labels, v in metric_values(text, "gpuvigil_gpu_power_watts")}
        assert power == {"0": pytest.approx(81.828), "1": pytest.approx(512.3)}
        nodes = {labels["node"] for labels, _ in metric_values(text, "gpuvigil_node_gpus")}
        assert nodes == {"gpu-node-07"}
    finally:
        server.stop()
        server.close()
        exporter.close()


def test_nvml_source_without_a_driver_is_an_error_never_the_simulator(capsys, tmp_path, monkeypatch):
    """An explicit source that cannot start exits non-zero naming it (no fallback)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML driver")
    except Exception:
        pass
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--source", "nvml", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "source nvml: cannot start" in err[0], err
    assert "simulat" not in err[0]


def test_sigterm_stops_serve_cleanly_and_keeps_undelivered_alerts(tmp_path):
    """Alertmanager unreachable: the page is queued; SIGTERM flushes (fails), exits 0, and the
    outbox on disk still holds it for the next start."""
    outbox = tmp_path / "outbox.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuvigil", "serve", "--scenario", "node_xid79", "--speed", "50", "--port", "0",
         "--alertmanager", f"http://127.0.0.1:{free_port()}", "--outbox", str(outbox), "--log-level", "warning"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith("gpuvigil serve: scenario node_xid79"), first + proc.stderr.read() if proc.poll() is not None else first
        url = first.split("metrics ", 1)[1].split(";")[0].strip()

        def xid_queued():
            text = httpx.get(url, timeout=10).text
            return metric_values(text, "gpuvigil_findings_total") and any(
                labels["kind"] == "xid" and v >= 1 for labels, v in metric_values(text, "gpuvigil_findings_total")
            ) and metric_values(text, "gpuvigil_alert_outbox_pending")[0][1] >= 1

        wait_for(xid_queued, timeout=60, what="the XID alert to be queued")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "alert(s) left in the outbox" in out
    with sqlite3.connect(outbox) as db:
        kinds = [r[0] for r in db.execute("SELECT json_extract(alert_json, '$.labels.kind') FROM outbox")]
    assert "xid" in kinds
    left = int(out.rsplit("stopped; ", 1)[1].split()[0])
    assert left == len(kinds)


def test_otlp_endpoint_receives_the_metrics():
    from test_otel import OtlpReceiver

    receiver = OtlpReceiver()
    server = _server("--scenario", "healthy", "--speed", "10", "--otlp-endpoint", receiver.url, "--otlp-interval", "0.5")
    try:
        _run_for(server, 2.0)
        assert receiver.got.wait(30)
    finally:
        server.stop()
        server.close()  # shuts the OTel provider down: a final export
        receiver.close()
    path, _, req = receiver.requests[-1]
    assert path == "/v1/metrics"
    names = {m.name for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"gpuvigil_gpu_power_watts", "gpuvigil_findings", "gpuvigil_scheduler_gpus", "gpuvigil_pipeline_tick_duration_seconds"} <= names
