"""The one way gpuvigil opens its SQLite files (the hint store, the alert outbox): WAL mode, a
busy timeout, eager write transactions, and schema migrations numbered by `PRAGMA user_version`.

A database's schema is a list of migrations; migration *i* (1-based) brings a file from version
*i-1* to *i*. Opening a file runs the migrations it lacks in one transaction, so a crash mid-way
leaves the old version, and refuses a file written by a newer gpuvigil (a higher version) rather
than guessing at it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from gpuvigil.errors import UserError

# A step is SQL (one or more statements) or a function of the connection, for what SQL alone
# cannot say (e.g. adopting a file that predates user_version).
Migration = str | Callable[[sqlite3.Connection], None]


class SchemaTooNew(UserError):
    """The file was written by a newer gpuvigil."""


def connect(path: str | Path, *, what: str, synchronous: str = "NORMAL", busy_timeout_s: float = 10.0) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit, see `transaction`), WAL."""
    try:
        db = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        return db
    except sqlite3.DatabaseError as exc:
        raise UserError(f"{what} {path}: not a usable SQLite file: {exc}") from exc


@contextmanager
def transaction(db: sqlite3.Connection, lock: threading.Lock | threading.RLock | None = None) -> Iterator[sqlite3.Connection]:
    """One write transaction, taken eagerly (BEGIN IMMEDIATE) so that concurrent writers queue on
    the busy timeout instead of deadlocking on a read-to-write upgrade. Rolls back on any error."""
    if lock is not None:
        lock.acquire()
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        else:
            try:
                db.execute("COMMIT")
            except BaseException:
                # COMMIT can fail (disk full): leave the connection usable, the data unchanged.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
    finally:
        if lock is not None:
            lock.release()


def user_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def migrate(db: sqlite3.Connection, migrations: Sequence[Migration], *, what: str) -> int:
    """Bring `db` to version `len(migrations)`; returns the version it had before."""
    target = len(migrations)
    with transaction(db):
        before = user_version(db)
        if before > target:
            raise SchemaTooNew(f"{what}: schema version {before}, this gpuvigil reads up to {target}; use a newer gpuvigil or another file")
        for version in range(before + 1, target + 1):
            step = migrations[version - 1]
            if callable(step):
                step(db)
            else:
                for stmt in step.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
            db.execute(f"PRAGMA user_version = {version}")  # no bind parameters in PRAGMA
    return before


__all__ = ["Migration", "SchemaTooNew", "connect", "migrate", "transaction", "user_version"]
