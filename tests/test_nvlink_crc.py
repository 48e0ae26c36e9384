"""The NVLink CRC detector, end to end: its counters from dcgm-exporter's CRC fields, a rate that
raises a ticket for the hardware team with a cordon hint, its own kind, clear time, route and
exported series, every one of them from its declarations (gpuvigil/detectors/nvlink_crc.py, the
kinds table, the signals table, hints.yaml, detectors.yaml).

Data: a dcgm-exporter exposition written for the test with the two CRC fields dcgm-exporter
exports once they are in its counters file (labels as dcgm-exporter 3.x writes them), and a
counter that grows 30 errors a minute, sampled each second."""

from __future__ import annotations

import polars as pl

from gpuvigil import config, kinds, schemas
from gpuvigil.alerts.pusher import team_of
from gpuvigil.alerts.settings import load_settings
from gpuvigil.collectors import dcgm
from gpuvigil.detectors import registry
from gpuvigil.exporter.metrics import GPU_SPECS
from gpuvigil.model import FindingKind, HintAction, Severity
from gpuvigil.pipeline.core import Pipeline

LABELS = 'gpu="{gpu}",UUID="GPU-{gpu}",pci_bus_id="00000000:1{gpu}:00.0",device="nvidia{gpu}",modelName="NVIDIA H200",Hostname="gpu-node-07"'


def test_dcgm_crc_fields_become_one_counter_per_gpu():
    text = "".join(
        f"DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{{LABELS.format(gpu=g)}}} {flit}\nDCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL{{{LABELS.format(gpu=g)}}} {data}\n"
        for g, flit, data in ((0, 12, 3), (1, 0, 0))
    )
    samples, _, _ = dcgm.parse_text(text, ts=100.0)
    assert samples.sort("gpu").select("node", "gpu", "nvlink_crc_errors_total").rows() == [("gpu-node-07", 0, 15), ("gpu-node-07", 1, 0)]


def test_the_series_is_exported():
    assert ("gpuvigil_gpu_nvlink_crc_errors", "counter", "nvlink_crc_errors_total") in [s[:3] for s in GPU_SPECS]


class _Link:
    """GPU 3 of node-1: its CRC counter grows 30 a minute; GPU 4's stays at 2."""

    name = "link"
    errors = 0
    streams: dict = {}

    def collect(self, now: float) -> dict:
        rows = [{"ts": now, "node": "node-1", "gpu": 3, "nvlink_crc_errors_total": int(now // 2)}, {"ts": now, "node": "node-1", "gpu": 4, "nvlink_crc_errors_total": 2}]
        return {
            "gpu_samples": schemas.frame(rows, schemas.GPU_SAMPLES),
            "allocations": schemas.frame([{"job": "job-a", "rank": 0, "node": "node-1", "gpu": 3}], schemas.ALLOCATIONS),
        }


def test_a_rising_crc_rate_is_a_hardware_ticket_with_a_cordon_hint():
    cfg = config.defaults()
    [det] = registry.default_detectors(cfg, only={"nvlink_crc": True})
    pipe = Pipeline([_Link()], [det], cfg=cfg)
    results = [pipe.tick(float(t)) for t in range(0, 70)]
    [f] = pipe.active.values()
    assert (f.kind, f.severity, f.node, f.gpu, f.job, f.cause) == (FindingKind.NVLINK_CRC, Severity.TICKET, "node-1", 3, "job-a", "hardware")
    assert f.evidence == {"nvlink_crc_errors_per_minute": 30.0, "nvlink_crc_errors_total": 30, "window_seconds": 60.0, "level": "L0"}
    first = next(i for i, r in enumerate(results) if r.new_findings)
    assert first == 60  # one window after the first reading
    assert [(h.action, h.node) for r in results for h in r.new_hints] == [(HintAction.CORDON_NODE, "node-1")]
    settings = load_settings(cfg)
    assert team_of(f, "tenant-of-job-a", settings) == settings.hardware_team
    assert pipe._clear_after(f) == kinds.policy(FindingKind.NVLINK_CRC).clear_after_seconds == 600
    assert registry.placement()["nvlink_crc"] == "agent"  # it needs only its own node's GPUs


def test_a_fleet_without_the_crc_fields_is_silent():
    cfg = config.defaults()
    [det] = registry.default_detectors(cfg, only={"nvlink_crc": True})
    from gpuvigil.window import Window

    w = Window(600.0)
    for t in range(0, 200, 10):
        w.add("gpu_samples", schemas.frame([{"ts": float(t), "node": "n", "gpu": 0, "memory_used_bytes": 1}], schemas.GPU_SAMPLES))
        w.seal(float(t))
        assert det.detect(w) == []
    assert w.get("gpu_samples").get_column("nvlink_crc_errors_total").dtype == pl.Int64
