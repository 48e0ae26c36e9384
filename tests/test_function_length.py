"""No function in gpuvigil/ runs over 80 lines (`end_lineno - lineno + 1` of its `def`, nested
functions counted on their own): a longer one is split into phases that have a name. The few
long functions not split yet are listed below, each by file and qualified name."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpuvigil"
MAX_LINES = 80

# Long functions not split into phases yet. An entry goes as soon as its function is split: the
# test fails on an entry that is no longer long (or no longer exists), so the list only shrinks.
ALLOWED: set[str] = set()


def long_functions(source: str, path: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """`path::Qualified.name` → length in lines, for each function of `source` longer than `max_lines`."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = [*scope, child.name]
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lines = child.end_lineno - child.lineno + 1
                    if lines > max_lines:
                        found[f"{path}::{'.'.join(name)}"] = lines
                visit(child, name)
            else:
                visit(child, scope)

    visit(ast.parse(source, filename=path), [])
    return found


@functools.cache
def package_long_functions() -> dict[str, int]:
    """Parsed once per test run; callers copy before changing it."""
    found: dict[str, int] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        found.update(long_functions(file.read_text(), file.relative_to(ROOT).as_posix()))
    return found


def not_allowed(found: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in found.items() if name not in ALLOWED}


def test_no_function_in_the_package_is_longer_than_80_lines():
    too_long = not_allowed(package_long_functions())
    listing = "\n".join(f"  {name}: {n} lines" for name, n in sorted(too_long.items(), key=lambda kv: -kv[1]))
    assert not too_long, f"functions over {MAX_LINES} lines; split each into named phases:\n{listing}"


def test_every_allowed_function_is_still_long():
    found = package_long_functions()
    stale = sorted(name for name in ALLOWED if name not in found)
    assert not stale, f"split (or gone): remove from ALLOWED in {Path(__file__).name}: {stale}"


def _function(name: str, body_lines: int, indent: str = "", prefix: str = "def") -> str:
    """A function of exactly 1 + body_lines lines."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}{prefix} {name}():\n{body}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # a top-level function one line over, and one exactly at the limit
        (_function("over", 80), {"m.py::over": 81}),
        (_function("at_limit", 79), {}),
        # async and methods, named by their class
        (_function("stream", 85, prefix="async def"), {"m.py::stream": 86}),
        ("class Detector:\n" + _function("detect", 90, indent="    "), {"m.py::Detector.detect": 91}),
        # a long nested function is reported under its own name, besides the outer one
        ("def outer():\n" + _function("inner", 81, indent="    ") + "    return inner\n", {"m.py::outer": 84, "m.py::outer.inner": 82}),
        # decorators do not count: the function starts at its `def`
        ("@decorator\n" * 5 + _function("decorated", 79), {}),
        # a function inside a conditional or a try block is still found
        ("if True:\n" + _function("hidden", 81, indent="    "), {"m.py::hidden": 82}),
    ],
)
def test_long_functions_finds_what_is_over_the_limit(source, expected):
    assert long_functions(source, "m.py") == expected


def test_a_newly_added_long_function_fails_the_package_check():
    added = long_functions(_function("new_long_phase", 120), "gpuvigil/new_module.py")
    assert not_allowed({**package_long_functions(), **added}) == {"gpuvigil/new_module.py::new_long_phase": 121}
