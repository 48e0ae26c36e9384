"""`gpuvigil act` applies hints through `serve`'s acting code (`gpuvigil.app.acting.make_acting`),
configured by the same keys (`sources.scheduler`, `sources.act`) or flags (`--scheduler`, `--act`):
only the leader builds it, and a hint is described/applied once, by the one leader that claims it
in the ledger, however often the finding is read. The ledger is driven through its own code
(`Ledger.gate`) over an in-memory bucket with JetStream KV's create semantics; no NATS is needed for
this (the NATS-backed lease and ledger run in tests/test_fleet_e2e.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest

from gpuvigil.api import HintStore
from gpuvigil.fleet import act as act_mod
from gpuvigil.fleet import transport
from gpuvigil.model import Finding, FindingKind, Severity


class MemoryKV:
    """JetStream KV's create/put/delete, as Ledger uses them: `create` of an existing key fails
    with the error nats-py raises for it."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    async def create(self, key: str, value: bytes) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        if key in self.data:
            raise KeyWrongLastSequenceError(description="wrong last sequence")
        self.data[key] = value
        return len(self.data)

    async def put(self, key: str, value: bytes) -> int:
        self.data[key] = value
        return len(self.data)

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)

    async def keys(self) -> list[str]:
        from nats.js.errors import NoKeysError

        if not self.data:
            raise NoKeysError
        return list(self.data)

    async def get(self, key: str):
        from types import SimpleNamespace

        return SimpleNamespace(key=key, value=self.data[key])


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    act_mod.add_parser(sub)
    return p.parse_args(["act", *argv])


def hang() -> Finding:
    # A Slurm job id: the dry-run prints the adapter's own plan, which refuses a name Slurm lacks.
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=10.0, job="4242", ranks=[0, 1], culprit_ranks=[1],
                   node="n1", gpu=1, summary="train-a is hung", source="hang")


def feed(a: act_mod.Act, now: float, findings: list[Finding]) -> None:
    """What `_findings` does with one findings message off the stream."""
    doc, found = transport.parse_findings(transport.findings_payload("detect", now, findings, partition=3, owner="d1"))
    a.relay.update("gv.findings.part.3", doc["now"], found, doc.get("tenants"))


def tick(a: act_mod.Act, now: float, ledger: act_mod.Ledger) -> None:
    asyncio.run(a._tick(now, ledger))


@pytest.mark.parametrize("with_store", [True, False], ids=["hint-db", "no-hint-db"])
def test_leader_dry_run_describes_each_hint_once(tmp_path, caplog, with_store):
    caplog.set_level(logging.INFO, logger="gpuvigil.app.serve")
    kv = MemoryKV()
    argv = ["--scheduler", "slurm", "--act", "dry-run", "--outbox", str(tmp_path / "outbox.sqlite")]
    first = act_mod.Act(parse([*argv, "--id", "a1", *(["--hint-db", str(tmp_path / "a1.sqlite")] if with_store else [])]))
    follower = act_mod.Act(parse([*argv, "--id", "a2", *(["--hint-db", str(tmp_path / "a2.sqlite")] if with_store else [])]))
    try:
        # Before it holds the lease an act replica has no acting sink at all.
        assert first.acting is None and follower.acting is None
        first._open_outputs()  # what run() does on taking the leader lease
        assert (first.acting.scheduler, first.acting.mode) == ("slurm", "dry-run")
        ledger = act_mod.Ledger(kv, "a1")
        f = hang()
        feed(first, 10.0, [f])
        feed(first, 10.0, [f])  # the same message read twice (a resubscribe)
        tick(first, 10.0, ledger)
        issued = [k for k in kv.data if k.startswith("hint.")]
        assert issued, "the hang finding makes no hint: nothing to apply"
        counts = dict(first.acting.counts)
        assert sum(counts.values()) == len(issued) and all(outcome == "dry_run" for _, outcome in counts)
        for now in (11.0, 12.0):  # the same finding reported again on later ticks
            feed(first, now, [f])
            tick(first, now, ledger)
        assert dict(first.acting.counts) == counts
        lines = [r.getMessage() for r in caplog.records if "act dry-run (slurm)" in r.getMessage()]
        assert len(lines) == len(issued) and all("would run: scontrol" in m for m in lines), lines
        if with_store:
            store = next(s for s in first.sinks if isinstance(s, HintStore))
            for key in issued:
                rec = store.get_hint(key.removeprefix("hint."))
                assert rec.state_reason.startswith("dry-run: would run: scontrol"), rec

        if with_store:
            # The leader loses the lease and takes it back (a NATS failover): a new Acting over
            # the same store; what it described is noted there, so it is not said again.
            first.close()
            first.sinks, first.acting = [], None
            first._open_outputs()
            feed(first, 12.5, [f])
            tick(first, 12.5, ledger)
            assert first.acting.counts == {}

        # The follower never built acting while standing by; once it takes over it reads the same
        # finding again but the ledger already holds its hints: it describes nothing.
        assert follower.acting is None
        first.close()
        follower._open_outputs()
        takeover = act_mod.Ledger(kv, "a2")
        feed(follower, 13.0, [f])
        tick(follower, 13.0, takeover)
        assert follower.acting is not None and follower.acting.counts == {}
        assert takeover.claimed == 0 and takeover.skipped == len(issued)
        assert len([r for r in caplog.records if "act dry-run (slurm)" in r.getMessage()]) == len(issued)
    finally:
        first.close()
        follower.close()


def test_act_reads_serves_keys_and_flags_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sources:\n  scheduler: kubernetes\n  act: dry-run\n")
    a = act_mod.Act(parse(["--config", str(cfg), "--id", "k", "--outbox", str(tmp_path / "o.sqlite")]))
    a._open_outputs()
    try:
        # Kubernetes dry-run needs no API server: it describes and counts, as in serve.
        assert (a.acting.scheduler, a.acting.mode) == ("kubernetes", "dry-run")
    finally:
        a.close()
    b = act_mod.Act(parse(["--config", str(cfg), "--id", "o", "--act", "off", "--outbox", str(tmp_path / "o2.sqlite")]))
    b._open_outputs()
    try:
        assert b.acting.mode == "off"
        feed(b, 10.0, [hang()])
        tick(b, 10.0, act_mod.Ledger(MemoryKV(), "o"))
        assert b.acting.counts == {}
    finally:
        b.close()
    # Nothing configured: no scheduler, no acting (the default, as serve's).
    c = act_mod.Act(parse(["--id", "n", "--outbox", str(tmp_path / "o3.sqlite")]))
    c._open_outputs()
    assert c.acting is None
    c.close()


def test_act_on_kubernetes_without_credentials_fails_at_start(tmp_path, monkeypatch, capsys):
    """As `serve --scheduler kubernetes --act on`: a one-line error at start, not on takeover."""
    from gpuvigil.cli.main import main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["act", "--scheduler", "kubernetes", "--act", "on", "--outbox", str(tmp_path / "o.sqlite")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot act" in err[0], err


def test_a_new_leader_adopts_the_incidents_the_ledger_records(tmp_path):
    """The leader records each active finding's incident in the ledger before its sinks run; a
    new leader adopts them (records that do not read as one are skipped) and names the finding's
    incident as the old one did, though it first sees it later; once the finding clears, its
    record goes."""
    import json

    kv = MemoryKV()
    old = act_mod.Act(parse(["--id", "a1", "--outbox", str(tmp_path / "a1.sqlite")]))
    new = act_mod.Act(parse(["--id", "a2", "--outbox", str(tmp_path / "a2.sqlite")]))
    try:
        f = hang()
        feed(old, 10.0, [f])
        tick(old, 10.0, act_mod.Ledger(kv, "a1"))
        named = old.pipeline.active[f.id]
        rec = json.loads(kv.data[f"incident.{f.id}"])
        assert (rec["incident"], rec["role"], rec["opened_at"], rec["by"]) == (named.incident, "opened", 10.0, "a1")
        kv.data["incident.garbage"] = b"\xff not json"
        kv.data["incident.wrong"] = json.dumps({"incident": 5, "role": "opened", "opened_at": 1.0}).encode()
        kv.data["incident.nan"] = json.dumps({"incident": "i", "role": "opened", "opened_at": float("nan")}).encode()

        ledger = act_mod.Ledger(kv, "a2")
        assert asyncio.run(new._adopt_incidents(ledger)) == 1
        feed(new, 40.0, [f])
        tick(new, 40.0, ledger)
        assert (new.pipeline.active[f.id].incident, new.pipeline.active[f.id].incident_role) == (named.incident, "opened")
        kept = json.loads(kv.data[f"incident.{f.id}"])
        assert kept["by"] == "a1" and kept["starts_at"] == rec["starts_at"]  # the same record: nothing rewritten

        new.relay.update("gv.findings.part.3", 41.0, [])
        for now in (41.0, 4000.0):
            tick(new, now, ledger)
        assert f.id not in new.pipeline.active and f"incident.{f.id}" not in kv.data
    finally:
        old.close()
        new.close()


def test_no_alert_is_sent_before_its_incident_is_in_the_ledger(tmp_path):
    """A tick whose incident records the ledger does not take sends nothing (a next leader could
    not name those alerts as this one did); the next tick that can record them sends them."""
    import json

    class Refusing(MemoryKV):
        refuse = True

        async def put(self, key: str, value: bytes) -> int:
            if self.refuse and key.startswith("incident."):
                raise TimeoutError("nats: timeout")
            return await super().put(key, value)

    kv = Refusing()
    a = act_mod.Act(parse(["--id", "a1", "--outbox", str(tmp_path / "a1.sqlite"), "--alertmanager", "http://127.0.0.1:9"]))
    try:
        a._open_outputs()
        ledger = act_mod.Ledger(kv, "a1")
        f = hang()
        feed(a, 10.0, [f])
        with pytest.raises(TimeoutError):
            tick(a, 10.0, ledger)
        assert a.pusher.enqueued_total == 0 and not [k for k in kv.data if k.startswith("incident.")]
        kv.refuse = False
        feed(a, 11.0, [f])
        tick(a, 11.0, ledger)
        assert a.pusher.enqueued_total >= 1
        with a.pusher._lock:
            sent = json.loads(a.pusher.db.execute("SELECT alert_json FROM sent").fetchone()[0])
        assert sent["labels"]["incident"] == json.loads(kv.data[f"incident.{f.id}"])["incident"]
    finally:
        a.close()
