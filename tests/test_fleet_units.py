"""The fleet's pieces without the cluster: the partition hash against nats-server's own mapping,
rows on the wire, the config section, and "same code, another transport": the agents' and detect
partitions' Pipelines, fed through the wire format, raise what `serve`'s one Pipeline raises."""

from __future__ import annotations

import asyncio
import subprocess

import polars as pl
import pytest

from gpuvigil import config
from gpuvigil.config.deploy import Fleet, fleet_from_config
from gpuvigil.errors import UserError
from gpuvigil.fleet import connection, transport
from gpuvigil.app import compose
from gpuvigil.fleet.agent import NodeView, SimWorld, job_rows, node_summary
from gpuvigil.fleet.detect import Feed
from gpuvigil.pipeline.core import Pipeline
from gpuvigil.app.runtime import build_simulated


def test_config_section_is_strict():
    cfg = config.load()
    assert fleet_from_config(cfg).partitions == 16
    with pytest.raises(UserError, match=r"fleet\.partiton: unknown key; did you mean 'partitions'"):
        fleet_from_config({"fleet": {"partiton": 4}})
    with pytest.raises(UserError, match="replay_seconds 900 exceeds rows_max_age_seconds 600"):
        fleet_from_config({"fleet": {"rows_max_age_seconds": 600, "replay_seconds": 900}})
    with pytest.raises(UserError, match="cluster_refresh_seconds 60 must be below findings_stale_seconds 60"):
        fleet_from_config({"fleet": {"cluster_refresh_seconds": 60}})
    with pytest.raises(UserError, match="not a nats://"):
        fleet_from_config({"fleet": {"servers": ["http://x:4222"]}})
    with pytest.raises(config.ConfigError, match="fleet"):
        config.load(overrides={"fleet": {"lease_ttl_seconds": 0}})


def test_detectors_split_is_serves_set():
    cfg = config.defaults()
    from gpuvigil.detectors.registry import default_detectors

    agent, detect, cluster = (compose.detectors(cfg, role, fleet=Fleet()) for role in ("agent", "detect", "act"))
    assert {d.name for d in agent} == {"xid", "ecc", "thermal", "pcie", "anomaly", "nvlink_crc", "infiniband", "nvlink_fabric", "memory_repair"}
    assert [d.name for d in cluster] == ["fragmentation_cluster"]  # run by the act leader
    # Every detector serve runs runs somewhere in the fleet, and in one place only.
    names = [d.name for d in (*agent, *detect, *cluster)]
    assert sorted(names) == sorted(d.name for d in default_detectors(cfg))
    with pytest.raises(UserError, match="unknown detector"):
        compose.detectors(cfg, "agent", fleet=Fleet(agent_detectors=["xid", "thermo"]))


def test_frames_round_trip_and_tokens():
    df = pl.DataFrame({"ts": [1.0, 2.0], "job": ["a", "a"], "rank": [0, 1]}, schema={"ts": pl.Float64, "job": pl.Utf8, "rank": pl.Int32})
    body, index = transport.encode_frames({"rank_progress": df, "nonsense_stream": df})
    out = transport.decode_frames(body, index)
    assert list(out) == ["rank_progress"]  # an unknown stream is skipped, not fatal
    assert out["rank_progress"].equals(df)
    assert transport.token("job-1_a") == "job-1_a"
    odd = [transport.token(n) for n in ("ns/pod.a", "ns/pod_a", "a b*>")]
    assert len(set(odd)) == 3 and all(transport._TOKEN_OK.match(t) for t in odd)


@pytest.mark.services
def test_partition_hash_is_the_servers(tmp_path):
    """`partition_of` is what nats-server's {{partition(N,1)}} mapping picks, name by name."""
    from fleet_helpers import nats_binary
    from services import free_port

    exe = nats_binary()
    fleet = Fleet(partitions=7)
    port = free_port()
    conf = tmp_path / "n.conf"
    conf.write_text(f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n{transport.nats_mapping(fleet)}\n')
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=(tmp_path / "n.log").open("w"), stderr=subprocess.STDOUT)
    jobs = ["llm-pretrain", "vision-ft", "12345", "ns/pod.a", "train-a", "train-b", *[f"job-{i}" for i in range(40)]]
    fleet = fleet.model_copy(update={"servers": [f"nats://127.0.0.1:{port}"]})

    async def go() -> dict[str, int]:
        nc = await connection.connect(fleet, "probe")  # retries until the server listens
        js = nc.jetstream()
        await transport.ensure(js, fleet)
        subjects = transport.Subjects(fleet)
        got = {}
        for job in jobs:
            await js.publish(subjects.rows(job), job.encode())
        sub = await js.pull_subscribe(f"{fleet.prefix}.part.>", stream=subjects.rows_stream)
        while len(got) < len(jobs):
            for m in await sub.fetch(64, timeout=5):
                got[m.data.decode()] = subjects.partition_from_subject(m.subject)
        await nc.close()
        return got

    try:
        got = asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(10)
    assert got == {j: transport.partition_of(j, 7) for j in jobs}
    assert len(set(got.values())) == 7  # 46 names use every partition


# A 16-GPU job over two nodes whose one GPU draws more power than its peers: `anomaly` runs in
# the agent, which sees only its node's 8 GPUs of the job, where serve compares all 16.
POWER_TWO_NODES = {
    "name": "power_two_nodes", "description": "one GPU of a two-node job draws more power than its peers", "duration_seconds": 600, "nodes": 2,
    "jobs": [{"name": "big", "gpus": 16, "gpus_per_node": 8, "step_time_seconds": 1.0, "collectives_per_step": 4, "checkpoint_every_steps": 1000,
              "memory_base_gib": 40, "memory_peak_gib": 80, "priority": "P1", "tenant": "research"}],
    "faults": [{"type": "power_excursion", "at": 100, "job": "big", "ranks": [3], "power_excess_w": 250}],
}


@pytest.mark.parametrize(("scenario", "horizon", "kind"), [("nccl_hang", 140.0, "collective_hang"), ("leak_to_oom", 150.0, "oom_predicted"),
                                                           ("power_two_nodes", 200.0, "anomaly")])
def test_same_findings_as_serve(tmp_path, scenario, horizon, kind):
    """A scenario through serve's single Pipeline and through the fleet's Pipelines (one per node
    with the node detectors, one per job partition with the job detectors, rows carried in the
    wire format): the same findings, at the same data time, up to the first one (after it serve's
    built-in scheduler acts on hints and the two worlds part). leak_to_oom: the L0 per-GPU memory
    trend (`oom_device`) runs in detect next to `oom`, whose L2 finding supersedes it there as in
    serve (in the agent it would raise a second finding for the same leak)."""
    import yaml

    if scenario == "power_two_nodes":
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(POWER_TWO_NODES))
        scenario = str(tmp_path / "s.yaml")
    cfg = config.defaults()
    fleet = Fleet(partitions=4)

    rt = build_simulated(scenario, seed=3, cfg=cfg)
    serve_found = []
    while rt.now < horizon and not serve_found:
        new = rt.step().new_findings  # step() advances rt.now to the tick's time
        serve_found = [(f.kind.value, f.job, f.node, f.gpu, tuple(f.culprit_ranks), f.source, rt.now) for f in new]

    world = SimWorld(scenario, None, 3, cfg)
    nodes = {n: compose.build(cfg, "agent", [NodeView(world, n)], fleet=fleet) for n in world.node_names}
    feeds = {p: Feed() for p in range(fleet.partitions)}
    parts = {p: compose.build(cfg, "detect", [feeds[p]], fleet=fleet) for p in feeds}
    fleet_found = []
    now = 0.0
    while now < horizon and not fleet_found:
        now += 1.0
        for node, pipe in nodes.items():
            fleet_found += [(f.kind.value, f.job, f.node, f.gpu, tuple(f.culprit_ranks), f.source, now) for f in pipe.tick(now).new_findings]
            for job, frames in job_rows(pipe.window, node).items():
                body, index = transport.encode_frames(frames)
                feeds[transport.partition_of(job, fleet.partitions)].add(transport.decode_frames(body, index), node, job, now)
        world.after_tick(now)
        for pipe in parts.values():
            fleet_found += [(f.kind.value, f.job, f.node, f.gpu, tuple(f.culprit_ranks), f.source, now) for f in pipe.tick(now).new_findings]
    assert serve_found, "serve found nothing: the comparison would be empty"
    assert sorted(fleet_found) == sorted(serve_found)
    assert any(k == kind for k, *_ in fleet_found)


def test_deploy_example_validates_and_names_its_mapping():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "deploy" / "fleet.yaml"
    cfg = config.load(path)
    fleet = fleet_from_config(cfg, str(path))
    assert fleet.replicas == 3 and fleet.partitions == 64
    assert transport.nats_mapping(fleet) in path.read_text()  # the comment shows the line to paste


def test_act_relay_runs_serves_lifecycle_and_routes_by_tenant(tmp_path):
    """act's Pipeline: the relayed finding is new once, stays active while reported, carries the
    job's tenant into its alert, and its hints come from serve's hint rules."""
    from gpuvigil.alerts.pusher import AlertPusher
    from gpuvigil.alerts.settings import load_settings
    from gpuvigil.fleet.act import Relay, TenantFeed
    from gpuvigil.model import Finding, FindingKind, Severity

    cfg = config.defaults()
    relay = Relay(stale_seconds=60)
    pipe = Pipeline([TenantFeed(relay)], [relay], cfg=cfg)
    f = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=10.0, job="train-a", ranks=[0, 1], culprit_ranks=[1],
                node="n1", gpu=1, summary="train-a is hung", source="hang")
    body = transport.findings_payload("detect", 10.0, [f], partition=3, owner="d1", tenants={"train-a": "research"})
    doc, found = transport.parse_findings(body)
    relay.update("gv.findings.part.3", doc["now"], found, doc["tenants"])
    first = pipe.tick(10.0)
    relay.update("gv.findings.part.3", 11.0, found, doc["tenants"])  # the same state read again
    second = pipe.tick(11.0)
    assert [x.id for x in first.new_findings] == [f.id] and second.new_findings == []
    assert first.new_hints and all(h.finding_id == f.id for h in first.new_hints)
    pusher = AlertPusher("http://127.0.0.1:9", tmp_path / "outbox.sqlite", load_settings(cfg))
    try:
        alert = pusher.alert_for(first.new_findings[0], pusher._tenants(pipe.window), starts_at=10.0, ends_at=70.0)
    finally:
        pusher.close()
    assert alert["labels"]["tenant"] == "research"


@pytest.mark.parametrize("command", ["agent", "detect", "act"])
def test_fleet_commands_reject_a_bad_config_in_one_line(tmp_path, capsys, command):
    from gpuvigil.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("fleet:\n  partiton: 4\n")
    assert main([command, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpuvigil: error: ") and "did you mean 'partitions'" in err[0], err


def test_act_api_needs_a_store_and_a_token(tmp_path, capsys, monkeypatch):
    from gpuvigil.cli.main import main

    monkeypatch.delenv("GPUVIGIL_API_TOKEN", raising=False)
    assert main(["act", "--api-port", "0"]) == 2
    assert "give --hint-db too" in capsys.readouterr().err
    assert main(["act", "--api-port", "0", "--hint-db", str(tmp_path / "h.sqlite")]) == 2
    assert "needs a token" in capsys.readouterr().err


def test_fragmentation_cluster_at_act_as_in_serve():
    """`fragmentation_cluster` needs every node: in the fleet each agent publishes its node summary
    (JSON, through the wire form) and the act leader runs serve's detector over their union. The
    cluster_fragmentation scenario gives the same first finding, at the same data time, as serve,
    and act's Pipeline issues serve's `compact` hint for it."""
    import json

    from gpuvigil.fleet.act import ClusterView, Relay, TenantFeed

    cfg = config.defaults()
    fleet = Fleet(partitions=4)
    horizon = 90.0

    def key(f, now):
        return (f.kind.value, f.job, f.node, json.dumps(f.evidence, sort_keys=True), now)

    rt = build_simulated("cluster_fragmentation", seed=1, cfg=cfg)
    serve_found = []
    while rt.now < horizon and not serve_found:
        new = rt.step().new_findings
        serve_found = [key(f, rt.now) for f in new if f.kind.value == "fragmentation_cluster"]

    world = SimWorld("cluster_fragmentation", None, 1, cfg)
    nodes = {n: compose.build(cfg, "agent", [NodeView(world, n)], fleet=fleet) for n in world.node_names}
    relay, view = Relay(stale_seconds=60), ClusterView(stale_seconds=60)
    act = compose.build(cfg, "act", [TenantFeed(relay, view)], fleet=fleet, lead=[relay])
    fleet_found, hints = [], []
    now = 0.0
    while now < horizon and not fleet_found:
        now += 1.0
        for i, (node, pipe) in enumerate(nodes.items()):
            pipe.tick(now)
            doc = node_summary(pipe.window, node, world.queue() if i == 0 else None)
            view.update(json.loads(json.dumps(doc, default=str)), now)
        world.after_tick(now)
        result = act.tick(now)
        fleet_found = [key(f, now) for f in result.new_findings if f.kind.value == "fragmentation_cluster"]
        hints = [h for h in result.new_hints if h.finding_id in {f.id for f in result.new_findings}]
    assert serve_found, "serve found no fragmentation: the comparison would be empty"
    assert fleet_found == serve_found
    assert fleet_found[0][1] == "moe-gang"
    assert {h.action.value for h in hints} == {"compact"}
    # A malformed summary is refused whole (never half-applied into the view).
    before = view.version
    assert not view.update({"node": "node-x", "row": None, "allocations": [["j", 0]]}, now)
    assert not view.update({"node": "node-x", "row": "up"}, now)
    assert "node-x" not in view.nodes and view.version == before
    # A node whose agent went silent leaves the view (its free GPUs are no longer counted).
    view.nodes[world.node_names[0]] = (view.nodes[world.node_names[0]][0] - 120.0, view.nodes[world.node_names[0]][1])
    view.expire()
    assert world.node_names[0] not in view.nodes and len(view.nodes) == len(world.node_names) - 1


def test_simulated_agent_serves_every_nodes_metrics():
    """One `gpuvigil agent` process playing the whole simulated cluster serves every node's GPU
    series on its one /metrics (node-labelled, none twice), as one agent per node would."""
    import argparse

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from gpuvigil.fleet.agent import Agent

    args = argparse.Namespace(config=None, nats=[], node=None, scenario="nccl_hang", nodes=3, seed=0, speed=1.0, host="127.0.0.1", port=0, duration=0.0)
    agent = Agent(args)
    try:
        agent.start_metrics()
        for _ in range(3):
            agent.tick()
        text = httpx.get(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10).text
    finally:
        agent.close()
    series = [(s.name, tuple(sorted(s.labels.items()))) for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert len(series) == len(set(series)), "a series appears twice"
    util_nodes = {dict(labels)["node"] for name, labels in series if name == "gpuvigil_gpu_utilization_ratio"}
    assert util_nodes == set(agent.world.node_names) and len(util_nodes) == 3
    ticks = [v for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "gpuvigil_pipeline_ticks_total" for v in [s.value]]
    assert ticks == [3.0]
