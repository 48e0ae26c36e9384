"""Prometheus exposition of the runtime snapshot: a prometheus_client custom collector that
computes every family from the runtime (nothing is copied into client-side metric objects).

`serve_metrics` renders that exposition at most once per pipeline tick and answers every scrape
from the rendered bytes: at 10,000 GPUs one exposition is ~240,000 lines (about 2 s of CPU), so
rendering it per scrape would let scrapers decide how much CPU the exporter burns, and each
render takes the tick lock for the reads of mutable state. Between two ticks nothing a scrape
shows can change except gpuvigil's own counters (outbox, sources), which are as of the last tick.
"""

from __future__ import annotations

import gzip
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from gpuvigil.exporter.metrics import Family, Snapshot, gpu_exposition_text


def to_prometheus(fam: Family) -> Metric:
    label_names = sorted({k for labels, _ in fam.samples for k, _ in labels} | {k for labels, *_ in fam.histograms for k, _ in labels})
    if fam.type == "info":
        metric = InfoMetricFamily(fam.name, fam.help)
        for labels, _ in fam.samples:
            metric.add_metric([], dict(labels))
        return metric
    if fam.type == "histogram":
        metric = HistogramMetricFamily(fam.name, fam.help, labels=label_names)
        for labels, bounds, counts, total, count in fam.histograms:
            d = dict(labels)
            buckets = [(_le(b), c) for b, c in zip(bounds, counts, strict=True)] + [("+Inf", count)]
            metric.add_metric([d.get(n, "") for n in label_names], buckets, total)
        return metric
    cls = CounterMetricFamily if fam.type == "counter" else GaugeMetricFamily
    metric = cls(fam.name, fam.help, labels=label_names)
    for labels, value in fam.samples:
        d = dict(labels)
        metric.add_metric([d.get(n, "") for n in label_names], value)
    return metric


def _le(bound: float) -> str:
    return repr(float(bound))


class RuntimeCollector:
    """A prometheus_client collector over a `Snapshot`."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        for fam in self.snapshot.families():
            yield to_prometheus(fam)

    def describe(self) -> list[Metric]:
        # Empty: families depend on runtime state; registering must not trigger a scrape.
        return []


def registry_for(snapshot: Snapshot) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(snapshot))
    return registry


def exposition(snapshot: Snapshot) -> bytes:
    """The text exposition of one scrape, every family through prometheus_client."""
    return generate_latest(registry_for(snapshot))


class _Families:
    def __init__(self, families: list[Family]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for fam in self.families:
            yield to_prometheus(fam)


def _render(families: list[Family]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry)


def fast_exposition(snapshot: Snapshot) -> bytes:
    """The same bytes as `exposition`, with the per-GPU series (most of a large scrape) written
    straight from the latest-sample frame (`gpu_exposition_text`). What `/metrics` serves."""
    latest, rest = snapshot.parts()
    return _render(rest[:1]) + gpu_exposition_text(latest).encode() + _render(rest[1:])


class RenderedExposition:
    """The exposition of a snapshot, rendered at most once per pipeline tick (single flight:
    concurrent scrapes of a new tick wait for one render), plus its gzip form on demand."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot
        self._lock = threading.Lock()
        self._key: Any = None
        self._body = b""
        self._gzipped: bytes | None = None
        self.renders = 0

    def _tick(self) -> Any:
        # The tick counter is an int the tick loop replaces: reading it needs no lock.
        return getattr(getattr(self.snapshot.runtime, "pipeline", None), "ticks", None)

    def get(self, gzipped: bool = False) -> bytes:
        key = self._tick()
        with self._lock:
            if key is None or key != self._key or self.renders == 0:
                self._body = fast_exposition(self.snapshot)
                self._gzipped = None
                self._key = key
                self.renders += 1
            if not gzipped:
                return self._body
            if self._gzipped is None:
                self._gzipped = gzip.compress(self._body, compresslevel=1)
            return self._gzipped


def serve_metrics(snapshot: Snapshot, port: int, host: str = "127.0.0.1") -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve the exposition over HTTP on a daemon thread (any path, as prometheus_client's own
    server does); returns (server, thread). Each tick is rendered once (`RenderedExposition`)."""
    rendered = RenderedExposition(snapshot)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path == "/favicon.ico":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            use_gzip = "gzip" in self.headers.get("Accept-Encoding", "")
            body = rendered.get(gzipped=use_gzip)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            if use_gzip:
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Handler)
    server.rendered = rendered  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name=f"gpuvigil-metrics:{server.server_address[1]}", daemon=True)
    thread.start()
    return server, thread
