"""Leases in a JetStream KV bucket whose entries expire (`max_age` = the lease TTL).

Take: `create` succeeds only if nobody holds the key. Renew: `update` with the revision we wrote,
so a holder whose lease expired and was taken meanwhile learns it lost it (wrong last sequence)
instead of overwriting the new owner. A holder that cannot reach NATS for a whole TTL treats its
lease as lost (`valid`), because by then another may have taken it.
"""

from __future__ import annotations

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
        self.renewed_at: dict[str, float] = {}

    def held(self) -> list[str]:
        return [k for k in self.revision if self.valid(k)]

    def valid(self, key: str) -> bool:
        """Held and renewed within the TTL (minus a margin for clock jitter between us and NATS)."""
        t = self.renewed_at.get(key)
        return t is not None and time.monotonic() - t < self.ttl * 0.9

    async def take(self, key: str) -> bool:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            rev = await self.kv.create(key, self.owner.encode())
        except KeyWrongLastSequenceError:
            return False
        except Exception as exc:  # noqa: BLE001 - NATS unreachable: not taken, try later
            log.debug("lease %s: take failed: %s", key, exc)
            return False
        self.revision[key] = rev
        self.renewed_at[key] = time.monotonic()
        return True

    async def renew(self, key: str) -> bool:
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        rev = self.revision.get(key)
        if rev is None:
            return False
        try:
            self.revision[key] = await self.kv.update(key, self.owner.encode(), last=rev)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            self.forget(key)
            return False
        except Exception as exc:  # noqa: BLE001 - NATS unreachable: keep trying until the TTL runs out
            log.debug("lease %s: renew failed: %s", key, exc)
            if not self.valid(key):
                self.forget(key)
            return self.valid(key)
        self.renewed_at[key] = time.monotonic()
        return True

    async def release(self, key: str) -> None:
        rev = self.revision.get(key)
        self.forget(key)
        if rev is None:
            return
        try:
            await self.kv.delete(key, last=rev)
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            log.debug("lease %s: release failed: %s", key, exc)

    def forget(self, key: str) -> None:
        self.revision.pop(key, None)
        self.renewed_at.pop(key, None)

    async def keys(self) -> set[str]:
        """Every live key (empty when the bucket is, or NATS does not answer)."""
        try:
            return set(await self.kv.keys())
        except Exception:  # noqa: BLE001 - NoKeysError when empty; timeouts during a failover
            return set()

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
