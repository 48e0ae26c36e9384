"""A detect takeover of a hang older than the replay window, on a real nats-server: the owner of
the hung job's partition is killed (SIGKILL, no clean handover) after the stall has outgrown
`replay_seconds`, and the other replica takes the partition over.

Replaying `replay_seconds` of rows alone would time the stall from the start of the replay. The
new owner restores the partition's carried-over state (the snapshot the old owner kept in the
state bucket) before it judges the replay: its first findings carry the hang's start as the old
owner timed it, and the finding's first report time.
"""

from __future__ import annotations

import json
import threading

import pytest
import yaml

from fleet_helpers import GvProc as Proc, NatsCluster, Probe, nats_binary
from services import wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.transport import nats_mapping, partition_of

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]
PARTITIONS = 2
SPEED = 4.0  # data seconds per wall second
REPLAY = 8.0  # wall seconds of rows a takeover replays: 32 data seconds
SCENARIO = {
    "name": "carryover_hang",
    "description": "one training job on two nodes; rank 5 never joins a collective at 10 s",
    "duration_seconds": 3600,
    "nodes": 2,
    "jobs": [
        {"name": "train-a", "gpus": 16, "gpus_per_node": 8, "step_time_seconds": 1.0, "collectives_per_step": 4, "checkpoint_every_steps": 500,
         "checkpoint_seconds": 12, "memory_base_gib": 40, "memory_peak_gib": 60, "priority": "P1", "tenant": "research"},
    ],
    "faults": [{"type": "nccl_hang", "at": 10, "job": "train-a", "ranks": [5], "mode": "outside"}],
}


def hangs(doc: dict) -> list[dict]:
    return [f for f in doc.get("findings", []) if f["kind"] == "collective_hang"]


def test_a_hang_older_than_the_replay_keeps_its_start_and_first_report_across_a_takeover(tmp_path):
    nats_binary()
    fleet = Fleet(partitions=PARTITIONS, replicas=1, lease_ttl_seconds=3.0, replay_seconds=REPLAY, rows_max_age_seconds=120,
                  findings_refresh_seconds=1, findings_stale_seconds=30, state_snapshot_seconds=2)
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
        docs: list[dict] = []
        lock = threading.Lock()

        async def on(msg) -> None:
            with lock:
                docs.append(json.loads(msg.data))

        probe.call(probe.nc.subscribe(f"gv.findings.part.{partition_of('train-a', PARTITIONS)}", cb=on))

        def settled():
            h = probe.holders()
            return h if {v for k, v in h.items() if k.startswith("part.")} == set(detects) and sum(k.startswith("part.") for k in h) == PARTITIONS else None

        wait_for(settled, 90, 0.5, "both detect replicas holding a partition")
        procs.append(Proc("agent", ["agent", *common, "--scenario", "scenario.yaml", "--speed", str(SPEED), "--port", "-1"], tmp_path))

        def latest_hang():
            with lock:
                found = [d for d in docs if hangs(d) and not d.get("claim")]
            return found[-1] if found else None

        # The old owner times the stall until it is well past what a replay holds.
        try:
            before = wait_for(lambda: (d := latest_hang()) and hangs(d)[0]["evidence"]["stalled_seconds"] >= REPLAY * SPEED + 10 and d, 120, 0.2,
                              "the hang timed past the replay window")
        except AssertionError:
            raise AssertionError("\n".join(p.tail() for p in procs)) from None
        old_owner = before["owner"]
        new_owner = next(n for n in detects if n != old_owner)
        [h0] = hangs(before)
        start = before["now"] - h0["evidence"]["stalled_seconds"]
        detects[old_owner].kill()

        def taken_over():
            d = latest_hang()
            return d if d is not None and d["owner"] == new_owner else None

        try:
            after = wait_for(taken_over, 60, 0.2, f"{new_owner} publishing the hang")
        except AssertionError:
            raise AssertionError("\n".join(p.tail() for p in procs)) from None
        [h1] = hangs(after)
        assert h1["id"] == h0["id"] and h1["culprit_ranks"] == [5]
        # Timed from when rank 5 stopped, as the old owner timed it (±1 s tick), not from the
        # start of the replay: the stall outgrew the replay window before the owner died.
        assert after["now"] - start > REPLAY * SPEED + 10
        assert abs((after["now"] - h1["evidence"]["stalled_seconds"]) - start) <= 1.5, (start, after["now"], h1["evidence"])
        # The finding keeps its first report (and so its age) and its incident.
        assert after["first_seen"][h1["id"]] == before["first_seen"][h0["id"]]
        assert h1["incident"] == h0["incident"]
        assert "restored partition" in detects[new_owner].text()
    finally:
        for p in procs:
            p.stop()
        if probe is not None:
            probe.close()
        cluster.stop()
