"""Push gpuvigil's own findings to Alertmanager (`POST /api/v2/alerts`) through a durable outbox.

`AlertPusher` is a pipeline sink. Each tick it writes, in one SQLite transaction, a *firing*
alert for every new finding and every active one due for a resend, and a *resolved* alert
(endsAt = now) for every finding that cleared. A delivery loop (`flush`, run by `gpuvigil serve`
on its own thread) posts what is due, oldest first, and deletes rows only after Alertmanager
accepted them. If Alertmanager is down, rows stay and delivery backs off exponentially; on
restart the outbox is replayed. Nothing is lost: an alert Alertmanager rejects (HTTP 400) goes to
a dead-letter table with the reason instead of being dropped.

Firing alerts carry endsAt = now + end_after_seconds and are re-sent every resend_seconds, so an
alert whose finding vanished with a crashed gpuvigil resolves by itself instead of paging forever.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import polars as pl

from gpuvigil import sqlitedb
from gpuvigil.backoff import backoff_seconds
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

# Migrations by PRAGMA user_version (gpuvigil.sqlitedb); version 1 is the schema above, which
# files written before user_version was used already have (CREATE IF NOT EXISTS adopts them).
MIGRATIONS: list[sqlitedb.Migration] = [SCHEMA]


def alert_name(kind: str) -> str:
    """`oom_predicted` → `GpuvigilOomPredicted`."""
    return "Gpuvigil" + "".join(part.capitalize() for part in kind.split("_"))


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class AlertPusher:
    """Pipeline sink: findings → Alertmanager alerts, through a SQLite outbox."""

    def __init__(
        self,
        alertmanager_url: str,
        outbox_path: str | Path,
        settings: AlertSettings,
        *,
        clock: Callable[[], float] = time.time,
        timeout_seconds: float = 5.0,
    ):
        self.url = alertmanager_url.rstrip("/") + "/api/v2/alerts"
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
        self._http = httpx.Client(timeout=timeout_seconds)
        self._next_attempt = 0.0
        self._failures_in_a_row = 0
        self.delivered_total = 0
        self.delivery_failures_total = 0
        self.enqueued_total = 0
        self.write_failures_total = 0

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

    def _enqueue_tick(self, result: Any, window: Any) -> None:
        tenants = self._tenants(window)
        pushed = set(self.settings.push_severities)
        now = self.clock()
        with sqlitedb.transaction(self.db, self._lock):
            cur = self.db.cursor()
            for finding in result.active_findings:
                if finding.severity.value not in pushed:
                    continue
                row = cur.execute("SELECT starts_at, last_enqueued_at FROM sent WHERE fingerprint = ?", (finding.id,)).fetchone()
                if row is not None and now - row[1] < self.settings.resend_seconds:
                    continue
                starts_at = row[0] if row is not None else now
                alert = self.alert_for(finding, tenants, starts_at=starts_at, ends_at=now + self.settings.end_after_seconds)
                self._enqueue(cur, finding.id, "firing", alert, now)
                cur.execute(
                    "INSERT INTO sent (fingerprint, starts_at, last_enqueued_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (fingerprint) DO UPDATE SET last_enqueued_at = excluded.last_enqueued_at",
                    (finding.id, starts_at, now),
                )
            for finding in result.cleared_findings:
                row = cur.execute("SELECT starts_at FROM sent WHERE fingerprint = ?", (finding.id,)).fetchone()
                if row is None:
                    continue
                alert = self.alert_for(finding, tenants, starts_at=row[0], ends_at=now)
                self._enqueue(cur, finding.id, "resolved", alert, now)
                cur.execute("DELETE FROM sent WHERE fingerprint = ?", (finding.id,))

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

    def alert_for(self, f: Finding, tenants: dict[str, str], *, starts_at: float, ends_at: float) -> dict[str, Any]:
        s = self.settings
        kind = f.kind.value
        tenant = tenants.get(f.job or "", "")
        hardware = kind in HARDWARE_KINDS
        team = s.hardware_team if hardware or not f.job else s.team_of_tenant(tenant)
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
        if f.kind == FindingKind.COLLECTOR_DOWN:
            # gpuvigil's own plumbing: the platform team's, one alert per collector target.
            labels.update(team=s.default_team, scope="cluster", collector=str(f.evidence.get("collector") or ""), target=str(f.evidence.get("target") or ""))
        labels = {k: v for k, v in labels.items() if v != ""}
        return {
            "labels": labels,
            "annotations": {
                "summary": f.summary,
                "evidence": json.dumps(f.evidence, sort_keys=True),
                "runbook": s.runbook(f"finding-{kind.replace('_', '-')}"),
                "finding_id": f.id,
            },
            "startsAt": _rfc3339(starts_at),
            "endsAt": _rfc3339(ends_at),
        }

    # -- delivery (its own thread) ----------------------------------------------------------
    def pending(self) -> int:
        with self._lock:
            return int(self.db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

    def dead_letters(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(r[0], r[1]) for r in self.db.execute("SELECT alert_json, error FROM dead_letter ORDER BY id")]

    def flush(self, *, force: bool = False, batch: int = 200) -> int:
        """Deliver due alerts, oldest first. Returns how many Alertmanager accepted.

        Honors the backoff unless `force`. Never raises for delivery problems: they are counted
        and retried later."""
        now = self.clock()
        if not force and now < self._next_attempt:
            return 0
        delivered = 0
        while True:
            with self._lock:
                rows = self.db.execute("SELECT id, fingerprint, alert_json FROM outbox ORDER BY id LIMIT ?", (batch,)).fetchall()
            if not rows:
                break
            status, error = self._post([json.loads(r[2]) for r in rows])
            if status == 200:
                self._delete([r[0] for r in rows])
                delivered += len(rows)
                continue
            if status == 400:
                # One bad alert must not block the rest: retry one by one, park the rejects.
                for row in rows:
                    one_status, one_error = self._post([json.loads(row[2])])
                    if one_status == 200:
                        self._delete([row[0]])
                        delivered += 1
                    elif one_status == 400:
                        self._dead_letter(row, one_error)
                    else:
                        self._backoff(rows, one_error)
                        return self._account(delivered)
                continue
            self._backoff(rows, error)
            return self._account(delivered)
        self._failures_in_a_row = 0
        self._next_attempt = 0.0
        return self._account(delivered)

    def _account(self, delivered: int) -> int:
        self.delivered_total += delivered
        return delivered

    def _post(self, alerts: list[dict[str, Any]]) -> tuple[int, str]:
        try:
            resp = self._http.post(self.url, json=alerts)
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}: {exc}"
        if resp.status_code == 200:
            return 200, ""
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
            return 400, f"HTTP {resp.status_code}: {resp.text[:300]}"
        return resp.status_code, f"HTTP {resp.status_code}: {resp.text[:300]}"

    def _delete(self, ids: list[int]) -> None:
        with self._lock:
            self.db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])

    def _dead_letter(self, row: tuple, error: str) -> None:
        log.error("Alertmanager rejected alert %s: %s", row[1], error)
        with sqlitedb.transaction(self.db, self._lock):
            self.db.execute(
                "INSERT INTO dead_letter (id, fingerprint, alert_json, error, failed_at) VALUES (?, ?, ?, ?, ?)",
                (row[0], row[1], row[2], error, self.clock()),
            )
            self.db.execute("DELETE FROM outbox WHERE id = ?", (row[0],))

    def _backoff(self, rows: list[tuple], error: str) -> None:
        self.delivery_failures_total += 1
        self._failures_in_a_row += 1
        s = self.settings
        delay = backoff_seconds(self._failures_in_a_row, s.retry_min_seconds, s.retry_max_seconds)  # jittered: replicas do not retry in lockstep
        self._next_attempt = self.clock() + delay
        with self._lock:
            self.db.executemany("UPDATE outbox SET attempts = attempts + 1 WHERE id = ?", [(r[0],) for r in rows])
        log.warning("Alertmanager delivery failed (%s); %d alert(s) kept in the outbox, retry in %.0fs", error, len(rows), delay)

    @property
    def backoff_seconds(self) -> float:
        return max(0.0, self._next_attempt - self.clock())

    def close(self) -> None:
        self._http.close()
        with self._lock:
            self.db.close()


class DeliveryLoop:
    """Runs `pusher.flush()` every `interval` seconds on a daemon thread until stopped."""

    def __init__(self, pusher: AlertPusher, interval: float = 0.5):
        self.pusher = pusher
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alert-delivery", daemon=True)

    def start(self) -> DeliveryLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.pusher.flush()
            except sqlite3.Error:
                log.exception("alert outbox error")

    def stop(self, final_flush: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
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
    return [pending, delivered, failures, rejected]
