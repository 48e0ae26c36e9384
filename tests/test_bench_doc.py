"""docs/benchmarks.md is written by code only: every section between its markers names the
`gpuvigil bench` command (with flags that command accepts) that wrote it, and outside the sections
there is nothing but the header that benchmarks/report.py writes."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from benchmarks.report import HEADER
from gpuvigil.cli.bench import BENCHMARKS

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = re.compile(r"<!-- bench:([\w.-]+):start -->\n(.*?)\n<!-- bench:\1:end -->", re.S)
MARKER = re.compile(r"<!-- bench:([\w.-]+):(start|end) -->")
COMMAND = re.compile(r"`(gpuvigil bench [^`]+)`")


def sections(text: str) -> list[tuple[str, str]]:
    return SECTION.findall(text)


def parses(cmd: str) -> bool:
    """Whether `gpuvigil bench KIND FLAGS` is accepted by that benchmark's own parser."""
    words = shlex.split(cmd)[2:]
    if not words or words[0] not in BENCHMARKS:
        return False
    parser = argparse.ArgumentParser(prog="gpuvigil bench", exit_on_error=False)
    sub = parser.add_subparsers(dest="bench")
    importlib.import_module(BENCHMARKS[words[0]][0]).add_parser(sub)
    try:
        parser.parse_args(words)
    except (SystemExit, argparse.ArgumentError):
        return False
    return True


def outside(text: str) -> str:
    return SECTION.sub("", text)


TEXT = DOC.read_text()


def test_markers_pair_up_once_each_and_do_not_nest():
    seen, open_name = [], None
    for name, edge in MARKER.findall(TEXT):
        if edge == "start":
            assert open_name is None, f"section {name} starts inside section {open_name}"
            open_name = name
            seen.append(name)
        else:
            assert open_name == name, f"end of {name} without its start"
            open_name = None
    assert open_name is None, f"section {open_name} has no end"
    assert len(seen) == len(set(seen)) and len(seen) == len(sections(TEXT))


@pytest.mark.parametrize("name, body", sections(TEXT), ids=[n for n, _ in sections(TEXT)])
def test_each_section_names_a_bench_command_that_exists(name, body):
    cmds = COMMAND.findall(body)
    assert cmds, f"section {name} names no `gpuvigil bench ...` command"
    assert parses(cmds[0]), f"section {name}: {cmds[0]!r} is not a command `gpuvigil bench` accepts"


def test_nothing_outside_the_sections_but_the_header():
    assert outside(TEXT).strip() == HEADER.strip()


@pytest.mark.parametrize(
    "text, ok",
    [
        (HEADER + "\n<!-- bench:hook:start -->\n## x\n\nWritten by `gpuvigil bench hook --quick`.\n<!-- bench:hook:end -->\n", True),
        (HEADER + "\nA hand-written note.\n\n<!-- bench:hook:start -->\n## x\n<!-- bench:hook:end -->\n", False),
        (HEADER + "\n<!-- bench:hook:start -->\n## x\n<!-- bench:hook:end -->\n\nFigures from an earlier run.\n", False),
    ],
)
def test_the_outside_check_sees_hand_written_text(text, ok):
    assert (outside(text).strip() == HEADER.strip()) is ok


@pytest.mark.parametrize(
    "cmd, ok",
    [
        ("gpuvigil bench pipeline --gpus 1000,10000 --ticks 5", True),
        ("gpuvigil bench hook --quick", True),
        ("gpuvigil bench pipeline --no-such-flag", False),
        ("gpuvigil bench pipeline --ticks many", False),
        ("gpuvigil bench nonesuch", False),
    ],
)
def test_the_command_check_rejects_what_the_cli_would(cmd, ok):
    assert parses(cmd) is ok
