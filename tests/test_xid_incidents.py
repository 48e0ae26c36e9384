"""A whole kernel log's XID incidents are judged by a registered detector placed `offline`
(`xid_incidents`, over the `xid_incidents` stream): `analyze` runs it through the composition
root, serve never does (live, the `xid` detector judges the same lines as `events`), and its
thresholds are its config block's.

Data: public kernel logs (tests/data/public/README.md names each thread): a GB200 node where
XID 145 hit three GPUs, reported as "Xid 45 caused by previous Xid 145" (`xid_ogkm_1150_cascade.log`),
and a desktop GPU's burst of XIDs 31, 13 and 32 a minute apart (`xid_dxvk_1027_block.log`).
"""

from __future__ import annotations

import pytest

from gpuvigil import config, schemas
from gpuvigil.app import compose
from gpuvigil.detectors import registry
from gpuvigil.model import FindingKind, Severity
from gpuvigil.offline.analyze import Analyzer, kernel_log_findings
from h_logs_helpers import PUBLIC, REFERENCE_TS

CASCADE = PUBLIC / "corpus" / "xid_ogkm_1150_cascade.log"
BLOCK = PUBLIC / "corpus" / "xid_dxvk_1027_block.log"


def test_registered_offline_and_run_by_analyze_alone():
    spec = registry.specs()["xid_incidents"]
    assert spec.placement == "offline" and FindingKind.XID in spec.emits and set(spec.reads) == {"xid_incidents"}
    assert "xid_incidents" in schemas.STREAMS
    assert "xid_incidents" in compose.detector_names("analyze")
    assert all("xid_incidents" not in compose.detector_names(role) for role in compose.ROLES if role != "analyze")
    assert "xid_incidents" not in {d.name for d in registry.default_detectors()}


def _xids(found):
    return [(f.xid, f.severity, f.gpu, f.evidence.get("pci_bus_id"), f.evidence.get("gpu_count")) for f in found]


def test_analyze_judges_a_cascade_by_the_detectors_config():
    """The shipped rule pages XID 145 once for the node (3 GPUs); the same log under a config
    that asks for 4 GPUs before a cascade pages each GPU: analyze's answer is the registered
    detector's, built from the config analyze was given."""
    report = Analyzer(at=REFERENCE_TS).run([CASCADE])
    assert _xids(report.findings) == [(149, Severity.PAGE, None, "0000:dc:00", None), (145, Severity.PAGE, None, None, 3)]
    assert [f.source for f in report.findings] == [f"{CASCADE}:1", f"{CASCADE}:2"]
    cfg = config.load(overrides={"detectors": {"xid_incidents": {"cascade_min_gpus": 4}}})
    apart = Analyzer(cfg=cfg, at=REFERENCE_TS).run([CASCADE]).findings
    assert sorted(_xids(apart), key=str) == sorted(
        [(149, Severity.PAGE, None, "0000:dc:00", None)] + [(145, Severity.PAGE, None, bus, None) for bus in ("0000:97:00", "0000:ba:00", "0000:ed:00")], key=str
    )


@pytest.mark.parametrize(
    ("overrides", "with_xids"),
    [
        ({}, [[13, 32], [31, 32], [13, 31]]),  # companions within the 180 s burst gap
        ({"kernel_log": {"burst_gap_seconds": 30}}, [[], [32], [13]]),  # null: follows the burst gap
        ({"kernel_log": {"burst_gap_seconds": 30}, "detectors": {"xid_incidents": {"companion_seconds": 180}}}, [[13, 32], [31, 32], [13, 31]]),
    ],
)
def test_companions_follow_the_burst_gap_unless_configured(overrides, with_xids):
    found = kernel_log_findings(BLOCK.read_text(), source_file=BLOCK.name, reference_ts=REFERENCE_TS, cfg=config.load(overrides=overrides))
    assert [f.xid for f in found] == [31, 13, 32]
    assert [f.evidence["with_xids"] for f in found] == with_xids


def test_the_detector_without_a_file_name_sources_its_findings_to_the_kernel_log():
    [f] = kernel_log_findings("[  100.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n", reference_ts=REFERENCE_TS)
    assert (f.xid, f.severity, f.source, f.evidence["pci_bus_id"]) == (79, Severity.PAGE, "kernel_log", "0000:3b:00")
