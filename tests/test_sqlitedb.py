"""One SQLite helper for both databases (hint store, alert outbox): migrations numbered by
PRAGMA user_version, files from before user_version adopted, newer files refused, transactions
that leave nothing half-written."""

from __future__ import annotations

import json
import sqlite3

import pytest

from gpuvigil.util import sqlitedb
from gpuvigil.api.store import MIGRATIONS, SCHEMA_VERSION, HintState, HintStore
from gpuvigil.errors import UserError

# The hint store schema as gpuvigil wrote it before user_version (schema_version 1 in `meta`).
V1_DDL = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE findings (id TEXT PRIMARY KEY, kind TEXT NOT NULL, severity TEXT NOT NULL, job TEXT, node TEXT, gpu INTEGER,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, cleared_ts REAL, active INTEGER NOT NULL, occurrences INTEGER NOT NULL, body TEXT NOT NULL);
CREATE TABLE hints (id TEXT PRIMARY KEY, action TEXT NOT NULL, finding_id TEXT NOT NULL, finding_kind TEXT NOT NULL, job TEXT, node TEXT,
    gpu INTEGER, first_seen REAL NOT NULL, last_seen REAL NOT NULL, occurrences INTEGER NOT NULL, state TEXT NOT NULL, state_reason TEXT,
    state_ts REAL, updated_ts REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT, seq INTEGER NOT NULL, body TEXT NOT NULL);
CREATE TABLE hint_log (seq INTEGER PRIMARY KEY AUTOINCREMENT, hint_id TEXT NOT NULL, ts REAL NOT NULL, event TEXT NOT NULL, state TEXT NOT NULL, detail TEXT);
INSERT INTO meta VALUES ('schema_version', '1');
"""


def _v1_store(path):
    from gpuvigil.model import FindingKind, Hint, HintAction

    hint = Hint(action=HintAction.DRAIN_NODE, ts=100.0, reason="2 DBEs", finding_id="a" * 16, finding_kind=FindingKind.ECC, node="node-a", gpu=3)
    db = sqlite3.connect(path)
    db.executescript(V1_DDL)
    db.execute(
        "INSERT INTO hints VALUES (?, 'drain_node', ?, 'ecc', NULL, 'node-a', 3, 100, 100, 1, 'acked', 'drained', 150, 150, 0, NULL, 2, ?)",
        (hint.id, "a" * 16, json.dumps(hint.to_json_dict())),
    )
    db.execute("INSERT INTO hint_log(hint_id, ts, event, state, detail) VALUES (?, 100, 'new', 'pending', '2 DBEs')", (hint.id,))
    db.execute("INSERT INTO hint_log(hint_id, ts, event, state, detail) VALUES (?, 150, 'acked', 'acked', 'drained')", (hint.id,))
    db.commit()
    db.close()
    return hint


def test_migrate_runs_each_step_once_and_records_the_version(tmp_path):
    db = sqlitedb.connect(tmp_path / "x.db", what="test")
    steps = ["CREATE TABLE a (x INTEGER)", "ALTER TABLE a ADD COLUMN y TEXT; CREATE INDEX a_y ON a(y)"]
    assert sqlitedb.migrate(db, steps, what="test") == 0
    assert sqlitedb.user_version(db) == 2
    assert sqlitedb.migrate(db, steps, what="test") == 2  # nothing to do
    steps.append(lambda conn: conn.execute("INSERT INTO a VALUES (1, 'one')"))
    assert sqlitedb.migrate(db, steps, what="test") == 2
    assert db.execute("SELECT x, y FROM a").fetchall() == [(1, "one")]
    with pytest.raises(sqlitedb.SchemaTooNew, match="schema version 3, this gpuvigil reads up to 1"):
        sqlitedb.migrate(db, steps[:1], what="test")


def test_failed_migration_leaves_the_old_version(tmp_path):
    db = sqlitedb.connect(tmp_path / "x.db", what="test")
    sqlitedb.migrate(db, ["CREATE TABLE a (x INTEGER)"], what="test")
    with pytest.raises(sqlite3.OperationalError):
        sqlitedb.migrate(db, ["CREATE TABLE a (x INTEGER)", "CREATE TABLE b (x); CREATE TABLE a (x)"], what="test")
    assert sqlitedb.user_version(db) == 1
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'b'").fetchone() is None


def test_transaction_rolls_back_on_error(tmp_path):
    db = sqlitedb.connect(tmp_path / "x.db", what="test")
    db.execute("CREATE TABLE a (x INTEGER)")
    with pytest.raises(RuntimeError):
        with sqlitedb.transaction(db):
            db.execute("INSERT INTO a VALUES (1)")
            raise RuntimeError("boom")
    assert db.execute("SELECT COUNT(*) FROM a").fetchone()[0] == 0
    assert not db.in_transaction


def test_hint_store_from_before_user_version_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.db"
    hint = _v1_store(path)
    with HintStore(path) as store:
        assert sqlitedb.user_version(store._db) == SCHEMA_VERSION == len(MIGRATIONS)
        rec = store.get_hint(hint.id)
        assert (rec.state, rec.state_reason, rec.state_wall, rec.updated_wall, rec.first_seen, rec.seq) == (HintState.ACKED, "drained", 150.0, 150.0, 100.0, 2)
        assert [e["ts_wall"] for e in store.hint_history(hint.id)] == [100.0, 150.0]
        assert store.knows(node="node-a") and not store.knows(node="node-b")
    with HintStore(path) as store:  # and opens again as it is
        assert store.get_hint(hint.id).state == HintState.ACKED


@pytest.mark.parametrize("how", ["user_version", "meta"])
def test_hint_store_from_a_newer_gpuvigil_is_refused(tmp_path, how):
    path = tmp_path / "new.db"
    if how == "user_version":
        HintStore(path).close()
        db = sqlite3.connect(path)
        db.execute("PRAGMA user_version = 99")
        db.close()
    else:
        db = sqlite3.connect(path)
        db.executescript(V1_DDL.replace("('schema_version', '1')", "('schema_version', '7')"))
        db.close()
    with pytest.raises(UserError, match="schema version"):
        HintStore(path)


def test_alert_outbox_from_before_user_version_keeps_its_rows(tmp_path):
    from gpuvigil.alerts.pusher import MIGRATIONS, SCHEMA, AlertPusher
    from gpuvigil.alerts.settings import load_settings

    path = tmp_path / "outbox.db"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    db.execute("INSERT INTO outbox (fingerprint, status, alert_json, enqueued_at) VALUES ('fp', 'firing', '{}', 1.0)")
    db.commit()
    db.close()
    pusher = AlertPusher("http://127.0.0.1:9", path, load_settings())
    try:
        assert pusher.pending() == 1
        # Migrated through every step, from the unversioned file to the newest schema.
        assert sqlitedb.user_version(pusher.db) == len(MIGRATIONS) == 3
    finally:
        pusher.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 5")
    db.close()
    with pytest.raises(UserError, match="schema version 5"):
        AlertPusher("http://127.0.0.1:9", path, load_settings())
