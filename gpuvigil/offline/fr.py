"""`gpuvigil fr PATH...`: cross-rank analysis of PyTorch Flight Recorder dumps (hangs,
mismatched collectives), read by `gpuvigil.collectors.flight_recorder` and judged by the
registered detectors serve runs over the same analyses (`hang_fr`, `fr_mismatch`): the dumps'
analyses become `fr_analysis` rows (trigger `offline`), as the live dump watcher's do."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors import flight_recorder as fr
from gpuvigil.collectors.fr_dumps import analysis_rows
from gpuvigil.model import Finding

# The registered detectors that judge `fr_analysis` rows.
DETECTORS = ("hang_fr", "fr_mismatch")


def rows_of(dumps: Sequence[fr.FRDump], *, job: str | None = None, stuck_after_seconds: float = fr.STUCK_AFTER_SECONDS) -> list[dict[str, Any]]:
    """One job's dumps (one per rank) as `fr_analysis` rows, at most one per process group, each
    at the time its analysis describes; none when the dumps show no problem."""
    dumps = list(dumps)
    analyses = fr.analyze_dumps(dumps, stuck_after_seconds=stuck_after_seconds)
    written = [d.written_ns / 1e9 for d in dumps if d.written_ns]
    return analysis_rows(analyses, dumps, job=job, trigger="offline", ts=None, dump_ts=max(written) if written else None) if analyses else []


def analyze_dumps(dumps: Sequence[fr.FRDump], *, job: str | None = None, stuck_after_seconds: float = fr.STUCK_AFTER_SECONDS,
                  cfg: dict[str, Any] | None = None) -> list[Finding]:
    """The findings of one job's dumps: each analysis judged on its own, at its own time, by the
    registered detectors."""
    from gpuvigil.app.compose import detect_once

    out: list[Finding] = []
    for row in rows_of(dumps, job=job, stuck_after_seconds=stuck_after_seconds):
        frame: pl.DataFrame = schemas.frame([row], schemas.FR_ANALYSIS)
        out.extend(detect_once(DETECTORS, {"fr_analysis": frame}, float(row["ts"]), cfg))
    return out


def analyze_paths(paths: Sequence[str | Path], *, job: str | None = None, errors: list[str] | None = None, cfg: dict[str, Any] | None = None) -> list[Finding]:
    """Load the dumps in files and folders and analyse each job (folder + file-name prefix) apart
    (`errors`: see `flight_recorder.load_groups`)."""
    return [f for group in fr.load_groups(paths, errors) for f in analyze_dumps(group, job=job, cfg=cfg)]


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
