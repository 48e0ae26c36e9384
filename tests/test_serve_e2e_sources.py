"""`serve`'s deployment config and sources, without external services: the strict `sources:`
model and its flags, log path patterns, never falling back to the simulator, sources that cannot
start (real processes, exit codes), and a real-source serve reading a kernel log, torch logs and
the hook receiver, with `gpuvigil_source_up` per source."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import polars as pl
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.cli.main import build_parser
from gpuvigil.config.deploy import Sources, from_config, merge_flags, parse, pattern_glob, pattern_regex, pattern_root, split_address
from gpuvigil.errors import UserError
from gpuvigil.app.serve import Server
from services import free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"


def metric(text: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


XID79 = "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus."  # tests/data/public/kernel_fallen_off_bus.log


def since_boot() -> float:
    """Now in dmesg's clock: seconds since this machine booted."""
    btime = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    return time.time() - btime


def loop_in_thread(server: Server) -> threading.Thread:
    """Run serve's loop in a thread and return once its first tick is done: tailing sources read
    what is appended from then on."""
    server.args.duration = 60
    thread = threading.Thread(target=server.loop, daemon=True)
    thread.start()
    wait_for(lambda: server.runtime.pipeline.ticks >= 1, 30, what="the first tick")
    return thread


def flags(*argv: str) -> argparse.Namespace:
    full = ["serve", *argv]
    return build_parser(full).parse_args(full)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"kernal_log": "kmsg"}, "sources.kernal_log: unknown key; did you mean 'kernel_log'?"),
        ({"schedular": "slurm"}, "did you mean 'scheduler'?"),
        ({"flightrecorder": "/x"}, "did you mean 'flight_recorder'?"),
        ({"zzz": 1}, "valid keys: node, sim, nvml, dcgm"),
        ({"act": "yes"}, "sources.act: Input should be 'off', 'dry-run' or 'on'"),
        ({"scheduler": "pbs"}, "sources.scheduler"),
        ({"dcgm": ["node7:9400"]}, "is not an http(s):// URL"),
        ({"hook": "localhost:http"}, "is not an address HOST:PORT"),
        ({"logs": ["relative/{job}.log"]}, "must be absolute"),
        ({"logs": ["/l/{job}/{job}.log"]}, "{job} may appear once"),
        ("kmsg", "must be a mapping"),
    ],
)
def test_sources_section_is_strict_and_names_the_key(raw, message):
    with pytest.raises(UserError) as err:
        parse(raw, "deploy.yaml")
    assert str(err.value).startswith("deploy.yaml: ") and message in str(err.value), str(err.value)


def test_flags_override_the_file_and_nothing_configured_is_the_simulator():
    assert not from_config({}, flags()).real  # the demo
    base = parse({"kernel_log": "/var/log/kern.log", "logs": ["/a/{job}.log"], "scheduler": "slurm", "act": "on"})
    merged = merge_flags(base, flags("--kernel-log", "kmsg", "--log", "/b/{job}/rank{rank}.log", "--log", "/c/*.log",
                                     "--act", "dry-run", "--hook-listen", ":9401", "--node", "gvnode1"))
    assert merged.kernel_log == "kmsg" and merged.logs == ["/b/{job}/rank{rank}.log", "/c/*.log"]
    assert merged.act == "dry-run" and merged.scheduler == "slurm" and merged.hook == ":9401" and merged.node_name() == "gvnode1"
    assert merge_flags(parse({}), flags("--source", "nvml", "--dcgm-url", "http://n7:9400/metrics")).dcgm == ["http://n7:9400/metrics"]
    assert Sources().act == "dry-run"  # the default: log what would be done, change nothing


@pytest.mark.parametrize(
    "file_sources, argv, message",
    [
        ({}, ["--source", "sim", "--kernel-log", "kmsg"], "cannot be combined with real sources (kernel_log)"),
        ({"sim": True, "scheduler": "slurm"}, [], "(scheduler slurm)"),
        ({}, ["--source", "sim", "--source", "nvml"], "--source sim cannot be combined"),
        ({}, ["--source", "dcgm"], "--dcgm-url"),
    ],
)
def test_the_simulator_is_never_mixed_with_real_sources(file_sources, argv, message):
    with pytest.raises(UserError, match=None) as err:
        from_config({"sources": file_sources}, flags(*argv))
    assert message in str(err.value)


@pytest.mark.parametrize(
    "pattern, path, groups",
    [
        ("/logs/{job}/rank{rank}.log", "/logs/4242/rank3.log", {"job": "4242", "rank": "3", "node": None}),
        ("/logs/{job}/rank{rank}.log", "/logs/4242/rank3.log.1", None),
        ("/logs/{job}/rank{rank}.log", "/logs/a/b/rank3.log", None),
        ("/var/log/pods/*_{job}-{rank}-*_*/*/*.log", "/var/log/pods/ml_llama-7-x9k2p_5f1e/trainer/0.log",
         {"job": "llama", "rank": "7", "node": None}),
        ("/n/{node}/*.out", "/n/gpu-07/slurm-1.out", {"job": None, "rank": None, "node": "gpu-07"}),
        ("/x/[ab]?.log", "/x/b1.log", {"job": None, "rank": None, "node": None}),
    ],
)
def test_log_patterns_give_job_rank_and_node(pattern, path, groups):
    m = pattern_regex(pattern).match(path)
    assert ({k: m.groupdict().get(k) for k in ("job", "rank", "node")} if m else None) == groups
    import fnmatch

    if groups is not None:
        assert fnmatch.fnmatch(path, pattern_glob(pattern))


def test_pattern_root_and_addresses():
    assert pattern_root("/var/log/train/{job}/rank{rank}.log") == Path("/var/log/train")
    assert pattern_root("/var/log/pods/*_{job}/*.log") == Path("/var/log/pods")
    assert split_address("0.0.0.0:9401") == ("0.0.0.0", 9401) and split_address(":9401") == ("127.0.0.1", 9401)
    assert split_address("[::1]:9401") == ("::1", 9401) and split_address("9401") == ("127.0.0.1", 9401)


def _serve_process(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuvigil", "serve", "--port", "0", "--duration", "1", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_source_that_cannot_start_exits_non_zero_naming_it(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cases = [
            (["--kernel-log", str(tmp_path / "no-such.log")], "source kernel_log:"),
            (["--kernel-log", str(tmp_path)], "source kernel_log:"),
            (["--hook-listen", f"127.0.0.1:{busy.getsockname()[1]}"], "source hook: cannot listen"),
            (["--fr-dump-dir", "/proc/gpuvigil-fr"], "source flight_recorder: cannot create /proc/gpuvigil-fr"),
        ]
        for argv, message in cases:
            done = _serve_process(tmp_path, *argv)
            assert done.returncode == 2, (argv, done.stdout, done.stderr)
            assert message in done.stderr and "simulat" not in done.stdout + done.stderr, (argv, done.stderr)
    finally:
        busy.close()


def test_sources_that_wait_for_jobs_say_so_at_start(tmp_path):
    done = _serve_process(tmp_path, "--log", str(tmp_path / "train" / "{job}" / "rank{rank}.log"), "--fr-dump-dir", str(tmp_path / "fr"))
    assert done.returncode == 0, done.stderr
    # up only once read: the start-up line waits for the first read, the next line says it is up
    assert f"source logs: {tmp_path}/train/{{job}}/rank{{rank}}.log (job, rank from the path; {tmp_path}/train does not exist yet): waiting for its first read" in done.stderr
    assert f"source logs: {tmp_path}/train/{{job}}/rank{{rank}}.log is up" in done.stderr
    assert (tmp_path / "fr").is_dir() and (tmp_path / "fr").stat().st_mode & 0o7777 == 0o1777
    assert f"source flight_recorder: {tmp_path}/fr" in done.stderr


def test_no_source_runs_the_simulator_and_says_so(tmp_path):
    done = _serve_process(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpuvigil serve: scenario healthy")
    assert "source sim: scenario healthy x1 (simulated data; nothing real is read): up" in done.stderr


def test_a_failing_source_is_down_in_the_pipeline_s_health_and_reports_why():
    """A real DCGM collector pointed at a closed port, and a collector that raises: the pipeline
    contains both, and each source's `up` and start-up line come from the pipeline's health."""
    from gpuvigil.collectors.dcgm import DcgmCollector
    from gpuvigil.app.sources import Source
    from gpuvigil.pipeline.health import HealthTracker

    class Raises:
        name, streams, errors = "boom", {}, 0

        def collect(self, now):
            raise RuntimeError("device went away")

    url = f"http://127.0.0.1:{free_port()}/metrics"
    dcgm = Source("dcgm", url, DcgmCollector(url, timeout_seconds=0.5))
    boom = Source("nvml", "NVML on gvx", Raises())
    try:
        assert not dcgm.up and not boom.up  # started, but not read yet: not up
        assert dcgm.line().endswith(": waiting for its first read")
        health = HealthTracker(down_after=3)
        dcgm.health = boom.health = health
        assert health.collect_all([dcgm.collector, boom.collector], time.time()) == []
        assert not dcgm.up and dcgm.collector.errors == 1 and [t for (c, t) in health.table if c == dcgm.collector.name] == [url]
        assert not boom.up and boom.collector.errors == 1
        assert boom.line() == "source nvml: NVML on gvx: DOWN (collect raised RuntimeError: device went away)"
    finally:
        dcgm.close()


def test_serve_reads_kernel_log_torch_logs_and_the_hook_receiver(tmp_path):
    """In process: real collectors on real files and a real HTTP hook receiver."""
    kern = tmp_path / "kern.log"
    kern.write_text("")
    logs = tmp_path / "logs"
    (logs / "777").mkdir(parents=True)
    hook_port = free_port()
    args = flags("--port", "0", "--kernel-log", str(kern), "--log", f"{logs}/{{job}}/rank{{rank}}.log",
                 "--hook-listen", f"127.0.0.1:{hook_port}", "--node", "gvx", "--hint-db", str(tmp_path / "h.sqlite"))
    server = Server(args)
    server.start()
    try:
        lines = server.describe()
        assert [line.split(":")[0] for line in lines] == ["source kernel_log", "source logs", "source hook"]
        # each is up once the pipeline has read it (the files, the receiver's queue)
        assert all(line.endswith(": waiting for its first read") for line in lines), lines
        loop_in_thread(server)
        wait_for(lambda: all(line.endswith(": up") for line in server.describe()), 30, what="every source read once")
        t = since_boot()
        with kern.open("a") as f:
            f.write(f"[{t:12.6f}] usb 1-1: new high-speed USB device number 3 using xhci_hcd\n")
            f.write(f"[{t + 0.01:12.6f}] {XID79}\n")
        # The H200 capture's lines, stamped now (glog stamps carry no year: old ones are old news).
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
        watchdog = re.sub(r"\[([IWEF])\d{4} \d\d:\d\d:\d\d", lambda m: f"[{m.group(1)}{stamp}",
                          (DATA / "h200" / "s6_nccl_watchdog_timeout.log").read_text())
        (logs / "777" / "rank0.log").write_text(watchdog)
        import gpuvigil.hook.instrument as gv

        sink = gv.HttpSink(f"http://127.0.0.1:{hook_port}/v1/hook")
        hook = gv.Hook("777", sink, rank=0, node="gvx", gpu=0, interval=0.05)
        hook.step()
        hook.publish()
        sink.close()
        assert sink.sent == 1 and sink.failed == 0

        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        text = wait_for(lambda: (t := httpx.get(url, timeout=10).text) and any(
            labels["kind"] == "xid" for labels, _ in metric(t, "gpuvigil_findings_total")) and t, 30, what="the XID finding")
        up = {labels["source"]: v for labels, v in metric(text, "gpuvigil_source_up")}
        assert up == {"kernel_log": 1, "logs": 1, "hook": 1}

        def window_has_it():
            with server.lock:
                events = server.runtime.pipeline.window.get("events")
                progress = server.runtime.pipeline.window.get("rank_progress")
            timeouts = events.filter(events["kind"] == "nccl_timeout")
            return timeouts.height and progress.height and (timeouts, progress)

        timeouts, progress = wait_for(window_has_it, 30, what="the watchdog timeout and the hook record in the window")
        assert set(timeouts["job"].to_list()) == {"777"} and set(timeouts["rank"].to_list()) == {0} and set(timeouts["node"].to_list()) == {"gvx"}
        assert progress["job"].to_list()[-1] == "777" and progress["node"].to_list()[-1] == "gvx"
        xid = next(f for f in server.runtime.pipeline.all_findings if f.kind.value == "xid")
        assert xid.node == "gvx" and xid.xid == 79
        # The watchdog's own message, read from the job's log, is a finding: rank 0 waited in
        # collective #6; the XID on its node makes the cause hardware and gvx the culprit node.
        timeout = wait_for(lambda: next((f for f in server.runtime.pipeline.all_findings if f.kind.value == "nccl_timeout"), None), 30,
                           what="the nccl_timeout finding")
        assert timeout.job == "777" and timeout.ranks == [0] and timeout.culprit_ranks == []
        assert timeout.cause == "hardware" and timeout.node == "gvx" and timeout.evidence["seq"] == 6 and timeout.evidence["op"] == "ALLREDUCE"
        assert timeout.evidence["xids"] == [79] and "collective #6 (ALLREDUCE) on rank 0 (gvx); XID 79 on gvx" in timeout.summary
        hints = [h for h in server.runtime.pipeline.all_hints if h.finding_id == timeout.id]
        assert {(h.action.value, tuple(h.exclude_nodes)) for h in hints} == {("cordon_node", ()), ("requeue_job", ("gvx",))}
    finally:
        server.stop()
        server.close()


def test_kubernetes_dry_run_says_what_it_would_cordon(tmp_path, caplog):
    """--scheduler kubernetes --act dry-run needs no API server: it describes and counts."""
    kern = tmp_path / "kern.log"
    kern.write_text("")
    args = flags("--port", "0", "--kernel-log", str(kern), "--scheduler", "kubernetes", "--act", "dry-run", "--node", "gpu-node-7",
                 "--hint-db", str(tmp_path / "h.sqlite"))
    server = Server(args)
    server.start()
    try:
        assert server.describe()[-1] == "act: dry-run on kubernetes (logs and counts what it would do; changes nothing)"
        with caplog.at_level(logging.INFO, logger="gpuvigil.app.serve"):
            thread = loop_in_thread(server)
            with kern.open("a") as f:
                f.write(f"[{since_boot():12.6f}] {XID79}\n")
            wait_for(lambda: server.acting.counts, 30, what="the dry-run")
            server.stop()
            thread.join(30)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("act dry-run (kubernetes)")]
        assert len(said) == 1 and "would run: cordon node gpu-node-7, taint gpuvigil.io/xid=" in said[0] and ":NoSchedule" in said[0], said
        hint = server.store.pending_hints()[0]
        assert hint.action.value == "cordon_node" and hint.state_reason.startswith("dry-run: would run: cordon node gpu-node-7")
        assert server.acting.counts == {("cordon_node", "dry_run"): 1}
    finally:
        server.stop()
        server.close()


def test_kubernetes_act_on_cordons_through_the_adapter(tmp_path, monkeypatch):
    """--scheduler kubernetes --act on: the XID's cordon goes through the real KubernetesAdapter
    and the official client. No API server can run here: as in test_kubernetes_adapter.py, only
    the client's urllib3 pool manager is replaced by FakeApiServer, which records the requests."""
    pytest.importorskip("kubernetes")
    from kubernetes import client

    from gpuvigil.scheduler.kubernetes import KubernetesAdapter
    from test_kubernetes_adapter import NODE, FakeApiServer, node_model

    fake = FakeApiServer()
    api_client = client.ApiClient(client.Configuration(host="https://k8s.invalid:6443"))
    api_client.rest_client.pool_manager = fake
    fake.on("GET", f"/api/v1/nodes/{NODE}", 200, node_model())
    fake.on("GET", "/api/v1/nodes", 200, client.V1NodeList(items=[node_model()]))
    monkeypatch.setattr(KubernetesAdapter, "_default_client", staticmethod(lambda: api_client))
    kern = tmp_path / "kern.log"
    kern.write_text("")
    # The XID is reported for 3 s and cleared 1 s later, and the node returns after a 1 s
    # hold-down, so the undo runs within the test.
    cfg = tmp_path / "fast-clear.yaml"
    cfg.write_text("detectors: {xid: {report_seconds: 3}}\npipeline: {clear_after_seconds: {xid: 1}}\nacting: {hold_down_seconds: 1}\n")
    server = Server(flags("--port", "0", "--kernel-log", str(kern), "--scheduler", "kubernetes", "--act", "on", "--node", NODE,
                          "--hint-db", str(tmp_path / "h.sqlite"), "--config", str(cfg)))
    server.start()
    try:
        thread = loop_in_thread(server)
        with kern.open("a") as f:
            f.write(f"[{since_boot():12.6f}] {XID79}\n")
        wait_for(lambda: server.acting.counts, 30, what="the cordon")
        hint = server.store.hints()[0]
        assert hint.state.value == "acked" and hint.state_reason.startswith(f"cordoned {NODE}")
        patches = [r for r in fake.requests if r.method == "PATCH"]
        assert any(r.path == f"/api/v1/nodes/{NODE}" and r.body.get("spec", {}).get("unschedulable") is True for r in patches), patches
        assert any(r.path == f"/api/v1/nodes/{NODE}/status" for r in patches)
        # What the API server holds now: the node cordoned and tainted by gpuvigil.
        ours = client.V1Taint(key="gpuvigil.io/xid", value=hint.finding_id, effect="NoSchedule")
        fake.on("GET", f"/api/v1/nodes/{NODE}", 200, node_model(annotations={"gpuvigil.io/cordoned-by": hint.finding_id}, unschedulable=True, taints=[ours]))
        # The cause clears and stays quiet for the hold-down: the adapter's undo runs (taint and
        # cordon removed, condition back to True).
        wait_for(lambda: server.acting.counts.get(("undo_cordon_node", "done")), 30, what="the undo")
        server.stop()
        thread.join(30)
        assert server.acting.counts == {("cordon_node", "acked"): 1, ("undo_cordon_node", "done"): 1}
        status = [r for r in fake.requests if r.method == "PATCH" and r.path == f"/api/v1/nodes/{NODE}/status"]
        assert len(status) == 2 and "True" in json.dumps(status[-1].body)
    finally:
        server.stop()
        server.close()


def test_job_map_from_the_prolog_s_files_reaches_the_window(tmp_path):
    """deploy/slurm/prolog.sh (run by a real shell) writes the GPU → job files; serve's job_map
    source reads them into `gpu_jobs`, which the pipeline joins findings and events on."""
    if subprocess.run(["sh", "-c", "command -v flock"], capture_output=True).returncode != 0:
        pytest.skip("flock (util-linux) not installed")
    jobmap = tmp_path / "job-map"
    subprocess.run(["sh", str(REPO / "deploy" / "slurm" / "prolog.sh")], check=True, timeout=30,
                   env={"PATH": os.environ["PATH"], "GPUVIGIL_JOB_MAP_DIR": str(jobmap), "SLURM_JOB_ID": "5150", "SLURM_JOB_GPUS": "1,3"})
    server = Server(flags("--port", "0", "--job-map-dir", str(jobmap), "--node", "gvx"))
    server.start()
    try:
        assert server.describe()[0] == f"source job_map: {jobmap} (job map: job-mapping dir {jobmap}): waiting for its first read"
        server.args.duration = 1.5
        server.loop()
        assert server.describe()[0] == f"source job_map: {jobmap} (job map: job-mapping dir {jobmap}): up"
        with server.lock:
            gpu_jobs = server.runtime.pipeline.window.get("gpu_jobs")
        assert sorted(gpu_jobs.select("node", "gpu", "job").unique().rows()) == [("gvx", 1, "5150"), ("gvx", 3, "5150")]
    finally:
        server.close()


@pytest.mark.parametrize("log_name, seq, op, ranks", [
    ("h200/s6_nccl_watchdog_timeout.log", 6, "ALLREDUCE", [0]),        # captured on an H200
    ("public/nccl_watchdog_reduce_scatter.log", None, None, None),      # public report: parsed, whatever it says
])
def test_watchdog_detector_on_real_logs_without_hardware_names_no_culprit(log_name, seq, op, ranks):
    """Software cause: the reporting ranks waited; no node is blamed and the requeue excludes none."""
    from gpuvigil.collectors.nccl_log import events, parse_lines
    from gpuvigil.detectors.watchdog import WatchdogTimeoutDetector
    from gpuvigil.pipeline.hints import HintPolicy
    from gpuvigil.window import Window

    now = time.time()
    parsed = parse_lines((DATA / log_name).read_text().splitlines(), reference_ts=now)
    ev = events(parsed, node="gvx", job="j1")
    ev = ev.with_columns(ts=pl.lit(now))  # as if just written (the captures' clocks are old)
    window = Window(600.0)
    window.add("events", ev)
    window.seal(now)
    found = WatchdogTimeoutDetector().detect(window)
    assert len(found) == 1
    f = found[0]
    assert f.kind.value == "nccl_timeout" and f.job == "j1" and f.cause == "software" and f.node is None and f.culprit_ranks == []
    if seq is not None:
        assert f.evidence["seq"] == seq and f.evidence["op"] == op and f.ranks == ranks
    hints = HintPolicy().hints_for(f)
    assert [(h.action.value, h.exclude_nodes) for h in hints] == [("requeue_job", [])]


def test_serve_process_pages_a_watchdog_timeout_from_a_log_whose_path_names_no_job(tmp_path):
    """`gpuvigil serve --log '<dir>/*.log'` as its own process: the real H200 watchdog timeout
    log, written into a file whose path names no job, is read, parsed and paged: the finding names
    the node and the file, carries no job, and no hint acts on a job (none is known)."""
    logs = tmp_path / "train"
    logs.mkdir()
    err = tmp_path / "serve.err"
    with err.open("w") as err_file:
        serve = subprocess.Popen(
            [sys.executable, "-m", "gpuvigil", "serve", "--port", "0", "--log", f"{logs}/*.log", "--node", "gvx", "--duration", "120"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_file, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        assert serve.stdout is not None
        started = serve.stdout.readline()
        url = re.search(r"metrics (http://\S+/metrics)", started).group(1).replace("0.0.0.0", "127.0.0.1")

        def scrape() -> str | None:
            try:
                return httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                return None

        # Files present at the first scan are read from their end: write the log after it.
        wait_for(lambda: (t := scrape()) and any(v >= 1 for _, v in metric(t, "gpuvigil_pipeline_ticks_total")), 60, what="serve's first tick")
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
        log = logs / "rank0.log"
        log.write_text(re.sub(r"\[([IWEF])\d{4} \d\d:\d\d:\d\d", lambda m: f"[{m.group(1)}{stamp}",
                              (DATA / "h200" / "s6_nccl_watchdog_timeout.log").read_text()))

        def paged() -> str | None:
            t = scrape()
            return t if t and any(l["kind"] == "nccl_timeout" and v >= 1 for l, v in metric(t, "gpuvigil_findings_total")) else None

        text = wait_for(paged, 60, what="the nccl_timeout finding in /metrics")
        assert {(l["node"], l["severity"]) for l, v in metric(text, "gpuvigil_node_findings_active") if l["kind"] == "nccl_timeout" and v >= 1} == {("gvx", "page")}
        assert {l["source"]: v for l, v in metric(text, "gpuvigil_source_up")} == {"logs": 1}
    finally:
        serve.terminate()
        serve.wait(60)
    said = err.read_text()
    assert "(no {job} in the pattern: its events carry no job; a timeout pages naming the node and file): waiting for its first read" in said, said
    found = [line for line in said.splitlines() if "finding page nccl_timeout:" in line]
    assert len(found) == 1, said
    assert found[0].endswith(f"finding page nccl_timeout: Job unknown (log gvx:{log}): the NCCL watchdog timed out collective #6 (ALLREDUCE) "
                             "on rank 0 (gvx); the ranks that did not join are not in the logs."), found
    assert "None" not in found[0]
