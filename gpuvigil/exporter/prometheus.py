"""Prometheus exposition of the runtime snapshot: a prometheus_client custom collector that
computes every family at scrape time (nothing is copied into client-side metric objects)."""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from gpuvigil.exporter.metrics import Family, Snapshot


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
    """The text exposition of one scrape (used by tests and `gpuvigil serve`)."""
    return generate_latest(registry_for(snapshot))


def serve_metrics(snapshot: Snapshot, port: int, host: str = "127.0.0.1") -> tuple[WSGIServer, object]:
    """Start prometheus_client's threaded HTTP server for /metrics; returns (server, thread)."""
    return start_http_server(port, addr=host, registry=registry_for(snapshot))
