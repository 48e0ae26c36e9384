"""`gpuvigil serve --sysfs-root DIR` as its own process, on a copy of a node's sysfs tree
(tests/data/sysfs/two_gpu_ndr, see its README) whose ports change while it runs: one goes down, one
drops and comes back (its link_downed counter rises), one takes a burst of symbol errors. serve
pages and tickets them (its log and /metrics), and exports the ports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

import sysfs_trees
from services import wait_for

REPO = Path(__file__).resolve().parents[1]
TREE = sysfs_trees.tree("two_gpu_ndr")


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def port(root: Path, device: str) -> Path:
    return root / "class" / "infiniband" / device / "ports" / "1"


def bump(path: Path, by: int) -> None:
    path.write_text(f"{int(path.read_text()) + by}\n")


def test_serve_reads_a_sysfs_copy_and_reports_its_ports(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(TREE, root, symlinks=True)
    err = tmp_path / "serve.err"
    with err.open("w") as err_file:
        serve = subprocess.Popen(
            [sys.executable, "-m", "gpuvigil", "serve", "--port", "0", "--sysfs-root", str(root), "--node", "ibn0", "--duration", "90"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_file, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        assert serve.stdout is not None
        started = serve.stdout.readline()
        assert "infiniband" in started, started
        url = re.search(r"metrics (http://\S+/metrics)", started).group(1).replace("0.0.0.0", "127.0.0.1")

        def scrape() -> str | None:
            try:
                return httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                return None

        wait_for(lambda: (t := scrape()) and samples(t, "gpuvigil_ib_ports") == [({"node": "ibn0"}, 3.0)], 60, what="serve's first read of the ports")
        (port(root, "mlx5_1") / "state").write_text("1: DOWN\n")
        (port(root, "mlx5_1") / "phys_state").write_text("2: Polling\n")
        bump(port(root, "mlx5_1") / "counters" / "link_downed", 1)
        bump(port(root, "mlx5_2") / "counters" / "link_downed", 1)  # down and back between two reads
        bump(port(root, "mlx5_0") / "counters" / "symbol_error", 5000)

        def reported() -> str | None:
            t = scrape()
            seen = {(l["kind"], l["severity"]) for l, v in samples(t or "", "gpuvigil_findings_total") if v >= 1}
            return t if {("ib_link_down", "page"), ("ib_link_down", "ticket"), ("ib_link_errors", "ticket")} <= seen else None

        text = wait_for(reported, 60, what="the ports' findings")
        up = {l["device"]: v for l, v in samples(text, "gpuvigil_ib_port_up")}
        assert up == {"mlx5_0": 1.0, "mlx5_1": 0.0, "mlx5_2": 1.0}
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    log = err.read_text()
    assert "finding page ib_link_down: InfiniBand link down on ibn0 mlx5_1 port 1: state DOWN, physical Polling (no link: the port polls for a peer; check the cable, the transceiver and the switch port; it was ACTIVE)" in log
    assert "finding ticket ib_link_down: InfiniBand link dropped on ibn0 mlx5_2 port 1" in log
    assert re.search(r"finding ticket ib_link_errors: InfiniBand link errors on ibn0 mlx5_0 port 1: symbol_error \d+/min", log)
    assert "ib_port_missing" not in log and "ib_link_degraded" not in log  # no port went missing or slow


def test_sysfs_root_flag_turns_the_source_on():
    from gpuvigil.cli.main import build_parser
    from gpuvigil.config.deploy import from_config

    def sources(*argv: str, cfg: dict | None = None):
        full = ["serve", *argv]
        return from_config(cfg or {}, build_parser(full).parse_args(full))

    assert not sources().infiniband and not sources().real
    s = sources("--sysfs-root", "/srv/copy")
    assert (s.infiniband, s.real, s.configured()) == ("/srv/copy", True, ["infiniband"])
    assert sources("--sysfs-root").infiniband == "/sys"
    assert sources(cfg={"sources": {"infiniband": True}}).infiniband is True
    assert sources("--sysfs-root", "/host/sys", cfg={"sources": {"infiniband": True}}).infiniband == "/host/sys"  # the flag wins
