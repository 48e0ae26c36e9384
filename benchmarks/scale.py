"""`gpuvigil bench scale`: what the fleet deployment (gpuvigil/fleet) costs per node and per core,
measured on this machine, as inputs to the model in docs/scale.md.

1. Agent CPU per node-second: one node of 8 simulated GPUs at 1 Hz (a job per node). The
   simulated world is read once per tick outside the timing; what is timed is the node's share: its
   collector slice, its Pipeline tick with the node/GPU detectors, and encoding its rows (Arrow IPC).
2. One detect core: the rows of a simulated cluster, encoded as the agents send them, decoded and
   ingested into the job partitions' Pipelines and ticked (CPU time of that work), plus the cost of
   fetching the same messages from a real nats-server (one node, file storage) with the pull
   consumer detect uses. msgs/s and rows/s per core = messages or rows / CPU seconds of both.
3. End to end and failover, on a real fleet (one nats-server; `gpuvigil agent` with a simulated
   cluster; two `gpuvigil detect`; `gpuvigil act`), all subprocesses: the latency from an agent's
   tick (its clock announcement) to the findings of that tick arriving on the findings stream that
   act reads (p50/p99 over every partition update), and the failover time after SIGKILL of a
   detect replica (until the survivor publishes each orphaned partition again) and of the act
   leader (until the standby holds the lease).

Every figure comes from the simulator's data on a shared, loaded 2-core machine; CPU times are
process/thread CPU, not wall. docs/scale.md turns them into cores, NATS throughput and bandwidth
for 10k, 100k and 1M GPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    from gpuvigil.fleet.agent import NodeAgent, NodeView, split_detectors
    from gpuvigil.pipeline.core import Pipeline

    cfg = config.defaults()
    fleet = Fleet()
    world = _world(nodes, workdir, cfg)
    agents = [NodeAgent(n, Pipeline([NodeView(world, n)], split_detectors(cfg, fleet)[0], cfg=cfg), fleet) for n in world.node_names]
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
    from gpuvigil.fleet.agent import NodeAgent, NodeView, split_detectors
    from gpuvigil.pipeline.core import Pipeline

    cfg = config.defaults()
    fleet = Fleet(findings_refresh_seconds=1e9)
    world = _world(nodes, workdir, cfg)
    agents = [NodeAgent(n, Pipeline([NodeView(world, n)], split_detectors(cfg, fleet)[0], cfg=cfg), fleet) for n in world.node_names]
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for t in range(1, ticks + 1):
        now = float(t)
        for a in agents:
            a.pipeline.tick(now)
            out += [m for m in a.outbox(now) if ".rows." in m[0]]
        world.after_tick(now)
    return out, sum(a.rows for a in agents)


def detect_cost(msgs: list[tuple[str, bytes, dict[str, str]]], rows: int, partitions: int) -> dict[str, Any]:
    """Decode + ingest + tick every partition Pipeline on one thread: CPU per message."""
    from types import SimpleNamespace

    from gpuvigil import config
    from gpuvigil.config.deploy import Fleet
    from gpuvigil.fleet import transport
    from gpuvigil.fleet.agent import split_detectors
    from gpuvigil.fleet.detect import Feed
    from gpuvigil.pipeline.core import Pipeline

    cfg = config.defaults()
    fleet = Fleet(partitions=partitions)
    feeds = {p: Feed() for p in range(partitions)}
    pipes = {p: Pipeline([feeds[p]], split_detectors(cfg, fleet)[1], cfg=cfg) for p in feeds}
    by_tick: dict[float, list] = {}
    for m in msgs:
        by_tick.setdefault(float(m[2]["Gv-Now"]), []).append(m)
    c0 = time.thread_time()
    for now in sorted(by_tick):
        for _subject, body, h in by_tick[now]:
            msg = SimpleNamespace(data=body, headers=h)
            frames = transport.decode_frames(msg.data, msg.headers["Gv-Frames"])
            feeds[transport.partition_of(h["Gv-Job"], partitions)].add(frames, h["Gv-Node"], h["Gv-Job"], now)
        for p in pipes.values():
            p.tick(now)
    cpu = time.thread_time() - c0
    return {"messages": len(msgs), "rows": rows, "cpu_seconds": cpu, "msgs_per_cpu_second": len(msgs) / cpu, "rows_per_cpu_second": rows / cpu,
            "bytes_per_message": sum(len(m[1]) for m in msgs) / len(msgs)}


def _nats(workdir: Path, mapping: str, name: str = "n") -> tuple[subprocess.Popen, str]:
    exe = shutil.which("nats-server")
    if exe is None:
        raise RuntimeError("nats-server not installed (make system-deps)")
    port = free_port()
    conf = workdir / f"{name}.conf"
    conf.write_text(f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{workdir / (name + "-js")}" }}\n{mapping}\n')
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=(workdir / f"{name}.log").open("w"), stderr=subprocess.STDOUT)
    return proc, f"nats://127.0.0.1:{port}"


def nats_cost(msgs: list[tuple[str, bytes, dict[str, str]]], workdir: Path) -> dict[str, Any]:
    """Publish the messages to a real nats-server (acked JetStream publishes, 64 in flight), then
    fetch them with detect's pull consumer: messages/s and client CPU of each side."""
    from gpuvigil.config.deploy import Fleet
    from gpuvigil.fleet import transport

    fleet = Fleet(partitions=1)
    proc, url = _nats(workdir, transport.nats_mapping(fleet), "bench")
    fleet = fleet.model_copy(update={"servers": [url]})

    async def go() -> dict[str, Any]:
        nc = await transport.connect(fleet, "bench")  # retries until the server listens
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
        return asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(10)


def fleet_run(workdir: Path, nodes: int, speed: float, seconds: float, log=print) -> dict[str, Any]:
    """The real fleet as subprocesses: latency tick → findings at act, detect and act failover."""
    import yaml

    from gpuvigil.config.deploy import Fleet
    from gpuvigil.fleet import transport

    ttl = 5.0
    fleet = Fleet(partitions=8, lease_ttl_seconds=ttl, findings_refresh_seconds=1, replay_seconds=300, rows_max_age_seconds=600)
    proc, url = _nats(workdir, transport.nats_mapping(fleet), "fleet")
    (workdir / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {**fleet.model_dump(), "servers": [url]}}))
    sc = _scenario(nodes, step=0.8)
    sc["faults"] = [{"type": "nccl_hang", "at": 20, "job": "job-0001", "ranks": [3], "mode": "outside"},
                    {"type": "thermal", "at": 15, "job": "job-0002", "ranks": [1]}]
    (workdir / "scenario.yaml").write_text(yaml.safe_dump(sc))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *argv: str) -> None:
        procs[name] = subprocess.Popen([sys.executable, "-m", "gpuvigil", *argv, "--config", "fleet.yaml", "--log-level", "info"], cwd=workdir, env=env,
                                       stdout=(workdir / f"{name}.log").open("w"), stderr=subprocess.STDOUT)

    ticks: dict[float, float] = {}
    updates: list[tuple[float, float, dict[str, Any]]] = []  # (wall, data now, doc)
    holders: dict[str, str] = {}

    async def probe(stop: asyncio.Event) -> None:
        nc = await transport.connect(fleet.model_copy(update={"servers": [url]}), "bench-probe")

        async def on_clock(m):
            now = float(json.loads(m.data)["now"])
            ticks.setdefault(now, time.monotonic())

        async def on_findings(m):
            doc = json.loads(m.data)
            updates.append((time.monotonic(), float(doc["now"]), doc))

        await nc.subscribe(f"{fleet.prefix}.clock.>", cb=on_clock)
        await nc.subscribe(f"{fleet.prefix}.findings.part.>", cb=on_findings)
        js = nc.jetstream()
        while not stop.is_set():
            try:
                kv = await js.key_value(f"{fleet.prefix}_leases")
                keys = await kv.keys()
                for k in list(holders):
                    if k not in keys:
                        holders.pop(k)
                for k in keys:
                    try:
                        holders[k] = (await kv.get(k)).value.decode()
                    except Exception:  # noqa: BLE001 - released (delete marker) or expired meanwhile
                        holders.pop(k, None)
            except Exception:  # noqa: BLE001 - bucket not there yet / empty
                pass
            await asyncio.sleep(0.2)
        await nc.close()

    result: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(probe(stop))
        start("detect-1", "detect", "--id", "detect-1")
        start("detect-2", "detect", "--id", "detect-2")
        start("act-1", "act", "--id", "act-1", "--outbox", "act-1.sqlite")
        await asyncio.sleep(6)
        start("act-2", "act", "--id", "act-2", "--outbox", "act-2.sqlite")
        start("agent", "agent", "--scenario", "scenario.yaml", "--speed", str(speed), "--port", "-1")
        t_end = time.monotonic() + seconds
        await asyncio.sleep(seconds / 2)
        owned = {k: v for k, v in holders.items() if k.startswith("part.")}
        victim = "detect-1" if any(v == "detect-1" for v in owned.values()) else "detect-2"
        orphans = {int(k.split(".")[1]) for k, v in owned.items() if v == victim}
        leader = holders.get("act.leader", "act-1")
        log(f"killing {victim} (partitions {sorted(orphans)}) and act leader {leader}")
        t_kill = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        procs[leader].send_signal(signal.SIGKILL)
        taken: dict[int, float] = {}
        new_leader_at = None
        while time.monotonic() < t_end and (len(taken) < len(orphans) or new_leader_at is None):
            for wall, _now, doc in updates:
                if wall > t_kill and doc.get("partition") in orphans and doc.get("owner") != victim:
                    taken.setdefault(doc["partition"], wall)
            if new_leader_at is None and holders.get("act.leader") not in (None, leader):
                new_leader_at = time.monotonic()
            await asyncio.sleep(0.1)
        await asyncio.sleep(max(0.0, t_end - time.monotonic()))
        lat = sorted(wall - ticks[now] for wall, now, _doc in updates if now in ticks)
        result.update({
            "latency_samples": len(lat),
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "detect_failover_s": (max(taken.values()) - t_kill) if taken and len(taken) == len(orphans) else None,
            "orphaned_partitions": len(orphans),
            "act_failover_s": (new_leader_at - t_kill) if new_leader_at else None,
            "lease_ttl_s": ttl,
            "ticks_seen": len(ticks),
            "findings_seen": sorted({f["kind"] for _w, _n, d in updates for f in d["findings"]}),
        })
        stop.set()
        await task

    try:
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
        proc.terminate()
        proc.wait(10)
    return result


def run(quick: bool, workdir: Path, log=print) -> dict[str, Any]:
    res: dict[str, Any] = {"quick": quick}
    log("agent CPU per node-second ...")
    res["agent"] = agent_cost(8, 60 if quick else 180, workdir)
    log(f"  {res['agent']}")
    # One replica holding one busy partition: the Pipeline's fixed cost per tick is shared by
    # every job in it, as it is at scale (hundreds of jobs per replica). Two sizes show how the
    # cost per message falls as a partition fills; the larger one feeds the model.
    for nodes in ((16, 32) if quick else (32, 128)):
        log(f"rows messages of a simulated cluster of {nodes} nodes ...")
        msgs, rows = encoded_messages(nodes, 60 if quick else 90, workdir)
        log("one detect core ...")
        res.setdefault("detect_sizes", []).append({"nodes": nodes, **detect_cost(msgs, rows, 1)})
        log(f"  {res['detect_sizes'][-1]}")
    res["detect"] = res["detect_sizes"][-1]
    log("NATS publish/fetch ...")
    res["nats"] = nats_cost(msgs, workdir)
    log(f"  {res['nats']}")
    log("end to end and failover (real fleet) ...")
    (workdir / "fleet").mkdir(exist_ok=True)
    res["fleet"] = fleet_run(workdir / "fleet", 4, 4.0, 40 if quick else 80, log=log)
    log(f"  {res['fleet']}")
    return res


def markdown(r: dict[str, Any], cmd: str | None = None) -> str:
    a, d, n, f = r["agent"], r["detect"], r["nats"], r["fleet"]
    per_core_msgs = 1.0 / (1.0 / d["msgs_per_cpu_second"] + n["fetch_cpu_us_per_msg"] / 1e6)
    per_core_rows = per_core_msgs * d["rows"] / d["messages"]
    fmt = lambda v, spec=".2f": "n/a" if v is None else format(v, spec)  # noqa: E731
    from benchmarks.report import provenance

    return "\n".join([
        provenance(cmd or r.get("command") or "gpuvigil bench scale", "**simulated** cluster: all rows come from gpuvigil's simulator (8 GPUs per node, one 8-GPU job per node, "
                   "hook + device telemetry sampled at 1 Hz); a real nats-server carries them. Measured on a shared 2-core machine, loaded by other work; "
                   "CPU times are thread/process CPU."),
        "",
        "Targets: none set for this benchmark; its figures feed the model below.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| agent CPU per node-second (8 GPUs, 1 Hz: collector slice + node detectors + encoding) | {a['cpu_ms_per_node_tick']:.1f} ms ({a['cpu_ms_per_node_tick'] / 10:.2f}% of a core) |",
        f"| agent output per node-second | {a['msgs_per_node_tick']:.2f} msgs, {a['bytes_per_node_tick'] / 1024:.1f} KiB (Arrow IPC, lz4) |",
        *[f"| detect, one partition of {s['nodes']} jobs (8 GPUs each): decode + ingest + job detectors, one core | {s['msgs_per_cpu_second']:,.0f} msgs/s, {s['rows_per_cpu_second']:,.0f} rows/s |"
          for s in r.get("detect_sizes", [d])],
        f"| detect: NATS pull-consumer fetch, client CPU (nats-py) | {n['fetch_cpu_us_per_msg']:.0f} µs/msg ({n['fetch_msgs_per_s']:,.0f} msgs/s wall) |",
        f"| **one detect core sustains** (largest partition + fetch) | **{per_core_msgs:,.0f} msgs/s = {per_core_rows:,.0f} rows/s** (≈ {per_core_msgs:,.0f} nodes at 1 Hz) |",
        f"| JetStream acked publish, one Python client, one server (file store) | {n['publish_msgs_per_s']:,.0f} msgs/s, {n['mb_per_s_published']:.1f} MB/s |",
        f"| end to end: agent tick → that tick's findings of a detect partition on the stream act reads | p50 {fmt(f.get('latency_p50_s'))} s, p99 {fmt(f.get('latency_p99_s'))} s ({f.get('latency_samples', 0)} samples) |",
        f"| detect failover: SIGKILL → survivor publishes all {f.get('orphaned_partitions', '?')} orphaned partitions (lease TTL {f.get('lease_ttl_s', '?'):g} s) | {fmt(f.get('detect_failover_s'), '.1f')} s |",
        f"| act failover: SIGKILL of the leader → standby holds the lease | {fmt(f.get('act_failover_s'), '.1f')} s |",
        "",
        f"Bytes per rows message: {d['bytes_per_message']:,.0f}; messages measured: {d['messages']:,} ({d['rows']:,} rows). "
        f"Findings seen in the end-to-end run: {', '.join(f.get('findings_seen', [])) or 'none'}.",
        "",
        *model(r, per_core_msgs),
    ])


# Published anchors (docs/scale.md cites each): JetStream acked async publish, one publisher,
# 16 B messages, R1 memory (nats-io/nats.docs, nats bench page); one large Prometheus server.
JETSTREAM_PUB_MSGS = 272_497
PROMETHEUS_SAMPLES_PER_S = 1_000_000
# Budget of one rows stream (an assumption, not a measurement; docs/scale.md says why): one stream
# is one RAFT group whose leader takes every write and sends it to two followers (R3), so one
# stream's intake is bounded by one server's disk and NIC. 250 MB/s in (750 MB/s written over
# three servers) leaves a 10 GbE NIC (1,250 MB/s) half free for consumers and replication.
STREAM_BUDGET_MB_S = 250.0


def model(r: dict[str, Any], per_core_msgs: float) -> list[str]:
    """Cores, NATS messages and bandwidth for 10k, 100k and 1M GPUs, linear in nodes from the
    measured per-node figures (8 GPUs per node, 1 Hz, one job per node)."""
    import math

    a = r["agent"]
    lines = ["Model (linear in nodes from the figures above; 8 GPUs per node, 1 Hz, one job per node; R3 streams; "
             f"`fleet.rows_streams` chosen so no rows stream takes more than {STREAM_BUDGET_MB_S:.0f} MB/s, an assumed budget):", "",
             "| GPUs | nodes | agent CPU, whole fleet (1 per node) | NATS msgs/s in | rows payload in | written by JetStream (R3) | `rows_streams` | per rows stream in | detect cores | vs JetStream 1-publisher anchor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for gpus in (10_000, 100_000, 1_000_000):
        nodes = gpus / 8
        msgs = nodes * a["msgs_per_node_tick"]
        mb = nodes * a["bytes_per_node_tick"] / 1e6
        cores = nodes * a["rows_msgs_per_node_tick"] / per_core_msgs
        streams = max(1, math.ceil(mb / STREAM_BUDGET_MB_S))
        lines.append(f"| {gpus:,} | {nodes:,.0f} | {nodes * a['cpu_ms_per_node_tick'] / 1000:,.1f} cores ({a['cpu_ms_per_node_tick'] / 10:.2f}% of one per node) "
                     f"| {msgs:,.0f} | {mb:,.0f} MB/s ({mb * 8 / 1000:.2f} Gbit/s) | {3 * mb:,.0f} MB/s | {streams} | {mb / streams:,.0f} MB/s "
                     f"| {cores:,.1f} | {msgs / JETSTREAM_PUB_MSGS:.2f}x |")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("scale", help="fleet (NATS) costs: agent CPU per node, detect core throughput, latency, failover")
    p.add_argument("--quick", action="store_true", help="smaller runs (about 3 minutes)")
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
