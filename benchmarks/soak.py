"""`gpuvigil bench soak`: `gpuvigil serve` for minutes (or hours) at 10,000 simulated GPUs while
things go wrong around it, and what it kept doing.

Set-up: the simulated cluster (1,250 nodes × 8 GPUs by default) in a steady state: about 60% of the
GPUs busy from the start, training jobs each completing after an exponential run time and replaced
by the next job of its slot when it completes (a closed loop, `job_plan`), so the number of running
jobs and of busy GPUs stays level while jobs come and go;
node faults replayed from the InfiniteHBD trace
(tests/data/traces/infinitehbd-faults-full: 584 faults on 231 servers over 349 days) in the
trace's order and spacing, time compressed (`--day-seconds` simulated seconds per trace day; the
trace's 231 faulty servers are mapped onto 231 of the simulated nodes' jobs). A real Alertmanager
routes every alert to a webhook in this process (the pager); the feedback API is up; client
threads poll it (verdicts, node health, findings, hints) and follow the hint stream (SSE,
resuming with Last-Event-ID). The SQLite files (hint store, alert outbox) live on a small tmpfs
mounted for the run (root), so the disk can be filled for real.

During the run: Alertmanager is restarted; `serve` is killed with SIGKILL and started again (the
simulated cluster lives in the killed process, so the new one is rebuilt and continues the fault
schedule where the old one stopped); the tmpfs is filled until writes fail, held, and freed.

Reported (docs/reliability.md): serve's RSS slope, read only once the last serve's windows are full
and the disk is free again, with the running-job count in that window (from `/metrics`); tick time
p99 against the tick period; page findings raised vs paged (none lost, none paged twice); API
requests/s and p99 (serve runs the API as its own process; the polling clients run in theirs);
CPU time of serve and of its API process, which the shared machine's load does not inflate.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from benchmarks.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "data" / "traces" / "infinitehbd-faults-full" / "fault_trace.json"
TOKEN = "soak-token-0123456789abcdef0123"
DOC = REPO / "docs" / "reliability.md"

# Trace fault descriptions -> the simulator's fault with the closest observable effect.
FAULT_MAP = [
    (r"ECC", "ecc_dbe"),
    (r"GPU (xid|Lost|device|P2P)|nvidia-smi|Silent Data|device not found", "gpu_lost"),
    (r"Link Down|NIC|Rnic|cable|Optical", "nccl_hang"),
    (r"Temperature|Fan", "thermal"),
    (r"PCI link", "pcie_replay"),
    (r"Power", "power_excursion"),
]


# -- scenario -------------------------------------------------------------------------------
def trace_faults(day_seconds: float, horizon: float, seed: int) -> list[dict[str, Any]]:
    events = json.loads(TRACE.read_text())
    starts = sorted((e for e in events if e["event_type"] == "fault_start"), key=lambda e: e["event_time"])
    t0 = starts[0]["event_time"]
    out = []
    for e in starts:
        at = (e["event_time"] - t0) * day_seconds + 30.0  # the first fault 30 s in
        if at >= horizon:
            break
        desc = e["fault_type"]["Desc"]
        kind = next((k for pattern, k in FAULT_MAP if re.search(pattern, desc, re.I)), "restart")
        out.append({"at": round(at, 1), "type": kind, "node_id": e["node_id"], "desc": desc})
    return out


JOB_MEAN_SECONDS = 240.0  # mean run time of a training job in the soak (exponential)
JOB_STARTUP_SECONDS = 10.0  # the simulator's default start-up time of a job


def job_plan(gpus: int, sim_seconds: float, seed: int) -> list[dict[str, Any]]:
    """Jobs in a steady state from the start, as a closed loop: a fixed number of job slots (60%
    of the GPUs busy on average), each running jobs of its own size back to back; each job runs an
    exponential time (mean JOB_MEAN_SECONDS; the first one of a slot the residual time, which for
    an exponential is the same distribution) and its successor is submitted when it completes
    (JobConfig.total_steps). Jobs keep arriving and completing at the rate of a Poisson stream of
    the same mean, but the number of running jobs and of busy GPUs stays level by construction.
    An open Poisson stream wandered too much for the RSS slope: with seed 0 the busy GPUs rose
    from 5,200 to 7,100 (+36%) inside the 7-minute window where the slope is read, and serve's
    memory follows the number of running ranks, so the slope measured the workload."""
    rng = random.Random(seed)
    nodes = max(2, gpus // 8)
    sizes = [8, 8, 16, 16, 32, 64, 128]
    sizes = [x for x in sizes if x <= 0.1 * nodes * 8] or [8]
    slots = max(1, round(0.6 * nodes * 8 / statistics.fmean(sizes)))  # 60% of GPUs busy
    plan = []
    for k in range(slots):
        size = sizes[k % len(sizes)]  # every size in its proportion, for good
        submit = 0.0
        while submit < sim_seconds:
            step = round(rng.uniform(0.5, 3.0), 2)
            run = rng.expovariate(1.0 / JOB_MEAN_SECONDS)
            job = {"gpus": size, "gpus_per_node": 8, "step_time_seconds": step,
                   "collectives_per_step": 4, "checkpoint_every_steps": 400, "checkpoint_seconds": 10, "memory_base_gib": 30,
                   "memory_peak_gib": round(rng.uniform(60, 110), 1), "tenant": rng.choice(["research", "prod", "vision"]), "submit_at": round(submit, 1),
                   "total_steps": max(1, round(run / step))}
            plan.append(job)
            submit = math.ceil(_end(job) * 10) / 10  # the slot's next job, when this one completes
    plan.sort(key=lambda j: j["submit_at"])
    return [{"name": f"train-{i:04d}", **j} for i, j in enumerate(plan)]


def _end(job: dict[str, Any]) -> float:
    """When the job is expected to complete (no queueing, slowdowns or checkpoints counted)."""
    return job["submit_at"] + JOB_STARTUP_SECONDS + job["total_steps"] * job["step_time_seconds"]


def scenario(gpus: int, sim_seconds: float, day_seconds: float, seed: int, offset: float = 0.0) -> dict[str, Any]:
    """The soak scenario; `offset` drops what happened before it (a restarted serve continues
    the schedule: jobs running then continue with the steps they had left) and shifts the rest
    to start at 0."""
    rng = random.Random(seed + 1)
    nodes = max(2, gpus // 8)
    jobs = job_plan(gpus, sim_seconds, seed)
    faults = []
    node_to_job: dict[str, str] = {}
    by_name = {j["name"]: j for j in jobs}
    for f in trace_faults(day_seconds, sim_seconds + offset, seed):
        # A trace server's faults hit the job running on it; when that job has left, another one.
        job = node_to_job.get(f["node_id"])
        if job is None or not by_name[job]["submit_at"] + JOB_STARTUP_SECONDS <= f["at"] < _end(by_name[job]) - 30:
            live = [j["name"] for j in jobs if j["submit_at"] + JOB_STARTUP_SECONDS <= f["at"] < _end(j) - 30]
            if not live:
                continue
            job = node_to_job[f["node_id"]] = rng.choice(live)
        faults.append({"type": f["type"], "at": f["at"], "job": job})
    shifted_jobs = []
    for j in jobs:
        if _end(j) <= offset:
            continue  # completed before the restart
        if j["submit_at"] < offset:
            done = max(0.0, offset - j["submit_at"] - JOB_STARTUP_SECONDS) / j["step_time_seconds"]
            j = {**j, "submit_at": 0.0, "total_steps": max(1, round(j["total_steps"] - done))}
        else:
            j = {**j, "submit_at": round(j["submit_at"] - offset, 1)}
        shifted_jobs.append(j)
    kept = {j["name"] for j in shifted_jobs}
    shifted_faults = [{**f, "at": round(f["at"] - offset, 1)} for f in faults if f["at"] >= offset and f["job"] in kept]
    return {
        "name": "soak",
        "description": "soak: InfiniteHBD fault arrivals, time-compressed, on a 10k-GPU simulated cluster",
        "duration_seconds": sim_seconds + 60,
        "nodes": nodes,
        "jobs": shifted_jobs,
        "background": {"jobs": max(1, nodes // 20), "sizes": [1, 2, 4]},
        "faults": shifted_faults,
    }


# -- the pager: Alertmanager's webhook ---------------------------------------------------------
@dataclass
class Pager:
    notifications: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> tuple[ThreadingHTTPServer, str]:
        pager = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with pager.lock:
                    pager.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}/hook"

    def pages(self) -> dict[str, int]:
        """finding id -> how many notifications paged it as firing."""
        out: dict[str, int] = {}
        with self.lock:
            for n in self.notifications:
                for a in n.get("alerts", []):
                    if a.get("status") == "firing" and a.get("labels", {}).get("severity") == "page":
                        fid = a.get("annotations", {}).get("finding_id", "")
                        out[fid] = out.get(fid, 0) + 1
        return out

    def duplicates(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Duplicate pages and re-pages.

        An incident is (finding id, startsAt): gpuvigil keeps startsAt while the finding stays
        active and starts a new one after it cleared. A *duplicate page* is a notification whose
        firing page alerts were all paged before, same incident: it told on-call nothing new.
        (A group notification that adds a new alert and lists the group's older ones again is
        not.) A *re-page* is a finding paged again as a new incident, after it cleared."""
        seen: set[tuple[str, str]] = set()
        first_start: dict[str, str] = {}
        dups: list[dict[str, Any]] = []
        repaged: set[str] = set()
        with self.lock:
            notes = list(self.notifications)
        for n in notes:
            firing = {
                (a.get("annotations", {}).get("finding_id", ""), a.get("startsAt", "")): a
                for a in n.get("alerts", [])
                if a.get("status") == "firing" and a.get("labels", {}).get("severity") == "page"
            }
            if firing and not set(firing) - seen:
                for (fid, start), a in firing.items():
                    dups.append({"finding_id": fid, "startsAt": start, "labels": a.get("labels", {})})
            for fid, start in firing:
                if first_start.setdefault(fid, start) != start:
                    repaged.add(fid)
            seen |= set(firing)
        return dups, sorted(repaged)


def start_alertmanager(workdir: Path, port: int, hook: str) -> subprocess.Popen:
    exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if exe is None:
        from gpuvigil.errors import UserError

        raise UserError("the soak needs a real Alertmanager (apt-get install prometheus-alertmanager)")
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "route": {"receiver": "pager", "group_by": ["alertname", "job", "node", "gpu"], "group_wait": "1s", "group_interval": "5s", "repeat_interval": "24h"},
        "receivers": [{"name": "pager", "webhook_configs": [{"url": hook, "send_resolved": False}]}],
    }
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [exe, f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", "--log.level=warn"],
        stdout=(workdir / "alertmanager.log").open("a"), stderr=subprocess.STDOUT,
    )
    _wait_http(f"http://127.0.0.1:{port}/-/ready", proc)
    return proc


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


# -- serve --------------------------------------------------------------------------------------
def start_serve(workdir: Path, db_dir: Path, scen: dict[str, Any], am_url: str, metrics_port: int, api_port: int, tick_seconds: float, gen: int) -> subprocess.Popen:
    scen_path = workdir / f"scenario-{gen}.yaml"
    scen_path.write_text(yaml.safe_dump(scen, sort_keys=False))
    cfg_path = workdir / "config.yaml"
    # Horizons of 180 s (the shipped ones go up to 600 s, and 3600 s for events) so that the
    # restarted serve's windows are full, and its RSS can be read for growth, within the run.
    cfg_path.write_text(yaml.safe_dump({"pipeline": {"tick_seconds": tick_seconds, "horizon_seconds": {"default": HORIZON, "events": HORIZON}}}))
    (workdir / "token").write_text(TOKEN)
    log = (workdir / f"serve-{gen}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuvigil", "serve", "--source", "sim", "--scenario", str(scen_path), "--config", str(cfg_path),
         "--port", str(metrics_port), "--alertmanager", am_url, "--outbox", str(db_dir / "outbox.sqlite"),
         "--hint-db", str(db_dir / "hints.sqlite"), "--api-port", str(api_port), "--api-token-file", str(workdir / "token"), "--log-level", "warning",
         "--tick-log", str(workdir / f"ticks-{gen}.log")],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    _wait_http(f"http://127.0.0.1:{api_port}/healthz", proc, timeout=600)
    return proc


def _api_child(pid: int) -> int | None:
    """serve's API process (gpuvigil/api/process.py): its one child."""
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids = (task / "children").read_text().split()
            if kids:
                return int(kids[0])
    except OSError:
        return None
    return None


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> tuple[float, float, float] | None:
    """(resident, anonymous, file-backed) MB from one read of /proc/PID/status: growth of a heap
    shows in the anonymous part, of mapped files (SQLite, libraries) in the file-backed one."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile"))  # type: ignore[return-value]
    except (OSError, KeyError, ValueError):
        return None


# -- clients ------------------------------------------------------------------------------------
@dataclass
class Clients:
    api: str
    stop: threading.Event = field(default_factory=threading.Event)
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    refused: int = 0
    sse_events: int = 0
    sse_reconnects: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def poll(self, k: int) -> None:
        # The raw-socket client of `bench api` (a few µs per request): the latency measured is
        # serve's, not a Python HTTP client's competing for this process's GIL with the others.
        from benchmarks.api import RawClient

        rng = random.Random(k)
        jobs: list[str] = []
        nodes: list[str] = []
        client: RawClient | None = None
        i = 0
        while not self.stop.is_set():
            i += 1
            if jobs and i % 4 == 0:
                path = f"/v1/jobs/{rng.choice(jobs)}/verdict"
            elif nodes and i % 4 == 1:
                path = f"/v1/nodes/{rng.choice(nodes)}/health"
            elif i % 4 == 2:
                path = "/v1/hints?limit=100"
            else:
                path = "/v1/findings?active=true&limit=200"
            try:
                if client is None:
                    client = RawClient(self.api, TOKEN)
                t0 = time.perf_counter()
                status, body = client.get(path)
            except (OSError, ValueError, IndexError):
                if client is not None:
                    client.close()
                    client = None
                with self.lock:
                    self.refused += 1
                self.stop.wait(0.5)
                continue
            dt = time.perf_counter() - t0
            with self.lock:
                self.latencies.append(dt)
                if status not in (200, 404):
                    self.errors += 1
            if path.startswith("/v1/findings") and status == 200:
                found = json.loads(body)["findings"]
                jobs = sorted({f["job"] for f in found if f.get("job")}) or jobs
                nodes = sorted({f["node"] for f in found if f.get("node")}) or nodes
            self.stop.wait(0.05)
        if client is not None:
            client.close()

    def stream(self) -> None:
        import httpx

        last_id: str | None = None
        while not self.stop.is_set():
            headers = {"Authorization": f"Bearer {TOKEN}"} | ({"Last-Event-ID": last_id} if last_id else {})
            try:
                with httpx.stream("GET", f"{self.api}/v1/hints/stream" + ("" if last_id else "?after_seq=0"), headers=headers, timeout=httpx.Timeout(10, read=30)) as r:
                    for line in r.iter_lines():
                        if self.stop.is_set():
                            return
                        if line.startswith("id: "):
                            last_id = line[4:]
                            with self.lock:
                                self.sse_events += 1
            except httpx.HTTPError:
                pass
            with self.lock:
                self.sse_reconnects += 1
            self.stop.wait(1.0)


def _poll_process(api: str, n: int, stop: Any, out: Any) -> None:
    """The polling clients (their own process; see `run`): latencies, errors, refusals back."""
    clients = Clients(api)
    threads = [threading.Thread(target=clients.poll, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    stop.wait()
    clients.stop.set()
    for t in threads:
        t.join(35)
    out.put((clients.latencies, clients.errors, clients.refused))


# -- the run ------------------------------------------------------------------------------------
def _mount_tmpfs(path: Path, mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)], capture_output=True).returncode == 0


def _fill(path: Path) -> int:
    """Write a filler file until the file system is full; return the bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    try:
        with open(path / "filler", "wb") as fh:
            while True:
                fh.write(chunk)
                fh.flush()
                written += len(chunk)
    except OSError:
        pass
    return written


SCRAPE_SECONDS = 60.0  # Prometheus' default scrape interval
HORIZON = 180.0  # the soak's window horizon (seconds) for every stream


def _scrape(url: str) -> tuple[dict[str, float], dict[float, float], float | None]:
    """Selected gauges/counters, the tick-duration histogram (le -> cumulative count), and how
    long the scrape took (None when it failed)."""
    import httpx

    out: dict[str, float] = {}
    buckets: dict[float, float] = {}
    t0 = time.monotonic()
    try:
        text = httpx.get(url, timeout=120).text
    except httpx.HTTPError:
        return out, buckets, None
    took = time.monotonic() - t0
    for line in text.splitlines():
        if line.startswith("gpuvigil_pipeline_tick_duration_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("gpuvigil_job_info{") and 'state="running"' in line and 'job="train-' in line:
            out["running_training_jobs"] = out.get("running_training_jobs", 0) + 1
        elif line.startswith(("gpuvigil_pipeline_last_tick_duration_seconds ", "gpuvigil_pipeline_ticks_total ", "gpuvigil_pipeline_ticks ")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out, buckets, took


def _bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile q (a bound, not an estimate)."""
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return float("nan")
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            return le
    return float("inf")


def run(minutes: float, gpus: int, day_seconds: float, tick_seconds: float, seed: int, workdir: Path, log=print) -> dict[str, Any]:
    wall = minutes * 60
    sim_seconds = wall  # --speed 1: simulated time runs with the wall clock
    db_dir = workdir / "db"
    tmpfs = _mount_tmpfs(db_dir, 48)
    log(f"soak: {gpus} GPUs, {minutes:g} min, SQLite on {'a 48 MB tmpfs' if tmpfs else 'the work dir (not root: no disk-full phase)'}")
    pager = Pager()
    hook_server, hook = pager.start()
    am_port, metrics_port, api_port = free_port(), free_port(), free_port()
    am = start_alertmanager(workdir / "am", am_port, hook)
    am_url = f"http://127.0.0.1:{am_port}"
    scen0 = scenario(gpus, sim_seconds, day_seconds, seed)
    injected = [f for f in scen0["faults"]]
    serve = start_serve(workdir, db_dir, scen0, am_url, metrics_port, api_port, tick_seconds, 0)
    t_start = time.monotonic()
    clients = Clients(f"http://127.0.0.1:{api_port}")
    # The polling clients run in a process of their own: in this one they would wait for its
    # GIL behind the scraper (which parses ~240,000 lines of /metrics) and count that as API time.
    mp = multiprocessing.get_context("spawn")
    poll_stop, poll_out = mp.Event(), mp.Queue()
    pollers = mp.Process(target=_poll_process, args=(clients.api, 3, poll_stop, poll_out), daemon=True)
    pollers.start()
    threads = [threading.Thread(target=clients.stream, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    rss: list[tuple[float, float, int]] = []
    rss_parts: list[tuple[float, float, float, int]] = []
    api_rss: list[tuple[float, float, int]] = []
    running_jobs: list[tuple[float, int, int]] = []
    ticks: list[float] = []
    events: list[str] = []
    hist_by_gen: dict[int, dict[float, float]] = {}
    scrape_seconds: list[float] = []
    current_gen = [0]

    def scraper() -> None:
        # Its own thread, as Prometheus is its own process: a slow scrape must not stop the
        # RSS sampling and the fault schedule.
        last_n = None
        while not clients.stop.is_set():
            m, hist, took = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            if took is not None:
                scrape_seconds.append(took)
                running_jobs.append((time.monotonic() - t_start, int(m.get("running_training_jobs", 0)), current_gen[0]))
            if hist:
                hist_by_gen[current_gen[0]] = hist  # cumulative per process: the latest scrape holds all its ticks
            n = m.get("gpuvigil_pipeline_ticks_total", m.get("gpuvigil_pipeline_ticks"))
            if n is not None and n != last_n and "gpuvigil_pipeline_last_tick_duration_seconds" in m:
                ticks.append(m["gpuvigil_pipeline_last_tick_duration_seconds"])
                last_n = n
            clients.stop.wait(SCRAPE_SECONDS)

    scrape_thread = threading.Thread(target=scraper, daemon=True)
    scrape_thread.start()
    # Everything that disturbs serve happens in the first half: serve is killed early, so that
    # the process that runs to the end has its windows full (HORIZON after its start) for most of
    # the run, and the disk is full and freed again (the ticks that could not be written are
    # kept in memory meanwhile) before the RSS slope is read, from the later of the two on.
    plan = {0.1: "kill_serve", 0.25: "fill_disk", 0.35: "free_disk", 0.45: "restart_alertmanager"}
    freed_at = 0.0
    loads = [os.getloadavg()[0]]
    last_start = 0.0
    done: set[float] = set()
    gen = 0
    fill_written = 0
    serve_alive_through_full_disk = None
    while (elapsed := time.monotonic() - t_start) < wall:
        for frac, what in plan.items():
            if frac in done or elapsed < frac * wall:
                continue
            done.add(frac)
            if what == "restart_alertmanager":
                am.terminate()
                am.wait(30)
                am = start_alertmanager(workdir / "am", am_port, hook)
                events.append(f"{elapsed:.0f} s: Alertmanager restarted (SIGTERM, same storage)")
            elif what == "kill_serve":
                serve.send_signal(signal.SIGKILL)
                serve.wait(30)
                gen += 1
                t0 = time.monotonic()
                serve = start_serve(workdir, db_dir, scenario(gpus, sim_seconds, day_seconds, seed, offset=elapsed), am_url, metrics_port, api_port, tick_seconds, gen)
                last_start = time.monotonic() - t_start
                events.append(f"{elapsed:.0f} s: serve killed (SIGKILL) and started again; API back after {time.monotonic() - t0:.0f} s")
            elif what == "fill_disk" and tmpfs:
                fill_written = _fill(db_dir)
                events.append(f"{elapsed:.0f} s: tmpfs holding the SQLite files filled ({fill_written >> 20} MB written until ENOSPC)")
            elif what == "free_disk" and tmpfs:
                serve_alive_through_full_disk = serve.poll() is None
                (db_dir / "filler").unlink(missing_ok=True)
                freed_at = elapsed
                events.append(f"{elapsed:.0f} s: filler deleted; serve {'still running' if serve_alive_through_full_disk else 'HAD EXITED'}")
        current_gen[0] = gen
        if len(loads) < 1 + int(elapsed // 60):
            loads.append(os.getloadavg()[0])
        r = rss_mb(serve.pid)
        if r is not None:
            rss.append((elapsed, r[0], gen))
            rss_parts.append((elapsed, r[1], r[2], gen))
        api_pid = _api_child(serve.pid)
        r = rss_mb(api_pid) if api_pid else None
        if r is not None:
            api_rss.append((elapsed, r[0], gen))
        if serve.poll() is not None and not any("serve exited" in e for e in events):
            events.append(f"{elapsed:.0f} s: serve exited with {serve.returncode} (see serve-{gen}.log)")
        time.sleep(min(1.0, tick_seconds / 2))
    m, hist, took = _scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    if hist:
        hist_by_gen[gen] = hist
    if took is not None:
        scrape_seconds.append(took)
    # CPU time (not polluted by the shared machine's load, unlike wall time) of the last serve
    # and of its API process, over their lives.
    api_pid = _api_child(serve.pid)
    serve_cpu = _cpu_seconds(serve.pid)
    api_cpu = _cpu_seconds(api_pid) if api_pid else None
    serve_life = time.monotonic() - t_start - last_start
    clients.stop.set()
    poll_stop.set()
    try:
        clients.latencies, clients.errors, clients.refused = poll_out.get(timeout=120)
    except Exception:  # noqa: BLE001 - the figures are then missing, not the rest of the report
        log("soak: the polling clients' process did not report")
    pollers.join(30)
    serve.terminate()
    try:
        serve.wait(60)
    except subprocess.TimeoutExpired:
        serve.kill()
    time.sleep(3)  # Alertmanager's group_wait for the last alerts
    for t in threads:
        t.join(35)
    am.terminate()
    am.wait(30)
    hook_server.shutdown()
    # What gpuvigil raised: page findings in the hint store.
    import sqlite3

    db = sqlite3.connect(db_dir / "hints.sqlite")
    raised = {r[0] for r in db.execute("SELECT id FROM findings WHERE severity = 'page'")}
    db.close()
    out = sqlite3.connect(db_dir / "outbox.sqlite")
    left = out.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    dead = out.execute("SELECT COUNT(*) FROM dead_letter").fetchone()[0]
    out.close()
    pages = pager.pages()
    dups, repaged = pager.duplicates()
    ticks_per_gen = [_tick_log(workdir / f"ticks-{g}.log") for g in range(gen + 1)]
    tick_rows = [row for rows in ticks_per_gen for row in rows]
    if tmpfs:
        subprocess.run(["umount", str(db_dir)], capture_output=True)
    lat = sorted(clients.latencies)
    merged: dict[float, float] = {}
    for h in hist_by_gen.values():
        for le, n in h.items():
            merged[le] = merged.get(le, 0.0) + n
    # RSS slope over the last serve process once its windows are full (HORIZON of simulated time,
    # = wall time at speed 1, after it answered, plus one minute for detector state to settle)
    # and the disk is free again (plus a minute to write the kept ticks).
    last = [(t, r) for t, r, g in rss if g == gen]
    full_at = max(last_start + HORIZON + 60, freed_at + 60)
    steady = [(t, r) for t, r in last if t >= full_at]
    slope = _slope(steady) * 3600 if len(steady) > 10 else float("nan")
    # The same least-squares fit over the second half of the window alone: warm-up that levels
    # off shows as a late slope well below the whole window's; a leak keeps its slope.
    late = steady[len(steady) // 2:]
    slope_late = _slope(late) * 3600 if len(late) > 10 else float("nan")
    parts_steady = [(a, f) for t, a, f, g in rss_parts if g == gen and t >= full_at]
    # And through each minute's median: RSS peaks for a few seconds after every /metrics render
    # (until the next tick's trim), and a peak near either end of a short window tilts the plain
    # fit; a minute's median is the level serve returns to.
    medians = _minute_medians(steady, full_at)
    slope_medians = _slope(medians) * 3600 if len(medians) >= 4 else float("nan")
    api_steady = [(t, r) for t, r, g in api_rss if g == gen and t >= full_at]
    api_slope = _slope(api_steady) * 3600 if len(api_steady) > 10 else float("nan")
    jobs_steady = [n for t, n, g in running_jobs if g == gen and t >= full_at]
    window_end = steady[-1][0] if steady else wall
    arrived = sum(1 for j in scen0["jobs"] if full_at <= j["submit_at"] < window_end)
    completed = sum(1 for j in scen0["jobs"] if full_at <= _end(j) < window_end)
    return {
        "minutes": minutes, "gpus": gpus, "nodes": scen0["nodes"], "jobs": len(scen0["jobs"]), "tick_seconds": tick_seconds, "day_seconds": day_seconds,
        "faults_scheduled": len(injected), "fault_kinds": _count(f["type"] for f in injected), "events": events, "tmpfs": tmpfs,
        "rss_first_mb": last[0][1] if last else None, "rss_last_mb": last[-1][1] if last else None, "rss_max_mb": max((r for _, r, _ in rss), default=None),
        "rss_slope_mb_per_hour": slope, "steady_window_s": (steady[-1][0] - steady[0][0]) if steady else 0,
        "rss_slope_medians_mb_per_hour": slope_medians, "rss_minute_medians_mb": [round(m) for _, m in medians],
        "rss_slope_late_mb_per_hour": slope_late, "rss_late_window_s": (late[-1][0] - late[0][0]) if late else 0,
        "rss_anon_steady_mb": (parts_steady[0][0], parts_steady[-1][0]) if parts_steady else None,
        "rss_file_steady_mb": (parts_steady[0][1], parts_steady[-1][1]) if parts_steady else None,
        "api_rss_slope_mb_per_hour": api_slope, "api_rss_steady_first_mb": api_steady[0][1] if api_steady else None,
        "api_rss_steady_last_mb": api_steady[-1][1] if api_steady else None,
        "running_jobs_steady": jobs_steady, "running_jobs_all": [(round(t), n) for t, n, _ in running_jobs],
        "jobs_arrived_in_window": arrived, "jobs_completed_in_window": completed,
        "serve_cpu_s": serve_cpu, "api_cpu_s": api_cpu, "serve_life_s": serve_life,
        "steady_from_s": full_at, "rss_steady_first_mb": steady[0][1] if steady else None, "rss_steady_last_mb": steady[-1][1] if steady else None,
        "load_avg_per_minute": [round(x, 1) for x in loads + [os.getloadavg()[0]]],
        "tick_count": len(tick_rows), "tick_expected": wall / tick_seconds,
        "tick_p50_s": _q([r[1] for r in tick_rows], 0.5), "tick_p99_s": _q([r[1] for r in tick_rows], 0.99), "tick_max_s": max((r[1] for r in tick_rows), default=float("nan")),
        "tick_locked_p99_s": _q([r[2] for r in tick_rows], 0.99), "tick_late_p99_s": _q([r[3] for r in tick_rows], 0.99),
        "ticks_over_period": sum(1 for r in tick_rows if r[2] > tick_seconds),
        "ticks_sampled": len(ticks), "tick_last_max_s": max(ticks, default=float("nan")),
        "ticks_total": sum(h.get(float("inf"), 0) for h in hist_by_gen.values()),
        "tick_p50_le_s": _bucket_quantile(merged, 0.5), "tick_p99_le_s": _bucket_quantile(merged, 0.99),
        "scrapes": len(scrape_seconds), "scrape_p50_s": _q(scrape_seconds, 0.5), "scrape_max_s": max(scrape_seconds, default=float("nan")),
        "page_findings_raised": len(raised), "paged": len(set(pages) & raised), "lost": sorted(raised - set(pages)),
        "paged_twice": sorted({d["finding_id"] for d in dups}), "duplicate_pages": dups, "repaged_new_incident": repaged,
        "listed_again_in_group_updates": sorted(fid for fid, n in pages.items() if n > 1), "pages_total": sum(pages.values()),
        "outbox_left": left, "dead_letters": dead,
        "api_requests": len(lat), "api_req_per_s": len(lat) / wall, "api_p50_ms": 1000 * _q(lat, 0.5), "api_p99_ms": 1000 * _q(lat, 0.99),
        "api_errors": clients.errors, "api_refused": clients.refused, "sse_events": clients.sse_events, "sse_reconnects": clients.sse_reconnects,
        "serve_alive_through_full_disk": serve_alive_through_full_disk,
    }


def _tick_log(path: Path) -> list[tuple[float, float, float, float]]:
    """serve's --tick-log: (end wall time, pipeline tick duration, duration with the lock wait,
    lateness against the schedule) per tick."""
    out = []
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                out.append(tuple(float(p) for p in parts))
    except (OSError, ValueError):
        pass
    return out  # type: ignore[return-value]


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _pair(values: tuple[float, float] | None) -> str:
    return "–" if not values else f"{values[0]:.0f} → {values[1]:.0f}"


def _range(values: list[int]) -> str:
    return f"{min(values)}–{max(values)}" if values else "–"


def _num(value: float | None, per: float = 1.0, digits: int = 0) -> str:
    return "–" if value is None or not per else f"{value / per:.{digits}f}"


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def _minute_medians(points: list[tuple[float, float]], start: float) -> list[tuple[float, float]]:
    """(mid time, median RSS) of each whole minute of samples from `start`."""
    by_minute: dict[int, list[tuple[float, float]]] = {}
    for t, r in points:
        by_minute.setdefault(int((t - start) // 60), []).append((t, r))
    out = []
    for _, pts in sorted(by_minute.items()):
        if pts[-1][0] - pts[0][0] >= 50:  # a whole minute (the last one may be cut short)
            out.append((statistics.fmean(t for t, _ in pts), statistics.median(r for _, r in pts)))
    return out


def _slope(points: list[tuple[float, float]]) -> float:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


# A bounded process's RSS does not trend; a least-squares fit over a window of minutes still
# wanders by tens of MB/h with the tick-to-tick garbage, so the fit through the minute medians is
# judged, against a bound that a real leak (hundreds of MB/h) exceeds.
TARGET_RSS_SLOPE_MB_PER_HOUR = 50.0
# Below this the fit follows the render peaks more than any trend: the slope is not judged.
MIN_SLOPE_WINDOW_SECONDS = 300.0
TARGET_API_MS = 50.0


def targets(r: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(what, threshold, measured, ok) for every target of the soak."""
    slope, window = r["rss_slope_medians_mb_per_hour"], r["steady_window_s"]
    judged = slope == slope and window >= MIN_SLOPE_WINDOW_SECONDS  # NaN: too few points
    rows: list[tuple[str, str, str, bool | None]] = [
        ("serve RSS slope once its windows were full (fit through the minute medians)", f"< {TARGET_RSS_SLOPE_MB_PER_HOUR:g} MB/h",
         f"{slope:.1f} MB/h over {window:.0f} s" if judged else
         f"– (steady window {window:.0f} s, under the {MIN_SLOPE_WINDOW_SECONDS:.0f} s a slope needs: run 12.5 minutes or more)",
         (slope < TARGET_RSS_SLOPE_MB_PER_HOUR) if judged else None),
        (f"tick duration p50 (period {r['tick_seconds']:g} s)", f"< {r['tick_seconds']:g} s", f"{r['tick_p50_s']:.2f} s", r["tick_p50_s"] < r["tick_seconds"]),
        (f"tick duration p99 (period {r['tick_seconds']:g} s)", f"< {r['tick_seconds']:g} s", f"{r['tick_p99_s']:.2f} s", r["tick_p99_s"] < r["tick_seconds"]),
        ("page findings lost (raised, never paged)", "0", str(len(r["lost"])), not r["lost"]),
        ("findings paged twice for one incident", "0", str(len(r["paged_twice"])), not r["paged_twice"]),
        ("alerts left in the outbox / dead letters at the end", "0 / 0", f"{r['outbox_left']} / {r['dead_letters']}", r["outbox_left"] == 0 and r["dead_letters"] == 0),
        ("API reads, p50", f"< {TARGET_API_MS:g} ms", f"{r['api_p50_ms']:.1f} ms", r["api_p50_ms"] < TARGET_API_MS),
        ("API reads, p99", f"< {TARGET_API_MS:g} ms", f"{r['api_p99_ms']:.0f} ms", r["api_p99_ms"] < TARGET_API_MS),
    ]
    if r["tmpfs"]:
        rows.append(("serve kept running while the disk was full", "yes", "yes" if r["serve_alive_through_full_disk"] else "no", bool(r["serve_alive_through_full_disk"])))
    else:
        rows.append(("serve kept running while the disk was full", "yes", "– (no tmpfs: the disk-full phase needs root)", None))
    return rows


def _data(r: dict[str, Any]) -> str:
    return (f"**simulated** cluster (gpuvigil's simulator: all telemetry, jobs and fault effects, every stream sampled once per "
            f"{r['tick_seconds']:g} s pipeline tick); the fault *arrival times* come from the real InfiniteHBD fault trace "
            f"(1 trace day = {r['day_seconds']:g} s).")


def markdown(r: dict[str, Any], cmd: str | None = None) -> str:
    from benchmarks.report import provenance, targets_table

    lost = len(r["lost"])
    lines = [
        "## Soak",
        "",
        provenance(cmd or r.get("command") or "gpuvigil bench soak", _data(r)),
        "",
        *targets_table(targets(r)),
        "",
        f"`gpuvigil serve` on the simulated cluster: {r['gpus']} GPUs ({r['nodes']} nodes), {r['jobs']} training jobs in a steady state: "
        f"about 60% of the GPUs busy from the start, each job completing after an exponential run time (mean {JOB_MEAN_SECONDS:g} s) "
        f"and replaced by the next job of its slot (a closed loop: as many leave as arrive, and the busy GPUs stay level); plus background jobs; tick period {r['tick_seconds']:g} s; {r['minutes']:g} min of wall time. Faults: the InfiniteHBD trace's fault "
        f"arrivals in order, 1 trace day = {r['day_seconds']:g} s ({r['faults_scheduled']} faults scheduled: "
        + ", ".join(f"{k} {v}" for k, v in sorted(r["fault_kinds"].items()))
        + "). Real Alertmanager → webhook pager; the feedback API polled by 3 clients and followed by 2 SSE streams. "
        "**All telemetry, jobs and fault effects come from the simulator**; the fault *arrival times* come from the trace. "
        f"Measured once on the shared development machine (2 cores; other jobs ran at the same time, at lower priority: load average "
        f"{min(r['load_avg_per_minute']):.1f}–{max(r['load_avg_per_minute']):.1f}, sampled each minute). Window horizon {HORIZON:g} s for every stream "
        "(so that the restarted serve's windows fill within the run).",
        "",
        "What happened during the run:",
        "",
        *[f"- {e}" for e in r["events"]],
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| serve RSS slope (last process, once its windows were full: from {r['steady_from_s']:.0f} s, over {r['steady_window_s']:.0f} s) | "
        f"{r['rss_slope_mb_per_hour']:.1f} MB/h (RSS {_mb(r['rss_steady_first_mb'])} → {_mb(r['rss_steady_last_mb'])} MB in that window; "
        f"{_mb(r['rss_first_mb'])} → {_mb(r['rss_last_mb'])} MB over the process, max {_mb(r['rss_max_mb'])} MB) |",
        f"| the same fit through each minute's median RSS (robust to the few seconds after each `/metrics` render) / the minute medians | "
        f"{r['rss_slope_medians_mb_per_hour']:.1f} MB/h / {', '.join(str(m) for m in r['rss_minute_medians_mb'])} MB |",
        f"| the same fit over the second half of that window ({r['rss_late_window_s']:.0f} s) / anonymous and file-backed RSS, start → end of the window | "
        f"{r['rss_slope_late_mb_per_hour']:.1f} MB/h / anonymous {_pair(r['rss_anon_steady_mb'])} MB, file-backed {_pair(r['rss_file_steady_mb'])} MB |",
        f"| training jobs running in that window (counted in `/metrics` at each scrape) / arriving / completing in it (the plan) | "
        f"{_range(r['running_jobs_steady'])} / {r['jobs_arrived_in_window']} / {r['jobs_completed_in_window']} |",
        f"| API process RSS slope in the same window | {r['api_rss_slope_mb_per_hour']:.1f} MB/h (RSS {_mb(r['api_rss_steady_first_mb'])} → "
        f"{_mb(r['api_rss_steady_last_mb'])} MB) |",
        f"| CPU time of the last serve process / of its API process over {r['serve_life_s']:.0f} s (wall time is polluted by the shared machine) | "
        f"{_num(r['serve_cpu_s'])} s ({_num(r['serve_cpu_s'], r['serve_life_s'] / r['tick_seconds'], 3)} s per tick period) / {_num(r['api_cpu_s'])} s |",
        f"| tick duration p50 / p99 / max ({r['tick_count']} ticks of {r['tick_expected']:.0f} scheduled; serve's --tick-log) | "
        f"{r['tick_p50_s']:.2f} / {r['tick_p99_s']:.2f} / {r['tick_max_s']:.2f} s; with the wait for the tick lock p99 {r['tick_locked_p99_s']:.2f} s; "
        f"started late p99 {r['tick_late_p99_s']:.2f} s; {r['ticks_over_period']} ticks longer than the period |",
        f"| `/metrics` scrape (every {SCRAPE_SECONDS:g} s; rendered once per tick, outside the tick lock but for the reads of mutable state) | "
        f"p50 {r['scrape_p50_s']:.1f} s, max {r['scrape_max_s']:.1f} s ({r['scrapes']} scrapes) |",
        f"| page findings raised (hint store) | {r['page_findings_raised']} |",
        f"| of those paged through Alertmanager | {r['paged']} ({lost} lost) |",
        f"| findings paged twice for one incident (a notification with nothing new) | {len(r['paged_twice'])} |",
        f"| findings paged again after they cleared (a new incident, new startsAt) | {len(r['repaged_new_incident'])} |",
        f"| alerts left in the outbox / dead letters at the end | {r['outbox_left']} / {r['dead_letters']} |",
        f"| API reads (serve's API process) | {r['api_requests']} ({r['api_req_per_s']:.0f} req/s), p50 {r['api_p50_ms']:.1f} ms, p99 {r['api_p99_ms']:.0f} ms; "
        f"{r['api_errors']} 5xx/other, {r['api_refused']} refused while serve restarted |",
        f"| SSE hint events received / reconnections | {r['sse_events']} / {r['sse_reconnects']} |",
    ]
    if r["tmpfs"]:
        lines.append(f"| serve kept running while the disk was full | {'yes' if r['serve_alive_through_full_disk'] else 'NO'} |")
    if r["lost"]:
        lines += ["", f"Lost (raised, never paged): {', '.join(r['lost'][:20])}" + (" …" if lost > 20 else "")]
    if r["paged_twice"]:
        lines += ["", "Paged twice: " + "; ".join(f"{d['finding_id']} ({d['labels'].get('alertname', '')}, startsAt {d['startsAt']})" for d in r["duplicate_pages"][:20])]
    if r["repaged_new_incident"]:
        lines += ["", f"Paged again as a new incident after clearing: {', '.join(r['repaged_new_incident'][:20])}"]
    return "\n".join(lines)


def summary(r: dict[str, Any], cmd: str | None = None) -> str:
    """The headline figures for docs/benchmarks.md (the full table is in docs/reliability.md)."""
    from benchmarks.report import provenance, targets_table

    return "\n".join([
        "## Soak",
        "",
        provenance(cmd or r.get("command") or "gpuvigil bench soak", _data(r)),
        "",
        *targets_table(targets(r)),
        "",
        f"`gpuvigil serve` at {r['gpus']} simulated GPUs for {r['minutes']:g} min with an Alertmanager restart, a `kill -9` of serve and a full "
        f"disk (shared 2-core machine, load average "
        f"{min(r['load_avg_per_minute']):.0f}–{max(r['load_avg_per_minute']):.0f}). Full table and reading: docs/reliability.md.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| page findings raised / paged / lost / paged twice | {r['page_findings_raised']} / {r['paged']} / {len(r['lost'])} / {len(r['paged_twice'])} |",
        f"| tick p50 / p99 (period {r['tick_seconds']:g} s) | {r['tick_p50_s']:.2f} / {r['tick_p99_s']:.2f} s |",
        (f"| serve RSS slope once the windows were full, jobs level | {r['rss_slope_mb_per_hour']:.1f} MB/h over {r['steady_window_s']:.0f} s "
         f"({_range(r['running_jobs_steady'])} training jobs running); through the minute medians {r['rss_slope_medians_mb_per_hour']:.1f} MB/h |"
         if r["steady_window_s"] >= MIN_SLOPE_WINDOW_SECONDS else
         f"| serve RSS slope once the windows were full | – (steady window {r['steady_window_s']:.0f} s: too short to fit) |"),
        f"| `/metrics` scrape p50 / max | {r['scrape_p50_s']:.2f} / {r['scrape_max_s']:.2f} s |",
        f"| API reads during the run (API in its own process) | {r['api_req_per_s']:.0f} req/s, p50 {r['api_p50_ms']:.1f} ms, p99 {r['api_p99_ms']:.0f} ms |",
        f"| CPU of serve / its API process | {_num(r['serve_cpu_s'])} / {_num(r['api_cpu_s'])} s over {r['serve_life_s']:.0f} s |",
    ])


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="serve at 10k simulated GPUs for minutes with faults, restarts and a full disk")
    p.add_argument("--minutes", type=float, default=12.5, help="wall minutes of the run itself (default 12.5: about 14 min with start-up and teardown)")
    p.add_argument("--hours", type=float, default=None, help="run this many hours instead")
    p.add_argument("--gpus", type=int, default=10_000)
    p.add_argument("--day-seconds", type=float, default=10.0, help="simulated seconds per trace day (default 10)")
    p.add_argument("--tick-seconds", type=float, default=5.0, help="pipeline tick period (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and files here (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-write", action="store_true", help="do not write docs/reliability.md")
    p.set_defaults(func=main)


def main(args) -> int:
    from gpuvigil.errors import UserError

    minutes = args.hours * 60 if args.hours is not None else args.minutes
    if minutes <= 0 or args.gpus < 16 or args.day_seconds <= 0 or args.tick_seconds <= 0:
        raise UserError("--minutes/--hours, --day-seconds, --tick-seconds must be > 0 and --gpus >= 16")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuvigil-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    res = run(minutes, args.gpus, args.day_seconds, args.tick_seconds, args.seed, workdir, log=lambda m: print(m, file=sys.stderr, flush=True))
    res["workdir"] = str(workdir)
    from benchmarks.report import command

    res["command"] = command("soak")
    md = markdown(res)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section("soak", md, DOC)
        write_section("soak", summary(res))  # docs/benchmarks.md: the headline figures
    print(json.dumps(res, default=float) if args.json else md)
    return 0
