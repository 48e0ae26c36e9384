"""Leases that survive a NATS server's loss and fence their previous holders, without a cluster:
`Leases` over a bucket with JetStream KV's semantics (one revision sequence for the bucket,
create/update/get/delete, entries expiring after the TTL) that can stop answering or lose an
acknowledgement, as a client sees when the server it talks to dies; and act's `Fence` and `Relay`
over findings messages in the wire format. The same code against real nats-server clusters runs
in tests/test_fleet_e2e.py (the leases bucket's leader killed) and tests/test_fleet_takeover.py
(a paused replica)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gpuvigil.fleet import transport
from gpuvigil.fleet.act import Relay
from gpuvigil.fleet.fence import Fence
from gpuvigil.fleet.lease import Leases
from gpuvigil.model import Finding, FindingKind, Severity


class Entry:
    def __init__(self, value: bytes, revision: int):
        self.value, self.revision = value, revision


class FlakyKV:
    """JetStream KV as the client sees it. `down`: every call times out. `lose_acks`: a write is
    committed but its caller gets a timeout (the server died before answering)."""

    def __init__(self, clock: list[float] | None = None):
        self.data: dict[str, Entry] = {}
        self.seq = 0
        self.down = False
        self.lose_acks = 0
        self.clock = clock  # the monotonic clock Leases reads: a call that gets no answer takes its time
        self.behind: Entry | None = None  # what a replica behind its leader answers to a read
        self.refuse_updates = 0  # updates answered 'wrong last sequence' (a leader change racing them)

    async def _answer(self) -> None:
        if self.down:
            if self.clock is not None:
                self.clock[0] += 0.5
            raise TimeoutError("nats: timeout")

    def _commit(self, key: str, value: bytes) -> int:
        self.seq += 1
        self.data[key] = Entry(value, self.seq)
        if self.lose_acks:
            self.lose_acks -= 1
            raise TimeoutError("nats: timeout")
        return self.seq

    async def create(self, key: str, value: bytes) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        await self._answer()
        if key in self.data:
            raise KeyWrongLastSequenceError(description="wrong last sequence")
        return self._commit(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        from nats.js.errors import KeyWrongLastSequenceError

        await self._answer()
        if self.refuse_updates or key not in self.data or self.data[key].revision != last:
            self.refuse_updates = max(0, self.refuse_updates - 1)
            raise KeyWrongLastSequenceError(description="wrong last sequence")
        return self._commit(key, value)

    async def get(self, key: str) -> Entry:
        from nats.js.errors import KeyNotFoundError

        await self._answer()
        if self.behind is not None:
            return self.behind
        if key not in self.data:
            raise KeyNotFoundError
        return self.data[key]

    async def delete(self, key: str, last: int | None = None) -> None:
        await self._answer()
        self.data.pop(key, None)

    def expire(self, key: str) -> None:
        self.data.pop(key, None)


def run(coro):
    return asyncio.run(coro)


def test_a_lost_acknowledgement_is_recognised_not_a_lost_lease():
    async def go():
        kv = FlakyKV()
        a = Leases(kv, "detect-1", ttl=4.0)
        assert await a.take("part.3")
        epoch = a.epoch["part.3"]
        kv.lose_acks = 1  # the renewal is committed; the answer dies with the server
        assert await a.renew("part.3")  # retried: 'wrong last sequence', the key holds our id at a newer revision
        assert a.adopted == 1 and a.epoch["part.3"] == epoch and a.revision["part.3"] == kv.data["part.3"].revision
        kv.lose_acks = 1  # a create whose answer was lost: the key is ours
        assert await a.take("part.4") and a.adopted == 2
        # A refused renewal, then a read answered by a replica behind its leader with the key's
        # previous holder: older than our own write, so no proof we lost it.
        kv.refuse_updates, kv.behind = 1, Entry(b"detect-2", a.revision["part.3"] - 1)
        assert await a.renew("part.3") and "part.3" in a.revision
        kv.behind = None
        assert await a.renew("part.3")
        # A read newer than our write naming another holder is a definite answer.
        kv.refuse_updates, kv.behind = 1, Entry(b"detect-2", kv.seq + 1)
        assert not await a.renew("part.3") and "part.3" not in a.revision

    run(go())


@pytest.mark.parametrize("someone_took_it", [False, True])
def test_nats_unreachable_past_the_ttl_keeps_the_lease_unless_another_took_it(monkeypatch, someone_took_it):
    clock = [1000.0]
    # Leases' own clock only (the event loop keeps the real one).
    monkeypatch.setattr("gpuvigil.fleet.lease.time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def go():
        kv = FlakyKV(clock)
        a = Leases(kv, "detect-1", ttl=2.5)  # one KV call bounded at 1 s
        assert await a.take("part.3")
        old_epoch = a.epoch["part.3"]
        kv.down = True  # each try takes 0.5 s: retried while another call fits in the lease's validity
        assert await a.renew("part.3")
        assert clock[0] - 1000.0 == 1.5
        clock[0] += 0.625  # the next round (TTL / 4 later): still no answer, validity over
        assert not await a.renew("part.3")
        assert "part.3" in a.revision and not a.valid("part.3")  # not a definite answer: still ours
        kv.expire("part.3")  # the new stream leader expires the entry
        kv.down = False
        if someone_took_it:
            assert await Leases(kv, "detect-2", ttl=2.5).take("part.3")
        renewed = await a.renew("part.3")
        if someone_took_it:
            assert not renewed and "part.3" not in a.revision  # a definite answer: lost
        else:
            assert renewed and a.valid("part.3") and a.retaken == 1
            assert a.epoch["part.3"] > old_epoch  # a new fencing token

    run(go())


def finding(job: str = "train-a") -> Finding:
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=100.0, job=job, ranks=[5], culprit_ranks=[5],
                   node="n1", gpu=5, summary=f"{job} is hung", source="hang")


def doc(owner: str, epoch: int | None, findings: list[Finding], now: float, claim: bool = False) -> dict:
    extra = {"claim": True} if claim else {}
    body = transport.findings_payload("detect", now, findings, partition=3, owner=owner, **({"epoch": epoch} if epoch is not None else {}), **extra)
    return transport.parse_findings(body)[0]


def test_fence_drops_a_replica_that_lost_the_lease_and_a_claim_holds_the_findings():
    fence, relay = Fence(), Relay(stale_seconds=60)
    subj = "gv.findings.part.3"

    def deliver(d: dict) -> bool:
        if not fence.admit(subj, d):
            return False
        if d.get("claim"):
            relay.hold(subj)
        else:
            _, found = transport.parse_findings(transport.findings_payload("detect", d["now"], [Finding.model_validate({k: v for k, v in f.items() if k != "id"}) for f in d["findings"]]))
            relay.update(subj, d["now"], found)
        return True

    assert deliver(doc("detect-1", 7, [finding()], 100.0))
    # detect-2 takes the partition (a newer epoch) and claims it while it catches up: the hang
    # stays reported (not an empty state), and detect-1, waking from a pause, is dropped.
    assert deliver(doc("detect-2", 12, [], 104.0, claim=True))
    assert [f.job for f in relay.detect(None)] == ["train-a"]
    assert not deliver(doc("detect-1", 7, [], 105.0))
    assert [f.job for f in relay.detect(None)] == ["train-a"]
    assert deliver(doc("detect-2", 12, [finding(), finding("train-b")], 106.0))
    assert sorted(f.job for f in relay.detect(None)) == ["train-a", "train-b"]
    assert fence.dropped == {"detect-1": 1}
    # An agent's node findings carry no lease: always admitted.
    assert fence.admit("gv.findings.node.n1", doc("agent", None, [], 107.0))
