"""Leases in a JetStream KV bucket whose entries expire (`max_age` = the lease TTL).

Take: `create` succeeds only if nobody holds the key. Renew: `update` with the revision we wrote,
so a holder whose lease expired and was taken meanwhile learns it lost it (wrong last sequence)
instead of overwriting the new owner. A holder that cannot reach NATS for a whole TTL treats its
lease as lost (`valid`), because by then another may have taken it.

Fencing: the revision at which a holder took a key (`epoch`) only grows from one holder to the
next (it is the bucket stream's sequence). A holder stamps it on what it publishes under the lease
and checks `valid` right before; readers drop a message whose epoch is older than the newest they
know for that key (`gpuvigil.fleet.fence`).

One NATS server lost: the client reconnects to another one and the bucket's stream elects a new
leader, which takes seconds. Each KV call is bounded by a fraction of the TTL and retried until
the lease would no longer be valid, so a slow election is waited out instead of dropping the lease.
A write the server committed whose acknowledgement was lost with the server is recognised on the
next try (the key holds our id at a newer revision, or our own `create` already exists): adopted,
not counted as lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("gpuvigil.fleet")

# The lease `act` replicas contend for; the one holding it acts (read by fleet/metrics.py too).
LEADER_KEY = "act.leader"


class Leases:
    def __init__(self, kv: Any, owner: str, ttl: float):
        self.kv = kv
        self.owner = owner
        self.ttl = ttl
        self.revision: dict[str, int] = {}
        self.epoch: dict[str, int] = {}  # key → the revision at which we took it (the fencing token)
        self.renewed_at: dict[str, float] = {}
        # One KV round trip at most this long (a request to a server that died silently is not
        # waited out), then tried again while another fits in the lease's validity.
        self.call_timeout = max(1.0, ttl / 3)
        self.adopted = 0  # writes whose acknowledgement was lost, recognised as ours afterwards
        self.retaken = 0  # keys that expired while NATS could not be reached, taken again
        self.lapsed: set[str] = set()  # held keys whose validity ran out while NATS did not answer

    async def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return await asyncio.wait_for(coro, timeout or self.call_timeout)

    def held(self) -> list[str]:
        return [k for k in self.revision if self.valid(k)]

    def valid(self, key: str) -> bool:
        """Held and renewed within the TTL (minus a margin for clock jitter between us and NATS)."""
        t = self.renewed_at.get(key)
        return t is not None and time.monotonic() - t < self.ttl * 0.9

    async def take(self, key: str) -> bool:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            rev = await self._call(self.kv.create(key, self.owner.encode()))
        except KeyWrongLastSequenceError:
            # Held by someone: or by us, from a create whose answer was lost with its server.
            state, rev = await self._look(key)
            if state != "ours" or rev is None:
                return False
            self.adopted += 1
        except Exception as exc:  # noqa: BLE001 - NATS unreachable: not taken, try later
            log.debug("lease %s: take failed: %s", key, exc)
            # Or taken, with the answer lost: then the key is ours, and nobody else may take it
            # until it expires.
            state, rev = await self._look(key)
            if state != "ours" or rev is None:
                return False
            self.adopted += 1
        self.revision[key] = self.epoch[key] = rev
        self.renewed_at[key] = time.monotonic()
        return True

    async def renew(self, key: str) -> bool:
        """Renew a held key; True when it is valid now. A key is forgotten (lost) only on a
        definite answer: someone else holds it. While NATS does not answer it stays ours but
        invalid (publish nothing under it) and is renewed, or taken again if it expired meanwhile
        and nobody took it, as soon as NATS answers: a replica that could not reach NATS for a
        moment keeps its work instead of replaying it."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        started = time.monotonic()
        tries = 0
        while True:
            tries += 1
            rev = self.revision.get(key)
            if rev is None:
                return False
            try:
                # An update whose answer is late but that was committed is recognised on the next
                # try (the key holds our id at a newer revision): retrying never loses the lease.
                self.revision[key] = await self._call(self.kv.update(key, self.owner.encode(), last=rev))
            except (KeyWrongLastSequenceError, KeyNotFoundError):
                state, ours = await self._look(key)
                if state == "ours" and ours is not None and ours > rev:  # our last update was committed, its ack lost
                    self.revision[key] = ours
                    self.adopted += 1
                    continue  # renew from there (the committed write may be old by now)
                if state == "absent":  # expired while NATS could not be reached, and nobody took it
                    return await self._retake(key) or self.valid(key)
                if state == "unknown" or (state == "theirs" and ours is not None and ours < rev):
                    # No answer, or a read older than our own write (a replica behind its
                    # leader): not a definite answer, try again next round.
                    return self.valid(key)
                self.forget(key)
                return False
            except Exception as exc:  # noqa: BLE001 - a NATS node died, a stream leader is being elected: retry while valid
                log.debug("lease %s: renew try %d failed after %.2fs: %r", key, tries, time.monotonic() - started, exc)
                if self._left(key) > self.call_timeout:
                    # No responders (a stream leader being elected) fails at once: a short pause
                    # keeps the retries from spinning.
                    await asyncio.sleep(min(0.25, self.call_timeout / 2))
                    continue
                if not self.valid(key) and key not in self.lapsed:
                    self.lapsed.add(key)  # said once per lapse, not on every round until NATS answers
                    log.warning("lease %s: not renewed within the TTL (last try: %r); paused until NATS answers", key, exc)
                return self.valid(key)  # still ours: renewed (or taken again) on the next round
            now = time.monotonic()
            if now - started > self.ttl / 4 or tries > 1:
                # A slow renewal is what a NATS failover costs: said, so its timing budget can be checked.
                log.info("lease %s: renewed after %.2fs (%d tries, %.2fs of validity were left)", key, now - started, tries,
                         self.ttl * 0.9 - (started - self.renewed_at[key]))
            self.renewed_at[key] = now
            self.lapsed.discard(key)
            return True

    async def _look(self, key: str) -> tuple[str, int | None]:
        """('ours' | 'theirs', the entry's revision) | ('absent', None) | ('unknown', None)."""
        from nats.js.errors import KeyNotFoundError

        try:
            e = await self._call(self.kv.get(key))
        except KeyNotFoundError:
            return "absent", None
        except Exception:  # noqa: BLE001 - no answer
            return "unknown", None
        if e is None or not e.value:
            return "absent", None
        return ("ours" if e.value == self.owner.encode() else "theirs"), int(e.revision or 0)

    async def _retake(self, key: str) -> bool:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            rev = await self._call(self.kv.create(key, self.owner.encode()))
        except KeyWrongLastSequenceError:
            state, ours = await self._look(key)
            if state == "ours" and ours is not None:
                rev = ours
            else:
                if state == "theirs":
                    self.forget(key)
                return False
        except Exception as exc:  # noqa: BLE001 - no answer: still ours to retry
            log.debug("lease %s: retake failed: %s", key, exc)
            return False
        log.info("lease %s: expired while NATS could not be reached; taken again (nobody else had)", key)
        self.retaken += 1
        self.lapsed.discard(key)
        self.revision[key] = self.epoch[key] = rev
        self.renewed_at[key] = time.monotonic()
        return True

    def _left(self, key: str) -> float:
        """Seconds of validity left (negative when none)."""
        t = self.renewed_at.get(key)
        return -1.0 if t is None else self.ttl * 0.9 - (time.monotonic() - t)

    async def release(self, key: str) -> None:
        rev = self.revision.get(key)
        self.forget(key)
        if rev is None:
            return
        try:
            await self._call(self.kv.delete(key, last=rev))
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            log.debug("lease %s: release failed: %s", key, exc)

    def forget(self, key: str) -> None:
        self.lapsed.discard(key)
        self.revision.pop(key, None)
        self.epoch.pop(key, None)
        self.renewed_at.pop(key, None)

    async def keys(self) -> set[str] | None:
        """Every live key (empty when the bucket is; None when NATS does not answer)."""
        try:
            return set(await self._call(self.kv.keys(), max(self.call_timeout, self.ttl / 2)))
        except Exception as exc:  # noqa: BLE001 - NoKeysError when empty; timeouts during a failover
            return set() if type(exc).__name__ == "NoKeysError" else None

    async def holders(self, prefix: str) -> dict[str, str]:
        """key → owner of every live key under `prefix` (e.g. 'member.')."""
        out: dict[str, str] = {}
        try:
            keys = await self.kv.keys()
        except Exception:  # noqa: BLE001 - NoKeysError when the bucket is empty
            return out
        for k in keys:
            if k.startswith(prefix):
                try:
                    e = await self.kv.get(k)
                except Exception:  # noqa: BLE001 - expired between keys() and get()
                    continue
                if e.value:
                    out[k] = e.value.decode()
        return out
