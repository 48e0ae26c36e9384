"""Findings → incidents: one fault, one incident, one message to on-call (plus updates).

A fault is usually seen by several detectors, one after another: a throttling GPU is first an
`anomaly` (its clock is unlike its peers'), then `thermal_throttle`, then its rank a `straggler`.
Each is a finding with its own cause key; paged one by one, on-call gets three messages for one
fault. The rule that groups them lives here, and only here:

- Findings that share a GPU (node, GPU index) or a job (a rank belongs to its job, so sharing a
  rank is sharing the job) join one incident while the incident is live: one of its findings was
  reported within the last `window_seconds` (config `pipeline.incidents`).
- The incident's first finding opens it (`incident_role` "opened").
- A later finding is an update (`incident_role` "update", a message marked as one) when it
  explains the fault better than the incident's title (a higher rank in `explains`: a known kind
  over `anomaly`; the incident is re-titled with it), when it raises the incident's severity, or
  when it is about none of the GPUs and ranks its messages were about (another GPU of the job).
  Otherwise it is evidence only (`incident_role` "evidence"): kept in the incident, never a page
  or a ticket.
- An `anomaly` about a GPU or rank that a known finding of the incident names is evidence: the
  deviation is explained, whatever the order they came in.

Findings first raised in the same tick are placed best-explained first, so a fault two detectors
see at once opens one incident titled by the known kind. Every finding carries its incident's id
(`Finding.incident`) and role for the sinks: alerts, the API store, the demo, replay.

An incident's id is a digest of its first finding and the time this tracker first saw it, so two
trackers name the same fault differently. Where one tracker takes over from another (the fleet's act
replicas: gpuvigil.fleet.act), it `adopt`s the placements the other one recorded: a finding it has
not placed yet joins the incident, under the id and role, that the earlier tracker gave it, so every
message keeps the labels it was first sent with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpuvigil.model import SEVERITY_RANK, Finding, FindingKind, Severity

OPENED = "opened"
UPDATE = "update"
EVIDENCE = "evidence"
MESSAGE_ROLES = frozenset({OPENED, UPDATE})


class IncidentsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Findings sharing a GPU, rank or job join one incident while one of its findings was reported
    # within this many seconds.
    window_seconds: float = Field(600.0, gt=0)
    # How well a finding kind explains a fault (higher: better). A finding that explains better than
    # an incident's title re-titles it. Kinds not listed rank `default`.
    explains: dict[str, int] = Field(default_factory=lambda: {"anomaly": 0, "straggler": 1, "default": 2, "xid": 3, "ecc": 3, "row_remap_failure": 3})


def _digest(*parts: object) -> str:
    return hashlib.sha1("|".join(str(p) for p in parts).encode()).hexdigest()[:16]


def _keys(f: Finding) -> set[tuple[Any, ...]]:
    """What a finding shares with others to join their incident: its GPU and its job."""
    keys: set[tuple[Any, ...]] = set()
    if f.node is not None and f.gpu is not None:
        keys.add(("gpu", f.node, f.gpu))
    if f.job:
        keys.add(("job", f.job))
    return keys


def places(f: Finding) -> set[tuple[Any, ...]]:
    """The GPUs and ranks a finding is about (its culprits when it names them); a job-level
    finding that names neither is about its job."""
    out: set[tuple[Any, ...]] = set()
    if f.node is not None and f.gpu is not None:
        out.add(("gpu", f.node, f.gpu))
    if f.job:
        out.update(("rank", f.job, r) for r in (f.culprit_ranks or f.ranks))
    if not out and f.job:
        out.add(("job", f.job))
    return out


@dataclass
class Incident:
    id: str
    opened_at: float
    last_seen: float
    title: Finding  # the finding that explains it best so far
    severity: str
    keys: set[tuple[Any, ...]] = field(default_factory=set)
    # Every finding that joined, latest report of each, in the order they joined: the evidence.
    findings: dict[str, Finding] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    messaged: set[tuple[Any, ...]] = field(default_factory=set)  # places named by its messages
    known: set[tuple[Any, ...]] = field(default_factory=set)  # places named by known kinds


@dataclass(frozen=True)
class Placement:
    """Where another tracker placed a finding: its incident (id, opening time) and its role."""

    incident: str
    role: str
    opened_at: float


class IncidentTracker:
    """Assigns each finding to an incident (see the module's docstring). Bounded: an incident is
    forgotten `window_seconds` after its findings were last reported."""

    def __init__(self, settings: IncidentsConfig | None = None):
        self.config = settings if settings is not None else IncidentsConfig()
        self.live: dict[str, Incident] = {}
        self._by_key: dict[tuple[Any, ...], str] = {}
        self._of_finding: dict[str, str] = {}  # finding id → incident id, while it is active
        # Placements adopted from an earlier tracker, for findings not placed here yet; forgotten
        # `window_seconds` after the first tick that follows their adoption.
        self.adopted: dict[str, Placement] = {}
        self._adopted_since: float | None = None

    def adopt(self, placements: dict[str, Placement]) -> None:
        """Placements an earlier tracker made (finding id → Placement): each of these findings,
        when first reported here, joins that incident with that role instead of being placed anew.
        A finding already placed here keeps its place."""
        self.adopted.update({fid: p for fid, p in placements.items() if fid not in self._of_finding and p.role in (OPENED, UPDATE, EVIDENCE)})
        self._adopted_since = None

    def rank(self, f: Finding) -> int:
        e = self.config.explains
        return e.get(f.kind.value, e.get("default", 2))

    def observe(self, findings: Iterable[Finding], now: float) -> None:
        """Give this tick's reported findings their incident and role (set on each finding).
        Findings already placed keep theirs and keep their incident live."""
        fresh: list[Finding] = []
        for f in findings:
            inc = self.live.get(self._of_finding.get(f.id, ""))
            if inc is None:
                fresh.append(f)
                continue
            f.incident, f.incident_role = inc.id, inc.roles[f.id]
            inc.findings[f.id] = f
            inc.last_seen = max(inc.last_seen, now)
        # Adopted placements first: the incidents they name take their keys before a fresh one
        # could open a second incident over the same GPU or job.
        for f in sorted(fresh, key=lambda f: (f.id not in self.adopted, -self.rank(f), -SEVERITY_RANK[f.severity])):
            self._place(f, now, self.adopted.pop(f.id, None))

    def forget(self, finding_ids: Iterable[str]) -> None:
        """Cleared findings: a later report of the same cause is placed again (it may rejoin the
        same incident, as evidence or an update)."""
        for fid in finding_ids:
            self._of_finding.pop(fid, None)
            self.adopted.pop(fid, None)

    def expire(self, now: float) -> list[Incident]:
        if self.adopted:
            if self._adopted_since is None:
                self._adopted_since = now
            elif now - self._adopted_since > self.config.window_seconds:
                self.adopted.clear()  # findings that never came back: their incidents are over
        gone = [inc for inc in self.live.values() if now - inc.last_seen > self.config.window_seconds]
        for inc in gone:
            del self.live[inc.id]
            for k in inc.keys:
                if self._by_key.get(k) == inc.id:
                    del self._by_key[k]
            for fid in inc.findings:
                if self._of_finding.get(fid) == inc.id:
                    del self._of_finding[fid]
        return gone

    def _place(self, f: Finding, now: float, adopted: Placement | None = None) -> None:
        keys = _keys(f)
        joined = [self.live[i] for i in {self._by_key[k] for k in keys if k in self._by_key} if i in self.live]
        where = places(f)
        known = f.kind != FindingKind.ANOMALY
        if adopted is not None:
            inc = self.live.get(adopted.incident)
            if inc is None:
                inc = Incident(id=adopted.incident, opened_at=adopted.opened_at, last_seen=now, title=f, severity=f.severity.value)
                self.live[inc.id] = inc
            else:
                inc.last_seen = max(inc.last_seen, now)
                if self.rank(f) > self.rank(inc.title):
                    inc.title = f
                if SEVERITY_RANK[f.severity] > SEVERITY_RANK[Severity(inc.severity)]:
                    inc.severity = f.severity.value
            role = adopted.role
        elif not joined:
            inc = Incident(id=_digest("incident", f.id, now), opened_at=now, last_seen=now, title=f, severity=f.severity.value)
            self.live[inc.id] = inc
            role = OPENED
        else:
            inc = min(joined, key=lambda i: (i.opened_at, i.id))  # a finding bridging two joins the older
            inc.last_seen = max(inc.last_seen, now)
            better = self.rank(f) > self.rank(inc.title)
            worse = SEVERITY_RANK[f.severity] > SEVERITY_RANK[Severity(inc.severity)]
            explained = not known and bool(where & inc.known)
            new_place = not (where & inc.messaged)
            role = UPDATE if not explained and (better or worse or new_place) else EVIDENCE
            if better:
                inc.title = f
            if worse and not explained:
                inc.severity = f.severity.value
        inc.keys |= keys
        for k in keys:
            self._by_key.setdefault(k, inc.id)
        if known:
            inc.known |= where
        if role in MESSAGE_ROLES:
            inc.messaged |= where
        inc.findings[f.id] = f
        inc.roles[f.id] = role
        self._of_finding[f.id] = inc.id
        f.incident, f.incident_role = inc.id, role

    def absorb(self, cause: Finding, members: Iterable[Finding]) -> None:
        """A shared component (`cause`, already placed) explains these findings: from now on they
        are evidence of its incident, whichever incident they opened before it was named."""
        inc = self.incident_of(cause.id)
        if inc is None:
            return
        for f in members:
            if f.id == cause.id:
                continue
            self._of_finding[f.id] = inc.id
            inc.findings[f.id] = f
            inc.roles[f.id] = EVIDENCE
            f.incident, f.incident_role = inc.id, EVIDENCE

    def restore(self, findings: Iterable[Finding], first_seen: dict[str, float], now: float) -> None:
        """Incidents as an earlier holder of the findings placed them (a fleet partition's previous
        owner): each restored finding keeps its incident and role, so its alerts stay one group."""
        by_incident: dict[str, list[Finding]] = {}
        for f in findings:
            if f.incident and f.incident_role:
                by_incident.setdefault(f.incident, []).append(f)
        for iid, members in by_incident.items():
            members.sort(key=lambda f: first_seen.get(f.id, now))
            title = max(members, key=self.rank)  # the first of the best-explaining kind
            inc = Incident(id=iid, opened_at=first_seen.get(members[0].id, now), last_seen=now, title=title,
                           severity=max((f.severity for f in members), key=SEVERITY_RANK.__getitem__).value)
            for f in members:
                keys, where = _keys(f), places(f)
                inc.keys |= keys
                for k in keys:
                    self._by_key.setdefault(k, iid)
                if f.kind != FindingKind.ANOMALY:
                    inc.known |= where
                if f.incident_role in MESSAGE_ROLES:
                    inc.messaged |= where
                inc.findings[f.id] = f
                inc.roles[f.id] = f.incident_role  # type: ignore[assignment]
                self._of_finding[f.id] = iid
            self.live[iid] = inc

    def incident_of(self, finding_id: str) -> Incident | None:
        return self.live.get(self._of_finding.get(finding_id, ""))


__all__ = ["EVIDENCE", "MESSAGE_ROLES", "OPENED", "UPDATE", "Incident", "IncidentTracker", "IncidentsConfig", "Placement", "places"]
