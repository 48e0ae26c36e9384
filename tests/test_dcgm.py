"""dcgm-exporter scrapes → gpu_samples / gpu_workloads / events.

The scrape file is constructed (tests/data/public/README.md says how): dcgm-exporter's default
counters and label set, GPU 0 with the real H200's readings, GPU 1 a failing GPU. The collector
is tested against a real HTTP server on 127.0.0.1 (http.server in a thread), started and stopped
by the fixture.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
from h_logs_helpers import DATA, check_golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.collectors import dcgm
from gpuvigil.offline.analyze import scrape_findings
from gpuvigil.errors import UserError
from gpuvigil.model import FindingKind, Severity

SCRAPE = DATA / "dcgm" / "node07_constructed.prom"
MIB = 1 << 20
TS = 1796000000.0


def test_scrape_maps_onto_gpu_samples():
    samples, workloads, extra = dcgm.read_scrape(SCRAPE, ts=TS)
    assert samples.schema == schemas.GPU_SAMPLES and workloads.schema == dcgm.GPU_WORKLOADS and extra.schema == dcgm.DCGM_EXTRA
    g0, g1 = samples.sort("gpu").to_dicts()
    expected = {
        "ts": TS,
        "node": "gpu-node-07",
        "gpu": 0,
        "gpu_uuid": "GPU-34d3dfff-b746-63b5-0224-9f470d7475f1",
        "memory_used_bytes": 22 * MIB,
        "memory_total_bytes": (22 + 143137 + 615) * MIB,  # FB_USED + FB_FREE + FB_RESERVED
        "util_ratio": 0.0,
        "mem_util_ratio": 0.0,
        "power_w": 81.828,
        "temperature_c": 35.0,
        "sm_clock_mhz": 1980.0,
        "mem_clock_mhz": 3201.0,
        "throttle_reasons": 0,
        "ecc_sbe_volatile_total": 0,
        "ecc_dbe_volatile_total": 0,
        "retired_pages_total": 0,
        "remap_failure": False,
        "pcie_replay_total": 0,
        "xid_total": None,
        "last_xid": None,  # 0 means no XID since the exporter started
        "ecc_sbe_aggregate_total": None,  # not in the default counters
        "ecc_dbe_aggregate_total": None,
        "memory_reserved_bytes": 615 * MIB,  # FB_RESERVED: total usable by processes = total − this
    }
    assert {k: g0[k] for k in expected} == expected
    assert all(g0[k] is None for k in set(g0) - set(expected))  # columns added to the schema later
    assert (g1["util_ratio"], g1["mem_util_ratio"]) == pytest.approx((0.97, 0.41))
    assert (g1["last_xid"], g1["ecc_dbe_volatile_total"], g1["retired_pages_total"], g1["throttle_reasons"]) == (48, 2, 1, 32)
    w = workloads.sort("gpu").to_dicts()
    assert (w[0]["pod"], w[0]["namespace"], w[0]["container"]) == (None, None, None)  # empty labels: no workload
    assert (w[1]["pod"], w[1]["namespace"], w[1]["container"], w[1]["model_name"]) == ("llama-pretrain-worker-3", "llm", "trainer", "NVIDIA H200")
    assert extra.sort("gpu")["total_energy_mj"].to_list() == [2990947.0, 931245877.0]


def test_scrape_findings():
    """GPU 1 reports XID 48 (double-bit ECC error) as its last XID and 2 volatile DBEs: serve's
    `ecc` detector, on what the collector makes of its first scrape, pages once for the GPU's
    memory, the XID its evidence; the XID detector leaves ECC XIDs to it."""
    samples, _, _ = dcgm.read_scrape(SCRAPE, ts=TS)
    events = dcgm.scrape_xid_events(samples, ts=TS)
    assert events.select("node", "gpu", "kind", "xid", "source").rows() == [("gpu-node-07", 1, "xid", 48, "dcgm")]
    found = scrape_findings(samples, [], TS, source="node07.prom")
    assert [(f.kind, f.severity, f.gpu, f.xid, f.source) for f in found] == [(FindingKind.ECC, Severity.PAGE, 1, 48, "node07.prom:gpu=1")]
    assert found[0].evidence["nvidia_action"] == "WORKFLOW_XID_48" and found[0].evidence["dbe_new"] == 2 and found[0].evidence["detector"] == "ecc"
    check_golden("dcgm_node07_findings.json", [f.to_json_dict() for f in found])


def test_xid_counters_become_events_the_xid_detector_judges():
    """An XID counter that labels its code (dcgm-exporter's `DCGM_EXP_XID_ERRORS_COUNT`): one
    `xid` event per GPU and code, however many series repeat it; XID 79 is fatal (page), and
    XID 48 in the same scrape goes to the `ecc` detector, as in serve."""
    from gpuvigil.parsers import nvidia_smi

    text = (
        'DCGM_FI_DEV_FB_USED{gpu="2",UUID="GPU-c",Hostname="n9"} 10\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="2",UUID="GPU-c",Hostname="n9",xid="79",window_size_in_ms="300000"} 2\n'
        'DCGM_FI_DEV_XID_ERRORS_ACTIVE{gpu="2",UUID="GPU-c",Hostname="n9",xid="79"} 1\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="2",UUID="GPU-c",Hostname="n9",xid="48"} 1\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="3",UUID="GPU-d",Hostname="n9",xid="99999999999"} 1\n'
    )
    samples, _, _ = dcgm.parse_text(text, ts=TS)
    events = dcgm.scrape_xid_events(samples, nvidia_smi.xid_counter_samples(text), ts=TS)
    assert sorted(events.select("node", "gpu", "xid").rows()) == [("n9", 2, 48), ("n9", 2, 79)]
    found = scrape_findings(samples, nvidia_smi.xid_counter_samples(text), TS, source="n9.prom")
    assert sorted((f.kind.value, f.severity.value, f.gpu, f.xid, f.source) for f in found) == [
        ("ecc", "page", 2, 48, "n9.prom:gpu=2"), ("xid", "page", 2, 79, "n9.prom:gpu=2")]


@pytest.mark.parametrize(
    ("labels", "node", "hpc_job"),
    [
        ('gpu="3",UUID="GPU-a",hostname="n-lower"', "n-lower", None),  # newer exporters: lowercase
        ('gpu="3",UUID="GPU-a",Hostname="n-upper",hpc_job="slurm-991"', "n-upper", "slurm-991"),
        ('gpu="3",UUID="GPU-a"', "fallback-node", None),
    ],
)
def test_label_variants(labels, node, hpc_job):
    text = f"# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{{{labels}}} 10\nDCGM_FI_DEV_XID_ERRORS{{{labels}}} 79\n"
    samples, workloads, _ = dcgm.parse_text(text, ts=TS, default_node="fallback-node")
    row = samples.row(0, named=True)
    assert (row["node"], row["gpu"], row["memory_used_bytes"], row["last_xid"]) == (node, 3, 10 * MIB, 79)
    assert workloads.row(0, named=True)["hpc_job"] == hpc_job


def test_older_throttle_reason_field_name():
    text = 'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0",UUID="GPU-a",Hostname="h"} 64\n'
    samples, _, _ = dcgm.parse_text(text, ts=TS)
    assert samples["throttle_reasons"].to_list() == [64]


def test_not_a_scrape_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.prom"
    bad.write_text('DCGM_FI_DEV_FB_USED{gpu="0" 12\n')
    with pytest.raises(UserError, match="bad.prom"):
        dcgm.read_scrape(bad)


class _Exporter:
    """A real HTTP server on 127.0.0.1 serving whatever text the test sets."""

    def __init__(self) -> None:
        self.body = SCRAPE.read_text()
        self.status = 200
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                data = owner.body.encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter():
    srv = _Exporter()
    yield srv
    srv.stop()


def test_collector_scrapes_and_counts_xid_changes(exporter):
    col = dcgm.DcgmCollector(exporter.url, timeout_seconds=2.0)
    try:
        out = col.collect(100.0)
        # dcgm_extra (energy, memory temperature) is read by nothing: not sent to the pipeline
        assert set(out) == {"gpu_samples", "gpu_workloads", "events"} and set(out) <= set(col.streams)
        assert out["gpu_samples"].schema == schemas.GPU_SAMPLES
        ev = out["events"]
        assert ev.schema == schemas.EVENTS and ev["xid"].to_list() == [48] and ev["gpu"].to_list() == [1] and ev["source"].to_list() == ["dcgm"]
        assert out["gpu_samples"].sort("gpu")["xid_total"].to_list() == [0, 1]
        # same last XID: not a new one
        out = col.collect(101.0)
        assert "events" not in out and out["gpu_samples"].sort("gpu")["xid_total"].to_list() == [0, 1]
        # GPU 1 raises 79, GPU 0 raises 13
        exporter.body = "\n".join(
            (l.rsplit(" ", 1)[0] + (" 79" if 'gpu="1"' in l else " 13")) if l.startswith("DCGM_FI_DEV_XID_ERRORS{") else l for l in exporter.body.splitlines()
        )
        out = col.collect(102.0)
        assert sorted(zip(out["events"]["gpu"].to_list(), out["events"]["xid"].to_list())) == [(0, 13), (1, 79)]
        assert out["gpu_samples"].sort("gpu")["xid_total"].to_list() == [1, 2]
        assert col.errors == 0
        # a failing exporter is counted, not raised
        exporter.status = 500
        assert col.collect(103.0) == {}
        exporter.status = 200
        exporter.body = "this is { not prometheus"
        assert col.collect(104.0) == {}
        assert col.errors == 2
    finally:
        col.close()


def test_collector_counts_connection_errors():
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    col = dcgm.DcgmCollector(f"http://127.0.0.1:{port}/metrics", timeout_seconds=0.5)
    try:
        assert col.collect(0.0) == {}
        assert col.errors == 1 and "ConnectError" in (col.last_error or "")
    finally:
        col.close()


REAL_LINES = SCRAPE.read_text().splitlines()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=500))
def test_random_text_raises_only_value_error(text):
    try:
        samples, _, _ = dcgm.parse_text(text, ts=TS)
    except ValueError:
        return
    assert samples.schema == schemas.GPU_SAMPLES


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(REAL_LINES)), st.integers(0, 200))
def test_truncated_scrape_never_crashes(n_lines, cut):
    text = "\n".join(REAL_LINES[:n_lines])
    text = text[: len(text) - cut] if cut < len(text) else text
    try:
        samples, _, _ = dcgm.parse_text(text, ts=TS)
    except ValueError:
        return
    assert samples.schema == schemas.GPU_SAMPLES


def test_path_type_accepted(tmp_path):
    p = Path(tmp_path / "s.prom")
    p.write_text(SCRAPE.read_text())
    samples, _, _ = dcgm.read_scrape(p)
    assert samples.height == 2


def test_collector_fits_the_pipeline(exporter):
    from gpuvigil.collectors.base import Collector
    from gpuvigil.pipeline.core import Pipeline

    col = dcgm.DcgmCollector(exporter.url)
    try:
        assert isinstance(col, Collector)
        pipe = Pipeline([col], [])
        pipe.tick(TS)
        assert pipe.window.get("gpu_samples").height == 2
        # the job map: GPU 1's pod (GPU 0 runs none and never did: no row)
        assert pipe.window.get("gpu_workloads").select("gpu", "pod").rows() == [(1, "llama-pretrain-worker-3")]
    finally:
        col.close()
