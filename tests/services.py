"""Real Prometheus and Alertmanager for tests, on free loopback ports, in temporary folders.

`prometheus_server(...)` and `alertmanager_server(...)` start the Debian binaries (skipping the
test with a clear reason when the binary is missing), wait until `/-/ready`, and stop them
(SIGTERM, then SIGKILL) on exit. `WebhookSink` is a local HTTP server that records every
notification Alertmanager sends to it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.ports import free_port  # noqa: F401 - re-exported for the tests

PROMETHEUS = "prometheus"
ALERTMANAGER_CANDIDATES = ("prometheus-alertmanager", "alertmanager")
PROMTOOL = "promtool"
AMTOOL = "amtool"


def binary(name: str, *alternatives: str) -> str:
    """Path of a server binary, or skip the test saying which package provides it."""
    for candidate in (name, *alternatives):
        path = shutil.which(candidate)
        if path:
            return path
    package = {"prometheus": "prometheus", "promtool": "prometheus", "amtool": "prometheus-alertmanager"}.get(name, "prometheus-alertmanager")
    pytest.skip(f"{name} not installed (Debian package {package}; `make system-deps` installs it)")


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} was ready:\n{tail}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s ({last})")


@dataclass
class Service:
    proc: subprocess.Popen
    url: str
    port: int
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_prometheus(config: dict[str, Any], workdir: Path, port: int | None = None, extra_files: dict[str, str] | None = None) -> Service:
    exe = binary(PROMETHEUS)
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in (extra_files or {}).items():
        (workdir / name).write_text(text)
    cfg = workdir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / "prometheus.log"
    proc = subprocess.Popen(
        [exe, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=workdir,
    )
    service = Service(proc, f"http://127.0.0.1:{port}", port, log)
    try:
        wait_ready(f"{service.url}/-/ready", proc, log=log)
    except BaseException:
        service.stop()
        raise
    return service


def start_alertmanager(config: dict[str, Any], workdir: Path, port: int | None = None) -> Service:
    exe = binary(ALERTMANAGER_CANDIDATES[0], *ALERTMANAGER_CANDIDATES[1:])
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / f"alertmanager-{port}.log"
    proc = subprocess.Popen(
        # --cluster.listen-address= turns gossip off: one instance, nothing bound beyond loopback.
        [exe, f"--config.file={cfg}", f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", "--log.level=warn"],
        stdout=log.open("a"), stderr=subprocess.STDOUT, cwd=workdir,
    )
    service = Service(proc, f"http://127.0.0.1:{port}", port, log)
    try:
        wait_ready(f"{service.url}/-/ready", proc, log=log)
    except BaseException:
        service.stop()
        raise
    return service


@contextlib.contextmanager
def prometheus_server(config: dict[str, Any], workdir: Path, **kw: Any) -> Iterator[Service]:
    service = start_prometheus(config, workdir, **kw)
    try:
        yield service
    finally:
        service.stop()


@contextlib.contextmanager
def alertmanager_server(config: dict[str, Any], workdir: Path, **kw: Any) -> Iterator[Service]:
    service = start_alertmanager(config, workdir, **kw)
    try:
        yield service
    finally:
        service.stop()


class WebhookSink:
    """Records Alertmanager webhook notifications: `received` is a list of (path, payload)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                try:
                    payload = json.loads(body)
                except json.JSONDecodeError:
                    payload = {"unparsed": body.decode(errors="replace")}
                with sink._lock:
                    sink.received.append((self.path, payload))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

            def handle(self) -> None:
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):  # the client went away: fine
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def notifications(self, path_prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return [(p, d) for p, d in self.received if p.startswith(path_prefix)]


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class StaticPage:
    """Serves a fixed page (e.g. a dcgm-exporter scrape) on a free loopback port: `.target` for
    Prometheus, `.url` for gpuvigil's DCGM collector."""

    def __init__(self, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):  # the scraper went away: fine
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.target}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
