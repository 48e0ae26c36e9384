"""Findings survive the fleet's wire: what detect publishes, act parses back into the same Finding.

A hang joined by a second detector (the detector levels put what it said under
`evidence.joined`) used to fail act's validation, so act dropped every findings message of that
partition while the hang lasted (seen in `gpuvigil bench scale`)."""

from __future__ import annotations

from gpuvigil.fleet import transport
from gpuvigil.model import Finding, FindingKind, Severity


def test_a_finding_with_joined_evidence_round_trips():
    f = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=120.0, job="job-0001", node="node-001", culprit_ranks=[2],
                summary="job-0001 is hung", evidence={"waited_s": 6.0, "joined": {"hang_device": {"level": "L1", "first_ts": 118.0,
                                                                                                   "culprit_ranks": [2], "summary": "GPU lost"}}})
    doc, found = transport.parse_findings(transport.findings_payload("detect", 120.0, [f], partition=1))
    assert doc["partition"] == 1 and len(found) == 1
    assert found[0].evidence["joined"]["hang_device"]["culprit_ranks"] == [2] and found[0].id == f.id
