"""Test-wide settings.

Under CI (CI=true) hypothesis runs derandomized: the same generated inputs every run, so a red
build always reproduces. Locally it explores new random inputs each run, which is how the
fuzzers keep finding new garbage to survive.

`--update-goldens` is the only way to rewrite golden files (see tests/golden.py): an explicit
option on one reviewed run, never an environment variable.
"""

from __future__ import annotations

import os

import golden
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite the golden files the selected tests compare against (review the diff before committing)",
    )


def pytest_configure(config):
    golden.UPDATE = bool(config.getoption("--update-goldens"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if golden.REWRITTEN:
        terminalreporter.section("golden files rewritten (review the diff)")
        for path in golden.REWRITTEN:
            terminalreporter.write_line(str(path))
