"""OpenTelemetry export of the same snapshot the Prometheus exporter serves.

Every gauge/counter/info family becomes an observable instrument of the same name (counters
without `_total`, which OTLP→Prometheus bridges add back); histogram families are recorded into
synchronous OTel histograms with the same buckets as they are observed. With an endpoint, an
OTLP/HTTP (protobuf) exporter pushes them every `interval_seconds`; tests pass their own reader.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

import gpuvigil
from gpuvigil.exporter.metrics import Family, HistogramAcc, Snapshot

# OTel/UCUM units by the base-unit suffix of the Prometheus name.
_UNITS = {"_bytes": "By", "_seconds": "s", "_watts": "W", "_celsius": "Cel", "_hertz": "Hz", "_ratio": "1"}


def unit_of(name: str) -> str:
    for suffix, unit in _UNITS.items():
        if name.endswith(suffix):
            return unit
    return "1"


def otel_name(fam: Family) -> str:
    return f"{fam.name}_info" if fam.type == "info" else fam.name


class OtelExporter:
    """Observable instruments over a `Snapshot`; `shutdown()` flushes and stops the readers."""

    def __init__(self, snapshot: Snapshot, readers: Sequence[MetricReader], *, service_name: str = "gpuvigil", cache_seconds: float = 0.5):
        self.snapshot = snapshot
        self._cache_seconds = cache_seconds
        self._cache: tuple[float, dict[str, Family]] | None = None
        self._cache_lock = threading.Lock()
        stats = snapshot.stats
        # Histograms are recorded as observed: attach them before the first snapshot so the
        # observations it folds in (e.g. placements so far) are recorded too.
        histograms: dict[str, tuple[HistogramAcc, str]] = {
            "gpuvigil_pipeline_tick_duration_seconds": (stats.tick_seconds, "Wall time of one pipeline tick."),
            "gpuvigil_detector_duration_seconds": (stats.detector_seconds, "Wall time of one detector run."),
            "gpuvigil_scheduler_queue_wait_seconds": (stats.waits, "Time jobs waited in the queue before being placed."),
        }
        views = [
            View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(boundaries=list(acc.buckets)))
            for name, (acc, _) in histograms.items()
        ]
        self.provider = MeterProvider(
            metric_readers=list(readers),
            resource=Resource.create({"service.name": service_name, "service.version": gpuvigil.__version__}),
            views=views,
        )
        meter = self.provider.get_meter("gpuvigil", gpuvigil.__version__)
        for name, (acc, help_text) in histograms.items():
            instrument = meter.create_histogram(name, unit=unit_of(name), description=help_text)
            acc.listeners.append(lambda value, labels, inst=instrument: inst.record(value, dict(labels)))
        self.instruments = []
        for fam in snapshot.families():
            if fam.type == "histogram":
                if fam.name not in histograms:
                    raise ValueError(f"histogram family {fam.name} has no OTel instrument")
                continue
            factory = meter.create_observable_counter if fam.type == "counter" else meter.create_observable_gauge
            self.instruments.append(factory(otel_name(fam), callbacks=[self._callback(fam.name)], unit=unit_of(fam.name), description=fam.help))

    def _current(self) -> dict[str, Family]:
        # One snapshot serves all instruments of a collection cycle.
        with self._cache_lock:
            now = time.monotonic()
            if self._cache is None or now - self._cache[0] > self._cache_seconds:
                self._cache = (now, {f.name: f for f in self.snapshot.families()})
            return self._cache[1]

    def _callback(self, name: str):
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            fam = self._current().get(name)
            if fam is None:
                return []
            return [Observation(value, dict(labels)) for labels, value in fam.samples]

        return observe

    def force_flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()


def otlp_exporter(snapshot: Snapshot, endpoint: str, *, interval_seconds: float = 15.0) -> OtelExporter:
    """Push to an OTLP/HTTP endpoint, e.g. http://collector:4318/v1/metrics."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    url = endpoint if endpoint.rstrip("/").endswith("/v1/metrics") else endpoint.rstrip("/") + "/v1/metrics"
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=url), export_interval_millis=int(interval_seconds * 1000))
    return OtelExporter(snapshot, [reader])
