"""The agent's spool: what it could not publish while NATS was unreachable, on disk (SQLite), bounded
in bytes, and replayed oldest first when NATS answers again.

Order is what detect needs: a job's rows feed its windows in stream order, so once anything is
spooled every later message goes behind it until the spool is empty (`Agent._publish`). Past
`max_bytes` the oldest messages are dropped and counted: after a long outage the newest data is
worth more (the rows stream keeps only `rows_max_age_seconds` anyway).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from gpuvigil.util import sqlitedb

_SCHEMA = ["CREATE TABLE spool (id INTEGER PRIMARY KEY AUTOINCREMENT, subject TEXT NOT NULL, headers TEXT NOT NULL, body BLOB NOT NULL, size INTEGER NOT NULL)"]

Message = tuple[str, bytes, dict[str, str]]


class Spool:
    def __init__(self, path: str | Path, max_bytes: int):
        path = Path(path)
        if path.suffix != ".sqlite":
            path.mkdir(parents=True, exist_ok=True)
            path = path / "agent-spool.sqlite"
        self.path = path
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.db = sqlitedb.connect(path, what="agent spool")
        sqlitedb.migrate(self.db, _SCHEMA, what=f"agent spool {path}")
        self.count, self.bytes = self.db.execute("SELECT count(*), coalesce(sum(size), 0) FROM spool").fetchone()
        self.spooled = 0  # messages put in since start
        self.replayed = 0  # of them (or of an earlier run's) published since
        self.dropped = 0  # oldest ones given up to keep under max_bytes

    def put(self, msgs: list[Message]) -> None:
        if not msgs:
            return
        rows = [(s, json.dumps(h, sort_keys=True), b, len(b) + len(s)) for s, b, h in msgs]
        with sqlitedb.transaction(self.db, self.lock) as db:
            db.executemany("INSERT INTO spool (subject, headers, body, size) VALUES (?, ?, ?, ?)", rows)
            self.count += len(rows)
            self.bytes += sum(r[3] for r in rows)
            self.spooled += len(rows)
            if self.bytes > self.max_bytes:
                # The oldest first, until under the bound.
                cut, total = None, self.bytes
                for rid, size in db.execute("SELECT id, size FROM spool ORDER BY id"):
                    if total <= self.max_bytes:
                        break
                    cut, total = rid, total - size
                    self.dropped += 1
                    self.count -= 1
                if cut is not None:
                    db.execute("DELETE FROM spool WHERE id <= ?", (cut,))
                self.bytes = total

    def peek(self, n: int) -> list[tuple[int, Message]]:
        """The `n` oldest messages (id, (subject, body, headers))."""
        with self.lock:
            rows = self.db.execute("SELECT id, subject, body, headers FROM spool ORDER BY id LIMIT ?", (n,)).fetchall()
        return [(rid, (s, bytes(b), json.loads(h))) for rid, s, b, h in rows]

    def done(self, rid: int) -> None:
        """Message `rid` is stored in NATS: forget it."""
        with sqlitedb.transaction(self.db, self.lock) as db:
            row = db.execute("DELETE FROM spool WHERE id = ? RETURNING size", (rid,)).fetchone()
            if row is not None:
                self.count -= 1
                self.bytes -= row[0]
                self.replayed += 1

    def close(self) -> None:
        with self.lock:
            self.db.close()
