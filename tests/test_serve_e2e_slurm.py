"""`gpuvigil serve` as an operator runs it on a Slurm node, end to end, every part real:

- a real Slurm cluster (munged + slurmctld + two slurmd, tests/slurm_cluster.py), shared by the
  module;
- serve started as a process with a deploy config (`sources:`: kernel log file, torch logs by
  path pattern, the hook receiver, `scheduler: slurm`, `act`), or with the matching flags;
- a kernel-log file that gets real NVIDIA XID lines (wordings from tests/data/public) appended in
  dmesg form (seconds since this machine's boot) among other kernel lines;
- a batch job whose stdout carries the NCCL watchdog's real wording (the H200 capture), found by
  a log pattern without `{job}`: Slurm says whose StdOut the file is;
- a torch/gloo job on CPU submitted with sbatch (tests/serve_workers.py): two ranks writing their
  own logs and sending the in-process hook's records to serve's receiver; rank 1 stops calling
  collectives;
- a real Prometheus scraping serve, and a real Alertmanager receiving serve's alerts and routing
  them to a local webhook.

Asserted from outside the process: an XID becomes a finding, an alert and a drained node in
`scontrol show node` (--act on); a watchdog timeout in a job's stdout becomes a finding for that
job; the hang becomes a finding naming the culprit rank and a requeue
with the node excluded, after which the job runs to the end on the other node; with --act dry-run
nothing changes in Slurm and the log says what would have been done.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.alerts.alertmanager_config import alertmanager_document, prometheus_document
from obs_helpers import alert_settings_for_tests
from services import WebhookSink, binary, free_port, start_alertmanager, start_prometheus, wait_for
from slurm_cluster import SlurmCluster, missing_binaries

pytestmark = [pytest.mark.services, pytest.mark.torch, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[1]
PUBLIC = Path(__file__).parent / "data" / "public"
PY = sys.executable


def metric(text: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def dmesg(messages: list[str]) -> str:
    """Kernel messages as `dmesg` prints them: [seconds since boot] message."""
    since_boot = time.time() - boot_time()
    return "".join(f"[{since_boot + i * 0.000137:12.6f}] {m}\n" for i, m in enumerate(messages))


def real_kernel_messages() -> tuple[list[str], list[str]]:
    """(XID 79 burst, other kernel lines) with the wording of real captures, prefixes stripped."""
    strip = re.compile(r"^(?:\[[^\]]*\]\s*|[A-Z][a-z]{2} +\d+ [\d:]+ (?:\S+ )?kernel: (?:\[[^\]]*\]\s*)?)")
    xid, other = [], []
    for f in ("kernel_fallen_off_bus.log", "kernel_xids.log"):
        for line in (PUBLIC / f).read_text().splitlines():
            msg = strip.sub("", line).strip()
            if not msg:
                continue
            if "Xid" in msg and ": 79," in msg:
                xid.append(msg)
            elif "Xid" not in msg:
                other.append(msg)
    assert xid and other
    return xid, other


class World:
    def __init__(self, root: Path, cluster: SlurmCluster, webhook: WebhookSink, am, prom, serve_port: int):
        self.root, self.cluster, self.webhook, self.am, self.prom, self.serve_port = root, cluster, webhook, am, prom, serve_port
        self.kern = root / "kern.log"
        self.logs = root / "logs"
        self.logs.mkdir()
        self.kern.write_text("[    0.000000] Linux version 6.1.0-18-amd64 (debian-kernel@lists.debian.org)\n")

    def append_kernel(self) -> None:
        xid, other = real_kernel_messages()
        with self.kern.open("a") as f:
            f.write(dmesg(other[:2] + xid + other[2:]))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmd as root (SlurmdUser=root); run the tests as root")
    pytest.importorskip("torch")
    binary("prometheus")
    binary("prometheus-alertmanager", "alertmanager")
    root = tmp_path_factory.mktemp("serve-e2e")
    cleanup = []
    try:
        cluster = SlurmCluster(root / "slurm").start()
        cleanup.append(cluster.stop)
        webhook = WebhookSink().__enter__()
        cleanup.append(lambda: webhook.__exit__(None, None, None))
        am = start_alertmanager(alertmanager_document(alert_settings_for_tests(webhook.url)), root / "alertmanager")
        cleanup.append(am.stop)
        serve_port = free_port()
        prom = start_prometheus(
            prometheus_document(targets=[f"127.0.0.1:{serve_port}"], alertmanagers=[f"127.0.0.1:{am.port}"], rule_files=[],
                                scrape_interval="1s", evaluation_interval="1s", cluster="e2e"),
            root / "prometheus",
        )
        cleanup.append(prom.stop)
        yield World(root, cluster, webhook, am, prom, serve_port)
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception:  # noqa: BLE001 - keep stopping the rest
                pass


@pytest.fixture(autouse=True)
def _cluster_idle_after_each_test(world):
    yield
    world.cluster.reset()


class Serve:
    """`gpuvigil serve` as a child process, its log in a file."""

    def __init__(self, world: World, name: str, argv: list[str]):
        self.world = world
        self.log = world.root / f"serve-{name}.log"
        self.api_port = free_port()
        cmd = [PY, "-m", "gpuvigil", "serve", "--port", str(world.serve_port), "--alertmanager", world.am.url,
               "--outbox", str(world.root / f"outbox-{name}.sqlite"), "--hint-db", str(world.root / f"hints-{name}.sqlite"),
               "--api-port", str(self.api_port), "--insecure-local", *argv]
        self.proc = subprocess.Popen(cmd, cwd=world.root, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_CONF": str(world.cluster.conf)})
        first = self.proc.stdout.readline()
        if not first.startswith("gpuvigil serve:"):
            self.stop()
            raise AssertionError(f"serve did not start: {first!r}\n{self.text()[-3000:]}")
        self.first_line = first
        self.metrics_url = first.split("metrics ", 1)[1].split(";")[0].strip()
        self.api = f"http://127.0.0.1:{self.api_port}/v1"
        # Sources that tail read what is appended after their first read: wait for the first tick.
        wait_for(lambda: any(v >= 1 for _, v in metric(self.metrics(), "gpuvigil_pipeline_ticks_total")), 30, what="serve's first tick")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text

    def hints(self) -> list[dict]:
        return httpx.get(f"{self.api}/hints", timeout=10).json()["hints"]

    def findings(self) -> list[dict]:
        return httpx.get(f"{self.api}/findings", timeout=10).json()["findings"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def deploy_yaml(world: World, path: Path, **sources) -> Path:
    doc = {
        "sources": {
            "kernel_log": str(world.kern),
            "logs": [f"{world.logs}/{{job}}/rank{{rank}}.log"],
            "scheduler": "slurm",
            **sources,
        }
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def node_record(world: World, node: str) -> str:
    return world.cluster.cmd("scontrol", "-o", "show", "node", node).stdout


def prom_query(world: World, q: str) -> list[dict]:
    r = httpx.get(f"{world.prom.url}/api/v1/query", params={"query": q}, timeout=10).json()
    return r["data"]["result"] if r.get("status") == "success" else []


def alerts_for(world: World, **labels) -> list[dict]:
    out = []
    for _path, n in world.webhook.notifications():
        for a in n.get("alerts", []):
            if a.get("status") == "firing" and all(a["labels"].get(k) == v for k, v in labels.items()):
                out.append(a)
    return out


def am_alerts(world: World, **labels) -> list[dict]:
    matchers = [f'{k}="{v}"' for k, v in labels.items()]
    return httpx.get(f"{world.am.url}/api/v2/alerts", params={"filter": matchers}, timeout=10).json()


def test_xid_in_the_kernel_log_drains_the_node_and_alerts(world):
    hook_port = free_port()
    cfg = deploy_yaml(world, world.root / "deploy-on.yaml", node="gvnode1", hook=f"127.0.0.1:{hook_port}", act="on")
    serve = Serve(world, "xid", ["--config", str(cfg)])
    try:
        start = serve.text()
        # Each source is named at start; one read by a collector is up only after its first read.
        for kind in ("kernel_log", "logs", "hook", "scheduler"):
            assert re.search(rf"source {kind}: .*(: up|: waiting for its first read| is up)$", start, re.M), start
        assert "act: on on slurm" in start

        def every_source_up():
            up = {labels["source"]: v for labels, v in metric(serve.metrics(), "gpuvigil_source_up")}
            return up if up == {"kernel_log": 1, "logs": 1, "hook": 1, "scheduler": 1} else None

        wait_for(every_source_up, 30, what="every source up after its first read")

        world.append_kernel()

        def drained():
            rec = node_record(world, "gvnode1")
            return rec if "DRAIN" in rec.split("State=", 1)[1].split()[0] else None

        rec = world.cluster.wait_for(drained, 30, "gvnode1 drained by serve")
        assert re.search(r"Reason=gpuvigil cordon xid \S+: xid: XID 79", rec), rec
        text = serve.metrics()
        assert any(labels["kind"] == "xid" and v >= 1 for labels, v in metric(text, "gpuvigil_findings_total"))
        acted = {(labels["action"], labels["mode"], labels["outcome"]): v for labels, v in metric(text, "gpuvigil_actions_total")}
        assert acted.get(("cordon_node", "on", "acked"), 0) >= 1, acted
        hint = next(h for h in serve.hints() if h["action"] == "cordon_node")
        assert hint["node"] == "gvnode1" and hint["state"] == "acked" and hint["state_reason"].startswith("scontrol drained gvnode1")
        alert = wait_for(lambda: alerts_for(world, kind="xid", node="gvnode1"), 30, what="the XID alert at the webhook")[0]
        assert alert["labels"]["severity"] == "page"
        scraped = wait_for(lambda: prom_query(world, 'gpuvigil_actions_total{action="cordon_node",outcome="acked"}'), 30,
                           what="Prometheus to scrape serve's action counter")
        assert float(scraped[0]["value"][1]) >= 1
        assert wait_for(lambda: prom_query(world, 'gpuvigil_source_up{source="kernel_log"} == 1'), 30, what="source up in Prometheus")
        assert re.search(r"act on \(slurm\): hint cordon_node \S+ acked: scontrol drained gvnode1", serve.text())
    finally:
        assert serve.stop() == 0, serve.text()[-3000:]


def test_hang_names_the_culprit_rank_and_requeues_the_job_away_from_its_node(world):
    hook_port = free_port()
    cfg = deploy_yaml(world, world.root / "deploy-hang.yaml", node="gvnode1", hook=f"127.0.0.1:{hook_port}", act="on")
    serve = Serve(world, "hang", ["--config", str(cfg)])
    try:
        hook_url = f"http://127.0.0.1:{hook_port}/v1/hook"
        job = world.cluster.sbatch("--requeue", "-N1", "--gres=gpu:2",
                                   "--wrap", f"{PY} {REPO / 'tests' / 'serve_workers.py'} {hook_url} {world.logs}")

        def running_node():
            return world.cluster.job_field(job, "NodeList") if world.cluster.job_field(job, "JobState") == "RUNNING" else None

        first_node = world.cluster.wait_for(running_node, 60, f"job {job} running")
        finding = wait_for(lambda: next((f for f in serve.findings() if f["kind"] == "collective_hang" and f["job"] == job), None),
                           90, what="the hang finding")
        assert finding["culprit_ranks"] == [1], finding
        assert "rank 1" in finding["summary"] and first_node in finding["summary"], finding["summary"]

        def requeued_excluding():
            return world.cluster.job_field(job, "ExcNodeList") == first_node and int(world.cluster.job_field(job, "Restarts")) >= 1

        world.cluster.wait_for(requeued_excluding, 60, f"job {job} requeued excluding {first_node}")
        hint = next(h for h in serve.hints() if h["action"] == "requeue_job" and h["job"] == job)
        assert hint["exclude_nodes"] == [first_node] and hint["state"] == "acked", hint
        assert f"excluding {first_node}" in hint["state_reason"]
        # The requeued run goes elsewhere and trains to the end.
        world.cluster.wait_for(lambda: world.cluster.job_field(job, "JobState") == "COMPLETED", 120, f"job {job} completed after requeue")
        other = world.cluster.job_field(job, "NodeList")
        assert other != first_node
        rank0 = (world.logs / job / "rank0.log").read_text()
        assert "trained to the end" in rank0 and "waiting for rank 1" in rank0
        log = serve.text()
        assert f"logs: reading {world.logs}/{job}/rank0.log (job {job}, rank 0)" in log
        assert re.search(rf"act on \(slurm\): hint requeue_job \S+ acked: job {job} requeued, excluding {first_node}", log), log[-3000:]
        # At Alertmanager (its webhook may stay silent: a job alert on a node with a fatal XID
        # alert from the test before is inhibited, as the shipped routing wants).
        alert = wait_for(lambda: am_alerts(world, kind="collective_hang", job=job), 30, what="the hang alert at Alertmanager")[0]
        assert alert["labels"]["severity"] == "page" and "rank 1" in alert["annotations"]["summary"]
    finally:
        assert serve.stop() == 0, serve.text()[-3000:]


def test_dry_run_changes_nothing_in_slurm_and_says_what_it_would_do(world):
    ctld_log = world.root / "slurm" / "log" / "slurmctld.log"

    def gvnode2_updates() -> list[str]:  # slurmctld logs every node update: "update_node: node gvnode2 ..."
        return [line for line in ctld_log.read_text().splitlines() if "update_node: node gvnode2" in line]

    before = gvnode2_updates()
    serve = Serve(world, "dry", ["--kernel-log", str(world.kern), "--scheduler", "slurm", "--act", "dry-run", "--node", "gvnode2"])
    try:
        assert "act: dry-run on slurm" in serve.text()
        world.append_kernel()
        line = wait_for(lambda: re.search(r"act dry-run \(slurm\): hint cordon_node (\S+): would run: scontrol update NodeName=gvnode2 State=DRAIN "
                                          r'Reason="gpuvigil cordon xid', serve.text()), 30, what="the dry-run log line")
        hint = next(h for h in serve.hints() if h["id"] == line.group(1))
        assert hint["state"] == "pending" and hint["state_reason"].startswith("dry-run: would run: scontrol update NodeName=gvnode2")
        acted = {(labels["action"], labels["mode"], labels["outcome"]): v for labels, v in metric(serve.metrics(), "gpuvigil_actions_total")}
        assert acted == {("cordon_node", "dry-run", "dry_run"): 1}, acted
        # What the same tick would have run did not run: gvnode2 is as it was, and slurmctld never heard of it.
        assert "DRAIN" not in node_record(world, "gvnode2").split("State=", 1)[1].split()[0]
        assert world.cluster.node_state("gvnode2")[0] == "idle"
        assert gvnode2_updates() == before
    finally:
        assert serve.stop() == 0, serve.text()[-3000:]


def test_watchdog_timeout_in_a_job_s_stdout_is_a_finding_for_that_job(world):
    """`logs: [.../job-*.out]` names no job: serve asks Slurm whose StdOut the file is."""
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
    capture = (Path(__file__).parent / "data" / "h200" / "s6_nccl_watchdog_timeout.log").read_text()
    lines = world.root / "watchdog-lines.log"
    lines.write_text(re.sub(r"\[([IWEF])\d{4} \d\d:\d\d:\d\d", lambda m: f"[{m.group(1)}{stamp}", capture))
    out_glob = f"{world.cluster.root}/log/job-*.out"  # where tests/slurm_cluster.py's sbatch sends stdout
    serve = Serve(world, "stdout", ["--log", out_glob, "--scheduler", "slurm", "--act", "dry-run", "--node", "gvnode1"])
    try:
        assert "job from Slurm (the job whose StdOut/StdErr is the file)" in serve.text()
        job = world.cluster.sbatch("-w", "gvnode1", "--wrap", f"sleep 3; cat {lines}; sleep 120")
        finding = wait_for(lambda: next((f for f in serve.findings() if f["kind"] == "nccl_timeout" and f["job"] == job), None),
                           60, what="the watchdog finding")
        assert finding["ranks"] == [0] and finding["evidence"]["seq"] == 6 and finding["cause"] == "software", finding
        assert f"logs: reading {world.cluster.root}/log/job-{job}.out (job {job}, rank ?)" in serve.text()
        # dry-run: the requeue is only described (no node excluded: the logs do not name a culprit).
        wait_for(lambda: re.search(rf"act dry-run \(slurm\): hint requeue_job \S+: would run: scontrol requeue {job}$", serve.text(), re.M),
                 30, what="the dry-run requeue line")
        assert world.cluster.job_field(job, "JobState") == "RUNNING" and world.cluster.job_field(job, "Restarts") == "0"
    finally:
        assert serve.stop() == 0, serve.text()[-3000:]
