"""Collectors and parsers emit frames and events; findings come from detectors only, including in
`analyze`. Read with `ast` (nothing is imported): no module under gpuvigil/collectors/,
gpuvigil/parsers/ or gpuvigil/offline/ builds a `Finding`, whether it calls the class by a name
it imported (`Finding(...)`, an alias), through its module (`model.Finding(...)`) or through
pydantic's constructors (`Finding.model_validate(...)`, `Finding.model_construct(...)`).
`test_checker_*` plant each form in a scratch file and prove the check reports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where judging is not done: what reads the world, what parses text, the offline commands.
NO_FINDINGS_UNDER = ("gpuvigil/collectors", "gpuvigil/parsers", "gpuvigil/offline")
_BUILDERS = {"model_validate", "model_validate_json", "model_construct"}


def finding_constructions(source: str) -> list[int]:
    """Line numbers where `source` builds a `gpuvigil.model.Finding`."""
    tree = ast.parse(source)
    names: set[str] = set()  # only names an import binds to the class count
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("model"):
            names |= {a.asname or a.name for a in node.names if a.name == "Finding"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "") == "gpuvigil":
            modules |= {a.asname or a.name for a in node.names if a.name == "model"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "gpuvigil.model"}

    def is_class(expr: ast.expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in names
        if isinstance(expr, ast.Attribute) and expr.attr == "Finding":
            return ast.unparse(expr.value) in modules
        return False

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if is_class(f) or (isinstance(f, ast.Attribute) and f.attr in _BUILDERS and is_class(f.value)):
            lines.append(node.lineno)
    return sorted(lines)


def _modules() -> list[Path]:
    return sorted(p for top in NO_FINDINGS_UNDER for p in (ROOT / top).rglob("*.py"))


def test_the_checked_folders_hold_modules():
    assert len(_modules()) > 20


def test_no_collector_parser_or_offline_command_builds_a_finding():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in _modules() for line in finding_constructions(p.read_text())]
    assert not bad, "a Finding is built outside the detectors (make it a record or frame and judge it in gpuvigil/detectors/):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source, lines",
    [
        ("from gpuvigil.model import Finding\nf = Finding(kind=1)\n", [2]),
        ("from gpuvigil.model import Finding as F\n\ndef g():\n    return F(kind=1)\n", [4]),
        ("from ..model import Finding\nx = [Finding(kind=k) for k in ()]\n", [2]),
        ("from gpuvigil import model\nmodel.Finding(kind=1)\n", [2]),
        ("import gpuvigil.model\ngpuvigil.model.Finding(kind=1)\n", [2]),
        ("from gpuvigil.model import Finding\nFinding.model_validate({})\nFinding.model_construct()\n", [2, 3]),
    ],
)
def test_checker_catches_each_way_of_building_one(source, lines):
    assert finding_constructions(source) == lines


@pytest.mark.parametrize(
    "source",
    [
        "from gpuvigil.model import Finding\n\ndef f(x: Finding) -> list[Finding]:\n    return [x]\n",  # a type, not a construction
        "from gpuvigil.schemas import Finding\nFinding()\n",  # another module's name
        "def Finding():\n    pass\nFinding()\n",  # a local function of the same name
        "from gpuvigil.model import Hint\nHint(kind=1)\n",
    ],
)
def test_checker_leaves_other_calls_alone(source):
    assert finding_constructions(source) == []
