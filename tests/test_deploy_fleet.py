"""deploy/ for the fleet (NATS, agent, detect, act), checked as the tools that read them would:
the Kubernetes manifests against the Kubernetes schemas and each container's arguments through
gpuvigil's own parser, the ConfigMap's files through gpuvigil's config validation and the NATS
config generator, and the systemd units with `systemd-analyze verify`."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuvigil import config
from gpuvigil.cli.main import build_parser
from gpuvigil.config.deploy import fleet_from_config
from gpuvigil.fleet import security

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes" / "fleet"
SYSTEMD = REPO / "deploy" / "systemd"
UNITS = {"agent": "gpuvigil-agent.service", "detect": "gpuvigil-detect@.service", "act": "gpuvigil-act.service"}


def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "manifests.yaml").read_text()) if d]


def by_name() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] != "Service"}


def parse(argv: list[str]):
    return build_parser(argv).parse_args(argv)


def test_manifests_match_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    kinds = []
    for doc in docs():
        kv.validate(doc, "1.30.0", strict=True)
        kinds.append((doc["kind"], doc["metadata"]["name"]))
    assert kinds == [("Service", "nats"), ("StatefulSet", "nats"), ("DaemonSet", "gpuvigil-agent"), ("Deployment", "gpuvigil-detect"),
                     ("Deployment", "gpuvigil-act")]


def test_the_configmap_files_are_a_valid_fleet_and_its_generated_nats_config(tmp_path):
    cfg = config.load(K8S / "fleet.yaml")  # every section validated
    fleet = fleet_from_config(cfg, "fleet.yaml")
    assert fleet.replicas == 3 and set(fleet.credentials) == {"agent", "detect", "act"}
    # nats-server.conf is the generator's output for this fleet.yaml (regenerate with the command in fleet.yaml).
    assert (K8S / "nats-server.conf").read_text() == security.server_config(fleet)
    # The StatefulSet's pods are the servers the fleet names, and the routes of the config.
    nats = next(d for d in docs() if d["kind"] == "StatefulSet")
    assert [f"tls://nats-{i}.{nats['spec']['serviceName']}:4222" for i in range(nats["spec"]["replicas"])] == fleet.servers
    env = {e["name"] for e in nats["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"SERVER_NAME", "NATS_ADMIN_PASSWORD", *security.PASSWORD_ENV.values()} <= env
    # nats-server accepts it (certificate paths pointed at a throwaway CA's).
    from fleet_helpers import make_tls, nats_binary

    tls = make_tls(tmp_path)
    text = (K8S / "nats-server.conf").read_text().replace("/etc/nats/tls/server.crt", str(tls["server.crt"]))
    text = text.replace("/etc/nats/tls/server.key", str(tls["server.key"])).replace("/etc/nats/tls/ca.crt", str(tls["ca.crt"]))
    (tmp_path / "n.conf").write_text(text.replace("/var/lib/nats/jetstream", str(tmp_path / "js")))
    environ = {"SERVER_NAME": "nats-0", "NATS_ADMIN_PASSWORD": "a", **{v: "x" for v in security.PASSWORD_ENV.values()}}
    check = subprocess.run([nats_binary(), "-t", "-c", str(tmp_path / "n.conf")], capture_output=True, text=True, timeout=30, env=environ)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("role, name", [("agent", "gpuvigil-agent"), ("detect", "gpuvigil-detect"), ("act", "gpuvigil-act")])
def test_each_workload_runs_its_role_with_the_configmap_and_its_own_credential(role, name):
    fleet = fleet_from_config(config.load(K8S / "fleet.yaml"), "fleet.yaml")
    work = by_name()[name]
    pod = work["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = [a.replace("$(NODE_NAME)", "gpu-node-07").replace("$(POD_NAME)", f"{name}-abc") for a in c["args"]]
    parsed = parse(args)
    assert args[0] == role and parsed.config == "/etc/gpuvigil/fleet.yaml"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["config"]["mountPath"] == parsed.config and volumes["config"]["configMap"]["name"] == "gpuvigil-fleet"
    # The role's password file and the TLS files are where fleet.yaml says, and only its own password is mounted.
    cred = fleet.credentials[role]
    items = {i["path"] for i in volumes["nats-client"]["secret"]["items"]}
    folder = mounts["nats-client"]["mountPath"]
    for path in (cred.password_file, fleet.tls.ca, fleet.tls.cert, fleet.tls.key):
        assert Path(path).parent == Path(folder) and Path(path).name in items, path
    assert {i for i in items if i.endswith(".pw")} == {Path(cred.password_file).name}
    # The metrics port the process listens on is the one declared and annotated.
    port = parsed.port if role == "agent" else parsed.metrics_port
    assert c["ports"][0]["containerPort"] == port == int(work["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    # Detect and act stop within 5 s of SIGTERM (tests/test_fleet_ops.py): the grace leaves room.
    assert pod["terminationGracePeriodSeconds"] >= 10
    if role == "agent":
        assert parsed.spool and Path(parsed.spool).is_relative_to(mounts["state"]["mountPath"])


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("="))
    parser.optionxform = str
    parser.read_string((SYSTEMD / name).read_text())
    return parser


@pytest.mark.parametrize("role", sorted(UNITS))
def test_systemd_units_run_their_role(role):
    unit = _unit(UNITS[role])
    argv = [a for a in shlex.split(unit["Service"]["ExecStart"]) if a != "$GPUVIGIL_ARGS"]
    assert argv[0].endswith("/gpuvigil") and argv[1] == role
    parsed = parse([a.replace("%H", "host1").replace("%i", "1") for a in argv[1:]])
    assert parsed.config == "/etc/gpuvigil/fleet.yaml"
    assert unit["Service"]["KillSignal"] == "SIGTERM" and int(unit["Service"]["TimeoutStopSec"]) >= 10
    if role == "agent":
        assert Path(parsed.spool).is_relative_to(unit["Service"]["ReadWritePaths"])
    if role == "act":
        assert Path(parsed.outbox).parent == Path(unit["Service"]["ReadWritePaths"])


def test_nats_unit_runs_the_generated_config():
    unit = _unit("gpuvigil-nats.service")
    assert shlex.split(unit["Service"]["ExecStart"]) == ["/usr/bin/nats-server", "-c", "/etc/nats/nats-server.conf"]
    assert "SERVER_NAME" in (SYSTEMD / "gpuvigil-nats.service").read_text()


@pytest.mark.parametrize("name", [*UNITS.values(), "gpuvigil-nats.service"])
def test_systemd_analyze_verifies_the_units(name, tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd); the units are still parsed above")
    gpuvigil = Path(sys.executable).with_name("gpuvigil")
    if not gpuvigil.exists():
        pytest.skip("no gpuvigil console script beside this Python")
    target = tmp_path / (name.replace("@.", "@1.") if "@." in name else name)
    text = (SYSTEMD / name).read_text().replace("/opt/gpuvigil/.venv/bin/gpuvigil", str(gpuvigil))
    if name == "gpuvigil-nats.service" and shutil.which("nats-server"):
        text = text.replace("/usr/bin/nats-server", shutil.which("nats-server"))
    (tmp_path / name).write_text(text)
    done = subprocess.run([exe, "verify", str(tmp_path / name) if "@." not in name else str(target)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if name.split("@")[0] in line and "EnvironmentFile" not in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr
