"""An act failover with hints in flight, on a real nats-server: the fleet's one hint store is the act
ledger bucket (gpuvigil.fleet.hints), each leader's --hint-db only its working copy.

The first leader describes one hang's hints (act: dry-run) and records a second hang's hints, then
dies before applying them (its acting raises, as a process killed between the two steps would stop).
The second leader, with an empty --hint-db of its own, loads every record at the start of its term:
its feedback API serves both hangs' hints; it describes the second hang's hints once and the first
hang's never again. The two replicas run in this process (their ticks driven by the test, so the
death falls exactly between recording and applying); the bucket is JetStream's, replicated like
every bucket of the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import httpx
import pytest
import yaml

from fleet_helpers import NatsCluster, nats_binary

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet import act as act_mod
from gpuvigil.fleet import connection, transport
from gpuvigil.fleet.hints import SharedHints
from gpuvigil.model import Finding, FindingKind, Severity

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    act_mod.add_parser(p.add_subparsers())
    return p.parse_args(["act", *argv])


def hang(job: str, node: str) -> Finding:
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=10.0, job=job, ranks=[0, 1], culprit_ranks=[1],
                   node=node, gpu=1, summary=f"{job} is hung", source="hang")


def feed(a: act_mod.Act, now: float, findings: list[Finding]) -> None:
    doc, found = transport.parse_findings(transport.findings_payload("detect", now, findings, partition=3, owner="d1", epoch=5))
    a.relay.update("gv.findings.part.3", doc["now"], found, doc.get("tenants"))


def described(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "act dry-run (slurm)" in r.getMessage()]


def test_act_failover_with_hints_in_flight_loses_none_and_repeats_none(tmp_path, caplog):
    nats_binary()
    caplog.set_level(logging.INFO, logger="gpuvigil.app.serve")
    cluster = NatsCluster(tmp_path, 1)
    try:
        cluster.wait_ready()
        fleet = Fleet(servers=cluster.urls, partitions=4)
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": fleet.model_dump()}))
        argv = ["--config", str(tmp_path / "fleet.yaml"), "--scheduler", "slurm", "--act", "dry-run", "--api-port", "0", "--insecure-local"]
        first = act_mod.Act(parse([*argv, "--id", "a1", "--hint-db", str(tmp_path / "a1.sqlite"), "--outbox", str(tmp_path / "a1-out.sqlite")]))
        second = act_mod.Act(parse([*argv, "--id", "a2", "--hint-db", str(tmp_path / "a2.sqlite"), "--outbox", str(tmp_path / "a2-out.sqlite")]))
        a, b = hang("train-a", "n1"), hang("train-b", "n2")

        async def term(act: act_mod.Act) -> tuple[act_mod.Ledger, object]:
            """What run() does on taking the leader lease."""
            nc = await connection.connect(fleet, f"test-{act.id}", role="act")
            js = nc.jetstream(timeout=5)
            await transport.ensure(js, fleet)
            kv = await js.key_value(act.subjects.ledger_bucket)
            act._open_outputs()
            act.shared = SharedHints(kv, act.store, act.stats.hint_store)
            await act.shared.load()
            return act_mod.Ledger(kv, act.id), nc

        async def go() -> None:
            ledger, nc1 = await term(first)
            feed(first, 10.0, [a])
            await first._tick(10.0, ledger)
            said_a = described(caplog)
            assert said_a and all("train-a" in m or "n1" in m for m in said_a), said_a
            # The second hang's hints are recorded in the fleet's store, then the leader dies
            # before its acting runs.

            def killed(*_args):
                raise SystemExit("killed between recording and applying")

            first.acting.on_tick = killed
            feed(first, 11.0, [a, b])
            with pytest.raises(SystemExit):
                await first._tick(11.0, ledger)
            recorded = {h.id: h for h in first.store.hints()}
            in_flight = [h for h in recorded.values() if h.job == "train-b"]
            assert in_flight and all(h.state.value == "pending" and not h.state_reason for h in in_flight)
            first.close()
            await nc1.close()

            ledger2, nc2 = await term(second)
            # Before its first tick, the new leader's API serves every hint the fleet issued.
            url = next(ln for ln in [second.api.url] if ln)
            async with httpx.AsyncClient() as http:
                served = (await http.get(f"{url}/v1/hints", timeout=10)).json()["hints"]
            assert {h["id"] for h in served} == set(recorded), served
            feed(second, 12.0, [a, b])
            await second._tick(12.0, ledger2)
            feed(second, 13.0, [a, b])
            await second._tick(13.0, ledger2)
            said = described(caplog)
            # Each hint described exactly once across both leaders: the first hang's by the first
            # leader, the in-flight ones by the second.
            ids = [m.split("hint ", 1)[1].split(" ", 2)[1].rstrip(":") for m in said]
            assert sorted(ids) == sorted(recorded), said
            assert {h.id: h.state_reason.startswith("dry-run: would run:") for h in second.store.hints()} == dict.fromkeys(recorded, True)
            assert second.stats.hint_store["loaded"] == len(recorded) and second.stats.hint_store["push_failures"] == 0
            second.close()
            await nc2.close()

        asyncio.run(go())
    finally:
        cluster.stop()
