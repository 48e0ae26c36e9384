"""Finding kinds and their policy: one table.

Every kind of finding a detector may raise is a member of `FindingKind` and a row of `POLICIES`:

- `scope`: what the finding is about: a `gpu` (a device's own fault), a `node`, a `job` (a
  leak, a hang, a blocked gang) or the `cluster`;
- `owner`: who is told: the `hardware` team, the `tenant` whose job it is (the hardware team
  when no job is known), or the `platform` team (gpuvigil's own plumbing);
- `identity`: the fields that make two findings the same cause (`Finding.cause_key`). A
  hardware finding's identity is the device, never the job that happens to hold it, so the same
  failing GPU handed to another job stays one finding, one alert and one set of hints. Fields
  are `Finding` attributes, or `evidence.<key>`;
- `fatal`: a page of this kind means the node's hardware is gone (Alertmanager holds back the
  job-level alerts on that node: `alerts.fatal_hardware_kinds` defaults to these);
- `clear_after_seconds`: how long the finding stays active once no detector reports it (None:
  the pipeline's `clear_after_seconds.default`); `pipeline.clear_after_seconds.<kind>` overrides;
- `runbook`: its anchor in docs/runbooks.md.

Alert routing (`alerts.settings.HARDWARE_KINDS`), identity, clear times and the demo's routing
are derived from this table; a kind without a row fails tests/test_kinds.py. Standard library only:
`model` builds on it and sits below everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


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
    PCIE_REPLAY = "pcie_replay"  # a GPU's PCIe link retransmits at a sustained rate
    NVLINK_CRC = "nvlink_crc"  # a GPU's NVLink links keep failing their CRC checks
    STRAGGLER = "straggler"
    FRAGMENTATION_ALLOCATOR = "fragmentation_allocator"
    FRAGMENTATION_CLUSTER = "fragmentation_cluster"
    ANOMALY = "anomaly"  # unknown anomaly from the learned model: never pages on its own
    COLLECTOR_DOWN = "collector_down"  # a collector failed N times in a row (pipeline/health.py)
    IB_LINK_DOWN = "ib_link_down"  # an InfiniBand/RoCE port down, or flapping
    IB_LINK_DEGRADED = "ib_link_degraded"  # trained below its expected rate or width
    IB_LINK_ERRORS = "ib_link_errors"  # symbol, receive or link-integrity errors over a rate
    IB_PORT_MISSING = "ib_port_missing"  # fewer ports than expected, or one gone
    NVLINK_DOWN = "nvlink_down"  # fewer NVLinks up than the GPU or its peers had
    FABRIC_MANAGER = "fabric_manager"  # the GPU's NVLink fabric failed or never completes
    ROW_REMAP_PENDING = "row_remap_pending"  # a row remap waits for a GPU reset
    ROW_REMAP_FAILURE = "row_remap_failure"  # a row remap failed: the GPU cannot repair its memory (RMA)
    RETIRED_PAGES = "retired_pages"  # pages wait for retirement, or past the replacement limit
    # Findings on several nodes that share a component (a leaf switch, a rack, a cooling loop)
    # and on few others: the component, not the nodes (pipeline/components.py).
    COMPONENT_FAULT = "component_fault"


Scope = Literal["gpu", "node", "job", "cluster"]
Owner = Literal["hardware", "tenant", "platform"]

# The identity fields a finding may name, in the order its cause key digests them.
IDENTITY_FIELDS = ("job", "node", "gpu", "xid")


@dataclass(frozen=True)
class KindPolicy:
    scope: Scope
    owner: Owner
    identity: tuple[str, ...]
    fatal: bool = False
    clear_after_seconds: float | None = None
    runbook: str = ""

    def __post_init__(self) -> None:
        allowed = {*IDENTITY_FIELDS, "cause"}
        bad = [f for f in self.identity if f not in allowed and not f.startswith("evidence.")]
        if bad:
            raise ValueError(f"identity fields {bad} are not finding fields (allowed: {sorted(allowed)} or evidence.<key>)")
        if self.scope in ("gpu", "node") and self.owner == "hardware" and "job" in self.identity:
            raise ValueError("a hardware finding's identity is the device, never the job")


_JOB = ("job",)
_DEVICE = ("node", "gpu")
_PORT = ("evidence.port_id",)

POLICIES: Mapping[FindingKind, KindPolicy] = {
    FindingKind.OOM_PREDICTED: KindPolicy("job", "tenant", _JOB),
    FindingKind.OOM_CAPACITY: KindPolicy("job", "tenant", _JOB, clear_after_seconds=600),
    FindingKind.OOM_FRAGMENTATION: KindPolicy("job", "tenant", _JOB, clear_after_seconds=600),
    FindingKind.OOM_FOREIGN_PROCESS: KindPolicy("job", "tenant", _JOB, clear_after_seconds=600),
    FindingKind.OOM_UNEXPLAINED: KindPolicy("job", "tenant", _JOB),
    FindingKind.NCCL_TIMEOUT: KindPolicy("job", "tenant", _JOB, clear_after_seconds=600),
    FindingKind.NCCL_ERROR: KindPolicy("job", "tenant", _JOB, clear_after_seconds=600),
    FindingKind.COLLECTIVE_HANG: KindPolicy("job", "tenant", _JOB),
    FindingKind.COLLECTIVE_MISMATCH: KindPolicy("job", "tenant", _JOB),
    FindingKind.FRAGMENTATION_ALLOCATOR: KindPolicy("job", "tenant", _JOB),
    # A pending gang the cluster's fragmentation blocks: the job waiting is what it is about.
    FindingKind.FRAGMENTATION_CLUSTER: KindPolicy("cluster", "tenant", _JOB),
    # Two XIDs on one GPU are two faults; an XID and an ECC error stay active for long: the
    # device does not heal by going quiet.
    FindingKind.XID: KindPolicy("gpu", "hardware", (*_DEVICE, "xid"), fatal=True, clear_after_seconds=600),
    FindingKind.ECC: KindPolicy("gpu", "hardware", _DEVICE, fatal=True, clear_after_seconds=3600),
    FindingKind.THERMAL_THROTTLE: KindPolicy("gpu", "hardware", _DEVICE),
    # A link that stops retransmitting while idle has not healed.
    FindingKind.PCIE_REPLAY: KindPolicy("gpu", "hardware", _DEVICE, clear_after_seconds=600),
    FindingKind.NVLINK_CRC: KindPolicy("gpu", "hardware", _DEVICE, clear_after_seconds=600),
    # A rank's slowness is its job's (a straggler follows the job's placement).
    FindingKind.STRAGGLER: KindPolicy("job", "tenant", ("job", "node", "gpu")),
    # The learned model's anomaly: about a rank of a job, the model's cause part of what it is.
    FindingKind.ANOMALY: KindPolicy("gpu", "tenant", ("job", "node", "gpu", "cause")),
    # A network port's faults are the port's (node/device/port: evidence port_id), whichever job or
    # GPU it serves; a link that stops erroring while idle has not healed.
    FindingKind.IB_LINK_DOWN: KindPolicy("node", "hardware", _PORT, clear_after_seconds=600),
    FindingKind.IB_LINK_DEGRADED: KindPolicy("node", "hardware", _PORT),
    FindingKind.IB_LINK_ERRORS: KindPolicy("node", "hardware", _PORT, clear_after_seconds=600),
    FindingKind.IB_PORT_MISSING: KindPolicy("node", "hardware", _PORT, clear_after_seconds=600),
    FindingKind.NVLINK_DOWN: KindPolicy("gpu", "hardware", _DEVICE, clear_after_seconds=600),
    FindingKind.FABRIC_MANAGER: KindPolicy("gpu", "hardware", _DEVICE, clear_after_seconds=600),
    # A pending repair or a retired page does not go away by going quiet.
    FindingKind.ROW_REMAP_PENDING: KindPolicy("gpu", "hardware", _DEVICE, clear_after_seconds=3600),
    # NVIDIA's RMA criterion: the memory behind a failed remap stays bad, whichever job holds the
    # GPU; like an ECC error, the node's other alerts are its consequence.
    FindingKind.ROW_REMAP_FAILURE: KindPolicy("gpu", "hardware", _DEVICE, fatal=True, clear_after_seconds=3600),
    FindingKind.RETIRED_PAGES: KindPolicy("gpu", "hardware", _DEVICE, clear_after_seconds=3600),
    FindingKind.COLLECTOR_DOWN: KindPolicy("cluster", "platform", ("evidence.collector", "evidence.target")),
    # One per component, whichever of its nodes show the symptom.
    FindingKind.COMPONENT_FAULT: KindPolicy("cluster", "hardware", ("evidence.level", "evidence.component")),
}


def policy(kind: FindingKind | str) -> KindPolicy:
    return POLICIES[FindingKind(kind)]


def runbook_anchor(kind: FindingKind | str) -> str:
    """The kind's anchor in docs/runbooks.md ('finding-pcie-replay')."""
    p = policy(kind)
    return p.runbook or f"finding-{FindingKind(kind).value.replace('_', '-')}"


def kinds_where(**match: object) -> frozenset[FindingKind]:
    """The kinds whose policy has every given attribute value: kinds_where(owner="hardware")."""
    return frozenset(k for k, p in POLICIES.items() if all(getattr(p, a) == v for a, v in match.items()))


HARDWARE_KINDS: frozenset[FindingKind] = kinds_where(owner="hardware")
JOB_SCOPE_KINDS: frozenset[FindingKind] = frozenset(k for k, p in POLICIES.items() if p.identity == _JOB)
FATAL_KINDS: frozenset[FindingKind] = kinds_where(fatal=True)


def clear_after_defaults() -> dict[str, float]:
    """Kind -> its own clear time (kinds without one use the pipeline's default)."""
    return {k.value: float(p.clear_after_seconds) for k, p in POLICIES.items() if p.clear_after_seconds is not None}


__all__ = [
    "FATAL_KINDS",
    "HARDWARE_KINDS",
    "IDENTITY_FIELDS",
    "JOB_SCOPE_KINDS",
    "POLICIES",
    "FindingKind",
    "KindPolicy",
    "clear_after_defaults",
    "kinds_where",
    "policy",
    "runbook_anchor",
]
