"""A finding's identity (`Finding.id`, the cause key): what makes two findings the same cause.

A device's own faults belong to the device: the same GPU handed to another job is the same
finding (one alert, one set of hints). An anomaly's cause is part of what it is: a PCIe replay
finding and the learned model's anomaly on one GPU are two findings, neither overwriting the other.
"""

from __future__ import annotations

import pytest

from gpuvigil.model import Finding, FindingKind, Severity


def finding(kind: FindingKind, **over) -> Finding:
    base = {"kind": kind, "severity": Severity.PAGE, "ts": 100.0, "job": "job-a", "node": "node-1", "gpu": 3, "summary": "s"}
    return Finding(**{**base, **over})


@pytest.mark.parametrize(
    ("kind", "extra"),
    [(FindingKind.XID, {"xid": 79}), (FindingKind.ECC, {}), (FindingKind.THERMAL_THROTTLE, {})],
)
def test_a_device_fault_is_the_same_finding_whichever_job_holds_the_gpu(kind, extra):
    first = finding(kind, job="job-a", **extra)
    assert finding(kind, job="job-b", ts=500.0, **extra).id == first.id
    assert finding(kind, job=None, **extra).id == first.id  # a kernel line that names no job
    assert finding(kind, job="job-a", gpu=4, **extra).id != first.id
    assert finding(kind, job="job-a", node="node-2", **extra).id != first.id


def test_two_xids_on_one_gpu_are_two_findings():
    assert finding(FindingKind.XID, xid=79).id != finding(FindingKind.XID, xid=94).id


def test_a_pcie_replay_finding_does_not_collide_with_the_model_anomaly_on_the_same_gpu():
    pcie = finding(FindingKind.ANOMALY, severity=Severity.TICKET, cause="pcie_replay")
    learned = finding(FindingKind.ANOMALY, severity=Severity.TICKET, cause="unknown")
    assert pcie.id != learned.id
    assert finding(FindingKind.ANOMALY, cause="pcie_replay", ts=900.0).id == pcie.id


@pytest.mark.parametrize("kind", [FindingKind.STRAGGLER, FindingKind.ANOMALY])
def test_a_rank_level_finding_still_belongs_to_its_job(kind):
    assert finding(kind, job="job-a").id != finding(kind, job="job-b").id


def test_job_level_causes_follow_the_job_across_nodes():
    a = finding(FindingKind.COLLECTIVE_HANG, node="node-1", gpu=3)
    assert finding(FindingKind.COLLECTIVE_HANG, node="node-7", gpu=0, ts=999.0).id == a.id
