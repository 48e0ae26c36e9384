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
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, computed_field

from gpuvigil.util import sqlitedb
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, Hint

# Migrations by `PRAGMA user_version` (gpuvigil.util.sqlitedb). Version 1 is the schema of files
# written before user_version was used (they say `schema_version = 1` in `meta`).
_V1 = """
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


def _adopt_v1(db: sqlite3.Connection) -> None:
    for stmt in _V1.split(";"):
        if stmt.strip():
            db.execute(stmt)
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is not None and row[0] != "1":
        raise sqlitedb.SchemaTooNew(f"hint store schema version {row[0]} in its meta table; this gpuvigil reads 1-{len(MIGRATIONS)}")


# Version 2: wall-clock columns say so in their names (the pipeline clock may be simulated, so the
# two are never mixed in one column); the nodes and jobs the pipeline has seen, so that a name
# nobody has seen answers 404 rather than "healthy"; indexes for the verdict and health reads.
_V2 = """
ALTER TABLE hints RENAME COLUMN updated_ts TO updated_wall;
ALTER TABLE hints RENAME COLUMN state_ts TO state_wall;
ALTER TABLE hint_log RENAME COLUMN ts TO ts_wall;
ALTER TABLE hint_log ADD COLUMN pipeline_ts REAL;
CREATE INDEX IF NOT EXISTS hints_updated_wall ON hints(updated_wall);
CREATE INDEX IF NOT EXISTS hints_state ON hints(state);
CREATE INDEX IF NOT EXISTS findings_active_seen ON findings(active, last_seen DESC, id);
CREATE INDEX IF NOT EXISTS findings_seen_id ON findings(last_seen DESC, id);
CREATE INDEX IF NOT EXISTS hints_node_seq ON hints(node, seq);
CREATE INDEX IF NOT EXISTS hints_finding_seq ON hints(finding_id, seq);
CREATE TABLE IF NOT EXISTS known_nodes (name TEXT PRIMARY KEY, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS known_jobs (name TEXT PRIMARY KEY, last_seen REAL NOT NULL);
DELETE FROM meta WHERE key = 'schema_version'
"""

log = logging.getLogger(__name__)
# Cleared findings and new/expired hints kept per kind while writes fail (a full disk).
_MAX_BACKLOG = 100_000


class HintState(StrEnum):
    PENDING = "pending"
    ACKED = "acked"
    NACKED = "nacked"
    EXPIRED = "expired"


class HintNotFound(KeyError):
    """No hint with that id."""


class HintStateConflict(ValueError):
    """The requested transition is not allowed from the hint's current state."""


_PIPELINE_CLOCK = "pipeline clock (epoch seconds; simulated time when the pipeline runs a simulation)"
_WALL_CLOCK = "wall clock of the store's host (epoch seconds), whatever clock the pipeline runs on"


class HintRecord(Hint):
    """A hint as stored: the hint itself plus its lifecycle.

    Times come from two clocks and never share a field: `ts`, `first_seen`, `last_seen` are the
    pipeline's clock; fields ending in `_wall` are the wall clock."""

    model_config = ConfigDict(extra="ignore")  # the stored body carries `id`, which is computed

    state: HintState
    state_reason: str | None = Field(None, description="nack reason, ack note, or why it expired")
    state_wall: float | None = Field(None, description=f"when the state last changed; {_WALL_CLOCK}")
    first_seen: float = Field(description=f"first report of the cause; {_PIPELINE_CLOCK}")
    last_seen: float = Field(description=f"latest report of the cause; {_PIPELINE_CLOCK}")
    occurrences: int = Field(description="how many times the cause produced this hint (duplicates merged)")
    updated_wall: float = Field(description=f"last change of any kind; {_WALL_CLOCK}")
    attempts: int = Field(0, description="how many times an adapter tried to apply it")
    last_error: str | None = Field(None, description="why the last apply attempt failed, if it did")
    seq: int = Field(description="position in the store's change log; increases on every change")

    @computed_field(description="stable id of the hint's cause (action, finding, job, node, GPU)")  # type: ignore[prop-decorator]
    @property
    def id(self) -> str:
        return self.cause_key

    def to_hint(self) -> Hint:
        return Hint.model_validate(self.model_dump(include=set(Hint.model_fields)))


class FindingRecord(Finding):
    """A finding as stored: the latest report of its cause plus its lifecycle (all times on the
    pipeline's clock)."""

    model_config = ConfigDict(extra="ignore")

    evidence: dict[str, Any] = Field(default_factory=dict)
    active: bool
    first_seen: float = Field(description=f"first report of the cause; {_PIPELINE_CLOCK}")
    last_seen: float = Field(description=f"latest report of the cause; {_PIPELINE_CLOCK}")
    cleared_ts: float | None = Field(None, description=f"when the cause stopped being reported; {_PIPELINE_CLOCK}")
    occurrences: int

    @computed_field(description="stable id of the finding's cause (kind, job, node, GPU)")  # type: ignore[prop-decorator]
    @property
    def id(self) -> str:
        return self.cause_key


# Records are assembled as JSON inside SQLite (stored generated columns, version 3): the API sends
# these bytes as they are, and Python callers parse the same text into the models above.
_HINT_COLUMNS = ("state", "state_reason", "state_wall", "first_seen", "last_seen", "occurrences", "updated_wall", "attempts", "last_error", "seq")


def _record_json(prefix: str, fields: Iterable[tuple[str, str]]) -> str:
    """SQL for a record's JSON text: the stored body (a JSON object written by json.dumps, whose
    keys never include the lifecycle columns) with the lifecycle fields appended by string
    concatenation. json_set would parse and re-serialise every body (~20 µs a row: 8 ms for a
    400-finding verdict); json_quote only formats one column value."""
    tail = " || ".join(f"',\"{key}\":' || {expr}" for key, expr in fields)
    return f"(CASE WHEN {prefix}body = '{{}}' THEN '{{' || substr({tail}, 2) ELSE substr({prefix}body, 1, length({prefix}body) - 1) || {tail} END) || '}}'"


def _hint_json(table: str = "") -> str:
    prefix = f"{table}." if table else ""
    return _record_json(prefix, [(c, f"json_quote({prefix}{c})") for c in _HINT_COLUMNS])


_HINT_JSON = _hint_json()
_FINDING_JSON = _record_json(
    "",
    [
        ("active", "(CASE WHEN active THEN 'true' ELSE 'false' END)"),
        ("first_seen", "json_quote(first_seen)"),
        ("last_seen", "json_quote(last_seen)"),
        ("cleared_ts", "json_quote(cleared_ts)"),
        ("occurrences", "json_quote(occurrences)"),
    ],
)
# Worst first: page, ticket, info; then the most recently seen.
_SEVERITY_ORDER = "CASE severity WHEN 'page' THEN 0 WHEN 'ticket' THEN 1 ELSE 2 END"


# Version 3: every record's JSON text, and what verdicts aggregate, are kept as STORED generated
# columns: SQLite computes them when a row is written (a tick, an ack), once, instead of on every
# read after every write. A 400-finding verdict is then a concatenation of stored texts (before,
# a cache miss built each record from its body and parsed each body three times, 6-8 ms).
_FINDINGS_V3 = f"""CREATE TABLE findings_v3 (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, severity TEXT NOT NULL, job TEXT, node TEXT, gpu INTEGER,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, cleared_ts REAL, active INTEGER NOT NULL,
    occurrences INTEGER NOT NULL, body TEXT NOT NULL,
    record TEXT GENERATED ALWAYS AS ({_FINDING_JSON}) STORED,
    summary TEXT GENERATED ALWAYS AS (json_extract(body, '$.summary')) STORED,
    culprit_ranks TEXT GENERATED ALWAYS AS (json_extract(body, '$.culprit_ranks')) STORED,
    culprit_nodes TEXT GENERATED ALWAYS AS (
        CASE json_type(body, '$.evidence.culprit_nodes') WHEN 'array' THEN json_extract(body, '$.evidence.culprit_nodes') END) STORED
)"""
_HINTS_V3 = f"""CREATE TABLE hints_v3 (
    id TEXT PRIMARY KEY, action TEXT NOT NULL, finding_id TEXT NOT NULL, finding_kind TEXT NOT NULL,
    job TEXT, node TEXT, gpu INTEGER, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    occurrences INTEGER NOT NULL, state TEXT NOT NULL, state_reason TEXT, state_wall REAL,
    updated_wall REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT,
    seq INTEGER NOT NULL, body TEXT NOT NULL,
    record TEXT GENERATED ALWAYS AS ({_HINT_JSON}) STORED
)"""
_FINDING_COLUMNS = "id, kind, severity, job, node, gpu, first_seen, last_seen, cleared_ts, active, occurrences, body"
_HINT_TABLE_COLUMNS = (
    "id, action, finding_id, finding_kind, job, node, gpu, first_seen, last_seen, occurrences, state, state_reason, "
    "state_wall, updated_wall, attempts, last_error, seq, body"
)


# Each job's verdict, kept by the writer: the jobs whose findings or hints changed are marked in
# `verdict_dirty`, and every write transaction rebuilds those jobs' rows before it commits
# (`_refresh_verdicts`). The API's read is then one row, whatever the verdict's size; the status
# and summary are left to the API, whose config says which severities make a job unhealthy.
_VERDICTS_V3 = [
    """CREATE TABLE job_verdicts (
        job TEXT PRIMARY KEY, n_findings INTEGER NOT NULL, severities TEXT NOT NULL, worst_kind TEXT, worst_summary TEXT,
        culprit_ranks TEXT NOT NULL, culprit_nodes TEXT NOT NULL, hints TEXT NOT NULL, findings TEXT NOT NULL)""",
    "CREATE TABLE verdict_dirty (job TEXT PRIMARY KEY) WITHOUT ROWID",
    # Hints change a few at a time (acks, nacks, new and expired hints): triggers mark their jobs.
    # A tick rewrites every active finding, and a trigger per row would cost ~40 µs (0.8 s a tick
    # at 20k findings): `record` marks the jobs of the findings it writes itself. Plain INSERTs
    # guarded by NOT IN: an OR IGNORE inside a trigger would be overridden by the conflict policy
    # of the statement that fired it.
    """CREATE TRIGGER hints_verdict_ins AFTER INSERT ON hints
       BEGIN INSERT INTO verdict_dirty(job) SELECT DISTINCT job FROM findings WHERE id = NEW.finding_id AND job IS NOT NULL
             AND job NOT IN (SELECT job FROM verdict_dirty); END""",
    """CREATE TRIGGER hints_verdict_upd AFTER UPDATE ON hints
       BEGIN INSERT INTO verdict_dirty(job) SELECT DISTINCT job FROM findings WHERE id IN (NEW.finding_id, OLD.finding_id) AND job IS NOT NULL
             AND job NOT IN (SELECT job FROM verdict_dirty); END""",
    """CREATE TRIGGER hints_verdict_del AFTER DELETE ON hints
       BEGIN INSERT INTO verdict_dirty(job) SELECT DISTINCT job FROM findings WHERE id = OLD.finding_id AND job IS NOT NULL
             AND job NOT IN (SELECT job FROM verdict_dirty); END""",
]


def _v3(db: sqlite3.Connection) -> None:
    # A stored generated column cannot be added by ALTER TABLE: each table is rebuilt (rows,
    # then its indexes as they were).
    for table, create, columns in (("findings", _FINDINGS_V3, _FINDING_COLUMNS), ("hints", _HINTS_V3, _HINT_TABLE_COLUMNS)):
        indexes = [r[0] for r in db.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL", (table,))]
        db.execute(create)
        db.execute(f"INSERT INTO {table}_v3({columns}) SELECT {columns} FROM {table}")
        db.execute(f"DROP TABLE {table}")
        db.execute(f"ALTER TABLE {table}_v3 RENAME TO {table}")
        for sql in indexes:
            db.execute(sql)
    for stmt in _VERDICTS_V3:
        db.execute(stmt)
    db.execute("INSERT INTO verdict_dirty(job) SELECT DISTINCT job FROM findings WHERE job IS NOT NULL")
    _refresh_verdicts(db)


def _job_verdict_row(db: sqlite3.Connection, job: str) -> tuple[Any, ...] | None:
    """A job's verdict parts from its active findings and their live hints (None: no active
    finding)."""
    rows = db.execute(
        f"""SELECT record, severity, kind, summary FROM findings INDEXED BY findings_job
            WHERE job = ? AND active = 1 ORDER BY {_SEVERITY_ORDER}, last_seen DESC, id""",
        (job,),
    ).fetchall()
    if not rows:
        return None
    ranks = [
        r[0]
        for r in db.execute(
            """SELECT DISTINCT r.value FROM findings AS f INDEXED BY findings_job, json_each(f.culprit_ranks) AS r
               WHERE f.job = ? AND f.active = 1 AND r.type = 'integer' ORDER BY r.value""",
            (job,),
        )
    ]
    # A finding names its culprit nodes in evidence.culprit_nodes, else its own node.
    nodes = [
        r[0]
        for r in db.execute(
            """SELECT CAST(n.value AS TEXT) AS name FROM findings AS f INDEXED BY findings_job, json_each(f.culprit_nodes) AS n
               WHERE f.job = ? AND f.active = 1 AND n.value IS NOT NULL
               UNION
               SELECT node AS name FROM findings INDEXED BY findings_job
               WHERE job = ? AND active = 1 AND culprit_nodes IS NULL AND node IS NOT NULL AND node <> ''
               ORDER BY name""",
            (job, job),
        )
    ]
    # The job's own live hints in change order, then live hints other jobs got for the same
    # findings (e.g. a drain of the culprit node), by finding. From the job's findings to their
    # hints (CROSS JOIN keeps that order: the finding_id index, not a scan of every live hint).
    hints = [
        r[0]
        for r in db.execute(
            """SELECT h.record FROM findings AS f INDEXED BY findings_job CROSS JOIN hints AS h ON h.finding_id = f.id
               WHERE f.job = ? AND f.active = 1 AND h.state IN ('pending', 'acked')
               ORDER BY (h.job IS NOT ?), CASE WHEN h.job IS ? THEN '' ELSE h.finding_id END, h.seq""",
            (job, job, job),
        )
    ]
    severities = sorted({r[1] for r in rows})
    return (
        job, len(rows), json.dumps(severities), rows[0][2], rows[0][3], json.dumps(ranks, separators=(",", ":")), json.dumps(nodes, separators=(",", ":")),
        "[" + ",".join(hints) + "]", "[" + ",".join(r[0] for r in rows) + "]",
    )


def _refresh_verdicts(db: sqlite3.Connection) -> None:
    """Rebuild the verdict rows of the jobs marked dirty in this transaction."""
    dirty = [r[0] for r in db.execute("SELECT job FROM verdict_dirty")]
    if not dirty:
        return
    for job in dirty:
        row = _job_verdict_row(db, job)
        if row is None:
            db.execute("DELETE FROM job_verdicts WHERE job = ?", (job,))
        else:
            db.execute("INSERT OR REPLACE INTO job_verdicts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
    db.execute("DELETE FROM verdict_dirty")


MIGRATIONS: list[sqlitedb.Migration] = [_adopt_v1, _V2, _v3]
SCHEMA_VERSION = len(MIGRATIONS)


class HintStore:
    """Findings and hints in one SQLite file (WAL mode). Safe to share between threads; other
    processes may open the same file (SQLite locking; writers wait up to `busy_timeout_s`).

    `wall_clock` stamps the `_wall` fields (acks, nacks, state changes); the pipeline's own clock
    arrives as `now` with each tick."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 10.0, wall_clock: Callable[[], float] = time.time):
        self.path = Path(path)
        if str(path) != ":memory:" and not self.path.parent.is_dir():
            raise UserError(f"{self.path}: directory {self.path.parent} does not exist")
        self._lock = threading.RLock()
        self._wall = wall_clock
        what = f"hint store {self.path}"
        try:
            self._db = sqlitedb.connect(path, what=what, busy_timeout_s=busy_timeout_s)
        except UserError as exc:
            raise UserError(f"{self.path}: not a usable gpuvigil hint store: {exc.__cause__ or exc}") from exc
        try:
            self._db.execute("PRAGMA foreign_keys=ON")
            mode = self._db.execute("PRAGMA journal_mode").fetchone()[0]
            sqlitedb.migrate(self._db, MIGRATIONS, what=what)
        except sqlitedb.SchemaTooNew as exc:
            self._db.close()
            raise UserError(f"{self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise UserError(f"{self.path}: not a usable gpuvigil hint store: {exc}") from exc
        self.journal_mode = str(mode).lower()
        self._closed = False
        # Readers (the API) use their own connections: in WAL mode they read the last committed
        # state while a tick is being written, instead of queueing on the writer's lock. A
        # file-less (":memory:") store has one connection, shared under the lock.
        self._shared = str(path) == ":memory:" or self.journal_mode != "wal"
        self._busy_timeout_s = busy_timeout_s
        self._readers: list[sqlite3.Connection] = []
        self._all_readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        # PRAGMA data_version on one connection that never writes changes whenever any other
        # connection (this process's writer, or another process) commits.
        self._version_db = None if self._shared else self._open_reader()
        self._version_lock = threading.Lock()
        self._known_written: set[tuple[str, str]] = set()
        # Bumped on every write by this process; readers (the API) cache derived answers per
        # value. Writes by other processes are seen through SQLite's data_version.
        self._generation = 0
        self._backlog: dict[str, list[Any]] = {"cleared": [], "new": [], "expired": []}
        self.write_failures = 0

    # -- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with sqlitedb.transaction(self._db, self._lock) as db:
            yield db
            _refresh_verdicts(db)  # the verdicts of jobs this transaction touched, in it
        self._generation += 1

    def _open_reader(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA query_only=1")
        with self._readers_lock:
            self._all_readers.append(db)
        return db

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """A connection for reads, in one read transaction (a consistent snapshot across the
        statements of one answer). Never waits for a write in progress."""
        if self._shared:
            with self._lock:
                yield self._db
            return
        with self._readers_lock:
            db = self._readers.pop() if self._readers else None
        if db is None:
            db = self._open_reader()
        try:
            db.execute("BEGIN")
            try:
                yield db
            finally:
                db.execute("COMMIT")
        finally:
            with self._readers_lock:
                self._readers.append(db)

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._reading() as db:
            cur = db.execute(sql, tuple(params))
            cur.row_factory = sqlite3.Row
            return cur.fetchall()

    def _column(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        with self._reading() as db:
            return [r[0] for r in db.execute(sql, tuple(params))]

    def generation(self, blocking: bool = True) -> tuple[int, int] | None:
        """Changes when the store's content may have changed (this process or another). Never
        waits for a write in progress on a file store; a file-less store with `blocking=False`
        gives None while a tick is being written."""
        if self._version_db is not None:
            with self._version_lock:
                return 0, int(self._version_db.execute("PRAGMA data_version").fetchone()[0])
        if not self._lock.acquire(blocking):
            return None
        try:
            return self._generation, int(self._db.execute("PRAGMA data_version").fetchone()[0])
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                with self._readers_lock:
                    for db in self._all_readers:
                        db.close()
                    self._all_readers.clear()
                    self._readers.clear()
                self._db.close()
                self._closed = True

    def __enter__(self) -> HintStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _log(db: sqlite3.Connection, hint_id: str, wall: float, event: str, state: HintState, detail: str | None, pipeline_ts: float | None = None) -> int:
        cur = db.execute(
            "INSERT INTO hint_log(hint_id, ts_wall, pipeline_ts, event, state, detail) VALUES (?, ?, ?, ?, ?, ?)",
            (hint_id, wall, pipeline_ts, event, state.value, detail),
        )
        return int(cur.lastrowid)  # type: ignore[arg-type]

    # -- writes -----------------------------------------------------------------------------
    def on_tick(self, result: Any, window: Any = None) -> None:
        """Pipeline sink: persist this tick's findings and hints, and expire cleared causes.

        A tick that cannot be written (disk full, I/O error) is logged, never raised into the
        pipeline, and kept: its cleared findings and new/expired hints are written with the next
        tick that can write (active findings are rewritten every tick anyway)."""
        nodes, jobs = _names_in(window)
        backlog = self._backlog
        try:
            self.record(
                now=result.now,
                active_findings=result.active_findings,
                cleared_findings=[*backlog["cleared"], *result.cleared_findings],
                new_hints=[*backlog["new"], *result.new_hints],
                expired_hints=[*backlog["expired"], *result.expired_hints],
                nodes=nodes,
                jobs=jobs,
            )
        except sqlite3.Error as exc:
            self.write_failures += 1
            for key, items in (("cleared", result.cleared_findings), ("new", result.new_hints), ("expired", result.expired_hints)):
                backlog[key].extend(items)
                del backlog[key][: max(0, len(backlog[key]) - _MAX_BACKLOG)]
            log.warning("hint store %s: cannot write this tick (%s); kept for the next tick", self.path, exc)
        else:
            if any(backlog.values()):
                log.info("hint store %s: writes work again; the ticks that failed are written", self.path)
            self._backlog = {"cleared": [], "new": [], "expired": []}

    def record(
        self,
        *,
        now: float,
        active_findings: Iterable[Finding] = (),
        cleared_findings: Iterable[Finding] = (),
        new_hints: Iterable[Hint] = (),
        expired_hints: Iterable[Hint] = (),
        nodes: Iterable[str] = (),
        jobs: Iterable[str] = (),
    ) -> None:
        """One tick in one transaction. `now` is the pipeline's clock; `nodes`/`jobs` are the
        names the pipeline saw (so that the API can tell a healthy node from an unknown one)."""
        active = list(active_findings)
        cleared = list(cleared_findings)
        wall = self._wall()
        # A node or job is written once per process (and again after a restart): the inventory
        # only answers "was it ever seen", so 10k GPUs do not cost 10k writes a tick.
        known = {("node", n) for n in nodes if n} | {("job", j) for j in jobs if j}
        known |= {("node", f.node) for f in active if f.node} | {("job", f.job) for f in active if f.job}
        fresh_names = known - self._known_written
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
                if row is None or row[0] == HintState.EXPIRED.value:
                    continue
                detail = why.get(row[1], "cause cleared")
                seq = self._log(db, hint_id, wall, "expired", HintState.EXPIRED, detail, now)
                db.execute(
                    "UPDATE hints SET state = 'expired', state_reason = ?, state_wall = ?, updated_wall = ?, seq = ? WHERE id = ?",
                    (detail, wall, wall, seq, hint_id),
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
            touched = {f.job for f in active if f.job} | {f.job for f in cleared if f.job}
            if touched:
                db.executemany("INSERT OR IGNORE INTO verdict_dirty(job) VALUES (?)", [(j,) for j in sorted(touched)])
            for hint in new_hints:
                self._upsert_hint(db, hint, now, wall)
            for table, kind in (("known_nodes", "node"), ("known_jobs", "job")):
                names = [(n, now) for k, n in fresh_names if k == kind]
                if names:
                    db.executemany(
                        f"INSERT INTO {table}(name, last_seen) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET last_seen = excluded.last_seen",
                        names,
                    )
        self._known_written |= fresh_names

    @staticmethod
    def _last_seen(db: sqlite3.Connection, finding_id: str) -> str:
        row = db.execute("SELECT last_seen FROM findings WHERE id = ?", (finding_id,)).fetchone()
        return "unknown" if row is None else f"t={row[0]:.1f}"

    def _upsert_hint(self, db: sqlite3.Connection, hint: Hint, now: float, wall: float) -> None:
        body = json.dumps(hint.to_json_dict(), sort_keys=True)
        row = db.execute("SELECT state FROM hints WHERE id = ?", (hint.id,)).fetchone()
        if row is None:
            seq = self._log(db, hint.id, wall, "new", HintState.PENDING, hint.reason, now)
            db.execute(
                """
                INSERT INTO hints(id, action, finding_id, finding_kind, job, node, gpu, first_seen, last_seen,
                                  occurrences, state, state_reason, state_wall, updated_wall, attempts, last_error, seq, body)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 'pending', NULL, ?, ?, 0, NULL, ?, ?)
                """,
                (hint.id, hint.action.value, hint.finding_id, hint.finding_kind.value, hint.job, hint.node, hint.gpu, now, now, wall, wall, seq, body),
            )
            return
        state = HintState(row[0])
        if state == HintState.EXPIRED:
            # The cause came back after clearing: the scheduler must act again.
            seq = self._log(db, hint.id, wall, "reopened", HintState.PENDING, hint.reason, now)
            db.execute(
                """UPDATE hints SET state = 'pending', state_reason = NULL, state_wall = ?, last_seen = ?, updated_wall = ?,
                   occurrences = occurrences + 1, seq = ?, body = ?, last_error = NULL WHERE id = ?""",
                (wall, now, wall, seq, body, hint.id),
            )
        else:
            seq = self._log(db, hint.id, wall, "seen", state, None, now)
            db.execute(
                "UPDATE hints SET last_seen = ?, updated_wall = ?, occurrences = occurrences + 1, seq = ?, body = ? WHERE id = ?",
                (now, wall, seq, body, hint.id),
            )

    def _transition(self, hint_id: str, target: HintState, reason: str | None, wall: float | None) -> HintRecord:
        wall = self._wall() if wall is None else wall
        with self._tx() as db:
            row = db.execute("SELECT state, state_reason FROM hints WHERE id = ?", (hint_id,)).fetchone()
            if row is None:
                raise HintNotFound(hint_id)
            state = HintState(row[0])
            if state == target and (target != HintState.NACKED or row[1] == reason):
                pass  # idempotent: a retried ack/nack does not log twice
            elif state != HintState.PENDING:
                raise HintStateConflict(f"hint {hint_id} is {state.value}; only a pending hint can be {target.value}")
            else:
                seq = self._log(db, hint_id, wall, target.value, target, reason)
                db.execute(
                    "UPDATE hints SET state = ?, state_reason = ?, state_wall = ?, updated_wall = ?, seq = ? WHERE id = ?",
                    (target.value, reason, wall, wall, seq, hint_id),
                )
        return self.get_hint(hint_id)

    def ack(self, hint_id: str, note: str | None = None, *, now: float | None = None) -> HintRecord:
        """The scheduler applied (or accepted) the hint. `now`: wall-clock time (default: now)."""
        return self._transition(hint_id, HintState.ACKED, note, now)

    def nack(self, hint_id: str, reason: str, *, now: float | None = None) -> HintRecord:
        """The scheduler refused the hint; `reason` says why (required, not blank)."""
        if not reason or not reason.strip():
            raise BlankReason("a nack needs a reason")
        return self._transition(hint_id, HintState.NACKED, reason.strip(), now)

    def record_attempt(self, hint_id: str, error: str | None, *, now: float | None = None) -> HintRecord:
        """An adapter tried to apply the hint. A failure leaves it pending with the error, so it
        is retried and nobody loses it; success is recorded by `ack`. `now`: wall clock."""
        wall = self._wall() if now is None else now
        with self._tx() as db:
            row = db.execute("SELECT state FROM hints WHERE id = ?", (hint_id,)).fetchone()
            if row is None:
                raise HintNotFound(hint_id)
            seq = self._log(db, hint_id, wall, "apply_failed" if error else "applied", HintState(row[0]), error)
            db.execute(
                "UPDATE hints SET attempts = attempts + 1, last_error = ?, updated_wall = ?, seq = ? WHERE id = ?",
                (error, wall, seq, hint_id),
            )
        return self.get_hint(hint_id)

    def note(self, hint_id: str, event: str, detail: str, *, now: float | None = None) -> HintRecord:
        """Record what was done about a hint without changing its state (serve's `--act dry-run`:
        "would drain gvnode1 ..."): appended to its history and shown as its state_reason."""
        wall = self._wall() if now is None else now
        with self._tx() as db:
            row = db.execute("SELECT state FROM hints WHERE id = ?", (hint_id,)).fetchone()
            if row is None:
                raise HintNotFound(hint_id)
            seq = self._log(db, hint_id, wall, event, HintState(row[0]), detail)
            db.execute("UPDATE hints SET state_reason = ?, updated_wall = ?, seq = ? WHERE id = ?", (detail, wall, seq, hint_id))
        return self.get_hint(hint_id)

    # -- reads: JSON text built by SQLite, and models parsed from it --------------------------
    def get_hint(self, hint_id: str) -> HintRecord:
        rows = self._column("SELECT record FROM hints WHERE id = ?", (hint_id,))
        if not rows:
            raise HintNotFound(hint_id)
        return HintRecord.model_validate_json(rows[0])

    @staticmethod
    def _hint_where(
        since: float | None = None,
        node: str | None = None,
        job: str | None = None,
        action: str | None = None,
        state: str | None = None,
        finding_id: str | None = None,
    ) -> tuple[str, list[Any]]:
        where, params = ["1=1"], []
        for column, value in (("node", node), ("job", job), ("action", action), ("state", state), ("finding_id", finding_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since is not None:
            where.append("updated_wall >= ?")
            params.append(since)
        return " AND ".join(where), params

    def hints_json(self, *, limit: int | None = None, **filters: Any) -> list[str]:
        """Hints as JSON text, oldest change first. `since` filters on the last change
        (`updated_wall`, wall clock)."""
        where, params = self._hint_where(**filters)
        sql = f"SELECT record FROM hints WHERE {where} ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return self._column(sql, params)

    def hints(self, *, limit: int | None = None, **filters: Any) -> list[HintRecord]:
        """Hints, oldest change first (filters as `hints_json`)."""
        return [HintRecord.model_validate_json(t) for t in self.hints_json(limit=limit, **filters)]

    def pending_hints(self) -> list[HintRecord]:
        return self.hints(state=HintState.PENDING.value)

    def changes_after(self, seq: int, limit: int = 500) -> list[HintRecord]:
        """Hints changed after log position `seq`, in change order (each once, latest state)."""
        rows = self._column("SELECT record FROM hints WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit))
        return [HintRecord.model_validate_json(t) for t in rows]

    def latest_seq(self) -> int:
        return int(self._column("SELECT COALESCE(MAX(seq), 0) FROM hint_log")[0])

    def hint_history(self, hint_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self._query("SELECT * FROM hint_log WHERE hint_id = ? ORDER BY seq", (hint_id,))]

    def findings_json(
        self,
        *,
        since: float | None = None,
        node: str | None = None,
        job: str | None = None,
        kind: str | None = None,
        severity: str | None = None,
        active: bool | None = None,
        limit: int | None = None,
        worst_first: bool = False,
    ) -> list[str]:
        """Findings as JSON text, most recently seen first (or worst severity first, then most
        recently seen). `since` filters on `last_seen` (pipeline clock)."""
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
        order = f"{_SEVERITY_ORDER}, last_seen DESC, id" if worst_first else "last_seen DESC, id"
        # Without statistics SQLite prefers walking findings_active_seen (every active finding)
        # to avoid a sort; for one job's or node's few hundred findings the sort is far cheaper.
        index = " INDEXED BY findings_job" if job is not None else " INDEXED BY findings_node" if node is not None else ""
        sql = f"SELECT record FROM findings{index} WHERE {' AND '.join(where)} ORDER BY {order}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return self._column(sql, params)

    def findings(self, **filters: Any) -> list[FindingRecord]:
        """Findings, most recently seen first (filters as `findings_json`)."""
        return [FindingRecord.model_validate_json(t) for t in self.findings_json(**filters)]

    def job_summary(self, job: str) -> dict[str, Any] | None:
        """A job verdict's parts as the writer stored them (None: no active finding): the active
        findings worst first and the live hints for them (each a JSON array text), their
        distinct severities, the worst finding's kind and summary, culprit ranks and nodes (JSON
        texts)."""
        with self._reading() as db:
            row = db.execute(
                "SELECT n_findings, severities, worst_kind, worst_summary, culprit_ranks, culprit_nodes, hints, findings FROM job_verdicts WHERE job = ?",
                (job,),
            ).fetchone()
        if row is None:
            return None
        keys = ("n_findings", "severities", "worst_kind", "worst_summary", "culprit_ranks", "culprit_nodes", "hints", "findings")
        out = dict(zip(keys, row, strict=True))
        out["severities"] = json.loads(out["severities"])
        return out

    def node_summary(self, node: str) -> dict[str, Any]:
        """Active findings on the node worst first (JSON, with severity, kind, summary) and the
        live hints that target it (JSON)."""
        with self._reading() as db:
            rows = db.execute(
                f"""SELECT record, severity, kind, summary
                    FROM findings INDEXED BY findings_node WHERE node = ? AND active = 1 ORDER BY {_SEVERITY_ORDER}, last_seen DESC, id""",
                (node,),
            ).fetchall()
            hints = [r[0] for r in db.execute("SELECT record FROM hints WHERE node = ? AND state IN ('pending', 'acked') ORDER BY seq", (node,))]
        return {"findings": [r[0] for r in rows], "rows": [(r[1], r[2], r[3]) for r in rows], "hints": hints}

    def knows(self, *, node: str | None = None, job: str | None = None) -> bool:
        """Whether the pipeline ever saw this node (or job), or the store holds anything for it."""
        column, table, name = ("node", "known_nodes", node) if node is not None else ("job", "known_jobs", job)
        sql = (
            f"SELECT EXISTS(SELECT 1 FROM {table} WHERE name = ?) OR EXISTS(SELECT 1 FROM findings WHERE {column} = ?) "
            f"OR EXISTS(SELECT 1 FROM hints WHERE {column} = ?)"
        )
        return bool(self._column(sql, (name, name, name))[0])

    def counts(self) -> dict[str, int]:
        out = {f"hints_{r[0]}": int(r[1]) for r in self._query("SELECT state, COUNT(*) FROM hints GROUP BY state")}
        out["findings_active"] = int(self._column("SELECT COUNT(*) FROM findings WHERE active = 1")[0])
        out["findings_total"] = int(self._column("SELECT COUNT(*) FROM findings")[0])
        return out


class BlankReason(ValueError):
    """A nack without a reason."""


def _names_in(window: Any) -> tuple[list[str], list[str]]:
    """Node and job names the pipeline saw this tick (snapshots, and GPU samples when no node
    snapshot is collected)."""
    if window is None or not hasattr(window, "get"):
        return [], []
    nodes: set[str] = set()
    jobs: set[str] = set()
    for stream, column, into in (("nodes", "node", nodes), ("jobs", "job", jobs), ("allocations", "node", nodes), ("allocations", "job", jobs)):
        try:
            df = window.get(stream)
        except Exception:  # noqa: BLE001 - a window without the stream has nothing to add
            continue
        if column in getattr(df, "columns", ()):
            into.update(v for v in df.get_column(column).unique().to_list() if v)
    if not nodes and hasattr(window, "fresh"):
        df = window.fresh("gpu_samples")
        if "node" in df.columns:
            nodes.update(v for v in df.get_column("node").unique().to_list() if v)
    return sorted(nodes), sorted(jobs)
