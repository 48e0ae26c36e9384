"""Typed findings and hints: what detectors conclude and what a scheduler should do about it.

Both have a JSON form (pydantic) used by the CLI, the feedback API, the alert outbox and the
tests. A finding's `cause_key` identifies the underlying cause (same kind, job, node, GPU), so
that a cause seen on every tick is one finding, and one hint, not thousands.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from gpuvigil import schemas


class Severity(StrEnum):
    PAGE = "page"
    TICKET = "ticket"
    INFO = "info"


# How grave each severity is (higher: graver): what an escalation, a sort by gravity or an
# incident's worst message compares.
SEVERITY_RANK = {Severity.INFO: 0, Severity.TICKET: 1, Severity.PAGE: 2}


class FindingKind(StrEnum):
    OOM_PREDICTED = "oom_predicted"
    OOM_CAPACITY = "oom_capacity"
    OOM_FRAGMENTATION = "oom_fragmentation"
    OOM_FOREIGN_PROCESS = "oom_foreign_process"
    OOM_UNEXPLAINED = "oom_unexplained"  # the message's own figures say the room was free
    NCCL_TIMEOUT = "nccl_timeout"
    NCCL_ERROR = "nccl_error"  # an NCCL call failed (torch raised its result): the job is down
    COLLECTIVE_HANG = "collective_hang"
    COLLECTIVE_MISMATCH = "collective_mismatch"
    XID = "xid"
    ECC = "ecc"
    THERMAL_THROTTLE = "thermal_throttle"
    STRAGGLER = "straggler"
    FRAGMENTATION_ALLOCATOR = "fragmentation_allocator"
    FRAGMENTATION_CLUSTER = "fragmentation_cluster"
    ANOMALY = "anomaly"  # unknown anomaly from the learned model: never pages on its own
    COLLECTOR_DOWN = "collector_down"  # a collector failed N times in a row (pipeline/health.py)


JOB_LEVEL_KINDS = frozenset(
    {
        FindingKind.OOM_PREDICTED,
        FindingKind.OOM_CAPACITY,
        FindingKind.OOM_FRAGMENTATION,
        FindingKind.OOM_FOREIGN_PROCESS,
        FindingKind.OOM_UNEXPLAINED,
        FindingKind.NCCL_TIMEOUT,
        FindingKind.NCCL_ERROR,
        FindingKind.COLLECTIVE_HANG,
        FindingKind.COLLECTIVE_MISMATCH,
        FindingKind.FRAGMENTATION_CLUSTER,
        FindingKind.FRAGMENTATION_ALLOCATOR,
    }
)

# Findings about a device's own health: their identity is the device (node, GPU, and the XID),
# never the job that happens to hold it, so the same hot or failing GPU handed to another job
# stays one finding, one alert and one set of hints. Alerts route them to the hardware team.
DEVICE_KINDS = frozenset({FindingKind.XID, FindingKind.ECC, FindingKind.THERMAL_THROTTLE})


class HintAction(StrEnum):
    CORDON_NODE = "cordon_node"
    DRAIN_NODE = "drain_node"
    REQUEUE_JOB = "requeue_job"
    SET_ALLOC_CONF = "set_alloc_conf"
    RESIZE_OR_MOVE_JOB = "resize_or_move_job"
    COMPACT = "compact"
    AVOID_GPU = "avoid_gpu"


Evidence = dict[str, float | int | str | bool | None | list[Any]]


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
        """Stable identity of the underlying cause (ignores time and evidence).

        Job-level causes (a leak, a hang, a blocked gang) follow the job wherever it is
        rescheduled; a device's own faults (DEVICE_KINDS) belong to the GPU, whichever job holds it.
        """
        if self.kind in JOB_LEVEL_KINDS and self.job:
            return _digest(self.kind.value, self.job)
        if self.kind in JOB_LEVEL_KINDS and self.evidence.get("files"):
            # No job known: the logs it was read from tell two jobs' timeouts on a node apart.
            return _digest(self.kind.value, None, self.node, "|".join(map(str, self.evidence["files"])))  # type: ignore[arg-type]
        if self.kind == FindingKind.COLLECTOR_DOWN:  # one per collector target (URL, device, file)
            return _digest(self.kind.value, self.evidence.get("collector"), self.evidence.get("target"))
        xid = self.xid if self.kind == FindingKind.XID else None
        if self.kind in DEVICE_KINDS:
            return _digest(self.kind.value, None, self.node, self.gpu, xid)
        if self.kind == FindingKind.ANOMALY and self.cause:
            # An anomaly's cause (pcie_replay, or the learned model's unknown) is part of what it
            # is: a PCIe replay finding must not overwrite the model's anomaly on the same GPU.
            return _digest(self.kind.value, self.job, self.node, self.gpu, xid, self.cause)
        return _digest(self.kind.value, self.job, self.node, self.gpu, xid)

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
