"""OpenTelemetry export: the same families as /metrics, read by an in-memory reader and pushed
over real OTLP/HTTP to a local receiver that decodes the protobuf request."""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.exporter.otel import OtelExporter, otlp_exporter, unit_of
from gpuvigil.exporter.prometheus import exposition
from obs_helpers import tiny_runtime


def _runtime(ticks: int = 4):
    stats = TickStats()
    rt = tiny_runtime(sinks=[stats])
    snap = Snapshot(rt, stats)
    return rt, snap, ticks


def _points(metrics_data) -> dict[tuple[str, frozenset], float]:
    out = {}
    for rm in metrics_data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if hasattr(p, "value"):
                        out[(m.name, frozenset((k, str(v)) for k, v in p.attributes.items()))] = p.value
                    else:
                        out[(m.name + "_count", frozenset((k, str(v)) for k, v in p.attributes.items()))] = p.count
    return out


def _prometheus_points(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_sum", "_created")):
                continue
            name = s.name[: -len("_total")] if s.name.endswith("_total") else s.name
            out[(name, frozenset(s.labels.items()))] = s.value
    return out


def test_in_memory_reader_sees_the_same_values_as_prometheus():
    rt, snap, ticks = _runtime()
    reader = InMemoryMetricReader()
    exporter = OtelExporter(snap, [reader])
    for _ in range(ticks):
        rt.step()
    otel = _points(reader.get_metrics_data())
    prom = _prometheus_points(exposition(snap).decode())
    # Every Prometheus sample (histograms by their count) has an OTel point of equal value.
    missing = {k for k in prom if k not in otel}
    assert not missing, sorted(missing)[:10]
    for key, v in prom.items():
        assert otel[key] == pytest.approx(v), key
    exporter.shutdown()


@pytest.mark.parametrize(
    "name, unit",
    [("gpuvigil_gpu_memory_used_bytes", "By"), ("gpuvigil_gpu_power_watts", "W"), ("gpuvigil_gpu_temperature_celsius", "Cel"),
     ("gpuvigil_gpu_utilization_ratio", "1"), ("gpuvigil_pipeline_tick_duration_seconds", "s"), ("gpuvigil_gpu_sm_clock_hertz", "Hz"),
     ("gpuvigil_findings", "1")],
)
def test_units(name, unit):
    assert unit_of(name) == unit


def test_instrument_kinds_follow_family_types():
    rt, snap, _ = _runtime()
    reader = InMemoryMetricReader()
    exporter = OtelExporter(snap, [reader])
    rt.step()
    kinds = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kinds[m.name] = type(m.data).__name__
    assert kinds["gpuvigil_findings"] == "Sum"  # counter → monotonic sum
    assert kinds["gpuvigil_gpu_power_watts"] == "Gauge"
    assert kinds["gpuvigil_pipeline_tick_duration_seconds"] == "Histogram"
    assert kinds["gpuvigil_build_info"] == "Gauge"
    exporter.shutdown()


class OtlpReceiver:
    """A minimal OTLP/HTTP metrics receiver: decodes each POST as ExportMetricsServiceRequest."""

    def __init__(self):
        self.requests: list[ExportMetricsServiceRequest] = []
        self.got = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                req = ExportMetricsServiceRequest()
                req.ParseFromString(body)
                receiver.requests.append((self.path, self.headers.get("Content-Type"), req))
                receiver.got.set()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(b"")

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_otlp_http_push_to_a_local_receiver():
    receiver = OtlpReceiver()
    try:
        rt, snap, ticks = _runtime()
        exporter = otlp_exporter(snap, receiver.url, interval_seconds=3600)
        for _ in range(ticks):
            rt.step()
        exporter.force_flush()  # one export now, not after the interval
        assert receiver.got.wait(30), "no OTLP request received"
        exporter.shutdown()
        path, content_type, req = receiver.requests[0]
        assert path == "/v1/metrics"
        assert content_type == "application/x-protobuf"
        resource = {kv.key: kv.value.string_value for kv in req.resource_metrics[0].resource.attributes}
        assert resource["service.name"] == "gpuvigil"
        metrics = {m.name: m for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        power = metrics["gpuvigil_gpu_power_watts"]
        assert power.unit == "W"
        by_gpu = {tuple(sorted((kv.key, kv.value.string_value) for kv in p.attributes)): p.as_double for p in power.gauge.data_points}
        assert by_gpu[(("gpu", "1"), ("node", "node-a"))] == 651.0
        findings = metrics["gpuvigil_findings"]
        assert findings.sum.is_monotonic
        xid = [p for p in findings.sum.data_points if {(kv.key, kv.value.string_value) for kv in p.attributes} == {("kind", "xid"), ("severity", "page")}]
        assert xid and xid[0].as_double == 1.0
        tick = metrics["gpuvigil_pipeline_tick_duration_seconds"].histogram.data_points[0]
        assert tick.count == ticks
    finally:
        receiver.close()
