"""Typed findings and hints: what detectors conclude and what a scheduler should do about it.

Both have a JSON form (pydantic) used by the CLI, the feedback API, the alert outbox and the
tests. A finding's `cause_key` identifies the underlying cause (the identity fields of its kind's
policy, gpuvigil/kinds.py), so that a cause seen on every tick is one finding, and one hint, not
thousands.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from gpuvigil import kinds, schemas
from gpuvigil.kinds import FindingKind


class Severity(StrEnum):
    PAGE = "page"
    TICKET = "ticket"
    INFO = "info"


# How grave each severity is (higher: graver): what an escalation, a sort by gravity or an
# incident's worst message compares.
SEVERITY_RANK = {Severity.INFO: 0, Severity.TICKET: 1, Severity.PAGE: 2}


# The kinds and their policy (scope, owner, identity, clear time, runbook): gpuvigil/kinds.py.
JOB_LEVEL_KINDS = kinds.JOB_SCOPE_KINDS
# Findings about a device's own health: their identity is the device (node, GPU, and the XID),
# never the job that happens to hold it. Alerts route them to the hardware team.
DEVICE_KINDS = kinds.HARDWARE_KINDS


class HintAction(StrEnum):
    CORDON_NODE = "cordon_node"
    DRAIN_NODE = "drain_node"
    REQUEUE_JOB = "requeue_job"
    SET_ALLOC_CONF = "set_alloc_conf"
    RESIZE_OR_MOVE_JOB = "resize_or_move_job"
    COMPACT = "compact"
    AVOID_GPU = "avoid_gpu"


# A mapping value too: the detector levels join what other detectors said about the same cause
# (`joined`), and a finding must survive the wire (the fleet's act validates what detect sends).
Evidence = dict[str, float | int | str | bool | None | list[Any] | dict[str, Any]]


def _digest(*parts: object) -> str:
    return hashlib.sha1("|".join("" if p is None else str(p) for p in parts).encode()).hexdigest()[:16]


class Finding(BaseModel):
    """One conclusion of a detector, with the numbers that justify it."""

    model_config = ConfigDict(frozen=False, extra="forbid")

    kind: FindingKind
    severity: Severity
    ts: float
    job: str | None = None
    ranks: list[int] = Field(default_factory=list)
    culprit_ranks: list[int] = Field(default_factory=list)
    node: str | None = None
    gpu: int | None = None
    xid: int | None = None
    evidence: Evidence = Field(default_factory=dict)
    summary: str
    source: str | None = None  # file:line for offline analysis, detector name online
    cause: str | None = None  # e.g. hardware | software | leak | fragmentation
    # The incident the finding belongs to (pipeline/incidents.py: the one rule that groups them) and
    # its part in it: "opened" it, an "update" (a message marked as one), or "evidence" only (no
    # message). None until the pipeline places it.
    incident: str | None = None
    incident_role: Literal["opened", "update", "evidence"] | None = None

    @property
    def cause_key(self) -> str:
        """Stable identity of the underlying cause (ignores time and evidence): the digest of the
        fields its kind's policy names (gpuvigil/kinds.py).

        Job-level causes (a leak, a hang, a blocked gang) follow the job wherever it is
        rescheduled; a device's own faults belong to the GPU, whichever job holds it.
        """
        p = kinds.policy(self.kind)
        ident = p.identity
        if ident == ("job",):
            if self.job:
                return _digest(self.kind.value, self.job)
            if self.evidence.get("files"):
                # No job known: the logs it was read from tell two jobs' timeouts on a node apart.
                return _digest(self.kind.value, None, self.node, "|".join(map(str, self.evidence["files"])))  # type: ignore[arg-type]
            return _digest(self.kind.value, None, self.node, self.gpu, None)
        if all(f.startswith("evidence.") for f in ident):  # e.g. one per collector target (URL, device, file)
            return _digest(self.kind.value, *(self.evidence.get(f.split(".", 1)[1]) for f in ident))
        parts: list[object] = [self.kind.value, *(getattr(self, f) if f in ident else None for f in kinds.IDENTITY_FIELDS)]
        if "cause" in ident and self.cause:
            # An anomaly's cause is part of what it is: two causes on one GPU are two findings.
            parts.append(self.cause)
        return _digest(*parts)

    @property
    def id(self) -> str:
        return self.cause_key

    def to_json_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        d["id"] = self.id
        if d["incident"] is None:  # not placed by a pipeline (offline analysis of one file): no incident to name
            del d["incident"], d["incident_role"]
        return d


class Hint(BaseModel):
    """An action for a scheduler, with its reason and the finding it came from."""

    model_config = ConfigDict(extra="forbid")

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

    @property
    def cause_key(self) -> str:
        return _digest(self.action.value, self.finding_id, self.job, self.node, self.gpu)

    @property
    def id(self) -> str:
        return self.cause_key

    def to_json_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        d["id"] = self.id
        return d


# Events read from a log file say so in their `source`: "torch:/var/log/train/a.log" (the kind
# of source, then the file), so that a line of no known job can still be told by its file.
LOG_SOURCE_SEPARATOR = ":"


def log_source(kind: str, path: str | None) -> str:
    """The `source` of an event read from the log file `path` ('torch' without a file)."""
    return f"{kind}{LOG_SOURCE_SEPARATOR}{path}" if path else kind


def log_file(source: pl.Expr) -> pl.Expr:
    """The log file an event was read from (null for events not read from a file)."""
    return source.str.splitn(LOG_SOURCE_SEPARATOR, 2).struct.field("field_1")


def place(node: str | None, gpu: int | None = None, *, pci: str | None = None) -> str:
    """Where a finding is, for its summary: 'n0 GPU 2'. Logs often name no node (a kernel log
    read without its host name) or no GPU (a VM without the PCI map): what is missing is said as
    unknown, never printed as 'None'."""
    if gpu is not None:
        dev = f"GPU {gpu}"
    elif pci:
        dev = f"the GPU at PCI {pci}"
    else:
        dev = None
    if node:
        return f"{node} {dev}" if dev else f"{node} (GPU unknown)"
    return f"{dev} of an unknown node" if dev else "an unknown node and GPU"


def subject(*, job: str | None = None, ranks: list[int] | tuple[int, ...] = (), node: str | None = None, gpu: int | None = None,
            pci: str | None = None, where: bool = True) -> str:
    """Who and where a finding is about, in one wording for every summary: 'job 4242 rank 3 on
    n0 GPU 2'. A job or rank the rows do not carry is left out (a log whose path names no job
    is 'an unknown job'); the place is `place` (or left out with where=False)."""
    ranks = [r for r in ranks if r is not None]
    who = f"job {job}" if job else "an unknown job"
    if ranks:
        who += f" rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return f"{who} on {place(node, gpu, pci=pci)}" if where else who


def findings_frame(findings: list[Finding]) -> pl.DataFrame:
    return schemas.frame(
        [
            {
                "id": f.id,
                "kind": f.kind.value,
                "severity": f.severity.value,
                "ts": f.ts,
                "job": f.job,
                "ranks": f.ranks,
                "node": f.node,
                "gpu": f.gpu,
                "xid": f.xid,
                "summary": f.summary,
                "evidence_json": json.dumps(f.evidence, sort_keys=True),
                "source": f.source,
            }
            for f in findings
        ],
        schemas.FINDINGS,
    )


def hints_frame(hints: list[Hint]) -> pl.DataFrame:
    return schemas.frame(
        [
            {
                "id": h.id,
                "action": h.action.value,
                "ts": h.ts,
                "job": h.job,
                "node": h.node,
                "gpu": h.gpu,
                "reason": h.reason,
                "finding_id": h.finding_id,
                "finding_kind": h.finding_kind.value,
                "params_json": json.dumps({"exclude_nodes": h.exclude_nodes, **h.params}, sort_keys=True),
            }
            for h in hints
        ],
        schemas.HINTS,
    )


@dataclass(frozen=True)
class GroupAnalysis:
    """What the cross-rank analysis found in one process group: the first collective some members
    never joined or disagreed on, or one every member joined and none completed. `kind` names it
    as the `fr_analysis` stream does (`collective_hang`, `collective_mismatch`); the culprits are
    the ranks the dumps show holding the others up. Whether it pages is for the detectors that
    read it as an `fr_analysis` row (`hang_fr`, `fr_mismatch`). The Flight Recorder reader
    (collectors/flight_recorder.py) returns it."""

    kind: str
    ts: float
    ranks: list[int]
    culprit_ranks: list[int]
    node: str | None
    evidence: dict[str, Any]
    summary: str
    source: str
