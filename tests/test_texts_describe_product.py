"""Code comments, docstrings, docs and config comments describe the product as it is: they never
point at a work session, a round of work, a helper or an issue number, which nobody reading the
repository can resolve. An upstream project's issue named with its repository
(`NVIDIA/NVSentinel#155`, `pytorch#35901`, `radixark/miles PR#2199`) resolves, and stays allowed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
FOLDERS = ("gpuvigil", "benchmarks", "docs", "tests")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh"}
NAMES = {"Makefile"}
SKIP = (ROOT / "tests" / "data",)

# "issue 11", "issue-9 targets", "(issue 13.2)", "Issue #4", "session 3", "session-2 suite",
# "round 4", "Rounds 6 and 7", "helper B". Not "session-3.scope" (a cgroup path), "round(x, 2)"
# or "a SQLite helper for" (a function that helps). An issue named after its repository
# ("NVIDIA/NVSentinel issue 155") resolves: the owner/repo right before it allows it.
PATTERNS = [
    re.compile(r"\bissues?[- ]#?\d+", re.I),
    re.compile(r"\bsessions?[ -]\d+(?![\w.])", re.I),
    re.compile(r"\brounds? \d+", re.I),
    re.compile(r"\bhelpers? [A-Z0-9]\b"),
]
REPO_BEFORE = re.compile(r"[\w.-]+/[\w.-]+\s+$")


def offending(text: str) -> list[str]:
    """Each reference in `text` that the repository cannot resolve, as `line N: excerpt`."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat in PATTERNS:
            for m in pat.finditer(line):
                if REPO_BEFORE.search(line[: m.start()]):
                    continue
                out.append(f"line {n}: {line[max(0, m.start() - 30) : m.end() + 30].strip()}")
    return out


def files() -> list[Path]:
    found = [ROOT / n for n in ("Makefile", "pyproject.toml") if (ROOT / n).is_file()]
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*")):
            if not p.is_file() or p.resolve() == HERE or any(s in p.parents for s in SKIP) or "__pycache__" in p.parts:
                continue
            if p.suffix in SUFFIXES or p.name in NAMES:
                found.append(p)
    return found


@pytest.mark.parametrize(
    "text, bad",
    [
        ("# Memory at scale (issue 11): rows older than ...", True),
        ('"""Mutation-testing round 4: the per-GPU slot helpers."""', True),
        ("| target (issue 9) | level |", True),
        ("the issue-9 targets", True),
        ("validated as a whole at load (issue 13.2).", True),
        ("see Issue #4", True),
        ("Command (issue 9, session 3): `gpuvigil bench detectors`", True),
        ("the session-2 suite", True),
        ("# Rounds 6 and 7 measured with these too", True),
        ("shared with helper B", True),
        ("# NVIDIA/NVSentinel#155: drivers report a lost GPU this way", False),
        ("(pytorch#35901; nccl#537/#238)", False),
        ("radixark/miles PR#2199: 113 GiB reserved", False),
        ("NVIDIA/NVSentinel issue 155", False),
        ("0::/user.slice/user-1000.slice/session-3.scope", False),
        ("x = round(v, 2)  # two rounds at most", False),
        ('"""One SQLite helper for both databases."""', False),
        ("collective #11 never completes", False),
    ],
)
def test_the_check_flags_unresolvable_references_only(text, bad):
    assert bool(offending(text)) is bad, offending(text)


def test_the_check_reads_the_folders_it_guards():
    names = {p.relative_to(ROOT).as_posix() for p in files()}
    assert {"gpuvigil/config/detectors.yaml", "benchmarks/detectors.py", "docs/benchmarks.md", "tests/test_bench_doc.py"} <= names
    assert not any(n.startswith("tests/data/") for n in names)
    assert HERE.relative_to(ROOT).as_posix() not in names


def test_no_text_refers_to_sessions_rounds_helpers_or_issue_numbers():
    bad = {p.relative_to(ROOT).as_posix(): hits for p in files() for hits in [offending(p.read_text(errors="replace"))] if hits}
    assert not bad, "\n".join(f"{path}: {h}" for path, hits in bad.items() for h in hits)
