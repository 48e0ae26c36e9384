"""Optional dependencies (extras): without them the base package still serves, validates its
config and runs the pipeline; the commands that need one say, in one line, which extra to install.

"Not installed" is made real by a `None` entry in `sys.modules`, which makes `import X` fail
exactly as it does where X is absent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuvigil.cli.main import main
from gpuvigil.util.extras import MissingExtra

OPTIONAL = ("kubernetes", "grafanalib", "sklearn")


def _hide(monkeypatch, top: str) -> None:
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, top, None)


def test_dashboards_build_without_grafanalib_names_the_extra(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "grafanalib")
    monkeypatch.delitem(sys.modules, "gpuvigil.dashboards.definitions", raising=False)
    assert main(["dashboards", "build", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpuvigil: error: gpuvigil dashboards build needs grafanalib, which is not installed: pip install 'gpuvigil[build]'"]
    assert list(tmp_path.iterdir()) == []


def test_the_kubernetes_adapter_without_the_client_names_the_extra(monkeypatch):
    _hide(monkeypatch, "kubernetes")
    from gpuvigil.scheduler.kubernetes import KubernetesAdapter

    with pytest.raises(MissingExtra, match=r"^the Kubernetes adapter needs kubernetes, which is not installed: pip install 'gpuvigil\[kubernetes\]'$"):
        KubernetesAdapter()


def test_the_base_package_runs_without_any_extra():
    code = (
        "import sys\n"
        f"for m in {OPTIONAL!r}: sys.modules[m] = None\n"
        "from gpuvigil import config\n"
        "config.validate_all(config.defaults())\n"  # imports every section's model
        "import gpuvigil.app.serve, gpuvigil.api.app, gpuvigil.offline.analyze, gpuvigil.alerts.build, gpuvigil.scheduler.slurm, gpuvigil.scheduler.kubernetes\n"
        "from gpuvigil.app.runtime import build_simulated\n"
        "rt = build_simulated('healthy', nodes=2)\n"
        "rt.run(15)\n"
        "print(rt.pipeline.ticks)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 15
