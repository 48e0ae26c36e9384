"""Push gpuvigil's own findings to Alertmanager (`POST /api/v2/alerts`) through a durable outbox.

`AlertPusher` is a pipeline sink. Each tick it writes, in one SQLite transaction, a *firing*
alert for every new finding and every active one due for a resend, and a *resolved* alert
(endsAt = now) for every finding that cleared. A delivery loop (`flush`, run by `gpuvigil serve`
on its own thread) posts what is due, oldest first, and deletes rows only after Alertmanager
accepted them. If Alertmanager is down, rows stay and delivery backs off exponentially; on
restart the outbox is replayed.

Several Alertmanagers (peers of one gossip cluster) are handled as Prometheus handles them: every
alert goes to every peer, and the cluster deduplicates the notifications. Each peer has its own
delivery state (the `delivered` table: which outbox rows it accepted) and its own backoff, and
`DeliveryLoop` runs one thread per peer, so a peer that is down or hangs neither blocks nor loses
the others' alerts; a row leaves the outbox once every configured peer accepted it.

Nothing is lost: an alert Alertmanager rejects (HTTP 400) goes to a dead-letter table with the
reason instead of being dropped.

Firing alerts carry endsAt = now + end_after_seconds and are re-sent every resend_seconds, so an
alert whose finding vanished with a crashed gpuvigil resolves by itself instead of paging forever.
The resends come from the delivery thread's own timer (`resend_due`), not from pipeline ticks: a
tick that runs late (a starved CPU, a slow collector) must not let a firing alert's endsAt lapse,
or Alertmanager resolves it and the next tick pages it a second time. The timer only re-sends what
a tick of this process saw active within `KEEP_FIRING_TICKS_LATE` × end_after_seconds, so a
pipeline that stopped ticking lets its alerts resolve. endsAt is also re-stamped when a firing
alert is delivered, so an alert that waited out an Alertmanager outage does not arrive ended.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import polars as pl

from gpuvigil import kinds
from gpuvigil.util import sqlitedb
from gpuvigil.util.backoff import backoff_seconds
from gpuvigil.alerts.settings import HARDWARE_KINDS, AlertSettings
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, FindingKind

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('firing', 'resolved')),
    alert_json TEXT NOT NULL,
    enqueued_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS outbox_fp ON outbox (fingerprint, status);
CREATE TABLE IF NOT EXISTS sent (
    fingerprint TEXT PRIMARY KEY,
    starts_at REAL NOT NULL,
    last_enqueued_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS dead_letter (
    id INTEGER PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    alert_json TEXT NOT NULL,
    error TEXT NOT NULL,
    failed_at REAL NOT NULL
);
"""

# Migrations by PRAGMA user_version (gpuvigil.util.sqlitedb); version 1 is the schema above, which
# files written before user_version was used already have (CREATE IF NOT EXISTS adopts them).
# Version 2: per-peer delivery (several Alertmanagers). A row of `outbox` is due for a peer until
# `delivered` holds (its id, that peer); ids are AUTOINCREMENT, so never reused by a later row.
PEERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS delivered (
    outbox_id INTEGER NOT NULL,
    peer TEXT NOT NULL,
    PRIMARY KEY (outbox_id, peer)
) WITHOUT ROWID;
"""
# Version 3: `sent` keeps the last firing alert (for the timer's resends) and when a tick last saw
# its finding active.
RESEND_SCHEMA = "ALTER TABLE sent ADD COLUMN confirmed_at REAL; ALTER TABLE sent ADD COLUMN alert_json TEXT"
MIGRATIONS: list[sqlitedb.Migration] = [SCHEMA, PEERS_SCHEMA, RESEND_SCHEMA]
# The delivery thread keeps re-sending a firing alert while the last tick that saw its finding is
# at most this many end_after_seconds old (3 × 300 s by default): late ticks do not end alerts, a
# pipeline that has stopped does (and its PipelineStalled alert fires after minutes).
KEEP_FIRING_TICKS_LATE = 3.0


def is_message(f: Finding) -> bool:
    """Whether a finding is a message to on-call: it opened its incident or updates it. Evidence
    only (an explained anomaly, a symptom of an incident's known cause) is never pushed."""
    return f.incident_role != "evidence"


def team_of(f: Finding, tenant: str | None, s: AlertSettings) -> str:
    """The team a finding's alert goes to, by its kind's owner (gpuvigil/kinds.py): hardware and
    job-less findings to the hardware team, gpuvigil's own plumbing to the default team, the rest
    to the team of the job's tenant. A device finding that is the user's fault (an application
    XID under that job only) goes to the job's tenant: its owner fixes it."""
    owner = kinds.policy(f.kind).owner
    if owner == "platform":
        return s.default_team
    hardware = (owner == "hardware" and f.evidence.get("fault") != "user") or not f.job
    return s.hardware_team if hardware else s.team_of_tenant(tenant)


def incident_teams(findings: Sequence[Finding], tenants: dict[str, str], s: AlertSettings, known: dict[str, str] | None = None) -> dict[str, str]:
    """Incident → the team its alerts go to: the team of the finding that opened it (from `known`
    when the opener is no longer among `findings`), so that its updates land in the same
    notification group as its first message."""
    teams: dict[str, str] = {}
    for f in findings:
        if f.incident and f.incident_role == "opened":
            teams[f.incident] = team_of(f, tenants.get(f.job or "", ""), s)
    for f in findings:
        if f.incident and f.incident not in teams:
            teams[f.incident] = (known or {}).get(f.incident) or team_of(f, tenants.get(f.job or "", ""), s)
    return teams


def alert_name(kind: str) -> str:
    """`oom_predicted` → `GpuvigilOomPredicted`."""
    return "Gpuvigil" + "".join(part.capitalize() for part in kind.split("_"))


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def peer_urls(alertmanagers: str | Sequence[str]) -> list[str]:
    """Base URLs of the Alertmanager peers, normalised (no trailing slash), in order, once each."""
    urls = [alertmanagers] if isinstance(alertmanagers, str) else list(alertmanagers)
    out: list[str] = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"Alertmanager {url!r}: expected an http(s):// URL")
        base = url.rstrip("/")
        if base not in out:
            out.append(base)
    if not out:
        raise UserError("no Alertmanager URL given")
    return out


@dataclass(eq=False)
class Peer:
    """One Alertmanager of the cluster and its own delivery state."""

    base: str  # the key in the `delivered` table
    url: str  # its POST /api/v2/alerts endpoint
    http: httpx.Client
    next_attempt: float = 0.0
    failures_in_a_row: int = 0
    delivered_total: int = 0
    failures_total: int = 0


class AlertPusher:
    """Pipeline sink: findings → Alertmanager alerts, through a SQLite outbox.

    `alertmanagers` is one base URL or a list of them (the peers of one Alertmanager cluster)."""

    def __init__(
        self,
        alertmanagers: str | Sequence[str],
        outbox_path: str | Path,
        settings: AlertSettings,
        *,
        clock: Callable[[], float] = time.time,
        timeout_seconds: float = 5.0,
    ):
        self.peers = [
            Peer(base, base + "/api/v2/alerts", httpx.Client(timeout=timeout_seconds)) for base in peer_urls(alertmanagers)
        ]
        self.url = self.peers[0].url
        self.settings = settings
        self.clock = clock
        self.path = Path(outbox_path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlitedb.connect(self.path, what="alert outbox", synchronous="FULL")
            sqlitedb.migrate(self.db, MIGRATIONS, what=f"alert outbox {self.path}")
        except OSError as exc:
            raise UserError(f"alert outbox {self.path}: cannot create its folder: {exc.strerror or exc}") from exc
        except sqlite3.Error as exc:
            raise UserError(f"alert outbox {self.path}: not a usable SQLite file: {exc}") from exc
        self._lock = threading.Lock()
        self.enqueued_total = 0
        self.write_failures_total = 0
        self.timer_resends_total = 0
        self._resend_failing = False
        self._incident_team: dict[str, str] = {}
        self._adopted_teams: dict[str, str] = {}  # incident → team, as an earlier pusher sent it
        self._adopted_starts: dict[str, float] = {}  # finding id → startsAt of its first alert, wherever it was sent
        # The timer re-sends only findings a tick of this process confirmed: after a restart, the
        # alerts of findings the new pipeline does not see again resolve by their endsAt.
        self._started = self.clock()
        # Rows every current peer already accepted (a peer was removed from the config) are done.
        with sqlitedb.transaction(self.db, self._lock):
            self._drop_done(None)

    @property
    def delivered_total(self) -> int:
        """Alerts accepted, summed over peers (an alert two peers accepted counts twice)."""
        return sum(p.delivered_total for p in self.peers)

    @property
    def delivery_failures_total(self) -> int:
        return sum(p.failures_total for p in self.peers)

    # -- enqueue (pipeline thread) -----------------------------------------------------------
    def on_tick(self, result: Any, window: Any) -> None:
        """Enqueue this tick's alerts. A write that fails (disk full, I/O error) is logged and
        counted, never raised into the pipeline: every active finding not yet in `sent` is
        enqueued again by the next tick that can write, so no page is lost to a full disk."""
        try:
            self._enqueue_tick(result, window)
        except sqlite3.Error as exc:
            self.write_failures_total += 1
            log.warning("alert outbox %s: cannot write this tick's alerts (%s); the next tick retries", self.path, exc)

    def adopt_incident_teams(self, teams: dict[str, str]) -> None:
        """The teams another pusher (an earlier act leader) gave incidents: an incident whose
        opening finding this one never sees active keeps its team, so its later alerts carry the
        labels the first ones were sent with."""
        self._adopted_teams.update(teams)

    def adopt_starts(self, starts: dict[str, float]) -> None:
        """The start of each finding's first alert as the fleet recorded it (fleet/act.py ledger):
        an alert this pusher sends for the first time keeps that startsAt, so a new act leader
        continues the alert instead of restarting its clock. Replaces what was adopted before."""
        self._adopted_starts = dict(starts)

    def incident_teams(self, result: Any, window: Any) -> dict[str, str]:
        """Incident → team for this tick's active findings (the `team` label of their alerts)."""
        known = {**self._incident_team, **self._adopted_teams}  # an adopted team is the one its first message went to
        self._incident_team = incident_teams(result.active_findings, self._tenants(window), self.settings, known)
        return self._incident_team

    def _enqueue_tick(self, result: Any, window: Any) -> None:
        tenants = self._tenants(window)
        pushed = set(self.settings.push_severities)
        teams = self.incident_teams(result, window)
        now = self.clock()
        with sqlitedb.transaction(self.db, self._lock):
            cur = self.db.cursor()
            for finding in result.active_findings:
                if finding.severity.value not in pushed or not is_message(finding):
                    continue
                row = cur.execute("SELECT starts_at, last_enqueued_at, alert_json FROM sent WHERE fingerprint = ?", (finding.id,)).fetchone()
                # Alertmanager knows an alert by its labels. One incident keeps the labels it was
                # first sent with: a job-level finding whose node or GPU label changes, or a
                # hardware finding whose GPU got another job, must not become a second alert
                # (a second page). Only a severity change (escalation) starts a new incident.
                sent_labels = json.loads(row[2])["labels"] if row is not None and row[2] else None
                first_start = self._adopted_starts.get(finding.id, now) if row is None else None
                if sent_labels is not None and sent_labels.get("severity") != finding.severity.value:
                    old = self.alert_for(finding, tenants, starts_at=row[0], ends_at=now)
                    old["labels"] = sent_labels
                    self._enqueue(cur, finding.id, "resolved", old, now)
                    row = sent_labels = None
                if row is not None and now - row[1] < self.settings.resend_seconds:
                    cur.execute("UPDATE sent SET confirmed_at = ? WHERE fingerprint = ?", (now, finding.id))
                    continue
                # A new alert starts now; one an earlier leader sent keeps its start. An escalation
                # (the old alert resolved above) is a new alert.
                starts_at = row[0] if row is not None else (first_start if first_start is not None else now)
                alert = self.alert_for(finding, tenants, starts_at=starts_at, ends_at=now + self.settings.end_after_seconds, incident_team=teams.get(finding.incident or ""))
                if sent_labels is not None:
                    alert["labels"] = sent_labels
                self._enqueue(cur, finding.id, "firing", alert, now)
                cur.execute(
                    "INSERT INTO sent (fingerprint, starts_at, last_enqueued_at, confirmed_at, alert_json) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (fingerprint) DO UPDATE SET starts_at = excluded.starts_at, last_enqueued_at = excluded.last_enqueued_at, "
                    "confirmed_at = excluded.confirmed_at, alert_json = excluded.alert_json",
                    (finding.id, starts_at, now, now, json.dumps(alert, sort_keys=True)),
                )
            for finding in result.cleared_findings:
                row = cur.execute("SELECT starts_at, alert_json FROM sent WHERE fingerprint = ?", (finding.id,)).fetchone()
                if row is None:
                    continue
                alert = self.alert_for(finding, tenants, starts_at=row[0], ends_at=now)
                if row[1]:
                    alert["labels"] = json.loads(row[1])["labels"]  # resolve the alert that was sent
                self._enqueue(cur, finding.id, "resolved", alert, now)
                cur.execute("DELETE FROM sent WHERE fingerprint = ?", (finding.id,))

    def page(self, text: str, firing: bool = True, *, name: str = "breaker_open") -> None:
        """An alert about gpuvigil's own acting (the circuit breaker), through the same outbox
        and delivery as findings: firing until `page(..., firing=False)` resolves it. It pages
        the platform team; endsAt lies far ahead, since only a person ends it."""
        now = self.clock()
        fingerprint = f"gpuvigil:{name}"
        labels = {"alertname": f"Gpuvigil{''.join(p.capitalize() for p in name.split('_'))}", "severity": "page", "kind": name,
                  "team": self.settings.default_team, "scope": "cluster", "origin": "acting", "incident": fingerprint}
        # Kept out of `sent` (the findings' resend timer would give it a near endsAt): one row,
        # delivered with the outbox's retries; Alertmanager repeats the notification while firing.
        alert = {
            "labels": labels,
            "annotations": {"summary": text, "runbook": self.settings.runbook(name.replace("_", "-"))},
            "startsAt": _rfc3339(now),
            "endsAt": _rfc3339(now + 30 * 86400 if firing else now),
        }
        with sqlitedb.transaction(self.db, self._lock):
            self._enqueue(self.db.cursor(), fingerprint, "firing" if firing else "resolved", alert, now)

    def _enqueue(self, cur: sqlite3.Cursor, fingerprint: str, status: str, alert: dict[str, Any], now: float) -> None:
        if status == "firing":
            # A newer firing state supersedes undelivered firing rows queued after the last
            # undelivered resolve of the same alert; the resolve itself is never dropped.
            cur.execute(
                "DELETE FROM outbox WHERE fingerprint = ? AND status = 'firing' AND id > "
                "COALESCE((SELECT MAX(id) FROM outbox WHERE fingerprint = ? AND status = 'resolved'), 0)",
                (fingerprint, fingerprint),
            )
        cur.execute(
            "INSERT INTO outbox (fingerprint, status, alert_json, enqueued_at) VALUES (?, ?, ?, ?)",
            (fingerprint, status, json.dumps(alert, sort_keys=True), now),
        )
        self.enqueued_total += 1

    @staticmethod
    def _tenants(window: Any) -> dict[str, str]:
        jobs = window.get("jobs") if window is not None else None
        if jobs is None or jobs.height == 0 or "tenant" not in jobs.columns:
            return {}
        pairs = jobs.select(pl.col("job"), pl.col("tenant").fill_null("")).unique("job")
        return dict(zip(pairs["job"].to_list(), pairs["tenant"].to_list(), strict=True))

    def alert_for(self, f: Finding, tenants: dict[str, str], *, starts_at: float, ends_at: float, incident_team: str | None = None) -> dict[str, Any]:
        s = self.settings
        kind = f.kind.value
        tenant = tenants.get(f.job or "", "")
        hardware = kind in HARDWARE_KINDS
        team = team_of(f, tenant, s)
        if incident_team is not None and f.kind != FindingKind.COLLECTOR_DOWN:
            team = incident_team
        labels = {
            "alertname": alert_name(kind),
            "severity": f.severity.value,
            "kind": kind,
            "job": f.job or "",
            "node": f.node or "",
            "gpu": "" if f.gpu is None else str(f.gpu),
            "team": team,
            "tenant": tenant,
            "scope": "node" if hardware else "job",
            "origin": "finding",
        }
        if kind in s.fatal_hardware_kinds and f.severity.value == "page":
            labels["hardware"] = "fatal"
        if f.kind == FindingKind.XID and f.xid is not None:
            labels["xid"] = str(f.xid)
        # The incident's alerts share a notification group (alertmanager.yml groups findings by
        # `incident`) and its owner: the team of the finding that opened it. A finding no pipeline
        # placed is an incident of its own, never grouped with every other such finding.
        labels["incident"] = f.incident or f.id
        if f.incident_role == "update":
            labels["update"] = "true"
        if f.kind == FindingKind.COLLECTOR_DOWN:
            # gpuvigil's own plumbing: the platform team's, one alert per collector target.
            labels.update(team=s.default_team, scope="cluster", collector=str(f.evidence.get("collector") or ""), target=str(f.evidence.get("target") or ""))
        labels = {k: v for k, v in labels.items() if v != ""}
        return {
            "labels": labels,
            "annotations": {
                "summary": f.summary,
                "evidence": json.dumps(f.evidence, sort_keys=True),
                "runbook": s.runbook(kinds.runbook_anchor(kind)),
                "finding_id": f.id,
            },
            "startsAt": _rfc3339(starts_at),
            "endsAt": _rfc3339(ends_at),
        }

    # -- delivery (its own thread) ----------------------------------------------------------
    def resend_due(self) -> int:
        """Re-enqueue every firing alert due for a resend (resend_seconds since the last one)
        whose finding a tick of this process saw active lately, with endsAt = now +
        end_after_seconds. Run by the delivery threads on their own timer, so an alert stays
        firing in Alertmanager however late the ticks run. Returns how many it re-enqueued."""
        s = self.settings
        now = self.clock()
        try:
            with sqlitedb.transaction(self.db, self._lock):
                cur = self.db.cursor()
                rows = cur.execute(
                    "SELECT fingerprint, alert_json FROM sent WHERE alert_json IS NOT NULL AND last_enqueued_at <= ? "
                    "AND confirmed_at >= ? AND confirmed_at >= ?",
                    (now - s.resend_seconds, now - KEEP_FIRING_TICKS_LATE * s.end_after_seconds, self._started),
                ).fetchall()
                for fingerprint, alert_json in rows:
                    alert = json.loads(alert_json)
                    alert["endsAt"] = _rfc3339(now + s.end_after_seconds)
                    self._enqueue(cur, fingerprint, "firing", alert, now)
                    cur.execute("UPDATE sent SET last_enqueued_at = ? WHERE fingerprint = ?", (now, fingerprint))
        except sqlite3.Error as exc:
            self.write_failures_total += 1
            if not self._resend_failing:  # once per outage, not every 0.5 s
                log.warning("alert outbox %s: cannot re-send firing alerts (%s); the timer keeps retrying", self.path, exc)
            self._resend_failing = True
            return 0
        if self._resend_failing:
            log.info("alert outbox %s: firing alerts are re-sent again", self.path)
        self._resend_failing = False
        self.timer_resends_total += len(rows)
        return len(rows)

    def _fresh(self, alert_json: str, status: str, now: float) -> dict[str, Any]:
        """The alert to post: a firing one ends no sooner than now + end_after_seconds. A row
        that waited in the outbox (Alertmanager down) would otherwise arrive already ended, be
        resolved, and page again with the next resend. A resolve keeps its endsAt."""
        alert = json.loads(alert_json)
        if status == "firing":
            alert["endsAt"] = max(alert.get("endsAt", ""), _rfc3339(now + self.settings.end_after_seconds))
        return alert

    def pending(self) -> int:
        with self._lock:
            return int(self.db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

    def dead_letters(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(r[0], r[1]) for r in self.db.execute("SELECT alert_json, error FROM dead_letter ORDER BY id")]

    def flush(self, *, force: bool = False, batch: int = 200) -> int:
        """Deliver due alerts to every peer, oldest first. Returns how many the peers accepted
        (summed over peers).

        Honors each peer's backoff unless `force`. Never raises for delivery problems: they are
        counted and retried later."""
        return sum(self.flush_peer(peer, force=force, batch=batch) for peer in self.peers)

    def flush_peer(self, peer: Peer, *, force: bool = False, batch: int = 200) -> int:
        """Deliver to one peer what it has not accepted yet, oldest first."""
        now = self.clock()
        if not force and now < peer.next_attempt:
            return 0
        delivered = 0
        while True:
            with self._lock:
                rows = self.db.execute(
                    "SELECT id, fingerprint, alert_json, status FROM outbox WHERE NOT EXISTS "
                    "(SELECT 1 FROM delivered d WHERE d.outbox_id = outbox.id AND d.peer = ?) ORDER BY id LIMIT ?",
                    (peer.base, batch),
                ).fetchall()
            if not rows:
                break
            status, error = self._post(peer, [self._fresh(r[2], r[3], now) for r in rows])
            if status == 200:
                self._delivered(peer, [r[0] for r in rows])
                delivered += len(rows)
                continue
            if status == 400:
                # One bad alert must not block the rest: retry one by one, park the rejects.
                for row in rows:
                    one_status, one_error = self._post(peer, [self._fresh(row[2], row[3], now)])
                    if one_status == 200:
                        self._delivered(peer, [row[0]])
                        delivered += 1
                    elif one_status == 400:
                        self._dead_letter(peer, row, one_error)
                    else:
                        self._backoff(peer, rows, one_error)
                        return self._account(peer, delivered)
                continue
            self._backoff(peer, rows, error)
            return self._account(peer, delivered)
        peer.failures_in_a_row = 0
        peer.next_attempt = 0.0
        return self._account(peer, delivered)

    def _account(self, peer: Peer, delivered: int) -> int:
        peer.delivered_total += delivered
        return delivered

    def _post(self, peer: Peer, alerts: list[dict[str, Any]]) -> tuple[int, str]:
        try:
            resp = peer.http.post(peer.url, json=alerts)
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}: {exc}"
        if resp.status_code == 200:
            return 200, ""
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
            return 400, f"HTTP {resp.status_code}: {resp.text[:300]}"
        return resp.status_code, f"HTTP {resp.status_code}: {resp.text[:300]}"

    def _delivered(self, peer: Peer, ids: list[int]) -> None:
        with sqlitedb.transaction(self.db, self._lock):
            self.db.executemany("INSERT OR IGNORE INTO delivered (outbox_id, peer) VALUES (?, ?)", [(i, peer.base) for i in ids])
            self._drop_done(ids)

    def _drop_done(self, ids: list[int] | None) -> None:
        """Delete the outbox rows (of `ids`, or all) that every configured peer accepted, and the
        delivery marks of rows no longer in the outbox (done, or superseded by a newer firing row).
        Call inside a transaction."""
        bases = [p.base for p in self.peers]
        marks = ",".join("?" * len(bases))
        done = f"(SELECT COUNT(*) FROM delivered d WHERE d.outbox_id = outbox.id AND d.peer IN ({marks})) = ?"
        if ids is None:
            self.db.execute(f"DELETE FROM outbox WHERE {done}", (*bases, len(bases)))
        else:
            self.db.executemany(f"DELETE FROM outbox WHERE id = ? AND {done}", [(i, *bases, len(bases)) for i in ids])
        self.db.execute("DELETE FROM delivered WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE outbox.id = delivered.outbox_id)")

    def _dead_letter(self, peer: Peer, row: tuple, error: str) -> None:
        log.error("Alertmanager %s rejected alert %s: %s", peer.base, row[1], error)
        with sqlitedb.transaction(self.db, self._lock):
            # Peers run the same Alertmanager, so they reject the same alert: one dead letter.
            self.db.execute(
                "INSERT OR IGNORE INTO dead_letter (id, fingerprint, alert_json, error, failed_at) VALUES (?, ?, ?, ?, ?)",
                (row[0], row[1], row[2], error, self.clock()),
            )
            self.db.execute("INSERT OR IGNORE INTO delivered (outbox_id, peer) VALUES (?, ?)", (row[0], peer.base))
            self._drop_done([row[0]])

    def _backoff(self, peer: Peer, rows: list[tuple], error: str) -> None:
        peer.failures_total += 1
        peer.failures_in_a_row += 1
        s = self.settings
        delay = backoff_seconds(peer.failures_in_a_row, s.retry_min_seconds, s.retry_max_seconds)  # jittered: replicas do not retry in lockstep
        peer.next_attempt = self.clock() + delay
        with self._lock:
            self.db.executemany("UPDATE outbox SET attempts = attempts + 1 WHERE id = ?", [(r[0],) for r in rows])
        log.warning("Alertmanager %s: delivery failed (%s); %d alert(s) kept in the outbox for it, retry in %.0fs", peer.base, error, len(rows), delay)

    def pending_for(self, peer: Peer) -> int:
        """Alerts in the outbox this peer has not accepted yet."""
        with self._lock:
            return int(self.db.execute(
                "SELECT COUNT(*) FROM outbox WHERE NOT EXISTS (SELECT 1 FROM delivered d WHERE d.outbox_id = outbox.id AND d.peer = ?)",
                (peer.base,),
            ).fetchone()[0])

    @property
    def backoff_seconds(self) -> float:
        """Seconds until every peer that is backing off is tried again (0: none is)."""
        return max(0.0, max(p.next_attempt for p in self.peers) - self.clock())

    def close(self) -> None:
        for peer in self.peers:
            peer.http.close()
        with self._lock:
            self.db.close()


class DeliveryLoop:
    """Runs `pusher.flush_peer(peer)` every `interval` seconds until stopped, on one daemon thread
    per Alertmanager peer: a peer that hangs until its timeout never delays the others."""

    def __init__(self, pusher: AlertPusher, interval: float = 0.5):
        self.pusher = pusher
        self.interval = interval
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(peer,), name=f"alert-delivery-{i}", daemon=True) for i, peer in enumerate(pusher.peers)
        ]

    def start(self) -> DeliveryLoop:
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, peer: Peer) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.pusher.resend_due()
                self.pusher.flush_peer(peer)
            except sqlite3.Error:
                log.exception("alert outbox error")

    def stop(self, final_flush: bool = True) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        if final_flush:
            self.pusher.flush(force=True)


def pusher_families(pusher: AlertPusher) -> list:
    """Self-metrics of the pusher, for the exporters (`Snapshot(extra=...)`)."""
    from gpuvigil.exporter.metrics import Family

    pending = Family("gpuvigil_alert_outbox_pending", "gauge", "Alerts waiting in the outbox for Alertmanager.")
    pending.add(pusher.pending())
    delivered = Family("gpuvigil_alerts_delivered", "counter", "Alerts Alertmanager accepted.")
    delivered.add(pusher.delivered_total)
    failures = Family("gpuvigil_alert_delivery_failures", "counter", "Failed delivery attempts (Alertmanager down or erroring).")
    failures.add(pusher.delivery_failures_total)
    with pusher._lock:
        dead = int(pusher.db.execute("SELECT COUNT(*) FROM dead_letter").fetchone()[0])
    rejected = Family("gpuvigil_alert_dead_letters", "gauge", "Alerts Alertmanager rejected as invalid (kept in the outbox's dead_letter table).")
    rejected.add(dead)
    per_peer = Family("gpuvigil_alert_peer_pending", "gauge", "Alerts in the outbox one Alertmanager peer has not accepted yet.")
    for peer in pusher.peers:
        per_peer.add(pusher.pending_for(peer), alertmanager=peer.base)
    return [pending, delivered, failures, rejected, per_peer]
