"""What a Flight Recorder cross-rank analysis means: a collective some members never joined, or
all joined and none completed, is a `collective_hang`; one whose members disagree on the op, the
sizes or the dtypes is a `collective_mismatch`. Either stops the job, so each pages, naming the
culprit ranks the dumps show (`gpuvigil.collectors.flight_recorder.analyze_dumps`).

`analyze` and `gpuvigil fr` judge the analyses of dumps read after the fact with this module;
`serve` judges the same analyses as rows of the `fr_analysis` stream (detectors/hang_fr.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from gpuvigil.model import Finding, FindingKind, Severity

# The analyses' kinds (the `fr_analysis` stream's names) and the finding each is.
KINDS = {"collective_hang": FindingKind.COLLECTIVE_HANG, "collective_mismatch": FindingKind.COLLECTIVE_MISMATCH}


class Analysis(Protocol):
    """One process group's analysis, as the Flight Recorder reader returns it."""

    kind: str
    ts: float
    ranks: list[int]
    culprit_ranks: list[int]
    node: str | None
    evidence: dict[str, Any]
    summary: str
    source: str


def findings(analyses: Iterable[Analysis], *, job: str | None = None) -> list[Finding]:
    """One paging finding per analysis (at most one per process group)."""
    return [
        Finding(
            kind=KINDS[a.kind],
            severity=Severity.PAGE,
            ts=a.ts,
            job=job,
            ranks=list(a.ranks),
            culprit_ranks=list(a.culprit_ranks),
            node=a.node,
            evidence=dict(a.evidence),
            summary=a.summary,
            source=a.source,
        )
        for a in analyses
    ]
