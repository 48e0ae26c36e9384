"""Prometheus exporter: scrape-time families from a real Pipeline + Scheduler, linted by the real
`promtool check metrics`, values checked against the frames the collector emitted."""

from __future__ import annotations

import subprocess
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.exporter.prometheus import exposition, serve_metrics
from gpuvigil.model import Finding, FindingKind, Severity
from obs_helpers import GIB, tiny_runtime
from services import PROMTOOL, binary


def scrape(ticks: int = 5, **kw):
    stats = TickStats()
    rt = tiny_runtime(sinks=[stats], **kw)
    for _ in range(ticks):
        rt.step()
    snap = Snapshot(rt, stats, team_of_tenant=lambda t: {"research": "ml-research"}.get(t, "gpu-platform"))
    return rt, snap, exposition(snap).decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset({k: str(v) for k, v in labels.items()}.items()))]


@pytest.fixture(scope="module")
def tiny():
    return scrape()


@pytest.mark.parametrize(
    "name, labels, expected",
    [
        ("gpuvigil_gpu_memory_used_bytes", {"node": "node-a", "gpu": 1}, 41 * GIB),
        ("gpuvigil_gpu_memory_total_bytes", {"node": "node-b", "gpu": 0}, 141 * GIB),
        ("gpuvigil_gpu_power_watts", {"node": "node-a", "gpu": 1}, 651.0),
        ("gpuvigil_gpu_temperature_celsius", {"node": "node-b", "gpu": 1}, 71.0),
        ("gpuvigil_gpu_utilization_ratio", {"node": "node-a", "gpu": 0}, 0.9),
        ("gpuvigil_gpu_sm_clock_hertz", {"node": "node-a", "gpu": 0}, 1980e6),
        ("gpuvigil_gpu_clock_throttled", {"node": "node-b", "gpu": 1, "reason": "hw_thermal_slowdown"}, 1.0),
        ("gpuvigil_gpu_clock_throttled", {"node": "node-a", "gpu": 0, "reason": "hw_thermal_slowdown"}, 0.0),
        ("gpuvigil_gpu_ecc_dbe_errors_total", {"node": "node-b", "gpu": 1}, 1.0),
        ("gpuvigil_gpu_xid_errors_total", {"node": "node-b", "gpu": 1}, 1.0),
        ("gpuvigil_gpu_last_xid", {"node": "node-b", "gpu": 1}, 79.0),
        ("gpuvigil_gpu_last_xid", {"node": "node-a", "gpu": 0}, 0.0),
        ("gpuvigil_gpu_last_xid_fatal", {"node": "node-b", "gpu": 1}, 1.0),
        ("gpuvigil_gpu_last_xid_fatal", {"node": "node-a", "gpu": 1}, 0.0),
        ("gpuvigil_rank_step_time_seconds", {"job": "train", "rank": 2}, 1.2),
        ("gpuvigil_rank_collective_pending", {"job": "train", "rank": 0}, 1.0),
        ("gpuvigil_rank_collective_completed_seq", {"job": "train", "rank": 1}, 20.0),
        # capacity 141 GiB - max(peak 61 GiB, reserved 40 GiB) - foreign 0
        ("gpuvigil_rank_memory_headroom_bytes", {"job": "train", "rank": 1}, 80 * GIB),
        ("gpuvigil_job_memory_headroom_ratio", {"job": "train"}, (141 - 62) / 141),
        ("gpuvigil_job_predicted_oom_seconds", {"job": "train"}, 420.0),
        ("gpuvigil_job_info", {"job": "train", "tenant": "research", "team": "ml-research", "priority": "P0", "state": "running"}, 1.0),
        ("gpuvigil_findings_total", {"kind": "xid", "severity": "page"}, 1.0),
        ("gpuvigil_findings_total", {"kind": "oom_predicted", "severity": "ticket"}, 1.0),
        ("gpuvigil_findings_total", {"kind": "straggler", "severity": "page"}, 0.0),
        ("gpuvigil_findings_active", {"kind": "xid", "severity": "page"}, 1.0),
        ("gpuvigil_node_findings_active", {"node": "node-b", "kind": "xid", "severity": "page"}, 1.0),
        ("gpuvigil_job_findings_active", {"job": "train", "kind": "oom_predicted", "severity": "ticket"}, 1.0),
        ("gpuvigil_node_state", {"node": "node-b", "state": "cordoned"}, 1.0),
        ("gpuvigil_node_state", {"node": "node-a", "state": "up"}, 1.0),
        ("gpuvigil_scheduler_gpus", {"state": "allocated"}, 3.0),
        ("gpuvigil_scheduler_gpus", {"state": "cordoned"}, 1.0),
        ("gpuvigil_scheduler_queue_jobs", {"priority": "P1", "tenant": "vision"}, 1.0),
        ("gpuvigil_scheduler_queue_oldest_wait_seconds", {"priority": "P1", "tenant": "vision"}, 5.0),
        ("gpuvigil_scheduler_queue_wait_seconds_count", {"priority": "P0", "tenant": "research"}, 1.0),
        ("gpuvigil_pipeline_ticks_total", {}, 5.0),
        ("gpuvigil_pipeline_tick_duration_seconds_count", {}, 5.0),
        ("gpuvigil_detector_duration_seconds_count", {"detector": "fixed"}, 5.0),
        ("gpuvigil_collector_errors_total", {"collector": "tiny"}, 0.0),
        ("gpuvigil_pipeline_time_seconds", {}, 5.0),
    ],
)
def test_values(tiny, name, labels, expected):
    _, _, text = tiny
    assert value(text, name, **labels) == pytest.approx(expected)


def test_promtool_check_metrics_reports_nothing(tiny):
    _, _, text = tiny
    proc = subprocess.run([binary(PROMTOOL), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_promtool_check_metrics_on_simulated_cluster():
    """The full simulator (all detectors, the real scheduler) scrapes lint-clean too."""
    from gpuvigil.app.runtime import build_simulated

    stats = TickStats()
    rt = build_simulated("node_xid79", sinks=[stats])
    rt.run(130)  # past the XID at t=100
    text = exposition(Snapshot(rt, stats)).decode()
    proc = subprocess.run([binary(PROMTOOL), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr
    s = samples(text)
    assert any(name == "gpuvigil_gpu_last_xid" and v == 79 for (name, _), v in s.items())
    assert value(text, "gpuvigil_findings_total", kind="xid", severity="page") >= 1


# Label names each family may carry: bounded by nodes × GPUs, jobs × ranks, or fixed enums.
ALLOWED_LABELS = {
    "gpuvigil_gpu_": {"node", "gpu", "reason", "gpu_uuid"},
    "gpuvigil_rank_": {"job", "rank", "node", "gpu", "pg"},
    "gpuvigil_job_": {"job", "kind", "severity", "tenant", "priority", "team", "state"},
    "gpuvigil_node_": {"node", "state", "kind", "severity", "rack"},
    "gpuvigil_findings": {"kind", "severity"},
    "gpuvigil_scheduler_": {"state", "priority", "tenant", "action", "le"},
    "gpuvigil_pipeline_": {"stream", "le"},
    "gpuvigil_detector_": {"detector", "le"},
    "gpuvigil_collector_": {"collector", "target"},  # target: a configured endpoint, device or file (bounded)
    "gpuvigil_build": {"version"},
    # per port of the node's HCAs (a handful), with its PCI address and GPUs on the _info series
    "gpuvigil_ib_": {"node", "device", "port", "link_layer", "pci_bus_id", "affinity", "gpus"},
}


def test_label_sets_are_bounded(tiny):
    _, _, text = tiny
    for fam in text_string_to_metric_families(text):
        prefix = next((p for p in ALLOWED_LABELS if fam.name.startswith(p)), None)
        assert prefix is not None, f"{fam.name}: no label policy"
        for s in fam.samples:
            assert set(s.labels) <= ALLOWED_LABELS[prefix], (fam.name, s.labels)
        # Only _info series carry placement details next to the job/rank key.
        if not fam.name.endswith("_info") and fam.name.startswith("gpuvigil_rank_"):
            assert all(set(s.labels) == {"job", "rank"} for s in fam.samples), fam.name


def test_units_and_counter_suffixes(tiny):
    _, _, text = tiny
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("gpuvigil_")
        assert not any(bad in fam.name for bad in ("_mhz", "_mb", "_gib", "_ms", "_percent", "_celsius_", "_w_")), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name


def test_finding_counted_once_per_cause_and_cleared_from_active():
    rt, snap, text = scrape(ticks=3)
    rt.detector.active = False
    clear = rt.pipeline._clear_after(rt.detector.findings[0])
    for _ in range(int(clear) + 2):
        rt.step()
    text = exposition(snap).decode()
    assert value(text, "gpuvigil_findings_total", kind="xid", severity="page") == 1
    assert value(text, "gpuvigil_findings_active", kind="oom_predicted", severity="ticket") == 0
    assert not any(name == "gpuvigil_job_predicted_oom_seconds" for name, _ in samples(text))


def test_rank_series_only_for_running_jobs():
    rt, snap, _ = scrape(ticks=2)
    rt.scheduler.job_completed("train", rt.now)
    text = exposition(snap).decode()
    assert not any(name.startswith("gpuvigil_rank_") for name, _ in samples(text))
    assert not any(name == "gpuvigil_job_info" and ("job", "train") in labels for name, labels in samples(text))


def test_time_to_oom_takes_the_soonest_prediction():
    findings = [
        Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.TICKET, ts=0, job="train", node="node-a", gpu=g,
                evidence={"time_to_oom_seconds": t}, summary="x")
        for g, t in ((0, 900.0), (1, 120.0))
    ]
    _, _, text = scrape(findings=findings)
    assert value(text, "gpuvigil_job_predicted_oom_seconds", job="train") == 120.0


def test_scrapes_while_ticking_share_the_lock():
    """Scrapes from several threads during ticks: every scrape is complete and consistent."""
    stats = TickStats()
    rt = tiny_runtime(sinks=[stats])
    snap = Snapshot(rt, stats)
    errors: list[BaseException] = []
    done = threading.Event()

    def ticker():
        try:
            for _ in range(40):
                with snap.lock:
                    rt.step()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def scraper():
        try:
            while not done.is_set():
                text = exposition(snap).decode()
                s = samples(text)
                ticks = s[("gpuvigil_pipeline_ticks_total", frozenset())]
                # Under the lock a scrape sees whole ticks: counters agree with each other.
                assert s[("gpuvigil_pipeline_tick_duration_seconds_count", frozenset())] == ticks
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ticker)] + [threading.Thread(target=scraper) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert rt.pipeline.ticks == 40


def test_http_endpoint_serves_the_exposition():
    stats = TickStats()
    rt = tiny_runtime(sinks=[stats])
    rt.step()
    server, thread = serve_metrics(Snapshot(rt, stats), 0)
    try:
        resp = httpx.get(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10)
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        assert value(resp.text, "gpuvigil_pipeline_ticks_total") == 1
    finally:
        server.shutdown()
        server.server_close()


def test_fast_exposition_is_byte_identical_to_prometheus_client_s():
    """/metrics writes the per-GPU series straight from the frame (gpuvigil_gpu_* are ~240k lines
    at 10k GPUs); it must be the exposition prometheus_client renders from the same families,
    with throttling, XIDs (fatal and not), ECC and a remap failure in it."""
    from gpuvigil.app import runtime as runtime_mod
    from gpuvigil.exporter.prometheus import fast_exposition

    stats = TickStats()
    rt = runtime_mod.build_simulated("node_xid79", nodes=6, seed=3, sinks=[stats])
    for _ in range(40):
        rt.step()
    snap = Snapshot(rt, stats)
    slow, fast = exposition(snap), fast_exposition(snap)
    assert fast == slow
    text = fast.decode()
    assert "gpuvigil_gpu_clock_throttled{" in text and "gpuvigil_gpu_info{" in text and "gpuvigil_gpu_last_xid_fatal{" in text
    assert text.count("gpuvigil_gpu_memory_used_bytes{") == 6 * 8


def test_metrics_endpoint_renders_once_per_tick():
    stats = TickStats()
    rt = tiny_runtime(sinks=[stats])
    rt.step()
    server, _thread = serve_metrics(Snapshot(rt, stats), 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        first = httpx.get(url, timeout=10)
        again = httpx.get(url, timeout=10, headers={"Accept-Encoding": "identity"})
        assert first.text == again.text and server.rendered.renders == 1
        assert first.headers.get("content-encoding") == "gzip"  # httpx asks for gzip and decodes it
        rt.step()
        assert value(httpx.get(url, timeout=10).text, "gpuvigil_pipeline_ticks_total") == 2
        assert server.rendered.renders == 2
    finally:
        server.shutdown()
        server.server_close()
