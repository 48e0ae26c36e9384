"""`gpuvigil serve`'s log is one an on-call engineer can read: at INFO, one line per change of
state (a source up or down, a finding, an observation level, an action), never one per read.

`gpuvigil serve` runs as a process against a real HTTP endpoint on loopback serving a real
dcgm-exporter exposition (tests/data/public/corpus/dcgm_exporter_736_mixed.prom, from NVIDIA
dcgm-exporter pull request 736; see tests/data/public/README.md), scraped every second for a
minute; and against an endpoint where nothing listens."""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
EXPOSITION = REPO / "tests" / "data" / "public" / "corpus" / "dcgm_exporter_736_mixed.prom"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): (.*)$")
# What a line at INFO or above may say: each is one change of state.
STATE_CHANGES = [
    re.compile(r"^source \w+: .*: waiting for its first read$"),  # the start-up line per source
    re.compile(r"^source \w+: \S+ is up( after \d+ failed collects)?$"),
    re.compile(r"^source \w+: \S+ is down after \d+ failed collects in a row: .+$"),
    re.compile(r"^source \w+: \S+ is up again: recovered after .+$"),
    re.compile(r"^finding (page|ticket|info) \w+: .+$"),
    re.compile(r"^observation level: .+$"),
]


class Exporter:
    """A loopback HTTP server answering GET /metrics with the exposition; counts the scrapes."""

    def __init__(self, body: bytes) -> None:
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def unused_url() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


def serve(tmp_path: Path, url: str, seconds: float, level: str = "info", probe_after: float | None = None) -> tuple[list[str], str | None]:
    """Run `gpuvigil serve --source dcgm` for `seconds`; its log lines, and /metrics read
    `probe_after` seconds in."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuvigil", "serve", "--source", "dcgm", "--dcgm-url", url, "--port", "0", "--duration", str(seconds),
         "--log-level", level, "--outbox", str(tmp_path / "outbox.sqlite"), "--hint-db", str(tmp_path / "hints.sqlite")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=(tmp_path / "serve.log").open("w"), text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    metrics = None
    try:
        first = proc.stdout.readline()
        assert first.startswith("gpuvigil serve:"), first + (tmp_path / "serve.log").read_text()
        if probe_after is not None:
            time.sleep(probe_after)
            metrics = httpx.get(first.split("metrics ", 1)[1].split(";")[0].strip(), timeout=10).text
        proc.communicate(timeout=seconds + 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    return (tmp_path / "serve.log").read_text().splitlines(), metrics


def source_up(metrics: str) -> float:
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith('gpuvigil_source_up{source="dcgm"')]
    return value


@pytest.mark.timeout(300)
def test_a_minute_against_a_working_exporter_logs_only_changes_of_state(tmp_path):
    exporter = Exporter(EXPOSITION.read_bytes())
    try:
        lines, metrics = serve(tmp_path, exporter.url, 60, probe_after=10)
    finally:
        exporter.close()
    assert exporter.requests >= 50  # it was scraped about once a second (plus the start-up probe)
    parsed = [LOG_LINE.match(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if not m]
    # no per-request line of any library (httpx logged "HTTP Request: GET ... 200 OK" every second)
    assert not [m.group(0) for m in parsed if m.group(2).startswith(("httpx", "httpcore", "uvicorn"))]
    messages = [m.group(3) for m in parsed]
    assert [msg for msg in messages if not any(p.match(msg) for p in STATE_CHANGES)] == []
    assert len(messages) <= 12, messages  # bounded: it does not grow with the number of scrapes
    assert messages[0].startswith(f"source dcgm: {exporter.url}") and messages[0].endswith("waiting for its first read")
    assert messages.count(f"source dcgm: {exporter.url} is up") == 1
    assert not [msg for msg in messages if " is down " in msg]
    assert source_up(metrics) == 1.0


@pytest.mark.timeout(300)
def test_the_same_minute_at_debug_shows_the_per_request_lines(tmp_path):
    """The library lines held back at INFO are there at DEBUG: the quiet INFO log is the level's
    doing, not scrapes that did not happen."""
    exporter = Exporter(EXPOSITION.read_bytes())
    try:
        lines, _ = serve(tmp_path, exporter.url, 5, level="debug")
    finally:
        exporter.close()
    assert len([line for line in lines if "HTTP Request: GET " + exporter.url in line]) >= 3


@pytest.mark.timeout(300)
def test_an_unreachable_exporter_is_never_reported_up(tmp_path):
    url = unused_url()
    lines, metrics = serve(tmp_path, url, 8, probe_after=1)
    messages = [m.group(3) for m in map(LOG_LINE.match, lines) if m]
    assert not [msg for msg in messages if re.search(r"(\bis up\b|: up$)", msg)], messages
    down = [msg for msg in messages if " is down " in msg]
    assert len(down) == 1 and down[0].startswith(f"source dcgm: {url} is down after 3 failed collects") and "ConnectError" in down[0]
    assert messages[0] == f"source dcgm: {url} (dcgm-exporter scrapes, concurrent): waiting for its first read"
    assert source_up(metrics) == 0.0  # never read: not up, even before it counts as down
