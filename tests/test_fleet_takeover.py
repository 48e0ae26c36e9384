"""A detect takeover during a hang, on a real nats-server: the replica owning the hung job's
partition is paused (SIGSTOP) past its lease, the other one takes the partition over, and the
paused one is woken again.

The new owner says nothing but claims until its replay has caught up (never an empty state), and
its first findings carry the hang with the start the old owner timed (the stall is timed from the
stream, not from the takeover). The woken replica publishes nothing more under the lease it lost,
and anything stamped with its lease epoch is dropped by a reader (act's `Fence`) once the new
owner has claimed the partition.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import yaml

from fleet_helpers import GvProc as Proc, NatsCluster, Probe, nats_binary
from services import wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.fence import Fence
from gpuvigil.fleet.transport import nats_mapping, partition_of

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]
PARTITIONS = 4
LEASE_TTL = 4.0
SPEED = 4.0
SCENARIO = {
    "name": "takeover_hang",
    "description": "one training job on two nodes; rank 5 never joins a collective at 10 s",
    "duration_seconds": 3600,
    "nodes": 2,
    "jobs": [
        {"name": "train-a", "gpus": 16, "gpus_per_node": 8, "step_time_seconds": 1.0, "collectives_per_step": 4, "checkpoint_every_steps": 500,
         "checkpoint_seconds": 12, "memory_base_gib": 40, "memory_peak_gib": 60, "priority": "P1", "tenant": "research"},
    ],
    "faults": [{"type": "nccl_hang", "at": 10, "job": "train-a", "ranks": [5], "mode": "outside"}],
}


class Recorder:
    """Every findings message on one partition's subject, in arrival order."""

    def __init__(self, probe: Probe, subject: str):
        self.docs: list[dict] = []
        self.lock = threading.Lock()

        async def on(msg) -> None:
            with self.lock:
                self.docs.append(json.loads(msg.data))

        probe.call(probe.nc.subscribe(subject, cb=on))

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.docs)


def hangs(doc: dict) -> list[dict]:
    return [f for f in doc.get("findings", []) if f["kind"] == "collective_hang"]


def test_takeover_during_a_hang_keeps_its_start_and_fences_the_paused_owner(tmp_path):
    nats_binary()
    fleet = Fleet(partitions=PARTITIONS, replicas=1, lease_ttl_seconds=LEASE_TTL, replay_seconds=300, rows_max_age_seconds=600,
                  findings_refresh_seconds=1, findings_stale_seconds=30)
    cluster = NatsCluster(tmp_path, 1, nats_mapping(fleet))
    procs: list[Proc] = []
    probe = None
    try:
        cluster.wait_ready()
        (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO, sort_keys=False))
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {**fleet.model_dump(), "servers": cluster.urls}}))
        probe = Probe(cluster.urls)
        common = ["--config", "fleet.yaml", "--log-level", "info"]
        detects = {name: Proc(name, ["detect", *common, "--id", name], tmp_path) for name in ("detect-1", "detect-2")}
        procs += detects.values()
        key = f"part.{partition_of('train-a', PARTITIONS)}"
        rec = Recorder(probe, f"gv.findings.{key}")

        def settled():
            h = probe.holders()
            return h if {v for k, v in h.items() if k.startswith("part.")} == set(detects) and sum(k.startswith("part.") for k in h) == PARTITIONS else None

        wait_for(settled, 90, 0.5, "both detect replicas sharing the partitions")
        procs.append(Proc("agent", ["agent", *common, "--scenario", "scenario.yaml", "--speed", str(SPEED), "--port", "-1"], tmp_path))

        def hang_seen():
            docs = [d for d in rec.snapshot() if hangs(d)]
            return docs[-1] if docs else None

        try:
            first = wait_for(hang_seen, 120, 0.2, "the hang published by the partition's owner")
        except AssertionError:
            raise AssertionError("\n".join(p.tail() for p in procs)) from None
        old_owner, old_epoch = first["owner"], first["epoch"]
        new_owner = next(n for n in detects if n != old_owner)
        # Let the old owner time the stall for a while, then pause it past its lease.
        wait_for(lambda: (d := hang_seen()) and d["now"] >= first["now"] + 8 and d, 60, 0.2, "the hang timed for 8 s")
        before = hang_seen()
        start = before["now"] - hangs(before)[0]["evidence"]["stalled_seconds"]
        n_before = len(rec.snapshot())
        detects[old_owner].proc.send_signal(signal.SIGSTOP)
        try:
            def taken_over():
                docs = rec.snapshot()[n_before:]
                return docs if any(d.get("owner") == new_owner and not d.get("claim") for d in docs) else None

            after = wait_for(taken_over, 90, 0.2, f"{new_owner} publishing the partition's findings")
        finally:
            detects[old_owner].proc.send_signal(signal.SIGCONT)

        mine = [d for d in after if d.get("owner") == new_owner]
        assert all(d["epoch"] > old_epoch for d in mine)
        # Claims while it catches up (if its replay outlasts a tick), then the hang: never an
        # empty state that would clear it.
        assert all(d["findings"] == [] for d in mine if d.get("claim"))
        real = [d for d in mine if not d.get("claim")]
        assert all(hangs(d) for d in real), [d for d in real if not hangs(d)]
        [h] = hangs(real[0])
        assert h["evidence"]["culprit_nodes"] and h["culprit_ranks"] == [5]
        # The stall is timed from when rank 5 stopped, as the old owner timed it (±1 s tick).
        assert abs((real[0]["now"] - h["evidence"]["stalled_seconds"]) - start) <= 1.5, (start, real[0]["now"], h["evidence"])
        assert h["evidence"]["stalled_seconds"] > hangs(before)[0]["evidence"]["stalled_seconds"]

        # The woken replica learns it lost the lease and publishes nothing more under it.
        wait_for(lambda: "lost the lease of partition" in detects[old_owner].text(), 30, 0.2, f"{old_owner} noticing it lost the lease")
        time.sleep(2.0)
        docs = rec.snapshot()
        claimed_at = docs.index(mine[0])
        # What it published under its old lease after the new owner's claim (in flight when it
        # was paused, if anything), a reader drops. Once woken, the replicas may rebalance and it
        # may take the partition again: under a new, higher epoch, which readers admit.
        stale = [i for i, d in enumerate(docs) if i >= claimed_at and d.get("owner") == old_owner and d["epoch"] <= old_epoch]
        fence = Fence()
        admitted = [fence.admit(f"gv.findings.{key}", d) for d in docs]
        assert not any(admitted[i] for i in stale), [docs[i] for i in stale]
        assert all(admitted[i] for i, d in enumerate(docs) if i >= claimed_at and d.get("owner") == new_owner and d["epoch"] == mine[0]["epoch"]
                   and all(e["epoch"] <= d["epoch"] for e in docs[:i]))
        assert "lease no longer valid, not publishing" in detects[old_owner].text() or not stale
    finally:
        for p in procs:
            try:
                p.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.stop()
        if probe is not None:
            probe.close()
        cluster.stop()
