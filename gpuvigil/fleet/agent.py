"""`gpuvigil agent`: one per node. Runs the node's collectors (the `sources:` section, as `serve`
does) and the detectors whose scope is one node or GPU (`fleet.agent_detectors`) in a Pipeline,
serves /metrics, and publishes to NATS JetStream, per tick:

- the job-level rows of every job on the node (rank progress, allocator stats, the job's GPUs'
  samples, its events, with the job's placement rows), one message per job, Arrow IPC;
- the node's active findings (on change and every `findings_refresh_seconds`);
- its tick time on `gv.clock.<node>`;
- its node summary on `gv.cluster.node.<node>` (on change and every `cluster_refresh_seconds`):
  the node's row, its GPUs' allocations and, where the agent sees the scheduler's queue, the
  pending jobs. The act leader runs `fragmentation_cluster` over the union of them.

Its pipeline comes from the composition root (app/compose.py, role `agent`). With a Flight
Recorder source it also listens on `gv.fr.request.<node>`: detect, which runs the hang detectors
and the dump trigger, asks there for dumps of a job with ranks on this node, and the source's
trigger writes the ranks' debug-info pipes, as serve's does.

With `sources: sim: true` (or nothing configured) one process plays every node of the simulated
cluster: one Pipeline and one publisher per node over a shared simulated world, so tests and
benchmarks run the code a real node runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import polars as pl
from pydantic import ValidationError

from gpuvigil import config, schemas
from gpuvigil.config.deploy import Fleet, fleet_from_config
from gpuvigil.errors import UserError
from gpuvigil.fleet import connection, transport
from gpuvigil.fleet.spool import Spool
from gpuvigil.fleet.transport import ROW_STREAMS, Subjects
from gpuvigil.util.recentlog import RecentLog

log = logging.getLogger("gpuvigil.fleet")
NAME = "agent"


def add_common(p: argparse.ArgumentParser, role: str = NAME) -> None:
    p.set_defaults(fleet_role=role)
    p.add_argument("--config", help="config file with the `fleet:` section (see deploy/fleet.yaml)")
    p.add_argument("--nats", action="append", default=[], metavar="URL", help="NATS server URL (repeatable; overrides fleet.servers)")
    g = p.add_argument_group(f"NATS security (override fleet.tls and fleet.credentials.{role}; docs/security.md)")
    g.add_argument("--nats-ca", metavar="PEM", help="CA of the NATS servers' certificates")
    g.add_argument("--nats-cert", metavar="PEM", help="client certificate (with --nats-key)")
    g.add_argument("--nats-key", metavar="PEM", help="client certificate's key")
    g.add_argument("--nats-creds", metavar="FILE", help=f"{role}'s .creds file")
    g.add_argument("--nats-nkey-seed", metavar="FILE", help=f"{role}'s nkey seed file")
    g.add_argument("--nats-user", help=f"{role}'s NATS user (with --nats-password-file)")
    g.add_argument("--nats-password-file", metavar="FILE", help="file holding the NATS user's password")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many wall seconds (default: until SIGTERM)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, help="serve this replica's /metrics on this port (0: a free one; default: none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="node agent: collectors + node/GPU detectors, publishes rows and findings to NATS JetStream")
    add_common(p)
    p.add_argument("--node", help="this node's name (default: sources.node or the hostname)")
    p.add_argument("--scenario", default="healthy", help="simulated cluster: scenario name or file (when no real source is configured)")
    p.add_argument("--nodes", type=int, help="simulated nodes (default: the scenario's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second")
    p.add_argument("--host", default="127.0.0.1", help="address for /metrics")
    p.add_argument("--port", type=int, default=9400, help="port for /metrics (0: a free one; -1: none)")
    p.add_argument("--spool", metavar="DIR", help="keep what NATS cannot take on disk here (at most fleet.spool_max_bytes) and replay it in order when NATS is back")
    p.add_argument("--print-nats-mapping", action="store_true", help="print the nats-server subject mapping for this config and exit")
    p.add_argument("--print-nats-config", action="store_true",
                   help="print a nats-server config for this fleet (TLS, 3-node JetStream cluster, one user per role with its permissions) and exit")
    p.set_defaults(func=run)


def load(args: argparse.Namespace) -> tuple[dict[str, Any], Fleet]:
    try:
        cfg = config.load(args.config)
    except config.ConfigError as exc:
        raise UserError(str(exc)) from exc
    fleet = fleet_from_config(cfg, args.config or "config")
    update: dict[str, Any] = {}
    if args.nats:
        update["servers"] = list(args.nats)
    tls = {k: v for k, v in (("ca", getattr(args, "nats_ca", None)), ("cert", getattr(args, "nats_cert", None)), ("key", getattr(args, "nats_key", None))) if v}
    if tls:
        update["tls"] = {**(fleet.tls.model_dump() if fleet.tls else {}), **tls}
    cred = {k: v for k, v in (("creds", getattr(args, "nats_creds", None)), ("nkey_seed", getattr(args, "nats_nkey_seed", None)),
                              ("user", getattr(args, "nats_user", None)), ("password_file", getattr(args, "nats_password_file", None))) if v}
    role = getattr(args, "fleet_role", NAME)
    if cred:
        update["credentials"] = {**fleet.model_dump()["credentials"], role: cred}
    if update:
        try:
            fleet = Fleet.model_validate({**fleet.model_dump(), **update})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise UserError(f"--nats*: {'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}") from None
    return cfg, fleet


_QUEUE_COLUMNS = ("job", "tenant", "priority", "n_gpus", "gpus_per_node", "state", "submit_ts")


def node_summary(window: Any, node: str, queue: pl.DataFrame | None = None) -> dict[str, Any]:
    """What the cluster-scope detectors need from one node: its `nodes` row (state, rack, GPUs,
    free GPUs), its GPUs' allocations and, from an agent that sees the scheduler's queue, the
    pending jobs. Small (one row, a few allocations) and JSON, so act unions thousands of them."""
    nodes = window.get("nodes")
    row = nodes.filter(pl.col("node") == node) if nodes.height else nodes
    alloc = window.get("allocations")
    alloc = alloc.filter(pl.col("node") == node) if alloc.height else alloc
    doc: dict[str, Any] = {
        "node": node,
        "row": row.row(0, named=True) if row.height else None,
        "allocations": [list(r) for r in alloc.select("job", "rank", "gpu").iter_rows()],
    }
    if queue is not None and queue.height:
        pending = queue.filter(pl.col("state") == "pending")
        if pending.height:
            doc["pending"] = pending.select(_QUEUE_COLUMNS).sort("job").to_dicts()
    return doc


# -- what a node ships ---------------------------------------------------------------------------
def job_rows(window: Any, node: str) -> dict[str, dict[str, pl.DataFrame]]:
    """job → {stream: this tick's rows of that job on this node}, plus the job's placement on the
    node (`allocations`) and its `jobs` row. Per-GPU samples carry no job: a GPU's rows go with
    the job the node's map places on it."""
    alloc = window.get("allocations")
    alloc = alloc.filter(pl.col("node") == node) if alloc.height else alloc
    out: dict[str, dict[str, pl.DataFrame]] = {}
    for stream in ROW_STREAMS:
        df = window.fresh(stream)
        if df.height == 0:
            continue
        if "job" not in df.columns:
            if alloc.height == 0 or not {"node", "gpu"} <= set(df.columns):
                continue
            df = df.join(alloc.select("node", "gpu", "job").unique(["node", "gpu"]), on=["node", "gpu"], how="inner")
            by_job = df.partition_by("job", as_dict=True, include_key=False)
        else:
            by_job = df.filter(pl.col("job").is_not_null()).partition_by("job", as_dict=True)
        for (job,), part in by_job.items():
            out.setdefault(job, {})[stream] = part
    if out:
        jobs = window.get("jobs")
        for job, frames in out.items():
            a = alloc.filter(pl.col("job") == job)
            if a.height:
                frames["allocations"] = a
            if jobs.height:
                j = jobs.filter(pl.col("job") == job)
                if j.height:
                    frames["jobs"] = j
    return out


class NodeView:
    """The slice of a shared simulated world that one node's instruments see."""

    name = "simulated"
    streams: Mapping[str, pl.Schema] = {
        "gpu_samples": schemas.GPU_SAMPLES, "rank_progress": schemas.RANK_PROGRESS, "allocator_stats": schemas.ALLOCATOR_STATS,
        "events": schemas.EVENTS, "jobs": schemas.JOBS, "allocations": schemas.ALLOCATIONS, "nodes": schemas.NODES,
    }

    def __init__(self, world: SimWorld, node: str):
        self.world = world
        self.node = node
        self.errors = 0

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        frames = self.world.frames(now)
        out: dict[str, pl.DataFrame] = {}
        for stream, df in frames.items():
            if stream == "jobs":
                continue
            if "node" in df.columns:
                out[stream] = df.filter(pl.col("node") == self.node)
        alloc = out.get("allocations")
        if alloc is not None and "jobs" in frames:
            out["jobs"] = frames["jobs"].join(alloc.select("job").unique(), on="job", how="semi")
        return out


class SimWorld:
    """One simulated cluster read once per tick and sliced per node (`NodeView`)."""

    def __init__(self, scenario: str, nodes: int | None, seed: int, cfg: dict[str, Any]):
        from gpuvigil.scheduler.core import Scheduler
        from gpuvigil.sim import scenario as scenario_mod
        from gpuvigil.sim.cluster import SimulatedCluster, node_specs

        try:
            sc = scenario_mod.load(scenario)
        except Exception as exc:  # noqa: BLE001 - name or file: one line either way
            raise UserError(f"--scenario {scenario}: {exc}") from exc
        if nodes is not None:
            sc = scenario_mod.with_nodes(sc, nodes)
        self.scenario = sc
        self.node_names = [n.name for n in node_specs(sc)]
        self.scheduler = Scheduler(node_specs(sc), cfg)
        self.cluster = SimulatedCluster(sc, self.scheduler, seed=seed)
        self.scheduler.cycle(0.0)
        self._now: float | None = None
        self._frames: dict[str, pl.DataFrame] = {}

    def frames(self, now: float) -> dict[str, pl.DataFrame]:
        if self._now != now:
            self._now = now
            self._frames = {**self.cluster.observe(now), **self.scheduler.state_frames()}
        return self._frames

    def after_tick(self, now: float) -> None:
        self.scheduler.cycle(now)

    def queue(self) -> pl.DataFrame:
        """The simulated scheduler's jobs (its queue included): what a Slurm-reading agent sees."""
        return self._frames.get("jobs", schemas.empty("jobs"))


class NodeAgent:
    """One node: its Pipeline (node/GPU detectors) and what it publishes after each tick."""

    def __init__(self, node: str, pipeline: Any, fleet: Fleet, queue: Any = None):
        self.node = node
        self.pipeline = pipeline
        self.fleet = fleet
        self.subjects = Subjects(fleet)
        self._published: tuple[str, ...] | None = None
        self._published_at = float("-inf")
        self._summary: bytes | None = None
        self._summary_at = float("-inf")
        # Where this node sees the scheduler's queue: () -> jobs frame (a real agent: its own
        # window's `jobs`, filled by a Slurm state source; the simulator: one designated node).
        self.queue = queue
        self.rows = 0

    def outbox(self, now: float) -> list[tuple[str, bytes, dict[str, str]]]:
        """This tick's messages: (subject, body, headers). Built in the tick thread."""
        msgs = []
        for job, frames in job_rows(self.pipeline.window, self.node).items():
            body, index = transport.encode_frames(frames)
            msgs.append((self.subjects.rows(job), body, {"Gv-Frames": index, "Gv-Node": self.node, "Gv-Job": job, "Gv-Now": repr(now)}))
            self.rows += sum(df.height for s, df in frames.items() if s in ROW_STREAMS)
        active = sorted(self.pipeline.active.values(), key=lambda f: f.id)
        key = tuple(f.id for f in active)
        if key != self._published or now - self._published_at >= self.fleet.findings_refresh_seconds:
            self._published, self._published_at = key, now
            msgs.append((self.subjects.findings_node(self.node), transport.findings_payload("agent", now, active, node=self.node), {}))
        summary = json.dumps(node_summary(self.pipeline.window, self.node, self.queue() if self.queue else None), sort_keys=True, default=str).encode()
        if summary != self._summary or now - self._summary_at >= self.fleet.cluster_refresh_seconds:
            self._summary, self._summary_at = summary, now
            msgs.append((self.subjects.cluster_node(self.node), summary, {"Gv-Now": repr(now)}))
        return msgs


class _MergedWindow:
    """The windows of every simulated node as one (each holds only its own node's rows, so the
    union is exact): what the exporter reads."""

    def __init__(self, windows: list[Any]):
        self.windows = windows

    def _concat(self, frames: list[pl.DataFrame]) -> pl.DataFrame:
        frames = [f for f in frames if f.height] or frames[:1]
        return pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]

    def latest(self, stream: str, by: list[str]) -> pl.DataFrame:
        return self._concat([w.latest(stream, by) for w in self.windows])

    def get(self, stream: str) -> pl.DataFrame:
        return self._concat([w.get(stream) for w in self.windows])

    def streams(self) -> list[str]:
        return sorted({s for w in self.windows for s in w.streams()})


class MergedPipeline:
    """Every simulated node's Pipeline seen as one by the exporter, so the one /metrics of a
    process that plays the whole cluster serves every node's series (each labelled with its
    node), as one agent per node would. `all_findings` is append-only across nodes (the
    exporter keeps a cursor into it)."""

    def __init__(self, pipelines: list[Any]):
        self.pipelines = pipelines
        self.window = _MergedWindow([p.window for p in pipelines])
        self.config = pipelines[0].config
        self.all_findings: RecentLog[Any] = RecentLog(self.config.findings_kept)

    @property
    def active(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self.pipelines:
            out.update(p.active)
        return out

    @property
    def ticks(self) -> int:
        return self.pipelines[0].ticks  # the nodes tick together

    @property
    def samples_ingested_total(self) -> int:
        return sum(p.samples_ingested_total for p in self.pipelines)

    @property
    def collectors(self) -> list[Any]:
        # One series per collector name (every node's simulated reader is called the same).
        errors: dict[str, int] = {}
        for p in self.pipelines:
            for c in p.collectors:
                errors[c.name] = errors.get(c.name, 0) + c.errors
        return [argparse.Namespace(name=n, errors=e) for n, e in errors.items()]


class Agent:
    """Every NodeAgent of this process and the loop that ticks and publishes them."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg, self.fleet = load(args)
        if args.speed <= 0:
            raise UserError(f"--speed {args.speed}: must be > 0")
        from gpuvigil.app import compose
        from gpuvigil.config import deploy as deployconfig

        self.src = deployconfig.from_config(self.cfg, argparse.Namespace(node=args.node), where=args.config or "config")
        self.simulated = not self.src.real
        self.lock = threading.RLock()
        self.stop_event = asyncio.Event()
        self.closers: list[Any] = []
        self.world: SimWorld | None = None
        self.agents: list[NodeAgent] = []
        # node -> its Flight Recorder source's trigger, which writes the pipes detect asks for.
        self.dump_askers: dict[str, Any] = {}
        if self.simulated:
            self.world = SimWorld(args.scenario, args.nodes, args.seed, self.cfg)
            for i, node in enumerate(self.world.node_names):
                # One node reports the simulated scheduler's queue, as one Slurm reader would.
                pipeline = compose.build(self.cfg, NAME, [NodeView(self.world, node)], fleet=self.fleet)
                self.agents.append(NodeAgent(node, pipeline, self.fleet,
                                             queue=self.world.queue if i == 0 else None))
            self.scheduler = self.world.scheduler
        else:
            self._build_real()
        self.tick_seconds = self.agents[0].pipeline.config.tick_seconds
        self.now = 0.0 if self.simulated else time.time()
        self.metrics_port: int | None = None
        self.ticks = 0
        self.tick_cpu_seconds = 0.0
        self.messages = 0
        self.bytes = 0
        self.msg_id_base = f"{self.agents[0].node}-{os.getpid()}-{int(time.time() * 1000)}"
        self._msg_seq = 0
        self.spool: Spool | None = None
        if getattr(args, "spool", None):
            self.spool = Spool(args.spool, self.fleet.spool_max_bytes)
            self.closers.append(self.spool.close)
            if self.spool.count:
                log.warning("agent: %d messages (%d bytes) left in the spool by the last run; replaying them first", self.spool.count, self.spool.bytes)

    def _build_real(self) -> None:
        from gpuvigil.app import compose

        started = compose.start_sources(self.src, self.cfg)
        sources = started.sources
        self.closers += [s.close for s in sources]
        node = self.src.node_name()
        self.scheduler = started.scheduler
        pipeline = compose.build(self.cfg, NAME, started.collectors, fleet=self.fleet, sources=sources)
        asker = compose.dump_asker(NAME, sources)
        if asker is not None:
            self.dump_askers[node] = asker
        # With a Slurm state source the window holds the cluster's queue: report its pending jobs.
        self.agents.append(NodeAgent(node, pipeline, self.fleet, queue=(lambda: pipeline.window.get("jobs")) if self.src.scheduler == "slurm" else None))

    def start_metrics(self) -> None:
        if self.args.port < 0:
            return
        from gpuvigil.exporter.metrics import Snapshot, TickStats
        from gpuvigil.exporter.prometheus import serve_metrics
        from gpuvigil.app.runtime import Runtime

        # One process, one /metrics: in simulated mode every node's series (with their node
        # label) through a merged view; a real node runs its own agent and serves its own.
        pipeline = self.agents[0].pipeline if len(self.agents) == 1 else MergedPipeline([a.pipeline for a in self.agents])
        self._merged = pipeline if isinstance(pipeline, MergedPipeline) else None
        rt = Runtime(pipeline, self.scheduler, None)
        self._runtime = rt
        try:
            server, _ = serve_metrics(Snapshot(rt, TickStats(), lock=self.lock), self.args.port, self.args.host)
        except OSError as exc:
            raise UserError(f"cannot serve /metrics on {self.args.host}:{self.args.port}: {exc.strerror or exc}") from exc
        self.metrics_port = server.server_address[1]
        self.closers += [server.server_close, server.shutdown]

    def tick(self) -> list[tuple[str, bytes, dict[str, str]]]:
        """One tick of every node (in a worker thread): collect, detect, build the messages."""
        c0 = time.thread_time()
        with self.lock:
            self.now = self.now + self.tick_seconds if self.simulated else time.time()
            now = self.now
            msgs: list[tuple[str, bytes, dict[str, str]]] = []
            for a in self.agents:
                result = a.pipeline.tick(now)
                if hasattr(self, "_runtime") and a is self.agents[0]:
                    self._runtime.now, self._runtime.last_result = now, result
                if getattr(self, "_merged", None) is not None:
                    self._merged.all_findings.extend(result.new_findings)
                for f in result.new_findings:
                    log.info("agent %s: finding %s %s: %s", a.node, f.severity.value, f.kind.value, f.summary)
                msgs += a.outbox(now)
            if self.world is not None:
                self.world.after_tick(now)
        self.ticks += 1
        self.tick_cpu_seconds += time.thread_time() - c0
        return msgs

    async def run(self) -> None:
        nc = await connection.connect(self.fleet, f"gpuvigil-agent-{self.agents[0].node}", role=NAME)
        js = nc.jetstream(timeout=5)
        subjects = Subjects(self.fleet)
        try:
            for node, asker in self.dump_askers.items():

                async def on_request(msg: Any, asker: Any = asker) -> None:
                    await self._on_dump_request(msg, asker)

                await nc.subscribe(subjects.fr_request(node), cb=on_request)
            if self.fleet.credential(NAME) is None:
                # With a credential the agent may not manage streams (fleet.security): detect
                # and act create them, and what is published before is retried.
                await transport.ensure(js, self.fleet)
            period = self.tick_seconds / (self.args.speed if self.simulated else 1.0)
            deadline = time.monotonic() + self.args.duration if self.args.duration else None
            next_tick = time.monotonic()
            if self.spool is not None:
                replay = asyncio.create_task(self._replay(js))
                self.closers.append(replay.cancel)
            while not self.stop_event.is_set():
                msgs = await asyncio.to_thread(self.tick)
                await self._publish(js, msgs)
                for a in self.agents:
                    try:
                        await nc.publish(subjects.clock(a.node), b'{"now": %r}' % self.now)
                    except Exception as exc:  # noqa: BLE001 - NATS away long enough to fill the client's buffer
                        log.debug("agent: clock not sent: %s", exc)
                next_tick += period
                if deadline is not None and time.monotonic() >= deadline:
                    break
                delay = next_tick - time.monotonic()
                if delay < 0:  # behind: no burst to catch up (the data clock just runs slower)
                    next_tick, delay = time.monotonic(), 0.0
                try:
                    await asyncio.wait_for(self.stop_event.wait(), delay)
                except TimeoutError:
                    pass
        finally:
            await transport.shutdown(nc)

    async def _on_dump_request(self, msg: Any, asker: Any) -> None:
        """detect suspects a hang of a job with ranks here: write its ranks' debug-info pipes, as
        serve's trigger does. The request is untrusted: a job that is not one folder name under
        the Flight Recorder root is refused."""
        try:
            doc = json.loads(msg.data)
            job, how = doc["job"], str(doc.get("how") or "on_demand")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("agent: unreadable Flight Recorder dump request on %s: %s", msg.subject, exc)
            return
        if not isinstance(job, str) or not job or job in (".", "..") or "/" in job or "\0" in job or len(job) > 255:
            log.warning("agent: Flight Recorder dump request for an invalid job name %r refused", job)
            return
        wrote = await asyncio.to_thread(self._ask_dump, asker, job, how[:32])
        log.info("agent: detect asks Flight Recorder dumps of job %s (%s): %s", job, how, "pipes written" if wrote else "no pipe of it read here")

    def _ask_dump(self, asker: Any, job: str, how: str) -> bool:
        with self.lock:  # the dump watcher reads the requests in the tick
            return bool(asker.ask(job, self.now, how))

    async def _publish(self, js: Any, msgs: list[tuple[str, bytes, dict[str, str]]]) -> None:
        """JetStream publishes with acks. Each message carries a `Nats-Msg-Id`, so one resent
        after a lost ack is stored once. A message NATS cannot take now (a node died, a leader is
        being elected) is retried briefly; then, with a spool (`--spool`), it goes to disk and
        everything after it goes behind it until the spool is replayed (`_replay`), so detect
        reads each job's rows in order. Without a spool it is retried for 10 s, then dropped
        and logged: the rows of one tick are worth less than the agent keeping its clock."""
        msgs = [(s, b, {**h, "Nats-Msg-Id": f"{self.msg_id_base}-{self._next_id()}"}) for s, b, h in msgs]
        self.messages += len(msgs)
        self.bytes += sum(len(m[1]) for m in msgs)
        if self.spool is not None and self.spool.count:
            await asyncio.to_thread(self.spool.put, msgs)
            return
        patience = 1.0 if self.spool is not None else 10.0

        async def one(subject: str, body: bytes, headers: dict[str, str]) -> bool:
            give_up = time.monotonic() + patience
            while True:
                try:
                    await js.publish(subject, body, headers=headers, timeout=min(5.0, 2 * patience))
                    return True
                except Exception as exc:  # noqa: BLE001 - timeout / no responders during failover
                    if time.monotonic() > give_up or self.stop_event.is_set():
                        if self.spool is None:
                            log.warning("agent: dropped a message to %s: %s", subject, exc)
                        return False
                    await asyncio.sleep(0.2)

        ok = await asyncio.gather(*(one(*m) for m in msgs))
        failed = [m for m, stored in zip(msgs, ok, strict=True) if not stored]
        if failed and self.spool is not None:
            if not self.spool.count:
                log.warning("agent: NATS does not take messages; spooling to %s (at most %d bytes)", self.spool.path, self.spool.max_bytes)
            await asyncio.to_thread(self.spool.put, failed)

    def _next_id(self) -> int:
        self._msg_seq += 1
        return self._msg_seq

    async def _replay(self, js: Any) -> None:
        """Publish the spool oldest first, each message forgotten once NATS stored it."""
        from nats.js.errors import APIError

        while True:
            batch = await asyncio.to_thread(self.spool.peek, 64) if self.spool.count else []
            if not batch:
                await asyncio.sleep(0.5)
                continue
            for rid, (subject, body, headers) in batch:
                try:
                    await js.publish(subject, body, headers=headers, timeout=2.0)
                except APIError as exc:
                    if exc.code is not None and 400 <= exc.code < 500:
                        # Refused for what it is (too large, a bad header): never stored,
                        # so it must not hold back the rest.
                        log.warning("agent: spooled message to %s refused by NATS, dropped: %s", subject, exc)
                        self.spool.dropped += 1
                        await asyncio.to_thread(self.spool.done, rid)
                        self.spool.replayed -= 1
                        continue
                    log.debug("agent: spool replay waits: %s", exc)
                    await asyncio.sleep(1.0)
                    break
                except Exception as exc:  # noqa: BLE001 - still away: try again shortly, same order
                    log.debug("agent: spool replay waits: %s", exc)
                    await asyncio.sleep(1.0)
                    break
                await asyncio.to_thread(self.spool.done, rid)
                if not self.spool.count:
                    log.warning("agent: spool replayed (%d messages in all, %d dropped over its bound)", self.spool.replayed, self.spool.dropped)

    def close(self) -> None:
        for c in reversed(self.closers):
            try:
                c()
            except Exception:  # noqa: BLE001 - best effort at exit
                log.exception("agent: close failed")


def install_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def run(args: argparse.Namespace) -> int:
    from gpuvigil.util.logsetup import configure as configure_logging

    configure_logging(args.log_level)
    if args.print_nats_mapping:
        _cfg, fleet = load(args)
        print(transport.nats_mapping(fleet))
        return 0
    if args.print_nats_config:
        from gpuvigil.fleet.security import server_config

        _cfg, fleet = load(args)
        print(server_config(fleet), end="")
        return 0
    agent = Agent(args)
    agent.start_metrics()

    async def main() -> None:
        install_signals(asyncio.get_running_loop(), agent.stop_event)
        what = f"simulated {agent.world.scenario.name}, {len(agent.agents)} nodes x{args.speed:g}" if agent.world else f"node {agent.agents[0].node}"
        print(f"gpuvigil agent: {what}; NATS {', '.join(agent.fleet.servers)}; metrics "
              + (f"http://{args.host}:{agent.metrics_port}/metrics" if agent.metrics_port else "off"), flush=True)
        await agent.run()

    try:
        asyncio.run(main())
    finally:
        agent.close()
        spooled = (f"; spool: {agent.spool.spooled} spooled, {agent.spool.replayed} replayed, {agent.spool.dropped} dropped, {agent.spool.count} left"
                   if agent.spool is not None else "")
        print(f"gpuvigil agent: stopped after {agent.ticks} ticks; published {agent.messages} messages, {agent.bytes / 1e6:.1f} MB{spooled}", flush=True)
    return 0
