"""Test-wide settings.

Under CI (CI=true) hypothesis runs derandomized: the same generated inputs every run, so a red
build always reproduces. Locally it explores new random inputs each run, which is how the
fuzzers keep finding new garbage to survive. The equivalence tests (incremental state against a
from-scratch oracle) draw `tests.hyp.examples(n)` examples: a quarter of their full count, unless
GPUVIGIL_TEST_DEEP=1 (`make test-deep`) asks for all of it.

Under CI a skipped test is an error: a dependency the tests need either installs or fails the
run. The only skips allowed are listed in `tests/ci_skips.py`, each with the reason it may skip.

`--update-goldens` is the only way to rewrite golden files (see tests/golden.py): an explicit
option on one reviewed run, never an environment variable.
"""

from __future__ import annotations

import os

import golden
import pytest
from hypothesis import settings

import ci_skips

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.register_profile("ci", derandomize=True, print_blob=True)
if CI:
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if ci_skips.allowed(item.nodeid, reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} skipped under CI=true ({reason}). A skip in CI is an error: install what the test "
        "needs in .ci/run / `make test`, or list it with its reason in tests/ci_skips.py."
    )
