"""A failed row remap is its own finding kind, `row_remap_failure`, offline as online: from an
`nvidia-smi -q` dump, a saved dcgm-exporter scrape and a replayed DCGM history; and the policy,
hint, alert rule and runbook that go with it.

Sources:
- real: the H200 capture's `nvidia-smi -q` (tests/data/h200/nvidia-smi-q.txt, a healthy GPU: its
  `Remapped Rows`, `ECC Errors` and `Retired Pages` blocks as the driver prints them). Each case
  sets one of its values as a failing GPU shows it (NVIDIA's A100/H100 GPU memory error
  management: `Remapping Failure Occurred: Yes`, `Pending: Yes`, a volatile `DRAM Uncorrectable`
  count; `Pending Page Blacklist: Yes` on GPUs before Ampere);
- constructed: tests/data/dcgm/node07_constructed.prom (dcgm-exporter's label layout) with GPU 0's
  `DCGM_FI_DEV_ROW_REMAP_FAILURE` set to 1, and a 20-minute history of it at dcgm-exporter's
  default 30 s interval.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gpuvigil import kinds
from gpuvigil.alerts import rules as alert_rules
from gpuvigil.alerts.settings import load_settings
from gpuvigil.kinds import FindingKind
from gpuvigil.offline.analyze import Analyzer
from gpuvigil.offline.replay import Recorded, load_files, run_replay
from gpuvigil.offline.analyze import smi_findings
from gpuvigil.parsers import nvidia_smi

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]
SMI_Q = (DATA / "h200" / "nvidia-smi-q.txt").read_text()


def _set(text: str, key: str, value: str, *, after: str | None = None) -> str:
    """The dump with the first `key : ...` line (below the `after` heading, if given) set to `value`."""
    start = text.index(after) if after else 0
    m = re.compile(rf"^(\s*{re.escape(key)}\s*:\s*)(.*)$", re.MULTILINE).search(text, start)
    assert m, key
    return text[: m.start(2)] + value + text[m.end(2):]


FAILED = _set(SMI_Q, "Remapping Failure Occurred", "Yes")
DBE = _set(SMI_Q, "DRAM Uncorrectable", "2", after="Volatile")
PENDING = _set(SMI_Q, "Pending", "Yes", after="Remapped Rows")
PAGES = _set(SMI_Q, "Pending Page Blacklist", "Yes")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (SMI_Q, []),  # the real, healthy H200
        (FAILED, [("row_remap_failure", "page")]),
        (_set(DBE, "Remapping Failure Occurred", "Yes"), [("row_remap_failure", "page")]),  # one finding: the GPU goes to RMA
        (DBE, [("ecc", "page")]),  # an uncorrectable error without a failed remap
        (PENDING, [("row_remap_pending", "ticket")]),
        (PAGES, [("retired_pages", "ticket")]),
        (_set(PENDING, "DRAM Uncorrectable", "1", after="Volatile"), [("ecc", "page"), ("row_remap_pending", "ticket")]),
        (_set(_set(FAILED, "Pending", "Yes", after="Remapped Rows"), "Pending Page Blacklist", "Yes"),
         [("retired_pages", "ticket"), ("row_remap_failure", "page"), ("row_remap_pending", "ticket")]),
        (_set(SMI_Q, "DRAM Uncorrectable", "5", after="Aggregate"), []),  # lifetime errors, not volatile ones
    ],
    ids=["healthy", "failed", "failed+dbe", "dbe", "pending", "pages", "pending+dbe", "failed+pending+pages", "aggregate-only"],
)
def test_nvidia_smi_q_names_each_memory_repair_by_its_kind(text, want):
    gpus = nvidia_smi.parse(text)
    assert [g.pci_bus_id for g in gpus] == [None, "00000000:00:06.0"]  # the header's lines, then the GPU's block
    found = smi_findings(text, ts=1.0, node="h200-node")
    assert sorted((f.kind.value, f.severity.value) for f in found) == want
    assert all(f.cause == "hardware" and f.node == "h200-node" for f in found)


def test_nvidia_smi_q_failed_remap_carries_the_dbes_and_says_rma():
    [f] = smi_findings(_set(DBE, "Remapping Failure Occurred", "Yes"), ts=1.0)
    assert f.evidence == {"pci_bus_id": f.evidence["pci_bus_id"], "remap_failure": True, "ecc_dbe_volatile_total": 2}
    assert "a row remapping failed; 2 uncorrectable ECC error(s)" in f.summary
    assert "(NVIDIA's RMA criterion): drain the node and replace the GPU" in f.summary  # the remedy serve's ecc detector gives


def test_analyze_an_nvidia_smi_dump(tmp_path):
    dump = tmp_path / "smi.txt"
    dump.write_text(FAILED)
    report = Analyzer(node="h200-node", at=1_790_000_000.0).run([dump])
    assert report.formats == {str(dump): "nvidia_smi_q"}
    assert [(f.kind.value, f.node, f.ts) for f in report.findings] == [("row_remap_failure", "h200-node", 1_790_000_000.0)]


def test_analyze_a_saved_dcgm_scrape_with_a_failed_remap(tmp_path):
    """GPU 0 reports DCGM_FI_DEV_ROW_REMAP_FAILURE 1; GPU 1 has 2 volatile DBEs and no failure."""
    prom = (DATA / "dcgm" / "node07_constructed.prom").read_text()
    failed, n = re.subn(r'^(DCGM_FI_DEV_ROW_REMAP_FAILURE\{gpu="0",[^}]*\}) 0$', r"\1 1", prom, flags=re.MULTILINE)
    assert n == 1
    scrape = tmp_path / "node07.prom"
    scrape.write_text(failed)
    report = Analyzer(at=1_790_000_000.0).run([scrape])
    memory = sorted((f.kind.value, f.gpu, f.severity.value) for f in report.findings if f.kind.value in ("ecc", "row_remap_failure"))
    assert memory == [("ecc", 1, "page"), ("row_remap_failure", 0, "page")]
    [rma] = [f for f in report.findings if f.kind.value == "row_remap_failure"]
    assert rma.evidence["remap_failure"] is True and rma.summary.startswith("Row remapping failed on gpu-node-07 GPU 0")


T0 = 1_790_000_000.0
STEP = 30
DCGM = 'gpu="{g}",UUID="GPU-{g}",pci_bus_id="00000000:0{g}:00.0",device="nvidia{g}",modelName="NVIDIA H200",Hostname="gpu-node-07"'


def _history() -> str:
    """GPU 0: a DBE from T0 + 300 s; GPU 1: its row remap fails at T0 + 600 s (the flag stays up)."""
    dbe, failed = ["# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter"], ["# TYPE DCGM_FI_DEV_ROW_REMAP_FAILURE gauge"]
    for i in range(40):
        t = T0 + i * STEP
        for g in (0, 1):
            dbe.append(f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{DCGM.format(g=g)}}} {1 if g == 0 and t >= T0 + 300 else 0} {t:.3f}")
            failed.append(f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{DCGM.format(g=g)}}} {1 if g == 1 and t >= T0 + 600 else 0} {t:.3f}")
    return "\n".join(dbe + failed) + "\n# EOF\n"


def test_replay_of_a_dcgm_history_fires_each_kind_when_it_appeared(tmp_path):
    om = tmp_path / "memory.om"
    om.write_text(_history())
    recorded = Recorded()
    load_files([om], recorded)
    assert not recorded.errors and "gpu_samples" in recorded.frames
    result = run_replay(recorded, step=float(STEP))
    first: dict[tuple[str, int], float] = {}
    for r in result.findings:
        first.setdefault((r.finding.kind.value, r.finding.gpu), r.at - T0)
    assert first == {("ecc", 0): 300.0, ("row_remap_failure", 1): 600.0}
    # reported on every read while the flag is up: one finding
    assert len({r.finding.id for r in result.findings if r.finding.kind == FindingKind.ROW_REMAP_FAILURE}) == 1


def test_the_kind_is_a_device_s_fatal_hardware_fault_with_its_hint_rule_and_runbook():
    p = kinds.policy(FindingKind.ROW_REMAP_FAILURE)
    assert (p.scope, p.owner, p.identity, p.fatal) == ("gpu", "hardware", ("node", "gpu"), True)
    assert "row_remap_failure" in load_settings().fatal_hardware_kinds
    runbook = (REPO / "docs" / "runbooks.md").read_text()
    section = runbook.split(f'<a id="{kinds.runbook_anchor(FindingKind.ROW_REMAP_FAILURE)}"></a>', 1)[1].split("<a id=", 1)[0]
    assert "RMA" in section and "Remapping Failure Occurred" in section and "DCGM_FI_DEV_ROW_REMAP_FAILURE" in section
    hints = yaml.safe_load((REPO / "gpuvigil" / "config" / "hints.yaml").read_text())
    [rule] = [r for r in hints["rules"] if r["kind"] == "row_remap_failure"]
    assert rule["actions"] == ["drain_node", "requeue_job"]
    assert {"kind": "row_remap_failure", "fault": "infrastructure"} in hints["faults"]
    [alert] = [r for r in alert_rules.rules(load_settings()) if r.kind == "row_remap_failure"]
    assert (alert.name, alert.severity, alert.fatal_hardware) == ("GpuvigilGpuRowRemapFailure", "page", True)
