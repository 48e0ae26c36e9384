"""Smaller hardening items: `gpuvigil demo` talks when it is not on a terminal, and the
scheduler benchmark's default traces live inside the repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_prints_progress_when_not_a_terminal():
    proc = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "demo", "--scenario", "healthy", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("gpuvigil demo: simulating 1 scenario(s)")
    assert any(line.startswith("gpuvigil demo: [1/1] healthy ok") for line in lines)
    assert "\x1b" not in proc.stderr  # plain lines, no progress-bar redraws


def test_scheduler_benchmark_default_traces_are_in_the_repository():
    from benchmarks import scheduler

    for folder, needed in ((scheduler.DEFAULT_TRACE, "openb_node_list_gpu_node.csv"), (scheduler.DEFAULT_FAULTS, "fault_trace.json")):
        assert folder.resolve().is_relative_to(REPO), folder
        assert (folder / needed).is_file(), folder
