"""`gpuvigil replay` and `gpuvigil analyze` of the fabric kinds. Replay: recorded series of gpuvigil's own InfiniBand port metrics
(as serve exports them, exporter/metrics.py) and of dcgm-exporter's fabric and memory-repair
fields, replayed at a 30 s step (dcgm-exporter's default interval), fire the findings at the
recorded moment the fault appears, and nothing before.

Source: a constructed 20-minute OpenMetrics history in the label layout of serve's /metrics
(tests/test_infiniband.py pins it) and of dcgm-exporter (tests/data/dcgm/node07_constructed.prom),
field ids as in tests/test_nvlink_fabric.py. Analyze: a saved dcgm-exporter scrape and a copy of a
sysfs tree (tests/data/sysfs/two_gpu_ndr), each read once."""

from __future__ import annotations

import shutil

from gpuvigil import config
import gpuvigil.cli.main as cli
from gpuvigil.offline.analyze import Analyzer
from gpuvigil.offline.replay import Recorded, load_files, run_replay

import sysfs_trees

T0 = 1_790_000_000.0
STEP = 30
IB = 'node="ib07",device="{d}",port="1",link_layer="InfiniBand"'
DCGM = 'gpu="{g}",UUID="GPU-{g}",pci_bus_id="00000000:0{g}:00.0",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="ib07"'


def history() -> str:
    series: dict[str, list[str]] = {}

    def point(family: str, name: str, labels: str, value: float, t: float) -> None:
        series.setdefault(family, []).append(f"{name}{{{labels}}} {value:g} {t:.3f}")

    for i in range(40):
        t = T0 + i * STEP
        for d in ("mlx5_0", "mlx5_1"):
            lab = IB.format(d=d)
            point("gpuvigil_ib_port_up", "gpuvigil_ib_port_up", lab, 0 if (d == "mlx5_1" and t >= T0 + 600) else 1, t)
            point("gpuvigil_ib_port_rate_bytes_per_second", "gpuvigil_ib_port_rate_bytes_per_second", lab, 5e10, t)
            point("gpuvigil_ib_port_width_lanes", "gpuvigil_ib_port_width_lanes", lab, 4, t)
            errors = 2000 * max(0, i - 10) if d == "mlx5_0" else 0  # from T0 + 330 s: 4000/min
            point("gpuvigil_ib_port_symbol_errors", "gpuvigil_ib_port_symbol_errors_total", lab, errors, t)
            point("gpuvigil_ib_port_link_downed", "gpuvigil_ib_port_link_downed_total", lab, 1 + (d == "mlx5_1" and t >= T0 + 600), t)
        for g in (0, 1):
            lab = DCGM.format(g=g)
            point("DCGM_FI_DEV_FABRIC_MANAGER_STATUS", "DCGM_FI_DEV_FABRIC_MANAGER_STATUS", lab, 4 if (g == 1 and t >= T0 + 900) else 3, t)
            point("DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ROW_REMAP_PENDING", lab, 1 if (g == 0 and t >= T0 + 300) else 0, t)
    types = {"gpuvigil_ib_port_symbol_errors": "counter", "gpuvigil_ib_port_link_downed": "counter"}
    lines = []
    for family, points in series.items():
        lines.append(f"# TYPE {family} {types.get(family, 'gauge')}")
        lines += points
    return "\n".join(lines) + "\n# EOF\n"


def test_replay_fires_the_fabric_findings_when_they_appeared(tmp_path):
    om = tmp_path / "fabric.om"
    om.write_text(history())
    recorded = Recorded()
    load_files([om], recorded)
    assert not recorded.errors and {"ib_ports", "gpu_samples"} <= set(recorded.frames)
    result = run_replay(recorded, step=float(STEP))
    first = {}
    for f in result.findings:
        first.setdefault((f.finding.kind.value, f.finding.evidence.get("device") or f.finding.gpu), f.at - T0)
    assert first == {
        ("row_remap_pending", 0): 300.0,
        ("ib_link_errors", "mlx5_0"): 330.0,  # its first read with errors: 2000 already exceed the window's allowance (10/min)
        ("ib_link_down", "mlx5_1"): 600.0,
        ("fabric_manager", 1): 900.0,
    }
    by_kind = {f.finding.kind.value: f.finding for f in result.findings}
    assert by_kind["ib_link_down"].severity.value == "page" and by_kind["ib_link_down"].node == "ib07"
    assert by_kind["fabric_manager"].evidence["status"] == "failure"


def test_analyze_a_saved_scrape_names_the_fabric_failure_and_the_pending_remap(tmp_path):
    scrape = tmp_path / "node.prom"
    scrape.write_text("\n".join(line.rsplit(" ", 1)[0] for line in history().splitlines()[-400:] if line and not line.startswith("#")
                                 and line.startswith("DCGM_FI_") and line.endswith(f"{T0 + 39 * STEP:.3f}")) + "\n")
    report = Analyzer(at=T0 + 2000).run([scrape])
    got = sorted((f.kind.value, f.gpu, f.severity.value) for f in report.findings)
    assert got == [("fabric_manager", 1, "page"), ("row_remap_pending", 0, "ticket")]
    assert report.formats == {str(scrape): "dcgm_scrape"}


def test_analyze_a_sysfs_copy(tmp_path, capsys):
    tree = tmp_path / "sys"
    shutil.copytree(sysfs_trees.tree("two_gpu_ndr"), tree, symlinks=True)
    report = Analyzer(node="n7", at=T0).run([tree])
    assert report.findings == [] and report.formats == {str(tree): "sysfs"}  # a healthy node's ports
    (tree / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "rate").write_text("200 Gb/sec (2X NDR)\n")
    (tree / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "state").write_text("1: DOWN\n")
    cfg = config.load(overrides={"detectors": {"infiniband": {"expected_ports": 3, "expected": {"mlx5_*": {"width": 4}}}}})
    report = Analyzer(node="n7", at=T0, cfg=cfg).run([tree])
    got = sorted((f.kind.value, f.evidence["device"], f.severity.value, f.ts) for f in report.findings)
    assert got == [("ib_link_degraded", "mlx5_1", "ticket", T0), ("ib_link_down", "mlx5_0", "page", T0)]
    assert cli.main(["analyze", str(tree), "--node", "n7"]) == 0
    assert "ib_link_degraded" not in capsys.readouterr().out  # without the config, two IB ports have no majority to compare with
