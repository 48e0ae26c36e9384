"""A lease renewal sent into a connection whose server died without closing it (no answer, ever)
is abandoned after one call timeout and tried again, so the renewal that reaches a live server
lands while the lease is still valid, instead of the first try waiting out the whole validity."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from gpuvigil.fleet.lease import Leases


@dataclass
class Entry:
    value: bytes
    revision: int


class SilentOnceKV:
    """KV whose first `silent` updates never get an answer (sent to a dead server)."""

    def __init__(self, silent: int):
        self.data: dict[str, Entry] = {}
        self.seq = 0
        self.silent = silent
        self.update_calls = 0

    async def create(self, key: str, value: bytes) -> int:
        self.seq += 1
        self.data[key] = Entry(value, self.seq)
        return self.seq

    async def update(self, key: str, value: bytes, last: int) -> int:
        self.update_calls += 1
        if self.silent:
            self.silent -= 1
            await asyncio.Event().wait()  # no answer: only the caller's timeout ends it
        assert self.data[key].revision == last
        self.seq += 1
        self.data[key] = Entry(value, self.seq)
        return self.seq

    async def get(self, key: str) -> Entry:
        return self.data[key]


@pytest.mark.parametrize("silent", [0, 1, 5])
def test_a_renewal_lost_in_a_dead_connection_is_retried_within_the_validity(silent):
    async def go() -> None:
        kv = SilentOnceKV(silent)
        leases = Leases(kv, "act-1", ttl=3.0)  # valid 2.7 s, one call at most 1 s
        assert await leases.take("act.leader")
        rev = leases.revision["act.leader"]
        ok = await leases.renew("act.leader")
        if silent <= 1:
            # One lost request costs one call timeout; the retry renews on the revision we wrote.
            assert ok and leases.revision["act.leader"] > rev and kv.update_calls == silent + 1
            assert leases.valid("act.leader")
        else:
            # Nothing answers: tried again (not one try waiting out the validity), still ours, not lost.
            assert kv.update_calls >= 2 and "act.leader" in leases.revision and leases.revision["act.leader"] == rev
            assert ok == leases.valid("act.leader")  # True while the old renewal still covers it

    asyncio.run(go())
