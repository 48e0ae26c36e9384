"""The fleet on a real nats-server with the job rows spread over two streams (`fleet.rows_streams:
2`), the cluster-scope detector at the act leader, and the /metrics of detect and act.

One JetStream server on loopback (the three-node cluster and its failures are
test_fleet_e2e's), one `gpuvigil agent` playing a fragmented simulated cluster in which a small
training job hangs, one `gpuvigil detect` replica, then a second one, and one `gpuvigil act`.
Asserts:
- each rows stream stores exactly its partitions (p % 2), and both carry rows;
- the detect replica reads each leased partition from its stream: the hang of a job whose
  partition lives in the second stream is found and reaches act;
- `fragmentation_cluster` runs at the act leader over the agents' node summaries: the blocked
  gang job is found there and its `compact` hint is stored;
- a second replica that takes partitions over (the first one SIGKILLed) rebuilds every
  partition from its own stream;
- detect's and act's /metrics (prometheus_client) report what happened.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet_helpers import GvProc as Proc, Probe, nats_binary
from services import free_port, wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.transport import Subjects, nats_mapping, partition_of

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]
PARTITIONS = 4
HUNG = "train-y"  # partition 3 of 4: stored in the second stream, GV_ROWS_1

SCENARIO = {
    "name": "fleet_streams",
    "description": "a fragmented cluster with a blocked 8-GPU gang, and a small training job that hangs",
    "duration_seconds": 900,
    "nodes": 6,
    "jobs": [{"name": HUNG, "gpus": 2, "step_time_seconds": 0.6, "collectives_per_step": 2, "checkpoint_every_steps": 500, "checkpoint_seconds": 5,
              "memory_base_gib": 20, "memory_peak_gib": 50, "priority": "P1", "tenant": "research"}],
    "fragmented_cluster": {"small_job_gpus": [1, 2, 3], "free_per_node": [2, 4],
                           "gang": {"name": "moe-gang", "gpus": 8, "gpus_per_node": 8, "step_time_seconds": 0.8, "memory_base_gib": 40,
                                    "memory_peak_gib": 100, "priority": "P1", "tenant": "research", "submit_at": 20}},
    "faults": [{"type": "nccl_hang", "at": 30, "job": HUNG, "ranks": [1], "mode": "outside"}],
}


def scrape(proc: Proc) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) → value; empty while the endpoint is not up."""
    url = proc.metrics_url()
    if url is None:
        return {}
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_rows_over_two_streams_fragmentation_at_act_and_metrics(tmp_path):
    exe = nats_binary()
    fleet = Fleet(partitions=PARTITIONS, rows_streams=2, replicas=1, lease_ttl_seconds=4, replay_seconds=300, rows_max_age_seconds=600,
                  findings_refresh_seconds=2, findings_stale_seconds=30)
    port, http = free_port(), free_port()
    (tmp_path / "nats.conf").write_text(f'listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{http}\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n{nats_mapping(fleet)}\n')
    nats = subprocess.Popen([exe, "-c", str(tmp_path / "nats.conf")], stdout=(tmp_path / "nats.log").open("w"), stderr=subprocess.STDOUT)
    url = f"nats://127.0.0.1:{port}"
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO, sort_keys=False))
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {**fleet.model_dump(), "servers": [url]}}))
    common = ["--config", "fleet.yaml", "--log-level", "info"]
    procs: list[Proc] = []
    probe = None
    try:
        wait_for(lambda: _healthy(http), 30, 0.2, "nats-server")
        probe = Probe([url])
        d1 = Proc("detect-1", ["detect", *common, "--id", "detect-1", "--metrics-port", "0"], tmp_path)
        act = Proc("act-1", ["act", *common, "--id", "act-1", "--hint-db", "hints.sqlite", "--metrics-port", "0"], tmp_path)
        procs += [d1, act]
        wait_for(lambda: len([k for k in probe.holders() if k.startswith("part.")]) == PARTITIONS and "act.leader" in probe.holders(), 60, 0.5,
                 "detect-1 holding every partition and an act leader")
        agent = Proc("agent", ["agent", *common, "--scenario", "scenario.yaml", "--speed", "4", "--port", "-1"], tmp_path)
        procs.append(agent)

        def found() -> dict | None:
            m = scrape(act)
            ok = value(m, "gpuvigil_act_findings_total", kind="fragmentation_cluster") >= 1 and value(m, "gpuvigil_act_findings_total", kind="collective_hang") >= 1
            return m if ok else None

        try:
            m_act = wait_for(found, 150, 1.0, "act to raise the fragmentation and to relay the hang")
        except AssertionError:
            raise AssertionError("\n".join(p.tail() for p in procs)) from None

        # Each stream stores exactly its partitions, and both carry rows.
        subjects = Subjects(fleet)
        assert partition_of(HUNG, PARTITIONS) % 2 == 1 and subjects.rows_stream_of(partition_of(HUNG, PARTITIONS)) == "GV_ROWS_1"
        infos = {name: probe.call(probe.nc.jetstream(timeout=5).stream_info(name)) for name in ("GV_ROWS_0", "GV_ROWS_1")}
        assert sorted(infos["GV_ROWS_0"].config.subjects) == ["gv.part.0.>", "gv.part.2.>"]
        assert sorted(infos["GV_ROWS_1"].config.subjects) == ["gv.part.1.>", "gv.part.3.>"]
        assert all(i.state.messages > 0 for i in infos.values()), {n: i.state.messages for n, i in infos.items()}
        with pytest.raises(Exception, match="not found"):  # no single GV_ROWS stream when N > 1
            probe.call(probe.nc.jetstream(timeout=5).stream_info("GV_ROWS"))

        # detect read both streams; act's /metrics say what it did.
        m_d1 = scrape(d1)
        for stream in ("GV_ROWS_0", "GV_ROWS_1"):
            assert value(m_d1, "gpuvigil_detect_messages_total", stream=stream) > 0, stream
            assert value(m_d1, "gpuvigil_detect_rows_total", stream=stream) > 0, stream
        assert value(m_d1, "gpuvigil_detect_partitions_held", replica="detect-1") == PARTITIONS
        assert value(m_d1, "gpuvigil_detect_partitions_caught_up", replica="detect-1") == PARTITIONS
        assert value(m_d1, "gpuvigil_detect_active_findings", partition=str(partition_of(HUNG, PARTITIONS))) >= 1
        assert value(m_d1, "gpuvigil_detect_findings_published_total") > 0
        assert value(m_act, "gpuvigil_act_leader", replica="act-1") == 1 and value(m_act, "gpuvigil_act_lease_held", replica="act-1") == 1
        assert value(m_act, "gpuvigil_act_leader_terms_total") == 1
        assert value(m_act, "gpuvigil_act_findings_messages_total") > 0
        assert value(m_act, "gpuvigil_act_cluster_nodes") == 6
        assert value(m_act, "gpuvigil_act_hints_claimed_total") >= 2  # the hang's and the compact hint
        assert value(m_act, "gpuvigil_act_hints_skipped_total") == 0
        assert value(m_act, "gpuvigil_act_ticks_total") > 0
        assert value(m_act, "gpuvigil_act_pages_total") == 0  # no Alertmanager given: nothing handed to a pusher

        # The act leader's fragmentation finding went through serve's hint rules into the store.
        con = sqlite3.connect(tmp_path / "hints.sqlite")
        try:
            rows = con.execute("SELECT action, job FROM hints").fetchall()
        finally:
            con.close()
        assert ("compact", "moe-gang") in rows, rows
        assert any(job == HUNG for _, job in rows), rows
        assert re.search(r"act act-1: finding ticket fragmentation_cluster: moe-gang", act.text())

        # A second replica joins, then the first dies: the survivor replays every partition from
        # the stream that stores it.
        d2 = Proc("detect-2", ["detect", *common, "--id", "detect-2", "--metrics-port", "0"], tmp_path)
        procs.append(d2)
        wait_for(lambda: value(scrape(d2), "gpuvigil_detect_partitions_caught_up") >= PARTITIONS // 2, 60, 0.5, "detect-2 to take its share")
        d1.stop(signal.SIGKILL)
        m_d2 = wait_for(lambda: (m := scrape(d2)) and value(m, "gpuvigil_detect_partitions_caught_up") == PARTITIONS and m, 60, 0.5,
                        "detect-2 to take every partition over")
        log2 = d2.text()
        for p in range(PARTITIONS):
            assert re.search(rf"took partition {p} \(stream GV_ROWS_{p % 2}\)", log2), (p, log2[-2000:])
            replayed = [int(n) for n in re.findall(rf"partition {p} rebuilt from the stream \((\d+) messages", log2)]
            assert replayed and max(replayed) > 0, (p, replayed)
        assert value(m_d2, "gpuvigil_detect_messages_total", stream="GV_ROWS_0") > 0 and value(m_d2, "gpuvigil_detect_messages_total", stream="GV_ROWS_1") > 0
        assert value(m_d2, "gpuvigil_detect_partitions_taken_total") >= PARTITIONS
        # The hang is still active in the partition the survivor rebuilt.
        wait_for(lambda: value(scrape(d2), "gpuvigil_detect_active_findings", partition=str(partition_of(HUNG, PARTITIONS))) >= 1, 60, 0.5,
                 "the rebuilt partition to hold the hang again")

        # A process configured for another number of rows streams refuses to start, in one line.
        from gpuvigil.errors import UserError
        from gpuvigil.fleet.transport import ensure

        for n in (1, 4):
            with pytest.raises(UserError, match="made for another fleet.rows_streams"):
                probe.call(ensure(probe.nc.jetstream(timeout=5), fleet.model_copy(update={"rows_streams": n}), attempts=2))
    finally:
        for p in procs:
            p.stop()
        if probe is not None:
            probe.close()
        nats.terminate()
        nats.wait(10)


def _healthy(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_rows_streams_config_and_subject_sets():
    """Partition p → stream p % N, every partition in exactly one stream; N=1 keeps the one
    `GV_ROWS` stream of earlier deployments; N > partitions is refused."""
    from gpuvigil.config.deploy import fleet_from_config
    from gpuvigil.errors import UserError

    one = Subjects(Fleet(partitions=8))
    assert one.rows_streams() == {"GV_ROWS": ["gv.part.>"]} and one.rows_stream_of(5) == "GV_ROWS"
    three = Subjects(Fleet(partitions=8, rows_streams=3))
    streams = three.rows_streams()
    assert sorted(streams) == ["GV_ROWS_0", "GV_ROWS_1", "GV_ROWS_2"]
    covered = [s for subs in streams.values() for s in subs]
    assert sorted(covered) == sorted(f"gv.part.{p}.>" for p in range(8))
    assert all(f"gv.part.{p}.>" in streams[three.rows_stream_of(p)] for p in range(8))
    with pytest.raises(UserError, match="rows_streams 9 exceeds partitions 8"):
        fleet_from_config({"fleet": {"partitions": 8, "rows_streams": 9}})
