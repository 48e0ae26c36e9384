"""`gpuvigil fr PATH...`: cross-rank analysis of PyTorch Flight Recorder dumps (hangs,
mismatched collectives), read by `gpuvigil.collectors.flight_recorder` and judged by
`gpuvigil.detectors.fr_analysis`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from gpuvigil.collectors import flight_recorder as fr
from gpuvigil.detectors import fr_analysis
from gpuvigil.model import Finding


def analyze_dumps(dumps: Sequence[fr.FRDump], *, job: str | None = None, stuck_after_seconds: float = fr.STUCK_AFTER_SECONDS) -> list[Finding]:
    """The findings of one job's dumps (one per rank): at most one per process group."""
    return fr_analysis.findings(fr.analyze_dumps(dumps, stuck_after_seconds=stuck_after_seconds), job=job)


def analyze_paths(paths: Sequence[str | Path], *, job: str | None = None, errors: list[str] | None = None) -> list[Finding]:
    """Load the dumps in files and folders and analyse each job (folder + file-name prefix) apart
    (`errors`: see `flight_recorder.load_groups`)."""
    return [f for group in fr.load_groups(paths, errors) for f in analyze_dumps(group, job=job)]


def _print_text(dumps: list[fr.FRDump], findings: list[Finding]) -> None:
    print(f"{len(dumps)} Flight Recorder dump(s)")
    for d in dumps:
        status = ", ".join(
            f"pg {name}: enqueued {s.last_enqueued} started {s.last_started} completed {s.last_completed}" for name, s in sorted(d.pg_status.items())
        )
        print(f"  rank {d.rank}: {len(d.entries)} entries ({d.completed_count()} completed); {status}  [{d.source}]")
    if not findings:
        print("no cross-rank problem: every rank joined every recorded collective with matching op, sizes and dtypes")
    for f in findings:
        culprits = f" culprits={fr._ranks_str(f.culprit_ranks)}" if f.culprit_ranks else ""
        print(f"{f.severity.value.upper()} {f.kind.value}{culprits}: {f.summary}")


def _command(args: argparse.Namespace) -> int:
    for dumps in fr.load_groups(args.paths):
        findings = analyze_dumps(dumps, job=args.job)
        if args.format == "json":
            for f in findings:
                print(json.dumps(f.to_json_dict(), sort_keys=True))
        else:
            _print_text(dumps, findings)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("fr", help="analyse PyTorch Flight Recorder dumps across ranks (hangs, mismatched collectives)")
    p.add_argument("paths", nargs="+", metavar="DIR_OR_FILE", help="dump files (one per rank, pickle or JSON) or folders holding them")
    p.add_argument("--format", choices=["text", "json"], default="text", help="text summary, or one JSON finding per line")
    p.add_argument("--job", default=None, help="job id to put on the findings")
    p.set_defaults(func=_command)
