"""`gpuvigil bench scale`: the fleet deployment (gpuvigil/fleet) measured end to end, as shipped, and
the inputs of the model in docs/scale.md.

1. End to end (`e2e_run`): a 3-node nats-server cluster with R3 streams and the shipped lease
   TTL, `gpuvigil agent` playing a simulated cluster, 2 `gpuvigil detect`, 2 `gpuvigil act`, a real
   Alertmanager whose webhook is timed. Real faults of the simulator (XID 79 found by the agent,
   collective hangs found by detect) in four phases: steady state, during a detect failover
   (SIGKILL of the replica holding the partition), during an act failover (SIGKILL of the
   leader), during the loss of a NATS server (SIGKILL). Latency: fault (the fleet's clock reaching
   the fault's time) → Alertmanager notification. Failover time: until the first *correct*
   finding (the survivor publishing the partition with its hang; the new act leader paging). CPU
   per GPU-sample: process CPU of the running replicas over the steady phase.
2. Agent CPU per node-second without the simulator's own work, and JetStream publish throughput
   of one Python client: per-node inputs of the model.

Every figure comes from the simulator's data on a shared, loaded 2-core machine, in a short run;
the table says so. docs/scale.md turns them into cores, messages, clock fan-out and storage for
10k, 100k and 1M GPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.natscluster import NatsCluster
from benchmarks.ports import free_port

DOC = Path(__file__).resolve().parent.parent / "docs" / "scale.md"
SECTION = "scale"


def _scenario(nodes: int, step: float = 1.0) -> dict[str, Any]:
    return {
        "name": f"scale_{nodes}", "duration_seconds": 36000, "nodes": nodes,
        "jobs": [{"name": f"job-{i:04d}", "gpus": 8, "gpus_per_node": 8, "step_time_seconds": step, "collectives_per_step": 4,
                  "checkpoint_every_steps": 500, "memory_base_gib": 40, "memory_peak_gib": 95} for i in range(nodes)],
    }


def _world(nodes: int, workdir: Path, cfg: dict[str, Any]):
    import yaml

    from gpuvigil.fleet.agent import SimWorld

    path = workdir / f"scale_{nodes}.yaml"
    path.write_text(yaml.safe_dump(_scenario(nodes)))
    return SimWorld(str(path), None, 0, cfg)


def agent_cost(nodes: int, ticks: int, workdir: Path) -> dict[str, Any]:
    from gpuvigil import config
    from gpuvigil.config.deploy import Fleet
    from gpuvigil.app import compose
    from gpuvigil.fleet.agent import NodeAgent, NodeView

    cfg = config.defaults()
    fleet = Fleet()
    world = _world(nodes, workdir, cfg)
    agents = [NodeAgent(n, compose.build(cfg, "agent", [NodeView(world, n)], fleet=fleet), fleet) for n in world.node_names]
    cpu = 0.0
    timed = 0
    msgs = 0
    rows_msgs = 0
    payload = 0
    warm = min(30, ticks // 3)
    for t in range(1, ticks + 1):
        now = float(t)
        world.frames(now)  # the simulator's own work, outside the timing
        for a in agents:
            c0 = time.thread_time()
            a.pipeline.tick(now)
            out = a.outbox(now)
            dt = time.thread_time() - c0
            if t > warm:
                cpu += dt
                timed += 1
                msgs += len(out)
                rows_msgs += sum(1 for s, _b, _h in out if ".rows." in s)
                payload += sum(len(b) for _s, b, _h in out)
        world.after_tick(now)
    return {"nodes": nodes, "gpus_per_node": 8, "node_ticks": timed, "cpu_ms_per_node_tick": 1000 * cpu / timed,
            "msgs_per_node_tick": msgs / timed, "rows_msgs_per_node_tick": rows_msgs / timed, "bytes_per_node_tick": payload / timed}


def encoded_messages(nodes: int, ticks: int, workdir: Path) -> tuple[list[tuple[str, bytes, dict[str, str]]], int]:
    """The rows messages a simulated cluster's agents send over `ticks` seconds."""
    from gpuvigil import config
    from gpuvigil.config.deploy import Fleet
    from gpuvigil.app import compose
    from gpuvigil.fleet.agent import NodeAgent, NodeView

    cfg = config.defaults()
    fleet = Fleet(findings_refresh_seconds=1e9)
    world = _world(nodes, workdir, cfg)
    agents = [NodeAgent(n, compose.build(cfg, "agent", [NodeView(world, n)], fleet=fleet), fleet) for n in world.node_names]
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for t in range(1, ticks + 1):
        now = float(t)
        for a in agents:
            a.pipeline.tick(now)
            out += [m for m in a.outbox(now) if ".rows." in m[0]]
        world.after_tick(now)
    return out, sum(a.rows for a in agents)


def nats_cost(msgs: list[tuple[str, bytes, dict[str, str]]], workdir: Path) -> dict[str, Any]:
    """Publish the messages to a real nats-server (acked JetStream publishes, 64 in flight), then
    fetch them with detect's pull consumer: messages/s and client CPU of each side."""
    from gpuvigil.config.deploy import Fleet
    from gpuvigil.fleet import connection, transport

    fleet = Fleet(partitions=1)
    server = NatsCluster(workdir, 1, transport.nats_mapping(fleet), max_file_store="4GB")
    fleet = fleet.model_copy(update={"servers": server.urls})

    async def go() -> dict[str, Any]:
        nc = await connection.connect(fleet, "bench")  # retries until the server listens
        js = nc.jetstream(timeout=10)
        await transport.ensure(js, fleet)
        subjects = transport.Subjects(fleet)
        sem = asyncio.Semaphore(64)

        async def pub(m):
            async with sem:
                await js.publish(m[0], m[1], headers=m[2])

        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(pub(m) for m in msgs))
        pub_cpu, pub_wall = time.process_time() - c0, time.perf_counter() - w0
        from nats.js.api import AckPolicy, ConsumerConfig

        sub = await js.pull_subscribe(subjects.part(0), durable="bench", stream=subjects.rows_stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE))
        got = 0
        c0, w0 = time.process_time(), time.perf_counter()
        while got < len(msgs):
            got += len(await sub.fetch(512, timeout=5))
        fetch_cpu, fetch_wall = time.process_time() - c0, time.perf_counter() - w0
        await nc.close()
        return {"messages": len(msgs), "publish_msgs_per_s": len(msgs) / pub_wall, "publish_cpu_us_per_msg": 1e6 * pub_cpu / len(msgs),
                "fetch_msgs_per_s": len(msgs) / fetch_wall, "fetch_cpu_us_per_msg": 1e6 * fetch_cpu / len(msgs),
                "mb_per_s_published": sum(len(m[1]) for m in msgs) / pub_wall / 1e6}

    try:
        server.wait_ready()
        return asyncio.run(go())
    finally:
        server.stop()


class _Webhook:
    """Alertmanager's webhook receiver: every notification with the wall time it arrived."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.received: list[tuple[float, dict[str, Any]]] = []
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                sink.received.append((time.monotonic(), json.loads(body or b"{}")))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _alertmanager(workdir: Path, webhook: str) -> tuple[subprocess.Popen, str]:
    """A real Alertmanager that notifies at once (group_wait 0s, one group per alert): the latency
    measured is gpuvigil's, not a grouping delay an operator chooses."""
    import urllib.request

    import yaml

    exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if exe is None:
        raise RuntimeError("alertmanager not installed (Debian package prometheus-alertmanager)")
    port = free_port()
    cfg = {"route": {"receiver": "hook", "group_by": ["..."], "group_wait": "0s", "group_interval": "1s", "repeat_interval": "4h"},
           "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook, "send_resolved": False}]}]}
    (workdir / "am.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([exe, f"--config.file={workdir / 'am.yml'}", f"--storage.path={workdir / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address=", "--log.level=warn"], stdout=(workdir / "am.log").open("w"), stderr=subprocess.STDOUT, cwd=workdir)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("alertmanager not ready")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (/proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _jobs_in_one_partition(partitions: int, count: int) -> list[str]:
    """`count` job names that the server's mapping puts in one partition."""
    from gpuvigil.fleet.transport import partition_of

    by_part: dict[int, list[str]] = {}
    for i in range(1000):
        name = f"job-{i:04d}"
        by_part.setdefault(partition_of(name, partitions), []).append(name)
        if len(by_part[partition_of(name, partitions)]) == count:
            return by_part[partition_of(name, partitions)]
    raise RuntimeError("no partition holds enough jobs")


# The phases of the end-to-end run, in the fleet's data time (simulated seconds). Each injected
# fault is a real fault of the simulator (an XID 79 GPU loss found by the node's agent, or a
# collective hang found by detect), and its latency ends at the Alertmanager notification.
PHASES = {"steady": 60.0, "detect failover": 200.0, "act failover": 300.0, "NATS server loss": 380.0}
END_DATA_S = 470.0


def e2e_run(workdir: Path, nodes: int, speed: float, wall_limit: float, log=print) -> dict[str, Any]:
    """The fleet as shipped on a 3-node R3 NATS cluster with the shipped lease TTL: an agent
    playing `nodes` simulated nodes, 2 detect replicas, 2 act replicas, a real Alertmanager.
    Faults are injected in four phases (PHASES); what is measured is fault → Alertmanager
    notification, failover time to the first correct finding, and CPU per GPU-sample of the
    running replicas."""
    import yaml

    from gpuvigil.config.deploy import Fleet
    from gpuvigil.fleet import connection, transport
    from gpuvigil.fleet.transport import partition_of

    shipped = Fleet()
    fleet = Fleet(partitions=8, replicas=3, replay_seconds=300, rows_max_age_seconds=600)
    assert fleet.lease_ttl_seconds == shipped.lease_ttl_seconds and fleet.findings_refresh_seconds == shipped.findings_refresh_seconds
    cluster = NatsCluster(workdir, 3, transport.nats_mapping(fleet), name="bench", max_file_store="4GB")
    hook = _Webhook()
    am_proc, am_url = _alertmanager(workdir, hook.url)
    procs: dict[str, subprocess.Popen] = {}
    try:
        cluster.wait_ready()
        (workdir / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {**fleet.model_dump(exclude_none=True), "servers": cluster.urls}}))
        # Jobs: two in one partition (a hang before the detect kill, one during it), the rest anywhere.
        if nodes < 7:
            raise ValueError("the fault plan needs 7 nodes (one job each)")
        hang_a, hang_b = _jobs_in_one_partition(fleet.partitions, 2)
        others = [f"job-{i:04d}" for i in range(1000) if f"job-{i:04d}" not in (hang_a, hang_b)][: nodes - 2]
        jobs = [hang_a, hang_b, *others]
        sc = _scenario(nodes, step=0.8)
        for j, name in zip(sc["jobs"], jobs, strict=False):
            j["name"] = name
        det_p = PHASES["detect failover"]
        faults = [
            ("steady", "xid", {"type": "gpu_lost", "at": PHASES["steady"], "job": others[0], "ranks": [2]}),
            ("steady", "collective_hang", {"type": "nccl_hang", "at": PHASES["steady"], "job": others[1], "ranks": [3], "mode": "outside"}),
            # The partition's owner is killed at det_p with hang_a active (failover time: until the
            # survivor publishes it again); hang_b starts 2 s later, during the takeover.
            ("before detect failover", "collective_hang", {"type": "nccl_hang", "at": det_p - 80, "job": hang_a, "ranks": [1], "mode": "outside"}),
            ("detect failover", "collective_hang", {"type": "nccl_hang", "at": det_p + 2, "job": hang_b, "ranks": [1], "mode": "outside"}),
            ("act failover", "xid", {"type": "gpu_lost", "at": PHASES["act failover"] + 2, "job": others[2], "ranks": [5]}),
            ("NATS server loss", "xid", {"type": "gpu_lost", "at": PHASES["NATS server loss"] + 2, "job": others[3], "ranks": [0]}),
            ("NATS server loss", "collective_hang", {"type": "nccl_hang", "at": PHASES["NATS server loss"] + 2, "job": others[4], "ranks": [6], "mode": "outside"}),
        ]
        sc["faults"] = [f for _, _, f in faults]
        sc["duration_seconds"] = END_DATA_S + 200
        (workdir / "scenario.yaml").write_text(yaml.safe_dump(sc))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

        def start(name: str, *argv: str) -> None:
            procs[name] = subprocess.Popen([sys.executable, "-m", "gpuvigil", *argv, "--config", "fleet.yaml", "--log-level", "info"], cwd=workdir, env=env,
                                           stdout=(workdir / f"{name}.log").open("w"), stderr=subprocess.STDOUT)

        clock: list[tuple[float, float]] = []  # (data now, wall) when the fleet's clock first reached it
        updates: list[tuple[float, str, dict[str, Any]]] = []  # (wall, subject, doc) of partition findings
        placement: dict[str, str] = {}  # job → node
        holders: dict[str, str] = {}
        result: dict[str, Any] = {"nodes": nodes, "gpus": nodes * 8, "speed": speed, "lease_ttl_s": fleet.lease_ttl_seconds, "nats_nodes": 3,
                                  "replicas": fleet.replicas, "partitions": fleet.partitions}

        def wall_of(data_ts: float) -> float | None:
            for now, wall in clock:
                if now >= data_ts:
                    return wall
            return None

        async def probe(stop: asyncio.Event) -> None:
            nc = await connection.connect(fleet.model_copy(update={"servers": cluster.urls}), "bench-probe")

            async def on_clock(m):
                try:
                    now = float(json.loads(m.data)["now"])
                except (ValueError, KeyError):
                    return
                if not clock or now > clock[-1][0]:
                    clock.append((now, time.monotonic()))

            async def on_findings(m):
                updates.append((time.monotonic(), m.subject, json.loads(m.data)))

            async def on_cluster(m):
                doc = json.loads(m.data)
                for job, _rank, _gpu in doc.get("allocations", []):
                    placement.setdefault(job, doc["node"])

            await nc.subscribe(f"{fleet.prefix}.clock.>", cb=on_clock)
            await nc.subscribe(f"{fleet.prefix}.findings.part.>", cb=on_findings)
            await nc.subscribe(f"{fleet.prefix}.cluster.>", cb=on_cluster)
            js = nc.jetstream(timeout=3)
            while not stop.is_set():
                try:
                    kv = await js.key_value(f"{fleet.prefix}_leases")
                    for k in await kv.keys():
                        try:
                            holders[k] = (await kv.get(k)).value.decode()
                        except Exception:  # noqa: BLE001 - expired meanwhile
                            holders.pop(k, None)
                except Exception:  # noqa: BLE001 - not there yet, or a server being lost
                    pass
                await asyncio.sleep(0.3)
            await nc.close()

        async def until(data_ts: float, deadline: float) -> bool:
            while time.monotonic() < deadline:
                if clock and clock[-1][0] >= data_ts:
                    return True
                await asyncio.sleep(0.05)
            return False

        async def main() -> None:
            stop = asyncio.Event()
            task = asyncio.create_task(probe(stop))
            deadline = time.monotonic() + wall_limit
            start("detect-1", "detect", "--id", "detect-1")
            start("detect-2", "detect", "--id", "detect-2")
            start("act-1", "act", "--id", "act-1", "--outbox", "act-1.sqlite", "--alertmanager", am_url)
            await asyncio.sleep(3)
            start("act-2", "act", "--id", "act-2", "--outbox", "act-2.sqlite", "--alertmanager", am_url)
            start("agent", "agent", "--scenario", "scenario.yaml", "--speed", str(speed), "--port", "-1")
            # CPU of the running replicas over the steady phase (before any kill).
            await until(PHASES["steady"] - 20, deadline)
            cpu0 = {n: _cpu_seconds(p.pid) for n, p in procs.items()}
            d0, w0 = (clock[-1][0] if clock else 0.0), time.monotonic()
            await until(det_p - 5, deadline)
            cpu1 = {n: _cpu_seconds(p.pid) for n, p in procs.items() if p.poll() is None}
            d1, w1 = (clock[-1][0] if clock else 0.0), time.monotonic()
            result["cpu_cores"] = {role: sum(cpu1[n] - cpu0[n] for n in cpu1 if n.startswith(role)) / max(1e-9, w1 - w0) for role in ("agent", "detect", "act")}
            samples = nodes * 8 * max(1.0, d1 - d0)  # GPU samples the agent produced at 1 Hz in the window
            result["cpu_window_data_s"] = d1 - d0
            result["cpu_us_per_gpu_sample"] = {role: 1e6 * sum(cpu1[n] - cpu0[n] for n in cpu1 if n.startswith(role)) / samples for role in ("agent", "detect", "act")}

            part = partition_of(hang_a, fleet.partitions)
            await until(det_p, deadline)
            victim = holders.get(f"part.{part}", "detect-1")
            t_kill = time.monotonic()
            procs[victim].send_signal(signal.SIGKILL)
            log(f"killed {victim} (held partition {part} with {hang_a}'s hang) at data {clock[-1][0]:.0f}")
            result["detect_kill"] = (t_kill, victim, part)

            await until(PHASES["act failover"], deadline)
            leader = holders.get("act.leader", "act-1")
            t_act = time.monotonic()
            procs[leader].send_signal(signal.SIGKILL)
            log(f"killed act leader {leader} at data {clock[-1][0]:.0f}")
            result["act_kill"] = (t_act, leader)

            await until(PHASES["NATS server loss"], deadline)
            t_nats = time.monotonic()
            cluster.kill(0)
            log(f"killed nats-server n0 at data {clock[-1][0]:.0f}")
            result["nats_kill"] = t_nats
            await until(END_DATA_S, deadline)
            result["data_reached_s"] = clock[-1][0] if clock else 0.0
            stop.set()
            await task

        asyncio.run(main())
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        am_proc.terminate()
        am_proc.wait(10)
        hook.close()
        cluster.stop()

    # Fault → notification: the first notification of the fault's kind for its job (a hang) or
    # its node (an XID, which names the device, not the job).
    notes: list[tuple[float, dict[str, str]]] = [(w, a.get("labels", {})) for w, doc in hook.received for a in doc.get("alerts", []) if a.get("status") == "firing"]
    # Every notification as received, for a look at a fault notified more than once.
    (workdir / "notifications.json").write_text(json.dumps([{"wall": w, "labels": lab} for w, lab in notes], indent=1, sort_keys=True))
    rows = []
    for phase, kind, f in faults:
        t0 = wall_of(float(f["at"]))
        node = placement.get(f["job"])
        hits = [w for w, lab in notes if lab.get("kind") == kind and (lab.get("job") == f["job"] if kind != "xid" else lab.get("node") == node)]
        first = min(hits) if hits and t0 is not None else None
        rows.append({"phase": phase, "kind": kind, "job": f["job"], "node": node, "at_data_s": f["at"],
                     "latency_s": (first - t0) if first is not None else None, "notifications": len(hits)})
    result["faults"] = rows
    # Detect failover: kill → the first message of the orphaned partition from the survivor that
    # holds hang_a (a correct finding, not an empty refresh).
    t_kill, victim, part = result.pop("detect_kill", (None, None, None))
    if t_kill is not None:
        ok = [w for w, subj, doc in updates if w > t_kill and subj.endswith(f".{part}") and doc.get("owner") != victim
              and any(x.get("job") == hang_a and x.get("kind") == "collective_hang" for x in doc.get("findings", []))]
        # An empty state published as the partition's (a claim while catching up says nothing about it).
        empty = [w for w, subj, doc in updates if w > t_kill and subj.endswith(f".{part}") and doc.get("owner") != victim and not doc.get("findings")
                 and not doc.get("claim")]
        result["detect_failover_s"] = (min(ok) - t_kill) if ok else None
        result["detect_failover_empty_messages"] = sum(1 for w in empty if not ok or w < min(ok))
    # Act failover: kill → the first notification after it (the standby leads and pages).
    t_act, _leader = result.pop("act_kill", (None, None))
    if t_act is not None:
        after = [w for w, _lab in notes if w > t_act]
        result["act_failover_s"] = (min(after) - t_act) if after else None
    result.pop("nats_kill", None)
    return result


def run(quick: bool, workdir: Path, log=print) -> dict[str, Any]:
    res: dict[str, Any] = {"quick": quick}
    log("agent CPU per node-second ...")
    res["agent"] = agent_cost(8, 40 if quick else 120, workdir)
    log(f"  {res['agent']}")
    log("rows messages of a simulated cluster, JetStream publish/fetch on one server ...")
    msgs, _rows = encoded_messages(8, 30 if quick else 60, workdir)
    res["nats"] = nats_cost(msgs, workdir)
    log(f"  {res['nats']}")
    log("end to end on a 3-node R3 NATS cluster with faults, failovers and a server loss ...")
    (workdir / "fleet").mkdir(exist_ok=True)
    res["e2e"] = e2e_run(workdir / "fleet", 7, 4.0, 300 if quick else 600, log=log)
    log(f"  {res['e2e']}")
    return res


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def markdown(r: dict[str, Any], cmd: str | None = None) -> str:
    a, n, e = r["agent"], r["nats"], r["e2e"]
    fmt = lambda v, spec=".1f": "n/a" if v is None else format(v, spec)  # noqa: E731
    secs = lambda v: "n/a" if v is None else f"{v:.2f} s"  # noqa: E731
    from benchmarks.report import provenance

    lines = [
        provenance(cmd or r.get("command") or "gpuvigil bench scale", "**simulated** cluster: every row comes from gpuvigil's simulator (8 GPUs per "
                   f"node, one 8-GPU job per node, hook and device telemetry at 1 Hz of simulated time, run at x{e['speed']:g} speed, so a fault's "
                   "detection time in wall seconds is about 1/" f"{e['speed']:g} of what it is on a real fleet, while NATS, act and Alertmanager times are real). Faults are the "
                   "simulator's (XID 79 GPU loss found by the node's agent, collective hang found by detect). A real 3-node nats-server cluster (R3 "
                   "streams), real Alertmanager (group_wait 0s). Measured on a shared 2-core machine loaded by other work, in a short run; "
                   "CPU times are process CPU (/proc)."),
        "",
        "Targets: none set for this benchmark; its figures feed the model below.",
        "",
        f"Fleet: {e['nodes']} simulated nodes ({e['gpus']} GPUs), 2 detect replicas, 2 act replicas, {e['partitions']} partitions, lease TTL "
        f"{e['lease_ttl_s']:g} s (shipped), streams R{e['replicas']} on {e['nats_nodes']} nats-servers; the fleet's data clock reached "
        f"{e.get('data_reached_s', 0):.0f} s of the {END_DATA_S:.0f} s planned.",
        "",
        "Fault → Alertmanager notification (wall seconds from the moment the fleet's clock reached the fault's time to the webhook):",
        "",
        "| phase | fault (found by) | job | latency | firing notifications of it |",
        "|---|---|---|---|---|",
    ]
    for f in e["faults"]:
        who = "agent" if f["kind"] == "xid" else "detect"
        lines.append(f"| {f['phase']} | {f['kind']} ({who}) | {f['job']} | {secs(f['latency_s'])} | {f['notifications']} |")
    lat = {}
    for f in e["faults"]:
        if f["latency_s"] is not None:
            lat.setdefault(f["phase"], []).append(f["latency_s"])
    lines += ["", "| phase | faults paged | p50 | p99 |", "|---|---|---|---|"]
    for phase in ("steady", "detect failover", "act failover", "NATS server loss"):
        vals = lat.get(phase, [])
        total = sum(1 for f in e["faults"] if f["phase"] == phase)
        lines.append(f"| {phase} | {len(vals)} of {total} | {secs(_pct(vals, 0.5))} | {secs(_pct(vals, 0.99))} |")
    cpu = e.get("cpu_us_per_gpu_sample", {})
    twice = [f for f in e["faults"] if f["notifications"] > 1]
    lines += [
        "",
        "With so few faults per phase p99 is the largest latency: a rerun with more faults (not --quick) narrows it. "
        + (f"{len(twice)} of {len(e['faults'])} faults were notified more than once: each was firing when the act leader was killed, and the "
           "new leader's alerts for it notified again (a second page for one fault; the run's notifications.json holds the labels of each)."
           if twice else "Every fault was notified once."),
        "",
        "| figure | value |",
        "|---|---|",
        f"| detect failover: SIGKILL of the replica holding a hung job's partition → the survivor publishes that partition with the hang (first correct finding) | {secs(e.get('detect_failover_s'))} ({e.get('detect_failover_empty_messages', 0)} empty states published before it; claims while catching up not counted) |",
        f"| act failover: SIGKILL of the leader → the first page through the new leader (an XID injected 2 simulated s after the kill) | {secs(e.get('act_failover_s'))} |",
        f"| CPU per GPU-sample, measured on the running replicas over {e.get('cpu_window_data_s', 0):.0f} simulated s: detect (2 replicas together) | {fmt(cpu.get('detect'), '.0f')} µs |",
        f"| same, act (leader and standby) | {fmt(cpu.get('act'), '.0f')} µs |",
        f"| same, agent (one process playing every node, the simulator included) | {fmt(cpu.get('agent'), '.0f')} µs |",
        "| CPU of the running processes over that window, in cores (wall) | "
        + ", ".join(f"{role} {fmt(e.get('cpu_cores', {}).get(role), '.2f')}" for role in ("agent", "detect", "act"))
        + f" for {e['gpus']} GPUs at x{e['speed']:g}: at this size the replicas' fixed costs (polling, leases, clock) dominate, so the per-GPU-sample "
        "figures are upper bounds |",
        f"| agent CPU per node-second, no simulator (8 GPUs, 1 Hz: collector slice + node detectors + encoding) | {a['cpu_ms_per_node_tick']:.1f} ms |",
        f"| agent output per node-second | {a['msgs_per_node_tick']:.2f} msgs, {a['bytes_per_node_tick'] / 1024:.1f} KiB (Arrow IPC, lz4) |",
        f"| JetStream acked publish, one Python client, one server (file store) | {n['publish_msgs_per_s']:,.0f} msgs/s, {n['mb_per_s_published']:.1f} MB/s |",
        "",
        *model(r),
    ]
    return "\n".join(lines)


# Published anchors (docs/scale.md cites each): JetStream acked async publish, one publisher,
# 16 B messages, R1 memory (nats-io/nats.docs, nats bench page); one large Prometheus server.
JETSTREAM_PUB_MSGS = 272_497
PROMETHEUS_SAMPLES_PER_S = 1_000_000
# Budget of one rows stream (an assumption, not a measurement; docs/scale.md says why): one stream
# is one RAFT group whose leader takes every write and sends it to two followers (R3), so one
# stream's intake is bounded by one server's disk and NIC. 250 MB/s in (750 MB/s written over
# three servers) leaves a 10 GbE NIC (1,250 MB/s) half free for consumers and replication.
STREAM_BUDGET_MB_S = 250.0


def model(r: dict[str, Any]) -> list[str]:
    """Cores, messages, clock fan-out and storage for 10k, 100k and 1M GPUs, linear in nodes from
    the measured per-node and per-GPU-sample figures (8 GPUs per node, 1 Hz, one job per node),
    with the shipped fleet config (deploy/fleet.yaml)."""
    import math

    from gpuvigil.config.deploy import Fleet

    a, e = r["agent"], r["e2e"]
    cpu = e.get("cpu_us_per_gpu_sample", {})
    f = Fleet(rows_max_age_seconds=900, partitions=64)
    detect_replicas, act_replicas = 2, 2
    lines = ["Model (linear in nodes from the figures above; 8 GPUs per node, 1 Hz GPU samples, one job per node; R3 streams on 3 servers; "
             f"rows kept {f.rows_max_age_seconds:g} s; `fleet.rows_streams` chosen so no rows stream takes more than {STREAM_BUDGET_MB_S:.0f} MB/s, an assumed "
             "budget; detect and act cores from the CPU per GPU-sample of the running replicas above, so they include NATS client work; the clock "
             f"fan-out is every agent's clock message delivered to {detect_replicas} detect and {act_replicas} act replicas at the "
             "minimum deployment, each further replica adding one more copy):", "",
             "| GPUs | nodes | agent CPU (whole fleet) | NATS msgs/s in | clock fan-out msgs/s out | findings + summaries msgs/s into act | rows in | rows on disk per server (R3) | `rows_streams` | detect cores (upper bound) | act cores (upper bound) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for gpus in (10_000, 100_000, 1_000_000):
        nodes = gpus / 8
        msgs = nodes * a["msgs_per_node_tick"] + nodes  # rows, findings, summaries + one clock message per node
        mb = nodes * a["bytes_per_node_tick"] / 1e6
        fan = nodes * (detect_replicas + act_replicas)
        act_in = nodes / f.findings_refresh_seconds + f.partitions / f.findings_refresh_seconds + nodes / f.cluster_refresh_seconds
        disk_gb = mb * f.rows_max_age_seconds / 1e3
        streams = max(1, math.ceil(mb / STREAM_BUDGET_MB_S))
        det = gpus * cpu["detect"] / 1e6 if cpu.get("detect") is not None else None
        act = gpus * cpu["act"] / 1e6 if cpu.get("act") is not None else None
        lines.append(f"| {gpus:,} | {nodes:,.0f} | {nodes * a['cpu_ms_per_node_tick'] / 1000:,.1f} cores | {msgs:,.0f} | {fan:,.0f} | {act_in:,.0f} "
                     f"| {mb:,.0f} MB/s | {disk_gb:,.0f} GB | {streams} | {'n/a' if det is None else f'{det:,.1f}'} | {'n/a' if act is None else f'{act:,.1f}'} |")
    lines += ["", "Act's cost grows with the nodes (their node summaries and clock messages) more than with the faults; one act leader is one "
              "process, so its cores column is where the model says when act needs sharding. Rows on disk is rate x rows_max_age_seconds per "
              "server (each of the 3 holds one replica); `fleet.rows_max_bytes` caps it (the shipped 150 GB holds ~13 min at 100k GPUs)."]
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("scale", help="fleet on a 3-node NATS cluster: fault → Alertmanager latency through failovers, CPU per GPU-sample, 100k-GPU model")
    p.add_argument("--quick", action="store_true", help="shorter runs (about 5 minutes; the end-to-end run stops after 300 wall s)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-write", action="store_true", help="do not write docs/scale.md")
    p.set_defaults(func=main)


def main(args) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuvigil-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    res = run(args.quick, workdir, log=lambda m: print(m, file=sys.stderr, flush=True))
    from benchmarks.report import command

    res["command"] = command("scale")
    md = markdown(res)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section(SECTION, md, DOC)
    print(json.dumps(res, default=float) if args.json else md)
    return 0
