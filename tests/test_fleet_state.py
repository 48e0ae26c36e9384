"""A detect partition's carried-over state: exact, and judged before it is taken.

- Exactness, without NATS: a partition's Pipeline ticked every second from the start of a hang is
  the reference. Another one takes the reference's snapshot (through its wire form), then
  replays only the last seconds of rows in one batch, as a new owner does: its hang has the
  reference's stall, first report and incident. Without the snapshot the replay alone times the
  stall from its own first row (what the snapshot is for).
- The takeover's rules, on a real nats-server, against a `Detect` replica in this process: a
  snapshot from an earlier owner within the replay is restored; one older than the replay, one
  written under our own lease epoch or a later one, one from an owner older than the last one that
  published the partition's findings, and garbage are ignored, each with a log line and a count
  in the replica's /metrics families. A write is fenced: never under a lease no longer valid,
  never over a later owner's snapshot, and over an earlier (paused) owner's late one; a clean
  handover writes the state as of the last tick.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import polars as pl
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import config
from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet import transport
from gpuvigil.app import compose
from gpuvigil.fleet.agent import NodeView, SimWorld, job_rows
from gpuvigil.fleet.detect import Feed
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import Pipeline

SCENARIO = {
    "name": "state_hang",
    "description": "one training job on two nodes; rank 5 never joins a collective at 10 s",
    "duration_seconds": 600,
    "nodes": 2,
    "jobs": [
        {"name": "train-a", "gpus": 16, "gpus_per_node": 8, "step_time_seconds": 1.0, "collectives_per_step": 4, "checkpoint_every_steps": 500,
         "checkpoint_seconds": 12, "memory_base_gib": 40, "memory_peak_gib": 60, "priority": "P1", "tenant": "research"},
    ],
    "faults": [{"type": "nccl_hang", "at": 10, "job": "train-a", "ranks": [5], "mode": "outside"}],
}


FINDING = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=40.0, job="train-a", ranks=[5], culprit_ranks=[5], node="node-000",
                  gpu=5, summary="train-a is hung", source="hang", incident="inc1", incident_role="opened")


def hang(pipe: Pipeline) -> Finding:
    [f] = [f for f in pipe.active.values() if f.kind == FindingKind.COLLECTIVE_HANG]
    return f


def test_a_snapshot_and_a_short_replay_rebuild_the_hang_exactly(tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SCENARIO))
    cfg = config.defaults()
    fleet = Fleet(partitions=1)
    world = SimWorld(str(tmp_path / "s.yaml"), None, 3, cfg)
    nodes = {n: compose.build(cfg, "agent", [NodeView(world, n)], fleet=fleet) for n in world.node_names}
    ref_feed = Feed()
    ref = compose.build(cfg, "detect", [ref_feed], fleet=fleet)
    sent: list[tuple[float, str, str, dict]] = []  # (now, node, job, the frames as decoded from the wire)
    snapshot_at, taken_at, replay = 40.0, 48.0, 12.0  # the hang began at ~10 s: before the replay's start
    body = None
    for now in range(1, int(taken_at) + 1):
        for node, pipe in nodes.items():
            pipe.tick(float(now))
            for job, frames in job_rows(pipe.window, node).items():
                data, index = transport.encode_frames(frames)
                sent.append((float(now), node, job, transport.decode_frames(data, index)))
                ref_feed.add(sent[-1][3], node, job, float(now))
        world.after_tick(float(now))
        ref.tick(float(now))
        if now == snapshot_at:
            body = transport.encode_state({"owner": "d-old", "epoch": 7, "wall": 0.0}, ref.carry_over())
    want = hang(ref)
    assert want.evidence["stalled_seconds"] > replay + 10  # the stall is older than the replay

    def takeover(snapshot: bytes | None) -> Pipeline:
        feed = Feed()
        pipe = compose.build(cfg, "detect", [feed], fleet=fleet)
        if snapshot is not None:
            stamps, state = transport.decode_state(snapshot)
            assert stamps["owner"] == "d-old" and stamps["epoch"] == 7
            assert pipe.restore(state) == len(state["findings"]) >= 1
        for now, node, job, frames in sent:
            if now >= taken_at - replay:
                feed.add(frames, node, job, now)
        pipe.tick(taken_at)
        return pipe

    assert body is not None
    new = takeover(body)
    got = hang(new)
    assert got.id == want.id and got.culprit_ranks == want.culprit_ranks == [5]
    assert got.evidence["stalled_seconds"] == want.evidence["stalled_seconds"]
    assert new.first_seen[got.id] == ref.first_seen[want.id] and got.incident == want.incident
    # The replay alone: the stall timed from the replay's first row, a new first report.
    alone = takeover(None)
    assert hang(alone).evidence["stalled_seconds"] <= replay + 1 < want.evidence["stalled_seconds"]
    assert alone.first_seen[want.id] == taken_at != ref.first_seen[want.id]


def test_decode_state_refuses_garbage():
    outside = b'{"findings": [], "frames": "hang/state:0:999"}'
    for data in (b"", b"nonsense", b"99\n{}", b"2\n[]", b"%d\n%s" % (len(outside), outside)):
        with pytest.raises(ValueError):
            transport.decode_state(data)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["owner", "epoch", "wall"]), st.one_of(st.integers(), st.text(max_size=8)), max_size=3),
       st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=5), st.floats(0.0, 1.0, exclude_max=True))
def test_decode_state_round_trips_and_refuses_a_truncated_copy(stamps, since, cut):
    frame = pl.DataFrame({"job": ["a"] * len(since), "since": since}, schema={"job": pl.Utf8, "since": pl.Float64})
    state = {"now": 40.0, "findings": [{"finding": FINDING.to_json_dict(), "first_seen": 12.0, "last_seen": 40.0}], "detectors": {"hang": {"state": frame}}}
    body = transport.encode_state(stamps, state)
    got_stamps, got = transport.decode_state(body)
    assert {k: got_stamps[k] for k in stamps} == stamps and got["findings"] == state["findings"] and got["now"] == 40.0
    assert got["detectors"]["hang"]["state"].equals(frame)
    # A copy cut anywhere (a damaged value) is refused, never taken half-read.
    with pytest.raises(ValueError):
        transport.decode_state(body[: int(cut * len(body))])


# -- on a real nats-server ------------------------------------------------------------------------


def snapshot(epoch: int, wall: float, owner: str = "d-old") -> bytes:
    state = {"now": 40.0, "findings": [{"finding": FINDING.to_json_dict(), "first_seen": 12.0, "last_seen": 40.0}], "detectors": {}}
    return transport.encode_state({"owner": owner, "epoch": epoch, "partition": 0, "wall": wall}, state)


@pytest.mark.services
@pytest.mark.timeout(120)
def test_takeover_restores_a_fresh_snapshot_ignores_stale_ones_and_fences_writes(tmp_path, caplog):
    from fleet_helpers import NatsServer, nats_binary

    from gpuvigil.fleet.detect import Detect, Partition, add_parser
    from gpuvigil.fleet.lease import Leases
    from gpuvigil.fleet.metrics import detect_families

    nats_binary()
    server = NatsServer(tmp_path, "")
    try:
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {"servers": [server.url()], "partitions": 2, "replay_seconds": 60, "lease_ttl_seconds": 10}}))
        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers())
        d = Detect(parser.parse_args(["detect", "--config", str(tmp_path / "fleet.yaml"), "--id", "d-new"]))
        caplog.set_level(logging.INFO, logger="gpuvigil.fleet")

        async def go() -> dict:
            import nats

            nc = await nats.connect(server.url())
            d.js = nc.jetstream(timeout=5)
            await transport.ensure(d.js, d.fleet)
            d.state_kv = kv = await d.js.key_value(d.subjects.state_bucket)
            d.leases = Leases(await d.js.key_value(d.subjects.leases_bucket), "d-new", 10.0)
            # Leases taken by others and let go first, so that ours has an epoch above theirs.
            for i in range(5):
                await d.leases.kv.put(f"member.other{i}", b"x")
            assert await d.leases.take("part.0")
            ours = d.leases.epoch["part.0"]

            def part() -> Partition:
                pipeline, feed = d._pipeline()
                p = Partition(0, pipeline, feed)
                p.epoch = ours
                return p

            out: dict = {}
            now = time.time()
            cases = {
                "fresh": snapshot(ours - 2, now - 5),
                "age": snapshot(ours - 2, now - 61),
                "own epoch": snapshot(ours, now - 5),
                "later epoch": snapshot(ours + 3, now - 5),
                "garbage": b"\x00\x01 not a snapshot",
            }
            for name, body in cases.items():
                await kv.put("part.0", body)
                p = part()
                await d.restore(p)
                out[name] = (dict(d.state_ignored), d.state_restored, {k: p.pipeline.first_seen.get(k) for k in p.pipeline.active}, p.state_rev)
            # An owner newer than the snapshot's published the partition's findings since: its
            # state (which the snapshot lacks) is gone with it.
            await d.js.publish(d.subjects.findings_part(0), transport.findings_payload("detect", 41.0, [FINDING], partition=0, owner="d-mid", epoch=ours - 1))
            await kv.put("part.0", snapshot(ours - 2, now - 5))
            p = part()
            await d.restore(p)
            out["newer publisher"] = (dict(d.state_ignored), d.state_restored, dict(p.pipeline.first_seen), p.state_rev)
            # Its claim (no findings, no state of its own yet) does not make the snapshot stale.
            await d.js.publish(d.subjects.findings_part(0), transport.findings_payload("detect", 42.0, [], partition=0, owner="d-mid2", epoch=ours - 1, claim=True))
            await kv.put("part.0", snapshot(ours - 2, now - 5))
            p = part()
            await d.restore(p)
            out["after a claim"] = (dict(d.state_ignored), d.state_restored, dict(p.pipeline.first_seen), p.state_rev)

            # A deleted snapshot is none (nothing restored, nothing ignored).
            await kv.delete("part.0")
            await d.restore(part())
            out["deleted"] = (dict(d.state_ignored), d.state_restored)

            # Writes: over what we read (here deleted since); over an earlier owner's late write;
            # never over a later owner's, nor once our lease is no longer valid.
            mine = snapshot(ours, time.time(), owner="d-new")
            out["write"] = (await d._save(p, ours, mine), (await kv.get("part.0")).value == mine)
            # A clean handover writes the partition's state as of its last tick.
            p.caught_up = True
            p.pipeline.tick(41.0)
            d.parts[0] = p
            await d.handover(0)
            del d.parts[0]
            stamps, state = transport.decode_state((await kv.get("part.0")).value)
            out["handover"] = (stamps["owner"], stamps["epoch"] == ours, state["now"], [(f["finding"]["id"], f["first_seen"]) for f in state["findings"]])
            await kv.put("part.0", snapshot(ours - 1, time.time(), owner="d-paused"))
            out["over an earlier owner"] = (await d._save(p, ours, mine), (await kv.get("part.0")).value == mine)
            later = snapshot(ours + 9, time.time(), owner="d-later")
            await kv.put("part.0", later)
            out["under a later owner"] = (await d._save(p, ours, mine), (await kv.get("part.0")).value == later, d.state_fenced)
            d.leases.forget("part.0")
            out["lease gone"] = (await d._save(p, ours, mine), d.state_fenced)
            await nc.close()
            return out

        out = asyncio.run(go())
    finally:
        server.stop()

    assert out["fresh"][:3] == ({}, 1, {FINDING.id: 12.0}) and out["fresh"][3] > 0
    assert out["age"][:3] == ({"age": 1}, 1, {})
    assert out["own epoch"][:3] == ({"age": 1, "epoch": 1}, 1, {})
    assert out["later epoch"][:3] == ({"age": 1, "epoch": 2}, 1, {})
    assert out["garbage"][:3] == ({"age": 1, "epoch": 2, "undecodable": 1}, 1, {})
    assert out["newer publisher"][:3] == ({"age": 1, "epoch": 3, "undecodable": 1}, 1, {})
    assert out["after a claim"][:3] == ({"age": 1, "epoch": 3, "undecodable": 1}, 2, {FINDING.id: 12.0})
    assert out["deleted"] == ({"age": 1, "epoch": 3, "undecodable": 1}, 2)
    assert out["write"] == (True, True)
    assert out["handover"] == ("d-new", True, 41.0, [(FINDING.id, 12.0)])
    assert out["over an earlier owner"] == (True, True)
    assert out["under a later owner"] == (False, True, 1)
    assert out["lease gone"] == (False, 2)
    text = caplog.text
    assert "written by d-old 61s ago, before the 60s the replay reads" in text
    assert "but d-mid published the partition's findings under epoch" in text
    assert "restored partition 0 from the state snapshot of d-old" in text
    assert "d-later wrote its state under lease epoch" in text
    fams = {f.name: f for f in detect_families(d)}
    assert {s.labels["reason"]: s.value for s in fams["gpuvigil_detect_state_snapshots_ignored"].samples} == {"age": 1, "epoch": 3, "undecodable": 1}
    assert fams["gpuvigil_detect_state_restored"].samples[0].value == 2
