"""Durable store of findings and scheduler hints (SQLite, WAL), and a pipeline sink that fills it.

One row per cause: a hint's id is its stable cause key (`Hint.id`), so a cause reported on
every tick, or again after a restart, updates `last_seen`/`occurrences` of the same row
instead of adding another. Hint states::

    pending ──ack──▶ acked
       │ └──nack(reason)──▶ nacked
       └──(cause clears)──▶ expired      (acked/nacked hints expire too: the scheduler may undo)
    expired ──(cause seen again)──▶ pending

Every change appends to `hint_log` (an audit trail) and stamps the hint with that log row's
`seq`, so readers can follow changes in order (`changes_after(seq)`, the API's SSE stream),
from this process or another one reading the same file. Each pipeline tick is written in one
transaction: a crash leaves the previous tick's state, never half a tick.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from gpuvigil.errors import UserError
from gpuvigil.model import Finding, FindingKind, Hint, HintAction, Severity

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS findings (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    severity TEXT NOT NULL,
    job TEXT,
    node TEXT,
    gpu INTEGER,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    cleared_ts REAL,
    active INTEGER NOT NULL,
    occurrences INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS findings_node ON findings(node, active);
CREATE INDEX IF NOT EXISTS findings_job ON findings(job, active);
CREATE INDEX IF NOT EXISTS findings_last_seen ON findings(last_seen);
CREATE TABLE IF NOT EXISTS hints (
    id TEXT PRIMARY KEY,
    action TEXT NOT NULL,
    finding_id TEXT NOT NULL,
    finding_kind TEXT NOT NULL,
    job TEXT,
    node TEXT,
    gpu INTEGER,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    occurrences INTEGER NOT NULL,
    state TEXT NOT NULL,
    state_reason TEXT,
    state_ts REAL,
    updated_ts REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS hints_seq ON hints(seq);
CREATE INDEX IF NOT EXISTS hints_node ON hints(node);
CREATE INDEX IF NOT EXISTS hints_job ON hints(job);
CREATE INDEX IF NOT EXISTS hints_finding ON hints(finding_id);
CREATE TABLE IF NOT EXISTS hint_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    hint_id TEXT NOT NULL,
    ts REAL NOT NULL,
    event TEXT NOT NULL,
    state TEXT NOT NULL,
    detail TEXT
);
"""


class HintState(StrEnum):
    PENDING = "pending"
    ACKED = "acked"
    NACKED = "nacked"
    EXPIRED = "expired"


class HintNotFound(KeyError):
    """No hint with that id."""


class HintStateConflict(ValueError):
    """The requested transition is not allowed from the hint's current state."""


class HintRecord(BaseModel):
    """A hint as stored: the hint itself plus its lifecycle."""

    id: str
    action: HintAction
    ts: float
    reason: str
    finding_id: str
    finding_kind: FindingKind
    job: str | None = None
    node: str | None = None
    gpu: int | None = None
    exclude_nodes: list[str] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    state: HintState
    state_reason: str | None = Field(None, description="nack reason, ack note, or why it expired")
    state_ts: float | None = None
    first_seen: float
    last_seen: float
    occurrences: int = Field(description="how many times the cause produced this hint (duplicates merged)")
    updated_ts: float
    attempts: int = Field(0, description="how many times an adapter tried to apply it")
    last_error: str | None = Field(None, description="why the last apply attempt failed, if it did")
    seq: int = Field(description="position in the store's change log; increases on every change")

    def to_hint(self) -> Hint:
        return Hint.model_validate(
            self.model_dump(include={"action", "ts", "reason", "finding_id", "finding_kind", "job", "node", "gpu", "exclude_nodes", "params"})
        )


class FindingRecord(BaseModel):
    """A finding as stored: the latest report of its cause plus its lifecycle."""

    id: str
    kind: FindingKind
    severity: Severity
    ts: float
    job: str | None = None
    ranks: list[int] = Field(default_factory=list)
    culprit_ranks: list[int] = Field(default_factory=list)
    node: str | None = None
    gpu: int | None = None
    xid: int | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    summary: str
    source: str | None = None
    cause: str | None = None
    active: bool
    first_seen: float
    last_seen: float
    cleared_ts: float | None = None
    occurrences: int


class HintStore:
    """Findings and hints in one SQLite file (WAL mode). Safe to share between threads; other
    processes may open the same file (SQLite locking; writers wait up to `busy_timeout_s`)."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 10.0):
        self.path = Path(path)
        if str(path) != ":memory:" and not self.path.parent.is_dir():
            raise UserError(f"{self.path}: directory {self.path.parent} does not exist")
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(
                str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._db.row_factory = sqlite3.Row
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            with self._tx():
                for stmt in _DDL.split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
                row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    self._db.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) != SCHEMA_VERSION:
                    raise UserError(f"{self.path}: hint store schema version {row[0]}, this gpuvigil reads {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            raise UserError(f"{self.path}: not a usable gpuvigil hint store: {exc}") from exc
        self.journal_mode = str(mode).lower()
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken eagerly so concurrent writers serialise, not deadlock."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._db.close()
                self._closed = True

    def __enter__(self) -> HintStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log(self, db: sqlite3.Connection, hint_id: str, ts: float, event: str, state: HintState, detail: str | None) -> int:
        cur = db.execute(
            "INSERT INTO hint_log(hint_id, ts, event, state, detail) VALUES (?, ?, ?, ?, ?)",
            (hint_id, ts, event, state.value, detail),
        )
        return int(cur.lastrowid)  # type: ignore[arg-type]

    # -- writes -----------------------------------------------------------------------------
    def on_tick(self, result: Any, window: Any = None) -> None:
        """Pipeline sink: persist this tick's findings and hints, and expire cleared causes."""
        self.record(
            now=result.now,
            active_findings=result.active_findings,
            cleared_findings=result.cleared_findings,
            new_hints=result.new_hints,
            expired_hints=result.expired_hints,
        )

    def record(
        self,
        *,
        now: float,
        active_findings: Iterable[Finding] = (),
        cleared_findings: Iterable[Finding] = (),
        new_hints: Iterable[Hint] = (),
        expired_hints: Iterable[Hint] = (),
    ) -> None:
        active = list(active_findings)
        cleared = list(cleared_findings)
        with self._tx() as db:
            # Clearing comes first: the pipeline clears a quiet cause before it looks at this
            # tick's reports, so a cause can clear and come back in one tick.
            if cleared:
                db.executemany(
                    "UPDATE findings SET active = 0, cleared_ts = ? WHERE id = ? AND active = 1",
                    [(now, f.id) for f in cleared],
                )
            # Expire by the pipeline's list and, for hints persisted before a restart that this
            # pipeline never issued, by the finding they came from.
            expire_ids = {h.id for h in expired_hints}
            cleared_ids = [f.id for f in cleared]
            if cleared_ids:
                marks = ",".join("?" * len(cleared_ids))
                expire_ids |= {r[0] for r in db.execute(f"SELECT id FROM hints WHERE finding_id IN ({marks})", cleared_ids)}
            why = {f.id: f"cause cleared: {f.kind.value} finding {f.id} not reported since {self._last_seen(db, f.id)}" for f in cleared}
            for hint_id in sorted(expire_ids):
                row = db.execute("SELECT state, finding_id FROM hints WHERE id = ?", (hint_id,)).fetchone()
                if row is None or row["state"] == HintState.EXPIRED.value:
                    continue
                detail = why.get(row["finding_id"], "cause cleared")
                seq = self._log(db, hint_id, now, "expired", HintState.EXPIRED, detail)
                db.execute(
                    "UPDATE hints SET state = 'expired', state_reason = ?, state_ts = ?, updated_ts = ?, seq = ? WHERE id = ?",
                    (detail, now, now, seq, hint_id),
                )
            if active:
                db.executemany(
                    """
                    INSERT INTO findings(id, kind, severity, job, node, gpu, first_seen, last_seen, cleared_ts, active, occurrences, body)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, 1, 1, ?)
                    ON CONFLICT(id) DO UPDATE SET
                        severity = excluded.severity,
                        last_seen = excluded.last_seen,
                        body = excluded.body,
                        occurrences = findings.occurrences + (1 - findings.active),
                        active = 1,
                        cleared_ts = NULL
                    """,
                    [
                        (f.id, f.kind.value, f.severity.value, f.job, f.node, f.gpu, now, now, json.dumps(f.to_json_dict(), sort_keys=True))
                        for f in active
                    ],
                )
            for hint in new_hints:
                self._upsert_hint(db, hint, now)

    @staticmethod
    def _last_seen(db: sqlite3.Connection, finding_id: str) -> str:
        row = db.execute("SELECT last_seen FROM findings WHERE id = ?", (finding_id,)).fetchone()
        return "unknown" if row is None else f"t={row[0]:.1f}"

    def _upsert_hint(self, db: sqlite3.Connection, hint: Hint, now: float) -> None:
        body = json.dumps(hint.to_json_dict(), sort_keys=True)
        row = db.execute("SELECT state FROM hints WHERE id = ?", (hint.id,)).fetchone()
        if row is None:
            seq = self._log(db, hint.id, now, "new", HintState.PENDING, hint.reason)
            db.execute(
                """
                INSERT INTO hints(id, action, finding_id, finding_kind, job, node, gpu, first_seen, last_seen,
                                  occurrences, state, state_reason, state_ts, updated_ts, attempts, last_error, seq, body)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 'pending', NULL, ?, ?, 0, NULL, ?, ?)
                """,
                (hint.id, hint.action.value, hint.finding_id, hint.finding_kind.value, hint.job, hint.node, hint.gpu, now, now, now, now, seq, body),
            )
            return
        state = HintState(row["state"])
        if state == HintState.EXPIRED:
            # The cause came back after clearing: the scheduler must act again.
            seq = self._log(db, hint.id, now, "reopened", HintState.PENDING, hint.reason)
            db.execute(
                """UPDATE hints SET state = 'pending', state_reason = NULL, state_ts = ?, last_seen = ?, updated_ts = ?,
                   occurrences = occurrences + 1, seq = ?, body = ?, last_error = NULL WHERE id = ?""",
                (now, now, now, seq, body, hint.id),
            )
        else:
            seq = self._log(db, hint.id, now, "seen", state, None)
            db.execute(
                "UPDATE hints SET last_seen = ?, updated_ts = ?, occurrences = occurrences + 1, seq = ?, body = ? WHERE id = ?",
                (now, now, seq, body, hint.id),
            )

    def _transition(self, hint_id: str, target: HintState, reason: str | None, now: float | None) -> HintRecord:
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute("SELECT state, state_reason FROM hints WHERE id = ?", (hint_id,)).fetchone()
            if row is None:
                raise HintNotFound(hint_id)
            state = HintState(row["state"])
            if state == target and (target != HintState.NACKED or row["state_reason"] == reason):
                pass  # idempotent: a retried ack/nack does not log twice
            elif state != HintState.PENDING:
                raise HintStateConflict(f"hint {hint_id} is {state.value}; only a pending hint can be {target.value}")
            else:
                seq = self._log(db, hint_id, now, target.value, target, reason)
                db.execute(
                    "UPDATE hints SET state = ?, state_reason = ?, state_ts = ?, updated_ts = ?, seq = ? WHERE id = ?",
                    (target.value, reason, now, now, seq, hint_id),
                )
        return self.get_hint(hint_id)

    def ack(self, hint_id: str, note: str | None = None, *, now: float | None = None) -> HintRecord:
        """The scheduler applied (or accepted) the hint."""
        return self._transition(hint_id, HintState.ACKED, note, now)

    def nack(self, hint_id: str, reason: str, *, now: float | None = None) -> HintRecord:
        """The scheduler refused the hint; `reason` says why (required)."""
        if not reason or not reason.strip():
            raise ValueError("a nack needs a reason")
        return self._transition(hint_id, HintState.NACKED, reason.strip(), now)

    def record_attempt(self, hint_id: str, error: str | None, *, now: float | None = None) -> HintRecord:
        """An adapter tried to apply the hint. A failure leaves it pending with the error, so it
        is retried and nobody loses it; success is recorded by `ack`."""
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute("SELECT state FROM hints WHERE id = ?", (hint_id,)).fetchone()
            if row is None:
                raise HintNotFound(hint_id)
            seq = self._log(db, hint_id, now, "apply_failed" if error else "applied", HintState(row["state"]), error)
            db.execute(
                "UPDATE hints SET attempts = attempts + 1, last_error = ?, updated_ts = ?, seq = ? WHERE id = ?",
                (error, now, seq, hint_id),
            )
        return self.get_hint(hint_id)

    # -- reads ------------------------------------------------------------------------------
    @staticmethod
    def _hint_record(row: sqlite3.Row) -> HintRecord:
        body = json.loads(row["body"])
        body.update(
            state=row["state"],
            state_reason=row["state_reason"],
            state_ts=row["state_ts"],
            first_seen=row["first_seen"],
            last_seen=row["last_seen"],
            occurrences=row["occurrences"],
            updated_ts=row["updated_ts"],
            attempts=row["attempts"],
            last_error=row["last_error"],
            seq=row["seq"],
        )
        return HintRecord.model_validate(body)

    @staticmethod
    def _finding_record(row: sqlite3.Row) -> FindingRecord:
        body = json.loads(row["body"])
        body.update(
            active=bool(row["active"]),
            first_seen=row["first_seen"],
            last_seen=row["last_seen"],
            cleared_ts=row["cleared_ts"],
            occurrences=row["occurrences"],
        )
        return FindingRecord.model_validate(body)

    def get_hint(self, hint_id: str) -> HintRecord:
        rows = self._query("SELECT * FROM hints WHERE id = ?", (hint_id,))
        if not rows:
            raise HintNotFound(hint_id)
        return self._hint_record(rows[0])

    def hints(
        self,
        *,
        since: float | None = None,
        node: str | None = None,
        job: str | None = None,
        action: str | None = None,
        state: str | None = None,
        finding_id: str | None = None,
        limit: int | None = None,
    ) -> list[HintRecord]:
        """Hints, oldest change first. `since` filters on the last change (`updated_ts`)."""
        where, params = ["1=1"], []
        for column, value in (("node", node), ("job", job), ("action", action), ("state", state), ("finding_id", finding_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since is not None:
            where.append("updated_ts >= ?")
            params.append(since)
        sql = f"SELECT * FROM hints WHERE {' AND '.join(where)} ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return [self._hint_record(r) for r in self._query(sql, params)]

    def pending_hints(self) -> list[HintRecord]:
        return self.hints(state=HintState.PENDING.value)

    def changes_after(self, seq: int, limit: int = 500) -> list[HintRecord]:
        """Hints changed after log position `seq`, in change order (each once, latest state)."""
        return [self._hint_record(r) for r in self._query("SELECT * FROM hints WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit))]

    def latest_seq(self) -> int:
        return int(self._query("SELECT COALESCE(MAX(seq), 0) FROM hint_log")[0][0])

    def hint_history(self, hint_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self._query("SELECT * FROM hint_log WHERE hint_id = ? ORDER BY seq", (hint_id,))]

    def findings(
        self,
        *,
        since: float | None = None,
        node: str | None = None,
        job: str | None = None,
        kind: str | None = None,
        severity: str | None = None,
        active: bool | None = None,
        limit: int | None = None,
    ) -> list[FindingRecord]:
        """Findings, most recently seen first. `since` filters on `last_seen`."""
        where, params = ["1=1"], []
        for column, value in (("node", node), ("job", job), ("kind", kind), ("severity", severity)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if active is not None:
            where.append("active = ?")
            params.append(1 if active else 0)
        if since is not None:
            where.append("last_seen >= ?")
            params.append(since)
        sql = f"SELECT * FROM findings WHERE {' AND '.join(where)} ORDER BY last_seen DESC, id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return [self._finding_record(r) for r in self._query(sql, params)]

    def counts(self) -> dict[str, int]:
        out = {f"hints_{r[0]}": int(r[1]) for r in self._query("SELECT state, COUNT(*) FROM hints GROUP BY state")}
        out["findings_active"] = int(self._query("SELECT COUNT(*) FROM findings WHERE active = 1")[0][0])
        out["findings_total"] = int(self._query("SELECT COUNT(*) FROM findings")[0][0])
        return out
