"""One NATS server of three lost, with the shipped lease TTL: no replica drops a lease over it.

A real 3-node JetStream cluster (Debian's nats-server), two `gpuvigil detect` replicas sharing the
partitions and one `gpuvigil act` leader. The test kills the NATS node that leads the leases
bucket (the worst one to lose: every renewal waits for the bucket's new RAFT leader) and watches
for three TTLs. Every lease must stay with its holder all along: no partition changes hands, none
is lost or taken again, and the act leader keeps its one term (docs/scale.md: the lease timing
budget, a NATS election of ~5 s inside the ~6.5 s of validity a 10 s TTL leaves).
"""

from __future__ import annotations

import time

import pytest
import yaml

from fleet_helpers import GvProc as Proc, NatsCluster, Probe, nats_binary
from services import wait_for
from test_fleet_e2e import scrape, value

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.transport import nats_mapping

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]
PARTITIONS = 8


def test_losing_the_nats_node_that_leads_the_leases_costs_no_lease(tmp_path):
    nats_binary()
    fleet = Fleet(partitions=PARTITIONS, replicas=3)
    assert fleet.lease_ttl_seconds == 10  # the shipped TTL, not a test's shorter one
    cluster = NatsCluster(tmp_path, 3, nats_mapping(fleet))
    procs: list[Proc] = []
    probe = None
    try:
        cluster.wait_ready()
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {**fleet.model_dump(), "servers": cluster.urls}}))
        probe = Probe(cluster.urls)
        common = ["--config", "fleet.yaml", "--log-level", "info", "--metrics-port", "0"]
        detects = {n: Proc(n, ["detect", *common, "--id", n], tmp_path) for n in ("detect-1", "detect-2")}
        act = Proc("act-1", ["act", *common, "--id", "act-1", "--outbox", "outbox.sqlite", "--hint-db", "hints.sqlite"], tmp_path)
        procs += [*detects.values(), act]

        def settled() -> dict[str, str] | None:
            h = probe.holders()
            parts = {k: v for k, v in h.items() if k.startswith("part.")}
            return h if len(parts) == PARTITIONS and set(parts.values()) == set(detects) and "act.leader" in h else None

        before = wait_for(settled, 90, 0.5, "both detect replicas sharing the partitions and an act leader")
        time.sleep(2 * fleet.lease_ttl_seconds / 4)  # a renewal or two on the held leases: a steady state
        before = wait_for(settled, 30, 0.5, "a steady lease table")
        counts = {n: (value(scrape(p), "gpuvigil_detect_partitions_taken_total"), value(scrape(p), "gpuvigil_detect_partitions_lost_total"))
                  for n, p in detects.items()}
        terms = value(scrape(act), "gpuvigil_act_leader_terms_total")
        assert terms == 1

        cluster.kill(int(probe.stream_leader("KV_gv_leases").removeprefix("n")))
        time.sleep(3 * fleet.lease_ttl_seconds)

        after = wait_for(settled, 30, 0.5, "a readable lease table after the NATS node's loss")
        assert {k: v for k, v in after.items() if k.startswith(("part.", "act."))} == {k: v for k, v in before.items() if k.startswith(("part.", "act."))}
        for name, proc in detects.items():
            m = scrape(proc)
            got = (value(m, "gpuvigil_detect_partitions_taken_total"), value(m, "gpuvigil_detect_partitions_lost_total"))
            assert got == counts[name], f"{name}: (taken, lost) {counts[name]} -> {got}\n{proc.tail()}"
            assert value(m, "gpuvigil_detect_member_lease_held") == 1
        m_act = scrape(act)
        assert value(m_act, "gpuvigil_act_leader_terms_total") == terms, act.tail()
        assert value(m_act, "gpuvigil_act_lease_held") == 1
    finally:
        for p in procs:
            p.stop()
        if probe is not None:
            probe.close()
        cluster.stop()
