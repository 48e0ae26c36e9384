"""What gpuvigil has done to each node and GPU, and how much it may still do: the quarantine state
machine and the circuit breaker, both persisted in one SQLite file.

Quarantine state machine
------------------------
Every node (key ``"node"``) and GPU (key ``"node/gpu"``) gpuvigil has acted on has a `Record`:

    healthy → suspect → cordoned → draining → remediating → verifying → healthy
    side exits: rma (taken out for repair) and operator_held (a person owns it now)

- ``suspect``: a finding asks for the node to be taken out, and nothing is applied yet (dry-run,
  breaker open, or the apply failed and is retried).
- ``cordoned`` / ``draining``: gpuvigil applied a cordon (no new work) or a drain (no new work,
  running jobs leave) itself. Only these, entered by gpuvigil, are ever undone by gpuvigil.
- ``remediating``: every cause went quiet; the remediation steps run (`Steps.remediate`).
- ``verifying``: the return-to-service check runs (`Steps.verify`); only a pass returns the node.
- ``rma``: out for hardware repair; only an operator returns it (`operator_release`).
- ``operator_held``: a person drained the node, or changed what gpuvigil did; gpuvigil never
  undoes it, and returns it only when an operator releases it.

`QuarantineMachine.transition` is the only writer: it refuses a move `TRANSITIONS` does not allow
(`IllegalTransition`), and records each move in the log with its cause, finding ids, evidence,
who (``rule`` or ``operator``), the rule's name and the time. `history(node)` reads it back
(`gpuvigil why NODE`). The state is read from the file on every call, so a process that restarts
resumes where the last one stopped: a record in ``cordoned`` is not cordoned again, a record
whose action was recorded is not applied again.

Hooks (remediation and verification)
------------------------------------
`Steps` is the seam for remediation and the return-to-service check: `remediate(record, now)`
and `verify(record, now)` each return a `StepResult` (``pending``: call again next tick;
``passed``: next state; ``failed``: ``remediate`` stays, ``verify`` goes back to remediating;
``rma``: to the RMA exit). `QuarantineMachine.advance(key, steps, now, hold_down)` drives one record
one tick further. `HoldDown` (the default) remediates by waiting until every cause has been quiet
for the hold-down and verifies by nothing else; a configured check replaces it.

Circuit breaker
---------------
`Breaker.admit(key, nodes=, gpus=, fleet_nodes=, fleet_gpus=, now=, cause=)` asks before a node or
GPU is taken out of service. Within the sliding window (`BreakerConfig.window_seconds`) the nodes
taken out may be at most `max_node_fraction` of the fleet and `max_nodes`, the GPUs at most
`max_gpu_fraction` and `max_gpus`; one node (or GPU) alone may always go when nothing else went in
the window. A request over the limit trips the breaker: it stays open (persisted) until
`close(who=...)`, and every later `admit` says no and counts what would have been taken
(`would_have`) and why (`causes`). `page_due()` returns the one page message of an opening, once.
`families()` is its /metrics view. A key admitted once stays admitted within the window (an apply
that failed and is retried is not counted twice). `breaker_scopes(store)` and
`close_breakers(store, cfg, who=..., now=...)` serve `gpuvigil breaker` and the API.

Everything here is pure bookkeeping: no scheduler, API or alert code. The callers
(`gpuvigil.app.acting.Acting`, the built-in scheduler's health plugin, `gpuvigil breaker`) act.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from gpuvigil.util import sqlitedb


class State(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    CORDONED = "cordoned"
    DRAINING = "draining"
    REMEDIATING = "remediating"
    VERIFYING = "verifying"
    RMA = "rma"
    OPERATOR_HELD = "operator_held"


S = State
# Moves a rule may make. An operator may move any record to operator_held or rma, and release
# one from either (to healthy); nothing else.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.HEALTHY: frozenset({S.SUSPECT, S.CORDONED, S.DRAINING, S.OPERATOR_HELD, S.RMA}),
    S.SUSPECT: frozenset({S.HEALTHY, S.CORDONED, S.DRAINING, S.OPERATOR_HELD, S.RMA}),
    S.CORDONED: frozenset({S.DRAINING, S.REMEDIATING, S.OPERATOR_HELD, S.RMA}),
    S.DRAINING: frozenset({S.REMEDIATING, S.OPERATOR_HELD, S.RMA}),
    S.REMEDIATING: frozenset({S.VERIFYING, S.CORDONED, S.DRAINING, S.OPERATOR_HELD, S.RMA}),
    S.VERIFYING: frozenset({S.HEALTHY, S.REMEDIATING, S.CORDONED, S.DRAINING, S.OPERATOR_HELD, S.RMA}),
    S.RMA: frozenset(),
    S.OPERATOR_HELD: frozenset(),
}
OPERATOR_TARGETS = frozenset({S.OPERATOR_HELD, S.RMA, S.HEALTHY})
OUT_OF_SERVICE = frozenset({S.CORDONED, S.DRAINING, S.REMEDIATING, S.VERIFYING, S.RMA, S.OPERATOR_HELD})
# States in which gpuvigil itself holds the node out, and so may return it.
OURS = frozenset({S.CORDONED, S.DRAINING, S.REMEDIATING, S.VERIFYING})


class IllegalTransition(ValueError):
    """A move the state machine does not allow (the record is left as it was)."""


def key_of(node: str, gpu: int | None = None) -> str:
    return node if gpu is None else f"{node}/{gpu}"


@dataclass
class Cause:
    """One finding that holds a record out: quiet_since is None while the finding is active."""

    finding_id: str
    kind: str
    summary: str = ""
    quiet_since: float | None = None
    hint_ids: list[str] = field(default_factory=list)


@dataclass
class Record:
    key: str
    node: str
    gpu: int | None = None
    state: State = S.HEALTHY
    since: float = 0.0
    causes: dict[str, Cause] = field(default_factory=dict)
    # What gpuvigil applied to take it out ("drain_node", "cordon_node", "avoid_gpu"), the
    # adapter's words for it, and the scheduler it went through; None while nothing is applied.
    action: str | None = None
    applied: str | None = None
    scheduler: str | None = None
    # The hint whose plan took it out (its JSON): the undo plan is built from it.
    hint: dict[str, Any] | None = None
    # Free-form state of the remediation and verification steps (rung, attempts, outputs).
    steps: dict[str, Any] = field(default_factory=dict)

    @property
    def out_of_service(self) -> bool:
        return self.state in OUT_OF_SERVICE

    @property
    def ours(self) -> bool:
        return self.state in OURS

    def quiet_for(self, now: float) -> float | None:
        """Seconds since the last of its causes went quiet; None while one is active (or none)."""
        if not self.causes or any(c.quiet_since is None for c in self.causes.values()):
            return None
        return now - max(c.quiet_since for c in self.causes.values())  # type: ignore[type-var]

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        d = dict(d)
        d["state"] = State(d["state"])
        d["causes"] = {k: Cause(**v) for k, v in (d.get("causes") or {}).items()}
        return cls(**d)


@dataclass
class Transition:
    key: str
    node: str
    gpu: int | None
    ts: float
    from_state: str
    to_state: str
    who: str  # "rule" or "operator" (with the operator's name after a colon, if given)
    rule: str  # the rule's name, e.g. "finding", "applied", "quiet", "verify_passed"
    cause: str = ""
    finding_ids: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    detail: str = ""

    def line(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.ts))
        ids = f" [{', '.join(self.finding_ids)}]" if self.finding_ids else ""
        return f"{when} {self.from_state} -> {self.to_state} by {self.who} ({self.rule}): {self.cause}{ids}" + (f"; {self.detail}" if self.detail else "")


@dataclass
class StepResult:
    status: str  # pending | passed | failed | rma
    detail: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)


class Steps(Protocol):
    """Remediation and return-to-service check of one record; see the module docstring."""

    def remediate(self, record: Record, now: float) -> StepResult: ...

    def verify(self, record: Record, now: float) -> StepResult: ...


class HoldDown:
    """The default steps: remediation is waiting until every cause has been quiet for
    `hold_down_seconds` (a link that goes quiet for one tick is not a repaired link); no check."""

    def __init__(self, hold_down_seconds: float):
        self.hold_down_seconds = hold_down_seconds

    def remediate(self, record: Record, now: float) -> StepResult:
        quiet = record.quiet_for(now)
        if quiet is None or quiet < self.hold_down_seconds:
            return StepResult("pending", f"causes quiet for {0 if quiet is None else quiet:.0f} of {self.hold_down_seconds:.0f} s")
        return StepResult("passed", f"every cause quiet for {quiet:.0f} s (hold-down {self.hold_down_seconds:.0f} s)")

    def verify(self, record: Record, now: float) -> StepResult:
        return StepResult("passed", "no return-to-service check configured")


# -- storage ----------------------------------------------------------------------------------
MIGRATIONS: list[sqlitedb.Migration] = [
    """
    CREATE TABLE records (key TEXT PRIMARY KEY, node TEXT NOT NULL, state TEXT NOT NULL, since REAL NOT NULL, data TEXT NOT NULL);
    CREATE INDEX records_node ON records(node);
    CREATE TABLE transitions (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, node TEXT NOT NULL, ts REAL NOT NULL, data TEXT NOT NULL);
    CREATE INDEX transitions_node ON transitions(node, id);
    CREATE TABLE breaker (scope TEXT PRIMARY KEY, data TEXT NOT NULL);
    CREATE TABLE breaker_taken (id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, ts REAL NOT NULL, key TEXT NOT NULL, nodes INTEGER NOT NULL, gpus INTEGER NOT NULL);
    CREATE INDEX breaker_taken_ts ON breaker_taken(scope, ts);
    CREATE TABLE breaker_log (id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, ts REAL NOT NULL, event TEXT NOT NULL, detail TEXT NOT NULL)
    """
]


class QuarantineStore:
    """The SQLite file (or ``":memory:"``) that holds records, transitions and the breaker.
    Several processes may open one file (WAL): `gpuvigil breaker close` writes while serve runs."""

    def __init__(self, path: str | Path = ":memory:"):
        self.path = str(path)
        self._lock = threading.RLock()
        self.db = sqlitedb.connect(self.path, what="quarantine state")
        sqlitedb.migrate(self.db, MIGRATIONS, what=f"quarantine state {self.path}")

    def tx(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: other processes' writers queue)."""
        return sqlitedb.transaction(self.db, self._lock)

    def read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> QuarantineStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def store_beside(hint_db: str | Path | None) -> QuarantineStore:
    """The quarantine file beside a hint store (``hints.db`` → ``hints.quarantine.db``); in
    memory without one."""
    if hint_db is None or str(hint_db) == ":memory:":
        return QuarantineStore(":memory:")
    p = Path(hint_db)
    return QuarantineStore(p.with_name(p.stem + ".quarantine.db"))


# -- the state machine ------------------------------------------------------------------------
class QuarantineMachine:
    def __init__(self, store: QuarantineStore):
        self.store = store

    def get(self, node: str, gpu: int | None = None) -> Record:
        key = key_of(node, gpu)
        rows = self.store.read("SELECT data FROM records WHERE key = ?", (key,))
        return Record.from_json(json.loads(rows[0][0])) if rows else Record(key=key, node=node, gpu=gpu)

    def records(self, states: Iterable[State] | None = None) -> list[Record]:
        if states is None:
            rows = self.store.read("SELECT data FROM records ORDER BY key")
        else:
            want = sorted({State(s).value for s in states})
            rows = self.store.read(f"SELECT data FROM records WHERE state IN ({', '.join('?' * len(want))}) ORDER BY key", tuple(want))
        return [Record.from_json(json.loads(r[0])) for r in rows]

    def save(self, record: Record) -> None:
        """Write a record's bookkeeping (causes, steps) without a state change."""
        with self.store.tx() as db:
            self._write(db, record)

    @staticmethod
    def _write(db: sqlite3.Connection, record: Record) -> None:
        db.execute(
            "INSERT INTO records(key, node, state, since, data) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(key) DO UPDATE SET state = excluded.state, since = excluded.since, data = excluded.data",
            (record.key, record.node, record.state.value, record.since, json.dumps(record.to_json_dict(), sort_keys=True)),
        )

    def transition(
        self,
        record: Record,
        to: State,
        *,
        now: float,
        rule: str,
        who: str = "rule",
        cause: str = "",
        finding_ids: Iterable[str] = (),
        evidence: dict[str, Any] | None = None,
        detail: str = "",
    ) -> Transition:
        """Move `record` to `to` (and write it, with the rest of its bookkeeping), recording why.
        Raises IllegalTransition for a move the machine does not allow."""
        if who.startswith("operator"):
            if to not in OPERATOR_TARGETS:
                raise IllegalTransition(f"an operator moves a record to {', '.join(sorted(OPERATOR_TARGETS))}, not {to.value}")
        elif to not in TRANSITIONS[record.state]:
            raise IllegalTransition(f"{record.key}: {record.state.value} -> {to.value} is not a rule's move")
        t = Transition(
            key=record.key,
            node=record.node,
            gpu=record.gpu,
            ts=now,
            from_state=record.state.value,
            to_state=to.value,
            who=who,
            rule=rule,
            cause=cause,
            finding_ids=sorted(set(finding_ids)),
            evidence=dict(evidence or {}),
            detail=detail,
        )
        record.state, record.since = to, now
        if to == S.HEALTHY:
            record.causes, record.action, record.applied, record.hint, record.steps = {}, None, None, None, {}
        with self.store.tx() as db:
            self._write(db, record)
            db.execute("INSERT INTO transitions(key, node, ts, data) VALUES (?, ?, ?, ?)", (t.key, t.node, t.ts, json.dumps(asdict(t), sort_keys=True, default=str)))
        return t

    def history(self, node: str, limit: int = 200) -> list[Transition]:
        """The node's transitions and its GPUs', oldest first (the newest `limit`)."""
        rows = self.store.read("SELECT data FROM transitions WHERE node = ? ORDER BY id DESC LIMIT ?", (node, limit))
        return [Transition(**json.loads(r[0])) for r in reversed(rows)]

    def why(self, node: str) -> dict[str, Any]:
        """`gpuvigil why NODE`: the node's (and its GPUs') records and their history."""
        rows = self.store.read("SELECT data FROM records WHERE node = ? ORDER BY key", (node,))
        records = [Record.from_json(json.loads(r[0])) for r in rows]
        return {"node": node, "records": [r.to_json_dict() for r in records], "history": [asdict(t) for t in self.history(node)]}

    # -- causes ----------------------------------------------------------------------------
    def add_cause(self, record: Record, *, finding_id: str, kind: str, summary: str, hint_id: str | None = None) -> None:
        c = record.causes.get(finding_id)
        if c is None:
            c = record.causes[finding_id] = Cause(finding_id, kind, summary)
        c.quiet_since = None
        if hint_id and hint_id not in c.hint_ids:
            c.hint_ids.append(hint_id)

    def observe(self, active_ids: set[str], quiet_ids: set[str], now: float) -> list[Record]:
        """Mark causes quiet (their hints expired) or active again (reported this tick); returns
        the records that changed. A cause that comes back cancels the hold-down."""
        changed = []
        for rec in self.records([s for s in State if s != S.HEALTHY]):
            dirty = False
            for fid, c in rec.causes.items():
                if fid in active_ids and c.quiet_since is not None:
                    c.quiet_since, dirty = None, True
                elif fid in quiet_ids and fid not in active_ids and c.quiet_since is None:
                    c.quiet_since, dirty = now, True
            if dirty:
                self.save(rec)
                changed.append(rec)
        return changed

    # -- the remediation and verification steps --------------------------------------------
    def advance(self, record: Record, steps: Steps, now: float) -> Transition | None:
        """One tick of a record gpuvigil holds out: remediating once every cause is quiet, then
        the steps; back to cordoned/draining if a cause comes back. Returns the move, if any.
        Reaching `verifying` → healthy is left to the caller (it must first undo its action
        on the scheduler: `return_to_service`)."""
        ids = list(record.causes)
        active = [c for c in record.causes.values() if c.quiet_since is None]
        if record.state in (S.CORDONED, S.DRAINING):
            if record.causes and not active:
                return self.transition(record, S.REMEDIATING, now=now, rule="causes_quiet", cause="every cause went quiet", finding_ids=ids)
            return None
        if record.state in (S.REMEDIATING, S.VERIFYING) and active:
            back = S.CORDONED if record.action == "cordon_node" else S.DRAINING
            return self.transition(record, back, now=now, rule="cause_returned", cause=f"{active[0].kind} {active[0].finding_id} reported again", finding_ids=[c.finding_id for c in active])
        if record.state == S.REMEDIATING:
            r = steps.remediate(record, now)
            if r.status == "passed":
                return self.transition(record, S.VERIFYING, now=now, rule="remediated", cause=r.detail, finding_ids=ids, evidence=r.evidence)
            if r.status == "rma":
                return self.transition(record, S.RMA, now=now, rule="rma", cause=r.detail, finding_ids=ids, evidence=r.evidence)
            if r.status == "failed":
                record.steps.setdefault("failures", []).append({"ts": now, "detail": r.detail})
                self.save(record)
            return None
        if record.state == S.VERIFYING:
            r = steps.verify(record, now)
            record.steps["verify"] = {"status": r.status, "detail": r.detail, "ts": now}
            if r.status == "failed":
                return self.transition(record, S.REMEDIATING, now=now, rule="verify_failed", cause=r.detail, finding_ids=ids, evidence=r.evidence)
            if r.status == "rma":
                return self.transition(record, S.RMA, now=now, rule="rma", cause=r.detail, finding_ids=ids, evidence=r.evidence)
            self.save(record)
        return None

    def verified(self, record: Record) -> bool:
        """The record's check passed (the caller may return it to service)."""
        return record.state == S.VERIFYING and record.steps.get("verify", {}).get("status") == "passed"


# -- the circuit breaker ----------------------------------------------------------------------
class BreakerConfig(BaseModel):
    """Limits on what gpuvigil takes out of service within a sliding window."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    window_seconds: float = Field(900.0, gt=0)
    max_node_fraction: float = Field(0.25, gt=0, le=1)
    max_gpu_fraction: float = Field(0.25, gt=0, le=1)
    max_nodes: int = Field(20, ge=1)
    max_gpus: int = Field(160, ge=1)
    # Causes named in the page (the most frequent first).
    top_causes: int = Field(3, ge=1)


@dataclass
class BreakerState:
    open: bool = False
    opened_at: float | None = None
    reason: str = ""
    would_have_nodes: int = 0
    would_have_gpus: int = 0
    would_have_keys: list[str] = field(default_factory=list)
    causes: dict[str, int] = field(default_factory=dict)
    paged: bool = False
    trips: int = 0
    closed_at: float | None = None
    closed_by: str | None = None


class Breaker:
    """See the module docstring. `scope` names one breaker per acting path in a shared file."""

    def __init__(self, store: QuarantineStore, cfg: BreakerConfig | None = None, *, scope: str = "default"):
        self.store = store
        self.cfg = cfg or BreakerConfig()
        self.scope = scope
        self.refused = 0  # admits answered no while open, in this process

    def state(self) -> BreakerState:
        rows = self.store.read("SELECT data FROM breaker WHERE scope = ?", (self.scope,))
        return BreakerState(**json.loads(rows[0][0])) if rows else BreakerState()

    def _put(self, db: sqlite3.Connection, st: BreakerState) -> None:
        db.execute(
            "INSERT INTO breaker(scope, data) VALUES (?, ?) ON CONFLICT(scope) DO UPDATE SET data = excluded.data",
            (self.scope, json.dumps(asdict(st), sort_keys=True)),
        )

    def _log(self, db: sqlite3.Connection, now: float, event: str, detail: str) -> None:
        db.execute("INSERT INTO breaker_log(scope, ts, event, detail) VALUES (?, ?, ?, ?)", (self.scope, now, event, detail))

    @property
    def is_open(self) -> bool:
        return self.cfg.enabled and self.state().open

    def taken(self, now: float) -> tuple[int, int]:
        """Nodes and GPUs taken out within the window ending now."""
        row = self.store.read(
            "SELECT COALESCE(SUM(nodes), 0), COALESCE(SUM(gpus), 0) FROM breaker_taken WHERE scope = ? AND ts > ?",
            (self.scope, now - self.cfg.window_seconds),
        )[0]
        return int(row[0]), int(row[1])

    def limits(self, fleet_nodes: int, fleet_gpus: int) -> tuple[int, int]:
        c = self.cfg
        nodes = min(c.max_nodes, max(1, math.floor(c.max_node_fraction * fleet_nodes + 1e-9)))
        gpus = min(c.max_gpus, max(1, math.floor(c.max_gpu_fraction * fleet_gpus + 1e-9)))
        return nodes, gpus

    def admit(self, key: str, *, nodes: int, gpus: int, fleet_nodes: int, fleet_gpus: int, now: float, cause: str) -> bool:
        """May `key` (`nodes` nodes and `gpus` GPUs) be taken out of service now? Yes is recorded
        in the window; no while open, or over a limit (which trips the breaker), is counted."""
        if not self.cfg.enabled:
            return True
        with self.store.tx() as db:
            st = self.state()
            again = db.execute("SELECT 1 FROM breaker_taken WHERE scope = ? AND key = ? AND ts > ?", (self.scope, key, now - self.cfg.window_seconds)).fetchone()
            if not st.open and again:
                return True  # admitted already in this window (an apply that failed is retried)
            if not st.open:
                got_nodes, got_gpus = self.taken(now)
                lim_nodes, lim_gpus = self.limits(fleet_nodes, fleet_gpus)
                first = got_nodes == 0 and got_gpus == 0
                if first or (got_nodes + nodes <= lim_nodes and got_gpus + gpus <= lim_gpus):
                    db.execute("INSERT INTO breaker_taken(scope, ts, key, nodes, gpus) VALUES (?, ?, ?, ?, ?)", (self.scope, now, key, nodes, gpus))
                    db.execute("DELETE FROM breaker_taken WHERE scope = ? AND ts <= ?", (self.scope, now - self.cfg.window_seconds))
                    return True
                st = BreakerState(
                    open=True,
                    opened_at=now,
                    reason=(
                        f"{got_nodes} node(s) and {got_gpus} GPU(s) taken out in the last {self.cfg.window_seconds:.0f} s; "
                        f"limits {lim_nodes} node(s) and {lim_gpus} GPU(s) of a fleet of {fleet_nodes} node(s), {fleet_gpus} GPU(s)"
                    ),
                    trips=st.trips + 1,
                )
                self._log(db, now, "open", st.reason)
            if key not in st.would_have_keys:
                st.would_have_keys.append(key)
                st.would_have_nodes += nodes
                st.would_have_gpus += gpus
                st.causes[cause] = st.causes.get(cause, 0) + 1
            self._put(db, st)
        self.refused += 1
        return False

    def page_due(self) -> str | None:
        """The page of the current opening, once (persisted: a restart does not page again)."""
        st = self.state()
        if not st.open or st.paged:
            return None
        with self.store.tx() as db:
            st.paged = True
            self._put(db, st)
        return self.page_text(st)

    def page_text(self, st: BreakerState | None = None) -> str:
        st = st or self.state()
        top = Counter(st.causes).most_common(self.cfg.top_causes)
        causes = ", ".join(f"{c} ({n})" for c, n in top) or "none"
        return (
            f"breaker open: {st.would_have_nodes} node(s) would have been drained ({st.would_have_gpus} GPU(s)), "
            f"top causes {causes}; {st.reason}. Acting is dry-run until a person runs `gpuvigil breaker close`."
        )

    def close(self, *, who: str, now: float, note: str = "") -> BreakerState:
        """A person closes the breaker: acting resumes, the window starts empty (what was taken
        before the trip does not count again), and what was held back while open is not
        replayed by the breaker (the callers re-evaluate live findings only)."""
        with self.store.tx() as db:
            st = self.state()
            was_open = st.open
            st = BreakerState(trips=st.trips, closed_at=now, closed_by=who)
            self._put(db, st)
            db.execute("DELETE FROM breaker_taken WHERE scope = ?", (self.scope,))
            self._log(db, now, "close" if was_open else "close (was closed)", f"by {who}" + (f": {note}" if note else ""))
        return st

    def log(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self.store.read("SELECT ts, event, detail FROM breaker_log WHERE scope = ? ORDER BY id DESC LIMIT ?", (self.scope, limit))
        return [{"ts": ts, "event": e, "detail": d} for ts, e, d in reversed(rows)]

    def status(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        st = self.state()
        nodes, gpus = self.taken(now)
        return {
            "scope": self.scope,
            "enabled": self.cfg.enabled,
            **asdict(st),
            "taken_in_window": {"nodes": nodes, "gpus": gpus, "window_seconds": self.cfg.window_seconds},
            "config": self.cfg.model_dump(),
            "log": self.log(10),
        }

    def families(self) -> list[Any]:
        from gpuvigil.exporter.metrics import Family

        st = self.state()
        now = time.time()
        nodes, gpus = self.taken(now)
        out = Family("gpuvigil_breaker_open", "gauge", "1 while the acting circuit breaker is open (acting is dry-run until a person closes it).")
        out.add(1 if (st.open and self.cfg.enabled) else 0, scope=self.scope)
        trips = Family("gpuvigil_breaker_trips", "counter", "Times the acting circuit breaker opened.")
        trips.add(st.trips, scope=self.scope)
        would = Family("gpuvigil_breaker_would_have_taken_nodes", "gauge", "Nodes the open breaker kept in service (what would have been drained).")
        would.add(st.would_have_nodes, scope=self.scope)
        taken = Family("gpuvigil_breaker_taken_nodes", "gauge", "Nodes taken out of service within the breaker's sliding window.")
        taken.add(nodes, scope=self.scope)
        taken_g = Family("gpuvigil_breaker_taken_gpus", "gauge", "GPUs taken out of service within the breaker's sliding window.")
        taken_g.add(gpus, scope=self.scope)
        return [out, trips, would, taken, taken_g]


class ActingConfig(BaseModel):
    """The `acting` config section: how gpuvigil acts on the schedulers (every acting path)."""

    model_config = ConfigDict(extra="forbid")

    # A cleared cause returns its node only after every cause of the node has been quiet this
    # long (and the return-to-service check passed): never on the first quiet tick.
    hold_down_seconds: float = Field(600.0, ge=0)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)


def acting_config(cfg: dict[str, Any] | None = None) -> ActingConfig:
    from gpuvigil import config

    cfg = config.defaults() if cfg is None else cfg
    return config.section("acting", ActingConfig, cfg)


def breaker_scopes(store: QuarantineStore) -> list[str]:
    """The breakers a file holds (one per acting path: "slurm", "kubernetes", ...)."""
    return [r[0] for r in store.read("SELECT scope FROM breaker ORDER BY scope")]


def close_breakers(store: QuarantineStore, cfg: BreakerConfig, *, who: str, now: float, note: str = "", scope: str | None = None) -> list[dict[str, Any]]:
    """Close the open breakers of a file (or the one named): what `gpuvigil breaker close` and
    `POST /v1/breaker/close` do. Returns each closed breaker's status."""
    out = []
    for name in breaker_scopes(store):
        if scope is not None and name != scope:
            continue
        b = Breaker(store, cfg, scope=name)
        if b.state().open:
            b.close(who=who, now=now, note=note)
            out.append(b.status(now))
    return out
