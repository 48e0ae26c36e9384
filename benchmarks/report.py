"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone, and the
pieces every section shares: the line naming the command that wrote it and where its data came
from, and the targets table whose verdicts are computed from the figures."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# gpuvigil benchmarks\n\n"
    "Every section below is written by the benchmark command it names (`gpuvigil bench KIND ...`, the exact flags "
    "included), between its start and end markers (HTML comments); nothing here is "
    "written by hand. Rerun the command to refresh a section and compare; earlier figures are in git history. "
    "Each section says which figures came from gpuvigil's simulator (and at which sample rate) and which from real "
    "traces, and gives a computed verdict, met or not met, for each of its targets.\n"
)
# Flags that change where the figures go, not what is measured.
_OUTPUT_FLAGS = ("--json", "--no-write")


def write_section(name: str, markdown: str, doc: Path | None = None) -> Path:
    doc = doc or DEFAULT_DOC
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    return doc


def command(kind: str, argv: Sequence[str] | None = None) -> str:
    """The `gpuvigil bench KIND ...` command line that is running, from the arguments the CLI was
    given (`gpuvigil.cli.subcommands.CURRENT_ARGV`), without the output-only flags; just
    `gpuvigil bench KIND` when the benchmark was called from Python rather than the CLI."""
    if argv is None:
        from gpuvigil.cli.subcommands import CURRENT_ARGV

        argv = CURRENT_ARGV
    args = list(argv)
    if "bench" in args and kind in args[args.index("bench") :]:
        args = args[args.index("bench") :]
        args = args[args.index(kind) + 1 :]
    else:
        args = []
    return shlex.join(["gpuvigil", "bench", kind, *(a for a in args if a not in _OUTPUT_FLAGS)])


def provenance(cmd: str, data: str) -> str:
    """The lines under a section's title: the command that wrote it and where its data came from."""
    return f"Written by `{cmd}`.\n\nData: {data}"


def verdict(ok: bool | None) -> str:
    """'met', 'not met', or 'not measured' when the run did not measure the figure a target needs."""
    return "not measured" if ok is None else "met" if ok else "not met"


def targets_table(rows: Iterable[tuple[str, str, str, bool | None]]) -> list[str]:
    """Markdown rows of (what, target, measured, ok) with the computed verdict."""
    out = ["| target | threshold | measured | verdict |", "| --- | --- | --- | --- |"]
    out += [f"| {what} | {threshold} | {measured} | {verdict(ok)} |" for what, threshold, measured, ok in rows]
    return out
