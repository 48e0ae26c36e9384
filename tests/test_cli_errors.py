"""Bad scenario files and bad CLI arguments: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD_SCENARIOS = {
    "not_yaml.yaml": "name: x\n  bad: [unclosed\n",
    "not_mapping.yaml": "- just\n- a list\n",
    "unknown_key.yaml": "name: x\nnodes: 2\nbogus: 1\n",
    "negative_nodes.yaml": "name: x\nnodes: -1\n",
    "unknown_fault.yaml": "name: x\nfaults:\n  - {type: meteor_strike, at: 1}\n",
    "fault_unknown_job.yaml": "name: x\nfaults:\n  - {type: nccl_hang, at: 1, job: ghost}\n",
    "rank_out_of_range.yaml": "name: x\nnodes: 1\njobs:\n  - {name: j, gpus: 2, step_time_seconds: 1}\nfaults:\n  - {type: nccl_hang, at: 1, job: j, ranks: [5]}\n",
    "too_big_job.yaml": "name: x\nnodes: 1\njobs:\n  - {name: j, gpus: 64, step_time_seconds: 1}\n",
    "bad.json": "{not json",
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuvigil", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("gpuvigil")


@pytest.mark.parametrize("fname", sorted(BAD_SCENARIOS))
def test_bad_scenario_file(tmp_path, fname):
    path = tmp_path / fname
    path.write_text(BAD_SCENARIOS[fname])
    proc = run_cli("demo", "--scenario", str(path))
    assert_one_line_error(proc)
    assert str(path) in proc.stderr


@pytest.mark.parametrize(
    "config_text", ["pipeline: {tick_seconds: -3}\n", "no_such_section: {}\n", "detectors: {hang: {min_stall_seconds: soon}}\n", "[1, 2\n"]
)
def test_bad_config_file(tmp_path, config_text):
    path = tmp_path / "cfg.yaml"
    path.write_text(config_text)
    assert_one_line_error(run_cli("demo", "--scenario", "healthy", "--config", str(path)))


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--scenario", "no_such_scenario"],
        ["demo", "--nodes", "many"],
        ["demo", "--nodes", "0"],
        ["demo", "--seed", "1.5"],
        ["demo", "--bogus-flag"],
        ["no-such-command"],
        [],
        ["demo", "--scenario", "/nonexistent/dir/x.yaml"],
        ["demo", "--scenario", "nccl_hang", "--nodes", "1"],
    ],
)
def test_bad_arguments(args):
    assert_one_line_error(run_cli(*args))
