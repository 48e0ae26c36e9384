"""deploy/: the files an operator installs, checked as the tools that read them would.

- Kubernetes manifests against the Kubernetes OpenAPI schemas (`kubernetes-validate`, strict:
  an unknown field is an error), and the DaemonSet's arguments through serve's own parser;
- the systemd unit with `systemd-analyze verify` where systemd is installed (else parsed), and
  its ExecStart through serve's parser;
- the example deploy.yaml and the ConfigMap's through gpuvigil's config validation;
- the Slurm prolog/epilog run by a real shell, writing and clearing the job-mapping files in the
  format dcgm-exporter's --hpc-job-mapping-dir reads.
"""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuvigil import config
from gpuvigil.config import deploy as deployconfig
from gpuvigil.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30.0"
MANIFESTS = [DEPLOY / "kubernetes" / "namespace.yaml", DEPLOY / "rbac.yaml", DEPLOY / "kubernetes" / "configmap.yaml",
             DEPLOY / "kubernetes" / "daemonset.yaml"]


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def serve_args(argv: list[str]):
    full = ["serve", *argv]
    return build_parser(full).parse_args(full)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_match_the_kubernetes_schemas(path):
    kv = pytest.importorskip("kubernetes_validate")
    docs = documents(path)
    assert docs
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError with the path of the bad field


def test_the_schema_check_rejects_a_broken_daemonset():
    """The check above can fail: a misspelt field and a wrong type are both caught."""
    kv = pytest.importorskip("kubernetes_validate")
    ds = documents(DEPLOY / "kubernetes" / "daemonset.yaml")[0]
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "metrics"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_daemonset_runs_serve_with_the_configmap_and_the_rbac_service_account():
    ds = documents(DEPLOY / "kubernetes" / "daemonset.yaml")[0]
    cm = documents(DEPLOY / "kubernetes" / "configmap.yaml")[0]
    sa = next(d for d in documents(DEPLOY / "rbac.yaml") if d["kind"] == "ServiceAccount")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and ds["metadata"]["namespace"] == sa["metadata"]["namespace"]
    container = pod["containers"][0]
    args = [a.replace("$(NODE_NAME)", "gpu-node-07") for a in container["args"]]
    parsed = serve_args(args[1:])
    assert parsed.node == "gpu-node-07" and parsed.config == "/etc/gpuvigil/deploy.yaml"
    assert any(e["name"] == "NODE_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName" for e in container["env"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert Path(mounts["config"], "deploy.yaml").as_posix() == parsed.config and "deploy.yaml" in cm["data"]
    # The ports serve listens on are the ones the pod declares.
    sources = deployconfig.parse(yaml.safe_load(cm["data"]["deploy.yaml"])["sources"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == parsed.port and ports["hook"] == deployconfig.split_address(sources.hook)[1]
    assert sources.scheduler == "kubernetes" and mounts["kmsg"] == "/dev/kmsg"


@pytest.mark.parametrize("text", [
    (DEPLOY / "deploy.yaml").read_text(),
    yaml.safe_load((DEPLOY / "kubernetes" / "configmap.yaml").read_text())["data"]["deploy.yaml"],
], ids=["deploy.yaml", "configmap"])
def test_example_deploy_configs_are_valid_config_files(text, tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    cfg = config.load(path)  # validates every section, `sources:` with the strict model
    sources = deployconfig.parse(cfg["sources"])
    assert sources.real and sources.act == "dry-run" and sources.scheduler in ("slurm", "kubernetes")


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / "systemd" / "gpuvigil.service").read_text())
    return parser


def test_systemd_unit_runs_serve_with_the_example_config():
    unit = _unit()
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0].endswith("/gpuvigil") and argv[1] == "serve"
    parsed = serve_args([a for a in argv[2:] if a != "$GPUVIGIL_ARGS"])
    assert parsed.config == "/etc/gpuvigil/deploy.yaml"
    assert Path(parsed.outbox).parent == Path(unit["Service"]["ReadWritePaths"]) == Path("/var/lib", unit["Service"]["StateDirectory"])
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_analyze_verifies_the_unit(tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd); the unit is still parsed above")
    # Verify resolves ExecStart: point it at this checkout's gpuvigil instead of /opt/gpuvigil.
    gpuvigil = Path(sys.executable).with_name("gpuvigil")
    if not gpuvigil.exists():
        pytest.skip("no gpuvigil console script beside this Python")
    unit = tmp_path / "gpuvigil.service"
    unit.write_text((DEPLOY / "systemd" / "gpuvigil.service").read_text().replace("/opt/gpuvigil/.venv/bin/gpuvigil", str(gpuvigil)))
    done = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "gpuvigil.service" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def _run(script: str, env: dict[str, str]) -> None:
    subprocess.run(["sh", str(DEPLOY / "slurm" / script)], env={"PATH": os.environ["PATH"], **env}, check=True, timeout=30)


def test_slurm_prolog_and_epilog_keep_the_dcgm_job_mapping_files(tmp_path):
    if shutil.which("flock") is None:
        pytest.skip("flock (util-linux) not installed")
    d = tmp_path / "job-map"
    _run("prolog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(d), "SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "0,2"})
    _run("prolog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(d), "SLURM_JOB_ID": "4243", "CUDA_VISIBLE_DEVICES": "2,3"})
    _run("prolog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(d), "SLURM_JOB_ID": "4243", "CUDA_VISIBLE_DEVICES": "2,3"})  # idempotent
    files = {f.name: f.read_text() for f in d.iterdir() if not f.name.startswith(".")}
    assert files == {"0": "4242\n", "2": "4242\n4243\n", "3": "4243\n"}
    _run("epilog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(d), "SLURM_JOB_ID": "4242"})
    files = {f.name: f.read_text() for f in d.iterdir() if not f.name.startswith(".")}
    assert files == {"2": "4243\n", "3": "4243\n"}
    _run("epilog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(d), "SLURM_JOB_ID": "4243"})
    assert [f.name for f in d.iterdir() if not f.name.startswith(".")] == []
    # A job without GPUs, and an epilog with no folder yet: nothing to do, and never a failure.
    _run("prolog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(tmp_path / "none"), "SLURM_JOB_ID": "1"})
    _run("epilog.sh", {"GPUVIGIL_JOB_MAP_DIR": str(tmp_path / "none"), "SLURM_JOB_ID": "1"})
    assert not (tmp_path / "none").exists()


def test_the_example_config_never_falls_back_to_the_simulator(tmp_path):
    """deploy/deploy.yaml asks for NVML: without a driver, serve stops naming it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML driver")
    except Exception:
        pass
    done = subprocess.run([sys.executable, "-m", "gpuvigil", "serve", "--config", str(DEPLOY / "deploy.yaml"), "--port", "0", "--duration", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "source nvml: cannot start" in done.stderr, done.stderr
    assert done.stdout == "" and "simulat" not in done.stderr
