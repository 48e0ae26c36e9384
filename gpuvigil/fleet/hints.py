"""The act leaders' one hint store: every hint record (`api.store.HintRecord`: the hint, its
state, attempts, notes) in the act ledger bucket under `rec.<hint id>`, replicated like every
bucket of the fleet.

A leader's `--hint-db` is a working copy of it, not a store of its own. When a replica becomes
leader it loads every record from the bucket into its copy before its first tick (the feedback API
it serves then answers with the hints earlier leaders issued, wherever they ran). On every tick it
records the new hints in its copy and pushes them to the bucket *before* the ledger claim and
before anything is applied; what acting then does (a dry-run note, an attempt, an ack) and what the
scheduler says through the API are pushed after. So a leader that dies:

- after recording a hint, before applying it: the next leader loads it as pending and applies it
  (at least once: nothing is lost);
- after applying it, before its record says so: the next leader applies it again, and the acting
  adapters make that a no-op (a drained node is drained; the intent is checked against what the
  scheduler shows), so the effect happens once;
- after its record says so: the next leader loads it as acked (or noted, for dry-run) and leaves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

log = logging.getLogger("gpuvigil.fleet")
PREFIX = "rec."


def key(hint_id: str) -> str:
    return f"{PREFIX}{hint_id}"


async def entries(kv: Any, prefix: str) -> list[tuple[str, bytes]]:
    """(key, value) of every key of a bucket that starts with `prefix` (none in an empty bucket;
    a key deleted while they are read is left out). Raises when the bucket cannot be read."""
    try:
        keys = [k for k in await kv.keys() if k.startswith(prefix)]
    except Exception as exc:  # noqa: BLE001 - NoKeysError: an empty bucket
        if type(exc).__name__ != "NoKeysError":
            raise
        return []
    out = []
    for k in keys:
        try:
            e = await kv.get(k)
        except Exception as exc:  # noqa: BLE001 - deleted meanwhile
            log.debug("%s: %s", k, exc)
            continue
        out.append((k, e.value or b""))
    return out


def import_records(store: Any, records: list[Any]) -> int:
    """Write records (HintRecord) into a HintStore as they are, replacing its own copies; each
    import is one entry of the hint's history. Returns how many changed the store."""
    from gpuvigil.api.store import HintState

    if not records:
        return 0
    wall = store._wall()
    changed = 0
    with store._tx() as db:
        for r in records:
            row = db.execute("SELECT state, state_reason, attempts, last_seen FROM hints WHERE id = ?", (r.id,)).fetchone()
            if row is not None and tuple(row) == (r.state.value, r.state_reason, r.attempts, r.last_seen):
                continue
            seq = store._log(db, r.id, wall, "loaded", HintState(r.state), "from the fleet's hint store", r.last_seen)
            body = json.dumps(r.to_hint().to_json_dict(), sort_keys=True)
            db.execute("DELETE FROM hints WHERE id = ?", (r.id,))
            db.execute(
                """
                INSERT INTO hints(id, action, finding_id, finding_kind, job, node, gpu, first_seen, last_seen,
                                  occurrences, state, state_reason, state_wall, updated_wall, attempts, last_error, seq, body)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (r.id, r.action.value, r.finding_id, r.finding_kind.value, r.job, r.node, r.gpu, r.first_seen, r.last_seen, r.occurrences,
                 r.state.value, r.state_reason, r.state_wall, r.updated_wall, r.attempts, r.last_error, seq, body),
            )
            changed += 1
    store._generation += 1
    return changed


class SharedHints:
    def __init__(self, kv: Any, store: Any, totals: Counter[str] | None = None):
        self.kv = kv
        self.store = store
        self.synced_seq = 0  # the local change log is in the bucket up to here
        self.loaded = 0
        # Across terms (the process's /metrics): records loaded, pushed, pushes that failed.
        self.totals: Counter[str] = totals if totals is not None else Counter()

    async def load(self) -> int:
        """Every record of the bucket into the local copy (at the start of a term)."""
        from gpuvigil.api.store import HintRecord

        records = []
        for k, value in await entries(self.kv, PREFIX):
            try:
                records.append(HintRecord.model_validate_json(value))
            except ValueError as exc:
                log.warning("hint store: unreadable record %s: %s", k, exc)
        self.loaded = await asyncio.to_thread(import_records, self.store, records)
        self.totals["loaded"] += self.loaded
        self.synced_seq = self.store.latest_seq()
        log.info("hint store: %d record(s) in the fleet's store, %d loaded into %s", len(records), self.loaded, self.store.path)
        return len(records)

    async def push(self) -> int:
        """Every change of the local copy since the last push, into the bucket. Raises when the
        bucket cannot take them (the caller then applies nothing this tick)."""
        n = 0
        while True:
            changes = await asyncio.to_thread(self.store.changes_after, self.synced_seq, 500)
            if not changes:
                return n
            latest: dict[str, Any] = {}
            for r in changes:
                latest[r.id] = r
            try:
                await asyncio.gather(*(self.kv.put(key(i), r.model_dump_json().encode()) for i, r in latest.items()))
            except Exception:
                self.totals["push_failures"] += 1
                raise
            self.synced_seq = max(r.seq for r in changes)
            self.totals["pushed"] += len(latest)
            n += len(latest)
