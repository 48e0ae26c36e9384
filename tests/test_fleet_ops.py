"""Operations of the fleet on a real nats-server: the agent's spool across an outage, and a prompt
stop of detect and act on SIGTERM.

- spool: a `gpuvigil agent --spool` publishing a simulated cluster's rows; nats-server is stopped
  for a few seconds and started again on the same store. Every tick's rows of a job are in the
  rows stream afterwards, once each and in order (no gap across the outage), and the spool is
  empty. The spool's bound drops the oldest messages first.
- SIGTERM: detect (holding partitions) and act (the leader) exit within 5 s, releasing their
  leases, so a standby takes over at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import signal
import time
import pytest
import yaml

from fleet_helpers import GvProc, NatsServer
from services import wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.spool import Spool
from gpuvigil.fleet.transport import Subjects, nats_mapping

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]


def test_spool_is_bounded_oldest_first_and_survives_a_restart(tmp_path):
    spool = Spool(tmp_path / "spool", max_bytes=2000)
    spool.put([(f"gv.rows.j{i}", bytes(300), {"i": str(i)}) for i in range(4)])
    assert spool.count == 4 and spool.dropped == 0
    spool.put([(f"gv.rows.j{i}", bytes(300), {"i": str(i)}) for i in range(4, 8)])
    # 8 x ~308 bytes > 2000: the oldest went first, the rest stay in order.
    kept = [h["i"] for _, (_, _, h) in spool.peek(100)]
    assert kept == [str(i) for i in range(8 - len(kept), 8)] and spool.dropped == 8 - len(kept) and spool.bytes <= 2000
    rid, _ = spool.peek(1)[0]
    spool.done(rid)
    spool.close()
    again = Spool(tmp_path / "spool", max_bytes=2000)
    assert again.count == len(kept) - 1 and [h["i"] for _, (_, _, h) in again.peek(100)] == kept[1:]
    again.close()


async def _stream_nows(fleet: Fleet) -> dict[tuple[str, str], list[float]]:
    """(node, job) → the Gv-Now of every rows message stored, in stream order."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(servers=fleet.servers, connect_timeout=3)
    js = nc.jetstream(timeout=5)
    out: dict[tuple[str, str], list[float]] = {}
    sub = await js.pull_subscribe(f"{fleet.prefix}.part.>", stream=Subjects(fleet).rows_stream,
                                  config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE))
    while True:
        try:
            msgs = await sub.fetch(512, timeout=2)
        except TimeoutError:
            break
        for m in msgs:
            h = m.headers or {}
            out.setdefault((h["Gv-Node"], h["Gv-Job"]), []).append(float(h["Gv-Now"]))
        if msgs and msgs[-1].metadata.num_pending == 0:
            break
    await nc.close()
    return out


def test_agent_spools_an_outage_and_replays_it_in_order(tmp_path):
    server = NatsServer(tmp_path, nats_mapping(Fleet.model_validate({"partitions": 4})) + "\n")
    fleet = Fleet.model_validate({"servers": [server.url()], "partitions": 4, "spool_max_bytes": 64 << 20})
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": fleet.model_dump(include={"servers", "partitions", "spool_max_bytes"})}))
    agent = GvProc("agent", ["agent", "--config", "fleet.yaml", "--port", "-1", "--nodes", "2", "--speed", "4", "--spool", "spool",
                             "--scenario", "healthy"], tmp_path)
    try:
        wait_for(lambda: "gpuvigil agent:" in agent.text(), 60, 0.2, "the agent to start")
        time.sleep(3)
        server.stop()
        wait_for(lambda: "spooling to" in agent.text() or agent.proc.poll() is not None, 30, 0.2, "the agent to spool")
        time.sleep(3)
        server.start()
        wait_for(lambda: "spool replayed" in agent.text() or agent.proc.poll() is not None, 60, 0.2, "the spool to be replayed")
        time.sleep(1)
    finally:
        agent.stop()
    try:
        assert agent.proc.returncode == 0, agent.tail()
        last = agent.text().strip().splitlines()[-1]
        counts = dict(part.rsplit(" ", 1)[::-1] for part in last.split("spool: ")[1].split(", "))
        assert int(counts["spooled"]) > 0 and counts["dropped"] == "0", last
        nows = asyncio.run(_stream_nows(fleet))
    finally:
        server.stop()
    assert nows
    tick = 1.0  # the pipeline's tick (pipeline.tick_seconds): the agent ticks the data clock by it
    for key, seq in nows.items():
        # Stored once each, in order, and no tick missing across the outage.
        assert seq == sorted(set(seq)), (key, seq)
        gaps = [b - a for a, b in zip(seq, seq[1:], strict=False) if b - a > tick + 1e-6]
        assert not gaps, (key, gaps, seq)
    longest = max(len(v) for v in nows.values())
    assert longest >= 12, nows  # the run spanned the outage (>= 3 s + the outage at 4 simulated s per s)


def _holders(fleet: Fleet) -> dict[str, str]:
    import nats

    async def go() -> dict[str, str]:
        nc = await nats.connect(servers=fleet.servers, connect_timeout=3)
        out = {}
        try:
            kv = await nc.jetstream(timeout=5).key_value(Subjects(fleet).leases_bucket)
            for k in await kv.keys():
                out[k] = (await kv.get(k)).value.decode()
        except Exception:  # noqa: BLE001 - no bucket or no keys yet
            pass
        await nc.close()
        return out

    return asyncio.run(go())


def test_detect_and_act_exit_within_5s_on_sigterm_and_release_their_leases(tmp_path):
    server = NatsServer(tmp_path, nats_mapping(Fleet.model_validate({"partitions": 4})) + "\n")
    fleet = Fleet.model_validate({"servers": [server.url()], "partitions": 4, "lease_ttl_seconds": 30})
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": fleet.model_dump(include={"servers", "partitions", "lease_ttl_seconds"})}))
    procs = [GvProc("agent", ["agent", "--config", "fleet.yaml", "--port", "-1", "--nodes", "2", "--speed", "2"], tmp_path),
             GvProc("detect", ["detect", "--config", "fleet.yaml", "--id", "d1"], tmp_path),
             GvProc("act", ["act", "--config", "fleet.yaml", "--id", "a1", "--outbox", str(tmp_path / "outbox.sqlite")], tmp_path)]
    try:
        wait_for(lambda: sum(k.startswith("part.") for k in _holders(fleet)) == 4 and "act.leader" in _holders(fleet), 90, 0.5,
                 "detect to hold every partition and act to lead")
        wait_for(lambda: "rebuilt from the stream" in procs[1].text(), 60, 0.3, "detect to consume")
        took = {}
        for p in procs[1:]:
            t0 = time.monotonic()
            p.proc.send_signal(signal.SIGTERM)
            try:
                p.proc.wait(30)
            finally:
                took[p.name] = time.monotonic() - t0
        assert all(p.proc.returncode == 0 for p in procs[1:]), [p.tail() for p in procs[1:]]
        # Both within the 5 s that systemd's and Kubernetes' stop budgets are set from.
        assert took["detect"] < 5.0 and took["act"] < 5.0, took
        left = _holders(fleet)
        assert not any(k.startswith(("part.", "member.")) or k == "act.leader" for k in left), left  # released, not left to expire
    finally:
        for p in procs:
            p.stop()
        server.stop()
