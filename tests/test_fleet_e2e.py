"""The fleet end to end on the real engine: three nats-server nodes clustered with JetStream on
loopback (streams and buckets replicated x3), one `gpuvigil agent` process playing every node of a
simulated cluster with injected faults, two `gpuvigil detect` replicas, two `gpuvigil act`
replicas, and a real Alertmanager paging a webhook receiver.

Mid-run (right after the hang is injected, before anything could have found it) the test kills the
NATS node that leads the leases bucket (the worst one to lose: every renewal waits for a new
leader; the surviving replicas must not drop a lease over it), the detect replica that owns the hung job's partition and the act leader, all with
SIGKILL. Before that, and again once everything paged, a client stamps a clock announcement, a rows
message and a findings message an hour ahead: the replicas count and ignore them (their data clock
is bounded by their own), act clears and re-raises nothing, and the lost GPU's XID, injected after
the first of them, still pages. Then it asserts that every injected fault is still paged, that
none is paged twice (nor any other alert), that no hint was issued twice, that the survivor took the dead replica's
partitions, and that fault→page time stays within the level's target plus the lease time.
"""

from __future__ import annotations

import re
import sqlite3
import time

import httpx
import pytest
import yaml

from fleet_helpers import GvProc as Proc, NatsCluster, Probe, nats_binary
from services import WebhookSink, binary, start_alertmanager, wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet import transport
from gpuvigil.fleet.transport import nats_mapping, partition_of

pytestmark = [pytest.mark.services, pytest.mark.timeout(420)]
PARTITIONS = 8
LEASE_TTL = 4.0
SPEED = 4.0
# The detection target of each fault's level (docs/levels.md: hang L0 <= 60 s; device faults are
# L0 too), in seconds; the bound adds the lease time (the failovers) and Alertmanager's group_wait.
TARGET_SECONDS = 60.0
GROUP_WAIT = 1.0

SCENARIO = {
    "name": "fleet_faults",
    "description": "two training jobs on four nodes; a hot GPU, a hang and a lost GPU",
    "duration_seconds": 3600,
    "nodes": 4,
    "jobs": [
        {"name": "train-a", "gpus": 16, "gpus_per_node": 8, "step_time_seconds": 1.2, "collectives_per_step": 4, "checkpoint_every_steps": 50,
         "checkpoint_seconds": 12, "memory_base_gib": 40, "memory_peak_gib": 95, "priority": "P1", "tenant": "research"},
        {"name": "train-b", "gpus": 8, "gpus_per_node": 8, "step_time_seconds": 0.4, "collectives_per_step": 2, "checkpoint_every_steps": 300,
         "checkpoint_seconds": 6, "memory_base_gib": 25, "memory_peak_gib": 70, "priority": "P2", "tenant": "prod"},
    ],
    "faults": [
        {"type": "thermal", "at": 30, "job": "train-b", "ranks": [2], "temperature_c": 93},
        {"type": "nccl_hang", "at": 40, "job": "train-a", "ranks": [5], "mode": "outside"},
        {"type": "gpu_lost", "at": 60, "job": "train-b", "ranks": [6]},
    ],
}
# fault type → (finding kind, job) its page must name
EXPECTED = {"thermal": ("thermal_throttle", "train-b"), "nccl_hang": ("collective_hang", "train-a"), "gpu_lost": ("xid", "train-b")}
KILL_AT = 42.0  # data time: after the hang (40), before any detector could have confirmed it
FORGE_AT = 20.0  # data time of the first forged future stamps: before any fault


def firing_pages(webhook: WebhookSink) -> list[dict]:
    """Every alert in every firing notification (one alert per group: group_by ['...'])."""
    out = []
    for _path, payload in webhook.notifications("/page"):
        for alert in payload.get("alerts", []):
            if alert.get("status") == "firing":
                out.append(alert)
    return out


def scrape(proc: Proc) -> dict[tuple[str, tuple], float]:
    """A replica's /metrics (the URL it printed at start) as (sample, sorted labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    url = proc.metrics_url()
    assert url, proc.tail()
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_fleet_survives_nats_detect_and_act_failures(tmp_path):
    nats_binary()
    binary("prometheus-alertmanager", "alertmanager")
    # The simulator's data time starts at 0 and runs SPEED times the wall clock: the replicas bound
    # theirs by it (clock_origin data), 30 data s (7.5 wall s) of skew allowed.
    fleet = Fleet(partitions=PARTITIONS, replicas=3, lease_ttl_seconds=LEASE_TTL, replay_seconds=300, rows_max_age_seconds=600,
                  findings_refresh_seconds=2, findings_stale_seconds=30, clock_origin="data", clock_rate=SPEED, clock_max_skew_seconds=30)
    cluster = NatsCluster(tmp_path, 3, nats_mapping(fleet))
    procs: list[Proc] = []
    probe = None
    webhook = WebhookSink().__enter__()
    am = None
    try:
        cluster.wait_ready()
        am = start_alertmanager({
            "route": {"receiver": "page", "group_by": ["..."], "group_wait": f"{GROUP_WAIT:g}s", "group_interval": "1h", "repeat_interval": "4h"},
            "receivers": [{"name": "page", "webhook_configs": [{"url": f"{webhook.url}/page", "send_resolved": False}]}],
        }, tmp_path / "alertmanager")
        (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO, sort_keys=False))
        fleet_cfg = {**fleet.model_dump(), "servers": cluster.urls}
        # Resends every 2 s: a re-sent alert that Alertmanager did not merge would page again.
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": fleet_cfg, "alerts": {"resend_seconds": 2, "end_after_seconds": 60}}))
        probe = Probe(cluster.urls)
        common = ["--config", "fleet.yaml", "--log-level", "info"]
        detects = {name: Proc(name, ["detect", *common, "--id", name, "--metrics-port", "0"], tmp_path) for name in ("detect-1", "detect-2")}
        acts = {name: Proc(name, ["act", *common, "--id", name, "--metrics-port", "0", "--alertmanager", am.url, "--outbox", f"{name}-outbox.sqlite",
                                  "--hint-db", f"{name}-hints.sqlite", "--api-port", "0", "--insecure-local",
                                  "--scheduler", "slurm", "--act", "dry-run"], tmp_path) for name in ("act-1", "act-2")}
        procs += [*detects.values(), *acts.values()]

        def settled() -> dict[str, str] | None:
            h = probe.holders()
            owners = {v for k, v in h.items() if k.startswith("part.")}
            parts = [k for k in h if k.startswith("part.")]
            return h if owners == set(detects) and len(parts) == PARTITIONS and "act.leader" in h else None

        wait_for(settled, 90, 0.5, "both detect replicas sharing the partitions and an act leader")
        agent = Proc("agent", ["agent", *common, "--scenario", "scenario.yaml", "--speed", str(SPEED), "--port", "-1"], tmp_path)
        procs.append(agent)
        assert probe.stream_replicas("GV_ROWS") == 3 and probe.stream_replicas("GV_FINDINGS") == 3 and probe.stream_replicas("GV_CLUSTER") == 3

        def forge() -> None:
            """An hour ahead, on every path a time travels: a clock announcement, a job's rows, a
            source's findings."""
            ahead = probe.now + 3600.0
            probe.publish("gv.clock.forged", b'{"now": %r}' % ahead)
            probe.publish("gv.rows.train-a", b"", {"Gv-Frames": "", "Gv-Node": "forged", "Gv-Job": "train-a", "Gv-Now": repr(ahead)})
            probe.publish("gv.findings.node.forged", transport.findings_payload("agent", ahead, [], node="forged"))

        wait_for(lambda: probe.now >= FORGE_AT, 120, 0.2, f"the fleet clock to reach {FORGE_AT}s")
        forge()
        # What each replica had lost so far (a loaded machine's start-up may cost a lease): the
        # NATS node's loss must cost none more.
        lost_at_forge = {n: value(scrape(p), "gpuvigil_detect_partitions_lost_total") for n, p in detects.items()}
        terms_at_forge = {n: value(scrape(p), "gpuvigil_act_leader_terms_total") for n, p in acts.items()}
        wait_for(lambda: probe.now >= KILL_AT, 120, 0.2, f"the fleet clock to reach {KILL_AT}s")
        holders = wait_for(settled, 30, 0.2, "a readable lease table at the kill point")
        hung_part = f"part.{partition_of('train-a', PARTITIONS)}"
        victim_detect = holders[hung_part]
        victim_act = holders["act.leader"]
        survivor_detect = next(n for n in detects if n != victim_detect)
        survivor_act = next(n for n in acts if n != victim_act)
        lost_before = lost_at_forge[survivor_detect]
        terms_before = terms_at_forge[survivor_act]
        leases_leader = probe.stream_leader("KV_gv_leases")
        cluster.kill(int(leases_leader.removeprefix("n")))
        detects[victim_detect].kill()
        acts[victim_act].kill()

        def all_paged() -> bool:
            kinds = {(a["labels"].get("kind"), a["labels"].get("job")) for a in firing_pages(webhook)}
            return all(exp in kinds for exp in EXPECTED.values())

        page_seen: dict[tuple[str, str], float] = {}

        def watch() -> bool:
            now = time.monotonic()
            for a in firing_pages(webhook):
                page_seen.setdefault((a["labels"].get("kind"), a["labels"].get("job")), now)
            return all_paged()

        try:
            wait_for(watch, 180, 0.2, "a page for every injected fault")
        except AssertionError:
            raise AssertionError("\n".join(p.tail() for p in procs) + f"\npages: {[a['labels'] for a in firing_pages(webhook)]}") from None

        # Let the survivor re-send every alert a few times (resend_seconds 2): a duplicate page
        # would arrive within Alertmanager's group_wait of a re-send.
        survivor_log = tmp_path / f"{survivor_act}-outbox.sqlite"
        wait_for(lambda: survivor_log.exists(), 30, 0.5, "the new act leader's outbox")
        # Forged future stamps again, now that act holds every finding: with an unbounded clock
        # it cleared them all at once (and re-raised them on the next true time).
        cleared_before = value(scrape(acts[survivor_act]), "gpuvigil_act_findings_cleared_total")
        forge()
        time.sleep(3 * 2 + 2 * GROUP_WAIT)

        pages = firing_pages(webhook)
        by_finding: dict[str, int] = {}
        for a in pages:
            if (a["labels"].get("kind"), a["labels"].get("job")) in EXPECTED.values():
                fid = a["annotations"].get("finding_id")
                by_finding[fid] = by_finding.get(fid, 0) + 1
        twice = {f: n for f, n in by_finding.items() if n > 1}
        assert not twice, f"an injected fault paged more than once: {twice}"

        hang = [a for a in pages if a["labels"].get("kind") == "collective_hang" and a["labels"].get("job") == "train-a"]
        assert hang and "rank 5" in hang[0]["annotations"]["summary"], hang
        assert hang[0]["labels"].get("tenant") == "research"  # act routes by the job's tenant, as serve does

        # The survivor holds every partition now (the killed replica's lease expired).
        final = wait_for(lambda: (h := probe.holders()) and {v for k, v in h.items() if k.startswith("part.")} == {survivor_detect} and h, 60, 0.5,
                         "the surviving replica to hold every partition")
        assert final.get("act.leader") == survivor_act
        assert "rebuilt from the stream" in (tmp_path / f"{survivor_detect}.log").read_text()

        # The act replicas' --hint-db are copies of the fleet's one hint store (the ledger bucket):
        # the survivor's holds every hint the killed leader stored (none lost with its disk).
        stored: dict[str, set[str]] = {}
        for name in acts:
            db = tmp_path / f"{name}-hints.sqlite"
            if db.exists():
                con = sqlite3.connect(db)
                stored[name] = {r[0] for r in con.execute("SELECT id FROM hints")}
                con.close()
        hint_ids = sorted(set().union(*stored.values()))
        assert hint_ids, "act stored no hint"
        assert stored.get(victim_act, set()) <= stored[survivor_act], stored
        # The leader applies them through serve's acting code (--act dry-run: Slurm commands it
        # would run, said once per hint across both replicas and the failovers).
        said = [m.group(1) for name in acts for m in re.finditer(r"act dry-run \(slurm\): hint \S+ (\S+): would run: ", (tmp_path / f"{name}.log").read_text())]
        assert said and set(said) <= set(hint_ids), (said, hint_ids)
        assert len(said) == len(set(said)), f"a hint was described twice: {sorted(said)}"

        # The new leader serves the feedback API (the one `serve` and `gpuvigil api` serve) over
        # its hint store, and the hung job's hints are there for the scheduler.
        hang_id = hang[0]["annotations"]["finding_id"]

        def served() -> list | None:
            # The API moves with the lease: ask the latest one the leader announced (a lease
            # lost and retaken during the NATS failover starts it again on a new port).
            lines = [ln for ln in (tmp_path / f"{survivor_act}.log").read_text().splitlines() if "feedback API http" in ln]
            if not lines:
                return None
            try:
                hints = httpx.get(f"{lines[-1].rsplit(' ', 1)[1]}/v1/hints", params={"job": "train-a"}, timeout=10).json()["hints"]
            except httpx.HTTPError:
                return None
            return [h for h in hints if h["finding_id"] == hang_id] or None

        assert wait_for(served, 30, 0.5, "the hang's hints on the new leader's feedback API")

        # The survivors' /metrics (prometheus_client) after the failovers.
        m_act = scrape(acts[survivor_act])
        assert value(m_act, "gpuvigil_act_leader") == 1 and value(m_act, "gpuvigil_act_lease_held") == 1
        assert value(m_act, "gpuvigil_act_findings_cleared_total") == cleared_before
        # Both forgeries were counted and ignored: the clock announcements by act and detect, the
        # findings by the act leader, the rows by the partition's owner.
        assert value(m_act, "gpuvigil_act_clock_future_messages_total", message="clock") == 2
        assert value(m_act, "gpuvigil_act_clock_future_messages_total", message="findings") >= 1
        assert value(m_act, "gpuvigil_act_clock_skew_seconds") > 3000  # the forged hour, seen within the last minute
        assert abs(value(m_act, "gpuvigil_act_clock_lag_seconds")) <= 30
        # The hang (found after the kill) and the lost GPU (injected after it) were handed to the
        # survivor's pusher; the thermal page may have been the killed leader's.
        assert value(m_act, "gpuvigil_act_pages_total") >= 2
        assert value(m_act, "gpuvigil_act_alerts_delivered_total") >= 2
        assert value(m_act, "gpuvigil_act_hints_claimed_total") >= 1
        # Recorded in the fleet's hint store (then described: the note is pushed too).
        assert value(m_act, "gpuvigil_act_hint_store_records_pushed_total") >= 2 * value(m_act, "gpuvigil_act_hints_claimed_total")
        # The hang's hints were claimed and described by the survivor (the kill came before them).
        assert value(m_act, "gpuvigil_act_hints_applied_total", outcome="dry_run") >= 1
        # The node summaries' stream may have had its leader on the killed node too: the view is
        # whole again once its consumer is recreated on the new leader.
        wait_for(lambda: value(scrape(acts[survivor_act]), "gpuvigil_act_cluster_nodes") == SCENARIO["nodes"], 60, 1.0,
                 "the new act leader's cluster view of every node")
        m_detect = scrape(detects[survivor_detect])
        assert value(m_detect, "gpuvigil_detect_partitions_held") == PARTITIONS
        # The NATS node leading the leases bucket died: the survivors lost no lease over it (the
        # detect replica kept its own partitions, the new act leader stayed leader).
        assert value(m_detect, "gpuvigil_detect_partitions_lost_total") == lost_before, (tmp_path / f"{survivor_detect}.log").read_text()[-3000:]
        assert value(m_act, "gpuvigil_act_leader_terms_total") == terms_before + 1  # the one term it took over in
        assert value(m_detect, "gpuvigil_detect_clock_future_messages_total", message="clock") == 2
        assert value(m_detect, "gpuvigil_detect_clock_future_messages_total", message="rows") >= 1
        assert value(m_detect, "gpuvigil_detect_partitions_taken_total") >= PARTITIONS

        # Fault → page, failovers included, within the level's target plus the lease time.
        for fault in SCENARIO["faults"]:
            key = EXPECTED[fault["type"]]
            injected_wall = probe.wall_of(fault["at"])
            assert injected_wall is not None
            latency = page_seen[key] - injected_wall
            assert latency <= TARGET_SECONDS + LEASE_TTL + GROUP_WAIT + 2.0, f"{key}: fault → page {latency:.1f}s"
    finally:
        for p in procs:
            p.stop()
        if probe is not None:
            probe.close()
        if am is not None:
            am.stop()
        webhook.__exit__(None, None, None)
        cluster.stop()
