"""deploy/slurm-taskprolog-l1.sh and deploy/k8s-pod-env-l1.yaml turn L1 on: the same variables,
pointing where the watcher looks (<root>/<job>/fr_dump_<rank>, fr_pipe_<rank>.pipe)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
FR_VARS = {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"}
INSPECTOR_VARS = {"NCCL_PROFILER_PLUGIN", "NCCL_INSPECTOR_ENABLE", "NCCL_INSPECTOR_DUMP_DIR", "NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS"}


def _prolog(tmp_path: Path, **env: str) -> dict[str, str]:
    out = subprocess.run(["bash", str(DEPLOY / "slurm-taskprolog-l1.sh")], env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "4242", "GPUVIGIL_FR_ROOT": str(tmp_path / "fr"), "GPUVIGIL_INSPECTOR_ROOT": str(tmp_path / "insp"), **env}, capture_output=True, text=True, check=True).stdout
    pairs = [line.removeprefix("export ").split("=", 1) for line in out.splitlines()]
    assert all(line.startswith("export ") for line in out.splitlines())
    return dict(pairs)


def test_taskprolog_sets_flight_recorder_per_job(tmp_path):
    env = _prolog(tmp_path)
    assert set(env) == FR_VARS  # no Inspector library given: the plugin stays off
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == f"{tmp_path}/fr/4242/fr_pipe_"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/fr/4242/fr_dump_"
    assert (tmp_path / "fr" / "4242").is_dir()


def test_taskprolog_turns_the_inspector_on_when_the_plugin_exists(tmp_path):
    lib = tmp_path / "libnccl-profiler-inspector.so"
    lib.write_bytes(b"")
    env = _prolog(tmp_path, GPUVIGIL_INSPECTOR_LIB=str(lib))
    assert INSPECTOR_VARS <= set(env) and env["NCCL_INSPECTOR_DUMP_DIR"] == f"{tmp_path}/insp/4242"
    prom = _prolog(tmp_path, GPUVIGIL_INSPECTOR_LIB=str(lib), GPUVIGIL_INSPECTOR_PROM="1")
    assert prom["NCCL_INSPECTOR_PROM_DUMP"] == "1" and int(prom["NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS"]) >= 30_000_000


def test_pod_env_snippet_sets_the_same_switches():
    pod = yaml.safe_load((DEPLOY / "k8s-pod-env-l1.yaml").read_text())
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert FR_VARS | INSPECTOR_VARS <= set(env)
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"].endswith("/$(JOB_ID)/fr_pipe_")


def test_serve_sources_build_the_l1_collectors(tmp_path):
    """`sources.flight_recorder` and `sources.nccl_inspector` start the L1 watchers."""
    from gpuvigil import config
    from gpuvigil.config.deploy import parse
    from gpuvigil.app.sources import build as build_sources

    (tmp_path / "insp" / "job-1").mkdir(parents=True)
    sources = parse({"flight_recorder": str(tmp_path / "fr"), "nccl_inspector": str(tmp_path / "insp"), "node": "n0"}, "test")
    started = build_sources(sources, config.defaults())
    try:
        kinds = {s.kind: s for s in started}
        assert {"flight_recorder", "nccl_inspector"} <= set(kinds)
        assert kinds["nccl_inspector"].collector.root == tmp_path / "insp"
    finally:
        for s in started:
            s.close()
