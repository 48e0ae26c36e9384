"""What a Flight Recorder cross-rank analysis means: a collective some members never joined, or
all joined and none completed, is a `collective_hang`; one whose members disagree on the op, the
sizes or the dtypes is a `collective_mismatch`. Either stops the job, so each pages, naming the
culprit ranks the dumps show (`gpuvigil.collectors.flight_recorder.analyze_dumps`).

`analyze` and `gpuvigil fr` judge the analyses of dumps read after the fact with this module;
`serve` judges the same analyses as rows of the `fr_analysis` stream (detectors/hang_fr.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuvigil.model import Finding, FindingKind, GroupAnalysis, Severity

# The analyses' kinds (the `fr_analysis` stream's names) and the finding each is.
KINDS = {"collective_hang": FindingKind.COLLECTIVE_HANG, "collective_mismatch": FindingKind.COLLECTIVE_MISMATCH}


def findings(analyses: Iterable[GroupAnalysis], *, job: str | None = None) -> list[Finding]:
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
